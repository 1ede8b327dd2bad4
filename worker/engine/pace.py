"""Whether a worker's speculative steps beat its plain ones, from step times.

The speculator hands each decode step's time here: a plain step's as a
reference for its batch size, a speculative step's with the tokens it gave.
Speculation is worth it while its tokens per second beat plain steps' of the
same batch size; when they do not, the worker pauses it (each pause twice
the last) and probes again afterwards.

A comparison is honest only if each side is timed as it runs on its own:

- Steps overlap: a plain step builds its forward before it reads the token
  of the step before (as mlx-lm's generate_step does), while a speculative
  step reads its rows' pending tokens first. So the first plain step after
  a speculative one only builds, and the first speculative step after a
  plain one also waits for that plain step's forward (and a draft model
  reads the tokens the plain steps made): neither is timed. That read is
  the cost of a pause, and pauses double.
- Plain steps after plain steps are references wherever they come (a
  pause, rows with nothing to draft). A batch size that keeps speculating
  has none, so it is timed in probes: PROBE_STEPS plain steps in a row,
  run when it has had JUDGE_AFTER speculative steps and again every
  PROBE_EVERY, since machines drift (other work, thermal limits). The
  reference is the median of the latest SAMPLES.
- The gain is the tokens of the latest WINDOW speculative steps over the
  tokens plain steps would have given in their time, a ratio of sums, so a
  slow step (the last steps of rows that may draft little more) weighs
  what it costs.
- A step that traced a new shape (a compiled step's first run at a batch
  size or capacity) takes many times a steady one: the speculator counts
  it on neither side, nor a step beside a prefill chunk (the chunk's time
  is not the step's), nor the first step after the batch was idle.

Pure: no clock and no model; the speculator measures, this judges.
"""

from __future__ import annotations

from collections import deque
from statistics import median

# Plain steps in a probe; all but the first are timed.
PROBE_STEPS = 5
# Speculative steps at a batch size between its plain timings; a batch size
# is first probed once it has had JUDGE_AFTER speculative steps, counted
# over every time the batch had that size (a size the batch only passes
# through is not probed at once; until it is, its steps are not judged).
# At 5 plain steps in 256 + 5, a probe costs a drafter that gains 1.5x
# about 0.6 % of it.
PROBE_EVERY = 256
SAMPLES = 5
# Timed speculative steps before a judgement, and the most the gain is taken over.
JUDGE_AFTER = 8
WINDOW = 16
# Decode steps of a pause, doubled on every pause in a row.
PAUSE = 64
PAUSE_MAX = 8192


class Pace:
    def __init__(self) -> None:
        # Seconds per plain step, the latest SAMPLES timed, by batch size
        # (both tables hold at most the worker's max_batch keys).
        self._plain: dict[int, deque[float]] = {}
        # Speculative steps at each batch size since it last had a plain step timed.
        self._since: dict[int, int] = {}
        # The latest timed speculative steps: (tokens, tokens plain steps
        # would have given in the same time).
        self._window: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self._wins = 0  # judgements in a row that found speculation faster
        self.pause = PAUSE

    @property
    def gain(self) -> float:
        """Speculative tokens over plain steps' in the same time, over the window (1.0 when empty)."""
        plain = sum(p for _, p in self._window)
        return sum(t for t, _ in self._window) / plain if plain > 0 else 1.0

    def reference(self, batch: int) -> float | None:
        """Seconds per plain step of `batch` rows, None before a probe."""
        times = self._plain.get(batch)
        return median(times) if times else None

    def probe_due(self, batch: int) -> bool:
        """Whether a probe of plain steps should start now, at this batch size."""
        due = PROBE_EVERY if batch in self._plain else JUDGE_AFTER
        return self._since.get(batch, 0) >= due

    def probed(self, batch: int) -> None:
        """A probe starts at this batch size."""
        self._since[batch] = 0

    def plain(self, batch: int, took: float) -> None:
        """A plain step of `batch` rows after a plain step took `took` seconds
        (in a probe, or wherever plain steps come: either refreshes the
        reference, so a batch size that pauses now and then needs no probe)."""
        if took > 0:
            self._plain.setdefault(batch, deque(maxlen=SAMPLES)).append(took)
            self._since[batch] = 0

    def spec(self, batch: int, took: float | None, tokens: int) -> tuple[int, float]:
        """A speculative step of `batch` rows gave `tokens` tokens in `took`
        seconds (None: not timed). Returns the steps to pause speculation
        for (0: go on) and the gain it was judged on."""
        self._since[batch] = self._since.get(batch, 0) + 1
        plain = self.reference(batch)
        if plain is None or took is None or took <= 0:
            return 0, self.gain
        self._window.append((tokens, took * batch / plain))
        if len(self._window) < JUDGE_AFTER:
            return 0, self.gain
        gain = self.gain
        if gain >= 1.0:
            # Only WINDOW winning judgements in a row end the doubling: a
            # drafter a few per cent slower than plain decoding, whose
            # noise puts the gain above 1.0 now and then, would otherwise
            # be tried again every PAUSE steps.
            self._wins += 1
            if self._wins >= WINDOW:
                self.pause = PAUSE
            return 0, gain
        pause = self.pause
        self.pause = min(PAUSE_MAX, self.pause * 2)
        self._window.clear()
        self._wins = 0
        return pause, gain
