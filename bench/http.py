"""The HTTP surface: its per-token cost against stdin, and 100 concurrent
SSE streams against the supervisor's memory.

    python -m bench.http [--size small] [--rounds 6] [--max-tokens 128] [--streams 100]

1. Overhead. One `lattice-pool serve --http` on the demo model; the same
   greedy request alternately on stdin (token lines timed as they arrive,
   harness.pool.PoolProc) and as a streamed /v1/completions (SSE events
   timed as they arrive at a raw-socket client that only splits events).
   Decode rate = (tokens - 1) / (last token's arrival - first token's), so
   prompt and connection setup stay out of it; tokens are the done line's
   gen_tokens / the usage chunk's completion_tokens. overhead = 1 - the
   median of the per-round ratios http/stdin. The goal is <= 5 %.
2. Streams. Another pool on the tiny model; 100 streamed chat requests at
   once, each on its own connection: every one must end with a finish
   reason and [DONE]. Then 100 more whose clients read nothing for
   --pause seconds, then everything: their events wait in the pool's
   per-stream buffers meanwhile. The supervisor's RSS is sampled every
   50 ms: before (warm, idle), the peak during each phase, and after.

Writes bench/results/http-<backend>.json. Runs unchanged on an NVIDIA
machine with mlx-cuda (`python -m bench.http`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from bench.common import NOISY, backend, demo_model, machine, summary, tagged, write  # noqa: E402
from harness.pool import PoolProc  # noqa: E402
from harness.procs import wait_for  # noqa: E402

PROMPT = "<|im_start|>user\nTell me about the river and the mill.<|im_end|>\n<|im_start|>assistant\n"
GREEDY = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0}


def start_pool(model: Path, *args: str) -> tuple[PoolProc, int]:
    pool = PoolProc("--model-dir", str(model), "--http", "127.0.0.1:0", "--no-control-socket", *args)
    pool.wait_ev("ready")
    found = wait_for(lambda: re.search(rb"http on http://127\.0\.0\.1:(\d+)/v1", pool.stderr), 60, message="the http log line")
    return pool, int(found.group(1))


async def sse_request(port: int, path: str, body: dict, pause: float = 0.0) -> dict:
    """One streamed request on its own connection: the arrival time of
    every event, the usage, the finish reason and whether [DONE] came."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write(
        b"POST %s HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
        % (path.encode(), len(data), data)
    )
    await writer.drain()
    if pause:
        await asyncio.sleep(pause)
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    out = {"times": [], "usage": None, "finish_reason": None, "done": False}
    buffer = b""
    while True:
        chunk = await reader.read(1 << 16)
        if not chunk:
            break
        now = time.monotonic()
        buffer += chunk
        complete = buffer.rfind(b"\n") + 1
        # Chunked transfer framing around the events (each HTTP chunk holds
        # whole events): their complete "data: " lines are all we need.
        for line in re.findall(rb"data: ([^\r\n]*)\r?\n", buffer[:complete]):
            if line == b"[DONE]":
                out["done"] = True
                continue
            if b'"finish_reason":null' in line and b'"role"' not in line:
                out["times"].append(now)  # a text event: not parsed, as the stdin side's lines are parsed by a C decoder
                continue
            event = json.loads(line)
            choice = event["choices"][0] if event["choices"] else None
            if choice is None:
                out["usage"] = event["usage"]
            elif choice["finish_reason"]:
                out["finish_reason"] = choice["finish_reason"]
        buffer = buffer[complete:]
    writer.close()
    return out


def cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def overhead(model: Path, rounds: int, max_tokens: int) -> dict:
    """Wall-clock decode rates (what a client sees; noisy on a shared
    machine) and the supervisor's CPU time per token on each path (what the
    HTTP surface costs, whatever else the machine runs)."""
    pool, port = start_pool(model)
    supervisor = psutil.Process(pool.proc.pid)
    request = {"prompt": PROMPT, "max_tokens": max_tokens, **GREEDY}
    try:
        stdin_rates, http_rates, ratios = [], [], []
        # CPU time comes in clock ticks (10 ms): summed over every round.
        cpu = {"stdin": 0.0, "http": 0.0, "tokens": 0}
        for i in range(rounds + 1):  # the first round warms both paths up
            c0 = cpu_seconds(supervisor)
            done = pool.generate({**request, "id": f"r{i}"})
            c1 = cpu_seconds(supervisor)
            n = done["gen_tokens"]
            stdin_rate = (n - 1) / ((done["client_total_ms"] - done["client_ttft_ms"]) / 1000.0)
            sse = asyncio.run(sse_request(port, "/v1/completions", {**request, "stream": True, "stream_options": {"include_usage": True}}))
            c2 = cpu_seconds(supervisor)
            assert sse["done"] and sse["usage"]["completion_tokens"] == n, sse["usage"]
            times = sse["times"]
            http_rate = (n - 1) / (times[-1] - times[0])
            if i == 0:
                continue
            stdin_rates.append(stdin_rate)
            http_rates.append(http_rate)
            ratios.append(http_rate / stdin_rate)
            cpu["stdin"] += c1 - c0
            cpu["http"] += c2 - c1
            cpu["tokens"] += n
            print(f"round {i}: stdin {stdin_rate:.1f} tok/s, http {http_rate:.1f} tok/s, ratio {http_rate / stdin_rate:.3f}", file=sys.stderr)
    finally:
        assert pool.close() == 0
    ratio = statistics.median(ratios)
    stdin_us, http_us = (cpu[k] / cpu["tokens"] * 1e6 for k in ("stdin", "http"))
    token_us = 1e6 / max(stdin_rates)  # the fastest round: the least contended token interval
    return {
        "tokens": max_tokens,
        "stdin_tok_s": summary(stdin_rates, 1),
        "http_tok_s": summary(http_rates, 1),
        "ratio_http_over_stdin": summary(ratios),
        "overhead_wall": round(1 - ratio, 4),
        "supervisor_cpu_us_per_token_stdin": round(stdin_us, 1),
        "supervisor_cpu_us_per_token_http": round(http_us, 1),
        "added_cpu_us_per_token": round(http_us - stdin_us, 1),
        "added_cpu_share_of_token_interval": round((http_us - stdin_us) / token_us, 4),
        "goal": "overhead <= 0.05",
    }


class RssSampler:
    """The peak RSS of a process, sampled every 50 ms from a thread."""

    def __init__(self, pid: int):
        self.proc = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def streams(model: Path, count: int, max_tokens: int, pause: float) -> dict:
    pool, port = start_pool(model, "--shutdown-grace", "5")
    body = {
        "messages": [{"role": "user", "content": "Tell me about the river."}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def phase(wait: float) -> list[dict]:
        return await asyncio.gather(*(sse_request(port, "/v1/chat/completions", {**body, "seed": i}, wait) for i in range(count)))

    supervisor = psutil.Process(pool.proc.pid)
    try:
        asyncio.run(sse_request(port, "/v1/chat/completions", body))  # warm
        before = supervisor.memory_info().rss
        result = {"streams": count, "max_tokens": max_tokens, "rss_before_bytes": before}
        for name, wait in (("reading", 0.0), ("paused", pause)):
            t0 = time.monotonic()
            with RssSampler(pool.proc.pid) as sampler:
                answers = asyncio.run(phase(wait))
            complete = sum(1 for a in answers if a["done"] and a["finish_reason"] in ("stop", "length") and a["usage"])
            result[name] = {
                "complete": complete,
                "seconds": round(time.monotonic() - t0, 2),
                "tokens": sum(a["usage"]["completion_tokens"] for a in answers if a["usage"]),
                "rss_peak_bytes": sampler.peak,
                "rss_peak_over_before_bytes": sampler.peak - before,
            }
            if wait:
                result[name]["pause_s"] = wait
            print(f"{name}: {complete}/{count} complete, peak RSS +{(sampler.peak - before) / 1e6:.1f} MB", file=sys.stderr)
        time.sleep(1.0)  # let the last responses' buffers go
        result["rss_after_bytes"] = supervisor.memory_info().rss
    finally:
        assert pool.close() == 0
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", help="demo model for the overhead part (default small)")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--streams", type=int, default=100)
    p.add_argument("--stream-tokens", type=int, default=48)
    p.add_argument("--pause", type=float, default=5.0, help="seconds the second phase's clients read nothing")
    p.add_argument("--tag", default="")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    result = {
        "benchmark": "http",
        "machine": machine(),
        "note": NOISY,
        "overhead": overhead(demo_model(args.size), args.rounds, args.max_tokens),
        "model_overhead": args.size,
        "concurrent_streams": streams(demo_model("tiny"), args.streams, args.stream_tokens, args.pause),
    }
    write(tagged(f"http-{backend()}", args.tag), result, args.out)
    print(json.dumps({k: result[k] for k in ("overhead", "concurrent_streams")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
