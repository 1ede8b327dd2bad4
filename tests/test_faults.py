"""Fault injection with fake workers (tests.fakeworker) behind a real
`lattice-pool serve`: crashes, hangs, floods, partial and over-long lines,
grandchildren holding pipes, workers that stop reading, boot failures."""

from __future__ import annotations

import os
import signal
import subprocess
import threading

import psutil
import pytest

from harness.fakes import FAKE_ENV, FakeModels
from harness.pool import RawPool, stalled
from harness.procs import pid_alive, said, wait_for

PARTIAL = '@@lattice {"ev":"gen_token","token":"cut off'


@pytest.fixture
def fakes(tmp_path):
    return FakeModels(tmp_path)


@pytest.fixture
def fake_pool(fakes, spawn_pool):
    def start(extra: str = "", preload: bool = True):
        return spawn_pool("--config", fakes.config("heartbeat_interval = 0.1\n" + extra, preload), env=FAKE_ENV)

    return start


def tokens_of(pool, request_id) -> list[dict]:
    return [e for e in pool.of(request_id) if e["ev"] == "gen_token" and not e["done"]]


class TestCrash:
    def test_mid_stream_crash_ends_the_request_and_the_worker_restarts(self, fakes, fake_pool):
        """A worker killed after 3 tokens: the request ends with worker_crashed
        naming model and signal, the line cut off by the death is never
        relayed, `restarting` comes with attempt and delay (none: a first
        crash restarts at once), and the next request runs on the new worker."""
        fakes.add("a", [{"crash_after": 3, "partial": PARTIAL}, {}])
        pool = fake_pool()
        first = pool.wait_ev("ready", model="a")
        pool.send({"model": "a", "id": "r1", "prompt": "x", "max_tokens": 10})
        err = pool.terminal("r1")
        assert err["ev"] == "error" and err["code"] == "worker_crashed"
        assert "'a'" in err["msg"] and "SIGKILL" in err["msg"]
        assert len(tokens_of(pool, "r1")) == 3
        restarting = pool.wait_ev("restarting", model="a")
        assert restarting["attempt"] == 1 and restarting["delay_s"] == 0
        second = pool.wait_ev("ready", model="a")
        assert second["pid"] != first["pid"] and not pid_alive(first["pid"])
        pool.send({"model": "a", "id": "r2", "prompt": "x", "max_tokens": 5})
        assert pool.terminal("r2")["gen_tokens"] == 5
        assert pool.close() == 0
        assert not any(b"cut off" in e["_line"] for e in pool.events)

    def test_exit_code_is_named(self, fakes, fake_pool):
        fakes.add("a", [{"crash_after": 2, "crash_code": 3}, {}])
        pool = fake_pool()
        pool.send({"model": "a", "id": "r1", "prompt": "x", "max_tokens": 10})
        err = pool.terminal("r1")
        assert err["code"] == "worker_crashed" and "exit code 3" in err["msg"]
        assert pool.close() == 0

    def test_crash_before_the_first_token_is_retried_once(self, fakes, fake_pool):
        """Nothing reached the client, so the retry is invisible: one clean stream."""
        fakes.add("a", [{"crash_after": 0}, {}])
        pool = fake_pool()
        pool.send({"model": "a", "id": "r1", "prompt": "x", "max_tokens": 6})
        done = pool.terminal("r1")
        assert done["ev"] == "gen_token" and done["gen_tokens"] == 6
        assert len(tokens_of(pool, "r1")) == 6
        assert len(fakes.starts("a")) == 2
        assert pool.close() == 0

    def test_second_crash_before_a_token_ends_the_request(self, fakes, fake_pool):
        fakes.add("a", [{"crash_after": 0}, {"crash_after": 0}, {}])
        pool = fake_pool()
        pool.send({"model": "a", "id": "r1", "prompt": "x", "max_tokens": 6})
        err = pool.terminal("r1")
        assert err["code"] == "worker_crashed" and not tokens_of(pool, "r1")
        assert len(fakes.starts("a")) == 2
        pool.send({"model": "a", "id": "r2", "prompt": "x", "max_tokens": 2})
        assert pool.terminal("r2")["gen_tokens"] == 2
        assert pool.close() == 0

    def test_queued_requests_survive_the_restart(self, fakes, fake_pool):
        fakes.add("a", [{"crash_after": 2}, {}])
        pool = fake_pool()
        for i in range(1, 4):
            pool.send({"model": "a", "id": i, "prompt": "x", "max_tokens": 4})
        assert pool.terminal(1)["code"] == "worker_crashed"
        assert pool.terminal(2)["gen_tokens"] == 4 and pool.terminal(3)["gen_tokens"] == 4
        assert len(fakes.starts("a")) == 2
        assert pool.close() == 0

    def test_idle_crash_restarts_and_other_models_keep_serving(self, fakes, fake_pool):
        fakes.add("a", [{"exit_after_ready": 1}, {}])
        fakes.add("b", {"token_interval": 0.01})
        pool = fake_pool()
        pool.wait_ev("ready", model="b")
        pool.send({"model": "b", "id": "long", "prompt": "x", "max_tokens": 100})
        restarting = pool.wait_ev("restarting", model="a")
        assert "exit code 1" in restarting["reason"]
        pool.wait_ev("ready", model="a")
        assert pool.terminal("long")["gen_tokens"] == 100
        assert pool.close() == 0


