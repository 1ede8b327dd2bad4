"""Recovery figures: kill -9 of a worker -> `ready` again, against the
worker's plain load time in the same run; how fast workers follow a
SIGKILLed supervisor; and a chaos run against the same requests undisturbed.

    python -m bench.restart [--rounds 5] [--requests 300] [--kills 6]

Real workers on demo models built with the real `demo-model` command:
- plain load: `python -m worker` spawned directly, spawn -> `ready` line;
- kill -9: a fresh `lattice-pool serve` per round (so every kill is a first
  crash, which restarts at once: the backoff the pool reports must be 0),
  SIGKILL of its worker -> `restarting` (detection) -> `ready` (recovered),
  and that minus the plain load of the same round (goal: <= 150 ms);
- orphans: SIGKILL of the supervisor -> its worker gone (polled every ms);
- chaos: `--requests` short requests over two models, undisturbed and then
  with `--kills` SIGKILLs at seeded points; wall time, outcomes, latency.
Writes bench/results/restart.json.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import NOISY, machine, percentile, summary, write  # noqa: E402
from harness.pool import PoolProc, is_terminal  # noqa: E402
from harness.procs import build_demo_model  # noqa: E402
from harness.worker import WorkerProc  # noqa: E402

CHAT = "<|im_start|>user\nTell me about the river.<|im_end|>\n<|im_start|>assistant\n"


def config(tmp: Path, models: dict[str, Path]) -> str:
    path = tmp / f"pool-{len(models)}.toml"
    path.write_text("".join(f'[[models]]\nname = "{n}"\npath = "{p}"\npreload = true\n\n' for n, p in models.items()))
    return str(path)


def worker_pids(pool: PoolProc) -> dict[str, int | None]:
    pool.send({"op": "status"})
    return {row["model"]: row["pid"] for row in pool.wait_ev("status")["models"]}


def plain_load(model: Path) -> tuple[float, int]:
    """(spawn -> ready wall ms, the worker's own load_ms)."""
    t0 = time.monotonic()
    w = WorkerProc(model)
    try:
        ready = w.wait_ready()
        return (time.monotonic() - t0) * 1000, ready["load_ms"]
    finally:
        w.close()


def kill_to_ready(cfg: str) -> dict:
    pool = PoolProc("--config", cfg)
    try:
        pool.wait_ev("ready", model="a")
        pid = worker_pids(pool)["a"]
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        restarting = pool.wait_ev("restarting", model="a")
        ready = pool.wait_ev("ready", model="a")
        assert pool.close() == 0
    finally:
        pool.kill()
    total = (ready["_at"] - t0) * 1000
    return {
        "detect_ms": (restarting["_at"] - t0) * 1000,
        "delay_ms": restarting["delay_s"] * 1000,
        "kill_to_ready_ms": total,
        "kill_to_ready_without_delay_ms": total - restarting["delay_s"] * 1000,
    }


def orphan_gone(cfg: str) -> float:
    """ms from SIGKILL of the supervisor until its worker is gone."""
    pool = PoolProc("--config", cfg)
    try:
        pool.wait_ev("ready", model="a")
        worker = psutil.Process(worker_pids(pool)["a"])
        t0 = time.monotonic()
        pool.proc.kill()
        while True:
            try:
                if worker.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            if time.monotonic() - t0 > 30:
                raise RuntimeError(f"worker {worker.pid} outlived its supervisor by 30 s")
            time.sleep(0.001)
        return (time.monotonic() - t0) * 1000
    finally:
        pool.kill()


def chaos(cfg: str, requests: int, kills: int, seed: int) -> dict:
    """Short requests over models a and b; SIGKILLs at seeded completion points."""
    rng = random.Random(seed)
    pool = PoolProc("--config", cfg)
    try:
        pool.wait_ev("ready", model="a")
        pool.wait_ev("ready", model="b")
        lengths = [rng.choice([6] * 9 + [80]) for _ in range(requests)]
        sent = {}
        t0 = time.monotonic()
        for i in range(requests):
            sent[i] = time.monotonic()
            pool.send({"model": "ab"[i % 2], "id": i, "prompt": CHAT, "max_tokens": lengths[i], "temperature": 0})
        points = sorted(rng.sample(range(10, requests - 40), kills)) if kills else []
        done_ids: set = set()
        killed: list[tuple[str, float]] = []
        per_model: collections.Counter[str] = collections.Counter()
        for point in points:

            def reached(e: dict) -> bool:
                if is_terminal(e) and "id" in e:
                    done_ids.add(e["id"])
                return len(done_ids) >= point

            pool.wait_for(reached)
            live = {m: p for m, p in worker_pids(pool).items() if p is not None and per_model[m] < (kills + 1) // 2}
            if live:
                victim = rng.choice(sorted(live))
                os.kill(live[victim], signal.SIGKILL)
                killed.append((victim, time.monotonic()))
                per_model[victim] += 1
        ends = [pool.terminal(i, timeout=300) for i in range(requests)]
        wall = max(e["_at"] for e in ends) - t0
        recoveries = []
        for model, at in killed:
            # An idle victim may come back after the last request has ended.
            ready = pool.wait_for(lambda e, m=model, a=at: e["ev"] == "ready" and e.get("model") == m and e["_at"] > a, timeout=300)
            recoveries.append((ready["_at"] - at) * 1000)
        assert pool.close() == 0
    finally:
        pool.kill()
    latency = [(e["_at"] - sent[i]) * 1000 for i, e in enumerate(ends)]
    outcomes = collections.Counter("done" if e["ev"] == "gen_token" else e["code"] for e in ends)
    return {
        "requests": requests,
        "kills": dict(per_model),
        "wall_s": round(wall, 2),
        "requests_per_s": round(requests / wall, 1),
        "outcomes": dict(outcomes),
        "retried_invisibly": pool.stderr.count(b"will be retried after the restart"),
        "restarting_events": sum(1 for e in pool.events if e["ev"] == "restarting"),
        "failed_events": sum(1 for e in pool.events if e["ev"] == "failed"),
        "kill_to_ready_ms": summary(recoveries, 1) if recoveries else None,
        "request_latency_ms": {"p50": round(percentile(latency, 50), 1), "p99": round(percentile(latency, 99), 1), "max": round(max(latency), 1)},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.restart", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="kill and plain-load measurements (default 5)")
    p.add_argument("--requests", type=int, default=300, help="chaos requests (default 300; 0 skips the chaos runs)")
    p.add_argument("--kills", type=int, default=6, help="chaos SIGKILLs, split over two models (default 6)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)

    loads, own_loads, kills, orphans, over_load = [], [], [], [], []
    result: dict = {"note": NOISY, "machine": machine(), "model": "demo tiny (bf16)"}

    def record_rounds() -> None:
        load_ms = summary(loads, 1)
        k = {key: summary([r[key] for r in kills], 1) for key in kills[0]}
        result.update(
            {
                "plain_load_ms": {"spawn_to_ready": load_ms, "worker_reported_load_ms": summary(own_loads, 1)},
                "kill9": k,
                "kill_to_ready_over_plain_load": round(k["kill_to_ready_ms"]["median"] / load_ms["median"], 3),
                "kill_to_ready_minus_plain_load_same_round_ms": summary(over_load, 1),
                "kill_to_ready_without_delay_over_plain_load": round(k["kill_to_ready_without_delay_ms"]["median"] / load_ms["median"], 3),
                "supervisor_sigkill_to_worker_gone_ms": summary(orphans, 1),
            }
        )
        print(
            f"round {len(loads)}: plain load (spawn -> ready) {loads[-1]:.1f} ms; kill -9 -> ready {kills[-1]['kill_to_ready_ms']:.1f} ms "
            f"(detected after {kills[-1]['detect_ms']:.1f} ms, backoff {kills[-1]['delay_ms']:.0f} ms): {over_load[-1]:+.1f} ms over the load",
            flush=True,
        )
        write("restart", result, args.out)

    with tempfile.TemporaryDirectory(prefix="lattice-bench-restart-") as tmp_name:
        tmp = Path(tmp_name)
        models = {}
        for name, seed in (("a", "0"), ("b", "1")):
            models[name] = tmp / name
            build_demo_model(models[name], "--seed", seed)
        one, two = config(tmp, {"a": models["a"]}), config(tmp, models)
        plain_load(models["a"])  # warm the page cache
        for n in range(args.rounds):
            # Sides alternate, so that drift in the machine's load favours neither.
            if n % 2:
                kills.append(kill_to_ready(one))
                wall, own = plain_load(models["a"])
            else:
                wall, own = plain_load(models["a"])
                kills.append(kill_to_ready(one))
            loads.append(wall)
            own_loads.append(own)
            over_load.append(kills[-1]["kill_to_ready_ms"] - wall)
            orphans.append(orphan_gone(one))
            record_rounds()
        if args.requests:
            calm = chaos(two, args.requests, 0, args.seed)
            stormy = chaos(two, args.requests, args.kills, args.seed)
            result["chaos"] = {"undisturbed": calm, "with_kills": stormy, "wall_ratio_with_kills_over_undisturbed": round(stormy["wall_s"] / calm["wall_s"], 3)}

    k, load_ms = result["kill9"], result["plain_load_ms"]["spawn_to_ready"]
    print(NOISY)
    print(
        f"plain load (spawn -> ready) {load_ms['median']} ms; kill -9 -> ready {k['kill_to_ready_ms']['median']} ms "
        f"(detected after {k['detect_ms']['median']} ms, backoff {k['delay_ms']['median']} ms; without backoff "
        f"{k['kill_to_ready_without_delay_ms']['median']} ms); ratio {result['kill_to_ready_over_plain_load']} "
        f"({result['kill_to_ready_without_delay_over_plain_load']} without backoff)"
    )
    extra = result["kill_to_ready_minus_plain_load_same_round_ms"]
    print(f"kill -9 -> ready minus plain load, same round: median {extra['median']:+} ms (range {extra['min']:+} .. {extra['max']:+}); goal <= +150 ms")
    print(
        f"supervisor SIGKILL -> worker gone {result['supervisor_sigkill_to_worker_gone_ms']['median']} ms (max {result['supervisor_sigkill_to_worker_gone_ms']['max']})"
    )
    for label, key in (("undisturbed", "undisturbed"), ("with kills", "with_kills")):
        if "chaos" not in result:
            break
        run = result["chaos"][key]
        print(
            f"chaos {label}: {run['requests']} requests in {run['wall_s']} s, outcomes {run['outcomes']}, kills {run['kills']}, "
            f"retried {run['retried_invisibly']}, latency p50 {run['request_latency_ms']['p50']} ms p99 {run['request_latency_ms']['p99']} ms"
            + (f", kill -> ready {run['kill_to_ready_ms']['median']} ms" if run["kill_to_ready_ms"] else "")
        )
    write("restart", result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
