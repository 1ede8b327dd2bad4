"""Pools of fake workers (tests.fakeworker), for fault-injection tests and
relay benchmarks: model dirs whose fake.json scripts each start."""

from __future__ import annotations

import json
from pathlib import Path

from harness.procs import pid_alive
from supervisor.child import WORKER_MODULE_VAR

FAKE_ENV = {WORKER_MODULE_VAR: "tests.fakeworker"}


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
