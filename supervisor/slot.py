"""The worker slot: one worker as the pool sees it.

A slot owns its worker's state alone (llama-swap's one-owner-per-process
rule): the state machine (supervisor.states), the requests waiting for the
worker and those in flight at it, the child process, crash handling and the
stall watchdog. Everything runs on the event loop thread, so no locks. The
pool drives a slot through its methods and hears back through `SlotEvents`;
a slot never reaches into the pool.

A slot serves every name whose spec has its key (the base model and the
worker's settings: supervisor.spec.ModelSpec.key), each a (model name,
adapter) pair (supervisor.names). The worker starts without an adapter and
every request carries its name's adapter (null for the base), so requests of
different names share its batch. The name a request used travels with its
Job, and errors name that one; lifecycle events go out once per name.

A slot has three rooms: this one starts the worker, keeps its figures,
handles its faults and stops it; `supervisor.traffic.Traffic` holds the
requests (queued, in flight) and routes the worker's lines to their sinks;
`supervisor.names.Roster` holds the names and their adapters. Each room
hears from the slot through its methods and reads it through a small
protocol (`WorkerSide`, `NamesSide`); all three tell the pool through
`SlotEvents`. The child process comes from `child_factory`, so a slot can be
driven without a subprocess.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable, Coroutine
from typing import Protocol

from ipc.context import read_context_limit
from ipc.events import LOAD_FAILED, MODEL_FAILED, UNLOADED
from ipc.messages import DEFAULT_MAX_BATCH, Cancel, Stats
from ipc.worker_events import AdapterError, AdapterLoaded, AdapterUnloaded, Loading, Ready, WorkerStats, parse_event
from supervisor.child import MAX_WORKER_LINE, RESOURCE_ERRNOS, ChildProcess
from supervisor.job import Sink
from supervisor.names import NamesTold, Roster
from supervisor.policy import CrashHistory, GiveUp, RestartPolicy, byte_count, on_crash
from supervisor.spec import ModelSpec
from supervisor.states import LIVE, State, StateMachine
from supervisor.stderr import LastMessage
from supervisor.traffic import RequestsTold, Traffic

log = logging.getLogger("lattice.worker")


# How long cancelled requests may take to end before their worker is killed.
CANCEL_GRACE = 5.0


class SlotEvents(RequestsTold, NamesTold, Protocol):
    """What a slot tells its owner; every call comes from the event loop.
    The requests' part (request ended, done, error counted, idle) and the
    names' part (adapter events) are declared with their rooms."""

    def restarted(self, slot: WorkerSlot) -> None: ...

    def worker_stderr(self, data: bytes) -> None: ...

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        """Runs a task the owner cancels when it shuts down."""


# ChildProcess(on_lines, on_stderr, on_exit, on_overflow), or a stand-in with
# its methods (a test's in-memory child).
ChildFactory = Callable[[Callable[[bytes], None], Callable[[bytes], None], Callable[[int | None], None], Callable[[], None]], ChildProcess]


