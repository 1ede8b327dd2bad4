"""The pool's side of LoRA adapters: hot reload, and the private copies.

Hot reload: watch the files of each adapter a worker has loaded, and ask
the worker to re-read it when they change.

One watcher serves the whole pool (FileWatcher): one thread, holding at
most one inotify instance (or FSEvents stream) at a time, with a watch on
each file of the adapters loaded now, never on a directory. A watch is
added once a worker has loaded the adapter (adapter_loaded), so a request
naming a file costs no watch, and removed when the last name using it
leaves. An atomic rename-over or a delete-then-create replaces the inode a
watch is on, so after every burst of events the watcher is armed anew on
the files' current inodes, and each file's identity (inode, size, times)
is compared with the last one seen: a change that fell between two
watchers, or a file that comes back after a delete (files that are missing
are looked for every POLL_MS), is still seen, and a change is reported once
however many events it made. watchfiles groups the burst of events of one
save (`step`: quiet time that ends a burst).

A reload that fails right after a change is retried a few times: an
in-place rewrite can be read half written, and the writer's last event may
already be folded into the burst that triggered the failed read. Only the
last failure is told (one adapter_error line per change, not one per try).

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
import threading
from collections.abc import Callable
from pathlib import Path

import psutil

# The watcher itself, not watchfiles.watch(): that arms it only on the
# first iteration, and a round must arm before it looks at the files.
from watchfiles._rust_notify import RustNotify

from supervisor.adapter_prints import Print, adapter_files, fingerprint
from supervisor.slot import WorkerSlot
from supervisor.spec import ModelSpec

log = logging.getLogger("lattice.watch")

STEP_MS = 50
DEBOUNCE_MS = 400
# How often files that are missing (deleted, not yet back) are looked for.
POLL_MS = 1000
# After the watcher itself failed (out of inotify watches, say): the wait
# before it tries again, so a lasting cause costs no busy loop.
FAILED_WAIT = 2.0
RETRY_DELAYS = (0.2, 0.5, 1.0)


class FileWatcher:
    """The pool's one watcher thread. add / remove are called on the event
    loop and only record the adapter and wake the thread; every look at the
    file system happens on the thread. `changed(adapter, exists)` is called
    on the event loop, once per change seen."""

    def __init__(self, loop: asyncio.AbstractEventLoop, changed: Callable[[str, bool], None]):
        self._loop = loop
        self._changed = changed
        self._lock = threading.Lock()
        self._adapters: set[str] = set()
        self._prints: dict[str, Print] = {}  # thread-side: the last identity seen
        # Loop-side, under the lock: each adapter's identity when the worker
        # was asked to read it, the first look's "before" (one per watched
        # adapter at most).
        self._baselines: dict[str, Print] = {}
        self._wake = threading.Event()  # the set changed, or stop
        self._stopped = False
        self._thread: threading.Thread | None = None

    def add(self, adapter: str, baseline: Print | None = None) -> None:
        """Watches `adapter`; `baseline`, its identity when the worker was
        asked to read it, makes a save between that moment and the watch's
        first look a change like any later one."""
        with self._lock:
            self._adapters.add(adapter)
            if baseline is not None and adapter not in self._prints:
                self._baselines[adapter] = baseline
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="adapter-watch", daemon=True)
            self._thread.start()
        self._wake.set()

    def remove(self, adapter: str) -> None:
        with self._lock:
            self._adapters.discard(adapter)
            self._baselines.pop(adapter, None)
        self._wake.set()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    def _run(self) -> None:
        while not self._stopped:
            try:
                self._round()
            except OSError as exc:  # out of inotify watches or instances, say
                log.warning("cannot watch adapter files now (%s); trying again in %gs", exc, FAILED_WAIT)
                self._wake.wait(FAILED_WAIT)
            except Exception:
                log.exception("the adapter watcher failed; trying again in %gs", FAILED_WAIT)
                self._wake.wait(FAILED_WAIT)

    def _round(self) -> None:
        """Arms a watcher on the files there are now and reports what
        changed since the last round; then waits, with the same watcher,
        until a change (reported, then a new round re-arms on the files'
        current inodes), a change of the set, or a missing file's return."""
        self._wake.clear()
        with self._lock:
            adapters = sorted(self._adapters)
        for gone in self._prints.keys() - set(adapters):
            del self._prints[gone]
        if not adapters:
            self._wake.wait()
            return
        files = [f for a in adapters for f in adapter_files(a)]
        present = [str(f) for f in files if f.exists()]
        if not present:
            self._report(adapters, set())
            self._wake.wait(POLL_MS / 1000)
            return
        try:
            notify = RustNotify(present, False, False, 0, False, True)
        except FileNotFoundError:
            return  # one went meanwhile: the next round looks again
        try:
            # Armed before the files are looked at: a change after the look
            # fires this watcher; one before it shows in the look.
            if self._report(adapters, set()):
                return
            timeout = POLL_MS if len(present) < len(files) else 0
            while not self._stopped:
                result = notify.watch(DEBOUNCE_MS, STEP_MS, timeout, self._wake)
                if result in ("stop", "signal"):
                    return
                touched = set() if result == "timeout" else {path for _, path in result}
                if self._report(adapters, touched) or touched:
                    return
        finally:
            notify.close()

    def _report(self, adapters: list[str], touched: set[str]) -> bool:
        """Tells the loop of each adapter whose files changed identity, or
        had an event (`touched`), since the last look; True if any did."""
        told = False
        for adapter in adapters:
            now = fingerprint(adapter)
            before = self._prints.get(adapter)
            if before is None:
                with self._lock:
                    before = self._baselines.pop(adapter, None)
            self._prints[adapter] = now
            if before is None:
                continue  # the first look, with no identity from the load: taken as what the worker read
            if now != before or any(path in touched for path, _ in now):
                told = True
                exists = os.path.exists(adapter)
                try:
                    self._loop.call_soon_threadsafe(self._changed, adapter, exists)
                except RuntimeError:  # the loop has closed: the pool is gone
                    self._stopped = True
        return told


