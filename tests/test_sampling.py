import threading

import mlx.core as mx
import numpy as np
import pytest

from ipc.sampling import Sampling
from worker.engine.sampling import NUCLEUS_AT_MOST, BatchSampler, RowSampling, _logsumexp, _logsumexp_cpu, _nucleus
from worker.runtime import cpu_streams
from worker.runtime.cpu_backend import usable_cores

V = 64


def logits_rows(seed=0, rows=1):
    rng = np.random.default_rng(seed)
    return mx.array(rng.normal(0, 2, size=(rows, V)).astype(np.float32))


def params(**kw):
    base = dict(temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0, seed=7)
    base.update(kw)
    return Sampling(**base)


def sampler(*rows: Sampling, prompt=()) -> BatchSampler:
    s = BatchSampler(V)
    s.extend([RowSampling(p, V, list(prompt)) for p in rows])
    return s


def draw(s, n=50, seed=0, width=None):
    """n steps of a batch; each row gets its own logits row every step."""
    width = width or len(s)
    out, last = [], mx.zeros((width,), dtype=mx.uint32)
    for i in range(n):
        last = s(logits_rows(seed + i, width), last)
        out.append(last.tolist())
    return [list(col) for col in zip(*out)]


def test_greedy_is_argmax_and_ignores_seed():
    row = logits_rows()
    s = sampler(params(temperature=0.0, seed=1))
    assert s(row, mx.zeros((1,), dtype=mx.uint32)).item() == int(np.argmax(np.array(row)))


def test_same_seed_same_tokens_different_seed_different():
    assert draw(sampler(params(seed=7))) == draw(sampler(params(seed=7)))
    assert draw(sampler(params(seed=7))) != draw(sampler(params(seed=8)))


def test_top_k_one_is_greedy():
    assert draw(sampler(params(top_k=1)), n=10) == draw(sampler(params(temperature=0.0)), n=10)


def test_top_k_limits_choices():
    row = logits_rows(3)
    allowed = set(np.argsort(-np.array(row)[0])[:3].tolist())
    s = sampler(params(top_k=3, seed=1))
    assert {s(row, mx.zeros((1,), dtype=mx.uint32)).item() for _ in range(200)} <= allowed


def test_top_p_keeps_the_nucleus():
    probs = np.array([0.5, 0.3, 0.15, 0.05] + [0.0] * (V - 4)) + 1e-12
    row = mx.array(np.log(probs)[None].astype(np.float32))
    s = sampler(params(top_p=0.75, seed=2))
    assert {s(row, mx.zeros((1,), dtype=mx.uint32)).item() for _ in range(300)} == {0, 1}


# A vocabulary larger than the candidates a top-p row looks among, as a real
# model's is.
WIDE = 3 * NUCLEUS_AT_MOST


