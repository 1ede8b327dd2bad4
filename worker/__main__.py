"""`python -m worker --model DIR`: one model behind a msgpack request pipe.

stdin carries length-prefixed msgpack frames (ipc.framing); stdout carries
`@@lattice` event lines only; logs go to stderr. Exit code 78 (EX_CONFIG)
means the model dir (or a resource limit) is unusable, so
restarting cannot help; its cause is the last line on stderr, one line.

`main` runs the start-up in steps, each a function below: parse the
arguments, set up the process, start the server's threads, load the model,
open the prefix cache's disk tier, build the scheduler, warm up, say ready,
serve.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import resource
import sys
import threading
import time
from pathlib import Path

from ipc.messages import DEFAULT_MAX_ADAPTER_BYTES, DEFAULT_MAX_PROMPT_BYTES
from ipc.worker_events import EX_CONFIG, FATAL_PREFIX
from worker.runtime import defaults

log = logging.getLogger("worker")

# Importing mlx_lm.utils sets RLIMIT_NOFILE to (2048, 4096), which fails (a
# ValueError at import) when the hard limit is lower.
MLX_LM_NOFILE = 4096


def fatal(cause: str, code: int = EX_CONFIG) -> int:
    """A start-up failure a restart cannot fix: its cause as one line on
    stderr (the pool quotes the last one), and exit code 78 (or `code`)."""
    print(FATAL_PREFIX + re.sub(r"\s*\n\s*", " ", cause.strip()), file=sys.stderr, flush=True)
    return code


def nofile_problem() -> str | None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < MLX_LM_NOFILE:
        return (
            f"the hard limit on open files (RLIMIT_NOFILE) is {hard}, below the {MLX_LM_NOFILE} "
            f"that mlx-lm sets when it is imported; raise it (ulimit -Hn {MLX_LM_NOFILE}) where the pool starts"
        )
    return None


def rank_tag(args: argparse.Namespace) -> str:
    """Which rank of a group this process is, for its log lines."""
    return f" rank={os.environ.get('MLX_RANK') or 0}" if args.ranks > 1 else ""


def max_batch_arg(text: str) -> int | None:
    """--max-batch: a positive number, or `auto` (None)."""
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected auto or a positive number, got {text!r}")
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m worker", description=__doc__.split("\n\n")[0])
    _model_args(p)
    _batch_args(p)
    _cache_args(p)
    _compute_args(p)
    _limit_args(p)
    _group_args(p.add_argument_group("one model over several processes (docs/scaling.md)"))
    args = p.parse_args(argv)
    _check_args(p, args)
    args.model = args.model.expanduser().resolve()
    args.name = args.name or args.model.name
    return args


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, type=Path, help="model directory")
    p.add_argument("--name", help="model name used in events (default: the dir name)")
    p.add_argument("--tokenizer-dir", type=Path, help="directory with tokenizer.json (default: the model dir)")
    p.add_argument(
        "--max-adapters",
        type=int,
        default=defaults.MAX_ADAPTERS,
        help="adapters kept in memory; the least recently used one no request runs with goes first (default %(default)s)",
    )
    p.add_argument("--heartbeat", type=float, default=2.0, help="seconds between heartbeats (default 2)")


def _batch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-batch",
        type=max_batch_arg,
        default=None,
        help="requests decoded together; more wait in line; auto (the default) sizes it from the device's free memory and a row's cache",
    )
    p.add_argument(
        "--batch-memory",
        type=int,
        help="bytes the requests' caches may take before more requests wait (default: 1/4 of the device's memory, at most 3/4 of what is free after loading less the prefix cache)",
    )
    p.add_argument(
        "--prefill-step",
        type=int,
        help=f"prompt tokens a request reads per prefill chunk; running requests wait at most one chunk "
        f"(default {defaults.PREFILL_STEP_CPU} on a CPU, {defaults.PREFILL_STEP_GPU} on a GPU)",
    )


def _cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefix-cache-bytes",
        type=int,
        help="memory for reusable prompt state of earlier requests, 0 to disable (default: 512 MiB on a CPU, an eighth of a GPU's memory or a quarter of what is free on it, if less)",
    )
    p.add_argument(
        "--memory-held-elsewhere",
        type=int,
        default=0,
        help="bytes of this machine's compute memory that other workers hold or may take (the pool passes their weights, "
        "prefix cache budgets and the most their rows' caches take): the defaults of --batch-memory, --prefix-cache-bytes "
        "and --max-batch auto leave them out",
    )
    p.add_argument(
        "--prefix-disk-dir",
        type=Path,
        help="directory for the prefix cache's files, which outlive this process (default: none, memory only)",
    )
    p.add_argument(
        "--prefix-disk-bytes",
        type=int,
        help="bytes the prefix cache's files may take, least recently used out (default: min(30 GiB, a quarter of the free space))",
    )
    p.add_argument(
        "--warm-prompt",
        action="append",
        default=[],
        metavar="TEXT",
        help="a prompt prefix (ChatML text) prefilled at start and kept in the prefix cache for good; repeatable",
    )
    p.add_argument(
        "--warm-prompt-file",
        action="append",
        default=[],
        type=Path,
        metavar="PATH",
        help="as --warm-prompt, the text of a file; repeatable",
    )
    p.add_argument("--kv-bits", type=int, choices=(4, 8), help="quantize attention caches to this many bits (default: the model's dtype)")
    p.add_argument(
        "--kv-group-size",
        type=int,
        default=64,
        choices=(32, 64, 128),
        help="values sharing one scale and bias in a quantized cache; must divide the head dimension (default %(default)s)",
    )
    p.add_argument(
        "--quantized-kv-start",
        type=int,
        default=0,
        metavar="N",
        help="with --kv-bits: a request's attention cache stays in the model's dtype until it holds N tokens (default %(default)s: quantized from the first)",
    )


def _compute_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cpu-dtype",
        choices=("float32", "stored"),
        default="float32",
        help="compute dtype on CPU: float32 (fast, more memory) or as stored in the checkpoint (default float32)",
    )
    p.add_argument(
        "--idle-release",
        type=float,
        default=defaults.IDLE_RELEASE_S,
        help="seconds idle before MLX's cache of freed buffers goes back (default %(default)s; inf: never); the next request reuses it meanwhile",
    )
    p.add_argument(
        "--eager-decode",
        action="store_true",
        help="build every decode step's graph op by op instead of replaying a compiled one (mx.compile; docs/engine.md)",
    )
    p.add_argument(
        "--mask-threads",
        type=int,
        default=None,
        help="threads that fill structured-output token masks (default: a quarter of the cores, 1 to 4)",
    )
    p.add_argument(
        "--gil-switch-ms",
        type=float,
        default=defaults.GIL_SWITCH_MS,
        help="ms the engine thread may keep the GIL from a side thread waiting for it (sys.setswitchinterval; default %(default)s, Python's own 5)",
    )
    p.add_argument(
        "--draft",
        help="speculative decoding: 'ngram' (prompt lookup), 'mtp' (the checkpoint's MTP head) or a draft model's directory drafts tokens "
        "that the model verifies in one forward (docs/engine.md)",
    )
    p.add_argument("--draft-tokens", type=int, default=4, help="most tokens drafted per row and step (default %(default)s)")


def _limit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-context",
        type=int,
        help="tokens a request's prompt and reply may take together (default: the model config's max_position_embeddings, with its rope scaling)",
    )
    p.add_argument("--max-prompt-bytes", type=int, default=DEFAULT_MAX_PROMPT_BYTES, help="refuse longer prompts before tokenizing")
    p.add_argument("--max-adapter-bytes", type=int, default=DEFAULT_MAX_ADAPTER_BYTES, help="refuse larger adapter files before reading")
    p.add_argument(
        "--adapter-copies",
        type=Path,
        help="private directory for copies of the adapters loaded, used when an adapter file is gone or broken at a restart",
    )


def _group_args(g) -> None:
    g.add_argument("--ranks", type=int, default=1, help="processes the model is split over; this one is rank 0 (default 1)")
    g.add_argument("--hosts", help='JSON list, one host per rank: [{"ssh": "mac-b", "ip": "10.0.0.2"}, ...] (default: this machine for every rank)')
    g.add_argument("--parallel", choices=("pipeline", "tensor"), help="how the model is split (default: pipeline where mlx-lm has it, else tensor)")
    g.add_argument("--backend", default="ring", help="MLX distributed backend (default ring)")
    g.add_argument(
        "--whole-vocab",
        action="store_true",
        help="keep the embedding and LM head whole on every rank: more memory per rank, but no logits between ranks at each token",
    )
    g.add_argument("--port", type=int, help="the first rank's port; the others follow it (default: free ports when every rank is local, else 32323)")
    g.add_argument("--rank-timeout", type=float, default=120.0, help="seconds a rank may be silent, or a step wait on the group, before the group restarts")


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.draft is not None and args.draft not in ("ngram", "mtp") and not Path(args.draft).expanduser().is_dir():
        p.error(f"--draft must be 'ngram', 'mtp' or a draft model's directory, not {args.draft!r}")
    if not 1 <= args.draft_tokens <= 32:
        p.error(f"--draft-tokens must be from 1 to 32, not {args.draft_tokens}")
    if args.max_context is not None and args.max_context < 2:
        p.error(f"--max-context must be at least 2 tokens, not {args.max_context}")
    if args.quantized_kv_start and args.kv_bits is None or args.quantized_kv_start < 0:
        p.error("--quantized-kv-start is a count of tokens (>= 0) for --kv-bits")
    if args.ranks > 1 and (args.kv_bits or args.warm_prompt or args.warm_prompt_file):
        p.error("--kv-bits and warm prompts are for a model in one process (--ranks 1)")
    if args.memory_held_elsewhere < 0:
        p.error(f"--memory-held-elsewhere is a count of bytes (>= 0), not {args.memory_held_elsewhere}")
    if not 0.01 <= args.gil_switch_ms <= 1000:  # also refuses nan
        p.error(f"--gil-switch-ms must be from 0.01 to 1000, not {args.gil_switch_ms}")


# A restarted worker reads its prefix cache's most recent files back before
# `ready` for at most this share of the time its start took until then, and
# at most READ_BACK_AT_MOST_S: a request that comes as soon as it is ready
# then finds its prefix in memory. Read back after `ready` instead, that
# request waited for its own file's check and read: on a 2-core Xeon, a
# 26k-token prefix's first token took 43 ms against a warm pool's 23.
READ_BACK_SHARE = 0.25
READ_BACK_AT_MOST_S = 5.0


class StartError(Exception):
    """A start-up failure a restart cannot fix (or, with EX_TEMPFAIL, may)."""

    def __init__(self, cause: str, code: int = EX_CONFIG):
        super().__init__(cause)
        self.code = code


def main(argv: list[str] | None = None) -> int:
    # load_ms counts the imports too: they are most of a small model's start.
    t0 = time.perf_counter()
    args = parse_args(argv)
    try:
        channel, cpu_kernels, cuda_kernels = set_up_process(args)
        server, group = start_server(args, argv, channel)
        tend_kernels(cpu_kernels, cuda_kernels)
        loaded, codec = load_model(args, server, group)
        args.prefix_cache_bytes = prefix_cache_budget(args)
        prefix_disk = open_prefix_disk(args, loaded, server.wake) if group is None else None
        if prefix_disk is not None:
            server.before_exit = prefix_disk.closing
        scheduler = build_scheduler(args, loaded, codec, server, group, prefix_disk)
        from worker.runtime.memory import bound_buffer_cache

        bound_buffer_cache(scheduler.batch_memory)
        warm(args, t0, scheduler, prefix_disk)
        start_embedder(args, loaded, codec, server, group, scheduler)
    except StartError as exc:
        return fatal(str(exc), exc.code)
    say_ready(args, t0, loaded, codec, server, group, scheduler)
    # Messages that came meanwhile (adapter messages too) wait in the inbox,
    # so every answer comes after `ready`.
    server.serve_forever()
    server.before_exit()
    return 0


def set_up_process(args: argparse.Namespace):
    """Logging, the limits mlx-lm needs, the BLAS and kernel caches (before
    anything imports mlx), stdout kept for events, and the lifeline; the
    event channel and the CPU and CUDA kernels' directories (None: not
    kept)."""
    sys.setswitchinterval(args.gil_switch_ms / 1000)
    logging.basicConfig(
        level=os.environ.get("LATTICE_LOG_LEVEL", "INFO").upper(),
        format=f"%(asctime)s %(levelname)s worker model={args.name}{rank_tag(args)} pid={os.getpid()}: %(message)s",
        stream=sys.stderr,
    )
    problem = nofile_problem()
    if problem:
        raise StartError(problem)

    # Before anything imports mlx: its BLAS symbols bind when it loads, and
    # its CUDA caches read their settings when they are made.
    from worker.runtime.kernel_cache import keep_cpu_kernels, no_thrashing_abort

    no_thrashing_abort(os.environ)
    cpu_kernels = keep_cpu_kernels(os.environ)
    if cpu_kernels:
        log.info("CPU kernels compiled at run time are kept in %s", cpu_kernels)
    from worker.runtime.cpu_backend import load_openblas, thin_routes

    openblas = load_openblas()
    if openblas:
        log.info("BLAS: %s%s", openblas, thin_routes())
    from worker.runtime.kernel_cache import keep_kernels

    kernels = keep_kernels()
    if kernels:
        log.info("CUDA kernels compiled at run time are kept in %s", kernels)

    from worker.shell.channel import EventChannel
    from worker.shell.lifeline import bind_to_parent

    channel = EventChannel.take_stdout()
    ppid = os.environ.get("LATTICE_SUPERVISOR_PID")
    bind_to_parent(int(ppid) if ppid else None)
    return channel, cpu_kernels, kernels


def tend_kernels(cpu_kernels: Path | None, cuda_kernels: Path | None) -> None:
    """On the CPU, g++'s precompiled header for the kernels mlx will compile
    into cpu_kernels; in both directories, the kernels of mlx versions no
    worker has used for a while removed. Done while the heartbeats run: the
    supervisor's stall_timeout also counts a start."""
    import mlx.core as mx

    from worker.runtime.kernel_cache import UNUSED_FOR_DAYS, prune_versions
    from worker.runtime.kernel_header import build_header

    roots = []
    if cpu_kernels:
        if mx.default_device() == mx.cpu:
            header = build_header(cpu_kernels, mx.__version__, Path(mx.__file__).parent / "include", os.environ)
            log.info("CPU kernels' precompiled header: %s", header)
        roots.append(cpu_kernels / "mlx")  # mlx's own layout: <temp dir>/mlx/<version>
    if cuda_kernels:
        roots.append(cuda_kernels.parent.parent)  # worker.runtime.kernel_cache: <root>/<version>/<GPU>
    for root in roots:
        for gone in prune_versions(root, mx.__version__):
            log.info("removed %s: the kernels of an mlx version no worker has used for %d days", gone, UNUSED_FOR_DAYS)


