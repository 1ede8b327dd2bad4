"""The prefix cache's disk tier under what a shared, long-lived directory
meets: files that lie in their metadata or are not files at all, a second
worker of the same model, files removed behind a worker's back, reads that
cross each other, and a disk that hangs."""

import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import threading
import time

import numpy as np

from harness.engine import engine_for
from harness.prefix_files import SECOND, FileParts, disk_after_first, files, path_of, shortest_file, snapshot_layers
from harness.procs import wait_for
from ipc.messages import Generate


def disk_of(root, n: int = 1):
    """A disk tier over n sound files of 50 tokens each (the first at 0, the next at 1000, ...)."""
    from worker.cache.prefix_disk import PrefixDisk

    disk = PrefixDisk(root, "model", budget=1 << 30)
    for i in range(n):
        disk.write(None, np.arange(i * 1000, i * 1000 + 50), snapshot_layers(i, 50))
    assert disk.flush(30)
    return disk


def test_a_file_whose_adapter_key_is_not_a_string_is_dropped_and_the_worker_starts(tmp_path):
    """The adapter key is hashed into the file's name at every start: one
    that is a number, a list or a lone surrogate raised out of the tier's
    constructor, and every worker of the model failed to start."""
    from worker.cache.prefix_disk import PrefixDisk

    disk = disk_of(tmp_path)
    [sound] = files(tmp_path)
    raw = sound.read_bytes()
    hostile = []
    for i, adapter in enumerate((5, ["a"], "\ud800", True)):
        path = disk.dir / f"{i:040x}.lpx"
        path.write_bytes(FileParts.of(raw).made(adapter=adapter))
        hostile.append(path)
    again = PrefixDisk(tmp_path, "model", budget=1 << 30)
    assert list(again._index) == [sound.name]
    assert not any(p.exists() for p in hostile)


def unblock(fifo) -> None:
    """Opens a FIFO to write, so that a reader blocked opening it goes on
    (a test that fails must still end)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # no reader waits


def test_a_fifo_where_a_file_should_be_never_blocks_a_start_or_a_read(tmp_path):
    """open() of a FIFO waits for a writer: a worker that found one named
    like a file at its start never became ready (the supervisor's restarts
    hung alike), and one put in place of an indexed file hung the reader."""
    from worker.cache.prefix_disk import PrefixDisk

    disk = disk_of(tmp_path, 2)
    fifo = disk.dir / ("f" * 40 + ".lpx")
    os.mkfifo(fifo)
    made = []
    threading.Thread(target=lambda: made.append(PrefixDisk(tmp_path, "model", budget=1 << 30)), daemon=True).start()
    try:
        [again] = wait_for(lambda: made, timeout=20, message="the tier to start beside a FIFO")
    finally:
        unblock(fifo)
    assert len(again) == 2 and fifo.exists()  # the sound files serve; the FIFO is not ours to remove

    entry = min(again._index.values(), key=lambda e: int(e.tokens[0]))
    (again.dir / entry.name).unlink()
    os.mkfifo(again.dir / entry.name)
    got = []
    threading.Thread(target=lambda: got.append(again.load_now(entry)), daemon=True).start()
    try:
        assert wait_for(lambda: got, timeout=20, message="the read of a FIFO to end") == [None]
    finally:
        unblock(again.dir / entry.name)


def test_a_start_leaves_the_temporary_file_of_a_writer_that_still_runs(tmp_path, monkeypatch):
    """Two workers of one model share its directory (two pool entries of
    one path, or a pool restarted while the old worker still writes): a
    start removed every temporary file, so the other worker's write in
    progress failed and its snapshot was lost. Those of dead processes go."""
    from worker.cache import prefix_disk
    from worker.cache.prefix_disk import PrefixDisk

    writing, go = threading.Event(), threading.Event()

    class Held:
        """The file's length prefix, written once the temporary file is open: a write held in the middle."""

        size = struct.calcsize("<Q")

        def pack(self, n: int) -> bytes:
            writing.set()
            go.wait(30)
            return struct.pack("<Q", n)

    monkeypatch.setattr(prefix_disk, "LENGTH", Held())
    old = PrefixDisk(tmp_path, "model", budget=1 << 30)
    tokens = np.arange(50)
    old.write(None, tokens, snapshot_layers(0, 50))
    try:
        assert writing.wait(30)
        [tmp] = old.dir.glob("*.tmp")
        PrefixDisk(tmp_path, "model", budget=1 << 30)  # another worker of the model starts
        assert tmp.exists()
    finally:
        go.set()
    assert old.flush(30)
    assert path_of(old, tokens).exists() and len(old) == 1

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = [old.dir / f"{'0' * 40}.lpx.{gone.pid}.tmp", old.dir / "no-pid.tmp"]
    for path in stale:
        path.write_bytes(b"cut short")
    PrefixDisk(tmp_path, "model", budget=1 << 30)
    assert not any(path.exists() for path in stale)


