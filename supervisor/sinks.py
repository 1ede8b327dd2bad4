"""Where the pool's lines go when a person, not a program, is reading:
`lattice-pool run` and `chat` render tokens as text, progress on stderr."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Callable, TextIO


class EventSink:
    """Takes the place of Output: parses each line and hands it to `on_event`."""

    def __init__(self, on_event: Callable[[dict, bytes], None]):
        self.on_event = on_event
        self.closed = asyncio.Event()
        self.paused = False

    def on_pause(self, listener) -> None:
        # A person reads slower than workers write, but text is tiny: never pause.
        pass

    def write(self, data: bytes) -> None:
        if self.closed.is_set():
            return
        try:
            for line in data.splitlines(keepends=True):
                if line.startswith(b"@@lattice "):
                    self.on_event(json.loads(line[10:]), line)
        except BrokenPipeError:
            # The reader went away (`| head`): stop, and let the interpreter's
            # final flush write to /dev/null instead of raising again.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            self.closed.set()


class LoadProgress:
    """A one-line progress bar on a terminal, one line per model otherwise."""

    def __init__(self, stream: TextIO = sys.stderr):
        self.stream = stream
        self.tty = stream.isatty()
        self._shown: set[str] = set()

    def update(self, event: dict) -> None:
        name = event.get("model", "?")
        total = event.get("bytes_total")
        if event["ev"] == "loading" and total:
            done = event.get("bytes_loaded", 0)
            if self.tty:
                filled = int(30 * done / total)
                self.stream.write(f"\rloading {name} [{'#' * filled}{'.' * (30 - filled)}] {100 * done // total:3d}% of {total / 1e6:.1f} MB")
                self.stream.flush()
            elif name not in self._shown:
                self._shown.add(name)
                self.stream.write(f"loading {name} ({total / 1e6:.1f} MB)\n")
        elif event["ev"] == "ready":
            if self.tty:
                self.stream.write("\r\033[K")
            self.stream.write(f"{name} ready ({event.get('format')}, loaded in {event.get('load_ms', 0) / 1000:.1f}s)\n")
            self.stream.flush()


def stats_line(done: dict) -> str:
    return (
        f"[{done['prompt_tokens']} prompt tokens, {done['gen_tokens']} generated in {done['total_ms']} ms, "
        f"{done['tok_s']:.1f} tok/s, ttft {done['ttft_ms']:.1f} ms, {done.get('finish_reason', '?')}]"
    )
