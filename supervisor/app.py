"""Running a pool on this process's stdin and stdout until shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal

from supervisor.config import Config, ConfigError
from supervisor.control import ControlServer
from supervisor.endpoint import serve_stdin
from supervisor.output import Output
from supervisor.pool import Pool

log = logging.getLogger("lattice.app")

EX_SOFTWARE = 70  # sysexits.h: an internal error


async def run_pool(
    config: Config,
    *,
    eof_grace: float | None,
    settle_first: bool = False,
) -> int:
    """Serves stdin until EOF, SIGTERM/SIGINT, a `shutdown` op or a closed
    stdout; then drains for the grace period and stops every worker.

    settle_first: read stdin only once preloaded models are ready (or have
    failed), as chat_metal did, so its clients see `ready` before anything."""
    loop = asyncio.get_running_loop()
    # The socket and the port before any worker starts: one that cannot be
    # had fails the start rather than leaving a pool nobody can reach.
    control = ControlServer.bind(config)
    output = Output()
    await output.open()
    pool = Pool(config, output)
    metrics = None
    if config.metrics_port is not None:
        from supervisor.metrics import MetricsServer  # prometheus-client only when asked for

        try:
            metrics = MetricsServer.start(pool, config.metrics_port, config.max_metrics_connections)
        except ConfigError:
            output.close()
            if control is not None:
                await control.close()
            raise
    if control is not None:
        await control.start(pool)
    stopping = asyncio.Event()

    def on_signal() -> None:
        # A second signal skips the grace period.
        (pool.hurry if stopping.is_set() else stopping).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    preloaded = pool.preload()
    housekeeping = pool.spawn(pool.housekeeping())
    stdin = asyncio.ensure_future(_serve_after(pool, preloaded if settle_first else []))
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
    await pool.shutdown(grace)
    for task in waits:
        task.cancel()
    housekeeping.cancel()
    if control is not None:
        await control.close()
    if metrics is not None:
        await metrics.close()
    await output.drain()
    output.close()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
    return rc


async def _serve_after(pool: Pool, handles: list) -> None:
    for handle in handles:
        await handle.settled.wait()
    await serve_stdin(pool)
