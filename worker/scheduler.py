"""Which requests run: the waiting line, the active rows and their streams.

Requests wait first in first out. At a step boundary, when no prefill group
is reading its prompts, the waiting requests at the head of the line start
together as the next group, as long as

- the batch stays within `max_batch` rows,
- the rows' caches stay within the memory guard (`batch_memory` bytes,
  estimated for the padded batch layout; a lone request always starts), and
- no adapter swap is pending.

An adapter swap waits until no row is active (new rows wait behind it), so
every request runs on exactly one adapter version.

Every request ends with exactly one terminal line. A request the model cannot
serve (no prompt, too long, a failing chat template) gets an error with its
id before any token; an exception while streaming one row ends that row
alone; a failed batched step ends every active row with an error, and the
worker goes on with the waiting ones.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable

import mlx.core as mx

from ipc.events import OVERLOADED, WORKER_CRASHED, encode_cancelled_done, encode_error
from ipc.messages import DEFAULT_MAX_PROMPT_BYTES, Generate
from worker import defaults
from worker.batch_cache import row_bytes
from worker.generator import BatchFailed, Row, TokenGenerator
from worker.loader import LoadedModel
from worker.prefix_cache import PrefixCache
from worker.prompts import PromptReader, RequestError, model_limit
from worker.sampling import RowSampling, SamplingParams
from worker.streamer import Emit, RowStream
from worker.text import TextCodec

log = logging.getLogger("worker")


@dataclass
class Waiting:
    req: Generate
    ids: list[int]
    arrived: float


class Scheduler:
    def __init__(
        self,
        loaded: LoadedModel,
        codec: TextCodec,
        emit: Emit,
        *,
        batch_memory: int,
        max_batch: int = defaults.MAX_BATCH,
        prefill_step: int | None = None,
        prefix_cache_bytes: int = defaults.PREFIX_CACHE_BYTES,
        max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
    ):
        self.loaded = loaded
        self.codec = codec
        # Lines are collected and written once per step (or per message
        # handled): one system call for a step's tokens of every row.
        self._write = emit
        self._lines: list[bytes] = []
        self.emit = self._lines.append
        self.prompts = PromptReader(codec, loaded.config, max_prompt_bytes)
        self.vocab_size = model_limit(loaded.config, "vocab_size") or codec.vocab_size
        self.prefix_cache = PrefixCache(loaded.model, prefix_cache_bytes)
        if prefill_step is None:
            prefill_step = defaults.PREFILL_STEP_GPU if mx.default_device() == mx.gpu else defaults.PREFILL_STEP_CPU
        self.prefill_step = prefill_step
        self.generator = self._generator(self.prefix_cache)
        self.max_batch = max(1, max_batch)
        if self.max_batch > 1 and not self.generator.can_batch:
            log.info("this architecture's caches cannot be batched: one request at a time")
            self.max_batch = 1
        self.batch_memory = batch_memory
        self.row_fixed_bytes, self.row_token_bytes = row_bytes(loaded.model)
        # Content sha256 of the active LoRA adapter (None: none). Anything
        # cached from model state must be keyed by it, never by the path.
        self.adapter_key: str | None = None
        self.waiting: deque[Waiting] = deque()
        self.streams: dict[Row, RowStream] = {}
        self._by_rid: dict[int, Row] = {}
        self._swaps: deque[Callable[[], None]] = deque()
        self._guard_logged = False
        self._ended_ids: dict[int, list[int]] | None = None
        self.figures = self._figures()

    def _generator(self, prefix_cache: PrefixCache) -> TokenGenerator:
        return TokenGenerator(self.loaded.model, self.vocab_size, prefix_cache, self.prefill_step, self.codec.tokenizer.token_to_id("<|im_start|>"))

    # -- requests in --------------------------------------------------------

    def submit(self, req: Generate, arrived: float) -> None:
        if len(self.waiting) >= defaults.MAX_WAITING:
            self._write(encode_error(f"the worker already holds {defaults.MAX_WAITING} waiting requests", OVERLOADED, req.id_json))
            return
        try:
            ids = self.prompts.ids(req)
        except RequestError as exc:
            log.info("request %s rejected: %s", req.id_json or req.rid, exc.msg)
            self._write(encode_error(exc.msg, exc.code, req.id_json))
            return
        self.waiting.append(Waiting(req, ids, arrived))

    def cancel(self, rid: int) -> None:
        for waiting in self.waiting:
            if waiting.req.rid == rid:
                self.waiting.remove(waiting)
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

    def run_when_idle(self, job: Callable[[], None]) -> None:
        """Runs `job` (an adapter swap) once no row is active; rows that have
        not started wait until it has run."""
        self._swaps.append(job)

    @property
    def has_work(self) -> bool:
        return bool(self.generator) or bool(self.waiting) or bool(self._swaps)

    @property
    def busy(self) -> bool:
        return bool(self.generator) or bool(self.waiting)

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

    def _step(self) -> None:
        while self._swaps and not self.generator:
            self._swaps.popleft()()
        if not self._swaps:
            self._admit()
        if self.generator:
            try:
                out = self.generator.step()
            except BatchFailed as failed:
                log.error("a batched step failed; ending %d rows", len(failed.rows), exc_info=failed.cause)
                for row in failed.rows:
                    self._fail(row, failed.cause)
                out = []
            self._stream(out)
            if not self.generator:
                mx.clear_cache()

    def drain(self) -> dict[int, list[int]]:
        """Steps until every request here has ended; returns the generated
        ids of the requests that ended meanwhile, by rid (in-process use:
        tests and benchmarks)."""
        self._ended_ids = {}
        try:
            while self.has_work:
                self.step()
            return self._ended_ids
        finally:
            self._ended_ids = None

    def _admit(self) -> None:
        if self.generator.prefilling or not self.waiting:
            return
        active = self.generator.rows
        lengths = [len(row.ids) + len(self.streams[row].generated) for row in active]
        start: list[Waiting] = []
        while self.waiting and len(active) + len(start) < self.max_batch:
            head = self.waiting[0]
            if active or start:
                if self._projected_bytes(lengths + [len(w.ids) for w in start] + [len(head.ids)]) > self.batch_memory:
                    if not self._guard_logged:
                        log.info("memory guard (%d bytes): %d requests wait for rows to end", self.batch_memory, len(self.waiting))
                        self._guard_logged = True
                    break
            start.append(self.waiting.popleft())
        if not start:
            return
        self._guard_logged = False
        rows = []
        for w in start:
            row = Row(w.req.rid, w.ids, RowSampling(SamplingParams.of(w.req), self.vocab_size, w.ids), adapter=self.adapter_key)
            self.streams[row] = RowStream(w.req, w.ids, self.codec, self.emit, w.arrived)
            self._by_rid[row.rid] = row
            rows.append(row)
        try:
            self.generator.start(rows)
        except Exception as exc:  # e.g. out of memory restoring a snapshot
            log.exception("requests could not start")
            self.generator.remove(rows)
            for row in rows:
                self._fail(row, exc)

    def _projected_bytes(self, lengths: list[int]) -> int:
        """Cache bytes of a batch of rows of these lengths: attention caches
        are padded to the longest row and grow in 256-token steps."""
        width = -(-max(lengths) // 256) * 256
        return len(lengths) * (self.row_fixed_bytes + width * self.row_token_bytes)

    def _stream(self, out: list[tuple[Row, int | None]]) -> None:
        ended: list[tuple[Row, str]] = []
        failed: list[tuple[Row, Exception]] = []
        for row, token in out:
            stream = self.streams[row]
            try:
                reason = None if token is None else stream.feed(token)
                if reason is not None:
                    ended.append((row, reason))
                elif stream.must_close_think():
                    self.generator.force(row, stream.think_end)
            except Exception as exc:  # one row's failure ends that row only
                log.exception("request %s failed while streaming", stream.id_json or row.rid)
                failed.append((row, exc))
        if ended or failed:
            self.generator.remove([row for row, _ in ended] + [row for row, _ in failed])
        for row, reason in ended:
            self._end(row, reason)
        for row, exc in failed:
            self._fail(row, exc)

    def _forget(self, row: Row) -> RowStream:
        if self._by_rid.get(row.rid) is row:
            del self._by_rid[row.rid]
        return self.streams.pop(row)

    def _end(self, row: Row, reason: str) -> None:
        stream = self._forget(row)
        if self._ended_ids is not None:
            self._ended_ids[row.rid] = stream.generated
        try:
            stream.finish(reason, row.cached)
        except Exception as exc:
            log.exception("request %s failed at its end", stream.id_json or row.rid)
            self.emit(encode_error(f"generation failed in the worker: {exc}", WORKER_CRASHED, stream.id_json))
        log.debug("request %s finished: %s", stream.id_json or row.rid, reason)

    def _fail(self, row: Row, exc: BaseException) -> None:
        stream = self._forget(row)
        self.emit(encode_error(f"generation failed in the worker: {exc}", WORKER_CRASHED, stream.id_json))

    def _figures(self) -> dict[str, int]:
        return {
            "active_rows": len(self.generator),
            "waiting_rows": len(self.waiting),
            "rows_cache_bytes": self.generator.cache_bytes,
            "max_batch": self.max_batch,
        }

    # -- warm-up ------------------------------------------------------------

    def warm_up(self) -> None:
        """Runs requests with ipc's default settings (and a greedy one)
        through a generator of its own, so kernels compile before `ready`:
        a lone row, then a full batch of prompts of different lengths
        (padded prefill, mixed samplers) that shrinks one row per step, so
        every batch size up to max_batch has run once."""
        generator = self._generator(PrefixCache(self.loaded.model, 0))
        default = SamplingParams.of(Generate(rid=0))
        greedy = replace(default, temperature=0.0)

        def row(i: int, params: SamplingParams) -> Row:
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
        generator.remove([lone])
        rows = [row(i, greedy if i == 1 else default) for i in range(self.max_batch)]
        run(rows, 1)
        while rows:
            generator.step()
            generator.remove([rows.pop()])
        mx.clear_cache()
