"""`lattice-pool chat`: a REPL on the serve lifecycle, as `ollama run` and
`mlx_lm.chat` have taught people to expect.

On a terminal the input is prompt_toolkit's (line editing, history kept in
~/.lattice/chat_history, bracketed paste: a pasted block is one message);
otherwise each stdin line is one message, for scripts. Both understand the
/commands (HELP) and `\"\"\"` multi-line messages. Ctrl-C stops a reply or
clears the line and never quits; Ctrl-D (or /bye) quits. Each turn sends the
whole history as `messages`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from ipc import sampling
from ipc.messages import Message
from supervisor import stderr
from supervisor.attach import PoolLink, RemoteLink
from supervisor.config import Config
from supervisor.lifecycle import RunningPool, first_set
from supervisor.requests import ClientLine
from supervisor.resolve import UnknownModel
from supervisor.screen import Screen
from supervisor.terminal import THINK_MODES, EventSink, LoadProgress, ReplyText, cause, error_line, stats_line

# Sampling settings `/set` changes: a request's fields, with their bounds
# and defaults (shown by `/set` for a knob left unset).
KNOBS = sampling.NAMES
HISTORY_LIMIT = 1000
MULTILINE = '"""'

HELP = f"""\
  /help, /?              this help
  /bye, /exit, /quit     quit (Ctrl-D too)
  /clear                 forget the conversation (the system prompt stays)
  /load [NAME]           load the model again (after a failure: retry); with NAME, switch to it
  /model [NAME]          switch to model NAME (the conversation stays); alone: which model
  /unload                unload the model; the next message loads it again
  /set                   show the sampling settings
  /set KNOB VALUE        {", ".join(KNOBS)}; VALUE `default` resets it
  /set system [TEXT]     set (or, alone, remove) the system prompt
  /set think on|off|hidden  show the model's thinking apart (on), ask it not to think (off), or think unseen (hidden)
  {MULTILINE} ... {MULTILINE}          a message of several lines (pasting several lines works too)
  Ctrl-C stops a reply or clears the line; it never quits."""


def history_path() -> Path:
    return Path.home() / ".lattice" / "chat_history"


def make_history(path: Path, limit: int = HISTORY_LIMIT):
    """prompt_toolkit's history in a file of one JSON string a line, mode
    0600 (a chat is private), the last `limit` entries kept: the file is
    rewritten once it holds twice that. A file that cannot be read or
    written leaves the session with its own history only."""
    from prompt_toolkit.history import History

    class ChatHistory(History):
        def load_history_strings(self):
            try:
                lines = path.read_text("utf-8").splitlines()
            except OSError:
                return []
            entries = []
            for line in lines[-limit:]:
                try:
                    entries.append(json.loads(line))
                except ValueError:
                    continue
            return [e for e in reversed(entries) if isinstance(e, str)]

        def store_string(self, string: str) -> None:
            try:
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                with os.fdopen(fd, "a", encoding="utf-8") as f:
                    f.write(json.dumps(string) + "\n")
                lines = path.read_text("utf-8").splitlines()
                if len(lines) > 2 * limit:
                    tmp = path.with_name(path.name + ".tmp")
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    with os.fdopen(fd, "w", encoding="utf-8") as f:
                        f.write("\n".join(lines[-limit:]) + "\n")
                    os.replace(tmp, path)
            except OSError:
                pass

    return ChatHistory()


class Cleared(Exception):
    """Ctrl-C at the prompt: the line (or the multi-line message) is dropped."""


class PromptInput:
    """A terminal: prompt_toolkit, whose raw mode makes Ctrl-C a key."""

    def __init__(self, screen: Screen):
        from prompt_toolkit import PromptSession

        self.screen = screen
        self.session = PromptSession(history=make_history(history_path()))

    async def read(self, prompt: str) -> str | None:
        self.screen.prompting(asyncio.get_running_loop())
        try:
            # Our own SIGINT handler stays: it stops replies (no raw mode then).
            return await self.session.prompt_async(prompt, handle_sigint=False)
        except KeyboardInterrupt:
            raise Cleared() from None
        except EOFError:
            return None
        finally:
            self.screen.prompting(None)