def test_a_file_removed_behind_the_workers_back_leaves_its_index_and_is_written_again(tmp_path):
    """Another worker's eviction or a user clearing the directory removes a
    file this worker indexed: it kept counting it against the budget
    (evicting sound files early) and, the same snapshot made again, only
    touched the missing file, so it was never on disk again."""
    disk = disk_of(tmp_path, 2)
    tokens = np.arange(50)
    path = path_of(disk, tokens)
    path.unlink()
    disk.write(None, tokens, snapshot_layers(0, 50))  # the memory tier made it again
    assert disk.flush(30)
    assert path.exists() and len(disk) == 2
    assert disk.used == sum(p.stat().st_size for p in files(tmp_path))

    other = path_of(disk, np.arange(1000, 1050))
    other.unlink()
    disk.touch(None, np.arange(1000, 1050))  # a hit in memory
    assert len(disk) == 1 and disk.used == path.stat().st_size


def test_a_read_back_a_request_waits_for_is_not_put_back_behind_the_quiet_time(tmp_path, monkeypatch):
    """A request that needs a file being read back waits for that read; one
    read-back stopped for another request's file went back among the
    read-backs, after READ_BACK_QUIET_S of no request: under a steady flow
    of requests, the first one waited out READ_WAIT_S and ran cold."""
    from worker.cache.prefix_disk import READ_BACK_QUIET_S

    disk = disk_of(tmp_path, 2)
    back, other = sorted(disk._index.values(), key=lambda e: int(e.tokens[0]))
    now = [100.0]
    disk._clock = lambda: now[0]  # no quiet time passes but the test's
    started, go = threading.Event(), threading.Event()
    original = disk._load

    def load(entry, stop=None):
        if entry is back and not started.is_set():
            started.set()
            go.wait(30)  # the read-back has begun
        return original(entry, stop)

    monkeypatch.setattr(disk, "_load", load)
    assert disk.read(back, read_back=True)
    now[0] += READ_BACK_QUIET_S
    disk._work.set()
    try:
        assert started.wait(30)
        assert not disk.read(back)  # a request waits for it: already being read
        assert disk.read(other)  # another request's file: the read-back stops for it
    finally:
        go.set()
    wait_for(lambda: disk._results.qsize() == 2, timeout=10, message="both requests' files")
    assert sorted(e.name for e, loaded in disk.results() if loaded is not None) == sorted([back.name, other.name])


