"""A pool's life from start to stop, shared by `serve`, `run` and `chat`.

RunningPool starts a pool with its housekeeping (and, for `serve`, the
control socket and the metrics page) and stops it the same way for every
front end; `serve` adds the stdin endpoint and the reasons to stop. The
terminal front ends (supervisor.terminal) put their own output and input
around the same RunningPool.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

from supervisor.config import Config, ConfigError, parse_duration
from supervisor.control import ControlServer
from supervisor.endpoint import serve_stdin
from supervisor.pool import Pool
from supervisor.slot import WorkerSlot
from supervisor.stdout import Output

log = logging.getLogger("lattice.app")

EX_SOFTWARE = 70  # sysexits.h: an internal error
SIGNALS = (signal.SIGTERM, signal.SIGINT)


async def first_set(*events: asyncio.Event) -> None:
    """Returns once any of the events is set."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


class RunningPool:
    def __init__(self, pool: Pool, control: ControlServer | None, metrics, http):
        self.pool = pool
        self.control = control
        self.metrics = metrics
        self.http = http
        self.housekeeping = pool.spawn(pool.workers.housekeeping())
        self._signals: list[int] = []

    @classmethod
    async def start(cls, config: Config, output, *, monitor: bool) -> RunningPool:
        """A pool writing to `output` (stdout's Output, or a terminal's
        EventSink). monitor: also the control socket, the metrics page and
        the HTTP surface."""
        # The sockets and ports before any worker starts: one that cannot
        # be had fails the start rather than leaving a pool nobody can reach.
        control = metrics = http = None
        try:
            control = ControlServer.bind(config) if monitor else None
            pool = Pool(config, output)
            if monitor and config.metrics_port is not None:
                from supervisor.metrics import MetricsServer  # prometheus-client only when asked for

                metrics = MetricsServer.start(pool, config.metrics_port, config.max_metrics_connections, parse_duration(config.metrics_request_timeout))
            if monitor and config.http is not None:
                from supervisor.httpapi.server import HttpServer  # uvicorn only when asked for

                http = await HttpServer.start(pool, config)
        except ConfigError:
            output.close()
            if control is not None:
                await control.close()
            if metrics is not None:
                await metrics.close()
            raise
        if control is not None:
            await control.start(pool)
        return cls(pool, control, metrics, http)

    def on_signals(self, handler: Callable[[], None], signals=SIGNALS) -> None:
        """Handlers until close(); they only set events (an asyncio signal
        handler runs on the loop, between callbacks)."""
        loop = asyncio.get_running_loop()
        for sig in signals:
            loop.add_signal_handler(sig, handler)
            self._signals.append(sig)

    async def close(self) -> None:
        """After pool.shutdown: the endpoints, then the output."""
        self.housekeeping.cancel()
        if self.http is not None:
            await self.http.close()
        if self.control is not None:
            await self.control.close()
        if self.metrics is not None:
            await self.metrics.close()
        await self.pool.output.drain()
        self.pool.output.close()
        loop = asyncio.get_running_loop()
        for sig in self._signals:
            loop.remove_signal_handler(sig)

    async def stop(self, grace: float | None) -> None:
        await self.pool.shutdown(grace)
        await self.close()


async def serve(config: Config, *, eof_grace: float | None, settle_first: bool = False, read_stdin: bool = True) -> int:
    """Serves stdin until EOF, SIGTERM/SIGINT, a `shutdown` op or a closed
    stdout; then drains for the grace period and stops every worker.

    settle_first: read stdin only once preloaded models are ready (or have
    failed), as chat_metal did, so its clients see `ready` before anything.
    read_stdin False (`--no-stdin`, for an HTTP server run as a service):
    stdin is never read, so its EOF stops nothing."""
    output = Output()
    await output.open()
    running = await RunningPool.start(config, output, monitor=True)
    pool = running.pool
    stopping = asyncio.Event()

    def on_signal() -> None:
        # A second signal skips the grace period.
        (pool.hurry if stopping.is_set() else stopping).set()

    running.on_signals(on_signal)
    preloaded = pool.preload()
    stdin = asyncio.ensure_future(_serve_after(pool, preloaded if settle_first else []) if read_stdin else asyncio.Event().wait())
    waits = {
        stdin: "stdin closed",
        asyncio.ensure_future(stopping.wait()): "signal",
        asyncio.ensure_future(pool.shutdown_requested.wait()): "shutdown op",
        asyncio.ensure_future(output.closed.wait()): "stdout closed",
    }
    done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    why = next(waits[t] for t in waits if t in done)
    rc = 0
    if stdin in done and stdin.exception() is not None:
        # Every line is its own boundary (endpoint.dispatch), so this is a
        # bug; a pool that stops reading must not look like one at EOF.
        log.critical("the stdin endpoint failed; shutting down", exc_info=stdin.exception())
        why, rc = "stdin endpoint failed", EX_SOFTWARE
    grace = eof_grace if why == "stdin closed" else config.shutdown_grace
    if why == "stdout closed":
        grace = 0
    log.info("shutting down (%s); grace %s", why, "unlimited" if grace is None else f"{grace:g}s")
    stopping.set()
    # Answers nobody can read are not worth waiting for: stdout gone during
    # the grace period (Ctrl-C on `serve | grep x`) ends it at once.
    hurry_when_gone = asyncio.ensure_future(_set_when(output.closed, pool.hurry))
    await pool.shutdown(grace)
    hurry_when_gone.cancel()
    for task in waits:
        task.cancel()
    await running.close()
    return rc


async def _set_when(cause: asyncio.Event, effect: asyncio.Event) -> None:
    await cause.wait()
    effect.set()


async def _serve_after(pool: Pool, slots: list[WorkerSlot]) -> None:
    for slot in slots:
        await slot.settled.wait()
    await serve_stdin(pool)
