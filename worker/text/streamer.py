"""Per-row streaming: token ids in, `@@lattice` lines out.

A RowStream turns one request's tokens into its event lines: UTF-8-safe
detokenizing, stop strings, the reasoning budget, max_tokens, end-of-sequence
ids, timing, and the final line. It never touches the model; the generator
(worker.engine.generator) produces the ids.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ipc.events import encode_done, encode_token, encode_token_logprobs, tokens_per_second
from ipc.messages import Generate
from worker.text.tokenizer import StopMatcher, TextCodec

Emit = Callable[[bytes], None]


def think_open(prompt: list[int], start: int | None, end: int | None) -> bool:
    """Whether `prompt` leaves a <think> block open (the model's reply starts
    inside it, as after Qwen3.5's generation prompt)."""
    if start is None or end is None:
        return False
    last_open = max((i for i, t in enumerate(prompt) if t == start), default=-1)
    last_close = max((i for i, t in enumerate(prompt) if t == end), default=-1)
    return last_open > last_close


class ThinkBudget:
    """Counts tokens inside <think> and says when </think> must be forced."""

    __slots__ = ("start", "end", "budget", "inside", "count")

    def __init__(self, start: int | None, end: int | None, budget: int | None, prompt: list[int]):
        self.start, self.end = start, end
        self.budget = budget if (budget is not None and start is not None and end is not None) else None
        self.inside = False
        self.count = 0
        if self.budget is not None and think_open(prompt, start, end):
            # The generation prompt has already opened the block.
            self.inside = True
            self.count = len(prompt) - 1 - max(i for i, t in enumerate(prompt) if t == start)

    def must_close(self) -> bool:
        return self.budget is not None and self.inside and self.count >= self.budget

    def observe(self, token: int) -> None:
        if self.budget is None:
            return
        if token == self.start:
            self.inside, self.count = True, 0
        elif token == self.end:
            self.inside = False
        elif self.inside:
            self.count += 1


class RowStream:
    """One request's event lines. `feed` takes each generated token and
    returns the finish reason once the request is over; `finish` writes the
    tail and the final line (exactly once)."""

    def __init__(self, req: Generate, ids: list[int], codec: TextCodec, emit: Emit, arrived: float):
        self.id_json = req.id_json
        self.prompt_tokens = len(ids)
        self.max_tokens = req.max_tokens
        self.think = ThinkBudget(codec.think_start, codec.think_end, req.reasoning_budget, ids)
        self.think_end = codec.think_end
        self._eos = codec.eos_ids
        self._detok = codec.detokenizer()
        self._stops = StopMatcher(req.stop)
        self._emit = emit
        self.t0 = arrived
        self.ttft_ms = 0.0
        self.generated: list[int] = []
        self._stopped_by_string = False
        self._codec = codec
        # Entries of the tokens fed since the last line, for a request that
        # asked for log-probabilities (None: it did not).
        self._logprobs: list[dict] | None = None if req.logprobs is None else []

    def must_close_think(self) -> bool:
        """True when the next token must be </think> (the budget is spent)."""
        return self.think.must_close()

    def draft_limit(self) -> int:
        """The most tokens the row may draft past its pending one: a drafted
        block ends at max_tokens, and a reasoning budget is spent at its
        last token at the latest, so that a forced </think> comes where it
        would without drafts (worker.engine.speculate)."""
        limit = self.max_tokens - len(self.generated) - 1
        think = self.think
        if think.budget is not None:
            limit = min(limit, think.budget - think.count - 1 if think.inside else think.budget)
        return max(0, limit)

    def feed(self, token: int, logprob: tuple[int, float, list[tuple[int, float]]] | None = None) -> str | None:
        """Streams one generated token (with its log-probabilities, for a
        request that asked); returns the finish reason when the request
        ends with it (then call finish), else None."""
        if token in self._eos:
            return "stop"
        self.generated.append(token)
        if self._logprobs is not None and logprob is not None:
            self._logprobs.append(self._entry(logprob))
        self.think.observe(token)
        text, hit = self._stops.feed(self._detok.add(token))
        if text:
            self._write(text)
        if hit:
            self._stopped_by_string = True
            return "stop"
        if len(self.generated) >= self.max_tokens:
            return "length"
        return None

    def _piece(self, token: int) -> dict:
        raw = self._codec.token_bytes(token)
        text = raw.decode("utf-8", "replace")
        # The bytes are written only where the text cannot give them back
        # (a token that holds part of a character).
        return {"token": text} if text.encode("utf-8") == raw else {"token": text, "bytes": list(raw)}

    def _entry(self, logprob: tuple[int, float, list[tuple[int, float]]]) -> dict:
        token, value, top = logprob
        return {**self._piece(token), "logprob": value, "top_logprobs": [{**self._piece(t), "logprob": v} for t, v in top]}

    def _write(self, text: str) -> None:
        if not self.ttft_ms:
            self.ttft_ms = (time.perf_counter() - self.t0) * 1000.0
        if self._logprobs is None:
            self._emit(encode_token(text, self.id_json))
            return
        self._emit(encode_token_logprobs(text, self._logprobs, self.id_json))
        self._logprobs = []

    def finish(self, reason: str, cached_tokens: int = 0, drafts: tuple[int, int] | None = None) -> None:
        """`drafts`: (drafted, accepted) tokens when the request ran with a
        drafter, for the final line."""
        if not self._stopped_by_string:
            tail, hit = self._stops.feed(self._detok.flush())
            if hit:
                reason = "stop"
            else:
                tail += self._stops.flush()
            if tail or self._logprobs:
                # Tokens whose text never came out (held back, or none)
                # still have their entries.
                self._write(tail)
        total_ms = int((time.perf_counter() - self.t0) * 1000.0)
        gen_tokens = len(self.generated)
        self._emit(
            encode_done(
                tok_s=tokens_per_second(gen_tokens, total_ms),
                ttft_ms=self.ttft_ms,
                prompt_tokens=self.prompt_tokens,
                gen_tokens=gen_tokens,
                total_ms=total_ms,
                finish_reason=reason,
                cached_tokens=cached_tokens or None,
                drafted_tokens=None if drafts is None else drafts[0],
                accepted_tokens=None if drafts is None else drafts[1],
                id_json=self.id_json,
            )
        )
