"""Ties the worker's life to its supervisor's, on every platform.

Layers: stdin EOF (handled by the frame reader) everywhere; on Linux
PR_SET_PDEATHSIG, which the kernel delivers when the parent dies; on macOS a
kqueue NOTE_EXIT watch on the parent. The ppid check closes the race where
the parent died before the watch was armed.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import sys
import threading

log = logging.getLogger("worker")

PR_SET_PDEATHSIG = 1


def bind_to_parent(expected_ppid: int | None) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    elif sys.platform == "darwin":
        threading.Thread(target=_watch_parent_kqueue, args=(os.getppid(),), name="parent-watch", daemon=True).start()
    if expected_ppid is not None and os.getppid() != expected_ppid:
        log.error("supervisor %d is gone before start-up finished; exiting", expected_ppid)
        os._exit(0)


def _watch_parent_kqueue(ppid: int) -> None:
    kq = select.kqueue()
    event = select.kevent(ppid, filter=select.KQ_FILTER_PROC, flags=select.KQ_EV_ADD, fflags=select.KQ_NOTE_EXIT)
    try:
        kq.control([event], 0)
    except ProcessLookupError:
        os._exit(0)
    kq.control(None, 1)
    os._exit(0)
