"""`lattice-pool`: serve, run, chat, ps, list, pull, stop, unload, demo-model."""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec

from ipc import sampling
from ipc.messages import MAX_RESPONSE_FORMAT_BYTES
from supervisor import local_models, preflight, ps, stderr
from supervisor.adapter_policy import DEFAULT_ADAPTER_DIR
from supervisor.chat import Attach, chat
from supervisor.child import child_env, python_module
from supervisor.config import Config, ConfigError, ModelEntry, load_config, parse_size, validate
from supervisor.control import socket_path
from supervisor.control_client import ControlConnection, NoPool
from supervisor.demo import DEMO_NAME, demo_dir, ensure_demo_model
from supervisor.lifecycle import serve
from supervisor.requests import BadRequest, parse_line
from supervisor.resolve import Resolver, UnknownModel, expand, model_cache_dir
from supervisor.terminal import THINK_MODES, run_once


class UsageError(Exception):
    pass


# -- building the config from a file and flags ------------------------------------------


def add_pool_flags(p: argparse.ArgumentParser, *, server: bool = True) -> None:
    """server False: without the flags that matter only to a pool others
    talk to (stats events, the grace period of a stop)."""
    p.add_argument("--config", type=Path, help="TOML config file (see configs/example.toml; default: none)")
    p.add_argument("--model-cache", help="directory of model dirs (default $LATTICE_MODEL_CACHE or ~/.lattice/models)")
    p.add_argument("--max-loaded", type=int, help="most workers loaded at once; least recently used idle ones are unloaded (default: no limit)")
    p.add_argument("--memory-budget", help="total worker memory, e.g. 12GiB; least recently used idle workers are unloaded (default: no limit)")
    p.add_argument("--keep-alive", help="unload a worker idle this long, e.g. 5m (default: never)")
    p.add_argument("--stall-timeout", type=float, help="kill a busy worker silent this many seconds (default 120)")
    if server:
        p.add_argument("--shutdown-grace", type=float, help="seconds requests may keep running at shutdown, once no model is loading (default 30)")
        p.add_argument("--stats-interval", help="emit a stats event per model this often, e.g. 10s (default: never)")
    p.add_argument(
        "--adapter-dir",
        dest="adapter_dirs",
        action="append",
        help="a directory whose adapter files a request's lora may name (repeatable; adds to adapter_dirs, whose default is ~/.lattice/adapters; docs/http.md)",
    )
    p.add_argument(
        "--max-batch",
        type=max_batch_flag,
        help="requests one worker decodes together; more wait in the pool (default auto: sized from the device's free memory)",
    )
    p.add_argument(
        "--log-level", help="stderr log level of the pool and its workers: DEBUG, INFO, WARNING, ERROR (default INFO for serve, WARNING for run and chat)"
    )


