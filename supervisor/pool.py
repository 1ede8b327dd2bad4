"""The pool: routes requests to worker slots, runs ops, admits and evicts workers.

Runs on one event loop. Slots are keyed by the worker a name needs (its base
model and the worker's settings, ModelSpec.key), so every name on one base
model shares one worker (SPEC §10); each WorkerSlot owns its worker's state
and its names, the pool owns which slots exist and hears from them as their
SlotEvents. Admission, eviction and keep_alive count workers, not names.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import random
import statistics
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psutil

from ipc.events import (
    BAD_REQUEST,
    INSUFFICIENT_MEMORY,
    INTERNAL,
    OVERLOADED,
    SHUTTING_DOWN,
    UNKNOWN_MODEL,
    UNLOADED,
    encode_error,
    encode_event,
)
from ipc.messages import Generate
from ipc.worker_events import Done
from supervisor.adapters import AdapterCopies, AdapterWatches
from supervisor.child import worker_command
from supervisor.config import Config, ModelEntry, parse_duration, parse_size
from supervisor.job import Job, Sink
from supervisor.names import Name
from supervisor.policy import Evict, FailedRow, NoFit, Resident, RestartPolicy, default_max_loaded, failed_rows_to_drop, make_room
from supervisor.requests import ClientLine, prompt_bytes, response_format_text, stop_list
from supervisor.resolve import AdapterRefused, Resolver, UnknownModel
from supervisor.slot import WorkerSlot
from supervisor.spec import ModelSpec
from supervisor.states import LIVE, State
from supervisor.status import Status, StatusRow, SurfaceRequests, stats_event, status, status_event, status_row
from supervisor.stderr import relay_worker_stderr
from supervisor.stdout import Output

log = logging.getLogger("lattice.pool")

# Python, MLX and the tokenizer cost about this much before any weights;
# replaced by measurements (RSS minus weights) once a worker has reported.
DEFAULT_RUNTIME_BYTES = 256 * 1024 * 1024
HOUSEKEEPING_INTERVAL = 0.25
STATS_REFRESH_INTERVAL = 5.0

Answer = Callable[[bytes], None]


class _Answering:
    """An op's answer function as the sink of a request."""

    def __init__(self, answer: Answer):
        self.write = answer


class PoolObserver(Protocol):
    """Told of what the pool counts (supervisor.metrics is one), labelled by
    the worker's spec (None: no model was resolved) and the surface the
    request came through (SURFACES); every call comes from the event loop
    thread."""

    def request_done(self, spec: ModelSpec, done: Done, surface: str) -> None: ...

    def error(self, spec: ModelSpec | None, code: str, surface: str) -> None: ...

    def adapter_event(self, spec: ModelSpec, loaded: bool) -> None:
        """An adapter_loaded (True) or adapter_error line written for the name `spec`."""

    def restarted(self, spec: ModelSpec) -> None: ...


# Where requests come from: stdin (and the terminal front ends), or HTTP.
SURFACES = ("stdin", "http")


@dataclass(frozen=True)
class ModelState:
    """A model's worker as the front ends see it."""

    worker: str | None  # the worker's own name (its first name's); None: no worker
    state: str  # a State's value; "unloaded" with no worker
    loaded: bool  # ready or busy
    opens_think: bool  # the worker's chat template opens <think> (its ready line says)
    max_context: int | None  # tokens a request may take; None with no worker
    expires_in: float | None  # idle seconds left before keep_alive unloads it; None: never, or no worker


