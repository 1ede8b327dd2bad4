"""How the supervisor starts worker-side programs: a fresh interpreter running
a module of the `worker` package. The supervisor never imports `worker`
(or MLX), which keeps it small and lets it outlive any worker crash."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The directory holding the ipc/, worker/ and supervisor/ packages; put on the
# child's path so a source checkout works without an install.
PACKAGE_ROOT = Path(__file__).resolve().parent.parent

# Test and benchmark hook, read only here: the module the pool runs as its
# workers (fault-injection tests and bench/relay.py set it to
# tests.fakeworker). Unset in production.
WORKER_MODULE_VAR = "LATTICE_WORKER_MODULE"


def pool_worker_module() -> str:
    return os.environ.get(WORKER_MODULE_VAR) or "worker"


def worker_argv(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(PACKAGE_ROOT) + (os.pathsep + path if path else "")
    # Unbuffered stderr keeps worker log lines in order with ours.
    env["PYTHONUNBUFFERED"] = "1"
    if extra:
        env.update(extra)
    return env