class TestDeathDetection:
    def test_a_grandchild_holding_the_pipes_does_not_hide_a_death(self, fakes, fake_pool):
        """Regression guard for cpython #119710: Process.wait() on 3.11 waits
        for every pipe to close, so a grandchild holding stdout would hide the
        death for as long as it lives (here 600 s). The exit status is used
        instead, and the grandchild goes with the worker's process group."""
        fakes.add("a", [{"grandchild": True, "crash_after": 1}, {}])
        pool = fake_pool()
        ready = pool.wait_ev("ready", model="a")
        assert pid_alive(ready["grandchild_pid"])
        pool.send({"model": "a", "id": "r1", "prompt": "x", "max_tokens": 5})
        assert pool.terminal("r1", timeout=30)["code"] == "worker_crashed"
        pool.wait_ev("ready", model="a", timeout=30)
        wait_for(lambda: not pid_alive(ready["grandchild_pid"]), 10, message="the grandchild to be killed")
        assert pool.close() == 0

    def test_last_lines_before_a_death_are_relayed(self, fakes, fake_pool):
        """The exit status can be seen before the last lines are read; they
        are read first, so a request that finished right before the crash
        keeps its done line."""
        fakes.add("a", [{"tokens": 2000, "crash_after": 2000}, {}])
        pool = fake_pool()
        pool.send({"model": "a", "id": "r1", "prompt": "x", "max_tokens": 2000})
        err = pool.terminal("r1")
        assert err["code"] == "worker_crashed"
        assert len(tokens_of(pool, "r1")) == 2000
        assert pool.close() == 0


