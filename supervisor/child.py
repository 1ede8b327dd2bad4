"""A worker child process: how it is started (argv, environment), its three
pipes on asyncio, and how it is stopped.

The supervisor starts worker-side programs as a fresh interpreter running a
module of the `worker` package; it never imports `worker` (or MLX) itself,
which keeps it small and lets it outlive any worker crash.

Death is detected from the exit status (SubprocessProtocol.process_exited),
never from stdout EOF or Process.wait(): on CPython 3.11 wait() returns only
once every pipe is closed, so a grandchild holding stdout would hide the
worker's death. Each worker leads its own process group, so stopping it also
stops anything it spawned.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ipc.framing import encode_frame
from ipc.messages import ToWorker
from ipc.paths import pool_cache_dir
from supervisor.config import Config, parse_duration, parse_size
from supervisor.spec import GroupSpec, ModelSpec

log = logging.getLogger("lattice.process")

# The directory holding the ipc/, worker/ and supervisor/ packages; put on the
# child's path so a source checkout works without an install.
PACKAGE_ROOT = Path(__file__).resolve().parent.parent

# Test and benchmark hook, read only here: the module the pool runs as its
# workers (fault-injection tests and bench/relay.py set it to
# tests.fakeworker). Unset in production.
WORKER_MODULE_VAR = "LATTICE_WORKER_MODULE"

# One worker line: a token event, or a lifecycle event. Longer means a
# broken or hostile worker, not a protocol we speak.
MAX_WORKER_LINE = 4 * 1024 * 1024

# Errors of spawn() and accept() that pass once file descriptors, processes
# or memory are freed: worth a retry, not a failure.
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOBUFS, errno.ENOMEM})

# What is read from a dead worker's pipes before they are closed: everything
# it wrote before dying, but not an endless stream from a grandchild.
_EXIT_DRAIN_LIMIT = 4 * 1024 * 1024


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child running one of our packages."""
    env = dict(os.environ)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(PACKAGE_ROOT) + (os.pathsep + path if path else "")
    # Unbuffered stderr keeps a child's log lines in order with ours.
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def worker_command(spec: ModelSpec, config: Config, adapter_copies: Path | None, held_elsewhere: int = 0) -> tuple[list[str], dict[str, str]]:
    """argv and environment of the pool's worker for `spec.key`, named by
    `spec.name`. It starts without an adapter: every request names its own
    (docs/adapters.md), so the one worker serves every name on its base
    model. `held_elsewhere`: the memory the pool's other workers hold or may
    take, which its default budgets leave out."""
    args = ["--model", str(spec.path), "--name", spec.name, "--heartbeat", str(config.heartbeat_interval), "--max-batch", str(spec.max_batch)]
    if held_elsewhere > 0:
        args += ["--memory-held-elsewhere", str(held_elsewhere)]
    args += ["--max-adapters", str(spec.max_adapters)]
    if spec.draft is not None:
        args += ["--draft", spec.draft, "--draft-tokens", str(spec.draft_tokens)]
    if spec.tokenizer_dir is not None:
        args += ["--tokenizer-dir", str(spec.tokenizer_dir)]
    if spec.max_context is not None:
        args += ["--max-context", str(spec.max_context)]
    if config.prefix_cache_bytes is not None:
        args += ["--prefix-cache-bytes", str(parse_size(config.prefix_cache_bytes))]
    disk_bytes = spec.prefix_disk_bytes if spec.prefix_disk_bytes is not None else parse_size(config.prefix_cache_disk_bytes)
    if disk_bytes != 0 and spec.group is None:
        # Keyed inside by the model's content, so every model shares the root.
        args += ["--prefix-disk-dir", str(pool_cache_dir(os.environ) / "prefix")]
        if disk_bytes is not None:
            args += ["--prefix-disk-bytes", str(disk_bytes)]
    if spec.kv is not None:
        args += ["--kv-bits", str(spec.kv[0]), "--kv-group-size", str(spec.kv[1])]
        if spec.kv[2]:
            args += ["--quantized-kv-start", str(spec.kv[2])]
    for kind, value in spec.warm_prompts:
        # One argument with "=": a prompt that starts with "-" stays a value.
        args.append(f"--warm-prompt={value}" if kind == "text" else f"--warm-prompt-file={value}")
    idle_release = parse_duration(config.idle_release)
    args += ["--idle-release", "inf" if idle_release is None else str(idle_release)]
    if not config.compile_decode:
        args.append("--eager-decode")
    if config.mask_threads is not None:
        args += ["--mask-threads", str(config.mask_threads)]
    args += ["--max-prompt-bytes", str(parse_size(config.max_prompt_bytes)), "--max-adapter-bytes", str(parse_size(config.max_adapter_bytes))]
    if adapter_copies is not None:
        args += ["--adapter-copies", str(adapter_copies)]
    if spec.group is not None:
        args += group_args(spec.group, config)
    module = os.environ.get(WORKER_MODULE_VAR) or "worker"
    # The worker's lifeline watches this pid (worker.shell.lifeline).
    return python_module(module, *args), child_env(LATTICE_SUPERVISOR_PID=str(os.getpid()))


def group_args(group: GroupSpec, config: Config) -> list[str]:
    """The worker's flags for a model split over processes: it starts the
    other ranks itself (worker.group.launch) and ends them all when it exits; a
    rank silent, or a step waiting on the group, for stall_timeout ends it."""
    args = ["--ranks", str(group.ranks), "--backend", group.backend, "--rank-timeout", str(config.stall_timeout)]
    if group.hosts is not None:
        args += ["--hosts", group.hosts]
    if group.parallel is not None:
        args += ["--parallel", group.parallel]
    if group.port is not None:
        args += ["--port", str(group.port)]
    if not group.split_vocab:
        args.append("--whole-vocab")
    return args


