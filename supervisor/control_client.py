"""The client side of the control socket (supervisor.control): what `ps`,
`stop` and `unload` use to reach a running pool. Blocking, for a command
that does one thing and exits."""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import msgspec

from ipc.events import PREFIX
from ipc.worker_events import parse_event


class NoPool(Exception):
    """The pool cannot be asked; the message says why, for a person."""


class ControlConnection:
    def __init__(self, path: Path, timeout: float):
        """Connects, or raises NoPool saying why not."""
        self.path = path
        self.timeout = timeout
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(str(path))
        except OSError as exc:
            self.sock.close()
            raise NoPool(self._why(exc)) from None
        self._buf = b""

    def _why(self, exc: OSError) -> str:
        path = self.path
        if isinstance(exc, FileNotFoundError):
            return f"no lattice-pool is running (no control socket at {path})"
        if isinstance(exc, ConnectionRefusedError):
            try:
                is_socket = stat.S_ISSOCK(os.stat(path).st_mode)
            except OSError:
                is_socket = True
            if not is_socket:
                return f"{path} is not a socket"
            return f"no lattice-pool is running ({path} was left by a pool that has ended)"
        if isinstance(exc, PermissionError):
            return f"cannot connect to {path}: permission denied (a pool of another user?)"
        if isinstance(exc, socket.timeout):
            return f"the pool at {path} did not answer within {self.timeout:g}s"
        return f"cannot connect to {path}: {exc.strerror or exc}"

    def __enter__(self) -> ControlConnection:
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()

    def send(self, op: dict, *, last: bool = False) -> None:
        """last: half-close after it; replies still come."""
        try:
            self.sock.sendall(msgspec.json.encode(op) + b"\n")
            if last:
                self.sock.shutdown(socket.SHUT_WR)
        except OSError as exc:
            raise NoPool(self._why(exc)) from None

    def events(self) -> Iterator[tuple[dict, bytes]]:
        """The pool's lines on this connection (replies and the lifecycle
        events it copies), until it closes the connection."""
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                if line.startswith(PREFIX):
                    yield parse_event(line), line[len(PREFIX) :]
            try:
                chunk = self.sock.recv(65536)
            except OSError as exc:
                raise NoPool(self._why(exc)) from None
            if not chunk:
                return
            self._buf += chunk
