from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import install_tag, tagged_processes, wait_for
from tests.workerproc import ROOT, child_env

TAG = install_tag()
_long_lived: set[int] = set()


def build_demo_model(path: Path, *args: str) -> Path:
    """A demo model made by the real `lattice-pool demo-model` command."""
    subprocess.run(
        [sys.executable, "-m", "supervisor", "demo-model", str(path), *args],
        check=True,
        env=child_env(),
        cwd=ROOT,
        capture_output=True,
    )
    return path


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(models_dir) -> Path:
    return build_demo_model(models_dir / "tiny")


@pytest.fixture(scope="session")
def tiny_q4_model(models_dir) -> Path:
    return build_demo_model(models_dir / "tiny-q4", "--q4")


@pytest.fixture(scope="session")
def second_model(models_dir) -> Path:
    return build_demo_model(models_dir / "tiny-b", "--seed", "1")


@pytest.fixture(scope="session")
def small_model(models_dir) -> Path:
    return build_demo_model(models_dir / "small", "--size", "small")


@pytest.fixture
def spawn_pool():
    """Starts `lattice-pool serve` processes; kills any a failing test left."""
    from tests.poolproc import PoolProc

    made = []

    def make(*args, **kwargs):
        pool = PoolProc(*args, **kwargs)
        made.append(pool)
        return pool

    yield make
    for pool in made:
        pool.kill()


def keep_alive_across_tests(pid: int) -> None:
    """Lets a module- or session-scoped fixture own a process across tests."""
    _long_lived.add(pid)


def release(pid: int) -> None:
    _long_lived.discard(pid)


@pytest.fixture(autouse=True)
def no_leaked_processes():
    """No worker, supervisor or fake worker outlives the test that started it."""
    yield

    def leaked():
        return [p for p in tagged_processes(TAG) if p.pid not in _long_lived and _root_pid(p) not in _long_lived]

    try:
        wait_for(lambda: not leaked(), timeout=15, message="test processes to exit")
    except AssertionError:
        left = leaked()
        described = [_describe(p) for p in left]
        for p in left:
            try:
                p.kill()
            except Exception:
                pass
        pytest.fail(f"processes outlived their test: {described}")


def _describe(proc) -> str:
    try:
        return f"{proc.pid} {' '.join(proc.cmdline())}"
    except Exception:
        return str(proc.pid)


def _root_pid(proc) -> int:
    try:
        parent = proc.parent()
        return parent.pid if parent else -1
    except Exception:
        return -1


def pytest_sessionfinish(session, exitstatus):
    left = tagged_processes(TAG)
    for p in left:
        try:
            p.kill()
        except Exception:
            pass
    if left and exitstatus == 0:
        session.exitstatus = 1
        print(f"\nprocesses left at session end: {[p.pid for p in left]}", file=sys.stderr)