def test_a_request_waiting_for_a_hung_disk_gets_its_alarm_after_an_earlier_one_fired(tiny_model, tmp_path, monkeypatch):
    """One timer wakes the worker at the next deadline of a request waiting
    for the disk, and `_admit` sets the next one. The timer whose wake
    started that `_admit` is still alive while it runs, so no timer was set:
    with nothing else to do, the worker slept past the request's deadline
    until some other message came (for ever, on an idle worker)."""
    from worker.engine import scheduler as scheduler_module

    disk = disk_after_first(tiny_model, tmp_path)
    release = threading.Event()
    hung = disk._load
    monkeypatch.setattr(disk, "_load", lambda entry, stop=None: release.wait(60) and hung(entry, stop))
    fired, go = threading.Event(), threading.Event()
    wakes = []

    def wake():
        wakes.append(threading.current_thread().name)
        if len(wakes) == 1:
            fired.set()
            go.wait(30)  # the worker's loop takes the wake while the timer's thread still runs

    disk.wake = wake
    reader = engine_for(tiny_model, prefix_disk=disk)
    try:
        monkeypatch.setattr(scheduler_module, "READ_WAIT_S", 0.2)
        reader.submit(Generate(rid=1, prompt=SECOND, temperature=0.0, max_tokens=4), 0.0)
        monkeypatch.setattr(scheduler_module, "READ_WAIT_S", 2.0)
        reader.submit(Generate(rid=2, prompt=SECOND, temperature=0.0, max_tokens=4), 0.0)
        assert [bool(w.disk) for w in reader.waiting] == [True, True]
        reader.cancel(1)  # its alarm still comes
        assert fired.wait(30)
        reader.step()  # the worker's loop, woken
        assert len(reader.waiting) == 1 and not reader.has_work  # the loop sleeps until a wake
        go.set()
        wait_for(lambda: len(wakes) >= 2, timeout=20, message="a wake at the second request's deadline")
        reader.drain()
        done = json.loads(reader.lines[-1].splitlines()[-1][len(b"@@lattice ") :])
        assert done.get("done") and "cached_tokens" not in done
    finally:
        go.set()
        release.set()


def test_the_default_budget_counts_the_caches_own_files_as_free(tmp_path, monkeypatch):
    """A quarter of the free space, where the tier's files take part of it,
    shrank at every start, and each start evicted more."""
    import shutil

    from worker.cache import disk_files

    disk_of(tmp_path, 2)
    own = sum(p.stat().st_size for p in files(tmp_path))
    free = 1 << 30
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2 * free, free, free))
    assert disk_files.default_budget(tmp_path) == (free + own) // 4
    assert disk_files.default_budget(tmp_path / "nowhere") == free // 4


def test_a_file_that_cannot_be_removed_leaves_the_index_and_the_tier_goes_on(tmp_path, monkeypatch, caplog):
    """On a read-only folder a corrupt file's removal raised out of the
    tier's read (a warm prompt's load_now ran it on the main thread)."""
    from pathlib import Path

    disk = disk_of(tmp_path, 2)
    bad, good = sorted(files(tmp_path))
    bad.write_bytes(bad.read_bytes()[:-7])
    real_unlink = Path.unlink

    def refuse(self, missing_ok=False):
        if self == bad:
            raise PermissionError(13, "Read-only file system", str(self))
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse)
    entry = disk._index[bad.name]
    assert disk.load_now(entry) is None
    assert bad.name not in disk._index and good.name in disk._index and bad.exists()
    assert "cannot remove" in caplog.text


def test_after_files_skipped_in_a_row_one_is_read_to_time_the_disk_again():
    """A read rate measured in a slow spell left every later file unread,
    and with no read left to time, for the worker's life."""
    from worker.cache.disk_rates import PROBE_AFTER_SKIPS, RATE_SAMPLES, DiskRates

    rates = DiskRates()
    rates.read.add(1, 1)  # a byte a second
    rates.prefill.add(1e6, 1)
    asked = [rates.skip(10 << 20, 100) for _ in range(2 * PROBE_AFTER_SKIPS + 2)]
    read = [i for i, skipped in enumerate(asked) if not skipped]
    assert read == [PROBE_AFTER_SKIPS, 2 * PROBE_AFTER_SKIPS + 1]
    # A file faster to read than to compute is read, and starts the count afresh.
    for _ in range(3):
        assert rates.skip(10 << 20, 100)
    assert not rates.skip(0, 100)
    assert [rates.skip(10 << 20, 100) for _ in range(PROBE_AFTER_SKIPS + 1)] == [True] * PROBE_AFTER_SKIPS + [False]
    # A rate is the median of the latest timings; one that took no time is not one.
    for seconds in (1, 1, 1, 1, 1, 0, 0.5):
        rates.read.add(100, seconds)
    assert rates.read.value == 100 and len(rates.read._samples) == RATE_SAMPLES


