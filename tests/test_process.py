"""supervisor.child.ChildProcess in this process's own event loop, with
small scripted children instead of workers."""

from __future__ import annotations

import asyncio
import sys

from harness.procs import async_wait_for, child_env, pid_alive
from ipc.messages import Generate, Stats
from supervisor.child import ChildProcess


class Recorder:
    def __init__(self):
        self.lines: list[bytes] = []
        self.stderr = bytearray()
        self.exits: list[int | None] = []
        self.overflows = 0

    def process(self) -> ChildProcess:
        return ChildProcess(self.lines.append, self.stderr.extend, self.exits.append, self._overflow)

    def _overflow(self) -> None:
        self.overflows += 1


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_lines_written_before_death_are_delivered_and_the_cut_line_is_not():
    """Reading is paused (as under backpressure) while the child writes and
    dies, so its last lines are still in the pipe when the exit status
    arrives: they are read then, the unterminated tail is dropped."""

    async def main():
        rec = Recorder()
        proc = rec.process()
        await proc.start(python("import os; os.write(2, b'last words\\n'); os.write(1, b'one\\ntwo\\ncut'); os._exit(3)"), child_env())
        proc.pause_reading(True)
        await asyncio.wait_for(proc.exited.wait(), 30)
        proc.close()
        return rec

    rec = asyncio.run(main())
    assert b"".join(rec.lines) == b"one\ntwo\n"
    assert rec.exits == [3]
    assert bytes(rec.stderr) == b"last words\n"


def test_overlong_line_is_reported_once_and_never_delivered():
    async def main():
        rec = Recorder()
        proc = rec.process()
        code = "import os, signal; os.write(1, b'ok\\n'); os.write(1, b'x' * (5 << 20)); os.write(1, b'\\nafter\\n'); signal.pause()"
        await proc.start(python(code), child_env())
        await async_wait_for(lambda: rec.overflows, 30, message="the overflow report")
        proc.kill()
        await asyncio.wait_for(proc.exited.wait(), 30)
        proc.close()
        return rec

    rec = asyncio.run(main())
    assert rec.lines == [b"ok\n"] and rec.overflows == 1


def test_stop_while_spawning_waits_for_the_spawn():
    """stop() called before the spawn finished used to return at once,
    leaving the new process running with nobody owning it."""

    async def main():
        rec = Recorder()
        proc = rec.process()
        spawn = asyncio.ensure_future(proc.start(python("import sys; sys.stdin.read()"), child_env()))
        await asyncio.sleep(0)
        await asyncio.wait_for(proc.stop(timeout=5), 30)
        await spawn
        return proc

    proc = asyncio.run(main())
    assert proc.exited.is_set() and not pid_alive(proc.pid)


def test_a_full_request_pipe_is_noticed_without_blocking():
    """A child that never reads: sends return at once, and the time the pipe
    filled up is recorded for the watchdog."""

    async def main():
        rec = Recorder()
        proc = rec.process()
        await proc.start(python("import signal; signal.pause()"), child_env())
        assert proc.write_blocked_since is None
        for rid in range(4):
            assert proc.send(Generate(rid=rid, prompt="x" * 100_000))
        blocked = proc.write_blocked_since
        await proc.stop(timeout=2)
        return blocked

    assert asyncio.run(main()) is not None


def test_a_line_that_arrives_during_the_spawn_can_be_answered():
    """A fast child's first line is delivered before subprocess_exec returns;
    a request sent from that callback (as `ready` dispatches queued ones)
    used to be dropped as "pipe closed". The child answers once it has read
    four bytes."""

    async def main():
        answered = 0
        for _ in range(5):
            rec = Recorder()
            proc = rec.process()

            def on_lines(block: bytes) -> None:
                rec.lines.append(block)
                if block == b"ready\n":
                    proc.send(Stats())

            proc.on_lines = on_lines
            await proc.start(["/bin/sh", "-c", "echo ready; head -c 4 >/dev/null; echo got; cat >/dev/null"], child_env())
            await async_wait_for(lambda: b"got\n" in b"".join(rec.lines), 30, message="the child's answer")
            answered += 1
            await proc.stop(timeout=5)
        return answered

    assert asyncio.run(main()) == 5
