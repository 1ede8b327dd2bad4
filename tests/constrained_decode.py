"""A small in-process batched decode loop driving worker.constrain the way
the batched engine will: every row shares one prompt, each has its own
one-row view of the worker's BatchSampler, an optional RowConstraint and
an optional reasoning budget. The tests and bench/constrain.py use it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from worker.constrain import BatchMasks, RowConstraint
from worker.streamer import ThinkBudget
from worker.sampling import BatchSampler, RowSampling, SamplingParams


class Sampler:
    """One row drawn by the worker's own BatchSampler, with its settings."""

    def __init__(self, *, vocab_size: int, temperature: float, top_k: int, top_p: float, repetition_penalty: float, seed: int | None):
        self.params = SamplingParams(temperature, top_k, top_p, repetition_penalty, seed)
        self.batch = BatchSampler(vocab_size)
        self.prompt: list[int] = []

    def observe_prompt(self, ids: list[int]) -> None:
        self.prompt = ids
        self.batch.extend([RowSampling(self.params, self.batch.vocab_size, ids)])

    def __call__(self, logits: mx.array, last: mx.array | None) -> mx.array:
        # The first draw has no new token to mark seen: the prompt's last one is already.
        if last is None:
            last = mx.array(self.prompt[-1:], dtype=mx.uint32)
        return self.batch(logits, last.reshape(1))


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
    overlap: bool = True,
) -> Decoded:
    """Runs every row until it ends (EOS, grammar done, or max_tokens).

    The masks of a step are filled on a side thread while its forward pass
    is evaluated (overlap=False fills them after it, to measure what the
    overlap saves). On a GPU the forward pass is queued before the previous
    step's tokens are read, as the worker does; mlx's CPU backend computes
    inside mx.async_eval on the calling thread, so there the pass waits
    until the masks have started."""
    batch = len(rows)
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
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
        constraints = [r.constraint if r.finish is None else None for r in rows]
        if overlap:
            pending = masks.fill_async(constraints)
            mx.eval(logits)
            bits = pending.result()
        else:
            mx.eval(logits)
            bits = masks.fill(constraints)
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
        if on_gpu:
            mx.async_eval(logits)  # the device starts now; on the CPU this would compute here, before the masks
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
