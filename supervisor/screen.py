"""A person's terminal, shared by four writers: the reply text (stdout), the
load progress bar and notes (stderr), the prompt (prompt_toolkit) and log
records (the stderr thread, supervisor.stderr). Screen is the one place
they all write through, so that no line lands inside another: a log record
clears the progress bar and draws it again below itself, waits while a reply
is half-written, and goes above the prompt while one is shown.

All of that matters only when stdout and stderr are one terminal; otherwise
each stream is written as it comes.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import TextIO

# Log bytes held back while a reply is half-written; past this they are
# dropped and counted, so a flood of records cannot grow our memory.
MAX_HELD = 1024 * 1024
CLEAR_LINE = "\r\033[K"


class Screen:
    def __init__(self, out: TextIO = sys.stdout, err: TextIO = sys.stderr):
        self.out = out
        self.err = err
        self.err_tty = err.isatty()
        # One terminal for both: the only case where writers can collide.
        self.shared = self.err_tty and out.isatty()
        self._lock = threading.RLock()
        self._bar: str | None = None  # the progress line now shown on stderr
        self._midline = False  # reply text written without its newline yet
        self._held: list[str] = []
        self._held_bytes = 0
        self._dropped = 0
        self._prompt_loop: asyncio.AbstractEventLoop | None = None

    # -- the event loop's writers ------------------------------------------------

    def reply(self, text: str) -> None:
        """Reply text on stdout; held log records follow its newline."""
        if not text:
            return
        with self._lock:
            # As UTF-8 bytes whatever the locale says, as chat_metal wrote them.
            buffer = getattr(self.out, "buffer", None)
            if buffer is not None:
                self.out.flush()
                buffer.write(text.encode("utf-8"))
                buffer.flush()
            else:
                self.out.write(text)
                self.out.flush()
            if self.shared:
                self._midline = not text.endswith("\n")
                if not self._midline:
                    self._flush_held()

    def note(self, line: str) -> None:
        """One line for the person on stderr (a failure, a hint, stats),
        starting on a line of its own (above the prompt, while one is shown)."""
        line = line if line.endswith("\n") else line + "\n"
        with self._lock:
            if self._prompt_loop is not None:
                self._above_prompt(line)
                return
            if self.shared and self._midline:
                self.out.write("\n")
                self.out.flush()
                self._midline = False
            self._write_err(line)
            self._flush_held()

    def bar(self, text: str) -> None:
        """Shows (or updates) the one-line progress bar."""
        with self._lock:
            self._bar = text
            self.err.write("\r" + text)
            self.err.flush()

    def end_bar(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar = None
                self.err.write(CLEAR_LINE)
                self.err.flush()

    # -- the prompt ----------------------------------------------------------------

    def prompting(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """While a prompt is shown (loop given), log records go above it."""
        with self._lock:
            self._prompt_loop = loop
            if loop is None:
                self._flush_held()

    # -- log records, from the stderr thread ------------------------------------------

    def log(self, data: bytes) -> None:
        text = data.decode("utf-8", "replace")
        with self._lock:
            if self._prompt_loop is not None:
                self._prompt_loop.call_soon_threadsafe(self._above_prompt, text)
            elif self.shared and self._midline:
                self._hold(text)
            else:
                self._write_err(text)

    def _above_prompt(self, text: str) -> None:
        """On the event loop: `text` above the prompt, if one is still shown."""
        from prompt_toolkit.application import get_app_or_none, run_in_terminal

        with self._lock:
            if self._prompt_loop is None or get_app_or_none() is None:
                self._write_err(text)
                return
        # Hides the prompt, writes, draws the prompt again.
        run_in_terminal(lambda: self._write_err(text), in_executor=False)

    def _hold(self, text: str) -> None:
        if self._held_bytes + len(text) > MAX_HELD:
            self._dropped += 1
            return
        self._held.append(text)
        self._held_bytes += len(text)

    def _flush_held(self) -> None:
        if self._dropped:
            self._held.append(f"[lattice-pool: {self._dropped} log writes dropped while a reply was shown]\n")
            self._dropped = 0
        if self._held:
            held, self._held, self._held_bytes = self._held, [], 0
            self._write_err("".join(held))

    def _write_err(self, text: str) -> None:
        """Writes whole lines on stderr, clear of the progress bar, which is
        drawn again below them."""
        if self._bar is not None and self.err_tty:
            self.err.write(CLEAR_LINE + text + ("" if text.endswith("\n") else "\n") + "\r" + self._bar)
        else:
            self.err.write(text)
        self.err.flush()
