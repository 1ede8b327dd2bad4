"""The chunked gated-delta prefill against mlx-lm's sequential recurrence."""

import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import gated_delta as reference

from worker.runtime.gated_delta import chunked_gated_delta, gated_delta_update, install

# Relative distance from the sequential recurrence. mlx-cuda computes float32
# matmuls on tensor cores in TF32 by default (MLX_ENABLE_TF32, a 10-bit
# mantissa), where the chunked
# form's matmuls moved results by 2e-4 to 6e-4 on an H100; the CPU's float32
# stays within 1e-5, and within 1e-4 for a float32 state under bf16 inputs
# and for a whole model's logits.
F32 = 1e-5 if mx.default_device() == mx.cpu else 2e-3
LOOSE = 1e-4 if mx.default_device() == mx.cpu else 2e-3


def _inputs(seed, B, T, Hk, Hv, Dk, Dv, decay=1.0, dtype=mx.float32):
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    q = normal(B, T, Hk, Dk)
    k = normal(B, T, Hk, Dk)
    # The model feeds L2-normalised keys and queries (normalize_qk).
    q, k = reference.normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
    v = normal(B, T, Hv, Dv)
    log_g = -decay * mx.exp(normal(B, T, Hv))
    beta = mx.sigmoid(normal(B, T, Hv))
    state = 0.3 * normal(B, Hv, Dv, Dk)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), log_g, beta, state


def _sequential(q, k, v, log_g, beta, state, mask=None):
    return reference.gated_delta_ops(q, k, v, mx.exp(log_g), beta, state, mask)


def _rel(a, b):
    a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


@pytest.mark.parametrize("T", [1, 2, 3, 31, 63, 64, 65, 128, 200])
@pytest.mark.parametrize("heads", [(2, 2), (1, 4), (2, 6)], ids=["mha", "gqa4", "gqa3"])
def test_matches_sequential_across_lengths_and_head_layouts(T, heads):
    Hk, Hv = heads
    q, k, v, log_g, beta, state = _inputs(T * 7 + Hv, 2, T, Hk, Hv, 32, 16)
    y0, s0 = _sequential(q, k, v, log_g, beta, state)
    y1, s1 = chunked_gated_delta(q, k, v, log_g, beta, state)
    assert y1.shape == y0.shape and y1.dtype == y0.dtype and s1.shape == s0.shape
    assert _rel(y1, y0) < F32 and _rel(s1, s0) < F32


@pytest.mark.parametrize("decay", [0.0, 1e-3, 5.0, 200.0], ids=["none", "slow", "fast", "underflow"])
def test_decay_extremes(decay):
    # At decay 200 every gate underflows to 0 in float32: the chunk must not
    # divide cumulative products, or 0/0 turns into NaN.
    q, k, v, log_g, beta, state = _inputs(3, 1, 150, 2, 4, 32, 32, decay=decay)
    y0, s0 = _sequential(q, k, v, log_g, beta, state)
    y1, s1 = chunked_gated_delta(q, k, v, log_g, beta, state)
    assert np.isfinite(np.array(y1)).all() and np.isfinite(np.array(s1)).all()
    assert _rel(y1, y0) < F32 and _rel(s1, s0) < F32


def test_padding_mask_leaves_state_untouched():
    B, T = 3, 90
    q, k, v, log_g, beta, state = _inputs(11, B, T, 2, 4, 32, 32)
    rng = np.random.default_rng(12)
    left_pad = [0, 17, 70]
    mask_np = np.arange(T)[None, :] >= np.array(left_pad)[:, None]
    mask_np[0] = rng.random(T) > 0.3  # scattered holes too
    mask = mx.array(mask_np)
    y0, s0 = _sequential(q, k, v, log_g, beta, state, mask)
    y1, s1 = chunked_gated_delta(q, k, v, log_g, beta, state, mask)
    assert _rel(s1, s0) < F32
    # Outputs at padded positions are never read; compare real tokens only.
    keep = mask_np[..., None, None]
    assert _rel(mx.array(np.where(keep, np.array(y1), 0)), mx.array(np.where(keep, np.array(y0), 0))) < F32


