"""The status row: one typed record per worker slot that the `status` op,
the `stats` events, the Prometheus gauges and `lattice-pool ps` all read.

Fields and their meaning: docs/monitoring.md. Every memory figure is the
worker's own measurement (worker_stats), or psutil's from outside for a
worker that has not answered yet; a row without a process reports 0.
"""

from __future__ import annotations

import msgspec
import psutil

from ipc.events import encode_event
from ipc.worker_events import RankFigures, WorkerStats, rss_uss
from supervisor.slot import WorkerSlot
from supervisor.states import State


class StatusRow(msgspec.Struct):
    model: str
    lora: str | None
    state: str
    pid: int | None
    format: str | None
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
    active_rows: int = 0
    waiting_rows: int = 0
    rows_cache_bytes: int = 0
    # A model split over processes (docs/scaling.md): each rank's pid, host
    # and memory; the memory fields above are their sums. None for a
    # single process.
    ranks: list[RankFigures] | None = None


class Status(msgspec.Struct):
    """The `status` event's fields (without "ev")."""

    models: list[StatusRow]
    rss_bytes: int
    system_total_bytes: int
    system_available_bytes: int


_NOTHING = WorkerStats()
_supervisor = psutil.Process()


def status_row(slot: WorkerSlot, stats: WorkerStats | None, state: State, waiting: int) -> StatusRow:
    """The slot's row with the worker's figures `stats`, as of `state` (the
    state when they were asked for). `waiting`: requests for it still
    waiting in the pool (id-less ones waiting their turn)."""
    pid = slot.pid
    s = stats or _NOTHING
    if pid is None:
        # Figures a dead or never-started worker reported earlier describe
        # memory that is no longer in use.
        s = WorkerStats(format=s.format)
    elif stats is None:
        s = WorkerStats(**rss_uss(pid))
    return StatusRow(
        model=slot.name,
        lora=slot.lora,
        state=state.value,
        pid=pid,
        format=s.format,
        rss_bytes=s.rss_bytes,
        uss_bytes=s.uss_bytes,
        mlx_active_bytes=s.mlx_active_bytes,
        mlx_peak_bytes=s.mlx_peak_bytes,
        mlx_cache_bytes=s.mlx_cache_bytes,
        weights_bytes=s.weights_bytes,
        adapter_bytes=s.adapter_bytes,
        queued=len(slot.queue) + waiting,
        in_flight=len(slot.in_flight),
        served=slot.served,
        tokens=slot.tokens,
        restarts=slot.restarts,
        uptime_s=round(slot.uptime(), 1),
        max_batch=slot.max_batch,
        active_rows=s.active_rows,
        waiting_rows=s.waiting_rows,
        rows_cache_bytes=s.rows_cache_bytes,
        ranks=s.ranks,
    )


def status(rows: list[StatusRow]) -> Status:
    memory = psutil.virtual_memory()
    return Status(
        models=rows,
        rss_bytes=_supervisor.memory_info().rss,
        system_total_bytes=memory.total,
        system_available_bytes=memory.available,
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
