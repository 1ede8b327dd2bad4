"""stderr for the supervisor: its own log records and its workers' stderr.

One thread owns fd 2. The event loop only appends to a bounded queue, so a
client that never drains our stderr pipe can stall that thread but never the
pool; past the bound, lines are dropped and counted.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

_MAX_QUEUED = 10_000


class _StderrSink:
    def __init__(self, fd: int = 2):
        self._fd = fd
        self._queue: queue.Queue[bytes] = queue.Queue(_MAX_QUEUED)
        self.dropped = 0
        threading.Thread(target=self._drain, name="stderr", daemon=True).start()

    def put(self, data: bytes) -> None:
        try:
            self._queue.put_nowait(data)
        except queue.Full:
            self.dropped += 1

    def _drain(self) -> None:
        while True:
            data = self._queue.get()
            if self.dropped:
                data = f"[lattice-pool: {self.dropped} stderr lines dropped]\n".encode() + data
                self.dropped = 0
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(self._fd, view) :]
            except OSError:
                pass
            finally:
                self._queue.task_done()

    def flush(self, timeout: float = 2.0) -> None:
        """Waits (bounded) until queued lines are written: used at exit."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)


_sink: _StderrSink | None = None


def sink() -> _StderrSink:
    global _sink
    if _sink is None:
        _sink = _StderrSink()
    return _sink


class _Handler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            sink().put((self.format(record) + "\n").encode("utf-8", "replace"))
        except Exception:
            self.handleError(record)


def setup(level: str | None = None) -> None:
    handler = _Handler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s lattice-pool: %(message)s"))
    root = logging.getLogger("lattice")
    root.handlers[:] = [handler]
    root.setLevel((level or os.environ.get("LATTICE_LOG_LEVEL", "INFO")).upper())
    root.propagate = False


def relay_worker_stderr(data: bytes) -> None:
    sink().put(data)
