"""A fake worker for fault-injection tests and relay benchmarks only.

`python -m tests.fakeworker --model DIR ...` takes the real worker's
arguments and speaks the real protocol: msgpack frames in (ipc.framing),
`@@lattice` lines out (ipc.events), heartbeats from a side thread, the real
lifeline (worker.shell.lifeline). It loads no model: what it does is read from
`DIR/fake.json` at every start, so a test scripts each start of a worker:

    fake.json = {knobs}                 the same for every start
              | [{knobs}, {knobs}, ...]  start i uses entry min(i, len - 1)

Each start appends its pid to `DIR/starts`, so tests can count starts.

Knobs (all optional):
    load_delay        seconds before `ready` (loading events every 0.05 s)
    load_silent       during load_delay send nothing, heartbeats included
    boot_exit         exit with this code instead of becoming ready...
    boot_message      ...having written this text (lines) to stderr at once
    boot_stderr       bytes of log lines written to stderr at start
    grandchild        spawn a sleeping grandchild that holds stdout/stderr
    ignore_sigterm    ignore SIGTERM
    ignore_eof        keep running when the request pipe closes
    stop_reading      never read the request pipe (heartbeats go on)
    start_delay       seconds a request waits before it starts (heartbeats say idle)
    tokens            token lines per request (default: max_tokens)
    token             token text (default "tok"); "{t}" becomes the send
                      time in ns of time.monotonic_ns(), for latency benches
    token_interval    seconds between token lines (default: none, a flood)
    crash_after       after this many tokens of a request, die...
    crash_code        ...with this exit code (default: SIGKILL itself)
    partial           ...having first written these bytes with no newline
    hang_after        after this many tokens go silent: no line, no heartbeat
    sigstop_after     after this many tokens SIGSTOP itself
    long_line         write one line of this many bytes before the tokens
    garbage           lines (latin-1 text) written before the tokens
    bad_final         end requests with a final line of the wrong shape
    request_stderr    bytes of log lines written to stderr per request
    exit_after_ready  exit with this code right after `ready`
    together          serve requests together, as a batching worker does:
                      each round writes this many token lines of every
                      running request, in one write; with it, `tokens`,
                      `token` and `token_interval` (between rounds) apply,
                      and `crash_after` counts rounds
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ipc.events import BAD_REQUEST, encode_cancelled_done, encode_done, encode_error, encode_event, encode_token
from ipc.framing import read_messages
from ipc.messages import Cancel, Generate, Shutdown, Stats, ToWorker
from worker.shell.lifeline import bind_to_parent

_BLOCK = 64 * 1024


class Out:
    """Whole lines to stdout from several threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.silent = False

    def write(self, data: bytes) -> None:
        with self.lock:
            if self.silent:
                return
            view = memoryview(data)
            try:
                while view:
                    view = view[os.write(1, view) :]
            except OSError:
                os._exit(0)


