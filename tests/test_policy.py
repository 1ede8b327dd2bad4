"""Restart and eviction policy as pure functions, driven by a fake clock."""

from __future__ import annotations

import random

import pytest

from ipc.worker_events import EX_CONFIG
from supervisor.policy import (
    DEFAULT_MAX_LOADED_CEILING,
    FAILED_ROW_SECONDS,
    MAX_FAILED_ROWS,
    CrashHistory,
    Evict,
    FailedRow,
    GiveUp,
    NoFit,
    Resident,
    Restart,
    RestartPolicy,
    Wait,
    default_max_loaded,
    failed_rows_to_drop,
    footprint,
    make_room,
    memory_to_share,
    on_crash,
    promised,
)

POLICY = RestartPolicy()


class FakeClock:
    """A worker's life on a made-up timeline: it starts, runs, crashes."""

    def __init__(self, seed: int = 0):
        self.now = 1000.0
        self.history = CrashHistory()
        self.rng = random.Random(seed)

    def crash_after(self, uptime: float, exit_code: int | None = -9) -> Restart | GiveUp:
        self.now += uptime
        decision = on_crash(POLICY, self.history, now=self.now, uptime=uptime, exit_code=exit_code, rng=self.rng)
        self.history = decision.history
        if isinstance(decision, Restart):
            self.now += decision.delay
        return decision


def nominal(attempt: int) -> float:
    """The first restart of a streak is at once; backoff doubles from the second."""
    return 0.0 if attempt == 1 else min(POLICY.base_delay * 2 ** (attempt - 2), POLICY.max_delay)


def within_jitter(delay: float, attempt: int) -> bool:
    return nominal(attempt) * (1 - POLICY.jitter) <= delay <= nominal(attempt) * (1 + POLICY.jitter)


class TestRestartPolicy:
    def test_the_first_crash_ever_restarts_at_once(self):
        for uptime in (0.1, 2.0, POLICY.reset_after, 3600.0):
            decision = FakeClock().crash_after(uptime=uptime)
            assert isinstance(decision, Restart) and decision.attempt == 1 and decision.delay == 0.0

    def test_quick_crashes_double_the_delay_then_give_up_on_the_sixth(self):
        clock = FakeClock()
        decisions = [clock.crash_after(uptime=2.0) for _ in range(6)]
        restarts, last = decisions[:5], decisions[5]
        assert [d.attempt for d in restarts] == [1, 2, 3, 4, 5]
        assert restarts[0].delay == 0.0 and all(within_jitter(d.delay, d.attempt) for d in restarts)
        assert [round(nominal(d.attempt), 3) for d in restarts] == [0.0, 0.5, 1.0, 2.0, 4.0]
        assert isinstance(last, GiveUp) and last.reason == "6 crashes within 300s"

    def test_jitter_is_seeded_and_varies(self):
        """Same seed, same delays; siblings with different seeds spread out."""

        def second_delay(seed: int) -> float:
            clock = FakeClock(seed=seed)
            clock.crash_after(2.0)
            return clock.crash_after(2.0).delay

        assert second_delay(1) == second_delay(1)
        spread = {round(second_delay(s), 6) for s in range(20)}
        assert len(spread) == 20 and all(within_jitter(d, 2) for d in spread)

    def test_a_run_of_60s_resets_the_backoff_and_the_next_crash_restarts_at_once(self):
        clock = FakeClock()
        for _ in range(3):
            clock.crash_after(uptime=1.0)
        after_stable_run = clock.crash_after(uptime=POLICY.reset_after)
        assert isinstance(after_stable_run, Restart) and after_stable_run.attempt == 1
        assert after_stable_run.delay == 0.0
        again = clock.crash_after(uptime=1.0)
        assert again.attempt == 2 and within_jitter(again.delay, 2) and again.delay > 0

    def test_59s_runs_do_not_reset_it_and_the_delay_caps_at_30s(self):
        clock = FakeClock()
        attempts = []
        for _ in range(40):
            decision = clock.crash_after(uptime=POLICY.reset_after - 1)
            assert isinstance(decision, Restart), "a crash every minute or more never trips the 5-in-300s rule"
            assert decision.delay <= POLICY.max_delay * (1 + POLICY.jitter)
            attempts.append(decision.attempt)
        assert attempts == list(range(1, 41))
        assert within_jitter(decision.delay, 40) and nominal(40) == POLICY.max_delay

    def test_the_window_slides(self):
        """Five crashes, a quiet spell longer than the window, five more: no give-up."""
        clock = FakeClock()
        for _ in range(5):
            assert isinstance(clock.crash_after(uptime=1.0), Restart)
        clock.now += POLICY.window
        for _ in range(5):
            assert isinstance(clock.crash_after(uptime=1.0), Restart)
        assert isinstance(clock.crash_after(uptime=1.0), GiveUp)

    def test_exit_78_gives_up_at_once(self):
        decision = FakeClock().crash_after(uptime=0.3, exit_code=EX_CONFIG)
        assert isinstance(decision, GiveUp) and "78" in decision.reason

    @pytest.mark.parametrize("code", [None, 0, 1, 3, -6, -9, -15, 77, 79])
    def test_other_exits_restart(self, code):
        assert isinstance(FakeClock().crash_after(uptime=0.3, exit_code=code), Restart)

    def test_a_fresh_history_starts_over(self):
        """What an explicit `load` of a failed model does."""
        clock = FakeClock()
        while isinstance(clock.crash_after(uptime=1.0), Restart):
            pass
        clock.history = CrashHistory()
        decision = clock.crash_after(uptime=1.0)
        assert isinstance(decision, Restart) and decision.attempt == 1

    def test_inputs_are_not_mutated(self):
        history = CrashHistory(times=(1.0, 2.0), streak=2)
        on_crash(POLICY, history, now=3.0, uptime=1.0, exit_code=1, rng=random.Random(0))
        assert history == CrashHistory(times=(1.0, 2.0), streak=2)


