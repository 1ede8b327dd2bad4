"""Prefill tok/s: the chunked gated-delta prefill vs mlx-lm's sequential loop.

One process, one loaded model (the worker's loader: float32 + OpenBLAS on CPU,
weights as stored on a GPU), one forward pass over T prompt tokens as
mlx-lm's generate_step does it (a single chunk up to 2048 tokens), with each
implementation in turn; plus the gated-delta call alone at the model's shape.

    python -m bench.prefill [--size small|0.8b] [--lengths 512,2048] [--runs 3]

With `--chunks 64,128,...` it measures instead how the worker's chunk size
(`--prefill-step`) trades prefill throughput against the longest chunk,
the time running requests wait while a prompt is read: the first length,
read in chunks of each size with the chunked gated-delta prefill
(`--tag chunks` keeps the other results file).
"""

from __future__ import annotations

import argparse
import sys
import time

from bench.common import load_average, load_model, machine, median, tagged, write_result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small")
    p.add_argument("--lengths", default="512,2048")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--chunks", help="comma-separated chunk sizes: the chunk-size sweep instead")
    p.add_argument("--tag", default="", help="suffix for the results file name")
    args = p.parse_args()

    model_dir, loaded, _ = load_model(args.size)
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models import gated_delta as mlx_lm_gdn
    from mlx_lm.models.cache import make_prompt_cache

    from worker.runtime import gated_delta

    model = loaded.model
    backend = "metal" if mx.metal.is_available() else ("cuda" if mx.cuda.is_available() else "cpu")
    users = [m for m in list(sys.modules.values()) if getattr(m, "gated_delta_update", None) is gated_delta.gated_delta_update]
    impls = {"mlx_lm_sequential": mlx_lm_gdn.gated_delta_update, "chunked": gated_delta.gated_delta_update}
    vocab = min(loaded.config["text_config"]["vocab_size"], 700)
    tc = loaded.config["text_config"]
    rng = np.random.default_rng(0)
    load_before = load_average()
    rows = []

    def timed(fn) -> float:
        fn()  # warm-up: kernels compile here
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return median(times) * 1000

    if args.chunks:
        return chunk_sweep(args, model, vocab, backend, rng, load_before)
    for T in [int(x) for x in args.lengths.split(",")]:
        ids = mx.array(rng.integers(0, vocab, T), dtype=mx.uint32)[None]
        Hk, Hv, Dk, Dv = tc["linear_num_key_heads"], tc["linear_num_value_heads"], tc["linear_key_head_dim"], tc["linear_value_head_dim"]
        dtype = model.language_model.model.embed_tokens.weight.dtype
        q, k = mlx_lm_gdn.normalize_qk(mx.random.normal((1, T, Hk, Dk)), mx.random.normal((1, T, Hk, Dk)), inv_scale=Dk**-0.5, eps=1e-6)
        v = mx.random.normal((1, T, Hv, Dv))
        a, b = mx.random.normal((1, T, Hv)), mx.random.normal((1, T, Hv))
        A_log, dt_bias = mx.log(mx.random.uniform(1, 16, (Hv,))), mx.ones((Hv,))
        q, k, v, a, b = (x.astype(dtype) for x in (q, k, v, a, b))
        mx.eval(q, k, v, a, b, A_log, dt_bias)
        row = {"tokens": T}
        for name, fn in impls.items():
            for m in users:
                m.gated_delta_update = fn

            def forward():
                cache = make_prompt_cache(model)
                logits = model(ids, cache=cache)
                mx.eval(logits, [c.state for c in cache])

            def op_alone():
                mx.eval(fn(q, k, v, a, b, A_log, dt_bias))

            ms = timed(forward)
            row[name] = {"prefill_ms": round(ms, 1), "tok_s": round(T / ms * 1000, 1), "gated_delta_ms": round(timed(op_alone), 2)}
            print(f"T={T} {name}: {row[name]}", file=sys.stderr, flush=True)
        row["speedup"] = round(row["mlx_lm_sequential"]["prefill_ms"] / row["chunked"]["prefill_ms"], 2)
        row["gated_delta_speedup"] = round(row["mlx_lm_sequential"]["gated_delta_ms"] / row["chunked"]["gated_delta_ms"], 2)
        rows.append(row)
    for m in users:
        m.gated_delta_update = gated_delta.gated_delta_update

    result = {
        "size": args.size,
        "backend": backend,
        "dtype": str(dtype),
        "runs": args.runs,
        "rows": rows,
        "machine": machine(),
        "load_average": {"before": load_before, "after": load_average()},
    }
    write_result(tagged(f"prefill-{backend}-{args.size}", args.tag), result)
    print(f"{'tokens':>7}{'mlx-lm ms':>12}{'chunked ms':>12}{'speedup':>9}{'chunked tok/s':>15}{'GDN op ms seq/chunk':>22}")
    for r in rows:
        s, c = r["mlx_lm_sequential"], r["chunked"]
        print(
            f"{r['tokens']:>7}{s['prefill_ms']:>12}{c['prefill_ms']:>12}{r['speedup']:>9}{c['tok_s']:>15}"
            f"{str(s['gated_delta_ms']) + ' / ' + str(c['gated_delta_ms']):>22}"
        )
    return 0


def chunk_sweep(args, model, vocab: int, backend: str, rng, load_before) -> int:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    T = int(args.lengths.split(",")[0])
    ids = mx.array(rng.integers(0, vocab, T), dtype=mx.uint32)[None]
    sizes = [int(x) for x in args.chunks.split(",")]

    def read(step: int) -> tuple[float, float]:
        cache = make_prompt_cache(model)
        longest = 0.0
        t0 = time.perf_counter()
        for start in range(0, T, step):
            c0 = time.perf_counter()
            model(ids[:, start : start + step], cache=cache)
            mx.eval([c.state for c in cache])
            longest = max(longest, time.perf_counter() - c0)
        return time.perf_counter() - t0, longest

    for step in sizes:
        read(step)  # warm-up: kernels compile here
    runs: dict[int, list[tuple[float, float]]] = {step: [] for step in sizes}
    for _ in range(args.runs):
        for step in sizes:  # alternated, so that noise hits every size
            runs[step].append(read(step))
    rows = [
        {"chunk": step, "tok_s": round(T / median([r[0] for r in runs[step]]), 1), "longest_chunk_ms": round(median([r[1] for r in runs[step]]) * 1000, 1)}
        for step in sizes
    ]
    result = {
        "size": args.size,
        "backend": backend,
        "tokens": T,
        "runs": args.runs,
        "chunks": rows,
        "machine": machine(),
        "load_average": {"before": load_before, "after": load_average()},
    }
    write_result(tagged(f"prefill-{backend}-{args.size}", args.tag), result)
    print(f"{'chunk':>7}{'prefill tok/s':>15}{'longest chunk ms':>18}")
    for r in rows:
        print(f"{r['chunk']:>7}{r['tok_s']:>15}{r['longest_chunk_ms']:>18}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
