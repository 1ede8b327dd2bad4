"""Quantized linear layers on the CPU: many rows through a float matmul.

mlx's CPU kernel for a quantized matmul (`x @ W.T` over packed weights)
works a row of `x` at a time: its cost grows with the rows as fast as
their count, where a float matmul (OpenBLAS) reads the weights once for all
of them. On a 2-core machine, float32, 4-bit groups of 64 (one layer's
matrix, median of 9):

| matrix | 1 row | 8 rows | 16 rows | dequantized, then a float matmul, 16 rows |
| --- | ---: | ---: | ---: | ---: |
| 256 x 768 | 0.26 ms | 1.59 | 3.13 | 0.55 |
| 1024 x 3072 | 3.2 ms | 25.6 | 50.3 | 10.3 |
| 2560 x 9728 | 24.9 ms | 197 | 391 | 234 |

So reading a 4-bit model's prompt cost as much as decoding as many tokens
one at a time. A call with at least DEQUANTIZED_FROM rows (a prompt
piece, or a decode batch that large) dequantizes the layer's weights to the
activations' dtype and multiplies them as floats; the float copy is
transient (one layer's matrix at a time: 100 MB for a 2560 x 9728 layer
in float32). Fewer rows keep mlx's kernel, which reads the packed weights
alone.

Only where mlx computes on the CPU: Metal's and CUDA's kernels for
quantized matmuls take many rows in one pass.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

# Rows of a call from which the weights are dequantized first: the measured
# crossover is 3-4 rows on small matrices and about 10 on Qwen3-4B's MLP.
DEQUANTIZED_FROM = 16


class DequantizedRows(nn.QuantizedLinear):
    """A QuantizedLinear whose calls of many rows multiply dequantized
    weights (installed by changing an instance's class: its parameters and
    settings stay as loaded)."""

    def __call__(self, x: mx.array) -> mx.array:
        if x.size < DEQUANTIZED_FROM * x.shape[-1]:
            return super().__call__(x)
        weight = mx.dequantize(self["weight"], self["scales"], self.get("biases"), group_size=self.group_size, bits=self.bits, mode=self.mode)
        y = x @ weight.astype(x.dtype).T
        if "bias" in self:
            y = y + self["bias"]
        return y


def install(model: nn.Module) -> int:
    """Gives the model's quantized linear layers the row rule above, on the
    CPU; returns how many it changed."""
    if mx.default_device() != mx.cpu:
        return 0
    changed = 0
    for _, module in model.named_modules():
        if type(module) is nn.QuantizedLinear:
            module.__class__ = DequantizedRows
            changed += 1
    return changed
