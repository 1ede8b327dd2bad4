"""The CUDA kernel for decode attention over a quantized cache against the
same attention computed from the dequantized cache in float32.

The kernel is mlx's `cuda_kernel`, which no other backend runs: its tests
run on an NVIDIA GPU only; the reference they compare with runs anywhere.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.base import quantized_scaled_dot_product_attention

from worker.engine import quant_decode_kernel as kernel

cuda_only = pytest.mark.skipif(not mx.cuda.is_available(), reason="a CUDA kernel: runs on an NVIDIA GPU only")


def _cache(B, kv_heads, S, D, group_size, bits, seed, spare=7):
    """Packed keys and values as slices of a longer buffer (as a worker's
    cache hands them over), from random bf16 values."""
    key = mx.random.key(seed)
    kk, kv = mx.random.split(key)
    raw_k = mx.random.normal((B, kv_heads, S + spare, D), key=kk).astype(mx.bfloat16)
    raw_v = mx.random.normal((B, kv_heads, S + spare, D), key=kv).astype(mx.bfloat16)
    keys = tuple(x[..., :S, :] for x in mx.quantize(raw_k, group_size=group_size, bits=bits))
    values = tuple(x[..., :S, :] for x in mx.quantize(raw_v, group_size=group_size, bits=bits))
    return keys, values


CASES = [
    # B, heads, kv_heads, L, S, D, group_size, bits, mask
    (1, 32, 8, 1, 300, 128, 64, 8, None),
    (1, 32, 8, 1, 20000, 128, 64, 8, None),
    (3, 8, 2, 1, 2049, 128, 64, 8, "lengths"),
    (2, 8, 2, 3, 700, 128, 32, 4, "causal"),
    (2, 16, 4, 1, 129, 64, 64, 8, "additive"),
    (1, 8, 2, 8, 513, 256, 64, 8, "causal"),
    (2, 4, 4, 1, 5, 256, 128, 4, "lengths"),
    (1, 16, 2, 4, 1000, 128, 128, 8, None),
]


@pytest.mark.parametrize("mask", [None, "causal", "lengths"])
def test_the_reference_is_mlx_lm_s_quantized_attention(mask):
    # On the CPU, which every build of mlx has: on an H100 (mlx-cuda 0.32.4)
    # mlx-lm's quantized attention itself gave other values for this cache,
    # where the reference and the kernel agreed.
    with mx.stream(mx.cpu):
        B, heads, kv_heads, L, S, D = 2, 8, 2, 3, 200, 64
        keys, values = _cache(B, kv_heads, S, D, 32, 8, seed=5)
        queries = mx.random.normal((B, heads, L, D), key=mx.random.key(6)).astype(mx.float32)
        if mask == "lengths":
            mask = mx.broadcast_to((mx.arange(S) >= mx.array([0, 9])[:, None]).reshape(B, 1, 1, S), (B, 1, L, S))
        contiguous = tuple(tuple(mx.contiguous(x) for x in t) for t in (keys, values))
        # A copy: mlx-lm scales its queries in place (`*=` on an mx.array).
        want = quantized_scaled_dot_product_attention(queries + 0, *contiguous, scale=D**-0.5, mask=mask, group_size=32, bits=8)
        got = kernel.reference(queries, keys, values, D**-0.5, mask, 32, 8)
        # mlx's CPU quantized matmul adds up in the scales' dtype (bf16 here).
        assert mx.allclose(got, want, rtol=1e-2, atol=1e-2).item()


@cuda_only
@pytest.mark.parametrize("case", CASES, ids=[f"B{c[0]}-h{c[1]}/{c[2]}-L{c[3]}-S{c[4]}-D{c[5]}-g{c[6]}-b{c[7]}-{c[8]}" for c in CASES])
def test_the_kernel_gives_the_dequantized_cache_s_attention(case):
    B, heads, kv_heads, L, S, D, group_size, bits, mask_kind = case
    keys, values = _cache(B, kv_heads, S, D, group_size, bits, seed=S + D)
    queries = mx.random.normal((B, heads, L, D), key=mx.random.key(D)).astype(mx.float32)
    scale = D**-0.5
    if mask_kind == "lengths":  # left padding: row b sees its last S - 3b tokens
        starts = mx.array([3 * b for b in range(B)])
        mask = (mx.arange(S)[None, :] >= starts[:, None]).reshape(B, 1, 1, S)
        mask = mx.broadcast_to(mask, (B, 1, L, S))
    elif mask_kind == "additive":
        mask = mx.where(mx.arange(S) % 3 == 0, -1e9, 0.0).astype(mx.float32).reshape(1, 1, 1, S)
    else:
        mask = mask_kind
    assert kernel.supported(queries.shape, keys, group_size, bits, mask)
    got = kernel.attention(queries, keys, values, scale, mask, group_size, bits)
    want = kernel.reference(queries, keys, values, scale, mask, group_size, bits)
    assert got.shape == want.shape and got.dtype == queries.dtype
    assert mx.allclose(got, want, rtol=1e-3, atol=1e-3).item(), mx.abs(got - want).max().item()


@cuda_only
def test_the_kernel_runs_inside_a_compiled_step_over_a_whole_buffer_under_a_mask():
    B, heads, kv_heads, S, D = 2, 32, 8, 1024, 128
    keys, values = _cache(B, kv_heads, S, D, 64, 8, seed=3, spare=0)
    queries = mx.random.normal((B, heads, 1, D), key=mx.random.key(4)).astype(mx.bfloat16)
    filled = mx.array([900, 1000])

    def step(q, filled):
        mask = (mx.arange(S)[None, :] < filled[:, None]).reshape(B, 1, 1, S)
        return kernel.attention(q, keys, values, D**-0.5, mask, 64, 8)

    got = mx.compile(step)(queries, filled)
    mask = (mx.arange(S)[None, :] < filled[:, None]).reshape(B, 1, 1, S)
    want = kernel.reference(queries, keys, values, D**-0.5, mask, 64, 8)
    assert mx.allclose(got.astype(mx.float32), want, rtol=2e-2, atol=2e-2).item()


@cuda_only
def test_the_check_passes_on_this_gpu():
    assert kernel.check({64, 128, 256}, 64, 8) is None
    assert kernel.check({128}, 32, 4) is None


def test_shapes_the_kernel_does_not_take_are_left_to_the_caller():
    keys, _ = _cache(1, 2, 10, 128, 64, 8, seed=1)
    assert not kernel.supported((1, 8, 9, 128), keys, 64, 8, None)  # 36 query rows a KV head
    assert not kernel.supported((1, 8, 1, 128), keys, 64, 2, None)  # 2 bits
    assert not kernel.supported((1, 8, 1, 128), keys, 64, 8, mx.zeros((1, 8, 1, 10), dtype=mx.bool_))  # a mask a head


def test_a_cuda_step_takes_the_kernel_from_its_length_on(monkeypatch):
    """The routing in worker.engine.quant_attention, run on any backend: the
    kernel's place taken by its reference, which computes what it does."""
    from types import SimpleNamespace

    from worker.engine import quant_attention

    taken = []

    def counted(*args):
        taken.append(args[1][0].shape[2])
        return kernel.reference(*args)

    monkeypatch.setattr(kernel, "FROM_TOKENS", 256)
    monkeypatch.setattr(kernel, "attention", counted)
    attention = quant_attention._attention("cuda", kernel=True)
    cache = SimpleNamespace(bits=8, group_size=64)
    for S in (255, 256, 300):
        keys, values = _cache(2, 2, S, 128, 64, 8, seed=S)
        queries = mx.random.normal((2, 8, 1, 128), key=mx.random.key(S)).astype(mx.float32)
        got = attention(queries + 0, keys, values, cache, scale=128**-0.5, mask=None)
        want = kernel.reference(queries, keys, values, 128**-0.5, None, 64, 8)
        assert mx.allclose(got, want, rtol=1e-2, atol=1e-2).item()
    assert taken == [256, 300]
    assert quant_attention._attention("cuda")(queries + 0, keys, values, cache, scale=128**-0.5, mask=None) is not None
    assert taken == [256, 300]  # kernel off: mlx's way
