"""A real worker process driven directly over its pipes (no supervisor), by
tests and by benchmarks: every line is stamped with its arrival time."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from harness.procs import ROOT, child_env, close_stdin
from ipc.framing import encode_frame
from ipc.messages import Generate, ToWorker
from ipc.worker_events import is_token, line_id, parse_event


def is_terminal(event: dict) -> bool:
    return event["ev"] == "error" or (event["ev"] == "gen_token" and event.get("done") is True)


def text_of(events: list[dict]) -> str:
    return "".join(e["token"] for e in events if e["ev"] == "gen_token")


def terminal(events: list[dict]) -> dict:
    finals = [e for e in events if is_terminal(e)]
    assert len(finals) == 1, events
    assert events[-1] is finals[0]
    return finals[0]


class WorkerProc:
    def __init__(self, model: Path, *args: str, profile: Path | None = None, env: dict[str, str] | None = None):
        # profile: the worker's main thread runs under cProfile, whose
        # figures go to that file when the worker exits after a Shutdown
        # (closing its stdin ends it at once, writing nothing).
        profiler = ["-m", "cProfile", "-o", str(profile)] if profile is not None else []
        self.proc = subprocess.Popen(
            [sys.executable, *profiler, "-m", "worker", "--model", str(model), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=child_env(**(env or {})),
            cwd=ROOT,
            # In a session of its own, as the pool starts its workers: with
            # autogroup scheduling that decides its share of a busy CPU.
            start_new_session=True,
        )
        self._lines: queue.Queue[tuple[bytes, float] | None] = queue.Queue()
        self.stderr = bytearray()
        # Adapter events that came while collect_by_id read requests' lines.
        self.adapter_events: list[dict] = []
        self._pumps = [threading.Thread(target=self._pump, daemon=True), threading.Thread(target=self._pump_err, daemon=True)]
        for t in self._pumps:
            t.start()

    @classmethod
    def started(cls, model: Path, *args: str, profile: Path | None = None, env: dict[str, str] | None = None) -> WorkerProc:
        """A worker that has said `ready`."""
        w = cls(model, *args, profile=profile, env=env)
        w.wait_ready()
        return w

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put((line, time.monotonic()))
        self._lines.put(None)

    def _pump_err(self) -> None:
        for line in self.proc.stderr:
            self.stderr += line

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, msg: ToWorker) -> None:
        self.send_raw(encode_frame(msg))

    def send_raw(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def ask(self, msg: ToWorker, timeout: float = 60.0) -> dict:
        """Sends a message (Stats, LoadAdapter, ...) and returns the next event."""
        self.send(msg)
        event = self.next_event(timeout)
        assert event is not None, f"worker exited: {self.stderr.decode(errors='replace')}"
        return event

    def next_stamped(self, timeout: float = 60.0) -> tuple[bytes, float] | None:
        """The next line and its arrival time (time.monotonic), None at EOF."""
        return self._lines.get(timeout=timeout)

    def next_line(self, timeout: float = 60.0) -> bytes | None:
        stamped = self.next_stamped(timeout)
        return None if stamped is None else stamped[0]

    def next_event(self, timeout: float = 60.0, skip=(b"heartbeat",)) -> dict | None:
        """The next event as a dict, skipping internal heartbeats."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.next_line(max(deadline - time.monotonic(), 0.001))
            if line is None:
                return None
            assert line.startswith(b"@@lattice {") and line.endswith(b"}\n"), line
            event = parse_event(line)
            if event["ev"].encode() not in skip:
                event["_line"] = line
                return event

    def wait_ready(self, timeout: float = 120.0) -> dict:
        while True:
            event = self.next_event(timeout)
            assert event is not None, f"worker exited before ready: {self.stderr.decode(errors='replace')}"
            if event["ev"] == "ready":
                return event

    def collect(self, timeout: float = 120.0) -> list[dict]:
        """Events up to and including the next terminal one."""
        events = []
        while True:
            event = self.next_event(timeout)
            assert event is not None, f"worker exited mid-request: {self.stderr.decode(errors='replace')}"
            events.append(event)
            if is_terminal(event):
                return events

    def send_together(self, reqs: list, timeout: float = 120.0) -> dict:
        """Generate frames in one write, so they reach the worker together;
        returns each request's events by rid (each id_json must be its rid)."""
        self.send_raw(b"".join(encode_frame(r) for r in reqs))
        return self.collect_by_id([r.rid for r in reqs], timeout)

    def collect_by_id(self, ids, timeout: float = 120.0) -> dict:
        """Events of several requests whose lines interleave, by id, until
        each has its terminal event. Every line must carry a known id, but
        adapter events, which go to `adapter_events`."""
        pending = set(ids)
        out: dict = {i: [] for i in ids}
        while pending:
            event = self.next_event(timeout)
            assert event is not None, f"worker exited mid-request: {self.stderr.decode(errors='replace')}"
            if event["ev"].startswith("adapter_") and "id" not in event:
                self.adapter_events.append(event)
                continue
            assert event.get("id") in out, event
            assert event["id"] in pending, f"a line after the terminal one: {event}"
            out[event["id"]].append(event)
            if is_terminal(event):
                pending.discard(event["id"])
        return out

    # -- timing, for benchmarks -------------------------------------------------

    def generate(self, **kw) -> dict:
        """Runs one request (rid 1 up); returns its final line plus client-side
        times: client_ttft_ms, client_total_ms, last_token_s, and its text."""
        self._rid = getattr(self, "_rid", 0) + 1
        t0 = time.monotonic()
        self.send(Generate(rid=self._rid, **kw))
        first = last = None
        text = []
        while True:
            line, now = self._stamped_event_line()
            event = parse_event(line)
            if event["ev"] == "error":
                raise RuntimeError(event["msg"])
            if event["done"]:
                event["client_ttft_ms"] = ((first or now) - t0) * 1000
                event["client_total_ms"] = (now - t0) * 1000
                event["text"] = "".join(text)
                event["last_token_s"] = (last or now) - t0
                return event
            text.append(event["token"])
            first = first or now
            last = now

    def generate_many(self, requests: list[dict]) -> dict:
        """Sends the requests in one write (they reach the worker together)
        and reads their interleaved lines; returns per-request client-side
        first-token times, the tokens generated, and the wall time to the
        last final line."""
        frames, ids = [], []
        for kw in requests:
            self._rid = getattr(self, "_rid", 0) + 1
            ids.append(str(self._rid).encode())
            frames.append(encode_frame(Generate(rid=self._rid, id_json=str(self._rid), **kw)))
        t0 = time.monotonic()
        self.send_raw(b"".join(frames))
        return self.figures(ids, t0)

    def figures(self, ids: list[bytes], t0: float) -> dict:
        """stream_figures of the requests `ids` (their ids as JSON text), sent
        at t0, from this worker's lines."""
        return stream_figures(self._stamped_event_line, ids, t0)

    def _stamped_event_line(self) -> tuple[bytes, float]:
        while True:
            stamped = self.next_stamped(600)
            if stamped is None:
                raise RuntimeError(f"worker exited with {self.proc.wait()}: {self.stderr[-2000:].decode(errors='replace')}")
            if not stamped[0].startswith(b'@@lattice {"ev":"heartbeat"'):
                return stamped

    def close(self) -> int:
        close_stdin(self.proc)
        try:
            rc = self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait(timeout=20)
        for t in self._pumps:
            t.join(timeout=10)
        self.proc.stdout.close()
        self.proc.stderr.close()
        return rc


