"""The disk tier's files as the operating system sees them: the default
budget, files opened only when they are regular files, temporary files of
writers that died, a read buffer per I/O thread, and other models' folders
that nothing uses any more."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import shutil
import stat
import threading
import time
from pathlib import Path

from worker.cache.prefix_file import SUFFIX

log = logging.getLogger("worker")

# LM Studio's rule for its disk cache: at most 30 GiB, at most a quarter of
# the free space.
DEFAULT_CAP = 30 << 30


def default_budget(root: Path) -> int:
    """min(30 GiB, a quarter of the free space where the files go), the
    files already there counted as free: else each start would see less
    free space than the last, its own files taking it, and evict more."""
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        return 0
    return min(DEFAULT_CAP, (free + _bytes_under(root)) // 4)


def _bytes_under(root: Path) -> int:
    """Bytes of the files one level below each folder of `root` (a model's
    cache files); 0 where they cannot be listed."""
    total = 0
    try:
        with os.scandir(root) as entries:
            folders = [e for e in entries if e.is_dir(follow_symlinks=False)]
        for folder in folders:
            with os.scandir(folder.path) as files:
                total += sum(f.stat(follow_symlinks=False).st_size for f in files if f.is_file(follow_symlinks=False))
    except OSError:
        return total
    return total


def open_regular(path: Path, buffering: int = -1):
    """Opens a file to read; OSError when it is not a regular file: open()
    of a FIFO under a file's name would wait for a writer for ever (at a
    worker's start, or on the disk thread)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path.name} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb", buffering)


def writer_runs(name: str) -> bool:
    """Whether the process that a temporary file's name ("<entry>.<pid>.tmp",
    PrefixDisk._store's) names still runs."""
    pid = name.rsplit(".", 2)[-2]
    if not pid.isdecimal() or int(pid) <= 0:
        return False  # not a name PrefixDisk writes (0 and -1 would ask about groups)
    try:
        os.kill(int(pid), 0)
    except PermissionError:
        return True  # another user's
    except (OSError, OverflowError):
        return False
    return True


_buffers = threading.local()


def read_buffer(size: int) -> memoryview:
    """This I/O thread's read buffer, of at least `size` bytes: kept, so
    that a check does not fault in fresh memory for every chunk."""
    buf = getattr(_buffers, "buf", None)
    if buf is None or len(buf) < size:
        buf = _buffers.buf = memoryview(bytearray(size))
    return buf


def warm_read_buffer(size: int, together: threading.Barrier) -> None:
    """Makes this I/O thread's read buffer with its pages faulted in, then
    waits for the pool's other threads to do the same, so that each thread
    takes one of these calls. A fresh buffer's page faults came on a
    restarted worker's first check, on the request's time: on a 2-core
    Xeon VM a 4 MB buffer's took 5 ms, and the check of a 13 MB file took
    8 ms in each of three restarted workers with fresh buffers, 6 ms with
    these (`python -m bench.long_context --parts restart`, the tiny demo
    model)."""
    buf = read_buffer(size)
    buf[:: mmap.PAGESIZE] = bytes(len(range(0, len(buf), mmap.PAGESIZE)))
    try:
        together.wait()
    except threading.BrokenBarrierError:
        pass  # a thread of the pool was busy: it makes its buffer when it reads


# Files of other folders (another model, or this one before its weights or
# mlx changed) unused this long are removed when a worker starts.
UNUSED_S = 30 * 86400


def drop_unused_beside(own: Path) -> None:
    """Removes the files of the other folders beside a model's folder `own`
    (other models, or this model before its weights, format or mlx
    changed) that nothing has used for UNUSED_S, and the folders they leave
    empty: each worker bounds only its own folder, and a folder no worker
    serves any more would keep its files for ever. An empty folder goes only
    when nothing has changed in it for UNUSED_S either: a worker of another
    model starting beside this one has just made its own, still empty."""
    cutoff = time.time() - UNUSED_S
    try:
        with os.scandir(own.parent) as entries:
            folders = [e.path for e in entries if e.is_dir(follow_symlinks=False) and e.name != own.name]
    except OSError as exc:
        log.warning("prefix cache: cannot clear unused files beside %s: %s", own, exc)
        return
    removed = 0
    for folder in folders:
        try:
            removed += _drop_unused(folder, cutoff)
        except FileNotFoundError:
            continue  # removed meanwhile by another worker starting beside this one
        except OSError as exc:
            log.warning("prefix cache: cannot clear unused files in %s: %s", folder, exc)
    if removed:
        log.info("prefix cache: %d file(s) unused for %d days removed from other folders of %s", removed, UNUSED_S // 86400, own.parent)


def _drop_unused(folder: str, cutoff: float) -> int:
    """`drop_unused_beside` for one folder: how many files it removed."""
    idle = os.stat(folder, follow_symlinks=False).st_mtime < cutoff
    with os.scandir(folder) as entries:
        old = [e for e in entries if e.name.endswith((SUFFIX, ".tmp")) and e.is_file(follow_symlinks=False) and e.stat(follow_symlinks=False).st_mtime < cutoff]
    removed = 0
    for e in old:
        with contextlib.suppress(FileNotFoundError):  # another worker's removal of the same file
            os.unlink(e.path)
            removed += 1
    if old or idle:
        with contextlib.suppress(OSError):
            os.rmdir(folder)  # only when empty
    return removed


def fd_path(fd: int) -> str:
    """A path that opens the file behind this process's descriptor `fd`
    (Linux's /proc; /dev/fd on macOS)."""
    return f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else f"/dev/fd/{fd}"
