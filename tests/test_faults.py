"""Fault injection with fake workers (tests.fakeworker) behind a real
`lattice-pool serve`: crashes, hangs, floods, partial and over-long lines,
grandchildren holding pipes, workers that stop reading, boot failures."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest

from tests.faults import FAKE_ENV, FakeModels
from tests.poolproc import is_terminal
from tests.procs import pid_alive, wait_for
from tests.workerproc import ROOT, child_env

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
        relayed, `restarting` comes with attempt and delay, and the next
        request runs on the new worker."""
        fakes.add("a", [{"crash_after": 3, "partial": PARTIAL}, {}])
        pool = fake_pool()
        first = pool.wait_ev("ready", model="a")
        pool.send({"model": "a", "id": "r1", "prompt": "x", "max_tokens": 10})
        err = pool.terminal("r1")
        assert err["ev"] == "error" and err["code"] == "worker_crashed"
        assert "'a'" in err["msg"] and "SIGKILL" in err["msg"]
        assert len(tokens_of(pool, "r1")) == 3
        restarting = pool.wait_ev("restarting", model="a")
        assert restarting["attempt"] == 1 and 0 < restarting["delay_s"] <= 1.0
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
