"""CPU streams, so that rows that do not read each other run on several
cores at once.

mlx runs the ops of one stream one after another on one thread, and on the
CPU a decode step's graph runs on the one stream, its products included
(the worker gives OpenBLAS one thread fewer than the cores, and a thin
product runs on the calling thread). So on a 2-core machine a step kept
one core busy. A batch's attention and its sampled tokens are computed
row by row with no row reading another: cut into spans of rows, one
stream a core, they run side by side. Measured on a 2-core Xeon VM
(development runs, the two ways alternated in one process): the attention
of 8 rows of the demo model's heads over 8,192 cached tokens, compiled,
2.6 against 4.6 ms; 8 top-p draws at 151,936 tokens 12.1 against 29.4 ms;
the gated-delta decode update of 8 rows of Qwen3.5-0.8B's heads, in spans
of 2 rows, 4.4 against 20.8 ms (worker.runtime.gated_delta says why).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from worker.runtime.cpu_backend import usable_cores

MAX_STREAMS = 8


_local = threading.local()


def streams() -> tuple:
    """The CPU's default stream and one more per usable core, up to
    MAX_STREAMS in all: this thread's (mlx's streams belong to the thread
    that made them)."""
    made = getattr(_local, "streams", None)
    if made is None:
        extra = min(MAX_STREAMS, usable_cores()) - 1
        made = _local.streams = (mx.default_stream(mx.cpu), *(mx.new_stream(mx.cpu) for _ in range(extra)))
    return made


def cuts(rows: int, spans: int = 1) -> list[slice]:
    """Contiguous spans of `rows`: at least `spans` of them, one a stream
    at least, at most one a row; one span where there is one core or one
    row and one span is asked."""
    parts = max(1, min(rows, max(spans, len(streams()))))
    bounds = [rows * i // parts for i in range(parts + 1)]
    return [slice(start, stop) for start, stop in zip(bounds, bounds[1:])]


def apart(rows: int, run: Callable[[slice], Any], spans: int = 1, axis: int = 0) -> Any:
    """run(span) for each of cuts(rows, spans), the spans dealt over the
    streams in turn (one span runs on the current stream), joined along
    `axis` (the rows): an array, or a tuple of arrays joined element by
    element."""
    parts = cuts(rows, spans)
    if len(parts) == 1:
        return run(parts[0])
    made = streams()
    out = []
    for i, span in enumerate(parts):
        with mx.stream(made[i % len(made)]):
            out.append(run(span))
    if isinstance(out[0], tuple):
        return tuple(mx.concatenate(column, axis=axis) for column in zip(*out))
    return mx.concatenate(out, axis=axis)


def rows_of(mask, span: slice):
    """An mlx-lm attention mask for a span of the rows: a batch's (rows,
    1, L, S) array cut to them; any other mask holds for every row."""
    if isinstance(mask, mx.array) and mask.ndim == 4 and mask.shape[0] > 1:
        return mask[span]
    return mask
