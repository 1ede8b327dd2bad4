"""Long prompts: the prefix cache's disk tier, and quantized KV caches.

Parts (`--parts`, default all), each written to
bench/results/long-context-<backend>-<size>[-tag].json after every round:

- `restart`: a pool (`lattice-pool serve`, a private cache dir per round)
  gets a long system prompt (an agent's tools, `--tokens` of them) and a
  short question: first token cold; the same prefix with another question
  (warm, in the worker's memory); then the pool is stopped, started again,
  and a third question comes (resumed from the files on disk). Ratios:
  cold / restart (the goal: >= 10) and restart / warm (<= 1.5).
- `kv`: one process per setting (the model's dtype, 8 and 4 bits) prefills
  `--kv-tokens` tokens in the worker's chunks; the attention caches' bytes
  and MLX's peak memory, as ratios to the model's dtype in the same round.
  `--kv-dtype bfloat16` computes in bf16 on the CPU too (a CPU worker
  computes in float32), so that the ratios are those to a bf16 cache.
- `decode`: tokens per second of N = 1 and N = 8 rows (`--decode-rows`) at a
  `--decode-context`-token prompt, 8-bit KV against the model's dtype,
  both with the worker's decode step (the default) and op by op (on
  CUDA; on the CPU the model's dtype only), alternated in one process; on the CPU also
  8-bit KV with the keys read by mlx's quantized matmul rather than scored
  from their bytes (`8k`). The worker's step is timed once it has chosen
  its way for that many rows at that context (on CUDA it times both first).
- `quality`: the mean log-probability of a fixed text (`--quality-tokens`
  long) with 8 and 4 bits against the model's dtype, and how many of 8
  prompts at that length give the same first 64 greedy tokens.

    python -m bench.long_context [--size tiny] [--tokens 26000] [--rounds 5] [--parts restart,kv,decode,quality]
    python -m bench.long_context --size 8b --rounds 3 --kv-rounds 3   # a GPU: Qwen3-8B's shape (or --model DIR)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

UNIT = (
    '{"name": "read_file", "description": "Read a file of the project and return its text", "parameters": {"path": "string"}}\n'
    '{"name": "run", "description": "Run a shell command in the sandbox and return what it printed", "parameters": {"cmd": "string"}}\n'
    '{"name": "search", "description": "Search the code for a pattern and list the places it occurs", "parameters": {"query": "string"}}\n'
)
QUESTIONS = ["Which tool reads a file?", "How do I run the tests?", "Where is the parser defined?", "What does search return?"]


def long_text(codec, tokens: int) -> str:
    """About `tokens` tokens of tool definitions, each line numbered so that
    no two stretches are the same."""
    lines = []
    n = 0
    i = 0
    while n < tokens:
        line = f"{i}: " + UNIT.splitlines()[i % 3] + "\n"
        lines.append(line)
        n += len(codec.encode(line))
        i += 1
    return "".join(lines)


def chat(system: str, question: str) -> str:
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


# -- restart ----------------------------------------------------------------------


def part_restart(args, path: Path, system: str, record) -> None:
    from harness.pool import PoolProc
    from ipc.paths import pool_cache_dir

    config_dir = Path(tempfile.mkdtemp(prefix="lattice-bench-"))
    config = config_dir / "pool.toml"
    config.write_text(f'[[models]]\nname = "m"\npath = "{path}"\npreload = true\n')
    rounds = []
    for r in range(args.rounds):
        cache = Path(tempfile.mkdtemp(prefix="lattice-bench-cache-"))
        env = {"XDG_CACHE_HOME": str(cache)}
        root = pool_cache_dir(env) / "prefix"

        def ask(pool, i: int) -> dict:
            done = pool.generate({"model": "m", "id": f"q{r}-{i}", "prompt": chat(system, QUESTIONS[i]), "temperature": 0, "max_tokens": 8})
            return {
                "ttft_ms": done["ttft_ms"],
                "client_ttft_ms": round(done["client_ttft_ms"], 1),
                "prompt_tokens": done["prompt_tokens"],
                "cached_tokens": done.get("cached_tokens", 0),
            }

        t0 = time.monotonic()
        pool = PoolProc("--config", str(config), env=env)
        pool.wait_ev("ready", model="m", timeout=300)
        first_ready_s = time.monotonic() - t0
        cold = ask(pool, 0)
        warm = ask(pool, 1)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not list(root.rglob("*.lpx")) or list(root.rglob("*.tmp"))):
            time.sleep(0.1)
        disk_bytes = sum(p.stat().st_size for p in root.rglob("*.lpx"))
        pool.close()
        t0 = time.monotonic()
        pool = PoolProc("--config", str(config), env=env)
        pool.wait_ev("ready", model="m", timeout=300)
        restart_ready_s = time.monotonic() - t0
        time.sleep(args.restart_wait)
        restart = ask(pool, 2)
        pool.close()
        for line in pool.stderr.decode(errors="replace").splitlines():
            if (
                "read from disk" in line
                or "rehearsed" in line
                or "not read:" in line
                or "prefix cache file(s) on disk" in line
                or "before ready" in line
                or " ready: " in line
            ):
                print(f"  restarted worker: {line.strip()}", file=sys.stderr)
        # From starting the pool to the model's `ready`: with files to read
        # back, a restarted worker reads some of them first.
        ready_s = {"first_start": round(first_ready_s, 3), "restart": round(restart_ready_s, 3)}
        rounds.append({"cold": cold, "warm": warm, "restart": restart, "disk_bytes": disk_bytes, "ready_s": ready_s})
        record(
            "restart",
            rounds,
            {
                "cold_over_restart": [x["cold"]["ttft_ms"] / x["restart"]["ttft_ms"] for x in rounds],
                "restart_over_warm": [x["restart"]["ttft_ms"] / x["warm"]["ttft_ms"] for x in rounds],
                "cold_ttft_ms": [x["cold"]["ttft_ms"] for x in rounds],
                "warm_ttft_ms": [x["warm"]["ttft_ms"] for x in rounds],
                "restart_ttft_ms": [x["restart"]["ttft_ms"] for x in rounds],
                "first_start_ready_s": [x["ready_s"]["first_start"] for x in rounds],
                "restart_ready_s": [x["ready_s"]["restart"] for x in rounds],
            },
        )
        print(
            f"restart round {r}: cold {cold['ttft_ms']:.0f} ms, warm {warm['ttft_ms']:.0f} ms, after restart {restart['ttft_ms']:.0f} ms; ready in {first_ready_s:.2f} s, {restart_ready_s:.2f} s after the restart "
            f"(cached {restart['cached_tokens']}/{restart['prompt_tokens']})",
            file=sys.stderr,
        )


# -- kv: bytes and peak memory, one process per setting ----------------------------


def prefill_step() -> int:
    """The worker's prefill chunk on this machine."""
    import mlx.core as mx

    from worker.runtime.defaults import PREFILL_STEP_CPU, PREFILL_STEP_GPU

    return PREFILL_STEP_GPU if mx.default_device() == mx.gpu else PREFILL_STEP_CPU


