"""The LM head on the CPU, its vocabulary cut over the CPU streams.

The LM head is the largest product of a decode step: Qwen3.5-0.8B's tied
embedding is 248,320 x 1,024 float32 values, 1 GB read for every step. On
the CPU it runs on one stream, so on one core, and one core does not draw
the memory bandwidth two do. Each token's logit is its own row of the
weights times the hidden state, so the vocabulary cut into spans, one
stream a core (worker.runtime.cpu_streams), gives the same logits, each
computed as before, with the weights read by every core at once. That
head alone on a 2-core Xeon VM (development runs, the two ways alternated
in one process): 36.0 against 67.8 ms for one row, 54.8 against 101.2 for
8, 175 against 267 for 32 (a speculative verify pass); the logits equal
bit for bit.

Only a float head is cut (an `nn.Linear` without bias, or a tied
`nn.Embedding`): a quantized head keeps mlx's kernel. So does a head of
fewer than CUT_FROM values, where the streams' hand-over costs more than
the product: the demo model's 704 x 128 took 0.10 against 0.08 ms cut,
where 32,000 x 512 took 1.6 against 2.6 (one row, the same VM).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from worker.runtime import cpu_streams
from worker.runtime.memory import processor
from worker.runtime.parts import head_module

CUT_FROM = 1 << 20


def logits(x: mx.array, weight: mx.array) -> mx.array:
    """x @ weight.T with weight's rows (the vocabulary) cut over the CPU
    streams, one span a stream, joined along the last axis."""
    return cpu_streams.apart(weight.shape[0], lambda span: x @ weight[span].T, axis=-1)


class _CutLinear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        return logits(x, self["weight"])


class _CutEmbedding(nn.Embedding):
    def as_linear(self, x: mx.array) -> mx.array:
        return logits(x, self.weight)


def install(model, where: str | None = None) -> bool:
    """Cuts the model's LM head over the CPU streams where mlx computes on
    the CPU (`where`: the processor, by default this one's), there are two
    streams or more and the head has CUT_FROM values or more; True when it
    did. The head keeps its parameters:
    only its class changes, to a subclass whose product is cut."""
    if (where or processor()) != "cpu" or len(cpu_streams.streams()) < 2:
        return False
    head = head_module(model)
    cut = {nn.Linear: _CutLinear, nn.Embedding: _CutEmbedding}.get(type(head))
    if cut is None or "bias" in head or head.weight.size < CUT_FROM:
        return False
    head.__class__ = cut
    return True
