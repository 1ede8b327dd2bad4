"""Quantized attention caches (kv_bits) in the batched engine: close to the
model's dtype, batched like any other, with the prefix cache."""

import mlx.core as mx
import pytest

from harness.engine import run
from harness.procs import said
from harness.prompts import chatml
from ipc.messages import Generate
from tests.conftest import LOGIT_TOLERANCE

# Float32 caches and the CPU's float32 tolerances: mlx-cuda has no quantized
# matmul of float32 queries for these shapes (its models run in bf16), and a
# GPU's bf16 logits move by more than these tolerances.
float32_only = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="float32 quantized matmuls and tolerances: the CPU's")

PROMPTS = ["<|im_start|>user\n" + "Tell me about the river and the mill. " * k + "<|im_end|>\n<|im_start|>assistant\n" for k in (1, 3, 6, 12)]


@pytest.fixture(scope="module")
def plain(tiny_model):
    from worker.runtime.loader import load

    return load(tiny_model)


def quantized(model_dir, bits: int):
    from worker.engine import kv_quant
    from worker.runtime.loader import load

    loaded = load(model_dir)
    kv_quant.install(loaded.model, bits, 32)
    return loaded


def forced_logits(model, ids: list[int], path: list[int] | None, steps: int):
    """Logits after the prompt and after each following token: `path`'s
    (teacher forced), or the greedy ones (then returned as the path too)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out = [model(mx.array(ids)[None], cache=cache)[0, -1]]
    greedy = []
    for i in range(steps):
        t = path[i] if path is not None else int(mx.argmax(out[-1]).item())
        greedy.append(t)
        out.append(model(mx.array([[t]]), cache=cache)[0, -1])
    return out, greedy


@pytest.mark.parametrize("bits, tolerance", [(8, 0.15), (4, 3.0)])
def test_quantized_logits_stay_near_the_models_dtype(tiny_model, plain, bits, tolerance):
    import mlx.core as mx

    from worker.text.tokenizer import TextCodec

    codec = TextCodec(tiny_model, plain.config)
    q = quantized(tiny_model, bits)
    agree = checked = 0
    for prompt in PROMPTS:
        ids = codec.encode(prompt)
        ref, path = forced_logits(plain.model, ids, None, 12)
        got, _ = forced_logits(q.model, ids, path, 12)
        for a, b in zip(ref, got):
            # Measured on this model: 8 bits 0.045 at most, 4 bits 1.15.
            assert mx.abs(a - b).max().item() < tolerance
            top = mx.sort(a)[-2:].tolist()
            if top[1] - top[0] > 2 * tolerance:
                checked += 1
                agree += int(mx.argmax(a).item()) == int(mx.argmax(b).item())
    assert agree == checked
    if bits == 8:
        assert checked > 20


def test_quantized_rows_batch_resume_and_are_smaller(tiny_model):
    from worker.engine.kv_quant import BatchQuantKV
    from worker.engine.scheduler import Scheduler
    from worker.runtime.loader import load
    from worker.text.tokenizer import TextCodec

    def engine(bits):
        loaded = quantized(tiny_model, bits) if bits else load(tiny_model)
        lines: list[bytes] = []
        s = Scheduler(loaded, TextCodec(tiny_model, loaded.config), lines.append, batch_memory=1 << 30, prefill_step=16)
        s.lines = lines
        return s

    base, q8, q4 = engine(None), engine(8), engine(4)
    # The memory guard counts the smaller rows.
    assert base.row_fixed_bytes == q8.row_fixed_bytes == q4.row_fixed_bytes
    # 8 bits and a scale and bias a group of 32: 0.3125x float32's bytes (a
    # CPU), 0.5625x bf16's (a GPU).
    assert q4.row_token_bytes < q8.row_token_bytes <= 0.57 * base.row_token_bytes
    assert q8.generator.can_batch and q8.max_batch > 1 and q8.prefix_cache.supported

    # A batch of rows of different lengths, joining together: each gives
    # what it gives alone (float noise aside, far below these margins).
    seen = []
    original = q8.generator._join

    def spy(rows, cache):
        seen.extend(type(c) for c in cache.layers)
        return original(rows, cache)

    q8.generator._join = spy
    for i, prompt in enumerate(PROMPTS):
        q8.submit(Generate(rid=i, prompt=prompt, temperature=0.0, max_tokens=10, id_json=str(i)), 0.0)
    together = q8.drain()
    assert BatchQuantKV in seen
    for i, prompt in enumerate(PROMPTS):
        q8.submit(Generate(rid=100 + i, prompt=prompt, temperature=0.0, max_tokens=10), 0.0)
        assert q8.drain()[100 + i] == together[i]

    # The prefix cache holds quantized snapshots and resumes from them.
    first = chatml([("user", "Where does the river bend?")], "A long system prompt about the mill and the bridge.")
    second = chatml([("user", "Where does the river bend?"), ("assistant", "ok"), ("user", "More.")], "A long system prompt about the mill and the bridge.")
    run(q8, prompt=first)
    entry = next(iter(q8.prefix_cache._entries.values()))
    assert any(isinstance(layer, tuple) and isinstance(layer[0], tuple) and len(layer[0]) == 3 for layer in entry.layers)
    ids, done = run(q8, prompt=second)
    assert done["cached_tokens"] > 0
    # Resumed, it says what a quantized worker says without a prefix cache.
    fresh = engine(8)
    fresh.prefix_cache.budget = 0
    assert run(fresh, prompt=second)[0] == ids


def test_a_pool_serves_quantized_and_plain_models_side_by_side(tiny_model, tmp_path, spawn_pool):
    config = tmp_path / "pool.toml"
    config.write_text(
        f"prefix_cache_disk_bytes = 0\n"
        f'[[models]]\nname = "q8"\npath = "{tiny_model}"\nkv_bits = 8\nkv_group_size = 32\nquantized_kv_start = 40\npreload = true\n'
        f'[[models]]\nname = "plain"\npath = "{tiny_model}"\npreload = true\n'
    )
    pool = spawn_pool("--config", str(config))
    for name in ("q8", "plain"):
        pool.wait_ev("ready", model=name)
    requests = [{"model": m, "id": f"{m}{i}", "prompt": p, "temperature": 0, "max_tokens": 12} for m in ("q8", "plain") for i, p in enumerate(PROMPTS)]
    for r in requests:
        pool.send(r)
    texts = {r["id"]: (pool.terminal(r["id"]), pool.text(r["id"])) for r in requests}
    assert all(done["ev"] == "gen_token" for done, _ in texts.values())
    # Each row of the quantized model's batch gives its text alone.
    for i, prompt in enumerate(PROMPTS):
        alone = pool.generate({"model": "q8", "id": f"alone{i}", "prompt": prompt, "temperature": 0, "max_tokens": 12})
        assert alone["ev"] == "gen_token" and pool.text(f"alone{i}") == texts[f"q8{i}"][1]
    pool.send({"op": "status"})
    rows = {r["model"]: r for r in pool.wait_ev("status")["models"]}
    # Two workers; the quantized one batches (a worker that cannot reports
    # max_batch 1), and its smaller rows never get fewer of them (`auto`: 8
    # on a CPU, up to 64 from a GPU's memory).
    assert rows["q8"]["pid"] != rows["plain"]["pid"]
    assert rows["q8"]["max_batch"] >= rows["plain"]["max_batch"] > 1
    # quantized_kv_start = 40: the prompts (30 to 195 tokens) batch on both sides of it.
    assert said(pool.stderr, b"attention caches quantized: 8 bits, groups of 32, from 40 tokens on")
    assert pool.close() == 0


# -- quantized_kv_start: plain caches until a row holds START tokens --------------

START = 40


def lazy(model_dir, start: int = START):
    from worker.engine import kv_quant
    from worker.runtime.loader import load

    loaded = load(model_dir)
    kv_quant.install(loaded.model, 8, 32, start)
    return loaded


def lone_logits(model, ids: list[int], inputs: list[int]):
    """Logits after `ids`, then after each of `inputs` fed one by one; and
    whether the attention caches were quantized before each of those steps."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out = [model(mx.array(ids)[None], cache=cache)[0, -1]]
    forms = []
    for t in inputs:
        out.append(model(mx.array([[t]]), cache=cache)[0, -1])
        forms.append(cache[-1].quantized)
    return out, forms


