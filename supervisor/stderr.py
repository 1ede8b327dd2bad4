"""stderr for the supervisor: its own log records and its workers' stderr.

One thread owns fd 2. The event loop only appends to a bounded queue, so a
client that never drains our stderr pipe can stall that thread but never the
pool; past the bound, lines are dropped and counted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable

from ipc.worker_events import FATAL_PREFIX, LOG_RECORD

_MAX_QUEUED = 10_000
# Worker stderr arrives in chunks of up to 256 KiB, so the count alone would
# let a flood pin gigabytes; bytes are bounded too.
_MAX_QUEUED_BYTES = 4 * 1024 * 1024


class _StderrSink:
    def __init__(self, fd: int = 2):
        self._fd = fd
        self._queue: queue.Queue[bytes] = queue.Queue(_MAX_QUEUED)
        self._lock = threading.Lock()
        self._queued_bytes = 0
        self.dropped = 0
        # Where the lines go: fd 2 itself, or a terminal front end that keeps
        # them off its progress bar, its prompt and a half-written reply.
        self.writer: Callable[[bytes], None] = self._write
        # Workers' stderr too: off in run and chat unless verbose (their last
        # message reaches the person anyway, quoted by the failed line).
        self.relay_workers = True
        threading.Thread(target=self._drain, name="stderr", daemon=True).start()

    def put(self, data: bytes) -> None:
        with self._lock:
            if self._queued_bytes + len(data) > _MAX_QUEUED_BYTES:
                self.dropped += 1
                return
            try:
                self._queue.put_nowait(data)
            except queue.Full:
                self.dropped += 1
                return
            self._queued_bytes += len(data)

    def _drain(self) -> None:
        while True:
            data = self._queue.get()
            with self._lock:
                self._queued_bytes -= len(data)
                dropped, self.dropped = self.dropped, 0
            if dropped:
                data = f"[lattice-pool: {dropped} stderr writes dropped]\n".encode() + data
            try:
                self.writer(data)
            except Exception:
                pass
            finally:
                self._queue.task_done()

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

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


LEVEL_VAR = "LATTICE_LOG_LEVEL"
# Loggers of what a worker slot goes through (start, crash, state): in run
# and chat the person sees those happenings once, as the pool's events.
SLOT_LOGGERS = ("lattice.worker", "lattice.state", "lattice.process")


def setup(level: str | None = None, default: str = "INFO", *, terminal: bool = False) -> str:
    """Log records of at least `level` (else $LATTICE_LOG_LEVEL, else
    `default`) go to stderr, for the pool and, through the environment they
    inherit, its workers. terminal: a person's terminal (`run`, `chat`)
    below INFO: workers' stderr and the slots' records stay off it.
    Returns the level."""
    level = (level or os.environ.get(LEVEL_VAR) or default).upper()
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError(f"unknown log level {level!r}; use DEBUG, INFO, WARNING, ERROR or CRITICAL")
    # Workers read it at start (worker/__main__.py): the level reaches them
    # before any line they write.
    os.environ[LEVEL_VAR] = level
    handler = _Handler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s lattice-pool: %(message)s"))
    # asyncio's own reports too: through the bounded sink, never a blocking
    # write on the event loop.
    for name in ("lattice", "asyncio"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.propagate = False
    logging.getLogger("lattice").setLevel(level)
    quiet = terminal and logging.getLevelName(level) > logging.INFO
    for name in SLOT_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL + 1 if quiet else logging.NOTSET)
    sink().relay_workers = not quiet
    return level


@contextlib.contextmanager
def routed(writer: Callable[[bytes], None]):
    """Meanwhile, log records and relayed stderr go to `writer` (called from
    the stderr thread) instead of fd 2."""
    out = sink()
    out.writer = writer
    try:
        yield
    finally:
        out.flush()
        out.writer = out._write


def relay_worker_stderr(data: bytes) -> None:
    out = sink()
    if out.relay_workers:
        out.put(data)


# Lines that begin a message on a worker's stderr: a log record, a traceback,
# the worker's one-line cause of exit 78. Other lines continue the one before.
_MESSAGE_START = re.compile(f"{LOG_RECORD.pattern}|Traceback |{re.escape(FATAL_PREFIX)}")


class LastMessage:
    """The last message a worker wrote on stderr, with all its lines (a
    multi-line error, a traceback down to its exception), for the reason of
    a crash. Only the last few KiB are kept, so a flood costs no Python per
    line. Lines repeated one after another are said once with their count,
    and a message over `limit` characters keeps its head (what the worker
    said) and its end (where a traceback's exception is): mlx's ring
    backend writes a line per failed send after a rank's exit was logged,
    which pushed the log line itself out of the message."""

    KEEP = 8192

    def __init__(self, limit: int = 600):
        self.limit = limit
        self._tail = b""

    def feed(self, data: bytes) -> None:
        self._tail = (self._tail + data[-self.KEEP :])[-self.KEEP :]

    def text(self) -> str:
        lines = [line for line in self._tail.decode("utf-8", "replace").splitlines() if line.strip()]
        start = max((i for i, line in enumerate(lines) if _MESSAGE_START.match(line)), default=0)
        said: list[list] = []
        for line in (line.strip() for line in lines[start:]):
            if said and said[-1][0] == line:
                said[-1][1] += 1
            else:
                said.append([line, 1])
        message = " ".join(line if n == 1 else f"{line} (x{n})" for line, n in said)
        if len(message) <= self.limit:
            return message
        head = self.limit // 3
        return message[:head] + " ... " + message[-(self.limit - head) :]
