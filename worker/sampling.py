"""Token selection: repetition penalty, temperature, top-k, top-p, seeded keys.

The order is Hugging Face's (penalty, temperature, top-k, top-p, then a draw),
which is what users of transformers and vLLM expect; mlx-lm filters before
applying temperature. Every request owns its PRNG key, so a seed reproduces
the same tokens in any process regardless of what ran before.
"""

from __future__ import annotations

import functools
import os

import mlx.core as mx


class Sampler:
    """Picks the next token from a (1, vocab) logits row, lazily (no sync)."""

    def __init__(
        self,
        *,
        vocab_size: int,
        temperature: float,
        top_k: int,
        top_p: float,
        repetition_penalty: float,
        seed: int | None,
    ):
        self.greedy = temperature <= 0.0
        self.inv_temp = 0.0 if self.greedy else 1.0 / temperature
        self.top_k = top_k if 0 < top_k < vocab_size else 0
        self.top_p = top_p if 0.0 < top_p < 1.0 else 1.0
        self.penalty = repetition_penalty
        self.vocab_size = vocab_size
        self._inv_temp = mx.array(self.inv_temp, dtype=mx.float32)
        self._top_p = mx.array(self.top_p, dtype=mx.float32)
        self._penalty = mx.array(repetition_penalty, dtype=mx.float32)
        self._seen: mx.array | None = None
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little") >> 1
        self._key = mx.random.key(seed)

    def observe_prompt(self, ids: list[int]) -> None:
        """Marks prompt tokens as seen, for the repetition penalty."""
        if self.penalty == 1.0:
            return
        seen = mx.zeros((self.vocab_size,), dtype=mx.bool_)
        if ids:
            valid = [i for i in ids if i < self.vocab_size]
            if valid:
                seen[mx.array(valid)] = True
        self._seen = seen

    def __call__(self, logits: mx.array, last: mx.array | None) -> mx.array:
        """logits: (1, V) for the position after `last` (a (1,) token or None)."""
        logits = logits.astype(mx.float32)
        if self._seen is not None:
            if last is not None:
                self._seen = _mark(self._seen, last)
            logits = _penalize(logits, self._seen, self._penalty)
        if self.greedy:
            return mx.argmax(logits, axis=-1)
        token, self._key = _draw(self.top_k, self.top_p < 1.0)(logits, self._inv_temp, self._top_p, self._key)
        return token


# Compiled once per shape of the computation (top-k size, top-p on or off);
# the numbers that vary per request (temperature, top-p, penalty) are array
# inputs, so a new request never recompiles. Fused, they cost less Python
# and fewer kernel launches per token than the op-by-op graph.


@mx.compile
def _mark(seen: mx.array, last: mx.array) -> mx.array:
    return mx.logical_or(seen, mx.arange(seen.shape[0]) == last)


@mx.compile
def _penalize(logits: mx.array, seen: mx.array, penalty: mx.array) -> mx.array:
    scaled = mx.where(logits > 0, logits / penalty, logits * penalty)
    return mx.where(seen, scaled, logits)


@functools.lru_cache(maxsize=None)
def _draw(top_k: int, use_top_p: bool):
    def draw(logits: mx.array, inv_temp: mx.array, top_p: mx.array, key: mx.array) -> tuple[mx.array, mx.array]:
        logits = logits * inv_temp
        key, sub = mx.random.split(key)
        if top_k:
            # Work on the k best only: O(V) to find them, O(k log k) for top-p.
            idx = mx.argpartition(-logits, kth=top_k - 1, axis=-1)[:, :top_k]
            vals = mx.take_along_axis(logits, idx, axis=-1)
            if use_top_p:
                vals = _top_p(vals, top_p)
            choice = mx.random.categorical(vals, key=sub)
            return mx.take_along_axis(idx, choice[:, None], axis=-1)[:, 0], key
        if use_top_p:
            logits = _top_p(logits, top_p)
        return mx.random.categorical(logits, key=sub), key

    return mx.compile(draw)


def _top_p(logits: mx.array, top_p: mx.array) -> mx.array:
    """Keeps the smallest set of highest-probability tokens whose mass reaches top_p."""
    order = mx.argsort(-logits, axis=-1)
    ranked = mx.take_along_axis(logits, order, axis=-1)
    probs = mx.softmax(ranked, axis=-1)
    before = mx.cumsum(probs, axis=-1) - probs
    ranked = mx.where(before < top_p, ranked, -mx.inf)
    inverse = mx.argsort(order, axis=-1)
    return mx.take_along_axis(ranked, inverse, axis=-1)
