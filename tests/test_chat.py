"""`lattice-pool chat` as a person meets it: driven through a pseudo-terminal
(pexpect), with the REPL's prompt, history, /commands, pasted and
triple-quoted messages, Ctrl-C and a model that fails. What reached the
model is read from the chat's own pool over its control socket (`served`
counts requests), not guessed from the noise the demo model writes."""

from __future__ import annotations

import os
import re
import stat
import sys
import time
from pathlib import Path

import pexpect
import psutil
import pytest

from harness.fakes import FAKE_ENV, FakeModels
from harness.procs import ROOT, child_env, wait_for
from supervisor.ps import query_status
from tests.lora_files import lora_pairs, targets_of, write_mlx

PROMPT = ">>>"
# The start of a log record on stderr (supervisor.stderr, worker/__main__.py).
LOG_RECORD = re.compile(rb"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR)")


ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]|\x1b[^\[]")


class Chat:
    """A chat process on a pseudo-terminal, with its own control socket.
    Everything the terminal receives is kept in `raw`; `wait` and `prompt`
    look at what came after a mark (by default, since the last keys sent)."""

    def __init__(self, tmp_path: Path, *args: str, extra: dict[str, str] | None = None):
        self.socket = tmp_path / "chat.sock"
        self.home = tmp_path / "home"
        self.home.mkdir(exist_ok=True)
        env = child_env(
            TERM="xterm",
            HOME=str(self.home),
            LATTICE_CONTROL_SOCKET=str(self.socket),
            # pexpect does not answer prompt_toolkit's cursor position requests.
            PROMPT_TOOLKIT_NO_CPR="1",
            **(extra or {}),
        )
        env.pop("LATTICE_LOG_LEVEL", None)
        self.proc = pexpect.spawn(sys.executable, ["-m", "supervisor", "chat", *args], env=env, cwd=str(ROOT), dimensions=(40, 200))
        self.raw = bytearray()
        self.mark = 0

    def _read(self) -> None:
        try:
            self.raw += self.proc.read_nonblocking(65536, timeout=0.05)
        except pexpect.TIMEOUT:
            pass

    def wait(self, pattern: str | bytes, timeout: float = 120) -> re.Match:
        """Reads until `pattern` (a regex) shows up after the mark; the mark
        moves past it."""
        regex = re.compile(pattern.encode() if isinstance(pattern, str) else pattern)
        deadline = time.monotonic() + timeout
        while (found := regex.search(self.raw, self.mark)) is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"no {pattern!r} within {timeout}s; the terminal got: {bytes(self.raw[self.mark :])[-3000:]!r}")
            self._read()
        self.mark = found.end()
        return found

    def at_prompt(self) -> bool:
        """The last thing drawn after the mark is an empty prompt."""
        at = self.raw.rfind(PROMPT.encode(), self.mark)
        return at >= 0 and not ANSI.sub(b"", bytes(self.raw[at + len(PROMPT) :])).strip()

    def prompt(self, timeout: float = 120) -> None:
        """Waits for a fresh, empty prompt after the mark."""
        deadline = time.monotonic() + timeout
        while not self.at_prompt():
            if time.monotonic() > deadline:
                raise AssertionError(f"no prompt within {timeout}s; the terminal got: {bytes(self.raw[self.mark :])[-3000:]!r}")
            self._read()
        self.mark = len(self.raw)

    def send(self, keys: str) -> None:
        self.mark = len(self.raw)
        self.proc.send(keys)

    def line(self, text: str) -> None:
        """Types a line and presses Enter."""
        self.send(text + "\r")

    def served(self) -> int:
        return sum(row.served for row in query_status(self.socket).models)

    def until(self, predicate, message: str) -> None:
        """Waits for predicate() while reading the terminal, so that a reply
        being written never fills it and blocks the chat."""

        def check() -> bool:
            self._read()
            return predicate()

        wait_for(check, 60, message=message)

    def wait_served(self, n: int) -> None:
        self.until(lambda: self.served() == n, f"{n} requests served")

    def close(self) -> int:
        deadline = time.monotonic() + 60
        while self.proc.isalive() and time.monotonic() < deadline:
            try:
                self.raw += self.proc.read_nonblocking(65536, timeout=0.1)
            except (pexpect.TIMEOUT, pexpect.EOF):
                pass
        self.proc.close()
        return self.proc.exitstatus

    def kill(self) -> None:
        if self.proc.isalive():
            self.proc.terminate(force=True)


