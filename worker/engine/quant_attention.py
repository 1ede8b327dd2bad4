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
runs of 100, 8 bits).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import base

from worker.runtime.memory import processor
from worker.runtime.rebind import rebind

DEQUANTIZED_ABOVE = 8

_ORIGINAL = base.scaled_dot_product_attention


def _grouped(queries, keys: tuple, values: tuple, scale: float, mask, group_size: int, bits: int) -> mx.array:
    """mlx-lm's quantized attention with each KV head's queries as the rows
    of one matmul: (B, Hk, G * L, D) against the cache's (B, Hk, S, D)."""
    B, heads, L, D = queries.shape
    kv_heads = keys[0].shape[1]
    G = heads // kv_heads
    q = (queries * scale).reshape(B, kv_heads, G * L, D)
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


def _attention(cuda: bool):
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
        return _grouped(queries, keys, values, scale, mask, cache.group_size, cache.bits)

    return scaled_dot_product_attention


def install(model) -> int:
    """Routes the attention of the model's modules (mlx-lm's, or an earlier
    install's) through this one; a plain cache still takes mlx-lm's own
    path. Returns how many modules were rebound."""
    attention = _attention(processor() == "cuda")
    return rebind(model, "scaled_dot_product_attention", attention, lambda current: current is _ORIGINAL or getattr(current, "__module__", None) == __name__)
