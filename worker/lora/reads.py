"""The adapter reader thread: adapter files read and checked off the token
path, one at a time, in the order they were handed in; their results come
back in that order, for the model's thread to settle (worker.lora.manager).

Bounds: one job per adapter message, and one per adapter path that requests
wait for; each holds at most one adapter's weights once read.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.lora.formats import AdapterError, AdapterReader, AdapterWeights, Targets

log = logging.getLogger("worker")


@dataclass
class Read:
    """An adapter file read: its weights, or why not."""

    weights: AdapterWeights | None = None
    error: str | None = None
    note: str | None = None  # why the last good copy stood in
    seconds: float = 0.0


class ReadThread:
    def __init__(self, reader: AdapterReader, targets: Targets, wake: Callable[[], None]):
        self._reader = reader
        self._targets = targets
        self._wake = wake
        self._jobs: queue.SimpleQueue[tuple[Any, str | None, bool]] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[Any, Read | None]] = queue.SimpleQueue()
        self._result = threading.Event()
        self._thread: threading.Thread | None = None
        self.in_flight = 0  # jobs handed in whose results are not yet taken

    def put(self, job: Any, path: str | None, fallback: bool) -> None:
        """Reads `path` (None: nothing to read; the job comes back with no
        Read, in its turn)."""
        self.in_flight += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="adapter-loader", daemon=True)
            self._thread.start()
        self._jobs.put((job, path, fallback))

    @property
    def has_results(self) -> bool:
        return not self._done.empty()

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until a job has finished (in-process drivers; the worker
        sleeps on its inbox, which `wake` feeds)."""
        self._result.wait(timeout)

    def results(self) -> Iterator[tuple[Any, Read | None]]:
        """The jobs finished by now, in the order they were put."""
        self._result.clear()
        while not self._done.empty():
            self.in_flight -= 1
            yield self._done.get()

    def _loop(self) -> None:
        while True:
            job, path, fallback = self._jobs.get()
            read = self.read(path, fallback) if path is not None else None
            self._done.put((job, read))
            self._result.set()
            self._wake()

    def read(self, path_str: str, fallback: bool) -> Read:
        """Reads and checks an adapter file (any thread). With `fallback`,
        the pool's last good copy of it stands in for a file that fails."""
        t0 = time.perf_counter()
        path = Path(path_str).expanduser()
        try:
            try:
                return Read(weights=self._reader.read(path, self._targets), seconds=time.perf_counter() - t0)
            except AdapterError as exc:
                first = exc
                kept = self._reader.read_last_good(path, self._targets) if fallback else None
                if kept is None:
                    return Read(error=str(exc))
                weights, copy = kept
                log.warning("%s; using the last good copy of it, kept in %s", exc, copy)
                note = f"{exc}; using the last good copy of it (sha256 {weights.sha256})"
                return Read(weights=weights, note=note, seconds=time.perf_counter() - t0)
        except AdapterError as exc:
            log.warning("the last good copy of adapter %s is unusable too: %s", path_str, exc)
            return Read(error=str(first))
        except Exception as exc:  # the worker keeps serving whatever a file holds
            log.exception("adapter %s could not be read", path_str)
            return Read(error=f"adapter {path_str}: {exc}")
