"""Token selection for a batch of rows: repetition penalty, temperature,
top-k, top-p and a PRNG key, each per row.

The order is Hugging Face's (penalty, temperature, top-k, top-p, then a draw),
which is what users of transformers and vLLM expect; mlx-lm filters before
applying temperature. Every row owns its PRNG key and nothing in a row's draw
reads another row, so a seeded row gives the same tokens alone or beside any
other rows, in any process.
"""

from __future__ import annotations

import functools
import os

import mlx.core as mx

from ipc.sampling import Sampling
from worker.runtime import cpu_attention, cpu_streams


class RowSampling:
    """One row's settings (a request's: a Generate is a Sampling), normalised,
    and its starting state."""

    __slots__ = ("greedy", "inv_temp", "top_k", "top_p", "penalty", "seen", "key", "logprobs")

    def __init__(self, params: Sampling, vocab_size: int, prompt: list[int], logprobs: int | None = None):
        self.greedy = params.temperature <= 0.0
        self.inv_temp = 0.0 if self.greedy else 1.0 / params.temperature
        self.top_k = params.top_k if 0 < params.top_k < vocab_size else 0
        self.top_p = params.top_p if 0.0 < params.top_p < 1.0 else 1.0
        self.penalty = params.repetition_penalty
        self.logprobs = logprobs  # Generate.logprobs
        # Prompt tokens count as seen, for the repetition penalty.
        self.seen: mx.array | None = None
        if self.penalty != 1.0:
            seen = mx.zeros((vocab_size,), dtype=mx.bool_)
            valid = [i for i in prompt if 0 <= i < vocab_size]
            if valid:
                seen[mx.array(valid)] = True
            self.seen = seen
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.key = mx.random.key(seed)

    @property
    def kind(self) -> tuple:
        """Rows of one kind are drawn by one compiled kernel."""
        return ("greedy",) if self.greedy else (self.top_k, self.top_p < 1.0)


