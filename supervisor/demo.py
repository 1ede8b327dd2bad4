"""The built-in demo model: generated once into the user's cache dir."""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

from ipc.paths import pool_cache_dir
from supervisor.child import child_env, python_module

log = logging.getLogger("lattice.demo")

DEMO_NAME = "demo"


def demo_dir() -> Path:
    return pool_cache_dir(os.environ) / "demo-model"


def ensure_demo_model() -> Path:
    path = demo_dir()
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        log.info("no model configured: serving the built-in demo model from %s", path)
        return path
    log.info("no model configured: generating the built-in demo model into %s (once)", path)
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(python_module("worker.demo.build", str(path)), env=child_env(), check=True)
    return path
