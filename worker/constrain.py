"""Structured output (SPEC §11): a request's response_format, compiled by
llguidance into a per-row token mask.

llguidance does the work: JSON Schema, regex and Lark to a grammar, the
token-level parser, the bitmask of allowed tokens. This module holds what is
the pool's own: one tokenizer view per worker, a bounded cache of compiled
grammars, the think-then-answer rule, and masks applied per row of a batch.

How the engine drives it (worker.scheduler, worker.generator;
docs/structured-output.md has the whole step):

    row = constraints.row(req.response_format, prompt_ids)   # at submit; ConstraintError -> bad_request
    ...
    row.advance(token)                                       # every token the row commits, forced ones too
    pending = masks.fill_async(rows)                         # masks on a side thread...
    mx.async_eval(logits := model(y, cache))                 # ...while the forward pass runs (GPU: is built too)
    nxt = sampler(masks.apply(logits, pending.result()), y)  # logits untouched when no row is constrained
    if row.done: finish = "stop"                             # the grammar cannot go on
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable, Sequence

import llguidance
import mlx.core as mx
import numpy as np
from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

from ipc.messages import GrammarFormat, JsonObjectFormat, JsonSchemaFormat, RegexFormat, decode_response_format

# Compiled grammars kept per worker, least recently used out. One takes about
# a millisecond to compile and ~25 KB (the test schema, 151k vocabulary), so
# the bound is about memory a client could pile up, not speed.
GRAMMAR_CACHE_SIZE = 64

# Compact JSON: the separators are fixed, so a looping model cannot pad a
# reply with whitespace until max_tokens. A schema may opt back in with
# "x-guidance": {"whitespace_flexible": true}.
_JSON_DEFAULTS = {"whitespace_flexible": False}


class ConstraintError(ValueError):
    """A response_format that cannot be compiled; the message is fit for a
    bad_request event."""


class ConstraintViolation(RuntimeError):
    """A committed token the grammar rejects: only a forced token can do it,
    since sampling is masked."""


_KINDS = {JsonObjectFormat: "json_object", JsonSchemaFormat: "JSON schema", RegexFormat: "regex", GrammarFormat: "grammar"}


def grammar_of(text: str) -> tuple[str, str]:
    """What a response_format (JSON text) asks for, and its llguidance grammar."""
    try:
        fmt = decode_response_format(text)
    except ValueError as exc:
        raise ConstraintError(str(exc)) from exc
    matcher = llguidance.LLMatcher
    try:
        if isinstance(fmt, JsonObjectFormat):
            grammar = matcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_DEFAULTS)
        elif isinstance(fmt, JsonSchemaFormat):
            grammar = matcher.grammar_from_json_schema(fmt.json_schema.schema, defaults=_JSON_DEFAULTS)
        elif isinstance(fmt, RegexFormat):
            grammar = matcher.grammar_from_regex(fmt.pattern)
        else:
            grammar = matcher.grammar_from_lark(fmt.grammar)
    except ValueError as exc:
        raise ConstraintError(f"invalid response_format: {exc}") from exc
    return _KINDS[type(fmt)], grammar


class Constraints:
    """One worker's view of its tokenizer for llguidance, and its compiled
    grammars. The view (0.6-1.7 s and 88 MB for a 151k vocabulary, 3 ms for
    the demo's) is built on first use or by prepare()."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_ids: Iterable[int],
        think_start: int | None = None,
        think_end: int | None = None,
        cache_size: int = GRAMMAR_CACHE_SIZE,
    ):
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self.think_start, self.think_end = think_start, think_end
        self._tokenizer_json = tokenizer_json
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size

    @classmethod
    def for_codec(cls, codec, vocab_size: int) -> "Constraints":
        return cls(codec.tokenizer.to_str(), vocab_size, codec.eos_ids, codec.think_start, codec.think_end)

    def prepare(self) -> llguidance.LLTokenizer:
        """The tokenizer view; ConstraintError when llguidance cannot read
        this tokenizer (then structured output is unavailable here)."""
        with self._lock:
            if self._tokenizer is None:
                # EOS ids are the tokens the mask allows once the grammar accepts.
                try:
                    self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_ids)
                except ValueError as exc:
                    raise ConstraintError(f"response_format is unavailable for this model's tokenizer: {exc}") from exc
            return self._tokenizer

    def compile(self, text: str) -> llguidance.LLMatcher:
        """A pristine matcher for this response_format, compiled once and
        cached; rows get copies. Raises ConstraintError."""
        with self._lock:
            hit = self._cache.get(text)
            if hit is not None:
                self._cache.move_to_end(text)
                return hit
        kind, grammar = grammar_of(text)
        matcher = llguidance.LLMatcher(self.prepare(), grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(f"invalid {kind} in response_format: {matcher.get_error()}")
        with self._lock:
            self._cache[text] = matcher
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return matcher

    def row(self, text: str, prompt: Sequence[int]) -> "RowConstraint":
        """The constraint of one request. When the prompt leaves a think block
        open, the grammar starts after the model's `</think>`."""
        matcher = self.compile(text).deep_copy()
        start_after = self.think_end if self._thinking(prompt) else None
        return RowConstraint(matcher, start_after)

    def _thinking(self, prompt: Sequence[int]) -> bool:
        if self.think_start is None or self.think_end is None:
            return False
        for token in reversed(prompt):
            if token == self.think_end:
                return False
            if token == self.think_start:
                return True
        return False


class RowConstraint:
    """One row's grammar state. Inactive until `start_after` has been
    committed (None: active at once); while inactive the row may write
    anything but an end-of-sequence token."""

    __slots__ = ("matcher", "start_after")

    def __init__(self, matcher: llguidance.LLMatcher, start_after: int | None = None):
        self.matcher = matcher
        self.start_after = start_after

    @property
    def active(self) -> bool:
        return self.start_after is None

    @property
    def done(self) -> bool:
        """The grammar is complete and admits no further token: end the row
        with finish_reason stop."""
        return self.start_after is None and self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.start_after is None and self.matcher.is_accepting()

    def advance(self, token: int) -> None:
        """Commits a token the row has generated (or was forced to)."""
        if self.start_after is not None:
            if token == self.start_after:
                self.start_after = None
            return
        if not self.matcher.consume_token(token):
            # The first line says what broke; the rest is a dump of the parser and the grammar.
            raise ConstraintViolation(f"token {token} breaks the response_format: {self.matcher.get_error().partition(chr(10))[0]}")


class BatchMasks:
    """Token masks for the rows of a (B, V) logits batch. Rows without a
    constraint cost nothing; a step with none costs one Python loop."""

    def __init__(self, vocab_size: int, eos_ids: Iterable[int]):
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._side: ThreadPoolExecutor | None = None
        self._no_eos = np.full(self.words, -1, dtype=np.int32)
        for token in eos_ids:
            if token < vocab_size:
                self._no_eos.view(np.uint32)[token // 32] &= ~np.uint32(1 << (token % 32))

    def fill(self, rows: Sequence[RowConstraint | None]) -> np.ndarray | None:
        """A (B, ceil(V/32)) int32 bitmask for this step, or None when no row
        is constrained. Several rows go to llguidance's thread pool in one
        call; llguidance drops the GIL while it works."""
        if all(r is None for r in rows):
            return None
        bits = np.full((len(rows), self.words), -1, dtype=np.int32)
        active: list[tuple[llguidance.LLMatcher, int]] = []
        for i, r in enumerate(rows):
            if r is None:
                continue
            if r.start_after is None:
                active.append((r.matcher, i))
            else:
                bits[i] = self._no_eos
        if len(active) == 1:
            fill_next_token_bitmask(active[0][0], bits, active[0][1])
        elif active:
            fill_next_token_bitmask_par(_executor(), active, bits)
        return bits

    def fill_async(self, rows: Sequence[RowConstraint | None]) -> Future:
        """fill() on a side thread; its result() is fill()'s. Start it before
        the forward pass is handed to mlx (on a GPU, before it is built),
        then wait: mlx's CPU backend computes inside mx.eval and
        mx.async_eval on the calling thread (releasing the GIL), so only
        masks started before it overlap with it. One side thread: at most
        one step's masks are in flight."""
        if all(r is None for r in rows):
            done: Future = Future()
            done.set_result(None)
            return done
        if self._side is None:
            self._side = ThreadPoolExecutor(max_workers=1, thread_name_prefix="token-masks")
        return self._side.submit(self.fill, list(rows))

    def apply(self, logits: mx.array, bits: np.ndarray | None) -> mx.array:
        """Masked (B, V) logits; `logits` itself when `bits` is None. Rows
        whose mask is all ones come out bit-identical."""
        if bits is None:
            return logits
        return _apply(logits, mx.array(bits))

    def __call__(self, logits: mx.array, rows: Sequence[RowConstraint | None]) -> mx.array:
        return self.apply(logits, self.fill(rows))

    def warm_up(self, logits: mx.array, max_rows: int) -> None:
        """Compiles the mask kernel for every batch size up to max_rows
        (`logits`: one (1, V) row of the model's), so that a worker's first
        constrained request pays no compilation."""
        for rows in range(1, max_rows + 1):
            mx.eval(self.apply(mx.repeat(logits, rows, axis=0), np.full((rows, self.words), -1, dtype=np.int32)))


_shared: list[llguidance.LLExecutor] = []
_shared_lock = threading.Lock()


def _executor() -> llguidance.LLExecutor:
    """One llguidance thread pool per process (its default size: 80 % of the
    cores). Measured: with a second, idle pool alive, masks filled through
    either no longer overlapped with mlx's CPU forward pass (17.2 ms a step
    overlapped vs 17.1 sequential, against 13.3 with one pool)."""
    with _shared_lock:
        if not _shared:
            _shared.append(llguidance.LLExecutor())
        return _shared[0]


# llguidance's MLX helper is a Metal kernel; this is the same bit test in
# plain MLX ops, so it runs on the CPU and CUDA backends too.
@mx.compile
def _apply(logits: mx.array, bits: mx.array) -> mx.array:
    allowed = mx.right_shift(bits[:, :, None], mx.arange(32, dtype=mx.int32)) & 1
    allowed = allowed.reshape(bits.shape[0], -1)[:, : logits.shape[1]]
    return mx.where(allowed.astype(mx.bool_), logits, mx.array(-mx.inf, dtype=logits.dtype))
