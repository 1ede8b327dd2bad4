"""The names one worker serves (SPEC §10).

A name is a configured or requested (model name, adapter) pair; every name
whose spec has the same worker key is served by one worker, which runs each
request with the adapter its name gives. The worker speaks under one name
of its own (its `--name`); each lifecycle line it writes about the base
model or an adapter goes out once per name it concerns, with that name in
its `model` field.
"""

from __future__ import annotations

from dataclasses import dataclass

from ipc.events import encode_event
from ipc.worker_events import parse_event
from supervisor.spec import ModelSpec


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