def knobs_for_this_start(model: Path) -> dict:
    """This start's knobs; records the start in DIR/starts."""
    starts = model / "starts"
    index = len(starts.read_text().split()) if starts.exists() else 0
    fd = os.open(starts, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{os.getpid()}\n".encode())
    finally:
        os.close(fd)
    path = model / "fake.json"
    spec = json.loads(path.read_text()) if path.exists() else {}
    if isinstance(spec, list):
        return spec[min(index, len(spec) - 1)] if spec else {}
    return spec


def log_lines(nbytes: int, what: str) -> None:
    line = f"fakeworker pid={os.getpid()}: {what} " + "x" * 60 + "\n"
    data = (line * (nbytes // len(line) + 1)).encode()[:nbytes]
    view = memoryview(data)
    while view:
        view = view[os.write(2, view) :]


def die(knobs: dict) -> None:
    if knobs.get("crash_code") is not None:
        os._exit(knobs["crash_code"])
    os.kill(os.getpid(), signal.SIGKILL)


class FakeWorker:
    def __init__(self, name: str, knobs: dict, out: Out):
        self.name = name
        self.knobs = knobs
        self.out = out
        self.jobs: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.current: int | None = None
        self.cancel = threading.Event()
        self.cancelled: set[int] = set()

    def heartbeat(self, interval: float) -> None:
        while True:
            time.sleep(interval)
            self.out.write(encode_event("heartbeat", busy=self.current is not None))

    def read_loop(self) -> None:
        for messages in read_messages(0, self.malformed):
            for msg in messages:
                self.handle(msg)
        if not self.knobs.get("ignore_eof"):
            os._exit(0)

    def malformed(self, problem: Exception) -> None:
        self.out.write(encode_error(f"malformed frame: {problem}", BAD_REQUEST))

    def handle(self, msg: ToWorker) -> None:
        if isinstance(msg, Cancel):
            with self.lock:
                if self.current == msg.rid and not self.knobs.get("together"):
                    self.cancel.set()
                else:
                    self.cancelled.add(msg.rid)
        elif isinstance(msg, Stats):
            self.out.write(
                encode_event(
                    "worker_stats",
                    model=self.name,
                    format="fake",
                    rss_bytes=rss_bytes(),
                    uss_bytes=rss_bytes(),
                    mlx_active_bytes=self.knobs.get("mlx_active_bytes", 0),
                    seq=msg.seq,
                )
            )
        else:
            self.jobs.put(msg)

    def serve(self) -> None:
        while True:
            msg = self.jobs.get()
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, Generate):
                time.sleep(self.knobs.get("start_delay", 0))
                with self.lock:
                    if msg.rid in self.cancelled:
                        self.cancelled.discard(msg.rid)
                        self.out.write(encode_cancelled_done(msg.id_json))
                        continue
                    self.current = msg.rid
                    self.cancel.clear()
                self.generate(msg)
                with self.lock:
                    self.current = None

    def serve_together(self, block: int) -> None:
        running: dict[int, list] = {}  # rid -> [request, tokens sent, start]
        token = self.knobs.get("token", "tok")
        rounds = 0
        while True:
            if rounds == self.knobs.get("crash_after"):
                die(self.knobs)
            rounds += 1
            time.sleep(self.knobs.get("token_interval") or 0)
            while not running or not self.jobs.empty():
                msg = self.jobs.get()
                if isinstance(msg, Shutdown):
                    return
                running[msg.rid] = [msg, 0, time.monotonic()]
            with self.lock:
                self.current = next(iter(running))
                gone = self.cancelled & running.keys()
                self.cancelled -= gone
            out = []
            for rid, (req, sent, t0) in list(running.items()):
                n = 0 if rid in gone else min(block, self.knobs.get("tokens", req.max_tokens) - sent)
                out.append(encode_token(token, req.id_json) * n)
                running[rid][1] = sent = sent + n
                if rid in gone or sent == self.knobs.get("tokens", req.max_tokens):
                    finish = "cancelled" if rid in gone else "length"
                    total_ms = int((time.monotonic() - t0) * 1000)
                    out.append(
                        encode_done(tok_s=0.0, ttft_ms=0.0, prompt_tokens=1, gen_tokens=sent, total_ms=total_ms, finish_reason=finish, id_json=req.id_json)
                    )
                    del running[rid]
            self.out.write(b"".join(out))
            with self.lock:
                self.current = None if not running else self.current

    def generate(self, req: Generate) -> None:
        k = self.knobs
        t0 = time.monotonic()
        if k.get("request_stderr"):
            log_lines(k["request_stderr"], f"request {req.rid}")
        for text in k.get("garbage", []):
            self.out.write(text.encode("latin-1"))
        if k.get("long_line"):
            self.out.write(b'@@lattice {"ev":"gen_token","token":"' + b"x" * k["long_line"] + b'","done":false}\n')
        total = k.get("tokens", req.max_tokens)
        token = k.get("token", "tok")
        interval = k.get("token_interval")
        # Every fault point, as a token count; the flood runs in blocks between them.
        stops = sorted(k[name] for name in ("crash_after", "hang_after", "sigstop_after") if k.get(name) is not None)
        sent = 0
        finish = "length"
        while sent < total:
            if self.cancel.is_set():
                finish = "cancelled"
                break
            if sent in stops:
                self.fault(sent)
            if interval is not None or "{t}" in token:
                if interval:
                    time.sleep(interval)
                self.out.write(encode_token(token.replace("{t}", str(time.monotonic_ns())), req.id_json))
                sent += 1
                continue
            line = encode_token(token, req.id_json)
            upto = min([total] + [s for s in stops if s > sent])
            n = min(upto - sent, max(1, _BLOCK // len(line)))
            self.out.write(line * n)
            sent += n
        if sent in stops:
            self.fault(sent)
        total_ms = int((time.monotonic() - t0) * 1000)
        if k.get("bad_final"):
            self.out.write(b'@@lattice {"ev":"gen_token","token":"","done":true,"gen_tokens":"many"}\n')
            return
        self.out.write(encode_done(tok_s=0.0, ttft_ms=0.0, prompt_tokens=1, gen_tokens=sent, total_ms=total_ms, finish_reason=finish, id_json=req.id_json))

    def fault(self, sent: int) -> None:
        k = self.knobs
        if k.get("crash_after") == sent:
            if k.get("partial"):
                self.out.write(k["partial"].encode())
            die(k)
        if k.get("sigstop_after") == sent:
            os.kill(os.getpid(), signal.SIGSTOP)
        if k.get("hang_after") == sent:
            self.out.silent = True
            threading.Event().wait()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m tests.fakeworker")
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--name")
    p.add_argument("--heartbeat", type=float, default=2.0)
    args, _ = p.parse_known_args()
    name = args.name or args.model.name
    knobs = knobs_for_this_start(args.model)
    ppid = os.environ.get("LATTICE_SUPERVISOR_PID")
    bind_to_parent(int(ppid) if ppid else None)
    if knobs.get("ignore_sigterm"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out = Out()
    worker = FakeWorker(name, knobs, out)
    grandchild = None
    if knobs.get("grandchild"):
        # Inherits fds 1 and 2: the worker's pipes stay open after it dies.
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdin=subprocess.DEVNULL)
    if knobs.get("boot_stderr"):
        log_lines(knobs["boot_stderr"], "booting")
    delay = knobs.get("load_delay", 0.0)
    if knobs.get("load_silent"):
        time.sleep(delay)
    else:
        threading.Thread(target=worker.heartbeat, args=(args.heartbeat,), daemon=True).start()
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline:
            out.write(encode_event("loading", model=name, bytes_loaded=0, bytes_total=1))
            time.sleep(0.05)
    if knobs.get("boot_exit") is not None:
        message = knobs.get("boot_message", f"fakeworker: failing at boot with exit code {knobs['boot_exit']}\n")
        os.write(2, message.encode())
        return knobs["boot_exit"]
    if knobs.get("load_silent"):
        threading.Thread(target=worker.heartbeat, args=(args.heartbeat,), daemon=True).start()
    out.write(
        encode_event(
            "ready",
            model=name,
            format="fake",
            lora=None,
            load_ms=int(delay * 1000),
            pid=os.getpid(),
            grandchild_pid=grandchild.pid if grandchild else None,
        )
    )
    if knobs.get("exit_after_ready") is not None:
        return knobs["exit_after_ready"]
    if not knobs.get("stop_reading"):
        threading.Thread(target=worker.read_loop, daemon=True).start()
    if knobs.get("together"):
        worker.serve_together(knobs["together"])
    else:
        worker.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
