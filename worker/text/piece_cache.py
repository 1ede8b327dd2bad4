"""Token ids of long prompt pieces, kept between requests.

An agent or a long chat sends the same system prompt (tools, files) with
every request, and the worker would tokenize all of it each time: 16-29 ms
for 26k tokens on a 2-core EPYC, on the engine's thread, before the prefix
cache can even be asked. A prompt is cut before each special token that
starts a turn (`<|im_start|>`), and the ids of each long piece are kept,
least recently used out past a bound, so the next request tokenizes only
the pieces it has not sent before.

The ids are the same as the whole prompt's: the tokenizer finds its added
tokens in the raw text first and tokenizes the text between them on its
own, so a cut just before such a token changes nothing, as long as no other
added token can match across the cut. `PieceCache.for_tokenizer` checks
that for each token it would cut before (none containing it, none ending
with its beginning, no strip or word rules) and tokenizes probe texts both
ways; a tokenizer that fails is never cut.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict

from tokenizers import Tokenizer

# Pieces shorter than this are tokenized each time: a lookup would cost
# about what it saves.
MIN_PIECE_CHARS = 4096
# Bounds of the kept pieces: their text (the keys) and their number. Four
# million characters hold 40-90 system prompts of 26k tokens (1.7-4
# characters a token), in 4-16 MB (Python keeps a text in 1, 2 or 4 bytes
# a character); their ids, 4 bytes a token, take 4-10 MB more.
MAX_TEXT_CHARS = 4 << 20
MAX_PIECES = 256
# Tokens a prompt is cut before, where the tokenizer has them: the turn
# starts of the chat formats the pool serves.
TURN_STARTS = ("<|im_start|>",)
_PROBES = (
    "Hello, world.\n{T}user\n  two  spaces\tand a tab{T}{T}assistant\n",
    " {T}x{T} y \n\n{T}",
    "e\u0301{T}\u0301 caf\u00e9 {T}\u00e9\n",
)


def _safe(token: str, added: list) -> bool:
    """Whether a cut just before `token` leaves every match of the
    tokenizer's added tokens where it was."""
    for t in added:
        if t.content == token:
            if t.lstrip or t.rstrip or t.single_word:
                return False
            continue
        if token in t.content or any(t.content.endswith(token[:k]) for k in range(1, len(token))):
            return False
    return True


class PieceCache:
    def __init__(self, tokenizer: Tokenizer, cut_before: list[str]):
        self._tokenizer = tokenizer
        self._cut = re.compile("|".join(map(re.escape, cut_before)))
        self._ids: OrderedDict[str, array] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> PieceCache | None:
        """A cache for this tokenizer, or None when it has no turn-start
        token that is safe to cut before."""
        added = list(tokenizer.get_added_tokens_decoder().values())
        tokens = [t for t in TURN_STARTS if tokenizer.token_to_id(t) is not None and _safe(t, added)]
        if not tokens:
            return None
        cache = cls(tokenizer, tokens)
        for probe in _PROBES:
            for token in tokens:
                text = probe.format(T=token)
                if cache._pieces_ids(text, keep=False) != tokenizer.encode(text, add_special_tokens=False).ids:
                    return None
        return cache

    def encode(self, text: str) -> list[int]:
        return self._pieces_ids(text, keep=True)

    def _pieces_ids(self, text: str, keep: bool) -> list[int]:
        cuts = [m.start() for m in self._cut.finditer(text) if m.start() > 0]
        ids: list[int] = []
        short_from = 0
        for start, end in zip([0, *cuts], [*cuts, len(text)]):
            if end - start < MIN_PIECE_CHARS and keep:
                continue
            if start > short_from:
                ids += self._tokenizer.encode(text[short_from:start], add_special_tokens=False).ids
            ids += self._piece(text[start:end], keep)
            short_from = end
        if short_from < len(text):
            ids += self._tokenizer.encode(text[short_from:], add_special_tokens=False).ids
        return ids

    def _piece(self, piece: str, keep: bool) -> list[int]:
        with self._lock:
            kept = self._ids.get(piece)
            if kept is not None:
                self._ids.move_to_end(piece)
                return kept.tolist()
        ids = self._tokenizer.encode(piece, add_special_tokens=False).ids
        if keep and len(piece) <= MAX_TEXT_CHARS:
            with self._lock:
                if piece not in self._ids:
                    self._ids[piece] = array("i", ids)
                    self._chars += len(piece)
                    while self._chars > MAX_TEXT_CHARS or len(self._ids) > MAX_PIECES:
                        old, _ = self._ids.popitem(last=False)
                        self._chars -= len(old)
        return ids
