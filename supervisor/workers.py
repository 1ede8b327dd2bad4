"""The pool's table of workers: which worker slots exist, admission under
max_loaded and memory_budget, eviction, stopping, the housekeeping round
(stall watchdog, keep_alive, stats) and what the slots tell (SlotEvents).

Slots are keyed by the worker a name needs (its base model and the worker's
settings, ModelSpec.key), so every name on one base model shares one worker
(docs/adapters.md). Admission, eviction and keep_alive count workers, not names. The
pool owns one `Workers`; the requests' accounting and the front ends'
questions stay with the pool, which this room tells through its methods.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import statistics
import time
from collections.abc import Coroutine
from typing import Protocol

import psutil

from ipc.events import INSUFFICIENT_MEMORY, INTERNAL, UNLOADED
from ipc.worker_events import Done
from supervisor.adapters import AdapterCopies, AdapterWatches
from supervisor.child import worker_command
from supervisor.config import Config, parse_size
from supervisor.job import Job
from supervisor.names import Name
from supervisor.policy import (
    Evict,
    FailedRow,
    NoFit,
    Resident,
    RestartPolicy,
    default_max_loaded,
    failed_rows_to_drop,
    footprint_of,
    make_room,
    memory_to_share,
    promised,
)
from supervisor.resolve import Resolver
from supervisor.slot import WorkerSlot
from supervisor.spec import ModelSpec
from supervisor.states import LIVE, State
from supervisor.status import StatusRow, stats_event, status_row
from supervisor.stderr import relay_worker_stderr
from supervisor.stdout import Output

log = logging.getLogger("lattice.pool")

# Python, MLX and the tokenizer cost about this much before any weights;
# replaced by measurements (held memory minus weights, policy.footprint)
# once a worker has reported.
DEFAULT_RUNTIME_BYTES = 256 * 1024 * 1024
HOUSEKEEPING_INTERVAL = 0.25
STATS_REFRESH_INTERVAL = 5.0


class PoolObserver(Protocol):
    """Told of what the pool counts (supervisor.metrics is one), labelled by
    the worker's spec (None: no model was resolved) and the surface the
    request came through (supervisor.pool.SURFACES); every call comes from
    the event loop thread."""

    def request_done(self, spec: ModelSpec, done: Done, surface: str) -> None: ...

    def error(self, spec: ModelSpec | None, code: str, surface: str) -> None: ...

    def adapter_event(self, spec: ModelSpec, loaded: bool) -> None:
        """An adapter_loaded (True) or adapter_error line written for the name `spec`."""

    def restarted(self, spec: ModelSpec) -> None: ...


class PoolSide(Protocol):
    """What the workers read of the pool (supervisor.pool.Pool), and tell it."""

    config: Config
    output: Output
    resolver: Resolver
    observers: list[PoolObserver]
    stats_interval: float | None

    def spawn(self, coro: Coroutine) -> asyncio.Task: ...

    def reject(self, code: str, msg: str, id_json: str | None) -> None: ...

    def note_error(self, spec: ModelSpec | None, code: str | None, surface: str = "stdin") -> None: ...

    def unload(self, spec: ModelSpec, reason: str) -> None: ...

    def request_ended(self, job: Job) -> None: ...

    def check_quiet(self) -> None:
        """A worker has room now: the pool checks whether nothing is left."""

    def idless_waiting(self, spec: ModelSpec) -> int: ...


def held(slot: WorkerSlot) -> int:
    """The memory the slot's worker last reported holding (0: none yet)."""
    return footprint_of(slot.stats) if slot.stats else 0


