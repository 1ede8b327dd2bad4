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
(worker.lora.formats.AdapterReader), so a restart survives the loss of the
file; the copies live in a private directory of this pool.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from watchfiles import awatch

from ipc.events import ADAPTER_ERROR, encode_event
from supervisor.job import Sink
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
    """One AdapterWatcher per worker key with an adapter."""

    def __init__(self, lines: Sink):
        self.lines = lines
        self._watchers: dict[tuple, AdapterWatcher] = {}

    def watch(self, slot: WorkerSlot) -> None:
        if slot.spec.lora is None or slot.spec.key in self._watchers:
            return

        def missing() -> None:
            msg = f"adapter {slot.lora} was deleted (or cannot be reached); the worker keeps the version it loaded"
            self.lines.write(encode_event("adapter_error", model=slot.name, lora=slot.lora, code=ADAPTER_ERROR, msg=msg))

        watcher = AdapterWatcher(slot.spec.lora, lambda: slot.set_adapter(slot.lora), missing)
        self._watchers[slot.spec.key] = watcher
        watcher.start()

    def unwatch(self, key: tuple) -> None:
        watcher = self._watchers.pop(key, None)
        if watcher is not None:
            watcher.stop()

    def result(self, key: tuple, loaded: bool) -> None:
        watcher = self._watchers.get(key)
        if watcher is not None:
            watcher.result(loaded)

    def stop_all(self) -> None:
        for watcher in self._watchers.values():
            watcher.stop()
        self._watchers.clear()


class AdapterCopies:
    """The pool's private directory (mode 0700, under $TMPDIR) of adapter
    copies, one subdirectory per worker key; made on first use, removed
    with its model or with the pool."""

    def __init__(self) -> None:
        self._root: Path | None = None

    def dir_for(self, spec: ModelSpec) -> Path | None:
        if spec.lora is None:
            return None
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="lattice-pool-adapters-"))
        return self._root / hashlib.sha256(f"{spec.path}\0{spec.lora}".encode()).hexdigest()[:16]

    def forget(self, spec: ModelSpec) -> None:
        if self._root is not None and spec.lora is not None:
            shutil.rmtree(self.dir_for(spec), ignore_errors=True)

    def remove_all(self) -> None:
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None
