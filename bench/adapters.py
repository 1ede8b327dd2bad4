"""Many adapters on one worker against one worker per adapter,
in one run, at the worker level (worker processes driven over their pipes).

1. Memory: a worker with no adapter; one worker with `--adapters` adapters
   loaded; and the old layout, one worker per adapter (each loads its
   one adapter for the batch's requests, which name it); each
   after the same batch of one row per adapter (mixed in the one worker). RSS and MLX active
   memory from each worker's own `worker_stats`. Goal: the one worker
   <= (the base alone + the adapters' bytes) x 1.10.
2. Throughput, in the one worker: 8 concurrent greedy requests spread over
   the adapters vs 8 on one adapter (and 8 on none), alternated over
   `--rounds` rounds; aggregate tok/s = generated tokens / time to the last
   final line. Goal: spread >= 0.8 x one adapter.
3. Through the pool (`lattice-pool serve`): one [[models]] name per
   adapter, all on the same base model, served by one worker (docs/adapters.md)
   vs the old layout, one worker per name (made here by giving each entry
   its own max_adapters, which gives it its own worker); each after the
   same batch of one row per name. RSS and MLX active memory summed over
   the workers from the `status` op, one row per worker.
4. Kernels, in this process: one linear layer of the model's MLP shape,
   a batch of rows each with its own adapter, computed four ways (what the
   worker does, `mx.gather_mm` on stacked adapters; gathering A and B per
   row then batched matmuls; a loop over the adapters; ranks grouped
   instead of padded), against the base layer alone and one adapter.

    python -m bench.adapters [--size small|0.8b] [--model DIR] [--adapters 4] [--rank 16] [--max-tokens 128] [--rounds 3]

Adapters are seeded PEFT files on every linear layer of the decoder
(bench.lora.write_adapter). Prefix caches are off (the prompts repeat).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path


def memory_of(client) -> dict:
    from ipc.messages import Stats

    stats = client.ask(Stats())
    return {k: stats[k] for k in ("rss_bytes", "mlx_active_bytes", "mlx_cache_bytes", "weights_bytes", "adapter_bytes")}


def worker(model: Path, *args: str):
    from harness.worker import WorkerProc

    return WorkerProc.started(model, "--prefix-cache-bytes", "0", "--max-batch", "8", *args)


def requests(prompts: list[str], loras: list, max_tokens: int) -> list[dict]:
    return [dict(prompt=p, lora=lora, max_tokens=max_tokens, temperature=0.0, repetition_penalty=1.0) for p, lora in zip(prompts, loras)]


def measure_memory(model: Path, adapters: list[str], prompts: list[str]) -> tuple[dict, dict, list[int]]:
    """The three layouts' memory, and the ms each adapter load took."""
    from ipc.messages import LoadAdapter

    # Every layout runs the same batch (one row per adapter) before it is measured.
    rows = prompts[: len(adapters)]
    stages: dict[str, dict] = {}
    base = worker(model)
    try:
        stages["base_ready"] = memory_of(base)
        base.generate_many(requests(rows, [None] * len(rows), 16))
        alone = memory_of(base)
    finally:
        base.close()
    separate = []
    for path in adapters:
        one = worker(model)
        try:
            one.generate_many(requests(rows, [path] * len(rows), 16))
            separate.append(memory_of(one))
        finally:
            one.close()
    shared = worker(model)
    stages["one_worker_ready"] = memory_of(shared)
    load_ms = []
    for i, path in enumerate(adapters):
        event = shared.ask(LoadAdapter(path=path))
        assert event["ev"] == "adapter_loaded", event
        load_ms.append(event["ms"])
        stages[f"one_worker_{i + 1}_loaded"] = memory_of(shared)
    shared.generate_many(requests(rows, [adapters[0]] * len(rows), 16))
    stages["one_worker_after_one_adapter_batch"] = memory_of(shared)
    shared.generate_many(requests(rows, adapters, 16))
    together = memory_of(shared)
    shared.close()
    # Where a worker's memory grows: after start, after each adapter load,
    # after a batch on one adapter, after the mixed batch.
    stages["one_worker_after_mixed_batch"] = together
    return {"base_alone": alone, "one_worker": together, "worker_per_adapter": separate, "stages": stages}, together, load_ms


