"""The lifecycle of one worker. Only its WorkerSlot changes it, and only
through `StateMachine.to()`, which refuses transitions not listed here and
logs every one with the model and pid."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable

log = logging.getLogger("lattice.state")


class State(str, enum.Enum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    READY = "ready"
    BUSY = "busy"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPING = "stopping"


S = State
TRANSITIONS: dict[State, frozenset[State]] = {
    S.UNLOADED: frozenset({S.LOADING}),
    S.LOADING: frozenset({S.READY, S.RESTARTING, S.FAILED, S.STOPPING}),
    S.READY: frozenset({S.BUSY, S.RESTARTING, S.STOPPING, S.FAILED}),
    S.BUSY: frozenset({S.READY, S.RESTARTING, S.STOPPING, S.FAILED}),
    S.RESTARTING: frozenset({S.LOADING, S.FAILED, S.STOPPING}),
    S.FAILED: frozenset({S.LOADING, S.STOPPING}),
    S.STOPPING: frozenset({S.UNLOADED}),
}

LIVE = frozenset({S.LOADING, S.READY, S.BUSY})


class InvalidTransition(Exception):
    pass


class StateMachine:
    def __init__(self, describe: Callable[[], str]):
        self.state = State.UNLOADED
        self._describe = describe

    def to(self, new: State, reason: str) -> None:
        old = self.state
        if new not in TRANSITIONS[old]:
            raise InvalidTransition(f"{self._describe()}: {old.value} -> {new.value} is not allowed ({reason})")
        self.state = new
        log.info("%s state %s -> %s (%s)", self._describe(), old.value, new.value, reason)
