"""The requests of one worker: those waiting for it, those in flight at it,
and where each line it writes goes.

Up to `max_batch` requests are in flight at the worker, the rest wait here,
first in first out. Each line the worker writes belongs to the in-flight
request its id tail names (a line without an id, to the one request without
an id) and is relayed to that request's sink as received, never decoded and
re-encoded; every other line is read once (ipc.worker_events.read_line) and
handed to the slot (`WorkerSide.heard`).

A slot owns one `Traffic`; it moves the slot's state between READY and
BUSY as requests come and go, the slot every other move.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from typing import Protocol

from ipc.events import MODEL_FAILED, UNLOADED, WORKER_CRASHED, encode_cancelled_done, encode_error
from ipc.messages import Cancel, Generate, ToWorker
from ipc.worker_events import TOKEN, Done, Error, Heartbeat, Malformed, Other, holds, line_id, read_line, token_block
from supervisor.child import ChildProcess
from supervisor.job import Job, Sink
from supervisor.names import Name
from supervisor.states import State, StateMachine

log = logging.getLogger("lattice.worker")


class WorkerSide(Protocol):
    """What the requests read of their slot, and ask of it."""

    names: dict[tuple, Name]
    child: ChildProcess | None
    max_batch: int
    failure: str | None  # why the model failed, for requests that come later
    kill_reason: str | None  # set while the worker is killed as broken

    def describe(self) -> str: ...

    def touch(self) -> None: ...

    def heard(self, event: object, line: bytes) -> None:
        """A line about no request (ready, stats, loading, adapters, ...)."""

    def kill(self, reason: str) -> None: ...


class RequestsTold(Protocol):
    """What the requests tell the pool (a part of supervisor.slot.SlotEvents)."""

    def request_ended(self, slot: WorkerSide, job: Job) -> None:
        """The job's one terminal line has gone to its sink."""

    def request_done(self, slot: WorkerSide, job: Job, done: Done) -> None:
        """The worker finished a request of the name `job.spec` (its done line, for the counters)."""

    def error_counted(self, slot: WorkerSide, job: Job, code: str | None) -> None:
        """An error line ended a request (the worker's or the slot's)."""

    def idle(self, slot: WorkerSide) -> None:
        """Nothing in flight or queued (or the model failed): room for others."""