def pool_memory(model: Path, adapters: list[str], prompts: list[str], tmp: Path) -> dict:
    """Memory of one name per adapter through `serve`: one shared worker vs
    one worker per name."""
    from harness.pool import PoolProc

    out = {}
    for layout in ("one_worker", "worker_per_name"):
        text = "prefix_cache_bytes = 0\ncontrol_socket = false\n"
        for i, path in enumerate(adapters):
            text += f'[[models]]\nname = "a{i}"\npath = "{model}"\nlora = "{path}"\npreload = true\n'
            if layout == "worker_per_name":
                text += f"max_adapters = {i + 1}\n"  # a worker key of its own
        config = tmp / f"{layout}.toml"
        config.write_text(text)
        pool = PoolProc("--config", str(config))
        try:
            for i in range(len(adapters)):
                pool.wait_ev("ready", model=f"a{i}", timeout=600)
            rows = [
                dict(model=f"a{i}", id=f"{layout}-{i}", prompt=p, max_tokens=16, temperature=0.0, repetition_penalty=1.0)
                for i, p in enumerate(prompts[: len(adapters)])
            ]
            pool.generate_many(rows)
            pool.send({"op": "status"})
            status = pool.wait_ev("status")["models"]
            workers = {row["worker"]: row for row in status}.values()
            out[layout] = {
                "names": len(status),
                "workers": len(workers),
                "rss_bytes": sum(w["rss_bytes"] for w in workers),
                "mlx_active_bytes": sum(w["mlx_active_bytes"] for w in workers),
                "adapter_bytes": sum(row["adapter_bytes"] for row in status),
            }
            assert pool.close() == 0
        finally:
            pool.kill()
    for key in ("rss_bytes", "mlx_active_bytes"):
        out[f"{key}_ratio"] = round(out["one_worker"][key] / out["worker_per_name"][key], 3)
    return out


def throughput(model: Path, adapters: list[str], prompts: list[str], max_tokens: int, rounds: int) -> dict:
    from ipc.messages import LoadAdapter

    n = len(prompts)
    sides = {
        "spread": [adapters[i % len(adapters)] for i in range(n)],
        "one_adapter": [adapters[0]] * n,
        "no_adapter": [None] * n,
    }
    client = worker(model)
    try:
        for path in adapters:
            assert client.ask(LoadAdapter(path=path))["ev"] == "adapter_loaded"
        for loras in sides.values():  # kernels compile before the figures
            client.generate_many(requests(prompts, loras, 8))
        runs: dict[str, list[float]] = {name: [] for name in sides}
        # Sides alternate, so a busy spell on a shared machine hits all of them.
        for _ in range(rounds):
            for name, loras in sides.items():
                run = client.generate_many(requests(prompts, loras, max_tokens))
                runs[name].append(run["tokens"] / run["wall_s"])
    finally:
        client.close()
    ratios = [s / o for s, o in zip(runs["spread"], runs["one_adapter"])]
    return {
        "aggregate_tok_s": {name: [round(x, 1) for x in values] for name, values in runs.items()},
        "median_tok_s": {name: round(statistics.median(values), 1) for name, values in runs.items()},
        "spread_over_one_adapter_per_round": [round(r, 3) for r in ratios],
        "spread_over_one_adapter": round(statistics.median(ratios), 3),
        "one_adapter_over_none": round(statistics.median(o / b for o, b in zip(runs["one_adapter"], runs["no_adapter"])), 3),
    }


