"""What the worker's main thread takes from its inbox: one typed union.

The frame reader puts the supervisor's messages in as they came (a Generate
with the time its frame was read); side threads put a Wake when work of
theirs ends; the main thread adds an IdleRelease when it has been idle long
enough. A rank of a group takes the same items from rank 0 instead
(worker.group.server), so every rank applies them alike.
"""

from __future__ import annotations

import msgspec

from ipc.messages import Cancel, Generate, LoadAdapter, ReloadAdapter, Shutdown, UnloadAdapter


class Arrived(msgspec.Struct, frozen=True):
    """A request, and when its frame was read (time.perf_counter): its
    time to first token counts from then."""

    req: Generate
    at: float


class Wake(msgspec.Struct, frozen=True):
    """A side thread's work ended (an adapter read, a prefix file read):
    the step after it settles the result."""


class IdleRelease(msgspec.Struct, tag="idle_release", frozen=True):
    """The worker has been idle for idle_release_s: MLX's buffer cache goes
    back. An item of its own, so that rank 0 of a group passes it on (the
    other ranks wait on the group meanwhile, so they have no clock of their
    own)."""


Item = Arrived | Cancel | LoadAdapter | ReloadAdapter | UnloadAdapter | Shutdown | IdleRelease | Wake
