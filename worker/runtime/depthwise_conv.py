"""Depthwise 1-D convolutions on the CPU, as shifted multiply-adds.

The gated-delta layers of Qwen3.5 and Qwen3-Next run a depthwise causal
convolution (4 taps, one filter per channel: as many groups as channels)
over their q, k and v projections. mlx's CPU convolution makes one small
matrix product per group: 6,144 BLAS calls per layer per call on the
Qwen3.5-0.8B shape. The same sums, as the input's K shifted slices times
the filter's K taps, are a handful of elementwise operations (one fused
kernel inside a compiled step). Measured on a 2-core AMD EPYC in float32,
6,144 channels, 515 positions (a 512-token prompt piece and the 3 carried
over): 146 ms per call through mlx's convolution, 41 ms as slices op by
op, 5.6 ms compiled. `bench.cpu_conv`, 5 alternated rounds in one process:
the 0.8b demo shape (18 such layers) read a 512-token prompt in 14.6 s
against 16.2 s (1.11x, 1.05-1.18); the small demo model 1.06x (0.92-1.08).

Only where mlx computes on the CPU, where it was measured. The layer keeps
its parameters and settings (a group run's sharding divides the channels
and the groups alike); any other convolution takes mlx's own path.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class DepthwiseConv1d(nn.Conv1d):
    """A Conv1d whose depthwise calls (groups = channels, stride and
    dilation 1, no padding) are sums of shifted slices (installed by
    changing an instance's class)."""

    def __call__(self, x: mx.array) -> mx.array:
        w = self["weight"]
        channels, taps, per_group = w.shape
        plain = (self.stride, self.dilation, self.padding) == (1, 1, 0)
        if per_group != 1 or self.groups != channels or x.shape[-1] != channels or x.shape[1] < taps or not plain:
            return super().__call__(x)
        length = x.shape[1] - taps + 1
        y = x[:, :length] * w[:, 0, 0]
        for j in range(1, taps):
            y = y + x[:, j : j + length] * w[:, j, 0]
        if "bias" in self:
            y = y + self["bias"]
        return y


def install(model: nn.Module) -> int:
    """Gives the model's depthwise convolutions the path above, on the CPU;
    returns how many it changed."""
    if mx.default_device() != mx.cpu:
        return 0
    changed = 0
    for _, module in model.named_modules():
        if type(module) is nn.Conv1d and module.groups > 1 and module.groups == module["weight"].shape[0] and module["weight"].shape[-1] == 1:
            module.__class__ = DepthwiseConv1d
            changed += 1
    return changed
