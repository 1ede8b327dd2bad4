"""The compiled decode step (worker.engine.compiled_step): it computes what the
model's own forward computes, for lone rows and left-padded batches, across
the caches' capacity steps and while rows leave and join; it steps only
rows and caches it can, and bounds its traces."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from ipc.sampling import Sampling
from tests.conftest import LOGIT_TOLERANCE
from worker.cache.prefix_cache import PrefixCache
from worker.engine import compiled_step
from worker.engine.batch_cache import BatchCache
from worker.engine.compiled_step import CompiledDecode
from worker.engine.generator import Row, TokenGenerator
from worker.engine.sampling import RowSampling

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="float32 tolerances of the CPU path")

GREEDY = Sampling(temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=1.0)


def load_model(path):
    from worker.runtime.loader import load

    loaded = load(path)
    return loaded.model, loaded.config.get("text_config", loaded.config)["vocab_size"]


def prefilled(model, prompts: list[list[int]]) -> BatchCache:
    """The rows' prompts read alone, then batched (left-padded)."""
    rows = []
    for ids in prompts:
        cache = make_prompt_cache(model)
        model(mx.array(ids)[None], cache=cache)
        mx.eval([c.state for c in cache])
        rows.append(cache)
    return BatchCache.of_rows(rows)


def twin_steps(model, vocab: int, prompts: list[list[int]], steps: int, leave_at: int | None = None, join: list[int] | None = None) -> float:
    """Steps the same rows with the model's forward and the compiled one,
    feeding both the eager side's greedy tokens; at `leave_at` the first row
    leaves and a row reading `join` joins. Returns the largest logit gap."""
    compiled = CompiledDecode(model)
    eager_cache, fast_cache = prefilled(model, prompts), prefilled(model, prompts)
    rng = np.random.default_rng(0)
    inputs = mx.array(rng.integers(5, vocab, size=len(prompts)).tolist(), dtype=mx.uint32)
    worst = 0.0
    for step in range(steps):
        if step == leave_at:
            keep = list(range(1, eager_cache.rows))
            for c in (eager_cache, fast_cache):
                c.filter(keep)
            inputs = inputs[mx.array(keep)]
            if join is not None:
                eager_cache = eager_cache.extend(prefilled(model, [join]))
                fast_cache = fast_cache.extend(prefilled(model, [join]))
                inputs = mx.concatenate([inputs, mx.array([join[-1]], dtype=mx.uint32)])
        assert compiled.steppable(fast_cache.layers)
        eager = model(inputs[:, None], cache=eager_cache.layers)[:, -1, :]
        fast = compiled.forward(inputs, fast_cache.layers)
        # Buffers stay at multiples of 256 columns, whatever rows leaving or
        # joining left, so traces are shared.
        assert all(_first(c.keys).shape[2] % 256 == 0 for c in fast_cache.layers if hasattr(c, "keys"))
        worst = max(worst, float(mx.max(mx.abs(eager - fast)).item()))
        inputs = mx.argmax(eager, axis=-1).astype(mx.uint32)
    # The caches the two sides left are the same (the compiled side's only
    # reach the columns it filled).
    for e, f in zip(eager_cache.layers, fast_cache.layers):
        if hasattr(e, "keys"):
            keys = e.keys_and_values()[0]
            n = _first(keys).shape[2]
            for x, y in zip(_parts(keys), _parts(f.keys)):
                assert np.allclose(np.array(x), np.array(y[..., :n, :]), atol=LOGIT_TOLERANCE)
            assert np.array_equal(np.array(e.offset), np.array(f.offset))
        else:
            assert np.allclose(np.array(e[1]), np.array(f[1]), atol=LOGIT_TOLERANCE)
    return worst


def _parts(keys) -> tuple:
    """A cache's key arrays: one, or a quantized cache's packed values, scales and biases."""
    return keys if isinstance(keys, tuple) else (keys,)


def _first(keys):
    return _parts(keys)[0]


