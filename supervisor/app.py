"""Running a pool on this process's stdin and stdout until shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
from supervisor.config import Config
from supervisor.endpoint import serve_stdin
from supervisor.output import Output
from supervisor.pool import Pool

log = logging.getLogger("lattice.app")


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
    output = Output()
    await output.open()
    pool = Pool(config, output)
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
    grace = eof_grace if why == "stdin closed" else config.shutdown_grace
    if why == "stdout closed":
        grace = 0
    log.info("shutting down (%s); grace %s", why, "unlimited" if grace is None else f"{grace:g}s")
    stopping.set()
    await pool.shutdown(grace)
    for task in waits:
        task.cancel()
    housekeeping.cancel()
    await output.drain()
    output.close()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
    return 0


async def _serve_after(pool: Pool, handles: list) -> None:
    for handle in handles:
        await handle.settled.wait()
    await serve_stdin(pool)
