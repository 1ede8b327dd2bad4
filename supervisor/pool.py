"""The pool: routes requests to workers, runs ops, admits and evicts workers.

Runs on one event loop. Workers are keyed by (model dir, adapter path);
each WorkerHandle owns its worker's state, the pool owns which handles exist.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import itertools
import logging
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Coroutine, Protocol

import psutil

from ipc.events import (
    ADAPTER_ERROR,
    BAD_REQUEST,
    INSUFFICIENT_MEMORY,
    INTERNAL,
    OVERLOADED,
    SHUTTING_DOWN,
    UNKNOWN_MODEL,
    UNLOADED,
    encode_error,
    encode_event,
)
from ipc.messages import Generate
from supervisor.adapter_watch import AdapterWatcher
from supervisor.config import Config, parse_duration, parse_size
from supervisor.handle import Job, WorkerHandle
from supervisor.logs import relay_worker_stderr
from supervisor.output import Output
from supervisor.policy import Evict, NoFit, Resident, RestartPolicy, make_room
from supervisor.requests import ClientLine, encode_id, prompt_bytes, response_format_text, stop_list
from supervisor.resolve import ModelSpec, Resolver, UnknownModel
from supervisor.states import LIVE, State
from supervisor.workerexec import pool_worker_module, worker_argv, worker_env

log = logging.getLogger("lattice.pool")

# Python, MLX and the tokenizer cost about this much before any weights;
# replaced by measurements (RSS minus weights) once a worker has reported.
DEFAULT_RUNTIME_BYTES = 256 * 1024 * 1024
HOUSEKEEPING_INTERVAL = 0.25
STATS_REFRESH_INTERVAL = 5.0


def process_memory(pid: int) -> dict[str, int]:
    """RSS and USS of a worker measured from outside, for a worker that has
    not answered a stats request yet (still importing, say)."""
    try:
        info = psutil.Process(pid).memory_full_info()
    except psutil.Error:
        return {}
    return {"rss_bytes": info.rss, "uss_bytes": getattr(info, "uss", info.rss)}


class PoolObserver(Protocol):
    """Told of what the pool counts (supervisor.metrics is one); every call
    comes from the event loop thread."""

    def request_done(self, handle: WorkerHandle, gen_tokens: int, ttft_ms: float, tok_s: float) -> None: ...

    def error(self, handle: WorkerHandle | None, code: str) -> None: ...

    def adapter_event(self, handle: WorkerHandle, name: str) -> None: ...

    def restarted(self, handle: WorkerHandle) -> None: ...


class Pool:
    def __init__(self, config: Config, output: Output, *, rng: random.Random | None = None):
        self.config = config
        self.output = output
        self.resolver = Resolver(config)
        self.restart_policy = RestartPolicy()
        self.rng = rng or random.Random()
        self.memory_budget = parse_size(config.memory_budget)
        self.max_prompt_bytes = parse_size(config.max_prompt_bytes)
        self.stats_interval = parse_duration(config.stats_interval)
        self.handles: dict[tuple, WorkerHandle] = {}
        self.watchers: dict[tuple, AdapterWatcher] = {}
        self.accepting = True
        self.observers: list[PoolObserver] = []
        self._rids = itertools.count(1)
        self._active: dict[str, Job] = {}
        self._idless: collections.deque[Job | bytes] = collections.deque()
        self._idless_running: Job | None = None
        self._idless_room = asyncio.Event()
        self._live_jobs = 0  # requests queued or running, id-less ones included
        # Copies of the adapters workers loaded (see worker.lora.formats.AdapterReader),
        # private to this pool and removed when it ends.
        self._adapter_copies: Path | None = None
        self._tasks: set[asyncio.Task] = set()
        self._admission = asyncio.Lock()
        self._room = asyncio.Event()
        self._all_idle = asyncio.Event()
        self.shutdown_requested = asyncio.Event()
        self.hurry = asyncio.Event()
        self._process = psutil.Process()
        output.on_pause(self._pause_sources)

    # -- plumbing used by handles ------------------------------------------------

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("pool task failed", exc_info=task.exception())

    def worker_argv(self, spec: ModelSpec) -> list[str]:
        args = ["--model", str(spec.path), "--name", spec.name, "--heartbeat", str(self.config.heartbeat_interval)]
        if spec.lora is not None:
            args += ["--lora", str(spec.lora)]
        if spec.tokenizer_dir is not None:
            args += ["--tokenizer-dir", str(spec.tokenizer_dir)]
        if self.config.prefix_cache_bytes is not None:
            args += ["--prefix-cache-bytes", str(parse_size(self.config.prefix_cache_bytes))]
        args += ["--max-prompt-bytes", str(self.max_prompt_bytes), "--max-adapter-bytes", str(parse_size(self.config.max_adapter_bytes))]
        if spec.lora is not None:
            args += ["--adapter-copies", str(self.adapter_copies_dir(spec))]
        return worker_argv(pool_worker_module(), *args)

    def adapter_copies_dir(self, spec: ModelSpec) -> Path:
        """Where the worker for `spec` keeps copies of the adapters it loaded."""
        if self._adapter_copies is None:
            self._adapter_copies = Path(tempfile.mkdtemp(prefix="lattice-pool-adapters-"))  # mode 0700
        return self._adapter_copies / hashlib.sha256(f"{spec.path}\0{spec.lora}".encode()).hexdigest()[:16]

    def _forget_adapter_copies(self, spec: ModelSpec | None = None) -> None:
        if self._adapter_copies is None:
            return
        if spec is None:
            shutil.rmtree(self._adapter_copies, ignore_errors=True)
            self._adapter_copies = None
        elif spec.lora is not None:
            shutil.rmtree(self.adapter_copies_dir(spec), ignore_errors=True)

    def worker_env(self) -> dict[str, str]:
        return worker_env({"LATTICE_SUPERVISOR_PID": str(os.getpid())})

    def relay_stderr(self, data: bytes) -> None:
        relay_worker_stderr(data)

    def _pause_sources(self, paused: bool) -> None:
        for handle in self.handles.values():
            if handle.proc is not None:
                handle.proc.pause_reading(paused)

    def on_idle(self, handle: WorkerHandle) -> None:
        self._room.set()
        if self._quiet():
            self._all_idle.set()

    def note_done(self, handle: WorkerHandle, gen_tokens: int, ttft_ms: float, tok_s: float) -> None:
        for observer in self.observers:
            observer.request_done(handle, gen_tokens, ttft_ms, tok_s)

    def note_error(self, handle: WorkerHandle | None, code: str | None) -> None:
        for observer in self.observers:
            observer.error(handle, code or "unknown")

    def note_adapter_event(self, handle: WorkerHandle, name: str) -> None:
        for observer in self.observers:
            observer.adapter_event(handle, name)
        watcher = self.watchers.get(handle.spec.key)
        if watcher is not None:
            watcher.result(name == "adapter_loaded")

    def _watch_adapter(self, handle: WorkerHandle) -> None:
        if handle.spec.lora is None or handle.spec.key in self.watchers:
            return

        def missing() -> None:
            self.output.write(
                encode_event(
                    "adapter_error",
                    model=handle.name,
                    lora=handle.lora,
                    code=ADAPTER_ERROR,
                    msg=f"adapter {handle.lora} was deleted (or cannot be reached); the worker keeps the version it loaded",
                )
            )

        watcher = AdapterWatcher(handle.spec.lora, lambda: handle.set_adapter(handle.lora), missing)
        self.watchers[handle.spec.key] = watcher
        watcher.start()

    def _unwatch(self, handle: WorkerHandle) -> None:
        watcher = self.watchers.get(handle.spec.key)
        # A replacement handle for the same key may own the watch by now.
        if watcher is not None and self.handles.get(handle.spec.key) is None:
            self.watchers.pop(handle.spec.key).stop()

    def note_restart(self, handle: WorkerHandle) -> None:
        for observer in self.observers:
            observer.restarted(handle)

    # -- requests ------------------------------------------------------------------

    def reject(self, code: str, msg: str, id_json: str | None) -> None:
        """Answers a line that will not run with one error line."""
        if id_json is not None and id_json in self._active:
            # The id names a request still running: a line carrying it would
            # read as that request's end.
            msg, id_json = f"{msg} (id {id_json} belongs to a request still running, so this error carries no id)", None
        self.note_error(None, code)
        line = encode_error(msg, code, id_json)
        if id_json is None and (self._idless_running is not None or self._idless):
            # An id-less error is the answer to an id-less line: it waits its
            # turn, or a chat_metal client would read it as the running
            # request's failure.
            self._idless.append(line)
            return
        self.output.write(line)

    def submit(self, msg: ClientLine) -> None:
        """A validated generation request: route it, or end it with an error."""
        id_json = encode_id(msg.id)
        if not self.accepting:
            self.reject(SHUTTING_DOWN, "the pool is shutting down", id_json)
            return
        if id_json is not None and id_json in self._active:
            self.reject(BAD_REQUEST, f"duplicate id {id_json}: a request with this id is still running; this line is refused", id_json)
            return
        if prompt_bytes(msg, self.max_prompt_bytes) > self.max_prompt_bytes:
            self.reject(BAD_REQUEST, f"prompt is longer than max_prompt_bytes ({self.max_prompt_bytes} bytes)", id_json)
            return
        try:
            spec = self.resolver.resolve(msg.model, msg.lora)
        except UnknownModel as exc:
            self.reject(BAD_REQUEST if msg.model is None else UNKNOWN_MODEL, str(exc), id_json)
            return
        if id_json is not None and (full := self._full(spec)):
            self.reject(OVERLOADED, full, id_json)
            return
        rid = next(self._rids)
        job = Job(rid=rid, generate=self._generate(msg, rid, id_json), id_json=id_json, spec=spec, on_end=self._job_ended)
        self._live_jobs += 1
        self._all_idle.clear()
        if id_json is None:
            # chat_metal clients send no id and expect no interleaving at all.
            self._idless.append(job)
            self._pump_idless()
        else:
            self._active[id_json] = job
            self.handle_for(spec).submit(job)

    def _full(self, spec: ModelSpec) -> str | None:
        """Why a request for `spec` cannot wait for its turn, if it cannot."""
        handle = self.handles.get(spec.key)
        if handle is not None and len(handle.queue) >= self.config.max_queued:
            return f"model {spec.name!r} has {len(handle.queue)} requests waiting (max_queued); try again later"
        if self._live_jobs >= self.config.max_queued_total:
            return f"the pool holds {self._live_jobs} requests (max_queued_total); try again later"
        return None

    def input_blocked(self) -> bool:
        """True while stdin must not be read: the client is not reading our
        answers, or id-less lines are waiting their turn up to the bound."""
        return self.output.paused or len(self._idless) >= self.config.max_queued_total

    async def input_room(self) -> None:
        """Returns once input_blocked() is False."""
        while self.input_blocked():
            if self.output.paused:
                await self.output.wait_writable()
            else:
                self._idless_room.clear()
                await self._idless_room.wait()

    def _generate(self, msg: ClientLine, rid: int, id_json: str | None) -> Generate:
        d = self.config.defaults
        fields = {}
        for name in ("max_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "reasoning_budget"):
            value = getattr(msg, name)
            if value is None:
                value = getattr(d, name)
            if value is not None:
                fields[name] = value
        return Generate(
            rid=rid,
            prompt=msg.prompt,
            messages=msg.messages,
            seed=msg.seed,
            stop=stop_list(msg.stop),
            id_json=id_json,
            response_format=response_format_text(msg),
            **fields,
        )

    def _pump_idless(self) -> None:
        while self._idless_running is None and self._idless:
            job = self._idless.popleft()
            self._idless_room.set()
            if isinstance(job, bytes):
                self.output.write(job)
                continue
            self._idless_running = job
            self.handle_for(job.spec).submit(job)

    def _job_ended(self, job: Job) -> None:
        self._live_jobs -= 1
        if job.id_json is not None and self._active.get(job.id_json) is job:
            del self._active[job.id_json]
        if self._idless_running is job:
            self._idless_running = None
            self._pump_idless()
        if self._quiet():
            self._all_idle.set()

    def _quiet(self) -> bool:
        return not self._active and not self._idless and self._idless_running is None

    # -- workers -------------------------------------------------------------------

    def handle_for(self, spec: ModelSpec) -> WorkerHandle:
        handle = self.handles.get(spec.key)
        if handle is None:
            handle = WorkerHandle(spec, self)
            self.handles[spec.key] = handle
            self.spawn(self._admit(handle))
        return handle

    def _estimate_bytes(self, spec: ModelSpec) -> int:
        try:
            weights = sum(p.stat().st_size for p in spec.path.glob("model*.safetensors"))
        except OSError as exc:
            # Out of file descriptors, say: an estimate is no reason to keep
            # a model from starting; its worker will say what is wrong.
            log.warning("model=%s: cannot size the weights in %s: %s", spec.name, spec.path, exc)
            weights = 0
        measured = [
            h.stats["rss_bytes"] - h.stats.get("weights_bytes", 0)
            for h in self.handles.values()
            if h.stats.get("rss_bytes") and h.state in LIVE
        ]
        return weights + (int(statistics.median(measured)) if measured else DEFAULT_RUNTIME_BYTES)

    def _residents(self, exclude: WorkerHandle) -> list[Resident]:
        return [
            Resident(
                key=h.spec.key,
                idle=h.idle,
                last_used=h.last_used,
                memory_bytes=h.stats.get("rss_bytes") or self._estimate_bytes(h.spec),
            )
            for h in self.handles.values()
            if h is not exclude and (h.state in LIVE or h.state == State.RESTARTING)
        ]

    async def _admit(self, handle: WorkerHandle) -> None:
        """Makes room under max_loaded / memory_budget, then starts the worker.
        Anything unexpected on the way ends the requests waiting for it with
        `internal` and forgets the handle, so the next request or load starts
        afresh: a model never waits unanswered in `unloaded`."""
        try:
            await self._make_room_and_start(handle)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("model=%s: admission failed", handle.name)
            if self.handles.get(handle.spec.key) is handle:
                del self.handles[handle.spec.key]
            await self._stop(handle, f"could not be started: internal error ({type(exc).__name__}: {exc})", INTERNAL)

    async def _make_room_and_start(self, handle: WorkerHandle) -> None:
        while True:
            async with self._admission:
                if self.handles.get(handle.spec.key) is not handle or handle.state != State.UNLOADED:
                    return
                decision = make_room(
                    self._residents(handle),
                    need_bytes=self._estimate_bytes(handle.spec),
                    max_loaded=self.config.max_loaded,
                    memory_budget=self.memory_budget,
                )
                if isinstance(decision, NoFit):
                    self.handles.pop(handle.spec.key, None)
                    if not handle.queue:  # a load op: nobody else would hear of it
                        self.reject(INSUFFICIENT_MEMORY, f"model {handle.name!r} cannot fit: {decision.reason}", None)
                    for job in list(handle.queue):
                        handle.queue.remove(job)
                        handle.end_with_error(job, INSUFFICIENT_MEMORY, f"model {job.spec.name!r} cannot fit: {decision.reason}")
                    return
                if isinstance(decision, Evict):
                    for key in decision.victims:
                        victim = self.handles.pop(key, None)
                        if victim is not None:
                            await self._stop(victim, f"evicted to make room for {handle.name!r}")
                    await handle.start("admitted")
                    if self.handles.get(handle.spec.key) is handle:  # not unloaded meanwhile
                        self._watch_adapter(handle)
                    return
                self._room.clear()
            log.info("model=%s waits for room: %s", handle.name, decision.reason)
            await self._room.wait()

    def unload(self, spec: ModelSpec, reason: str, answer: Callable[[bytes], None] | None = None) -> None:
        handle = self.handles.pop(spec.key, None)
        if handle is None:
            (answer or self.output.write)(encode_event("unloaded", model=spec.name, lora=str(spec.lora) if spec.lora else None, reason="not loaded"))
            return
        self.spawn(self._stop(handle, reason))

    async def _stop(self, handle: WorkerHandle, reason: str, queued_code: str = UNLOADED) -> None:
        self._unwatch(handle)
        await handle.stop(reason, queued_code)
        if self.handles.get(handle.spec.key) is None:
            self._forget_adapter_copies(handle.spec)
        self._room.set()

    # -- ops -------------------------------------------------------------------------

    def op(self, msg: ClientLine, answer: Callable[[bytes], None] | None = None) -> asyncio.Task | None:
        """Runs a control op. The part that decides runs now, so ops and
        requests take effect in the order their lines arrived; waiting (a
        worker stopping, stats replies) continues in a task.

        answer: where the op's own reply goes (the status event, an error,
        the ready line of a model already up) when it did not come from
        stdin; lifecycle events (loading, ready, unloaded...) always go to
        stdout. Returns the task that will still write a reply, if any."""
        id_json = encode_id(msg.id)
        if msg.op == "status":
            return self.spawn(self._write_status(answer or self.output.write))
        if msg.op == "cancel":
            self.cancel(id_json, answer)
            return None
        if msg.op == "shutdown":
            self.shutdown_requested.set()
            return None
        try:
            spec = self.resolver.resolve(msg.model, msg.lora)
        except UnknownModel as exc:
            self._refuse(UNKNOWN_MODEL, str(exc), id_json, answer)
            return None
        if msg.op == "load":
            if not self.accepting:
                # A worker started now could outlive the stop of all workers.
                self._refuse(SHUTTING_DOWN, "the pool is shutting down", id_json, answer)
                return None
            self.load(spec, answer)
        elif msg.op == "unload":
            self.unload(spec, "unloaded on request", answer)
        elif msg.op == "reload":
            self.reload(spec, id_json, answer)
        return None

    def _refuse(self, code: str, msg: str, id_json: str | None, answer: Callable[[bytes], None] | None) -> None:
        if answer is None:
            self.reject(code, msg, id_json)
        else:
            answer(encode_error(msg, code, id_json))

    async def _write_status(self, answer: Callable[[bytes], None]) -> None:
        try:
            line = await self.status_event()
        except Exception as exc:
            log.exception("status op failed")
            line = encode_error(f"status failed: internal error ({type(exc).__name__}: {exc})", INTERNAL)
        answer(line)

    def load(self, spec: ModelSpec, answer: Callable[[bytes], None] | None = None) -> None:
        handle = self.handles.get(spec.key)
        if handle is not None and handle.state == State.FAILED:
            # An explicit load is the user saying "try again".
            handle.reset_failed()
            self.spawn(handle.start("load requested after failure"))
            return
        handle = self.handle_for(spec)
        handle.last_used = time.monotonic()
        if handle.state in (State.READY, State.BUSY) and handle.ready_line is not None:
            (answer or self.output.write)(handle.ready_line)

    def reload(self, spec: ModelSpec, id_json: str | None, answer: Callable[[bytes], None] | None = None) -> None:
        handle = self.handles.get(spec.key)
        if handle is None or not handle.set_adapter(handle.lora):
            self._refuse(BAD_REQUEST, f"model {spec.name!r} is not running; nothing to reload", id_json, answer)

    def cancel(self, id_json: str, answer: Callable[[bytes], None] | None = None) -> None:
        job = self._active.get(id_json)
        if job is not None:
            handle = self.handles.get(job.spec.key)
            if handle is not None and handle.cancel(id_json):
                return
        (answer or self.output.write)(encode_error(f"cancel: no queued or running request has id {id_json}", BAD_REQUEST))

    async def status_event(self) -> bytes:
        return encode_event("status", **await self.status_fields())

    async def status_fields(self) -> dict:
        """The `status` event's fields, measured now (see docs/monitoring.md)."""
        rows = await self._measure(list(self.handles.values()))
        memory = psutil.virtual_memory()
        return {
            "models": rows,
            "rss_bytes": self._process.memory_info().rss,
            "system_total_bytes": memory.total,
            "system_available_bytes": memory.available,
        }

    async def _measure(self, handles: list[WorkerHandle]) -> list[dict]:
        # The state as it was when the figures were asked for: a worker that
        # turns ready meanwhile measured its memory while still loading.
        states = [h.state for h in handles]
        stats = await asyncio.gather(*(h.fresh_stats() for h in handles))
        return [self._status_row(h, s, state) for h, s, state in zip(handles, stats, states)]

    def _status_row(self, h: WorkerHandle, s: dict, state: State) -> dict:
        pid = h.pid
        if pid is None:
            # Figures a dead or never-started worker reported earlier
            # describe memory that is no longer in use.
            s = {"format": s.get("format")}
        elif "rss_bytes" not in s:
            s = {**s, **process_memory(pid)}
        return {
            "model": h.name,
            "lora": h.lora,
            "state": state.value,
            "pid": pid,
            "format": s.get("format"),
            "rss_bytes": s.get("rss_bytes", 0),
            "uss_bytes": s.get("uss_bytes", 0),
            "mlx_active_bytes": s.get("mlx_active_bytes", 0),
            "mlx_peak_bytes": s.get("mlx_peak_bytes", 0),
            "mlx_cache_bytes": s.get("mlx_cache_bytes", 0),
            "weights_bytes": s.get("weights_bytes", 0),
            "adapter_bytes": s.get("adapter_bytes", 0),
            "queued": len(h.queue) + sum(1 for j in self._idless if isinstance(j, Job) and j.spec.key == h.spec.key),
            "in_flight": 1 if h.current is not None else 0,
            "served": h.served,
            "tokens": h.tokens,
            "restarts": h.restarts,
            "uptime_s": round(h.uptime(), 1),
        }

    # -- housekeeping ------------------------------------------------------------------

    async def housekeeping(self) -> None:
        """Stall watchdog, keep_alive unloads, memory refresh, stats events."""
        last_refresh = last_stats = time.monotonic()
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL)
            now = time.monotonic()
            try:
                for handle in list(self.handles.values()):
                    handle.check_stall(now, self.config.stall_timeout)
                    keep = handle.spec.keep_alive
                    if keep is not None and handle.idle and now - handle.last_used > keep:
                        self.handles.pop(handle.spec.key, None)
                        self.spawn(self._stop(handle, f"idle for {now - handle.last_used:.0f}s (keep_alive {keep:g}s)"))
                if now - last_refresh >= STATS_REFRESH_INTERVAL:
                    last_refresh = now
                    for handle in self.handles.values():
                        if handle.state in LIVE:
                            handle.request_stats_nowait()
                if self.stats_interval and now - last_stats >= self.stats_interval:
                    last_stats = now
                    self.spawn(self._emit_stats())
            except Exception:
                # The watchdog must outlive a bad round; the next one comes.
                log.exception("housekeeping round failed")

    async def _emit_stats(self) -> None:
        handles = [h for h in self.handles.values() if h.state in LIVE]
        for h, row in zip(handles, await self._measure(handles)):
            # Unloaded while it was measured: its `unloaded` line is out.
            if self.handles.get(h.spec.key) is h:
                self.output.write(encode_event("stats", **row))

    def preload(self) -> list[WorkerHandle]:
        handles = []
        for entry in self.config.models:
            if not entry.preload:
                continue
            try:
                spec = self.resolver.resolve(entry.name)
            except UnknownModel as exc:
                # A path that cannot be resolved (a symlink loop) fails this
                # model, not the pool.
                log.error("model=%s: not preloaded: %s", entry.name, exc)
                self.output.write(encode_event("failed", model=entry.name, lora=entry.lora, reason=str(exc)))
                continue
            handles.append(self.handle_for(spec))
        return handles

    # -- shutdown ------------------------------------------------------------------------

    async def shutdown(self, grace: float | None) -> None:
        """Stops accepting; lets queued and running requests go on for `grace`
        seconds (None: until done); then cancels what still runs, ends what
        still waits with shutting_down, and stops every worker."""
        self.accepting = False
        if not self._quiet() and grace != 0:
            waits = [asyncio.ensure_future(self._all_idle.wait()), asyncio.ensure_future(self.hurry.wait())]
            done, pending = await asyncio.wait(waits, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
            for w in pending:
                w.cancel()
            if not self._all_idle.is_set():
                log.info("shutdown: cancelling requests that are still running")
        while self._idless:
            job = self._idless.popleft()
            if isinstance(job, bytes):
                self.output.write(job)
            else:
                self.output.write(encode_error("the pool is shutting down", SHUTTING_DOWN, job.id_json))
                self.note_error(None, SHUTTING_DOWN)
        handles = list(self.handles.values())
        self.handles.clear()
        for watcher in self.watchers.values():
            watcher.stop()
        self.watchers.clear()
        await asyncio.gather(*(h.stop("the pool is shutting down", SHUTTING_DOWN) for h in handles))
        self._forget_adapter_copies()
        for task in list(self._tasks):
            task.cancel()