@pytest.fixture
def start_chat(tmp_path):
    made = []

    def start(*args: str, **kwargs) -> Chat:
        chat = Chat(tmp_path, *args, **kwargs)
        made.append(chat)
        return chat

    yield start
    for chat in made:
        chat.kill()


def columns_at(raw: bytes, pattern: re.Pattern) -> list[int]:
    """The terminal column at which each match of `pattern` starts, playing
    the bytes as a terminal would: CR, LF, backspace, cursor left/right;
    other escape sequences move nothing."""
    cols, col = [], 0
    starts = {m.start() for m in pattern.finditer(raw)}
    token = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]|\x1b[^\[]|[\r\n\b]|[^\x1b\r\n\b]")
    for m in token.finditer(raw):
        t = m.group()
        if m.start() in starts:
            cols.append(col)
        if t == b"\r":
            col = 0
        elif t == b"\n":
            col = 0  # the pty's output processing turns LF into CRLF
        elif t == b"\b":
            col = max(0, col - 1)
        elif t.startswith(b"\x1b["):
            params = t[2:-1]
            n = int(params) if params.isdigit() else 1
            if t.endswith(b"D"):
                col = max(0, col - n)
            elif t.endswith(b"C"):
                col += n
        elif not t.startswith(b"\x1b") and t[0] >= 0x20 and t[0] & 0xC0 != 0x80:
            col += 1  # a printable character (a UTF-8 continuation byte is none)
    return cols


def test_chat_repl_on_a_terminal(tiny_model, start_chat):
    chat = start_chat("--model-dir", str(tiny_model), "--max-tokens", "4", "--seed", "1")
    chat.wait("tiny ready")
    chat.prompt()  # the prompt comes after `ready`, not before the progress bar
    # Quiet by default: no log record of the pool or its worker.
    assert not LOG_RECORD.search(chat.raw), bytes(chat.raw)[-2000:]

    # A /command is the REPL's, never a message to the model.
    chat.line("/help")
    chat.wait("/unload")
    chat.prompt()
    assert chat.served() == 0

    chat.line("Hello there")
    chat.prompt()
    chat.wait_served(1)

    # History: the up arrow brings the last message back, ready to send again.
    chat.send("\x1b[A")
    chat.wait("Hello there")
    chat.send("\r")
    chat.prompt()
    chat.wait_served(2)

    # A pasted block of three lines (bracketed paste) is one message.
    chat.send("\x1b[200~first line\nsecond line\nthird line\x1b[201~")
    chat.send("\r")
    chat.prompt()
    chat.wait_served(3)
    # So is a message between triple quotes, as in `ollama run`.
    chat.line('"""one')
    chat.wait(re.escape("..."))
    chat.line('two"""')
    chat.prompt()
    chat.wait_served(4)

    # Sampling settings.
    chat.line("/set temperature 0.2")
    chat.wait("temperature set to 0.2")
    chat.line("/set top_p 7")
    chat.wait("top_p 7: .*top_p")
    chat.line("/set")
    chat.wait(r"temperature 0\.2\s")
    chat.wait(r"top_k 50 \(default\)")
    chat.prompt()

    # Ctrl-C at an idle prompt clears the line; it does not quit.
    chat.send("never sent")
    chat.send("\x03")
    chat.prompt()
    chat.line("")
    chat.prompt()
    assert chat.proc.isalive() and chat.served() == 4

    # Ctrl-C during a reply stops the reply, and the prompt comes back.
    chat.line("/set max_tokens 30000")
    chat.wait("max_tokens set to 30000")
    chat.prompt()
    chat.line("Tell me everything")
    chat.until(lambda: any(row.in_flight for row in query_status(chat.socket).models), "the reply to start")
    chat.send("\x03")
    chat.prompt()
    chat.wait_served(5)
    assert chat.proc.isalive()

    chat.send("\x04")  # Ctrl-D
    assert chat.close() == 0
    history = chat.home / ".lattice" / "chat_history"
    assert stat.S_IMODE(os.stat(history).st_mode) == 0o600
    assert "Hello there" in history.read_text() and "never sent" not in history.read_text()


def test_chat_failed_model_shows_its_cause_and_load_retries(tiny_model, second_model, tmp_path, start_chat):
    lora = tmp_path / "style.safetensors"  # not there yet: the base runs, the name's adapter cannot load
    chat = start_chat("--model-dir", str(tiny_model), "--lora", str(lora), "--max-tokens", "3")
    chat.wait("model 'tiny': bad adapter")
    chat.wait("/load retries")
    chat.prompt()
    # The cause is said once, not as the worker's stderr, a log and an event.
    assert bytes(chat.raw).count(str(lora).encode()) == 1, bytes(chat.raw)

    # A message to the failed model tries the adapter again: the same cause
    # is not said again, the way out is.
    chat.line("Hello")
    chat.wait(r"error \(adapter_error\): the bad adapter above  \(type /load to retry\)")
    chat.prompt()
    assert bytes(chat.raw).count(str(lora).encode()) == 1, bytes(chat.raw)

    write_mlx(lora, lora_pairs(targets_of(tiny_model), rank=4, seed=3), alpha=8.0)
    chat.line("/load")
    chat.wait("tiny ready")
    chat.prompt()
    chat.line("Hello")
    chat.prompt()
    chat.wait_served(2)  # the refused one counts: `served` counts requests ended

    # /unload stops the worker; /model switches (any form --model takes).
    chat.line("/unload")
    chat.wait("model 'tiny' unloaded")
    chat.prompt()
    assert query_status(chat.socket).models == []
    chat.line(f"/model {second_model}")
    chat.wait(f"{second_model} ready")
    chat.prompt()
    chat.line("Hello")
    chat.prompt()
    chat.wait_served(1)
    assert [row.model for row in query_status(chat.socket).models] == [str(second_model)]
    chat.line("/bye")
    assert chat.close() == 0


def test_chat_verbose_logs_never_share_a_line(tiny_model, start_chat):
    chat = start_chat("--model-dir", str(tiny_model), "--max-tokens", "4", "--verbose")
    chat.wait("tiny ready")
    chat.prompt()
    chat.line("Hello there")
    chat.wait(r"\[\d+ prompt tokens")
    chat.prompt()
    chat.send("\x04")
    assert chat.close() == 0
    raw = bytes(chat.raw)
    # --verbose brings the pool's and the worker's records back...
    assert re.search(rb"INFO lattice-pool: ", raw) and re.search(rb"INFO worker model=tiny pid=\d+: ", raw)
    # ...each on a line of its own: never after the progress bar, the prompt
    # or half a reply on the same line.
    assert b"% of" in raw
    starts = columns_at(raw, LOG_RECORD)
    assert len(starts) >= 3 and set(starts) == {0}, starts


def test_chat_shows_thinking_apart_and_set_think(tiny_model, start_chat):
    # The demo template opens <think>; a budget of 3 closes it after three
    # tokens of thinking, so each reply has both parts.
    chat = start_chat("--model-dir", str(tiny_model), "--max-tokens", "12", "--seed", "1", "--reasoning-budget", "3")
    chat.wait("tiny ready")
    chat.prompt()
    chat.line("Hello")
    chat.wait(rb"\x1b\[2mThinking\.\.\.\x1b\[0m\r?\n")
    chat.wait(rb"\x1b\[2m\r?\n\.\.\.done thinking\.\x1b\[0m\r?\n\r?\n")
    chat.prompt()
    chat.wait_served(1)

    for mode, served in (("hidden", 2), ("off", 3)):
        chat.line(f"/set think {mode}")
        chat.wait(f"think set to {mode}")
        chat.prompt()
        start = len(chat.raw)
        chat.line("Hello")
        chat.prompt()
        chat.wait_served(served)
        assert b"Thinking" not in chat.raw[start:] and b"done thinking" not in chat.raw[start:], bytes(chat.raw[start:])
    chat.line("/set think maybe")
    chat.wait("think maybe: say on")
    chat.line("/set")
    chat.wait(r"think off")
    chat.prompt()
    # The tags themselves are never shown.
    assert b"<think>" not in chat.raw and b"</think>" not in chat.raw
    chat.send("\x04")
    assert chat.close() == 0


def test_chat_uses_a_running_pool(tiny_model, tmp_path, spawn_pool, start_chat):
    pool = spawn_pool("--model-dir", str(tiny_model), "--control-socket", str(tmp_path / "chat.sock"))
    pool.wait_ev("ready", model="tiny")
    (row,) = query_status(tmp_path / "chat.sock").models
    chat = start_chat("--max-tokens", "4", "--seed", "1")  # it looks for a pool at tmp_path/chat.sock
    chat.wait("using the pool running at")
    chat.wait("tiny ready")
    chat.prompt()
    chat.line("Hello there")
    chat.prompt()
    chat.wait_served(1)
    # One worker, the running pool's: the chat started none of its own.
    assert [(r.model, r.pid) for r in query_status(chat.socket).models] == [("tiny", row.pid)]
    assert psutil.Process(chat.proc.pid).children(recursive=True) == []
    chat.line("/bye")
    assert chat.close() == 0
    # Quitting the chat leaves the pool serving.
    pool.send({"id": "after", "prompt": "Hi", "max_tokens": 2})
    assert pool.terminal("after")["gen_tokens"] == 2
    assert pool.close() == 0


def test_ctrl_c_aborts_a_load(tmp_path, start_chat):
    # A load that never ends (a fake worker: the pool's side of a load is
    # what is tested, and a real loader refuses every file that could hang).
    stuck = FakeModels(tmp_path).add("stuck", {"load_delay": 600})
    chat = start_chat("--model-dir", str(stuck), "--own-pool", extra=FAKE_ENV)
    chat.until(lambda: chat.socket.exists() and [r.state for r in query_status(chat.socket).models] == ["loading"], "the load to begin")
    pid = query_status(chat.socket).models[0].pid
    chat.send("\x03")
    chat.wait(r"model 'stuck' unloaded \(load cancelled \(Ctrl-C\)\)")
    chat.prompt()
    assert query_status(chat.socket).models == [] and not psutil.pid_exists(pid)
    chat.line("/bye")
    assert chat.close() == 0


def test_chat_without_a_model_among_several_says_how_to_choose_one(tiny_model, tmp_path, start_chat):
    config = tmp_path / "pool.toml"
    config.write_text("".join(f'[[models]]\nname = "{name}"\npath = "{tiny_model}"\n' for name in ("one", "two")))
    chat = start_chat("--config", str(config), "--own-pool")
    chat.wait(r"no model chosen: .*/model NAME")
    chat.prompt()
    chat.line("hello")
    chat.wait(r"no model chosen: .*/model NAME")
    chat.prompt()
    assert b'no "model" given' not in chat.raw and chat.raw.count(b"no model chosen") == 2
    chat.line("/bye")
    assert chat.close() == 0
