"""The choice between a traced and an op-by-op decode step
(worker.engine.step_choice): a pure policy, driven here with made-up step
times."""

from __future__ import annotations

import logging

from worker.engine import step_choice
from worker.engine.step_choice import BLOCK, RETRY, TRIAL, TRIAL_AT_MOST, StepChoice


def run(choice: StepChoice, batch: int, seconds: dict[bool, float], steps: int, tokens: int = 256) -> list[bool]:
    """`steps` decode steps of `batch` rows over caches of `tokens`, each
    way taking its own time; like the generator, the first step of each
    run of one way is not timed."""
    ways = []
    for _ in range(steps):
        traced = choice.traced((batch, tokens))
        if ways and ways[-1] == traced:
            choice.timed((batch, tokens), traced, seconds[traced])
        ways.append(traced)
    return ways


def test_a_trial_alternates_blocks_then_keeps_the_faster_way(caplog):
    choice = StepChoice()
    with caplog.at_level(logging.INFO, logger=step_choice.__name__):
        ways = run(choice, 1, {True: 0.010, False: 0.008}, 40)
    # Blocks of BLOCK steps each way, the trace first, until each way has
    # TRIAL timed steps (BLOCK - 1 a block).
    blocks = -(-TRIAL // (BLOCK - 1))
    trial = 2 * blocks * BLOCK
    assert ways[:trial] == ([True] * BLOCK + [False] * BLOCK) * blocks
    assert choice.chosen(1) is False
    assert ways[trial:] == [False] * (40 - trial)
    assert "decode steps of 1 rows over 128-511 tokens of context: traced 10.00 ms (median of 6), op by op 8.00 ms (median of 6): op by op" in caplog.text


def test_the_trace_wins_a_tie_and_a_median_ignores_one_slow_step():
    choice = StepChoice()
    run(choice, 1, {True: 0.005, False: 0.005}, 40)
    assert choice.chosen(1) is True
    choice = StepChoice()
    times = iter([0.5] + [0.004] * 100)  # the trace's first timed step: slow (a kernel built)
    for _ in range(40):
        traced = choice.traced((2, 256))
        choice.timed((2, 256), traced, next(times) if traced else 0.005)
    assert choice.chosen(2) is True


def test_batch_sizes_are_chosen_apart():
    choice = StepChoice()
    run(choice, 1, {True: 0.004, False: 0.006}, 40)
    run(choice, 8, {True: 0.020, False: 0.012}, 40)
    assert choice.chosen(1) is True and choice.chosen(8) is False
    assert choice.chosen(32) is None


def test_a_longer_context_is_chosen_apart_and_a_similar_one_is_not():
    """A lone row whose cache grows from a few hundred tokens to 32k: the
    trace won short, op by op wins long (as an 8-bit cache on an H100)."""
    choice = StepChoice()
    run(choice, 1, {True: 0.004, False: 0.006}, 40, tokens=512)
    assert choice.chosen(1) is True
    ways = run(choice, 1, {True: 0.004, False: 0.006}, 40, tokens=2047)  # the same span: no new trial
    assert all(ways)
    ways = run(choice, 1, {True: 0.020, False: 0.011}, 60, tokens=32768 + 256)
    assert ways[:BLOCK] == [True] * BLOCK and ways[-1] is False and choice.chosen(1) is False
    # Back to a short context (another request): its own choice stands.
    assert run(choice, 1, {True: 0.004, False: 0.006}, 1, tokens=512) == [True] and choice.chosen(1) is True
    assert [step_choice.span(t) for t in (256, 511, 512, 2047, 2048, 8191, 8192, 32768)] == [4, 4, 5, 5, 6, 6, 7, 8]


def test_a_choice_holds_for_retry_steps_then_is_tried_again():
    choice = StepChoice()
    run(choice, 1, {True: 0.004, False: 0.006}, 40)
    assert choice.chosen(1) is True
    choice.timed((1, 256), False, 0.001)  # after the choice: not counted
    ways = run(choice, 1, {True: 0.009, False: 0.006}, RETRY - 40)
    assert all(ways) and choice.chosen(1) is True
    # The machine got slower for the trace: the next trial finds it out.
    ways = run(choice, 1, {True: 0.009, False: 0.006}, 100)
    assert False in ways and choice.chosen(1) is False and ways[-1] is False


def test_a_trial_without_timings_ends_in_the_trace_and_one_with_few_chooses_on_them():
    choice = StepChoice()
    for _ in range(TRIAL_AT_MOST + 1):
        choice.traced((4, 256))  # every step shared its time with a prompt chunk
    assert choice.chosen(4) is True
    choice = StepChoice()
    for i in range(TRIAL_AT_MOST + 1):
        traced = choice.traced((4, 256))
        if i in (1, 5):  # one timed step each way
            choice.timed((4, 256), traced, 0.003 if traced else 0.002)
    assert choice.chosen(4) is False
