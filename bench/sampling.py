"""One sampling step over a real model's vocabulary: the worker's sampler
against mlx-lm's, on the same logits.

    python -m bench.sampling [--rounds 7] [--reps 20] [--vocabs 151936,248320]

Each case is one draw for 1 and 8 rows at temperature 0.7:

- `top_p`: top-p 0.9 alone, as OpenAI's and most chat clients send it;
- `top_k_top_p`: top-k 50 and top-p 0.9 (chat_metal's default sampler);
- `top_k`: top-k 50 alone.

The worker's side is `worker.engine.sampling.BatchSampler` on the logits
(its draw is compiled per kind of row). mlx-lm's is what its
`generate_step` does per token: the log-softmax, then
`make_sampler(temp, top_p, top_k)`. The vocabularies are Qwen3's
(151,936) and Qwen3.5's (248,320).

The logits are made to look like a model's: a power law over ranks (the
k-th likeliest token's logit is -ln k plus noise), shuffled, so that top-p
0.9 keeps about a hundred tokens; the `flat` profile
(Gaussian logits of deviation 1) has a nucleus wider than the worker's
candidates (`NUCLEUS_AT_MOST`), where the worker draws among its 4,096
likeliest tokens. The nucleus sizes are in the results.

Sides alternate, the order turning each round. Results go to
bench/results/sampling-<backend>[-tag].json after every round:
milliseconds a draw (median and range) and ours over mlx-lm's per round.
"""

from __future__ import annotations

import argparse
import sys

CASES = {
    # name: (top_k, top_p)
    "top_p": (0, 0.9),
    "top_k_top_p": (50, 0.9),
    "top_k": (50, 1.0),
}
TEMPERATURE = 0.7


def model_like(rows: int, vocab: int, profile: str, seed: int):
    import numpy as np

    rng = np.random.default_rng(seed)
    if profile == "flat":
        return rng.normal(size=(rows, vocab)).astype(np.float32)
    ranks = np.arange(1, vocab + 1, dtype=np.float64)
    out = np.empty((rows, vocab), dtype=np.float32)
    for r in range(rows):
        out[r] = rng.permutation(-np.log(ranks) + rng.normal(0, 0.3, size=vocab))
    return out


def nucleus_size(logits, top_p: float) -> int:
    """Tokens top-p keeps at the benchmark's temperature, largest row."""
    import numpy as np

    sizes = []
    for row in logits.astype(np.float64) / TEMPERATURE:
        p = np.exp(np.sort(row)[::-1] - row.max())
        p /= p.sum()
        sizes.append(int((np.cumsum(p) - p < top_p).sum()))
    return max(sizes)


def sides_of(logits, top_k: int, top_p: float) -> dict:
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from ipc.sampling import Sampling
    from worker.engine.sampling import BatchSampler, RowSampling

    rows, vocab = logits.shape
    params = Sampling(temperature=TEMPERATURE, top_k=top_k, top_p=top_p, repetition_penalty=1.0, seed=1)
    ours = BatchSampler(vocab)
    ours.extend([RowSampling(params, vocab, []) for _ in range(rows)])
    last = mx.zeros((rows,), dtype=mx.uint32)
    theirs = make_sampler(temp=TEMPERATURE, top_p=top_p if top_p < 1.0 else 0.0, top_k=top_k)

    def mlx_lm():
        return theirs(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    return {"mlx_lm": mlx_lm, "ours": lambda: ours(logits, last)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=20, help="draws a side and round")
    p.add_argument("--vocabs", default="151936,248320")
    p.add_argument("--tag", default="")
    args = p.parse_args()

    from worker.runtime.cpu_backend import load_openblas

    load_openblas()
    import mlx.core as mx

    from bench.common import backend, load_average, machine, summary, tagged, write_result
    from bench.cpu_attention import timed_ms

    cases, nuclei = {}, {}
    for vocab in [int(v) for v in args.vocabs.split(",")]:
        for profile in ("model", "flat"):
            for rows in (1, 8):
                logits_np = model_like(rows, vocab, profile, seed=rows)
                logits = mx.array(logits_np)
                for case, (top_k, top_p) in CASES.items():
                    if profile == "flat" and case != "top_p":
                        continue  # top-k bounds the others whatever the profile
                    name = f"{case} {profile} vocab={vocab} rows={rows}"
                    cases[name] = sides_of(logits, top_k, top_p)
                    if top_p < 1.0:
                        nuclei[name] = nucleus_size(logits_np, top_p)
    for sides in cases.values():
        for fn in sides.values():
            mx.eval(fn())
    result = {"machine": machine(), "load_average": {"before": load_average()}, "rounds": args.rounds, "temperature": TEMPERATURE, "nucleus_tokens": nuclei}
    name = tagged(f"sampling-{backend()}", args.tag)
    runs = {case: {"mlx_lm": [], "ours": []} for case in cases}
    for r in range(args.rounds):
        for case, sides in cases.items():
            for side in ("mlx_lm", "ours") if r % 2 == 0 else ("ours", "mlx_lm"):
                runs[case][side].append(timed_ms(sides[side], args.reps))
        result["cases"] = {
            case: {
                "ms": {side: summary(v) for side, v in t.items()},
                "ours_over_mlx_lm": summary([o / m for o, m in zip(t["ours"], t["mlx_lm"])]),
            }
            for case, t in runs.items()
        }
        result["load_average"]["after"] = load_average()
        write_result(name, result)
        print(f"round {r}: " + "; ".join(f"{c} {t['ours'][-1]:.2f}/{t['mlx_lm'][-1]:.2f} ms" for c, t in runs.items()), file=sys.stderr)
    for case, row in result["cases"].items():
        ratio = row["ours_over_mlx_lm"]
        print(
            f"  {case:42} ours {row['ms']['ours']['median']:8.2f} ms, mlx-lm {row['ms']['mlx_lm']['median']:8.2f} ms, ours / mlx-lm {ratio['median']:.3f} ({ratio['min']}-{ratio['max']})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
