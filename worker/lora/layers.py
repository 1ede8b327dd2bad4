"""Unfused LoRA on a loaded mlx-lm model, several adapters at once:
y = base(x) + (x @ A_i) @ (scale_i * B_i), with i each row's own adapter.

The base layers are never modified (a 4-bit base stays 4-bit, nothing is
re-quantized), so an adapter comes and goes by replacing arrays beside the
layer, and rows without an adapter get the base outputs bit for bit.

Adapters live in numbered slots (a slot holds one version of one adapter).
Each wrapped layer stacks the pairs of the slots that target it, ranks
padded with zeros to the largest one there: A (n, d_in, r), B (n, r, d_out).
Before each forward the generator routes its rows (`LoRASlots.route`), and
every layer computes

- nothing beyond the base when no row has an adapter that targets it;
- (x @ A_i) @ B_i on slices of the stacks when every row has the same
  adapter: a lone adapted request costs what one adapter always cost;
- otherwise one `mx.gather_mm` per factor with each row's index into the
  stacks, and rows whose adapter does not target the layer (or that have
  none) masked out. Measured against gathering A and B per row, or looping
  over the adapters, in docs/performance.md ("Many adapters").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from worker.lora.formats import AdapterWeights, Targets


class Table:
    """Slot -> index into one layer's stacks. Layers whose tables hold the
    same slots at the same places share one, so a forward builds each row
    index array once per distinct table, not once per layer."""

    __slots__ = ("index",)

    def __init__(self, index: dict[int, int]):
        self.index = index


class Route:
    """Which slot each row of the next forward uses (None: no adapter). Set
    by the generator before every forward; read by every wrapped layer
    while that forward's graph is built, on the same thread."""

    def __init__(self):
        self.single: int | None = None  # every row uses this slot (or none)
        self.rows: tuple[int | None, ...] | None = None  # else each row's
        self._gathers: dict[Table, tuple[mx.array, mx.array | None] | None] = {}

    def set(self, slots: Sequence[int | None]) -> None:
        rows = tuple(slots)
        if rows == self.rows:
            return  # the same decode batch as the last forward: same indices
        first = rows[0] if rows else None
        if all(s == first for s in rows):
            self.single, self.rows = first, None
        else:
            self.single, self.rows = None, rows
        self._gathers.clear()

    def forget(self) -> None:
        """The stacks changed: index arrays are built afresh."""
        self._gathers.clear()

    def gather(self, table: Table) -> tuple[mx.array, mx.array | None] | None:
        """(each row's index into the stacks, a (B, 1, 1) mask of the rows
        whose adapter targets the layer or None when all do), or None when
        no row's does."""
        if table not in self._gathers:
            hits = [table.index.get(s) if s is not None else None for s in self.rows]
            if all(h is None for h in hits):
                self._gathers[table] = None
            else:
                index = mx.array([h or 0 for h in hits], dtype=mx.uint32)
                mask = None if all(h is not None for h in hits) else mx.array([h is not None for h in hits])[:, None, None]
                self._gathers[table] = (index, mask)
        return self._gathers[table]


class Stacks:
    """One layer's adapters: the pairs of the slots that target it, stacked."""

    __slots__ = ("a", "b", "pairs", "ranks", "table")

    def __init__(self, entries: Mapping[int, tuple[mx.array, mx.array]]):
        rank = max(a.shape[1] for a, _ in entries.values())
        slots = sorted(entries)
        self.a = mx.stack([_pad(entries[s][0], 1, rank) for s in slots])  # (n, d_in, r)
        self.b = mx.stack([_pad(entries[s][1], 0, rank) for s in slots])  # (n, r, d_out)
        self.ranks = {s: entries[s][0].shape[1] for s in slots}
        # Full-rank slices: contiguous views of the stacks (a[i] would be a
        # gather, a copy); the padding adds exact zeros.
        self.pairs = {s: (self.a[i : i + 1].squeeze(0), self.b[i : i + 1].squeeze(0)) for i, s in enumerate(slots)}
        self.table = Table({s: i for i, s in enumerate(slots)})

    def arrays(self) -> list[mx.array]:
        return [self.a, self.b, *(x for pair in self.pairs.values() for x in pair)]

    def entries(self) -> dict[int, tuple[mx.array, mx.array]]:
        """Each slot's pair at its own rank."""
        return {s: (a[:, : self.ranks[s]], b[: self.ranks[s]]) for s, (a, b) in self.pairs.items()}


