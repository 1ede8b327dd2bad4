"""The worker process: a frame reader thread, a heartbeat thread, an
adapter reader thread (worker.lora.reads), and the main thread running
the scheduler's steps on the model.

Every message from the supervisor goes through one inbox (its items are
worker.shell.inbox's union, applied in `_apply`) in arrival order, so
a Cancel always finds the Generate sent before it, and a request the adapter
messages sent before it. The main thread takes all that has arrived at each
step boundary (and sleeps on the inbox when there is no work, until a
message comes or an adapter read ends), so requests written together start
together.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable

from ipc.events import BAD_REQUEST, encode_error, encode_event
from ipc.framing import read_messages
from ipc.messages import Cancel, Embed, Generate, LoadAdapter, ReloadAdapter, Shutdown, Stats, UnloadAdapter
from ipc.worker_events import HEARTBEAT, WORKER_STATS
from worker.engine.embed import Embedder
from worker.engine.scheduler import Scheduler
from worker.runtime.memory import memory_figures
from worker.shell.channel import EventChannel
from worker.shell.inbox import Arrived, EmbedArrived, IdleRelease, Item, Wake

log = logging.getLogger("worker")


class WorkerServer:
    def __init__(self, name: str, channel: EventChannel, request_fd: int = 0):
        self.name = name
        self.channel = channel
        self.request_fd = request_fd
        self.scheduler: Scheduler | None = None
        # Embed requests (worker.engine.embed); None where the model cannot
        # embed (or is split over processes): they are refused.
        self.embedder: Embedder | None = None
        self.embed_refusal = "this worker does not compute embeddings"
        self.format = "unknown"
        self.weights_bytes = 0
        self.processor: str | None = None  # set once the model is loaded
        self.device_memory = 0  # likewise (worker.runtime.memory.device_memory)
        # Lists of items (worker.shell.inbox), one per read of the request
        # pipe; emptied at every step; what it feeds is bounded by the
        # scheduler's waiting line (MAX_WAITING, beyond which requests are
        # refused).
        self._inbox: queue.Queue[list[Item]] = queue.Queue()
        # Run before the process exits: on the reader thread when the request
        # pipe closes, on the main thread after a Shutdown (the prefix
        # cache's queued writes, within a deadline).
        self.before_exit: Callable[[], None] = lambda: None

    def wake(self) -> None:
        """Called by the adapter reader when a read ends (any thread)."""
        self._inbox.put([Wake()])

    # -- side threads -------------------------------------------------------

    def start_reader(self) -> None:
        threading.Thread(target=self._read_loop, name="frame-reader", daemon=True).start()

    def start_heartbeat(self, interval_s: float) -> None:
        # A side thread, so a long prefill or a slow load still proves the
        # process is alive; only a stopped or wedged process goes quiet.
        def beat() -> None:
            while True:
                time.sleep(interval_s)
                busy = self.scheduler is not None and self.scheduler.busy
                busy = busy or (self.embedder is not None and (self.embedder.has_work or self.embedder.running))
                self.channel.write(encode_event(HEARTBEAT, busy=busy))

        threading.Thread(target=beat, name="heartbeat", daemon=True).start()

    def _read_loop(self) -> None:
        for messages in read_messages(self.request_fd, self._malformed):
            items: list[Item] = []
            for msg in messages:
                match msg:
                    case Generate():
                        items.append(Arrived(msg, time.perf_counter()))
                    case Embed():
                        items.append(EmbedArrived(msg, time.perf_counter()))
                    case Stats():
                        self.channel.write(self.stats_event(msg.seq))
                    case _:
                        items.append(msg)
            if items:
                # One inbox entry per read: what was written together is
                # taken together.
                self._inbox.put(items)
        # The supervisor closed the pipe or died: nobody is left to serve.
        log.info("request pipe closed; exiting")
        try:
            self.before_exit()
        except Exception:
            log.exception("before exiting")
        os._exit(0)

    def _malformed(self, problem: Exception) -> None:
        log.warning("malformed frame: %s", problem)
        self.channel.write(encode_error(f"malformed frame: {problem}", BAD_REQUEST))

    def stats_event(self, seq: int) -> bytes:
        return self.encode_stats(seq, self.weights_bytes, memory_figures())

    def encode_stats(self, seq: int, weights_bytes: int, memory: dict, **extra) -> bytes:
        """The worker_stats line: this process's identity and batch figures
        with the given memory figures (a group's are its ranks' sums)."""
        batch = dict(self.scheduler.figures) if self.scheduler else {}
        return encode_event(
            WORKER_STATS,
            model=self.name,
            format=self.format,
            processor=self.processor,
            weights_bytes=weights_bytes,
            adapter_bytes=batch.pop("adapter_bytes", 0),
            **memory,
            **batch,
            **extra,
            device_memory_bytes=self.device_memory,
            seq=seq,
        )

    # -- main thread --------------------------------------------------------

    def serve_forever(self) -> None:
        scheduler = self.scheduler
        embedder = self.embedder
        stopping = False
        while True:
            block = not scheduler.has_work and not (embedder is not None and embedder.has_work)
            if stopping and block and not scheduler.busy and not scheduler.adapters.reading:
                log.info("shutdown requested; exiting")
                return
            stopping = self._apply(self._take(block)) or stopping
            if embedder is not None and embedder.has_work:
                embedder.step()
                if not embedder.has_work and not scheduler.busy:
                    # MLX's buffers of the last forward go back after
                    # idle_release_s, as after a batch of generations.
                    scheduler.idle_since = time.monotonic()
            scheduler.step()

    def _take(self, block: bool) -> list[Item]:
        """What has arrived by now; with nothing to do, wait for one, handing
        MLX's buffer cache back once the worker has been idle long enough.
        (A rank of a group takes what rank 0 took: worker.group.server.)"""
        items = self._wait() if block else []
        for _ in range(self._inbox.qsize()):
            items += self._inbox.get_nowait()
        return items

    def _wait(self) -> list[Item]:
        release_in = self.scheduler.idle_release_in(time.monotonic())
        if release_in is not None:
            try:
                return self._inbox.get(timeout=release_in)
            except queue.Empty:
                return [IdleRelease()]
        return self._inbox.get()

    def _apply(self, items: list[Item]) -> bool:
        """Hands the items to the scheduler; True when one asks to stop."""
        scheduler = self.scheduler
        stopping = False
        for item in items:
            match item:
                case Arrived(req=req, at=at):
                    scheduler.submit(req, at)
                case EmbedArrived(req=req, at=at):
                    self._embed(req, at)
                case Cancel(rid=rid):
                    if self.embedder is None or not self.embedder.cancel(rid):
                        scheduler.cancel(rid)
                case LoadAdapter() | ReloadAdapter() | UnloadAdapter():
                    scheduler.adapter_message(item)
                case IdleRelease():
                    log.debug("idle for %.1f s: MLX's buffer cache handed back", scheduler.idle_release_s)
                    scheduler.release_idle()
                case Shutdown():
                    # Everything sent before it still runs to its end.
                    stopping = True
                case Wake():
                    pass  # the step after it settles the read
        return stopping

    def _embed(self, msg: Embed, arrived: float) -> None:
        if self.embedder is None:
            self.channel.write(encode_error(self.embed_refusal, BAD_REQUEST, msg.id_json))
        else:
            self.embedder.submit(msg, arrived)
