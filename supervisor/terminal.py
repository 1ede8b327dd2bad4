"""The terminal front ends: `lattice-pool run --prompt` and `chat`, where a
person, not a program, reads the pool's lines: tokens as text on stdout,
load progress and stats on stderr. Both run the serve lifecycle
(supervisor.lifecycle.RunningPool) with an EventSink as the pool's output."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import sys
import threading
from typing import Callable, TextIO

from ipc.messages import Message
from ipc.worker_events import parse_event
from supervisor.config import Config
from supervisor.lifecycle import RunningPool, first_set
from supervisor.requests import ClientLine


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


async def run_once(config: Config, request: ClientLine, *, as_json: bool) -> int:
    finished = asyncio.Event()
    outcome = {"rc": 0}
    progress = LoadProgress()
    out = sys.stdout.buffer

    def on_event(event: dict, line: bytes) -> None:
        ev = event["ev"]
        if as_json:
            out.write(line)
            out.flush()
        elif ev == "gen_token" and not event["done"]:
            out.write(event["token"].encode("utf-8"))
            out.flush()
        elif ev in ("loading", "ready"):
            progress.update(event)
        if ev == "error" or (ev == "gen_token" and event["done"]):
            if ev == "error":
                outcome["rc"] = 1
                if not as_json:
                    print(f"error ({event.get('code')}): {event['msg']}", file=sys.stderr)
            elif not as_json:
                out.write(b"\n")
                out.flush()
                print(stats_line(event), file=sys.stderr)
            finished.set()
        elif ev == "failed" and not as_json:
            print(f"model failed: {event.get('reason')}", file=sys.stderr)

    sink = EventSink(on_event)
    running = await RunningPool.start(config, sink, monitor=False)
    pool = running.pool
    running.on_signals(pool.hurry.set)
    pool.submit(request)
    await first_set(pool.hurry, finished, sink.closed)
    if pool.hurry.is_set() and not finished.is_set():
        outcome["rc"] = 130
    await running.stop(0)
    return outcome["rc"]


async def chat(config: Config, args: argparse.Namespace) -> int:
    """A REPL: each turn sends the whole history as messages; Ctrl-C stops a
    reply, Ctrl-D or /bye quits, /clear forgets the history."""
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[str | None] = asyncio.Queue()
    reply: list[str] = []
    turn_done = asyncio.Event()
    progress = LoadProgress()
    out = sys.stdout

    def on_event(event: dict, line: bytes) -> None:
        ev = event["ev"]
        if ev in ("loading", "ready"):
            progress.update(event)
        elif ev == "gen_token":
            if event["done"]:
                out.write("\n")
                if args.verbose:
                    print(stats_line(event), file=sys.stderr)
                turn_done.set()
            else:
                reply.append(event["token"])
                out.write(event["token"])
            out.flush()
        elif ev == "error" and event.get("id") is not None:
            print(f"\nerror ({event.get('code')}): {event['msg']}", file=sys.stderr)
            turn_done.set()
        elif ev in ("failed", "restarting"):
            print(f"[{ev}: {event.get('reason')}]", file=sys.stderr)

    def read_input() -> None:
        for text in sys.stdin:
            loop.call_soon_threadsafe(lines.put_nowait, text.rstrip("\n"))
        loop.call_soon_threadsafe(lines.put_nowait, None)

    sink = EventSink(on_event)
    running = await RunningPool.start(config, sink, monitor=False)
    pool = running.pool
    pool.preload()
    threading.Thread(target=read_input, name="chat-input", daemon=True).start()
    history: list[Message] = []
    if args.system:
        history.append(Message("system", args.system))
    ids = itertools.count(1)
    current: list[str] = []

    def on_interrupt() -> None:
        if current:
            pool.cancel(current[0])
        else:
            lines.put_nowait(None)

    running.on_signals(on_interrupt, (signal.SIGINT,))
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            out.write(">>> ")
            out.flush()
        text = await lines.get()
        if text is None or text.strip() in ("/bye", "/exit", "/quit"):
            break
        if text.strip() == "/clear":
            history = history[:1] if args.system else []
            continue
        if not text.strip():
            continue
        history.append(Message("user", text))
        reply.clear()
        turn_done.clear()
        request = ClientLine(id=f"chat-{next(ids)}", messages=list(history), max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        current[:] = [request.id_json]
        pool.submit(request)
        await first_set(turn_done, sink.closed)
        if sink.closed.is_set():
            break
        current.clear()
        history.append(Message("assistant", "".join(reply)))
    await running.stop(0)
    return 0
