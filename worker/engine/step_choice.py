"""Whether a decode step of N rows runs faster traced or op by op, measured.

On CUDA neither way wins everywhere. mlx's fused attention kernels for one
query (its vector kernel, cuDNN's) refuse an array mask, and the compiled
trace masks its whole buffer, so under the trace each attention layer runs
as separate matmul, mask and softmax kernels, while the trace fuses the
rest of the step's elementwise chains. Which weighs more depends on the
shape, the batch, the context and the machine: on two H100s, one process,
the 8B shape's lone row stepped op by op at 0.96x and 0.98x mlx-lm's rate
and traced at 0.85x on the first machine and 1.09x on the second; with 8
rows at 2k tokens op by op ran 1.2x the trace. So the worker times both,
per batch size and span of context, and keeps the faster: a choice made
for a short context does not hold for a long one (on an H100 a lone row
of the 8B shape over an 8-bit cache of 32k tokens stepped at 51-55 tokens
a second traced, the way its warm-up had chosen at a few tokens, and at
90 op by op). Contexts within a factor of 4 of each other (by their
caches' capacity: 512-2047 tokens, 2048-8191, ...) share a choice.

A trial alternates blocks of BLOCK steps of each way until each has TRIAL
timed steps, then keeps the one with the lower median step time, for RETRY
steps at that batch size and span; then it tries again, since a machine's speed
drifts (other work, clocks) and a long context changes the balance. A
trial that has not timed enough steps in TRIAL_AT_MOST (a batch whose
steps keep sharing their time with prompt chunks) chooses on what it has,
the trace where one way has nothing. The
caller times a step only where it ran as it does in a run of its own kind:
after a step of the same way, batch size and capacity, with no prompt chunk and no
new trace in between (so the first step of each block is not timed).

Pure: no clock and no model; the generator measures, this judges. The
table holds one entry per batch size and span met: at most the worker's
max_batch times the spans up to its longest context (5 from 256 to 128k
tokens: capacities grow in steps of 256).
"""

from __future__ import annotations

import logging
from statistics import median

log = logging.getLogger(__name__)

TRIAL = 6  # timed steps of each way before a choice
BLOCK = 4  # steps in a row one way during a trial (3 of them timed)
RETRY = 4096  # steps at a batch size between trials
TRIAL_AT_MOST = 64  # steps a trial takes at most


class _Size:
    __slots__ = ("traced", "times", "turn", "left", "since", "steps")

    def __init__(self) -> None:
        self.traced: bool | None = None  # the choice; None while trying
        self.times: dict[bool, list[float]] = {True: [], False: []}
        self.turn = True  # the trial's current way
        self.left = BLOCK  # steps of the current block (its way: `turn`)
        self.since = 0  # steps since the choice
        self.steps = 0  # steps of the trial


def span(tokens: int) -> int:
    """The span of context a choice holds for: contexts within a factor of
    4 of each other share one."""
    return max(tokens, 1).bit_length() // 2


def _kept(key: tuple[int, int]) -> tuple[int, int]:
    """The table's key for a step's (rows, tokens): (rows, span)."""
    rows, tokens = key
    return rows, span(tokens)


class StepChoice:
    """Keys are (rows, tokens): a decode step's batch size and its caches'
    capacity in tokens."""

    def __init__(self) -> None:
        self._sizes: dict[tuple[int, int], _Size] = {}
        self._latest: dict[int, tuple[int, int]] = {}  # rows -> the span they last stepped at

    def traced(self, key: tuple[int, int]) -> bool:
        """The way the next decode step of `key` runs (True: traced)."""
        key = _kept(key)
        self._latest[key[0]] = key
        size = self._sizes.get(key)
        if size is None:
            size = self._sizes[key] = _Size()
        if size.traced is not None:
            size.since += 1
            if size.since < RETRY:
                return size.traced
            self._sizes[key] = size = _Size()
        size.steps += 1
        if size.steps > TRIAL_AT_MOST:
            self._choose(key, size)
            return size.traced
        if size.left == 0 or len(size.times[size.turn]) >= TRIAL:
            if len(size.times[not size.turn]) < TRIAL:
                size.turn = not size.turn
            size.left = BLOCK
        size.left -= 1
        return size.turn

    def timed(self, key: tuple[int, int], traced: bool, seconds: float) -> None:
        """A step of `key` run that way took `seconds` (see the module's
        docstring for which steps count)."""
        key = _kept(key)
        size = self._sizes.get(key)
        if size is None or size.traced is not None or seconds <= 0:
            return
        times = size.times[traced]
        if len(times) < TRIAL:
            times.append(seconds)
        if all(len(t) >= TRIAL for t in size.times.values()):
            self._choose(key, size)

    @staticmethod
    def _choose(key: tuple[int, int], size: _Size) -> None:
        traced, eager = size.times[True], size.times[False]
        size.traced = not (traced and eager) or median(traced) <= median(eager)
        rows, s = key
        log.info(
            "decode steps of %d rows over %d-%d tokens of context: traced %s, op by op %s: %s",
            rows,
            1 << (2 * s - 1) if s else 0,
            (1 << (2 * s + 1)) - 1,
            f"{median(traced) * 1e3:.2f} ms (median of {len(traced)})" if traced else "not timed",
            f"{median(eager) * 1e3:.2f} ms (median of {len(eager)})" if eager else "not timed",
            "traced" if size.traced else "op by op",
        )

    def chosen(self, rows: int) -> bool | None:
        """The way kept for this many rows at the span they last stepped at
        (None: not chosen yet)."""
        size = self._sizes.get(self._latest.get(rows))
        return None if size is None else size.traced
