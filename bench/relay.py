"""Relay cost of the supervisor: events/s and added latency per event through
`lattice-pool serve` vs a raw pipe from the same fake worker, in one run.

    python -m bench.relay [--events 2000000] [--rounds 5] [--latency-events 3000]

Capacity: the fake worker (tests.fakeworker) floods `--events` token lines
for one request as fast as it can write; the reader here drains its stdout
in 1 MiB reads. "raw" reads the worker's own pipe; "serve" reads the pool's
stdout, the worker behind it. Rounds alternate. Also reported: supervisor
CPU time per event, which noise on a shared machine disturbs less.

Latency: the worker writes one line per millisecond carrying
time.monotonic_ns() at the write; the reader notes the clock when the line
arrives (CLOCK_MONOTONIC is one clock for all processes on Linux). Added
latency = serve percentile - raw percentile.

Goals: >= 1 M events/s through the pool, p99 added <= 0.5 ms.
Writes bench/results/relay.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import NOISY, machine, percentile, summary, write  # noqa: E402
from harness.fakes import FAKE_ENV, FakeModels  # noqa: E402
from harness.procs import child_env  # noqa: E402
from ipc.framing import encode_frame  # noqa: E402
from ipc.messages import Generate  # noqa: E402

DONE = b'"done":true'
TOKEN = b'"token":"'


class Source:
    """A fake worker seen raw (its own pipes) or through `lattice-pool serve`."""

    def __init__(self, mode: str, model: Path, tmp: Path):
        self.mode = mode
        if mode == "raw":
            argv = [sys.executable, "-m", "tests.fakeworker", "--model", str(model), "--heartbeat", "1"]
            env = child_env()
        else:
            config = tmp / f"{model.name}.toml"
            config.write_text(f'heartbeat_interval = 1.0\n[[models]]\nname = "f"\npath = "{model}"\npreload = true\n')
            argv = [sys.executable, "-m", "supervisor", "serve", "--config", str(config)]
            env = child_env(**FAKE_ENV)
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=ROOT)
        self.fd = self.proc.stdout.fileno()
        self.rid = 0
        self.read_until(b'"ev":"ready"')

    def read_until(self, needle: bytes, on_chunk=None) -> None:
        tail = b""
        while True:
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:
                raise RuntimeError(f"{self.mode} source exited")
            if on_chunk is not None:
                on_chunk(chunk)
            if needle in tail + chunk:
                return
            tail = chunk[-64:]

    def request(self, max_tokens: int = 1) -> None:
        self.rid += 1
        if self.mode == "raw":
            self.proc.stdin.write(encode_frame(Generate(rid=self.rid, prompt="x", max_tokens=max_tokens, id_json=f'"r{self.rid}"')))
        else:
            self.proc.stdin.write(json.dumps({"id": f"r{self.rid}", "prompt": "x", "max_tokens": max_tokens}).encode() + b"\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        self.proc.stdin.close()
        while os.read(self.fd, 1 << 20):
            pass
        self.proc.wait(30)
        self.proc.stdout.close()


def flood(source: Source, events: int) -> tuple[float, float | None]:
    """(events/s, supervisor CPU µs per event, None for raw)."""
    supervisor = psutil.Process(source.proc.pid) if source.mode == "serve" else None
    cpu0 = sum(supervisor.cpu_times()[:2]) if supervisor else 0.0
    t0 = time.perf_counter()
    source.request()
    source.read_until(DONE)
    elapsed = time.perf_counter() - t0
    cpu_us = (sum(supervisor.cpu_times()[:2]) - cpu0) * 1e6 / events if supervisor else None
    return events / elapsed, cpu_us


def latencies(source: Source, events: int) -> list[float]:
    """Per-event latency in ms, write -> read."""
    out: list[float] = []

    def on_chunk(chunk: bytes) -> None:
        now = time.monotonic_ns()
        at = chunk.find(TOKEN)
        while at >= 0:
            start = at + len(TOKEN)
            end = chunk.index(b'"', start)
            if end > start:
                out.append((now - int(chunk[start:end])) / 1e6)
            at = chunk.find(TOKEN, end)

    source.request(events)
    source.read_until(DONE, on_chunk)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.relay", description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=2_000_000, help="token lines per flood (default 2,000,000)")
    p.add_argument("--rounds", type=int, default=5, help="floods per side (default 5)")
    p.add_argument("--latency-events", type=int, default=3000, help="timed lines per side (default 3000)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)

    rates: dict[str, list[float]] = {"raw": [], "serve": []}
    cpu_per_event: list[float] = []
    lat: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="lattice-bench-relay-") as tmp_name:
        tmp = Path(tmp_name)
        fakes = FakeModels(tmp)
        flooder = fakes.add("flood", {"tokens": args.events})
        ticker = fakes.add("tick", {"token": "{t}", "token_interval": 0.001})
        sources = {mode: Source(mode, flooder, tmp) for mode in ("raw", "serve")}
        try:
            for mode in sources:
                flood(sources[mode], args.events)  # warm-up
            for _ in range(args.rounds):
                for mode, source in sources.items():
                    rate, cpu = flood(source, args.events)
                    rates[mode].append(rate)
                    if cpu is not None:
                        cpu_per_event.append(cpu)
        finally:
            for source in sources.values():
                source.close()
        sources = {mode: Source(mode, ticker, tmp) for mode in ("raw", "serve")}
        try:
            for mode, source in sources.items():
                latencies(source, 100)  # warm-up
                lat[mode] = latencies(source, args.latency_events)
        finally:
            for source in sources.values():
                source.close()

    def pcts(values: list[float]) -> dict:
        return {f"p{q}": round(percentile(values, q), 4) for q in (50, 90, 99)} | {"max": round(max(values), 4), "n": len(values)}

    serve_rate = statistics.median(rates["serve"])
    added_p50 = percentile(lat["serve"], 50) - percentile(lat["raw"], 50)
    added_p99 = percentile(lat["serve"], 99) - percentile(lat["raw"], 99)
    result = {
        "note": NOISY,
        "machine": machine(),
        "capacity": {
            "events_per_flood": args.events,
            "event_bytes": len(b'@@lattice {"ev":"gen_token","token":"tok","done":false,"id":"r1"}\n'),
            "events_per_s": {"raw": summary(rates["raw"], 0), "serve": summary(rates["serve"], 0)},
            "serve_over_raw": round(serve_rate / statistics.median(rates["raw"]), 3),
            "supervisor_cpu_us_per_event": summary(cpu_per_event, 4),
            "goal_events_per_s": 1_000_000,
            "meets_goal": serve_rate >= 1_000_000,
        },
        "latency_ms": {
            "raw": pcts(lat["raw"]),
            "serve": pcts(lat["serve"]),
            "added_p50": round(added_p50, 4),
            "added_p99": round(added_p99, 4),
            "goal_added_p99": 0.5,
            "meets_goal": added_p99 <= 0.5,
        },
    }
    cap, lat = result["capacity"], result["latency_ms"]
    print(NOISY)
    print(
        f"capacity  raw {cap['events_per_s']['raw']['median']:,.0f} ev/s  serve {serve_rate:,.0f} ev/s  ratio {cap['serve_over_raw']}  "
        f"supervisor CPU {cap['supervisor_cpu_us_per_event']['median']} us/event  (goal >= 1M ev/s: {'met' if cap['meets_goal'] else 'MISSED'})"
    )
    print(
        f"latency ms  raw p50 {lat['raw']['p50']} p99 {lat['raw']['p99']}  serve p50 {lat['serve']['p50']} p99 {lat['serve']['p99']}  "
        f"added p50 {lat['added_p50']} p99 {lat['added_p99']}  (goal p99 added <= 0.5 ms: {'met' if lat['meets_goal'] else 'MISSED'})"
    )
    write("relay", result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
