"""Set-adapter requests: load and validate off the token path, swap when no
request is running.

A loader thread reads and checks each adapter while the model keeps serving
with the current one; the swap itself is handed to the main thread, which
runs it at a step boundary once no row is active (the scheduler holds new
requests back meanwhile), so every request runs with exactly one adapter
version. Set-adapter requests are handled one at a time, in order, so the
replies come in the order they were asked for.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path
from typing import Callable

from ipc.events import ADAPTER_ERROR, encode_event
from worker.lora.formats import AdapterError, AdapterWeights, Targets
from worker.lora.layers import LoRASlots

log = logging.getLogger("worker")

Emit = Callable[[bytes], None]
RunWhenIdle = Callable[[Callable[[], None]], None]


class AdapterSwapper:
    def __init__(self, name: str, emit: Emit, run_when_idle: RunWhenIdle):
        self.name = name
        self._emit = emit
        self._run_when_idle = run_when_idle
        self._requests: queue.Queue[str | None] = queue.Queue()
        self._slots: LoRASlots | None = None
        self._on_swap: Callable[[str | None], None] = lambda key: None
        self._read: Callable[[Path, Targets], AdapterWeights] | None = None

    @property
    def nbytes(self) -> int:
        return self._slots.nbytes if self._slots else 0

    def submit(self, path: str | None) -> None:
        """Queues a request; safe before `attach`, which starts serving them."""
        self._requests.put(path)

    def attach(self, slots: LoRASlots, on_swap: Callable[[str | None], None], read: Callable[[Path, Targets], AdapterWeights]) -> None:
        """Starts serving requests on the loaded model, reading adapters with
        `read`; `on_swap(key or None)` runs on the main thread right after
        each swap."""
        self._slots = slots
        self._on_swap = on_swap
        self._read = read
        threading.Thread(target=self._loop, name="adapter-loader", daemon=True).start()

    def _loop(self) -> None:
        while True:
            path = self._requests.get()
            t0 = time.perf_counter()
            try:
                weights = self._read(Path(path).expanduser(), self._slots.targets) if path is not None else None
            except AdapterError as exc:
                self._error(path, str(exc))
                continue
            except Exception as exc:  # the worker keeps serving whatever a file holds
                log.exception("adapter %s could not be read", path)
                self._error(path, f"adapter {path}: {exc}")
                continue
            load_s = time.perf_counter() - t0
            done = threading.Event()
            self._run_when_idle(lambda: self._swap(path, weights, load_s, done))
            done.wait()

    def _swap(self, path: str | None, weights: AdapterWeights | None, load_s: float, done: threading.Event) -> None:
        try:
            t0 = time.perf_counter()
            try:
                self._slots.install(weights)
            except Exception as exc:
                log.exception("adapter %s could not be installed", path)
                self._error(path, f"adapter {path}: cannot install: {exc}")
                return
            key = weights.sha256 if weights else None
            self._on_swap(weights.key if weights else None)
            # Loading and swapping time; waiting for a running request is not the adapter's cost.
            ms = int((load_s + time.perf_counter() - t0) * 1000)
            log.info("adapter %s active: sha256=%s modules=%d bytes=%d ms=%d", path, key, len(weights.pairs) if weights else 0, self.nbytes, ms)
            self._emit(
                encode_event(
                    "adapter_loaded",
                    model=self.name,
                    lora=path,
                    sha256=key,
                    ms=ms,
                    format=weights.format if weights else None,
                    modules=len(weights.pairs) if weights else 0,
                    adapter_bytes=self.nbytes,
                    config_sha256=weights.config_sha256 if weights else None,
                )
            )
        finally:
            done.set()

    def _error(self, path: str | None, msg: str) -> None:
        log.warning("%s; keeping the current adapter", msg)
        self._emit(encode_event("adapter_error", model=self.name, lora=path, code=ADAPTER_ERROR, msg=msg))