_EXITING_WORKER = """
import os, sys, threading
from pathlib import Path
import numpy as np
from harness.prefix_files import snapshot_layers
from worker.cache.prefix_disk import PrefixDisk
from worker.shell.channel import EventChannel
from worker.shell.server import WorkerServer

disk = PrefixDisk(Path(sys.argv[1]), "model", budget=1 << 30)
store = disk._store
exiting = threading.Event()

def held(*job):
    exiting.wait()  # the write is still under way when the pipe closes
    store(*job)

def before_exit():
    exiting.set()
    disk.closing()

disk._store = held
r, w = os.pipe()
server = WorkerServer("m", EventChannel(os.dup(1)), request_fd=r)
server.before_exit = before_exit
disk.write(None, np.arange(50), snapshot_layers(0, 50))
os.close(w)
server.start_reader()
threading.Event().wait()  # the reader thread ends the process
"""


def test_a_worker_whose_pipe_closes_writes_its_queued_snapshots_first(tmp_path):
    """An unload or a pool restart closes the worker's pipe, and it exited
    at once: the snapshots still queued for the disk were lost."""
    root = tmp_path / "prefix"
    child = subprocess.run([sys.executable, "-c", _EXITING_WORKER, str(root)], capture_output=True, timeout=60)
    assert child.returncode == 0, child.stderr.decode()
    assert len(files(root)) == 1
    from worker.cache.prefix_disk import PrefixDisk

    assert len(PrefixDisk(root, "model", budget=1 << 30)._index) == 1


def test_snapshots_waiting_for_the_disk_are_bounded_in_bytes(tmp_path, caplog):
    """A queued snapshot keeps its arrays alive after the memory tier lets
    them go: 64 of an 8B model's 26k-token prompts would be 240 GB."""
    from worker.cache.prefix_disk import PrefixDisk

    gate = threading.Event()
    disk = PrefixDisk(tmp_path, "model", budget=1 << 30, max_pending_bytes=1)
    store = disk._store
    disk._store = lambda *job: (gate.wait(30), store(*job))
    for i in range(3):
        disk.write(None, np.arange(i * 1000, i * 1000 + 50), snapshot_layers(i, 50))
    assert "wait for the disk; a snapshot of 50 tokens is not written" in caplog.text
    gate.set()
    assert disk.flush(30) and len(files(tmp_path)) == 1 and disk._pending_bytes == 0
    # Once written, the next is taken again.
    disk.write(None, np.arange(5000, 5050), snapshot_layers(5, 50))
    assert disk.flush(30) and len(files(tmp_path)) == 2


def test_a_file_whose_arrays_have_other_shapes_than_the_models_is_refused(tiny_model, tmp_path, caplog):
    """A file passes its checksums with any shapes: one whose state arrays
    (or keys and values) are laid out in other dimensions, the bytes the
    same, joined a batch and failed every row of it. The worker learns its
    arrays' shapes from the warm-up's forward."""
    disk, entry, path, raw, parts = shortest_file(tiny_model, tmp_path)
    header, meta = parts.header, parts.meta
    engine = engine_for(tiny_model)
    engine.warm_up()
    cache = engine.prefix_cache

    def with_shape(name: str, shape: list) -> None:
        path.write_bytes(parts.made(tensors={**header, name: {**header[name], "shape": shape}}))

    # The first layer is a gated-delta one (its states), the fourth attention (keys).
    state = next(f"a{layer[0]}" for layer in meta["tree"] if isinstance(layer, list) and layer and layer[0] is not None)
    keys = next(f"a{layer['t'][0]}" for layer in meta["tree"] if isinstance(layer, dict) and isinstance(layer["t"][0], int))
    for name in (state, keys):
        shape = header[name]["shape"]
        turned = [*shape[:-3], shape[-1], shape[-2], shape[-3]] if name == state else [shape[0], shape[3], shape[2], shape[1]]
        assert turned != shape
        with_shape(name, turned)
        restored = disk.load_now(disk._index[entry.name]).layers()
        assert not cache.insert_read(None, entry.tokens, *restored)
        assert "holds arrays of shapes" in caplog.text
    assert len(cache) == 0
    path.write_bytes(raw)
    assert cache.insert_read(None, entry.tokens, *disk.load_now(disk._index[entry.name]).layers()) and len(cache) == 1


