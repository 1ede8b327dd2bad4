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
per batch size, and keeps the faster.

A trial alternates blocks of BLOCK steps of each way until each has TRIAL
timed steps, then keeps the one with the lower median step time, for RETRY
steps at that batch size; then it tries again, since a machine's speed
drifts (other work, clocks) and a long context changes the balance. A
trial that has not timed enough steps in TRIAL_AT_MOST (a batch whose
steps keep sharing their time with prompt chunks) chooses on what it has,
the trace where one way has nothing. The
caller times a step only where it ran as it does in a run of its own kind:
after a step of the same way and batch size, with no prompt chunk and no
new trace in between (so the first step of each block is not timed).

Pure: no clock and no model; the generator measures, this judges. The
table holds one entry per batch size, at most the worker's max_batch.
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


class StepChoice:
    def __init__(self) -> None:
        self._sizes: dict[int, _Size] = {}

    def traced(self, batch: int) -> bool:
        """The way the next decode step of `batch` rows runs (True: traced)."""
        size = self._sizes.get(batch)
        if size is None:
            size = self._sizes[batch] = _Size()
        if size.traced is not None:
            size.since += 1
            if size.since < RETRY:
                return size.traced
            self._sizes[batch] = size = _Size()
        size.steps += 1
        if size.steps > TRIAL_AT_MOST:
            self._choose(batch, size)
            return size.traced
        if size.left == 0 or len(size.times[size.turn]) >= TRIAL:
            if len(size.times[not size.turn]) < TRIAL:
                size.turn = not size.turn
            size.left = BLOCK
        size.left -= 1
        return size.turn

    def timed(self, batch: int, traced: bool, seconds: float) -> None:
        """A step of `batch` rows run that way took `seconds` (see the module's
        docstring for which steps count)."""
        size = self._sizes.get(batch)
        if size is None or size.traced is not None or seconds <= 0:
            return
        times = size.times[traced]
        if len(times) < TRIAL:
            times.append(seconds)
        if all(len(t) >= TRIAL for t in size.times.values()):
            self._choose(batch, size)

    @staticmethod
    def _choose(batch: int, size: _Size) -> None:
        traced, eager = size.times[True], size.times[False]
        size.traced = not (traced and eager) or median(traced) <= median(eager)
        log.info(
            "decode steps of %d rows: traced %s, op by op %s: %s",
            batch,
            f"{median(traced) * 1e3:.2f} ms (median of {len(traced)})" if traced else "not timed",
            f"{median(eager) * 1e3:.2f} ms (median of {len(eager)})" if eager else "not timed",
            "traced" if size.traced else "op by op",
        )

    def chosen(self, batch: int) -> bool | None:
        """The way kept for this batch size (None: not chosen yet)."""
        size = self._sizes.get(batch)
        return None if size is None else size.traced
