"""Rank 0 starts the other ranks of its group and watches them, as
`mlx.launch` does (docs/scaling.md): the same worker command for every
rank, with MLX_RANK and the backend's environment; a local rank as a child
process, a remote one through ssh.

Each rank is a child of rank 0 in rank 0's process group, so the pool's
kill of its worker's group reaches the local ranks and the ssh sessions of
the remote ones. A rank's stdin is its lifeline: it exits at EOF, which it
gets when rank 0 dies (or, remote, when its ssh session goes away). Its
stdout carries one `rank_stats` line per heartbeat interval (its pid and
measured memory); its stderr is relayed to rank 0's, and its last line is
the cause rank 0 quotes when that rank dies.

Rank 0 ends the group (exits, so the pool restarts it) when a rank dies,
when a rank is silent for `timeout`, and when one step waits on the group
for `timeout`. A rank that fails before the group is ready with exit code
78, an ssh that cannot reach its host, or a rank that does not get ready to
join within `timeout` fails the model (78): a restart would fail the same
way.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from ipc.events import PREFIX
from ipc.worker_events import EX_CONFIG, FATAL_PREFIX, LOG_RECORD, RankFigures, event_body, event_name
from worker.group.model import abort
from worker.group.plan import EX_TEMPFAIL, GroupPlan, Host

RANK_STATS = "rank_stats"
# A rank says it is about to join the group (worker.group.model.join says why).
RANK_JOINING = "rank_joining"
# ssh exits 255 when it cannot connect or authenticate.
SSH_FAILED = 255
# Where the worker package lives here; a remote host must have it at the
# same path (as mlx.launch expects the same layout on every host).
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
# What a remote rank gets of this environment besides the group's own.
REMOTE_ENV = ("LATTICE_LOG_LEVEL", "OPENBLAS_NUM_THREADS", "MLX_RING_VERBOSE")
SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3")

# How long a failed collective waits for the death of a rank to be seen.
LOST_GRACE = 3.0

_figures = msgspec.json.Decoder(RankFigures)


def describe_exit(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


@dataclass
class Rank:
    """One rank rank 0 started."""

    rank: int
    host: Host
    proc: subprocess.Popen
    last_heard: float = field(default_factory=time.monotonic)
    figures: RankFigures | None = None
    tail: str = ""  # its last stderr line that is not a log record
    stderr_done: threading.Event = field(default_factory=threading.Event)
    joining: threading.Event = field(default_factory=threading.Event)


class Launcher:
    def __init__(self, plan: GroupPlan, argv: list[str], timeout: float, step_since: Callable[[], float | None] = lambda: None):
        self.plan = plan
        self.argv = argv
        self.timeout = timeout
        self.step_since = step_since  # when rank 0's current step began waiting on the group
        self.ports: list[int] = []
        self.ranks: list[Rank] = []
        self.formed = False
        self.ready = False

    def describe(self, rank: int) -> str:
        return self.plan.describe(rank, self.ports)

    def start(self) -> None:
        """Sets rank 0's own environment and starts the other ranks; call it
        on the main thread: a local rank dies with the thread that forked it
        (PR_SET_PDEATHSIG), and the main thread lasts as long as rank 0."""
        self.ports = self.plan.ports()
        shared = self.plan.shared_env(self.ports)
        os.environ.update(self.plan.rank_env(0, shared))
        for rank in range(1, self.plan.ranks):
            self.ranks.append(self._spawn(rank, self.plan.rank_env(rank, shared)))
        threading.Thread(target=self._watch, name="group-watch", daemon=True).start()

    def _spawn(self, rank: int, env: dict[str, str]) -> Rank:
        host = self.plan.hosts[rank]
        command = [sys.executable, "-m", "worker", *self.argv]
        if host.local:
            # The lifeline checks that its parent is still this process.
            argv, full_env = command, {**os.environ, **env, "LATTICE_SUPERVISOR_PID": str(os.getpid())}
        else:
            remote = {k: os.environ[k] for k in REMOTE_ENV if k in os.environ}
            remote.update(env, PYTHONPATH=str(PACKAGE_ROOT), PYTHONUNBUFFERED="1")
            script = (
                f"cd {shlex.quote(str(PACKAGE_ROOT))} && exec env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in remote.items()) + " " + shlex.join(command)
            )
            argv, full_env = ["ssh", *SSH_OPTIONS, host.ssh, script], None
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full_env)
        except OSError as exc:
            abort(f"cannot start {self.describe(rank)}: {exc}", EX_CONFIG if exc.filename == "ssh" else EX_TEMPFAIL)
        r = Rank(rank, host, proc)
        threading.Thread(target=self._read_stdout, args=(r,), name=f"rank{rank}-out", daemon=True).start()
        threading.Thread(target=self._read_stderr, args=(r,), name=f"rank{rank}-err", daemon=True).start()
        return r

    def wait_joining(self) -> None:
        """Returns once every other rank is about to join the group. A rank
        that dies meanwhile ends this process (_lost), one that does not get
        there within `timeout` too."""
        deadline = time.monotonic() + self.timeout
        for r in self.ranks:
            if not r.joining.wait(max(0.0, deadline - time.monotonic())):
                abort(f"{self.describe(r.rank)} did not get ready to join the group within {self.timeout:g}s", EX_CONFIG)

    # -- each rank's pipes -------------------------------------------------------

    def _read_stdout(self, r: Rank) -> None:
        for line in r.proc.stdout:
            r.last_heard = time.monotonic()
            name = event_name(line) if line.startswith(PREFIX) else ""
            if name == RANK_STATS:
                try:
                    r.figures = _figures.decode(event_body(line))
                except msgspec.DecodeError:
                    pass
            elif name == RANK_JOINING:
                r.joining.set()
        self._lost(r)

    def _read_stderr(self, r: Rank) -> None:
        for line in r.proc.stderr:
            try:
                # A line cut off by the rank's death still ends here: this
                # process's own last message must start a line of its own,
                # where the pool looks for it.
                os.write(2, line if line.endswith(b"\n") else line + b"\n")
            except OSError:
                pass
            text = line.decode("utf-8", "replace").strip()
            # A log record is progress, never the cause of a rank's death,
            # which is what it says otherwise (its fatal message, a
            # traceback's exception).
            if text and not LOG_RECORD.match(text):
                r.tail = text
        r.stderr_done.set()

    def _lost(self, r: Rank) -> None:
        """Its stdout closed: it died (or its ssh session did)."""
        try:
            code = r.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            r.proc.kill()
            code = r.proc.wait()
        r.stderr_done.wait(2)
        cause = r.tail.removeprefix(FATAL_PREFIX)
        what = self.describe(r.rank)
        if not self.ready and code == EX_CONFIG:
            # A rank's own group errors already say which rank it is.
            abort(cause if cause.startswith(what) else f"{what}: {cause}", EX_CONFIG)
        if not self.ready and not r.host.local and code == SSH_FAILED:
            abort(f"cannot reach {r.host.ssh} over ssh for rank {r.rank}: {cause or 'ssh failed'}", EX_CONFIG)
        abort(f"{what} exited ({describe_exit(code)}{'; ' + cause if cause else ''}); the group restarts")

    # -- watch ---------------------------------------------------------------------

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            now = time.monotonic()
            if not self.formed:
                continue  # wait_joining watches the start
            for r in self.ranks:
                if now - r.last_heard > self.timeout:
                    abort(f"{self.describe(r.rank)} has been silent for {now - r.last_heard:.0f}s; the group restarts")
            since = self.step_since()
            if since is not None and now - since > self.timeout:
                abort(f"rank 0 has waited {now - since:.0f}s for the other ranks in one step; the group restarts")

    def broken(self, cause: str) -> None:
        """The group failed under rank 0 (a collective, a step): most likely
        a rank died, so its reader gets a moment to end this process with
        that rank's cause; else `cause` ends it."""
        time.sleep(LOST_GRACE)
        abort(cause)

    def figures(self) -> list[RankFigures]:
        """Each other rank's last report (pid and memory), in rank order."""
        return [r.figures or RankFigures(rank=r.rank, host=r.host.name, pid=r.proc.pid if r.host.local else None) for r in self.ranks]