def start_server(args: argparse.Namespace, argv: list[str] | None, channel):
    """The server (a group's rank, or a worker of its own) and its side
    threads; and the group's role, None for a model in one process."""
    from worker.group.plan import GroupError
    from worker.shell.server import WorkerServer

    if args.ranks == 1:
        server = WorkerServer(args.name, channel)
        group = None
    else:
        if args.draft:
            raise StartError("speculative decoding (draft) does not run on a model split over several processes (ranks > 1)")
        from worker.group.server import GroupRole

        try:
            group = GroupRole(args, sys.argv[1:] if argv is None else argv)
        except GroupError as exc:
            raise StartError(str(exc)) from exc
        server = group.make_server(args.name, channel)
    server.start_heartbeat(args.heartbeat)
    server.start_reader()
    return server, group


def load_model(args: argparse.Namespace, server, group):
    """The model (a group's share of it), its tokenizer, and its quantized
    attention caches when asked."""
    from ipc.events import encode_event
    from worker.group.plan import EX_TEMPFAIL, GroupError
    from worker.runtime.loader import ModelDirError, materialise, open_lazy
    from worker.text.tokenizer import TextCodec, TokenizerError

    def progress(done: int, total: int) -> None:
        server.channel.write(encode_event("loading", model=args.name, bytes_loaded=done, bytes_total=total))

    try:
        lazy = open_lazy(args.model)
        if group is not None:
            group.form(lazy)
        loaded = materialise(lazy, progress, cpu_float32=args.cpu_dtype == "float32")
        codec = TextCodec((args.tokenizer_dir or args.model).expanduser().resolve(), loaded.config)
    except (ModelDirError, TokenizerError) as exc:
        raise StartError(f"bad model dir: {exc}") from exc
    except RecursionError as exc:
        raise StartError(f"bad model dir: a JSON file in {args.model} or its tokenizer dir nests too deeply") from exc
    except GroupError as exc:
        raise StartError(str(exc), EX_TEMPFAIL if exc.retry else EX_CONFIG) from exc
    if args.kv_bits is not None:
        from worker.engine import kv_quant

        try:
            kv_quant.install(loaded.model, args.kv_bits, args.kv_group_size, args.quantized_kv_start)
        except ValueError as exc:
            raise StartError(str(exc)) from exc
        start = f", from {args.quantized_kv_start} tokens on" if args.quantized_kv_start else ""
        log.info("attention caches quantized: %d bits, groups of %d%s", args.kv_bits, args.kv_group_size, start)
    return loaded, codec


