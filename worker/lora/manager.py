"""The adapters of one worker: which are resident, which version each row
runs with, and the reader thread that loads them off the token path.

Everything here runs on the model's thread except the reads: adapter
messages (LoadAdapter, ReloadAdapter, UnloadAdapter, SetAdapter) and the
loads that requests need become jobs, handed to one reader thread in order
and settled back on the model's thread in the same order (`poll`, at every
step), so the answers come in the order the messages came.

- Up to `max_adapters` adapters are resident. A read of one more evicts the
  least recently used that no row runs with; when every resident adapter is
  in use, or the batch has no room for the request that needs the read, the
  read waits.
- A request waits for every message about its adapter sent before it, then
  runs with that adapter's current version; a request for an adapter that
  is not resident waits while it is read, and one whose file fails gets an
  `adapter_error` line (unless the pool kept a good copy, which then stands
  in, and the adapter_error event says so).
- A reload puts the new version in a new slot: rows already running keep
  theirs (a request never mixes versions), new rows get the new one, and
  the old version goes once its last row ends. A bad file keeps the
  previous version; other adapters are untouched.
- The default adapter (`--lora`, SetAdapter) is what a request without a
  `lora` field runs with.

Bounds: at most `max_adapters` current versions, plus superseded ones still
used by running rows (at most one per row); one read job per adapter path
that requests wait for.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from ipc.events import ADAPTER_ERROR, encode_event
from ipc.messages import LoadAdapter, ReloadAdapter, SetAdapter, UnloadAdapter
from worker.lora.formats import AdapterError, AdapterReader, AdapterWeights
from worker.lora.layers import LoRASlots
from worker.lora.residency import Entry, Version, choose_victim
from worker.runtime import defaults
from worker.runtime.memory import release_free_memory

log = logging.getLogger("worker")

AdapterMessage = LoadAdapter | ReloadAdapter | UnloadAdapter | SetAdapter


class _Wait:
    def __repr__(self) -> str:
        return "WAIT"


WAIT = _Wait()
"""What `resolve` says about a request that cannot start yet."""


@dataclass(frozen=True)
class Refused:
    """A request whose adapter cannot be loaded; `msg` says why."""

    msg: str


@dataclass(eq=False)
class _Job:
    seq: int
    kind: str  # "load" | "reload" | "unload" | "set"
    path: str | None  # None only for SetAdapter(None)
    reply: bool  # an adapter message (answered even when nothing is read), not a request's need
    read: bool = False
    fallback: bool = False  # the adapter is not resident: a kept good copy may stand in


@dataclass
class Read:
    """An adapter file read: its weights, or why not."""

    weights: AdapterWeights | None = None
    error: str | None = None
    note: str | None = None  # why the last good copy stood in
    seconds: float = 0.0


class AdapterManager:
    def __init__(
        self,
        model,
        name: str,
        reader: AdapterReader | None = None,
        max_adapters: int = defaults.MAX_ADAPTERS,
        wake: Callable[[], None] = lambda: None,
    ):
        self.slots = LoRASlots(model)
        self.name = name
        self.max_adapters = max(1, max_adapters)
        # Where adapter events go: the scheduler points it at the lines it
        # writes at the end of each step.
        self.emit: Callable[[bytes], None] = lambda line: None
        self._reader = reader or AdapterReader()
        self._wake = wake
        self._entries: dict[str, Entry] = {}
        self._clock = 0  # adapter jobs queued and loads failed so far
        self._tick = 0  # uses, for least recently used
        self._next_slot = 0
        self._queue: deque[_Job] = deque()  # not yet with the reader
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[_Job, Read | None]] = queue.SimpleQueue()
        self._result = threading.Event()
        self._in_flight = 0
        self._thread: threading.Thread | None = None
        self._drops: set[int] = set()  # slots to empty
        self._prune = False
        self._trim = False
        # A read waits for room among the resident adapters, all in use.
        self.starved = False
        self.default: str | None = None
        self._default_seq = 0
        self._default_pending: deque[int] = deque()

    # -- requests -------------------------------------------------------------

    def arrival(self) -> int:
        """A request's place among adapter messages: it waits for those
        about its adapter that came before it."""
        return self._clock

    def resolve(self, lora, arrived: int) -> Version | None | _Wait | Refused:
        """What a request sent with `lora` (a path, None for the base model,
        or msgspec.UNSET for the default) runs with, if it can start now."""
        if lora is msgspec.UNSET:
            if self._default_pending and self._default_pending[0] <= arrived:
                return WAIT
            lora = self.default
        if lora is None:
            return None
        entry = self._entry(lora)
        if entry.pending and entry.pending[0] <= arrived:
            return WAIT
        if entry.current is not None:
            return entry.current
        if entry.failed > arrived:
            return Refused(entry.failure)
        if not entry.pending:
            self._add_job(_Job(self._next_seq(), "load", lora, reply=False))
            # Known now, so that requests behind this one are held back at once.
            self.starved = self.starved or not self._has_room(entry)
        return WAIT

    def acquire(self, version: Version) -> None:
        version.rows += 1
        self._touch(self._entries[version.path])

    def release(self, version: Version) -> None:
        version.rows -= 1
        if version.retired and version.rows == 0:
            self._drops.add(version.slot)

    def route(self, slots: list[int | None]) -> None:
        self.slots.route(slots)

    # -- adapter messages -----------------------------------------------------

    def submit(self, msg: AdapterMessage) -> None:
        kind = {LoadAdapter: "load", ReloadAdapter: "reload", UnloadAdapter: "unload", SetAdapter: "set"}[type(msg)]
        job = _Job(self._next_seq(), kind, msg.path, reply=True)
        if kind == "set":
            self._default_pending.append(job.seq)
        self._add_job(job)

    def preload(self, path: str, weights: AdapterWeights) -> Version:
        """Installs an adapter read at start-up as the default one."""
        entry = self._entry(path)
        version = self._install(entry, weights)
        self.default = path
        return version

    # -- the model's thread, every step ---------------------------------------

    @property
    def reading(self) -> bool:
        """Jobs wait or run: their results will come."""
        return bool(self._queue) or self._in_flight > 0

    @property
    def has_results(self) -> bool:
        return not self._done.empty()

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until a job has finished (in-process drivers; the worker
        sleeps on its inbox, which `wake` feeds)."""
        self._result.wait(timeout)

    def poll(self) -> bool:
        """Settles finished jobs (at the start of a step). True when a
        request's fate may have changed: the caller then reads its whole
        waiting line (`resolve`) before the next poll, which forgets what
        failed reads left behind."""
        if self._prune:
            self._prune = False
            for path in [p for p, e in self._entries.items() if e.idle]:
                del self._entries[path]
        changed = False
        self._result.clear()
        while not self._done.empty():
            job, read = self._done.get()
            self._settle(job, read)
            changed = self._prune = self._trim = True
        return changed

    def dispatch(self, room: bool) -> None:
        """Hands out the jobs that may start and empties the slots of
        versions no row runs with any more (at the end of a step, after the
        admission). A read that must evict an adapter waits while the batch
        has no `room` for the request that needs it: adapters read but not
        yet used are then never evicted for another (no thrashing)."""
        if self._queue:
            self._hand_out(room)
        self.starved = bool(self._queue)
        if self._apply_drops() or self._trim:
            # Reads and restacking leave many freed blocks behind; RSS would
            # count them as adapter memory.
            self._trim = False
            release_free_memory()

    # -- jobs -----------------------------------------------------------------

    def _next_seq(self) -> int:
        self._clock += 1
        return self._clock

    def _entry(self, path: str) -> Entry:
        entry = self._entries.get(path)
        if entry is None:
            entry = self._entries[path] = Entry(path)
        return entry

    def _touch(self, entry: Entry) -> None:
        self._tick += 1
        entry.last_used = self._tick

    def _add_job(self, job: _Job) -> None:
        if job.path is not None:
            self._entry(job.path).pending.append(job.seq)
        self._queue.append(job)

    def _hand_out(self, room: bool) -> None:
        """Jobs go to the reader in order; one that needs a place among the
        resident adapters while none can be freed waits, and so do the
        later jobs about the same path."""
        blocked: set[str] = set()
        waiting: deque[_Job] = deque()
        for job in self._queue:
            if job.path in blocked or not self._start(job, room):
                blocked.add(job.path)
                waiting.append(job)
        self._queue = waiting

    def _start(self, job: _Job, room: bool) -> bool:
        entry = self._entries[job.path] if job.path is not None else None
        if entry is not None and job.kind != "unload":
            resident = entry.occupies
            job.read = job.kind != "load" or not resident
            if job.read and not resident:
                if not self._make_room(entry, evict=room):
                    return False
                entry.claimed = True
            job.fallback = entry.current is None
        if entry is not None:
            entry.in_flight += 1
        self._in_flight += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._read_loop, name="adapter-loader", daemon=True)
            self._thread.start()
        self._jobs.put(job)
        return True

    def _has_room(self, entry: Entry) -> bool:
        full = sum(e.occupies for e in self._entries.values()) >= self.max_adapters
        return not full or choose_victim(self._entries.values(), keep=entry.path) is not None

    def _make_room(self, entry: Entry, evict: bool) -> bool:
        if sum(e.occupies for e in self._entries.values()) < self.max_adapters:
            return True
        victim = choose_victim(self._entries.values(), keep=entry.path) if evict else None
        if victim is None:
            return False
        log.info("adapter %s evicted (least recently used) for %s", victim.path, entry.path)
        self._retire(victim.current)
        victim.current = None
        return True

    # -- the reader thread ----------------------------------------------------

    def _read_loop(self) -> None:
        while True:
            job = self._jobs.get()
            read = self.read(job.path, job.fallback) if job.read else None
            self._done.put((job, read))
            self._result.set()
            self._wake()

    def read(self, path_str: str, fallback: bool) -> Read:
        """Reads and checks an adapter file (any thread). With `fallback`,
        the pool's last good copy of it stands in for a file that fails."""
        t0 = time.perf_counter()
        path = Path(path_str).expanduser()
        targets = self.slots.targets
        try:
            try:
                return Read(weights=self._reader.read(path, targets), seconds=time.perf_counter() - t0)
            except AdapterError as exc:
                first = exc
                kept = self._reader.read_last_good(path, targets) if fallback else None
                if kept is None:
                    return Read(error=str(exc))
                weights, copy = kept
                log.warning("%s; using the last good copy of it, kept in %s", exc, copy)
                note = f"{exc}; using the last good copy of it (sha256 {weights.sha256})"
                return Read(weights=weights, note=note, seconds=time.perf_counter() - t0)
        except AdapterError as exc:
            log.warning("the last good copy of adapter %s is unusable too: %s", path_str, exc)
            return Read(error=str(first))
        except Exception as exc:  # the worker keeps serving whatever a file holds
            log.exception("adapter %s could not be read", path_str)
            return Read(error=f"adapter {path_str}: {exc}")

    # -- settling, on the model's thread --------------------------------------

    def _settle(self, job: _Job, read: Read | None) -> None:
        self._in_flight -= 1
        if job.kind == "set":
            self._default_pending.remove(job.seq)
        entry = self._entries[job.path] if job.path is not None else None
        if entry is not None:
            entry.pending.remove(job.seq)
            entry.in_flight -= 1
        try:
            if entry is None:
                self._set_default(job, None)
                self._loaded(None, None, 0.0)
            elif job.kind == "unload":
                self._unload(entry)
            elif read is None:
                self._answer_load(entry, job)
            elif read.weights is None:
                self._failed(entry, read.error)
            else:
                if read.note is not None:
                    self._error(entry.path, read.note)
                t0 = time.perf_counter()
                try:
                    version = self._install(entry, read.weights)
                except Exception as exc:
                    log.exception("adapter %s could not be installed", entry.path)
                    self._failed(entry, f"adapter {entry.path}: cannot install: {exc}")
                else:
                    if job.kind == "set":
                        self._set_default(job, entry.path)
                    self._loaded(entry.path, version, read.seconds + time.perf_counter() - t0)
        finally:
            if entry is not None and entry.in_flight == 0:
                entry.claimed = False

    def _answer_load(self, entry: Entry, job: _Job) -> None:
        """A load of an adapter already resident (or read by an earlier job)."""
        if not job.reply:
            return
        if entry.current is not None:
            self._touch(entry)
            self._loaded(entry.path, entry.current, 0.0)
        else:
            self._error(entry.path, entry.failure or f"adapter {entry.path} could not be loaded")

    def _failed(self, entry: Entry, msg: str) -> None:
        if entry.current is None:
            entry.failed = self._next_seq()
            entry.failure = msg
            self._error(entry.path, msg)
        else:
            self._error(entry.path, f"{msg}; keeping the version loaded before (sha256 {entry.current.sha256})")

    def _install(self, entry: Entry, weights: AdapterWeights) -> Version:
        old = entry.current
        if old is not None and old.key == weights.key:
            return old  # the same content again: nothing changes
        slot = self._next_slot
        drops = set(self._drops)
        self.slots.update(add={slot: weights}, drop=drops)
        self._drops -= drops
        self._next_slot += 1
        version = Version(
            slot=slot,
            path=entry.path,
            sha256=weights.sha256,
            config_sha256=weights.config_sha256,
            key=weights.key,
            format=weights.format,
            modules=len(weights.pairs),
            nbytes=self.slots.own_bytes(weights),
        )
        entry.current = version
        entry.failed, entry.failure = -1, ""
        if old is not None:
            self._retire(old)
        self._touch(entry)
        return version

    def _retire(self, version: Version) -> None:
        """No longer current: its slot is emptied once no row runs with it."""
        version.retired = True
        if version.rows == 0:
            self._drops.add(version.slot)

    def _unload(self, entry: Entry) -> None:
        was = entry.current
        if was is not None:
            self._retire(was)
            entry.current = None
            log.info("adapter %s unloaded", entry.path)
        self.emit(encode_event("adapter_unloaded", model=self.name, lora=entry.path, resident=was is not None))

    def _set_default(self, job: _Job, path: str | None) -> None:
        # SetAdapters can settle out of order (one may wait for room); the
        # last one sent decides.
        if job.seq > self._default_seq:
            self._default_seq = job.seq
            self.default = path

    def _apply_drops(self) -> bool:
        if not self._drops:
            return False
        drops = set(self._drops)
        try:
            self.slots.update(drop=drops)
        except Exception:
            log.exception("adapter slots %s could not be emptied; trying again later", sorted(drops))
            return False
        self._drops -= drops
        return True

    # -- events and figures ---------------------------------------------------

    def _loaded(self, path: str | None, version: Version | None, seconds: float) -> None:
        ms = int(seconds * 1000)
        if version is None:
            log.info("default adapter: none (the base model) ms=%d", ms)
        else:
            log.info("adapter %s loaded: sha256=%s modules=%d bytes=%d ms=%d", path, version.sha256, version.modules, version.nbytes, ms)
        self.emit(
            encode_event(
                "adapter_loaded",
                model=self.name,
                lora=path,
                sha256=version.sha256 if version else None,
                ms=ms,
                format=version.format if version else None,
                modules=version.modules if version else 0,
                adapter_bytes=version.nbytes if version else 0,
                config_sha256=version.config_sha256 if version else None,
            )
        )

    def _error(self, path: str, msg: str) -> None:
        # The adapter_error event carries the cause to the client; a
        # warning as well would say it twice on a terminal (`chat`).
        log.info("%s", msg)
        self.emit(encode_event("adapter_error", model=self.name, lora=path, code=ADAPTER_ERROR, msg=msg))

    def figures(self) -> dict:
        """For worker_stats: the bytes of every adapter array held (padding
        and versions still used by running rows included), and each resident
        adapter with its own bytes."""
        resident = sorted((e.current for e in self._entries.values() if e.current is not None), key=lambda v: v.path)
        return {
            "adapter_bytes": self.slots.nbytes,
            "adapters": [
                {"lora": v.path, "sha256": v.sha256, "config_sha256": v.config_sha256, "bytes": v.nbytes, "rows": v.rows, "default": v.path == self.default}
                for v in resident
            ],
            "max_adapters": self.max_adapters,
        }