def test_files_no_worker_used_for_30_days_leave_the_other_folders_at_a_start(tmp_path):
    """Each worker bounds its own folder only: the folder of a model no
    longer served (or of this one before its weights or mlx changed) kept
    its files for ever."""
    from worker.cache.disk_files import UNUSED_S
    from worker.cache.prefix_disk import PrefixDisk

    for key, n in (("old-model", 1), ("other-model", 2)):
        other = PrefixDisk(tmp_path, key, budget=1 << 30)
        for i in range(n):
            other.write(None, np.arange(i * 1000, i * 1000 + 50), snapshot_layers(i, 50))
        assert other.flush(30)
    (stale,) = files(tmp_path / "old-model")
    aged, recent = files(tmp_path / "other-model")
    long_ago = time.time() - UNUSED_S - 3600
    for path in (stale, aged):
        os.utime(path, (long_ago, long_ago))
    PrefixDisk(tmp_path, "model", budget=1 << 30)
    assert not (tmp_path / "old-model").exists()
    assert files(tmp_path / "other-model") == [recent]


def test_a_folder_another_model_has_just_made_stays_and_a_long_idle_empty_one_goes(tmp_path, caplog):
    """Two models' workers starting together: the second removed the
    first's folder, just made and still empty, and every write of the first
    then failed for want of it."""
    from worker.cache.disk_files import UNUSED_S
    from worker.cache.prefix_disk import PrefixDisk

    first = PrefixDisk(tmp_path, "first-model", budget=1 << 30)
    (tmp_path / "left-model").mkdir()
    long_ago = time.time() - UNUSED_S - 3600
    os.utime(tmp_path / "left-model", (long_ago, long_ago))
    PrefixDisk(tmp_path, "second-model", budget=1 << 30)
    assert (tmp_path / "first-model").is_dir() and not (tmp_path / "left-model").exists()
    with caplog.at_level(logging.WARNING):
        first.write(None, np.arange(50), snapshot_layers(0, 50))
        assert first.flush(30)
    assert len(files(tmp_path / "first-model")) == 1 and "cannot write" not in caplog.text