def prefix_cache_budget(args: argparse.Namespace) -> int:
    """--prefix-cache-bytes, or its default for this device."""
    if args.prefix_cache_bytes is not None:
        return args.prefix_cache_bytes
    import mlx.core as mx

    from worker.runtime.memory import device_memory, unused_device_memory

    return defaults.prefix_cache_bytes(mx.default_device() == mx.gpu, device_memory(), unused_device_memory(args.memory_held_elsewhere))


def open_prefix_disk(args: argparse.Namespace, loaded, wake):
    """The prefix cache's disk tier, or None (not asked for, or unusable)."""
    if args.prefix_disk_dir is None or args.prefix_cache_bytes <= 0 or args.prefix_disk_bytes == 0:
        return None
    from worker.cache.disk_files import default_budget
    from worker.cache.prefix_disk import PrefixDisk
    from worker.cache.prefix_file import model_key
    from worker.runtime.memory import processor

    root = args.prefix_disk_dir.expanduser()
    budget = args.prefix_disk_bytes if args.prefix_disk_bytes is not None else default_budget(root)
    try:
        kv = f"kv{args.kv_bits}g{args.kv_group_size}" if args.kv_bits else "kv"
        if args.quantized_kv_start:
            # Snapshots hold what this setting computes: the start decides
            # which tokens were computed over a quantized cache.
            kv += f"s{args.quantized_kv_start}"
        key = model_key(args.model, f"{loaded.format} {kv}", loaded.model)
        on_device = processor() == "cuda"
        prefix_disk = PrefixDisk(root, key, budget, wake=wake, max_pending_bytes=args.prefix_cache_bytes, on_device=on_device)
    except OSError as exc:
        # A read-only or full disk costs the disk tier, not the worker.
        log.warning("prefix cache on disk off: %s", exc)
        return None
    log.info("prefix cache on disk: %s (%d bytes at most)", prefix_disk.dir, budget)
    return prefix_disk


