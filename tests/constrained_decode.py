"""A small in-process batched decode loop driving worker.constrain the way
the batched engine will: every row shares one prompt, each has its own
Sampler (unchanged from the worker), an optional RowConstraint and an
optional reasoning budget. The tests and bench/constrain.py use it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from worker.constrain import BatchMasks, RowConstraint
from worker.engine import ThinkBudget
from worker.sampling import Sampler


@dataclass
class Row:
    sampler: Sampler
    constraint: RowConstraint | None = None
    think: ThinkBudget | None = None
    ids: list[int] = field(default_factory=list)
    finish: str | None = None


@dataclass
class Decoded:
    rows: list[Row]
    steps: int
    seconds: float  # decode loop only, after the prefill
    raw_logits: list[mx.array] = field(default_factory=list)
    masked_logits: list[mx.array] = field(default_factory=list)


def decode(
    model,
    prompt: list[int],
    rows: list[Row],
    masks: BatchMasks,
    *,
    max_tokens: int,
    eos: frozenset[int],
    think_end: int | None = None,
    keep_logits: bool = False,
) -> Decoded:
    """Runs every row until it ends (EOS, grammar done, or max_tokens).

    Pipelined as the worker is: the next forward pass is queued before this
    step's tokens are read, and the masks of the next step are filled on the
    CPU while that forward pass runs."""
    batch = len(rows)
    cache = make_prompt_cache(model)
    tokens = mx.array([prompt] * batch, dtype=mx.uint32)
    if len(prompt) > 1:
        model(tokens[:, :-1], cache=cache)
    logits = model(tokens[:, -1:], cache=cache)[:, -1, :]
    for r in rows:
        r.sampler.observe_prompt(prompt)
    last: list[mx.array | None] = [None] * batch
    out = Decoded(rows=rows, steps=0, seconds=0.0)
    t0 = time.perf_counter()
    while True:
        bits = masks.fill([r.constraint if r.finish is None else None for r in rows])
        masked = masks.apply(logits, bits)
        if keep_logits:
            out.raw_logits.append(logits)
            out.masked_logits.append(masked)
        picks = []
        for i, r in enumerate(rows):
            if r.think is not None and r.think.must_close():
                pick = mx.array([think_end], dtype=mx.uint32)
            else:
                pick = r.sampler(masked[i : i + 1], last[i]).astype(mx.uint32)
            picks.append(pick)
            last[i] = pick
        y = mx.concatenate(picks)
        logits = model(y[:, None], cache=cache)[:, -1, :]
        mx.async_eval(logits)
        values = y.tolist()
        out.steps += 1
        for r, token in zip(rows, values):
            if r.finish is not None:
                continue
            if token in eos:
                r.finish = "stop"
                continue
            r.ids.append(token)
            if r.think is not None:
                r.think.observe(token)
            if r.constraint is not None:
                r.constraint.advance(token)
                if r.constraint.done:
                    r.finish = "stop"
                    continue
            if len(r.ids) >= max_tokens:
                r.finish = "length"
        if all(r.finish is not None for r in rows):
            break
    mx.eval(logits)
    out.seconds = time.perf_counter() - t0
    return out
