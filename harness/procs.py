"""Process bookkeeping: the environment of every child we start, and a tag
in it, so that leaks are found even after re-parenting to init."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil

from supervisor.child import PACKAGE_ROOT, child_env

ROOT = PACKAGE_ROOT
TAG_VAR = "LATTICE_TEST_TAG"
__all__ = ["ROOT", "child_env", "build_demo_model", "install_tag", "tagged_processes", "wait_for", "said", "pid_alive", "close_stdin"]


def build_demo_model(path: Path, *args: str) -> Path:
    """A demo model made by the real `lattice-pool demo-model` command."""
    subprocess.run([sys.executable, "-m", "supervisor", "demo-model", str(path), *args], check=True, env=child_env(), cwd=ROOT, capture_output=True)
    return path


def install_tag() -> str:
    """The tag this test process gives every child (and finds leaks by).
    Under pytest-xdist each worker process adds its own name to the tag it
    inherited, so one worker's leak check never counts another's children."""
    tag = os.environ.get(TAG_VAR) or uuid.uuid4().hex
    xdist_worker = os.environ.get("PYTEST_XDIST_WORKER")
    if xdist_worker and not tag.endswith(f"-{xdist_worker}"):
        tag = f"{tag}-{xdist_worker}"
    os.environ[TAG_VAR] = tag
    return tag


def tagged_processes(tag: str) -> list[psutil.Process]:
    me = os.getpid()
    found = []
    for proc in psutil.process_iter(["pid"]):
        if proc.pid == me:
            continue
        try:
            if proc.environ().get(TAG_VAR) == tag and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def wait_for(predicate, timeout: float, interval: float = 0.02, message: str = "condition"):
    """Polls predicate until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)


def said(stderr: bytearray, text: bytes, timeout: float = 30.0) -> bool:
    """Waits until `text` is in a process's stderr as read so far. The pool
    writes its workers' stderr from a thread of its own, and a reader thread
    collects it here: a line can land after events the process wrote later."""
    try:
        return wait_for(lambda: text in stderr, timeout, message=f"{text!r} on stderr")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; its last lines:\n{bytes(stderr[-3000:]).decode(errors='replace')}") from None


async def async_wait_for(predicate, timeout: float, interval: float = 0.01, message: str = "condition"):
    """wait_for inside an event loop: polls without blocking the loop."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        await asyncio.sleep(interval)


def pid_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def close_stdin(proc) -> None:
    """EOF for a child: the signal every lattice-pool process stops on."""
    if proc.stdin and not proc.stdin.closed:
        try:
            proc.stdin.close()
        except BrokenPipeError:
            pass