def build_scheduler(args: argparse.Namespace, loaded, codec, server, group, prefix_disk):
    from worker.engine.scheduler import Scheduler
    from worker.engine.speculate import DraftError
    from worker.lora.formats import AdapterReader
    from worker.lora.manager import AdapterManager
    from worker.runtime.batch_size import default_batch_memory
    from worker.runtime.memory import device_memory, unused_device_memory

    reader = AdapterReader(args.max_adapter_bytes, args.adapter_copies)
    adapters = AdapterManager(loaded.model, args.name, reader, args.max_adapters, wake=server.wake)
    try:
        return (Scheduler if group is None else group.scheduler)(
            loaded,
            codec,
            server.channel.write,
            max_batch=args.max_batch,
            batch_memory=args.batch_memory
            if args.batch_memory is not None
            else default_batch_memory(device_memory(), unused_device_memory(args.memory_held_elsewhere), args.prefix_cache_bytes),
            prefill_step=args.prefill_step,  # None: the device's default
            prefix_cache_bytes=args.prefix_cache_bytes,
            max_prompt_bytes=args.max_prompt_bytes,
            adapters=adapters,
            idle_release_s=args.idle_release,
            compile_decode=not args.eager_decode,
            mask_threads=args.mask_threads,
            draft=args.draft,
            draft_tokens=args.draft_tokens,
            max_context=args.max_context,
            prefix_disk=prefix_disk,
            held_elsewhere=args.memory_held_elsewhere,
        )
    except DraftError as exc:
        raise StartError(f"bad draft: {exc}") from exc


