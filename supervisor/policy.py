"""Restart and eviction decisions as pure functions of their inputs.

Neither reads a clock nor touches a process: callers pass `now` (from
time.monotonic) and a seeded random source, so tests drive them with a fake
clock.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from ipc.worker_events import EX_CONFIG


@dataclass(frozen=True)
class RestartPolicy:
    base_delay: float = 0.5  # the delay before the second restart of a streak
    max_delay: float = 30.0
    jitter: float = 0.2  # +/- fraction of the delay, so crashed siblings don't restart in lockstep
    reset_after: float = 60.0  # this long up resets the backoff
    window: float = 300.0
    max_crashes: int = 5  # more than this many within `window` -> failed


@dataclass(frozen=True)
class CrashHistory:
    times: tuple[float, ...] = ()
    streak: int = 0  # consecutive quick crashes, drives the backoff exponent


@dataclass(frozen=True)
class Restart:
    delay: float
    attempt: int
    history: CrashHistory


@dataclass(frozen=True)
class GiveUp:
    reason: str
    history: CrashHistory = field(default_factory=CrashHistory)


def on_crash(
    policy: RestartPolicy,
    history: CrashHistory,
    *,
    now: float,
    uptime: float,
    exit_code: int | None,
    rng: random.Random,
) -> Restart | GiveUp:
    """What to do about a worker that died `uptime` seconds after it started.

    The first crash of a streak (the first ever, or the first after
    `reset_after` up) restarts at once: one crash says nothing about the
    next start, and waiting only adds to the outage. Backoff guards against
    a crash loop, so it starts from the second crash in a row."""
    times = tuple(t for t in history.times if now - t <= policy.window) + (now,)
    if exit_code == EX_CONFIG:
        return GiveUp("the worker exited with code 78: a bad model dir, adapter or resource limit keeps it from starting", CrashHistory(times, history.streak))
    if len(times) > policy.max_crashes:
        return GiveUp(f"{len(times)} crashes within {policy.window:g}s", CrashHistory(times, history.streak))
    streak = 0 if uptime >= policy.reset_after else history.streak
    if streak == 0:
        delay = 0.0
    else:
        delay = min(policy.base_delay * (2 ** (streak - 1)), policy.max_delay)
        delay *= 1.0 + rng.uniform(-policy.jitter, policy.jitter)
    return Restart(delay=delay, attempt=streak + 1, history=CrashHistory(times, streak + 1))


@dataclass(frozen=True)
class Resident:
    """A loaded worker as the eviction policy sees it."""

    key: object
    idle: bool
    last_used: float
    memory_bytes: int


@dataclass(frozen=True)
class Evict:
    victims: tuple[object, ...]


@dataclass(frozen=True)
class Wait:
    """Room can be made once a busy worker goes idle."""

    reason: str


@dataclass(frozen=True)
class NoFit:
    reason: str


def make_room(
    residents: list[Resident],
    *,
    need_bytes: int,
    max_loaded: int | None,
    memory_budget: int | None,
) -> Evict | Wait | NoFit:
    """Least-recently-used idle workers to unload so one more (needing
    `need_bytes`) fits under `max_loaded` and `memory_budget`."""
    if memory_budget is not None and need_bytes > memory_budget:
        return NoFit(f"needs about {need_bytes} bytes; memory_budget is {memory_budget}")
    count = len(residents)
    used = sum(r.memory_bytes for r in residents)

    def fits(count: int, used: int) -> bool:
        return (max_loaded is None or count + 1 <= max_loaded) and (memory_budget is None or used + need_bytes <= memory_budget)

    victims: list[object] = []
    for r in sorted((r for r in residents if r.idle), key=lambda r: r.last_used):
        if fits(count, used):
            break
        victims.append(r.key)
        count -= 1
        used -= r.memory_bytes
    if fits(count, used):
        return Evict(tuple(victims))
    return Wait("every loaded model that would have to be unloaded is busy")


def footprint(rss_bytes: int, mlx_active_bytes: int, mlx_cache_bytes: int) -> int:
    """The memory a worker holds, as eviction counts it: its resident size,
    or MLX's buffers (in use and kept for reuse) where they are more. On a
    CPU those buffers are part of the resident size; on a GPU they are not,
    and they hold the weights, the rows' caches and the prefix cache."""
    return max(rss_bytes, mlx_active_bytes + mlx_cache_bytes)