class Workers:
    def __init__(self, pool: PoolSide, rng: random.Random):
        self.pool = pool
        config = pool.config
        self.restart_policy = RestartPolicy()
        self.rng = rng
        self.memory_budget = parse_size(config.memory_budget)
        self.total_memory = psutil.virtual_memory().total  # for the default max_loaded
        self.slots: dict[tuple, WorkerSlot] = {}
        self.watches = AdapterWatches()
        self.copies = AdapterCopies()
        self._numbers = itertools.count(1)
        self._admission = asyncio.Lock()
        self._room = asyncio.Event()

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        return self.pool.spawn(coro)

    def pause_reading(self, paused: bool) -> None:
        for slot in self.slots.values():
            slot.pause_reading(paused)

    # -- SlotEvents ----------------------------------------------------------------

    def request_ended(self, slot: WorkerSlot, job: Job) -> None:
        self.pool.request_ended(job)

    def request_done(self, slot: WorkerSlot, job: Job, done: Done) -> None:
        for observer in self.pool.observers:
            observer.request_done(job.spec, done, job.surface)

    def error_counted(self, slot: WorkerSlot, job: Job, code: str | None) -> None:
        self.pool.note_error(slot.spec, code, job.surface)

    def adapter_event(self, slot: WorkerSlot, lora: str | None, specs: list[ModelSpec], loaded: bool) -> bool:
        if self.watches.result(slot.spec.key, lora, loaded):
            return True  # a failed reload that its watch tries again: told if the last try fails
        for observer in self.pool.observers:
            for spec in specs:
                observer.adapter_event(spec, loaded)
        if loaded and lora is not None and self.slots.get(slot.spec.key) is slot and slot.roster.uses(lora):
            # Watched from the moment its worker holds it, not before: a
            # request naming a file that never loads costs no watch.
            self.watches.watch(slot, lora, slot.roster.read_prints.get(lora))
        return False

    def restarted(self, slot: WorkerSlot) -> None:
        # Once per worker, under the name `ps` lists it by: its first name
        # without adapter, else its first.
        names = sorted(slot.names.values(), key=lambda n: (n.lora is not None, n.name, n.lora or ""))
        spec = names[0].spec if names else slot.spec
        for observer in self.pool.observers:
            observer.restarted(spec)

    def idle(self, slot: WorkerSlot) -> None:
        self._room.set()
        self.pool.check_quiet()

    def worker_stderr(self, data: bytes) -> None:
        relay_worker_stderr(data)

    # -- admission and eviction ---------------------------------------------------

    def slot_for(self, spec: ModelSpec) -> WorkerSlot:
        """The worker slot of the name `spec`, with the name joined; the
        first name of a worker creates its slot and starts its admission."""
        slot = self.slots.get(spec.key)
        if slot is None:
            command = lambda: worker_command(spec, self.pool.config, self.copies.dir_for(spec), self._held_elsewhere(spec.key))  # noqa: E731
            slot = WorkerSlot(spec, self, self.pool.output, command, self.restart_policy, self.rng, next(self._numbers))
            slot.pause_reading(self.pool.output.paused)
            self.slots[spec.key] = slot
            slot.roster.join(spec)
            self.pool.spawn(self._admit(slot))
        elif spec.name_key not in slot.names:
            slot.roster.join(spec)
            self._trim_names(slot, spec)
        return slot

    def _trim_names(self, slot: WorkerSlot, joined: ModelSpec) -> None:
        """Past max_names, the least recently used names with no request
        queued or running leave the worker (names with requests stay: they
        are bounded by the queues)."""
        limit = self.pool.config.max_names
        excess = len(slot.names) - limit
        if excess <= 0:
            return
        idle = [n for n in slot.names.values() if n.spec.name_key != joined.name_key and slot.traffic.waiting(n.spec) == (0, 0)]
        for name in sorted(idle, key=lambda n: n.last_used)[:excess]:
            log.info("model=%s lora=%s: leaves worker %d, which serves max_names (%d) names", name.name, name.lora, slot.number, limit)
            self.pool.unload(name.spec, f"left its worker, which serves max_names ({limit}) names, as the least recently used one")

    def _estimate_bytes(self, spec: ModelSpec) -> int:
        try:
            weights = sum(p.stat().st_size for p in spec.path.glob("model*.safetensors"))
        except OSError as exc:
            # Out of file descriptors, say: an estimate is no reason to keep
            # a model from starting; its worker will say what is wrong.
            log.warning("model=%s: cannot size the weights in %s: %s", spec.name, spec.path, exc)
            weights = 0
        measured = [held(s) - s.stats.weights_bytes for s in self.slots.values() if held(s) and s.state in LIVE]
        return weights + (int(statistics.median(measured)) if measured else DEFAULT_RUNTIME_BYTES)

    def _held_elsewhere(self, key: object) -> int:
        """What the other workers on this machine, live or restarting, hold
        or may take of its compute memory as the worker of `key` starts: the
        promise of its last ready line (policy.promised; a worker started
        again takes what it took), or before one, its estimated footprint.
        A model split over processes (its ranks may be on other hosts) is
        not counted."""
        total = 0
        for s in self.slots.values():
            if s.spec.key == key or s.spec.group is not None or not (s.state in LIVE or s.state == State.RESTARTING):
                continue
            told = promised(s.ready)
            total += told if told is not None else self._estimate_bytes(s.spec)
        return total

    def _residents(self, exclude: WorkerSlot) -> list[Resident]:
        return [
            Resident(
                key=s.spec.key,
                idle=s.traffic.idle,
                last_used=s.last_used,
                memory_bytes=held(s) or self._estimate_bytes(s.spec),
            )
            for s in self.slots.values()
            if s is not exclude and (s.state in LIVE or s.state == State.RESTARTING)
        ]

    def _memory_to_share(self) -> int:
        """The machine's memory, or the device's that live workers report
        computing on (a model split over processes spans devices: not
        counted)."""
        devices = [s.stats.device_memory_bytes for s in self.slots.values() if s.state in LIVE and s.stats is not None and s.stats.ranks is None]
        return memory_to_share(self.total_memory, devices)

    async def _admit(self, slot: WorkerSlot) -> None:
        """Makes room under max_loaded / memory_budget, then starts the worker.
        Anything unexpected on the way ends the requests waiting for it with
        `internal` and forgets the slot, so the next request or load starts
        afresh: a model never waits unanswered in `unloaded`."""
        try:
            await self._make_room_and_start(slot)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("model=%s: admission failed", slot.name)
            if self.slots.get(slot.spec.key) is slot:
                del self.slots[slot.spec.key]
            await self.stop(slot, f"could not be started: internal error ({type(exc).__name__}: {exc})", INTERNAL)

    async def _make_room_and_start(self, slot: WorkerSlot) -> None:
        while True:
            async with self._admission:
                if self.slots.get(slot.spec.key) is not slot or slot.state != State.UNLOADED:
                    return
                residents = self._residents(slot)
                need = self._estimate_bytes(slot.spec)
                max_loaded = self.pool.config.max_loaded
                if max_loaded is None and self.memory_budget is None:
                    max_loaded = default_max_loaded(self._memory_to_share(), [r.memory_bytes for r in residents] + [need])
                decision = make_room(residents, need_bytes=need, max_loaded=max_loaded, memory_budget=self.memory_budget)
                if isinstance(decision, NoFit):
                    self.slots.pop(slot.spec.key, None)
                    if not slot.traffic.queue:  # a load op: nobody else would hear of it
                        self.pool.reject(INSUFFICIENT_MEMORY, f"model {slot.name!r} cannot fit: {decision.reason}", None)
                    slot.traffic.fail_queued(INSUFFICIENT_MEMORY, lambda model: f"model {model!r} cannot fit: {decision.reason}")
                    return
                if isinstance(decision, Evict):
                    for key in decision.victims:
                        victim = self.slots.pop(key, None)
                        if victim is not None:
                            await self.stop(victim, f"evicted to make room for {slot.name!r}")
                    await slot.start("admitted")
                    return
                self._room.clear()
            log.info("model=%s waits for room: %s", slot.name, decision.reason)
            await self._room.wait()

    async def stop(self, slot: WorkerSlot, reason: str, queued_code: str = UNLOADED) -> None:
        if self.slots.get(slot.spec.key) is None:
            # A replacement slot for the same key would own the watch by now.
            self.watches.unwatch(slot.spec.key)
        await slot.stop(reason, queued_code)
        if self.slots.get(slot.spec.key) is None:
            self.copies.forget(slot.spec)
        self._room.set()

    # -- housekeeping ------------------------------------------------------------------

    async def housekeeping(self) -> None:
        """Stall watchdog, keep_alive unloads, memory refresh, stats events."""
        last_refresh = last_stats = time.monotonic()
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL)
            now = time.monotonic()
            try:
                for slot in list(self.slots.values()):
                    slot.check_stall(now, self.pool.config.stall_timeout)
                    keep = slot.roster.keep_alive
                    if keep is not None and slot.traffic.idle and now - slot.last_used > keep:
                        self.slots.pop(slot.spec.key, None)
                        self.pool.spawn(self.stop(slot, f"idle for {now - slot.last_used:.0f}s (keep_alive {keep:g}s)"))
                self._drop_failed_rows(now)
                if now - last_refresh >= STATS_REFRESH_INTERVAL:
                    last_refresh = now
                    for slot in self.slots.values():
                        if slot.state in LIVE:
                            slot.request_stats_nowait()
                if self.pool.stats_interval and now - last_stats >= self.pool.stats_interval:
                    last_stats = now
                    self.pool.spawn(self._emit_stats())
            except Exception:
                # The watchdog must outlive a bad round; the next one comes.
                log.exception("housekeeping round failed")

    def _drop_failed_rows(self, now: float) -> None:
        """Forgets failed workers of models the config does not name, after
        a while or past a bound (supervisor.policy says which)."""
        failed = {s.spec.key: s for s in self.slots.values() if s.state == State.FAILED}
        if not failed:
            return
        rows = [FailedRow(key, s.failed_at, any(n.spec.name in self.pool.resolver.by_name for n in s.names.values())) for key, s in failed.items()]
        for key in failed_rows_to_drop(rows, now=now):
            slot = self.slots.pop(key)
            self.watches.unwatch(key)
            self.copies.forget(slot.spec)
            log.info("%s: failed %.0fs ago; dropped from the table (named again, it starts afresh)", slot.name, now - slot.failed_at)

    async def measure(self, slots: list[WorkerSlot]) -> list[tuple[WorkerSlot, Name, StatusRow]]:
        """One row per name of each slot, measured once per worker."""
        # The state as it was when the figures were asked for: a worker that
        # turns ready meanwhile measured its memory while still loading.
        states = [s.state for s in slots]
        stats = await asyncio.gather(*(s.fresh_stats() for s in slots))
        return [
            (s, name, status_row(s, name, st, state, self.pool.idless_waiting(name.spec)))
            for s, st, state in zip(slots, stats, states)
            for name in list(s.names.values())
        ]

    async def _emit_stats(self) -> None:
        slots = [s for s in self.slots.values() if s.state in LIVE]
        for slot, name, row in await self.measure(slots):
            # Unloaded while it was measured: its `unloaded` line is out.
            if self.slots.get(slot.spec.key) is slot and slot.names.get(name.spec.name_key) is name:
                self.pool.output.write(stats_event(row))