def resident(key, *, idle=True, last_used=0.0, memory=100):
    return Resident(key=key, idle=idle, last_used=last_used, memory_bytes=memory)


class TestEvictionPolicy:
    def test_room_left_evicts_nothing(self):
        assert make_room([resident("a")], need_bytes=100, max_loaded=2, memory_budget=None) == Evict(())

    def test_least_recently_used_idle_worker_goes_first(self):
        residents = [resident("new", last_used=30.0), resident("old", last_used=10.0), resident("mid", last_used=20.0)]
        assert make_room(residents, need_bytes=1, max_loaded=3, memory_budget=None) == Evict(("old",))
        assert make_room(residents, need_bytes=1, max_loaded=2, memory_budget=None) == Evict(("old", "mid"))

    def test_busy_workers_are_never_evicted(self):
        residents = [resident("busy", idle=False, last_used=0.0), resident("idle", last_used=50.0)]
        assert make_room(residents, need_bytes=1, max_loaded=2, memory_budget=None) == Evict(("idle",))
        decision = make_room([resident("busy", idle=False)], need_bytes=1, max_loaded=1, memory_budget=None)
        assert isinstance(decision, Wait)

    def test_memory_budget_evicts_until_it_fits(self):
        residents = [resident("a", last_used=1.0, memory=400), resident("b", last_used=2.0, memory=400), resident("c", last_used=3.0, memory=100)]
        assert make_room(residents, need_bytes=300, memory_budget=1000, max_loaded=None) == Evict(("a",))
        assert make_room(residents, need_bytes=700, memory_budget=1000, max_loaded=None) == Evict(("a", "b"))

    def test_both_limits_apply(self):
        residents = [resident("a", last_used=1.0, memory=10), resident("b", last_used=2.0, memory=900)]
        assert make_room(residents, need_bytes=200, memory_budget=1000, max_loaded=3) == Evict(("a", "b"))

    def test_too_big_for_the_budget_never_fits(self):
        assert isinstance(make_room([], need_bytes=2000, memory_budget=1000, max_loaded=None), NoFit)

    def test_busy_memory_makes_it_wait(self):
        residents = [resident("busy", idle=False, memory=900), resident("idle", memory=50)]
        assert isinstance(make_room(residents, need_bytes=200, memory_budget=1000, max_loaded=None), Wait)

    def test_no_limits(self):
        assert make_room([resident(k) for k in "abc"], need_bytes=10**12, memory_budget=None, max_loaded=None) == Evict(())


