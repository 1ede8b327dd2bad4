"""A generation request on its way through the pool, and where its lines go."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ipc.messages import Embed, Generate
from supervisor.spec import ModelSpec


class Sink(Protocol):
    """Where lines go: the stdout writer for stdin's requests, a terminal
    renderer for `run` and `chat`. A write never blocks; a sink that cannot
    keep up says so through its own flow control (supervisor.stdout)."""

    def write(self, data: bytes) -> None: ...


@dataclass(eq=False)
class Job:
    """One request. Its id is `generate.id_json`, the client's id encoded
    once when its line was parsed; `key` is the same text as bytes, which is
    how the worker's lines name it (ipc.worker_events.line_id)."""

    generate: Generate | Embed  # what the worker is sent (an Embed for the `embed` op)
    spec: ModelSpec
    sink: Sink
    surface: str = "stdin"  # where it came from: "stdin" (also run/chat) or "http"
    emitted: bool = False  # a line of it reached its sink: a retry would show
    attempts: int = 0
    finished: bool = False
    key: bytes | None = field(init=False)

    def __post_init__(self) -> None:
        self.key = None if self.generate.id_json is None else self.generate.id_json.encode()

    @property
    def rid(self) -> int:
        return self.generate.rid

    @property
    def id_json(self) -> str | None:
        return self.generate.id_json

    @property
    def label(self) -> str:
        return self.id_json or f"#{self.rid}"