def max_batch_flag(text: str) -> int | str:
    """--max-batch: `auto` or a number (its range is the config's check)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a number, got {text!r}") from None


def add_socket_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--control-socket",
        help="unix socket for ops from other clients, e.g. `lattice-pool ps` (default: $LATTICE_CONTROL_SOCKET, $XDG_RUNTIME_DIR/lattice-pool.sock or ~/.lattice/pool.sock)",
    )
    p.add_argument(
        "--no-control-socket", dest="control_socket", action="store_false", default=None, help="do not open (or look for) a control socket (default: open one)"
    )


def add_monitor_flags(p: argparse.ArgumentParser) -> None:
    add_socket_flag(p)
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1:PORT (0: any free port, logged; default: none)")
    p.add_argument("--http", metavar="HOST:PORT", help="serve the OpenAI-compatible HTTP API, e.g. 127.0.0.1:8080 (docs/http.md; default: none)")
    p.add_argument("--api-key", help="with --http: require this bearer token; needed for a host that is not loopback (default $LATTICE_API_KEY)")


def apply_overrides(config: Config, args: argparse.Namespace) -> None:
    flags = (
        "model_cache",
        "max_loaded",
        "memory_budget",
        "keep_alive",
        "stall_timeout",
        "shutdown_grace",
        "stats_interval",
        "max_batch",
        "metrics_port",
        "control_socket",
        "http",
        "api_key",
    )
    for flag in flags:
        value = getattr(args, flag, None)
        if value is not None:
            setattr(config, flag, value)
    dirs = getattr(args, "adapter_dirs", None)
    if dirs:
        config.adapter_dirs = [*(config.adapter_dirs if config.adapter_dirs is not None else [DEFAULT_ADAPTER_DIR]), *dirs]


def base_config(args: argparse.Namespace) -> Config:
    config = load_config(args.config) if getattr(args, "config", None) else Config()
    apply_overrides(config, args)
    # The checks of the file, on the merged values: a flag out of range
    # (--metrics-port 99999) is refused like the same key in a file.
    return validate(config)


def add_cli_model(config: Config, ref: str | None, model_dir: Path | None, lora: str | None, tokenizer_dir: Path | None) -> None:
    """Makes the model named on the command line the default (and preloaded) one."""
    if model_dir is not None:
        path, name = expand(str(model_dir)), model_dir.name
        if not path.is_dir():
            # Said once, at start, rather than by a worker that cannot start.
            raise UsageError(f"--model-dir {model_dir}: {'not a directory' if path.exists() else 'no such directory'}")
    elif ref == DEMO_NAME and ref not in {m.name for m in config.models} and not (model_cache_dir(config) / ref).is_dir():
        # The name ps, /v1/models and chat give the demo model.
        path, name = ensure_demo_model(), DEMO_NAME
    elif ref is not None:
        if ref in {m.name for m in config.models}:
            config.default_model = ref
            entry = next(m for m in config.models if m.name == ref)
            entry.preload = True
            if lora:
                entry.lora = lora
            return
        try:
            spec = Resolver(config).resolve(ref)
        except UnknownModel as exc:
            raise UsageError(str(exc)) from exc
        path, name = spec.path, ref
    elif not config.models:
        path, name = ensure_demo_model(), DEMO_NAME
    else:
        return
    config.models.append(ModelEntry(name=name, path=str(path), lora=lora, tokenizer_dir=str(tokenizer_dir) if tokenizer_dir else None, preload=True))
    config.default_model = name


def check_start(config: Config, args: argparse.Namespace, *, lora: bool) -> None:
    """What can be checked before any model loads (supervisor.preflight):
    every problem found, each said once. lora: --lora must be readable now
    (`chat` lets an adapter appear later: its /load retries)."""
    problems = preflight.config_paths(config)
    if lora and getattr(args, "lora", None):
        problem = preflight.lora_problem(args.lora)
        problems += [problem] if problem else []
    if problems:
        raise ConfigError("\n".join(problems))


# -- commands ------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    config = base_config(args)
    if args.model or args.model_dir or not config.models:
        add_cli_model(config, args.model, args.model_dir, args.lora, args.tokenizer_dir)
    check_start(config, args, lora=True)
    if args.no_stdin and config.http is None:
        raise UsageError("--no-stdin leaves the pool no requests but HTTP ones: add --http HOST:PORT")
    return asyncio.run(serve(config, eof_grace=config.shutdown_grace, read_stdin=not args.no_stdin))


def preflight_args(args: argparse.Namespace, *, lora: bool = False) -> None:
    """The checks of the command line alone, whichever pool runs the model."""
    problems = []
    if args.model_dir is not None:
        path = expand(str(args.model_dir))
        if not path.is_dir():
            # Said once, at start, rather than by a worker that cannot start.
            problems.append(f"--model-dir {args.model_dir}: {'not a directory' if path.exists() else 'no such directory'}")
    if lora and args.lora:
        problem = preflight.lora_problem(args.lora)
        problems += [problem] if problem else []
    if problems:
        raise UsageError("\n".join(problems))


def cmd_run(args: argparse.Namespace) -> int:
    config = base_config(args)
    if args.serve:
        add_cli_model(config, args.model, args.model_dir, args.lora, args.tokenizer_dir)
        check_start(config, args, lora=True)
        if not args.json:
            raise UsageError("--serve speaks the event protocol: add --json")
        if args.json_schema:
            raise UsageError("--json-schema applies to --prompt; with --serve, give each request a response_format")
        # chat_metal finished every request it had read before exiting at EOF.
        return asyncio.run(serve(config, eof_grace=None, settle_first=True))
    prompt, templated = run_prompt(args, parse_size(config.max_prompt_bytes))
    if args.no_think and args.reasoning_budget is not None:
        raise UsageError("--no-think is --reasoning-budget 0: give one of them")
    if args.think and (args.no_think or not templated):
        raise UsageError("--think shows the thinking of a templated reply: not with --no-think or --prompt")
    fields = {
        **prompt,
        **{name: getattr(args, name) for name in sampling.NAMES},
        "reasoning_budget": 0 if args.no_think else args.reasoning_budget,
        "stop": args.stop,
        "response_format": json_schema_format(args.json_schema) if args.json_schema else None,
    }
    try:
        # The same validation as a line on stdin, so the limits match.
        request = parse_line(msgspec.json.encode({k: v for k, v in fields.items() if v is not None}))
    except BadRequest as exc:
        raise UsageError(exc.msg) from exc
    think = None if not templated else "on" if args.think else "off" if args.no_think else "hidden"
    preflight_args(args, lora=True)
    # A --json run is chat_metal's: a process of its own, with its lines alone.
    attach = None if args.json else attach_to(config, args)
    return asyncio.run(run_once(request, as_json=args.json, think=think, local=local_config(config, args, lora=True), attach=attach))


def run_prompt(args: argparse.Namespace, limit: int) -> tuple[dict, bool]:
    """`run`'s prompt as request fields, and whether it gets the model's
    chat template: PROMPT (or stdin) does, as with `ollama run` and
    mlx_lm.generate; --prompt is chat_metal's text, sent verbatim."""
    if args.prompt is not None:
        if args.text is not None:
            raise UsageError("give PROMPT (templated) or --prompt TEXT (verbatim), not both")
        if args.system is not None:
            raise UsageError("--system goes into the chat template: give PROMPT instead of --prompt, which is sent verbatim")
        return {"prompt": args.prompt}, False
    text = args.text
    if text is None:
        if sys.stdin.isatty():
            raise UsageError("give a PROMPT (or pipe one in), --prompt TEXT to send text verbatim, or --json --serve to read requests from stdin")
        data = sys.stdin.buffer.read(limit + 1)
        if len(data) > limit:
            raise UsageError(f"the prompt on stdin is longer than max_prompt_bytes ({limit} bytes)")
        try:
            text = data.decode("utf-8").rstrip("\n")
        except UnicodeDecodeError as exc:
            raise UsageError(f"the prompt on stdin is not UTF-8: {exc}") from exc
        if not text.strip():
            raise UsageError("no prompt: stdin was empty; give a PROMPT")
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": text}]
    return {"messages": messages}, True


