"""Supervisor -> worker messages: one tagged union of msgspec Structs.

The worker answers with `@@lattice` lines only (see ipc.events), so this file
holds every typed message that crosses the pipe in the other direction.
"""

from __future__ import annotations

import msgspec

# chat_metal's generation defaults (SPEC §3); the supervisor's config may
# override them per pool, the request per call.
DEFAULT_MAX_TOKENS = 512
DEFAULT_TEMPERATURE = 0.7
DEFAULT_TOP_K = 50
DEFAULT_TOP_P = 0.9
DEFAULT_REPETITION_PENALTY = 1.1

# Bounds both sides enforce (the pool's config may change them): prompt text
# is refused above this many UTF-8 bytes before it is tokenized, and an
# adapter file above this size before it is read.
DEFAULT_MAX_PROMPT_BYTES = 1 << 20
DEFAULT_MAX_ADAPTER_BYTES = 1 << 30


def utf8_len(text: str, limit: int) -> int:
    """UTF-8 bytes of `text`, exact up to `limit`; above it, some number
    above `limit`: a text longer than the limit in characters is longer in
    bytes too, so it is never encoded just to be refused."""
    if text.isascii() or len(text) > limit:
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


class Message(msgspec.Struct, frozen=True):
    role: str
    content: str


class Generate(msgspec.Struct, tag="generate", frozen=True):
    """One generation request. `rid` is the supervisor's own number for it;
    `id_json` is the client's id, already encoded, echoed on every line."""

    rid: int
    prompt: str | None = None
    messages: list[Message] | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = DEFAULT_TEMPERATURE
    top_k: int = DEFAULT_TOP_K
    top_p: float = DEFAULT_TOP_P
    repetition_penalty: float = DEFAULT_REPETITION_PENALTY
    seed: int | None = None
    reasoning_budget: int | None = None
    stop: list[str] = []
    id_json: str | None = None


class Cancel(msgspec.Struct, tag="cancel", frozen=True):
    rid: int


class SetAdapter(msgspec.Struct, tag="set_adapter", frozen=True):
    """Load, validate and swap in the adapter at `path` (None: no adapter)."""

    path: str | None


class Stats(msgspec.Struct, tag="stats", frozen=True):
    pass


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    pass


ToWorker = Generate | Cancel | SetAdapter | Stats | Shutdown

# Internal worker events the supervisor consumes instead of relaying.
HEARTBEAT = b"heartbeat"
WORKER_STATS = b"worker_stats"
