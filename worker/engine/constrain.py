"""Structured output (docs/structured-output.md): a request's response_format, compiled by
llguidance into a per-row token mask.

llguidance does the work: JSON Schema, regex and Lark to a grammar, the
token-level parser, the bitmask of allowed tokens. This module holds what is
the pool's own: one tokenizer view per worker, a bounded cache of compiled
grammars, the think-then-answer rule, and masks applied per row of a batch.

How the engine drives it (worker.engine.scheduler, worker.engine.generator;
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
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import mlx.core as mx
import msgspec
import numpy as np
from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

from ipc.messages import GrammarFormat, JsonObjectFormat, JsonSchemaFormat, RegexFormat, ResponseFormat
from worker.engine.schema_refs import too_deep, unmatchable_ref
from worker.runtime.cpu_backend import usable_cores

# Compiled grammars kept per worker, least recently used out. One takes about
# a millisecond to compile and ~25 KB (the test schema, 151k vocabulary), so
# the bound is about memory a client could pile up, not speed. Each keeps at
# most one separately compiled matcher per mask thread (see Constraints.row).
GRAMMAR_CACHE_SIZE = 64


def default_mask_threads() -> int:
    """Threads that fill a batch's masks: a quarter of the usable cores, 1
    to 4. The masks fill beside the forward pass and only need to be done
    by its end. On a 16-core H200 host llguidance's own default (80 % of
    the cores: 12) decoded 8 rows of a 151k vocabulary no faster than 4
    threads (0.82 vs 0.81x the free speed) and took more CPU, and each
    thread may cost a grammar one more compiled matcher (Constraints.row)."""
    return min(4, max(1, usable_cores() // 4))


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


# A compiled grammar's cache key: its response_format as msgpack (a
# format holds a schema's dicts, so it cannot be a key itself).
_key = msgspec.msgpack.Encoder().encode


def grammar_of(fmt: ResponseFormat) -> tuple[str, str]:
    """What a response_format asks for, and its llguidance grammar."""
    matcher = llguidance.LLMatcher
    try:
        if isinstance(fmt, JsonObjectFormat):
            grammar = matcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_DEFAULTS)
        elif isinstance(fmt, JsonSchemaFormat):
            # Before llguidance sees it: it would overflow its stack on the
            # one, and compile the other to a grammar that allows only the end.
            problem = too_deep(fmt.json_schema.schema) or unmatchable_ref(fmt.json_schema.schema)
            if problem:
                raise ConstraintError(f"invalid response_format: {problem}")
            grammar = matcher.grammar_from_json_schema(fmt.json_schema.schema, defaults=_JSON_DEFAULTS)
        elif isinstance(fmt, RegexFormat):
            grammar = matcher.grammar_from_regex(fmt.pattern)
        else:
            grammar = matcher.grammar_from_lark(fmt.grammar)
    except ValueError as exc:
        raise ConstraintError(f"invalid response_format: {exc}") from exc
    return _KINDS[type(fmt)], grammar


class CompiledFormat:
    """One response_format, compiled: its llguidance grammar and separately
    compiled matchers ("lexers", the first one built at once), each with the
    rows that copy it."""

    __slots__ = ("kind", "grammar", "lexers")

    def __init__(self, kind: str, grammar: str, first: llguidance.LLMatcher):
        self.kind, self.grammar = kind, grammar
        self.lexers: list[_Lexer] = [_Lexer(first)]


class _Lexer:
    __slots__ = ("matcher", "rows")

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher
        self.rows: weakref.WeakSet[RowConstraint] = weakref.WeakSet()  # live rows copying it


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
        lexers: int = 1,
    ):
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self.think_start, self.think_end = think_start, think_end
        self._tokenizer_json = tokenizer_json
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[bytes, CompiledFormat] = OrderedDict()
        self._cache_size = cache_size
        self._lexers = max(1, lexers)

    @classmethod
    def for_codec(cls, codec, vocab_size: int, lexers: int = 1) -> Constraints:
        return cls(codec.tokenizer.to_str(), vocab_size, codec.eos_ids, codec.think_start, codec.think_end, lexers=lexers)

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

    def compile(self, fmt: ResponseFormat) -> CompiledFormat:
        """This response_format, compiled once and cached. Raises
        ConstraintError."""
        key = _key(fmt)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        kind, grammar = grammar_of(fmt)
        compiled = CompiledFormat(kind, grammar, self._matcher(kind, grammar))
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _matcher(self, kind: str, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.prepare(), grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(f"invalid {kind} in response_format: {matcher.get_error()}")
        return matcher

    def row(self, fmt: ResponseFormat, prompt: Sequence[int]) -> RowConstraint:
        """The constraint of one request. When the prompt leaves a think block
        open, the grammar starts after the model's `</think>`.

        A row gets a copy of a compiled matcher. llguidance's copies share
        the original's lexer (a DFA built as it goes) behind one lock, so
        the masks of rows copying one matcher fill one at a time, however
        many threads the batch's fill has (2 threads, 8 rows of one schema,
        151k vocabulary: 2.96 ms a step, against 1.62 for separately
        compiled matchers). A row therefore copies the matcher with the
        fewest live rows, and a grammar compiles another (up to `lexers`,
        one per mask thread) when every one it has is in use."""
        compiled = self.compile(fmt)
        with self._lock:
            lexer = min(compiled.lexers, key=lambda lx: len(lx.rows))
            grow = bool(lexer.rows) and len(compiled.lexers) < self._lexers
        if grow:
            lexer = _Lexer(self._matcher(compiled.kind, compiled.grammar))
            with self._lock:
                compiled.lexers.append(lexer)
        start_after = self.think_end if self._thinking(prompt) else None
        row = RowConstraint(lexer.matcher.deep_copy(), start_after, lexer)
        lexer.rows.add(row)
        return row

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

    __slots__ = ("matcher", "start_after", "lexer", "__weakref__")

    def __init__(self, matcher: llguidance.LLMatcher, start_after: int | None = None, lexer: _Lexer | None = None):
        self.matcher = matcher
        self.start_after = start_after
        self.lexer = lexer  # the compiled matcher it copies

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

    def __init__(self, vocab_size: int, eos_ids: Iterable[int], threads: int | None = None):
        self.vocab_size = vocab_size
        self.threads = default_mask_threads() if threads is None else max(1, threads)
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
        active: list[tuple[RowConstraint, int]] = []
        for i, r in enumerate(rows):
            if r is None:
                continue
            if r.start_after is None:
                active.append((r, i))
            else:
                bits[i] = self._no_eos
        if len(active) == 1:
            fill_next_token_bitmask(active[0][0].matcher, bits, active[0][1])
        elif active:
            # Rows copying one matcher side by side: their fills take its
            # lock in turn, so they had better be one thread's run.
            active.sort(key=lambda a: id(a[0].lexer))
            fill_next_token_bitmask_par(_executor(self.threads), [(r.matcher, i) for r, i in active], bits)
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


_shared: dict[int, llguidance.LLExecutor] = {}
_shared_lock = threading.Lock()


def _executor(threads: int) -> llguidance.LLExecutor:
    """One llguidance thread pool per process, of the size last asked for (a
    worker asks for one size). Measured: with a second, idle pool alive,
    masks filled through either no longer overlapped with mlx's CPU
    forward pass (17.2 ms a step overlapped vs 17.1 sequential, against
    13.3 with one pool)."""
    with _shared_lock:
        if threads not in _shared:
            _shared.clear()
            _shared[threads] = llguidance.LLExecutor(num_threads=threads)
        return _shared[threads]


# llguidance's MLX helper is a Metal kernel; this is the same bit test in
# plain MLX ops, so it runs on the CPU and CUDA backends too.
@mx.compile
def _apply(logits: mx.array, bits: mx.array) -> mx.array:
    allowed = mx.right_shift(bits[:, :, None], mx.arange(32, dtype=mx.int32)) & 1
    allowed = allowed.reshape(bits.shape[0], -1)[:, : logits.shape[1]]
    return mx.where(allowed.astype(mx.bool_), logits, mx.array(-mx.inf, dtype=logits.dtype))
