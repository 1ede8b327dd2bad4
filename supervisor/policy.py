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
