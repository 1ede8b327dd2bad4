"""A real `lattice-pool serve` process, driven over stdin/stdout like Studio
does: PoolProc reads and decodes every line (stamped with its arrival
time), RawPool leaves the raw stream to its user (clients that read too
slowly, or not at all)."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time

import psutil

from harness.procs import ROOT, child_env, close_stdin, wait_for
from harness.worker import is_terminal, stream_figures
from ipc.worker_events import parse_event

__all__ = ["PoolProc", "RawPool", "is_terminal", "stalled"]


class PoolProc:
    def __init__(self, *args: str, command: str = "serve", env: dict[str, str] | None = None, stdin=subprocess.PIPE, preexec_fn=None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor", command, *args],
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=child_env(**(env or {})),
            cwd=ROOT,
            preexec_fn=preexec_fn,
        )
        self.events: list[dict] = []
        self._queue: queue.Queue[dict | None] = queue.Queue()
        self._returned: set[int] = set()
        self._low = 0  # every event before it has been returned
        self.stderr = bytearray()
        self.sent_ids: list[object] = []
        # Ids a test reused on purpose, with the number of terminals it expects.
        self.expected_terminals: dict[object, int] = {}
        self.idless_sent = 0
        self._pumps = [threading.Thread(target=self._pump, daemon=True), threading.Thread(target=self._pump_err, daemon=True)]
        for t in self._pumps:
            t.start()

    def _pump(self) -> None:
        try:
            for line in self.proc.stdout:
                at = time.monotonic()
                assert line.startswith(b"@@lattice {") and line.endswith(b"}\n"), line
                event = parse_event(line)
                event["_line"] = line
                event["_at"] = at
                self._queue.put(event)
        except ValueError:  # the test closed stdout to play a vanished client
            pass
        self._queue.put(None)

    def _pump_err(self) -> None:
        for line in self.proc.stderr:
            self.stderr += line

    @staticmethod
    def line(request: dict) -> bytes:
        return json.dumps(request, ensure_ascii=False).encode() + b"\n"

    def send(self, request: dict | bytes) -> None:
        """A request (counted for check_terminals) or raw bytes (not counted)."""
        if isinstance(request, dict):
            if request.get("op") in (None, "embed", "count"):  # a request: it ends with one terminal line
                if request.get("id") is None:
                    self.idless_sent += 1
                else:
                    self.sent_ids.append(request["id"])
            data = self.line(request)
        else:
            data = request
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def _pull(self, timeout: float) -> dict | None:
        event = self._queue.get(timeout=timeout)
        if event is not None:
            self.events.append(event)
        return event

    def wait_for(self, predicate, timeout: float = 120.0, since: int = 0) -> dict:
        """The earliest event from events[since] on matching predicate that
        no earlier call returned."""
        deadline = time.monotonic() + timeout
        scanned = max(self._low, since)
        while True:
            for i in range(scanned, len(self.events)):
                if i not in self._returned and predicate(self.events[i]):
                    self._returned.add(i)
                    while self._low in self._returned:
                        self._low += 1
                    return self.events[i]
            scanned = len(self.events)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"timed out waiting; last events: {self.events[-5:]}\nstderr: {self.stderr[-3000:].decode(errors='replace')}")
            try:
                event = self._pull(remaining)
            except queue.Empty:
                continue
            if event is None:
                raise AssertionError(f"pool exited; stderr: {self.stderr[-3000:].decode(errors='replace')}")

    def wait_ev(self, ev: str, timeout: float = 120.0, **fields) -> dict:
        return self.wait_for(lambda e: e["ev"] == ev and all(e.get(k) == v for k, v in fields.items()), timeout)

    def terminal(self, request_id, timeout: float = 120.0) -> dict:
        """Waits for the terminal event of the request with this id."""
        for event in self.events:
            if event.get("id") == request_id and is_terminal(event):
                return event
        return self.wait_for(lambda e: e.get("id") == request_id and is_terminal(e), timeout)

    def of(self, request_id) -> list[dict]:
        return [e for e in self.events if e.get("id") == request_id and e["ev"] in ("gen_token", "error")]

    def text(self, request_id) -> str:
        return "".join(e["token"] for e in self.of(request_id) if e["ev"] == "gen_token")

    # -- timing, for benchmarks -------------------------------------------------

    def generate(self, request: dict) -> dict:
        """Sends one request; returns its terminal event with client-side
        times from the send: client_ttft_ms, client_total_ms, and its text."""
        t0 = time.monotonic()
        self.send(request)
        key = request.get("id")
        first = None
        text = []
        while True:
            event = self.wait_for(lambda e: e["ev"] in ("gen_token", "error") and e.get("id") == key)
            if event["ev"] == "error":
                raise RuntimeError(event["msg"])
            if event["done"]:
                event["client_ttft_ms"] = ((first or event["_at"]) - t0) * 1000
                event["client_total_ms"] = (event["_at"] - t0) * 1000
                event["text"] = "".join(text)
                return event
            first = first or event["_at"]
            text.append(event["token"])

    def generate_many(self, requests: list[dict]) -> dict:
        """Sends requests with ids in one write; returns harness.worker's
        stream_figures of their lines."""
        t0 = time.monotonic()
        self.send(b"".join(self.line(r) for r in requests))
        self.sent_ids += [r["id"] for r in requests]

        def next_line() -> tuple[bytes, float]:
            event = self.wait_for(lambda e: True, timeout=600)
            return event["_line"], event["_at"]

        return stream_figures(next_line, [json.dumps(r["id"]).encode() for r in requests], t0)

    def idless_texts(self, since: int = 0) -> list[str]:
        """The texts of the id-less requests whose lines are among
        events[since:], read as a chat_metal client reads them: every token
        line without an id belongs to the current text, a done line ends it."""
        texts, current = [], []
        for e in self.events[since:]:
            if e["ev"] == "gen_token" and "id" not in e:
                if e["done"]:
                    texts.append("".join(current))
                    current = []
                else:
                    current.append(e["token"])
        return texts

    def drain(self) -> None:
        while True:
            try:
                if self._pull(0.0) is None:
                    return
            except queue.Empty:
                return

    def close(self, timeout: float = 60.0) -> int:
        """EOF on stdin, wait for exit, then check that every request ended
        with exactly one terminal event."""
        close_stdin(self.proc)
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        finally:
            for t in self._pumps:
                t.join(timeout=10)
            self.proc.stdout.close()
            self.proc.stderr.close()
        self.drain()
        self.check_terminals()
        return rc

    def check_terminals(self) -> None:
        """Every request sent as a dict ends with exactly one terminal event.

        Id-less requests are counted: their terminals are done lines without
        an id and id-less errors other than bad_request (tests send malformed
        id-less lines as raw bytes, which this does not count)."""
        by_id: dict[object, int] = {}
        idless = 0
        for event in self.events:
            if not is_terminal(event):
                continue
            if "id" in event:
                by_id[event["id"]] = by_id.get(event["id"], 0) + 1
            elif event["ev"] == "gen_token" or event.get("code") != "bad_request":
                idless += 1
        for request_id in self.sent_ids:
            want = self.expected_terminals.get(request_id, 1)
            assert by_id.get(request_id) == want, f"request {request_id!r}: {by_id.get(request_id, 0)} terminal events"
        unexpected = set(by_id) - set(self.sent_ids)
        assert not unexpected, f"terminal events for ids never sent: {unexpected}"
        assert idless == self.idless_sent, f"{self.idless_sent} id-less requests, {idless} id-less terminal events"

    def kill(self) -> None:
        """Teardown for a test that failed before closing its pool."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                if stream and not stream.closed:
                    stream.close()
            except BrokenPipeError:
                pass
        for t in self._pumps:
            t.join(timeout=10)


