"""The `lattice-pool` commands as a user runs them."""

import argparse
import json
import re
import shutil
import subprocess
import sys

import jsonschema

from harness.cli import CHAT, cli, events
from harness.procs import ROOT, child_env
from tests.schemas import PET


def test_run_json_prompt_prints_parseable_events(tiny_model):
    out = cli("run", "--model-dir", str(tiny_model), "--json", "--prompt", CHAT, "--max-tokens", "12", "--seed", "3")
    assert out.returncode == 0, out.stderr
    evs = events(out.stdout)
    tokens = [e for e in evs if e["ev"] == "gen_token"]
    assert tokens[-1]["done"] is True and tokens[-1]["gen_tokens"] == 12 and "id" not in tokens[-1]
    assert sum(1 for e in evs if e["ev"] == "ready") == 1


def test_run_plain_text_matches_json_and_prints_stats(tiny_model, models_dir):
    args = ("--prompt", CHAT, "--max-tokens", "15", "--seed", "4", "--temperature", "0.9")
    as_json = cli("run", "--model-dir", str(tiny_model), "--json", *args)
    text = "".join(e["token"] for e in events(as_json.stdout) if e["ev"] == "gen_token")
    # --model resolves under LATTICE_MODEL_CACHE, like chat_metal's.
    plain = cli("run", "--model", "tiny", *args, env={"LATTICE_MODEL_CACHE": str(models_dir)})
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.decode() == text + "\n"
    assert re.search(rb"\[\d+ prompt tokens, 15 generated in \d+ ms, [\d.]+ tok/s", plain.stderr)
    # Quiet by default: progress and stats, no log records.
    assert b"INFO" not in plain.stderr and b"tiny ready" in plain.stderr


def test_run_json_serve_is_chat_metal_compatible(tiny_model):
    requests = (
        b"\n".join(
            [
                json.dumps({"prompt": CHAT, "max_tokens": 4}).encode(),
                b"{not json",
                json.dumps({"max_tokens": 4}).encode(),
                json.dumps({"prompt": CHAT, "max_tokens": 3, "stop": ["zzz"]}).encode(),
            ]
        )
        + b"\n"
    )
    out = cli("run", "--model-dir", str(tiny_model), "--json", "--serve", input=requests)
    assert out.returncode == 0, out.stderr
    evs = [e for e in events(out.stdout) if e["ev"] in ("gen_token", "error", "ready")]
    assert evs[0]["ev"] == "ready"
    finals = [e for e in evs if e["ev"] == "error" or e.get("done")]
    assert [f["ev"] for f in finals] == ["gen_token", "error", "error", "gen_token"]
    assert finals[1]["msg"].startswith("malformed request") and finals[2]["msg"] == 'missing "prompt" field'
    assert finals[0]["gen_tokens"] == 4 and finals[3]["gen_tokens"] == 3


def test_chat_keeps_the_history(tiny_model):
    # Not a terminal: one message per line, for scripts; /commands still the REPL's.
    script = b"Hello there\n/help\n/set temperature 0.3\nAnd again\n/bye\nnever read\n"
    out = cli("chat", "--model-dir", str(tiny_model), "--max-tokens", "6", "--seed", "1", "--verbose", "--no-control-socket", input=script)
    assert out.returncode == 0, out.stderr
    prompts = [int(n) for n in re.findall(rb"\[(\d+) prompt tokens", out.stderr)]
    assert len(prompts) == 2 and prompts[1] > prompts[0] + 6
    assert out.stdout.count(b"\n") >= 2
    assert b"temperature set to 0.3" in out.stderr and b"/unload" in out.stderr


def test_usage_errors_exit_2(tiny_model):
    assert cli("run", "--model-dir", str(tiny_model)).returncode == 2
    bad = cli("run", "--model-dir", str(tiny_model), "--prompt", "x", "--temperature", "-1")
    assert bad.returncode == 2 and b"temperature" in bad.stderr
    unknown = cli("run", "--model", "no-such-model", "--prompt", "x", env={"LATTICE_MODEL_CACHE": "/nonexistent"})
    assert unknown.returncode == 2 and b"unknown model" in unknown.stderr