class Traffic:
    def __init__(self, owner: WorkerSide, events: RequestsTold, sm: StateMachine, lines: Sink):
        self.owner = owner
        self.events = events  # the pool's: told about the owner slot
        self.sm = sm
        self.lines = lines  # lines of no request
        self.queue: collections.deque[Job] = collections.deque()
        self.in_flight: dict[bytes | None, Job] = {}  # by id (None: the id-less request), in dispatch order
        self._sink: Sink | None = None  # the one sink of every in-flight request, if they share one
        self._silent: list[Job] = []  # in-flight requests that have emitted nothing yet
        self._unsent: list[ToWorker] = []  # requests (and their names' loads) of this turn of the event loop
        # Since when a worker with requests in flight says it is idle.
        self.idle_since: float | None = None
        self.drained = asyncio.Event()  # set while nothing is in flight
        self.drained.set()

    @property
    def idle(self) -> bool:
        return self.sm.state == State.READY and not self.in_flight and not self.queue

    def quiet(self) -> None:
        """Tells the pool when nothing is in flight or queued: room for others."""
        if self.idle:
            self.events.idle(self.owner)

    def submit(self, job: Job) -> None:
        if self.sm.state == State.FAILED:
            self.end_with_error(job, MODEL_FAILED, f"model {job.spec.name!r} has failed and waits for a load op to retry: {self.owner.failure}")
            return
        self.queue.append(job)
        self.owner.touch()
        name = self.owner.names.get(job.spec.name_key)
        if name is not None:
            name.last_used = time.monotonic()
        self.dispatch()

    def dispatch(self) -> None:
        if self.sm.state not in (State.READY, State.BUSY):
            return
        while self.queue and len(self.in_flight) < self.owner.max_batch:
            job = self.queue.popleft()
            self.in_flight[job.key] = job
            self._in_flight_changed()
            self.idle_since = None
            if self.sm.state == State.READY:
                self.sm.to(State.BUSY, f"request {job.label}")
            self.send_soon(job.generate)

    def send_soon(self, msg: ToWorker) -> None:
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
        child = self.owner.child
        if unsent and not (child is not None and child.send(*unsent)):
            rids = ", ".join(str(g.rid) for g in unsent if isinstance(g, Generate))
            log.warning("%s: request pipe closed while dispatching %s", self.owner.describe(), rids or "an adapter load")

    def send(self, msg: ToWorker) -> bool:
        """Any other message, after the requests dispatched before it."""
        self._send_unsent()
        child = self.owner.child
        return child is not None and child.send(msg)

    def _in_flight_changed(self) -> None:
        jobs = list(self.in_flight.values())
        sink = jobs[0].sink if jobs else None
        self._sink = sink if all(job.sink is sink for job in jobs) else None
        self._silent = [job for job in jobs if not job.emitted]
        if jobs:
            self.drained.clear()
        else:
            self.drained.set()

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
        if job is not None and self.owner.child is not None:
            self.send(Cancel(rid=job.rid))
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
        self.events.error_counted(self.owner, job, code)
        self._end(job, encode_error(msg, code, job.id_json))

    def _end(self, job: Job, line: bytes) -> None:
        """Writes the one terminal line of a request (from the worker or ours)."""
        if job.finished:
            log.error("%s: second terminal line for request %s dropped", self.owner.describe(), job.label)
            return
        job.finished = True
        job.sink.write(line)
        self.events.request_ended(self.owner, job)

    def drop_name(self, name_key: tuple, reason: str) -> None:
        """A name leaves: its queued requests end with `unloaded`, those in
        flight are cancelled (finish_reason cancelled)."""
        jobs = [job for job in self.queue if job.spec.name_key == name_key]
        for job in jobs:
            self.queue.remove(job)
            self.end_with_error(job, UNLOADED, f"request not run: model {job.spec.name!r} {reason}")
        for job in list(self.in_flight.values()):
            if job.spec.name_key == name_key:
                self.send(Cancel(rid=job.rid))

    def waiting(self, spec) -> tuple[int, int]:
        """The name's requests queued here and in flight at the worker."""
        key = spec.name_key
        return sum(1 for j in self.queue if j.spec.name_key == key), sum(1 for j in self.in_flight.values() if j.spec.name_key == key)

    # -- worker output -----------------------------------------------------------

    def route(self, block: bytes) -> None:
        """A block of whole lines from the worker."""
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
                self.idle_since = None
                sink.write(block)
                return
        for line in block.splitlines(keepends=True):
            self._on_line(line)
            if self.owner.kill_reason is not None:
                return

    def _on_line(self, line: bytes) -> None:
        # Token lines are relayed as the worker wrote them (its EventChannel
        # writes whole lines); every other line is read before it can reach
        # a client, and a terminal line we cannot read means the worker is
        # broken: it is killed, so the request still ends once.
        event = read_line(line)
        if event is TOKEN:
            self._relay(line, "token")
            return
        match event:
            case Other(ev="embedding"):
                # One vector of an embeddings request: relayed as a token line is.
                self._relay(line, "embedding")
            case Done():
                job = self.in_flight.get(line_id(line))
                if job is None:
                    log.warning("%s: final line of no request in flight dropped: %r", self.owner.describe(), line[-80:])
                    return
                self._finish(job, line, event)
            case Error(code=code):
                job = self.in_flight.get(line_id(line))
                if job is None:
                    self.lines.write(line)
                    return
                self.events.error_counted(self.owner, job, code)
                self._finish(job, line, None)
            case Heartbeat(busy=busy):
                if not self.in_flight or busy:
                    self.idle_since = None
                elif self.idle_since is None:
                    self.idle_since = time.monotonic()
            case Malformed(why=why, terminal=terminal):
                if terminal and self.in_flight:
                    # Which request it meant to end cannot be read: the
                    # worker is broken, and its crash ends them all once.
                    self.owner.kill(f"it wrote {why}")
                else:
                    log.warning("%s: malformed line from the worker dropped (%s): %r", self.owner.describe(), why, line[:120])
            case _:
                self.owner.heard(event, line)

    def _relay(self, line: bytes, what: str) -> None:
        job = self.in_flight.get(line_id(line))
        if job is None:
            log.warning("%s: %s line of no request in flight dropped: %r", self.owner.describe(), what, line[-80:])
            return
        if not job.emitted:
            self._emitted(job)
        self.idle_since = None
        job.sink.write(line)

    def _finish(self, job: Job, line: bytes, done: Done | None) -> None:
        del self.in_flight[job.key]
        self._in_flight_changed()
        self.owner.touch()
        name = self.owner.names.get(job.spec.name_key)
        if name is not None:  # else unloaded while the request ended
            name.served += 1
            if done is not None:
                name.tokens += done.gen_tokens
                name.drafted_tokens += done.drafted_tokens
                name.accepted_tokens += done.accepted_tokens
        if done is not None:
            self.events.request_done(self.owner, job, done)
        self._end(job, line)
        if not self.in_flight and self.sm.state == State.BUSY:
            self.sm.to(State.READY, f"request {job.label} done")
        self.dispatch()
        self.quiet()

    # -- the worker's end ----------------------------------------------------------

    def worker_died(self, how: str, tail: str) -> None:
        """Requests in flight at a worker that died: those that showed
        nothing yet wait for the restart (once), the rest end with an error."""
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
                log.info("%s: request %s will be retried after the restart", self.owner.describe(), job.label)
            else:
                self.end_with_error(job, WORKER_CRASHED, f"worker for model {job.spec.name!r} crashed ({how}) while generating{tail}")
        self.queue.extendleft(reversed(retry))

    def cancel_in_flight(self) -> None:
        jobs = list(self.in_flight.values())
        self.in_flight.clear()
        self._in_flight_changed()
        for job in jobs:
            self._end(job, encode_cancelled_done(job.id_json))
