"""The model state (cache) of the rows of a batch, one entry per layer.

A lone row keeps the caches the model made for it (`KVCache`,
`RotatingKVCache`, `ArraysCache`), so one request computes exactly what it
would without batching, at the same speed. Two or more rows use mlx-lm's
batch caches (`BatchKVCache`, `BatchRotatingKVCache`, a batched
`ArraysCache`): each cache type's `merge` builds them from lone rows,
`extend` appends rows, `filter` keeps some, `extract` gives one row back as a
lone cache. Attention caches of rows of different lengths are left-padded
(`left_padding` masks the gap); a prompt chunk whose rows differ in length is
right-padded, and `prepare`/`finalize` turn that padding into left padding
afterwards, while linear-attention layers stop their state at each row's
length.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache


def batchable(layers: list) -> bool:
    """Whether rows with these caches can share a batch: mlx-lm gives the
    cache types that can a `merge` (others, e.g. its chunked and quantized
    KV caches, run one request at a time)."""
    return all(hasattr(c, "merge") for c in layers)


def _merge(rows: list[list]) -> list:
    layers = [type(per_row[0]).merge(list(per_row)) for per_row in zip(*rows)]
    for c in layers:
        # Merging marks empty linear-attention rows as padded, which would
        # mask every later step; nothing is padded yet.
        c.finalize()
    return layers


def _zero_empty_states(a, a_rows: int, b, b_rows: int) -> None:
    """Gives a linear-attention cache that has not run yet (a row joining a
    prefill group) zero states shaped like the other side's: the state it
    starts from. mlx-lm's extend sizes a missing state by the cache's batch
    size, which a merged cache of empty rows reports as 1."""
    if not hasattr(a, "cache"):  # attention caches size their gaps by their offsets
        return
    for e, (x, y) in enumerate(zip(a.cache, b.cache)):
        if x is None and y is not None:
            a.cache[e] = mx.zeros((a_rows, *y.shape[1:]), dtype=y.dtype)
        elif y is None and x is not None:
            b.cache[e] = mx.zeros((b_rows, *x.shape[1:]), dtype=x.dtype)


class BatchCache:
    __slots__ = ("layers", "rows", "merged")

    def __init__(self, layers: list, rows: int, merged: bool):
        self.layers = layers
        self.rows = rows
        self.merged = merged

    @classmethod
    def lone(cls, layers: list) -> BatchCache:
        """One row's own caches, as the model made them."""
        return cls(layers, 1, False)

    @classmethod
    def of_rows(cls, rows: list[list]) -> BatchCache:
        """Several rows' lone caches as one batch (copied into batch caches
        when there are two or more)."""
        if len(rows) == 1:
            return cls.lone(rows[0])
        return cls(_merge(rows), len(rows), True)

    def _merged_layers(self) -> list:
        return self.layers if self.merged else _merge([self.layers])

    def extend(self, other: BatchCache) -> BatchCache:
        """Appends other's rows after this batch's; returns the joined batch
        (self and other must not be used afterwards)."""
        layers = self._merged_layers()
        for mine, theirs in zip(layers, other._merged_layers()):
            _zero_empty_states(mine, self.rows, theirs, other.rows)
            mine.extend(theirs)
        return BatchCache(layers, self.rows + other.rows, True)

    def filter(self, keep: list[int]) -> None:
        """Keeps only the rows at `keep`, in that order; the others' memory
        is released as soon as nothing else refers to it."""
        if len(keep) == self.rows and keep == list(range(self.rows)):
            return
        if not keep:
            self.layers = []
        elif self.merged:
            for c in self.layers:
                c.filter(keep)
        self.rows = len(keep)

    def row(self, i: int) -> list:
        """Row i as lone caches (a copy when the batch is merged)."""
        return [c.extract(i) for c in self.layers] if self.merged else self.layers

    def split(self, take: list[int]) -> BatchCache:
        """Removes the rows at `take` from this batch and returns them."""
        if len(take) == self.rows:
            part = BatchCache(self.layers, self.rows, self.merged)
            self.layers, self.rows = [], 0
            return part
        part = BatchCache.of_rows([self.row(i) for i in take])
        self.filter([i for i in range(self.rows) if i not in take])
        return part

    def pad(self, lengths: list[int], width: int) -> None:
        """The next input is right-padded to `width`: row i holds lengths[i]
        real tokens."""
        padding = [width - n for n in lengths]
        for c in self.layers:
            c.prepare(lengths=lengths, right_padding=padding)

    def unpad(self) -> None:
        for c in self.layers:
            c.finalize()

    @property
    def state(self) -> list:
        return [c.state for c in self.layers]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers)


def row_bytes(model) -> tuple[int, int]:
    """(fixed bytes, bytes per token) of one row's caches, measured on a
    one-token forward: attention caches grow with the tokens they hold,
    linear-attention state does not."""
    cache = make_prompt_cache(model)
    model(mx.zeros((1, 1), dtype=mx.uint32), cache=cache)
    mx.eval([c.state for c in cache])
    fixed = per_token = 0
    for c in cache:
        keys = getattr(c, "keys", None)
        if isinstance(keys, tuple):  # quantized (worker.engine.kv_quant): packed values, scales, biases
            keys = keys[0]
        if isinstance(keys, mx.array):
            token = -(-c.nbytes // keys.shape[2])
            start = getattr(c, "start", 0) if hasattr(c, "quantize") else 0
            if start:
                # Plain until `start` tokens, quantized from then on: a row of n
                # tokens takes at most n quantized tokens plus start tokens'
                # difference.
                c.quantize()
                quantized = -(-c.nbytes // c.keys[0].shape[2])
                fixed += start * (token - quantized)
                token = quantized
            per_token += token
        else:
            fixed += c.nbytes
    return fixed, per_token
