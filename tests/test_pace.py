"""The worker's judgement of its speculative steps (worker.engine.pace), on
step times it is given: a pure function of those times."""

from __future__ import annotations

from worker.engine.pace import JUDGE_AFTER, PAUSE, PROBE_EVERY, PROBE_STEPS, SAMPLES, WINDOW, Pace


def probe(pace: Pace, batch: int, took: float) -> None:
    """A probe as the speculator reports one: its first step is not timed."""
    pace.probed(batch)
    for _ in range(PROBE_STEPS - 1):
        pace.plain(batch, took)


def test_without_a_reference_nothing_is_judged_and_a_lasting_batch_size_is_probed():
    pace = Pace()
    for _ in range(JUDGE_AFTER - 1):
        assert pace.spec(8, 1.0, 1) == (0, 1.0)  # far slower than any plain step: no reference yet
        assert not pace.probe_due(8)
    pace.spec(8, None, 8)  # untimed steps count towards the probe too
    assert pace.probe_due(8) and not pace.probe_due(4)
    probe(pace, 8, 0.010)
    assert not pace.probe_due(8)
    assert pace.reference(8) == 0.010


def until_pause(pace: Pace, took: float, tokens: int) -> tuple[int, int]:
    """Feeds speculative steps of one row until a pause: (steps fed, pause)."""
    for n in range(1, 10 * JUDGE_AFTER):
        pause, _ = pace.spec(1, took, tokens)
        if pause:
            return n, pause
    return n, 0


def test_slower_speculative_steps_pause_speculation_each_pause_twice_the_last():
    pace = Pace()
    probe(pace, 1, 0.010)  # 100 tokens/s
    assert until_pause(pace, 0.030, 2) == (JUDGE_AFTER, PAUSE)  # 67 tokens/s
    assert until_pause(pace, 0.030, 2) == (JUDGE_AFTER, 2 * PAUSE)
    # Faster for fewer than WINDOW judgements: the doubling goes on.
    assert all(pace.spec(1, 0.015, 3)[0] == 0 for _ in range(JUDGE_AFTER + 2))
    assert until_pause(pace, 0.030, 2)[1] == 4 * PAUSE
    # Faster for WINDOW judgements: the next slow spell starts from the first pause.
    assert all(pace.spec(1, 0.015, 3)[0] == 0 for _ in range(JUDGE_AFTER - 1 + WINDOW))
    assert pace.gain == 2.0
    assert until_pause(pace, 0.030, 2)[1] == PAUSE


def test_the_gain_is_a_ratio_of_sums_so_a_rare_slow_step_weighs_what_it_costs():
    """Seven steps at 1.2x and one that takes five steps' time (a draft
    model reading the tokens of a pause) lose overall: the mean of their
    per-step ratios (1.08) would have kept speculating."""
    pace = Pace()
    probe(pace, 10, 0.010)
    for _ in range(JUDGE_AFTER - 1):
        assert pace.spec(10, 0.010, 12)[0] == 0
    assert round(pace.gain, 6) == 1.2
    pause, gain = pace.spec(10, 0.050, 12)
    assert pause == PAUSE and round(gain, 6) == 0.8


def test_the_reference_is_the_median_of_the_latest_plain_steps():
    pace = Pace()
    for took in (0.010, 0.011, 0.090, 0.009, 0.010):
        pace.plain(2, took)
    assert pace.reference(2) == 0.010  # one slow step does not move it
    for _ in range(SAMPLES):
        pace.plain(2, 0.020)
    assert pace.reference(2) == 0.020  # only the latest SAMPLES count


def test_a_speculating_batch_size_is_probed_again_after_probe_every_steps():
    pace = Pace()
    probe(pace, 4, 0.010)
    for _ in range(PROBE_EVERY - 1):
        pace.spec(4, 0.010, 8)
    assert not pace.probe_due(4)
    pace.spec(4, 0.010, 8)
    assert pace.probe_due(4)
    # The machine slowed down: the new probe's steps are the reference.
    probe(pace, 4, 0.030)
    assert pace.reference(4) == 0.030


def test_plain_steps_outside_a_probe_refresh_the_reference_and_put_off_the_next_probe():
    pace = Pace()
    probe(pace, 4, 0.010)
    for _ in range(PROBE_EVERY - 1):
        pace.spec(4, 0.010, 8)
    pace.plain(4, 0.012)  # a plain step after a plain one (a pause, say)
    pace.spec(4, 0.010, 8)
    assert not pace.probe_due(4)
    assert pace.reference(4) == 0.010  # the median of the latest SAMPLES
