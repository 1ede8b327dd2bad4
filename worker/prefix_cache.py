"""Model state for earlier prompts, reused when a new prompt starts the same way.

Requests are stateless ChatML, so turn N of a chat resends turns 1..N-1. The
worker keeps snapshots of the model cache at chat-structure boundaries (the
start of a `<|im_start|>` block: after the system prompt, after the last
complete message) and resumes the next prompt from the longest stored prefix.

Qwen3.5's linear-attention state summarises every token seen and cannot be
cut back, so for such models a snapshot is only usable when it covers exactly
a prefix of the new prompt. Models whose layers are all trimmable KV caches
keep one snapshot of each whole prompt (all but its last token) and cut it
back to the longest common prefix. A snapshot never covers a whole prompt:
the last prompt token must run to give the logits of the first new token.

Entries are keyed by the adapter content hash as well as the tokens, held in
least-recently-used order and bounded by a byte budget.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

log = logging.getLogger("worker")


def message_starts(ids: list[int], marker: int | None) -> list[int]:
    """Positions of the chat markers that open a block, the first excluded."""
    if marker is None:
        return []
    return [i for i, t in enumerate(ids) if t == marker and i > 0]


def chunk_ends(n: int, cuts: list[int], step: int, start: int) -> list[int]:
    """End positions of the prefill chunks over ids[start:n].

    Chunks end at every cut and every `step` tokens after the previous cut,
    so the chunks after a cut are the same whether the prompt ran from 0 or
    resumed from a snapshot there: the arithmetic, and so the greedy output,
    does not depend on the cache.
    """
    ends = []
    prev = 0
    for cut in sorted({c for c in cuts if 0 < c < n} | {n}):
        pos = prev + step
        while pos < cut:
            ends.append(pos)
            pos += step
        ends.append(cut)
        prev = cut
    return [e for e in ends if e > start]


@dataclass
class _Entry:
    adapter: str | None
    tokens: np.ndarray
    layers: list
    nbytes: int


def _snapshot(cache: list) -> tuple[list, int]:
    layers = []
    nbytes = 0
    for c in cache:
        if isinstance(c, KVCache):
            if c.keys is None:
                layers.append(None)
                continue
            # A copy, not a view: a view would pin the whole preallocated
            # buffer and make every later in-place write copy it.
            keys = mx.array(c.keys[..., : c.offset, :])
            values = mx.array(c.values[..., : c.offset, :])
            layers.append((keys, values))
            nbytes += keys.nbytes + values.nbytes
        else:
            # Linear-attention layers replace their arrays on every step and
            # never write into them, so holding references is a snapshot.
            arrays = list(c.cache)
            layers.append(arrays)
            nbytes += sum(a.nbytes for a in arrays if a is not None)
    mx.eval([x for layer in layers if layer is not None for x in layer if x is not None])
    return layers, nbytes


def _restore(model, layers: list, length: int) -> list:
    cache = make_prompt_cache(model)
    for c, saved in zip(cache, layers):
        if isinstance(c, KVCache):
            if saved is not None:
                # Fresh handles: KVCache writes into its arrays in place.
                c.keys, c.values = saved[0][...], saved[1][...]
                c.offset = length
        else:
            c.cache = [a[...] if a is not None else None for a in saved]
    return cache


class PrefixCache:
    def __init__(self, model, budget_bytes: int):
        self.model = model
        self.budget = budget_bytes
        self.used = 0
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next = 0
        kinds = {type(c) for c in make_prompt_cache(model)}
        self.trimmable = kinds == {KVCache}
        self.supported = kinds <= {KVCache, ArraysCache}
        if not self.supported:
            log.info("prefix cache off: cache types %s", sorted(k.__name__ for k in kinds))

    @property
    def enabled(self) -> bool:
        return self.supported and self.budget > 0

    def __len__(self) -> int:
        return len(self._entries)

    def snapshot_points(self, n: int, starts: list[int]) -> set[int]:
        """Where a prompt of n tokens should leave snapshots."""
        if not self.enabled:
            return set()
        if self.trimmable:
            return {n - 1} if n > 1 else set()
        # After the system prompt (shared by every chat) and after the last
        # complete message (the next turn's history).
        return {p for p in (starts[:1] + starts[-1:]) if p < n}

    def resume(self, adapter: str | None, ids: list[int], cuts: list[int]) -> tuple[list, int]:
        """A live cache for `ids` and how many of its tokens it already holds."""
        n = len(ids)
        best, best_len = None, 0
        if self.enabled and n > 1:
            want = np.asarray(ids, dtype=np.int64)
            allowed = set(cuts)
            for key, entry in self._entries.items():
                if entry.adapter != adapter:
                    continue
                usable = self._usable(entry.tokens, want, allowed)
                if usable > best_len:
                    best, best_len = key, usable
        if best is None:
            return make_prompt_cache(self.model), 0
        self._entries.move_to_end(best)
        entry = self._entries[best]
        return _restore(self.model, entry.layers, best_len), best_len

    def _usable(self, tokens: np.ndarray, want: np.ndarray, allowed: set[int]) -> int:
        m = min(len(tokens), len(want) - 1)
        same = tokens[:m] == want[:m]
        common = m if same.all() else int(np.argmin(same))
        if self.trimmable:
            return common
        # A snapshot of a hybrid model is all or nothing, and only at a
        # chunk cut of this prompt, where the no-cache run also stops.
        return len(tokens) if common == len(tokens) and len(tokens) in allowed else 0

    def store(self, adapter: str | None, tokens: list[int], cache: list) -> None:
        want = np.asarray(tokens, dtype=np.int64)
        for key, entry in self._entries.items():
            if entry.adapter == adapter and len(entry.tokens) == len(want) and (entry.tokens == want).all():
                self._entries.move_to_end(key)
                return
        layers, nbytes = _snapshot(cache)
        nbytes = self._counted(nbytes)
        if nbytes > self.budget:
            return
        if self.trimmable:
            # A trimmable snapshot serves every shorter prefix of itself.
            for key in [k for k, e in self._entries.items() if e.adapter == adapter and self._is_prefix(e.tokens, want)]:
                self._drop(key)
        while self.used + nbytes > self.budget and self._entries:
            self._drop(next(iter(self._entries)))
        self._entries[self._next] = _Entry(adapter, want, layers, nbytes)
        self._next += 1
        self.used += nbytes

    def _counted(self, nbytes: int) -> int:
        """What a snapshot of `nbytes` counts against the budget (a rank of
        a group counts what every rank agrees on: worker.group)."""
        return nbytes

    @staticmethod
    def _is_prefix(short: np.ndarray, long: np.ndarray) -> bool:
        return len(short) <= len(long) and bool((long[: len(short)] == short).all())

    def _drop(self, key: int) -> None:
        self.used -= self._entries.pop(key).nbytes