def stream_figures(next_line, ids: list[bytes], t0: float) -> dict:
    """Reads the lines of the requests `ids` (their ids as JSON text) from
    `next_line()` -> (line, arrival time) until each has ended; returns the
    time of each one's first token and of its end from t0 (ms, in the order
    of `ids`), the tokens generated, the wall time to the last end, and each
    one's figures as the worker measured them (its final line's ttft_ms,
    total_ms and gen_tokens, from when the request reached the worker).
    Token lines are read as the supervisor relays them, without decoding
    JSON: only the id at the tail matters."""
    first: dict[bytes, float] = {}
    done: dict[bytes, float] = {}
    rates: dict[bytes, list] = {}
    tokens = 0
    pending = set(ids)
    last = t0
    while pending:
        line, at = next_line()
        key = line_id(line)
        if key not in pending:
            continue
        if is_token(line):
            first.setdefault(key, at)
            continue
        event = parse_event(line)
        if event["ev"] == "error":
            raise RuntimeError(event["msg"])
        if event["ev"] == "gen_token":
            tokens += event["gen_tokens"]
            rates[key] = [event["ttft_ms"], event["total_ms"], event["gen_tokens"]]
            pending.discard(key)
            done[key] = last = at
    wall = last - t0
    return {
        # A request whose first token ended it (an end-of-sequence token)
        # has no token line: its first token is its done line.
        "ttft_ms": [(first.get(i, done[i]) - t0) * 1000 for i in ids],
        "done_ms": [(done[i] - t0) * 1000 for i in ids],
        "tokens": tokens,
        "wall_s": wall,
        "worker_ttft_total_tokens": [rates[i] for i in ids],
    }