class TestDefaultMaxLoaded:
    GIB = 1 << 30

    def test_as_many_as_fit_in_three_quarters_of_memory_at_the_largest_footprint(self):
        assert default_max_loaded(16 * self.GIB, [2 * self.GIB]) == 6
        assert default_max_loaded(16 * self.GIB, [1 * self.GIB, 4 * self.GIB, 2 * self.GIB]) == 3
        assert default_max_loaded(64 * self.GIB, [20 * self.GIB]) == 2

    def test_at_least_one_and_at_most_the_ceiling(self):
        assert default_max_loaded(8 * self.GIB, [40 * self.GIB]) == 1
        assert default_max_loaded(512 * self.GIB, [300 << 20]) == DEFAULT_MAX_LOADED_CEILING == 16
        assert default_max_loaded(512 * self.GIB, []) == DEFAULT_MAX_LOADED_CEILING


def test_the_memory_shared_out_is_the_devices_where_workers_report_a_smaller_one():
    gib = 1 << 30
    # A CUDA machine: 125 GB of RAM beside an 80 GB GPU.
    assert memory_to_share(125 * gib, [80 * gib, 80 * gib]) == 80 * gib
    # Nothing reported yet (0), or a CPU or Apple silicon (the machine's).
    assert memory_to_share(125 * gib, []) == 125 * gib
    assert memory_to_share(125 * gib, [0]) == 125 * gib
    assert memory_to_share(64 * gib, [64 * gib]) == 64 * gib
    assert default_max_loaded(memory_to_share(125 * gib, [80 * gib]), [16 * gib]) == 3


def test_a_ready_worker_promises_its_weights_its_prefix_cache_and_its_rows_most():
    ready = {"ev": "ready", "weights_bytes": 16 << 30, "prefix_cache_bytes": 2 << 30, "rows_memory_bytes": 35 << 30}
    assert promised(ready) == 53 << 30
    # A line without the figures (an older or a fake worker), or with a bad one.
    assert promised({"ev": "ready", "weights_bytes": 1}) is None
    assert promised(ready | {"rows_memory_bytes": True}) is None
    assert promised(ready | {"prefix_cache_bytes": -1}) is None
    assert promised(ready | {"weights_bytes": "16GiB"}) is None


def test_footprint_counts_mlx_buffers_that_rss_does_not_show():
    # A CPU worker: MLX's buffers are part of its resident size.
    assert footprint(rss_bytes=900, mlx_active_bytes=600, mlx_cache_bytes=100) == 900
    # A GPU worker: the weights, rows and prefix cache sit in device memory.
    assert footprint(rss_bytes=900, mlx_active_bytes=16_000, mlx_cache_bytes=4_000) == 20_000


class TestFailedRows:
    def rows(self, *spec):
        return [FailedRow(key, failed_at, configured) for key, failed_at, configured in spec]

    def test_configured_models_are_kept(self):
        rows = self.rows(("conf", 0.0, True), *((f"dir{i}", 0.0, False) for i in range(3)))
        assert failed_rows_to_drop(rows, now=FAILED_ROW_SECONDS * 10, max_rows=1) == ["dir0", "dir1", "dir2"]

    def test_rows_go_after_their_time(self):
        rows = self.rows(("old", 0.0, False), ("new", 500.0, False))
        assert failed_rows_to_drop(rows, now=FAILED_ROW_SECONDS - 1) == []
        assert failed_rows_to_drop(rows, now=FAILED_ROW_SECONDS) == ["old"]
        assert failed_rows_to_drop(rows, now=500.0 + FAILED_ROW_SECONDS) == ["old", "new"]

    def test_past_the_bound_the_oldest_go(self):
        rows = self.rows(*((f"dir{i}", float(i), False) for i in range(MAX_FAILED_ROWS + 3)))
        assert failed_rows_to_drop(rows[::-1], now=20.0) == ["dir0", "dir1", "dir2"]
        assert failed_rows_to_drop(rows[:MAX_FAILED_ROWS], now=20.0) == []
