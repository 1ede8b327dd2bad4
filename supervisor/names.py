"""The names one worker serves (docs/adapters.md).

A name is a configured or requested (model name, adapter) pair; every name
whose spec has the same worker key is served by one worker, which runs each
request with the adapter its name gives. The worker speaks under one name
of its own (its `--name`); each lifecycle line it writes about the base
model or an adapter goes out once per name it concerns, with that name in
its `model` field.

A slot keeps its names in a `Roster`: which names it serves, each name's
`ready` line once the worker (and the name's adapter) is up, the adapters
the worker is asked to hold, and the lifecycle lines written once per name.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

from ipc.events import ADAPTER_ERROR, encode_event
from ipc.messages import LoadAdapter, ReloadAdapter, ToWorker, UnloadAdapter
from ipc.worker_events import parse_event
from supervisor.adapter_prints import Print, fingerprint
from supervisor.job import Sink
from supervisor.spec import ModelSpec
from supervisor.states import LIVE, State, StateMachine

log = logging.getLogger("lattice.worker")


@dataclass(eq=False)
class Name:
    spec: ModelSpec
    served: int = 0  # requests ended by the worker (done or error line)
    tokens: int = 0
    # Speculative decoding: tokens drafted for its requests and kept.
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    # Its `ready` line went out for the running worker process: for a name
    # with an adapter, once the worker answered that adapter with
    # adapter_loaded.
    up: bool = False
    since: float = 0.0  # when it began to come up (time.monotonic)
    last_used: float = 0.0  # its last request or load (time.monotonic)
    ready_line: bytes | None = None
    # Why its adapter could not be loaded, while it never was (a failed
    # reload of a loaded one keeps the old version and is no error here).
    adapter_error: str | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def lora(self) -> str | None:
        """The adapter path, as requests and events carry it."""
        return str(self.spec.lora) if self.spec.lora else None


def renamed(line: bytes, name: str, worker_name: str) -> bytes:
    """A worker's lifecycle line as the line of `name` (its `model` field
    replaced); the line itself when the worker already speaks as `name`."""
    if name == worker_name:
        return line
    fields = parse_event(line)
    ev = fields.pop("ev")
    fields["model"] = name
    return encode_event(ev, **fields)


class RequestsSide(Protocol):
    """The slot's requests as its names use them (supervisor.traffic.Traffic)."""

    def send(self, msg: ToWorker) -> bool: ...

    def send_soon(self, msg: ToWorker) -> None: ...

    def drop_name(self, name_key: tuple, reason: str) -> None: ...

    def quiet(self) -> None: ...


class NamesSide(Protocol):
    """What the names read of their slot."""

    name: str  # the worker's own name
    ready: dict  # the fields of the running worker's ready line
    ready_at: float  # when it came (time.monotonic)
    traffic: RequestsSide  # the requests, and the way to the worker

    def describe(self) -> str: ...


class NamesTold(Protocol):
    """What the names tell the pool (a part of supervisor.slot.SlotEvents)."""

    def adapter_event(self, slot: NamesSide, lora: str | None, specs: list[ModelSpec], loaded: bool) -> bool:
        """adapter_loaded (True) or adapter_error (False) from the worker
        about `lora`, to be written for the names of `specs`; True holds
        the line back (a failed reload that will be tried again)."""


