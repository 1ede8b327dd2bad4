"""supervisor.slot.WorkerSlot driven without a subprocess: its child comes
from the injected factory, here an in-memory child that records what the
slot sends and hands the slot the lines a worker would write."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from pathlib import Path

from harness.procs import async_wait_for
from ipc.events import encode_done, encode_event, encode_token
from ipc.messages import Cancel, Generate, Stats
from supervisor.job import Job
from supervisor.policy import RestartPolicy
from supervisor.slot import WorkerSlot
from supervisor.spec import ModelSpec
from supervisor.states import State


class MemoryChild:
    """What a slot needs of supervisor.child.ChildProcess, in memory."""

    def __init__(self, on_lines, on_stderr, on_exit, on_overflow):
        self.on_lines, self.on_exit = on_lines, on_exit
        self.sent: list = []
        self.pid = 4242
        self.exited = asyncio.Event()
        self.started_at = 0.0
        self.reading_paused = False
        self.write_blocked_since = None

    async def start(self, argv: list[str], env: dict[str, str]) -> None:
        self.started_at = time.monotonic()

    def send(self, *msgs) -> bool:
        self.sent += msgs
        return True

    def pause_reading(self, paused: bool) -> None:
        self.reading_paused = paused

    def kill(self) -> None:
        self.exit(-9)

    def exit(self, code: int | None) -> None:
        self.exited.set()
        self.on_exit(code)

    def signal_group(self, sig) -> None:
        pass

    def close(self) -> None:
        pass

    async def stop(self) -> None:
        self.exit(0)


class Lines:
    def __init__(self):
        self.lines: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.lines += data.splitlines(keepends=True)


class Told:
    """The pool's side of SlotEvents: what the slot told it."""

    def __init__(self):
        self.ended: list[Job] = []
        self.done: list[int] = []
        self.idles = 0

    def request_ended(self, slot, job):
        self.ended.append(job)

    def request_done(self, slot, job, done):
        self.done.append(done.gen_tokens)

    def error_counted(self, slot, job, code):
        pass

    def adapter_event(self, slot, lora, specs, loaded):
        return False

    def restarted(self, slot):
        pass

    def idle(self, slot):
        self.idles += 1

    def worker_stderr(self, data):
        pass

    def spawn(self, coro):
        return asyncio.get_running_loop().create_task(coro)


def joined_slot(children: list, child=MemoryChild) -> WorkerSlot:
    """A slot of model "m" whose children (of type `child`) go to `children`."""
    spec = ModelSpec("m", Path("/nowhere"))
    slot = WorkerSlot(
        spec,
        Told(),
        Lines(),
        lambda: (["worker"], {}),
        RestartPolicy(),
        random.Random(0),
        child_factory=lambda *cb: children.append(child(*cb)) or children[-1],
    )
    slot.roster.join(spec)
    return slot


