"""The status row: one typed record per name (a model name and adapter
that a worker serves) that the `status` op, the `stats` events, the
Prometheus gauges and `lattice-pool ps` all read.

Fields and their meaning: docs/monitoring.md. Every memory figure is the
worker's own measurement (worker_stats), or psutil's from outside for a
worker that has not answered yet; a row without a process reports 0. The
worker's figures repeat in the row of each of its names, except
`adapter_bytes`, the name's adapter's own; `worker` tells workers apart.
"""

from __future__ import annotations

import time

import msgspec
import psutil

from ipc.events import ADAPTER_ERROR, encode_event
from ipc.worker_events import MemoryFigures, RankFigures, WorkerStats, rss_uss
from supervisor.names import Name
from supervisor.slot import WorkerSlot
from supervisor.states import State


class StatusRow(msgspec.Struct):
    model: str
    lora: str | None
    state: str
    pid: int | None
    format: str | None
    # The worker's MemoryFigures (ipc.worker_events), listed here so that a
    # row's JSON starts with what it is about (docs/monitoring.md).
    rss_bytes: int
    uss_bytes: int
    mlx_active_bytes: int
    mlx_peak_bytes: int
    mlx_cache_bytes: int
    weights_bytes: int
    adapter_bytes: int
    queued: int
    in_flight: int
    served: int
    tokens: int
    restarts: int
    uptime_s: float
    # Continuous batching: the pool sends at most max_batch requests to the
    # worker (in_flight); of those, the worker decodes active_rows and holds
    # waiting_rows back (its memory guard), their caches taking rows_cache_bytes.
    max_batch: int = 0
    # Why max_batch is what it is: "configured", or the worker's sizing
    # ("auto: 64, the cuda cap (...)"); null until the worker is ready.
    max_batch_why: str | None = None
    # The worker's memory for earlier prompts' state (its default or the
    # configured prefix_cache_bytes); null until the worker is ready.
    prefix_cache_bytes: int | None = None
    # The most the worker's rows' caches take: its memory guard, or
    # max_batch rows at the model's context if less; null until it is ready.
    rows_memory_bytes: int | None = None
    active_rows: int = 0
    waiting_rows: int = 0
    rows_cache_bytes: int = 0
    # Many names on one worker (docs/adapters.md): the worker's number, the same in
    # the rows of all its names, and the adapters it may keep in memory.
    worker: int = 0
    max_adapters: int = 0
    processor: str | None = None  # cpu, metal or cuda, as the worker reports
    # The memory of the device the worker computes on: the GPU's on CUDA,
    # the machine's on a CPU or Apple silicon; 0 until the worker reports it.
    device_memory_bytes: int = 0
    # Seconds until keep_alive unloads the worker (the full keep_alive while
    # requests run or wait: the countdown starts when it goes idle); null
    # when it is never unloaded for idling.
    expires_in_s: float | None = None
    # A model split over processes (docs/scaling.md): each rank's pid, host
    # and memory; the memory fields above are their sums. None for a
    # single process.
    ranks: list[RankFigures] | None = None
    # State `adapter_error`: the base model runs but this name's adapter
    # could not be loaded; why, in the worker's words.
    error: str | None = None
    # Speculative decoding (a model with a drafter): tokens drafted for the
    # name's requests since its worker started serving it, and those kept.
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    # Tokens a request's prompt and reply may take together (the model's
    # config or the entry's max_context); null when the config names none.
    max_context: int | None = None


class SurfaceRequests(msgspec.Struct):
    """Generation requests that came through one surface (stdin or http)."""

    received: int  # since the pool started, refused ones included
    active: int  # queued or running now


class Status(msgspec.Struct):
    """The `status` event's fields (without "ev")."""

    models: list[StatusRow]
    rss_bytes: int
    system_total_bytes: int
    system_available_bytes: int
    requests: dict[str, SurfaceRequests] = {}


_NOTHING = WorkerStats()
_supervisor = psutil.Process()


def status_row(slot: WorkerSlot, name: Name, stats: WorkerStats | None, state: State, waiting: int) -> StatusRow:
    """The row of one of the slot's names with the worker's figures `stats`,
    as of `state` (the state when they were asked for). `waiting`: requests
    of the name still waiting in the pool (id-less ones waiting their turn)."""
    pid = slot.pid
    s = stats or _NOTHING
    if pid is None:
        # Figures a dead or never-started worker reported earlier describe
        # memory that is no longer in use.
        s = WorkerStats(format=s.format, processor=s.processor)
    elif stats is None:
        s = WorkerStats(**rss_uss(pid))
    queued, in_flight = slot.traffic.waiting(name.spec)
    failed = name.adapter_error is not None and state in (State.READY, State.BUSY)
    return StatusRow(
        model=name.name,
        lora=name.lora,
        state=ADAPTER_ERROR if failed else state.value,
        pid=pid,
        format=s.format,
        **{field: getattr(s, field) for field in MemoryFigures.__struct_fields__},
        adapter_bytes=next((a.bytes for a in s.adapters if a.lora == name.lora), 0),
        queued=queued + waiting,
        in_flight=in_flight,
        served=name.served,
        tokens=name.tokens,
        restarts=slot.restarts,
        uptime_s=round(slot.uptime(), 1),
        max_batch=slot.max_batch,
        max_batch_why=slot.max_batch_why,
        prefix_cache_bytes=slot.prefix_cache_bytes,
        rows_memory_bytes=slot.rows_memory_bytes,
        active_rows=s.active_rows,
        waiting_rows=s.waiting_rows,
        rows_cache_bytes=s.rows_cache_bytes,
        worker=slot.number,
        max_adapters=s.max_adapters or slot.spec.max_adapters,
        processor=s.processor,
        device_memory_bytes=s.device_memory_bytes,
        expires_in_s=expires_in(slot),
        ranks=s.ranks,
        error=name.adapter_error if failed else None,
        drafted_tokens=name.drafted_tokens,
        accepted_tokens=name.accepted_tokens,
        max_context=slot.max_context,
    )


def expires_in(slot: WorkerSlot) -> float | None:
    keep = slot.spec.keep_alive
    if keep is None:
        return None
    if not slot.traffic.idle:
        return keep
    return round(max(0.0, keep - (time.monotonic() - slot.last_used)), 1)


def status(rows: list[StatusRow], requests: dict[str, SurfaceRequests]) -> Status:
    memory = psutil.virtual_memory()
    return Status(
        models=rows,
        rss_bytes=_supervisor.memory_info().rss,
        system_total_bytes=memory.total,
        system_available_bytes=memory.available,
        requests=requests,
    )


def fields(record: msgspec.Struct) -> dict:
    """A row's or status's fields in order, for an event line."""
    return msgspec.to_builtins(record)


def status_event(record: Status) -> bytes:
    return encode_event("status", **fields(record))


def stats_event(row: StatusRow) -> bytes:
    return encode_event("stats", **fields(row))


_reply = msgspec.json.Decoder(Status)


def read_status(body: bytes) -> Status:
    """A `status` event's JSON (ipc.worker_events.event_body) as a Status."""
    return _reply.decode(body)
