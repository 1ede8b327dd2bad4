"""A CPU worker's start with and without mlx's compiled kernels on disk.

On Linux mlx compiles the fused kernels of compiled graphs with the system's
C++ compiler the first time it meets them, and keeps them on disk; workers
keep them in the user's cache dir (`LATTICE_CPU_KERNELS` overrides), where
mlx's default, the temp dir, is often emptied at boot. Each round starts a
worker of the demo model three times, the order rotating: with an empty
kernel directory (a machine's first start, or the first after /tmp was
emptied), the same without the precompiled header workers build for those
kernels (worker/runtime/kernel_header.py; LATTICE_CPU_KERNEL_HEADER=off),
and with the directory an earlier start filled. Reported per side: seconds
from the process' start to `ready` (the load and warm-up, which traces the
decode step for every batch size) and to its first request's last token
(greedy, 16 tokens). Results: bench/results/kernel-cache-<backend>-<size>[-tag].json
after every round.

    python -m bench.kernel_cache [--size tiny] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "<|im_start|>user\nTell me about the river and the mill.<|im_end|>\n<|im_start|>assistant\n"


SIDES = ("empty", "empty_no_header", "filled")


def start(model: Path, kernels: Path, header: bool = True) -> dict:
    from harness.worker import WorkerProc
    from worker.runtime.kernel_cache import CPU_ENV
    from worker.runtime.kernel_header import OFF_ENV

    os.environ[CPU_ENV] = str(kernels)  # the worker's environment is this process'
    os.environ[OFF_ENV] = "on" if header else "off"
    t0 = time.monotonic()
    w = WorkerProc.started(model)
    try:
        ready = time.monotonic() - t0
        w.generate(prompt=PROMPT, max_tokens=16, temperature=0.0)
        return {"ready_s": round(ready, 2), "first_request_s": round(time.monotonic() - t0, 2)}
    finally:
        w.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="tiny")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tag", default="")
    args = p.parse_args()
    if sys.platform != "linux":
        print("mlx compiles CPU kernels with a C++ compiler on Linux only", file=sys.stderr)
        return 2

    from bench.common import backend, demo_model, load_average, machine, summary, tagged, write_result

    model = demo_model(args.size)
    name = tagged(f"kernel-cache-{backend()}-{args.size}", args.tag)
    result: dict = {"machine": machine(), "size": args.size, "rounds": []}
    with tempfile.TemporaryDirectory(prefix="lattice-kernels-") as root:
        filled = Path(root) / "filled"
        start(model, filled)  # fills it
        for r in range(args.rounds):
            row = {}
            for side in SIDES[r % 3 :] + SIDES[: r % 3]:
                directory = filled if side == "filled" else Path(root) / f"{side}-{r}"
                row[side] = start(model, directory, header=side != "empty_no_header")
                if directory != filled:
                    shutil.rmtree(directory)
            row["load_average"] = load_average()
            result["rounds"].append(row)
            for key in ("ready_s", "first_request_s"):
                result[key] = {side: summary([x[side][key] for x in result["rounds"]]) for side in SIDES}
            write_result(name, result)
            print(f"round {r}: {row}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