def kv_child(path: Path, bits: int, tokens: int, dtype: str) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

    step = prefill_step()
    loaded = load_with_kv(path, bits, cpu_float32=dtype == "float32")
    ids = mx.random.randint(3, 600, (tokens,), key=mx.random.key(0)).astype(mx.uint32)
    cache = make_prompt_cache(loaded.model)
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    t0 = time.perf_counter()
    for at in range(0, tokens, step):
        loaded.model(ids[None, at : at + step], cache=cache)
        mx.eval([c.state for c in cache])
    seconds = time.perf_counter() - t0
    kv = sum(c.nbytes for c in cache if isinstance(c, (KVCache, QuantizedKVCache)))
    dtype = next(c.keys.dtype if isinstance(c.keys, mx.array) else c.keys[1].dtype for c in cache if isinstance(c, (KVCache, QuantizedKVCache)))
    return {
        "bits": bits,
        "kv_bytes": kv,
        "peak_bytes": mx.get_peak_memory() - base,
        "weights_bytes": loaded.weights_bytes,
        "prefill_s": round(seconds, 2),
        "dtype": str(dtype),
    }


def args_group(loaded) -> int:
    """The largest group size (64 or 32) that divides the model's head dimension."""
    head = (loaded.config.get("text_config") or loaded.config).get("head_dim", 64)
    return 64 if head % 64 == 0 else 32


def load_with_kv(path: Path, bits: int, cpu_float32: bool = True):
    """The model loaded as a worker loads it, its attention caches quantized
    to `bits` (0: the model's dtype)."""
    from worker.engine import kv_quant
    from worker.runtime.loader import load

    loaded = load(path, cpu_float32=cpu_float32)
    if bits:
        kv_quant.install(loaded.model, bits, args_group(loaded))
    return loaded


def prefill_but_last(model, ids: list[int], cache: list, step: int) -> None:
    """All of `ids` but the last token into `cache`, in chunks of `step`."""
    import mlx.core as mx

    for at in range(0, len(ids) - 1, step):
        model(mx.array(ids[at : min(at + step, len(ids) - 1)])[None], cache=cache)
        mx.eval([c.state for c in cache])