class TestWatchdog:
    def test_a_hung_busy_worker_is_killed_and_restarted(self, fakes, fake_pool):
        fakes.add("a", [{"hang_after": 2}, {}])
        pool = fake_pool("stall_timeout = 2")
        pool.send({"model": "a", "id": "r1", "prompt": "x", "max_tokens": 5})
        err = pool.terminal("r1", timeout=60)
        assert err["code"] == "worker_crashed" and "no event or heartbeat" in err["msg"]
        assert len(tokens_of(pool, "r1")) == 2
        pool.wait_ev("ready", model="a")
        pool.send({"model": "a", "id": "r2", "prompt": "x", "max_tokens": 5})
        assert pool.terminal("r2")["gen_tokens"] == 5
        assert pool.close() == 0

    def test_a_loading_worker_is_killed_only_when_it_goes_silent(self, fakes, fake_pool):
        """Loading for 3x the stall timeout is fine while loading events and
        heartbeats come; a silent load is killed and restarted."""
        fakes.add("slow", {"load_delay": 6})
        fakes.add("silent", [{"load_delay": 600, "load_silent": True}, {}])
        pool = fake_pool("stall_timeout = 2")
        restarting = pool.wait_ev("restarting", model="silent", timeout=60)
        assert "no event or heartbeat" in restarting["reason"]
        pool.wait_ev("ready", model="silent")
        pool.wait_ev("ready", model="slow", timeout=60)
        assert len(fakes.starts("slow")) == 1
        assert not [e for e in pool.events if e["ev"] in ("restarting", "failed") and e["model"] == "slow"]
        assert pool.close() == 0

    @pytest.mark.parametrize(
        "prompt, reason",
        [
            # The frame does not fit the pipe: the pipe stays full.
            ("x" * (1 << 20), "has not read its request pipe"),
            # It fits: heartbeats go on, saying idle although a request was sent.
            ("x", "heartbeats say idle"),
        ],
    )
    def test_a_worker_that_stops_reading_its_pipe_cannot_block_the_pool(self, fakes, fake_pool, prompt, reason):
        """Sends never wait, other models keep serving, and the worker is
        restarted after the stall timeout although it still sends heartbeats."""
        fakes.add("a", [{"stop_reading": True}, {}])
        fakes.add("b")
        pool = fake_pool("stall_timeout = 2")
        pool.wait_ev("ready", model="a")
        pool.send({"model": "a", "id": "stuck", "prompt": prompt, "max_tokens": 3})
        pool.send({"model": "b", "id": "other", "prompt": "x", "max_tokens": 3})
        assert pool.terminal("other")["gen_tokens"] == 3
        restarting = pool.wait_ev("restarting", model="a", timeout=60)
        assert reason in restarting["reason"]
        assert pool.terminal("stuck")["gen_tokens"] == 3
        assert pool.close() == 0