class AdaptedLinear(nn.Module):
    """Wraps a Linear or QuantizedLinear with the stacked adapters that target it."""

    def __init__(self, base: nn.Module, route: Route):
        super().__init__()
        self.base = base
        # Underscored, so MLX does not count them as model parameters: the
        # base's weights stay the model's weights whatever is installed.
        self._route = route
        self._stacks: Stacks | None = None

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        stacks = self._stacks
        if stacks is None:
            return y
        route = self._route
        if route.rows is None:
            pair = stacks.pairs.get(route.single)
            if pair is None:
                return y
            return y + ((x @ pair[0]) @ pair[1]).astype(y.dtype)
        gather = route.gather(stacks.table)
        if gather is None:
            return y
        index, mask = gather
        # gather_mm multiplies row i's (L, d_in) by the stacks' matrix index[i].
        shape = x.shape
        xs = x.reshape(shape[0], -1, shape[-1])
        delta = mx.gather_mm(mx.gather_mm(xs, stacks.a, rhs_indices=index), stacks.b, rhs_indices=index)
        if mask is not None:
            delta = mx.where(mask, delta, mx.zeros((), delta.dtype))
        return y + delta.reshape(*shape[:-1], delta.shape[-1]).astype(y.dtype)


def _pad(x: mx.array, axis: int, rank: int) -> mx.array:
    if x.shape[axis] == rank:
        return x
    widths = [(0, 0), (0, 0)]
    widths[axis] = (0, rank - x.shape[axis])
    return mx.pad(x, widths)


def linear_dims(layer: nn.Module) -> tuple[int, int, mx.Dtype]:
    """(d_in, d_out, activation dtype) of a plain or quantized linear layer."""
    d_out, packed = layer.weight.shape
    if isinstance(layer, nn.QuantizedLinear):
        return packed * 32 // layer.bits, d_out, layer.scales.dtype
    return packed, d_out, layer.weight.dtype


class LoRASlots:
    """Every linear layer inside the decoder layers, and the adapters on them.

    Wrappers are installed on first use only, so a worker that never sees an
    adapter runs the model exactly as loaded. Everything here runs on the
    thread that runs the model, between forwards.
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
                    d_in, d_out, dtype = linear_dims(module)
                    self._bases[key] = (n, rel, module)
                    self._dtypes[key] = dtype
                    targets[key] = (d_in, d_out)
        self.targets: Targets = targets
        self._wrapped: dict[str, AdaptedLinear] = {}
        self._route = Route()
        self.nbytes = 0

    def own_bytes(self, weights: AdapterWeights) -> int:
        """What the adapter takes in memory, without any padding."""
        return sum((a.shape[0] + b.shape[1]) * a.shape[1] * self._dtypes[key].size for key, (a, b) in weights.pairs.items())

    def update(self, add: Mapping[int, AdapterWeights] = {}, drop: Iterable[int] = ()) -> None:
        """Puts adapters into new slots and empties others, in one step.

        Every new array is built and evaluated before the first assignment,
        so a failure (out of memory, say) leaves the layers as they were.
        Forwards already queued keep the arrays they were built with."""
        drop = set(drop)
        fresh: dict[str, dict[int, tuple[mx.array, mx.array]]] = {}
        for slot, weights in add.items():
            for key, (a, b) in weights.pairs.items():
                dtype = self._dtypes[key]
                fresh.setdefault(key, {})[slot] = (mx.array(a).astype(dtype), mx.array(b).astype(dtype))
        touched = set(fresh) | {key for key, w in self._wrapped.items() if w._stacks is not None and drop & set(w._stacks.pairs)}
        plans: dict[str, Stacks | None] = {}
        for key in touched:
            stacks = self._wrapped[key]._stacks if key in self._wrapped else None
            entries = {s: p for s, p in stacks.entries().items() if s not in drop} if stacks is not None else {}
            entries.update(fresh.get(key, {}))
            plans[key] = Stacks(entries) if entries else None
        mx.eval([x for stacks in plans.values() if stacks is not None for x in stacks.arrays()])
        for key, stacks in plans.items():
            self._wrapper(key)._stacks = stacks
        self._share_tables()
        self._route.forget()
        self.nbytes = sum(w._stacks.a.nbytes + w._stacks.b.nbytes for w in self._wrapped.values() if w._stacks is not None)

    def route(self, slots: Sequence[int | None]) -> None:
        """The slot of each row of the next forward (None: the base model)."""
        self._route.set(slots)

    def _share_tables(self) -> None:
        shared: dict[tuple, Table] = {}
        for wrapper in self._wrapped.values():
            if wrapper._stacks is not None:
                table = wrapper._stacks.table
                wrapper._stacks.table = shared.setdefault(tuple(table.index.items()), table)

    def _wrapper(self, key: str) -> AdaptedLinear:
        wrapper = self._wrapped.get(key)
        if wrapper is None:
            n, rel, base = self._bases[key]
            wrapper = self._wrapped[key] = AdaptedLinear(base, self._route)
            self._layers[n].update_modules(tree_unflatten([(rel, wrapper)]))
        return wrapper
