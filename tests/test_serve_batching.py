"""Continuous batching through `lattice-pool serve` (the pool's
side): requests with ids to one model run concurrently at its worker, up to
max_batch, the rest waiting in the pool; each line goes to its request by
the id at its tail; every request ends exactly once, also when the worker
dies mid-batch. One pool (a real worker on the tiny demo model) serves the
whole module, so the requests of each test get their own ids."""

from __future__ import annotations

import itertools
import os
import random
import signal

import pytest

from harness.pool import PoolProc, is_terminal
from harness.procs import wait_for
from harness.prompts import MIXED, PROMPTS, THINK
from tests.conftest import GREEDY_MARGIN, keep_alive_across_tests, release

MAX_BATCH = 8
_ids = itertools.count(1)


@pytest.fixture(scope="module")
def pool(tiny_model, tmp_path_factory):
    """The prefix cache is off, so a prompt computes the same way every time
    it is sent (a snapshot would let a repeat skip part of its prefill)."""
    config = tmp_path_factory.mktemp("batching") / "pool.toml"
    config.write_text(f'prefix_cache_bytes = 0\nmax_batch = {MAX_BATCH}\n[[models]]\nname = "m"\npath = "{tiny_model}"\npreload = true\n')
    p = PoolProc("--config", str(config))
    keep_alive_across_tests(p.proc.pid)
    try:
        p.wait_ev("ready", model="m")
        yield p
    finally:
        release(p.proc.pid)
        assert p.close() == 0


def request(**kw) -> dict:
    kw.setdefault("id", f"q{next(_ids)}")
    kw.setdefault("model", "m")
    kw.setdefault("prompt", PROMPTS[0])
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 24)
    return kw


def again(req: dict, **kw) -> dict:
    """The same request under a new id."""
    return {**req, **kw, "id": f"q{next(_ids)}"}


def send_together(pool: PoolProc, reqs: list[dict]) -> None:
    pool.send(b"".join(PoolProc.line(r) for r in reqs))
    pool.sent_ids += [r["id"] for r in reqs]


def ended(pool: PoolProc, reqs: list[dict]) -> dict:
    return {r["id"]: pool.terminal(r["id"]) for r in reqs}


def alone(pool: PoolProc, req: dict) -> str:
    pool.send(req)
    pool.terminal(req["id"])
    return pool.text(req["id"])


def status(pool: PoolProc) -> dict:
    pool.send({"op": "status"})
    return pool.wait_ev("status")["models"][0]


def test_a_request_joining_mid_stream_streams_before_the_first_ends(pool, greedy_margins):
    long, short = request(max_tokens=120), request(prompt=PROMPTS[1], max_tokens=6)
    long_alone, short_alone = alone(pool, long), alone(pool, short)
    first, second = again(long), again(short)
    pool.send(first)
    pool.wait_for(lambda e: e.get("id") == first["id"] and e["ev"] == "gen_token")
    pool.send(second)  # joins while the first is decoding
    pool.terminal(first["id"])
    order = [e["id"] for e in pool.events if e.get("id") in (first["id"], second["id"])]
    short_done = next(i for i, e in enumerate(pool.events) if e.get("id") == second["id"] and is_terminal(e))
    long_done = next(i for i, e in enumerate(pool.events) if e.get("id") == first["id"] and is_terminal(e))
    assert short_done < long_done, "the second request ended while the first went on"
    assert order.index(second["id"]) > order.index(first["id"])
    assert pool.text(first["id"]) == long_alone and pool.text(second["id"]) == short_alone
    assert min(greedy_margins([PROMPTS[0]], 120) + greedy_margins([PROMPTS[1]], 6)) > GREEDY_MARGIN


def test_eight_greedy_requests_batched_give_their_alone_text(pool, greedy_margins):
    reqs = [request(prompt=p, max_tokens=32) for p in PROMPTS]
    texts = {r["id"]: alone(pool, r) for r in reqs}
    batch = [again(r) for r in reqs]
    send_together(pool, batch)
    ends = ended(pool, batch)
    for original, r in zip(reqs, batch):
        assert ends[r["id"]]["gen_tokens"] == 32 or ends[r["id"]]["finish_reason"] == "stop"
        assert pool.text(r["id"]) == texts[original["id"]], original["prompt"]
    # They ran as one batch: their lines interleave.
    ids = [e["id"] for e in pool.events if e.get("id") in ends and e["ev"] == "gen_token" and not e["done"]]
    assert len({ids[i] for i in range(MAX_BATCH)}) > 1
    # Why text equality is safe on any CPU: tests/test_batching.py.
    assert min(greedy_margins(PROMPTS, 32)) > GREEDY_MARGIN


