"""Speculative decoding inside the batched engine.

A decode step normally feeds each row its pending token (sampled, not yet
fed) and draws one new token. A speculative step feeds each row its pending
token followed by a draft of up to k tokens (worker.engine.drafters), in one
forward of shape (rows, 1 + longest draft), and draws the target's token at
every position. A row keeps the draft tokens up to the first one that
differs from the target's own draw, and the target's token at that position
becomes its new pending token: each row advances by 1 to k+1 tokens.

Why the result is what plain decoding gives:

- Each position's token is drawn exactly as a plain step draws it: the
  repetition penalty sees the tokens fed up to that position, the PRNG key
  is the row's key split once per position (a plain step splits it once per
  token), a constrained row's logits are masked by its grammar after the
  tokens before that position. The row's key and penalty state afterwards
  are those after its last kept position.
- A draft is one token per position (a point mass q), so the standard
  rejection rule (accept d with probability min(1, p(d)/q(d)) = p(d), else
  draw from the residual, p without d, renormalised) is exactly "draw x from
  p; keep d if x == d, else emit x". The draw uses the plain step's noise,
  so a greedy row gives the plain engine's tokens and a seeded sampled row
  gives them too, draft or no draft, accepted or not.

Rolling back what was not kept, per row:

- Attention caches (plain or quantized, worker.engine.kv_quant): the
  rejected columns are
  trimmed; in a batch, rows that rejected more than the least are turned
  into left padding by mlx-lm's own right-padding roll (`prepare` /
  `finalize`, the prefill path's), so their positions stay exact.
- Gated-delta layers (ArraysCache) cannot be cut back: their state sums
  every token. Off Metal, the verify forward keeps each layer's state after
  every position (`_Positions`) and each row takes the one after its last
  kept token. On Metal (whose fused kernel keeps no intermediate states),
  their state before the step is kept (the arrays are replaced, never
  written, so a reference is a snapshot), attention caches are trimmed to
  before the step, and the kept tokens are fed again in one right-padded
  forward in which each row's recurrence stops at its own length (the
  prefill path's `lengths`); not needed when every row kept its whole
  draft.

Honest: k adapts per row (one more after a draft kept whole, back to what
was kept plus one after a miss); a row whose drafts are mostly rejected, or
whose drafter keeps proposing nothing, stops drafting for a while and tries
again later, each pause longer; and the
worker compares the tokens per second of its speculative steps with those
of plain steps of the same batch size, timed in probes of plain steps run
as plain decoding runs, and stops speculating for a while when it is not
faster (worker.engine.pace).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache

from worker.engine.constrain import RowConstraint
from worker.engine.kv_quant import BatchLazyKV, BatchQuantKV, LazyKV, QuantKV
from worker.engine.pace import PROBE_STEPS, Pace

log = logging.getLogger("worker")

DEFAULT_TOKENS = 4
MAX_TOKENS = 32

# A row's share of drafted tokens kept is a running mean over its drafting
# steps (weight ROW_EMA for the latest), starting at ROW_PRIOR; from its
# ROW_JUDGE_AFTER-th drafting step on, a share below ROW_MIN_ACCEPT pauses
# the row for ROW_PAUSE steps, doubled on every pause up to ROW_PAUSE_MAX.
# A drafter that never agrees thus costs a row two steps (at 8 rows on a
# CPU a wasted step costs about three plain ones), while one that agrees
# survives the two or three misses in a row that a token it cannot guess
# brings (a start at "all kept" cost six steps for the first).
ROW_PRIOR = 0.5
ROW_EMA = 0.3
ROW_MIN_ACCEPT = 0.3
ROW_PAUSE = 16
ROW_PAUSE_MAX = 1024
ROW_JUDGE_AFTER = 2
# Drafting steps in a row with nothing proposed before a row pauses as one
# that misses does (an empty proposal costs a step only its overlap).
ROW_EMPTY_AFTER = 4


def supported(layers: list) -> bool:
    """Whether rows with these caches can be rolled back after a draft."""
    return bool(layers) and all(type(c) in (KVCache, BatchKVCache, QuantKV, BatchQuantKV, LazyKV, BatchLazyKV, ArraysCache) for c in layers)


@dataclass(eq=False)
class RowSpec:
    state: object  # the drafter's per-row state
    k: int
    accept: float = ROW_PRIOR  # running share of drafted tokens kept
    judged: int = 0  # drafting steps since the row last paused
    off_until: int = 0  # the step from which it drafts again
    pause: int = ROW_PAUSE
    empty: int = 0  # drafting steps in a row with nothing proposed
    inherited: bool = False  # paused as it joined, for its drafter's recent misses


class Speculator:
    def __init__(self, drafter, tokens: int = DEFAULT_TOKENS, weights_bytes: int = 0, clock=time.monotonic):
        self.drafter = drafter
        self._clock = clock
        self.weights_bytes = weights_bytes  # a draft model's
        self.k_max = max(1, min(MAX_TOKENS, tokens))
        self._rows: dict[object, RowSpec] = {}
        # Prompt chunks' hidden states of rows still reading their prompts
        # (a drafter that reads hidden states), handed over when they join.
        self._prompts: dict[object, list[tuple[int, mx.array]]] = {}
        self.steps = 0
        self.off_until = 0
        self.pace = Pace()
        self._probe = 0  # plain steps left in a probe (worker.engine.pace)
        # The pause a joining row starts with while its drafter's last judged
        # row (any row) kept too little, doubled for each row that joins so,
        # up to ROW_PAUSE_MAX; 0 once a row drafts well, which also
        # lets every row paused this way draft again. So a draft model that
        # never agrees with the target is probed by one new row at a time,
        # not by all of a new batch (at 8 rows on a CPU, each row's probe
        # cost a request 1 % of its time: the draft model reads the row's
        # whole context). Prompt lookup's drafts depend on the request's
        # text, not on a model pair, so its rows start afresh.
        self._join_pause = 0
        self._inherits = not getattr(drafter, "per_request", False)
        # The last decode step: (start, kind, rows, tokens, the kind of the
        # step before it, traces made before it); kinds are "plain", "spec",
        # or None for a step beside a prefill chunk.
        self._last: tuple[float, str, int, int, str | None, int] | None = None
        self._kind: str | None = None  # the last step's kind
        self.drafted = 0
        self.accepted = 0
        self.verified = 0  # speculative steps run
        # Gated-delta state kept per position (else the kept tokens are fed
        # again): off Metal, see _Positions.
        self.per_position = not mx.metal.is_available()
        self._gd: tuple[object, list] | None = None  # (model, its gated-delta layers)

    def figures(self) -> dict[str, int]:
        """Totals for worker_stats (summed by the pool's status and metrics)."""
        return {"drafted_tokens": self.drafted, "accepted_tokens": self.accepted, "speculating": int(self.active)}

    # -- rows ---------------------------------------------------------------

    def join(self, rows: list) -> None:
        for row in rows:
            if row.speculative:
                spec = self._rows[row] = RowSpec(self.drafter.state(list(row.ids)), self.k_max)
                if self._join_pause:
                    spec.off_until, spec.k, spec.inherited = self.steps + self._join_pause, 1, True
                    self._join_pause = spec.pause = min(ROW_PAUSE_MAX, self._join_pause * 2)
                for start, hidden in self._prompts.pop(row, ()):
                    self.drafter.add(spec.state, start, hidden)

    @property
    def reads_hidden(self) -> bool:
        """The drafter reads the target's hidden states (MTP): prompt chunks
        are read through read_prompt."""
        return getattr(self.drafter, "wants_hidden", False)

    def read_prompt(self, rows: list, starts: list[int], lengths: list[int], tokens: mx.array, layers: list) -> None:
        """A prefill chunk's forward (rows right-padded to `tokens`' width),
        keeping each speculative row's hidden states for the drafter. The LM
        head is never evaluated on them (the plain chunk computes logits it
        drops)."""
        _, hidden = self.drafter.forward(tokens, layers)
        # Every reading row is in every chunk: others were lost with their group.
        for row in [row for row in self._prompts if row not in rows]:
            del self._prompts[row]
        for i, (row, start, n) in enumerate(zip(rows, starts, lengths)):
            if row.speculative and n:
                pieces = self._prompts.setdefault(row, [])
                if pieces and pieces[-1][0] + pieces[-1][1].shape[0] != start:
                    pieces.clear()
                pieces.append((start, hidden[i, :n]))
                # Only the latest few chunks can be read (MAX_POSITIONS).
                del pieces[:-4]

    def forget(self, rows) -> None:
        for row in rows:
            self._prompts.pop(row, None)
        gone = [spec.state for spec in (self._rows.pop(row, None) for row in rows) if spec is not None]
        if gone:
            self.drafter.forget(gone)

    def clear(self) -> None:
        self.drafter.forget([spec.state for spec in self._rows.values()])
        self._rows.clear()
        self._prompts.clear()
        self.idle()

    def idle(self) -> None:
        """The decode batch emptied: the next step's time is not this one's."""
        self._last = self._kind = None

    def observe(self, out: list) -> None:
        """The tokens fed this step, in order (a row's history for drafting)."""
        by_row: dict[object, list[int]] = {}
        for row, token in out:
            if token is not None and row in self._rows:
                by_row.setdefault(row, []).append(token)
        for row, tokens in by_row.items():
            self._rows[row].state.extend(tokens)

    @property
    def active(self) -> bool:
        """Whether speculation is on for the worker now."""
        return self.steps >= self.off_until

    def _may_draft(self, row) -> bool:
        spec = self._rows.get(row)
        return spec is not None and self.steps >= spec.off_until and row.draft_limit > 0 and row.broken is None

    def wants(self, rows: list) -> bool:
        return self.active and not self._probe and any(self._may_draft(row) for row in rows)

    # -- a step -------------------------------------------------------------

    def step(self, gen) -> list | None:
        """One decode step of `gen`'s decode batch, speculative when some row
        has a draft; None when the plain step should run instead."""
        now = self._clock()
        self._account(now, gen)
        self.steps += 1
        rows = gen.decoding
        if self._probe:
            self._probe -= 1
            return self._plain_step(now, gen)
        if gen._ahead is not None or not self.wants(rows):
            return self._plain_step(now, gen)
        if not gen.prefilling and self.pace.probe_due(len(rows)):
            # Plain steps in a row, overlapping as plain decoding does
            # (wants() says no meanwhile).
            self.pace.probed(len(rows))
            self._probe = PROBE_STEPS - 1
            log.debug("timing plain steps of %d rows", len(rows))
            return self._plain_step(now, gen)
        gen._apply_forced()
        pending = gen._next.tolist()
        drafts = self._drafts(gen, rows, pending)
        if not any(drafts) and not self._capture(rows):
            return self._plain_step(now, gen)
        out = self._verify(gen, rows, pending, drafts)
        self.verified += 1
        # Every entry is one token a row advanced by (a fresh row's first
        # one is pending, still one step of that row).
        self._mark(now, gen, "spec", len(out))
        return out

    def _plain_step(self, now: float, gen) -> None:
        self._mark(now, gen, "plain", len(gen.decoding))
        return None

    def _mark(self, now: float, gen, kind: str, tokens: int) -> None:
        before, self._kind = self._kind, (kind if not gen.prefilling else None)
        self._last = (now, kind, len(gen.decoding), tokens, before, self._traces(gen)) if self._kind else None

    def _traces(self, gen) -> int:
        """Traces the target's and the drafter's compiled steps have made."""
        own = getattr(self.drafter, "compiled", None)
        return (gen.compiled.traces if gen.compiled is not None else 0) + (own.traces if own is not None else 0)

    def _capture(self, rows: list) -> bool:
        """A drafter that reads the target's hidden states (MTP) lacks some
        row's latest: a verify forward without drafts hands it over."""
        waiting = getattr(self.drafter, "waiting", None)
        return waiting is not None and waiting([self._rows[row].state for row in rows if self._may_draft(row)])

    def _drafts(self, gen, rows: list, pending: list[int]) -> list[list[int]]:
        which = [i for i, row in enumerate(rows) if self._may_draft(row)]
        specs = [self._rows[rows[i]] for i in which]
        proposed = self.drafter.propose(
            [spec.state for spec in specs],
            [None if rows[i].fresh else pending[i] for i in which],
            [min(spec.k, rows[i].draft_limit) for i, spec in zip(which, specs)],
        )
        drafts: list[list[int]] = [[] for _ in rows]
        for i, spec, draft in zip(which, specs, proposed):
            drafts[i] = self._checked(gen, rows[i], pending[i], draft)
            self._idle(spec, bool(drafts[i]))
        return drafts

    def _idle(self, spec: RowSpec, proposed: bool) -> None:
        """A row whose drafter keeps finding nothing (prompt lookup on text
        that does not repeat) pauses as a row that misses does: while it may
        draft, its steps read their tokens back at once, which costs a plain
        step its overlap with the device."""
        if proposed:
            spec.empty = 0
            return
        spec.empty += 1
        if spec.empty >= ROW_EMPTY_AFTER:
            spec.off_until = self.steps + spec.pause
            spec.pause = min(ROW_PAUSE_MAX, spec.pause * 2)
            spec.empty = 0

    def _checked(self, gen, row, pending: int, draft: list[int]) -> list[int]:
        eos = gen.eos_ids
        for i, token in enumerate(draft):
            # An end-of-sequence token ends the row: the target's own draw
            # gives it at no loss.
            if token in eos or not 0 <= token < gen.sampler.vocab_size:
                draft = draft[:i]
                break
        if draft and row.constraint is not None:
            draft = _allowed(row.constraint, None if row.fresh else pending, draft)
        return draft

    def _verify(self, gen, rows: list, pending: list[int], drafts: list[list[int]]) -> list:
        width = 1 + max(len(d) for d in drafts)
        inputs = mx.array([[p] + d + [0] * (width - 1 - len(d)) for p, d in zip(pending, drafts)], dtype=mx.uint32)
        cache = gen._cache
        layers = cache.layers
        hybrid = any(type(c) is ArraysCache for c in layers)
        saved = [list(c.cache) if type(c) is ArraysCache else None for c in layers] if hybrid else None
        positions = _Positions(self._gated_delta(gen.model)) if hybrid and self.per_position else None
        constrained = any(row.constraint is not None for row in rows)
        bits = None
        if constrained:
            # The tokens fed now are committed first, as a plain step does.
            constraints = gen._commit(pending)
            bits = _masks(gen.masks, constraints, drafts, width)
        gen._route([row.slot for row in rows])
        logits, hidden = self._forward(gen, rows, inputs, layers, positions)
        sampler = gen.sampler
        drawn, keys, seen, logprobs = [], [], [], []
        for j in range(width):
            lj = logits[:, j, :]
            if bits is not None:
                lj = gen.masks.apply(lj, bits[j])
            drawn.append(sampler(lj, inputs[:, j]))
            keys.append(sampler._keys)
            seen.append(sampler._seen)
            logprobs.append(sampler.logprobs)
        drawn = mx.stack(drawn, axis=1)
        keys = mx.stack(keys)
        mx.eval(drawn, keys)
        targets = drawn.tolist()
        kept = []
        for d, t in zip(drafts, targets):
            a = 0
            while a < len(d) and d[a] == t[a]:
                a += 1
            kept.append(a)
        if hidden is not None:
            specs = [self._rows.get(row) for row in rows]
            self.drafter.verified(
                [None if spec is None else spec.state for spec in specs],
                [0 if spec is None else len(spec.state.tokens) - row.fresh for row, spec in zip(rows, specs)],
                hidden,
                kept,
            )
        index = mx.array(kept)
        across = mx.arange(len(rows))
        sampler._keys = keys[index, across]
        if seen[0] is not None:
            sampler._seen = mx.stack(seen)[index, across]
        if positions is not None and positions.complete(layers):
            positions.keep(layers, saved, kept)
            saved = None  # the attention caches are rolled back as in an attention-only model
        self._roll_back(gen, cache, layers, saved, inputs, kept, width)
        gen._next = mx.array([t[a] for t, a in zip(targets, kept)], dtype=mx.uint32)
        if logprobs[0] is not None:
            # The target's log-probabilities: each kept draft token's from
            # the draw at its position, the new pending token's from the
            # draw after the last kept one.
            gen.take_logprobs(pending)
            for i, (row, d, a) in enumerate(zip(rows, drafts, kept)):
                top = row.sampling.logprobs
                if top is not None:
                    row.logprobs.extend(logprobs[j].entry(i, d[j], top) for j in range(a))
                    row.pending_lp = (logprobs[a], i)
        out = []
        for row, p, d, a in zip(rows, pending, drafts, kept):
            if row.constraint is not None and row.broken is None:
                for token in d[:a]:
                    row.constraint.advance(token)
            out.append((row, None if row.fresh else p))
            row.fresh = False
            out.extend((row, token) for token in d[:a])
            if d:
                self._judge(row, len(d), a)
        return out

    def _gated_delta(self, model) -> list:
        """The model's gated-delta layers (found once: walking the model's
        modules every step cost about 5 % of a speculative step on a CPU)."""
        if self._gd is None or self._gd[0] is not model:
            self._gd = (model, [m for m in model.modules() if hasattr(m, "in_proj_qkv") and hasattr(m, "conv_kernel_size")])
        return self._gd[1]

    def _forward(self, gen, rows: list, inputs: mx.array, layers: list, positions) -> tuple[mx.array, mx.array | None]:
        """The verify forward: logits, and the final hidden states for a
        drafter that reads them; `positions` (or None) records the
        gated-delta states at every position. Compiled as the decode step is
        when the batch's rows could take that step: op by op, a small
        model's verify cost about twice a compiled plain step on a CPU, most
        of it in unfused elementwise work (the per-position recurrence)."""
        hidden = getattr(self.drafter, "wants_hidden", False)
        compiled = gen.compiled
        if compiled is not None and all(row.slot is None for row in rows) and compiled.steppable(layers):
            name = "verify" + ("-hidden" if hidden else "") + ("-positions" if positions is not None else "")
            outputs = compiled.block(name, self._traced_verify(gen.model, hidden, positions is not None), inputs, layers)
            if outputs is not None:
                logits, rest = outputs[0], outputs[1:]
                h = rest.pop(0) if hidden else None
                if positions is not None:
                    positions.unpack(rest, inputs.shape[1])
                return logits, h
        if positions is None:
            return self._plain_forward(gen.model, hidden, inputs, layers)
        with positions:
            return self._plain_forward(gen.model, hidden, inputs, layers)

    def _plain_forward(self, model, hidden: bool, inputs: mx.array, layers: list) -> tuple[mx.array, mx.array | None]:
        if hidden:
            return self.drafter.forward(inputs, layers)
        return model(inputs, cache=layers), None

    def _traced_verify(self, model, hidden: bool, per_position: bool):
        """The verify forward as a list of arrays, for CompiledDecode.block:
        logits, the hidden states (a drafter that reads them), then each
        gated-delta layer's state after every position and its convolution
        input (per-position roll-back)."""

        def run(inputs: mx.array, layers: list) -> list:
            if not per_position:
                logits, h = self._plain_forward(model, hidden, inputs, layers)
                return [logits] + ([h] if hidden else [])
            positions = _Positions(self._gated_delta(model))
            with positions:
                logits, h = self._plain_forward(model, hidden, inputs, layers)
            return [logits] + ([h] if hidden else []) + positions.packed()

        return run

    def _roll_back(self, gen, cache, layers, saved, inputs, kept: list[int], width: int) -> None:
        """Leaves each row's cache holding its pending token and its kept
        draft tokens, nothing after."""
        rejected = [width - 1 - a for a in kept]
        if saved is None:
            least = min(rejected)
            rest = [r - least for r in rejected]
            for c in layers:
                if type(c) is ArraysCache:
                    continue
                c.trim(least)
                if any(rest):
                    c.prepare(right_padding=rest)
                    c.finalize()
            return
        if not any(rejected):
            return
        # Gated-delta state: back to before the step, then the kept tokens again.
        for c, arrays in zip(layers, saved):
            if arrays is not None:
                c.cache = arrays
            else:
                c.trim(width)
        lengths = [1 + a for a in kept]
        span = max(lengths)
        again = inputs[:, :span]
        if cache.merged and span * len(lengths) > sum(lengths):
            cache.pad(lengths, span)
        gen._route([row.slot for row in gen.decoding])
        gen.model(again, cache=layers)
        if cache.merged:
            cache.unpad()

    # -- adapting -----------------------------------------------------------

    def _judge(self, row, drafted: int, kept: int) -> None:
        self.drafted += drafted
        self.accepted += kept
        row.drafted += drafted
        row.accepted += kept
        spec = self._rows.get(row)
        if spec is None:
            return
        spec.k = min(self.k_max, spec.k + 1) if kept == drafted else max(1, kept + 1)
        spec.judged += 1
        spec.accept += ROW_EMA * (kept / drafted - spec.accept)
        if spec.judged < ROW_JUDGE_AFTER:
            return
        if spec.accept < ROW_MIN_ACCEPT:
            spec.off_until = self.steps + spec.pause
            log.debug("row %d: drafts kept %.0f%%; drafting again in %d steps", row.rid, 100 * spec.accept, spec.pause)
            spec.accept, spec.judged = ROW_PRIOR, 0
            if self._inherits:
                self._join_pause = max(self._join_pause, spec.pause)
            spec.pause = min(ROW_PAUSE_MAX, spec.pause * 2)
            spec.k, spec.inherited = 1, False
        elif kept:
            spec.pause = ROW_PAUSE  # drafting well again
            if self._join_pause:
                self._join_pause = 0
                for other in self._rows.values():
                    if other.inherited:
                        other.off_until, other.pause, other.inherited = 0, ROW_PAUSE, False

    def _account(self, now: float, gen) -> None:
        """Times the previous decode step (up to this one's start) for the
        worker's judgement (worker.engine.pace), which says what is timed
        and why."""
        last, self._last = self._last, None
        if last is None or gen.prefilling or not gen.decoding:
            return
        start, kind, batch, tokens, before, traces = last
        took = now - start if self._traces(gen) == traces and before == kind else None
        if kind == "plain":
            if took is not None:
                self.pace.plain(batch, took)
            return
        pause, gain = self.pace.spec(batch, took, tokens)
        if pause:
            self.off_until = self.steps + pause
            log.info("speculative steps measured %.2fx plain decode; off for %d steps", gain, pause)


def _allowed(constraint: RowConstraint, pending: int | None, draft: list[int]) -> list[int]:
    """The longest prefix of `draft` the row's grammar allows after its
    pending token, without changing the grammar's state."""
    start = constraint.start_after
    if start is not None and pending != start:
        # Still before the grammar starts: only text without the token that
        # starts it (masks stay the same across the draft).
        return draft[: draft.index(start)] if start in draft else draft
    if start is not None:
        return draft[: constraint.matcher.validate_tokens(draft)]
    if pending is None:
        return draft[: constraint.matcher.validate_tokens(draft)]
    return draft[: max(0, constraint.matcher.validate_tokens([pending] + draft) - 1)]


def _masks(masks, constraints: list[RowConstraint | None], drafts: list[list[int]], width: int) -> list:
    """Each position's token masks: the grammar after the row's draft up to
    that position (grammars are advanced along the drafts, then rolled
    back)."""
    out = []
    for j in range(width):
        out.append(masks.fill([c if c is not None and j <= len(d) else None for c, d in zip(constraints, drafts)]))
        for c, d in zip(constraints, drafts):
            if c is not None and j < len(d):
                c.advance(d[j])
    for c, d in zip(constraints, drafts):
        if c is not None and c.active and d:
            c.matcher.rollback(len(d))
    return out


class _Positions:
    """Keeps, during one verify forward, each gated-delta layer's state after
    every position, so that each row can keep the state after its own kept
    tokens without feeding them again.

    The layers' recurrence runs token by token (mlx-lm's ops) with every
    step's state recorded, and each layer's convolution input (the
    in_proj_qkv output) is kept: the conv state after m tokens is rows m to
    m + kernel - 1 of [conv state before, inputs]. Off Metal only: there the
    token-by-token verify forward alone measured cheaper than the chunked
    one plus a re-run (docs/performance.md, "Speculative decoding"); on
    Metal mlx-lm's fused kernel keeps no intermediate states."""

    def __init__(self, layers: list):
        self.layers = layers  # the model's gated-delta layers
        self.states: list[list[mx.array]] = []
        self.inputs: list[tuple[int, mx.array]] = []
        self._patched: list[tuple[object, object]] = []

    def __enter__(self):
        import sys

        names = {type(m).__module__ for m in self.layers}
        for name in names:
            module = sys.modules[name]
            self._patched.append((module, module.gated_delta_update))
            module.gated_delta_update = self._recurrence
        for m in self.layers:
            m.in_proj_qkv = _Kept(m.in_proj_qkv, m.conv_kernel_size - 1, self.inputs)
        return self

    def __exit__(self, *exc) -> None:
        for m in self.layers:
            if isinstance(m.in_proj_qkv, _Kept):
                m.in_proj_qkv = m.in_proj_qkv.inner
        for module, original in self._patched:
            module.gated_delta_update = original
        self._patched.clear()

    def _recurrence(self, q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *, use_kernel=True, lower_bound=None, allow_neg_eigval=False):
        from mlx_lm.models.gated_delta import _gated_delta_step_ops, compute_g, compute_lower_bound_g

        beta = mx.sigmoid(b)
        if allow_neg_eigval:
            beta = beta * 2.0
        g = compute_g(A_log, a, dt_bias) if lower_bound is None else compute_lower_bound_g(A_log, a, dt_bias, lower_bound)
        B, T, Hk, Dk = q.shape
        Hv, Dv = v.shape[-2:]
        if state is None:
            state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
        if Hv > Hk:
            q = mx.repeat(q, Hv // Hk, -2)
            k = mx.repeat(k, Hv // Hk, -2)
        ys, states = [], []
        for t in range(T):
            y, state = _gated_delta_step_ops(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, None if mask is None else mask[:, t])
            ys.append(y)
            states.append(state)
        self.states.append(states)
        return mx.stack(ys, axis=1), state

    def packed(self) -> list[mx.array]:
        """What was recorded, as one list of arrays (a traced forward's outputs)."""
        return [state for states in self.states for state in states] + [qkv for _, qkv in self.inputs]

    def unpack(self, arrays: list[mx.array], width: int) -> None:
        """Takes back what `packed` gave, from a traced forward of `width` tokens."""
        n_keep = self.layers[0].conv_kernel_size - 1
        count = len(arrays) // (width + 1)
        self.states = [arrays[i * width : (i + 1) * width] for i in range(count)]
        self.inputs = [(n_keep, qkv) for qkv in arrays[count * width :]]

    def complete(self, layers: list) -> bool:
        """Every gated-delta layer was recorded (else: re-run)."""
        n = sum(1 for c in layers if type(c) is ArraysCache)
        return len(self.states) == len(self.inputs) == n

    def keep(self, layers: list, saved: list, kept: list[int]) -> None:
        """Each row's gated-delta state after its pending token and kept drafts."""
        across = mx.arange(len(kept))
        after = mx.array(kept)  # index of the last kept position
        j = 0
        for c, before in zip(layers, saved):
            if type(c) is not ArraysCache:
                continue
            n_keep, qkv = self.inputs[j]
            conv = before[0] if before[0] is not None else mx.zeros((qkv.shape[0], n_keep, qkv.shape[-1]), dtype=qkv.dtype)
            window = (after + 1)[:, None] + mx.arange(n_keep)
            c[0] = mx.take_along_axis(mx.concatenate([conv, qkv], axis=1), window[..., None], axis=1)
            c[1] = mx.stack(self.states[j])[after, across]
            j += 1


class _Kept(nn.Module):
    """A layer's in_proj_qkv that keeps what it computed (the conv input)."""

    def __init__(self, inner, n_keep: int, out: list):
        super().__init__()
        self.inner = inner
        self._n_keep = n_keep
        self._out = out

    def __call__(self, x):
        y = self.inner(x)
        self._out.append((self._n_keep, y))
        return y


class DraftError(ValueError):
    """A draft model that cannot serve: the worker cannot start as configured."""


def speculator_for(draft: str | None, tokens: int, model, path=None, config: dict | None = None) -> Speculator | None:
    """The worker's speculator for `--draft` (None: no drafter); `path` and
    `config` are the target's directory and config (for "mtp")."""
    if draft is None:
        return None
    from mlx_lm.models.cache import make_prompt_cache

    if not supported(make_prompt_cache(model)):
        kinds = sorted({type(c).__name__ for c in make_prompt_cache(model)})
        log.warning("speculative decoding is off: drafts cannot be rolled back in caches %s", kinds)
        return None
    if draft == "ngram":
        from worker.engine.drafters import NgramDrafter

        log.info("speculative decoding: prompt lookup, up to %d tokens a step", tokens)
        return Speculator(NgramDrafter(), tokens)
    if draft == "mtp":
        return _mtp_speculator(model, path, config or {}, tokens)
    from pathlib import Path

    from worker.engine.drafters import ModelDrafter
    from worker.runtime.loader import load

    try:
        loaded = load(Path(draft).expanduser().resolve())
    except Exception as exc:
        raise DraftError(f"draft model {draft}: {exc}") from exc
    if not supported(make_prompt_cache(loaded.model)):
        raise DraftError(f"draft model {draft}: its caches cannot be rolled back after a draft")
    try:  # a model that cannot run fails here, not at its first draft
        mx.eval(loaded.model(mx.array([[0]]), cache=make_prompt_cache(loaded.model)))
    except Exception as exc:
        raise DraftError(f"draft model {draft} cannot run: {exc}") from exc
    log.info("speculative decoding: draft model %s (%d bytes), up to %d tokens a step", draft, loaded.weights_bytes, tokens)
    return Speculator(ModelDrafter(loaded.model), tokens, loaded.weights_bytes)


def _mtp_speculator(model, path, config: dict, tokens: int) -> Speculator:
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from worker.engine.mtp import MtpDrafter, MtpError, load_head

    try:
        head = load_head(model, path, config)
        drafter = MtpDrafter(model, head)
        # A head that cannot run fails here, not at its first draft; and the
        # verify forward, split at the hidden states, must be the model's.
        probe = mx.array([[0, 1]])
        logits, hidden = drafter.forward(probe, make_prompt_cache(model))
        mx.eval(head(drafter.body.embed_tokens(probe), hidden, KVCache()))
        if not mx.allclose(logits, model(probe, cache=make_prompt_cache(model)), rtol=1e-3, atol=1e-3).item():
            raise MtpError(f'draft = "mtp": this model\'s logits are not its LM head on its final hidden state ({type(model).__module__})')
    except MtpError as exc:
        raise DraftError(str(exc)) from exc
    except Exception as exc:
        raise DraftError(f'draft = "mtp": the MTP head of {path} cannot run: {exc}') from exc
    nbytes = sum(p.nbytes for _, p in tree_flatten(head.parameters()))
    log.info("speculative decoding: the checkpoint's MTP head (%d bytes), up to %d tokens a step", nbytes, tokens)
    return Speculator(drafter, tokens, nbytes)
