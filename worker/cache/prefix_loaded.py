"""What the prefix cache's disk tier (worker.cache.prefix_disk) hands the
engine: an entry of its index, a file checked, and the making of that
file's arrays on the main thread, where mlx arrays are made: by mlx's own
reader, all at once or a part at a time, or from mlx's read of the file
started beside its check."""

from __future__ import annotations

import logging
import os
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from worker.cache.disk_files import fd_path, open_regular
from worker.cache.prefix_file import unflatten

log = logging.getLogger("worker")


@dataclass
class DiskEntry:
    name: str
    adapter: str | None
    tokens: np.ndarray
    size: int  # bytes of the file
    used: float  # its modification time: when last written or hit


def identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def mlx_read(f) -> dict:
    """mlx's read of the open file `f`, by name, on its CPU stream. mlx
    reads through the descriptor opened (and checked regular) here: a FIFO
    put under the file's name since its check would block mx.load on the
    main thread for ever. mx.load opens its own reader of the file at
    once, so `f` may close before the arrays are read."""
    return mx.load(fd_path(f.fileno()), format="safetensors", stream=mx.cpu)


@dataclass
class Beside:
    """mlx's read of a file, started before its check ends (PrefixDisk.read_beside):
    the file's identity, and mlx's arrays by name."""

    identity: tuple
    found: dict


@dataclass
class Loaded:
    """A file checked on the disk thread; its arrays are read on the main
    thread (mlx arrays are made there)."""

    entry: DiskEntry
    path: Path
    tree: object
    arrays: int
    identity: tuple  # of the file checked (`identity`)
    check_s: float = 0.0  # how long the check took (the disk thread's read)

    def layers(self, beside: Beside | None = None) -> tuple[list, int] | None:
        """The file's state, read by mlx's own reader (into the arrays'
        memory: no copy through Python); None, logged, when the file changed
        since it was checked. `beside`: see `parts`."""
        parts = self.parts(None, beside)
        while True:
            try:
                next(parts)
            except StopIteration as end:
                return end.value

    def parts(self, step_bytes: int | None, beside: Beside | None = None) -> Generator[None, None, tuple[list, int] | None]:
        """`layers`, made about `step_bytes` of arrays at a time (None: all
        at once): the generator yields after each part and returns the
        state. A read-back beside running rows holds them up a part a step,
        not a whole file (the 8B shape's 3.8 GB took 0.4 s on an H100).
        `beside`: mlx's read of this file started before the check ended,
        taken where it read the file checked."""
        try:
            if beside is not None and beside.identity == self.identity:
                found = beside.found
            else:
                with open_regular(self.path) as f:
                    found = mlx_read(f)
            # mlx reads a file on the host, into managed memory on CUDA, and
            # the GPU pulls it over page by page at its first use. That is
            # still the fastest way measured: on an H100, 3.8 GB read in
            # 0.42-0.63 s and first used in 0.36 s, against 2.1-2.2 s copied
            # to the device array by array as they are made and 2.4-2.7 s
            # read by mlx on the GPU's stream (a host buffer, then one copy).
            tokens = found["tokens"]
            arrays = [found[f"a{i}"] for i in range(self.arrays)]
            part, size = [tokens], 0
            for a in arrays:
                part.append(a)
                size += a.nbytes
                if step_bytes is not None and size >= step_bytes:
                    mx.eval(part)
                    part, size = [], 0
                    yield
            mx.eval(part)
            if not np.array_equal(np.array(tokens), self.entry.tokens):
                raise ValueError("its token ids changed since its check")
            return unflatten(self.tree, arrays), sum(a.nbytes for a in arrays)
        except (RuntimeError, ValueError, KeyError, IndexError, TypeError, OSError) as exc:
            log.warning("prefix cache: %s could not be read after its check (%s); not used", self.entry.name, exc)
            return None
