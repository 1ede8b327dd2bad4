"""One worker as the pool sees it: its process, its state, its request queue.

Everything here runs on the event loop thread; the handle is the single owner
of its worker's state (llama-swap's one-owner-per-process rule), so no locks.
Requests for one worker run FIFO, one at a time; the worker's lines are
relayed to stdout as received bytes, never decoded and re-encoded, except
terminal lines, which are also parsed for accounting.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import msgspec

from ipc.events import (
    LOAD_FAILED,
    MODEL_FAILED,
    UNLOADED,
    WORKER_CRASHED,
    encode_cancelled_done,
    encode_error,
    encode_event,
    event_name,
    is_final_token,
)
from ipc.messages import HEARTBEAT, WORKER_STATS, Cancel, Generate, SetAdapter, Stats
from supervisor.logs import LastMessage
from supervisor.policy import CrashHistory, GiveUp, on_crash
from supervisor.process import RESOURCE_ERRNOS, WorkerProcess
from supervisor.resolve import ModelSpec
from supervisor.states import LIVE, State, StateMachine

if TYPE_CHECKING:
    from supervisor.pool import Pool

log = logging.getLogger("lattice.worker")

_TOKEN_PREFIX = b'@@lattice {"ev":"gen_token","token":'
_TOKEN_LINE_START = b"\n" + _TOKEN_PREFIX
_FINAL = b'"done":true'
_IDLE_BEAT = b'"busy":false'

# How long a cancelled request may take to end before its worker is killed.
CANCEL_GRACE = 5.0


class _Final(msgspec.Struct):
    gen_tokens: int = 0
    ttft_ms: float = 0.0
    tok_s: float = 0.0
    finish_reason: str | None = None


class _ErrorLine(msgspec.Struct):
    code: str | None = None


_final_decoder = msgspec.json.Decoder(_Final)
_error_decoder = msgspec.json.Decoder(_ErrorLine)
_object_decoder = msgspec.json.Decoder(dict)


@dataclass(eq=False)
class Job:
    """A generation request on its way through the pool."""

    rid: int
    generate: Generate
    id_json: str | None
    spec: ModelSpec
    emitted: bool = False
    attempts: int = 0
    finished: bool = False
    on_end: Callable[["Job"], None] | None = None

    @property
    def label(self) -> str:
        return self.id_json or f"#{self.rid}"


def describe_exit(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class WorkerHandle:
    def __init__(self, spec: ModelSpec, pool: "Pool"):
        self.spec = spec
        self.pool = pool
        self.sm = StateMachine(self._describe)
        self.queue: collections.deque[Job] = collections.deque()
        self.current: Job | None = None
        self.proc: WorkerProcess | None = None
        self.history = CrashHistory()
        self.restarts = 0
        self.served = 0
        self.tokens = 0
        self.last_used = time.monotonic()
        self.last_heard = time.monotonic()
        self.ready_line: bytes | None = None
        self.stats: dict = {}
        self.stderr_tail = LastMessage()
        self._stats_waiters: list[asyncio.Future] = []
        self._restart_timer: asyncio.TimerHandle | None = None
        self._kill_reason: str | None = None
        # Since when a worker with a request dispatched says it is idle.
        self._idle_since: float | None = None
        self._current_done = asyncio.Event()
        self._stopped = asyncio.Event()
        self._retired = False  # stopped for good: a handle is never reused
        self.settled = asyncio.Event()  # set once the first start ended: ready or failed

    # -- identity and state --------------------------------------------------

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def lora(self) -> str | None:
        return str(self.spec.lora) if self.spec.lora else None

    @property
    def state(self) -> State:
        return self.sm.state

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc and not self.proc.exited.is_set() else None

    def _describe(self) -> str:
        pid = self.proc.pid if self.proc else "-"
        lora = f" lora={self.lora}" if self.lora else ""
        return f"model={self.name}{lora} pid={pid}"

    def _emit(self, ev: str, **fields: object) -> None:
        self.pool.output.write(encode_event(ev, model=self.name, lora=self.lora, **fields))

    @property
    def idle(self) -> bool:
        return self.state == State.READY and self.current is None and not self.queue

    def uptime(self) -> float:
        if self.proc is None or self.state not in LIVE:
            return 0.0
        return time.monotonic() - self.proc.started_at

    # -- starting --------------------------------------------------------------

    async def start(self, reason: str) -> None:
        """Spawns the worker; `ready` from it moves the state on."""
        if self._retired:
            # A restart or load scheduled just before the handle was stopped.
            log.info("%s: not started (%s): the model was unloaded", self._describe(), reason)
            return
        self.sm.to(State.LOADING, reason)
        self.ready_line = None
        self._kill_reason = None
        self._emit("loading")
        proc = WorkerProcess(self._on_lines, self._on_stderr, self._on_exit, self._on_overflow)
        self.proc = proc
        self.last_heard = time.monotonic()
        try:
            await proc.start(self.pool.worker_argv(self.spec), self.pool.worker_env())
        except Exception as exc:
            self.proc = None
            if self.state != State.LOADING:
                return
            how = f"cannot start the worker process: {exc}"
            if isinstance(exc, OSError) and exc.errno in RESOURCE_ERRNOS:
                # Out of file descriptors or processes: that passes, so it is retried like a crash.
                log.error("%s: %s; will retry", self._describe(), how)
                self._crashed(how, how, exit_code=None, uptime=0.0, was_loading=True)
            else:
                log.error("%s: %s", self._describe(), how, exc_info=not isinstance(exc, OSError))
                self._give_up(how, LOAD_FAILED)
            return
        proc.pause_reading(self.pool.output.paused)
        log.info("%s: worker started", self._describe())

    # -- requests --------------------------------------------------------------

    def submit(self, job: Job) -> None:
        if self.state == State.FAILED:
            self.end_with_error(job, MODEL_FAILED, f"model {job.spec.name!r} has failed; send a load op to retry")
            return
        self.queue.append(job)
        self.last_used = time.monotonic()
        self._dispatch()

    def _dispatch(self) -> None:
        if self.state != State.READY or self.current is not None or not self.queue:
            return
        job = self.queue.popleft()
        self.current = job
        self._idle_since = None
        self._current_done.clear()
        self.sm.to(State.BUSY, f"request {job.label}")
        if not self.proc.send(job.generate):
            log.warning("%s: request pipe closed while dispatching %s", self._describe(), job.label)

    def cancel(self, id_json: str) -> bool:
        """Cancels a queued or running request with this id."""
        for job in self.queue:
            if job.id_json == id_json:
                self.queue.remove(job)
                self._end(job, encode_cancelled_done(job.id_json))
                return True
        if self.current is not None and self.current.id_json == id_json:
            self.proc.send(Cancel(rid=self.current.rid))
            return True
        return False

    def end_with_error(self, job: Job, code: str, msg: str) -> None:
        self.pool.note_error(self, code)
        self._end(job, encode_error(msg, code, job.id_json))

    def _end(self, job: Job, line: bytes) -> None:
        """Writes the one terminal line of a request (from the worker or ours)."""
        if job.finished:
            log.error("%s: second terminal line for request %s dropped", self._describe(), job.label)
            return
        job.finished = True
        self.pool.output.write(line)
        if job.on_end is not None:
            job.on_end(job)

    # -- worker output -----------------------------------------------------------

    def _on_lines(self, block: bytes) -> None:
        if self._kill_reason is not None:
            return  # being killed as broken: nothing it writes counts any more
        self.last_heard = time.monotonic()
        job = self.current
        # Fast path: a block in which every line starts as a token line and
        # none is final is relayed whole. The searches run in C, so a flood
        # costs no Python per line; anything else (a stray line included)
        # goes line by line.
        if (
            job is not None
            and block.startswith(_TOKEN_PREFIX)
            and _FINAL not in block
            and block.count(_TOKEN_LINE_START) == block.count(b"\n") - 1
        ):
            job.emitted = True
            self._idle_since = None
            self.pool.output.write(block)
            return
        for line in block.splitlines(keepends=True):
            self._on_line(line)
            if self._kill_reason is not None:
                return

    def _on_line(self, line: bytes) -> None:
        # Token lines are relayed as the worker wrote them (its EventChannel
        # writes whole lines); every other line is checked before it can
        # reach the client, and a terminal line we cannot read means the
        # worker is broken: it is killed, so the request still ends once.
        name = event_name(line)
        if not name or not line.endswith(b"}\n"):
            self._malformed(line)
        elif name == b"gen_token":
            job = self.current
            if job is None:
                log.warning("%s: token line with no request in flight dropped", self._describe())
                return
            if is_final_token(line):
                try:
                    final = _final_decoder.decode(line[10:])
                except msgspec.DecodeError as exc:
                    self.kill(f"it wrote a malformed final line ({exc})")
                    return
                self._finish(job, line, final)
            else:
                job.emitted = True
                self._idle_since = None
                self.pool.output.write(line)
        elif name == HEARTBEAT:
            if self.current is None or _IDLE_BEAT not in line:
                self._idle_since = None
            elif self._idle_since is None:
                self._idle_since = time.monotonic()
        elif name == WORKER_STATS:
            self._got_stats(line)
        elif name == b"error":
            try:
                code = _error_decoder.decode(line[10:]).code
            except msgspec.DecodeError as exc:
                if self.current is not None:
                    self.kill(f"it wrote a malformed error line ({exc})")
                else:
                    self._malformed(line)
                return
            job = self.current
            if job is None:
                self.pool.output.write(line)
                return
            self.pool.note_error(self, code)
            self._finish(job, line, None)
        elif not self._is_object(line):
            self._malformed(line)
        elif name == b"ready":
            self._on_ready(line)
        else:
            self.pool.output.write(line)
            if name == b"adapter_loaded" or name == b"adapter_error":
                self.pool.note_adapter_event(self, name.decode())

    def _is_object(self, line: bytes) -> bool:
        try:
            _object_decoder.decode(line[10:])
        except msgspec.DecodeError:
            return False
        return True

    def _malformed(self, line: bytes) -> None:
        log.warning("%s: malformed line from the worker dropped: %r", self._describe(), line[:120])

    def _finish(self, job: Job, line: bytes, final: _Final | None) -> None:
        self.current = None
        self.served += 1
        self.last_used = time.monotonic()
        if final is not None:
            self.tokens += final.gen_tokens
            self.pool.note_done(self, final.gen_tokens, final.ttft_ms, final.tok_s)
        self._end(job, line)
        self._current_done.set()
        if self.state == State.BUSY:
            self.sm.to(State.READY, f"request {job.label} done")
            self._dispatch()
        if self.idle:
            self.pool.on_idle(self)

    def _on_ready(self, line: bytes) -> None:
        self.ready_line = line
        if self.state != State.LOADING:
            self.pool.output.write(line)
            return
        self.sm.to(State.READY, "worker ready")
        self.settled.set()
        self.pool.output.write(line)
        self.request_stats_nowait()
        self._dispatch()
        if self.idle:
            self.pool.on_idle(self)

    def _on_stderr(self, data: bytes) -> None:
        self.last_heard = time.monotonic()
        self.stderr_tail.feed(data)
        self.pool.relay_stderr(data)

    def _on_overflow(self) -> None:
        self.kill(f"it wrote a line longer than {4 * 1024 * 1024} bytes")

    # -- stats -------------------------------------------------------------------

    def request_stats_nowait(self) -> None:
        if self.proc is not None:
            self.proc.send(Stats())

    async def fresh_stats(self, timeout: float = 2.0) -> dict:
        """The worker's measured memory now, or the last known figures."""
        if self.proc is None or self.state not in LIVE:
            return self.stats
        future = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(future)
        if not self.proc.send(Stats()):
            self._stats_waiters.remove(future)
            return self.stats
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            return self.stats

    def _got_stats(self, line: bytes) -> None:
        try:
            self.stats = _object_decoder.decode(line[10:])
        except msgspec.DecodeError:
            self._malformed(line)
            return
        waiters, self._stats_waiters = self._stats_waiters, []
        for future in waiters:
            if not future.done():
                future.set_result(self.stats)

    # -- adapters ----------------------------------------------------------------

    def set_adapter(self, path: str | None) -> bool:
        if self.proc is None or self.state not in LIVE:
            return False
        return self.proc.send(SetAdapter(path=path))

    # -- faults ------------------------------------------------------------------

    def kill(self, reason: str) -> None:
        """Kills a misbehaving worker; its exit then goes through the crash path."""
        if self.proc is None or self.proc.exited.is_set():
            return
        log.warning("%s: killing worker: %s", self._describe(), reason)
        self._kill_reason = reason
        self.proc.kill()

    def check_stall(self, now: float, stall_timeout: float) -> None:
        proc = self.proc
        if proc is None or proc.exited.is_set() or self.state not in LIVE:
            return
        blocked = proc.write_blocked_since
        if blocked is not None and now - blocked > stall_timeout:
            self.kill(f"it has not read its request pipe for {now - blocked:.0f}s (stall_timeout {stall_timeout:g}s)")
            return
        if proc.reading_paused:
            # A slow client made us stop reading this worker: its silence is
            # ours, and its last heartbeat may be stale.
            self.last_heard = now
            if self._idle_since is not None:
                self._idle_since = now
            return
        if self.state == State.BUSY and self._idle_since is not None and now - self._idle_since > stall_timeout:
            # Alive (heartbeats) but it never picked up the request: its
            # request pipe is stuck, short of full.
            self.kill(f"its heartbeats say idle {now - self._idle_since:.0f}s after a request was sent (stall_timeout {stall_timeout:g}s)")
            return
        if self.state in (State.LOADING, State.BUSY) and now - self.last_heard > stall_timeout:
            self.kill(f"no event or heartbeat for {now - self.last_heard:.0f}s (stall_timeout {stall_timeout:g}s)")

    def _on_exit(self, code: int | None) -> None:
        proc = self.proc
        proc.signal_group(signal.SIGKILL)
        proc.close()
        if self.state == State.STOPPING:
            self._fail_current_on_stop()
            self._stopped.set()
            return
        how = self._kill_reason or describe_exit(code)
        last = self.stderr_tail.text()
        tail = f"; last stderr: {last}" if last else ""
        was_loading = self.state == State.LOADING
        log.error("%s: worker died (%s)%s", self._describe(), how, tail)
        job = self.current
        self.current = None
        self._current_done.set()
        if job is not None:
            if not job.emitted and job.attempts == 0:
                # Nothing reached the client yet, so a second try is invisible.
                job.attempts += 1
                self.queue.appendleft(job)
                log.info("%s: request %s will be retried after the restart", self._describe(), job.label)
            else:
                self.end_with_error(job, WORKER_CRASHED, f"worker for model {job.spec.name!r} crashed ({how}) while generating{tail}")
        self._crashed(how, f"{how}{tail}", exit_code=code, uptime=time.monotonic() - proc.started_at, was_loading=was_loading)

    def _crashed(self, how: str, why: str, *, exit_code: int | None, uptime: float, was_loading: bool) -> None:
        """Restart with backoff, or give up: the restart policy decides."""
        decision = on_crash(
            self.pool.restart_policy,
            self.history,
            now=time.monotonic(),
            uptime=uptime,
            exit_code=exit_code,
            rng=self.pool.rng,
        )
        self.history = decision.history
        if isinstance(decision, GiveUp):
            self._give_up(f"{decision.reason} ({why})", LOAD_FAILED if was_loading else MODEL_FAILED)
            return
        self.restarts += 1
        self.pool.note_restart(self)
        self.sm.to(State.RESTARTING, how)
        self._emit("restarting", attempt=decision.attempt, delay_s=round(decision.delay, 3), reason=how)
        self._restart_timer = asyncio.get_running_loop().call_later(decision.delay, self._restart_now)

    def _restart_now(self) -> None:
        self._restart_timer = None
        if self.state == State.RESTARTING:
            self.pool.spawn(self.start("restart after crash"))

    def _give_up(self, reason: str, code: str) -> None:
        self.sm.to(State.FAILED, reason)
        self.settled.set()
        self._emit("failed", reason=reason)
        jobs = list(self.queue)
        self.queue.clear()
        for job in jobs:
            self.end_with_error(job, code, f"model {job.spec.name!r} failed: {reason}")
        self.pool.on_idle(self)

    def reset_failed(self) -> None:
        self.history = CrashHistory()

    # -- stopping ----------------------------------------------------------------

    async def stop(self, reason: str, queued_code: str = UNLOADED) -> None:
        """Ends queued requests with `queued_code`, cancels the running one
        (finish_reason cancelled), stops the process and emits `unloaded`."""
        self._retired = True
        if self.state == State.STOPPING:
            await self._stopped.wait()
            return
        if self.state == State.UNLOADED:
            # Never started (waiting for room): nothing to stop.
            self._fail_queue(queued_code, reason)
            self._emit("unloaded", reason=reason)
            return
        self.sm.to(State.STOPPING, reason)
        if self._restart_timer is not None:
            self._restart_timer.cancel()
            self._restart_timer = None
        self._fail_queue(queued_code, reason)
        proc = self.proc
        if self.current is not None and proc is not None and not proc.exited.is_set():
            proc.send(Cancel(rid=self.current.rid))
            try:
                await asyncio.wait_for(self._current_done.wait(), CANCEL_GRACE)
            except asyncio.TimeoutError:
                log.warning("%s: request %s ignored its cancel", self._describe(), self.current.label)
        if proc is not None and not proc.exited.is_set():
            await proc.stop()
        self._fail_current_on_stop()
        self._stopped.set()
        self.sm.to(State.UNLOADED, reason)
        self._emit("unloaded", reason=reason)

    def _fail_queue(self, code: str, reason: str) -> None:
        jobs = list(self.queue)
        self.queue.clear()
        for job in jobs:
            self.end_with_error(job, code, f"request not run: model {job.spec.name!r} {reason}")

    def _fail_current_on_stop(self) -> None:
        job = self.current
        if job is not None:
            self.current = None
            self._end(job, encode_cancelled_done(job.id_json))
            self._current_done.set()