def part_kv(args, path: Path, record) -> None:
    rounds = []
    for r in range(args.kv_rounds):
        row = {}
        order = (0, 8, 4) if r % 2 == 0 else (4, 8, 0)
        for bits in order:
            out = subprocess.run(
                [sys.executable, "-m", "bench.long_context", "--kv-child", str(bits), "--model", str(path), "--kv-tokens", str(args.kv_tokens)]
                + ["--kv-dtype", args.kv_dtype],
                capture_output=True,
                text=True,
                check=True,
            )
            row[str(bits)] = json.loads(out.stdout.strip().splitlines()[-1])
        rounds.append(row)
        record(
            "kv",
            rounds,
            {f"kv_bytes_{b}_over_dtype": [x[b]["kv_bytes"] / x["0"]["kv_bytes"] for x in rounds] for b in ("8", "4")}
            | {f"peak_{b}_over_dtype": [x[b]["peak_bytes"] / x["0"]["peak_bytes"] for x in rounds] for b in ("8", "4")},
        )
        print(f"kv round {r}: " + ", ".join(f"{b} bits: kv {v['kv_bytes']} peak {v['peak_bytes']}" for b, v in row.items()), file=sys.stderr)


# -- decode -------------------------------------------------------------------------

# Each decode engine's batch memory (its rows' caches).
BATCH_MEMORY = 1 << 34


def part_decode(args, path: Path, codec, record) -> None:
    import mlx.core as mx

    from bench.common import decode_rate
    from worker.engine.scheduler import Scheduler
    from worker.runtime.memory import bound_buffer_cache, processor

    # "0": the model's dtype, the worker's decode step (the default: on the
    # CPU compiled; on CUDA traced or op by op, whichever its timing of
    # both chose); "0e": the same, op by op; "8" and "8e": 8 bits, the same
    # two; "8k" (CPU): 8 bits, compiled, with the scores from mlx's
    # quantized matmul. The attention is rebound on the model's module,
    # shared by every engine here, so how `8k` scores its keys is a module
    # setting switched around each run (a trace keeps the setting it was
    # made with, and each engine traces its own). Engines of the same cache share one loaded model (a 16 GB load
    # apiece on the 8B shape).
    keys = ("0", "0e", "8", "8k") if processor() == "cpu" else ("0", "0e", "8", "8e")
    # MLX's cache of freed buffers bounded as a worker bounds it: unbounded,
    # it may grow to the GPU's 95 % while four engines and two models share
    # this process.
    bound_buffer_cache(BATCH_MEMORY)
    engines = {}
    models = {}
    for key in keys:
        quantized = key.startswith("8")
        if quantized not in models:
            models[quantized] = load_with_kv(path, 8 if quantized else 0)
        loaded = models[quantized]
        s = Scheduler(loaded, codec, lambda d: None, batch_memory=BATCH_MEMORY, prefix_cache_bytes=0, compile_decode=not key.endswith("e"))
        with scores_by(key):
            s.warm_up()
        engines[key] = s
    text = long_text(codec, args.decode_context)

    def steps_per_s(s, n: int) -> float:
        # On CUDA the worker's step tries both ways at each new span of
        # context (worker.engine.step_choice): timed after its choice.
        return decode_rate(s, [codec.encode(chat(text, QUESTIONS[i % 4] + f" ({i})")) for i in range(n)], args.decode_steps)

    rows = [int(n) for n in args.decode_rows.split(",")]
    rounds = []
    for r in range(args.rounds):
        row = {}
        for n in rows:
            for key in keys if r % 2 == 0 else keys[::-1]:
                with scores_by(key):
                    row[f"n{n}_{key}"] = round(steps_per_s(engines[key], n), 1)
        row["mlx_gb"] = {
            "active": round(mx.get_active_memory() / 1e9, 2),
            "cache": round(mx.get_cache_memory() / 1e9, 2),
            "peak": round(mx.get_peak_memory() / 1e9, 2),
        }
        rounds.append(row)
        ratios = {
            f"n{n}_8bit_over_{base}": [x[f"n{n}_8"] / x[f"n{n}_{key}"] for x in rounds] for n in rows for key, base in (("0", "dtype"), ("0e", "dtype_eager"))
        }
        if "8k" in keys:
            ratios |= {f"n{n}_8bit_kernel_over_dtype": [x[f"n{n}_8k"] / x[f"n{n}_0"] for x in rounds] for n in rows}
        if "8e" in keys:
            # 8 bits by the faster of its two steps, against the model's dtype's faster.
            ratios |= {f"n{n}_8bit_best_over_dtype_best": [max(x[f"n{n}_8"], x[f"n{n}_8e"]) / max(x[f"n{n}_0"], x[f"n{n}_0e"]) for x in rounds] for n in rows}
        record("decode", rounds, ratios)
        print(f"decode round {r}: {row}", file=sys.stderr)


