"""The adapters of one worker, as the scheduler sees them: the adapter
messages and the loads that requests need, in order, and what each request
runs with.

Everything here runs on the model's thread except the reads: adapter
messages (LoadAdapter, ReloadAdapter, UnloadAdapter) and the loads that
requests need become jobs, handed to one reader thread in order
(worker.lora.reads) and settled back on the model's thread in the same order
(`poll`, at every step), so the answers come in the order the messages
came. What is resident, and what to evict, is worker.lora.residency's.

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

Bounds: jobs waiting for the reader, at most one per adapter message and one
per adapter path that requests wait for; the resident versions are bounded
in worker.lora.residency.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ipc.events import ADAPTER_ERROR, encode_event
from ipc.messages import LoadAdapter, ReloadAdapter, UnloadAdapter
from worker.lora.formats import AdapterReader
from worker.lora.reads import Read, ReadThread
from worker.lora.residency import Entry, Residency, Version
from worker.runtime import defaults
from worker.runtime.memory import release_free_memory

log = logging.getLogger("worker")

AdapterMessage = LoadAdapter | ReloadAdapter | UnloadAdapter
_KINDS = {LoadAdapter: "load", ReloadAdapter: "reload", UnloadAdapter: "unload"}


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
    kind: str  # "load" | "reload" | "unload"
    path: str
    reply: bool  # an adapter message (answered even when nothing is read), not a request's need


class AdapterManager:
    def __init__(
        self,
        model,
        name: str,
        reader: AdapterReader | None = None,
        max_adapters: int = defaults.MAX_ADAPTERS,
        wake: Callable[[], None] = lambda: None,
    ):
        self.resident = Residency(model, max_adapters)
        self.reads = ReadThread(reader or AdapterReader(), self.resident.slots.targets, wake)
        self.name = name
        # Where adapter events go: the scheduler points it at the lines it
        # writes at the end of each step.
        self.emit: Callable[[bytes], None] = lambda line: None
        self._clock = 0  # adapter jobs queued and loads failed so far
        self._queue: deque[_Job] = deque()  # not yet with the reader
        self._prune = False
        self._trim = False
        # A read waits for room among the resident adapters, all in use.
        self.starved = False

    # -- requests -------------------------------------------------------------

    def arrival(self) -> int:
        """A request's place among adapter messages: it waits for those
        about its adapter that came before it."""
        return self._clock

    def resolve(self, lora: str | None, arrived: int) -> Version | None | _Wait | Refused:
        """What a request sent with `lora` (a path, or None for the base
        model) runs with, if it can start now."""
        if lora is None:
            return None
        entry = self.resident.entry(lora)
        if entry.pending and entry.pending[0] <= arrived:
            return WAIT
        if entry.current is not None:
            return entry.current
        if entry.failed > arrived:
            return Refused(entry.failure)
        if not entry.pending:
            self._add_job(_Job(self._next_seq(), "load", lora, reply=False))
            # Known now, so that requests behind this one are held back at once.
            self.starved = self.starved or not self.resident.has_room(entry)
        return WAIT

    def acquire(self, version: Version) -> None:
        self.resident.acquire(version)

    def release(self, version: Version) -> None:
        self.resident.release(version)

    def route(self, slots: list[int | None]) -> None:
        self.resident.slots.route(slots)

    # -- adapter messages -----------------------------------------------------

    def submit(self, msg: AdapterMessage) -> None:
        self._add_job(_Job(self._next_seq(), _KINDS[type(msg)], msg.path, reply=True))

    # -- the model's thread, every step ---------------------------------------

    @property
    def reading(self) -> bool:
        """Jobs wait or run: their results will come."""
        return bool(self._queue) or self.reads.in_flight > 0

    @property
    def has_results(self) -> bool:
        return self.reads.has_results

    def wait(self, timeout: float | None = None) -> None:
        self.reads.wait(timeout)

    def poll(self) -> bool:
        """Settles finished jobs (at the start of a step). True when a
        request's fate may have changed: the caller then reads its whole
        waiting line (`resolve`) before the next poll, which forgets what
        failed reads left behind."""
        if self._prune:
            self._prune = False
            self.resident.forget_idle()
        changed = False
        for job, read in self.reads.results():
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
        if self.resident.apply_drops() or self._trim:
            # Reads and restacking leave many freed blocks behind; RSS would
            # count them as adapter memory.
            self._trim = False
            release_free_memory()

    def figures(self) -> dict:
        return self.resident.figures()

    # -- jobs -----------------------------------------------------------------

    def _next_seq(self) -> int:
        self._clock += 1
        return self._clock

    def _add_job(self, job: _Job) -> None:
        self.resident.entry(job.path).pending.append(job.seq)
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
        entry = self.resident.entries[job.path]
        read = fallback = False
        if job.kind != "unload":
            resident = entry.occupies
            read = job.kind != "load" or not resident
            if read and not resident:
                if not self.resident.make_room(entry, evict=room):
                    return False
                entry.claimed = True
            # Not resident: a kept good copy may stand in for a file that fails.
            fallback = entry.current is None
        entry.in_flight += 1
        self.reads.put(job, job.path if read else None, fallback)
        return True

    # -- settling, on the model's thread --------------------------------------

    def _settle(self, job: _Job, read: Read | None) -> None:
        entry = self.resident.entries[job.path]
        entry.pending.remove(job.seq)
        entry.in_flight -= 1
        try:
            if job.kind == "unload":
                self._unload(entry)
            elif read is None:
                self._answer_load(entry, job)
            elif read.weights is None:
                self._failed(entry, read.error)
            else:
                self._install(entry, read)
        finally:
            if entry.in_flight == 0:
                entry.claimed = False

    def _install(self, entry: Entry, read: Read) -> None:
        if read.note is not None:
            self._error(entry.path, read.note)
        t0 = time.perf_counter()
        try:
            version = self.resident.install(entry, read.weights)
        except Exception as exc:
            log.exception("adapter %s could not be installed", entry.path)
            self._failed(entry, f"adapter {entry.path}: cannot install: {exc}")
        else:
            self._loaded(version, read.seconds + time.perf_counter() - t0)

    def _answer_load(self, entry: Entry, job: _Job) -> None:
        """A load of an adapter already resident (or read by an earlier job)."""
        if not job.reply:
            return
        if entry.current is not None:
            self.resident.touch(entry)
            self._loaded(entry.current, 0.0)
        else:
            self._error(entry.path, entry.failure or f"adapter {entry.path} could not be loaded")

    def _failed(self, entry: Entry, msg: str) -> None:
        if entry.current is None:
            entry.failed = self._next_seq()
            entry.failure = msg
            self._error(entry.path, msg)
        else:
            self._error(entry.path, f"{msg}; keeping the version loaded before (sha256 {entry.current.sha256})")

    def _unload(self, entry: Entry) -> None:
        resident = self.resident.unload(entry)
        if resident:
            log.info("adapter %s unloaded", entry.path)
        self.emit(encode_event("adapter_unloaded", model=self.name, lora=entry.path, resident=resident))

    # -- events ---------------------------------------------------------------

    def _loaded(self, version: Version, seconds: float) -> None:
        ms = int(seconds * 1000)
        log.info("adapter %s loaded: sha256=%s modules=%d bytes=%d ms=%d", version.path, version.sha256, version.modules, version.nbytes, ms)
        self.emit(
            encode_event(
                "adapter_loaded",
                model=self.name,
                lora=version.path,
                sha256=version.sha256,
                ms=ms,
                format=version.format,
                modules=version.modules,
                adapter_bytes=version.nbytes,
                config_sha256=version.config_sha256,
            )
        )

    def _error(self, path: str, msg: str) -> None:
        # The adapter_error event carries the cause to the client; a
        # warning as well would say it twice on a terminal (`chat`).
        log.info("%s", msg)
        self.emit(encode_event("adapter_error", model=self.name, lora=path, code=ADAPTER_ERROR, msg=msg))
