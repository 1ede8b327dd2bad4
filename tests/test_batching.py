"""Continuous batching through a real worker process: requests with ids run
together, their lines interleave, and each request's tokens are its own."""

import random

import pytest

from harness.procs import wait_for
from harness.prompts import MIXED, PROMPTS, THINK
from harness.worker import WorkerProc, is_terminal, terminal, text_of
from ipc.framing import encode_frame
from ipc.messages import Cancel, Generate, Stats
from tests.conftest import GREEDY_MARGIN, float32_margins, shared_worker


@pytest.fixture(scope="module")
def worker(tiny_model):
    """The prefix cache is off, so a prompt computes the same way every time
    it is sent (a snapshot would let a repeat skip part of its prefill)."""
    yield from shared_worker(tiny_model, "--max-batch", "8", "--prefix-cache-bytes", "0")


_rid = iter(range(1, 1_000_000))


def request(**kw) -> Generate:
    rid = next(_rid)
    kw.setdefault("prompt", PROMPTS[0])
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 24)
    return Generate(rid=rid, id_json=str(rid), **kw)


def alone(w, req: Generate) -> list[dict]:
    return w.send_together([req])[req.rid]


def same_as(req: Generate, **kw) -> Generate:
    """The request again under a new rid."""
    fields = {f: getattr(req, f) for f in Generate.__struct_fields__ if f not in ("rid", "id_json")}
    fields.update(kw)
    return request(**fields)


@float32_margins
def test_a_second_request_streams_before_the_first_ends(worker, greedy_margins):
    long, short = request(max_tokens=120), request(prompt=PROMPTS[1], max_tokens=6)
    long_alone, short_alone = text_of(alone(worker, long)), text_of(alone(worker, short))
    first, second = same_as(long), same_as(short)
    worker.send(first)
    head = worker.next_event()
    assert head["id"] == first.rid and not head["done"]
    worker.send(second)  # joins while the first is decoding
    lines = []
    while not (lines and is_terminal(lines[-1]) and lines[-1]["id"] == first.rid):
        lines.append(worker.next_event())
    ids = [e["id"] for e in lines]
    short_done = next(i for i, e in enumerate(lines) if e["id"] == second.rid and is_terminal(e))
    assert ids.index(second.rid) < short_done < len(lines) - 1
    assert first.rid in ids[short_done + 1 :], "the first request went on after the second ended"
    assert text_of([head] + [e for e in lines if e["id"] == first.rid]) == long_alone
    assert text_of([e for e in lines if e["id"] == second.rid]) == short_alone
    assert min(greedy_margins([PROMPTS[0]], 120) + greedy_margins([PROMPTS[1]], 6)) > GREEDY_MARGIN


@float32_margins
def test_eight_greedy_requests_batched_give_their_alone_text(worker, greedy_margins):
    reqs = [request(prompt=p, max_tokens=32) for p in PROMPTS]
    texts = {r.rid: text_of(alone(worker, r)) for r in reqs}
    again = [same_as(r) for r in reqs]
    batched = worker.send_together(again)
    for original, r in zip(reqs, again):
        done = terminal(batched[r.rid])
        assert done["gen_tokens"] == 32 or done["finish_reason"] == "stop"
        assert text_of(batched[r.rid]) == texts[original.rid], original.prompt
    # Why text equality is safe on any CPU: batching moves logits by float
    # noise (tests/test_generator.py bounds it), and every greedy choice of
    # these prompts wins by far more than that.
    assert min(greedy_margins(PROMPTS, 32)) > GREEDY_MARGIN


