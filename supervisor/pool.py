"""The pool: routes requests to worker slots, runs ops, admits and evicts workers.

Runs on one event loop. Slots are keyed by the worker a name needs (its base
model and the worker's settings, ModelSpec.key), so every name on one base
model shares one worker (docs/adapters.md); each WorkerSlot owns its worker's state
and its names, the pool owns which slots exist and hears from them as their
SlotEvents. Admission, eviction and keep_alive count workers, not names.

The pool is the front door: it takes requests (counting them, keeping ids
unique, running id-less ones one at a time) and answers the front ends'
questions. Two rooms do the rest: `supervisor.workers.Workers` (which worker
slots exist, admission, eviction, housekeeping, and the slots' SlotEvents)
and `supervisor.ops.Ops` (the control ops).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import random
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path

from ipc.events import (
    BAD_REQUEST,
    OVERLOADED,
    SHUTTING_DOWN,
    UNKNOWN_MODEL,
    encode_error,
    encode_event,
)
from ipc.messages import Embed, Generate
from ipc.sampling import given
from supervisor.config import Config, ModelEntry, parse_duration, parse_size
from supervisor.embeddings import embed_inputs, inputs_size, wrong_kind
from supervisor.job import Job, Sink
from supervisor.ops import Answer, Ops
from supervisor.requests import ClientLine, logprobs_count, prompt_bytes, stop_list
from supervisor.resolve import AdapterRefused, Resolver, UnknownModel
from supervisor.slot import WorkerSlot
from supervisor.spec import ModelSpec
from supervisor.states import State
from supervisor.status import Status, SurfaceRequests, status
from supervisor.stdout import Output
from supervisor.workers import PoolObserver, Workers

log = logging.getLogger("lattice.pool")


# Where requests come from: stdin (and the terminal front ends), or HTTP.
SURFACES = ("stdin", "http")
# How often a shutdown looks whether a worker is still loading (Pool._drain).
LOADING_LOOK = 1.0


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
        self.max_prompt_bytes = parse_size(config.max_prompt_bytes)
        self.stats_interval = parse_duration(config.stats_interval)
        self.workers = Workers(self, rng or random.Random())
        self.slots = self.workers.slots  # the workers' table, for the questions below
        self.ops = Ops(self)
        self.accepting = True
        self.observers: list[PoolObserver] = []
        self._rids = itertools.count(1)
        self.active: dict[str, Job] = {}  # requests with an id, queued or running
        # Id-less requests, and answers to id-less lines, in arrival order.
        self._idless: collections.deque[Job | tuple[Sink, bytes]] = collections.deque()
        self._idless_running: Job | None = None
        self._idless_room = asyncio.Event()
        self._live_jobs = 0  # requests queued or running, id-less ones included
        self.received = dict.fromkeys(SURFACES, 0)  # generation requests submitted, by surface
        self.live_by_surface = dict.fromkeys(SURFACES, 0)  # of _live_jobs
        self._tasks: set[asyncio.Task] = set()
        self._all_idle = asyncio.Event()
        self.shutdown_requested = asyncio.Event()
        self.hurry = asyncio.Event()
        output.on_pause(self.workers.pause_reading)

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("pool task failed", exc_info=task.exception())

    def note_error(self, spec: ModelSpec | None, code: str | None, surface: str = "stdin") -> None:
        for observer in self.observers:
            observer.error(spec, code or "unknown", surface)

    # -- what the workers tell -------------------------------------------------------

    def request_ended(self, job: Job) -> None:
        """The job's one terminal line has gone to its sink."""
        self._live_jobs -= 1
        self.live_by_surface[job.surface] -= 1
        if job.id_json is not None and self.active.get(job.id_json) is job:
            del self.active[job.id_json]
        if self._idless_running is job:
            self._idless_running = None
            self._pump_idless()
        self.check_quiet()

    def check_quiet(self) -> None:
        if self._quiet():
            self._all_idle.set()

    # -- requests ------------------------------------------------------------------

    def reject(self, code: str, msg: str, id_json: str | None, sink: Sink | None = None, surface: str = "stdin") -> None:
        """Answers a line that will not run with one error line."""
        sink = sink or self.output
        if id_json is not None and id_json in self.active:
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
        if id_json is not None and id_json in self.active:
            refuse(BAD_REQUEST, f"duplicate id {id_json}: a request with this id is still running; this line is refused")
            return
        embed = msg.op == "embed"
        if embed:
            try:
                inputs = embed_inputs(msg.input)
            except ValueError as exc:
                refuse(BAD_REQUEST, str(exc))
                return
            if inputs_size(inputs, self.max_prompt_bytes) > self.max_prompt_bytes:
                refuse(BAD_REQUEST, f"input is longer than max_prompt_bytes ({self.max_prompt_bytes} bytes of text and token ids)")
                return
        elif prompt_bytes(msg, self.max_prompt_bytes) > self.max_prompt_bytes:
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
        if (wrong := wrong_kind(spec, embed)) is not None:
            refuse(BAD_REQUEST, wrong)
            return
        if id_json is not None and (full := self._full(spec)):
            refuse(OVERLOADED, full)
            return
        rid = next(self._rids)
        if embed:
            request = Embed(rid=rid, inputs=inputs, dimensions=msg.dimensions, truncate=bool(msg.truncate), id_json=id_json)
        else:
            request = self._generate(msg, spec, rid)
        job = Job(request, spec, sink, surface)
        self._live_jobs += 1
        self.live_by_surface[surface] += 1
        self._all_idle.clear()
        if id_json is None:
            # chat_metal clients send no id and expect no interleaving at all.
            self._idless.append(job)
            self._pump_idless()
        else:
            self.active[id_json] = job
            self.workers.slot_for(spec).traffic.submit(job)

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
        # Both validated with ipc.sampling's bounds, so either is fit to send.
        fields = given(msg, d)
        special = msg.allow_special_tokens if msg.allow_special_tokens is not None else d.allow_special_tokens
        # Every request names its adapter (None: the base model); workers
        # have no default adapter (docs/adapters.md).
        lora = str(spec.lora) if spec.lora else None
        return Generate(
            rid=rid,
            prompt=msg.prompt,
            messages=msg.messages,
            tools=msg.tools,
            stop=stop_list(msg.stop),
            id_json=msg.id_json,
            response_format=msg.format,
            lora=lora,
            allow_special_tokens=bool(special),
            speculative=msg.speculative is not False,
            clip_max_tokens="max_tokens" not in fields,
            logprobs=logprobs_count(msg),
            count_only=msg.op == "count",
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
            self.workers.slot_for(job.spec).traffic.submit(job)

    def _quiet(self) -> bool:
        return not self.active and not self._idless and self._idless_running is None

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

    # -- ops that stay at the door -----------------------------------------------------

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
                self.workers.watches.unwatch(slot.spec.key, str(spec.lora))
            return
        del self.slots[spec.key]
        self.spawn(self.workers.stop(slot, reason))

    def cancel(self, id_json: str, answer: Answer | None = None) -> None:
        job = self.active.get(id_json)
        if job is not None:
            slot = self.slots.get(job.spec.key)
            if slot is not None and slot.traffic.cancel(id_json):
                return
        (answer or self.output.write)(encode_error(f"cancel: no queued or running request has id {id_json}", BAD_REQUEST))

    async def status(self) -> Status:
        """The `status` event's figures, measured now (docs/monitoring.md)."""
        rows = [row for _, _, row in await self.workers.measure(list(self.slots.values()))]
        return status(rows, {s: SurfaceRequests(received=self.received[s], active=self.live_by_surface[s]) for s in SURFACES})

    def idless_waiting(self, spec: ModelSpec) -> int:
        return sum(1 for j in self._idless if isinstance(j, Job) and j.spec.name_key == spec.name_key)

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
            slots.append(self.workers.slot_for(spec))
        return slots

    # -- shutdown ------------------------------------------------------------------------

    async def _drain(self, grace: float | None) -> None:
        """Waits until every request has ended, `hurry` is set, or `grace`
        seconds have passed with no worker loading. A load streams its
        progress and one that stalls is killed (stall_timeout), so the
        requests waiting for it keep their grace: on a machine whose kernel
        cache is empty, the demo model's first load on 2 cores takes about
        35 s, which spent all of the default grace of `echo REQUEST | serve`
        and answered its one request shutting_down."""
        loop = asyncio.get_running_loop()
        deadline = None if grace is None else loop.time() + grace
        waits = [asyncio.ensure_future(self._all_idle.wait()), asyncio.ensure_future(self.hurry.wait())]
        was_loading = False
        try:
            while True:
                loading = any(slot.state in (State.LOADING, State.RESTARTING) for slot in self.slots.values())
                # Loads are looked at once a second, so the grace restarts
                # at the first look that finds them all ended too: from the
                # last look during a load, a load ending just before the
                # next one would leave its requests none of it.
                if deadline is not None and (loading or was_loading):
                    deadline = loop.time() + grace
                was_loading = loading
                left = None if deadline is None else deadline - loop.time()
                if left is not None and left <= 0:
                    return
                # Loads are looked at again each second; the waits end it at once.
                done, _ = await asyncio.wait(waits, timeout=LOADING_LOOK if left is None else min(left, LOADING_LOOK), return_when=asyncio.FIRST_COMPLETED)
                if done:
                    return
        finally:
            for w in waits:
                w.cancel()

    async def shutdown(self, grace: float | None) -> None:
        """Stops accepting; lets queued and running requests go on for `grace`
        seconds (None: until done); then cancels what still runs, ends what
        still waits with shutting_down, and stops every worker."""
        self.accepting = False
        if not self._quiet() and grace != 0:
            await self._drain(grace)
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
        self.workers.watches.stop_all()
        await asyncio.gather(*(s.stop("the pool is shutting down", SHUTTING_DOWN) for s in slots))
        self.workers.copies.remove_all()
        for task in list(self._tasks):
            task.cancel()