def describe_exit(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class WorkerSlot:
    def __init__(
        self,
        spec: ModelSpec,
        events: SlotEvents,
        lines: Sink,
        command: Callable[[], tuple[list[str], dict[str, str]]],
        restart_policy: RestartPolicy,
        rng,
        number: int = 0,
        child_factory: ChildFactory = ChildProcess,
    ):
        # The settings of the worker are those of `spec`, the first name;
        # the worker speaks under its name.
        self.spec = spec
        self.number = number  # tells this worker's status rows apart from others'
        self.events = events
        self.lines = lines  # lifecycle events and lines of no request
        self.command = command
        self.restart_policy = restart_policy
        self.rng = rng
        self.child_factory = child_factory
        # "auto" is the worker's to size: its ready line says the number
        # (a worker whose line does not keeps the old default).
        self.max_batch = spec.max_batch if isinstance(spec.max_batch, int) else DEFAULT_MAX_BATCH
        self.max_batch_why: str | None = None
        # The worker's prefix cache budget, from its ready line (None before).
        self.prefix_cache_bytes: int | None = None
        # The most its rows' caches take, from its ready line (None before).
        self.rows_memory_bytes: int | None = None
        self.sm = StateMachine(self.describe)
        self.roster = Roster(self, events, self.sm, lines)
        self.names = self.roster.names  # the roster's table: the names this worker serves
        self.traffic = Traffic(self, events, self.sm, lines)
        self.child: ChildProcess | None = None
        self.history = CrashHistory()
        self.restarts = 0
        self.last_used = time.monotonic()
        self.last_heard = time.monotonic()
        self.ready: dict = {}  # the fields of the running worker's ready line
        self._config_context: list[int | None] | None = None  # max_context before a worker says it
        self.ready_at = 0.0
        self.stats: WorkerStats | None = None
        self.stderr_tail = LastMessage()
        self.reading_paused = False
        # Futures of fresh_stats, each with the number of its Stats message.
        self._stats_waiters: list[tuple[int, asyncio.Future]] = []
        self._stats_sent = 0  # the number of the last Stats message sent
        # Lines answering a Stats sent before the running worker's `ready`
        # measured it loading (weights_bytes 0); once it is ready they are
        # dropped, whenever they come.
        self._stats_floor = 0
        self._restart_timer: asyncio.TimerHandle | None = None
        self.kill_reason: str | None = None  # set while it is killed as broken
        self._stopped = asyncio.Event()
        self._retired = False  # stopped for good: a slot is never reused
        self.settled = asyncio.Event()  # set once the first start ended: ready or failed
        self.failure: str | None = None  # why it failed, for requests that come later
        self.failed_at = 0.0  # time.monotonic() when it did

    # -- identity and state --------------------------------------------------

    @property
    def name(self) -> str:
        """The worker's own name (its first name's)."""
        return self.spec.name

    @property
    def state(self) -> State:
        return self.sm.state

    @property
    def pid(self) -> int | None:
        return self.child.pid if self.child and not self.child.exited.is_set() else None

    def describe(self) -> str:
        pid = self.child.pid if self.child else "-"
        others = f" (+{len(self.names) - 1} names)" if len(self.names) > 1 else ""
        return f"model={self.name}{others} pid={pid}"

    @property
    def opens_think(self) -> bool:
        """Whether the running worker's chat template opens <think> (its ready line says)."""
        return bool(self.ready.get("opens_think"))

    @property
    def max_context(self) -> int | None:
        """Tokens a request may take: what the running worker said, else
        the configured limit or the model config's (read once)."""
        told = self.ready.get("max_context")
        if isinstance(told, int):
            return told
        if self._config_context is None:
            self._config_context = [self.spec.max_context or read_context_limit(self.spec.path)]
        return self._config_context[0]

    def uptime(self) -> float:
        if self.child is None or self.state not in LIVE:
            return 0.0
        return time.monotonic() - self.child.started_at

    def touch(self) -> None:
        """Counts as a use for least-recently-used eviction."""
        self.last_used = time.monotonic()

    # -- starting --------------------------------------------------------------

    async def start(self, reason: str) -> None:
        """Spawns the worker; `ready` from it moves the state on."""
        if self._retired:
            # A restart or load scheduled just before the slot was stopped.
            log.info("%s: not started (%s): the model was unloaded", self.describe(), reason)
            return
        self.sm.to(State.LOADING, reason)
        self.ready = {}
        self.kill_reason = None
        self.roster.starting()
        child = self.child_factory(self._on_lines, self._on_stderr, self._on_exit, self._on_overflow)
        self.child = child
        self.last_heard = time.monotonic()
        try:
            await child.start(*self.command())
        except Exception as exc:
            self.child = None
            if self.state != State.LOADING:
                return
            how = f"cannot start the worker process: {exc}"
            if isinstance(exc, OSError) and exc.errno in RESOURCE_ERRNOS:
                # Out of file descriptors or processes: that passes, so it is retried like a crash.
                log.error("%s: %s; will retry", self.describe(), how)
                self._crashed(how, how, exit_code=None, uptime=0.0, was_loading=True)
            else:
                log.error("%s: %s", self.describe(), how, exc_info=not isinstance(exc, OSError))
                self._give_up(how, LOAD_FAILED)
            return
        child.pause_reading(self.reading_paused)
        log.info("%s: worker started", self.describe())

    def pause_reading(self, paused: bool) -> None:
        """Stops reading the worker while its lines' reader is slow."""
        self.reading_paused = paused
        if self.child is not None:
            self.child.pause_reading(paused)

    # -- worker output -----------------------------------------------------------

    def _on_lines(self, block: bytes) -> None:
        if self.kill_reason is not None:
            return  # being killed as broken: nothing it writes counts any more
        self.last_heard = time.monotonic()
        self.traffic.route(block)

    def heard(self, event: object, line: bytes) -> None:
        """A line about no request, read once by the traffic."""
        match event:
            case WorkerStats():
                self._got_stats(event)
            case Ready():
                self._on_ready(line)
            case Loading():
                self.roster.loading(line)
            case AdapterLoaded() | AdapterError():
                self.roster.on_adapter_event(line, event.lora, isinstance(event, AdapterLoaded))
            case AdapterUnloaded(lora=lora, resident=resident):
                # The pool has answered the unload with `unloaded` already.
                log.info("%s: adapter %s unloaded (was resident: %s)", self.describe(), lora, resident)
            case _:
                self.lines.write(line)

    def _on_ready(self, line: bytes) -> None:
        if self.state == State.STOPPING:
            # Stopped while it loaded (unloaded, evicted, the pool shutting
            # down): its ready line crossed the stop, which is no fault.
            log.info("%s: ready after its stop began; it stops", self.describe())
            return
        if self.state != State.LOADING:
            log.warning("%s: a second ready line dropped: %r", self.describe(), line[:200])
            return
        self.ready = parse_event(line)
        self.ready_at = time.monotonic()
        chosen = self.ready.get("max_batch")
        if isinstance(chosen, int) and chosen >= 1:
            self.max_batch = self._capped(chosen)
            self.max_batch_why = self.ready.get("max_batch_why")
        self.prefix_cache_bytes = byte_count(self.ready.get("prefix_cache_bytes"))
        self.rows_memory_bytes = byte_count(self.ready.get("rows_memory_bytes"))
        self.sm.to(State.READY, "worker ready")
        self.settled.set()
        self.roster.worker_ready(line)
        self._stats_floor = self.request_stats_nowait()
        self.traffic.dispatch()
        self.traffic.quiet()

    def _on_stderr(self, data: bytes) -> None:
        self.last_heard = time.monotonic()
        self.stderr_tail.feed(data)
        self.events.worker_stderr(data)

    def _on_overflow(self) -> None:
        self.kill(f"it wrote a line longer than {MAX_WORKER_LINE} bytes")

    # -- stats -------------------------------------------------------------------

    def request_stats_nowait(self) -> int:
        """Asks the worker for its figures; the number of the request."""
        self._stats_sent += 1
        self.traffic.send(Stats(seq=self._stats_sent))
        return self._stats_sent

    async def fresh_stats(self, timeout: float = 2.0) -> WorkerStats | None:
        """The worker's figures measured after this call, or the last ones
        it reported (None before its first report)."""
        if self.child is None or self.state not in LIVE:
            return self.stats
        future = asyncio.get_running_loop().create_future()
        self._stats_sent += 1
        entry = (self._stats_sent, future)
        self._stats_waiters.append(entry)
        if not self.traffic.send(Stats(seq=self._stats_sent)):
            self._stats_waiters.remove(entry)
            return self.stats
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            return self.stats
        finally:
            # Bounded whatever the worker does: a worker that never answers
            # leaves no waiter behind for each status asked of it.
            if entry in self._stats_waiters:
                self._stats_waiters.remove(entry)

    def _capped(self, rows: int) -> int:
        """The worker's number of rows, within a configured max_batch."""
        return min(self.spec.max_batch, rows) if isinstance(self.spec.max_batch, int) else rows

    def _got_stats(self, stats: WorkerStats) -> None:
        if stats.seq < self._stats_floor:
            return
        self.stats = stats
        if stats.max_batch:
            # A worker whose architecture cannot batch runs one at a time;
            # the rest then wait here, where a cancel stays local.
            self.max_batch = self._capped(stats.max_batch)
        # The worker answers in order: this line answers every request up
        # to its number, and none after it.
        answered = [f for seq, f in self._stats_waiters if seq <= stats.seq]
        self._stats_waiters = [(seq, f) for seq, f in self._stats_waiters if seq > stats.seq]
        for future in answered:
            if not future.done():
                future.set_result(stats)

    # -- faults ------------------------------------------------------------------

    def kill(self, reason: str) -> None:
        """Kills a misbehaving worker; its exit then goes through the crash path."""
        if self.child is None or self.child.exited.is_set():
            return
        log.warning("%s: killing worker: %s", self.describe(), reason)
        self.kill_reason = reason
        self.child.kill()

    def check_stall(self, now: float, stall_timeout: float) -> None:
        child = self.child
        if child is None or child.exited.is_set() or self.state not in LIVE:
            return
        blocked = child.write_blocked_since
        if blocked is not None and now - blocked > stall_timeout:
            self.kill(f"it has not read its request pipe for {now - blocked:.0f}s (stall_timeout {stall_timeout:g}s)")
            return
        if child.reading_paused:
            # A slow client made us stop reading this worker: its silence is
            # ours, and its last heartbeat may be stale.
            self.last_heard = now
            if self.traffic.idle_since is not None:
                self.traffic.idle_since = now
            return
        if self.state == State.BUSY and self.traffic.idle_since is not None and now - self.traffic.idle_since > stall_timeout:
            # Alive (heartbeats) but it never picked up the request: its
            # request pipe is stuck, short of full.
            self.kill(f"its heartbeats say idle {now - self.traffic.idle_since:.0f}s after a request was sent (stall_timeout {stall_timeout:g}s)")
            return
        if self.state in (State.LOADING, State.BUSY) and now - self.last_heard > stall_timeout:
            self.kill(f"no event or heartbeat for {now - self.last_heard:.0f}s (stall_timeout {stall_timeout:g}s)")

    def _on_exit(self, code: int | None) -> None:
        child = self.child
        child.signal_group(signal.SIGKILL)
        child.close()
        if self.state == State.STOPPING:
            self.traffic.cancel_in_flight()
            self._stopped.set()
            return
        how = self.kill_reason or describe_exit(code)
        last = self.stderr_tail.text()
        tail = f"; last stderr: {last}" if last else ""
        was_loading = self.state == State.LOADING
        log.error("%s: worker died (%s)%s", self.describe(), how, tail)
        self.traffic.worker_died(how, tail)
        self._crashed(how, f"{how}{tail}", exit_code=code, uptime=time.monotonic() - child.started_at, was_loading=was_loading)

    def _crashed(self, how: str, why: str, *, exit_code: int | None, uptime: float, was_loading: bool) -> None:
        """Restart with backoff, or give up: the restart policy decides."""
        decision = on_crash(self.restart_policy, self.history, now=time.monotonic(), uptime=uptime, exit_code=exit_code, rng=self.rng)
        self.history = decision.history
        if isinstance(decision, GiveUp):
            self._give_up(f"{decision.reason} ({why})", LOAD_FAILED if was_loading else MODEL_FAILED)
            return
        self.restarts += 1
        self.events.restarted(self)
        self.sm.to(State.RESTARTING, how)
        self.roster.emit("restarting", attempt=decision.attempt, delay_s=round(decision.delay, 3), reason=how)
        self._restart_timer = asyncio.get_running_loop().call_later(decision.delay, self._restart_now)

    def _restart_now(self) -> None:
        self._restart_timer = None
        if self.state == State.RESTARTING:
            self.events.spawn(self.start("restart after crash"))

    def _give_up(self, reason: str, code: str) -> None:
        self.failure = reason
        self.failed_at = time.monotonic()
        self.sm.to(State.FAILED, reason)
        self.settled.set()
        self.roster.emit("failed", reason=reason)
        self.traffic.fail_queued(code, lambda model: f"model {model!r} failed: {reason}")
        self.events.idle(self)

    def reset_failed(self) -> None:
        self.history = CrashHistory()

    # -- stopping ----------------------------------------------------------------

    async def stop(self, reason: str, queued_code: str = UNLOADED) -> None:
        """Ends queued requests with `queued_code`, cancels those in flight
        (finish_reason cancelled), stops the process and emits `unloaded`."""
        self._retired = True
        if self.state == State.STOPPING:
            await self._stopped.wait()
            return

        def not_run(model: str) -> str:
            return f"request not run: model {model!r} {reason}"

        if self.state == State.UNLOADED:
            # Never started (waiting for room): nothing to stop.
            self.traffic.fail_queued(queued_code, not_run)
            self.roster.emit("unloaded", reason=reason)
            return
        self.sm.to(State.STOPPING, reason)
        if self._restart_timer is not None:
            self._restart_timer.cancel()
            self._restart_timer = None
        self.traffic.fail_queued(queued_code, not_run)
        child = self.child
        in_flight = self.traffic.in_flight
        if in_flight and child is not None and not child.exited.is_set():
            for job in in_flight.values():
                self.traffic.send(Cancel(rid=job.rid))
            try:
                await asyncio.wait_for(self.traffic.drained.wait(), CANCEL_GRACE)
            except TimeoutError:
                log.warning("%s: requests %s ignored their cancel", self.describe(), ", ".join(j.label for j in in_flight.values()))
        if child is not None and not child.exited.is_set():
            await child.stop()
        self.traffic.cancel_in_flight()
        self._stopped.set()
        self.sm.to(State.UNLOADED, reason)
        self.roster.emit("unloaded", reason=reason)