def test_a_slot_runs_requests_through_an_in_memory_child():
    """ready -> two requests sent in one write -> their token and done lines
    reach their sinks, the slot counts them and goes back to ready; stop
    cancels nothing (nothing in flight) and says unloaded."""

    async def main():
        children: list[MemoryChild] = []

        def factory(*callbacks):
            children.append(MemoryChild(*callbacks))
            return children[-1]

        spec = ModelSpec("m", Path("/nowhere"), max_batch=4)
        told, lines = Told(), Lines()
        slot = WorkerSlot(spec, told, lines, lambda: (["worker"], {}), RestartPolicy(), random.Random(0), child_factory=factory)
        slot.roster.join(spec)
        await slot.start("test")
        child = children[0]
        assert slot.state == State.LOADING and b'"ev":"loading"' in lines.lines[0]
        child.on_lines(encode_event("ready", model="m", load_ms=7, max_batch=2))
        assert slot.state == State.READY and slot.names[spec.name_key].up
        assert b'"ev":"ready"' in lines.lines[-1]

        sinks = [Lines(), Lines(), Lines()]
        jobs = [Job(Generate(rid=i, prompt="hi", id_json=f'"r{i}"'), spec, sinks[i]) for i in range(3)]
        for job in jobs:
            slot.traffic.submit(job)
        # max_batch 2 (the ready line's): two in flight, one queued.
        await async_wait_for(lambda: [m for m in child.sent if isinstance(m, Generate)], 5, message="the requests sent")
        assert [m.rid for m in child.sent if isinstance(m, Generate)] == [0, 1]
        assert slot.state == State.BUSY and slot.traffic.waiting(spec) == (1, 2)

        child.on_lines(encode_token("a", '"r1"') + encode_token("b", '"r0"'))
        child.on_lines(encode_done(tok_s=1.0, ttft_ms=1.0, prompt_tokens=1, gen_tokens=1, total_ms=1, id_json='"r0"'))
        assert sinks[0].lines[0] == encode_token("b", '"r0"') and sinks[1].lines == [encode_token("a", '"r1"')]
        assert told.ended == [jobs[0]] and told.done == [1] and slot.names[spec.name_key].served == 1
        # r0's end made room: r2 goes to the worker.
        await async_wait_for(lambda: any(isinstance(m, Generate) and m.rid == 2 for m in child.sent), 5, message="the queued request sent")

        assert slot.traffic.cancel('"r2"')
        assert any(isinstance(m, Cancel) and m.rid == 2 for m in child.sent)
        for rid in (1, 2):
            child.on_lines(encode_done(tok_s=0.0, ttft_ms=0.0, prompt_tokens=1, gen_tokens=0, total_ms=1, finish_reason="cancelled", id_json=f'"r{rid}"'))
        assert slot.state == State.READY and slot.traffic.idle and told.idles >= 1
        assert [len(s.lines) for s in sinks] == [2, 2, 1]

        await slot.stop("test over")
        assert slot.state == State.UNLOADED and b'"ev":"unloaded"' in lines.lines[-1]

    asyncio.run(main())


def test_stats_lines_answer_the_request_they_name():
    """A worker answers Stats on its reader thread, so a line measured while
    it loaded can reach the pool after `ready`: that line (weights_bytes 0)
    neither answers a later request nor replaces the figures of the ready
    worker."""

    async def main():
        children: list[MemoryChild] = []

        def factory(*callbacks):
            children.append(MemoryChild(*callbacks))
            return children[-1]

        spec = ModelSpec("m", Path("/nowhere"))
        slot = WorkerSlot(spec, Told(), Lines(), lambda: (["worker"], {}), RestartPolicy(), random.Random(0), child_factory=factory)
        slot.roster.join(spec)
        await slot.start("test")
        child = children[0]

        def asked() -> list[int]:
            return [m.seq for m in child.sent if isinstance(m, Stats)]

        loading_seq = slot.request_stats_nowait()
        child.on_lines(encode_event("ready", model="m", load_ms=7, weights_bytes=100))
        ready_seq = asked()[-1]
        fresh = asyncio.ensure_future(slot.fresh_stats(timeout=30))
        await async_wait_for(lambda: len(asked()) == 3, 5, message="status's Stats sent")
        status_seq = asked()[-1]
        assert loading_seq < ready_seq < status_seq

        child.on_lines(encode_event("worker_stats", model="m", weights_bytes=0, seq=loading_seq))
        assert slot.stats is None and not fresh.done()
        child.on_lines(encode_event("worker_stats", model="m", weights_bytes=100, rss_bytes=1, seq=ready_seq))
        await asyncio.sleep(0)
        assert slot.stats.weights_bytes == 100 and not fresh.done()
        child.on_lines(encode_event("worker_stats", model="m", weights_bytes=100, rss_bytes=2, seq=status_seq))
        assert (await fresh).rss_bytes == 2
        await slot.stop("test over")

    asyncio.run(main())


