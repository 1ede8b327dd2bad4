"""Drafters: cheap guesses of a row's next tokens, checked by the target model.

A drafter proposes up to k tokens per row; worker.speculate verifies every
row's proposal in one forward of the target model and keeps the longest
prefix the target would have produced itself. Drafts are deterministic (one
token per position, no distribution), which is what makes the acceptance
rule a plain comparison with the target's own draw (worker.speculate).

`NgramDrafter` is prompt lookup: the row's last n tokens (n from
`max_n` down to `min_n`) are looked up among its earlier tokens, prompt and
text so far, and what followed their latest earlier occurrence is the
draft. No model, no device work: strong when the reply copies from the
prompt (edits, code, RAG, JSON) or repeats itself.
"""

from __future__ import annotations


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

    def __init__(self, max_n: int = 3, min_n: int = 2):
        self.max_n = max_n
        self.min_n = min_n

    def state(self, tokens: list[int]) -> NgramState:
        return NgramState(tokens, self.max_n)

    def propose(self, state: NgramState, pending: int | None, k: int) -> list[int]:
        """Up to k tokens to follow the row's tokens and `pending` (its
        token about to be fed, None when that is its last prompt token,
        already in `state`)."""
        if k <= 0:
            return []
        tokens = state.tokens
        tail = [] if pending is None else [pending]
        size = len(tokens) + len(tail)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            key = tuple(tokens[len(tokens) - (n - len(tail)) :] + tail) if n > len(tail) else tuple(tail[-n:])
            start = state.follows.get(key)
            if start is not None:
                # A loop may run into the tokens just proposed: the draft
                # then stops where the known tokens end.
                draft = tokens[start : start + k]
                if len(draft) < k and tail:
                    draft += tail[: k - len(draft)]
                return draft
        return []
