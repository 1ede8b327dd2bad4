"""A real worker process driven directly over its pipes (no supervisor)."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from ipc.framing import encode_frame
from ipc.messages import ToWorker
from tests.procs import close_stdin

ROOT = Path(__file__).resolve().parent.parent


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


class WorkerProc:
    def __init__(self, model: Path, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "worker", "--model", str(model), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=child_env(),
            cwd=ROOT,
        )
        self.lines: queue.Queue[bytes | None] = queue.Queue()
        self.stderr = bytearray()
        # Adapter events that came while collect_by_id read requests' lines.
        self.adapter_events: list[dict] = []
        self._pumps = [threading.Thread(target=self._pump, daemon=True), threading.Thread(target=self._pump_err, daemon=True)]
        for t in self._pumps:
            t.start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

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

    def next_line(self, timeout: float = 60.0) -> bytes | None:
        return self.lines.get(timeout=timeout)

    def next_event(self, timeout: float = 60.0, skip=(b"heartbeat",)) -> dict | None:
        """The next event as a dict, skipping internal heartbeats."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.next_line(max(deadline - time.monotonic(), 0.001))
            if line is None:
                return None
            assert line.startswith(b"@@lattice {") and line.endswith(b"}\n"), line
            event = json.loads(line[len(b"@@lattice ") :])
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


def is_terminal(event: dict) -> bool:
    return event["ev"] == "error" or (event["ev"] == "gen_token" and event["done"])


def text_of(events: list[dict]) -> str:
    return "".join(e["token"] for e in events if e["ev"] == "gen_token")


def terminal(events: list[dict]) -> dict:
    finals = [e for e in events if is_terminal(e)]
    assert len(finals) == 1, events
    assert events[-1] is finals[0]
    return finals[0]