class Roster:
    """The names one worker serves, by `ModelSpec.name_key`."""

    def __init__(self, owner: NamesSide, events: NamesTold, sm: StateMachine, lines: Sink):
        self.owner = owner
        self.events = events  # the pool's: told about the owner slot
        self.sm = sm
        self.lines = lines  # lifecycle events
        self.names: dict[tuple, Name] = {}
        # A client's keep_alive (Ollama's API): seconds, None for ever; it
        # replaces the names' keep_alive for this worker. False: none given.
        self.keep_alive_request: float | None | bool = False
        # Each adapter's files' identity when the worker was last asked to
        # read it (`_read`); one per adapter of a name here.
        self.read_prints: dict[str, Print] = {}

    @property
    def keep_alive(self) -> float | None:
        """Idle seconds before the worker is unloaded: the longest of its
        names' keep_alive, None (never) if any of them has none."""
        if self.keep_alive_request is not False:
            return self.keep_alive_request
        values = [n.spec.keep_alive for n in self.names.values()]
        return None if not values or None in values else max(values)

    def emit(self, ev: str, **fields: object) -> None:
        """A lifecycle event of the worker, once for each of its names."""
        for name in list(self.names.values()):
            self.emit_for(name, ev, **fields)

    def emit_for(self, name: Name, ev: str, **fields: object) -> None:
        self.lines.write(encode_event(ev, model=name.name, lora=name.lora, **fields))

    def starting(self) -> None:
        """A worker process starts: every name comes up again with it."""
        now = time.monotonic()
        for name in self.names.values():
            name.up, name.since, name.ready_line = False, now, None
        self.emit("loading")

    def loading(self, line: bytes) -> None:
        """The worker's `loading` line, for the names still coming up."""
        for name in [n for n in self.names.values() if not n.up]:
            self.lines.write(renamed(line, name.name, self.owner.name))

    def worker_ready(self, line: bytes) -> None:
        """The worker's `ready` line: the names without an adapter are up,
        the others once the worker has read their adapter."""
        asked: set[str] = set()
        for name in list(self.names.values()):
            if name.lora is None:
                self._announce(name, line)
            elif name.lora not in asked:
                asked.add(name.lora)
                self.owner.traffic.send(self._read(LoadAdapter, name.lora))

    def join(self, spec: ModelSpec) -> Name:
        """The name of `spec` on this worker; a new one comes up now if the
        worker runs (`loading`, then `ready` once its adapter is loaded),
        else with the worker."""
        name = self.names.get(spec.name_key)
        if name is None:
            name = self.names[spec.name_key] = Name(spec, last_used=time.monotonic())
            if self.sm.state in LIVE:
                name.since = time.monotonic()
                self.emit_for(name, "loading")
                if self.sm.state != State.LOADING:
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
            self.owner.traffic.send_soon(self._read(LoadAdapter, name.lora))

    def _announce(self, name: Name, worker_line: bytes | None = None) -> None:
        """The name's `ready` line: the worker's, for its name and adapter."""
        ready, ready_at = self.owner.ready, self.owner.ready_at
        if name.since <= ready_at:
            # Up with the worker: its load time, and the adapter's read after it.
            load_ms = ready.get("load_ms", 0) + int((time.monotonic() - ready_at) * 1000 if name.lora else 0)
        else:
            load_ms = int((time.monotonic() - name.since) * 1000)
        if worker_line is not None and name.name == self.owner.name:
            line = worker_line  # the worker spoke for this very name: its line as written
        else:
            fields = {k: v for k, v in ready.items() if k != "ev"}
            line = encode_event("ready", **{**fields, "model": name.name, "lora": name.lora, "load_ms": load_ms})
        name.up, name.ready_line = True, line
        self.lines.write(line)

    def on_adapter_event(self, line: bytes, lora: str | None, loaded: bool) -> None:
        """adapter_loaded / adapter_error about `lora`, written once per name
        with that adapter; except that adapter_loaded brings up the names
        still coming up, and their `ready` line stands for it, as it did when
        a worker read its one adapter at start."""
        names = [n for n in self.names.values() if n.lora == lora]
        coming = [n for n in names if not n.up] if loaded and self.sm.state in (State.READY, State.BUSY) else []
        told = [n for n in names if n not in coming]
        if self.events.adapter_event(self.owner, lora, [n.spec for n in told], loaded):
            log.info("%s: adapter %s: a failed reload, tried again: %r", self.owner.describe(), lora, line[:200])
            return
        failed = None if loaded else str(parse_event(line).get("msg") or "the adapter could not be loaded")
        for name in names:
            if loaded or not name.up:
                name.adapter_error = failed
        for name in told:
            self.lines.write(renamed(line, name.name, self.owner.name))
        if not names:
            log.info("%s: adapter event of no name dropped: %r", self.owner.describe(), line[:200])
        for name in coming:
            self._announce(name)

    def load_adapter(self, lora: str) -> bool:
        """Makes the worker hold this adapter (a use, for its least recently
        used order); answered by adapter_loaded or adapter_error."""
        return self.sm.state in LIVE and self.owner.traffic.send(self._read(LoadAdapter, lora))

    def reload_adapter(self, lora: str) -> bool:
        """The worker reads the adapter's file again (it changed, or the
        `reload` op): new requests get the new version, a bad file keeps the
        one it has."""
        return self.sm.state in LIVE and self.owner.traffic.send(self._read(ReloadAdapter, lora))

    def _read(self, message: type[LoadAdapter] | type[ReloadAdapter], lora: str) -> LoadAdapter | ReloadAdapter:
        """The message asking the worker to read `lora`, with the files'
        identity noted as it goes: the hot-reload watch, armed only once the
        worker has read them, compares its first look with this, so a save
        in between is not missed. A few stats of the files the request's
        policy check has just looked at."""
        self.read_prints[lora] = fingerprint(lora)
        return message(path=lora)

    def adapter_missing(self, lora: str) -> None:
        msg = f"adapter {lora} was deleted (or cannot be reached); the worker keeps the version it loaded"
        for name in [n for n in self.names.values() if n.lora == lora]:
            self.emit_for(name, "adapter_error", code=ADAPTER_ERROR, msg=msg)

    def remove_name(self, spec: ModelSpec, reason: str) -> bool:
        """Unloads one name while the worker goes on serving the others: its
        queued requests end with `unloaded`, those in flight are cancelled
        (finish_reason cancelled), its adapter leaves the worker's memory
        unless another name uses it. False when it is not here."""
        name = self.names.pop(spec.name_key, None)
        if name is None:
            return False
        self.owner.traffic.drop_name(spec.name_key, reason)
        if name.lora is not None and not self.uses(name.lora):
            self.read_prints.pop(name.lora, None)
            if self.sm.state in LIVE:
                self.owner.traffic.send(UnloadAdapter(path=name.lora))
        self.emit_for(name, "unloaded", reason=reason)
        self.owner.traffic.quiet()
        return True

    def uses(self, lora: str) -> bool:
        """Whether a name of this worker runs with the adapter `lora`."""
        return any(n.lora == lora for n in self.names.values())
