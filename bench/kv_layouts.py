"""One decode step's attention over a quantized KV cache, by the cache's layout.

    python -m bench.kv_layouts [--context 2048] [--rows 1,8] [--bits 8] [--runs 7]

A decode step with `kv_bits` reads the cache through mlx's quantized
matmul. On mlx's CPU backend that kernel is fast one way and slow the other:
`x @ W` with W quantized along its last axis (`transpose=False`, as the
values are read) runs near a float matmul, while `x @ W.T` (`transpose=True`,
as the keys are read: scores = q @ K.T) runs several times slower. So the
8-bit cache's decode at 8 rows stays under the float cache's however the
queries are laid out, as long as the keys go through that kernel.

Four layouts, each timed as the
attention of one layer for one decode step (scores, softmax, values) on the
same random cache, alternated, `--runs` rounds of `--reps` calls each after
a warm-up:

- `float`: the cache in float32 (the CPU worker's dtype): the baseline.
- `mlx-lm`: keys and values quantized along the head dimension, as mlx-lm's
  QuantizedKVCache and the worker keep them; queries laid out as the
  worker's CPU path does (each KV head's queries as one matmul's rows).
- `keys-per-channel`: values as in `mlx-lm`, keys stored transposed and
  quantized along the tokens (each channel's group of tokens shares a scale,
  as KIVI quantizes keys), so that the scores take the fast direction too.
  Only the complete groups would be quantized in a cache that grows a token
  at a time; here the whole context is.
- `bytes`: the `mlx-lm` layout with the scores as the worker's
  CPU path computes them (worker.engine.quant_attention): the packed keys
  read as bytes and converted to float32, at once or a KV head and a block
  of tokens at a time, one float matmul against the queries spread over
  the groups, then each group's scale and bias.

Shapes: `tiny` (the demo model: 2 KV heads of 32, 2 queries each, groups of
32), `8b` (Qwen3-8B: 8 KV heads of 128, 4 queries each, groups of 64) and
`8b-g128` (the same heads, `kv_group_size = 128`: a group per head).
Reported: milliseconds per call and each layout's time over `float`'s per
round (median, min, max), and each layout's largest difference from the
float scores. Results go to bench/results/kv-layouts-<backend>[-tag].json
after every round.
"""

from __future__ import annotations

import argparse
import sys
import time

SHAPES = {
    # (KV heads, queries per KV head, head dim, group size)
    "tiny": (2, 2, 32, 32),
    "8b": (8, 4, 128, 64),
    "8b-g128": (8, 4, 128, 128),
}


def layouts(rows: int, context: int, shape: tuple, bits: int, seed: int = 0) -> tuple[dict, dict]:
    """The attention functions over one random cache, and each one's
    largest score difference from float."""
    import mlx.core as mx

    from worker.engine.quant_attention import _byte_blocks, _byte_scores

    kv_heads, group, dim, group_size = shape
    mx.random.seed(seed)
    keys = mx.random.normal((rows, kv_heads, context, dim))
    values = mx.random.normal((rows, kv_heads, context, dim))
    queries = mx.random.normal((rows, kv_heads, group, dim)) * dim**-0.5
    qk = mx.quantize(keys, group_size=group_size, bits=bits)
    qv = mx.quantize(values, group_size=group_size, bits=bits)
    qk_t = mx.quantize(keys.swapaxes(-1, -2), group_size=group_size, bits=bits)
    mx.eval(keys, values, queries, qk, qv, qk_t)
    q = dict(group_size=group_size, bits=bits)

    def scores(kind: str):
        if kind == "float":
            return queries @ keys.swapaxes(-1, -2)
        if kind == "mlx-lm":
            return mx.quantized_matmul(queries, *qk, transpose=True, **q)
        if kind == "bytes":
            return _byte_scores(queries, qk, group_size, bits, _byte_blocks(qk, dim))
        return mx.quantized_matmul(queries, *qk_t, transpose=False, **q)

    def attention(kind: str):
        def run():
            weights = mx.softmax(scores(kind), axis=-1, precise=True)
            if kind == "float":
                return weights @ values
            return mx.quantized_matmul(weights, *qv, transpose=False, **q)

        return run

    kinds = ["float", "mlx-lm", "keys-per-channel", "bytes"]
    reference = scores("float")
    errors = {kind: mx.abs(scores(kind) - reference).max().item() for kind in kinds[1:]}
    return {kind: attention(kind) for kind in kinds}, errors


def timed(fn, reps: int) -> float:
    import mlx.core as mx

    start = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    return (time.perf_counter() - start) / reps * 1000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="tiny,8b", help=f"comma-separated, of {sorted(SHAPES)} (default %(default)s)")
    p.add_argument("--rows", default="1,8", help="decode rows, comma-separated (default %(default)s)")
    p.add_argument("--context", type=int, default=2048, help="cached tokens per row (default %(default)s)")
    p.add_argument("--bits", type=int, default=8, choices=(4, 8))
    p.add_argument("--runs", type=int, default=7, help="measured rounds (default %(default)s)")
    p.add_argument("--reps", type=int, default=30, help="calls per layout and round (default %(default)s)")
    p.add_argument("--tag", default="")
    args = p.parse_args()

    from worker.runtime.cpu_backend import load_openblas

    load_openblas()
    from bench.common import backend, machine, summary, tagged, write_result

    name = tagged(f"kv-layouts-{backend()}", args.tag)
    result = {"machine": machine(), "args": vars(args), "cases": {}}
    for shape in args.shapes.split(","):
        for rows in (int(x) for x in args.rows.split(",")):
            fns, errors = layouts(rows, args.context, SHAPES[shape], args.bits)
            key = f"{shape}/{rows}"
            entry = result["cases"][key] = {"ms": {k: [] for k in fns}, "over_float": {}, "max_score_error": errors}
            order = list(fns)
            for kind in order:
                timed(fns[kind], 3)
            for round_ in range(args.runs):
                # Alternated: each round in the other order.
                for kind in order if round_ % 2 == 0 else order[::-1]:
                    entry["ms"][kind].append(round(timed(fns[kind], args.reps), 4))
                ratios = {kind: [a / b for a, b in zip(entry["ms"][kind], entry["ms"]["float"])] for kind in order[1:]}
                entry["over_float"] = {kind: summary(v) for kind, v in ratios.items()}
                entry["ms_median"] = {kind: summary(v)["median"] for kind, v in entry["ms"].items()}
                write_result(name, result)
            over = {k: v["median"] for k, v in entry["over_float"].items()}
            print(f"{key}: ms {entry['ms_median']}, over float {over}, score error {errors}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
