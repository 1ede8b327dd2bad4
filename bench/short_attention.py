"""A prompt resumed over a long cache, its last few tokens read: mlx's own
attention against the worker's two-matmul route (worker.runtime.short_attention).

One process, the model's forward only: a cache of `--tokens` tokens (random
keys and values: the attention's cost does not depend on them), then
`--queries` new tokens read over it and the next token taken. Every call
meets a cache length not met before, as a prefix-cache hit does, since on
CUDA mlx builds a cuDNN plan for each new length; a second call at the same
length shows the call without that build. The sides alternate, the order
rotating each round. Meaningful on CUDA; on a CPU both sides are mlx's
kernels and matmuls with no plan to build.

    python -m bench.short_attention --size 8b --rounds 7   # on a GPU
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="tiny")
    p.add_argument("--tokens", type=int, default=26000)
    p.add_argument("--queries", type=int, default=21)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--tag", default="")
    args = p.parse_args()

    from bench.common import backend, load_average, load_model, machine, summary, tagged, write_result

    path, loaded, codec = load_model(args.size)
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from worker.runtime import short_attention

    model = loaded.model
    modules = {sys.modules[type(m).__module__] for m in model.modules()}
    modules = [m for m in modules if getattr(m, "scaled_dot_product_attention", None) in (short_attention.attention, short_attention._MLX)]
    if not modules:
        raise SystemExit("this model's attention is routed elsewhere (kv_bits?)")

    def route(ours: bool) -> None:
        for m in modules:
            m.scaled_dot_product_attention = short_attention.attention if ours else short_attention._MLX

    # A cache of the prefix's length (plus room: each call's cut moves it).
    cache = make_prompt_cache(model)
    model(mx.array([list(range(200, 204))]), cache=cache)
    mx.random.seed(0)
    span = 8 * (2 * args.rounds + 2)
    for c in cache:
        if type(c) is KVCache:
            shape = (1, c.keys.shape[1], args.tokens + span, c.keys.shape[3])
            c.keys = (mx.random.normal(shape) * 0.1).astype(c.keys.dtype)
            c.values = (mx.random.normal(shape) * 0.1).astype(c.keys.dtype)
            c.offset = args.tokens
    attention_layers = [c for c in cache if type(c) is KVCache]
    mx.eval([c.keys for c in attention_layers], [c.values for c in attention_layers])
    length = args.tokens

    def resumed(at: int) -> float:
        """The next token after `--queries` tokens over `at` cached ones (ms)."""
        for c in attention_layers:
            c.offset = at
        t0 = time.perf_counter()
        logits = model(mx.array([list(range(100, 100 + args.queries))]), cache=cache)
        mx.argmax(logits[:, -1], axis=-1).item()
        return (time.perf_counter() - t0) * 1000

    for ours in (False, True):  # each side's kernels loaded once, at a length of its own
        route(ours)
        resumed(length - 1 - ours)
    load_before = load_average()
    new = {"mlx": [], "ours": []}
    same = {"mlx": [], "ours": []}
    for r in range(args.rounds):
        order = ["mlx", "ours"] if r % 2 == 0 else ["ours", "mlx"]
        for name in order:
            route(name == "ours")
            length += 8  # a length no call met before
            new[name].append(resumed(length))
            same[name].append(resumed(length))
        result = {
            "size": args.size,
            "cached_tokens": args.tokens,
            "queries": args.queries,
            "new_length_ms": {n: summary(v, 1) for n, v in new.items()},
            "same_length_ms": {n: summary(v, 1) for n, v in same.items()},
            "ours_over_mlx_new_length": summary([o / m for o, m in zip(new["ours"], new["mlx"])]),
            "runs_ms": {"new": {n: [round(x, 1) for x in v] for n, v in new.items()}, "same": {n: [round(x, 1) for x in v] for n, v in same.items()}},
            "machine": machine(),
            "load_average": {"before": load_before, "after": load_average()},
        }
        write_result(tagged(f"short-attention-{backend()}-{args.size}", args.tag), result)
        print(f"round {r}: " + ", ".join(f"{n} {new[n][-1]:.1f} ms new / {same[n][-1]:.1f} ms same" for n in order), flush=True)
    route(backend() == "cuda")
    for n in new:
        s, t = result["new_length_ms"][n], result["same_length_ms"][n]
        print(f"{n:5} new length {s['median']:7.1f} ms ({s['min']}-{s['max']}); same length {t['median']:7.1f} ms")
    print(f"ours / mlx at a new length, per round: {result['ours_over_mlx_new_length']['median']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
