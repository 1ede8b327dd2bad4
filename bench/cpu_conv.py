"""A hybrid model's depthwise convolutions on the CPU: mlx's convolution
against sums of shifted slices (worker/runtime/depthwise_conv.py), in one
process.

For each prompt length, the model reads a prompt of that many tokens
(fresh caches, one forward, synced at the end), then takes one decode step
(one token, op by op), once with its gated-delta layers' convolutions as
mlx's `Conv1d` and once as `DepthwiseConv1d`, in an order that flips every
round, after a warm-up of each. Reported per length: milliseconds of each
side (median, min, max over the rounds) and the ratio mlx/slices per round
(above 1: the slices are faster). Results go to
bench/results/cpu-conv-<size>[-tag].json after every round.

    python -m bench.cpu_conv [--size small|0.8b | --model DIR] [--tokens 64,512] [--runs 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small")
    p.add_argument("--model", type=Path, help="a model dir instead of a demo model")
    p.add_argument("--tokens", default="64,512", help="prompt lengths, comma-separated (default %(default)s)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--tag", default="")
    args = p.parse_args()

    from bench.common import backend, load_average, load_model, machine, summary, tagged, write_result

    if backend() != "cpu":
        p.error("this compares two CPU paths; MLX computes on a GPU here")
    path, loaded, _ = load_model(args.model or args.size)
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.cache import make_prompt_cache

    from worker.runtime.depthwise_conv import DepthwiseConv1d

    model = loaded.model
    convs = [m for _, m in model.named_modules() if type(m) is DepthwiseConv1d]
    if not convs:
        print("this model has no depthwise convolutions", file=sys.stderr)
        return 2
    sides = {"mlx conv": nn.Conv1d, "slices": DepthwiseConv1d}

    def run(side: str, tokens: int) -> tuple[float, float]:
        for m in convs:
            m.__class__ = sides[side]
        prompt = mx.array([[5 + (i * 7) % 500 for i in range(tokens)]], dtype=mx.uint32)
        cache = make_prompt_cache(model)
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(model(prompt, cache=cache)[:, -1], [c.state for c in cache])
        t1 = time.perf_counter()
        mx.eval(model(prompt[:, -1:], cache=cache)[:, -1])
        t2 = time.perf_counter()
        return (t1 - t0) * 1000, (t2 - t1) * 1000

    size = path.name if args.model else args.size
    result = {"size": size, "convolutions": len(convs), "machine": machine(), "tokens": {}}
    name = tagged(f"cpu-conv-{size}", args.tag)
    try:
        for tokens in [int(x) for x in args.tokens.split(",")]:
            entry = result["tokens"].setdefault(str(tokens), {"rounds": []})
            for side in sides:
                run(side, tokens)  # warm-up
            for r in range(args.runs):
                order = list(sides) if r % 2 == 0 else list(reversed(sides))
                got = {side: [round(x, 2) for x in run(side, tokens)] for side in order}
                got["prompt_ratio"] = round(got["mlx conv"][0] / got["slices"][0], 3)
                got["step_ratio"] = round(got["mlx conv"][1] / got["slices"][1], 3)
                entry["rounds"].append(got)
                for part, i in (("prompt", 0), ("step", 1)):
                    entry[f"{part}_ms"] = {side: summary([x[side][i] for x in entry["rounds"]], 1) for side in sides}
                    entry[f"{part}_ratio"] = summary([x[f"{part}_ratio"] for x in entry["rounds"]])
                result["load_average"] = load_average()
                write_result(name, result)
                print(f"{tokens} tokens, round {r + 1}: {got}", flush=True)
            print(f"{tokens} tokens: prompt mlx/slices {entry['prompt_ratio']}, decode step {entry['step_ratio']}")
    finally:
        for m in convs:
            m.__class__ = DepthwiseConv1d
    return 0


if __name__ == "__main__":
    sys.exit(main())
