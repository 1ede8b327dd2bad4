"""The terminal front ends: `lattice-pool run --prompt` here and `chat`
(supervisor.chat), where a person, not a program, reads the pool's lines:
tokens as text on stdout, load progress, errors and stats on stderr, all
through one Screen (supervisor.screen). Both run the serve lifecycle
(supervisor.lifecycle.RunningPool) with an EventSink as the pool's output."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from collections.abc import Callable

import msgspec

from ipc.worker_events import FATAL_PREFIX, LIFECYCLE, parse_event
from supervisor import stderr
from supervisor.config import Config
from supervisor.httpapi.reasoning import ThinkSplitter
from supervisor.lifecycle import SIGNALS, RunningPool, first_set
from supervisor.requests import ClientLine
from supervisor.screen import Screen
from supervisor.stdout import Tapped


class EventSink(Tapped):
    """Takes the place of Output: parses each line and hands it to `on_event`."""

    def __init__(self, on_event: Callable[[dict, bytes], None]):
        super().__init__()
        self.on_event = on_event
        self.paused = False

    def on_pause(self, listener) -> None:
        # A person reads slower than workers write, but text is tiny: never pause.
        pass

    def take(self, data: bytes) -> None:
        try:
            for line in data.splitlines(keepends=True):
                if line.startswith(b"@@lattice "):
                    self.on_event(parse_event(line), line)
        except BrokenPipeError:
            # The reader went away (`| head`): stop, and let the interpreter's
            # final flush write to /dev/null instead of raising again.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            self.closed.set()

    async def drain(self) -> None:
        """Lines are handed on as they come: nothing waits."""

    def close(self) -> None:
        self.closed.set()


class LoadProgress:
    """A one-line progress bar on a terminal, one line per model otherwise."""

    def __init__(self, screen: Screen):
        self.screen = screen
        self._shown: set[str] = set()

    def update(self, event: dict) -> None:
        name = event.get("model", "?")
        total = event.get("bytes_total")
        if event["ev"] == "loading" and total:
            done = event.get("bytes_loaded", 0)
            if self.screen.err_tty:
                filled = int(30 * done / total)
                self.screen.bar(f"loading {name} [{'#' * filled}{'.' * (30 - filled)}] {100 * done // total:3d}% of {total / 1e6:.1f} MB")
            elif name not in self._shown:
                self._shown.add(name)
                self.screen.note(f"loading {name} ({total / 1e6:.1f} MB)")
        elif event["ev"] == "ready":
            self.screen.end_bar()
            self.screen.note(f"{name} ready ({event.get('format')}, loaded in {event.get('load_ms', 0) / 1000:.1f}s)")
        elif event["ev"] in ("failed", "adapter_error"):
            self.screen.end_bar()


# How a reply's thinking is shown: "on" apart from the answer (dimmed on a
# terminal, between Ollama's "Thinking..." and "...done thinking."),
# "hidden" not at all, "off": the model is asked not to think (a reasoning
# budget of 0 closes its think block at once).
THINK_MODES = ("on", "off", "hidden")
DIM, RESET = "\033[2m", "\033[0m"


class ReplyText:
    """One templated reply for a person: its thinking (text inside
    <think>...</think>, supervisor.httpapi.reasoning) shown apart or left
    out, then the answer. `answer` collects the answer's text."""

    def __init__(self, write: Callable[[str], None], opens_think: bool, show_thinking: bool, tty: bool):
        self.write = write
        self.splitter = ThinkSplitter(opens_think)
        self.show_thinking = show_thinking
        self.tty = tty
        self.thinking = False  # the thinking header is shown, its footer not yet
        self.answer: list[str] = []

    def _dim(self, text: str) -> str:
        # Each piece closes its own dimming: a reply cut short never leaves
        # the terminal dim.
        return f"{DIM}{text}{RESET}" if self.tty and text else text

    def feed(self, text: str) -> None:
        self._show(self.splitter.feed(text))

    def finish(self) -> None:
        self._show(self.splitter.flush())
        self._end_thinking()

    def _end_thinking(self) -> None:
        if self.thinking:
            self.thinking = False
            self.write(self._dim("\n...done thinking.") + "\n\n")

    def _show(self, pieces: list[tuple[bool, str]]) -> None:
        for reasoning, text in pieces:
            if reasoning:
                if self.show_thinking:
                    if not self.thinking:
                        self.thinking = True
                        self.write(self._dim("Thinking...") + "\n")
                        text = text.lstrip("\n")
                    self.write(self._dim(text))
                continue
            self._end_thinking()
            if not self.answer:
                text = text.lstrip("\n")
            if text:
                self.answer.append(text)
                self.write(text)


