"""Quantized linear layers on the CPU: a call of many rows multiplies the
dequantized weights, a call of few keeps mlx's kernel, and the output is
the kernel's either way (within float32 rounding)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from worker.runtime import dequantized_rows, loader
from worker.runtime.dequantized_rows import DEQUANTIZED_FROM, DequantizedRows

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the rule is for mlx's CPU kernel")


def _quantized(bias: bool) -> nn.QuantizedLinear:
    mx.random.seed(3)
    return nn.QuantizedLinear.from_linear(nn.Linear(128, 96, bias=bias), group_size=64, bits=4)


@pytest.fixture
def dequantized(monkeypatch) -> list:
    """Counts the calls that dequantize weights."""
    calls = []
    original = mx.dequantize

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(dequantized_rows.mx, "dequantize", counted)
    return calls


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (1, DEQUANTIZED_FROM - 1), (1, DEQUANTIZED_FROM), (2, DEQUANTIZED_FROM // 2), (1, 40)])
def test_a_layer_gives_the_kernel_s_output_and_dequantizes_for_many_rows_only(bias, shape, dequantized):
    layer = _quantized(bias)
    x = mx.random.normal((*shape, 128), key=mx.random.key(1))
    expected = nn.QuantizedLinear.__call__(layer, x)
    layer.__class__ = DequantizedRows
    got = layer(x)
    assert got.shape == expected.shape
    assert mx.allclose(got, expected, atol=1e-5, rtol=1e-4).item()
    rows = shape[0] * shape[1]
    assert len(dequantized) == (1 if rows >= DEQUANTIZED_FROM else 0)


def test_a_loaded_4_bit_model_reads_a_prompt_through_dequantized_weights(tiny_q4_model, dequantized):
    loaded = loader.load(tiny_q4_model)
    layers = [m for _, m in loaded.model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert layers and all(type(m) is DequantizedRows for m in layers)
    prompt = mx.array([[5 + (i * 7) % 300 for i in range(DEQUANTIZED_FROM + 9)]])
    got = loaded.model(prompt)
    mx.eval(got)
    assert dequantized, "a prompt piece of many tokens dequantizes"
    for m in layers:
        m.__class__ = nn.QuantizedLinear
    expected = loaded.model(prompt)
    scale = mx.abs(expected).max().item()
    assert mx.allclose(got, expected, atol=1e-5 * scale, rtol=1e-4).item()