def json_schema_format(path: Path) -> dict:
    """`run --json-schema FILE`: the file's JSON Schema as a response_format."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_RESPONSE_FORMAT_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"cannot read --json-schema {path}: {exc.strerror or exc}") from exc
    if len(data) > MAX_RESPONSE_FORMAT_BYTES:
        raise UsageError(f"--json-schema {path} is over {MAX_RESPONSE_FORMAT_BYTES} bytes, the limit of a response_format")
    try:
        schema = msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise UsageError(f"--json-schema {path} is not JSON: {exc}") from exc
    if not isinstance(schema, dict):
        raise UsageError(f"--json-schema {path} must hold a JSON object (a JSON Schema)")
    problem = preflight.schema_problem(schema)
    if problem:
        raise UsageError(f"--json-schema {path}: not a schema the pool can compile: {problem}")
    return {"type": "json_schema", "json_schema": {"name": path.stem, "schema": schema}}


def attach_to(config: Config, args: argparse.Namespace) -> Attach | None:
    """The running pool `chat` or `run` tries first (the control socket
    `serve` would open with the same flags and config), unless --own-pool
    or --no-control-socket; the model as the command line names it."""
    if args.own_pool:
        return None
    path = socket_path(config)
    if path is None:
        return None
    ref = str(expand(str(args.model_dir))) if args.model_dir is not None else args.model
    return Attach(path, ref, str(expand(args.lora)) if args.lora else None)


def local_config(config: Config, args: argparse.Namespace, *, lora: bool) -> Callable[[], Config]:
    """The config of a pool of the command's own, made only when needed
    (the demo model is generated on first use)."""

    def make() -> Config:
        add_cli_model(config, args.model, args.model_dir, args.lora, args.tokenizer_dir)
        check_start(config, args, lora=lora)
        return config

    return make


def cmd_chat(args: argparse.Namespace) -> int:
    config = base_config(args)
    preflight_args(args)
    return asyncio.run(chat(args, local_config(config, args, lora=False), attach_to(config, args)))


def control_path(args: argparse.Namespace) -> Path:
    """The socket `serve` would open with the same --config and flag."""
    path = socket_path(base_config(args))
    if path is None:
        raise UsageError("the control socket is switched off; give --control-socket PATH")
    return path


def cmd_ps(args: argparse.Namespace) -> int:
    path = control_path(args)
    try:
        status = ps.query_status(path)
    except NoPool as exc:
        print(f"lattice-pool ps: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(ps.as_json(status) if args.json else ps.table(status))
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    """The `shutdown` op; returns once the pool has closed the connection,
    which it does as it exits (after its grace period)."""
    path = control_path(args)
    try:
        with ControlConnection(path, args.timeout) as conn:
            conn.send({"op": "shutdown"})
            for event, _ in conn.events():
                if event.get("ev") == "error":
                    raise NoPool(f"the pool refused: {event.get('msg')}")
    except NoPool as exc:
        print(f"lattice-pool stop: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_unload(args: argparse.Namespace) -> int:
    path = control_path(args)
    op = {"op": "unload", "model": args.name, **({"lora": args.lora} if args.lora else {})}
    try:
        with ControlConnection(path, args.timeout) as conn:
            conn.send(op)
            for event, _ in conn.events():
                if event.get("ev") == "error":
                    raise NoPool(event.get("msg"))
                if event.get("ev") == "unloaded" and event.get("model") == args.name:
                    if event.get("reason") == "not loaded":
                        raise NoPool(f"{args.name} is not loaded")
                    return 0
            raise NoPool(f"the pool at {path} closed the connection")
    except NoPool as exc:
        print(f"lattice-pool unload: {exc}", file=sys.stderr)
        return 1


def cmd_list(args: argparse.Namespace) -> int:
    config = base_config(args)
    cache = model_cache_dir(config)
    configured = (local_models.dir_model(m.name, expand(m.path)) for m in config.models)
    demo = local_models.dir_model(DEMO_NAME, demo_dir())
    found = [m for m in configured if m is not None] + local_models.cache_models(cache) + local_models.hub_models() + local_models.lmstudio_models()
    found += [demo] if demo is not None and DEMO_NAME not in {m.name for m in found} else []
    if args.json:
        print(json.dumps([{"name": m.name, "format": m.format, "size_bytes": m.size, "path": str(m.where)} for m in found], indent=2))
        return 0
    rows = [("NAME", "FORMAT", "SIZE", "WHERE")] + [(m.name, m.format, ps.human_bytes(m.size), local_models.short_path(m.where)) for m in found]
    sys.stdout.write(ps.columns(rows))
    if not found:
        hub = local_models.hub_cache_dir()
        print(f"no models in {cache} or the Hugging Face cache ({hub}); `lattice-pool pull ORG/NAME` downloads one", file=sys.stderr)
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    try:
        path = local_models.pull(args.repo, args.revision)
    except local_models.PullError as exc:
        print(f"lattice-pool pull: cannot download {args.repo}: {exc}", file=sys.stderr)
        return 1
    if not local_models.is_model_dir(path):
        print(
            f"lattice-pool pull: {args.repo} has no config.json with model*.safetensors: not a model lattice-pool can run (look for an MLX conversion)",
            file=sys.stderr,
        )
        return 1
    print(f"{args.repo} ({local_models.model_format(path)}) is in {local_models.short_path(path)}; chat with it: lattice-pool chat --model {args.repo}")
    return 0


def cmd_demo_model(args: argparse.Namespace, extra: list[str]) -> int:
    # Building weights needs MLX, which only worker-side code imports.
    return subprocess.call(python_module("worker.demo.build", *extra), env=child_env())


# -- argument parsing ------------------------------------------------------------------------


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        help="configured name, dir name under the model cache, Hugging Face id in its cache or LM Studio's (ORG/NAME), `demo`, or path (default: the demo model)",
    )
    p.add_argument("--model-dir", type=Path, help="model directory (chat_metal's flag; default: see --model)")
    p.add_argument("--lora", help="LoRA adapter file or directory (default: none)")
    p.add_argument("--tokenizer-dir", type=Path, help="directory holding tokenizer.json (default: the model dir)")


# What each sampling flag does; its bounds and default are ipc.sampling's
# (or the config's [defaults] table), and what a None default means is here.
SAMPLING_HELP = {
    "max_tokens": ("most tokens to generate", None),
    "temperature": ("sampling temperature; 0 is greedy", None),
    "top_k": ("sample from the K likeliest tokens; 0: all", None),
    "top_p": ("sample from the likeliest tokens that make up P of the probability", None),
    "repetition_penalty": ("penalty on tokens already in the text; 1 is none", None),
    "seed": ("random seed: the same seed gives the same tokens", "none, a fresh draw each time"),
    "reasoning_budget": ("tokens a thinking model may think before </think> is forced", "no limit"),
}


def sampling_value(name: str) -> Callable[[str], object]:
    """argparse's type for the flag of sampling field `name`: a request's
    value with a request's bounds, so a bad one is a usage error at once."""

    def parse(text: str) -> object:
        try:
            number = int(text)
        except ValueError:
            try:
                number = float(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        try:
            return sampling.check(name, number)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    for name, (what, unset) in SAMPLING_HELP.items():
        default = sampling.DEFAULTS[name]
        shown = f"default {default}" if default is not None else f"default: {unset}"
        p.add_argument("--" + name.replace("_", "-"), type=sampling_value(name), help=f"{what} ({shown})")
    p.add_argument("--stop", action="append", help="stop string, not printed; repeatable (default: none)")


def version() -> str:
    try:
        return importlib.metadata.version("lattice-pool")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def add_socket_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, help="read control_socket from this config file, as serve does (default: none)")
    p.add_argument(
        "--control-socket",
        help="the pool's control socket (default: as serve's: $LATTICE_CONTROL_SOCKET, $XDG_RUNTIME_DIR/lattice-pool.sock or ~/.lattice/pool.sock)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lattice-pool", description="A pool of warm MLX model workers behind one stdin endpoint.")
    parser.add_argument("--version", action="version", version=f"lattice-pool {version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="the stdin endpoint: NDJSON requests in, @@lattice events out")
    add_pool_flags(serve)
    add_monitor_flags(serve)
    add_model_flags(serve)
    serve.add_argument("--no-stdin", action="store_true", help="with --http: do not read stdin (run as a service; stop with SIGTERM)")
    serve.set_defaults(func=cmd_serve)

    run = sub.add_parser("run", help="chat_metal-compatible single-model run")
    add_pool_flags(run)
    add_monitor_flags(run)
    add_model_flags(run)
    add_sampling_flags(run)
    run.add_argument(
        "text",
        nargs="?",
        metavar="PROMPT",
        help="a message, sent with the model's chat template (as `ollama run` and mlx_lm.generate do); read from stdin when left out and stdin is not a terminal (default: none)",
    )
    run.add_argument("--prompt", help="prompt text sent verbatim, without the chat template (chat_metal's flag; default: none)")
    run.add_argument("--system", help="system prompt, with PROMPT (default: none)")
    run.add_argument("--think", action="store_true", help="also print the model's thinking, apart from the answer")
    run.add_argument("--no-think", action="store_true", help="ask the model not to think (a reasoning budget of 0 closes its think block at once)")
    run.add_argument("--json", action="store_true", help="print @@lattice event lines instead of text")
    run.add_argument("--serve", action="store_true", help="with --json: read requests from stdin (chat_metal's serve mode)")
    run.add_argument("--json-schema", type=Path, metavar="FILE", help="constrain the reply to this JSON Schema (response_format json_schema; default: none)")
    run.add_argument("--verbose", action="store_true", help="show the pool's and the worker's logs (--log-level INFO)")
    run.add_argument(
        "--own-pool",
        action="store_true",
        help="start a pool of this command's own even when one is running (default: use the running pool that --control-socket, the config or the default path names)",
    )
    run.set_defaults(func=cmd_run)

    chat = sub.add_parser(
        "chat",
        help="interactive chat (a REPL: /help lists its commands)",
        description="An interactive chat with a model: on the running pool if one answers, else on a pool of its own.",
    )
    add_pool_flags(chat, server=False)
    add_socket_flag(chat)
    add_model_flags(chat)
    add_sampling_flags(chat)
    chat.add_argument("--system", help="system prompt (default: none; /set system changes it)")
    chat.add_argument(
        "--think",
        choices=THINK_MODES,
        default="on",
        help="a thinking model's reasoning: shown apart, dimmed (on); not asked for (off); not shown (hidden); /set think changes it (default on)",
    )
    chat.add_argument("--verbose", action="store_true", help="show logs (--log-level INFO) and a stats line after each reply")
    chat.add_argument(
        "--own-pool",
        action="store_true",
        help="start a pool of this chat's own even when one is running (default: use the running pool that --control-socket, the config or the default path names)",
    )
    chat.set_defaults(func=cmd_chat)

    ps_cmd = sub.add_parser("ps", help="models of the running pool: state, memory, processor, pid, uptime, keep_alive, requests")
    add_socket_flags(ps_cmd)
    ps_cmd.add_argument("--json", action="store_true", help="print the status event as JSON")
    ps_cmd.set_defaults(func=cmd_ps)

    list_cmd = sub.add_parser("list", help="models on this machine: the model cache and the Hugging Face cache")
    list_cmd.add_argument("--config", type=Path, help="also list the models this config file names (default: none)")
    list_cmd.add_argument("--model-cache", help="directory of model dirs (default $LATTICE_MODEL_CACHE or ~/.lattice/models)")
    list_cmd.add_argument("--json", action="store_true", help="print JSON")
    list_cmd.set_defaults(func=cmd_list)

    pull = sub.add_parser("pull", help="download a model from the Hugging Face hub into its cache, e.g. mlx-community/Qwen3-0.6B-4bit")
    pull.add_argument("repo", metavar="ORG/NAME", help="the model repo on the Hugging Face hub, e.g. mlx-community/Qwen3-0.6B-4bit")
    pull.add_argument("--revision", help="branch, tag or commit (default main)")
    pull.set_defaults(func=cmd_pull)

    stop = sub.add_parser("stop", help="stop the running pool (the shutdown op over its control socket)")
    add_socket_flags(stop)
    stop.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the pool to exit (default %(default)s)")
    stop.set_defaults(func=cmd_stop)

    unload = sub.add_parser("unload", help="unload a model of the running pool (the unload op over its control socket)")
    unload.add_argument("name", metavar="NAME", help="the model's name, as `lattice-pool ps` shows it")
    unload.add_argument("--lora", help="the adapter of the name to unload, as `ps` shows it (default: none)")
    add_socket_flags(unload)
    unload.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the worker to stop (default %(default)s)")
    unload.set_defaults(func=cmd_unload)

    demo = sub.add_parser("demo-model", help="write a tiny real-architecture Qwen3.5 demo model", add_help=False)
    demo.set_defaults(func=cmd_demo_model, passthrough=True)
    return parser


def log_level(args: argparse.Namespace) -> tuple[str | None, str, bool]:
    """(the level asked for, the command's default, a terminal front end?):
    a person at `run` or `chat` sees no INFO lines unless --verbose."""
    terminal = args.command in ("run", "chat") and not getattr(args, "serve", False)
    asked = getattr(args, "log_level", None) or ("INFO" if getattr(args, "verbose", False) else None)
    return asked, "WARNING" if terminal else "INFO", terminal


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "passthrough", False):
        return args.func(args, extra)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    asked, default, terminal = log_level(args)
    try:
        stderr.setup(asked, default, terminal=terminal)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        return args.func(args)
    except (ConfigError, UsageError, UnknownModel) as exc:
        for line in str(exc).splitlines():
            print(f"lattice-pool: error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        stderr.sink().flush()