class _Protocol(asyncio.SubprocessProtocol):
    def __init__(self, proc: ChildProcess):
        self._proc = proc

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Comes before any pipe data, which can arrive (even a `ready`, with
        # requests dispatched on it) before subprocess_exec returns.
        self._proc.transport = transport
        self._proc.pid = transport.get_pid()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        try:
            if fd == 1:
                self._proc._stdout(data)
            else:
                self._proc.on_stderr(data)
        except Exception:
            # A bug met by one worker's output must not take the pool down;
            # the worker goes through the crash path, which answers its request.
            log.exception("pid=%s: handling the worker's output failed; killing it", self._proc.pid)
            self._proc.kill()

    def process_exited(self) -> None:
        try:
            self._proc._exited()
        except Exception:
            log.exception("pid=%s: handling the worker's exit failed", self._proc.pid)

    def pause_writing(self) -> None:
        # The request pipe is full: the worker is not reading it.
        self._proc.write_blocked_since = time.monotonic()

    def resume_writing(self) -> None:
        self._proc.write_blocked_since = None


class ChildProcess:
    def __init__(
        self,
        on_lines: Callable[[bytes], None],
        on_stderr: Callable[[bytes], None],
        on_exit: Callable[[int | None], None],
        on_overflow: Callable[[], None],
    ):
        self.on_lines = on_lines
        self.on_stderr = on_stderr
        self.on_exit = on_exit
        self.on_overflow = on_overflow
        self.transport: asyncio.SubprocessTransport | None = None
        self.pid: int | None = None
        self.returncode: int | None = None
        self.exited = asyncio.Event()
        self.started_at = time.monotonic()
        self.reading_paused = False
        self.write_blocked_since: float | None = None
        self._spawned = asyncio.Event()
        self._partial = b""
        self._dead = False

    async def start(self, argv: list[str], env: dict[str, str]) -> None:
        loop = asyncio.get_running_loop()
        try:
            self.transport, _ = await loop.subprocess_exec(
                lambda: _Protocol(self),
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                env=env,
            )
        finally:
            self._spawned.set()
        self.pid = self.transport.get_pid()
        self.started_at = time.monotonic()

    def _stdout(self, data: bytes) -> None:
        if self._dead:
            return
        buf = self._partial + data
        end = buf.rfind(b"\n") + 1
        self._partial = buf[end:]
        if len(self._partial) > MAX_WORKER_LINE:
            self._partial = b""
            self._dead = True
            self.on_overflow()
            return
        if end:
            self.on_lines(buf[:end])

    def _exited(self) -> None:
        # The exit status can arrive before the loop has read the last lines
        # the worker wrote; they are in the pipe now, so read them first.
        if not self._dead:
            self._drain(1, self._stdout)
        self._drain(2, self.on_stderr)
        # Lines the pipe transport has read already may still wait in the
        # loop's queue behind this call (asyncio queues a subprocess's
        # callbacks in the order it saw them, and can see the exit first):
        # the death is settled after them.
        asyncio.get_running_loop().call_soon(self._settle_exit)

    def _settle_exit(self) -> None:
        self._dead = True
        # A line cut off by the death is never relayed.
        self._partial = b""
        self.returncode = self.transport.get_returncode() if self.transport else None
        self.exited.set()
        self.on_exit(self.returncode)

    def _drain(self, fd: int, deliver: Callable[[bytes], None]) -> None:
        pipe = self.transport.get_pipe_transport(fd) if self.transport else None
        if pipe is None or pipe.is_closing():
            return
        fileno = pipe.get_extra_info("pipe").fileno()
        left = _EXIT_DRAIN_LIMIT
        while left > 0:
            try:
                data = os.read(fileno, min(left, 1 << 18))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if not data:
                return
            left -= len(data)
            deliver(data)

    def send(self, *msgs: ToWorker) -> bool:
        """Queues frames, in one write, without waiting: a worker that stops
        reading must not block the pool (the stall watchdog deals with it)."""
        if self._dead or self.transport is None:
            return False
        pipe = self.transport.get_pipe_transport(0)
        if pipe is None or pipe.is_closing():
            return False
        pipe.write(b"".join(encode_frame(msg) for msg in msgs))
        return True

    def pause_reading(self, paused: bool) -> None:
        self.reading_paused = paused
        if self.transport is None or self._dead:
            return
        pipe = self.transport.get_pipe_transport(1)
        if pipe is None or pipe.is_closing():
            return
        if paused:
            pipe.pause_reading()
        else:
            pipe.resume_reading()

    def signal_group(self, sig: int) -> None:
        # Also after the leader exited: the group id stays reserved while any
        # member lives, so this reaches leftover grandchildren, nobody else.
        if self.pid is None:
            return
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        self.signal_group(signal.SIGKILL)

    async def stop(self, timeout: float = 5.0) -> None:
        """EOF on the request pipe (the worker exits by itself), then SIGTERM,
        then SIGKILL to the whole group."""
        # Stopped while it was being spawned: let the spawn finish, or the
        # new process would be left running with nobody owning it.
        await self._spawned.wait()
        if self.transport is None:
            return
        pipe = self.transport.get_pipe_transport(0)
        if pipe is not None and not pipe.is_closing():
            pipe.close()
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None:
                self.signal_group(sig)
            try:
                await asyncio.wait_for(self.exited.wait(), timeout)
                break
            except TimeoutError:
                continue
        # Grandchildren may still hold the group; they go with it.
        self.signal_group(signal.SIGKILL)
        self.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
