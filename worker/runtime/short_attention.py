"""A few queries over a longer cache, as two matmuls, on CUDA.

mlx's CUDA attention hands every call of two or more queries (with no
array mask, or with one) to cuDNN, and caches cuDNN's plan under the
exact shapes of the query, keys and values. A prompt that resumes from the
prefix cache reads its last few tokens against a cache whose length is new
every time (the prefix plus the new message), so nearly every such call
builds a plan first. On an H100, Qwen3-8B's shape, bf16, 21 queries
against 26k cached tokens, medians of 2 processes: 24-27 ms for a shape
met before, 82-100 ms for a new length; the same calls through the two
matmuls below: 38-52 ms for a new length.

So a call of at most QUERIES_AT_MOST queries against more keys than
queries, under no mask or the causal one, with at most SCORES_AT_MOST
scores in all, is computed here: each KV head's queries laid along the
rows of one matmul against its keys (scores in the model's dtype, as
mlx's own composed attention, which CUDA runs for heads over 128, keeps
them), a softmax computed in float32, and a matmul by its values. Larger
prompt pieces keep cuDNN's fused kernel, whose plan
costs little against their compute and which never holds the whole score
matrix; one query a row (decode) keeps mlx's vector kernel.

Only on CUDA: the CPU and Metal have no per-shape plan to build.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import base
from mlx_lm.models.cache import KVCache

from worker.runtime.memory import processor
from worker.runtime.rebind import rebind

QUERIES_AT_MOST = 64
# Query x key scores of a call, all rows and heads: 2^26 is 128 MiB in bf16
# (Qwen3-8B's 32 heads, 21 queries and 26k keys hold 17.5 M).
SCORES_AT_MOST = 1 << 26

# The key length of the warm-up's calls (`warm_up`): as long as a long
# prompt's, since on an H100 the first call of a process at 26k keys took
# 208-356 ms (in two development scripts, after a warm-up over a few keys)
# against 38-52 ms for the calls after it: kernels load at their first use.
WARM_KEYS = 32768

_MLX = base.scaled_dot_product_attention


def takes(queries: mx.array, keys: mx.array, mask, sinks) -> bool:
    """Whether a call is computed here rather than by mlx."""
    rows, heads, length, dim = queries.shape
    keys_length = keys.shape[2]
    return (
        1 < length <= QUERIES_AT_MOST
        and keys_length > length
        and sinks is None
        and (mask is None or isinstance(mask, str))
        and rows * heads * length * keys_length <= SCORES_AT_MOST
    )


def composed(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: str | None) -> mx.array:
    """Attention of (rows, heads, L, D) queries over (rows, kv heads, S, D)
    keys and values; `mask` "causal" aligns the queries with the last L keys."""
    rows, heads, length, dim = queries.shape
    kv_heads, keys_length = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    scores = (queries * scale).reshape(rows, kv_heads, group * length, dim) @ keys.swapaxes(-1, -2)
    if mask is not None:
        seen = mx.tile(base.create_causal_mask(length, keys_length - length), (group, 1))
        scores = mx.where(seen, scores, mx.array(-float("inf"), scores.dtype))
    weights = mx.softmax(scores, axis=-1, precise=True)
    return (weights @ values).reshape(rows, heads, length, values.shape[-1])


def attention(queries, keys, values, cache, scale: float, mask, sinks=None):
    """mlx-lm's `scaled_dot_product_attention`, with the calls above taken here."""
    if not hasattr(cache, "bits") and takes(queries, keys, mask, sinks):
        return composed(queries, keys, values, scale, mask)
    return _MLX(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def install(model, where: str | None = None) -> int:
    """Routes the model's attention through `attention` where mlx computes
    on CUDA (`where`: the processor, by default this one's); returns how
    many modules were rebound."""
    if (where or processor()) != "cuda":
        return 0
    return rebind(model, "scaled_dot_product_attention", attention, lambda current: current is _MLX)


def warm_up(cache: list, where: str | None = None) -> None:
    """Runs the route once, at the first attention cache's heads and dtype
    over WARM_KEYS keys, a few queries and QUERIES_AT_MOST (on CUDA only)."""
    if (where or processor()) != "cuda":
        return
    layer = next((c for c in cache if type(c) is KVCache and c.keys is not None), None)
    if layer is None:
        return
    _, kv_heads, _, dim = layer.keys.shape
    keys = mx.zeros((1, kv_heads, WARM_KEYS, dim), layer.keys.dtype)
    for length in (8, QUERIES_AT_MOST):
        mx.eval(composed(mx.zeros((1, 4 * kv_heads, length, dim), keys.dtype), keys, keys, 1.0, "causal"))