def test_quantized_kv_start_is_plain_before_it_and_near_8_bits_after(tiny_model, plain):
    """Teacher-forced on one path: the same logits as the model's dtype while
    the row holds fewer than START tokens, then those of an 8-bit cache
    within its tolerance."""
    import mlx.core as mx

    from worker.text.tokenizer import TextCodec

    codec = TextCodec(tiny_model, plain.config)
    q8, lz = quantized(tiny_model, 8), lazy(tiny_model)
    ids = codec.encode(PROMPTS[0])
    assert len(ids) < START - 4
    ref, path = forced_logits(plain.model, ids, None, 24)
    eight, _ = forced_logits(q8.model, ids, path, 24)
    got, forms = lone_logits(lz.model, ids, path)
    # Before step k the row holds len(ids) + k tokens; it is quantized once
    # it holds START (mlx-lm's rule: before the forward that would pass it).
    assert forms == [len(ids) + k >= START for k in range(24)]
    for k, (a, b, c) in enumerate(zip(ref, eight, got)):
        if len(ids) + k < START:
            assert mx.abs(a - c).max().item() <= LOGIT_TOLERANCE
        else:
            assert mx.abs(b - c).max().item() < 0.15


@float32_only
def test_a_batch_holds_rows_on_both_sides_of_quantized_kv_start(tiny_model):
    """Rows below, across and above START in one batch, rows leaving and
    joining, a right-padded chunk in which one row crosses START: each row's
    logits are those it gets alone."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from worker.engine.batch_cache import BatchCache
    from worker.engine.kv_quant import BatchLazyKV

    model = lazy(tiny_model).model
    rng = np.random.default_rng(7)
    prompts = [rng.integers(5, 500, size=n).tolist() for n in (8, 36, 60, 38, 36)]
    joiner, steps, chunk_at = len(prompts) - 1, 10, 6

    def length(r: int, k: int) -> int:
        # At the chunk the joiner (39 tokens) reads 4 and crosses START.
        return 1 if k != chunk_at else 4 if r == joiner else 1 + r % 3

    pieces = [[rng.integers(5, 500, size=length(r, k)).tolist() for k in range(steps)] for r in range(len(prompts))]

    def prefilled(ids):
        cache = make_prompt_cache(model)
        model(mx.array(ids)[None], cache=cache)
        return cache

    def first_step(r: int) -> int:
        return 3 if r == joiner else 0

    alone = []
    for r, ids in enumerate(prompts):
        cache = prefilled(ids)
        alone.append([model(mx.array(piece)[None], cache=cache)[0, -1] for piece in pieces[r][: steps - first_step(r)]])
    batch = BatchCache.of_rows([prefilled(ids) for ids in prompts[:joiner]])
    rows = list(range(joiner))
    kinds = set()
    for k in range(steps):
        if k == 3:  # the first row leaves, a row joins
            batch.filter(list(range(1, len(rows))))
            rows = rows[1:]
            batch = batch.extend(BatchCache.of_rows([prefilled(prompts[joiner])]))
            rows.append(joiner)
        feed = [pieces[r][k - first_step(r)] for r in rows]
        lengths = [len(f) for f in feed]
        width = max(lengths)
        if width * len(rows) > sum(lengths):
            batch.pad(lengths, width)
        logits = model(mx.array([f + [0] * (width - len(f)) for f in feed], dtype=mx.uint32), cache=batch.layers)
        batch.unpad()
        layer = batch.layers[-1]
        assert isinstance(layer, BatchLazyKV)
        kinds.add((layer.plain is not None, layer.quant is not None))
        for i, r in enumerate(rows):
            # A mixed batch's quantized rows attend over their values
            # dequantized, with the plain rows' kernel: float rounding apart,
            # what mlx-lm's quantized attention gives (0 on the CPU here).
            gap = mx.abs(logits[i, lengths[i] - 1] - alone[r][k - first_step(r)]).max().item()
            assert gap < 1e-3, (k, r, gap)
    # Mixed until the joiner is quantized, then one kind again.
    assert kinds == {(True, True), (False, True)}
    held = [len(prompts[r]) + sum(len(p) for p in pieces[r][: steps - first_step(r)]) for r in rows]
    assert layer.lens == layer.offset.tolist() == held


def test_quantized_kv_start_in_the_engine_batches_resumes_and_speculates(tiny_model, plain):
    """Through the scheduler: rows on both sides of START decode together and
    each gives its text alone; the memory guard counts a row as quantized
    tokens plus START tokens' difference; a prefix resumed from a snapshot
    (stored in the form it had) and a speculating engine give the same text."""
    from worker.engine.batch_cache import row_bytes
    from worker.engine.kv_quant import BatchLazyKV
    from worker.engine.scheduler import Scheduler
    from worker.text.tokenizer import TextCodec

    def engine(loaded, **kw):
        lines: list[bytes] = []
        s = Scheduler(loaded, TextCodec(tiny_model, loaded.config), lines.append, batch_memory=1 << 30, prefill_step=16, **kw)
        s.lines = lines
        return s

    start = 64
    lz, q8 = engine(lazy(tiny_model, start)), engine(quantized(tiny_model, 8))
    assert lz.row_token_bytes == q8.row_token_bytes
    assert lz.row_fixed_bytes - q8.row_fixed_bytes == start * (row_bytes(plain.model)[1] - q8.row_token_bytes) > 0
    seen = []
    original = lz.generator._join

    def spy(rows, cache):
        seen.extend(type(c) for c in cache.layers)
        return original(rows, cache)

    lz.generator._join = spy
    for i, prompt in enumerate(PROMPTS[:3]):  # 30, 60 and 105 tokens: below, across and above 64
        lz.submit(Generate(rid=i, prompt=prompt, temperature=0.0, max_tokens=12, id_json=str(i)), 0.0)
    together = lz.drain()
    assert BatchLazyKV in seen
    for i, prompt in enumerate(PROMPTS[:3]):
        lz.submit(Generate(rid=100 + i, prompt=prompt, temperature=0.0, max_tokens=12), 0.0)
        assert lz.drain()[100 + i] == together[i]

    second = chatml(
        [("user", "Where does the river bend? " * 6), ("assistant", "ok"), ("user", "More.")], "A long system prompt about the mill and the bridge."
    )
    first = second[: second.index("<|im_start|>assistant")]
    run(lz, prompt=first + "<|im_start|>assistant\n")
    forms = {isinstance(layer[0], tuple) for e in lz.prefix_cache._entries.values() for layer in e.layers if isinstance(layer, tuple)}
    ids, done = run(lz, prompt=second)
    assert done["cached_tokens"] > 0
    fresh = engine(lazy(tiny_model, start))
    fresh.prefix_cache.budget = 0
    assert run(fresh, prompt=second)[0] == ids
    assert forms  # snapshots were stored
    speculating = engine(lazy(tiny_model, start), draft="ngram")
    assert speculating.speculator is not None
    assert run(speculating, prompt=second)[0] == ids
    assert speculating.speculator.drafted > 0


@float32_only
@pytest.mark.parametrize("queries", [1, 5, 40])
@pytest.mark.parametrize("where", ["cpu", "metal", "cuda"])
@pytest.mark.parametrize("group_size, bits", [(32, 8), (64, 8), (64, 4)])
def test_attention_over_a_quantized_cache_matches_mlx_lms_for_pieces_and_steps(queries, where, group_size, bits):
    """A prompt piece reads the cache dequantized through the fused kernel,
    a step the packed values (each KV head's queries as one matmul's
    rows; on the CPU keys scored from their bytes, on CUDA the cache
    copied to one block first): all compute
    mlx-lm's quantized attention, on a cache's view up to its offset (a
    slice of its buffer), with a causal, a boolean or an additive mask."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    from worker.engine.kv_quant import QuantKV
    from worker.engine.quant_attention import _attention

    rng = np.random.default_rng(queries)
    B, heads, kv_heads, dim, held = 2, 4, 2, 64, 100

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    cache = QuantKV(group_size, bits)
    cache.update_and_fetch(normal(B, kv_heads, held - queries, dim), normal(B, kv_heads, held - queries, dim))
    keys, values = cache.update_and_fetch(normal(B, kv_heads, queries, dim), normal(B, kv_heads, queries, dim))
    assert keys[0].shape[2] == held and cache.keys[0].shape[2] > held  # a view into a bigger buffer
    q = normal(B, heads, queries, dim)
    visible = np.broadcast_to(np.tril(np.ones((queries, held), dtype=bool), held - queries), (B, queries, held)).copy()
    visible[1, :, :3] = False  # row 1 holds three tokens of left padding
    for mask in ("causal", mx.array(visible[:, None]), mx.where(mx.array(visible[:, None]), 0.0, -1e9)):
        if isinstance(mask, str) and queries == 1:
            mask = None
        # (mlx-lm scales the queries in place: each call gets its own.)
        want = quantized_scaled_dot_product_attention(q + 0, keys, values, scale=dim**-0.5, mask=mask, group_size=group_size, bits=bits)
        got = _attention(where)(q + 0, keys, values, cache, scale=dim**-0.5, mask=mask)
        assert got.shape == want.shape
        assert mx.abs(got - want).max().item() < 1e-4


