"""A real `lattice-pool serve` process, driven over stdin/stdout like Studio does."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time

from tests.procs import close_stdin
from tests.workerproc import ROOT, child_env


def is_terminal(event: dict) -> bool:
    return event["ev"] == "error" or (event["ev"] == "gen_token" and event.get("done") is True)


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
                assert line.startswith(b"@@lattice {") and line.endswith(b"}\n"), line
                event = json.loads(line[10:])
                event["_line"] = line
                self._queue.put(event)
        except ValueError:  # the test closed stdout to play a vanished client
            pass
        self._queue.put(None)

    def _pump_err(self) -> None:
        for line in self.proc.stderr:
            self.stderr += line

    def send(self, request: dict | bytes) -> None:
        if isinstance(request, dict):
            if "op" not in request:
                if request.get("id") is None:
                    self.idless_sent += 1
                else:
                    self.sent_ids.append(request["id"])
            data = json.dumps(request, ensure_ascii=False).encode() + b"\n"
        else:
            data = request
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def _pull(self, timeout: float) -> dict | None:
        event = self._queue.get(timeout=timeout)
        if event is not None:
            self.events.append(event)
        return event

    def wait_for(self, predicate, timeout: float = 120.0) -> dict:
        """The earliest event matching predicate that no earlier call returned."""
        deadline = time.monotonic() + timeout
        scanned = 0
        while True:
            for i in range(scanned, len(self.events)):
                if i not in self._returned and predicate(self.events[i]):
                    self._returned.add(i)
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
        while True:
            try:
                if self._pull(0.0) is None:
                    break
            except queue.Empty:
                break
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
