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
be cut, padded and rolled along the token axis like a plain one. mlx-lm's
attention sees `bits` on the cache and takes its quantized path.

"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, dynamic_roll


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
            q.keys = mx.quantize(plain.keys[..., : plain.offset, :], group_size=group_size, bits=bits)
            q.values = mx.quantize(plain.values[..., : plain.offset, :], group_size=group_size, bits=bits)
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


def install(model, bits: int, group_size: int) -> None:
    """Makes the model's caches quantized: every plain attention cache that
    `make_prompt_cache(model)` hands out becomes a QuantKV (ValueError when
    the model's head dimension is not a multiple of group_size)."""
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
    made = model.make_cache if hasattr(model, "make_cache") else None

    def make_cache():
        caches = made() if made is not None else [KVCache() for _ in model.layers]
        return [QuantKV(group_size, bits) if type(c) is KVCache else c for c in caches]

    model.make_cache = make_cache


def _probe(model, caches: list) -> list:
    model(mx.zeros((1, 1), dtype=mx.uint32), cache=caches)
    return caches