class TestFloods:
    def test_a_flood_is_relayed_byte_for_byte(self, fakes, fake_pool):
        fakes.add("a", {"tokens": 200_000, "token": "fl\u00f6\u00f6d \\"})
        pool = fake_pool()
        pool.send({"model": "a", "id": "f", "prompt": "x", "max_tokens": 1})
        assert pool.terminal("f")["gen_tokens"] == 200_000
        lines = [e["_line"] for e in tokens_of(pool, "f")]
        assert len(lines) == 200_000
        assert set(lines) == {'@@lattice {"ev":"gen_token","token":"fl\u00f6\u00f6d \\\\","done":false,"id":"f"}\n'.encode()}
        assert pool.close() == 0

    def test_an_overlong_line_is_an_error_and_a_restart(self, fakes, fake_pool):
        fakes.add("a", [{"long_line": 5 << 20}, {"long_line": 5 << 20}, {}])
        pool = fake_pool()
        pool.send({"model": "a", "id": "r1", "prompt": "x", "max_tokens": 3})
        err = pool.terminal("r1")
        assert err["code"] == "worker_crashed" and "longer than" in err["msg"]
        assert "longer than" in pool.wait_ev("restarting", model="a")["reason"]
        pool.send({"model": "a", "id": "r2", "prompt": "x", "max_tokens": 3})
        assert pool.terminal("r2")["gen_tokens"] == 3
        assert len(fakes.starts("a")) == 3
        assert pool.close() == 0

    def test_a_slow_client_bounds_memory_and_is_not_taken_for_a_stall(self, fakes):
        """The client stops reading while a worker floods ~40 MB: the pool
        stops reading the worker (its writes block), keeps its own memory to
        the output buffer, and does not kill the worker as stalled although
        nothing is heard from it for many stall timeouts (and its last
        heartbeats, from before the request started, said idle)."""
        fakes.add("a", {"tokens": 800_000, "start_delay": 0.3})
        pool = RawPool(fakes.config("heartbeat_interval = 0.1\nstall_timeout = 0.5\n"), env=FAKE_ENV)
        try:
            ready = pool.read_until(b'"ev":"ready"')
            supervisor, worker = psutil.Process(pool.proc.pid), psutil.Process(ready["pid"])
            before = supervisor.memory_info().rss
            pool.send({"model": "a", "id": "f", "prompt": "x", "max_tokens": 1})
            sent_at = len(pool.out)
            wait_for(stalled(worker, "write_chars", 6 * 0.5), 60, message="the worker's writes to block")
            grown = supervisor.memory_info().rss - before
            done = pool.read_until(b'"done":true')
            assert pool.close() == 0
        finally:
            pool.kill()
        assert done["id"] == "f" and done["gen_tokens"] == 800_000
        assert pool.out.count(b'"done":false,"id":"f"}\n') == 800_000
        assert b'"restarting"' not in pool.out[sent_at:] and b"worker_crashed" not in pool.out
        assert grown < 16 << 20, f"supervisor RSS grew by {grown} bytes"

    def test_a_stderr_flood_with_an_unread_stderr_neither_blocks_nor_grows(self, fakes):
        """Nobody reads the pool's stderr; a worker writes 32 MB to its own.
        Requests go on, and the pool keeps a bounded backlog, dropping the rest."""
        fakes.add("a", {"request_stderr": 32 << 20})
        pool = RawPool(fakes.config("heartbeat_interval = 0.1"), stderr=subprocess.PIPE, env=FAKE_ENV)
        try:
            pool.read_until(b'"ev":"ready"')
            supervisor = psutil.Process(pool.proc.pid)
            before = supervisor.memory_info().rss
            pool.send({"model": "a", "id": "r1", "prompt": "x", "max_tokens": 3})
            assert pool.read_until(b'"done":true')["id"] == "r1"
            grown = supervisor.memory_info().rss - before
            assert grown < 16 << 20, f"supervisor RSS grew by {grown} bytes"
            pool.send({"model": "a", "id": "r2", "prompt": "x", "max_tokens": 3})
            assert pool.read_until(b'"done":true')["id"] == "r2"
            stderr = bytearray()

            def read_stderr() -> None:
                while chunk := os.read(pool.proc.stderr.fileno(), 1 << 20):
                    stderr.extend(chunk)

            reader = threading.Thread(target=read_stderr)
            reader.start()
            said(stderr, b"stderr writes dropped", 30)
            assert pool.close() == 0
            reader.join(30)
        finally:
            pool.kill()


