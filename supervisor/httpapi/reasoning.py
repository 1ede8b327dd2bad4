"""Thinking text apart from the answer, for `reasoning_content`.

A thinking model writes its reasoning inside <think>...</think>: either the
chat template's generation prompt opens the block (Qwen3.5: the reply
starts inside it and only `</think>` shows in the output), or the model
writes `<think>` itself first (Qwen3). The worker says which in its
`ready` line (`opens_think`). Text inside the block is reasoning, text
after it the answer; the tags themselves are dropped, and so are the
newlines the model puts right after `</think>` (as Qwen's templates drop
them from history).

The worker emits each tag as one piece of text, but a stop-string matcher
may hold text back and release it joined or split differently, so a tag is
looked for across pieces: a tail that may be the start of one waits for
the next piece.
"""

from __future__ import annotations

OPEN = "<think>"
CLOSE = "</think>"

Pieces = list[tuple[bool, str]]  # (is reasoning, text)


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper start of `tag`."""
    start = text.rfind("<", max(0, len(text) - len(tag) + 1))
    if start < 0:
        return 0
    tail = text[start:]
    return len(tail) if tag.startswith(tail) else 0


class ThinkSplitter:
    def __init__(self, inside: bool):
        self.inside = inside
        self.thought = inside  # the reply has a reasoning part (maybe empty)
        self._may_open = not inside  # nothing but whitespace so far: <think> may still open
        self._held = ""
        self._trim = False  # drop the newlines that follow </think>

    def settled(self) -> bool | None:
        """True inside the block, False in the answer, when nothing is held
        back and the next piece's kind depends only on a tag in it (the
        caller's fast path); None otherwise."""
        if self._held or self._trim or self._may_open:
            return None
        return self.inside

    def feed(self, text: str) -> Pieces:
        text = self._held + text
        self._held = ""
        out: Pieces = []
        while text:
            if self.inside:
                end = text.find(CLOSE)
                if end < 0:
                    keep = _partial_tag(text, CLOSE)
                    out.append((True, text[: len(text) - keep]))
                    self._held = text[len(text) - keep :]
                    break
                out.append((True, text[:end]))
                text = text[end + len(CLOSE) :]
                self.inside = False
                self._trim = True
                continue
            if self._may_open:
                stripped = text.lstrip()
                if stripped.startswith(OPEN):
                    text = stripped[len(OPEN) :]
                    self.inside = self.thought = True
                    self._may_open = False
                    continue
                if OPEN.startswith(stripped):  # whitespace, or the start of the tag
                    self._held = text
                    break
                self._may_open = False
            if self._trim:
                text = text.lstrip("\n")
                if not text:
                    break
                self._trim = False
            out.append((False, text))
            break
        return [(kind, piece) for kind, piece in out if piece]

    def flush(self) -> Pieces:
        """What was held back, at the end of the reply."""
        held, self._held = self._held, ""
        return [(self.inside, held)] if held else []
