"""Depthwise convolutions on the CPU: sums of shifted slices give mlx's
convolution output; other convolutions keep mlx's path; a loaded hybrid
model reads a prompt to the same logits either way."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from worker.runtime import loader
from worker.runtime.depthwise_conv import DepthwiseConv1d, install

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the path is for mlx's CPU convolution")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("channels, taps, length", [(8, 4, 4), (64, 4, 5), (64, 4, 37), (24, 3, 9), (16, 1, 6)])
def test_a_depthwise_layer_gives_mlx_s_output(bias, channels, taps, length):
    mx.random.seed(7)
    conv = nn.Conv1d(channels, channels, kernel_size=taps, groups=channels, bias=bias)
    if bias:
        conv.bias = mx.random.normal((channels,))
    x = mx.random.normal((2, length, channels), key=mx.random.key(2))
    expected = conv(x)
    assert install(conv) == 1 and type(conv) is DepthwiseConv1d
    got = conv(x)
    assert got.shape == expected.shape
    assert mx.allclose(got, expected, atol=1e-5, rtol=1e-5).item()


def test_other_convolutions_keep_mlx_s_path():
    mx.random.seed(7)
    x = mx.random.normal((1, 9, 16), key=mx.random.key(3))
    for conv in (nn.Conv1d(16, 16, 3, groups=1), nn.Conv1d(16, 16, 3, groups=4), nn.Conv1d(16, 16, 3, groups=16, padding=1)):
        expected = conv(x)
        installed = install(conv)
        if conv.groups != 16:
            assert installed == 0 and type(conv) is nn.Conv1d
        else:
            assert type(conv) is DepthwiseConv1d  # padded: falls back at the call
        assert mx.array_equal(conv(x), expected).item()


def test_a_loaded_hybrid_model_reads_a_prompt_to_the_same_logits(tiny_model):
    loaded = loader.load(tiny_model)
    convs = [m for _, m in loaded.model.named_modules() if isinstance(m, nn.Conv1d)]
    assert convs and all(type(m) is DepthwiseConv1d for m in convs)
    prompt = mx.array([[5 + (i * 7) % 300 for i in range(40)]])
    got = loaded.model(prompt)
    for m in convs:
        m.__class__ = nn.Conv1d
    expected = loaded.model(prompt)
    assert mx.allclose(got, expected, atol=1e-4, rtol=1e-4).item()