def stats_line(done: dict) -> str:
    return (
        f"[{done['prompt_tokens']} prompt tokens, {done['gen_tokens']} generated in {done['total_ms']} ms, "
        f"{done['tok_s']:.1f} tok/s, ttft {done['ttft_ms']:.1f} ms, {done.get('finish_reason', '?')}]"
    )


# How the pool quotes the one-line cause a worker gave for exit code 78
# (worker/__main__.py `fatal`, quoted as "last stderr" by supervisor.slot).
_WORKER_CAUSE = re.compile(rf"\blast stderr: {re.escape(FATAL_PREFIX)}(.*)\)$")


def cause(reason: str) -> str:
    """A failure's cause as a person reads it: the worker's own one line
    when it said why it could not start, else the pool's reason."""
    match = _WORKER_CAUSE.search(reason)
    return match.group(1) if match else reason


def readable(msg: str) -> str:
    """An error message with the cause it quotes shortened (see cause):
    "model 'x' failed: bad model dir: ...", the cause said once."""
    head, _, rest = msg.partition(": ")
    short = cause(rest)
    return msg if short is rest else f"{head}: {short}"


def error_line(event: dict) -> str:
    return f"error ({event.get('code')}): {readable(event.get('msg', ''))}"


async def run_once(request: ClientLine, *, as_json: bool, think: str | None, local: Callable[[], Config], attach=None) -> int:
    """One request, on the running pool `attach` names when one answers
    there (supervisor.attach), else on a pool of our own from `local()`.
    think (THINK_MODES): the request is templated, and its reply's
    thinking is shown so; None: the text is printed as it comes (a
    verbatim --prompt, chat_metal's meaning)."""
    finished = asyncio.Event()
    interrupted = asyncio.Event()
    outcome = {"rc": 0}
    screen = Screen()
    progress = LoadProgress(screen)
    out = sys.stdout.buffer
    reply: list[ReplyText] = []
    opens_think = [False]
    model: list[str | None] = [None]  # the name whose lifecycle lines are ours
    load_id = f"run-load-{os.getpid()}"

    def on_event(event: dict, line: bytes) -> None:
        ev = event["ev"]
        if ev in LIFECYCLE and model[0] is not None and event.get("model") != model[0]:
            return  # another model of a shared pool
        if ev == "error" and event.get("id") == load_id:
            return  # the request's own error says it again
        if ev == "ready":
            opens_think[0] = bool(event.get("opens_think"))
        if as_json:
            out.write(line)
            out.flush()
        elif ev == "gen_token" and not event["done"]:
            if think is None:
                screen.reply(event["token"])
                return
            if not reply:
                reply.append(ReplyText(screen.reply, opens_think[0], think == "on", sys.stdout.isatty()))
            reply[0].feed(event["token"])
        elif ev in ("loading", "ready", "failed"):
            progress.update(event)
        if ev == "error" or (ev == "gen_token" and event["done"]):
            if ev == "error":
                outcome["rc"] = 1
                if not as_json:
                    # The request's error carries the cause of a failed
                    # model too: one line, not one per event.
                    screen.note(error_line(event))
            elif not as_json:
                if reply:
                    reply[0].finish()
                screen.reply("\n")
                screen.note(stats_line(event))
            finished.set()

    sink = EventSink(on_event)
    loop = asyncio.get_running_loop()
    with stderr.routed(screen.log):
        link = None
        if attach is not None:
            from supervisor.attach import RemoteLink  # a pool's client, not a pool

            link = await RemoteLink.connect(attach.path, sink, attach.ref)
        if link is not None:
            link.lora = attach.lora
            model[0] = link.default
            # A request on a shared pool needs an id of its own.
            request = msgspec.structs.replace(request, id=f"run-{os.getpid()}")
            link.send({"op": "load", "id": load_id, "model": link.default, "lora": link.lora})
            link.submit(request, sink)
            stopped = link.stopped
            for sig in SIGNALS:
                loop.add_signal_handler(sig, interrupted.set)
        else:
            running = await RunningPool.start(local(), sink, monitor=False)
            running.on_signals(interrupted.set)
            running.pool.submit(request)
            stopped = running.pool.shutdown_requested
        try:
            await first_set(interrupted, finished, sink.closed, stopped)
            if interrupted.is_set() and not finished.is_set():
                outcome["rc"] = 130
            elif stopped.is_set() and not finished.is_set():
                outcome["rc"] = 1
                if link is not None and stopped.is_set():
                    screen.note(f"the pool at {attach.path} stopped before the reply ended")
        finally:
            if link is not None:
                for sig in SIGNALS:
                    loop.remove_signal_handler(sig)
                await link.close()  # the pool cancels the request if it still runs
            else:
                await running.stop(0)
    return outcome["rc"]
