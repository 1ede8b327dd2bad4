"""Helpers for fault-injection tests: pools of fake workers (tests.fakeworker)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from tests.procs import pid_alive, wait_for
from tests.workerproc import ROOT, child_env

FAKE_ENV = {"LATTICE_WORKER_MODULE": "tests.fakeworker"}


class FakeModels:
    """Model dirs for fake workers and a pool config naming them."""

    def __init__(self, root: Path):
        self.root = root
        self.dirs: dict[str, Path] = {}

    def add(self, name: str, knobs: dict | list | None = None) -> Path:
        path = self.root / name
        path.mkdir()
        if knobs is not None:
            (path / "fake.json").write_text(json.dumps(knobs))
        self.dirs[name] = path
        return path

    def starts(self, name: str) -> list[int]:
        """Pids of every start of this model's worker, oldest first."""
        path = self.dirs[name] / "starts"
        return [int(p) for p in path.read_text().split()] if path.exists() else []

    def config(self, extra: str = "", preload: bool = True) -> str:
        body = extra + "\n"
        for name, path in self.dirs.items():
            body += f'\n[[models]]\nname = "{name}"\npath = "{path}"\npreload = {str(preload).lower()}\n'
        config = self.root / "pool.toml"
        config.write_text(body)
        return str(config)

    def all_gone(self) -> bool:
        return not any(pid_alive(pid) for name in self.dirs for pid in self.starts(name))


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

    def __init__(self, config: str, stderr=subprocess.DEVNULL):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "supervisor", "serve", "--config", config],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=child_env(**FAKE_ENV),
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
                return json.loads(self.out[start + 10 : end])
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