class TestGivingUp:
    def test_exit_78_fails_at_once_and_an_explicit_load_resets_it(self, fakes, fake_pool):
        fakes.add("a", [{"boot_exit": 78}, {}])
        pool = fake_pool(preload=False)
        pool.send({"model": "a", "id": "r0", "prompt": "x"})
        failed = pool.wait_ev("failed", model="a")
        assert "78" in failed["reason"] and "failing at boot" in failed["reason"]
        assert pool.terminal("r0")["code"] == "load_failed"
        pool.send({"model": "a", "id": "r1", "prompt": "x"})
        assert pool.terminal("r1")["code"] == "model_failed"
        assert len(fakes.starts("a")) == 1
        pool.send({"op": "load", "model": "a"})
        pool.wait_ev("ready", model="a")
        pool.send({"model": "a", "id": "r2", "prompt": "x", "max_tokens": 2})
        assert pool.terminal("r2")["gen_tokens"] == 2
        assert pool.close() == 0

    def test_the_cause_of_a_failed_start_keeps_all_its_lines(self, fakes, fake_pool):
        """`last stderr` kept only the last line of a message written at once."""
        message = "lattice-pool worker: bad model dir: cannot load it:\nValueError: shapes differ\n  (4, 8) vs (8, 4)\n"
        fakes.add("a", {"boot_exit": 78, "boot_message": message})
        pool = fake_pool()
        failed = pool.wait_ev("failed", model="a")
        assert "last stderr: lattice-pool worker: bad model dir: cannot load it: ValueError: shapes differ (4, 8) vs (8, 4)" in failed["reason"]
        assert pool.close() == 0

    def test_errors_name_the_model_as_the_request_named_it(self, fakes, spawn_pool):
        """Two names for one model dir share one worker; an error named the
        name that happened to start it."""
        path = fakes.add("dir", {"boot_exit": 78})
        config = fakes.root / "aliases.toml"
        config.write_text(f'[[models]]\nname = "first"\npath = "{path}"\n\n[[models]]\nname = "second"\npath = "{path}"\n')
        pool = spawn_pool("--config", str(config), env=FAKE_ENV)
        pool.send({"model": "first", "id": "r1", "prompt": "x"})
        assert "model 'first' failed" in pool.terminal("r1")["msg"]
        pool.send({"model": "second", "id": "r2", "prompt": "x"})
        err = pool.terminal("r2")
        assert err["code"] == "model_failed" and "model 'second' has failed" in err["msg"]
        assert pool.close() == 0

    def test_a_crash_loop_ends_in_failed_while_other_models_serve(self, fakes, fake_pool):
        """Six crashes at boot within 300 s: the first restarts at once, the
        next four after doubling, jittered delays, then `failed`; requests get
        model_failed until a load."""
        fakes.add("a", [{"boot_exit": 1}] * 6 + [{}])
        fakes.add("b", {"token_interval": 0.01})
        pool = fake_pool()
        pool.send({"model": "b", "id": "steady", "prompt": "x", "max_tokens": 1000})
        restarts = [pool.wait_ev("restarting", model="a", timeout=60) for _ in range(5)]
        assert [r["attempt"] for r in restarts] == [1, 2, 3, 4, 5]
        assert restarts[0]["delay_s"] == 0
        for n, r in enumerate(restarts[1:]):
            assert 0.8 * 0.5 * 2**n <= r["delay_s"] <= 1.2 * 0.5 * 2**n
        failed = pool.wait_ev("failed", model="a", timeout=60)
        assert "6 crashes within 300s" in failed["reason"]
        pool.send({"model": "a", "id": "r1", "prompt": "x"})
        assert pool.terminal("r1")["code"] == "model_failed"
        assert pool.terminal("steady")["gen_tokens"] == 1000
        crashed = set(fakes.starts("a"))
        assert len(crashed) == 6
        pool.send({"op": "load", "model": "a"})
        pool.wait_for(lambda e: e["ev"] == "ready" and e["model"] == "a" and e["pid"] not in crashed)
        pool.send({"model": "a", "id": "r2", "prompt": "x", "max_tokens": 2})
        assert pool.terminal("r2")["gen_tokens"] == 2
        assert pool.close() == 0


class TestShutdown:
    def test_a_load_at_eof_does_not_spend_the_grace_of_the_requests_waiting_for_it(self, fakes, fake_pool):
        """`echo REQUEST | serve` where the model loads for longer than the
        grace period (a first start with no compiled kernels): the request
        is answered. The grace then counts from the end of the load: a
        request still running a grace period later is cancelled."""
        fakes.add("slow", {"load_delay": 4})
        fakes.add("steady", {"token_interval": 0.01})
        pool = fake_pool("shutdown_grace = 1")
        pool.wait_ev("ready", model="steady")
        pool.send({"model": "steady", "id": "endless", "prompt": "x", "max_tokens": 1_000_000})
        pool.send({"model": "slow", "id": "waits", "prompt": "x", "max_tokens": 3})
        pool.wait_for(lambda e: e.get("id") == "endless")
        assert pool.close() == 0
        assert pool.terminal("waits")["gen_tokens"] == 3
        assert pool.terminal("endless")["finish_reason"] == "cancelled"
        ready = next(i for i, e in enumerate(pool.events) if e["ev"] == "ready" and e["model"] == "slow")
        assert pool.events.index(pool.terminal("endless")) > ready