def stalled(proc: psutil.Process, counter: str, seconds: float):
    """A predicate: the process's io counter (`read_chars`, `write_chars`)
    has not moved for `seconds`."""
    seen = {"chars": -1, "since": 0.0}

    def check() -> bool:
        chars = getattr(proc.io_counters(), counter)
        now = time.monotonic()
        if chars != seen["chars"]:
            seen.update(chars=chars, since=now)
        return now - seen["since"] > seconds

    return check


class RawPool:
    """`lattice-pool serve` whose stdout the test reads itself, or not at all:
    for clients that stop reading."""

    def __init__(self, config: str, stderr=subprocess.DEVNULL, env: dict[str, str] | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor", "serve", "--config", config],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=child_env(**(env or {})),
            cwd=ROOT,
        )
        self.out = bytearray()
        self._scanned = 0

    def send(self, request: dict) -> None:
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()

    def read_until(self, needle: bytes) -> dict:
        """Reads stdout until a line containing needle; returns that event."""
        while True:
            at = self.out.find(needle, self._scanned)
            if at >= 0:
                start = self.out.rfind(b"\n", 0, at) + 1
                end = self.out.index(b"\n", at) + 1
                self._scanned = end
                return parse_event(self.out[start:end])
            self._scanned = max(self._scanned, len(self.out) - len(needle))
            chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
            if not chunk:
                raise AssertionError(f"pool exited before {needle!r}")
            self.out += chunk

    def drain_stdout(self) -> None:
        """Reads stdout to EOF (in a thread, while another writes stdin)."""
        while chunk := os.read(self.proc.stdout.fileno(), 1 << 20):
            self.out += chunk

    def flood(self, data: bytes, timeout: float = 120) -> tuple[threading.Thread, int]:
        """Writes `data` to stdin from a thread without reading stdout; once
        the pool stops reading, returns the writer and how many bytes the
        supervisor's RSS grew meanwhile."""
        supervisor = psutil.Process(self.proc.pid)
        before = supervisor.memory_info().rss
        writer = threading.Thread(target=self.proc.stdin.write, args=(data,))
        writer.start()
        wait_for(stalled(supervisor, "read_chars", 1.0), timeout, message="the pool to stop reading stdin")
        return writer, supervisor.memory_info().rss - before

    def finish_flood(self, writer: threading.Thread, timeout: float = 120) -> None:
        """Reads stdout again until the flood is answered and the pool exits 0."""
        drained = threading.Thread(target=self.drain_stdout)
        drained.start()
        writer.join(timeout)
        self.proc.stdin.close()
        drained.join(timeout)
        assert self.proc.wait(60) == 0

    def close(self, timeout: float = 60) -> int:
        self.proc.stdin.close()
        self.drain_stdout()
        rc = self.proc.wait(timeout)
        self.proc.stdout.close()
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None and not stream.closed:
                try:
                    stream.close()
                except BrokenPipeError:
                    pass