def test_mixed_settings_in_one_batch_reproduce_and_keep_greedy_exact(pool, greedy_margins):
    first = [request(prompt=PROMPTS[i], max_tokens=40, **kw) for i, kw in enumerate(MIXED)]
    greedy_alone = alone(pool, again(first[0]))
    runs = []
    for reqs in (first, [again(r) for r in first]):
        send_together(pool, reqs)
        ended(pool, reqs)
        runs.append([pool.text(r["id"]) for r in reqs])
    assert runs[0] == runs[1], "the same requests sent the same way give the same tokens"
    assert runs[0][0] == greedy_alone
    assert min(greedy_margins([PROMPTS[0]], 40)) > GREEDY_MARGIN
    assert len(set(runs[0])) == len(MIXED)
    other = [again(r, seed=r["seed"] + 100) if "seed" in r else again(r) for r in first]
    send_together(pool, other)
    ended(pool, other)
    assert [pool.text(r["id"]) != runs[0][i] for i, r in enumerate(other)] == [False] + [True] * (len(MIXED) - 1)


def test_cancel_one_row_while_the_others_go_on(pool, greedy_margins):
    """The cancelled row asks for ten times the tokens of its neighbours, so
    the cancel lands mid-stream however fast the machine decodes; its text
    is then held against its prompt run alone for as many tokens as it made
    (a cut inside a character of several bytes ends in one U+FFFD either
    way, as any ending flushes the bytes it has)."""
    reqs = [request(prompt=p, max_tokens=60) for p in PROMPTS[:3]]
    reqs[1]["max_tokens"] = 600
    expected = {i: alone(pool, reqs[i]) for i in (0, 2)}
    batch = [again(r) for r in reqs]
    send_together(pool, batch)
    for r in batch:
        pool.wait_for(lambda e, i=r["id"]: e.get("id") == i and e["ev"] == "gen_token")
    pool.send({"op": "cancel", "id": batch[1]["id"]})
    ends = ended(pool, batch)
    made = ends[batch[1]["id"]]["gen_tokens"]
    assert ends[batch[1]["id"]]["finish_reason"] == "cancelled" and made < 600
    assert pool.text(batch[1]["id"]) == alone(pool, again(reqs[1], max_tokens=made))
    for i in (0, 2):
        assert ends[batch[i]["id"]]["gen_tokens"] == 60 and pool.text(batch[i]["id"]) == expected[i]
    assert min(greedy_margins([PROMPTS[0], PROMPTS[2]], 60) + greedy_margins([PROMPTS[1]], made)) > GREEDY_MARGIN


def test_stop_string_and_reasoning_budget_on_rows_of_one_batch(pool, greedy_margins):
    plain = request(prompt=PROMPTS[2], max_tokens=30)
    full = alone(pool, plain)
    stop = full[12:15]
    stopped = request(prompt=PROMPTS[2], max_tokens=30, stop=[stop])
    budget = request(prompt=THINK, max_tokens=20, reasoning_budget=3)
    free = request(prompt=THINK, max_tokens=20)
    same = again(plain)
    send_together(pool, [stopped, budget, free, same])
    ends = ended(pool, [stopped, budget, free, same])
    assert pool.text(stopped["id"]) == full[: full.index(stop)] and ends[stopped["id"]]["finish_reason"] == "stop"
    tokens = [e["token"] for e in pool.of(budget["id"]) if not e["done"]]
    free_tokens = [e["token"] for e in pool.of(free["id"]) if not e["done"]]
    assert "</think>" in tokens and "</think>" not in free_tokens
    assert tokens[: tokens.index("</think>")] == free_tokens[: tokens.index("</think>")]
    assert ends[budget["id"]]["gen_tokens"] == 20 and pool.text(same["id"]) == full
    assert min(greedy_margins([PROMPTS[2]], 30) + greedy_margins([THINK], 20)) > GREEDY_MARGIN