class TestNoOrphans:
    def test_shutdown_kills_a_worker_that_ignores_sigterm_and_eof(self, fakes, fake_pool):
        fakes.add("a", {"ignore_sigterm": True, "ignore_eof": True, "grandchild": True})
        pool = fake_pool("shutdown_grace = 0")
        ready = pool.wait_ev("ready", model="a")
        pool.proc.send_signal(signal.SIGTERM)
        assert pool.close() == 0
        assert not pid_alive(ready["pid"]) and not pid_alive(ready["grandchild_pid"])

    def test_supervisor_sigkill_leaves_no_worker_20_rounds(self, fakes, spawn_pool):
        """loky's leak test: SIGKILL the supervisor with one worker busy and
        one idle; both go (PDEATHSIG, pipe EOF). Twenty rounds."""
        fakes.add("a", {"token_interval": 0.001})
        fakes.add("b")
        config = fakes.config("heartbeat_interval = 0.1")
        for _ in range(20):
            pool = spawn_pool("--config", config, env=FAKE_ENV)
            pids = [pool.wait_ev("ready", model=m)["pid"] for m in ("a", "b")]
            pool.send({"model": "a", "id": "busy", "prompt": "x", "max_tokens": 1_000_000})
            pool.wait_for(lambda e: e.get("id") == "busy")
            pool.proc.kill()
            pool.proc.wait()
            wait_for(lambda: not any(pid_alive(p) for p in pids), 10, message=f"workers {pids} to die with their supervisor")
            pool.kill()
        assert fakes.all_gone()

    def test_a_model_unloaded_while_waiting_for_an_eviction_never_starts(self, fakes, fake_pool):
        """Under max_loaded = 1, b's admission waits while idle a is evicted
        (slowly: a ignores EOF, so it takes a SIGTERM). b is unloaded during
        that wait; its admission must not start a worker nobody owns."""
        fakes.add("a", {"ignore_eof": True})
        fakes.add("b")
        pool = fake_pool("max_loaded = 1", preload=False)
        pool.send({"model": "a", "id": "r1", "prompt": "x", "max_tokens": 1})
        pool.terminal("r1")
        pool.send({"model": "b", "id": "r2", "prompt": "x", "max_tokens": 1})
        said(pool.stderr, b"evicted to make room", 30)
        pool.send({"op": "unload", "model": "b"})
        assert pool.terminal("r2")["code"] == "unloaded"
        pool.wait_ev("unloaded", model="a", timeout=30)
        pool.send({"op": "status"})
        assert [row["model"] for row in pool.wait_ev("status")["models"]] == []
        assert pool.close() == 0
        assert fakes.starts("b") == []


class TestMalformedOutput:
    GARBAGE = [
        "hello from a stray print\n",
        '@@lattice {"ev":"loading",broken}\n',
        '@@lattice {"ev":"gen_tok\n',
        '@@lattice {"ev":"loading","model":"\xff"}\n',
        '@@lattice {"ev":"mystery","model":"a"}\n',
    ]

    def test_only_well_formed_lines_reach_the_client(self, fakes, fake_pool):
        """Lines that are not events, or not JSON objects, or not UTF-8 are
        dropped and logged; a well-formed event of an unknown kind passes."""
        fakes.add("a", {"garbage": self.GARBAGE})
        pool = fake_pool()
        pool.send({"model": "a", "id": "r1", "prompt": "x", "max_tokens": 3})
        assert pool.terminal("r1")["gen_tokens"] == 3
        pool.send({"model": "a", "id": "r2", "prompt": "x", "max_tokens": 3})
        assert pool.terminal("r2")["gen_tokens"] == 3
        assert pool.close() == 0
        assert [e["ev"] for e in pool.events if e["ev"] not in ("gen_token", "loading", "ready", "unloaded")] == ["mystery", "mystery"]
        assert pool.stderr.count(b"malformed line from the worker dropped") == 8
        assert b"restarting" not in b"".join(e["_line"] for e in pool.events)

    @pytest.mark.parametrize(
        "starts, reason",
        [
            # Tokens reached the client first: no retry.
            ([{"bad_final": True}, {}], "malformed final line"),
            # Nothing did: one retry, broken again.
            ([{"garbage": ['@@lattice {"ev":"error","msg":3,"code":[]}\n'], "tokens": 0}] * 2 + [{}], "malformed error line"),
        ],
    )
    def test_a_terminal_line_of_the_wrong_shape_ends_the_request_once(self, fakes, fake_pool, starts, reason):
        """The worker is killed as broken; its request still gets one terminal."""
        fakes.add("a", starts)
        pool = fake_pool()
        pool.send({"model": "a", "id": "r1", "prompt": "x", "max_tokens": 3})
        err = pool.terminal("r1")
        assert err["code"] == "worker_crashed" and reason in err["msg"]
        pool.send({"model": "a", "id": "r2", "prompt": "x", "max_tokens": 3})
        assert pool.terminal("r2")["gen_tokens"] == 3
        assert len(fakes.starts("a")) == len(starts)
        assert pool.close() == 0


