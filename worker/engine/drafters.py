"""Drafters: cheap guesses of a row's next tokens, checked by the target model.

A drafter proposes up to k tokens per row; worker.engine.speculate verifies every
row's proposal in one forward of the target model and keeps the longest
prefix the target would have produced itself. Drafts are deterministic (one
token per position, no distribution), which is what makes the acceptance
rule a plain comparison with the target's own draw (worker.engine.speculate).

`NgramDrafter` is prompt lookup: the row's last n tokens (n from
`max_n` down to `min_n`) are looked up among its earlier tokens, prompt and
text so far, and what followed their latest earlier occurrence is the
draft. No model, no device work: strong when the reply copies from the
prompt (edits, code, RAG, JSON) or repeats itself.

`ModelDrafter` runs a small model with the same tokenizer, greedily, over
every drafting row at once: its own batch cache, a row's prompt read once
when it first drafts, then each step the row's new tokens in one
right-padded forward and k - 1 one-token forwards. Its cache is put back to
the row's known tokens after each draft (attention caches trimmed by the
same count for every row, gated-delta state restored from before the
drafts), so the next step reads only what the target kept. It runs without
LoRA adapters: a row with an adapter is drafted by the base draft model and
verified by the target with its adapter.

Drafters take every drafting row of a step at once
(`propose(states, pendings, limits)`), so a model drafter batches them.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from worker.engine.batch_cache import BatchCache
from worker.engine.compiled_step import CompiledDecode


class NgramState:
    """One row's tokens and, per n-gram, where its latest earlier
    occurrence was followed (the index of the following token)."""

    __slots__ = ("tokens", "follows", "max_n")

    def __init__(self, tokens: list[int], max_n: int):
        self.tokens: list[int] = []
        self.follows: dict[tuple[int, ...], int] = {}
        self.max_n = max_n
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        seq = self.tokens
        follows = self.follows
        for token in tokens:
            end = len(seq)
            # The n-grams ending just before this token are followed by it.
            for n in range(1, min(self.max_n, end) + 1):
                follows[tuple(seq[end - n : end])] = end
            seq.append(token)


class NgramDrafter:
    name = "ngram"
    # Whether its drafts' acceptance depends on the request's text rather
    # than on a model pair (worker.engine.speculate: new rows do not inherit
    # earlier rows' pauses).
    per_request = True

    def __init__(self, max_n: int = 3, min_n: int = 2):
        self.max_n = max_n
        self.min_n = min_n

    def state(self, tokens: list[int]) -> NgramState:
        return NgramState(tokens, self.max_n)

    def forget(self, states) -> None:
        pass

    def propose(self, states: list, pendings: list[int | None], limits: list[int]) -> list[list[int]]:
        """Up to limits[i] tokens to follow row i's tokens and pendings[i]
        (its token about to be fed; None when that is its last prompt
        token, already in its state)."""
        return [self._one(s, p, k) for s, p, k in zip(states, pendings, limits)]

    def _one(self, state: NgramState, pending: int | None, k: int) -> list[int]:
        if k <= 0:
            return []
        tokens = state.tokens
        tail = [] if pending is None else [pending]
        size = len(tokens) + len(tail)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            key = tuple(tokens[len(tokens) - (n - len(tail)) :] + tail) if n > len(tail) else tuple(tail[-n:])
            start = state.follows.get(key)
            if start is not None:
                return _continued(tokens, tail, start, k)
        return []


def _continued(tokens: list[int], tail: list[int], start: int, k: int) -> list[int]:
    """k tokens from `start` on in tokens + tail, then on in the draft
    itself: a match within the last few tokens is a loop (text repeating a
    short piece), and a loop's next tokens are its own earlier ones, so the
    draft goes round it again rather than stop where the known tokens end."""
    known = len(tokens) + len(tail)
    draft: list[int] = []
    for i in range(start, start + k):
        draft.append(tokens[i] if i < len(tokens) else tail[i - len(tokens)] if i < known else draft[i - known])
    return draft


class History:
    """A row's tokens, as a model drafter needs them."""

    __slots__ = ("tokens",)

    def __init__(self, tokens: list[int]):
        self.tokens = list(tokens)

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)


# The longest piece of a row's tokens a draft model reads in one forward
# (a row's prompt when it first drafts, or the text of a long pause).
READ_PIECE = 256


class BatchRows:
    """A drafter's rows in the order of its own batch cache: `_rows` holds
    their states, `_cache` one row each (None while it has none)."""

    def __init__(self) -> None:
        self._rows: list = []
        self._cache: BatchCache | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self._cache is None else self._cache.nbytes

    def forget(self, states) -> None:
        self._drop({id(s) for s in states})

    def _drop(self, gone: set[int]) -> list[int] | None:
        """Drops the rows whose state is in `gone` (by id); returns the kept
        rows' indices, None when none was dropped."""
        keep = [i for i, s in enumerate(self._rows) if id(s) not in gone]
        if len(keep) == len(self._rows):
            return None
        self._rows = [self._rows[i] for i in keep]
        if keep:
            self._cache.filter(keep)
        else:
            self._cache = None
        return keep


