"""A few queries over a longer cache as two matmuls (CUDA's route around a
cuDNN plan per new cache length): the same attention as mlx's, taken only
where it should be."""

import sys

import pytest

from tests.conftest import LOGIT_TOLERANCE


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mask", [None, "causal"])
@pytest.mark.parametrize("shape", [(1, 8, 2, 5, 32), (2, 4, 4, 21, 40), (1, 2, 2, 64, 300)])
def test_composed_attention_matches_mlxs_fused_kernel(shape, mask, dtype):
    import mlx.core as mx

    from worker.runtime.short_attention import composed

    rows, heads, kv_heads, length, keys_length = shape
    mx.random.seed(7)
    q = mx.random.normal((rows, heads, length, 64)).astype(getattr(mx, dtype))
    k = mx.random.normal((rows, kv_heads, keys_length, 64)).astype(q.dtype)
    v = mx.random.normal((rows, kv_heads, keys_length, 64)).astype(q.dtype)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    got = composed(q, k, v, 0.125, mask)
    assert got.shape == want.shape and got.dtype == want.dtype
    tolerance = 1e-5 if dtype == "float32" else 2e-2
    assert mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item() < tolerance


def test_only_a_few_queries_over_more_keys_under_no_or_the_causal_mask_are_taken():
    import mlx.core as mx

    from worker.runtime import short_attention
    from worker.runtime.short_attention import takes

    def q(length, heads=8, rows=1):
        return mx.zeros((rows, heads, length, 32))

    def k(length, rows=1):
        return mx.zeros((rows, 2, length, 32))

    assert takes(q(2), k(3), None, None)
    assert takes(q(21), k(26000), "causal", None)
    assert takes(q(short_attention.QUERIES_AT_MOST), k(500), "causal", None)
    assert not takes(q(1), k(500), None, None)  # decode: mlx's vector kernel
    assert not takes(q(short_attention.QUERIES_AT_MOST + 1), k(500), "causal", None)
    assert not takes(q(40), k(40), "causal", None)  # a fresh prompt
    assert not takes(q(4), k(9), mx.zeros((4, 9)), None)  # an array mask (padded rows)
    assert not takes(q(4), k(9), None, mx.zeros((8,)))  # attention sinks
    many = short_attention.SCORES_AT_MOST // (8 * 64) + 1
    assert not takes(q(64), k(many), "causal", None)


def test_installed_for_cuda_a_resumed_prompt_reads_the_same_and_quantized_caches_still_route(dense_model, monkeypatch):
    """Only CUDA gets the route; forced onto this machine's model, a prompt
    resumed over a cache gives mlx's logits, and kv_bits still installs over it."""
    import mlx.core as mx
    from mlx_lm.models import base
    from mlx_lm.models.cache import make_prompt_cache

    from worker.engine import quant_attention
    from worker.runtime import short_attention
    from worker.runtime.loader import load

    loaded = load(dense_model)
    modules = {sys.modules[type(m).__module__] for m in loaded.model.modules()}
    for module in modules:
        if hasattr(module, "scaled_dot_product_attention"):
            # Restored after the test: the route is bound in mlx-lm's modules.
            monkeypatch.setattr(module, "scaled_dot_product_attention", base.scaled_dot_product_attention)
    assert short_attention.install(loaded.model, "cpu") == 0

    ids = [5, 17, 300, 41, 9, 77, 120, 3, 64, 8, 200, 11, 90, 14, 2, 33]

    def resumed_logits():
        cache = make_prompt_cache(loaded.model)
        loaded.model(mx.array([ids[:10]]), cache=cache)
        return loaded.model(mx.array([ids[10:]]), cache=cache)[0]

    want = resumed_logits()
    taken = []
    real = short_attention.composed
    monkeypatch.setattr(short_attention, "composed", lambda *a: taken.append(a[0].shape) or real(*a))
    assert short_attention.install(loaded.model, "cuda") >= 1
    got = resumed_logits()
    assert taken and all(shape[2] == len(ids) - 10 for shape in taken)
    assert mx.abs(got - want).max().item() < LOGIT_TOLERANCE
    assert quant_attention.install(loaded.model) >= 1


def test_the_warm_up_runs_the_route_over_long_caches_on_cuda_only(dense_model, monkeypatch):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from worker.runtime import short_attention
    from worker.runtime.loader import load

    loaded = load(dense_model)
    cache = make_prompt_cache(loaded.model)
    loaded.model(mx.array([[1, 2, 3]]), cache=cache)
    calls = []
    monkeypatch.setattr(short_attention, "composed", lambda q, k, v, scale, mask: calls.append((q.shape, k.shape, mask)) or q)
    short_attention.warm_up(cache, "cpu")
    assert not calls
    short_attention.warm_up(cache, "cuda")
    layer = cache[0]
    heads, dim = layer.keys.shape[1], layer.keys.shape[3]
    assert [c[0][2] for c in calls] == [8, short_attention.QUERIES_AT_MOST]
    assert all(k == (1, heads, short_attention.WARM_KEYS, dim) and q[1] == 4 * heads and mask == "causal" for q, k, mask in calls)
