"""Unfused LoRA on a loaded mlx-lm model: y = base(x) + (x @ A) @ (scale * B).

The base layers are never modified (a 4-bit base stays 4-bit, nothing is
re-quantized), so an adapter is swapped in or out by assigning two arrays
per layer, and clearing gives back the base outputs bit for bit.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from worker.lora.formats import AdapterWeights, Targets


class AdaptedLinear(nn.Module):
    """Wraps a Linear or QuantizedLinear; holds at most one adapter."""

    def __init__(self, base: nn.Module):
        super().__init__()
        self.base = base
        # Underscored, so MLX does not count them as model parameters: the
        # base's weights stay the model's weights whatever is installed.
        self._a: mx.array | None = None
        self._b: mx.array | None = None

    def set(self, a: mx.array | None, b: mx.array | None) -> None:
        self._a, self._b = a, b

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        if self._a is None:
            return y
        return y + ((x @ self._a) @ self._b).astype(y.dtype)


def _dims(layer: nn.Module) -> tuple[int, int, mx.Dtype]:
    """(d_in, d_out, activation dtype) of a plain or quantized linear layer."""
    d_out, packed = layer.weight.shape
    if isinstance(layer, nn.QuantizedLinear):
        return packed * 32 // layer.bits, d_out, layer.scales.dtype
    return packed, d_out, layer.weight.dtype


class LoRASlots:
    """Every linear layer inside the decoder layers, and the adapter on them.

    Wrappers are installed on first use only, so a worker that never sees an
    adapter runs the model exactly as loaded. `install` must run on the thread
    that runs the model, between requests.
    """

    def __init__(self, model: nn.Module):
        self._layers = list(model.layers)
        self._bases: dict[str, tuple[int, str, nn.Module]] = {}
        self._dtypes: dict[str, mx.Dtype] = {}
        targets: dict[str, tuple[int, int]] = {}
        for n, layer in enumerate(self._layers):
            for rel, module in layer.named_modules():
                if isinstance(module, nn.Linear | nn.QuantizedLinear):
                    key = f"layers.{n}.{rel}"
                    d_in, d_out, dtype = _dims(module)
                    self._bases[key] = (n, rel, module)
                    self._dtypes[key] = dtype
                    targets[key] = (d_in, d_out)
        self.targets: Targets = targets
        self._wrapped: dict[str, AdaptedLinear] = {}
        self.nbytes = 0

    def install(self, weights: AdapterWeights | None) -> None:
        """Makes `weights` (None: no adapter) the one every layer uses.

        All new arrays are built and evaluated before the first assignment,
        so a failure leaves the previous adapter fully in place.
        """
        ready: dict[str, tuple[mx.array, mx.array]] = {}
        if weights is not None:
            for key, (a, b) in weights.pairs.items():
                dtype = self._dtypes[key]
                ready[key] = (mx.array(a).astype(dtype), mx.array(b).astype(dtype))
            mx.eval(list(ready.values()))
        for key, wrapper in self._wrapped.items():
            if key not in ready:
                wrapper.set(None, None)
        for key, (a, b) in ready.items():
            self._wrapper(key).set(a, b)
        self.nbytes = sum(a.nbytes + b.nbytes for a, b in ready.values())

    def _wrapper(self, key: str) -> AdaptedLinear:
        wrapper = self._wrapped.get(key)
        if wrapper is None:
            n, rel, base = self._bases[key]
            wrapper = self._wrapped[key] = AdaptedLinear(base)
            self._layers[n].update_modules(tree_unflatten([(rel, wrapper)]))
        return wrapper