def nucleus_reference(logits: np.ndarray, top_p: float) -> tuple[set[int], np.ndarray, np.ndarray]:
    """The nucleus by a full sort in float64, and each ranked token's mass
    before it."""
    order = np.argsort(-logits, kind="stable")
    probs = np.exp(logits[order].astype(np.float64) - logits.max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    return set(order[before < top_p].tolist()), order, before


def test_nucleus_matches_a_full_sort():
    rng = np.random.default_rng(5)
    # Peaked rows (6 to 130 tokens in the nucleus) and flatter ones (320 to 4,400).
    scale = np.array([[5.0], [4.0], [4.0], [2.0], [2.0], [2.0]], dtype=np.float32)
    logits = rng.normal(size=(6, WIDE)).astype(np.float32) * scale
    top_p = np.array([0.5, 0.9, 0.95, 0.5, 0.9, 0.95], dtype=np.float32)
    x = mx.array(logits)
    for lse in (_logsumexp, _logsumexp_cpu):
        kept = np.isfinite(np.array(_nucleus(x, mx.array(top_p), lse(x))))
        for row in range(len(top_p)):
            want, order, before = nucleus_reference(logits[row], float(top_p[row]))
            got = set(np.flatnonzero(kept[row]).tolist())
            # Only a token whose mass before it is within float32's rounding
            # of top_p may fall on either side.
            near = {int(t) for t, b in zip(order, before) if abs(b - top_p[row]) < 1e-5}
            assert got ^ want <= near, (row, len(got), len(want))
            assert len(want) > 1


def wide_sampler(p: Sampling) -> BatchSampler:
    s = BatchSampler(WIDE)
    s.extend([RowSampling(p, WIDE, [])])
    return s


def test_top_p_over_a_wide_vocabulary_draws_only_the_nucleus():
    probs = np.full(WIDE, 1e-9)
    probs[[10, 5000, WIDE - 1, 77]] = [0.45, 0.35, 0.15, 0.05]
    row = mx.array(np.log(probs / probs.sum())[None].astype(np.float32))
    s = wide_sampler(params(top_p=0.75, seed=3))
    drawn = [s(row, mx.zeros((1,), dtype=mx.uint32)).item() for _ in range(300)]
    assert set(drawn) == {10, 5000}
    assert 0.5 < drawn.count(10) / len(drawn) < 0.8  # 0.45 / 0.8 of the draws expected


def test_a_nucleus_wider_than_the_candidates_draws_among_the_likeliest():
    """The documented bound: a nearly flat distribution's nucleus is cut to
    the NUCLEUS_AT_MOST likeliest tokens."""
    rng = np.random.default_rng(9)
    logits = rng.normal(size=WIDE).astype(np.float32) * 0.1
    want, order, _ = nucleus_reference(logits, 0.9)
    assert len(want) > NUCLEUS_AT_MOST
    likeliest = set(order[:NUCLEUS_AT_MOST].tolist())
    s = wide_sampler(params(top_p=0.9, seed=4))
    drawn = {s(mx.array(logits[None]), mx.zeros((1,), dtype=mx.uint32)).item() for _ in range(200)}
    assert drawn <= likeliest and len(drawn) > 150


def test_rows_split_over_streams_draw_what_each_draws_alone():
    """On a CPU with cores to spare a batch's rows are drawn on several
    streams at once; each row's tokens are still its own."""
    if mx.default_device() == mx.cpu and usable_cores() > 1:
        assert len(cpu_streams.streams()) > 1
    rows = [params(top_p=0.9, seed=20 + i) for i in range(8)]
    rng = np.random.default_rng(6)
    steps = [mx.array((rng.normal(size=(8, WIDE)) * 3).astype(np.float32)) for _ in range(4)]
    together = BatchSampler(WIDE)
    together.extend([RowSampling(p, WIDE, []) for p in rows])
    drawn = [together(x, mx.zeros((8,), dtype=mx.uint32)).tolist() for x in steps]
    for i, p in enumerate(rows):
        alone = wide_sampler(p)
        assert [alone(x[i : i + 1], mx.zeros((1,), dtype=mx.uint32)).item() for x in steps] == [d[i] for d in drawn]


def test_repetition_penalty_discourages_seen_tokens():
    row = mx.array(np.array([[5.0, 4.9] + [-10.0] * (V - 2)], dtype=np.float32))
    s = sampler(params(temperature=0.0, repetition_penalty=1.5), prompt=[0])
    assert s(row, mx.array([0], dtype=mx.uint32)).item() == 1


def test_sampling_in_a_side_thread_is_random_and_seeded():
    # mlx 0.32.0 froze compiled samplers off the main thread; guard against it.
    results = []

    def run():
        results.append(draw(sampler(params(seed=11)), n=40)[0])

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[0] == results[1]
    assert len(set(results[0])) > 5


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_output_is_a_valid_id(temperature):
    s = sampler(params(temperature=temperature, top_k=50, top_p=0.9, repetition_penalty=1.1), prompt=[1, 2, 3])
    for tok in draw(s, n=20)[0]:
        assert 0 <= tok < V


MIXED = [
    params(seed=1, top_k=5, top_p=0.8, repetition_penalty=1.3),
    params(temperature=0.0),
    params(seed=2, temperature=0.5),
    params(seed=3, top_p=0.9),
    params(seed=4, top_k=5, top_p=0.8, repetition_penalty=1.3),
]


def test_a_row_draws_the_same_tokens_alone_and_in_a_mixed_batch():
    """Row i sees the same logits either way; its own settings, key and seen
    tokens decide its draw, whatever else shares the batch."""
    n = 30
    batch = draw(sampler(*MIXED, prompt=[1, 2]), n=n)
    for i, p in enumerate(MIXED):
        alone = BatchSampler(V)
        alone.extend([RowSampling(p, V, [1, 2])])
        last, got = mx.array([0], dtype=mx.uint32), []
        for step in range(n):
            # The batch's row i at this step, and the batch's previous token.
            row = logits_rows(step, len(MIXED))[i : i + 1]
            last = alone(row, mx.array([batch[i][step - 1]] if step else [0], dtype=mx.uint32))
            got.append(last.item())
        assert got == batch[i], i
    assert batch[1] == [int(np.argmax(np.array(logits_rows(s, len(MIXED))[1]))) for s in range(n)]


def test_rows_leave_and_join_with_their_state():
    s = sampler(*MIXED[:3], prompt=[1])
    before = draw(s, n=5)
    s.filter([2, 0])
    s.extend([RowSampling(MIXED[3], V, [1])])
    assert [r.top_p for r in s.rows] == [1.0, 0.8, 0.9]
    after = draw(s, n=5, seed=100)
    # The same three rows from a fresh start, driven the same way.
    t = sampler(*MIXED[:3], prompt=[1])
    assert draw(t, n=5) == before
    t.filter([2, 0])
    t.extend([RowSampling(MIXED[3], V, [1])])
    assert draw(t, n=5, seed=100) == after