class BatchSampler:
    """Picks the next token of every row of a decode batch, lazily (no sync).

    Rows are kept in the batch's order; `extend` and `filter` follow the
    batch's membership. A batch whose rows share one kind costs one kernel
    call, as a lone row does; mixed kinds are drawn group by group.
    """

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.rows: list[RowSampling] = []
        self._keys: mx.array | None = None  # (B, 2) uint32
        self._seen: mx.array | None = None  # (B, V) bool, only while a row has a penalty
        # The last draw's log-probabilities, while some row asks for them.
        self.logprobs: StepLogprobs | None = None
        self._params()

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def wants_logprobs(self) -> bool:
        """Some row asks for log-probabilities."""
        return self._top_logprobs is not None

    def extend(self, rows: list[RowSampling]) -> None:
        if not rows:
            return
        keys = mx.stack([r.key for r in rows])
        self._keys = keys if self._keys is None else mx.concatenate([self._keys, keys])
        if self._seen is not None or any(r.seen is not None for r in rows):
            blank = mx.zeros((self.vocab_size,), dtype=mx.bool_)
            seen = mx.stack([blank if r.seen is None else r.seen for r in rows])
            # Rows already here have no penalty when nothing was tracked.
            before = self._seen if self._seen is not None else mx.zeros((len(self.rows), self.vocab_size), dtype=mx.bool_)
            self._seen = mx.concatenate([before, seen])
        self.rows = self.rows + rows
        self._params()

    def filter(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self._keys = self._seen = None
        else:
            index = mx.array(keep)
            self._keys = self._keys[index]
            if self._seen is not None:
                self._seen = self._seen[index] if any(r.penalty != 1.0 for r in self.rows) else None
        self._params()

    def _params(self) -> None:
        rows = self.rows
        self._inv_temp = mx.array([r.inv_temp for r in rows], dtype=mx.float32)
        self._top_p = mx.array([r.top_p for r in rows], dtype=mx.float32)
        self._penalty = mx.array([r.penalty for r in rows], dtype=mx.float32)[:, None]
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(rows):
            groups.setdefault(r.kind, []).append(i)
        self._groups = [(kind, mx.array(idx)) for kind, idx in groups.items()]
        # Where each row's token lands when the groups are concatenated.
        order = [i for idx in groups.values() for i in idx]
        self._unsort = mx.argsort(mx.array(order)) if len(groups) > 1 else None
        asked = [r.logprobs for r in rows if r.logprobs is not None]
        self._top_logprobs = max(asked) if asked else None

    def __call__(self, logits: mx.array, last: mx.array) -> mx.array:
        """logits (B, V) for the position after `last` (B,), the tokens just
        fed; returns (B,) token ids, and sets `logprobs` for the draw when
        some row asks for them."""
        if logits.dtype != mx.float32:
            logits = logits.astype(mx.float32)
        tokens = self._pick(logits, last)
        self.logprobs = None if self._top_logprobs is None else StepLogprobs(logits, tokens, self._top_logprobs)
        return tokens

    def _pick(self, logits: mx.array, last: mx.array) -> mx.array:
        if self._seen is not None:
            self._seen = _mark(self._seen, last)
            logits = _penalize(logits, self._seen, self._penalty)
        if self._unsort is None:
            kind = self._groups[0][0]
            tokens, self._keys = _draw_kind(kind, logits, self._inv_temp, self._top_p, self._keys)
            return tokens
        tokens, keys = [], []
        for kind, idx in self._groups:
            t, k = _draw_kind(kind, logits[idx], self._inv_temp[idx], self._top_p[idx], self._keys[idx])
            tokens.append(t)
            keys.append(k)
        self._keys = mx.concatenate(keys)[self._unsort]
        return mx.concatenate(tokens)[self._unsort]


# A token the distribution cannot give (a grammar's mask) has log-probability
# -inf, which JSON cannot carry; OpenAI and vLLM write this instead.
FLOOR_LOGPROB = -9999.0


class StepLogprobs:
    """One draw's log-probabilities, as vLLM reports them by default
    ("raw_logprobs"): the log-softmax of the model's logits, before the
    repetition penalty, temperature, top-k and top-p; for a constrained row
    after its grammar's mask (a token the grammar forbids has the floor).
    Lazy arrays, read once (`entry`) when the step's tokens are read."""

    __slots__ = ("_lsm", "_arrays", "_lists")

    def __init__(self, logits: mx.array, tokens: mx.array, top: int):
        lsm = _log_softmax(logits)
        chosen = mx.take_along_axis(lsm, tokens[:, None].astype(mx.int32), axis=-1)[:, 0]
        if top:
            ids = mx.argpartition(-lsm, kth=top - 1, axis=-1)[:, :top]
            vals = mx.take_along_axis(lsm, ids, axis=-1)
            order = mx.argsort(-vals, axis=-1)
            ids, vals = mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)
        else:
            ids = vals = mx.zeros((lsm.shape[0], 0))
        self._lsm = lsm  # for a token put in place of the drawn one (forced)
        self._arrays = (tokens, chosen, ids, vals)
        self._lists: tuple | None = None

    @property
    def arrays(self) -> tuple[mx.array, ...]:
        return self._arrays

    def entry(self, i: int, token: int, top: int) -> tuple[int, float, list[tuple[int, float]]]:
        """Row i's (token, its log-probability, its `top` likeliest tokens)."""
        if self._lists is None:
            self._lists = tuple(a.tolist() for a in self._arrays)
        drawn, chosen, ids, vals = self._lists
        lp = chosen[i] if drawn[i] == token else self._lsm[i, token].item()
        return token, max(lp, FLOOR_LOGPROB), [(t, max(v, FLOOR_LOGPROB)) for t, v in zip(ids[i][:top], vals[i][:top])]