def test_on_cuda_steps_quantized_matmuls_take_whole_unbroadcast_operands(monkeypatch):
    """mlx's CUDA quantized matmul runs only on contiguous operands: the
    cache's slice is copied to one block, and each KV head's queries are
    the rows of one matmul rather than the cache broadcast over them (the
    broadcast failed the 8B shape's first step on an H100)."""
    import mlx.core as mx

    from worker.engine.kv_quant import QuantKV
    from worker.engine.quant_attention import _attention

    calls = []
    original = mx.quantized_matmul

    def spy(x, w, *rest, **kw):
        calls.append((x.shape, w.shape))
        return original(x, w, *rest, **kw)

    monkeypatch.setattr(mx, "quantized_matmul", spy)
    mx.random.seed(5)
    cache = QuantKV(64, 8)
    keys, values = cache.update_and_fetch(mx.random.normal((1, 2, 9, 128)), mx.random.normal((1, 2, 9, 128)))
    out = _attention("cuda")(mx.random.normal((1, 8, 1, 128)), keys, values, cache, scale=128**-0.5, mask=None)
    mx.eval(out)
    assert len(calls) == 2
    for x_shape, w_shape in calls:
        assert x_shape[:-2] == w_shape[:-2] == (1, 2)  # one matmul per KV head, nothing broadcast