def kernels(d_in: int, d_out: int, rank: int, n_adapters: int, dtype, repeats: int = 5) -> dict:
    """Microseconds per call of each way to add each row's adapter delta to
    one linear layer, for a decode batch (8 rows, 1 token) and a prefill
    group (4 rows, 64 tokens); ranks mixed (half the adapters at rank/2)
    for the padded-vs-grouped comparison."""
    import mlx.core as mx
    import numpy as np

    mx.random.seed(0)
    w = (mx.random.normal((d_out, d_in)) * 0.02).astype(dtype)
    a = (mx.random.normal((n_adapters, d_in, rank)) * d_in**-0.5).astype(dtype)
    b = (mx.random.normal((n_adapters, rank, d_out)) * 0.02).astype(dtype)
    low = rank // 2  # adapters with an odd index have this rank
    a_low, b_low = a[1::2, :, :low], b[1::2, :low, :]
    a_high, b_high = a[0::2], b[0::2]
    mx.eval(w, a, b, a_low, b_low, a_high, b_high)
    out = {}
    for shape_name, (rows, length) in {"decode_8x1": (8, 1), "prefill_4x64": (4, 64)}.items():
        x = mx.random.normal((rows, length, d_in)).astype(dtype)
        which = [i % n_adapters for i in range(rows)]
        index = mx.array(which, dtype=mx.uint32)
        groups = [(k, mx.array([i for i, s in enumerate(which) if s == k])) for k in sorted(set(which))]
        order = mx.array(np.argsort(np.concatenate([np.flatnonzero(np.array(which) == k) for k, _ in groups])))
        high = [i for i, s in enumerate(which) if s % 2 == 0]
        lowr = [i for i, s in enumerate(which) if s % 2 == 1]
        high_rows, low_rows = mx.array(high), mx.array(lowr)
        high_idx = mx.array([which[i] // 2 for i in high], dtype=mx.uint32)
        low_idx = mx.array([which[i] // 2 for i in lowr], dtype=mx.uint32)
        by_rank = mx.array(np.argsort(np.array(high + lowr)))
        a1, b1 = a[0:1].squeeze(0), b[0:1].squeeze(0)
        mx.eval(x, index, order, high_rows, low_rows, high_idx, low_idx, by_rank, a1, b1, *[g for _, g in groups])

        def base():
            return x @ w.T

        def one_adapter():
            return x @ w.T + (x @ a1) @ b1

        def gather_mm():  # what the worker does
            return x @ w.T + mx.gather_mm(mx.gather_mm(x, a, rhs_indices=index), b, rhs_indices=index)

        def gather_then_matmul():
            return x @ w.T + (x @ a[index]) @ b[index]

        def loop_over_adapters():
            parts = [(x[rows_k] @ a[k]) @ b[k] for k, rows_k in groups]
            return x @ w.T + mx.concatenate(parts)[order]

        def grouped_by_rank():
            hi = mx.gather_mm(mx.gather_mm(x[high_rows], a_high, rhs_indices=high_idx), b_high, rhs_indices=high_idx)
            lo = mx.gather_mm(mx.gather_mm(x[low_rows], a_low, rhs_indices=low_idx), b_low, rhs_indices=low_idx)
            return x @ w.T + mx.concatenate([hi, lo])[by_rank]

        ways = {f.__name__: f for f in (base, one_adapter, gather_mm, gather_then_matmul, loop_over_adapters, grouped_by_rank)}
        times: dict[str, list[float]] = {name: [] for name in ways}
        for f in ways.values():
            for _ in range(5):
                mx.eval(f())
        for _ in range(repeats):
            for name, f in ways.items():
                n = 50
                t0 = time.perf_counter()
                for _ in range(n):
                    mx.eval(f())
                times[name].append((time.perf_counter() - t0) / n * 1e6)
        out[shape_name] = {name: round(statistics.median(v), 1) for name, v in times.items()}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", help="demo model size to build and use (default small)")
    p.add_argument("--model", type=Path, help="a model dir instead of a demo model")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--requests", type=int, default=8, help="concurrent requests (default 8)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tag", default="", help="suffix for the results file name")
    args = p.parse_args()

    from bench.common import backend, load_average, load_model, machine, tagged, write_result

    model, loaded, _ = load_model(args.model or args.size)  # before mlx, for the in-process kernel figures
    from tokenizers import Tokenizer

    from bench.chat import user_messages
    from bench.lora import write_adapter
    from worker.lora.layers import LoRASlots, linear_dims

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    prompts = [f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n" for text in user_messages(tokenizer, args.requests, 24)]
    result = {
        "model": str(model),
        "size": None if args.model else args.size,
        "backend": backend(),
        "machine": machine(),
        "load_average": {"before": load_average()},
    }
    result["complete"] = False
    name = tagged(f"adapters-{result['backend']}-{args.size if not args.model else model.name}", args.tag)
    # The layer the kernels are timed on, in the dtype the worker computes in.
    d_in, d_out, dtype = linear_dims(loaded.model.layers[0].mlp.up_proj)
    targets = dict(LoRASlots(loaded.model).targets)
    del loaded
    with tempfile.TemporaryDirectory(prefix="lattice-bench-adapters-") as tmp:
        adapters = []
        for i in range(args.adapters):
            modules = write_adapter(targets, Path(tmp) / f"adapter-{i}", args.rank, seed=i)
            adapters.append(str(Path(tmp) / f"adapter-{i}"))
        # Each part is written as it ends ("complete": false until the
        # last), so that a later failure keeps it.
        memory, shared, load_ms = measure_memory(model, adapters, prompts)
        result.update(memory=memory, one_worker_memory=shared)
        write_result(name, result)
        result["pool_memory"] = through_pool = pool_memory(model, adapters, prompts, Path(tmp))
        write_result(name, result)
        speed = throughput(model, adapters, prompts, args.max_tokens, args.rounds)
    kernel_us = kernels(d_in, d_out, args.rank, args.adapters, dtype)

    base = memory["base_alone"]
    adapter_bytes = shared["adapter_bytes"]
    per = memory["worker_per_adapter"]
    goals = {}
    for key in ("rss_bytes", "mlx_active_bytes"):
        allowed = base[key] + adapter_bytes
        goals[key] = {
            "one_worker": shared[key],
            "base_alone_plus_adapter_bytes": allowed,
            "ratio": round(shared[key] / allowed, 3),
            "worker_per_adapter_total": sum(m[key] for m in per),
            "one_worker_over_worker_per_adapter": round(shared[key] / sum(m[key] for m in per), 3),
        }
    result.update(
        adapters={"count": args.adapters, "rank": args.rank, "modules": modules, "adapter_bytes_total": adapter_bytes, "load_ms": load_ms},
        memory=memory,
        memory_goal=goals,
        pool_memory=through_pool,
        throughput={"requests": args.requests, "max_tokens": args.max_tokens, "rounds": args.rounds, **speed},
        kernels_us={"layer": {"d_in": d_in, "d_out": d_out, "dtype": str(dtype)}, **kernel_us},
    )
    result["load_average"]["after"] = load_average()
    result["complete"] = True
    write_result(name, result)

    mib = 1 / 2**20
    print(f"{args.adapters} adapters of rank {args.rank} on {modules} layers: {adapter_bytes * mib:.1f} MiB; loads {load_ms} ms")
    for key, g in goals.items():
        print(
            f"{key}: one worker {g['one_worker'] * mib:.0f} MiB vs base + adapters {g['base_alone_plus_adapter_bytes'] * mib:.0f} MiB "
            f"(ratio {g['ratio']}, goal <= 1.10); a worker per adapter: {g['worker_per_adapter_total'] * mib:.0f} MiB"
        )
    for stage, m in memory["stages"].items():
        print(f"  {stage:40} RSS {m['rss_bytes'] * mib:8.0f} MiB  MLX active {m['mlx_active_bytes'] * mib:8.0f}  cache {m['mlx_cache_bytes'] * mib:8.0f}")
    for layout in ("one_worker", "worker_per_name"):
        m = through_pool[layout]
        print(
            f"through serve, {m['names']} names on {m['workers']} worker(s): RSS {m['rss_bytes'] * mib:.0f} MiB, MLX active {m['mlx_active_bytes'] * mib:.0f} MiB"
        )
    print(f"one worker / worker per name: RSS {through_pool['rss_bytes_ratio']}, MLX active {through_pool['mlx_active_bytes_ratio']}")
    t = speed["median_tok_s"]
    print(
        f"8 requests: spread over {args.adapters} adapters {t['spread']} tok/s, one adapter {t['one_adapter']}, none {t['no_adapter']}; "
        f"spread / one adapter {speed['spread_over_one_adapter']} (goal >= 0.8)"
    )
    for shape, us in kernel_us.items():
        print(f"kernels {shape} (us): " + ", ".join(f"{k} {v}" for k, v in us.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
