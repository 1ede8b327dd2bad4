"""The worker slot: one worker as the pool sees it.

A slot owns its worker's state alone (llama-swap's one-owner-per-process
rule): the state machine (supervisor.states), the requests waiting for the
worker and those in flight at it, the child process, crash handling and the
stall watchdog. Everything runs on the event loop thread, so no locks. The
pool drives a slot through its methods and hears back through `SlotEvents`;
a slot never reaches into the pool.

A slot serves every name whose spec has its key (the base model and the
worker's settings: supervisor.spec.ModelSpec.key), each a (model name,
adapter) pair (supervisor.names). The worker starts without an adapter and
every request carries its name's adapter (null for the base), so requests of
different names share its batch. The name a request used travels with its
Job, and errors name that one; lifecycle events go out once per name.

Up to `max_batch` requests are in flight at the worker, the rest wait here,
first in first out. Each line the worker writes belongs to the in-flight
request its id tail names (a line without an id, to the one request without
an id) and is relayed to that request's sink as received, never decoded and
re-encoded; every other line is read once (ipc.worker_events.read_line).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import signal
import time
from collections.abc import Callable, Coroutine
from typing import Protocol

from ipc.context import read_context_limit
from ipc.events import ADAPTER_ERROR, LOAD_FAILED, MODEL_FAILED, UNLOADED, WORKER_CRASHED, encode_cancelled_done, encode_error, encode_event
from ipc.messages import DEFAULT_MAX_BATCH, Cancel, Generate, LoadAdapter, ReloadAdapter, Stats, ToWorker, UnloadAdapter
from ipc.worker_events import (
    TOKEN,
    AdapterError,
    AdapterLoaded,
    AdapterUnloaded,
    Done,
    Error,
    Heartbeat,
    Loading,
    Malformed,
    Other,
    Ready,
    WorkerStats,
    holds,
    line_id,
    parse_event,
    read_line,
    token_block,
)
from supervisor.child import MAX_WORKER_LINE, RESOURCE_ERRNOS, ChildProcess
from supervisor.job import Job, Sink
from supervisor.names import Name, renamed
from supervisor.policy import CrashHistory, GiveUp, RestartPolicy, on_crash
from supervisor.spec import ModelSpec
from supervisor.states import LIVE, State, StateMachine
from supervisor.stderr import LastMessage

log = logging.getLogger("lattice.worker")


# How long cancelled requests may take to end before their worker is killed.
CANCEL_GRACE = 5.0


class SlotEvents(Protocol):
    """What a slot tells its owner; every call comes from the event loop."""

    def request_ended(self, slot: WorkerSlot, job: Job) -> None:
        """The job's one terminal line has gone to its sink."""

    def request_done(self, slot: WorkerSlot, job: Job, done: Done) -> None:
        """The worker finished a request of the name `job.spec` (its done line, for the counters)."""

    def error_counted(self, slot: WorkerSlot, job: Job, code: str | None) -> None:
        """An error line ended a request (the worker's or the slot's)."""

    def adapter_event(self, slot: WorkerSlot, lora: str | None, specs: list[ModelSpec], loaded: bool) -> bool:
        """adapter_loaded (True) or adapter_error (False) from the worker
        about `lora`, to be written for the names of `specs`; True holds
        the line back (a failed reload that will be tried again)."""

    def restarted(self, slot: WorkerSlot) -> None: ...

    def idle(self, slot: WorkerSlot) -> None:
        """Nothing in flight or queued (or the model failed): room for others."""

    def worker_stderr(self, data: bytes) -> None: ...

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        """Runs a task the owner cancels when it shuts down."""


