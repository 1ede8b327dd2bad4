"""The worker process: a frame reader thread, a heartbeat thread, and the
main thread running one request at a time on the model."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

import msgspec

from ipc.events import WORKER_CRASHED, encode_cancelled_done, encode_error, encode_event
from ipc.framing import FrameTooLarge, decode_payload, read_payload
from ipc.messages import Cancel, Generate, SetAdapter, Shutdown, Stats
from worker.lora.swap import AdapterSwapper
from worker.channel import EventChannel
from worker.engine import Engine, RequestError
from worker.memory import memory_figures

log = logging.getLogger("worker")

_SHUTDOWN = object()


class WorkerServer:
    def __init__(self, name: str, channel: EventChannel, request_fd: int = 0):
        self.name = name
        self.channel = channel
        self.request_fd = request_fd
        self.engine: Engine | None = None
        self.format = "unknown"
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._current: int | None = None
        self._cancel = threading.Event()
        self._cancelled: set[int] = set()
        self.adapters = AdapterSwapper(name, channel.write, self._jobs.put)

    # -- side threads -------------------------------------------------------

    def start_reader(self) -> None:
        threading.Thread(target=self._read_loop, name="frame-reader", daemon=True).start()

    def start_heartbeat(self, interval_s: float) -> None:
        # A side thread, so a long prefill or a slow load still proves the
        # process is alive; only a stopped or wedged process goes quiet.
        def beat() -> None:
            while True:
                time.sleep(interval_s)
                self.channel.write(encode_event("heartbeat", busy=self._current is not None))

        threading.Thread(target=beat, name="heartbeat", daemon=True).start()

    def _read_loop(self) -> None:
        while True:
            try:
                payload = read_payload(self.request_fd)
            except FrameTooLarge as exc:
                self.channel.write(encode_error(f"malformed frame: {exc}", "bad_request"))
                continue
            except OSError:
                payload = None
            if payload is None:
                # The supervisor closed the pipe or died: nobody is left to serve.
                log.info("request pipe closed; exiting")
                os._exit(0)
            try:
                msg = decode_payload(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("malformed frame: %s", exc)
                self.channel.write(encode_error(f"malformed frame: {exc}", "bad_request"))
                continue
            self._dispatch(msg)

    def _dispatch(self, msg) -> None:
        if isinstance(msg, Generate):
            self._jobs.put(msg)
        elif isinstance(msg, SetAdapter):
            self.adapters.submit(msg.path)
        elif isinstance(msg, Cancel):
            with self._lock:
                if self._current == msg.rid:
                    self._cancel.set()
                else:
                    self._cancelled.add(msg.rid)
        elif isinstance(msg, Stats):
            self.channel.write(self.stats_event())
        elif isinstance(msg, Shutdown):
            self._jobs.put(_SHUTDOWN)

    def stats_event(self) -> bytes:
        figures = memory_figures()
        weights = self.engine.loaded.weights_bytes if self.engine else 0
        return encode_event("worker_stats", model=self.name, format=self.format, weights_bytes=weights, adapter_bytes=self.adapters.nbytes, **figures)

    # -- main thread --------------------------------------------------------

    def serve_forever(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _SHUTDOWN:
                log.info("shutdown requested; exiting")
                return
            if isinstance(job, Generate):
                self._run(job)
            else:
                job()  # an adapter swap, due between two requests

    def _run(self, req: Generate) -> None:
        with self._lock:
            if req.rid in self._cancelled:
                self._cancelled.discard(req.rid)
                self.channel.write(encode_cancelled_done(req.id_json))
                return
            self._current = req.rid
            self._cancel.clear()
        try:
            finish, _ = self.engine.run(req, self.channel.write, self._cancel)
            log.debug("request %s finished: %s", req.id_json or req.rid, finish)
        except RequestError as exc:
            log.info("request %s rejected: %s", req.id_json or req.rid, exc.msg)
            self.channel.write(encode_error(exc.msg, exc.code, req.id_json))
        except Exception as exc:  # the request must still end with one terminal line
            log.exception("request %s failed", req.id_json or req.rid)
            self.channel.write(encode_error(f"generation failed in the worker: {exc}", WORKER_CRASHED, req.id_json))
        finally:
            with self._lock:
                self._current = None