@float32_only
@pytest.mark.parametrize("dim, group_size, kernel_scores", [(64, 64, False), (64, 32, True), (128, 64, True)])
def test_on_cuda_a_cache_of_one_group_a_row_scores_its_keys_dequantized(monkeypatch, dim, group_size, kernel_scores):
    """mlx's CUDA quantized matmul gets `x @ W.T` wrong where each row of W
    is one group (the head dimension equal to the group size): such a
    cache scores its keys dequantized, and its values stay quantized;
    with more groups a row both products go through the kernel. Either
    way the CUDA route computes the same attention as the CPU's, under
    every kind of mask, for a decode step and a block of queries."""
    import mlx.core as mx
    import numpy as np

    from worker.engine.kv_quant import QuantKV
    from worker.engine.quant_attention import _attention

    transposed = []
    original = mx.quantized_matmul

    def spy(x, w, *rest, transpose=True, **kw):
        transposed.append(transpose)
        return original(x, w, *rest, transpose=transpose, **kw)

    rng = np.random.default_rng(9)
    B, heads, kv_heads, held = 2, 8, 2, 101
    cache = QuantKV(group_size, 8)

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    cache.update_and_fetch(normal(B, kv_heads, held - 3, dim), normal(B, kv_heads, held - 3, dim))
    keys, values = cache.update_and_fetch(normal(B, kv_heads, 3, dim), normal(B, kv_heads, 3, dim))
    visible = np.broadcast_to(np.tril(np.ones((3, held), dtype=bool), held - 3), (B, 3, held)).copy()
    visible[1, :, :5] = False
    cases = [(1, None)] + [(3, mask) for mask in ("causal", mx.array(visible[:, None]), mx.where(mx.array(visible[:, None]), 0.0, -1e9))]
    for queries, mask in cases:
        q = normal(B, heads, queries, dim)
        want = _attention("cpu")(q, keys, values, cache, scale=dim**-0.5, mask=mask)
        transposed.clear()
        monkeypatch.setattr(mx, "quantized_matmul", spy)
        got = _attention("cuda")(q, keys, values, cache, scale=dim**-0.5, mask=mask)
        mx.eval(got)
        monkeypatch.setattr(mx, "quantized_matmul", original)
        assert transposed == ([True, False] if kernel_scores else [False])
        assert mx.abs(got - want).max().item() < 1e-4


