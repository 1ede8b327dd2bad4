"""Where one decode step's GPU time goes, kernel by kernel, under Nsight
Compute.

One row decodes op by op, as mlx-lm's loop does, after a prompt of
`--context` tokens, over a cache in the model's dtype (`--kv-bits 0`) or
quantized as a worker's `kv_bits` quantizes it; after warm-up steps the
CUDA profiler is switched on for `--steps` steps and off again, so that
`ncu --profile-from-start off` records those steps' kernels only:

    ncu --profile-from-start off --clock-control none \\
        --metrics gpu__time_duration.sum --print-summary per-kernel \\
        python -m bench.step_kernels --size 8b --kv-bits 8 --context 32768 > ncu-8.txt
    python -m bench.step_kernels --summarize ncu-0.txt ncu-8.txt --steps 3

`--summarize` reads ncu's per-kernel summaries and prints, per step, the
kernels' count, their summed time and the kernels that take the most.
ncu runs each kernel alone (and by default empties the caches before
it), so the sum is the device's work with no overlap and no launch gaps:
compare sums and kernels between settings, not with a step's wall time.
"""

from __future__ import annotations

import argparse
import ctypes
import re
import sys
from pathlib import Path

UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
KERNEL = re.compile(r"  (\S.*?) \(\d+, \d+, \d+\)x\(\d+, \d+, \d+\), Device \d+, CC [\d.]+, Invocations (\d+)")
DURATION = re.compile(r"gpu__time_duration\.sum\s+(\w+)\s+([\d.,]+)\s+([\d.,]+)\s+([\d.,]+)")


def kernels(text: str) -> list[tuple[str, int, float]]:
    """(name, invocations, mean µs) of each kernel in ncu's per-kernel summary."""
    lines = text.split("\n")
    out = []
    for i, line in enumerate(lines):
        if m := KERNEL.match(line):
            for after in lines[i + 1 : i + 10]:
                if t := DURATION.search(after):
                    out.append((re.sub(r"\(.*", "", m.group(1)), int(m.group(2)), float(t.group(4).replace(",", "")) * UNITS[t.group(1)]))
                    break
    return out


def summarize(paths: list[Path], steps: int, top: int) -> None:
    for path in paths:
        rows = sorted(kernels(path.read_text()), key=lambda r: -r[1] * r[2])
        total = sum(n * us for _, n, us in rows)
        print(f"{path.name}: {sum(n for _, n, _ in rows) / steps:.0f} kernels a step, {total / steps / 1000:.2f} ms a step")
        for name, n, us in rows[:top]:
            print(f"  {n * us / steps / 1000:7.3f} ms  {n / steps:6.1f} a step  {us:8.2f} µs each  {name[:90]}")


def profile(args) -> None:
    from worker.runtime.cpu_backend import load_openblas

    load_openblas()
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from bench.common import demo_model
    from bench.long_context import QUESTIONS, chat, load_with_kv, long_text, prefill_but_last, prefill_step
    from worker.text.tokenizer import TextCodec

    path = args.model or demo_model(args.size)
    loaded = load_with_kv(path, args.kv_bits)
    model = loaded.model
    codec = TextCodec(path, loaded.config)
    ids = codec.encode(chat(long_text(codec, args.context), QUESTIONS[0]))
    cache = make_prompt_cache(model)
    prefill_but_last(model, ids, cache, prefill_step())

    def step(y):
        nxt = mx.argmax(model(y.reshape(1, -1), cache=cache)[:, -1, :], axis=-1)
        mx.async_eval(nxt)
        return nxt

    y = step(mx.array(ids[-1:]))
    for _ in range(args.warm):
        y, _ = step(y), y.item()
    mx.synchronize()
    cudart = ctypes.CDLL(args.cudart)
    cudart.cudaProfilerStart()
    for _ in range(args.steps):
        y, _ = step(y), y.item()
    mx.synchronize()
    cudart.cudaProfilerStop()
    print(f"{args.steps} steps profiled at {len(ids)} tokens, kv_bits {args.kv_bits}", file=sys.stderr)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="8b")
    p.add_argument("--model", type=Path)
    p.add_argument("--kv-bits", type=int, choices=(0, 4, 8), default=0)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--warm", type=int, default=12)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--cudart", default="libcudart.so.13", help="the CUDA runtime whose profiler switch to call")
    p.add_argument("--summarize", nargs="+", type=Path, help="ncu outputs to summarize instead of running")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    if args.summarize:
        summarize(args.summarize, args.steps, args.top)
    else:
        profile(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