def test_state_carries_across_calls():
    q, k, v, log_g, beta, state = _inputs(5, 1, 173, 1, 2, 32, 32)
    y_all, s_all = chunked_gated_delta(q, k, v, log_g, beta, state)
    cut = 77
    y_a, s_a = chunked_gated_delta(q[:, :cut], k[:, :cut], v[:, :cut], log_g[:, :cut], beta[:, :cut], state)
    y_b, s_b = chunked_gated_delta(q[:, cut:], k[:, cut:], v[:, cut:], log_g[:, cut:], beta[:, cut:], s_a)
    assert _rel(mx.concatenate([y_a, y_b], axis=1), y_all) < F32
    assert _rel(s_b, s_all) < F32
    y0, s0 = _sequential(q, k, v, log_g, beta, None)
    y1, s1 = chunked_gated_delta(q, k, v, log_g, beta, None)
    assert _rel(y1, y0) < F32 and _rel(s1, s0) < F32


def test_bf16_inputs_keep_their_dtype():
    q, k, v, log_g, beta, state = _inputs(8, 1, 100, 2, 4, 64, 32, dtype=mx.bfloat16)
    y0, s0 = _sequential(q, k, v, log_g, beta, state)
    y1, s1 = chunked_gated_delta(q, k, v, log_g, beta, state)
    assert y1.dtype == mx.bfloat16 and s1.dtype == mx.float32
    assert _rel(y1, y0) < 1e-2 and _rel(s1, s0) < LOOSE


@pytest.mark.parametrize("variant", [{}, {"lower_bound": -4.0}, {"allow_neg_eigval": True}], ids=["plain", "lower_bound", "neg_eigval"])
def test_update_wrapper_matches_mlx_lm(variant):
    rng = np.random.default_rng(21)
    B, T, Hk, Hv, D = 1, 70, 2, 4, 32
    q, k, v, *_ = _inputs(22, B, T, Hk, Hv, D, D)
    a = mx.array(rng.standard_normal((B, T, Hv)).astype(np.float32))
    b = mx.array(rng.standard_normal((B, T, Hv)).astype(np.float32))
    A_log = mx.array(np.log(rng.uniform(1, 16, Hv)).astype(np.float32))
    dt_bias = mx.array(rng.standard_normal(Hv).astype(np.float32))
    y0, s0 = reference.gated_delta_update(q, k, v, a, b, A_log, dt_bias, None, None, **variant)
    y1, s1 = gated_delta_update(q, k, v, a, b, A_log, dt_bias, None, None, **variant)
    assert _rel(y1, y0) < F32 and _rel(s1, s0) < F32


def test_install_routes_the_model_and_keeps_its_logits(tiny_model):
    from mlx_lm.models import qwen3_5
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    model, _ = load_model(tiny_model)
    model.set_dtype(mx.float32)
    prompt = mx.array(np.random.default_rng(0).integers(0, 700, 150), dtype=mx.uint32)[None]
    users = [m for name, m in sys.modules.items() if name.startswith("mlx_lm.models.") and hasattr(m, "gated_delta_update")]
    saved = {m: m.gated_delta_update for m in users}
    try:
        for m in users:
            m.gated_delta_update = reference.gated_delta_update
        before = model(prompt, cache=make_prompt_cache(model))
        assert install(model) >= 1
        assert qwen3_5.gated_delta_update is gated_delta_update
        after = model(prompt, cache=make_prompt_cache(model))
    finally:
        for m, fn in saved.items():
            m.gated_delta_update = fn
    assert _rel(after, before) < LOOSE
    assert (np.array(after.argmax(-1)) == np.array(before.argmax(-1))).mean() > 0.99


def test_decode_steps_of_many_rows_go_in_spans_and_match_mlx_lm():
    """On the CPU a step whose state passes SPAN_STATE is cut into spans of
    rows (worker.runtime.cpu_streams); each row's output and state are
    mlx-lm's, with a row masked out and with no state yet."""
    from worker.runtime import gated_delta as ours

    rng = np.random.default_rng(31)
    B, H, D = 5, 8, 128
    assert B * H * D * D > ours.SPAN_STATE
    q, k, v, *_ = _inputs(32, B, 1, H, H, D, D)
    a = mx.array(rng.standard_normal((B, 1, H)).astype(np.float32))
    b = mx.array(rng.standard_normal((B, 1, H)).astype(np.float32))
    A_log = mx.array(np.log(rng.uniform(1, 16, H)).astype(np.float32))
    dt_bias = mx.array(rng.standard_normal(H).astype(np.float32))
    state = mx.array(0.3 * rng.standard_normal((B, H, D, D)).astype(np.float32))
    mask = mx.array([[True], [False], [True], [True], [True]])
    for s, m in ((state, mask), (None, None)):
        y0, s0 = reference.gated_delta_update(q, k, v, a, b, A_log, dt_bias, s, m)
        y1, s1 = gated_delta_update(q, k, v, a, b, A_log, dt_bias, s, m)
        assert _rel(y1, y0) < F32 and _rel(s1, s0) < F32
