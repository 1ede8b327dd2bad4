"""Quantized attention caches that batch: `kv_bits = 8 | 4` per model.

mlx-lm quantizes a KV cache (`QuantizedKVCache`: each token's keys and
values as packed integers with a scale and bias per `group_size` values),
but has no batched form of it, so its server and LM Studio run one request
at a time when it is on. Here a lone row keeps a `QuantKV` (mlx-lm's cache,
made mergeable) and rows of a batch share a `BatchQuantKV`: mlx-lm's
`BatchKVCache` bookkeeping (left padding, right-padded prefill chunks
rolled into left padding, rows joining, leaving and taken out) applied to
the three arrays of each quantized tensor. Quantization groups run along
the head dimension, so every token's entry stands alone and the cache can
be cut, padded and rolled along the token axis like a plain one. The
model's attention sees `bits` on the cache and takes the quantized path
(worker.engine.quant_attention: prompt pieces dequantized, decode steps on
the packed values).

`quantized_kv_start = N` (as mlx-lm's): a row's cache stays in the model's
dtype until it holds N tokens, and is quantized before the next forward
(`LazyKV` alone; a batch's `BatchLazyKV` converts each row on its own).
Rows of one batch may be on either side: a `BatchLazyKV` holds its plain
rows in a `BatchKVCache` and its quantized ones in a `BatchQuantKV`, both
right-aligned at the same column, and, while it holds both kinds, gives the
model's attention the quantized rows dequantized beside the plain ones (so
a plain row computes what it does in a plain batch, and a quantized one
what mlx-lm's quantized attention computes, up to float rounding). The
prefill cuts a prompt's chunks at N, so a row converts at exactly N tokens
whatever batch it reads in.

"""

from __future__ import annotations

import logging

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, _BaseCache, dynamic_roll

from worker.engine import quant_attention, quant_decode_kernel
from worker.runtime.memory import processor

log = logging.getLogger("worker")


def _map(f, *trees):
    return tuple(f(*xs) for xs in zip(*trees))