def test_run_and_chat_honour_the_log_level(tiny_model):
    args = ("run", "--model-dir", str(tiny_model), "--prompt", CHAT, "--max-tokens", "3")
    quiet = cli(*args, "--log-level", "ERROR")
    assert quiet.returncode == 0, quiet.stderr
    assert not re.search(rb"INFO|WARNING", quiet.stderr), quiet.stderr
    # --verbose brings back the pool's records and the worker's: the level
    # reaches the worker process.
    loud = cli(*args, "--verbose")
    assert loud.returncode == 0, loud.stderr
    assert re.search(rb"INFO lattice-pool: model=tiny pid=\d+ state loading -> ready", loud.stderr)
    assert re.search(rb"INFO worker model=tiny pid=\d+: ready: format=bf16", loud.stderr)
    # The prefix cache's default on a CPU: 512 MiB.
    assert re.search(rb"ready: .* prefix_cache=536870912 ", loud.stderr), loud.stderr
    # MLX's cache of freed buffers is bounded by the batch memory.
    ready = re.search(rb"ready: .* batch_memory=(\d+) buffer_cache=(\d+) ", loud.stderr)
    assert ready is not None, loud.stderr
    assert int(ready[2]) == max(1 << 30, int(ready[1]) // 4)
    chat = cli("chat", "--model-dir", str(tiny_model), "--max-tokens", "3", "--no-control-socket", input=b"Hi\n")
    assert chat.returncode == 0 and b"INFO" not in chat.stderr, chat.stderr


def test_a_missing_model_dir_is_one_line_at_start(tmp_path):
    for command in (("run", "--prompt", "x"), ("serve",), ("chat",)):
        out = cli(*command, "--model-dir", "/nope", input=b"")
        assert out.returncode == 2, (command, out.stderr)
        assert out.stderr == b"lattice-pool: error: --model-dir /nope: no such directory\n", (command, out.stderr)
    # A directory the worker cannot load: its cause, said once.
    (tmp_path / "empty").mkdir()
    out = cli("run", "--model-dir", str(tmp_path / "empty"), "--prompt", "x")
    assert out.returncode == 1
    assert out.stderr.decode().splitlines() == [f"error (load_failed): model 'empty' failed: bad model dir: {tmp_path / 'empty'} has no config.json"]


def test_version():
    out = cli("--version")
    assert out.returncode == 0 and re.fullmatch(rb"lattice-pool \d+\.\d+\.\d+\S*\n", out.stdout), out.stdout


def test_run_json_schema_constrains_text_and_json_output(tiny_model, tmp_path):
    schema = tmp_path / "pet.json"
    schema.write_text(json.dumps(PET))
    prompt = "<|im_start|>user\nDescribe a pet as JSON.<|im_end|>\n<|im_start|>assistant\n"
    args = ("run", "--model-dir", str(tiny_model), "--prompt", prompt, "--json-schema", str(schema), "--temperature", "1", "--seed", "5", "--max-tokens", "160")
    plain = cli(*args)
    assert plain.returncode == 0, plain.stderr
    jsonschema.validate(json.loads(plain.stdout), PET)
    evs = events(cli(*args, "--json").stdout)
    assert "".join(e["token"] for e in evs if e["ev"] == "gen_token") + "\n" == plain.stdout.decode()
    assert [e["finish_reason"] for e in evs if e.get("done")] == ["stop"]


def test_json_schema_usage_errors_exit_2(tiny_model, tmp_path):
    not_json, array = tmp_path / "schema.txt", tmp_path / "array.json"
    not_json.write_text("{type: object}")
    array.write_text("[1]")
    cases = [
        ((str(tmp_path / "missing.json"),), b"cannot read --json-schema"),
        ((str(tmp_path),), b"Is a directory"),
        ((str(not_json),), b"is not JSON"),
        ((str(array),), b"must hold a JSON object"),
        ((str(array), "--json", "--serve"), b"with --serve, give each request a response_format"),
    ]
    for args, message in cases:
        out = cli("run", "--model-dir", str(tiny_model), "--prompt", "x", "--json-schema", *args)
        assert out.returncode == 2 and message in out.stderr, out.stderr


def test_demo_model_command_help():
    out = cli("demo-model", "--help")
    assert out.returncode == 0 and b"--q4" in out.stdout


def test_run_exits_when_its_reader_goes_away(tiny_model):
    proc = subprocess.Popen(
        [sys.executable, "-m", "supervisor", "run", "--model-dir", str(tiny_model), "--json", "--prompt", CHAT, "--max-tokens", "30000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=child_env(),
        cwd=ROOT,
    )
    for line in proc.stdout:
        if b'"gen_token"' in line:
            break
    proc.stdout.close()  # like `| head`
    assert proc.wait(timeout=60) == 0


def prompt_tokens(out: subprocess.CompletedProcess) -> int:
    assert out.returncode == 0, out.stderr
    return next(e["prompt_tokens"] for e in events(out.stdout) if e.get("done"))


def test_run_prompt_gets_the_chat_template_and_prompt_is_sent_verbatim(tiny_model):
    from ipc.messages import Message
    from supervisor.httpapi.reasoning import ThinkSplitter
    from worker.text.tokenizer import TextCodec

    codec = TextCodec(tiny_model, json.loads((tiny_model / "config.json").read_text()))
    base = ("--model-dir", str(tiny_model), "--max-tokens", "12", "--seed", "2", "--reasoning-budget", "4")
    # A positional PROMPT is a user message in the model's chat template
    # (as `ollama run` and mlx_lm.generate send it) ...
    templated = cli("run", "Hello", *base, "--json")
    assert prompt_tokens(templated) == len(codec.encode(codec.render([Message("user", "Hello")])))
    # ... --prompt is chat_metal's text, verbatim.
    assert prompt_tokens(cli("run", "--prompt", "Hello", *base, "--json")) == len(codec.encode("Hello"))
    # Without PROMPT, stdin is the message; --system joins the template;
    # --no-think closes the think block at once.
    piped = cli("run", "--model-dir", str(tiny_model), "--max-tokens", "3", "--system", "Be brief.", "--no-think", "--json", input=b"Hello\n")
    assert prompt_tokens(piped) == len(codec.encode(codec.render([Message("system", "Be brief."), Message("user", "Hello")])))
    assert next(e["token"] for e in events(piped.stdout) if e["ev"] == "gen_token") == "</think>"

    # As text, run prints the answer only; --think shows the thinking apart.
    splitter = ThinkSplitter(inside=True)
    pieces = [p for e in events(templated.stdout) if e["ev"] == "gen_token" for p in splitter.feed(e["token"])] + splitter.flush()
    thought = "".join(t for reasoning, t in pieces if reasoning).lstrip("\n")
    answer = "".join(t for reasoning, t in pieces if not reasoning)
    assert thought and answer
    plain = cli("run", "Hello", *base)
    assert plain.returncode == 0 and plain.stdout.decode() == answer + "\n", plain.stdout
    shown = cli("run", "Hello", *base, "--think")
    assert shown.stdout.decode() == f"Thinking...\n{thought}\n...done thinking.\n\n{answer}\n"

    both = cli("run", "Hello", "--prompt", "Hello", "--model-dir", str(tiny_model))
    assert both.returncode == 2 and b"not both" in both.stderr
    empty = cli("run", "--model-dir", str(tiny_model), input=b"\n")
    assert empty.returncode == 2 and b"stdin was empty" in empty.stderr


def test_problems_at_start_are_refused_before_any_model_loads(tiny_model, tmp_path):
    config = tmp_path / "pool.toml"
    config.write_text(
        f'[[models]]\nname = "b"\npath = "{tmp_path / "gone-b"}"\n\n[[models]]\nname = "a"\npath = "{tmp_path / "gone-a"}"\n\n'
        f'[[models]]\nname = "later"\npath = "{tmp_path / "mounted-later"}"\noptional = true\n\n[[models]]\nname = "ok"\npath = "{tiny_model}"\n'
    )
    out = cli("serve", "--config", str(config), "--no-control-socket", input=b"")
    lines = out.stderr.decode().splitlines()
    assert out.returncode == 2 and len(lines) == 2, out.stderr
    # Every problem at once, each said once, in order; `optional` is not one.
    assert lines[0].startswith("lattice-pool: error: model 'a': path ") and lines[1].startswith("lattice-pool: error: model 'b': path ")
    assert all("no such directory" in line and "optional = true" in line for line in lines)
    config.write_text(f'[[models]]\nname = "later"\npath = "{tmp_path / "mounted-later"}"\noptional = true\n')
    assert cli("serve", "--config", str(config), "--no-control-socket", input=b"").returncode == 0

    # A --lora that is not there, a schema that does not compile: said
    # before the model loads (no progress line).
    nope = cli("run", "Hi", "--model-dir", str(tiny_model), "--lora", "/nope")
    assert nope.returncode == 2 and nope.stderr == b"lattice-pool: error: --lora /nope: no such file or directory\n", nope.stderr
    schema = tmp_path / "bad.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "strin"}}}))
    bad = cli("run", "Hi", "--model-dir", str(tiny_model), "--json-schema", str(schema))
    assert bad.returncode == 2 and b"not a schema the pool can compile: Invalid type: strin" in bad.stderr, bad.stderr
    assert b"loading" not in bad.stderr and len(bad.stderr.splitlines()) == 1


def test_config_typos_are_all_reported_with_the_nearest_key(tmp_path):
    config = tmp_path / "pool.toml"
    config.write_text('max_loded = 2\nkeep_alvie = "5m"\n[defaults]\ntemprature = 0.2\n[[models]]\nname = "a"\npath = "/m"\npreloud = true\n')
    out = cli("serve", "--config", str(config), "--no-control-socket", input=b"")
    assert out.returncode == 2
    assert out.stderr.decode().splitlines() == [
        f"lattice-pool: error: {config}: {line}"
        for line in (
            "unknown key `keep_alvie` (did you mean `keep_alive`?)",
            "unknown key `max_loded` (did you mean `max_loaded`?)",
            "unknown key `preloud` in [models[0]] (did you mean `preload`?)",
            "unknown key `temprature` in [defaults] (did you mean `temperature`?)",
        )
    ]


def test_help_gives_every_flag_a_text_and_its_default():
    from supervisor.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    for name, parser in commands.items():
        if name == "demo-model":
            continue  # worker.demo.build's own parser
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, (name, action.dest)
            if action.option_strings and action.nargs != 0:
                assert "default" in action.help, (name, action.option_strings)
    flags = {f for a in commands["chat"]._actions for f in a.option_strings}
    # chat talks to a person: none of a server's flags.
    assert not flags & {"--http", "--api-key", "--metrics-port", "--stats-interval", "--shutdown-grace", "--no-stdin"}
    assert cli("chat", "--help").stdout.count(b"default") >= 20


def test_the_demo_model_by_name_and_lm_studio_models(tiny_model, tmp_path):
    home = tmp_path / "home"
    studio = home / ".lmstudio" / "models" / "lmstudio-community" / "tiny-MLX"
    shutil.copytree(tiny_model, studio)
    env = {"HOME": str(home), "XDG_CACHE_HOME": str(tmp_path / "cache"), "LATTICE_MODEL_CACHE": str(tmp_path / "none"), "HF_HUB_CACHE": str(tmp_path / "hf")}
    listed = {m["name"]: m for m in json.loads(cli("list", "--json", env=env).stdout)}
    assert set(listed) == {"lmstudio-community/tiny-MLX"} and listed["lmstudio-community/tiny-MLX"]["path"] == str(studio)
    out = cli("run", "Hi", "--model", "lmstudio-community/tiny-MLX", "--max-tokens", "2", "--own-pool", env=env)
    assert out.returncode == 0 and b"lmstudio-community/tiny-MLX ready" in out.stderr, out.stderr
    # `demo` is what ps, /v1/models and chat call the demo model: --model takes it.
    demo = cli("run", "Hi", "--model", "demo", "--max-tokens", "2", "--own-pool", env=env)
    assert demo.returncode == 0 and b"demo ready" in demo.stderr, demo.stderr
    assert "demo" in {m["name"] for m in json.loads(cli("list", "--json", env=env).stdout)}


def test_serve_on_a_terminal_hints_after_a_first_line_that_is_not_json(tiny_model):
    import pexpect

    proc = pexpect.spawn(sys.executable, ["-m", "supervisor", "serve", "--model-dir", str(tiny_model), "--no-control-socket"], env=child_env(), cwd=str(ROOT))
    try:
        proc.expect('"ev":"ready"', timeout=120)
        proc.send("hello\r")
        proc.expect(r"JSON is malformed", timeout=60)
        proc.expect(r"hint: each stdin line is one JSON request, e\.g\. \{\"messages\"", timeout=60)
        proc.send("hello again\r")
        proc.expect(r"JSON is malformed", timeout=60)
        proc.sendeof()
        proc.expect(pexpect.EOF, timeout=60)
        assert proc.before.count(b"hint:") == 0  # said once, after the first line only
    finally:
        proc.close(force=True)
