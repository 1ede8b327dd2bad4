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

The few queries of each KV head are laid along the matmul's rows
(`_grouped`) instead of broadcasting the cache over them as mlx-lm does:
one matmul of G rows per KV head in place of G of one row. On the CPU that
is faster (2 KV heads of 32, 4 query heads, 2,304 tokens: 0.52 against
0.64 ms a call for one row, 3.7 against 4.4 ms for eight, medians of 8
alternated runs of 100, 8 bits). On CUDA it is the only way that runs:
mlx's quantized matmul there has no kernel for an operand that is not
contiguous (`is_last_2_dims_row_contiguous` in its qmm.cu), which a
broadcast cache is not (mlx-lm's own path fails at the first decode step,
"No implementation for problem shape"), nor a cache's tokens so far, a
slice of its buffer, which are copied to one block first there. mlx's CPU
kernel for the scores (`x @ W.T`) runs at 2-3x a float matmul; keys are
scored from their bytes with a float matmul instead (`_byte_scores`).
That kernel also adds up a bf16 product in bf16, and slowly: the values'
side of a step, which sums over every cached token, drifted 5 % from
float32 at 1k tokens and 12 % at 4k (heads of 128, 8 bits) and ran 7.6x
the same product's time in float32. So on the CPU a step over a bf16 or
fp16 cache (a worker started with `--cpu-dtype stored`) computes in
float32, its scales and biases converted, and gives its output back in
the model's dtype: one layer's step on Qwen3-8B's heads (8 KV heads of 4
queries) took 8.8 against 29.1 ms at 2,304 tokens and 23.7 against
78.2 ms at 8k, 0.3 % from a float32 reference where it was 8.5-13.8 %.

On CUDA a decode step over a long cache (worker.engine.quant_decode_kernel
.FROM_TOKENS and more) skips mlx's quantized matmuls altogether: their
kernel for the values' product walks every cached token on one thread
block a KV head, and at 32k tokens an 8B row decoded at 0.27x bf16. The
worker's own kernel (worker.engine.quant_decode_kernel) splits the tokens
over thread blocks instead; kv_quant.install checks it against a float32
reference once at load and keeps mlx's way if it fails there.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import base

from worker.engine import quant_decode_kernel
from worker.runtime import cpu_attention, cpu_streams, short_attention
from worker.runtime.memory import processor
from worker.runtime.rebind import rebind

DEQUANTIZED_ABOVE = 8
# mlx's CUDA quantized matmul (0.32.4) computes `x @ W.T` wrongly where
# each row of W is one group (a head dimension equal to the group size: 64
# and 64, 128 and 128; 8 or 4 bits): on an H100, every such call but a
# lone 2-D row gave errors the size of the scores themselves, or NaN,
# over 300, 304 or 512 keys alike, and its Hopper kernel's TMA setup
# failed on some; with two or more groups a row every shape tried was
# right to bf16's rounding, and the values' product (`x @ W`) was right in
# all. So on CUDA a cache of one group a row scores its keys dequantized
# (`mx.dequantize`, then a float matmul); its values stay quantized.
# `_byte_scores` converts the packed keys to float32 before its matmul; that
# copy pays while it stays in cache. Up to BYTES_AT_ONCE key values (rows x
# KV heads x tokens x head dimension; 16 MB of float32, half the L3 of the
# machines it was measured on) it converts them at once; beyond, one row's
# KV head at a time, in blocks of at most BYTES_BLOCK values (1 MB of
# float32, the L2 of a core of the first), each multiplied as soon as it
# is made; beyond BYTES_BLOCKS_AT_MOST blocks (a few ops each, in every
# attention layer's part of a step's graph; 256 is 8 rows of Qwen3-8B's KV
# heads at 8k tokens, the largest measured) mlx's kernel reads the keys.
# Measured on a 2-core CPU with 1 MB of L2 a core and 32 MB of L3
# (bench.kv_layouts): one layer's attention on Qwen3-8B's heads 1.6-1.9x
# float32's time against the kernel's 2.9-3.8x; without blocks, 8 rows of
# those heads at 2k tokens took as long as the kernel. The bound was 2M
# values then; on a 2-core EPYC with 2 MB of L2 a core and 32 MB of L3,
# the scores of 2.4M to 4.2M key values (1 to 4 rows of Qwen3-8B's heads
# or of 4 KV heads of 64, 2k to 8k tokens) took 1.2-2.4x float32's time
# at once against 2.0-3.5x in blocks (at once the faster in 5 of 6
# development runs of 7 alternated rounds), and bench.dense's model
# decoded 8 rows at 2k tokens (a CPU stream's 4 rows: 2.4M key values) at
# 130 tokens a second against 94 with the 2M bound (bench.long_context,
# medians of 5 rounds, two runs back to back).
BYTES_AT_ONCE = 1 << 22
BYTES_BLOCK = 1 << 18
BYTES_BLOCKS_AT_MOST = 256

