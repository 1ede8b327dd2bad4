"""A decode step's attention on the CPU: mlx's own against the worker's
(worker.runtime.cpu_attention, whose softmax has an exponential of its own).

    python -m bench.cpu_attention [--parts calls,decode] [--rounds 7]

Two parts, the sides alternated, the order turning each round:

- `calls`: one attention call of a decode step (one query a row), compiled
  as the worker's step is: `mx.fast.scaled_dot_product_attention` against
  `cpu_attention.attention`, on random queries, keys and values. Heads of
  the demo model (4 query heads of 32 over 2 KV heads) and of Qwen3-8B (32
  of 128 over 8), 1 and 8 rows, `--contexts` cached tokens. Also the
  softmax alone, over the same scores.
- `decode`: tokens per second of the worker's compiled decode step on the
  demo model (`--size`), N = 1 and N = 8 rows at a `--context`-token
  prompt, with the model's attention bound to mlx's and to the worker's
  (two engines on one loaded model, the binding switched around each run,
  as each engine's trace keeps the binding it was made with).

Results go to bench/results/cpu-attention-<backend>[-tag].json after every
round: milliseconds (calls) and tokens per second (decode), median and
range, and ours over mlx's per round.
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import contextmanager

HEADS = {
    # (query heads, KV heads, head dim)
    "tiny": (4, 2, 32),
    "8b": (32, 8, 128),
}


def timed_ms(fn, reps: int) -> float:
    import mlx.core as mx

    t0 = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    return (time.perf_counter() - t0) / reps * 1000


def call_cases(contexts: list[int], seed: int = 0) -> dict:
    """name -> {side: zero-argument function}, every side compiled."""
    import mlx.core as mx

    from worker.runtime import cpu_attention

    mx.random.seed(seed)
    cases = {}
    for heads_name, (heads, kv_heads, dim) in HEADS.items():
        for rows in (1, 8):
            for context in contexts:
                if rows * kv_heads * context * dim > 1 << 24:
                    continue  # keys over 64 MB in float32: a long run on a small CPU, and the same exponentials
                q = mx.random.normal((rows, heads, 1, dim))
                k = mx.random.normal((rows, kv_heads, context, dim))
                v = mx.random.normal((rows, kv_heads, context, dim))
                scores = mx.random.normal((rows, kv_heads, heads // kv_heads, context)) * 3
                mx.eval(q, k, v, scores)
                scale = dim**-0.5

                def mlx_attention(q=q, k=k, v=v, scale=scale):
                    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=None)

                def our_attention(q=q, k=k, v=v, scale=scale):
                    return cpu_attention.attention(q, k, v, None, scale=scale, mask=None)

                name = f"{heads_name} rows={rows} context={context}"
                cases[name] = {"mlx": mx.compile(mlx_attention), "ours": mx.compile(our_attention)}
                cases[f"softmax {name}"] = {
                    "mlx": mx.compile(lambda s=scores: mx.softmax(s, axis=-1, precise=True)),
                    "ours": mx.compile(lambda s=scores: cpu_attention.softmax(s)),
                }
    return cases


def part_calls(args, record) -> None:
    import mlx.core as mx

    from bench.common import summary

    cases = call_cases([int(c) for c in args.contexts.split(",")])
    for sides in cases.values():
        for fn in sides.values():
            mx.eval(fn())
    runs = {name: {"mlx": [], "ours": []} for name in cases}
    for r in range(args.rounds):
        for name, sides in cases.items():
            for side in ("mlx", "ours") if r % 2 == 0 else ("ours", "mlx"):
                runs[name][side].append(timed_ms(sides[side], args.reps))
        table = {
            name: {
                "ms": {side: summary(v) for side, v in t.items()},
                "ours_over_mlx": summary([o / m for o, m in zip(t["ours"], t["mlx"])]),
            }
            for name, t in runs.items()
        }
        record("calls", table)
        print(f"calls round {r}: " + "; ".join(f"{n} {t['ours'][-1]:.3f}/{t['mlx'][-1]:.3f} ms" for n, t in runs.items()), file=sys.stderr)


@contextmanager
def bound(modules: list, fn):
    kept = {m: m.scaled_dot_product_attention for m in modules}
    for m in modules:
        m.scaled_dot_product_attention = fn
    try:
        yield
    finally:
        for m, f in kept.items():
            m.scaled_dot_product_attention = f


def part_decode(args, record) -> None:
    from bench.common import decode_rate, load_model, summary
    from bench.long_context import QUESTIONS, chat, long_text
    from worker.engine.scheduler import Scheduler
    from worker.runtime import cpu_attention
    from worker.runtime.memory import bound_buffer_cache

    memory = 1 << 34
    bound_buffer_cache(memory)
    _, loaded, codec = load_model(args.size)
    modules = [sys.modules[name] for name in sorted({type(m).__module__ for m in loaded.model.modules()})]
    modules = [m for m in modules if getattr(m, "scaled_dot_product_attention", None) is cpu_attention.attention]
    if not modules:
        raise SystemExit("this model's attention is not the CPU's route (not on a CPU?)")
    sides = {"mlx": cpu_attention._MLX, "ours": cpu_attention.attention}
    engines = {}
    for side, fn in sides.items():
        with bound(modules, fn):
            engines[side] = Scheduler(loaded, codec, lambda d: None, batch_memory=memory, prefix_cache_bytes=0)
            engines[side].warm_up()
    text = long_text(codec, args.context)
    prompts = [codec.encode(chat(text, QUESTIONS[i % 4] + f" ({i})")) for i in range(8)]
    runs = {f"n{n}_{side}": [] for n in (1, 8) for side in sides}
    for r in range(args.rounds):
        for n in (1, 8):
            for side in sides if r % 2 == 0 else list(sides)[::-1]:
                with bound(modules, sides[side]):
                    runs[f"n{n}_{side}"].append(decode_rate(engines[side], prompts[:n], args.steps))
        table = {
            "tok_s": {k: summary(v, 1) for k, v in runs.items()},
            "ours_over_mlx": {f"n{n}": summary([o / m for o, m in zip(runs[f"n{n}_ours"], runs[f"n{n}_mlx"])]) for n in (1, 8)},
            "context": args.context,
            "size": args.size,
        }
        record("decode", table)
        print(f"decode round {r}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items()), file=sys.stderr)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="calls,decode")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=30, help="calls a side and round (calls)")
    p.add_argument("--contexts", default="2048,8192,32768", help="cached tokens of the calls, comma-separated")
    p.add_argument("--size", default="tiny", help="the demo model of the decode part")
    p.add_argument("--context", type=int, default=8192, help="the decode part's prompt, in tokens")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed a run")
    p.add_argument("--tag", default="")
    args = p.parse_args()

    from worker.runtime.cpu_backend import load_openblas

    load_openblas()
    from bench.common import backend, load_average, machine, tagged, write_result

    result = {"machine": machine(), "load_average": {"before": load_average()}, "rounds": args.rounds}
    name = tagged(f"cpu-attention-{backend()}", args.tag)

    def record(part: str, table: dict) -> None:
        result[part] = table
        result["load_average"]["after"] = load_average()
        write_result(name, result)

    parts = args.parts.split(",")
    if "calls" in parts:
        part_calls(args, record)
    if "decode" in parts:
        part_decode(args, record)
    for part in ("calls", "decode"):
        if part in result:
            print(part)
            table = result[part] if part == "calls" else result[part]["ours_over_mlx"]
            for key, row in table.items():
                ratio = row["ours_over_mlx"] if part == "calls" else row
                print(f"  {key:40} ours / mlx {ratio['median']:.3f} ({ratio['min']}-{ratio['max']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
