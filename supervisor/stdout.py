"""The single writer of the supervisor's stdout.

Pipes and sockets get an asyncio transport whose buffer limits drive
backpressure: above the high-water mark every source (each worker's stdout)
is paused, so a slow client slows generation instead of growing memory.
Regular files and terminals are written synchronously: a file never blocks
for long, and asyncio would switch a shared terminal to non-blocking mode
under the user's shell.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from collections.abc import Callable

log = logging.getLogger("lattice.output")

HIGH_WATER = 4 * 1024 * 1024
LOW_WATER = 1024 * 1024


class _PipeProtocol(asyncio.Protocol):
    def __init__(self, owner: Output):
        self._owner = owner

    def pause_writing(self) -> None:
        self._owner._set_paused(True)

    def resume_writing(self) -> None:
        self._owner._set_paused(False)

    def connection_lost(self, exc: Exception | None) -> None:
        self._owner._lost(exc)


class Tapped:
    """The part every pool output shares: the writes are seen by taps too
    (the control socket's event feed), before the output takes them, and
    nothing is written once it is closed."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()
        self._taps: list[Callable[[bytes], None]] = []

    def add_tap(self, tap: Callable[[bytes], None]) -> None:
        """tap(data) sees every write too."""
        self._taps.append(tap)

    def write(self, data: bytes) -> None:
        if self.closed.is_set():
            return
        for tap in self._taps:
            tap(data)
        self.take(data)

    def take(self, data: bytes) -> None:
        raise NotImplementedError


class Output(Tapped):
    def __init__(self, fd: int = 1):
        super().__init__()
        self.fd = fd
        self._writable = asyncio.Event()
        self._writable.set()
        self.paused = False
        self._transport: asyncio.WriteTransport | None = None
        self._listeners: list[Callable[[bool], None]] = []

    async def open(self) -> None:
        mode = os.fstat(self.fd).st_mode
        if (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)) and not os.isatty(self.fd):
            loop = asyncio.get_running_loop()
            pipe = os.fdopen(os.dup(self.fd), "wb", buffering=0)
            self._transport, _ = await loop.connect_write_pipe(lambda: _PipeProtocol(self), pipe)
            self._transport.set_write_buffer_limits(high=HIGH_WATER, low=LOW_WATER)

    def on_pause(self, listener: Callable[[bool], None]) -> None:
        """listener(True) when sources must stop, listener(False) to resume."""
        self._listeners.append(listener)

    def take(self, data: bytes) -> None:
        if self._transport is not None:
            self._transport.write(data)
            return
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view) :]
        except OSError as exc:
            self._lost(exc)

    def _set_paused(self, paused: bool) -> None:
        self.paused = paused
        if paused:
            self._writable.clear()
        else:
            self._writable.set()
        for listener in self._listeners:
            listener(paused)

    async def wait_writable(self) -> None:
        """Returns once the client has read us back under the high-water mark."""
        await self._writable.wait()

    def _lost(self, exc: Exception | None) -> None:
        if not self.closed.is_set():
            log.info("stdout closed (%s): the client is gone", exc or "EOF")
            self.closed.set()
            if self.paused:
                self._set_paused(False)

    async def drain(self, timeout: float = 5.0) -> None:
        """Waits (bounded) for buffered lines to reach the pipe."""
        if self._transport is None:
            return
        deadline = asyncio.get_running_loop().time() + timeout
        while self._transport.get_write_buffer_size() and not self.closed.is_set():
            if asyncio.get_running_loop().time() > deadline:
                return
            await asyncio.sleep(0.01)

    def close(self) -> None:
        # Ours to close: not a client that went away.
        self.closed.set()
        if self._transport is not None:
            self._transport.close()
