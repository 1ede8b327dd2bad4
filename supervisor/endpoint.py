"""The stdin endpoint: NDJSON lines in, requests and ops to the pool.

A thread does the blocking reads, so stdin may be a pipe, a file or a
terminal, and the event loop never sees a half line. The bounded queue
between them is the backpressure: a client that floods requests waits in
its write() instead of growing our memory.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading

from ipc.events import BAD_REQUEST
from supervisor.pool import Pool
from supervisor.requests import BadRequest, ClientLine, parse_line

log = logging.getLogger("lattice.endpoint")

MAX_LINE = 64 * 1024 * 1024
READ_SIZE = 1 << 20


class _TooLong:
    pass


TOO_LONG = _TooLong()


class LineSplitter:
    """Bytes in, complete lines out; an over-long line becomes TOO_LONG once
    and is skipped up to its newline."""

    def __init__(self, max_line: int = MAX_LINE):
        self.max_line = max_line
        self._buf = bytearray()
        self._skipping = False

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
                out.append(TOO_LONG)
            else:
                self._buf += chunk[start:nl]
                out.append(bytes(self._buf))
            self._buf.clear()
            start = nl + 1
        if not self._skipping:
            self._buf += chunk[start:]
            if len(self._buf) > self.max_line:
                self._buf.clear()
                self._skipping = True
                out.append(TOO_LONG)
        return out

    def finish(self) -> list:
        """A last line without a newline still counts at EOF."""
        rest = [] if self._skipping or not self._buf else [bytes(self._buf)]
        self._buf.clear()
        return rest


def start_reader(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, fd: int = 0) -> threading.Thread:
    def run() -> None:
        splitter = LineSplitter()
        while True:
            try:
                chunk = os.read(fd, READ_SIZE)
            except OSError as exc:
                log.warning("stdin read failed: %s", exc)
                chunk = b""
            lines = splitter.feed(chunk) if chunk else splitter.finish()
            if lines:
                asyncio.run_coroutine_threadsafe(queue.put(lines), loop).result()
            if not chunk:
                asyncio.run_coroutine_threadsafe(queue.put(None), loop).result()
                return

    thread = threading.Thread(target=run, name="stdin", daemon=True)
    thread.start()
    return thread


def read_line(line, max_line: int = MAX_LINE) -> ClientLine | None:
    """A splitter's line as a request or op; None for a blank line. Raises
    BadRequest for anything invalid, an over-long line included."""
    if line is TOO_LONG:
        raise BadRequest(f"request line longer than {max_line} bytes")
    if not line.strip():
        return None
    return parse_line(line)


def dispatch(pool: Pool, line) -> None:
    try:
        msg = read_line(line)
    except BadRequest as exc:
        pool.reject(BAD_REQUEST, exc.msg, exc.id_json)
        return
    if msg is None:
        return
    if msg.op is None:
        pool.submit(msg)
    else:
        pool.op(msg)


async def serve_stdin(pool: Pool, fd: int = 0) -> None:
    """Returns at EOF."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=16)
    start_reader(asyncio.get_running_loop(), queue, fd)
    while True:
        lines = await queue.get()
        if lines is None:
            log.info("stdin closed")
            return
        # Every line gets an answer on stdout: a client that sends without
        # reading waits in its write, instead of growing our output buffer.
        await pool.output.wait_writable()
        for line in lines:
            dispatch(pool, line)