class Pool:
    def __init__(self, config: Config, output: Output, *, rng: random.Random | None = None):
        self.config = config
        self.output = output
        self.resolver = Resolver(config)
        self.restart_policy = RestartPolicy()
        self.rng = rng or random.Random()
        self.memory_budget = parse_size(config.memory_budget)
        self.total_memory = psutil.virtual_memory().total  # for the default max_loaded
        self.max_prompt_bytes = parse_size(config.max_prompt_bytes)
        self.stats_interval = parse_duration(config.stats_interval)
        self.slots: dict[tuple, WorkerSlot] = {}
        self.watches = AdapterWatches()
        self.copies = AdapterCopies()
        self._numbers = itertools.count(1)
        self.accepting = True
        self.observers: list[PoolObserver] = []
        self._rids = itertools.count(1)
        self._active: dict[str, Job] = {}
        # Id-less requests, and answers to id-less lines, in arrival order.
        self._idless: collections.deque[Job | tuple[Sink, bytes]] = collections.deque()
        self._idless_running: Job | None = None
        self._idless_room = asyncio.Event()
        self._live_jobs = 0  # requests queued or running, id-less ones included
        self.received = dict.fromkeys(SURFACES, 0)  # generation requests submitted, by surface
        self.live_by_surface = dict.fromkeys(SURFACES, 0)  # of _live_jobs
        self._tasks: set[asyncio.Task] = set()
        self._admission = asyncio.Lock()
        self._room = asyncio.Event()
        self._all_idle = asyncio.Event()
        self.shutdown_requested = asyncio.Event()
        self.hurry = asyncio.Event()
        output.on_pause(self._pause_sources)

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("pool task failed", exc_info=task.exception())

    def _pause_sources(self, paused: bool) -> None:
        for slot in self.slots.values():
            slot.pause_reading(paused)

    def note_error(self, spec: ModelSpec | None, code: str | None, surface: str = "stdin") -> None:
        for observer in self.observers:
            observer.error(spec, code or "unknown", surface)

    # -- SlotEvents ----------------------------------------------------------------

    def request_ended(self, slot: WorkerSlot, job: Job) -> None:
        self._live_jobs -= 1
        self.live_by_surface[job.surface] -= 1
        if job.id_json is not None and self._active.get(job.id_json) is job:
            del self._active[job.id_json]
        if self._idless_running is job:
            self._idless_running = None
            self._pump_idless()
        if self._quiet():
            self._all_idle.set()

    def request_done(self, slot: WorkerSlot, job: Job, done: Done) -> None:
        for observer in self.observers:
            observer.request_done(job.spec, done, job.surface)

    def error_counted(self, slot: WorkerSlot, job: Job, code: str | None) -> None:
        self.note_error(slot.spec, code, job.surface)

    def adapter_event(self, slot: WorkerSlot, lora: str | None, specs: list[ModelSpec], loaded: bool) -> bool:
        if self.watches.result(slot.spec.key, lora, loaded):
            return True  # a failed reload that its watch tries again: told if the last try fails
        for observer in self.observers:
            for spec in specs:
                observer.adapter_event(spec, loaded)
        if loaded and lora is not None and self.slots.get(slot.spec.key) is slot and slot.roster.uses(lora):
            # Watched from the moment its worker holds it, not before: a
            # request naming a file that never loads costs no watch.
            self.watches.watch(slot, lora)
        return False

    def restarted(self, slot: WorkerSlot) -> None:
        # Once per worker, under the name `ps` lists it by: its first name
        # without adapter, else its first.
        names = sorted(slot.names.values(), key=lambda n: (n.lora is not None, n.name, n.lora or ""))
        spec = names[0].spec if names else slot.spec
        for observer in self.observers:
            observer.restarted(spec)

    def idle(self, slot: WorkerSlot) -> None:
        self._room.set()
        if self._quiet():
            self._all_idle.set()

    def worker_stderr(self, data: bytes) -> None:
        relay_worker_stderr(data)

    # -- requests ------------------------------------------------------------------

    def reject(self, code: str, msg: str, id_json: str | None, sink: Sink | None = None, surface: str = "stdin") -> None:
        """Answers a line that will not run with one error line."""
        sink = sink or self.output
        if id_json is not None and id_json in self._active:
            # The id names a request still running: a line carrying it would
            # read as that request's end.
            msg, id_json = f"{msg} (id {id_json} belongs to a request still running, so this error carries no id)", None
        self.note_error(None, code, surface)
        line = encode_error(msg, code, id_json)
        if id_json is None and (self._idless_running is not None or self._idless):
            # An id-less error is the answer to an id-less line: it waits its
            # turn, or a chat_metal client would read it as the running
            # request's failure.
            self._idless.append((sink, line))
            return
        sink.write(line)

    def submit(self, msg: ClientLine, sink: Sink | None = None, surface: str = "stdin") -> None:
        """A validated generation request: route it, or end it with an error.
        Its lines go to `sink` (default: stdout); `surface` (SURFACES) says
        where it came from, for the counters."""
        sink = sink or self.output
        id_json = msg.id_json
        self.received[surface] += 1

        def refuse(code: str, why: str) -> None:
            self.reject(code, why, id_json, sink, surface)

        if not self.accepting:
            refuse(SHUTTING_DOWN, "the pool is shutting down")
            return
        if id_json is not None and id_json in self._active:
            refuse(BAD_REQUEST, f"duplicate id {id_json}: a request with this id is still running; this line is refused")
            return
        if prompt_bytes(msg, self.max_prompt_bytes) > self.max_prompt_bytes:
            refuse(BAD_REQUEST, f"prompt is longer than max_prompt_bytes ({self.max_prompt_bytes} bytes)")
            return
        try:
            # stdin is the pool's owner; HTTP clients get the HTTP rule.
            spec = self.resolver.resolve(msg.model, msg.lora, lora_paths=None if surface == "http" else True)
        except AdapterRefused as exc:
            refuse(BAD_REQUEST, str(exc))
            return
        except UnknownModel as exc:
            refuse(BAD_REQUEST if msg.model is None else UNKNOWN_MODEL, str(exc))
            return
        if id_json is not None and (full := self._full(spec)):
            refuse(OVERLOADED, full)
            return
        job = Job(self._generate(msg, spec, next(self._rids)), spec, sink, surface)
        self._live_jobs += 1
        self.live_by_surface[surface] += 1
        self._all_idle.clear()
        if id_json is None:
            # chat_metal clients send no id and expect no interleaving at all.
            self._idless.append(job)
            self._pump_idless()
        else:
            self._active[id_json] = job
            self.slot_for(spec).traffic.submit(job)

    def _full(self, spec: ModelSpec) -> str | None:
        """Why a request for `spec` cannot wait for its turn, if it cannot."""
        slot = self.slots.get(spec.key)
        if slot is not None and len(slot.traffic.queue) >= self.config.max_queued:
            return f"model {spec.name!r} has {len(slot.traffic.queue)} requests waiting (max_queued); try again later"
        if self._live_jobs >= self.config.max_queued_total:
            return f"the pool holds {self._live_jobs} requests (max_queued_total); try again later"
        return None

    def input_blocked(self) -> bool:
        """True while stdin must not be read: the client is not reading our
        answers, or id-less lines are waiting their turn up to the bound."""
        return self.output.paused or len(self._idless) >= self.config.max_queued_total

    async def input_room(self) -> None:
        """Returns once input_blocked() is False."""
        while self.input_blocked():
            if self.output.paused:
                await self.output.wait_writable()
            else:
                self._idless_room.clear()
                await self._idless_room.wait()

    def _generate(self, msg: ClientLine, spec: ModelSpec, rid: int) -> Generate:
        d = self.config.defaults
        fields = {}
        for name in ("max_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "reasoning_budget", "allow_special_tokens"):
            value = getattr(msg, name)
            if value is None:
                value = getattr(d, name)
            if value is not None:
                fields[name] = value
        # Every request names its adapter (None: the base model); workers
        # have no default adapter (SPEC §10).
        lora = str(spec.lora) if spec.lora else None
        return Generate(
            rid=rid,
            prompt=msg.prompt,
            messages=msg.messages,
            tools=msg.tools,
            seed=msg.seed,
            stop=stop_list(msg.stop),
            id_json=msg.id_json,
            response_format=response_format_text(msg),
            lora=lora,
            speculative=msg.speculative is not False,
            clip_max_tokens="max_tokens" not in fields,
            **fields,
        )

    def _pump_idless(self) -> None:
        while self._idless_running is None and self._idless:
            job = self._idless.popleft()
            self._idless_room.set()
            if isinstance(job, tuple):
                sink, line = job
                sink.write(line)
                continue
            self._idless_running = job
            self.slot_for(job.spec).traffic.submit(job)

    def _quiet(self) -> bool:
        return not self._active and not self._idless and self._idless_running is None

    # -- questions from the front ends --------------------------------------------
    # HTTP, the chat REPL and the CLI ask these instead of reading the slots
    # or the resolver, so the pool's insides can change without them.

    def resolve(self, ref: str | None, lora: str | None = None, *, paths: bool = True) -> ModelSpec:
        """What the model reference `ref` (None: the default model) with
        the adapter `lora` names; UnknownModel (or AdapterRefused) if none.
        paths: whether `ref` may be a path on this machine (not for HTTP)."""
        return self.resolver.resolve(ref, lora, paths=paths)

    def default_model(self) -> str | None:
        return self.resolver.default_ref()

    def configured(self, name: str) -> ModelEntry | None:
        """The config's entry for `name`, None if it is not a configured name."""
        return self.resolver.by_name.get(name)

    @property
    def model_cache(self) -> Path:
        return self.resolver.cache

    def model_state(self, spec: ModelSpec) -> ModelState:
        """Where the pool is with the worker of `spec`."""
        slot = self.slots.get(spec.key)
        if slot is None:
            return ModelState(None, State.UNLOADED.value, False, False, None, None)
        keep = slot.roster.keep_alive
        left = None if keep is None else max(0.0, keep - (time.monotonic() - slot.last_used))
        return ModelState(slot.name, slot.state.value, slot.state in (State.READY, State.BUSY), slot.opens_think, slot.max_context, left)

    def keep_alive(self, spec: ModelSpec, seconds: float | None) -> None:
        """A request's own keep_alive (Ollama's API sends one): the idle
        seconds (None: for ever) of the worker of `spec` from now on."""
        slot = self.slots.get(spec.key)
        if slot is not None:
            slot.roster.keep_alive_request = seconds
            slot.touch()

    # -- workers -------------------------------------------------------------------

    def slot_for(self, spec: ModelSpec) -> WorkerSlot:
        """The worker slot of the name `spec`, with the name joined; the
        first name of a worker creates its slot and starts its admission."""
        slot = self.slots.get(spec.key)
        if slot is None:
            command = lambda: worker_command(spec, self.config, self.copies.dir_for(spec))  # noqa: E731
            slot = WorkerSlot(spec, self, self.output, command, self.restart_policy, self.rng, next(self._numbers))
            slot.pause_reading(self.output.paused)
            self.slots[spec.key] = slot
            slot.roster.join(spec)
            self.spawn(self._admit(slot))
        elif spec.name_key not in slot.names:
            slot.roster.join(spec)
            self._trim_names(slot, spec)
        return slot

    def _trim_names(self, slot: WorkerSlot, joined: ModelSpec) -> None:
        """Past max_names, the least recently used names with no request
        queued or running leave the worker (names with requests stay: they
        are bounded by the queues)."""
        limit = self.config.max_names
        excess = len(slot.names) - limit
        if excess <= 0:
            return
        idle = [n for n in slot.names.values() if n.spec.name_key != joined.name_key and slot.traffic.waiting(n.spec) == (0, 0)]
        for name in sorted(idle, key=lambda n: n.last_used)[:excess]:
            log.info("model=%s lora=%s: leaves worker %d, which serves max_names (%d) names", name.name, name.lora, slot.number, limit)
            self.unload(name.spec, f"left its worker, which serves max_names ({limit}) names, as the least recently used one")

    def _estimate_bytes(self, spec: ModelSpec) -> int:
        try:
            weights = sum(p.stat().st_size for p in spec.path.glob("model*.safetensors"))
        except OSError as exc:
            # Out of file descriptors, say: an estimate is no reason to keep
            # a model from starting; its worker will say what is wrong.
            log.warning("model=%s: cannot size the weights in %s: %s", spec.name, spec.path, exc)
            weights = 0
        measured = [s.stats.rss_bytes - s.stats.weights_bytes for s in self.slots.values() if s.stats and s.stats.rss_bytes and s.state in LIVE]
        return weights + (int(statistics.median(measured)) if measured else DEFAULT_RUNTIME_BYTES)

    def _residents(self, exclude: WorkerSlot) -> list[Resident]:
        return [
            Resident(
                key=s.spec.key,
                idle=s.traffic.idle,
                last_used=s.last_used,
                memory_bytes=(s.stats.rss_bytes if s.stats else 0) or self._estimate_bytes(s.spec),
            )
            for s in self.slots.values()
            if s is not exclude and (s.state in LIVE or s.state == State.RESTARTING)
        ]

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
            await self._stop(slot, f"could not be started: internal error ({type(exc).__name__}: {exc})", INTERNAL)

    async def _make_room_and_start(self, slot: WorkerSlot) -> None:
        while True:
            async with self._admission:
                if self.slots.get(slot.spec.key) is not slot or slot.state != State.UNLOADED:
                    return
                residents = self._residents(slot)
                need = self._estimate_bytes(slot.spec)
                max_loaded = self.config.max_loaded
                if max_loaded is None and self.memory_budget is None:
                    max_loaded = default_max_loaded(self.total_memory, [r.memory_bytes for r in residents] + [need])
                decision = make_room(residents, need_bytes=need, max_loaded=max_loaded, memory_budget=self.memory_budget)
                if isinstance(decision, NoFit):
                    self.slots.pop(slot.spec.key, None)
                    if not slot.traffic.queue:  # a load op: nobody else would hear of it
                        self.reject(INSUFFICIENT_MEMORY, f"model {slot.name!r} cannot fit: {decision.reason}", None)
                    slot.traffic.fail_queued(INSUFFICIENT_MEMORY, lambda model: f"model {model!r} cannot fit: {decision.reason}")
                    return
                if isinstance(decision, Evict):
                    for key in decision.victims:
                        victim = self.slots.pop(key, None)
                        if victim is not None:
                            await self._stop(victim, f"evicted to make room for {slot.name!r}")
                    await slot.start("admitted")
                    return
                self._room.clear()
            log.info("model=%s waits for room: %s", slot.name, decision.reason)
            await self._room.wait()

    def unload(self, spec: ModelSpec, reason: str, answer: Answer | None = None) -> None:
        """Unloads the name `spec`: its worker stops with its last name, and
        otherwise goes on serving the others."""
        slot = self.slots.get(spec.key)
        if slot is None or spec.name_key not in slot.names:
            (answer or self.output.write)(encode_event("unloaded", model=spec.name, lora=str(spec.lora) if spec.lora else None, reason="not loaded"))
            return
        if len(slot.names) > 1:
            slot.roster.remove_name(spec, reason)
            if spec.lora is not None and not slot.roster.uses(str(spec.lora)):
                self.watches.unwatch(slot.spec.key, str(spec.lora))
            return
        del self.slots[spec.key]
        self.spawn(self._stop(slot, reason))

    async def _stop(self, slot: WorkerSlot, reason: str, queued_code: str = UNLOADED) -> None:
        if self.slots.get(slot.spec.key) is None:
            # A replacement slot for the same key would own the watch by now.
            self.watches.unwatch(slot.spec.key)
        await slot.stop(reason, queued_code)
        if self.slots.get(slot.spec.key) is None:
            self.copies.forget(slot.spec)
        self._room.set()

    # -- ops -------------------------------------------------------------------------

    def op(self, msg: ClientLine, answer: Answer | None = None) -> asyncio.Task | None:
        """Runs a control op. The part that decides runs now, so ops and
        requests take effect in the order their lines arrived; waiting (a
        worker stopping, stats replies) continues in a task.

        answer: where the op's own reply goes (the status event, an error,
        the ready line of a model already up) when it did not come from
        stdin; lifecycle events (loading, ready, unloaded...) always go to
        stdout. Returns the task that will still write a reply, if any."""
        id_json = msg.id_json
        if msg.op == "generate":
            self.submit(msg, None if answer is None else _Answering(answer))
            return None
        if msg.op == "status":
            return self.spawn(self._write_status(answer or self.output.write))
        if msg.op == "cancel":
            self.cancel(id_json, answer)
            return None
        if msg.op == "shutdown":
            self.shutdown_requested.set()
            return None
        try:
            # Ops come from stdin or the control socket (the pool's user); an
            # unload or reload names a name already known, whose file may
            # have gone since.
            spec = self.resolver.resolve(msg.model, msg.lora, lora_paths=True, check_lora=msg.op == "load")
        except AdapterRefused as exc:
            self._refuse(BAD_REQUEST, str(exc), id_json, answer)
            return None
        except UnknownModel as exc:
            self._refuse(UNKNOWN_MODEL, str(exc), id_json, answer)
            return None
        if msg.op == "load":
            if not self.accepting:
                # A worker started now could outlive the stop of all workers.
                self._refuse(SHUTTING_DOWN, "the pool is shutting down", id_json, answer)
                return None
            self.load(spec, answer)
        elif msg.op == "unload":
            self.unload(spec, "unloaded on request", answer)
        elif msg.op == "reload":
            self.reload(spec, id_json, answer)
        return None

    def cancel_for(self, id_json: str, sink: Sink) -> None:
        """Cancels the request `id_json` if it still runs for `sink` (a
        control client that went away: nobody reads its lines any more)."""
        job = self._active.get(id_json)
        if job is not None and job.sink is sink:
            self.cancel(id_json, lambda _: None)

    def runs_for(self, id_json: str, sink: Sink) -> bool:
        job = self._active.get(id_json)
        return job is not None and job.sink is sink

    def _refuse(self, code: str, msg: str, id_json: str | None, answer: Answer | None) -> None:
        if answer is None:
            self.reject(code, msg, id_json)
        else:
            answer(encode_error(msg, code, id_json))

    async def _write_status(self, answer: Answer) -> None:
        try:
            line = status_event(await self.status())
        except Exception as exc:
            log.exception("status op failed")
            line = encode_error(f"status failed: internal error ({type(exc).__name__}: {exc})", INTERNAL)
        answer(line)

    def load(self, spec: ModelSpec, answer: Answer | None = None) -> None:
        """Brings up the name `spec`: its worker starts if it does not run,
        its adapter is loaded into the running worker if it has one. A name
        already up gets its `ready` line again, and its adapter is loaded
        again (read anew if the worker had dropped it, answered by
        adapter_loaded)."""
        slot = self.slots.get(spec.key)
        if slot is not None and slot.state == State.FAILED:
            # An explicit load is the user saying "try again".
            self.slot_for(spec)
            slot.reset_failed()
            self.spawn(slot.start("load requested after failure"))
            return
        already = slot is not None and spec.name_key in slot.names
        slot = self.slot_for(spec)
        slot.touch()
        name = slot.names[spec.name_key]
        name.last_used = time.monotonic()
        if already and slot.state in (State.READY, State.BUSY):
            if name.up:
                (answer or self.output.write)(name.ready_line)
            if name.lora is not None:
                # Read again if the worker dropped it, or if it failed before
                # (its name then comes up now).
                slot.roster.load_adapter(name.lora)

    def reload(self, spec: ModelSpec, id_json: str | None, answer: Answer | None = None) -> None:
        slot = self.slots.get(spec.key)
        if slot is None or spec.name_key not in slot.names:
            self._refuse(BAD_REQUEST, f"model {spec.name!r} is not running; nothing to reload", id_json, answer)
        elif spec.lora is None:
            self._refuse(BAD_REQUEST, f"model {spec.name!r} has no adapter; nothing to reload", id_json, answer)
        elif not slot.roster.reload_adapter(str(spec.lora)):
            self._refuse(BAD_REQUEST, f"model {spec.name!r} is not running; nothing to reload", id_json, answer)

    def cancel(self, id_json: str, answer: Answer | None = None) -> None:
        job = self._active.get(id_json)
        if job is not None:
            slot = self.slots.get(job.spec.key)
            if slot is not None and slot.traffic.cancel(id_json):
                return
        (answer or self.output.write)(encode_error(f"cancel: no queued or running request has id {id_json}", BAD_REQUEST))

    async def status(self) -> Status:
        """The `status` event's figures, measured now (docs/monitoring.md)."""
        rows = [row for _, _, row in await self._measure(list(self.slots.values()))]
        return status(rows, {s: SurfaceRequests(received=self.received[s], active=self.live_by_surface[s]) for s in SURFACES})

    async def _measure(self, slots: list[WorkerSlot]) -> list[tuple[WorkerSlot, Name, StatusRow]]:
        """One row per name of each slot, measured once per worker."""
        # The state as it was when the figures were asked for: a worker that
        # turns ready meanwhile measured its memory while still loading.
        states = [s.state for s in slots]
        stats = await asyncio.gather(*(s.fresh_stats() for s in slots))
        return [
            (s, name, status_row(s, name, st, state, self._idless_waiting(name.spec)))
            for s, st, state in zip(slots, stats, states)
            for name in list(s.names.values())
        ]

    def _idless_waiting(self, spec: ModelSpec) -> int:
        return sum(1 for j in self._idless if isinstance(j, Job) and j.spec.name_key == spec.name_key)

    # -- housekeeping ------------------------------------------------------------------

    async def housekeeping(self) -> None:
        """Stall watchdog, keep_alive unloads, memory refresh, stats events."""
        last_refresh = last_stats = time.monotonic()
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL)
            now = time.monotonic()
            try:
                for slot in list(self.slots.values()):
                    slot.check_stall(now, self.config.stall_timeout)
                    keep = slot.roster.keep_alive
                    if keep is not None and slot.traffic.idle and now - slot.last_used > keep:
                        self.slots.pop(slot.spec.key, None)
                        self.spawn(self._stop(slot, f"idle for {now - slot.last_used:.0f}s (keep_alive {keep:g}s)"))
                self._drop_failed_rows(now)
                if now - last_refresh >= STATS_REFRESH_INTERVAL:
                    last_refresh = now
                    for slot in self.slots.values():
                        if slot.state in LIVE:
                            slot.request_stats_nowait()
                if self.stats_interval and now - last_stats >= self.stats_interval:
                    last_stats = now
                    self.spawn(self._emit_stats())
            except Exception:
                # The watchdog must outlive a bad round; the next one comes.
                log.exception("housekeeping round failed")

    def _drop_failed_rows(self, now: float) -> None:
        """Forgets failed workers of models the config does not name, after
        a while or past a bound (supervisor.policy says which)."""
        failed = {s.spec.key: s for s in self.slots.values() if s.state == State.FAILED}
        if not failed:
            return
        rows = [FailedRow(key, s.failed_at, any(n.spec.name in self.resolver.by_name for n in s.names.values())) for key, s in failed.items()]
        for key in failed_rows_to_drop(rows, now=now):
            slot = self.slots.pop(key)
            self.watches.unwatch(key)
            self.copies.forget(slot.spec)
            log.info("%s: failed %.0fs ago; dropped from the table (named again, it starts afresh)", slot.name, now - slot.failed_at)

    async def _emit_stats(self) -> None:
        slots = [s for s in self.slots.values() if s.state in LIVE]
        for slot, name, row in await self._measure(slots):
            # Unloaded while it was measured: its `unloaded` line is out.
            if self.slots.get(slot.spec.key) is slot and slot.names.get(name.spec.name_key) is name:
                self.output.write(stats_event(row))

    def preload(self) -> list[WorkerSlot]:
        slots = []
        for entry in self.config.models:
            if not entry.preload:
                continue
            try:
                spec = self.resolver.resolve(entry.name)
            except UnknownModel as exc:
                # A path that cannot be resolved (a symlink loop) fails this
                # model, not the pool.
                log.error("model=%s: not preloaded: %s", entry.name, exc)
                self.output.write(encode_event("failed", model=entry.name, lora=entry.lora, reason=str(exc)))
                continue
            slots.append(self.slot_for(spec))
        return slots

    # -- shutdown ------------------------------------------------------------------------

    async def shutdown(self, grace: float | None) -> None:
        """Stops accepting; lets queued and running requests go on for `grace`
        seconds (None: until done); then cancels what still runs, ends what
        still waits with shutting_down, and stops every worker."""
        self.accepting = False
        if not self._quiet() and grace != 0:
            waits = [asyncio.ensure_future(self._all_idle.wait()), asyncio.ensure_future(self.hurry.wait())]
            done, pending = await asyncio.wait(waits, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
            for w in pending:
                w.cancel()
            if not self._all_idle.is_set():
                log.info("shutdown: cancelling requests that are still running")
        while self._idless:
            job = self._idless.popleft()
            if isinstance(job, tuple):
                sink, line = job
                sink.write(line)
            else:
                job.sink.write(encode_error("the pool is shutting down", SHUTTING_DOWN, job.id_json))
                self.note_error(None, SHUTTING_DOWN, job.surface)
        slots = list(self.slots.values())
        self.slots.clear()
        self.watches.stop_all()
        await asyncio.gather(*(s.stop("the pool is shutting down", SHUTTING_DOWN) for s in slots))
        self.copies.remove_all()
        for task in list(self._tasks):
            task.cancel()