def prompts_of(vocab: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(5, vocab, size=n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def hybrid(tiny_model):
    return load_model(tiny_model)


def test_a_lone_row_steps_past_its_caches_capacity_as_the_model_does(hybrid):
    model, vocab = hybrid
    # 250 prompt tokens in a 256-column buffer: the steps cross into 512.
    assert twin_steps(model, vocab, prompts_of(vocab, [250]), steps=12) <= LOGIT_TOLERANCE


def test_a_left_padded_batch_steps_as_the_model_does_while_rows_leave_and_join(hybrid):
    model, vocab = hybrid
    # The longest row leaves: the others' common left padding is trimmed.
    prompts = prompts_of(vocab, [252, 130, 1, 70])
    join = prompts_of(vocab, [40])[0]
    assert twin_steps(model, vocab, prompts, steps=10, leave_at=2, join=join) <= LOGIT_TOLERANCE


def test_an_attention_only_model_steps_as_it_does_alone(dense_model):
    model, vocab = load_model(dense_model)
    assert twin_steps(model, vocab, prompts_of(vocab, [60, 9, 255]), steps=6, leave_at=3) <= LOGIT_TOLERANCE


def test_quantized_caches_step_as_the_model_does(tiny_model):
    from worker.engine import kv_quant

    model, vocab = load_model(tiny_model)
    kv_quant.install(model, 8, 32)
    # The longest row crosses into a second 256-column buffer; rows leave and join.
    prompts = prompts_of(vocab, [252, 130, 1, 70])
    assert twin_steps(model, vocab, prompts, steps=6, leave_at=2, join=prompts_of(vocab, [40])[0]) <= LOGIT_TOLERANCE


def twin_blocks(model, vocab: int, prompts: list[list[int]], widths: list[int], chained: bool = False) -> float:
    """Reads blocks of `widths` tokens per row with the model's forward and
    with `CompiledDecode.block` (chained: each block is followed, inside the
    same trace, by a one-token forward of its last token, as a drafter's
    is), then a decode step on both; returns the largest logit gap."""
    compiled = CompiledDecode(model)
    eager_cache, fast_cache = prefilled(model, prompts), prefilled(model, prompts)
    rng = np.random.default_rng(1)

    def run(inputs, layers):
        logits = model(inputs, cache=layers)
        if not chained:
            return [logits]
        return [logits, model(inputs[:, -1:], cache=layers)]

    worst = 0.0
    for width in widths:
        inputs = mx.array(rng.integers(5, vocab, size=(len(prompts), width)).tolist(), dtype=mx.uint32)
        assert compiled.steppable(fast_cache.layers)
        eager = [model(inputs, cache=eager_cache.layers)]
        if chained:
            eager.append(model(inputs[:, -1:], cache=eager_cache.layers))
        fast = compiled.block(f"block-{chained}", run, inputs, fast_cache.layers, written=width + chained)
        for e, f in zip(eager, fast):
            worst = max(worst, float(mx.max(mx.abs(e - f)).item()))
    # The caches continue as the model's: one more decode step on each.
    step = mx.array(rng.integers(5, vocab, size=len(prompts)).tolist(), dtype=mx.uint32)
    eager = model(step[:, None], cache=eager_cache.layers)[:, -1, :]
    fast = compiled.forward(step, fast_cache.layers)
    for e, f in zip(eager_cache.layers, fast_cache.layers):
        if hasattr(e, "keys"):
            assert np.array_equal(np.array(e.offset), np.array(f.offset))
    return max(worst, float(mx.max(mx.abs(eager - fast)).item()))


@pytest.mark.parametrize("chained", [False, True])
def test_blocks_of_tokens_read_as_the_model_reads_them(hybrid, chained):
    model, vocab = hybrid
    # Left-padded rows; the blocks cross the first 256-column buffer.
    prompts = prompts_of(vocab, [250, 31, 4])
    assert twin_blocks(model, vocab, prompts, [5, 2, 5, 1], chained) <= LOGIT_TOLERANCE


def test_blocks_on_an_attention_only_model_and_on_quantized_caches(dense_model, tiny_model):
    from worker.engine import kv_quant

    model, vocab = load_model(dense_model)
    assert twin_blocks(model, vocab, prompts_of(vocab, [60, 9]), [4, 3], chained=True) <= LOGIT_TOLERANCE
    model, vocab = load_model(tiny_model)
    kv_quant.install(model, 8, 32)
    assert twin_blocks(model, vocab, prompts_of(vocab, [252, 20]), [5, 5], chained=True) <= LOGIT_TOLERANCE


def test_a_block_that_cannot_be_traced_is_left_to_the_caller(hybrid):
    model, vocab = hybrid
    compiled = CompiledDecode(model)
    cache = prefilled(model, prompts_of(vocab, [20]))
    before = cache.layers[-1].offset

    def reads_back(inputs, layers):
        out = model(inputs, cache=layers)
        out.sum().item()
        return [out]

    inputs = mx.array([[5, 6, 7]], dtype=mx.uint32)
    assert compiled.block("reads", reads_back, inputs, cache.layers) is None
    assert compiled.block("reads", reads_back, inputs, cache.layers) is None  # not tried again
    assert "eval" in compiled.failed_blocks["reads"] and cache.layers[-1].offset == before
    assert compiled.failed is None  # the decode step is not affected


class Spy(CompiledDecode):
    def __init__(self, model):
        super().__init__(model)
        self.calls = 0

    def forward(self, inputs, layers):
        self.calls += 1
        return super().forward(inputs, layers)


def test_rows_with_an_adapter_take_the_models_own_forward(hybrid):
    model, vocab = hybrid
    spy = Spy(model)
    gen = TokenGenerator(model, vocab, PrefixCache(model, 0), 64, None, compiled=spy)
    plain, adapted = (Row(i, [5, 6, 7], RowSampling(GREEDY, vocab, [5, 6, 7])) for i in range(2))
    adapted.slot = 0
    gen.start([plain])
    while not gen.decoding:
        gen.step()
    # The lone prompt's last pass read its last token too: the first step
    # draws from it, the second runs a forward.
    gen.step()
    assert spy.calls == 0
    gen.step()
    assert spy.calls == 1
    gen.start([adapted])
    while adapted not in gen.decoding:
        gen.step()
    calls = spy.calls
    gen.step()
    gen.step()
    assert spy.calls == calls and len(gen.decoding) == 2
    assert gen._way is None  # not a step to time for the choice of way
    gen.remove([adapted])
    gen.step()
    assert spy.calls == calls + 1


def test_caches_it_cannot_trace_are_left_to_the_model(hybrid):
    model, _ = hybrid
    compiled = CompiledDecode(model)
    assert not compiled.steppable([RotatingKVCache(max_size=8)])
    assert not compiled.steppable(make_prompt_cache(model))  # nothing read yet
    assert not compiled.steppable([])


def test_on_cuda_a_lone_row_of_an_attention_only_model_decodes_op_by_op_where_steps_are_not_timed(dense_model, hybrid):
    """The rule for steps nobody times (a draft model's; the CPU keeps
    tracing every cache it can): with the CUDA rule on, a lone row of plain
    attention caches decodes with the model, whose attention then needs no
    mask; its blocks of several tokens (a verify, a draft's read) still
    trace, and so do batches and hybrid rows. A timed step (its rows
    given) takes the way the choice picks instead."""
    from worker.engine.step_choice import StepChoice

    model, vocab = load_model(dense_model)
    compiled = CompiledDecode(model)
    assert not compiled.lone_attention_eager and compiled.choice is None  # this machine's default device is the CPU
    lone, batch = prefilled(model, prompts_of(vocab, [9])), prefilled(model, prompts_of(vocab, [9, 5]))
    assert compiled.decodes(lone.layers) and compiled.decodes(batch.layers)
    compiled.lone_attention_eager = True
    assert not compiled.decodes(lone.layers) and compiled.steppable(lone.layers)
    assert compiled.decodes(batch.layers) and compiled.way(lone.layers, 1) == (False, None)  # no choice: the rule
    compiled.choice = StepChoice()
    assert compiled.way(lone.layers, 1) == (True, compiled.key(lone.layers, 1))  # a trial starts with the trace
    # A choice is kept per rows and context: the longest cache's capacity.
    assert compiled.key(lone.layers, 1) == (1, max(c.keys.shape[2] for c in lone.layers)) and compiled.key(lone.layers, 1)[1] >= 9
    assert not compiled.decodes(lone.layers)
    model, vocab = hybrid
    compiled = CompiledDecode(model)
    compiled.lone_attention_eager = True
    assert compiled.decodes(prefilled(model, prompts_of(vocab, [9])).layers)


@pytest.mark.parametrize("rows", [1, 3])
def test_the_generator_times_its_steps_both_ways_and_keeps_the_faster(dense_model, monkeypatch, rows):
    """With a choice (CUDA's default), a decode batch's steps run traced and
    op by op in turn, each way's steady steps timed by the generator, until
    one way is kept for that many rows; a step that made a trace, the
    first of each run of one way and steps beside a prompt chunk are not
    timed."""
    from worker.engine import step_choice
    from worker.engine.step_choice import StepChoice

    model, vocab = load_model(dense_model)
    compiled = CompiledDecode(model)
    compiled.choice = StepChoice()
    timed = []
    original = compiled.choice.timed
    monkeypatch.setattr(compiled.choice, "timed", lambda key, traced, seconds: timed.append((key[0], traced)) or original(key, traced, seconds))
    gen = TokenGenerator(model, vocab, PrefixCache(model, 0), 64, None, compiled=compiled)
    prompts = prompts_of(vocab, [9, 6, 12][:rows])
    gen.start([Row(i, ids, RowSampling(GREEDY, vocab, ids)) for i, ids in enumerate(prompts)])
    ways = []
    for _ in range(60):
        chunks = gen._chunks
        gen.step()
        if gen.decoding and gen._way is not None:
            ways.append((gen._way[2], chunks != gen._chunks))
    chosen = compiled.choice.chosen(rows)
    assert chosen is not None
    block = step_choice.BLOCK
    assert [w for w, _ in ways[: 3 * block]] == [True] * block + [False] * block + [True] * block
    assert {batch for batch, _ in timed} == {rows}
    # A block's first step is not timed, nor the step that made the trace.
    assert timed[: 2 * (block - 1)] == [(rows, True)] * (block - 1) + [(rows, False)] * (block - 1)
    assert sum(t for _, t in timed) >= step_choice.TRIAL and sum(not t for _, t in timed) >= step_choice.TRIAL
    assert all(w == chosen for w, _ in ways[-10:])


def test_a_step_is_timed_only_as_it_runs_in_a_run_of_its_own_way(dense_model):
    """The generator reports a step's time to the choice only when it was
    built by the step before, right after a step of the same way and rows,
    with no prompt chunk since the read before and no trace made."""
    import time

    from worker.engine.step_choice import StepChoice

    model, vocab = load_model(dense_model)
    compiled = CompiledDecode(model)
    compiled.choice = StepChoice()
    reports = []
    compiled.choice.timed = lambda key, traced, seconds: reports.append((key, traced, seconds))
    gen = TokenGenerator(model, vocab, PrefixCache(model, 0), 64, None, compiled=compiled)
    two = (2, 512)  # two rows, caches of 512 tokens
    steady = [(8, two, True, False), (9, two, True, False), (10, two, True, False)]
    cases = {
        "steady": (steady, (9, 3), True),
        "a prompt chunk since the read before": (steady, (9, 2), False),
        "the way before was the other": ([(8, two, False, False)] + steady[1:], (9, 3), False),
        "other rows before": ([(8, (3, 512), True, False)] + steady[1:], (9, 3), False),
        "caches grown since the step before": ([(8, (2, 256), False, False), (9, two, False, False), steady[2]], (9, 3), False),
        "it made a trace": ([steady[0], (9, two, True, True), steady[2]], (9, 3), False),
        "no read in the step before (a speculative step)": (steady, (8, 3), False),
        "not a step the choice chose (an adapter's rows)": ([steady[0], None, steady[2]], (9, 3), False),
    }
    for name, (ways, (read_step, chunks_then), timed) in cases.items():
        reports.clear()
        gen._steps, gen._chunks = 10, 3
        gen._ways.clear()
        gen._ways.extend(ways)
        gen._read_at = (read_step, time.monotonic() - 0.005, chunks_then)
        gen._time_read()
        assert bool(reports) == timed, name
        if timed:
            [(batch, traced, seconds)] = reports
            assert batch == (2, 512) and traced and seconds >= 0.005
        assert gen._read_at[0] == 10 and gen._read_at[2] == 3


class ReadsBack:
    """A model whose forward reads a value back while it builds."""

    def __init__(self, model):
        self.model = model

    def __call__(self, inputs, cache=None):
        out = self.model(inputs, cache=cache)
        out.sum().item()
        return out


def test_a_model_that_cannot_be_traced_steps_op_by_op(hybrid):
    model, vocab = hybrid
    compiled = CompiledDecode(ReadsBack(model))
    cache, twin = prefilled(model, prompts_of(vocab, [20, 7])), prefilled(model, prompts_of(vocab, [20, 7]))
    inputs = mx.array([5, 6], dtype=mx.uint32)
    for _ in range(3):
        fast = compiled.forward(inputs, cache.layers)
        eager = model(inputs[:, None], cache=twin.layers)[:, -1, :]
        assert float(mx.max(mx.abs(fast - eager)).item()) <= LOGIT_TOLERANCE
    assert "eval" in compiled.failed and not compiled.steppable(cache.layers)


def test_traces_are_bounded(hybrid, monkeypatch):
    model, vocab = hybrid
    monkeypatch.setattr(compiled_step, "MAX_TRACES", 2)
    compiled = CompiledDecode(model)
    first = compiled._fn
    for rows in (1, 2, 3):
        cache = prefilled(model, prompts_of(vocab, [10] * rows))
        mx.eval(compiled.forward(mx.zeros((rows,), dtype=mx.uint32), cache.layers))
    assert len(compiled._shapes) == 1 and compiled._fn is not first


def test_block_traces_are_bounded_apart_from_the_decode_steps(hybrid, monkeypatch):
    model, vocab = hybrid
    monkeypatch.setattr(compiled_step, "MAX_TRACES", 2)
    compiled = CompiledDecode(model)
    cache = prefilled(model, prompts_of(vocab, [10]))
    mx.eval(compiled.forward(mx.zeros((1,), dtype=mx.uint32), cache.layers))
    first = compiled._fn

    def run(inputs, layers):
        return [model(inputs, cache=layers)]

    for width in (2, 3, 4):
        mx.eval(compiled.block("read", run, mx.zeros((1, width), dtype=mx.uint32), cache.layers))
    assert len(compiled._block_shapes) == 1 and len(compiled._shapes) == 1 and compiled._fn is first


def test_a_big_batch_keeps_a_trace_per_size_and_capacity(hybrid, monkeypatch):
    # The warm-up traces every batch size up to max_batch; a new capacity
    # must not drop them all (max_batch 3 here: 2 + 3 traces kept).
    model, vocab = hybrid
    monkeypatch.setattr(compiled_step, "MAX_TRACES", 2)
    monkeypatch.setattr(compiled_step, "CAPACITIES_KEPT", 2)
    compiled = CompiledDecode(model)
    compiled.keep_for(3)
    first = compiled._fn
    for rows, length in ((1, 10), (2, 10), (3, 10), (1, 300), (2, 300)):
        cache = prefilled(model, prompts_of(vocab, [length] * rows))
        mx.eval(compiled.forward(mx.zeros((rows,), dtype=mx.uint32), cache.layers))
    assert len(compiled._shapes) == 5 and compiled._fn is first


def test_the_scheduler_compiles_its_decode_step_unless_told_not_to(tiny_model):
    from ipc.messages import Generate
    from worker.engine.scheduler import Scheduler
    from worker.runtime.loader import load
    from worker.text.tokenizer import TextCodec

    loaded = load(tiny_model)
    for compile_decode in (True, False):
        s = Scheduler(
            loaded, TextCodec(loaded.path, loaded.config), lambda line: None, batch_memory=1 << 30, prefix_cache_bytes=0, compile_decode=compile_decode
        )
        for i in range(3):
            s.submit(Generate(rid=i, prompt=f"<|im_start|>user\nQuestion {i}<|im_end|>\n", id_json=str(i), max_tokens=8, temperature=0.0), 0.0)
        ended = s.drain()
        assert sorted(ended) == [0, 1, 2] and all(len(ids) == 8 for ids in ended.values())
        assert (s.compiled is not None and len(s.compiled._shapes) > 0) == compile_decode


def test_the_warm_up_times_a_lone_rows_two_ways_so_the_first_request_does_not(dense_model):
    """With a choice (CUDA's default; this CPU machine gets one by hand), the
    worker's warm-up steps its lone row until the way for one row is
    chosen, instead of leaving the trial to the first request's steps."""
    from harness.engine import engine_for
    from worker.engine.step_choice import StepChoice

    scheduler = engine_for(dense_model, max_batch=2)
    scheduler.compiled.choice = choice = StepChoice()
    scheduler.warm_up()
    assert choice.chosen(1) is not None