def test_two_hundred_requests_with_max_batch_8_end_exactly_once(pool):
    """Some have no prompt (bad_request), some are cancelled while queued in
    the pool or in flight at the worker; the pool never has more than
    max_batch in flight, and the rest wait in its queue."""
    rng = random.Random(5)
    reqs = []
    for i in range(200):
        if rng.random() < 0.05:
            reqs.append({"id": f"q{next(_ids)}", "model": "m"})  # no prompt
        else:
            reqs.append(request(prompt=rng.choice(PROMPTS), max_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 0.8]), seed=i))
    cancelled = {r["id"] for r in rng.sample([r for r in reqs if "prompt" in r], 10)}
    send_together(pool, reqs)
    row = status(pool)
    pool.send(b"".join(PoolProc.line({"op": "cancel", "id": i}) for i in sorted(cancelled)))
    assert 0 < row["in_flight"] <= MAX_BATCH and row["queued"] > 0 and row["max_batch"] == MAX_BATCH
    ends = ended(pool, reqs)
    for r in reqs:
        done = ends[r["id"]]
        if "prompt" not in r:
            assert done["ev"] == "error" and done["code"] == "bad_request"
        elif r["id"] not in cancelled:
            assert done["finish_reason"] in ("length", "stop") and done["gen_tokens"] <= r["max_tokens"]
        else:
            assert done["finish_reason"] in ("cancelled", "length", "stop")
    assert sum(ends[i]["finish_reason"] == "cancelled" for i in cancelled) >= 5
    idle = wait_for(lambda: (r := status(pool))["in_flight"] == 0 and r["active_rows"] == 0 and r, 30, message="an idle status")
    assert idle["queued"] == idle["waiting_rows"] == 0


def test_idless_requests_never_interleave_with_each_other(pool):
    """Id-less requests run one at a time pool-wide: each one's lines are
    contiguous among the id-less lines, though id'd requests share the
    batch with them."""
    seeded = [dict(prompt=PROMPTS[i], max_tokens=20, temperature=1.0, seed=i) for i in range(3)]
    refs = [again(request(**s)) for s in seeded]
    send_together(pool, refs)
    ended(pool, refs)
    expected = [pool.text(r["id"]) for r in refs]
    start = len(pool.events)
    busy = request(max_tokens=80)
    pool.send(busy)
    pool.send(b"".join(PoolProc.line({"model": "m", **s}) for s in seeded))
    pool.idless_sent += len(seeded)
    for _ in seeded:
        pool.wait_for(lambda e: is_terminal(e) and "id" not in e, since=start)
    pool.terminal(busy["id"])
    assert pool.idless_texts(start) == expected
    assert any("id" in e for e in pool.events[start:] if e["ev"] == "gen_token"), "the id'd request ran meanwhile"


def test_a_worker_killed_mid_batch_ends_each_request_once(pool, greedy_margins):
    """The worker is stopped (SIGSTOP) while one request streams, so the
    requests sent then are in flight at it but have emitted nothing, one
    more waits in the pool; SIGKILL then. The streaming request ends with
    worker_crashed; the silent ones are retried invisibly on the restarted
    worker and give their whole alone text; the queued one waits for it."""
    streaming = request(max_tokens=30_000)
    late = [request(prompt=PROMPTS[i % len(PROMPTS)], max_tokens=10) for i in range(MAX_BATCH)]
    texts = {r["id"]: alone(pool, again(r)) for r in late}
    pool.send(streaming)
    pool.wait_for(lambda e: e.get("id") == streaming["id"] and e["ev"] == "gen_token")
    pid = status(pool)["pid"]
    os.kill(pid, signal.SIGSTOP)
    send_together(pool, late)
    row = status(pool)  # the worker cannot answer: the pool's own counts
    assert (row["in_flight"], row["queued"]) == (MAX_BATCH, 1)
    os.kill(pid, signal.SIGKILL)
    err = pool.terminal(streaming["id"])
    assert err["ev"] == "error" and err["code"] == "worker_crashed"
    for r in late:
        done = pool.terminal(r["id"])
        assert done["ev"] == "gen_token" and pool.text(r["id"]) == texts[r["id"]]
    assert min(greedy_margins(PROMPTS, 10)) > GREEDY_MARGIN
    assert pool.stderr.count(b"will be retried after the restart") >= MAX_BATCH - 1
    pool.wait_ev("ready", model="m")
    assert status(pool)["pid"] not in (None, pid)