@float32_margins
def test_mixed_settings_in_one_batch_reproduce_and_keep_greedy_exact(worker, greedy_margins):
    first = [request(prompt=PROMPTS[i], max_tokens=40, **kw) for i, kw in enumerate(MIXED)]
    greedy_alone = text_of(alone(worker, same_as(first[0])))
    runs = []
    for reqs in (first, [same_as(r) for r in first]):
        events = worker.send_together(reqs)
        runs.append([text_of(events[r.rid]) for r in reqs])
    assert runs[0] == runs[1], "the same requests sent the same way give the same tokens"
    assert runs[0][0] == greedy_alone
    assert min(greedy_margins([PROMPTS[0]], 40)) > GREEDY_MARGIN
    assert len(set(runs[0])) == len(MIXED)
    # The seed decides: another seed on the same row gives other tokens.
    other = [same_as(r, seed=r.seed + 100) if r.seed is not None else same_as(r) for r in first]
    events = worker.send_together(other)
    changed = [text_of(events[r.rid]) != runs[0][i] for i, r in enumerate(other)]
    assert changed == [False] + [True] * (len(MIXED) - 1)


@float32_margins
def test_cancel_one_row_while_the_others_go_on(worker, greedy_margins):
    reqs = [request(prompt=p, max_tokens=60) for p in PROMPTS[:3]]
    expected = [text_of(alone(worker, r)) for r in reqs]
    again = [same_as(r) for r in reqs]
    worker.send_raw(b"".join(encode_frame(r) for r in again))
    seen = []
    while len({e["id"] for e in seen}) < 3:
        seen.append(worker.next_event())
    worker.send(Cancel(rid=again[1].rid))
    events = worker.collect_by_id([r.rid for r in again])
    for e in reversed(seen):
        events[e["id"]].insert(0, e)
    cancelled = terminal(events[again[1].rid])
    assert cancelled["finish_reason"] == "cancelled" and cancelled["gen_tokens"] < 60
    assert expected[1].startswith(text_of(events[again[1].rid]))
    for i in (0, 2):
        assert terminal(events[again[i].rid])["gen_tokens"] == 60
        assert text_of(events[again[i].rid]) == expected[i]
    assert min(greedy_margins(PROMPTS[:3], 60)) > GREEDY_MARGIN


@float32_margins
def test_stop_string_and_reasoning_budget_on_rows_of_one_batch(worker, greedy_margins):
    plain = request(prompt=PROMPTS[2], max_tokens=30)
    full = text_of(alone(worker, plain))
    stop = full[12:15]
    stopped = request(prompt=PROMPTS[2], max_tokens=30, stop=[stop])
    budget = request(prompt=THINK, max_tokens=20, reasoning_budget=3)
    free = request(prompt=THINK, max_tokens=20)
    again = same_as(plain)
    events = worker.send_together([stopped, budget, free, again])
    assert text_of(events[stopped.rid]) == full[: full.index(stop)]
    assert terminal(events[stopped.rid])["finish_reason"] == "stop"
    tokens = [e["token"] for e in events[budget.rid] if not e["done"]]
    free_tokens = [e["token"] for e in events[free.rid] if not e["done"]]
    assert "</think>" in tokens and "</think>" not in free_tokens
    at = tokens.index("</think>")
    assert tokens[:at] == free_tokens[:at]
    assert terminal(events[budget.rid])["gen_tokens"] == 20
    assert text_of(events[again.rid]) == full
    assert min(greedy_margins([PROMPTS[2]], 30) + greedy_margins([THINK], 20)) > GREEDY_MARGIN


def test_failing_rows_end_alone(worker):
    good = [request(prompt=PROMPTS[0], max_tokens=8), request(prompt=PROMPTS[1], max_tokens=8)]
    rid = next(_rid)
    missing = Generate(rid=rid, id_json=str(rid))
    empty = request(prompt="")
    events = worker.send_together([good[0], missing, empty, good[1]])
    assert [e["ev"] for e in events[missing.rid]] == ["error"] and events[missing.rid][0]["code"] == "bad_request"
    assert [e["ev"] for e in events[empty.rid]] == ["error"] and "empty" in events[empty.rid][0]["msg"]
    for r in good:
        assert terminal(events[r.rid])["gen_tokens"] == 8