@float32_only
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(
    "limits, blocks",
    [
        ({}, 1),  # 2 x 2 x 100 x 64 key values: at once
        ({"BYTES_AT_ONCE": 0, "BYTES_BLOCK": 16 * 64}, 4 * 7),  # each row's KV head in blocks of 16 tokens
        ({"BYTES_AT_ONCE": 0, "BYTES_BLOCK": 16 * 64, "BYTES_BLOCKS_AT_MOST": 27}, 0),  # too many: mlx's kernel
    ],
)
def test_cpu_steps_score_keys_from_their_bytes_at_once_or_in_blocks(monkeypatch, group_size, bits, limits, blocks):
    import mlx.core as mx
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    from worker.engine import quant_attention
    from worker.engine.kv_quant import QuantKV

    for name, value in limits.items():
        monkeypatch.setattr(quant_attention, name, value)
    read = []
    original = quant_attention._raw
    monkeypatch.setattr(quant_attention, "_raw", lambda q, packed, g, b: read.append(packed.shape) or original(q, packed, g, b))
    mx.random.seed(3)
    cache = QuantKV(group_size, bits)
    keys, values = cache.update_and_fetch(mx.random.normal((2, 2, 100, 64)), mx.random.normal((2, 2, 100, 64)))
    q = mx.random.normal((2, 4, 3, 64))
    got = quant_attention._attention("cpu")(q + 0, keys, values, cache, scale=0.125, mask="causal")
    want = quantized_scaled_dot_product_attention(q + 0, keys, values, scale=0.125, mask="causal", group_size=group_size, bits=bits)
    assert mx.abs(got - want).max().item() < 1e-4
    assert len(read) == blocks


