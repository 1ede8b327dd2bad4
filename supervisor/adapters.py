"""The pool's side of LoRA adapters: hot reload, and the private copies.

Hot reload: watch an adapter on disk and ask its worker to re-read it.

The watch is on the adapter's parent directory, not the file: an atomic
rename-over or a delete-then-create replaces the inode, and a watch on the
old inode would never fire again. watchfiles groups the burst of events of
one save (`step`: quiet time that ends a burst), so a save is seen once.

A reload that fails right after a change is retried a few times: an
in-place rewrite can be read half written, and the writer's last event may
already be folded into the burst that triggered the failed read.

Copies: each worker keeps a copy of every adapter it loaded in full
(worker.lora.formats.AdapterReader), so a read after a restart or an
eviction survives the loss of the file; the copies live in a private
directory of this pool, one per worker, until the worker stops: at most one
copy (max_adapter_bytes) per adapter path the worker has read.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import psutil
from watchfiles import awatch

from supervisor.resolve import ModelSpec
from supervisor.slot import WorkerSlot

log = logging.getLogger("lattice.watch")

STEP_MS = 50
DEBOUNCE_MS = 400
RETRY_DELAYS = (0.2, 0.5, 1.0)

# A PEFT adapter given as its .safetensors file is configured by the JSON beside it.
_CONFIG_NAMES = ("adapter_config.json",)


class AdapterWatcher:
    def __init__(self, path: Path, reload: Callable[[], bool], missing: Callable[[], None]):
        self.path = path
        self._reload = reload
        self._missing = missing
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._retry: asyncio.TimerHandle | None = None
        self._retries_left = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        self._stop.set()
        self._cancel_retry()
        if self._task is not None:
            self._task.cancel()

    def _relevant(self, changed: str) -> bool:
        p = Path(changed)
        if p == self.path:
            return True
        if self.path.suffix == ".safetensors":
            return p.parent == self.path.parent and p.name in _CONFIG_NAMES
        return self.path in p.parents

    async def _run(self) -> None:
        root = self.path.parent
        try:
            async for changes in awatch(root, stop_event=self._stop, step=STEP_MS, debounce=DEBOUNCE_MS, recursive=self.path.is_dir()):
                if any(self._relevant(changed) for _, changed in changes):
                    self._changed()
        except FileNotFoundError:
            log.warning("cannot watch %s: its directory does not exist", root)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("watching %s failed; hot reload is off for it", self.path)

    def _changed(self) -> None:
        self._cancel_retry()
        if not self.path.exists():
            log.warning("adapter %s was deleted (or cannot be reached); the worker keeps the version it has", self.path)
            self._missing()
            return
        log.info("adapter %s changed on disk; reloading", self.path)
        self._retries_left = len(RETRY_DELAYS)
        self._reload()

    def result(self, loaded: bool) -> None:
        """The worker's answer to a reload (adapter_loaded or adapter_error)."""
        if loaded or self._retries_left <= 0 or self._stop.is_set():
            self._retries_left = 0
            return
        delay = RETRY_DELAYS[len(RETRY_DELAYS) - self._retries_left]
        self._retries_left -= 1
        self._cancel_retry()
        self._retry = asyncio.get_running_loop().call_later(delay, self._retry_now)

    def _retry_now(self) -> None:
        self._retry = None
        if self.path.exists():
            log.info("adapter %s: retrying the reload", self.path)
            self._reload()

    def _cancel_retry(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None


class AdapterWatches:
    """One AdapterWatcher per adapter path in use on each worker."""

    def __init__(self) -> None:
        # (worker key, adapter path) -> the slot it reloads, and its watcher
        self._watchers: dict[tuple, tuple[WorkerSlot, AdapterWatcher]] = {}

    def watch(self, slot: WorkerSlot, lora: Path) -> None:
        key = (slot.spec.key, str(lora))
        if key in self._watchers:
            if self._watchers[key][0] is slot:
                return
            self._watchers.pop(key)[1].stop()  # left by the slot this one replaced
        path = str(lora)
        watcher = AdapterWatcher(lora, lambda: slot.reload_adapter(path), lambda: slot.adapter_missing(path))
        self._watchers[key] = (slot, watcher)
        watcher.start()

    def unwatch(self, worker: tuple, lora: str | None = None) -> None:
        """Stops the watch of one adapter of a worker, or (lora None) all of them."""
        for key in [k for k in self._watchers if k[0] == worker and (lora is None or k[1] == lora)]:
            self._watchers.pop(key)[1].stop()

    def result(self, worker: tuple, lora: str | None, loaded: bool) -> None:
        entry = self._watchers.get((worker, lora))
        if entry is not None:
            entry[1].result(loaded)

    def stop_all(self) -> None:
        for _, watcher in self._watchers.values():
            watcher.stop()
        self._watchers.clear()


COPIES_PREFIX = "lattice-pool-adapters-"


class AdapterCopies:
    """The pool's private directory (mode 0700, under $TMPDIR) of adapter
    copies, one subdirectory per worker, in which the worker keeps a copy of
    each adapter it has read; made on first use, removed with its worker or
    with the pool. Its name carries the pool's pid, so that a later pool
    removes what a SIGKILLed one left."""

    def __init__(self) -> None:
        self._root: Path | None = None

    def dir_for(self, spec: ModelSpec) -> Path | None:
        """The directory for the worker of `spec`, asked at each start of
        it; None while the private directory cannot be made (out of file
        descriptors, say): copies are insurance, never a reason for a
        worker not to start."""
        if self._root is None:
            try:
                sweep_stale_copies()
                self._root = Path(tempfile.mkdtemp(prefix=f"{COPIES_PREFIX}{os.getpid()}-"))
            except OSError as exc:
                log.warning("no directory for adapter copies now (%s); this worker start keeps none", exc)
                return None
        return self._root / _subdir(spec)

    def forget(self, spec: ModelSpec) -> None:
        if self._root is not None:
            shutil.rmtree(self._root / _subdir(spec), ignore_errors=True)

    def remove_all(self) -> None:
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None


def sweep_stale_copies() -> None:
    """Removes the copies of pools that are gone (a SIGKILL leaves them):
    ours are the directories of our prefix, owned by us, whose pid is no
    running process. A pid taken by another process since keeps its
    directory; nothing else is touched."""
    root = Path(tempfile.gettempdir())
    try:
        found = [p for p in root.iterdir() if p.name.startswith(COPIES_PREFIX)]
    except OSError as exc:
        log.info("cannot look for stale adapter copies in %s: %s", root, exc)
        return
    for path in found:
        pid = path.name[len(COPIES_PREFIX) :].split("-", 1)[0]
        try:
            mine = path.is_dir() and not path.is_symlink() and path.stat().st_uid == os.getuid()
        except OSError:
            continue
        if mine and pid.isdigit() and not psutil.pid_exists(int(pid)):
            log.info("removing the adapter copies of pool %s, which is gone: %s", pid, path)
            shutil.rmtree(path, ignore_errors=True)


def _subdir(spec: ModelSpec) -> str:
    """The copies of one worker (one worker key)."""
    return hashlib.sha256(repr(spec.key).encode()).hexdigest()[:16]
