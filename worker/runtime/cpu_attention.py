"""A decode step's attention on the CPU, with a softmax of its own.

mlx's CPU backend computes `exp` an element at a time, and slowly: in a
decode step's attention, two thin matmuls and a softmax over every cached
token of every query head, the softmax took 0.86 of the 1.45 ms a call
took for 8 rows of the demo model's heads (4 query heads of 32 over 2 KV
heads) at 2,048 cached tokens, on a 2-core Intel Xeon VM.

Here the exponential is a polynomial that mlx's compiler fuses into a few
loops over the scores: 2^n from the bits of n, and Cephes' `expf`
polynomial on the remainder. Its relative error is within 1.2e-7 of the
exact value over the whole range a softmax feeds it (0 down to -87, where
float32 runs out; mlx's own `exp` is within 3.8e-6 there), and below -87
it is exactly 0, as masked scores must be. Measured on that
VM (`python -m bench.cpu_attention`, compiled as the worker's step is):
the softmax took 0.45-0.75x mlx's time and a whole call 0.57-0.91x
(medians of 5 alternated rounds), over
1 and 8 rows of the demo model's and Qwen3-8B's heads at 2k to 32k cached
tokens; the demo model decoded 1.28x as fast at 8 rows and 8k tokens.

Only calls of at most QUERIES_AT_MOST queries a row are taken (decode
steps, speculative verification): a prompt piece keeps mlx's attention,
which costs less there (in a development run, 256 queries over 4,096
cached tokens took 68 ms through mlx and 94 ms composed as here).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import base

from worker.runtime import cpu_streams
from worker.runtime.memory import processor
from worker.runtime.rebind import rebind

QUERIES_AT_MOST = 16
# Fewer scores than this (rows x heads x queries x keys) keep mlx's softmax
# and attention: there the polynomial's few more operations cost more than
# its exponentials save (in a development run, a row of 4 heads over 1,024
# tokens took 169 against mlx's 156 us a call; from 8,192 scores on, this
# way was the faster).
SCORES_FROM = 1 << 13

_MLX = base.scaled_dot_product_attention

LOG2E = 1.4426950408889634
# ln 2 in two parts (Cody and Waite's): the first has few enough bits that
# n times it is exact in float32 for the n here, so x - n ln 2 keeps its
# precision where x is large.
LN2_HIGH, LN2_LOW = 0.693359375, -2.12194440e-4
# Below this exp(x) is under float32's smallest normal number.
FLOOR = -87.0
# Cephes' `expf`: e^r = 1 + r + r^2 p(r) for |r| <= ln(2)/2, p's
# coefficients highest degree first.
EXPF = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


@mx.compile
def exp_nonpositive(x: mx.array) -> mx.array:
    """exp(x) for float32 x <= 0 (a score less its row's largest);
    exactly 0 below FLOOR. exp(x) = 2^n e^r with n the integer nearest
    x / ln 2 (a cast toward zero of x / ln 2 - 1/2, as x <= 0: mlx's
    floor took 3x a cast's time over a vocabulary on a 2-core Xeon) and
    r = x - n ln 2, |r| <= ln(2)/2; e^r from the polynomial, 2^n from the
    bits of n. The polynomial is evaluated in Estrin's order, which keeps
    the chain of operations short enough for mlx to fuse it into few
    loops."""
    clamped = mx.maximum(x, FLOOR)
    n = (clamped * LOG2E - 0.5).astype(mx.int32)
    m = n.astype(mx.float32)
    r = (clamped - m * LN2_HIGH) - m * LN2_LOW
    r2 = r * r
    c = EXPF
    p = (c[5] + c[4] * r) + r2 * (c[3] + c[2] * r) + (r2 * r2) * (c[1] + c[0] * r)
    # 2^n as a float32's bits: n + 127 in the exponent field (n >= -126 here).
    two_n = ((n + 127) << 23).view(mx.float32)
    return mx.where(x < FLOOR, 0.0, (1.0 + r + r2 * p) * two_n)


def softmax(scores: mx.array) -> mx.array:
    """Softmax over the last axis, computed in float32 (as mlx's
    `precise=True`), in the scores' dtype."""
    if scores.size < SCORES_FROM:
        return mx.softmax(scores, axis=-1, precise=True)
    s = scores.astype(mx.float32)
    e = exp_nonpositive(s - s.max(axis=-1, keepdims=True))
    return (e / e.sum(axis=-1, keepdims=True)).astype(scores.dtype)


def masked(scores: mx.array, mask, kv_heads: int, group: int) -> mx.array:
    """(rows, KV heads, group * L, S) scores with an mlx-lm attention mask
    applied: None, "causal" (the L queries are the last L keys), or an array
    of (L, S) or (rows, 1, L, S), boolean or added."""
    if mask is None:
        return scores
    rows, _, length, keys_length = scores.shape
    length //= group
    scores = scores.reshape(rows, kv_heads, group, length, keys_length)
    if isinstance(mask, str):
        mask = base.create_causal_mask(length, keys_length - length)
    elif mask.ndim == 4:  # the same for every head
        mask = mx.expand_dims(mask, 2)
    if mask.dtype == mx.bool_:
        scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
    else:
        scores = scores + mask
    return scores.reshape(rows, kv_heads, group * length, keys_length)


def takes(queries: mx.array, keys: mx.array, sinks) -> bool:
    """Whether a call is computed here rather than by mlx."""
    return queries.shape[2] <= QUERIES_AT_MOST and queries.size // queries.shape[-1] * keys.shape[2] >= SCORES_FROM and sinks is None


def composed(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask) -> mx.array:
    """Attention of (rows, heads, L, D) queries over (rows, KV heads, S, D)
    keys and values, each KV head's queries the rows of one matmul."""
    rows, heads, length, dim = queries.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    scores = (queries * scale).reshape(rows, kv_heads, group * length, dim) @ keys.swapaxes(-1, -2)
    weights = softmax(masked(scores, mask, kv_heads, group))
    return (weights @ values).reshape(rows, heads, length, values.shape[-1])


def attention(queries, keys, values, cache, scale: float, mask, sinks=None):
    """mlx-lm's `scaled_dot_product_attention`, with the calls above taken here."""
    if not hasattr(cache, "bits") and takes(queries, keys, sinks):
        # Rows a core each (worker.runtime.cpu_streams).
        return cpu_streams.apart(queries.shape[0], lambda r: composed(queries[r], keys[r], values[r], scale, cpu_streams.rows_of(mask, r)))
    return _MLX(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def install(model, where: str | None = None) -> int:
    """Routes the model's attention through `attention` where mlx computes
    on the CPU (`where`: the processor, by default this one's); returns how
    many modules were rebound."""
    if (where or processor()) != "cpu":
        return 0
    return rebind(model, "scaled_dot_product_attention", attention, lambda current: current is _MLX)