def test_a_quantized_model_routes_its_attention_and_a_plain_cache_keeps_mlx_lms(tiny_model, plain):
    import sys

    import mlx.core as mx
    from mlx_lm.models import base
    from mlx_lm.models.cache import make_prompt_cache

    q = quantized(tiny_model, 8)
    modules = {sys.modules[type(m).__module__] for m in q.model.modules()}
    routed = [m for m in modules if getattr(m, "scaled_dot_product_attention", None) not in (None, base.scaled_dot_product_attention)]
    assert routed and all(m.scaled_dot_product_attention.__module__ == "worker.engine.quant_attention" for m in routed)
    # The plain model shares those modules: its caches carry no `bits`, so
    # its logits are those of the route a plain model has (mlx-lm's own, or
    # the CPU's or CUDA's for a few queries).
    from worker.runtime import cpu_attention, short_attention
    from worker.runtime.memory import processor

    own = {"cpu": cpu_attention.attention, "cuda": short_attention.attention}.get(processor(), base.scaled_dot_product_attention)
    ids = mx.array([[5, 17, 300, 41, 9, 77, 120, 3, 64, 8, 200, 11]])
    before = plain.model(ids, cache=make_prompt_cache(plain.model))
    routed_fn = {m: m.scaled_dot_product_attention for m in routed}
    try:
        for m in routed:
            m.scaled_dot_product_attention = own
        reference = plain.model(ids, cache=make_prompt_cache(plain.model))
    finally:
        for m, fn in routed_fn.items():
            m.scaled_dot_product_attention = fn
    assert mx.abs(before - reference).max().item() == 0.0