@contextmanager
def scores_by(key: str):
    """For engine `8k`, 8-bit keys read by mlx's quantized matmul instead
    of scored from their bytes (worker.engine.quant_attention)."""
    from worker.engine import quant_attention

    kept = quant_attention.BYTES_BLOCKS_AT_MOST
    if key == "8k":
        quant_attention.BYTES_BLOCKS_AT_MOST = -1
    try:
        yield
    finally:
        quant_attention.BYTES_BLOCKS_AT_MOST = kept


# -- quality --------------------------------------------------------------------------


def part_quality(args, path: Path, codec, record) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    step = prefill_step()
    models = {bits: load_with_kv(path, bits).model for bits in (0, 8, 4)}
    ids = codec.encode(long_text(codec, args.quality_tokens))

    def mean_logprob(model) -> float:
        cache = make_prompt_cache(model)
        total, count = 0.0, 0
        for at in range(0, len(ids) - 1, step):
            piece = ids[at : at + step + 1]
            logits = model(mx.array(piece[:-1])[None], cache=cache)[0].astype(mx.float32)
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            total += mx.take_along_axis(lp, mx.array(piece[1:])[:, None], axis=-1).sum().item()
            count += len(piece) - 1
        return total / count

    def greedy(model, prompt_ids: list[int], n: int) -> list[int]:
        cache = make_prompt_cache(model)
        prefill_but_last(model, prompt_ids, cache, step)
        token = prompt_ids[-1]
        out = []
        for _ in range(n):
            token = int(mx.argmax(model(mx.array([[token]]), cache=cache)[0, -1]).item())
            out.append(token)
        return out

    logprob = {bits: mean_logprob(m) for bits, m in models.items()}
    same = {8: 0, 4: 0}
    prompts = 8
    text = codec.decode(ids)
    for i in range(prompts):
        prompt = codec.encode(chat(text, f"Question {i}: " + QUESTIONS[i % 4]))
        ref = greedy(models[0], prompt, 64)
        for bits in (8, 4):
            same[bits] += greedy(models[bits], prompt, 64) == ref
    result = {
        "tokens": len(ids),
        "mean_logprob": logprob,
        "relative_difference_8": abs(logprob[8] - logprob[0]) / abs(logprob[0]),
        "relative_difference_4": abs(logprob[4] - logprob[0]) / abs(logprob[0]),
        "greedy_64_same_8": f"{same[8]}/{prompts}",
        "greedy_64_same_4": f"{same[4]}/{prompts}",
    }
    record("quality", [result], {})
    print(f"quality: {result}", file=sys.stderr)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="tiny")
    p.add_argument("--model", type=Path)
    p.add_argument("--tokens", type=int, default=26000, help="the long prefix of the restart part")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--restart-wait",
        type=float,
        default=0.0,
        help="seconds between the restarted pool's ready and its question (default 0: at once; a restarted worker reads its most recent files back before ready, within a share of its start, and the rest after it)",
    )
    p.add_argument("--parts", default="restart,kv,decode,quality")
    p.add_argument("--kv-tokens", type=int, default=32768)
    p.add_argument("--kv-rounds", type=int, default=5)
    p.add_argument(
        "--kv-dtype", choices=("float32", "bfloat16"), default="float32", help="the kv part's compute dtype on the CPU (a GPU computes in the model's)"
    )
    p.add_argument("--decode-context", type=int, default=2048)
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--decode-rows", default="1,8", help="the batch sizes of the decode part, comma-separated")
    p.add_argument("--quality-tokens", type=int, default=4096)
    p.add_argument("--tag", default="")
    p.add_argument("--kv-child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()

    from worker.runtime.cpu_backend import load_openblas

    load_openblas()
    from bench.common import backend, demo_model, machine, summary, tagged, write_result

    path = args.model or demo_model(args.size)
    if args.kv_child is not None:
        print(json.dumps(kv_child(path, args.kv_child, args.kv_tokens, args.kv_dtype)))
        return 0
    from worker.text.tokenizer import TextCodec

    config = json.loads((path / "config.json").read_text())
    codec = TextCodec(path, config)
    name = tagged(f"long-context-{backend()}-{args.model.name if args.model else args.size}", args.tag)
    result = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "parts": {}}

    def record(part: str, rounds: list, ratios: dict) -> None:
        result["parts"][part] = {"rounds": rounds, "ratios": {k: summary(v) for k, v in ratios.items() if v}}
        write_result(name, result)

    parts = args.parts.split(",")
    if "restart" in parts:
        system = long_text(codec, args.tokens)
        part_restart(args, path, system, record)
    if "kv" in parts:
        part_kv(args, path, record)
    if "decode" in parts:
        part_decode(args, path, codec, record)
    if "quality" in parts:
        part_quality(args, path, codec, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