class ModelDrafter(BatchRows):
    name = "model"

    def __init__(self, model):
        super().__init__()
        self.model = model
        # The draft's one-token forwards, compiled as the target's decode
        # step is: a small draft model's step is bound by building its graph
        # op by op (CPU, demo draft of 2 layers, 3 chained tokens: about
        # half the time compiled; bench/speculative.py).
        self.compiled = CompiledDecode(model)
        self._fed: list[int] = []  # tokens in the cache, per row

    def state(self, tokens: list[int]) -> History:
        return History(tokens)

    def _drop(self, gone: set[int]) -> list[int] | None:
        keep = super()._drop(gone)
        if keep is not None:
            self._fed = [self._fed[i] for i in keep]
        return keep

    def propose(self, states: list[History], pendings: list[int | None], limits: list[int]) -> list[list[int]]:
        k = max(limits, default=0)
        if k <= 0:
            return [[] for _ in states]
        contexts = {id(s): s.tokens if p is None else s.tokens + [p] for s, p in zip(states, pendings)}
        self._admit(states, contexts)
        # Rows here that do not draft this step (the caller left them out)
        # still read their new tokens, so every row feeds the same count.
        for s in self._rows:
            contexts.setdefault(id(s), s.tokens)
        layers = self._cache.layers
        known = [contexts[id(s)] for s in self._rows]
        got = self._drafted_compiled(known, layers, k)
        if got is None:
            got = self._drafted(known, layers, k)
        per_row, saved = got
        for c, arrays in zip(layers, saved):
            if arrays is not None:
                c.cache = arrays
            elif k > 1:
                c.trim(k - 1)
        where = {id(s): i for i, s in enumerate(self._rows)}
        return [per_row[where[id(s)]][:n] for s, n in zip(states, limits)]

    def _drafted(self, contexts: list[list[int]], layers: list, k: int) -> tuple[list[list[int]], list]:
        """Each row's k drafted tokens, op by op (one-token forwards
        compiled); and each gated-delta layer's state before the drafts
        (None for attention layers)."""
        last = self._catch_up(contexts)
        saved = [list(c.cache) if type(c) is ArraysCache else None for c in layers]
        tokens = mx.argmax(last, axis=-1)
        drafted = [tokens]
        compiled = self.compiled.decodes(layers)
        for _ in range(k - 1):
            logits = self.compiled.forward(tokens, layers) if compiled else self.model(tokens[:, None], cache=layers)[:, -1, :]
            tokens = mx.argmax(logits, axis=-1)
            drafted.append(tokens)
        return mx.stack(drafted, axis=1).tolist(), saved

    def _drafted_compiled(self, contexts: list[list[int]], layers: list, k: int) -> tuple[list[list[int]], list] | None:
        """`_drafted` as one compiled block (the read of the rows' new tokens
        and the k - 1 forwards after it, chained without a read-back), when
        every row has the same number of new tokens, no more than a step
        keeps (its pending token and k drafts); else None. A longer read (a
        row back from a pause) would trace a shape met once."""
        new = {len(c) - f for c, f in zip(contexts, self._fed)}
        if len(new) != 1 or not 0 < (width := new.pop()) <= k + 1 or not self.compiled.steppable(layers):
            return None
        x = mx.array([c[f:] for c, f in zip(contexts, self._fed)], dtype=mx.uint32)
        outputs = self.compiled.block(f"draft-{k}", self._chained(k), x, layers, written=width + k - 1)
        if outputs is None:
            return None
        self._fed = [f + width for f in self._fed]
        pairs = iter(outputs[1:])
        saved = [[next(pairs), next(pairs)] if type(c) is ArraysCache else None for c in layers]
        return outputs[0].tolist(), saved

    def _chained(self, k: int):
        def run(inputs: mx.array, layers: list) -> list:
            tokens = mx.argmax(self.model(inputs, cache=layers)[:, -1, :], axis=-1)
            # The gated-delta states before the drafts: what the row keeps.
            saved = [a for c in layers if not hasattr(c, "keys") for a in c.cache]
            drafted = [tokens]
            for _ in range(k - 1):
                tokens = mx.argmax(self.model(tokens[:, None], cache=layers)[:, -1, :], axis=-1)
                drafted.append(tokens)
            return [mx.stack(drafted, axis=1), *saved]

        return run

    def _admit(self, states: list[History], contexts: dict) -> None:
        """Rows new to the draft model read all but their last known token."""
        known = {id(s) for s in self._rows}
        for s in states:
            if id(s) in known:
                continue
            cache = make_prompt_cache(self.model)
            context = contexts[id(s)]
            for start in range(0, len(context) - 1, READ_PIECE):
                self.model(mx.array(context[start : min(start + READ_PIECE, len(context) - 1)])[None], cache=cache)
            one = BatchCache.lone(cache)
            self._cache = one if self._cache is None else self._cache.extend(one)
            self._rows.append(s)
            self._fed.append(len(context) - 1)
            known.add(id(s))

    def _catch_up(self, contexts: list[list[int]]) -> mx.array:
        """Feeds each row its tokens not yet read; returns (rows, V) logits
        after each row's last one."""
        cache = self._cache
        last = None
        while True:
            pieces = [c[f : f + READ_PIECE] for c, f in zip(contexts, self._fed)]
            lengths = [len(p) for p in pieces]
            width = max(lengths)
            x = mx.array([p + [0] * (width - len(p)) for p in pieces], dtype=mx.uint32)
            if cache.merged and width * len(pieces) > sum(lengths):
                cache.pad(lengths, width)
            logits = self.model(x, cache=cache.layers)
            if cache.merged:
                cache.unpad()
            self._fed = [f + n for f, n in zip(self._fed, lengths)]
            got = logits[mx.arange(len(pieces)), mx.array([max(n - 1, 0) for n in lengths])]
            # A row with nothing left to read keeps the logits it had.
            last = got if last is None else mx.where(mx.array([n > 0 for n in lengths])[:, None], got, last)
            if all(f == len(c) for f, c in zip(self._fed, contexts)):
                return last