class TestOpsDuringRecovery:
    def test_unload_during_backoff_and_load_during_loading_spawn_nothing_extra(self, fakes, fake_pool):
        """Unloaded while waiting to restart (the second crash in a row, so
        with backoff): no restart comes. Loaded twice while loading (slowly,
        for longer than that backoff): one worker."""
        fakes.add("a", [{"exit_after_ready": 1}, {"exit_after_ready": 1}, {"load_delay": 2}])
        pool = fake_pool()
        assert pool.wait_ev("restarting", model="a")["delay_s"] == 0
        restarting = pool.wait_ev("restarting", model="a")
        assert restarting["delay_s"] > 0
        pool.send({"op": "unload", "model": "a"})
        pool.wait_ev("unloaded", model="a")
        pool.send({"op": "load", "model": "a"})
        pool.send({"op": "load", "model": "a"})
        pool.send({"model": "a", "id": "r1", "prompt": "x", "max_tokens": 2})
        ready = pool.wait_for(lambda e: e["ev"] == "ready" and e["load_ms"] == 2000)
        assert restarting["delay_s"] < 2
        assert pool.terminal("r1")["gen_tokens"] == 2
        assert fakes.starts("a") == [*fakes.starts("a")[:2], ready["pid"]]
        assert pool.close() == 0


class TestClientBackpressure:
    def test_a_client_that_sends_without_reading_is_held_back(self, fakes):
        """150,000 invalid lines and nothing read back: once its output
        buffer is full the pool stops reading stdin, so the client waits in
        its write and the pool's memory stays bounded; then every line still
        gets its error."""
        fakes.add("a")
        pool = RawPool(fakes.config("heartbeat_interval = 60"), env=FAKE_ENV)
        total = 150_000
        try:
            pool.read_until(b'"ev":"ready"')
            writer, grown = pool.flood(b"".join(b'{"prompt": 1, "id": %d}\n' % i for i in range(total)))
            assert writer.is_alive(), "the client was never held back"
            assert grown < 10 << 20, f"supervisor RSS grew by {grown} bytes"
            pool.finish_flood(writer)
        finally:
            pool.kill()
        assert pool.out.count(b'"code":"bad_request"') == total


