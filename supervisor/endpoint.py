"""The stdin endpoint: NDJSON lines in, requests and ops to the pool.

A thread does the blocking reads, so stdin may be a pipe, a file or a
terminal. It hands raw chunks to the event loop through a small queue, and
the loop takes one line at a time, reading on only while the pool can take
more (pool.input_blocked): a client that floods lines without reading the
answers waits in its write() instead of growing our memory. Each line is
one boundary: whatever goes wrong with it is answered and logged, and the
next line is read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading

from ipc.events import BAD_REQUEST, INTERNAL
from supervisor.pool import Pool
from supervisor.requests import BadRequest, ClientLine, parse_line, scan_id

log = logging.getLogger("lattice.endpoint")

MAX_LINE = 64 * 1024 * 1024
READ_SIZE = 256 * 1024
# Raw chunks read ahead of the loop: the only input buffered beyond the line
# being handled (and the splitter's partial line).
READ_AHEAD = 4


# Of a line over the limit, the start kept to read its id from, so that
# its error still reaches the request it answers.
TOO_LONG_HEAD = 4096


@dataclasses.dataclass(frozen=True)
class TooLong:
    """A line over the limit: only its first bytes."""

    head: bytes


class LineSplitter:
    """Bytes in, complete lines out; an over-long line becomes one TooLong
    and is skipped up to its newline."""

    def __init__(self, max_line: int = MAX_LINE):
        self.max_line = max_line
        self._head = min(TOO_LONG_HEAD, max_line)
        self._buf = bytearray()
        self._skipping = False

    @property
    def partial(self) -> bool:
        """Whether a line has begun and not yet ended."""
        return bool(self._buf) or self._skipping

    def _too_long(self, more: bytes = b"") -> TooLong:
        head = bytes(self._buf[: self._head])
        return TooLong(head + more[: self._head - len(head)])

    def feed(self, chunk: bytes) -> list:
        out: list = []
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            if nl < 0:
                break
            if self._skipping:
                self._skipping = False
            elif len(self._buf) + nl - start > self.max_line:
                out.append(self._too_long(chunk[start:nl]))
            else:
                self._buf += chunk[start:nl]
                out.append(bytes(self._buf))
            self._buf.clear()
            start = nl + 1
        if not self._skipping:
            self._buf += chunk[start:]
            if len(self._buf) > self.max_line:
                out.append(self._too_long())
                self._buf.clear()
                self._skipping = True
        return out

    def finish(self) -> list:
        """A last line without a newline still counts at EOF."""
        rest = [] if self._skipping or not self._buf else [bytes(self._buf)]
        self._buf.clear()
        return rest


def start_reader(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, fd: int = 0) -> threading.Thread:
    """Puts raw chunks of `fd` on `queue`, then b"" at EOF."""

    def run() -> None:
        while True:
            try:
                chunk = os.read(fd, READ_SIZE)
            except OSError as exc:
                log.warning("stdin read failed: %s", exc)
                chunk = b""
            asyncio.run_coroutine_threadsafe(queue.put(chunk), loop).result()
            if not chunk:
                return

    thread = threading.Thread(target=run, name="stdin", daemon=True)
    thread.start()
    return thread


def read_line(line, max_line: int = MAX_LINE) -> ClientLine | None:
    """A splitter's line as a request or op; None for a blank line. Raises
    BadRequest for anything invalid, an over-long line included."""
    if isinstance(line, TooLong):
        raise BadRequest(f"request line longer than {max_line} bytes", scan_id(line.head))
    if not line.strip():
        return None
    return parse_line(line)


def internal_error(what: str, exc: BaseException) -> str:
    return f"internal error while handling {what}: {type(exc).__name__}: {exc}; the pool logged it and goes on"


# Said once, on a terminal, after a first line that is not JSON: what
# someone typing `hello` into `serve` needs to know.
HINT = 'hint: each stdin line is one JSON request, e.g. {"messages":[{"role":"user","content":"Hello"}]}; for a chat, run `lattice-pool chat`'


def dispatch(pool: Pool, line) -> bool:
    """False when the line is not JSON at all."""
    id_json = None
    try:
        msg = read_line(line)
        if msg is None:
            return True
        id_json = msg.id_json
        if msg.op is None:
            pool.submit(msg)
        else:
            pool.ops.op(msg)
    except BadRequest as exc:
        pool.reject(BAD_REQUEST, exc.msg, exc.id_json)
        return not exc.msg.startswith("malformed request: JSON is malformed")
    except Exception as exc:
        log.exception("stdin line failed: %r", line[:200] if isinstance(line, bytes) else line)
        pool.reject(INTERNAL, internal_error("this line", exc), id_json)
    return True


async def serve_stdin(pool: Pool, fd: int = 0) -> None:
    """Returns at EOF."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=READ_AHEAD)
    start_reader(asyncio.get_running_loop(), queue, fd)
    splitter = LineSplitter()
    hint = os.isatty(fd)
    while True:
        chunk = await queue.get()
        for line in splitter.feed(chunk) if chunk else splitter.finish():
            # Every line gets an answer on stdout, and a request may wait in
            # the pool: either can outgrow what a client that does not read
            # lets us write, so each line waits for room first.
            if pool.input_blocked():
                await pool.input_room()
            json = dispatch(pool, line)
            if hint and not isinstance(line, TooLong) and line.strip():
                hint = False
                if not json:
                    log.warning(HINT)
        if not chunk:
            log.info("stdin closed")
            return
