"""Whether a prefix cache file is worth reading: only while reading it is
faster than computing the tokens it holds. At 26k tokens the 0.8b shape's
state is 312 MB against 2.4 s of prefill on an H100, but the 8B shape's is
3.8 GB, over 10 s at 0.3 GB/s (what one H100 machine gave a single thread
that read and hashed a file).

The scheduler times each file read whole, its check and its arrays, and
each long prompt's reading, and skips a file that `slower_than_prefill`
says costs more than it saves. Until both rates are measured, files are
read; after PROBE_AFTER_SKIPS skipped in a row the next is read anyway, to
time the disk again.
"""

from __future__ import annotations

import statistics
from collections import deque

# Timings a rate is the median of (the latest).
RATE_SAMPLES = 5
# Files skipped in a row as slower to read than to compute, after which the
# next one is read anyway: the rate is the latest reads', and a slow spell
# (a busy disk, a cold page cache at start) would otherwise stop every read
# for the worker's life, with no read left to time.
PROBE_AFTER_SKIPS = 8


class Rate:
    """Amount per second of the latest RATE_SAMPLES timings: their median."""

    def __init__(self) -> None:
        self._samples: deque[float] = deque(maxlen=RATE_SAMPLES)

    def add(self, amount: float, seconds: float) -> None:
        if seconds > 0:
            self._samples.append(amount / seconds)

    @property
    def value(self) -> float | None:
        """None before a timing."""
        return statistics.median(self._samples) if self._samples else None


def slower_than_prefill(nbytes: int, tokens: int, read_rate: float | None, prefill_rate: float | None) -> bool:
    """Whether reading a file of `nbytes` at `read_rate` (bytes/s) takes
    longer than computing the `tokens` it saves at `prefill_rate` (tokens/s);
    False while either rate is unmeasured."""
    if not read_rate or not prefill_rate:
        return False
    return nbytes / read_rate > tokens / prefill_rate


class DiskRates:
    """A worker's two rates and its choice between reading and computing."""

    def __init__(self) -> None:
        self.read = Rate()  # bytes/s of files read whole
        self.prefill = Rate()  # prompt tokens/s of long prompts read
        self._skipped = 0  # files `skip` left unread in a row

    def skip(self, nbytes: int, tokens: int) -> bool:
        """Whether to leave a file of `nbytes` that saves `tokens` unread,
        but for one in PROBE_AFTER_SKIPS + 1 in a row."""
        if self._skipped < PROBE_AFTER_SKIPS and slower_than_prefill(nbytes, tokens, self.read.value, self.prefill.value):
            self._skipped += 1
            return True
        self._skipped = 0
        return False
