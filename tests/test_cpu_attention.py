"""worker.runtime.cpu_attention: the CPU's decode attention and its
polynomial exponential, against mlx's own."""

from __future__ import annotations

import math
import sys

import mlx.core as mx
import numpy as np
import pytest

from worker.runtime import cpu_attention
from worker.runtime.cpu_attention import FLOOR, composed, exp_nonpositive, softmax

# The route runs on the CPU only; compared there with mlx's CPU kernels at
# float32 precision (a GPU's exp and TF32 matmuls are coarser references).
cpu_only = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU's route, at float32 precision")


@cpu_only
def test_the_exponential_is_exact_to_float32_precision_and_zero_below_its_floor():
    x = mx.concatenate([mx.linspace(FLOOR, 0.0, 200_001), mx.array([-0.0, -1e-30, -1e-7, math.log(0.5), -86.999])])
    want = np.exp(np.array(x, dtype=np.float64))
    # Measured 1.2e-7 (mlx's own exp: 3.8e-6 near the floor).
    assert (np.abs(np.array(exp_nonpositive(x), dtype=np.float64) - want) / want).max() < 2.5e-7
    assert exp_nonpositive(mx.array([0.0])).item() == 1.0
    below = exp_nonpositive(mx.array([FLOOR - 0.01, -100.0, -3.4e38, -float("inf")]))
    assert below.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert math.isnan(exp_nonpositive(mx.array([float("nan")])).item())


@cpu_only
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_the_softmax_is_mlx_s_precise_one(dtype):
    mx.random.seed(3)
    scores = (mx.random.normal((3, 2, 5, 700)) * 6).astype(dtype)
    # A row of masked scores (finfo.min), as a padded row's are.
    scores[0, 0, 0, :300] = mx.finfo(dtype).min
    got, want = softmax(scores), mx.softmax(scores, axis=-1, precise=True)
    assert got.dtype == dtype
    tolerance = 1e-6 if dtype == mx.float32 else 4e-3
    assert mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item() < tolerance
    assert (got[0, 0, 0, :300] == 0).all().item()


def _inputs(rows: int, length: int, keys_length: int, seed: int = 0):
    mx.random.seed(seed)
    queries = mx.random.normal((rows, 4, length, 32))
    keys = mx.random.normal((rows, 2, keys_length, 32))
    values = mx.random.normal((rows, 2, keys_length, 32))
    return queries, keys, values


def _mlx(queries, keys, values, mask):
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=32**-0.5, mask=mask)


@cpu_only
@pytest.mark.parametrize("length", [1, 4, cpu_attention.QUERIES_AT_MOST])
def test_composed_attention_is_mlx_s_under_each_kind_of_mask(length):
    # 3 rows x 4 heads x 800 keys: past SCORES_FROM at one query a row.
    queries, keys, values = _inputs(3, length, 800)
    # Rows left-padded by 0, 7 and 120 tokens, as a batch's decode mask is.
    padding = mx.array([0, 7, 120])
    seen = (mx.arange(800)[None, :] >= padding[:, None])[:, None, None, :]
    seen = mx.broadcast_to(seen, (3, 1, length, 800))
    additive = mx.where(seen, 0.0, -float("inf"))
    for mask in (None, "causal", seen, additive, mx.ones((length, 800), mx.bool_)):
        got = composed(queries, keys, values, 32**-0.5, mask)
        want = _mlx(queries, keys, values, mask)
        assert mx.abs(got - want).max().item() < 1e-5, mask if isinstance(mask, str) or mask is None else mask.shape


@cpu_only
def test_rows_split_over_streams_compute_what_one_call_computes():
    """The route cuts a batch's rows into spans, one CPU stream each; a
    batch's mask goes with its rows."""
    from worker.runtime import cpu_streams

    queries, keys, values = _inputs(3, 1, 4000, seed=4)
    padding = mx.array([0, 9, 300])
    seen = (mx.arange(4000)[None, :] >= padding[:, None])[:, None, None, :]
    for mask in (None, seen, mx.where(seen, 0.0, -float("inf"))):
        got = cpu_attention.attention(queries, keys, values, None, scale=32**-0.5, mask=mask)
        assert mx.abs(got - composed(queries, keys, values, 32**-0.5, mask)).max().item() < 1e-6
    spans = cpu_streams.cuts(3)
    assert spans[0].start == 0 and spans[-1].stop == 3 and len(spans) == min(3, len(cpu_streams.streams()))


def test_the_route_takes_few_queries_over_many_keys_and_leaves_the_rest_to_mlx(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_attention, "composed", lambda *a: calls.append("here") or _mlx(*a[:3], a[4]))
    monkeypatch.setattr(cpu_attention, "_MLX", lambda *a, **k: calls.append("mlx") or _mlx(*a[:3], k["mask"]))
    # 4 heads x 16 queries x 128 keys: SCORES_FROM scores.
    few = _inputs(1, cpu_attention.QUERIES_AT_MOST, cpu_attention.SCORES_FROM // (4 * cpu_attention.QUERIES_AT_MOST))
    many = _inputs(1, cpu_attention.QUERIES_AT_MOST + 1, 512)
    short = _inputs(1, cpu_attention.QUERIES_AT_MOST, cpu_attention.SCORES_FROM // (4 * cpu_attention.QUERIES_AT_MOST) - 1)
    cpu_attention.attention(*few, None, scale=32**-0.5, mask="causal")
    cpu_attention.attention(*many, None, scale=32**-0.5, mask="causal")
    cpu_attention.attention(*short, None, scale=32**-0.5, mask="causal")
    cpu_attention.attention(*few, None, scale=32**-0.5, mask="causal", sinks=mx.zeros((4,)))
    assert calls == ["here", "mlx", "mlx", "mlx"]


def test_few_scores_keep_mlx_s_softmax():
    scores = mx.random.normal((1, 4, cpu_attention.SCORES_FROM // 4 - 1)) * 5
    assert mx.array_equal(softmax(scores), mx.softmax(scores, axis=-1, precise=True)).item()


def test_a_load_installs_it_on_the_cpu_only(tiny_model, monkeypatch):
    from worker.runtime import loader

    installed = []
    real = cpu_attention.install
    monkeypatch.setattr(cpu_attention, "install", lambda model, where=None: installed.append(model) or real(model, where))
    model = loader.load(tiny_model).model
    assert installed == [model]
    # Installing binds the attention where mlx-lm's is bound (other tests'
    # models may have rebound this process' modules already), on the CPU only.
    modules = [sys.modules[name] for name in sorted({type(m).__module__ for m in model.modules()})]
    modules = [m for m in modules if hasattr(m, "scaled_dot_product_attention")]
    for m in modules:
        monkeypatch.setattr(m, "scaled_dot_product_attention", cpu_attention._MLX)
    assert real(model, where="cuda") == 0 and real(model, where="metal") == 0
    assert real(model, where="cpu") == len(modules) >= 1
    assert all(m.scaled_dot_product_attention is cpu_attention.attention for m in modules)
