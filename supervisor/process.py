"""A worker child process and its three pipes, on asyncio.

Death is detected from the exit status (SubprocessProtocol.process_exited),
never from stdout EOF or Process.wait(): on CPython 3.11 wait() returns only
once every pipe is closed, so a grandchild holding stdout would hide the
worker's death. Each worker leads its own process group, so stopping it also
stops anything it spawned.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import Callable

from ipc.framing import encode_frame
from ipc.messages import ToWorker

log = logging.getLogger("lattice.process")

# One worker line: a token event, or a lifecycle event. Longer means a
# broken or hostile worker, not a protocol we speak.
MAX_WORKER_LINE = 4 * 1024 * 1024


class _Protocol(asyncio.SubprocessProtocol):
    def __init__(self, proc: "WorkerProcess"):
        self._proc = proc

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        if fd == 1:
            self._proc._stdout(data)
        else:
            self._proc.on_stderr(data)

    def process_exited(self) -> None:
        self._proc._exited()


class WorkerProcess:
    def __init__(
        self,
        on_lines: Callable[[bytes], None],
        on_stderr: Callable[[bytes], None],
        on_exit: Callable[[int | None], None],
        on_overflow: Callable[[], None],
    ):
        self.on_lines = on_lines
        self.on_stderr = on_stderr
        self.on_exit = on_exit
        self.on_overflow = on_overflow
        self.transport: asyncio.SubprocessTransport | None = None
        self.pid: int | None = None
        self.returncode: int | None = None
        self.exited = asyncio.Event()
        self.started_at = time.monotonic()
        self._partial = b""
        self._dead = False

    async def start(self, argv: list[str], env: dict[str, str]) -> None:
        loop = asyncio.get_running_loop()
        self.transport, _ = await loop.subprocess_exec(
            lambda: _Protocol(self),
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            env=env,
        )
        self.pid = self.transport.get_pid()
        self.started_at = time.monotonic()

    def _stdout(self, data: bytes) -> None:
        if self._dead:
            return
        buf = self._partial + data
        end = buf.rfind(b"\n") + 1
        self._partial = buf[end:]
        if len(self._partial) > MAX_WORKER_LINE:
            self._partial = b""
            self._dead = True
            self.on_overflow()
            return
        if end:
            self.on_lines(buf[:end])

    def _exited(self) -> None:
        self._dead = True
        # A line cut off by the death is never relayed.
        self._partial = b""
        self.returncode = self.transport.get_returncode() if self.transport else None
        self.exited.set()
        self.on_exit(self.returncode)

    def send(self, msg: ToWorker) -> bool:
        """Queues a frame without waiting: a worker that stops reading must
        not block the pool (the stall watchdog deals with it)."""
        if self._dead or self.transport is None:
            return False
        pipe = self.transport.get_pipe_transport(0)
        if pipe is None or pipe.is_closing():
            return False
        pipe.write(encode_frame(msg))
        return True

    def pause_reading(self, paused: bool) -> None:
        if self.transport is None or self._dead:
            return
        pipe = self.transport.get_pipe_transport(1)
        if pipe is None or pipe.is_closing():
            return
        if paused:
            pipe.pause_reading()
        else:
            pipe.resume_reading()

    def signal_group(self, sig: int) -> None:
        # Also after the leader exited: the group id stays reserved while any
        # member lives, so this reaches leftover grandchildren, nobody else.
        if self.pid is None:
            return
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        self.signal_group(signal.SIGKILL)

    async def stop(self, timeout: float = 5.0) -> None:
        """EOF on the request pipe (the worker exits by itself), then SIGTERM,
        then SIGKILL to the whole group."""
        if self.transport is None:
            return
        pipe = self.transport.get_pipe_transport(0)
        if pipe is not None and not pipe.is_closing():
            pipe.close()
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None:
                self.signal_group(sig)
            try:
                await asyncio.wait_for(self.exited.wait(), timeout)
                break
            except asyncio.TimeoutError:
                continue
        # Grandchildren may still hold the group; they go with it.
        self.signal_group(signal.SIGKILL)
        self.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