def test_a_status_a_worker_never_answers_leaves_no_waiter_behind():
    async def main():
        children: list[MemoryChild] = []
        slot = joined_slot(children)
        await slot.start("test")
        children[0].on_lines(encode_event("ready", model="m", load_ms=7))
        for _ in range(3):
            assert await slot.fresh_stats(timeout=0.01) is None
        assert slot._stats_waiters == []
        await slot.stop("test over")

    asyncio.run(main())


class SlowStopChild(MemoryChild):
    """A worker that takes its time to exit when told to stop."""

    def __init__(self, *callbacks):
        super().__init__(*callbacks)
        self.let_go = asyncio.Event()

    async def stop(self) -> None:
        await self.let_go.wait()
        self.exit(0)


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_ready_line_that_crosses_a_stop_is_no_warning():
    """A model unloaded (or the pool shut down) while it loads: the worker's
    ready line can arrive after the stop began. That is the normal race, so
    the slot keeps stopping and says so below WARNING; a ready line from a
    worker already ready is a fault, and warned."""

    async def main():
        children: list[SlowStopChild] = []

        def warned() -> list[str]:
            return [r.getMessage() for r in records.records if r.levelno >= logging.WARNING]

        records = Records()
        logger = logging.getLogger("lattice.worker")
        logger.addHandler(records)
        level = logger.level
        logger.setLevel(logging.INFO)
        try:
            slot = joined_slot(children, SlowStopChild)
            await slot.start("test")
            stopping = asyncio.get_running_loop().create_task(slot.stop("test over"))
            await async_wait_for(lambda: slot.state == State.STOPPING, 5, message="the stop begun")
            children[0].on_lines(encode_event("ready", model="m", load_ms=7))
            assert slot.state == State.STOPPING and warned() == []
            assert any("ready after its stop began" in r.getMessage() for r in records.records)
            children[0].let_go.set()
            await stopping
            assert slot.state == State.UNLOADED

            slot = joined_slot(children, SlowStopChild)
            await slot.start("test")
            children[1].on_lines(encode_event("ready", model="m", load_ms=7))
            assert slot.state == State.READY and warned() == []
            children[1].on_lines(encode_event("ready", model="m", load_ms=7))
            assert slot.state == State.READY
            assert len(warned()) == 1 and "a second ready line dropped" in warned()[0]
            children[1].let_go.set()
            await slot.stop("test over")
        finally:
            logger.removeHandler(records)
            logger.setLevel(level)

    asyncio.run(main())


def test_a_crash_s_last_message_keeps_its_head_under_a_flood_of_one_line():
    """A rank's exit was logged, then mlx's ring backend wrote a line per
    failed send: the crash reason kept only those lines. Repeats are said
    once with their count, and a long message keeps its head and its end."""
    from supervisor.stderr import LastMessage

    last = LastMessage(limit=300)
    last.feed(b"2026-12-07 12:00:00,000 ERROR worker model=two pid=7: rank 1 on 127.0.0.1, port 57945 exited (killed by signal 9)\n")
    last.feed(b"[ring] Sending to socket 10 failed with errno 32\n" * 50)
    text = last.text()
    assert text.startswith("2026-12-07 12:00:00,000 ERROR worker model=two pid=7: rank 1 on 127.0.0.1, port 57945")
    assert text.endswith("[ring] Sending to socket 10 failed with errno 32 (x50)") and len(text) <= 305

    last = LastMessage(limit=300)
    frames = "".join(f'  File "m{i}.py", line {i}, in f{i}\n' for i in range(40))
    last.feed(f"Traceback (most recent call last):\n{frames}ValueError: the cause\n".encode())
    text = last.text()
    assert text.startswith("Traceback (most recent call last):") and " ... " in text
    assert text.endswith("ValueError: the cause") and len(text) <= 305

    last = LastMessage()
    last.feed(b"lattice-pool worker: bad model dir\nValueError: shapes differ\n")
    assert last.text() == "lattice-pool worker: bad model dir ValueError: shapes differ"
