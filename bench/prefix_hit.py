"""A prefix-cache memory hit's first token, in one process: the worker's
scheduler with its prefix cache in memory only, with the disk tier writing
every snapshot as an agent's loop does, with that disk tier reading the
memory tier's own arrays (`moved`: what it did before it wrote copies on a
GPU), and mlx-lm with a prompt cache (a deep copy of the prefix's cache,
then `stream_generate`, as its server resumes a prompt).

Each round asks every side a new short question on the same long prefix
(`--tokens` of tool definitions), the order rotating; before each question
the disk sides have written the snapshots of the one before. On CUDA,
reading an array on the host moves it into managed memory, which the
`moved` side shows; on a CPU or Apple silicon the disk sides should match
the memory side.

    python -m bench.prefix_hit [--size tiny] [--tokens 26000] [--rounds 5]
    python -m bench.prefix_hit --size 8b --rounds 5   # on a GPU
"""

from __future__ import annotations

import argparse
import copy
import shutil
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="tiny")
    p.add_argument("--tokens", type=int, default=26000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cache-gib", type=float, default=8.0, help="each side's prefix cache (default 8 GiB)")
    p.add_argument("--tag", default="")
    args = p.parse_args()

    from bench.common import backend, first_line_ms, load_average, load_model, machine, summary, tagged, write_result

    path, loaded, codec = load_model(args.size)
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from bench.long_context import QUESTIONS, chat, long_text, prefill_but_last
    from ipc.messages import Generate
    from worker.cache.prefix_disk import PrefixDisk
    from worker.engine.scheduler import Scheduler

    system = long_text(codec, args.tokens)
    cache_bytes = int(args.cache_gib * (1 << 30))
    first: list[float] = []
    disks: dict[str, PrefixDisk] = {}

    def scheduler(disk: PrefixDisk | None) -> Scheduler:
        s = Scheduler(
            loaded,
            codec,
            lambda data: first.append(time.perf_counter()),
            batch_memory=cache_bytes,
            prefix_cache_bytes=cache_bytes,
            max_batch=8,
            prefix_disk=disk,
        )
        s.warm_up()
        return s

    # Each disk side keeps 16 GiB of files at most (an 8B snapshot of 26k
    # tokens is 3.8 GB; the oldest go), in a folder removed at the end.
    root = Path(tempfile.mkdtemp(prefix="lattice-bench-prefix-hit-"))
    on_gpu = backend() == "cuda"
    for name, on_device in (("disk", on_gpu), ("moved", False)):
        disks[name] = PrefixDisk(root / name, "model", budget=16 << 30, max_pending_bytes=cache_bytes, on_device=on_device)
    schedulers = {"memory": scheduler(None), "disk": scheduler(disks["disk"]), "moved": scheduler(disks["moved"])}
    rid = 0

    def ours(name: str, question: str) -> float:
        nonlocal rid
        rid += 1
        ttft = first_line_ms(schedulers[name], first, Generate(rid=rid, prompt=chat(system, question), max_tokens=2, temperature=0.0, repetition_penalty=1.0))
        if name in disks and not disks[name].flush(120):
            raise SystemExit(f"{name}: the disk did not take the snapshots in 120 s")
        return ttft

    tokenizer = load_tokenizer(loaded.path)
    prefix = codec.encode(chat(system, "")[: -len("<|im_end|>\n<|im_start|>assistant\n")])
    held = make_prompt_cache(loaded.model)
    prefill_but_last(loaded.model, prefix, held, 2048)

    def theirs(question: str) -> float:
        ids = codec.encode(chat(system, question))
        t0 = time.perf_counter()
        c = copy.deepcopy(held)
        stream = stream_generate(loaded.model, tokenizer, mx.array(ids[len(prefix) - 1 :]), prompt_cache=c, max_tokens=1)
        try:
            next(stream)
            return (time.perf_counter() - t0) * 1000
        finally:
            stream.close()

    sides = {"memory": lambda q: ours("memory", q), "disk": lambda q: ours("disk", q), "moved": lambda q: ours("moved", q), "mlx_lm": theirs}
    cold = {name: round(ours(name, QUESTIONS[0]), 1) for name in schedulers}
    print(f"cold: {cold}", flush=True)
    load_before = load_average()
    runs: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            runs[name].append(sides[name](f"({r}, {name}) {QUESTIONS[(r + 1) % len(QUESTIONS)]}"))
        result = {
            "size": args.size,
            "prefix_tokens": len(prefix),
            "cold_ms": cold,
            "first_token_ms": {name: summary(v, 1) for name, v in runs.items()},
            "runs_ms": {name: [round(x, 1) for x in v] for name, v in runs.items()},
            "over_memory": {name: summary([x / m for x, m in zip(v, runs["memory"])]) for name, v in runs.items() if name != "memory"},
            "copies_written": on_gpu,
            "machine": machine(),
            "load_average": {"before": load_before, "after": load_average()},
        }
        write_result(tagged(f"prefix-hit-{backend()}-{args.size}", args.tag), result)
        print(f"round {r}: " + ", ".join(f"{n} {runs[n][-1]:.1f} ms" for n in names), flush=True)
    for name, s in result["first_token_ms"].items():
        print(f"{name:8} {s['median']:8.1f} ms ({s['min']}-{s['max']})")
    print("per round, over memory: " + ", ".join(f"{n} {s['median']}" for n, s in result["over_memory"].items()))
    for disk in disks.values():
        disk.flush(120)
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
