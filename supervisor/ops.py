"""The pool's control ops (load, unload, reload, cancel, status, shutdown)
from stdin and the control socket.

The part of an op that decides runs now, so ops and requests take effect in
the order their lines arrived; waiting (a worker stopping, stats replies)
continues in a task. The pool owns one `Ops`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from ipc.events import BAD_REQUEST, INTERNAL, SHUTTING_DOWN, UNKNOWN_MODEL, encode_error
from supervisor.job import Job, Sink
from supervisor.requests import REQUEST_OPS, ClientLine
from supervisor.resolve import AdapterRefused, Resolver, UnknownModel
from supervisor.slot import WorkerSlot
from supervisor.spec import ModelSpec
from supervisor.states import State
from supervisor.status import Status, status_event
from supervisor.stdout import Output
from supervisor.workers import Workers

log = logging.getLogger("lattice.pool")

Answer = Callable[[bytes], None]


class _Answering:
    """An op's answer function as the sink of a request."""

    def __init__(self, answer: Answer):
        self.write = answer


class Door(Protocol):
    """What the ops use of the pool (supervisor.pool.Pool): its front door."""

    output: Output
    resolver: Resolver
    workers: Workers
    slots: dict[tuple, WorkerSlot]
    active: dict[str, Job]
    accepting: bool
    shutdown_requested: asyncio.Event

    def spawn(self, coro) -> asyncio.Task: ...

    def submit(self, msg: ClientLine, sink: Sink | None = None, surface: str = "stdin") -> None: ...

    def reject(self, code: str, msg: str, id_json: str | None) -> None: ...

    def cancel(self, id_json: str, answer: Answer | None = None) -> None: ...

    def unload(self, spec: ModelSpec, reason: str, answer: Answer | None = None) -> None: ...

    async def status(self) -> Status: ...


class Ops:
    def __init__(self, pool: Door):
        self.pool = pool

    def op(self, msg: ClientLine, answer: Answer | None = None) -> asyncio.Task | None:
        """Runs a control op. The part that decides runs now, so ops and
        requests take effect in the order their lines arrived; waiting (a
        worker stopping, stats replies) continues in a task.

        answer: where the op's own reply goes (the status event, an error,
        the ready line of a model already up) when it did not come from
        stdin; lifecycle events (loading, ready, unloaded...) always go to
        stdout. Returns the task that will still write a reply, if any."""
        id_json = msg.id_json
        if msg.op in REQUEST_OPS:
            self.pool.submit(msg, None if answer is None else _Answering(answer))
            return None
        if msg.op == "status":
            return self.pool.spawn(self._write_status(answer or self.pool.output.write))
        if msg.op == "cancel":
            self.pool.cancel(id_json, answer)
            return None
        if msg.op == "shutdown":
            self.pool.shutdown_requested.set()
            return None
        try:
            # Ops come from stdin or the control socket (the pool's user); an
            # unload or reload names a name already known, whose file may
            # have gone since.
            spec = self.pool.resolver.resolve(msg.model, msg.lora, lora_paths=True, check_lora=msg.op == "load")
        except AdapterRefused as exc:
            self._refuse(BAD_REQUEST, str(exc), id_json, answer)
            return None
        except UnknownModel as exc:
            self._refuse(UNKNOWN_MODEL, str(exc), id_json, answer)
            return None
        if msg.op == "load":
            if not self.pool.accepting:
                # A worker started now could outlive the stop of all workers.
                self._refuse(SHUTTING_DOWN, "the pool is shutting down", id_json, answer)
                return None
            self.load(spec, answer)
        elif msg.op == "unload":
            self.pool.unload(spec, "unloaded on request", answer)
        elif msg.op == "reload":
            self.reload(spec, id_json, answer)
        return None

    def cancel_for(self, id_json: str, sink: Sink) -> None:
        """Cancels the request `id_json` if it still runs for `sink` (a
        control client that went away: nobody reads its lines any more)."""
        job = self.pool.active.get(id_json)
        if job is not None and job.sink is sink:
            self.pool.cancel(id_json, lambda _: None)

    def runs_for(self, id_json: str, sink: Sink) -> bool:
        job = self.pool.active.get(id_json)
        return job is not None and job.sink is sink

    def _refuse(self, code: str, msg: str, id_json: str | None, answer: Answer | None) -> None:
        if answer is None:
            self.pool.reject(code, msg, id_json)
        else:
            answer(encode_error(msg, code, id_json))

    async def _write_status(self, answer: Answer) -> None:
        try:
            line = status_event(await self.pool.status())
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
        slot = self.pool.slots.get(spec.key)
        if slot is not None and slot.state == State.FAILED:
            # An explicit load is the user saying "try again".
            self.pool.workers.slot_for(spec)
            slot.reset_failed()
            self.pool.spawn(slot.start("load requested after failure"))
            return
        already = slot is not None and spec.name_key in slot.names
        slot = self.pool.workers.slot_for(spec)
        slot.touch()
        name = slot.names[spec.name_key]
        name.last_used = time.monotonic()
        if already and slot.state in (State.READY, State.BUSY):
            if name.up:
                (answer or self.pool.output.write)(name.ready_line)
            if name.lora is not None:
                # Read again if the worker dropped it, or if it failed before
                # (its name then comes up now).
                slot.roster.load_adapter(name.lora)

    def reload(self, spec: ModelSpec, id_json: str | None, answer: Answer | None = None) -> None:
        slot = self.pool.slots.get(spec.key)
        if slot is None or spec.name_key not in slot.names:
            self._refuse(BAD_REQUEST, f"model {spec.name!r} is not running; nothing to reload", id_json, answer)
        elif spec.lora is None:
            self._refuse(BAD_REQUEST, f"model {spec.name!r} has no adapter; nothing to reload", id_json, answer)
        elif not slot.roster.reload_adapter(str(spec.lora)):
            self._refuse(BAD_REQUEST, f"model {spec.name!r} is not running; nothing to reload", id_json, answer)
