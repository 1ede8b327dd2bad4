"""The token generator: advances a batch of rows by one token per step.

Rows come in (prompt ids, sampling state, adapter key) and per-step token
ids come out; nothing here knows about text or events. Each `step()`:

1. a decode step: every row of the decode batch gets one token. The next
   step is queued on the device before this step's tokens are read, so the
   device computes step t+1 while the caller streams step t.
2. one prefill chunk of the rows that are still reading their prompts (the
   "prefill group"): one batched forward, right-padded to the longest row's
   piece, in which each of the B rows reads up to S = max(prefill_step / B,
   64) prompt tokens (a lone row: prefill_step), and S / 4 more when that
   leaves no short piece before its prompt's end or a cut (a pass of a few
   tokens reads all the weights for almost no work). Decode rows therefore
   stall for at most one such chunk, about max(prefill_step, 64 B) tokens,
   per token. Rows admitted while a group reads join it at its next chunk;
   whenever rows join or leave, every reading row's remaining pieces are
   cut again for the new B. A row whose prompt is read (all but its last
   token) joins the decode batch; the last prompt token is its first decode
   input. Where no row decodes and the whole group ends its prompts in
   this chunk, the chunk reads the last tokens too and its logits at each
   row's last token give the first tokens (`_folds`).

The prefix cache is used per row: a row resumes from the longest stored
snapshot of its adapter and stores snapshots at its own chunk ends.

A hybrid model's state cannot be cut back, so its snapshots sit at message
starts, where chunks end. The prompt's last message start is the one the
next turn resumes from, but a chunk ending there puts a pass of a few
tokens (`<|im_start|>assistant\n`) in front of the first token, as long on
a GPU as a decode step, and the snapshot stored there, a copy of the whole
attention cache. So a lone request (no other row reading or decoding)
without an adapter may read through it instead (`defer_from`), and once
its first token is read a "ghost" row reads the prompt's last message
again up to there, stores that snapshot and leaves: on a GPU a pass of a
few hundred tokens costs about what one of a few does (a read of the
weights), so the pass moves from before the first token to after it, for
every prompt. Rows that start together keep the cut: their cut's pass is
shared, where each ghost would be a pass of its own among their decode
steps. On a CPU a pass costs its tokens' arithmetic: on a short chat
prompt reading the message twice cost more than the pass it saved, so
the cut stays there, but from CPU_DEFER_FROM tokens of prompt the
snapshot's copy before the first token costs more (`_deferrable`).

Each row runs with its own LoRA adapter (or none): `Row.slot` is its slot
in the model's stacked adapters (worker.lora.layers), routed before every
forward, and `Row.adapter` the adapter's content key, which the prefix
cache keys snapshots by.

Structured output: a row may carry a RowConstraint (worker.engine.constrain). A
decode step in which some row has one commits this step's tokens to the
constraints and masks the logits before sampling, the masks filled while
the forward pass runs (on a GPU, while it is built too); a step in which
none has one runs the plain path.

A mask depends on the token just read, so a constrained step cannot queue
the next step's forward pass before reading its tokens, as a free step
does. Running ahead (`run_ahead`, the default), it builds that pass right
after the masked draw instead, on the draw's lazy tokens. On mlx's CPU
backend it is handed to mlx at once, and mlx's CPU stream computes forward
t+1 while this thread reads token t, fills mask t+1 and builds forward t+2
(2-core CPU, 151k vocabulary, 8 rows: 0.954x a free step step by step,
1.022x ahead). On a GPU handing a pass over (launching its kernels) is
this thread's own work, and most of a small model's step there: done at
once it would put the masks in series with it (H200, 8 rows: 24.1 ms a
step against 16.9 step by step), so the pass built ahead is handed over
next step, beside the masks, and only the device's tail of the last step
hides behind its building. A row's pending token is then already fed when
the caller sees the one before it, so it cannot be forced: rows that may
be forced (a reasoning budget) and a prefill group about to join keep the
batch stepping one by one.

A constrained step's tokens go to `on_read` as soon as they are read: the
masked draw is handed to mlx after the forward pass it masks, and on mlx's
CPU backend that hand-over waits while the pass runs, so tokens returned
only at the step's end would reach the client a pass late. On a GPU they go
right after the step's forward pass is launched, so that the device
computes while the caller streams them.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from worker.cache.prefix_cache import PrefixCache, chunk_ends, cut_points, message_starts, tokens_of
from worker.engine.batch_cache import BatchCache, batchable
from worker.engine.compiled_step import CompiledDecode
from worker.engine.constrain import BatchMasks, ConstraintViolation, RowConstraint
from worker.engine.sampling import BatchSampler, RowSampling, StepLogprobs
from worker.engine.speculate import Speculator
from worker.engine.step_choice import TRIAL_AT_MOST
from worker.runtime.gated_delta import CHUNK
from worker.runtime.parts import last_position_only, model_parts, text_model

log = logging.getLogger("worker")

# The smallest prompt piece a row reads per forward in a group: the chunked
# gated-delta prefill's own chunk; smaller pieces gain no parallelism there.
MIN_PIECE = CHUNK
# A piece of at most 1/FOLD of a chunk left before a cut or the prompt's end
# is read with the chunk before it (chunk_ends), not in a pass of its own:
# 32 chat prompts of 53-80 tokens arriving together (64-token pieces each)
# are read in one pass.
FOLD = 4
# Ghost rows (deferred snapshots) waiting to start: beyond this many the
# oldest is dropped; its snapshot is then made by the next turn's prefill.
MAX_DEFERRED = 16
# A last message longer than this keeps its cut: a ghost would read it
# again (past a few hundred tokens a GPU's pass costs its arithmetic), to
# save one short pass in front of a first token that waits for the whole
# message anyway.
DEFER_AT_MOST = 512
# On a CPU, the prompt length from which a lone row reads through its last
# cut (`defer_from`). The tiny demo model, 2-core EPYC, a 40-token message
# after a system prompt of tool definitions, 5 alternated rounds
# (bench.last_snapshot --context-tokens), read through against the cut:
# the next turn's first token (a prefix cache hit) 0.86x at 1.1k tokens of
# prompt, 0.79x at 4.2k and 0.80x at 26k, its reply's decode rate (the
# ghost running beside its first steps) 0.89x, 0.95x and 0.92x; the small
# demo model at 106 tokens gained nothing on its first token, its decode
# rate 0.68-0.95x. At 26k a new question's first token (bench.prefix_hit,
# 7 rounds) took 20.0 ms read through, 43.9 ms with the cut.
CPU_DEFER_FROM = 4096

# mlx-lm architectures whose forward is the LM head (or the tied embedding)
# over the body's output, nothing after it: a group's last chunk may run the
# body and score each row's last position alone (TokenGenerator._folds).
FOLDABLE = frozenset({"qwen2", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "llama"})


@dataclass(eq=False)
class Row:
    """One request as the generator sees it."""

    rid: int
    ids: list[int]
    sampling: RowSampling
    adapter: str | None = None  # content key of its adapter
    slot: int | None = None  # its adapter's slot in the LoRA layers
    cached: int = 0  # prompt tokens resumed from the prefix cache
    pos: int = 0  # prompt tokens in the row's cache
    cuts: list[int] = field(default_factory=list)  # its message starts and checkpoints, where chunks end
    ends: list[int] = field(default_factory=list)  # remaining prefill chunk ends
    snapshots: set[int] = field(default_factory=set)  # where to store prefix snapshots
    tokens: np.ndarray | None = None  # ids as the prefix cache compares them, made at start
    deferred: int = 0  # the message start whose snapshot a ghost row reads after this row's prompt
    ghost: bool = False  # reads a prefix for its snapshot only: never decodes, streams nothing
    fresh: bool = True  # its decode input is still its last prompt token
    constraint: RowConstraint | None = None  # its response_format, if any
    broken: ConstraintViolation | None = None  # a committed token broke its constraint
    may_force: bool = False  # the caller may force its pending token (TokenGenerator.force)
    # Speculative decoding (worker.engine.speculate): whether the row drafts, the
    # most tokens it may draft now (the caller's bound: max_tokens, a
    # reasoning budget), and its tokens drafted and kept so far.
    speculative: bool = False
    draft_limit: int = 1 << 30
    drafted: int = 0
    accepted: int = 0
    # Rows that ask for log-probabilities (sampling.logprobs): the draw
    # that gave its pending token (and the row's place in it), and one
    # (token, logprob, top) entry per token read, in the order step()
    # gives the tokens; the caller takes them as it streams each token.
    pending_lp: tuple[StepLogprobs, int] | None = None
    logprobs: deque = field(default_factory=deque)


class BatchFailed(Exception):
    """A batched forward or its bookkeeping failed: the listed rows' state is
    gone (they have been dropped from the generator). `out` holds what the
    step gave the rows that go on (a prefill chunk that fails after the
    decode step)."""

    def __init__(self, rows: list[Row], cause: BaseException, out: list[tuple[Row, int | None]] | None = None):
        super().__init__(str(cause))
        self.rows = rows
        self.cause = cause
        self.out = out or []


Route = Callable[[list[int | None]], None]


class TokenGenerator:
    def __init__(
        self,
        model,
        vocab_size: int,
        prefix_cache: PrefixCache,
        prefill_step: int,
        chat_marker: int | None,
        route: Route = lambda slots: None,
        masks: BatchMasks | None = None,
        run_ahead: bool = True,
        compiled: CompiledDecode | None = None,
        speculator: Speculator | None = None,
        eos_ids: frozenset[int] = frozenset(),
        fold: bool = True,
    ):
        self.model = model
        # Drafts and verifies several tokens per row a step (None: never).
        self.speculator = speculator
        self.eos_ids = eos_ids
        # The decode forward, compiled, for rows without an adapter (None:
        # always the model's own forward).
        self.compiled = compiled
        # Tells the LoRA layers each row's adapter slot before a forward.
        self._route = route
        self.prefix_cache = prefix_cache
        self.prefill_step = prefill_step
        self.chat_marker = chat_marker
        self.can_batch = batchable(make_prompt_cache(model))
        # (body, LM head): a group's last chunk scores only each row's last
        # position (_folds). None when not asked (a rank of a group, whose
        # head computes a slice of the logits its forward gathers), for an
        # architecture whose forward is not exactly the head over the body's
        # output, or a stand-in model.
        foldable = fold and isinstance(model, nn.Module) and getattr(text_model(model), "model_type", None) in FOLDABLE
        self._parts = model_parts(model)[1:] if foldable else None
        # kv_bits with quantized_kv_start (worker.engine.kv_quant): prefill
        # chunks end there, so a row converts at exactly that many tokens
        # whatever batch reads it.
        self.kv_start = getattr(model, "quantized_kv_start", 0)
        self.sampler = BatchSampler(vocab_size)
        self.masks = masks
        self.on_gpu = mx.default_device() == mx.gpu
        # From how many tokens a hybrid prompt's last snapshot is read by a
        # ghost row after its first token (None: never; see the module's
        # docstring).
        self.defer_from: int | None = 0 if self.on_gpu else CPU_DEFER_FROM
        self.run_ahead = run_ahead
        # Whether a pass built ahead is handed to mlx at once (else next
        # step, beside the masks); see the module's docstring.
        self.hand_over_at_once = not self.on_gpu
        self.decoding: list[Row] = []
        self._cache: BatchCache | None = None
        self._next: mx.array | None = None  # (B,) the decode batch's next inputs
        # (B, V) logits of the pass already built on `_next` (run ahead;
        # on the CPU backend also handed to mlx).
        self._ahead: mx.array | None = None
        self._forced: dict[Row, int] = {}
        # Called with a constrained step's (row, token) pairs (None: a row's
        # first token is pending) as soon as they are read, before the
        # step's masked draw is handed to mlx; step() returns them too.
        self.on_read: Callable[[list[tuple[Row, int | None]]], None] | None = None
        self.prefilling: list[Row] = []
        self._group: BatchCache | None = None
        self._joining = False
        self._deferred: deque[Row] = deque(maxlen=MAX_DEFERRED)  # ghost rows to start
        # The timing of plain decode steps for the compiled step's choice of
        # way (worker.engine.step_choice): steps taken, prompt chunks read,
        # (step, rows, traced, new trace) of the last forward built and of
        # the last three built by unconstrained decode steps, and (step,
        # time, chunks) of the last such step's read.
        self._steps = 0
        self._chunks = 0
        self._way: tuple[int, tuple[int, int] | None, bool, bool] | None = None
        self._ways: deque[tuple[int, tuple[int, int] | None, bool, bool] | None] = deque(maxlen=3)
        self._read_at: tuple[int, float, int] | None = None

    # -- membership ---------------------------------------------------------

    @property
    def rows(self) -> list[Row]:
        """The requests' rows (ghost rows are the generator's own)."""
        return self.decoding + [row for row in self.prefilling if not row.ghost]

    def __len__(self) -> int:
        """Rows with work left, ghost rows (started or not) included."""
        return len(self.decoding) + len(self.prefilling) + len(self._deferred)

    @property
    def first_token_pending(self) -> bool:
        """Whether a request waits for its first token: its prompt is
        being read, or its last prompt token is still to be fed."""
        return any(not row.ghost for row in self.prefilling) or any(row.fresh for row in self.decoding)

    @property
    def cache_bytes(self) -> int:
        return sum(c.nbytes for c in (self._cache, self._group) if c is not None)

    def start(self, rows: list[Row]) -> None:
        """Starts reading the rows' prompts: as a prefill group, or in the
        one that is reading, which they join at its next chunk."""
        caches = []
        alone = len(rows) == 1 and not self.decoding and not self.prefilling
        for row in rows:
            # A hybrid model's chunks end at message starts, with or without a
            # prefix cache, so a prompt resumed from a snapshot there computes
            # what a cold one does (greedy output is the same with and without
            # the cache). An attention-only model resumes at any common
            # prefix, so such cuts would only add forward passes: a chat
            # prompt's `<|im_start|>assistant\n` read in one of its own, on a
            # GPU as long as a decode step.
            row.tokens = tokens_of(row.ids)
            row.cuts = cut_points(row.tokens, None if self.prefix_cache.trimmable else self.chat_marker)
            if 0 < self.kv_start < len(row.ids) - 1:
                row.cuts = sorted({*row.cuts, self.kv_start})
            cache, row.cached = self.prefix_cache.resume(row.adapter, row.tokens, row.cuts)
            row.pos = row.cached
            starts = message_starts(row.tokens, self.chat_marker)
            row.snapshots = self.prefix_cache.snapshot_points(len(row.ids), starts)
            if alone and (last := self._deferrable(row, starts)) is not None:
                row.cuts.remove(last)
                if last in row.snapshots:
                    row.snapshots.discard(last)
                    row.deferred = last
            caches.append(cache)
        # A ghost whose whole prefix is stored already has nothing to do.
        done = [i for i, row in enumerate(rows) if row.ghost and len(row.ids) - 1 <= row.pos]
        if done:
            rows = [row for i, row in enumerate(rows) if i not in done]
            caches = [cache for i, cache in enumerate(caches) if i not in done]
        self._cut(self.prefilling + rows)
        # Rows whose whole prompt was resumed join now, unless the batch has
        # run ahead: then they are not at its step and join with the group's
        # first chunk (_prefill_chunk), after a step that does not run ahead.
        ready = [i for i, row in enumerate(rows) if not row.ends and self._ahead is None]
        if ready:
            self._join([rows[i] for i in ready], BatchCache.of_rows([caches[i] for i in ready]))
        reading = [i for i in range(len(rows)) if i not in ready]
        if reading:
            group = BatchCache.of_rows([caches[i] for i in reading])
            if self._group is None:
                self._group = group
            else:
                try:
                    self._group = self._group.extend(group)
                except Exception as exc:  # extended in place: the group's state is gone
                    raise BatchFailed(self._lose(decode=False, group=True), exc) from exc
            self.prefilling = self.prefilling + [rows[i] for i in reading]

    def _deferrable(self, row: Row, starts: list[int]) -> int | None:
        """The prompt's last message start, when the row, a lone request,
        reads through it (see the module's docstring); None when it stays a
        cut. Decided by the row, the device and what else runs, not the
        cache, so a worker with and one without a prefix cache read a
        prompt in the same chunks. Not for a row with
        an adapter (a ghost would need its adapter loaded after the row has
        left), nor beside a drafter (which reads every prompt row's hidden
        states), nor after a last message of more than DEFER_AT_MOST
        tokens, nor for a prompt resumed at or past that start, nor where
        the prompt's reading ends there anyway (its last token is the
        start's marker), nor for a prompt under `defer_from` tokens."""
        if (
            self.defer_from is None
            or len(row.ids) < self.defer_from
            or row.ghost
            or row.slot is not None
            or self.speculator is not None
            or self.prefix_cache.trimmable
            or not starts
        ):
            return None
        last = starts[-1]
        if last - (starts[-2] if len(starts) > 1 else 0) > DEFER_AT_MOST:
            return None
        return last if row.pos < last < len(row.ids) - 1 and last in row.cuts else None

    def _start_ghosts(self) -> None:
        """Starts the oldest ghost row queued in an earlier step (its chunks
        are read in this step's prefill part on) while no request's prompt
        is being read and no row's first token is pending. One at a time: a
        ghost holds a row's cache up to its snapshot, which the memory
        guard that admits requests does not count."""
        if self._deferred and not self.prefilling and not self.first_token_pending:
            ghost = self._deferred.popleft()
            try:
                self.start([ghost])
            except Exception:  # e.g. out of memory restoring a snapshot: no request's concern
                log.warning("a deferred prefix snapshot (%d tokens) dropped", len(ghost.ids) - 1, exc_info=True)

    def _cut(self, rows: list[Row]) -> None:
        """Plans the remaining prefill chunks of a group's rows, from where
        each is. A forward reads about prefill_step prompt tokens however
        many rows share it, so running rows wait no longer for a bigger
        group; a row's piece stays at least MIN_PIECE tokens, so short
        prompts arriving together are read in one forward. Cut again
        whenever rows join or leave the group."""
        readers = sum(1 for row in rows if row.pos < len(row.ids) - 1)
        step = max(min(MIN_PIECE, self.prefill_step), self.prefill_step // max(1, readers))
        for row in rows:
            row.ends = chunk_ends(len(row.ids) - 1, row.cuts, step, row.pos, fold=step // FOLD)

    def remove(self, rows: list[Row]) -> None:
        """Drops rows (finished, cancelled or failed) and frees their state."""
        gone = set(rows)
        for row in gone:
            self._forced.pop(row, None)
        if self.speculator is not None:
            self.speculator.forget(gone)
        keep = [i for i, row in enumerate(self.decoding) if row not in gone]
        if len(keep) < len(self.decoding):
            self.decoding = [self.decoding[i] for i in keep]
            self._cache.filter(keep)
            self.sampler.filter(keep)
            if keep:
                index = mx.array(keep)
                self._next = self._next[index]
                if self._ahead is not None:
                    self._ahead = self._ahead[index]
            else:
                self._cache, self._next, self._ahead = None, None, None
                if self.speculator is not None:
                    self.speculator.idle()
        keep = [i for i, row in enumerate(self.prefilling) if row not in gone]
        if len(keep) < len(self.prefilling):
            self.prefilling = [self.prefilling[i] for i in keep]
            self._group.filter(keep)
            if not keep:
                self._group = None
            self._cut(self.prefilling)

    def force(self, row: Row, token: int) -> None:
        """Replaces the row's pending token (sampled, not yet fed to the
        model) with `token`; only for rows marked `may_force`, which keep
        the batch from running ahead."""
        if self._ahead is not None:
            raise RuntimeError(f"row {row.rid}'s pending token is already fed: mark rows that may be forced")
        self._forced[row] = token

    def _join(self, rows: list[Row], cache: BatchCache) -> None:
        """Rows whose prompt is read join the decode batch."""
        for row in rows:
            row.fresh = True
        first = mx.array([row.ids[-1] for row in rows], dtype=mx.uint32)
        if self._cache is None:
            self._cache, self._next = cache, first
        else:
            self._cache = self._cache.extend(cache)
            self._next = mx.concatenate([self._next, first])
        self.decoding = self.decoding + rows
        self.sampler.extend([row.sampling for row in rows])
        if self.speculator is not None:
            self.speculator.join(rows)

    def _lose(self, decode: bool, group: bool) -> list[Row]:
        """Drops the decode batch and/or the prefill group whole, without
        touching their (possibly broken) state; returns their rows."""
        lost = []
        if decode:
            lost += self.decoding
            self.decoding, self._cache, self._next, self._ahead = [], None, None, None
            self.sampler = BatchSampler(self.sampler.vocab_size)
            self._forced.clear()
            if self.speculator is not None:
                self.speculator.clear()
        if group:
            lost += [row for row in self.prefilling if not row.ghost]
            self.prefilling, self._group = [], None
        return lost

    # -- stepping -----------------------------------------------------------

    def step_until_chosen(self, rows: int) -> None:
        """Steps until the compiled step has chosen its way for this many
        rows at their context (worker.engine.step_choice), at most a
        trial's length; without a choice (the CPU), not at all."""
        choice = self.compiled.choice if self.compiled is not None else None
        for _ in range(TRIAL_AT_MOST + 1):
            if choice is None or choice.chosen(rows) is not None:
                return
            self.step()

    def step(self) -> list[tuple[Row, int | None]]:
        """One decode step and one prefill chunk. Returns each decode row
        with its token, or None for a row whose last prompt token was fed in
        this step (its first token is pending). Raises BatchFailed when the
        decode batch or the prefill group is lost."""
        out: list[tuple[Row, int | None]] = []
        self._steps += 1
        self._start_ghosts()
        if self.decoding:
            rows = self.decoding
            try:
                drafted = self.speculator.step(self) if self.speculator is not None else None
                tokens = self._decode() if drafted is None else []
            except Exception as exc:
                raise BatchFailed(self._lose(decode=True, group=False), exc) from exc
            if drafted is not None:
                out = drafted
            for row, token in zip(rows, tokens):
                if row.fresh:
                    row.fresh = False
                    out.append((row, None))
                else:
                    out.append((row, token))
            if self.speculator is not None:
                self.speculator.observe(out)
            for row, token in out:
                if token is not None and row.deferred:
                    # Its first token is read: its ghost starts next step,
                    # so that the snapshot's pass (whose store waits for it)
                    # does not hold that token's line back.
                    self._deferred.append(Row(row.rid, row.ids[: row.deferred + 1], row.sampling, ghost=True))
                    row.deferred = 0
        if self.prefilling:
            try:
                self._prefill_chunk()
            except Exception as exc:
                # A failure while rows were joining the decode batch may have
                # left it half-extended: then it goes too.
                lost = self._lose(decode=self._joining, group=True)
                self._joining = False
                raise BatchFailed(lost, exc, [(row, token) for row, token in out if row not in lost]) from exc
        return out

    def _apply_forced(self) -> None:
        """Puts forced tokens in place of the rows' pending ones."""
        if self._forced:
            where = {row: i for i, row in enumerate(self.decoding)}
            index = mx.array([where[row] for row in self._forced])
            self._next[index] = mx.array(list(self._forced.values()), dtype=self._next.dtype)
            self._forced.clear()

    def _decode(self) -> list[int]:
        self._apply_forced()
        inputs = self._next
        logits, self._ahead = self._ahead, None
        constrained = any(row.constraint for row in self.decoding)
        ahead = logits is not None  # built last step (and on a CPU, handed to mlx)
        # Step by step, a constrained step's masks fill on their side thread
        # while its forward pass is computed. On a GPU they start before the
        # pass is even built: a small model's step is bound by the building
        # there (the device waits for it either way), so the masks hide
        # behind it too (H200, 8 rows: 0.84x -> 0.905x a free step). On
        # mlx's CPU backend building it first measured 2-3 % faster.
        if not ahead and not (constrained and self.on_gpu):
            logits = self._forward(inputs)
        if not constrained:
            self._next = self.sampler(logits, inputs)
            self._async_eval_next()
            if ahead:
                self._ways.clear()
            else:
                self._ways.append(self._way)
            tokens = inputs.tolist()
            self._time_read()
            self.take_logprobs(tokens)
            self.stash_logprobs()
            return tokens
        tokens, pending = self._start_masks(inputs)
        self.take_logprobs(tokens)
        if logits is None:
            logits = self._forward(inputs)
        hand_over = not (ahead and self.hand_over_at_once)
        if hand_over and self.on_gpu:
            # Launched first: the device computes while this thread streams.
            mx.async_eval(logits)
        if self.on_read is not None:
            self.on_read([(row, None if row.fresh else token) for row, token in zip(self.decoding, tokens)])
        if hand_over and not self.on_gpu:
            mx.async_eval(logits)
        self._next = self.sampler(self.masks.apply(logits, pending.result()), inputs)
        self._async_eval_next()
        self.stash_logprobs()
        # A batch that may speculate reads its pending tokens before each step.
        speculating = self.speculator is not None and self.speculator.wants(self.decoding)
        if self.run_ahead and not self.prefilling and not speculating and not any(row.may_force for row in self.decoding):
            self._ahead = self._forward(self._next)
            if self.hand_over_at_once:
                # Apart from the draw, so that reading the draw next step
                # waits for the draw alone, not for this pass too.
                mx.async_eval(self._ahead)
        return tokens

    def _time_read(self) -> None:
        """Reports the time of the forward whose draw was just read to the
        compiled step's choice, where it ran as in a run of its own way:
        built by the step before, right after a forward of the same way,
        rows and caches' capacity (whose draw the step before read), no
        prompt chunk read since that read, and no trace made
        (worker.engine.step_choice)."""
        now = time.monotonic()
        last, self._read_at = self._read_at, (self._steps, now, self._chunks)
        choice = self.compiled.choice if self.compiled is not None else None
        if choice is None or last is None or len(self._ways) < 3 or None in self._ways:
            return
        before, timed, _ = self._ways
        step, then, chunks = last
        if step == self._steps - 1 == timed[0] == before[0] + 1 and chunks == self._chunks and before[1:3] == timed[1:3] and not timed[3]:
            choice.timed(timed[1], timed[2], now - then)

    def _async_eval_next(self) -> None:
        step = self.sampler.logprobs
        if step is None:
            mx.async_eval(self._next)
        else:
            mx.async_eval(self._next, *step.arrays)

    def take_logprobs(self, tokens: list[int]) -> None:
        """Queues, for each decode row that asks, the log-probabilities of
        its token just read (`tokens`, in the batch's order; a forced one
        included); a fresh row's input is its prompt's, not a token."""
        if not self.sampler.wants_logprobs:
            return  # (a row that asked and left took its pending draw with it)
        for row, token in zip(self.decoding, tokens):
            if row.pending_lp is not None and not row.fresh:
                step, i = row.pending_lp
                row.logprobs.append(step.entry(i, token, row.sampling.logprobs))
                row.pending_lp = None

    def stash_logprobs(self) -> None:
        """Marks the sampler's last draw as the source of each asking row's
        pending token."""
        step = self.sampler.logprobs
        if step is None:
            return
        for i, row in enumerate(self.decoding):
            if row.sampling.logprobs is not None:
                row.pending_lp = (step, i)

    def _forward(self, inputs: mx.array) -> mx.array:
        """The decode batch's forward pass on `inputs` (B,): (B, V) logits."""
        slots = [row.slot for row in self.decoding]
        # Routed for the compiled step too: a trace made now must see the
        # adapter layers pass every row through to the base model.
        self._route(slots)
        layers = self._cache.layers
        # Only a step whose way the compiled step chose is timed for it (not
        # an adapter's rows, nor caches it cannot trace).
        traced, key = self.compiled.way(layers, len(slots)) if self.compiled is not None and all(s is None for s in slots) else (None, None)
        if not traced:
            self._way = None if traced is None else (self._steps, key, False, False)
            return self.model(inputs[:, None], cache=layers)[:, -1, :]
        traces = self.compiled.traces
        logits = self.compiled.forward(inputs, layers)
        self._way = (self._steps, key, True, self.compiled.traces != traces)
        return logits

    def _start_masks(self, inputs: mx.array) -> tuple[list[int], Future]:
        """Reads this step's tokens, commits them and starts the next masks."""
        tokens = inputs.tolist()
        return tokens, self.masks.fill_async(self._commit(tokens))

    def _commit(self, tokens: list[int]) -> list[RowConstraint | None]:
        """Advances each decode row's constraint by its token of this step
        (a forced one included) and returns the constraints to mask the
        next tokens with. A row whose token breaks its constraint is marked
        `broken` and drawn unmasked; the caller ends it."""
        out: list[RowConstraint | None] = []
        for row, token in zip(self.decoding, tokens):
            constraint = row.constraint
            if constraint is not None and not row.fresh and row.broken is None:
                try:
                    constraint.advance(token)
                except ConstraintViolation as exc:
                    row.broken = exc
            out.append(None if row.broken else constraint)
        return out

    def _folds(self, rows: list[Row]) -> bool:
        """Whether this chunk, the last of every row in the group, reads
        each prompt's last token too, and its logits there give the rows'
        first tokens: the decode step that would read those tokens (a pass
        over all the weights, on a GPU as long as any step) is not needed.
        Only where that step could have run ahead the same way: an empty
        decode batch, rows that may not be forced, no drafter (a
        speculative row's first step reads its pending token with the
        drafts), no ghost row, and caches that keep no snapshot at the
        token before the last (a hybrid model's state cannot be cut back to
        there)."""
        if self.decoding or not self.run_ahead or self.speculator is not None or self._parts is None:
            return False
        for row in rows:
            last = len(row.ids) - 1
            if row.ends != [last] or row.may_force or row.ghost:
                return False
            if not self.prefix_cache.trimmable and last in row.snapshots:
                return False
        return True

    def _prefill_chunk(self) -> None:
        self._chunks += 1
        rows = self.prefilling
        group = self._group
        resumed = [i for i, row in enumerate(rows) if not row.ends]
        if resumed:  # whole prompts resumed while the batch ran ahead (start)
            self._joining = True
            self._join([rows[i] for i in resumed], group.split(resumed))
            self._joining = False
            rows = self.prefilling = [row for row in rows if row.ends]
            if not rows:
                self._group = None
                return
        folded = self._folds(rows)
        if folded:
            for row in rows:
                row.ends[0] += 1
        pieces = [row.ids[row.pos : row.ends[0]] for row in rows]
        width = max(len(p) for p in pieces)
        lengths = [len(p) for p in pieces]
        padded = width * len(rows) > sum(lengths)
        tokens = mx.array([p + [0] * (width - len(p)) for p in pieces], dtype=mx.uint32)
        if padded:
            group.pad(lengths, width)
        self._route([row.slot for row in rows])
        first = None
        if folded:
            body, head = self._parts
            with last_position_only(body):
                hidden = body(tokens, cache=group.layers)
            if padded:  # each row's last token, before its right padding
                hidden = hidden[mx.arange(len(rows)), mx.array(lengths) - 1][:, None, :]
            else:
                hidden = hidden[:, -1:, :]
            first = head(hidden)[:, -1, :]
        elif self.speculator is not None and self.speculator.reads_hidden:
            self.speculator.read_prompt(rows, [row.pos for row in rows], lengths, tokens, group.layers)
        else:
            self.model(tokens, cache=group.layers)
        if group.merged:
            group.unpad()
        mx.async_eval(group.state)
        for i, row in enumerate(rows):
            row.pos = row.ends.pop(0)
            # A folded row's cache holds its last token too: for a cache cut
            # back to any prefix, that snapshot serves the one before it.
            if row.pos in row.snapshots or (folded and row.pos - 1 in row.snapshots):
                self.prefix_cache.store(row.adapter, row.tokens[: row.pos], group.row(i))
        done = [i for i, row in enumerate(rows) if not row.ends]
        if done:
            read = group.split(done)
            joining = [k for k, i in enumerate(done) if not rows[i].ghost]
            if len(joining) < len(done):  # a ghost's snapshot is stored: it leaves
                read.filter(joining)
            if joining:
                self._joining = True
                self._join([rows[done[k]] for k in joining], read)
                self._joining = False
            if folded:
                # The pass that read the last prompt token is built: the
                # first decode step draws from it (as a step run ahead does).
                self._ahead = first
                mx.async_eval(first)
            self.prefilling = [row for row in rows if row.ends]
            if not self.prefilling:
                self._group = None
            self._cut(self.prefilling)
