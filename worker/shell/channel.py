"""The worker's event channel: the only writer of `@@lattice` lines.

At start-up the original stdout fd is kept for events and fd 1 is pointed at
stderr, so a library that prints (Python or C) can never corrupt the stream.
"""

from __future__ import annotations

import os
import sys
import threading


class EventChannel:
    def __init__(self, fd: int):
        self._fd = fd
        self._lock = threading.Lock()

    @classmethod
    def take_stdout(cls) -> EventChannel:
        sys.stdout.flush()
        events = os.dup(1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        return cls(events)

    def write(self, line: bytes) -> None:
        """Writes whole lines; a second thread's line never lands inside one.

        A closed pipe means the supervisor is gone: nobody is left to serve.
        """
        with self._lock:
            view = memoryview(line)
            try:
                while view:
                    view = view[os.write(self._fd, view) :]
            except (BrokenPipeError, OSError):
                os._exit(0)