class TestBatching:
    """max_batch requests in flight at a worker (this fake serves them one
    after another, or `together` as a batching worker does)."""

    @staticmethod
    def send_together(pool, requests: list[dict]) -> None:
        # One write: the pool reads them at once and sends the worker as
        # many as max_batch allows before it reads anything back.
        pool.send(b"".join(pool.line(r) for r in requests))
        pool.sent_ids += [r["id"] for r in requests]

    def test_a_crash_mid_batch_retries_only_what_emitted_nothing(self, fakes, fake_pool):
        """r1 streams, r2 and r3 are in flight behind it, r4 waits in the
        pool; the worker dies after 2 tokens of r1. r1 ends worker_crashed;
        r2 and r3 are retried invisibly; r4 waits for the restart."""
        fakes.add("a", [{"crash_after": 2}, {}])
        pool = fake_pool("max_batch = 3")
        pool.wait_ev("ready", model="a")
        self.send_together(pool, [{"model": "a", "id": i, "prompt": "x", "max_tokens": 4} for i in range(1, 5)])
        assert pool.terminal(1)["code"] == "worker_crashed" and len(tokens_of(pool, 1)) == 2
        for i in (2, 3, 4):
            assert pool.terminal(i)["gen_tokens"] == 4 and len(tokens_of(pool, i)) == 4
        assert pool.stderr.count(b"will be retried after the restart") == 2
        assert len(fakes.starts("a")) == 2
        assert pool.close() == 0

    def test_the_watchdog_kills_a_hung_worker_with_many_in_flight(self, fakes, fake_pool):
        fakes.add("a", [{"hang_after": 2}, {}])
        pool = fake_pool("stall_timeout = 2\nmax_batch = 3")
        pool.wait_ev("ready", model="a")
        self.send_together(pool, [{"model": "a", "id": i, "prompt": "x", "max_tokens": 3} for i in range(1, 4)])
        err = pool.terminal(1, timeout=60)
        assert err["code"] == "worker_crashed" and "no event or heartbeat" in err["msg"]
        assert [pool.terminal(i)["gen_tokens"] for i in (2, 3)] == [3, 3]
        assert pool.close() == 0

    def test_interleaved_floods_reach_their_requests_byte_for_byte(self, fakes, fake_pool):
        """Blocks that mix the lines of three requests go to each request by
        the id at each line's tail; the fourth waits for a free row."""
        fakes.add("a", {"together": 50, "tokens": 20_000, "token": "fl\u00f6 \\"})
        pool = fake_pool("max_batch = 3")
        pool.wait_ev("ready", model="a")
        ids = ["f1", "f2", "f3", "f4"]
        self.send_together(pool, [{"model": "a", "id": i, "prompt": "x", "max_tokens": 1} for i in ids])
        for i in ids:
            assert pool.terminal(i)["gen_tokens"] == 20_000
            lines = {e["_line"] for e in tokens_of(pool, i)}
            assert lines == {f'@@lattice {{"ev":"gen_token","token":"fl\u00f6 \\\\","done":false,"id":"{i}"}}\n'.encode()}
            assert len(tokens_of(pool, i)) == 20_000
        order = [e["id"] for e in pool.events if e["ev"] == "gen_token"]
        assert order.index("f2") < len(order) - 1 - order[::-1].index("f1"), "their lines interleave"
        assert set(order[order.index("f4") :]) == {"f4"}, "the fourth started once a row was free"
        assert pool.close() == 0

    def test_a_request_whose_first_line_shares_a_block_is_not_retried(self, fakes, fake_pool):
        """r2 joins while r1 streams; its first line comes in a block of r1's
        lines, so that block is read line by line and r2 counts as emitted:
        when the worker then dies, r2 ends with worker_crashed after exactly
        the tokens it showed (a retry would repeat them)."""
        fakes.add("a", [{"together": 2, "tokens": 10_000, "token_interval": 0.01, "crash_after": 60}, {}])
        pool = fake_pool("max_batch = 3")
        pool.wait_ev("ready", model="a")
        pool.send({"model": "a", "id": "r1", "prompt": "x", "max_tokens": 1})
        pool.wait_for(lambda e: e.get("id") == "r1")
        pool.send({"model": "a", "id": "r2", "prompt": "x", "max_tokens": 1})
        for i in ("r1", "r2"):
            err = pool.terminal(i)
            assert err["code"] == "worker_crashed" and 0 < len(tokens_of(pool, i)) < 10_000
        assert b"will be retried" not in pool.stderr
        assert pool.close() == 0
