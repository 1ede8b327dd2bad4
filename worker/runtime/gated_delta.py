"""Chunked (WY-form) gated-delta prefill for backends without Metal.

mlx-lm runs Qwen3.5's linear-attention recurrence with a Metal kernel on
Apple GPUs and, everywhere else, as a Python loop of one graph step per token,
so a 2k-token prompt costs 2k dependent steps per layer. This module computes
the same recurrence a chunk of C tokens at a time: inside a chunk every token's
correction is found at once by inverting a small unit-triangular system (the
WY representation of a product of Householder-like updates), so only one
dependent step per chunk remains.

Recurrence, per value head (state S is Dv x Dk):
    S_t = g_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T,    y_t = S_t q_t
Within a chunk starting from S_0, with G_t = g_1...g_t (cumulative decay):
    d_t = b_t (v_t - G_t S_0 k_t - sum_{i<t} (G_t/G_i)(k_i.k_t) d_i)
    y_t = G_t S_0 q_t + sum_{i<=t} (G_t/G_i)(k_i.q_t) d_i
    S_C = G_C S_0 + sum_i (G_C/G_i) d_i k_i^T
The d_t solve a unit lower-triangular system (I + A) D = ..., solved with a
log-depth block inversion built from matmuls. Decay ratios are taken in log
space, so tiny gates underflow to zero instead of dividing 0 by 0.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.gated_delta import gated_delta_update as _ORIGINAL

from worker.runtime import cpu_streams
from worker.runtime.rebind import rebind

log = logging.getLogger("worker")

CHUNK = 64


def _invert_unit_lower(a: mx.array) -> mx.array:
    """(I + a)^-1 for strictly lower-triangular a (..., C, C), C a power of two.

    Doubling: the inverse of [[L11, 0], [L21, L22]] is
    [[X11, 0], [-X22 L21 X11, X22]], so inverses of diagonal blocks of size s
    give those of size 2s in two batched matmuls. Every L21 block of a level
    is read through one strided view of a (no gather, no copy of a).
    """
    c = a.shape[-1]
    lead = a.shape[:-2]
    neg = mx.contiguous(-a)
    lead_strides = [c * c * int(np.prod(lead[i + 1 :], dtype=np.int64)) for i in range(len(lead))]
    inv = mx.ones((*lead, c, 1, 1), dtype=a.dtype)
    s = 1
    while s < c:
        n = c // (2 * s)
        # Block j's L21 starts at row (2j+1)s, column 2js.
        lower = mx.as_strided(neg, (*lead, n, s, s), (*lead_strides, 2 * s * c + 2 * s, c, 1), s * c)
        x11, x22 = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        x21 = x22 @ lower @ x11
        top = mx.concatenate([x11, mx.zeros_like(x11)], axis=-1)
        bottom = mx.concatenate([x21, x22], axis=-1)
        inv = mx.concatenate([top, bottom], axis=-2)
        s *= 2
    return inv.reshape(*lead, c, c)


@mx.compile
def _advance(state, u, w, kd, g_end):
    """The only dependent step: the state after one chunk."""
    delta = u - w @ mx.swapaxes(state, -1, -2)
    return g_end[..., None, None] * state + mx.swapaxes(delta, -1, -2) @ kd


def chunked_gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    log_g: mx.array,
    beta: mx.array,
    state: mx.array | None = None,
    mask: mx.array | None = None,
    chunk: int = CHUNK,
) -> tuple[mx.array, mx.array]:
    """Gated-delta recurrence over a whole prompt piece.

    Shapes: q, k (B, T, Hk, Dk); v (B, T, Hv, Dv); log_g, beta (B, T, Hv);
    state (B, Hv, Dv, Dk) float32; mask (B, T), False marks padding, whose
    tokens leave the state untouched. Returns y (B, T, Hv, Dv) in q's dtype
    and the final state in float32.
    """
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[-2:]
    f32 = mx.float32
    out_dtype = q.dtype
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=f32)
    if Hv > Hk:
        q = mx.repeat(q, Hv // Hk, axis=2)
        k = mx.repeat(k, Hv // Hk, axis=2)
    if mask is not None:
        # A padded token decays nothing and writes nothing.
        log_g = mx.where(mask[..., None], log_g, 0.0)
        beta = mx.where(mask[..., None], beta, 0.0)
    c = min(chunk, 1 << max(T - 1, 0).bit_length())
    n = -(-T // c)
    pad = n * c - T

    def heads_first(x, width):
        if pad:
            x = mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        # One copy kernel: the cast writes the head-major layout.
        x = mx.moveaxis(x, 2, 1).astype(f32)
        return x.reshape(B, Hv, n, c, width) if width else x.reshape(B, Hv, n, c)

    q, k, v = heads_first(q, Dk), heads_first(k, Dk), heads_first(v, Dv)
    log_g, beta = heads_first(log_g, 0), heads_first(beta, 0)

    cum = mx.cumsum(log_g, axis=-1)
    diff = cum[..., :, None] - cum[..., None, :]
    rows = mx.arange(c)
    causal = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    # Mask before exp: above the diagonal the differences are positive and
    # could overflow.
    ratio = mx.exp(mx.where(causal, diff, -mx.inf))
    kt = mx.swapaxes(k, -1, -2)
    a = mx.where(strict, beta[..., None] * (k @ kt) * ratio, 0.0)
    inv = _invert_unit_lower(a)
    u = inv @ (beta[..., None] * v)
    w = inv @ ((beta * mx.exp(cum))[..., None] * k)
    kd = mx.exp(cum[..., -1:] - cum)[..., None] * k
    g_end = mx.exp(cum[..., -1])

    # Chunk-major copies, so each step reads contiguous slices.
    u_c, w_c, kd_c, g_c = (mx.contiguous(mx.moveaxis(x, 2, 0)) for x in (u, w, kd, g_end))
    starts = []
    for i in range(n):
        starts.append(state)
        step = (x[i : i + 1].squeeze(0) for x in (u_c, w_c, kd_c, g_c))
        state = _advance(state, *step)
    # With every chunk's starting state known, the outputs are batched.
    s0t = mx.swapaxes(mx.stack(starts, axis=2), -1, -2)
    delta = u - w @ s0t
    y = (mx.exp(cum)[..., None] * q) @ s0t + ((q @ kt) * ratio) @ delta
    y = y.reshape(B, Hv, n * c, Dv)[:, :, :T]
    return mx.moveaxis(y, 1, 2).astype(out_dtype), state


# A decode step's rows on the CPU go in spans of about this many state
# values (2 MB of float32): from 2 rows of Qwen3.5-0.8B's heads up the step
# was faster cut, below it the streams' hand-over cost more (development
# runs on a 2-core Xeon: 1.07 against 1.22 ms at 2 rows, 0.73 against 0.68
# at 8 rows of 8 heads of 64 x 64).
SPAN_STATE = 1 << 19


def gated_delta_update(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: mx.array | None = None,
    mask: mx.array | None = None,
    *,
    use_kernel: bool = True,
    lower_bound: float | None = None,
    allow_neg_eigval: bool = False,
) -> tuple[mx.array, mx.array]:
    """Drop-in for mlx_lm.models.gated_delta.gated_delta_update.

    Prompt pieces go through the chunked form; single decode steps, vector
    gates and training keep mlx-lm's own path.
    """
    if q.shape[1] < 2 or a.ndim != 3 or not use_kernel:
        kw = dict(use_kernel=use_kernel, lower_bound=lower_bound, allow_neg_eigval=allow_neg_eigval)
        rows = q.shape[0]
        state_size = rows * v.shape[2] * v.shape[3] * q.shape[3]  # rows x value heads x Dv x Dk
        if mx.default_device() != mx.cpu or state_size < SPAN_STATE:
            return _ORIGINAL(q, k, v, a, b, A_log, dt_bias, state, mask, **kw)
        # mlx-lm's step makes several arrays the size of the state; past a
        # few MB each they fall out of the CPU's caches and the step slows
        # far more than in proportion (one step of Qwen3.5-0.8B's 16 heads
        # of 128 x 128 on a 2-core Xeon: 1.2 ms for 2 rows, 8.0 for 4, 21
        # for 8). So rows go in spans of about SPAN_STATE state values, over
        # the CPU's streams (worker.runtime.cpu_streams).
        return cpu_streams.apart(
            rows,
            lambda r: _ORIGINAL(q[r], k[r], v[r], a[r], b[r], A_log, dt_bias, None if state is None else state[r], None if mask is None else mask[r], **kw),
            spans=-(-state_size // SPAN_STATE),
        )
    beta = mx.sigmoid(b)
    if allow_neg_eigval:
        beta = beta * 2.0
    # The same gate formulas as mlx-lm, kept as logarithms.
    if lower_bound is None:
        log_g = -mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias)
    else:
        log_g = lower_bound * mx.sigmoid(mx.exp(A_log.astype(mx.float32)) * (a.astype(mx.float32) + dt_bias))
    return chunked_gated_delta(q, k, v, log_g, beta, state, mask)


def install(model: nn.Module) -> int:
    """Routes the model's gated-delta calls through the chunked prefill when
    Metal is absent (CPU, CUDA); returns how many modules were patched.

    (worker.runtime.rebind says why a name is rebound per module.)
    """
    if mx.metal.is_available():
        return 0
    patched = rebind(model, "gated_delta_update", gated_delta_update, lambda current: current is _ORIGINAL)
    if patched:
        log.info("gated-delta prefill: chunked (%d tokens per chunk)", CHUNK)
    return patched