_ORIGINAL = base.scaled_dot_product_attention


def _byte_blocks(keys: tuple, dim: int) -> int:
    """How many blocks `_byte_scores` reads these keys in (1: at once)."""
    B, H, S, _ = keys[0].shape
    if B * H * S * dim <= BYTES_AT_ONCE:
        return 1
    return B * H * -(-S // max(1, BYTES_BLOCK // dim))


def _unpacked(packed: mx.array, bits: int) -> mx.array:
    """Packed words as the float32 values they hold, in order: mlx packs
    value i of a word at bits i * bits, and every machine mlx runs on is
    little-endian, so byte j holds value j (8 bits), or values 2j and
    2j + 1 in its low and high halves (4 bits)."""
    b = packed.view(mx.uint8)
    if bits == 4:
        b = mx.stack([b & 15, b >> 4], axis=-1).reshape(*b.shape[:-1], -1)
    return b.astype(mx.float32)


def _raw(q: mx.array, packed: mx.array, group_size: int, bits: int) -> mx.array:
    """Each query's dot product with each token's quantized values, group by
    group: (..., L, D) float32 against (..., S, D * bits / 32) packed words
    gives (..., L, D / group_size, S). The queries are spread over a
    block-diagonal matrix, a row per (query, group), so that one matmul
    reads each key once."""
    L, D = q.shape[-2:]
    n = D // group_size
    spread = mx.arange(D)[None, :] // group_size == mx.arange(n)[:, None]
    rows = (q[..., :, None, :] * spread).reshape(*q.shape[:-2], L * n, D)
    return (rows @ _unpacked(packed, bits).swapaxes(-1, -2)).reshape(*q.shape[:-2], L, n, -1)


def _byte_scores(q: mx.array, keys: tuple, group_size: int, bits: int, blocks: int) -> mx.array:
    """q @ K.T for 8- or 4-bit keys without mlx's CPU kernel for it
    (`x @ W.T`, 2-3x a float matmul): with a token's group g holding
    s_g w + b_g, q . k = sum over g of s_g (q_g . w) + b_g sum(q_g), the
    dot products from one float matmul over the keys' bytes (`_raw`). In
    float32 whatever the model's dtype: q_g . w runs up to 255 times the
    score's size before the bias takes most of it back. `blocks` is
    `_byte_blocks(keys, D)`, which the caller has already counted."""
    packed, scales, biases = keys
    B, H, S, _ = packed.shape
    L, D = q.shape[-2:]
    q32 = q.astype(mx.float32)
    if blocks == 1:
        raw = _raw(q32, packed, group_size, bits)
    else:
        per = max(1, BYTES_BLOCK // D)
        heads = []
        for b in range(B):
            for h in range(H):
                blocks = [_raw(q32[b, h], packed[b, h, t : t + per], group_size, bits) for t in range(0, S, per)]
                heads.append(mx.concatenate(blocks, axis=-1) if len(blocks) > 1 else blocks[0])
        raw = mx.stack(heads).reshape(B, H, L, D // group_size, S)
    sums = q32.reshape(B, H, L, D // group_size, group_size).sum(axis=-1, keepdims=True)
    scores = raw * mx.expand_dims(scales.swapaxes(-1, -2), 2) + sums * mx.expand_dims(biases.swapaxes(-1, -2), 2)
    return scores.sum(axis=-2).astype(q.dtype)


def _precise_softmax(scores: mx.array) -> mx.array:
    return mx.softmax(scores, axis=-1, precise=True)


def _grouped(
    queries, keys: tuple, values: tuple, scale: float, mask, group_size: int, bits: int, scores_by: str = "kernel", softmax=_precise_softmax
) -> mx.array:
    """mlx-lm's quantized attention with each KV head's queries as the rows
    of one matmul: (B, Hk, G * L, D) against the cache's (B, Hk, S, D).
    Keys are scored by mlx's quantized matmul (`scores_by` "kernel"), by
    `_byte_scores` where its blocks stay few ("bytes"), or dequantized
    ("dequantized"); `softmax` takes the masked scores (on the CPU,
    worker.runtime.cpu_attention's)."""
    B, heads, L, D = queries.shape
    kv_heads = keys[0].shape[1]
    G = heads // kv_heads
    q = (queries * scale).reshape(B, kv_heads, G * L, D)
    if scores_by == "bytes" and (blocks := _byte_blocks(keys, D)) <= BYTES_BLOCKS_AT_MOST:
        scores = _byte_scores(q, keys, group_size, bits, blocks)
    elif scores_by == "dequantized":
        scores = q @ mx.dequantize(*keys, group_size=group_size, bits=bits).swapaxes(-1, -2)
    else:
        scores = mx.quantized_matmul(q, *keys, transpose=True, group_size=group_size, bits=bits)
    scores = cpu_attention.masked(scores, mask, kv_heads, G)
    weights = softmax(scores)
    out = mx.quantized_matmul(weights, *values, transpose=False, group_size=group_size, bits=bits)
    return out.reshape(B, heads, L, D)


def keys_dequantized(where: str, dim: int, group_size: int) -> bool:
    """Whether a step scores its keys dequantized: on CUDA, for rows of keys
    of one group (see above)."""
    return where == "cuda" and dim == group_size


def _contiguous(packed: tuple) -> tuple:
    """A quantized cache's arrays as contiguous arrays (what mlx's CUDA
    quantized matmul takes)."""
    return tuple(mx.contiguous(x) for x in packed)


def _float32(packed: tuple) -> tuple:
    """A quantized cache's words with its scales and biases in float32."""
    return (packed[0], *(x.astype(mx.float32) for x in packed[1:]))


def _attention(where: str, kernel: bool = False):
    """The attention for a backend: `cpu`, `cuda` or `metal`; `kernel`: on
    CUDA, decode steps through worker.engine.quant_decode_kernel where it
    takes their shape."""
    cuda, cpu = where == "cuda", where == "cpu"
    plain = short_attention.attention if cuda else cpu_attention.attention if cpu else _ORIGINAL

    def scaled_dot_product_attention(queries, keys, values, cache, scale: float, mask, sinks=None):
        if not hasattr(cache, "bits"):
            return plain(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        if queries.shape[2] > DEQUANTIZED_ABOVE:
            keys = mx.dequantize(*keys, group_size=cache.group_size, bits=cache.bits)
            values = mx.dequantize(*values, group_size=cache.group_size, bits=cache.bits)
            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        if sinks is not None:
            raise ValueError("quantized attention does not support attention sinks")
        dtype, scores_by = queries.dtype, "kernel"
        if cpu:
            scores_by = "bytes"
            if dtype != mx.float32:
                queries, keys, values = queries.astype(mx.float32), _float32(keys), _float32(values)
        elif cuda:
            if (
                kernel
                and keys[0].shape[2] >= quant_decode_kernel.FROM_TOKENS
                and quant_decode_kernel.supported(queries.shape, keys, cache.group_size, cache.bits, mask)
            ):
                return quant_decode_kernel.attention(queries, keys, values, scale, mask, cache.group_size, cache.bits)
            scores_by = "dequantized" if keys_dequantized(where, queries.shape[-1], cache.group_size) else "kernel"
            keys = keys if scores_by == "dequantized" else _contiguous(keys)
            values = _contiguous(values)
        softmax = cpu_attention.softmax if cpu else _precise_softmax
        args = (cache.group_size, cache.bits, scores_by, softmax)
        if cpu and cpu_attention.takes(queries, keys[0], None):
            # Rows a core each (worker.runtime.cpu_streams).
            out = cpu_streams.apart(
                queries.shape[0],
                lambda r: _grouped(queries[r], tuple(x[r] for x in keys), tuple(x[r] for x in values), scale, cpu_streams.rows_of(mask, r), *args),
            )
        else:
            out = _grouped(queries, keys, values, scale, mask, *args)
        return out if out.dtype == dtype else out.astype(dtype)

    return scaled_dot_product_attention


def install(model, kernel: bool = False) -> int:
    """Routes the attention of the model's modules (mlx-lm's, or an earlier
    install's) through this one; a plain cache still takes mlx-lm's own
    path (on CUDA, worker.runtime.short_attention's). `kernel`: see
    `_attention`. Returns how many modules were rebound."""
    attention = _attention(processor(), kernel)
    ours = (__name__, short_attention.__name__, cpu_attention.__name__)
    return rebind(model, "scaled_dot_product_attention", attention, lambda current: current is _ORIGINAL or getattr(current, "__module__", None) in ours)