def test_cpu_steps_over_a_bf16_cache_add_up_in_float32():
    """mlx's CPU quantized matmul adds a bf16 product up in bf16, which over
    thousands of cached tokens drifts by several percent: a step over a
    bf16 cache computes in float32 and gives bf16 back, close to a float32
    reference of the same quantized cache."""
    import mlx.core as mx

    from worker.engine.kv_quant import QuantKV
    from worker.engine.quant_attention import _attention, _float32

    mx.random.seed(5)
    cache = QuantKV(64, 8)
    keys, values = cache.update_and_fetch(*(mx.random.normal((1, 2, 4096, 128)).astype(mx.bfloat16) for _ in range(2)))
    q = mx.random.normal((1, 8, 1, 128)).astype(mx.bfloat16)
    dequantized = [mx.dequantize(*_float32(x), group_size=64, bits=8) for x in (keys, values)]
    want = mx.fast.scaled_dot_product_attention(q.astype(mx.float32), *dequantized, scale=128**-0.5)

    def error(out):
        return (mx.abs(out.astype(mx.float32) - want).max() / mx.abs(want).max()).item()

    got = _attention("cpu")(q, keys, values, cache, scale=128**-0.5, mask=None)
    assert got.dtype == mx.bfloat16
    assert error(got) < 0.01


def test_a_cache_of_one_group_a_row_on_cuda_is_named_at_load():
    """Where kv_group_size equals the head dimension, a CUDA worker says at
    load that its keys are read dequantized, and which group size keeps
    them packed; other processors and other group sizes say nothing."""
    from worker.engine.kv_quant import one_group_note

    note = one_group_note("cuda", {128}, 128)
    assert note and "kv_group_size 128 equals the head dimension" in note and "kv_group_size 64 keeps them packed" in note
    assert one_group_note("cuda", {128}, 64) is None
    assert one_group_note("cpu", {64}, 64) is None
    assert one_group_note("metal", {64}, 64) is None


def test_a_gpu_that_cannot_attend_over_a_quantized_cache_refuses_kv_bits_at_load(tiny_model, monkeypatch):
    """On a GPU, install runs a prompt piece and a decode step over fresh
    quantized caches, and a kernel that mlx lacks there (mlx-cuda has no
    quantized matmul of float32 queries for some shapes) fails the load
    with mlx's message and what to do, not every request after it. Run
    here with the GPU's route taken and mlx's failure injected."""
    from worker.engine import kv_quant, quant_attention, quant_decode_kernel
    from worker.runtime.loader import load

    monkeypatch.setattr(kv_quant, "processor", lambda: "cuda")
    monkeypatch.setattr(quant_decode_kernel, "check", lambda *args, **kwargs: "not on this machine")

    def lacking(*args, **kwargs):
        raise ValueError("[quantized_matmul] No implementation for problem shape")

    loaded = load(tiny_model)
    kv_quant.install(loaded.model, 8, 32)  # mlx has the kernel: the load goes on
    monkeypatch.setattr(quant_attention, "_grouped", lacking)
    with pytest.raises(ValueError) as caught:
        kv_quant.install(load(tiny_model).model, 8, 32)
    message = str(caught.value)
    assert "kv_bits 8: this cuda GPU cannot attend over a quantized cache of this model (float32)" in message
    assert "No implementation for problem shape" in message and "convert its weights to bf16 or run it without kv_bits" in message
