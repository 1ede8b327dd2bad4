"""Attention over quantized caches (kv_bits), routed by the cache's form.

mlx-lm's quantized attention scores every query against every key with two
quantized matmuls and a softmax in between. For a prompt piece that
materialises the whole score matrix (2,048 queries of 32 heads against 32k
cached tokens: 4 GiB in bf16), which the fused attention kernel of the
model's dtype never holds: on an H200, the 8B shape's prefill of 32k tokens
peaked at 1.27x the memory with an 8-bit cache than with a bf16 one. So a piece of more than
DEQUANTIZED_ABOVE queries reads the cache dequantized, one layer at a time,
through `mx.fast.scaled_dot_product_attention`; decode steps and speculative
verification, a few queries each, keep the quantized matmuls, which read the
packed values only.

mlx's CUDA quantized matmul has no kernel for an operand that is not
contiguous (`is_last_2_dims_row_contiguous` in its qmm.cu), and a cache's
tokens so far are a slice of its buffer: on CUDA they are copied to one
block first. On the CPU the few queries of each KV head are laid along the
matmul's rows (`_grouped`) instead of broadcasting the cache over them as
mlx-lm does: one matmul of G rows per KV head in place of G of one row
(2 KV heads of 32, 4 query heads, 2,304 tokens: 0.52 against 0.64 ms a
call for one row, 3.7 against 4.4 ms for eight, medians of 8 alternated
runs of 100, 8 bits). mlx's CPU kernel for the scores (`x @ W.T`) runs at
2-3x a float matmul; 8-bit keys grouped by the whole head are scored from
their bytes with a float matmul instead (`_byte_scores`) while they are
few enough (`BYTES_AT_MOST`).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import base

from worker.runtime.memory import processor
from worker.runtime.rebind import rebind

DEQUANTIZED_ABOVE = 8
# The most cached key values (rows x KV heads x tokens x head dimension) that
# `_byte_scores` reads as float32: its float copy of the keys pays while it
# stays in cache. On a 2-core CPU with 32 MB of L3 (bench.kv_layouts, one
# layer's attention over float32's): 1M values (8 rows of the demo model at
# 2k tokens) 1.22x against mlx's kernel's 1.89x; 2M (one row of Qwen3-8B's
# heads at 2k, one of the demo model's at 32k) 1.34x and 1.21x against 3.03x
# and 1.74x; 16M (eight rows of either) 2.90x and 2.68x against 3.06x and
# 1.72x.
BYTES_AT_MOST = 1 << 21

_ORIGINAL = base.scaled_dot_product_attention


def _byte_scores(q: mx.array, keys: tuple) -> mx.array:
    """q @ K.T for 8-bit keys whose group is the whole head: the packed words
    read as the bytes they hold (the quantized values, in order), one float
    matmul, then each token's scale and bias: q . (s w + b) = s (q . w) +
    b sum(q). In float32 whatever the model's dtype: q . w runs up to 255
    times the score's size before the bias takes most of it back."""
    packed, scales, biases = keys
    w = packed.view(mx.uint8).astype(mx.float32)
    q32 = q.astype(mx.float32)
    raw = q32 @ w.swapaxes(-1, -2)
    scores = raw * scales.swapaxes(-1, -2) + q32.sum(axis=-1, keepdims=True) * biases.swapaxes(-1, -2)
    return scores.astype(q.dtype)


def _grouped(queries, keys: tuple, values: tuple, scale: float, mask, group_size: int, bits: int, bytes_scores: bool = False) -> mx.array:
    """mlx-lm's quantized attention with each KV head's queries as the rows
    of one matmul: (B, Hk, G * L, D) against the cache's (B, Hk, S, D);
    with `bytes_scores`, 8-bit keys grouped by the whole head are scored by
    `_byte_scores`."""
    B, heads, L, D = queries.shape
    kv_heads = keys[0].shape[1]
    G = heads // kv_heads
    q = (queries * scale).reshape(B, kv_heads, G * L, D)
    if bytes_scores and bits == 8 and group_size == D and keys[0].size * 4 <= BYTES_AT_MOST:
        scores = _byte_scores(q, keys)
    else:
        scores = mx.quantized_matmul(q, *keys, transpose=True, group_size=group_size, bits=bits)
    if mask is not None:
        S = scores.shape[-1]
        scores = scores.reshape(B, kv_heads, G, L, S)
        if isinstance(mask, str):
            mask = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
        elif mask.ndim == 4:  # (B, 1, L, S), the same for every head
            mask = mx.expand_dims(mask, 2)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
        scores = scores.reshape(B, kv_heads, G * L, S)
    weights = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(weights, *values, transpose=False, group_size=group_size, bits=bits)
    return out.reshape(B, heads, L, D)


def _attention(where: str):
    """The attention for a backend: `cpu`, `cuda` or `metal`."""
    cuda, cpu = where == "cuda", where == "cpu"

    def scaled_dot_product_attention(queries, keys, values, cache, scale: float, mask, sinks=None):
        if not hasattr(cache, "bits"):
            return _ORIGINAL(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        if queries.shape[2] > DEQUANTIZED_ABOVE:
            keys = mx.dequantize(*keys, group_size=cache.group_size, bits=cache.bits)
            values = mx.dequantize(*values, group_size=cache.group_size, bits=cache.bits)
            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        if sinks is not None:
            raise ValueError("quantized attention does not support attention sinks")
        if cuda:
            keys = tuple(mx.contiguous(x) for x in keys)
            values = tuple(mx.contiguous(x) for x in values)
            return _ORIGINAL(queries, keys, values, cache, scale=scale, mask=mask)
        return _grouped(queries, keys, values, scale, mask, cache.group_size, cache.bits, bytes_scores=cpu)

    return scaled_dot_product_attention


def install(model) -> int:
    """Routes the attention of the model's modules (mlx-lm's, or an earlier
    install's) through this one; a plain cache still takes mlx-lm's own
    path. Returns how many modules were rebound."""
    attention = _attention(processor())
    return rebind(model, "scaled_dot_product_attention", attention, lambda current: current is _ORIGINAL or getattr(current, "__module__", None) == __name__)