def test_a_folder_gone_while_the_others_are_cleared_is_passed_over(tmp_path, monkeypatch, caplog):
    """Workers of two models starting together clear the same folders: one
    that the other worker removed first used to end the clearing, with a
    warning, before the folders after it."""
    from worker.cache import disk_files

    long_ago = time.time() - disk_files.UNUSED_S - 3600
    for name in ("gone-model", "old-model"):
        (tmp_path / name).mkdir()
        stale = tmp_path / name / f"x{disk_files.SUFFIX}"
        stale.write_bytes(b"x")
        os.utime(stale, (long_ago, long_ago))
    clear = disk_files._drop_unused

    def removed_first(folder: str, cutoff: float) -> int:
        if folder.endswith("gone-model"):
            shutil.rmtree(folder)
        return clear(folder, cutoff)

    monkeypatch.setattr(disk_files, "_drop_unused", removed_first)
    (tmp_path / "model").mkdir()
    with caplog.at_level(logging.INFO):
        disk_files.drop_unused_beside(tmp_path / "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert "cannot clear" not in caplog.text and "1 file(s) unused" in caplog.text


def test_a_write_makes_its_folder_again_when_it_has_gone(tmp_path, caplog):
    from worker.cache.prefix_disk import PrefixDisk

    disk = PrefixDisk(tmp_path, "model", budget=1 << 30)
    shutil.rmtree(tmp_path / "model")
    with caplog.at_level(logging.WARNING):
        disk.write(None, np.arange(50), snapshot_layers(0, 50))
        assert disk.flush(30)
    assert len(files(tmp_path / "model")) == 1 and "cannot write" not in caplog.text


def test_the_files_of_a_model_are_bounded_in_number_as_well_as_bytes(tmp_path, monkeypatch):
    """The index holds every file's token ids and a request's lookup reads
    them all: small files under a large byte budget grew it without bound."""
    from worker.cache import prefix_disk

    monkeypatch.setattr(prefix_disk, "MAX_FILES", 3)
    disk = disk_of(tmp_path, 5)
    assert len(disk._index) == 3 == len(files(tmp_path))
    assert sorted(int(e.tokens[0]) for e in disk._index.values()) == [2000, 3000, 4000]


def test_a_tier_that_finds_files_makes_its_read_threads_buffers_before_any_read(tmp_path):
    """A restarted worker's first check made the buffers its threads read
    into, and faulted their pages in on the request's time; now a tier that
    starts with files makes them at once (one without files does not)."""
    from worker.cache import prefix_disk
    from worker.cache.disk_files import read_buffer

    def buffer_sizes(disk) -> list[int]:
        together = threading.Barrier(prefix_disk.READ_THREADS, timeout=30)

        def size() -> int:  # one call a thread, as the warm-up's
            n = len(read_buffer(0))
            together.wait()
            return n

        return [f.result(60) for f in [disk._io.submit(size) for _ in range(prefix_disk.READ_THREADS)]]

    assert buffer_sizes(prefix_disk.PrefixDisk(tmp_path / "empty", "model", budget=1 << 30)) == [0] * prefix_disk.READ_THREADS
    disk_of(tmp_path, 1)
    disk = prefix_disk.PrefixDisk(tmp_path, "model", budget=1 << 30)
    assert buffer_sizes(disk) == [prefix_disk.CHUNK] * prefix_disk.READ_THREADS


_SWAPPED_FOR_A_FIFO = """
import os, sys
from pathlib import Path
from worker.cache.prefix_disk import PrefixDisk

disk = PrefixDisk(Path(sys.argv[1]), sys.argv[2], budget=1 << 30)
entry = min(disk._index.values(), key=lambda e: len(e.tokens))
loaded = disk.load_now(entry)
path = disk.dir / entry.name
path.unlink()
os.mkfifo(path)
print(loaded.layers())
"""


def test_a_fifo_put_under_a_files_name_after_its_check_does_not_block_mlxs_read(tiny_model, tmp_path):
    """mlx reads a checked file on the main thread: a FIFO put under its
    name between the check and that read blocked the worker for ever, its
    heartbeat thread too (mx.load waits in open() holding the GIL). In a
    child process, which the test can stop."""
    disk = disk_after_first(tiny_model, tmp_path)
    try:
        child = subprocess.run([sys.executable, "-c", _SWAPPED_FOR_A_FIFO, str(tmp_path), disk.dir.name], capture_output=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError("mlx's read of the file waited on the FIFO") from None
    assert child.returncode == 0 and child.stdout.strip() == b"None", child.stderr.decode()[-2000:]


def test_a_file_renamed_over_the_one_being_checked_is_neither_failed_nor_deleted(tmp_path, monkeypatch):
    """Each chunk of a check opened the file by its name again: another
    worker's write of the same entry, renamed over it mid-check, failed the
    checksums of the chunks read after it, and its good file was deleted."""
    from worker.cache import prefix_disk

    monkeypatch.setattr(prefix_disk, "CHUNK", 256)  # many chunks
    monkeypatch.setattr(prefix_disk, "READ_THREADS", 1)  # read in order
    tokens = np.arange(50)
    disks = []
    for seed, root in enumerate((tmp_path / "mine", tmp_path / "theirs")):
        disk = prefix_disk.PrefixDisk(root, "model", budget=1 << 30)
        disk.write(None, tokens, snapshot_layers(seed, 50))
        assert disk.flush(30)
        disks.append(disk)
    mine, theirs = disks
    [entry] = mine._index.values()
    [path], [other] = files(tmp_path / "mine"), files(tmp_path / "theirs")
    assert path.read_bytes() != other.read_bytes()
    calls = []

    def renamed_over_after_the_first_chunk() -> bool:
        calls.append(1)
        if len(calls) == 2:
            os.replace(other, path)
        return False

    loaded = mine._load(entry, renamed_over_after_the_first_chunk)
    assert len(calls) > 2 and isinstance(loaded, prefix_disk.Loaded)
    assert path.exists() and entry.name in mine._index