@mx.compile
def _log_softmax(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _draw_kind(kind: tuple, logits, inv_temp, top_p, keys) -> tuple[mx.array, mx.array]:
    if kind[0] == "greedy":
        return mx.argmax(logits, axis=-1), keys
    top_k, use_top_p = kind
    draw = _draw(top_k, use_top_p, logits.shape[-1])
    if mx.default_device() != mx.cpu:
        return draw(logits, inv_temp, top_p, keys)
    # A draw's passes over the vocabulary (argpartition, logsumexp) are most
    # of a step's sampling; rows go a core each (worker.runtime.cpu_streams),
    # each with its own key as ever.
    return cpu_streams.apart(logits.shape[0], lambda r: draw(logits[r], inv_temp[r], top_p[r], keys[r]))


# Compiled once per kind of row (top-k size, top-p on or off); the numbers
# that vary per row (temperature, top-p, penalty) are array inputs, so a new
# request never recompiles. Fused, they cost less Python and fewer kernel
# launches per token than the op-by-op graph.


@mx.compile
def _mark(seen: mx.array, last: mx.array) -> mx.array:
    # A scatter of one element per row (4x faster than comparing every id
    # at a 248k vocabulary on a CPU).
    return mx.put_along_axis(seen, last[:, None].astype(mx.int32), mx.array(True), axis=-1)


@mx.compile
def _penalize(logits: mx.array, seen: mx.array, penalty: mx.array) -> mx.array:
    scaled = mx.where(logits > 0, logits / penalty, logits * penalty)
    return mx.where(seen, scaled, logits)


_split = mx.vmap(mx.random.split)

# A row with top-p and no top-k looks for its nucleus among this many of its
# likeliest tokens: finding them is one pass over the vocabulary, where
# sorting all of it cost 27 ms a row on a 2-core CPU at 151,936 tokens. A
# nucleus that needs more tokens than this (a distribution nearly flat over
# thousands of them) is cut to these, as if top_k were this number too.
NUCLEUS_AT_MOST = 4096


@functools.cache
def _draw(top_k: int, use_top_p: bool, vocab: int):
    # A Gumbel-max draw whose noise comes from each row's own key (vmap over
    # the keys): categorical sampling without one row's noise depending on
    # where it sits in the batch.
    width = top_k or (min(NUCLEUS_AT_MOST, vocab) if use_top_p else vocab)
    noise = mx.vmap(lambda key: mx.random.gumbel((width,), key=key))
    # mlx's CPU exp works one element at a time; over a whole vocabulary the
    # polynomial one is twice as fast there.
    logsumexp = _logsumexp_cpu if mx.default_device() == mx.cpu else _logsumexp

    def draw(logits: mx.array, inv_temp: mx.array, top_p: mx.array, keys: mx.array) -> tuple[mx.array, mx.array]:
        logits = logits * inv_temp[:, None]
        pairs = _split(keys)
        keys, sub = pairs[:, 0], pairs[:, 1]
        idx, vals = None, logits
        if width < vocab:
            # Work on the likeliest only: O(V) to find them, O(k log k) for top-p.
            idx = mx.argpartition(-logits, kth=width - 1, axis=-1)[:, :width]
            vals = mx.take_along_axis(logits, idx, axis=-1)
        if use_top_p:
            # Top-p's probabilities are over what top-k kept (Hugging Face's
            # order), else over the whole vocabulary.
            vals = _nucleus(vals, top_p, logsumexp(vals if top_k else logits))
        choice = mx.argmax(vals + noise(sub), axis=-1)
        if idx is None:
            return choice, keys
        return mx.take_along_axis(idx, choice[:, None], axis=-1)[:, 0], keys

    return mx.compile(draw)


def _logsumexp(x: mx.array) -> mx.array:
    return mx.logsumexp(x, axis=-1, keepdims=True)


def _logsumexp_cpu(x: mx.array) -> mx.array:
    top = x.max(axis=-1, keepdims=True)
    return top + mx.log(cpu_attention.exp_nonpositive(x - top).sum(axis=-1, keepdims=True))


def _nucleus(logits: mx.array, top_p: mx.array, logsumexp: mx.array) -> mx.array:
    """Keeps, per row, the smallest set of highest-probability tokens whose
    mass reaches that row's top_p (tokens tied with the last one kept stay
    too); the probabilities are exp(logits - logsumexp)."""
    ranked = mx.sort(logits, axis=-1)[:, ::-1]
    probs = mx.exp(ranked - logsumexp)
    before = mx.cumsum(probs, axis=-1) - probs
    least = mx.min(mx.where(before < top_p[:, None], ranked, mx.inf), axis=-1, keepdims=True)
    return mx.where(logits >= least, logits, -mx.inf)
