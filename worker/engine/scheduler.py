"""Which requests run: the waiting line, the active rows and their streams.

Requests wait first in first out. At a step boundary, when no prefill group
is reading its prompts, the waiting requests whose adapter is ready start
together as the next group, in their order, as long as

- the batch stays within `max_batch` rows, and
- the rows' caches stay within the memory guard (`batch_memory` bytes,
  estimated for the padded batch layout; a lone request always starts).

A request's adapter (worker.lora.manager) is ready once every adapter
message about it sent before the request has been handled and it is
resident; meanwhile later requests may start before it. While a read waits
for room among the resident adapters, requests behind one waiting for its
adapter start only without an adapter, so the rows that pin the resident
ones run out. Each row keeps the adapter version it started with.

Every request ends with exactly one terminal line. A request the model cannot
serve (no prompt, too long, a failing chat template, a response_format that
does not compile) gets an error with its id before any token; an adapter
that cannot be loaded ends the requests waiting for it with `adapter_error`;
a constrained row whose grammar is complete ends `stop`; an exception while
streaming one row ends that row alone; a failed batched step ends every
active row with an error, and the worker goes on with the waiting ones.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ipc.events import ADAPTER_ERROR, BAD_REQUEST, OVERLOADED, WORKER_CRASHED, encode_cancelled_done, encode_done, encode_error
from ipc.messages import DEFAULT_MAX_PROMPT_BYTES, Generate
from ipc.sampling import Sampling
from worker.cache.disk_rates import DiskRates
from worker.cache.prefix_cache import PrefixCache, cut_points, tokens_of
from worker.cache.prefix_disk import READ_WAIT_S, PrefixDisk
from worker.cache.prefix_loaded import Beside, DiskEntry, Loaded
from worker.engine.batch_cache import row_bytes
from worker.engine.compiled_step import CompiledDecode
from worker.engine.constrain import BatchMasks, ConstraintError, Constraints, RowConstraint
from worker.engine.generator import BatchFailed, Row, TokenGenerator
from worker.engine.sampling import RowSampling
from worker.engine.speculate import DEFAULT_TOKENS, speculator_for
from worker.lora.manager import WAIT, AdapterManager, AdapterMessage, Refused
from worker.lora.residency import Version
from worker.runtime import defaults, short_attention
from worker.runtime.batch_size import auto_max_batch, batch_cache_bytes
from worker.runtime.loader import LoadedModel
from worker.runtime.memory import processor, trim_heap, unused_device_memory
from worker.text.prompts import PromptReader, RequestError, model_limit
from worker.text.streamer import Emit, RowStream
from worker.text.tokenizer import TextCodec

log = logging.getLogger("worker")

# Uncached prompt tokens a request must have read for its first token's wait
# to count as a prefill rate (shorter ones are mostly fixed cost).
RATE_MIN_TOKENS = 1024
# Bytes of a read-back's arrays made a step beside running rows: about 20 ms
# of mlx's reading on a 2-core EPYC (445 MB in 0.13-0.16 s), 10 ms on an H100
# machine (339 MB in 50-60 ms).
READ_BACK_STEP_BYTES = 64 << 20
# The longest the prefix cache's disk writes wait for first tokens
# (PrefixDisk.writes_wait_until).
WRITES_HELD_AT_MOST_S = 1.0


@dataclass
class _Restoring:
    """A file read from disk whose arrays are being made."""

    entry: DiskEntry
    loaded: Loaded
    parts: Generator
    spent: float = 0.0  # seconds its parts took


@dataclass
class Waiting:
    req: Generate
    ids: list[int]
    arrived: float
    adapter_clock: int  # its place among adapter messages
    constraint: RowConstraint | None
    # Prefix cache files being read for it: it starts once they are in
    # memory, or at disk_until (time.monotonic()) without them.
    disk: set[str] = field(default_factory=set)
    disk_until: float = 0.0


class Scheduler:
    # A lone prompt's last chunk reads its last token too (TokenGenerator._folds).
    fold_last_token = True

    def __init__(
        self,
        loaded: LoadedModel,
        codec: TextCodec,
        emit: Emit,
        *,
        batch_memory: int,
        max_batch: int | None = defaults.MAX_BATCH,  # None: auto (worker.runtime.batch_size)
        prefill_step: int | None = None,
        prefix_cache_bytes: int = defaults.PREFIX_CACHE_BYTES,
        max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
        adapters: AdapterManager | None = None,
        idle_release_s: float = defaults.IDLE_RELEASE_S,
        run_ahead: bool = True,
        compile_decode: bool = True,
        mask_threads: int | None = None,
        draft: str | None = None,
        draft_tokens: int = DEFAULT_TOKENS,
        max_context: int | None = None,
        prefix_disk: PrefixDisk | None = None,
        held_elsewhere: int = 0,  # worker.runtime.memory.unused_device_memory's
    ):
        self.loaded = loaded
        self.run_ahead = run_ahead  # TokenGenerator's
        # One compiled decode step for every generator made here (the
        # warm-up's too), so its traces are made once.
        self.compiled = CompiledDecode(loaded.model) if compile_decode else None
        self.codec = codec
        # Lines are collected and written once per step (or per message
        # handled): one system call for a step's tokens of every row.
        self._write = emit
        self._lines: list[bytes] = []
        self.emit = self._lines.append
        # What streaming each row's token of this step gave (a finish reason,
        # None to go on, or the exception), for rows streamed as soon as
        # the generator read them (_read).
        self._fed: dict[Row, str | Exception | None] = {}
        self.prompts = PromptReader(codec, loaded.config, max_prompt_bytes, max_context)
        self.vocab_size = model_limit(loaded.config, "vocab_size") or codec.vocab_size
        self.prefix_cache = PrefixCache(loaded.model, prefix_cache_bytes, prefix_disk)
        # The tokenizer view for llguidance is built on the first
        # response_format (0.6-1.7 s and 88 MB for a 151k vocabulary).
        self._constraints: Constraints | None = None
        # None: worker.engine.constrain.default_mask_threads()
        self.masks = BatchMasks(self.vocab_size, codec.eos_ids, mask_threads)
        if prefill_step is None:
            prefill_step = defaults.PREFILL_STEP_GPU if mx.default_device() == mx.gpu else defaults.PREFILL_STEP_CPU
        self.prefill_step = prefill_step
        self.adapters = adapters or AdapterManager(loaded.model, loaded.path.name)
        self.adapters.emit = self.emit
        # One speculator for every generator made here: its measurements of
        # plain and speculative steps outlive a generator lost to a fault.
        self.speculator = speculator_for(draft, draft_tokens, loaded.model, loaded.path, loaded.config)
        self.generator = self._generator(self.prefix_cache)
        self.batch_memory = batch_memory
        self.row_fixed_bytes, self.row_token_bytes = row_bytes(loaded.model)
        if max_batch is None:
            chosen = auto_max_batch(
                processor=processor(),
                # The prefix cache fills its budget as it is used: what it
                # will hold is not memory for rows.
                free_bytes=unused_device_memory(held_elsewhere) - self.prefix_cache.budget,
                guard_bytes=batch_memory,
                row_fixed_bytes=self.row_fixed_bytes,
                row_token_bytes=self.row_token_bytes,
                context=self.prompts.max_context,
            )
            self.max_batch, self.max_batch_why = chosen.rows, chosen.why
        else:
            self.max_batch, self.max_batch_why = max(1, max_batch), "configured"
        if self.max_batch > 1 and not self.generator.can_batch:
            log.info("this architecture's caches cannot be batched: one request at a time")
            self.max_batch, self.max_batch_why = 1, "this architecture's caches cannot be batched"
        if self.compiled is not None:
            self.compiled.keep_for(self.max_batch)
        self.waiting: deque[Waiting] = deque()
        self.streams: dict[Row, RowStream] = {}
        self._by_rid: dict[int, Row] = {}
        # The adapter version each row runs with, released when it ends.
        self._versions: dict[Row, Version] = {}
        # Every waiting request waits for an adapter read: nothing to do
        # until a message comes or a read ends.
        self._stalled = False
        # The last admission started every request it could: none waits
        # for a row or for memory.
        self._room = True
        self._guard_logged = False
        self._ended_ids: dict[int, list[int]] | None = None
        # When the last batch emptied, while MLX still caches its buffers,
        # and whether the heap was trimmed since.
        self.idle_since: float | None = None
        self._trimmed = True
        self.idle_release_s = idle_release_s
        # When the alarm last set wakes the worker (time.monotonic()).
        self._disk_due: float | None = None
        # Files whose arrays are made a part a step (_disk_results), while
        # no request waits for a file: at most one per file in the disk
        # tier's index.
        self._restoring: deque[_Restoring] = deque()
        # mlx's read of a file a request waits for, started beside its check
        # (PrefixDisk.read_beside), by name: one at a time, so that files
        # waited for hold no more than one file's arrays before their checks.
        self._beside: dict[str, Beside] = {}
        # Read-backs made since the last rehearsal of a hit (PrefixCache.rehearse).
        self._rehearse_due = False
        self._first_pending_since: float | None = None  # since when a first token has been pending
        # Files read and long prompts read, timed (_disk_results, _end).
        self.disk_rates = DiskRates()
        self.figures = self._figures()

    def _generator(self, prefix_cache: PrefixCache, speculate: bool = True) -> TokenGenerator:
        marker = self.codec.tokenizer.token_to_id("<|im_start|>")
        speculator = self.speculator if speculate else None
        if speculator is not None:
            speculator.clear()
        generator = TokenGenerator(
            self.loaded.model,
            self.vocab_size,
            prefix_cache,
            self.prefill_step,
            marker,
            self.adapters.route,
            self.masks,
            self.run_ahead,
            self.compiled,
            speculator,
            frozenset(self.codec.eos_ids),
            self.fold_last_token,
        )
        generator.on_read = self._read
        return generator

    def _constraint(self, req: Generate, ids: list[int]) -> RowConstraint | None:
        """The request's compiled response_format (RequestError when it
        does not compile)."""
        if req.response_format is None:
            return None
        if self._constraints is None:
            self._constraints = Constraints.for_codec(self.codec, self.vocab_size, lexers=self.masks.threads)
        try:
            return self._constraints.row(req.response_format, ids)
        except ConstraintError as exc:
            raise RequestError(BAD_REQUEST, str(exc)) from exc

    # -- requests in --------------------------------------------------------

    def submit(self, req: Generate, arrived: float) -> None:
        if len(self.waiting) >= defaults.MAX_WAITING:
            self._write(encode_error(f"the worker already holds {defaults.MAX_WAITING} waiting requests", OVERLOADED, req.id_json))
            return
        try:
            ids = self.prompts.ids(req)
            if req.count_only:
                total_ms = int((time.perf_counter() - arrived) * 1000)
                self._write(
                    encode_done(tok_s=0.0, ttft_ms=0.0, prompt_tokens=len(ids), gen_tokens=0, total_ms=total_ms, finish_reason="stop", id_json=req.id_json)
                )
                return
            req = self.prompts.fit(req, ids)
            constraint = self._constraint(req, ids)
        except RequestError as exc:
            log.info("request %s rejected: %s", req.id_json or req.rid, exc.msg)
            self._write(encode_error(exc.msg, exc.code, req.id_json))
            return
        waiting = Waiting(req, ids, arrived, self.adapters.arrival(), constraint)
        self._read_from_disk(waiting)
        self.waiting.append(waiting)
        self._stalled = False

    def _read_from_disk(self, w: Waiting) -> None:
        """Starts reading the prefix cache files that would resume more of
        the request's prompt than memory holds (for any adapter: which one
        it runs with is settled when it starts), where reading is faster
        than computing what they hold (worker.cache.prefix_disk); it waits
        for them."""
        disk = self.prefix_cache.disk
        if disk is None:
            return
        try:
            rates = self.disk_rates
            tokens = tokens_of(w.ids)
            for entry, saved in self.prefix_cache.disk_reads(tokens, cut_points(tokens, self.generator.chat_marker)):
                if rates.skip(entry.size, saved):
                    log.info(
                        "request %s: prefix cache file %s not read: %d MB at %.2f GB/s takes longer than %d tokens at %.0f tokens/s",
                        w.req.id_json or w.req.rid,
                        entry.name,
                        entry.size >> 20,
                        rates.read.value / 1e9,
                        saved,
                        rates.prefill.value,
                    )
                    continue
                disk.read(entry)
                w.disk.add(entry.name)
                if not self._beside and (beside := disk.read_beside(entry)) is not None:
                    self._beside[entry.name] = beside
        except Exception:  # the disk tier is an optimisation: never a request's failure
            log.exception("prefix cache: looking on disk failed")
        if w.disk:
            log.info("request %s waits for %d prefix cache file(s) on disk", w.req.id_json or w.req.rid, len(w.disk))
            w.disk_until = time.monotonic() + READ_WAIT_S
            self._disk_alarm(READ_WAIT_S)

    def _disk_alarm(self, seconds: float) -> None:
        """Wakes the worker after `seconds`, when a request stops waiting
        for the disk: one timer at a time, set again for the next deadline
        by _admit. A timer counts until it is due, not while it is alive:
        the one whose wake started this _admit may still run."""
        now = time.monotonic()
        if self._disk_due is not None and now < self._disk_due <= now + seconds:
            return
        self._disk_due = now + seconds
        timer = threading.Timer(seconds, self.prefix_cache.disk.wake)
        timer.daemon = True
        timer.start()

    def _disk_results(self) -> None:
        """Files read since the last step go into the memory tier, and the
        requests waiting for them may start."""
        disk = self.prefix_cache.disk
        if disk is None:
            return
        awaited = set().union(*(w.disk for w in self.waiting))
        for entry, loaded in disk.results():
            # Read beside a check that failed, or for a request that stopped
            # waiting, its arrays are dropped here, never used.
            beside = self._beside.pop(entry.name, None)
            if entry.name not in awaited:
                # A read-back (or a file its request stopped waiting for):
                # made a part a step, once no request waits for a file.
                if loaded is not None:
                    self._restoring.append(_Restoring(entry, loaded, loaded.parts(READ_BACK_STEP_BYTES)))
                    self._rehearse_due = True
                continue
            if loaded is not None:
                self._restore(_Restoring(entry, loaded, loaded.parts(None, beside)))
            for w in self.waiting:
                w.disk.discard(entry.name)
            self._stalled = False
        if self._restoring and not awaited:
            if self._restore(self._restoring[0]):
                self._restoring.popleft()
        if self._rehearse_ready:
            self._rehearse_due = False
            t0 = time.monotonic()
            try:
                if tokens := self.prefix_cache.rehearse():
                    log.info("prefix cache: a hit on %d tokens rehearsed in %.0f ms", tokens, (time.monotonic() - t0) * 1e3)
            except Exception:  # only a head start for the first hit: the worker goes on without it
                log.exception("prefix cache: rehearsing a hit failed")

    def _restore(self, restoring: _Restoring) -> bool:
        """Makes the next part of a file's arrays; at the last, puts its
        snapshot in the memory tier. True when it has ended."""
        t0 = time.monotonic()
        try:
            next(restoring.parts)
            return False
        except StopIteration as end:
            restored = end.value
        except Exception:
            log.exception("prefix cache: %s could not be restored", restoring.entry.name)
            return True
        finally:
            restoring.spent += time.monotonic() - t0
        entry, loaded = restoring.entry, restoring.loaded
        try:
            if restored is not None and self.prefix_cache.insert_read(entry.adapter, entry.tokens, *restored):
                self.disk_rates.read.add(entry.size, loaded.check_s + restoring.spent)
                log.info(
                    "prefix cache: %d tokens read from disk (%d MB: checked in %.0f ms, arrays in %.0f ms)",
                    len(entry.tokens),
                    entry.size // 10**6,
                    loaded.check_s * 1e3,
                    restoring.spent * 1e3,
                )
        except Exception:
            log.exception("prefix cache: %s could not be restored", entry.name)
        return True

    def adapter_message(self, msg: AdapterMessage) -> None:
        self.adapters.submit(msg)
        self._stalled = False

    def cancel(self, rid: int) -> None:
        for waiting in self.waiting:
            if waiting.req.rid == rid:
                self.waiting.remove(waiting)
                self._stalled = False
                self._write(encode_cancelled_done(waiting.req.id_json, len(waiting.ids)))
                return
        row = self._by_rid.get(rid)
        if row is None:
            log.debug("cancel of request %d, which is not here", rid)
            return
        self.generator.remove([row])
        self._end(row, "cancelled")
        self._flush()

    def _flush(self) -> None:
        # The figures first: a stats request (answered on the reader thread)
        # that follows a request's last line must not count it still active.
        self.figures = self._figures()
        if self._lines:
            self._write(b"".join(self._lines))
            self._lines.clear()

    @property
    def has_work(self) -> bool:
        return (
            self._rehearse_ready
            or bool(self.generator)
            or (bool(self.waiting) and not self._stalled)
            or self.adapters.has_results
            or (bool(self._restoring) and not any(w.disk for w in self.waiting))
            or (self.prefix_cache.disk is not None and bool(self.prefix_cache.disk.uncopied))
        )

    @property
    def _rehearse_ready(self) -> bool:
        """Every file read back is in the memory tier and nothing runs: a
        hit's rehearsal holds up no request (PrefixCache.rehearse)."""
        disk = self.prefix_cache.disk
        return self._rehearse_due and not self._restoring and not self.busy and disk is not None and not disk.reading

    @property
    def busy(self) -> bool:
        return bool(self.generator) or bool(self.waiting)

    def idle_release_in(self, now: float) -> float | None:
        """Seconds until an idle worker hands MLX's buffer cache back (0: now),
        or None when it is busy, holds nothing to hand back, or never does."""
        if self.idle_since is None or self.busy or self.idle_release_s == math.inf:
            return None
        return max(0.0, self.idle_since + self.idle_release_s - now)

    def release_idle(self) -> None:
        mx.clear_cache()
        self.idle_since = None

    # -- the loop -----------------------------------------------------------

    def step(self) -> None:
        """Admits what may start, then runs one generator step and streams
        its tokens."""
        try:
            self._step()
        except Exception as exc:  # a fault of the worker, not of a request
            log.exception("a step failed; ending the active requests")
            rows = [row for row in self.generator.rows if row in self.streams]
            # Whatever state the generator was left in, start afresh.
            self.generator = self._generator(self.prefix_cache)
            for row in rows:
                self._fail(row, exc)
        self._flush()
        if self.idle_since is not None and not self._trimmed:
            # After the lines are out, so no final line waits for it: the
            # heap that the batch's bookkeeping and new kernels' compilation
            # (on CUDA) left goes back at once; MLX's buffers only after
            # idle_release_s (WorkerServer._wait).
            trim_heap()
            self._trimmed = True

    def _step(self) -> None:
        self._fed.clear()
        self._disk_results()
        settled = self.adapters.poll()
        self._admit(sweep=settled)
        if self.generator:
            try:
                out = self.generator.step()
            except BatchFailed as failed:
                log.error("a batched step failed; ending %d rows", len(failed.rows), exc_info=failed.cause)
                for row in failed.rows:
                    self._fail(row, failed.cause)
                out = failed.out
            self._stream(out)
            if not self.generator:
                self.idle_since = time.monotonic()
                self._trimmed = False
        # Reads the admission asked for start now, and versions whose last
        # row ended this step are dropped.
        self.adapters.dispatch(room=self._room)
        disk = self.prefix_cache.disk
        if disk is not None:
            # Snapshot writes wait while a request waits for its first token,
            # for WRITES_HELD_AT_MOST_S at most, so a flow of requests cannot
            # hold them for ever.
            if self.generator.first_token_pending:
                if self._first_pending_since is None:
                    self._first_pending_since = time.monotonic()
                disk.writes_wait_until = self._first_pending_since + WRITES_HELD_AT_MOST_S
            else:
                self._first_pending_since = None
                disk.writes_wait_until = 0.0
            disk.make_copies()

    def drain(self) -> dict[int, list[int]]:
        """Steps until every request here has ended; returns the generated
        ids of the requests that ended meanwhile, by rid (in-process use:
        tests and benchmarks)."""
        self._ended_ids = {}
        try:
            disk = self.prefix_cache.disk
            while self.has_work or (self.waiting and (self.adapters.reading or (disk is not None and disk.reading))):
                if not self.has_work:
                    if disk is not None and disk.reading:
                        disk.wait(1.0)
                    else:
                        self.adapters.wait(1.0)
                self.step()
            return self._ended_ids
        finally:
            self._ended_ids = None

    def _admit(self, sweep: bool) -> None:
        """Starts what may start. The line is read up to where the batch is
        full, or whole when an adapter read has just ended (`sweep`), so the
        requests it failed get their error."""
        self._room = True
        if not self.waiting:
            return
        active = self.generator.rows
        lengths = [len(row.ids) + len(self.streams[row].generated) for row in active]
        start: list[tuple[Waiting, Version | None]] = []
        scanned: deque[Waiting] = deque()
        full = False
        behind_starved = False
        now = time.monotonic()
        while self.waiting and (sweep or not full):
            w = self.waiting.popleft()
            if w.disk:
                if now < w.disk_until:
                    self._disk_alarm(w.disk_until - now)
                    scanned.append(w)
                    continue
                log.warning("request %s: prefix cache files still being read after %.0f s; it starts without them", w.req.id_json or w.req.rid, READ_WAIT_S)
                w.disk.clear()
            got = self.adapters.resolve(w.req.lora, w.adapter_clock)
            if isinstance(got, Refused):
                log.info("request %s: %s", w.req.id_json or w.req.rid, got.msg)
                self.emit(encode_error(got.msg, ADAPTER_ERROR, w.req.id_json))
                continue
            if got is WAIT:
                behind_starved = behind_starved or self.adapters.starved
            elif not full and not (got is not None and behind_starved):
                if len(active) + len(start) >= self.max_batch:
                    full = True
                elif (active or start) and self._projected_bytes(lengths + [len(s.ids) for s, _ in start] + [len(w.ids)]) > self.batch_memory:
                    if not self._guard_logged:
                        log.info("memory guard (%d bytes): %d requests wait for rows to end", self.batch_memory, len(self.waiting) + 1)
                        self._guard_logged = True
                    full = True
                else:
                    start.append((w, got))
                    continue
            scanned.append(w)
        self.waiting.extendleft(reversed(scanned))
        self._room = not full
        self._stalled = not start and not self.generator
        if not start:
            return
        self._guard_logged = False
        rows = []
        for w, version in start:
            stream = RowStream(w.req, w.ids, self.codec, self.emit, w.arrived)
            # A reasoning budget may force </think> (_stream).
            row = Row(
                w.req.rid, w.ids, RowSampling(w.req, self.vocab_size, w.ids, w.req.logprobs), constraint=w.constraint, may_force=stream.think.budget is not None
            )
            row.speculative = self.speculator is not None and w.req.speculative
            row.draft_limit = stream.draft_limit()
            if version is not None:
                row.adapter, row.slot = version.key, version.slot
                self.adapters.acquire(version)
                self._versions[row] = version
            self.streams[row] = stream
            self._by_rid[row.rid] = row
            rows.append(row)
        try:
            self.generator.start(rows)
        except Exception as exc:  # e.g. out of memory restoring a snapshot
            log.exception("requests could not start")
            self.generator.remove(rows)
            # Joining the group that was reading can take that group down too.
            for row in rows + (exc.rows if isinstance(exc, BatchFailed) else []):
                self._fail(row, exc)

    def _projected_bytes(self, lengths: list[int]) -> int:
        return batch_cache_bytes(len(lengths), max(lengths), self.row_fixed_bytes, self.row_token_bytes)

    def _feed(self, row: Row, token: int | None) -> str | None:
        """Streams the row's token; returns its finish reason, if any."""
        if row.broken is not None:
            raise row.broken
        if token is None:
            return None
        if row.logprobs:
            return self.streams[row].feed(token, row.logprobs.popleft())
        return self.streams[row].feed(token)

    def _read(self, out: list[tuple[Row, int | None]]) -> None:
        """A constrained step's tokens, streamed and written as soon as the
        generator has read them, before it hands the step's masked draw to
        mlx: on mlx's CPU backend that hand-over waits while the forward
        pass it masks runs, which put every token of a constrained row one
        pass behind a free row's (151k vocabulary, a first token 37 ms
        later). Ending rows and forcing tokens wait for the step's end, and
        so does asking a row's grammar whether it is done: the step's masks
        are filling on their side thread, and llguidance refuses a matcher
        that another thread is using ("Already mutably borrowed")."""
        for row, token in out:
            if token is None or row not in self.streams:
                continue
            try:
                self._fed[row] = self._feed(row, token)
            except Exception as exc:
                self._fed[row] = exc
        self._flush()

    def _stream(self, out: list[tuple[Row, int | None]]) -> None:
        ended: list[tuple[Row, str]] = []
        failed: list[tuple[Row, Exception]] = []
        # A speculative step gives a row several tokens in a row; what the
        # row's grammar and reasoning budget say is read after its last one,
        # and a row that ends (a stop string inside the block) drops the rest.
        last = {row: i for i, (row, _) in enumerate(out)}
        over: set[Row] = set()
        for i, (row, token) in enumerate(out):
            if row in over:
                continue
            stream = self.streams[row]
            try:
                reason = self._fed.pop(row) if row in self._fed else self._feed(row, token)
                if isinstance(reason, Exception):
                    raise reason
                if last[row] != i and reason is None:
                    continue
                if token is not None and row.constraint is not None and row.constraint.done:
                    reason = "stop"  # the grammar is complete, max_tokens or not
                if reason is not None:
                    ended.append((row, reason))
                    over.add(row)
                elif stream.must_close_think():
                    self.generator.force(row, stream.think_end)
                row.draft_limit = stream.draft_limit()
            except Exception as exc:  # one row's failure ends that row only
                log.exception("request %s failed while streaming", stream.id_json or row.rid)
                failed.append((row, exc))
                over.add(row)
        if ended or failed:
            self.generator.remove([row for row, _ in ended] + [row for row, _ in failed])
        for row, reason in ended:
            self._end(row, reason)
        for row, exc in failed:
            self._fail(row, exc)

    def _forget(self, row: Row) -> RowStream:
        if self._by_rid.get(row.rid) is row:
            del self._by_rid[row.rid]
        version = self._versions.pop(row, None)
        if version is not None:
            self.adapters.release(version)
        return self.streams.pop(row)

    def _end(self, row: Row, reason: str) -> None:
        stream = self._forget(row)
        computed = len(row.ids) - row.cached
        if computed >= RATE_MIN_TOKENS and stream.ttft_ms > 0:
            # Its first token's wait, over the tokens it read: a prefill rate
            # no faster than the true one (a wait in line or beside other
            # rows counts against it), so files are read where in doubt.
            self.disk_rates.prefill.add(computed, stream.ttft_ms / 1000.0)
        if self._ended_ids is not None:
            self._ended_ids[row.rid] = stream.generated
        try:
            stream.finish(reason, row.cached, (row.drafted, row.accepted) if row.speculative else None)
        except Exception as exc:
            log.exception("request %s failed at its end", stream.id_json or row.rid)
            self.emit(encode_error(f"generation failed in the worker: {exc}", WORKER_CRASHED, stream.id_json))
        log.debug("request %s finished: %s", stream.id_json or row.rid, reason)

    def _fail(self, row: Row, exc: BaseException) -> None:
        stream = self._forget(row)
        self.emit(encode_error(f"generation failed in the worker: {exc}", WORKER_CRASHED, stream.id_json))

    def _figures(self) -> dict[str, int]:
        return {
            "active_rows": len(self.generator.rows),
            "waiting_rows": len(self.waiting),
            "rows_cache_bytes": self.generator.cache_bytes,
            "max_batch": self.max_batch,
            **self.adapters.figures(),
            **(self.speculator.figures() if self.speculator is not None else {}),
        }

    # -- warm-up ------------------------------------------------------------

    def warm_up(self) -> None:
        """Runs requests with ipc's default settings (and a greedy one)
        through a generator of its own, so kernels compile before `ready`:
        a lone row (on CUDA until its way of stepping is chosen), then a
        full batch of prompts of different lengths
        (padded prefill, mixed samplers) that shrinks one row per step, so
        every batch size up to max_batch has run once; then the token mask
        of structured output at each batch size."""
        generator = self._generator(PrefixCache(self.loaded.model, 0), speculate=False)
        default = Sampling()
        greedy = Sampling(temperature=0.0)

        def row(i: int, params: Sampling) -> Row:
            ids = self.codec.encode("<|im_start|>user\nwarm up" + " up" * i + "<|im_end|>\n") or [0]
            return Row(0, ids, RowSampling(params, self.vocab_size, ids))

        def run(rows: list[Row], steps: int) -> None:
            generator.start(rows)
            while generator.prefilling:
                generator.step()
            for _ in range(steps):
                generator.step()

        lone = row(0, default)
        run([lone], 2)
        # On CUDA a lone row's way of stepping (traced or op by op) is timed
        # here rather than in the first request's steps, half of which would
        # take the slower way (worker.engine.step_choice): a chat app's
        # requests mostly come one at a time.
        generator.step_until_chosen(1)
        generator.remove([lone])
        rows = [row(i, greedy if i == 1 else default) for i in range(self.max_batch)]
        run(rows, 1)
        while rows:
            generator.step()
            generator.remove([rows.pop()])
        self.adapters.route([None])
        cache = make_prompt_cache(self.loaded.model)
        self.masks.warm_up(self.loaded.model(mx.array([[0]]), cache=cache)[:, -1, :], self.max_batch)
        self.prefix_cache.learn_layout(cache)
        # A prompt resumed from the prefix cache reads its last message over
        # a long cache: on CUDA that attention has a route of its own, whose
        # kernels load here.
        short_attention.warm_up(cache)
        mx.clear_cache()