def test_two_hundred_requests_end_exactly_once(worker):
    rng = random.Random(5)
    reqs = []
    for i in range(200):
        if rng.random() < 0.05:
            rid = next(_rid)
            reqs.append(Generate(rid=rid, id_json=str(rid)))  # no prompt: an error
        else:
            reqs.append(request(prompt=rng.choice(PROMPTS), max_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 0.8]), seed=i))
    cancelled = {r.rid for r in rng.sample(reqs[100:], 10)}
    rest = b"".join(encode_frame(r) for r in reqs[100:]) + b"".join(encode_frame(Cancel(rid=rid)) for rid in cancelled)
    worker.send_raw(b"".join(encode_frame(r) for r in reqs[:100]))
    events = {r.rid: [] for r in reqs}
    pending = set(events)
    stats = None
    while pending:
        e = worker.next_event(timeout=120)
        if e["ev"] == "worker_stats":
            stats = e
            continue
        assert e["id"] in pending, e
        events[e["id"]].append(e)
        if is_terminal(e):
            pending.discard(e["id"])
            if rest and e["ev"] == "gen_token":
                # Mid-way: a full batch runs, the rest waits.
                worker.send(Stats())
                worker.send_raw(rest)
                rest = b""
    assert stats is not None and stats["max_batch"] == 8
    assert 0 < stats["active_rows"] <= 8 and stats["waiting_rows"] > 0 and stats["rows_cache_bytes"] > 0
    for r in reqs:
        done = terminal(events[r.rid])
        if r.prompt is None:
            assert done["ev"] == "error"
        elif r.rid not in cancelled:
            assert done["finish_reason"] in ("length", "stop") and done["gen_tokens"] <= r.max_tokens
    worker.send(Stats())
    idle = worker.next_event()
    assert (idle["active_rows"], idle["waiting_rows"], idle["rows_cache_bytes"]) == (0, 0, 0)


def test_queued_request_is_cancelled_before_it_starts(tiny_model):
    w = WorkerProc(tiny_model, "--max-batch", "1", "--heartbeat", "0.2")
    try:
        w.wait_ready()
        running, queued = request(max_tokens=30_000), request(prompt=PROMPTS[1], max_tokens=5)
        w.send_raw(encode_frame(running) + encode_frame(queued))
        assert w.next_event()["id"] == running.rid
        w.send(Stats())
        stats = w.next_event(skip=(b"heartbeat", b"gen_token"))
        assert (stats["active_rows"], stats["waiting_rows"], stats["max_batch"]) == (1, 1, 1)
        w.send(Cancel(rid=queued.rid))
        line = w.next_event()
        while line["id"] == running.rid and not line["done"]:
            line = w.next_event()
        # The queued request ends at once, the running one goes on.
        assert line["id"] == queued.rid and line["finish_reason"] == "cancelled" and line["gen_tokens"] == 0
        w.send(Cancel(rid=running.rid))
        assert terminal(w.collect())["finish_reason"] == "cancelled"
        # Heartbeats say busy while a request runs or waits, then idle.
        wait_for(lambda: w.next_event(skip=())["_line"] == b'@@lattice {"ev":"heartbeat","busy":false}\n', 10, message="an idle heartbeat")
    finally:
        assert w.close() == 0


def test_an_idle_worker_keeps_its_buffers_a_while_then_hands_them_back(tiny_model):
    """The next request reuses the buffers the last one freed (on CUDA each
    new one is a costly allocation); after --idle-release seconds of nothing
    to do they go back."""
    w = WorkerProc.started(tiny_model, "--idle-release", "3", "--prefix-cache-bytes", "0")
    try:

        def cache_bytes() -> int:
            w.send(Stats())
            while (e := w.next_event()) is not None and e["ev"] != "worker_stats":
                pass
            assert e is not None, w.stderr.decode(errors="replace")
            return e["mlx_cache_bytes"]

        done = w.generate(prompt=PROMPTS[0], max_tokens=16, temperature=0.0)
        assert done["gen_tokens"] == 16
        held = cache_bytes()
        assert held > 0
        wait_for(lambda: cache_bytes() < held / 100, timeout=30, interval=0.2, message="the buffer cache handed back")
        # And the worker serves on as before.
        assert w.generate(prompt=PROMPTS[0], max_tokens=16, temperature=0.0)["text"] == done["text"]
    finally:
        assert w.close() == 0
