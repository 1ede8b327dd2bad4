"""Faults with real workers on two demo models: SIGKILL, SIGSTOP, a SIGKILLed
supervisor, and a seeded chaos run of a few hundred requests."""

from __future__ import annotations

import collections
import os
import random
import signal

import pytest

from harness.pool import is_terminal
from harness.procs import pid_alive, wait_for

CHAT = "<|im_start|>user\nTell me about the river.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture
def real_pool(tmp_path, tiny_model, second_model, spawn_pool):
    def start(extra: str = ""):
        path = tmp_path / "pool.toml"
        path.write_text(
            f'{extra}\n[[models]]\nname = "a"\npath = "{tiny_model}"\npreload = true\n\n[[models]]\nname = "b"\npath = "{second_model}"\npreload = true\n'
        )
        pool = spawn_pool("--config", str(path))
        pool.wait_ev("ready", model="a")
        pool.wait_ev("ready", model="b")
        return pool

    return start


def pids(pool) -> dict[str, int | None]:
    pool.send({"op": "status"})
    return {row["model"]: row["pid"] for row in pool.wait_ev("status")["models"]}


def first_token(pool, request_id) -> None:
    pool.wait_for(lambda e: e.get("id") == request_id and e["ev"] == "gen_token")


def wait_terminals(pool, n: int) -> None:
    """Until at least n requests with an id have ended."""
    ended = set()

    def reached(event: dict) -> bool:
        if is_terminal(event) and "id" in event:
            ended.add(event["id"])
        return len(ended) >= n

    pool.wait_for(reached)


def test_sigkill_of_a_busy_worker(real_pool):
    """Its request ends with worker_crashed, the worker restarts at once (a
    first crash), the request queued behind it
    (max_batch 1: waiting in the pool) runs on the restarted worker, and the
    other model never notices. tests/test_serve_batching.py kills one mid-batch."""
    pool = real_pool("heartbeat_interval = 0.5\nmax_batch = 1")
    before = pids(pool)
    pool.send({"model": "a", "id": "long", "prompt": CHAT, "max_tokens": 30_000})
    pool.send({"model": "a", "id": "queued", "prompt": CHAT, "max_tokens": 5})
    pool.send({"model": "b", "id": "other", "prompt": CHAT, "max_tokens": 200})
    first_token(pool, "long")
    os.kill(before["a"], signal.SIGKILL)
    err = pool.terminal("long")
    assert err["ev"] == "error" and err["code"] == "worker_crashed"
    assert "'a'" in err["msg"] and "SIGKILL" in err["msg"]
    restarting = pool.wait_ev("restarting", model="a")
    # A first crash restarts at once: no backoff on the way back to ready.
    assert restarting["attempt"] == 1 and restarting["delay_s"] == 0
    pool.wait_ev("ready", model="a")
    assert pool.terminal("queued")["gen_tokens"] == 5
    assert pool.terminal("other")["gen_tokens"] == 200
    after = pids(pool)
    assert after["a"] != before["a"] and after["b"] == before["b"]
    assert pool.close() == 0


def test_sigstop_of_a_busy_worker_trips_the_watchdog(real_pool):
    """A stopped worker sends no heartbeat; after stall_timeout it is
    SIGKILLed (SIGTERM would wait for a SIGCONT) and replaced."""
    pool = real_pool("heartbeat_interval = 0.25\nstall_timeout = 5")
    before = pids(pool)
    pool.send({"model": "a", "id": "long", "prompt": CHAT, "max_tokens": 30_000})
    first_token(pool, "long")
    os.kill(before["a"], signal.SIGSTOP)
    err = pool.terminal("long", timeout=60)
    assert err["code"] == "worker_crashed" and "no event or heartbeat" in err["msg"]
    wait_for(lambda: not pid_alive(before["a"]), 10, message="the stopped worker to be killed")
    pool.wait_ev("ready", model="a")
    pool.send({"model": "a", "id": "after", "prompt": CHAT, "max_tokens": 5})
    assert pool.terminal("after")["gen_tokens"] == 5
    assert pool.close() == 0


def test_supervisor_sigkill_with_busy_workers_leaves_none(real_pool):
    """The lifeline holds while the workers run inference."""
    pool = real_pool()
    workers = list(pids(pool).values())
    for model in "ab":
        pool.send({"model": model, "id": model, "prompt": CHAT, "max_tokens": 30_000})
    first_token(pool, "a")
    first_token(pool, "b")
    pool.proc.kill()
    pool.proc.wait()
    wait_for(lambda: not any(pid_alive(p) for p in workers), 10, message=f"workers {workers} to die with their supervisor")


def test_chaos_random_kills_across_two_models(real_pool):
    """300 requests over two models while workers are SIGKILLed at seeded
    random points: every request ends exactly once (PoolProc.close checks),
    each either whole or with worker_crashed; a retried request's stream is
    indistinguishable from an undisturbed one; the pool ends healthy."""
    rng = random.Random(20261202)
    pool = real_pool("heartbeat_interval = 0.5")
    total, per_model_kills = 300, 3
    request = {"prompt": CHAT, "temperature": 0}
    # Mostly short requests, some long enough for a kill to land mid-stream.
    lengths = [rng.choice([6] * 9 + [80]) for _ in range(total)]
    for i in range(total):
        pool.send({**request, "model": "ab"[i % 2], "id": i, "max_tokens": lengths[i]})
    kill_points = sorted(rng.sample(range(10, total - 40), 2 * per_model_kills))
    kills: collections.Counter[str] = collections.Counter()
    for point in kill_points:
        wait_terminals(pool, point)
        live = {m: p for m, p in pids(pool).items() if p is not None and kills[m] < per_model_kills}
        if live:
            victim = rng.choice(sorted(live))
            os.kill(live[victim], signal.SIGKILL)
            kills[victim] += 1
            # Its death seen before the next status: until then the pool
            # still reports the dead pid, and a second kill of it is no kill.
            pool.wait_ev("restarting", model=victim)
    outcomes = [pool.terminal(i) for i in range(total)]
    # Greedy decoding: every whole request of one model and length has one text.
    texts: dict[tuple[str, int], set[str]] = collections.defaultdict(set)
    for i, end in enumerate(outcomes):
        if end["ev"] == "error":
            assert end["code"] == "worker_crashed", end
        else:
            assert end["gen_tokens"] == lengths[i] or end["finish_reason"] == "stop"
            texts["ab"[i % 2], lengths[i]].add(pool.text(i))
    assert all(len(t) == 1 for t in texts.values()), texts
    for model in "ab":
        restarts = [e for e in pool.events if e["ev"] == "restarting" and e["model"] == model]
        assert len(restarts) == kills[model]
        pool.send({**request, "model": model, "id": f"after-{model}", "max_tokens": 6})
        pool.terminal(f"after-{model}")
        assert {pool.text(f"after-{model}")} == texts[model, 6]
    assert not [e for e in pool.events if e["ev"] == "failed"]
    crashed = sum(1 for e in outcomes if e["ev"] == "error")
    print(f"chaos: {total} requests, kills {dict(kills)}, worker_crashed {crashed}, done {total - crashed}")
    assert pool.close() == 0