class LineInput:
    """Anything else: one line at a time from a reader thread (a blocking
    read must not hold the event loop); no prompt unless stdin is a terminal."""

    def __init__(self, screen: Screen):
        self.screen = screen
        self.show_prompt = sys.stdin.isatty()
        self.lines: asyncio.Queue[str | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def read_lines() -> None:
            for text in sys.stdin:
                loop.call_soon_threadsafe(self.lines.put_nowait, text.rstrip("\n"))
            loop.call_soon_threadsafe(self.lines.put_nowait, None)

        threading.Thread(target=read_lines, name="chat-input", daemon=True).start()

    async def read(self, prompt: str) -> str | None:
        if self.show_prompt:
            self.screen.reply(prompt)
        return await self.lines.get()


async def read_message(source) -> str | None:
    """One message or command; None at end of input. A message between
    triple quotes may span lines, as in `ollama run`."""
    line = await source.read(">>> ")
    if line is None or not line.lstrip().startswith(MULTILINE):
        return line
    rest = line.lstrip()[len(MULTILINE) :]
    parts = []
    while not rest.rstrip().endswith(MULTILINE):
        parts.append(rest)
        rest = await source.read("... ")
        if rest is None:
            break
    else:
        parts.append(rest.rstrip()[: -len(MULTILINE)])
    return "\n".join(parts).strip()


class Chat:
    def __init__(self, args: argparse.Namespace, screen: Screen):
        self.args = args
        self.screen = screen
        self.progress = LoadProgress(screen)
        self.model: str | None = None
        self.knobs = {k: getattr(args, k, None) for k in KNOBS}
        self.stop = getattr(args, "stop", None)
        self.system = args.system
        self.history: list[Message] = []
        self.ids = itertools.count(1)
        self.reply: list[str] = []
        self.think = getattr(args, "think", None) or "on"
        self.shown: ReplyText | None = None  # the reply being shown
        # Whether a reply of each model starts inside <think> (its ready line says).
        self.opens_think: dict[str, bool] = {}
        self.current: ClientLine | None = None  # the request being answered
        self.turn_done = asyncio.Event()
        # A wait for one of `events` of model `name` (a load, an unload).
        self.awaited: tuple[str, frozenset[str]] | None = None
        self.awaited_event = asyncio.Event()
        self.outcome: str | None = None  # the event that ended it
        self.interrupted = asyncio.Event()
        self.quit = asyncio.Event()
        self.quitting = False
        self.sink = EventSink(self.on_event)
        self.link: PoolLink | RemoteLink | None = None
        # The adapter error last shown for each model: a message that tries
        # the name again gets the same one, which is not said again.
        self.adapter_errors: dict[str, str] = {}

    # -- the pool's lines ------------------------------------------------------------

    def on_event(self, event: dict, line: bytes) -> None:
        ev = event["ev"]
        if ev in ("loading", "ready", "failed", "adapter_error"):
            self.progress.update(event)
        if ev in ("ready", "adapter_loaded"):
            self.adapter_errors.pop(event.get("model"), None)
        if ev == "ready":
            self.opens_think[event.get("model")] = bool(event.get("opens_think"))
        if ev == "gen_token" and self.answers(event):
            self.on_token(event)
        elif ev == "error":
            self.on_error(event)
        elif ev in ("failed", "restarting", "unloaded", "adapter_error") and not self.quitting:
            self.on_model_change(event)
        if self.awaited is not None and event.get("model") == self.awaited[0] and ev in self.awaited[1]:
            self.end_wait(ev)

    def on_token(self, event: dict) -> None:
        if event["done"]:
            if self.shown is not None:
                self.shown.finish()
            self.screen.reply("\n")
            if self.args.verbose:
                self.screen.note(stats_line(event))
            self.turn_done.set()
        else:
            self.reply.append(event["token"])
            if self.shown is None:
                self.shown = ReplyText(self.screen.reply, self.opens_think.get(self.model_name(), False), self.think == "on", self.screen.out.isatty())
            self.shown.feed(event["token"])

    def model_name(self) -> str | None:
        """The name the next message's model has in the pool's events."""
        try:
            return self.link.name_of(self.model)
        except UnknownModel:
            return self.model

    def on_error(self, event: dict) -> None:
        if event.get("id") is None:
            # A load that cannot be done (insufficient_memory, say).
            self.screen.note(error_line(event))
            self.end_wait("error")
        elif self.answers(event):
            hint = "  (type /load to retry)" if event.get("code") in ("model_failed", "load_failed", "adapter_error") else ""
            if event.get("code") == "adapter_error" and event.get("msg") in self.adapter_errors.values():
                self.screen.note("error (adapter_error): the bad adapter above" + hint)
            else:
                self.screen.note(error_line(event) + hint)
            self.turn_done.set()

    def on_model_change(self, event: dict) -> None:
        name, ev = event.get("model"), event["ev"]
        if ev == "failed":
            self.screen.note(f"model {name!r} failed: {cause(event.get('reason', ''))}")
            self.screen.note("  /load retries, /model NAME switches to another model, /bye quits")
        elif ev == "adapter_error":
            # The base model runs; the name's adapter could not be read (at
            # its load, or a later change of its file, which keeps the old one).
            waited = self.awaited is not None and self.awaited[0] == name
            if self.adapter_errors.get(name) == event.get("msg", "") and not waited:
                return
            self.adapter_errors[name] = event.get("msg", "")
            self.screen.note(f"model {name!r}: bad adapter: {event.get('msg', '')}")
            if waited:
                self.screen.note("  /load retries, /model NAME switches to another model, /bye quits")
        elif ev == "restarting":
            self.screen.note(f"model {name!r} restarting: {cause(event.get('reason', ''))}")
        elif event.get("reason") != "not loaded":
            self.screen.note(f"model {name!r} unloaded ({event.get('reason')})")

    def answers(self, event: dict) -> bool:
        return self.current is not None and event.get("id") == self.current.id

    def expect(self, name: str, events: set[str]) -> None:
        """Sets up a wait for the next of `events` of model `name`, before
        the action that leads to it (its event may come at once)."""
        self.awaited = (name, frozenset(events))
        self.awaited_event.clear()
        self.interrupted.clear()
        self.outcome = None

    def end_wait(self, outcome: str) -> None:
        if self.awaited is not None:
            self.awaited = None
            self.outcome = outcome
            self.awaited_event.set()

    async def expected(self) -> str | None:
        """The event that ended the wait, or None when Ctrl-C (or a quit)
        ended it first."""
        await first_set(self.awaited_event, self.interrupted, self.quit, self.link.stopped)
        self.awaited = None
        return self.outcome

    # -- signals -----------------------------------------------------------------------

    def on_interrupt(self) -> None:
        """SIGINT, which comes only while no prompt is shown (prompt_toolkit's
        raw mode turns Ctrl-C into a key): stop the reply or the wait."""
        if self.current is not None:
            self.link.cancel(self.current.id_json)
        else:
            self.interrupted.set()

    # -- models ------------------------------------------------------------------------

    async def load(self, ref: str | None) -> bool:
        """Loads `ref` (a failed model is started again) and waits for ready
        or failed, showing progress. Ctrl-C aborts the load of our own pool;
        a pool shared with others goes on with it."""
        try:
            name = self.link.name_of(ref)
        except UnknownModel as exc:
            self.screen.note(str(exc))
            return False
        self.expect(name, {"ready", "failed", "adapter_error"})
        self.link.load(ref)
        outcome = await self.expected()
        if outcome is None and self.interrupted.is_set():
            self.screen.end_bar()
            if self.link.remote:
                self.screen.note(f"stopped waiting; the running pool goes on loading {name}")
            else:
                self.expect(name, {"unloaded"})
                self.link.unload(ref, "load cancelled (Ctrl-C)")
                await self.expected()
        return outcome == "ready"

    async def unload(self) -> None:
        """Unloads the model and waits until its worker has stopped."""
        try:
            name = self.link.name_of(self.model)
        except UnknownModel as exc:
            self.screen.note(str(exc))
            return
        self.expect(name, {"unloaded"})
        if not self.link.unload(self.model, "unloaded from chat"):
            self.awaited = None
            self.screen.note(f"{name} is not loaded")
            return
        await self.expected()

    async def switch(self, ref: str) -> None:
        """Makes `ref` the model of the next messages once it resolves (a
        model that fails to load stays chosen, for /load to retry)."""
        try:
            self.link.name_of(ref)
        except UnknownModel as exc:
            self.screen.note(str(exc))
            return
        self.model = ref
        await self.load(ref)

    # -- commands ----------------------------------------------------------------------

    async def command(self, text: str) -> bool:
        """Runs a /command; False to quit."""
        name, _, arg = text.strip().partition(" ")
        arg = arg.strip()
        if name in ("/bye", "/exit", "/quit"):
            return False
        if name in ("/help", "/?"):
            self.screen.note(HELP)
        elif name == "/clear":
            self.history.clear()
            self.screen.note("conversation cleared")
        elif name == "/load":
            if arg:
                await self.switch(arg)
            else:
                await self.load(self.model)
        elif name == "/model":
            if arg:
                await self.switch(arg)
            else:
                self.screen.note(f"model: {self.model or '(default)'}")
        elif name == "/unload":
            await self.unload()
        elif name == "/set":
            self.set(arg)
        else:
            self.screen.note(f"unknown command {name}; /help lists them")
        return True

    def set(self, arg: str) -> None:
        knob, _, value = arg.partition(" ")
        value = value.strip()
        if not knob:
            shown = []
            for k in KNOBS:
                value = self.knobs[k] if self.knobs[k] is not None else sampling.DEFAULTS[k]
                shown.append(f"  {k} {'none' if value is None else value}" + (" (default)" if self.knobs[k] is None else ""))
            system = f"  system {self.system!r}" if self.system else "  system (none)"
            self.screen.note("\n".join(shown + [system, f"  think {self.think}"]))
        elif knob == "system":
            self.system = value or None
            self.screen.note("system prompt set" if value else "system prompt removed")
        elif knob == "think":
            if value not in THINK_MODES:
                self.screen.note(f"think {value}: say on (show the thinking apart), off (ask the model not to think) or hidden")
                return
            self.think = value
            self.screen.note(f"think set to {value}")
        elif knob not in KNOBS:
            self.screen.note(f"cannot set {knob!r}; settings: {', '.join(KNOBS)}, system, think")
        elif value in ("", "default"):
            self.knobs[knob] = None
            self.screen.note(f"{knob} back to its default")
        else:
            try:
                number = msgspec.json.decode(value)
                sampling.check(knob, number)
            except msgspec.DecodeError:
                self.screen.note(f"{knob} {value}: not a number")
                return
            except ValueError as exc:
                self.screen.note(f"{knob} {value}: {exc}")
                return
            self.knobs[knob] = number
            self.screen.note(f"{knob} set to {number}")

    # -- one turn ----------------------------------------------------------------------

    def model_chosen(self) -> bool:
        """Whether messages have a model to go to; if none was named and the
        pool has no default, says how to choose one, in the chat's words (the
        pool's own error speaks of the protocol's fields)."""
        if self.model is not None:
            return True
        try:
            self.link.name_of(None)
        except UnknownModel:
            self.screen.note(
                "no model chosen: more than one is configured and none is the default; choose one with /model NAME (or start chat with --model NAME)"
            )
            return False
        return True

    async def turn(self, text: str) -> None:
        if not self.model_chosen():
            return
        messages = ([Message("system", self.system)] if self.system else []) + self.history + [Message("user", text)]
        knobs = {k: v for k, v in self.knobs.items() if v is not None}
        if self.think == "off":
            knobs["reasoning_budget"] = 0  # the think block closes before its first token
        request = ClientLine(id=f"chat-{next(self.ids)}", model=self.model, messages=messages, stop=self.stop, **knobs)
        self.reply.clear()
        self.shown = None
        self.turn_done.clear()
        self.current = request
        self.link.submit(request, self.sink)
        await first_set(self.turn_done, self.sink.closed, self.quit)
        self.current = None
        if self.turn_done.is_set() and self.reply:
            self.history += [Message("user", text), Message("assistant", "".join(self.reply))]

    async def next_input(self, source) -> str | None:
        """The next message or command, or None to quit (end of input, a
        signal, a `shutdown` op from `lattice-pool stop`)."""
        reading = asyncio.ensure_future(read_message(source))
        stopping = asyncio.ensure_future(first_set(self.quit, self.link.stopped, self.sink.closed))
        await asyncio.wait({reading, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not reading.done():
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
            return None
        return reading.result()

    async def start(self, local: Callable[[], Config], attach: Attach | None) -> None:
        """Attaches to the running pool `attach` names, if one answers; else
        starts a pool of our own, with the config `local` makes."""
        if attach is not None:
            self.link = await RemoteLink.connect(attach.path, self.sink, attach.ref)
        if self.link is not None:
            self.link.lora = attach.lora
            self.model = self.link.default
            self.screen.note(f"using the pool running at {attach.path} (--own-pool for a pool of this chat's own)")
            return
        config = local()
        self.model = config.default_model
        running = await RunningPool.start(config, self.sink, monitor=True)
        self.link = PoolLink(running)
        running.pool.preload()

    async def run(self, local: Callable[[], Config], attach: Attach | None) -> int:
        loop = asyncio.get_running_loop()
        handlers = ((signal.SIGINT, self.on_interrupt), (signal.SIGTERM, self.quit.set), (signal.SIGHUP, self.quit.set))
        for sig, handler in handlers:
            loop.add_signal_handler(sig, handler)
        try:
            await self.start(local, attach)
            return await self.session()
        finally:
            for sig, _ in handlers:
                loop.remove_signal_handler(sig)

    async def session(self) -> int:
        if self.model_chosen():
            await self.load(self.model)
        interactive = sys.stdin.isatty() and sys.stdout.isatty()
        source = PromptInput(self.screen) if interactive else LineInput(self.screen)
        try:
            while True:
                try:
                    text = await self.next_input(source)
                except Cleared:
                    continue
                if text is None:
                    break
                if text.strip().startswith("/"):
                    if not await self.command(text):
                        break
                elif text.strip():
                    await self.turn(text)
                if self.quit.is_set() or self.sink.closed.is_set():
                    break
        finally:
            self.quitting = True
            if self.link.stopped.is_set():
                self.screen.note("the pool stopped; bye" if self.link.remote else "the pool was asked to stop (shutdown op); bye")
            await self.link.close()
        return 0


@dataclass(frozen=True)
class Attach:
    """A running pool to try first: its control socket, and the model
    (None: the pool's one model) and adapter asked for."""

    path: Path
    ref: str | None
    lora: str | None


async def chat(args: argparse.Namespace, local: Callable[[], Config], attach: Attach | None) -> int:
    screen = Screen()
    with stderr.routed(screen.log):
        return await Chat(args, screen).run(local, attach)
