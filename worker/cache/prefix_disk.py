"""The prefix cache's disk tier: snapshots kept as files, so a worker that
crashed, was unloaded or belongs to a restarted pool resumes long prompts
from disk instead of reading them again.

Every snapshot the memory tier stores is written here too, by a thread of
its own (the engine thread only hands it the arrays, which are never
written in place). Files live in `<dir>/<model key>/`, where the model key
hashes the model's content (config, weight headers, samples of the weight
bytes), the dtype it computes in, and mlx's version: the same state from the
same tokens. A file's name hashes its adapter's content key and its token
ids; the file holds both, so a lookup compares them, never the name alone.

A file is written under a temporary name and renamed, so a crash leaves a
whole file or none; its layout, a safetensors file with its checksums, is
worker.cache.prefix_file's. A file that is short, malformed or fails a
check is removed with a log line, never used. The files' modification times
order them, least recently used first out, past the byte budget, and a hit
touches its file: the order survives restarts.

Reads go through the same thread: a request whose prompt has a longer
prefix on disk than in memory waits while its file is checked
(worker.engine.scheduler): READ_THREADS threads read and check its chunks
at once (file reads and zlib let go of the GIL), which also brings the file
into the page cache. Then the main thread has mlx read it into arrays
(worker.cache.prefix_loaded): mlx's reader fills the arrays' memory
itself, with no copy through Python. For the first file a request waits
for, mlx's read starts as the request asks (`read_beside`, on mlx's CPU
stream, its header checked first), beside the check rather than after it;
its arrays are used only if the check passes on that same file (the same
inode, size and modification time), and dropped otherwise. On a 2-core
EPYC, for a 445 MB file in the page cache, the check took 0.09-0.15 s and
mlx's read 0.13-0.16 s, where one thread that read the file and took its
SHA-256 took 0.88 s and making arrays from its bytes another 0.27 s on the
main thread.

A worker that starts reads the most recently used files back into memory
the same way, up to half its memory budget, so that after a restart the
prefixes in use are in memory again by the time their requests come: before
`ready`, for as long as the worker allows them (worker.__main__.warm,
`read_backs_now`), then after it. There, read-backs start READ_BACK_QUIET_S
after they are queued and after any request's read; a request's read goes
before them, even one half checked (it stops between chunks and starts
again later), and takes the place of one of them it needs; and the scheduler makes read-backs' arrays only once
no request waits for a file, a part a step (`Loaded.parts`). Read back
oldest first (so the newest ends most recently used in memory), a GPU's
budget of several GB would otherwise hold a request that comes right after
the start behind every file but its own.

A file is read only while reading it is faster than computing the tokens
it holds (worker.cache.disk_rates).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np

from worker.cache.disk_files import drop_unused_beside, open_regular, read_buffer, warm_read_buffer, writer_runs
from worker.cache.prefix_file import (
    LENGTH,
    SUFFIX,
    BadEntry,
    check_chunk,
    checked_layout,
    crc_of,
    encode,
    entry_name,
    flatten,
    read_layout,
    read_tokens,
)
from worker.cache.prefix_loaded import Beside, DiskEntry, Loaded, identity, mlx_read

log = logging.getLogger("worker")

# Snapshots waiting to be written; more are dropped (logged): the engine
# never waits for the disk.
MAX_PENDING_WRITES = 64
# Files in a model's folder, least recently used out beyond it, whatever
# the byte budget: the index holds each file's token ids in memory, and a
# request's lookup compares its prompt with every one, on the main thread.
MAX_FILES = 4096
# Bytes of the snapshots queued to be written, beyond which more are
# dropped (logged); a worker passes its prefix_cache_bytes.
DEFAULT_PENDING_BYTES = 1 << 30
# The same bound where the queue holds copies on a GPU (`on_device`): they
# take device memory outside the worker's budgets until they are written.
COPIES_PENDING_BYTES = 2 << 30
# Bytes of device copies made in one engine step (`make_copies`; one array
# at least): a large snapshot's copy holds running rows up a part a step,
# not whole.
COPY_STEP_BYTES = 512 << 20
# How long an exiting worker waits for the writes queued (`closing`): less
# than the pool's 5 s between closing a worker's pipe and SIGTERM.
EXIT_FLUSH_S = 3.0
# How long a request waits for prefix cache files before it starts without
# them (a disk that hangs must not hold requests for ever).
READ_WAIT_S = 30.0
# Read-backs wait until no request has asked for a file for this long (and
# as long after they are queued): a request that comes right after a
# worker's start, the usual case after a crash or an unload, then reads
# its own file alone, where on an H100 the 0.8b shape's restart spent
# 100-150 ms of its 390 ms on other files read back first.
READ_BACK_QUIET_S = 0.5
# How often the disk thread looks again at writes the engine holds back
# (`writes_wait_until`).
WRITE_POLL_S = 0.02
# Data bytes under one checksum: the unit a check is split into. Each of
# the READ_THREADS threads keeps one buffer of it (at most MAX_CHUNK, what
# a file may claim).
CHUNK = 4 << 20
READ_THREADS = max(1, min(8, os.cpu_count() or 1))
# What `_load` returns for a read-back that stopped for a request's read.
STOPPED = object()


def device_copies(arrays: list[mx.array]) -> list[mx.array]:
    """Copies of the arrays, made where mlx computes (on a GPU, in device
    memory). Only arrays held elsewhere too are copied: mlx hands an array
    that nothing else holds its buffer (as the snapshots the memory tier
    keeps are held, and a file's arrays as they are read are not)."""
    return [mx.array(a) for a in arrays]


class PrefixDisk:
    def __init__(
        self,
        root: Path,
        key: str,
        budget: int,
        wake: Callable[[], None] = lambda: None,
        max_pending_bytes: int = DEFAULT_PENDING_BYTES,
        on_device: bool = False,
    ):
        self.dir = root / key
        # With `on_device` (arrays on a CUDA device) the queue holds device
        # copies, not the memory tier's arrays (`write`), and at most
        # COPIES_PENDING_BYTES of them beside the one always taken.
        self.on_device = on_device
        self.max_pending_bytes = min(max_pending_bytes, COPIES_PENDING_BYTES) if on_device else max_pending_bytes
        self._pending_bytes = 0  # arrays of the snapshots queued to be written
        # The engine's: no write starts before this time.monotonic(), while a
        # request waits for its first token (worker.engine.scheduler). On a
        # 2-core EPYC a 26k-token hit's first token took 55.9 ms with the
        # snapshot stored at its cut written beside it, 45.6 ms without.
        self.writes_wait_until = 0.0
        self.dir.mkdir(parents=True, exist_ok=True)
        self.budget = budget
        self.wake = wake
        self._lock = threading.Lock()
        self._index: dict[str, DiskEntry] = {}
        self._writes: queue.Queue = queue.Queue(MAX_PENDING_WRITES)
        # On a device: snapshots taken whose copies are not all made yet,
        # each [job, copies so far] (main thread only; `make_copies`).
        self.uncopied: deque[list] = deque()
        # Entries to read: requests' first, then read-backs (`read`); both
        # bounded by the index, an entry at most once (`_reading`).
        self._reads: deque[DiskEntry] = deque()
        self._read_backs: deque[DiskEntry] = deque()
        self._results: queue.Queue = queue.Queue()
        self._reading: set[str] = set()
        # Those of them a request asked for (`read`), until `results`.
        self._asked: set[str] = set()
        self._work = threading.Event()
        self._clock = time.monotonic
        # When a request last asked for a file, or read-backs were queued
        # with none waiting: read-backs start READ_BACK_QUIET_S after it.
        self._quiet_since = 0.0
        self._io = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="prefix-disk-io")
        self._scan()
        if self._index:
            # A worker that finds files is likely a restarted one, whose
            # first request reads one of them.
            together = threading.Barrier(READ_THREADS, timeout=5.0)
            for _ in range(READ_THREADS):
                self._io.submit(warm_read_buffer, CHUNK, together)
        threading.Thread(target=self._run, name="prefix-disk", daemon=True).start()

    @property
    def used(self) -> int:
        with self._lock:
            return sum(e.size for e in self._index.values())

    def __len__(self) -> int:
        return len(self._index)

    # -- start: what is on disk ----------------------------------------------

    def _scan(self) -> None:
        for path in self.dir.iterdir():
            if path.name.endswith(".tmp"):
                # A write that a crash cut short; not one of a process that
                # still runs (another worker of this model, or the one a
                # pool restart replaces): its rename would fail.
                if not writer_runs(path.name):
                    path.unlink(missing_ok=True)
                continue
            if not path.name.endswith(SUFFIX):
                continue
            try:
                entry = self._read_index(path)
            except BadEntry as exc:
                self._discard(path, str(exc))
                continue
            except OSError as exc:
                log.warning("prefix cache: cannot read %s: %s", path, exc)
                continue
            self._index[entry.name] = entry
        if self._index:
            log.info("prefix cache on disk: %d entries, %d bytes in %s", len(self._index), self.used, self.dir)
        self._evict()
        drop_unused_beside(self.dir)

    def _read_index(self, path: Path) -> DiskEntry:
        with open_regular(path) as f:
            st = os.fstat(f.fileno())
            layout = read_layout(f, st.st_size)
            tokens = read_tokens(f, layout)
        adapter = layout.meta.get("adapter")
        if entry_name(adapter, tokens) != path.name:
            raise BadEntry("its name does not match its tokens")
        return DiskEntry(path.name, adapter, tokens, st.st_size, st.st_mtime)

    def _discard(self, path: Path, why: str) -> None:
        log.warning("prefix cache: dropping %s: %s", path.name, why)
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            # A read-only folder: the file stays, out of the index.
            log.warning("prefix cache: cannot remove %s: %s", path.name, exc)
        with self._lock:
            self._index.pop(path.name, None)

    # -- lookups (main thread) -----------------------------------------------

    def candidates(self, ids: np.ndarray, usable: Callable[[np.ndarray, np.ndarray], int]) -> dict[str | None, tuple[int, DiskEntry]]:
        """The longest usable entry per adapter key: (tokens it covers, entry)."""
        best: dict[str | None, tuple[int, DiskEntry]] = {}
        with self._lock:
            entries = list(self._index.values())
        for entry in entries:
            n = usable(entry.tokens, ids)
            if n > 0 and n > best.get(entry.adapter, (0, None))[0]:
                best[entry.adapter] = (n, entry)
        return best

    def recent(self, limit_bytes: int) -> list[DiskEntry]:
        """The most recently used entries, newest first, as many as fit in
        `limit_bytes` (of file size, about their size in memory)."""
        with self._lock:
            entries = sorted(self._index.values(), key=lambda e: e.used, reverse=True)
        out, total = [], 0
        for entry in entries:
            if total + entry.size > limit_bytes:
                break
            out.append(entry)
            total += entry.size
        return out

    def read(self, entry: DiskEntry, read_back: bool = False) -> bool:
        """Starts reading an entry, for a request or (`read_back`) to have it
        in memory again; False when it is already being read (a request's
        read then goes before the read-backs still waiting)."""
        with self._lock:
            if not read_back:
                self._asked.add(entry.name)
            if entry.name in self._reading:
                if not read_back:
                    self._quiet_since = self._clock()
                    waiting = next((e for e in self._read_backs if e.name == entry.name), None)
                    if waiting is not None:
                        self._read_backs.remove(waiting)
                        self._reads.append(waiting)
                        # The disk thread may be waiting out the quiet time.
                        self._work.set()
                return False
            self._reading.add(entry.name)
            if not read_back or not self._read_backs:
                self._quiet_since = self._clock()
            (self._read_backs if read_back else self._reads).append(entry)
        self._work.set()
        return True

    def read_backs_now(self) -> None:
        """Read-backs queued start without waiting for quiet: a worker reading
        them before `ready`, when no request can come."""
        with self._lock:
            self._quiet_since = self._clock() - READ_BACK_QUIET_S
        self._work.set()

    def _next_read(self) -> tuple[DiskEntry | None, bool]:
        """The next entry to read, and whether it is a read-back (None while
        read-backs wait for quiet)."""
        with self._lock:
            if self._reads:
                return self._reads.popleft(), False
            if self._read_backs and self._held() == 0:
                return self._read_backs.popleft(), True
            return None, True

    def _held(self) -> float | None:
        """Seconds until read-backs may start; None when none waits."""
        if not self._read_backs:
            return None
        return max(0.0, self._quiet_since + READ_BACK_QUIET_S - self._clock())

    def read_beside(self, entry: DiskEntry) -> Beside | None:
        """Starts mlx's read of a file a request waits for, on mlx's CPU
        stream, while the disk thread checks it; None where it cannot be
        opened or its header is bad (the check then says why). The header is
        checked first: mlx makes arrays of the sizes it states."""
        try:
            with open_regular(self.dir / entry.name) as f:
                st = os.fstat(f.fileno())
                read_layout(f, st.st_size)
                found = mlx_read(f)
            mx.async_eval(list(found.values()))
            return Beside(identity(st), found)
        except Exception:  # a bad file is the check's to report and remove
            return None

    def load_now(self, entry: DiskEntry) -> Loaded | None:
        """Reads an entry on the calling thread (a worker loading, before
        any request runs); None when it is bad (then removed)."""
        return self._load(entry)

    def results(self) -> list[tuple[DiskEntry, Loaded | None]]:
        """Reads that ended since the last call (None: the entry was bad)."""
        out = []
        while True:
            try:
                entry, loaded = self._results.get_nowait()
            except queue.Empty:
                return out
            with self._lock:
                self._reading.discard(entry.name)
                self._asked.discard(entry.name)
            out.append((entry, loaded))

    @property
    def reading(self) -> bool:
        return bool(self._reading)

    def wait(self, timeout: float) -> None:
        """Until a read ends (in-process drains)."""
        deadline = time.monotonic() + timeout
        while self._results.empty() and time.monotonic() < deadline:
            time.sleep(0.005)

    # -- writes (main thread hands over) -------------------------------------

    def write(self, adapter: str | None, tokens: np.ndarray, layers: list) -> None:
        """Queues a snapshot for writing; its arrays are evaluated and never
        written in place (worker.cache.prefix_cache), so this thread may read them."""
        name = entry_name(adapter, tokens)
        with self._lock:
            known = self._index.get(name)
        if known is not None and self._touch(known):
            return
        arrays: list = []
        tree = flatten(layers, arrays)
        nbytes = sum(a.nbytes for a in arrays)
        with self._lock:
            # A queued snapshot keeps its arrays alive after the memory tier
            # lets them go; one is always taken, whatever its size.
            if self._pending_bytes and self._pending_bytes + nbytes > self.max_pending_bytes:
                log.warning("prefix cache: %d MB wait for the disk; a snapshot of %d tokens is not written", self._pending_bytes >> 20, len(tokens))
                return
            if self._writes.qsize() + len(self.uncopied) >= MAX_PENDING_WRITES:
                log.warning("prefix cache: %d snapshots wait for the disk; one of %d tokens is not written", MAX_PENDING_WRITES, len(tokens))
                return
            self._pending_bytes += nbytes
        job = (name, adapter, tokens, tree, arrays, nbytes)
        if self.on_device:
            self.uncopied.append([job, []])
            self.make_copies()
            return
        # Only this thread queues, so the queue has room still.
        self._writes.put_nowait(job)
        self._work.set()

    def make_copies(self, step_bytes: int | None = COPY_STEP_BYTES) -> None:
        """On a device, makes the next copies of the snapshots taken, about
        `step_bytes` of them (None: all), and queues each snapshot whose
        copies are all made; nothing while the engine holds writes back.

        On CUDA, reading an array's bytes on the host (the buffer protocol
        `_store` uses) moves its buffer into managed memory for good (mlx's
        `Buffer::raw_ptr`), so the next request resuming from the memory
        tier's array would fetch it back over the bus: the disk thread
        writes copies made on the device, and frees them. Making them holds
        the main thread: on an H100, in one process, the 8B shape's hits on
        a 26k-token prefix took 385-485 ms to their first token with the
        3.7 GB copy made as the snapshot was stored (in the prompt's pass),
        71-78 ms with the memory tier alone. So copies wait while a request
        waits for its first token (`writes_wait_until`, set by the engine,
        which steps while any wait: worker.engine.scheduler), and a large
        snapshot's are made a part a step."""
        if not self.uncopied or self.writes_wait_until > self._clock():
            return
        made = 0
        while self.uncopied and (step_bytes is None or made < step_bytes):
            (name, adapter, tokens, tree, arrays, nbytes), copies = self.uncopied[0]
            take = arrays[len(copies) : len(copies) + 1]  # one array at least
            made += sum(a.nbytes for a in take)
            for a in arrays[len(copies) + 1 :]:
                if step_bytes is not None and made >= step_bytes:
                    break
                take.append(a)
                made += a.nbytes
            try:
                part = device_copies(take)
                mx.eval(part)
                copies += part
            except Exception as exc:  # the disk tier never fails a request
                self.uncopied.popleft()
                with self._lock:
                    self._pending_bytes -= nbytes
                log.warning("prefix cache: a snapshot of %d tokens is not written: no copy for the disk (%s)", len(tokens), exc)
                continue
            if len(copies) == len(arrays):
                self.uncopied.popleft()
                self._writes.put_nowait((name, adapter, tokens, tree, copies, nbytes))
                self._work.set()

    def touch(self, adapter: str | None, tokens: np.ndarray) -> None:
        with self._lock:
            entry = self._index.get(entry_name(adapter, tokens))
        if entry is not None:
            self._touch(entry)

    def _touch(self, entry: DiskEntry) -> bool:
        """Marks an entry used; False when its file is gone (another
        worker's eviction, or a user clearing the directory): it leaves the
        index, which no longer counts it against the budget, and a write
        makes it again."""
        entry.used = time.time()
        try:
            os.utime(self.dir / entry.name, (entry.used, entry.used))
        except FileNotFoundError:
            with self._lock:
                if self._index.get(entry.name) is entry:
                    del self._index[entry.name]
            return False
        except OSError:
            pass
        return True

    def closing(self) -> None:
        """The worker exits: the snapshots queued by then go to disk, within
        EXIT_FLUSH_S (an unload or a pool restart would otherwise lose the
        last long prompts' files)."""
        self.writes_wait_until = 0.0
        if not self.flush(EXIT_FLUSH_S) or self.uncopied:
            log.warning("prefix cache: exiting with %d snapshot(s) not written", self._writes.unfinished_tasks + len(self.uncopied))

    def flush(self, timeout: float) -> bool:
        """Waits until every snapshot queued is on disk. On the main thread
        the device copies still to make are made and count; on another (the
        reader thread, exiting when the request pipe closes, while the main
        thread may be in a step) they are not: mlx arrays are made on the
        main thread only."""
        main = threading.current_thread() is threading.main_thread()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if main:
                self.make_copies(None)
            if self._writes.unfinished_tasks == 0 and not (main and self.uncopied):
                return True
            time.sleep(0.01)
        return False

    # -- the disk thread -----------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                held = self._held()
            if not self._writes.empty() and self.writes_wait_until > self._clock():
                held = WRITE_POLL_S if held is None else min(held, WRITE_POLL_S)
            if held != 0:
                self._work.wait(held)
            self._work.clear()
            while True:
                entry, read_back = self._next_read()
                if entry is not None:
                    t0 = time.monotonic()
                    try:
                        loaded = self._load(entry, stop=(lambda: bool(self._reads)) if read_back else None)
                    except Exception:  # every read ends with a result: a request waits for it
                        log.exception("prefix cache: reading %s failed", entry.name)
                        loaded = None
                    if loaded is STOPPED:
                        with self._lock:
                            # A request that asked for it while it was read
                            # back waits for it: back among the read-backs,
                            # it would wait for quiet (up to READ_WAIT_S
                            # under a flow of requests).
                            (self._reads if entry.name in self._asked else self._read_backs).appendleft(entry)
                        continue
                    took = time.monotonic() - t0
                    if loaded is not None:
                        loaded.check_s = took
                    self._results.put((entry, loaded))
                    self.wake()
                    continue
                if self.writes_wait_until > self._clock():
                    break
                try:
                    job = self._writes.get_nowait()
                except queue.Empty:
                    break
                *job, nbytes = job
                try:
                    self._store(*job)
                except Exception:
                    log.exception("prefix cache: writing a snapshot failed")
                finally:
                    with self._lock:
                        self._pending_bytes -= nbytes
                    self._writes.task_done()

    def _load(self, entry: DiskEntry, stop: Callable[[], bool] | None = None) -> Loaded | None:
        """Reads and checks an entry, its chunks on READ_THREADS threads (the
        read also brings the file into the page cache, where the main thread
        reads it next): None when it is bad (then removed) or gone; STOPPED
        when `stop` said so between chunks."""
        path = self.dir / entry.name
        try:
            # Every chunk is read from the file opened here: a file renamed
            # over this one meanwhile (another worker's write of the same
            # entry) would fail the checksums of the chunks read after it,
            # and be deleted, good as it is.
            with open_regular(path) as f:
                return self._checked(entry, path, f, stop)
        except FileNotFoundError:
            with self._lock:
                self._index.pop(entry.name, None)
            return None
        except (BadEntry, KeyError, TypeError, ValueError, RecursionError) as exc:
            self._discard(path, str(exc))
            return None
        except OSError as exc:
            log.warning("prefix cache: cannot read %s: %s", path, exc)
            return None

    def _checked(self, entry: DiskEntry, path: Path, f, stop: Callable[[], bool] | None) -> Loaded | object:
        """`_load`'s check of the open file `f`: Loaded, or STOPPED; raises
        BadEntry (and what a malformed header raises) when it is bad."""
        st = os.fstat(f.fileno())
        layout = checked_layout(f, st.st_size, entry.adapter, entry.tokens)

        def one(i: int) -> bool:
            if stop is not None and stop():
                return False
            check_chunk(f.fileno(), layout, i, read_buffer(layout.meta["chunk"]))
            return True

        if not all(self._io.map(one, range(len(layout.meta["crc32"])))):
            return STOPPED
        self._touch(entry)
        return Loaded(entry, path, layout.meta.get("tree"), layout.arrays, identity(st))

    def _store(self, name: str, adapter: str | None, tokens: np.ndarray, tree: object, arrays: list[mx.array]) -> None:
        """Writes a snapshot flattened by `write` (prefix_file.flatten)."""
        raw, segments = encode(tokens, arrays, adapter, tree, CHUNK, lambda parts: self._io.map(crc_of, parts))
        if LENGTH.size + len(raw) + sum(len(seg) for seg in segments) > self.budget:
            return
        path = self.dir / name
        tmp = path.with_name(f"{name}.{os.getpid()}.tmp")
        try:
            # The folder may have gone since the start: removed by hand, or
            # by a worker of another model (disk_files.drop_unused_beside)
            # that found only files unused for a month in it.
            self.dir.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(LENGTH.pack(len(raw)))
                f.write(raw)
                for seg in segments:
                    f.write(seg)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            log.warning("prefix cache: cannot write %s: %s", path, exc)
            return
        st = path.stat()
        with self._lock:
            self._index[name] = DiskEntry(name, adapter, np.asarray(tokens, dtype=np.int64), st.st_size, st.st_mtime)
        self._evict()

    def _evict(self) -> None:
        with self._lock:
            total = sum(e.size for e in self._index.values())
            gone = []
            count = len(self._index)
            for entry in sorted(self._index.values(), key=lambda e: e.used):
                if total <= self.budget and count <= MAX_FILES:
                    break
                if entry.name in self._reading:
                    continue
                total -= entry.size
                count -= 1
                gone.append(self._index.pop(entry.name))
        for entry in gone:
            with contextlib.suppress(OSError):
                (self.dir / entry.name).unlink(missing_ok=True)
            log.debug("prefix cache: %s evicted from disk (least recently used)", entry.name)