def learn(codec, prefixes: list) -> None:
    """The piece cache taught these prefixes' text (TextCodec.learn); a
    failure costs only the time it would have saved."""
    t0 = time.monotonic()
    for ids in prefixes:
        try:
            codec.learn(ids)
        except Exception:
            log.exception("piece cache: a stored prefix's text could not be tokenized")
    if prefixes:
        log.info("piece cache: the text of %d stored prefix(es) tokenized in %.0f ms", len(prefixes), (time.monotonic() - t0) * 1000)


def warm(args: argparse.Namespace, t0: float, scheduler, prefix_disk) -> None:
    """Kernels compiled, warm prompts prefilled, and the prefix cache's most
    recent files read back into memory before `ready`, as far as
    READ_BACK_SHARE of the start so far allows (`t0`: its time.perf_counter())."""
    from worker.runtime.memory import release_free_memory

    recent = prefix_disk.recent(args.prefix_cache_bytes // 2) if prefix_disk is not None else []
    learning = None
    if recent:
        # The prefixes most likely to come again, tokenized beside the
        # warm-up: a restarted worker's first request otherwise tokenizes
        # its whole long prefix (26k tokens: 30 ms of the tiny model's
        # 58 ms first hit on a 2-core EPYC, against 0.4 ms from the cache).
        learning = threading.Thread(target=learn, args=(scheduler.codec, [e.tokens for e in recent]), name="piece-cache", daemon=True)
        learning.start()
        # Checked on the disk thread beside the warm-up; the oldest first,
        # so that the newest ends up the most recently used in memory.
        for entry in reversed(recent):
            prefix_disk.read(entry, read_back=True)
        prefix_disk.read_backs_now()
    scheduler.warm_up()
    if args.warm_prompt or args.warm_prompt_file:
        from worker.engine.warm import read_warm_file, warm_prompts

        try:
            texts = args.warm_prompt + [read_warm_file(p.expanduser()) for p in args.warm_prompt_file]
        except ValueError as exc:
            raise StartError(str(exc)) from exc
        warm_prompts(scheduler, texts)
    # Before the read-backs: the hit they rehearse leaves its buffers in
    # mlx's cache for the first request's copy of its prefix.
    release_free_memory()
    if recent:
        budget = min(READ_BACK_AT_MOST_S, READ_BACK_SHARE * (time.perf_counter() - t0))
        t1 = time.monotonic()
        try:
            done = read_back(scheduler, prefix_disk, t1 + budget)
        except Exception:  # files on disk are a head start, never a reason not to start
            log.exception("prefix cache: reading files back before ready failed; what is left follows after ready")
            done = False
        # A first request tokenizing beside the piece cache's learning would
        # share the cores with it.
        learning.join(max(0.0, t1 + budget - time.monotonic()))
        log.info(
            "prefix cache: the %d most recently used files %s in %.0f ms before ready (at most %.0f ms)",
            len(recent),
            "read back into memory" if done else "partly read back; the rest follows after ready",
            (time.monotonic() - t1) * 1000,
            budget * 1000,
        )


def read_back(scheduler, prefix_disk, until: float) -> bool:
    """Before `ready`: the files queued to be read back are checked, made
    into arrays and a hit on the longest rehearsed, by the scheduler's own
    steps (no request is in it yet), until `until` (time.monotonic()). True
    when all of it is done; what is left goes on after `ready`, beside
    requests, as it would have."""
    prefix_disk.read_backs_now()
    while prefix_disk.reading or scheduler.has_work:
        left = until - time.monotonic()
        if left <= 0:
            return False
        if not scheduler.has_work:
            prefix_disk.wait(left)
        scheduler.step()
    return True


def start_embedder(args: argparse.Namespace, loaded, codec, server, group, scheduler) -> None:
    """Embed requests' engine (worker.engine.embed), warmed up; a model it
    cannot serve, or a group, refuses them instead."""
    from worker.engine.embed import Embedder, EmbedError

    if group is not None:
        server.embed_refusal = "a model split over several processes (ranks > 1) computes no embeddings"
        return
    try:
        server.embedder = Embedder(
            loaded.model,
            loaded.config,
            codec,
            server.channel.write,
            max_context=scheduler.prompts.max_context,
            chunk=scheduler.prefill_step,
            max_prompt_bytes=args.max_prompt_bytes,
            route=scheduler.adapters.route,
        )
        server.embedder.warm_up()
    except EmbedError as exc:
        server.embed_refusal = f"this model cannot compute embeddings: {exc}"


def say_ready(args: argparse.Namespace, t0: float, loaded, codec, server, group, scheduler) -> None:
    """The server learns what it serves; the log and the supervisor hear
    `ready`."""
    from ipc.events import encode_event
    from worker.runtime.batch_size import rows_memory_at_most
    from worker.runtime.memory import buffer_cache_limit, device_memory, processor

    server.scheduler = scheduler
    server.format = loaded.format
    # A draft model (speculative decoding) is part of this worker's weights.
    server.weights_bytes = loaded.weights_bytes + (scheduler.speculator.weights_bytes if scheduler.speculator else 0)
    server.processor = processor()
    server.device_memory = device_memory()
    # A group's ready says when every rank is, with the whole model's bytes.
    weights = server.weights_bytes if group is None else group.weights_bytes(loaded)
    load_ms = int((time.perf_counter() - t0) * 1000)
    log.info(
        "ready: format=%s weights=%d bytes load_ms=%d max_batch=%d (%s) batch_memory=%d buffer_cache=%d prefix_cache=%d memory_held_elsewhere=%d mask_threads=%d gil_switch_ms=%g",
        loaded.format,
        weights,
        load_ms,
        scheduler.max_batch,
        scheduler.max_batch_why,
        scheduler.batch_memory,
        buffer_cache_limit(scheduler.batch_memory),
        scheduler.prefix_cache.budget,
        args.memory_held_elsewhere,
        scheduler.masks.threads,
        sys.getswitchinterval() * 1000,
    )
    if group is not None:
        server.channel.write(encode_event("loading", model=args.name, bytes_loaded=weights, bytes_total=weights))
    server.channel.write(
        encode_event(
            "ready",
            model=args.name,
            format=loaded.format,
            # The pool relays this line as the base model's `ready`: no adapter.
            lora=None,
            load_ms=load_ms,
            weights_bytes=weights,
            opens_think=chat_opens_think(codec),
            processor=server.processor,
            max_context=scheduler.prompts.max_context,
            max_batch=scheduler.max_batch,
            max_batch_why=scheduler.max_batch_why,
            prefix_cache_bytes=scheduler.prefix_cache.budget,
            rows_memory_bytes=rows_memory_at_most(
                batch_memory=scheduler.batch_memory,
                max_batch=scheduler.max_batch,
                row_fixed_bytes=scheduler.row_fixed_bytes,
                row_token_bytes=scheduler.row_token_bytes,
                context=scheduler.prompts.max_context,
            ),
        )
    )


def chat_opens_think(codec) -> bool:
    """Whether a reply to `messages` starts inside a <think> block (the chat
    template's generation prompt opens one): HTTP clients get that text as
    reasoning_content, not as the answer."""
    from ipc.messages import Message
    from worker.text.streamer import think_open

    try:
        prompt = codec.encode(codec.render([Message("user", "Hi")]))
    except Exception:  # a user's template may raise anything; requests will say so
        return False
    return think_open(prompt, codec.think_start, codec.think_end)


if __name__ == "__main__":
    sys.exit(main())