def describe_exit(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class WorkerSlot:
    def __init__(
        self,
        spec: ModelSpec,
        events: SlotEvents,
        lines: Sink,
        command: Callable[[], tuple[list[str], dict[str, str]]],
        restart_policy: RestartPolicy,
        rng,
        number: int = 0,
    ):
        # The settings of the worker are those of `spec`, the first name;
        # the worker speaks under its name.
        self.spec = spec
        self.number = number  # tells this worker's status rows apart from others'
        self.names: dict[tuple, Name] = {}
        self.events = events
        self.lines = lines  # lifecycle events and lines of no request
        self.command = command
        self.restart_policy = restart_policy
        self.rng = rng
        # "auto" is the worker's to size: its ready line says the number
        # (a worker whose line does not keeps the old default).
        self.max_batch = spec.max_batch if isinstance(spec.max_batch, int) else DEFAULT_MAX_BATCH
        self.max_batch_why: str | None = None
        self.sm = StateMachine(self._describe)
        self.queue: collections.deque[Job] = collections.deque()
        self.in_flight: dict[bytes | None, Job] = {}  # by id (None: the id-less request), in dispatch order
        self.child: ChildProcess | None = None
        self.history = CrashHistory()
        self.restarts = 0
        self.last_used = time.monotonic()
        # A client's keep_alive (Ollama's API): seconds, None for ever; it
        # replaces the names' keep_alive for this worker. False: none given.
        self.keep_alive_request: float | None | bool = False
        self.last_heard = time.monotonic()
        self._ready: dict = {}  # the fields of the running worker's ready line
        self._config_context: list[int | None] | None = None  # max_context before a worker says it
        self._ready_at = 0.0
        self.stats: WorkerStats | None = None
        self.stderr_tail = LastMessage()
        self.reading_paused = False
        self._sink: Sink | None = None  # the one sink of every in-flight request, if they share one
        self._silent: list[Job] = []  # in-flight requests that have emitted nothing yet
        self._unsent: list[ToWorker] = []  # requests (and their names' loads) of this turn of the event loop
        self._stats_waiters: list[asyncio.Future] = []
        self._restart_timer: asyncio.TimerHandle | None = None
        self._kill_reason: str | None = None
        # Since when a worker with requests in flight says it is idle.
        self._idle_since: float | None = None
        self._drained = asyncio.Event()  # set while nothing is in flight
        self._drained.set()
        self._stopped = asyncio.Event()
        self._retired = False  # stopped for good: a slot is never reused
        self.settled = asyncio.Event()  # set once the first start ended: ready or failed
        self.failure: str | None = None  # why it failed, for requests that come later
        self.failed_at = 0.0  # time.monotonic() when it did

    # -- identity and state --------------------------------------------------

    @property
    def name(self) -> str:
        """The worker's own name (its first name's)."""
        return self.spec.name

    @property
    def state(self) -> State:
        return self.sm.state

    @property
    def pid(self) -> int | None:
        return self.child.pid if self.child and not self.child.exited.is_set() else None

    def _describe(self) -> str:
        pid = self.child.pid if self.child else "-"
        others = f" (+{len(self.names) - 1} names)" if len(self.names) > 1 else ""
        return f"model={self.name}{others} pid={pid}"

    def _emit(self, ev: str, **fields: object) -> None:
        """A lifecycle event of the worker, once for each of its names."""
        for name in list(self.names.values()):
            self._emit_for(name, ev, **fields)

    def _emit_for(self, name: Name, ev: str, **fields: object) -> None:
        self.lines.write(encode_event(ev, model=name.name, lora=name.lora, **fields))

    @property
    def idle(self) -> bool:
        return self.state == State.READY and not self.in_flight and not self.queue

    @property
    def opens_think(self) -> bool:
        """Whether the running worker's chat template opens <think> (its ready line says)."""
        return bool(self._ready.get("opens_think"))

    @property
    def max_context(self) -> int | None:
        """Tokens a request may take: what the running worker said, else
        the configured limit or the model config's (read once)."""
        told = self._ready.get("max_context")
        if isinstance(told, int):
            return told
        if self._config_context is None:
            self._config_context = [self.spec.max_context or read_context_limit(self.spec.path)]
        return self._config_context[0]

    def uptime(self) -> float:
        if self.child is None or self.state not in LIVE:
            return 0.0
        return time.monotonic() - self.child.started_at

    @property
    def keep_alive(self) -> float | None:
        """Idle seconds before the worker is unloaded: the longest of its
        names' keep_alive, None (never) if any of them has none."""
        if self.keep_alive_request is not False:
            return self.keep_alive_request
        values = [n.spec.keep_alive for n in self.names.values()]
        return None if not values or None in values else max(values)

    def touch(self) -> None:
        """Counts as a use for least-recently-used eviction."""
        self.last_used = time.monotonic()

    # -- starting --------------------------------------------------------------

    async def start(self, reason: str) -> None:
        """Spawns the worker; `ready` from it moves the state on."""
        if self._retired:
            # A restart or load scheduled just before the slot was stopped.
            log.info("%s: not started (%s): the model was unloaded", self._describe(), reason)
            return
        self.sm.to(State.LOADING, reason)
        self._ready = {}
        self._kill_reason = None
        now = time.monotonic()
        for name in self.names.values():
            name.up, name.since, name.ready_line = False, now, None
        self._emit("loading")
        child = ChildProcess(self._on_lines, self._on_stderr, self._on_exit, self._on_overflow)
        self.child = child
        self.last_heard = time.monotonic()
        try:
            await child.start(*self.command())
        except Exception as exc:
            self.child = None
            if self.state != State.LOADING:
                return
            how = f"cannot start the worker process: {exc}"
            if isinstance(exc, OSError) and exc.errno in RESOURCE_ERRNOS:
                # Out of file descriptors or processes: that passes, so it is retried like a crash.
                log.error("%s: %s; will retry", self._describe(), how)
                self._crashed(how, how, exit_code=None, uptime=0.0, was_loading=True)
            else:
                log.error("%s: %s", self._describe(), how, exc_info=not isinstance(exc, OSError))
                self._give_up(how, LOAD_FAILED)
            return
        child.pause_reading(self.reading_paused)
        log.info("%s: worker started", self._describe())

    def pause_reading(self, paused: bool) -> None:
        """Stops reading the worker while its lines' reader is slow."""
        self.reading_paused = paused
        if self.child is not None:
            self.child.pause_reading(paused)

    # -- requests --------------------------------------------------------------

    def submit(self, job: Job) -> None:
        if self.state == State.FAILED:
            self.end_with_error(job, MODEL_FAILED, f"model {job.spec.name!r} has failed and waits for a load op to retry: {self.failure}")
            return
        self.queue.append(job)
        self.touch()
        name = self.names.get(job.spec.name_key)
        if name is not None:
            name.last_used = time.monotonic()
        self._dispatch()

    def _dispatch(self) -> None:
        if self.state not in (State.READY, State.BUSY):
            return
        while self.queue and len(self.in_flight) < self.max_batch:
            job = self.queue.popleft()
            self.in_flight[job.key] = job
            self._in_flight_changed()
            self._idle_since = None
            if self.state == State.READY:
                self.sm.to(State.BUSY, f"request {job.label}")
            self._send_soon(job.generate)

    def _send_soon(self, msg: ToWorker) -> None:
        """Sends `msg` with the others of this turn of the loop, in one write."""
        self._unsent.append(msg)
        if len(self._unsent) == 1:
            asyncio.get_running_loop().call_soon(self._send_unsent)

    def _send_unsent(self) -> None:
        # Requests that reach a worker in one write start together (their
        # prompts read in the same forwards: docs/engine.md), so those
        # dispatched in one turn of the loop, e.g. for the lines of one
        # chunk of stdin, go out in one write at its end.
        unsent, self._unsent = self._unsent, []
        if unsent and not (self.child is not None and self.child.send(*unsent)):
            rids = ", ".join(str(g.rid) for g in unsent if isinstance(g, Generate))
            log.warning("%s: request pipe closed while dispatching %s", self._describe(), rids or "an adapter load")

    def _send(self, msg: ToWorker) -> bool:
        """Any other message, after the requests dispatched before it."""
        self._send_unsent()
        return self.child is not None and self.child.send(msg)

    def _in_flight_changed(self) -> None:
        jobs = list(self.in_flight.values())
        sink = jobs[0].sink if jobs else None
        self._sink = sink if all(job.sink is sink for job in jobs) else None
        self._silent = [job for job in jobs if not job.emitted]
        if jobs:
            self._drained.clear()
        else:
            self._drained.set()

    def _emitted(self, job: Job) -> None:
        job.emitted = True
        self._silent.remove(job)

    def cancel(self, id_json: str) -> bool:
        """Cancels a queued or in-flight request with this id."""
        for job in self.queue:
            if job.id_json == id_json:
                self.queue.remove(job)
                self._end(job, encode_cancelled_done(job.id_json))
                return True
        job = self.in_flight.get(id_json.encode())
        if job is not None and self.child is not None:
            self._send(Cancel(rid=job.rid))
            return True
        return False

    def fail_queued(self, code: str, msg: Callable[[str], str]) -> None:
        """Ends every queued request with an error; `msg(name)` says why,
        naming the model as the request named it."""
        jobs = list(self.queue)
        self.queue.clear()
        for job in jobs:
            self.end_with_error(job, code, msg(job.spec.name))

    def end_with_error(self, job: Job, code: str, msg: str) -> None:
        self.events.error_counted(self, job, code)
        self._end(job, encode_error(msg, code, job.id_json))

    def _end(self, job: Job, line: bytes) -> None:
        """Writes the one terminal line of a request (from the worker or ours)."""
        if job.finished:
            log.error("%s: second terminal line for request %s dropped", self._describe(), job.label)
            return
        job.finished = True
        job.sink.write(line)
        self.events.request_ended(self, job)

    # -- worker output -----------------------------------------------------------

    def _on_lines(self, block: bytes) -> None:
        if self._kill_reason is not None:
            return  # being killed as broken: nothing it writes counts any more
        self.last_heard = time.monotonic()
        # Fast path: a block of token lines goes whole to the in-flight
        # requests' one sink. A request's first line must be seen (whether a
        # crash may retry it depends on it), so a block holding one goes line
        # by line, as does anything else (a stray line included).
        sink = self._sink
        lines = token_block(block) if sink is not None else 0
        if lines:
            if len(self.in_flight) == 1:
                if self._silent:
                    self._emitted(self._silent[0])
            elif any(holds(block, job.key, lines) for job in self._silent):
                sink = None
            if sink is not None:
                self._idle_since = None
                sink.write(block)
                return
        for line in block.splitlines(keepends=True):
            self._on_line(line)
            if self._kill_reason is not None:
                return

    def _on_line(self, line: bytes) -> None:
        # Token lines are relayed as the worker wrote them (its EventChannel
        # writes whole lines); every other line is read before it can reach
        # a client, and a terminal line we cannot read means the worker is
        # broken: it is killed, so the request still ends once.
        event = read_line(line)
        if event is TOKEN:
            job = self.in_flight.get(line_id(line))
            if job is None:
                log.warning("%s: token line of no request in flight dropped: %r", self._describe(), line[-80:])
                return
            if not job.emitted:
                self._emitted(job)
            self._idle_since = None
            job.sink.write(line)
            return
        match event:
            case Done():
                job = self.in_flight.get(line_id(line))
                if job is None:
                    log.warning("%s: final line of no request in flight dropped: %r", self._describe(), line[-80:])
                    return
                self._finish(job, line, event)
            case Error(code=code):
                job = self.in_flight.get(line_id(line))
                if job is None:
                    self.lines.write(line)
                    return
                self.events.error_counted(self, job, code)
                self._finish(job, line, None)
            case Heartbeat(busy=busy):
                if not self.in_flight or busy:
                    self._idle_since = None
                elif self._idle_since is None:
                    self._idle_since = time.monotonic()
            case WorkerStats():
                self._got_stats(event)
            case Ready():
                self._on_ready(line)
            case Loading():
                for name in [n for n in self.names.values() if not n.up]:
                    self.lines.write(renamed(line, name.name, self.name))
            case AdapterLoaded() | AdapterError():
                self._on_adapter_event(line, event.lora, isinstance(event, AdapterLoaded))
            case AdapterUnloaded(lora=lora, resident=resident):
                # The pool has answered the unload with `unloaded` already.
                log.info("%s: adapter %s unloaded (was resident: %s)", self._describe(), lora, resident)
            case Other(ev="embedding"):
                # One vector of an embeddings request: relayed as a token line is.
                job = self.in_flight.get(line_id(line))
                if job is None:
                    log.warning("%s: embedding line of no request in flight dropped", self._describe())
                    return
                if not job.emitted:
                    self._emitted(job)
                self._idle_since = None
                job.sink.write(line)
            case Malformed(why=why, terminal=terminal):
                if terminal and self.in_flight:
                    # Which request it meant to end cannot be read: the
                    # worker is broken, and its crash ends them all once.
                    self.kill(f"it wrote {why}")
                else:
                    log.warning("%s: malformed line from the worker dropped (%s): %r", self._describe(), why, line[:120])
            case _:
                self.lines.write(line)

    def _finish(self, job: Job, line: bytes, done: Done | None) -> None:
        del self.in_flight[job.key]
        self._in_flight_changed()
        self.touch()
        name = self.names.get(job.spec.name_key)
        if name is not None:  # else unloaded while the request ended
            name.served += 1
            if done is not None:
                name.tokens += done.gen_tokens
                name.drafted_tokens += done.drafted_tokens
                name.accepted_tokens += done.accepted_tokens
        if done is not None:
            self.events.request_done(self, job, done)
        self._end(job, line)
        if not self.in_flight and self.state == State.BUSY:
            self.sm.to(State.READY, f"request {job.label} done")
        self._dispatch()
        if self.idle:
            self.events.idle(self)

    def _on_ready(self, line: bytes) -> None:
        if self.state != State.LOADING:
            log.warning("%s: a second ready line dropped: %r", self._describe(), line[:200])
            return
        self._ready = parse_event(line)
        self._ready_at = time.monotonic()
        chosen = self._ready.get("max_batch")
        if isinstance(chosen, int) and chosen >= 1:
            self.max_batch = self._capped(chosen)
            self.max_batch_why = self._ready.get("max_batch_why")
        self.sm.to(State.READY, "worker ready")
        self.settled.set()
        asked: set[str] = set()
        for name in list(self.names.values()):
            if name.lora is None:
                self._announce(name, line)
            elif name.lora not in asked:
                asked.add(name.lora)
                self._send(LoadAdapter(path=name.lora))
        self.request_stats_nowait()
        self._dispatch()
        if self.idle:
            self.events.idle(self)

    def _on_stderr(self, data: bytes) -> None:
        self.last_heard = time.monotonic()
        self.stderr_tail.feed(data)
        self.events.worker_stderr(data)

    def _on_overflow(self) -> None:
        self.kill(f"it wrote a line longer than {MAX_WORKER_LINE} bytes")

    # -- stats -------------------------------------------------------------------

    def request_stats_nowait(self) -> None:
        self._send(Stats())

    async def fresh_stats(self, timeout: float = 2.0) -> WorkerStats | None:
        """The worker's measured figures now, or the last ones it reported
        (None before its first report)."""
        if self.child is None or self.state not in LIVE:
            return self.stats
        future = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(future)
        if not self._send(Stats()):
            self._stats_waiters.remove(future)
            return self.stats
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            return self.stats

    def _capped(self, rows: int) -> int:
        """The worker's number of rows, within a configured max_batch."""
        return min(self.spec.max_batch, rows) if isinstance(self.spec.max_batch, int) else rows

    def _got_stats(self, stats: WorkerStats) -> None:
        self.stats = stats
        if stats.max_batch:
            # A worker whose architecture cannot batch runs one at a time;
            # the rest then wait here, where a cancel stays local.
            self.max_batch = self._capped(stats.max_batch)
        waiters, self._stats_waiters = self._stats_waiters, []
        for future in waiters:
            if not future.done():
                future.set_result(stats)

    # -- names and their adapters ------------------------------------------------

    def join(self, spec: ModelSpec) -> Name:
        """The name of `spec` on this worker; a new one comes up now if the
        worker runs (`loading`, then `ready` once its adapter is loaded),
        else with the worker."""
        name = self.names.get(spec.name_key)
        if name is None:
            name = self.names[spec.name_key] = Name(spec, last_used=time.monotonic())
            if self.state in LIVE:
                name.since = time.monotonic()
                self._emit_for(name, "loading")
                if self.state != State.LOADING:
                    self._bring_up(name)
        return name

    def _bring_up(self, name: Name) -> None:
        """Its ready line now, or once the worker has its adapter."""
        if name.lora is None:
            self._announce(name)
        else:
            # In one write with the request that brought the name, if one
            # did: the worker then answers both with one read of the file
            # (a request arriving after a failed read reads it again, and
            # the name got two adapter_error lines).
            self._send_soon(LoadAdapter(path=name.lora))

    def _announce(self, name: Name, worker_line: bytes | None = None) -> None:
        """The name's `ready` line: the worker's, for its name and adapter."""
        if name.since <= self._ready_at:
            # Up with the worker: its load time, and the adapter's read after it.
            load_ms = self._ready.get("load_ms", 0) + int((time.monotonic() - self._ready_at) * 1000 if name.lora else 0)
        else:
            load_ms = int((time.monotonic() - name.since) * 1000)
        if worker_line is not None and name.name == self.name:
            line = worker_line  # the worker spoke for this very name: its line as written
        else:
            fields = {k: v for k, v in self._ready.items() if k != "ev"}
            line = encode_event("ready", **{**fields, "model": name.name, "lora": name.lora, "load_ms": load_ms})
        name.up, name.ready_line = True, line
        self.lines.write(line)

    def _on_adapter_event(self, line: bytes, lora: str | None, loaded: bool) -> None:
        """adapter_loaded / adapter_error about `lora`, written once per name
        with that adapter; except that adapter_loaded brings up the names
        still coming up, and their `ready` line stands for it, as it did when
        a worker read its one adapter at start."""
        names = [n for n in self.names.values() if n.lora == lora]
        coming = [n for n in names if not n.up] if loaded and self.state in (State.READY, State.BUSY) else []
        told = [n for n in names if n not in coming]
        if self.events.adapter_event(self, lora, [n.spec for n in told], loaded):
            log.info("%s: adapter %s: a failed reload, tried again: %r", self._describe(), lora, line[:200])
            return
        failed = None if loaded else str(parse_event(line).get("msg") or "the adapter could not be loaded")
        for name in names:
            if loaded or not name.up:
                name.adapter_error = failed
        for name in told:
            self.lines.write(renamed(line, name.name, self.name))
        if not names:
            log.info("%s: adapter event of no name dropped: %r", self._describe(), line[:200])
        for name in coming:
            self._announce(name)

    def load_adapter(self, lora: str) -> bool:
        """Makes the worker hold this adapter (a use, for its least recently
        used order); answered by adapter_loaded or adapter_error."""
        return self.state in LIVE and self._send(LoadAdapter(path=lora))

    def reload_adapter(self, lora: str) -> bool:
        """The worker reads the adapter's file again (it changed, or the
        `reload` op): new requests get the new version, a bad file keeps the
        one it has."""
        return self.state in LIVE and self._send(ReloadAdapter(path=lora))

    def adapter_missing(self, lora: str) -> None:
        msg = f"adapter {lora} was deleted (or cannot be reached); the worker keeps the version it loaded"
        for name in [n for n in self.names.values() if n.lora == lora]:
            self._emit_for(name, "adapter_error", code=ADAPTER_ERROR, msg=msg)

    def remove_name(self, spec: ModelSpec, reason: str) -> bool:
        """Unloads one name while the worker goes on serving the others: its
        queued requests end with `unloaded`, those in flight are cancelled
        (finish_reason cancelled), its adapter leaves the worker's memory
        unless another name uses it. False when it is not here."""
        name = self.names.pop(spec.name_key, None)
        if name is None:
            return False
        jobs = [job for job in self.queue if job.spec.name_key == spec.name_key]
        for job in jobs:
            self.queue.remove(job)
            self.end_with_error(job, UNLOADED, f"request not run: model {job.spec.name!r} {reason}")
        for job in list(self.in_flight.values()):
            if job.spec.name_key == spec.name_key:
                self._send(Cancel(rid=job.rid))
        if name.lora is not None and not self.uses(name.lora) and self.state in LIVE:
            self._send(UnloadAdapter(path=name.lora))
        self._emit_for(name, "unloaded", reason=reason)
        if self.idle:
            self.events.idle(self)
        return True

    def uses(self, lora: str) -> bool:
        """Whether a name of this worker runs with the adapter `lora`."""
        return any(n.lora == lora for n in self.names.values())

    def waiting(self, spec: ModelSpec) -> tuple[int, int]:
        """The name's requests queued here and in flight at the worker."""
        key = spec.name_key
        return sum(1 for j in self.queue if j.spec.name_key == key), sum(1 for j in self.in_flight.values() if j.spec.name_key == key)

    # -- faults ------------------------------------------------------------------

    def kill(self, reason: str) -> None:
        """Kills a misbehaving worker; its exit then goes through the crash path."""
        if self.child is None or self.child.exited.is_set():
            return
        log.warning("%s: killing worker: %s", self._describe(), reason)
        self._kill_reason = reason
        self.child.kill()

    def check_stall(self, now: float, stall_timeout: float) -> None:
        child = self.child
        if child is None or child.exited.is_set() or self.state not in LIVE:
            return
        blocked = child.write_blocked_since
        if blocked is not None and now - blocked > stall_timeout:
            self.kill(f"it has not read its request pipe for {now - blocked:.0f}s (stall_timeout {stall_timeout:g}s)")
            return
        if child.reading_paused:
            # A slow client made us stop reading this worker: its silence is
            # ours, and its last heartbeat may be stale.
            self.last_heard = now
            if self._idle_since is not None:
                self._idle_since = now
            return
        if self.state == State.BUSY and self._idle_since is not None and now - self._idle_since > stall_timeout:
            # Alive (heartbeats) but it never picked up the request: its
            # request pipe is stuck, short of full.
            self.kill(f"its heartbeats say idle {now - self._idle_since:.0f}s after a request was sent (stall_timeout {stall_timeout:g}s)")
            return
        if self.state in (State.LOADING, State.BUSY) and now - self.last_heard > stall_timeout:
            self.kill(f"no event or heartbeat for {now - self.last_heard:.0f}s (stall_timeout {stall_timeout:g}s)")

    def _on_exit(self, code: int | None) -> None:
        child = self.child
        child.signal_group(signal.SIGKILL)
        child.close()
        if self.state == State.STOPPING:
            self._cancel_in_flight()
            self._stopped.set()
            return
        how = self._kill_reason or describe_exit(code)
        last = self.stderr_tail.text()
        tail = f"; last stderr: {last}" if last else ""
        was_loading = self.state == State.LOADING
        log.error("%s: worker died (%s)%s", self._describe(), how, tail)
        jobs = list(self.in_flight.values())
        self.in_flight.clear()
        self._in_flight_changed()
        self._unsent.clear()
        retry = []
        for job in jobs:
            if not job.emitted and job.attempts == 0:
                # Nothing reached the client yet, so a second try is invisible.
                job.attempts += 1
                retry.append(job)
                log.info("%s: request %s will be retried after the restart", self._describe(), job.label)
            else:
                self.end_with_error(job, WORKER_CRASHED, f"worker for model {job.spec.name!r} crashed ({how}) while generating{tail}")
        self.queue.extendleft(reversed(retry))
        self._crashed(how, f"{how}{tail}", exit_code=code, uptime=time.monotonic() - child.started_at, was_loading=was_loading)

    def _crashed(self, how: str, why: str, *, exit_code: int | None, uptime: float, was_loading: bool) -> None:
        """Restart with backoff, or give up: the restart policy decides."""
        decision = on_crash(self.restart_policy, self.history, now=time.monotonic(), uptime=uptime, exit_code=exit_code, rng=self.rng)
        self.history = decision.history
        if isinstance(decision, GiveUp):
            self._give_up(f"{decision.reason} ({why})", LOAD_FAILED if was_loading else MODEL_FAILED)
            return
        self.restarts += 1
        self.events.restarted(self)
        self.sm.to(State.RESTARTING, how)
        self._emit("restarting", attempt=decision.attempt, delay_s=round(decision.delay, 3), reason=how)
        self._restart_timer = asyncio.get_running_loop().call_later(decision.delay, self._restart_now)

    def _restart_now(self) -> None:
        self._restart_timer = None
        if self.state == State.RESTARTING:
            self.events.spawn(self.start("restart after crash"))

    def _give_up(self, reason: str, code: str) -> None:
        self.failure = reason
        self.failed_at = time.monotonic()
        self.sm.to(State.FAILED, reason)
        self.settled.set()
        self._emit("failed", reason=reason)
        self.fail_queued(code, lambda model: f"model {model!r} failed: {reason}")
        self.events.idle(self)

    def reset_failed(self) -> None:
        self.history = CrashHistory()

    # -- stopping ----------------------------------------------------------------

    async def stop(self, reason: str, queued_code: str = UNLOADED) -> None:
        """Ends queued requests with `queued_code`, cancels those in flight
        (finish_reason cancelled), stops the process and emits `unloaded`."""
        self._retired = True
        if self.state == State.STOPPING:
            await self._stopped.wait()
            return

        def not_run(model: str) -> str:
            return f"request not run: model {model!r} {reason}"

        if self.state == State.UNLOADED:
            # Never started (waiting for room): nothing to stop.
            self.fail_queued(queued_code, not_run)
            self._emit("unloaded", reason=reason)
            return
        self.sm.to(State.STOPPING, reason)
        if self._restart_timer is not None:
            self._restart_timer.cancel()
            self._restart_timer = None
        self.fail_queued(queued_code, not_run)
        child = self.child
        if self.in_flight and child is not None and not child.exited.is_set():
            for job in self.in_flight.values():
                self._send(Cancel(rid=job.rid))
            try:
                await asyncio.wait_for(self._drained.wait(), CANCEL_GRACE)
            except TimeoutError:
                log.warning("%s: requests %s ignored their cancel", self._describe(), ", ".join(j.label for j in self.in_flight.values()))
        if child is not None and not child.exited.is_set():
            await child.stop()
        self._cancel_in_flight()
        self._stopped.set()
        self.sm.to(State.UNLOADED, reason)
        self._emit("unloaded", reason=reason)

    def _cancel_in_flight(self) -> None:
        jobs = list(self.in_flight.values())
        self.in_flight.clear()
        self._in_flight_changed()
        for job in jobs:
            self._end(job, encode_cancelled_done(job.id_json))