class _Watch:
    """One adapter of one worker: what a change asks of it, and the
    retries of a reload that failed; on the event loop."""

    def __init__(self, slot: WorkerSlot, path: str):
        self.slot = slot
        self.path = path
        self._retry: asyncio.TimerHandle | None = None
        self._retries_left = 0
        self._stopped = False

    def changed(self, exists: bool) -> None:
        self._cancel_retry()
        if not exists:
            log.warning("adapter %s was deleted (or cannot be reached); the worker keeps the version it has", self.path)
            self._retries_left = 0
            self.slot.roster.adapter_missing(self.path)
            return
        log.info("adapter %s changed on disk; reloading", self.path)
        self._retries_left = len(RETRY_DELAYS)
        self.slot.roster.reload_adapter(self.path)

    def result(self, loaded: bool) -> bool:
        """The worker's answer to a reload (adapter_loaded or adapter_error);
        True when a failure will be retried, so it is not told yet."""
        if loaded or self._retries_left <= 0 or self._stopped:
            self._retries_left = 0
            return False
        delay = RETRY_DELAYS[len(RETRY_DELAYS) - self._retries_left]
        self._retries_left -= 1
        self._cancel_retry()
        self._retry = asyncio.get_running_loop().call_later(delay, self._retry_now)
        return True

    def _retry_now(self) -> None:
        self._retry = None
        log.info("adapter %s: retrying the reload", self.path)
        if not self.slot.roster.reload_adapter(self.path):
            self._retries_left = 0

    def stop(self) -> None:
        self._stopped = True
        self._cancel_retry()

    def _cancel_retry(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None


class AdapterWatches:
    """The adapters each worker has loaded, watched through one FileWatcher."""

    def __init__(self) -> None:
        # (worker key, adapter path) -> its watch; bounded by the names the
        # workers serve (max_names each).
        self._watches: dict[tuple, _Watch] = {}
        self._files: FileWatcher | None = None

    def watch(self, slot: WorkerSlot, lora: str, baseline: Print | None = None) -> None:
        """Watches `lora` of this slot's worker; `baseline`: the files'
        identity when the worker was asked to read them (FileWatcher.add)."""
        key = (slot.spec.key, lora)
        current = self._watches.get(key)
        if current is not None:
            if current.slot is slot:
                return
            current.stop()  # left by the slot this one replaced
        self._watches[key] = _Watch(slot, lora)
        if self._files is None:
            self._files = FileWatcher(asyncio.get_running_loop(), self._changed)
        self._files.add(lora, baseline)

    def unwatch(self, worker: tuple, lora: str | None = None) -> None:
        """Stops the watch of one adapter of a worker, or (lora None) all of them."""
        for key in [k for k in self._watches if k[0] == worker and (lora is None or k[1] == lora)]:
            self._watches.pop(key).stop()
            if self._files is not None and not any(k[1] == key[1] for k in self._watches):
                self._files.remove(key[1])

    def result(self, worker: tuple, lora: str | None, loaded: bool) -> bool:
        """A reload's answer; True when its failure is retried, not told."""
        entry = self._watches.get((worker, lora))
        return entry is not None and entry.result(loaded)

    def _changed(self, adapter: str, exists: bool) -> None:
        for (_, lora), entry in list(self._watches.items()):
            if lora == adapter:
                entry.changed(exists)

    def stop_all(self) -> None:
        for entry in self._watches.values():
            entry.stop()
        self._watches.clear()
        if self._files is not None:
            self._files.stop()


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