def _zeros(shape: tuple, dim: int, dtype, group_size: int, bits: int) -> tuple:
    return (
        mx.zeros((*shape, dim * bits // 32), dtype=mx.uint32),
        mx.zeros((*shape, dim // group_size), dtype=dtype),
        mx.zeros((*shape, dim // group_size), dtype=dtype),
    )


def _dims(q: tuple, bits: int) -> int:
    """The head dimension a packed tensor holds."""
    return q[0].shape[-1] * 32 // bits


class QuantKV(QuantizedKVCache):
    """One row's quantized cache; merges into a BatchQuantKV."""

    def size(self) -> int:
        return self.offset

    @classmethod
    def of(cls, plain: KVCache, group_size: int, bits: int) -> QuantKV:
        """A plain cache's tokens, quantized."""
        q = cls(group_size, bits)
        if plain.keys is not None and plain.offset:
            # Tuples, as QuantizedKVCache keeps them (mx.quantize gives lists).
            q.keys = tuple(mx.quantize(plain.keys[..., : plain.offset, :], group_size=group_size, bits=bits))
            q.values = tuple(mx.quantize(plain.values[..., : plain.offset, :], group_size=group_size, bits=bits))
            q.offset = plain.offset
        return q

    @classmethod
    def merge(cls, caches: list) -> BatchQuantKV:
        return BatchQuantKV.merge(caches)


class BatchQuantKV(BatchKVCache):
    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8):
        super().__init__(left_padding)
        self.group_size = group_size
        self.bits = bits

    def update_and_fetch(self, keys, values):
        prev = self._idx
        B, H, S, Dk = keys.shape
        Dv = values.shape[3]
        if self.keys is None or prev + S > self.keys[0].shape[2]:
            n = (self.step + S - 1) // self.step * self.step
            new_k = _zeros((B, H, n), Dk, keys.dtype, self.group_size, self.bits)
            new_v = _zeros((B, H, n), Dv, values.dtype, self.group_size, self.bits)
            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys = _map(lambda x: x[..., :prev, :], self.keys)
                    self.values = _map(lambda x: x[..., :prev, :], self.values)
                self.keys = _map(lambda a, b: mx.concatenate([a, b], axis=2), self.keys, new_k)
                self.values = _map(lambda a, b: mx.concatenate([a, b], axis=2), self.values, new_v)
            else:
                self.keys, self.values = new_k, new_v
        self.offset = self.offset + S
        self._idx += S
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for i in range(3):
            self.keys[i][..., prev : self._idx, :] = qk[i]
            self.values[i][..., prev : self._idx, :] = qv[i]
        return self.keys_and_values()

    def keys_and_values(self):
        end = self._idx
        return _map(lambda x: x[..., :end, :], self.keys), _map(lambda x: x[..., :end, :], self.values)

    def finalize(self):
        if self._right_padding is not None:
            shift = self._right_padding[:, None]
            self.keys = _map(lambda x: dynamic_roll(x, shift, axis=2), self.keys)
            self.values = _map(lambda x: dynamic_roll(x, shift, axis=2), self.values)
            self.offset = self.offset - self._right_padding
            self.left_padding += self._right_padding
            self._right_padding = None

    def filter(self, batch_indices):
        if self.keys is not None:
            self.keys = _map(lambda x: x[batch_indices], self.keys)
            self.values = _map(lambda x: x[batch_indices], self.values)
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(self.left_padding.tolist())
        if shift > 0:
            if self.keys is not None:
                self.keys = _map(lambda x: x[..., shift:, :], self.keys)
                self.values = _map(lambda x: x[..., shift:, :], self.values)
            self._idx -= shift
            self.left_padding -= shift

    def extend(self, other):
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        idx = max(self._idx, other._idx)
        like = self if self.keys is not None else other
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        H = like.keys[0].shape[1]
        dtype = like.keys[1].dtype

        def pad(c):
            k, v = c.keys, c.values
            if k is None:
                rows = c.offset.shape[0]
                k = _zeros((rows, H, 0), _dims(like.keys, self.bits), dtype, self.group_size, self.bits)
                v = _zeros((rows, H, 0), _dims(like.values, self.bits), dtype, self.group_size, self.bits)
            left = idx - c._idx
            right = size - k[0].shape[2] - left
            if right < 0:
                k = _map(lambda x: x[..., :right, :], k)
                v = _map(lambda x: x[..., :right, :], v)
                right = 0
            if left or right:
                widths = [(0, 0), (0, 0), (left, right), (0, 0)]
                k = _map(lambda x: mx.pad(x, widths), k)
                v = _map(lambda x: mx.pad(x, widths), v)
            return k, v, c.offset, c.left_padding + left

        (k1, v1, o1, p1), (k2, v2, o2, p2) = pad(self), pad(other)
        self.keys = _map(lambda a, b: mx.concatenate([a, b]), k1, k2)
        self.values = _map(lambda a, b: mx.concatenate([a, b]), v1, v2)
        self.offset = mx.concatenate([o1, o2])
        self.left_padding = mx.concatenate([p1, p2])
        self._idx = idx

    def extract(self, idx):
        cache = QuantKV(self.group_size, self.bits)
        padding = self.left_padding.tolist()[idx]
        cache.keys = _map(lambda x: mx.contiguous(x[idx : idx + 1, :, padding : self._idx]), self.keys)
        cache.values = _map(lambda x: mx.contiguous(x[idx : idx + 1, :, padding : self._idx]), self.values)
        cache.offset = self._idx - padding
        return cache

    @classmethod
    def merge(cls, caches: list) -> BatchQuantKV:
        first = caches[0]
        lengths = [c.offset for c in caches]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        cache = cls(padding, first.group_size, first.bits)
        if longest == 0:
            return cache
        like = next(c for c in caches if c.keys is not None and c.offset)
        H = like.keys[0].shape[1]
        shape = (len(caches), H, longest)
        dtype = like.keys[1].dtype
        keys = _zeros(shape, _dims(like.keys, first.bits), dtype, first.group_size, first.bits)
        values = _zeros(shape, _dims(like.values, first.bits), dtype, first.group_size, first.bits)
        for i, (p, c) in enumerate(zip(padding, caches)):
            if c.keys is None or not c.offset:
                continue
            for j in range(3):
                keys[j][i : i + 1, :, p : p + c.offset] = c.keys[j][..., : c.offset, :]
                values[j][i : i + 1, :, p : p + c.offset] = c.values[j][..., : c.offset, :]
        cache.keys, cache.values = keys, values
        cache.offset += longest
        cache._idx = longest
        return cache

    @property
    def nbytes(self):
        if self.keys is None:
            return 0
        return sum(x.nbytes for x in (*self.keys, *self.values))


class LazyKV(QuantKV):
    """One row's cache under quantized_kv_start: a plain cache (keys and
    values arrays) until it holds `start` tokens, then a QuantKV (keys and
    values tuples). `bits` exists only once quantized: mlx-lm's attention
    takes its quantized path by `hasattr(cache, "bits")`."""

    def __init__(self, group_size: int, bits: int, start: int):
        super().__init__(group_size, bits)
        self.start = start

    @property
    def bits(self) -> int:
        if not self.quantized:
            raise AttributeError("bits")
        return self._bits

    @bits.setter
    def bits(self, value: int) -> None:
        self._bits = value

    @property
    def quantized(self) -> bool:
        return isinstance(self.keys, tuple)

    def quantize(self) -> None:
        q = QuantKV.of(self, self.group_size, self._bits)
        self.keys, self.values = q.keys, q.values

    def due(self) -> bool:
        return not self.quantized and self.offset >= self.start

    def settle(self) -> None:
        """Quantizes the cache if it holds `start` tokens or more."""
        if self.due():
            self.quantize()

    def update_and_fetch(self, keys, values):
        self.settle()
        if self.quantized:
            return super().update_and_fetch(keys, values)
        return KVCache.update_and_fetch(self, keys, values)

    def keys_and_values(self):
        return super().keys_and_values() if self.quantized else KVCache.keys_and_values(self)

    @property
    def state(self):
        return (self.keys, self.values, self.offset, self.group_size, self._bits) if self.quantized else (self.keys, self.values, self.offset)

    @classmethod
    def like(cls, c, group_size: int, bits: int, start: int) -> LazyKV:
        """A lone cache (plain or quantized) as a LazyKV, sharing its arrays."""
        lazy = cls(group_size, bits, start)
        lazy.keys, lazy.values, lazy.offset = c.keys, c.values, c.offset
        return lazy

    @classmethod
    def merge(cls, caches: list) -> BatchLazyKV:
        return BatchLazyKV.merge(caches)


def _pad_left(sub, width: int, like) -> None:
    """Left-pads a batch cache (plain or quantized) so that its rows end at
    column `width`, as mlx-lm's extend right-aligns two batches; `like` is
    the other batch, whose shapes an empty one borrows."""
    d = width - sub._idx
    if d <= 0:
        return
    quantized = isinstance(sub, BatchQuantKV)
    if sub.keys is None:
        rows = sub.offset.shape[0]
        if quantized:
            H, dtype = like.keys.shape[1], like.keys.dtype
            sub.keys = _zeros((rows, H, d), like.keys.shape[3], dtype, sub.group_size, sub.bits)
            sub.values = _zeros((rows, H, d), like.values.shape[3], dtype, sub.group_size, sub.bits)
        else:
            H, dtype = like.keys[0].shape[1], like.keys[1].dtype
            sub.keys = mx.zeros((rows, H, d, _dims(like.keys, like.bits)), dtype=dtype)
            sub.values = mx.zeros((rows, H, d, _dims(like.values, like.bits)), dtype=dtype)
    else:
        widths = [(0, 0), (0, 0), (d, 0), (0, 0)]
        if quantized:
            sub.keys = _map(lambda x: mx.pad(x, widths), sub.keys)
            sub.values = _map(lambda x: mx.pad(x, widths), sub.values)
        else:
            sub.keys, sub.values = mx.pad(sub.keys, widths), mx.pad(sub.values, widths)
    sub.left_padding = sub.left_padding + d
    sub._idx = width


def _reorder(sub, order: list[int]) -> None:
    """Puts a batch cache's rows in `order`, moving no column (mlx-lm's
    filter also drops common left padding, which would move them)."""
    index = mx.array(order)
    if sub.keys is not None:
        take = (lambda x: _map(lambda a: a[index], x)) if isinstance(sub.keys, tuple) else (lambda x: x[index])
        sub.keys, sub.values = take(sub.keys), take(sub.values)
    sub.offset = sub.offset[index]
    sub.left_padding = sub.left_padding[index]


class BatchLazyKV(_BaseCache):
    """The rows of a batch under quantized_kv_start: `plain` (a BatchKVCache)
    holds the rows still in the model's dtype and `quant` (a BatchQuantKV)
    the others, `plain_rows` and `quant_rows` saying which batch row each
    of their rows is. Both end at the same column (`_idx`); a batch of one
    kind keeps its rows in batch order, so it is that kind's batch cache
    with its own attention path (and the compiled decode step's). `lens`
    (host ints) is what each row holds, so that conversions are found
    without reading the device."""

    def __init__(self, group_size: int, bits: int, start: int):
        self.group_size, self._bits, self.start = group_size, bits, start
        self.plain: BatchKVCache | None = None
        self.quant: BatchQuantKV | None = None
        self.plain_rows: list[int] = []
        self.quant_rows: list[int] = []
        self.lens: list[int] = []
        self._right: list[int] | None = None  # right padding of the chunk being read
        self._index: tuple | None = None  # (plain rows, quantized rows, inverse) as arrays

    # -- what the model sees ------------------------------------------------

    @property
    def bits(self) -> int:
        if self.plain is not None or self.quant is None:
            raise AttributeError("bits")
        return self._bits

    def _subs(self) -> list:
        return [c for c in (self.plain, self.quant) if c is not None]

    @property
    def pure(self):
        """The batch cache of the one kind this batch holds, else None."""
        subs = self._subs()
        return subs[0] if len(subs) == 1 else None

    @property
    def _idx(self) -> int:
        return self._subs()[0]._idx

    def _indices(self) -> tuple:
        if self._index is None:
            order = self.plain_rows + self.quant_rows
            inverse = [0] * len(order)
            for at, r in enumerate(order):
                inverse[r] = at
            self._index = (mx.array(self.plain_rows), mx.array(self.quant_rows), mx.array(inverse))
        return self._index

    def _joined(self, a: mx.array, b: mx.array) -> mx.array:
        return mx.concatenate([a, b])[self._indices()[2]]

    @property
    def offset(self) -> mx.array:
        pure = self.pure
        return pure.offset if pure is not None else self._joined(self.plain.offset, self.quant.offset)

    @property
    def left_padding(self) -> mx.array:
        pure = self.pure
        return pure.left_padding if pure is not None else self._joined(self.plain.left_padding, self.quant.left_padding)

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def update_and_fetch(self, keys, values):
        self.settle()
        n = keys.shape[2]
        self.lens = [x + n for x in self.lens]
        pure = self.pure
        if pure is not None:
            return pure.update_and_fetch(keys, values)
        p, q, _ = self._indices()
        pk, pv = self.plain.update_and_fetch(keys[p], values[p])
        qk, qv = self.quant.update_and_fetch(keys[q], values[q])
        g, b = self.group_size, self._bits
        dk = mx.dequantize(*qk, group_size=g, bits=b).astype(pk.dtype)
        dv = mx.dequantize(*qv, group_size=g, bits=b).astype(pv.dtype)
        return self._joined(pk, dk), self._joined(pv, dv)

    # -- conversion ---------------------------------------------------------

    def settle(self) -> None:
        """Quantizes the plain rows that hold `start` tokens or more."""
        due = [s for s, r in enumerate(self.plain_rows) if self.lens[r] >= self.start]
        if not due:
            return
        width = self._idx
        moved = BatchQuantKV.merge([QuantKV.of(self.plain.extract(s), self.group_size, self._bits) for s in due])
        rows = [self.plain_rows[s] for s in due]
        keep = [s for s in range(len(self.plain_rows)) if s not in due]
        if keep:
            self.plain.filter(keep)
        else:
            self.plain = None
        self.plain_rows = [self.plain_rows[s] for s in keep]
        if self.quant is None:
            self.quant = moved
        else:
            self.quant.extend(moved)
        self.quant_rows = self.quant_rows + rows
        self._normal(width)

    def _normal(self, width: int = 0) -> None:
        """Restores the invariants after rows moved, joined or left: both
        kinds end at one column (at least `width`), a batch of one kind is
        in batch order, and pending right padding sits on the right rows."""
        self._index = None
        subs = self._subs()
        width = max([width] + [c._idx for c in subs])
        for c in subs:
            _pad_left(c, width, next(o for o in subs if o is not c) if len(subs) == 2 else None)
        if self.plain is not None and self.quant is None and self.plain_rows != sorted(self.plain_rows):
            _reorder(self.plain, sorted(range(len(self.plain_rows)), key=self.plain_rows.__getitem__))
            self.plain_rows = sorted(self.plain_rows)
        if self.quant is not None and self.plain is None and self.quant_rows != sorted(self.quant_rows):
            _reorder(self.quant, sorted(range(len(self.quant_rows)), key=self.quant_rows.__getitem__))
            self.quant_rows = sorted(self.quant_rows)
        self._push_right()

    def _push_right(self) -> None:
        for c, rows in ((self.plain, self.plain_rows), (self.quant, self.quant_rows)):
            if c is not None:
                pad = [self._right[r] for r in rows] if self._right else []
                c._right_padding = mx.array(pad) if any(pad) else None

    # -- batch bookkeeping (mlx-lm's batch cache interface) ----------------------

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if left_padding is not None:
            raise ValueError("BatchLazyKV takes no left padding")
        self._right = list(right_padding) if right_padding is not None and max(right_padding) > 0 else None
        self._push_right()

    def finalize(self):
        for c in self._subs():
            c.finalize()
        if self._right is not None:
            self.lens = [x - p for x, p in zip(self.lens, self._right)]
            self._right = None

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        for c in self._subs():
            c.trim(n)
        self.lens = [x - n for x in self.lens]
        return n

    def is_trimmable(self) -> bool:
        return True

    def filter(self, batch_indices):
        where = {r: k for k, r in enumerate(batch_indices)}
        for kind in ("plain", "quant"):
            c, rows = getattr(self, kind), getattr(self, kind + "_rows")
            keep = [s for s, r in enumerate(rows) if r in where]
            if c is not None:
                if keep:
                    c.filter(keep)
                else:
                    c = None
            setattr(self, kind, c)
            setattr(self, kind + "_rows", [where[rows[s]] for s in keep])
        self.lens = [self.lens[i] for i in batch_indices]
        self._normal()

    def extend(self, other: BatchLazyKV):
        n = len(self.lens)
        for kind in ("plain", "quant"):
            mine, theirs = getattr(self, kind), getattr(other, kind)
            if theirs is not None:
                if mine is None:
                    setattr(self, kind, theirs)
                else:
                    mine.extend(theirs)
            setattr(self, kind + "_rows", getattr(self, kind + "_rows") + [n + r for r in getattr(other, kind + "_rows")])
        self.lens = self.lens + other.lens
        self._normal()

    def extract(self, idx: int) -> LazyKV:
        if idx in self.plain_rows:
            c = self.plain.extract(self.plain_rows.index(idx))
        else:
            c = self.quant.extract(self.quant_rows.index(idx))
        return LazyKV.like(c, self.group_size, self._bits, self.start)

    @classmethod
    def merge(cls, caches: list) -> BatchLazyKV:
        first = caches[0]
        cache = cls(first.group_size, first._bits, first.start)
        plain = [i for i, c in enumerate(caches) if not c.quantized]
        quant = [i for i, c in enumerate(caches) if c.quantized]
        if plain:
            cache.plain = BatchKVCache.merge([caches[i] for i in plain])
        if quant:
            cache.quant = BatchQuantKV.merge([caches[i] for i in quant])
        cache.plain_rows, cache.quant_rows = plain, quant
        cache.lens = [c.offset for c in caches]
        cache._normal()
        return cache

    def advanced(self, n: int) -> None:
        """The compiled decode step wrote n tokens into this batch's one kind."""
        self.lens = [x + n for x in self.lens]

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return all(c.keys is None for c in self._subs())

    @property
    def state(self):
        return [c.state for c in self._subs()]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._subs())


def install(model, bits: int, group_size: int, start: int = 0) -> None:
    """Makes the model's caches quantized: every plain attention cache that
    `make_prompt_cache(model)` hands out becomes a QuantKV, or with `start`
    a LazyKV quantized from `start` tokens on (ValueError when the model's
    head dimension is not a multiple of group_size, or when a GPU cannot
    run a step over a quantized cache of this model: `_decode_fails`)."""
    if bits not in (4, 8):
        raise ValueError(f"kv_bits must be 8 or 4, not {bits}")
    from mlx_lm.models.cache import make_prompt_cache

    plain = make_prompt_cache(model)
    if not any(type(c) is KVCache for c in plain):
        raise ValueError("kv_bits: this model has no plain attention caches to quantize")
    dims = {c.keys.shape[-1] for c in _probe(model, plain) if type(c) is KVCache}
    bad = sorted(d for d in dims if d % group_size)
    if bad:
        raise ValueError(f"kv_group_size {group_size} does not divide the head dimension {bad[0]}; use one that does (32, 64 or 128)")
    where = processor()
    kernel = where == "cuda"
    if kernel and (failed := quant_decode_kernel.check(dims, group_size, bits)):
        log.warning("the CUDA kernel for quantized decode attention is off (%s): decode steps use mlx's quantized matmuls", failed)
        kernel = False
    if note := one_group_note(where, dims, group_size):
        log.warning("%s", note)
    made = model.make_cache if hasattr(model, "make_cache") else None

    def caches_of(quantized) -> list:
        caches = made() if made is not None else [KVCache() for _ in model.layers]
        return [quantized() if type(c) is KVCache else c for c in caches]

    def make_cache() -> list:
        return caches_of(lambda: LazyKV(group_size, bits, start) if start else QuantKV(group_size, bits))

    model.make_cache = make_cache
    quant_attention.install(model, kernel)
    if where != "cpu" and (failed := _decode_fails(model, caches_of(lambda: QuantKV(group_size, bits)))):
        dtypes = {str(c.keys.dtype).removeprefix("mlx.core.") for c in plain if type(c) is KVCache}
        hint = "convert its weights to bf16 or run it without kv_bits" if dtypes == {"float32"} else "run it without kv_bits"
        raise ValueError(f"kv_bits {bits}: this {where} GPU cannot attend over a quantized cache of this model ({'/'.join(sorted(dtypes))}): {failed}; {hint}")
    # Where a prompt's prefill chunks end, so that a row converts at exactly
    # this many tokens (worker.engine.generator).
    model.quantized_kv_start = start


def one_group_note(where: str, dims: set[int], group_size: int) -> str | None:
    """What a user should know when a row of keys is one group on CUDA
    (worker.engine.quant_attention: mlx's kernel gets those scores wrong,
    so they are read dequantized); None otherwise."""
    if not any(quant_attention.keys_dequantized(where, dim, group_size) for dim in dims):
        return None
    return (
        f"kv_group_size {group_size} equals the head dimension: on CUDA each decode step reads its keys dequantized "
        f"(mlx's quantized matmul gets one group a row wrong); kv_group_size {group_size // 2} keeps them packed"
    )


def _decode_fails(model, caches: list) -> str | None:
    """None if a two-token prompt piece and a decode step run over these
    fresh quantized caches, else mlx's message. mlx's GPU kernels for
    quantized attention do not take every dtype and shape (mlx-cuda 0.32
    has no quantized matmul of float32 queries for some), and a worker that
    cannot run them says so at load instead of failing every request."""
    try:
        mx.eval(model(mx.zeros((1, 2), dtype=mx.uint32), cache=caches))
        mx.eval(model(mx.zeros((1, 1), dtype=mx.uint32), cache=caches))
    except Exception as exc:  # whatever mlx raises for a kernel it lacks
        return f"{type(exc).__name__}: {exc}"
    return None


def _probe(model, caches: list) -> list:
    model(mx.zeros((1, 1), dtype=mx.uint32), cache=caches)
    return caches