def footprint_of(figures) -> int:
    """The footprint of a process's reported figures: a worker's stats, a
    status row, a rank's (each has rss_bytes, mlx_active_bytes and
    mlx_cache_bytes)."""
    return footprint(figures.rss_bytes, figures.mlx_active_bytes, figures.mlx_cache_bytes)


def byte_count(value: object) -> int | None:
    """A count of bytes from a worker's line: an int >= 0, else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def promised(ready: dict) -> int | None:
    """What a ready worker holds or may take of the memory it computes on,
    from its ready line: its weights, its prefix cache's budget and the
    most its rows' caches take (None where the line lacks one). A
    worker starting beside it sizes its own defaults from what is left
    (`--memory-held-elsewhere`): each sizing from free memory alone, two
    workers on one GPU or Mac would each count the other's caches, not yet
    allocated, as theirs."""
    parts = [byte_count(ready.get(k)) for k in ("weights_bytes", "prefix_cache_bytes", "rows_memory_bytes")]
    return None if None in parts else sum(parts)


# Without max_loaded or memory_budget the pool still bounds its workers: as
# many as fit in this share of the machine's memory at the footprint of the
# largest (its weights and the runtime a worker takes besides), never more
# than DEFAULT_MAX_LOADED_CEILING (each worker is a process with its threads
# and pipes even when its model is tiny), and at least one.
DEFAULT_MEMORY_SHARE = 0.75
DEFAULT_MAX_LOADED_CEILING = 16


def memory_to_share(ram_bytes: int, device_bytes: list[int]) -> int:
    """The memory default_max_loaded shares out: the machine's, or the
    device's where the workers compute on one with less. On a CUDA GPU the
    footprints are the GPU's memory (weights, caches), which a machine's RAM
    can well exceed (125 GB of RAM beside an 80 GB H100). Figures of 0 (not
    reported yet) do not count."""
    return min([ram_bytes, *(b for b in device_bytes if b > 0)])


def default_max_loaded(total_memory: int, footprints: list[int]) -> int:
    """max_loaded when the config sets neither it nor memory_budget, from the
    machine's memory and the bytes of each worker loaded or about to be."""
    largest = max(footprints, default=0)
    if largest <= 0:
        return DEFAULT_MAX_LOADED_CEILING
    return max(1, min(DEFAULT_MAX_LOADED_CEILING, int(total_memory * DEFAULT_MEMORY_SHARE) // largest))


# Models that failed stay in `ps` and status, so that their cause can be
# read and requests get model_failed, but not for ever: a client naming
# model dir after model dir that fails would grow the table without end.
# Configured models are kept (a `load` op retries them); other failed rows
# go after FAILED_ROW_SECONDS, or past MAX_FAILED_ROWS, oldest first. A
# request naming a dropped one again starts it afresh.
MAX_FAILED_ROWS = 8
FAILED_ROW_SECONDS = 600.0


@dataclass(frozen=True)
class FailedRow:
    key: object
    failed_at: float  # time.monotonic() when it failed
    configured: bool


def failed_rows_to_drop(rows: list[FailedRow], *, now: float, max_rows: int = MAX_FAILED_ROWS, keep_for: float = FAILED_ROW_SECONDS) -> list[object]:
    """Keys of failed rows to forget: those not configured that failed
    `keep_for` seconds ago or more, then the oldest past `max_rows`."""
    adhoc = sorted((r for r in rows if not r.configured), key=lambda r: r.failed_at)
    expired = [r for r in adhoc if now - r.failed_at >= keep_for]
    left = [r for r in adhoc if now - r.failed_at < keep_for]
    return [r.key for r in expired] + [r.key for r in left[: max(0, len(left) - max_rows)]]
