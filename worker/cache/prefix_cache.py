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

A prompt's chunks also end every CHECKPOINT tokens, and a hybrid model
keeps a snapshot at the last such point of each prompt as well: a long
message (a pasted file, an agent's tool output) that a later prompt
extends or edits near its end resumes from there.

Entries are keyed by the adapter content hash as well as the tokens, held in
least-recently-used order and bounded by a byte budget. With a disk tier
(worker.cache.prefix_disk) every snapshot stored is written to disk as well, and
entries read back from disk come in through `insert`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, make_prompt_cache

log = logging.getLogger("worker")


# A prompt's ids: as the request gave them, or as an array (`tokens_of`).
Tokens = list[int] | np.ndarray


def tokens_of(ids: Tokens) -> np.ndarray:
    """A prompt's ids as the array every lookup compares: a row converts
    its ids once (a 26k-token list took 1.2 ms each time on a 2-core
    EPYC, and a request was looked up six or seven times)."""
    return ids if isinstance(ids, np.ndarray) else np.asarray(ids, dtype=np.int64)


def message_starts(ids: Tokens, marker: int | None) -> list[int]:
    """Positions of the chat markers that open a block, the first excluded."""
    if marker is None:
        return []
    # numpy: a 26k-token prompt took 30 ms in a Python loop.
    return [int(i) for i in np.flatnonzero(tokens_of(ids) == marker) if i > 0]


# Positions (multiples of it) where every prompt's prefill chunks end, and
# where a hybrid model keeps its last snapshot of a prompt.
CHECKPOINT = 4096


def cut_points(ids: Tokens, marker: int | None) -> list[int]:
    """Where a prompt's prefill chunks must end: its message starts and
    every CHECKPOINT tokens. Both depend on the tokens alone, so two prompts
    that share a prefix cut it at the same places."""
    grid = range(CHECKPOINT, len(ids), CHECKPOINT)
    return sorted(set(message_starts(ids, marker)) | set(grid))


def chunk_ends(n: int, cuts: list[int], step: int, start: int, fold: int = 0) -> list[int]:
    """End positions of the prefill chunks over ids[start:n].

    Chunks end at every cut and every `step` tokens after the previous cut,
    so the chunks after a cut are the same whether the prompt ran from 0 or
    resumed from a snapshot there: the arithmetic, and so the greedy output,
    does not depend on the cache. A piece of at most `fold` tokens left
    before a cut (or the prompt's end) is read with the chunk before it: a
    forward pass of a few tokens reads all the weights, as long on a GPU as
    a decode step, for almost no work.
    """
    ends = []
    prev = 0
    for cut in sorted({c for c in cuts if 0 < c < n} | {n}):
        pos = prev + step
        while pos < cut - fold:
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
    pinned: bool = False  # a warm prompt's: never evicted


# Attention caches that can be cut back: plain, or quantized (kv_bits),
# whose keys and values are each a tuple of packed values, scales, biases.
_KV = (KVCache, QuantizedKVCache)


def _head(x, n: int):
    """The first n tokens of a cache tensor, copied."""
    if isinstance(x, tuple):
        return tuple(_head(a, n) for a in x)
    # A copy, not a view: a view would pin the whole preallocated
    # buffer and make every later in-place write copy it.
    return mx.array(x[..., :n, :])


def _fresh(x):
    return tuple(a[...] for a in x) if isinstance(x, tuple) else x[...]


def _bytes(x) -> int:
    return sum(a.nbytes for a in x) if isinstance(x, tuple) else x.nbytes


def _snapshot(cache: list) -> tuple[list, int]:
    layers = []
    nbytes = 0
    for c in cache:
        if isinstance(c, _KV):
            if c.keys is None:
                layers.append(None)
                continue
            keys, values = _head(c.keys, c.offset), _head(c.values, c.offset)
            layers.append((keys, values))
            nbytes += _bytes(keys) + _bytes(values)
        else:
            # Linear-attention layers replace their arrays on every step and
            # never write into them, so holding references is a snapshot.
            arrays = list(c.cache)
            layers.append(arrays)
            nbytes += sum(a.nbytes for a in arrays if a is not None)
    mx.eval([layer for layer in layers if layer is not None])
    return layers, nbytes


def _map_arrays(f, node):
    """`node` (a snapshot's layer: arrays in tuples and lists, None where a
    state is unset) with f applied to each array, as nested tuples."""
    if isinstance(node, (tuple, list)):
        return tuple(_map_arrays(f, x) for x in node)
    return None if node is None else f(node)


def _with_room(x: mx.array, length: int, capacity: int) -> mx.array:
    B, H, _, D = x.shape
    return mx.concatenate([x[..., :length, :], mx.zeros((B, H, capacity - length, D), x.dtype)], axis=2)


def _restore(model, layers: list, length: int, total: int) -> list:
    """A live cache holding a snapshot's first `length` tokens, for a
    prompt of `total` tokens."""
    cache = make_prompt_cache(model)
    for c, saved in zip(cache, layers):
        if isinstance(c, _KV):
            if saved is not None:
                if type(c) is KVCache:
                    # One copy, with room for the rest of the prompt and the
                    # first token, its capacity a multiple of KVCache.step as
                    # the compiled decode step wants it: sharing the
                    # snapshot's buffer instead, the prompt's first write
                    # copied it to a capacity off that grid and the first
                    # decode step copied it again (26k tokens: both, every hit).
                    capacity = -(-(total + 1) // KVCache.step) * KVCache.step
                    c.keys, c.values = _with_room(saved[0], length, capacity), _with_room(saved[1], length, capacity)
                else:
                    # Fresh handles: attention caches write into their arrays in place.
                    c.keys, c.values = _fresh(saved[0]), _fresh(saved[1])
                c.offset = length
        else:
            c.cache = [a[...] if a is not None else None for a in saved]
    return cache


class PrefixCache:
    def __init__(self, model, budget_bytes: int, disk=None):
        self.model = model
        self.disk = disk  # worker.cache.prefix_disk.PrefixDisk, or None
        self.budget = budget_bytes
        self.used = 0
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next = 0
        cache = make_prompt_cache(model)
        kinds = {type(c) for c in cache}
        self._shapes: list | None = None  # set by learn_layout
        # A snapshot cut back below quantized_kv_start would resume quantized
        # what a fresh prompt holds plain: such a model's snapshots serve
        # only their whole length, as a hybrid model's do.
        self.trimmable = all(issubclass(k, _KV) for k in kinds) and not getattr(model, "quantized_kv_start", 0)
        self.supported = all(issubclass(k, (*_KV, ArraysCache)) for k in kinds)
        # What a snapshot read from disk must hold, layer by layer: keys and
        # values (None) or that many state arrays; once `learn_layout` has
        # seen a forward's caches, their arrays' shapes too.
        self._layout = [None if isinstance(c, _KV) else len(c.cache) for c in cache] if self.supported else []
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
        # After the system prompt (shared by every chat), after the last
        # complete message (the next turn's history), and at the last
        # checkpoint (inside a long message).
        points = set(starts[:1] + starts[-1:])
        if n - 1 >= CHECKPOINT:
            points.add((n - 1) // CHECKPOINT * CHECKPOINT)
        return {p for p in points if p < n}

    def _best(self, adapter: str | None, ids: Tokens, cuts: list[int]) -> tuple[int | None, int]:
        best, best_len = None, 0
        if self.enabled and len(ids) > 1:
            want = tokens_of(ids)
            allowed = set(cuts)
            for key, entry in self._entries.items():
                if entry.adapter != adapter:
                    continue
                usable = self._usable(entry.tokens, want, allowed)
                if usable > best_len:
                    best, best_len = key, usable
        return best, best_len

    def resume(self, adapter: str | None, ids: Tokens, cuts: list[int]) -> tuple[list, int]:
        """A live cache for `ids` and how many of its tokens it already holds."""
        best, best_len = self._best(adapter, ids, cuts)
        if best is None:
            return make_prompt_cache(self.model), 0
        self._entries.move_to_end(best)
        entry = self._entries[best]
        if self.disk is not None:
            self.disk.touch(adapter, entry.tokens)
        return _restore(self.model, entry.layers, best_len, len(ids)), best_len

    def rehearse(self) -> int:
        """Makes, and lets go of, the live cache a hit on the longest held
        snapshot makes; returns its tokens (0: none held). A restarted
        worker's first hit otherwise writes its copy of a snapshot into
        memory the process has never touched (on a CPU about 0.4 ms a MB
        of page faults), where later hits get buffers of that size back
        from mlx's cache of freed buffers; after this, the first hit on a
        snapshot of that capacity (in steps of 256 tokens) does too."""
        if not self._entries:
            return 0
        entry = max(self._entries.values(), key=lambda e: len(e.tokens))
        cache = _restore(self.model, entry.layers, len(entry.tokens), len(entry.tokens))
        mx.eval([[x for x in ((c.keys, c.values) if isinstance(c, _KV) else c.cache) if x is not None] for c in cache])
        return len(entry.tokens)

    def held(self, adapter: str | None, ids: Tokens, cuts: list[int]) -> int:
        """Tokens of `ids` the memory tier can resume."""
        return self._best(adapter, ids, cuts)[1]

    def disk_reads(self, ids: Tokens, cuts: list[int]) -> list[tuple]:
        """Disk entries that would resume more of `ids` than memory can,
        the longest per adapter, each with how many more tokens."""
        if self.disk is None or not self.enabled or len(ids) < 2:
            return []
        want = tokens_of(ids)
        allowed = set(cuts)
        found = self.disk.candidates(want, lambda tokens, w: self._usable(tokens, w, allowed))
        more = [(entry, n - self.held(adapter, ids, cuts)) for adapter, (n, entry) in found.items()]
        return [(entry, saved) for entry, saved in more if saved > 0]

    def _usable(self, tokens: np.ndarray, want: np.ndarray, allowed: set[int]) -> int:
        m = min(len(tokens), len(want) - 1)
        same = tokens[:m] == want[:m]
        common = m if same.all() else int(np.argmin(same))
        if self.trimmable:
            return common
        # A snapshot of a hybrid model is all or nothing, and only at a
        # chunk cut of this prompt, where the no-cache run also stops.
        return len(tokens) if common == len(tokens) and len(tokens) in allowed else 0

    def _key_of(self, adapter: str | None, want: np.ndarray) -> int | None:
        """The key of the snapshot of exactly these tokens, if held."""
        for key, entry in self._entries.items():
            if entry.adapter == adapter and len(entry.tokens) == len(want) and (entry.tokens == want).all():
                return key
        return None

    def store(self, adapter: str | None, tokens: Tokens, cache: list) -> None:
        want = tokens_of(tokens)
        key = self._key_of(adapter, want)
        if key is not None:
            self._entries.move_to_end(key)
            return
        layers, nbytes = _snapshot(cache)
        if self.insert(adapter, want, layers, nbytes) and self.disk is not None:
            self.disk.write(adapter, want, layers)

    def insert(self, adapter: str | None, want: np.ndarray, layers: list, nbytes: int) -> bool:
        """Holds a snapshot (made here or read from disk); False when it is
        larger than the whole budget."""
        if self._key_of(adapter, want) is not None:
            return True
        nbytes = self._counted(nbytes)
        if nbytes > self.budget - self.pinned_bytes:
            return False
        if self.trimmable:
            # A trimmable snapshot serves every shorter prefix of itself.
            for key in [k for k, e in self._entries.items() if e.adapter == adapter and not e.pinned and self._is_prefix(e.tokens, want)]:
                self._drop(key)
        while self.used + nbytes > self.budget:
            self._drop(next(k for k, e in self._entries.items() if not e.pinned))
        self._entries[self._next] = _Entry(adapter, want, layers, nbytes)
        self._next += 1
        self.used += nbytes
        return True

    def insert_read(self, adapter: str | None, want: np.ndarray, layers: list, nbytes: int) -> bool:
        """Holds a snapshot read from disk, if it is laid out as this model's
        caches are; False, logged, when it is not (a file passes its
        checksums whatever it holds)."""
        problem = self._layout_problem(layers, len(want))
        if problem is not None:
            log.warning("prefix cache: a snapshot read from disk does not fit this model (%s); not used", problem)
            return False
        return self.insert(adapter, want, layers, nbytes)

    def learn_layout(self, cache: list) -> None:
        """The shapes of the arrays of a snapshot of `cache` (a forward's,
        made by this model), which a snapshot read from disk must have but
        for its token count: a file passes its checksums with any shapes,
        and one that did not fit would fail every row of the batch it
        joined."""
        if getattr(self.model, "quantized_kv_start", 0):
            # Keys below the start are plain arrays, past it quantized
            # triples: a one-token forward's are not a long prompt's.
            return
        layers, _ = _snapshot(cache)
        self._shapes = [self._shapes_of(i, saved) for i, saved in enumerate(layers)]

    def _shapes_of(self, i: int, saved) -> tuple | None:
        """Layer i's arrays' shapes, as nested tuples; keys' and values'
        without their token count (axis 2)."""
        if saved is None:
            return None
        tokens = self._layout[i] is None
        return _map_arrays(lambda a: (*a.shape[:2], *a.shape[3:]) if tokens else tuple(a.shape), saved)

    def _layout_problem(self, layers: object, length: int) -> str | None:
        problem = self._structure_problem(layers, length)
        if problem is not None or self._shapes is None:
            return problem
        for i, (shapes, saved) in enumerate(zip(self._shapes, layers)):
            got = self._shapes_of(i, saved)
            if shapes is not None and saved is not None and got != shapes:
                return f"layer {i} holds arrays of shapes {got}, not {shapes}"
        return None

    def _structure_problem(self, layers: object, length: int) -> str | None:
        layout = self._layout
        if not isinstance(layers, list) or len(layers) != len(layout):
            return f"{len(layers) if isinstance(layers, list) else 'no'} layers for {len(layout)}"
        for i, (states, saved) in enumerate(zip(layout, layers)):
            if states is None:
                if saved is None:
                    continue
                if not isinstance(saved, tuple) or len(saved) != 2:
                    return f"layer {i} is not keys and values"
                for part in saved:
                    arrays = part if isinstance(part, tuple) else (part,)
                    if not all(isinstance(a, mx.array) and a.ndim == 4 and a.shape[-2] == length for a in arrays):
                        return f"layer {i} does not hold {length} tokens"
            elif not isinstance(saved, list) or len(saved) != states or not all(a is None or isinstance(a, mx.array) for a in saved):
                return f"layer {i} is not {states} state arrays"
        return None

    @property
    def pinned_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values() if e.pinned)

    def pin(self, adapter: str | None, tokens: Tokens) -> bool:
        """Keeps the snapshot of exactly these tokens for good (a warm
        prompt's); False when there is none."""
        key = self._key_of(adapter, tokens_of(tokens))
        if key is None:
            return False
        self._entries[key].pinned = True
        return True

    def _counted(self, nbytes: int) -> int:
        """What a snapshot of `nbytes` counts against the budget (a rank of
        a group counts what every rank agrees on: worker.group.model)."""
        return nbytes

    @staticmethod
    def _is_prefix(short: np.ndarray, long: np.ndarray) -> bool:
        return len(short) <= len(long) and bool((long[: len(short)] == short).all())

    def _drop(self, key: int) -> None:
        self.used -= self._entries.pop(key).nbytes
