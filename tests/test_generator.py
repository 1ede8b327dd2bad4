"""The token generator and scheduler in one process: rows batched together
compute what each computes alone (up to float noise) for every cache type
mlx-lm models use, and failures end each request exactly once."""

from __future__ import annotations

import json
import math
from contextlib import contextmanager

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ChunkedKVCache, KVCache, QuantizedKVCache, make_prompt_cache

from harness.engine import ends_by_id, events, scheduler_for
from ipc.messages import Generate
from ipc.sampling import Sampling
from tests.conftest import LOGIT_TOLERANCE
from worker.cache.prefix_cache import PrefixCache, message_starts
from worker.engine.batch_cache import batchable
from worker.engine.generator import Row, TokenGenerator
from worker.engine.sampling import RowSampling

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="float32 tolerances of the CPU path")

GREEDY = Sampling(temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=1.0)


class Recorder:
    """A model that keeps the last-position logits of every call."""

    def __init__(self, model):
        self.model = model
        self.calls: list[mx.array] = []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, inputs, cache=None):
        out = self.model(inputs, cache=cache)
        self.calls.append(out[:, -1, :])
        return out


def make_generator(model, vocab: int, prefill_step: int = 64) -> TokenGenerator:
    return TokenGenerator(model, vocab, PrefixCache(model, 0), prefill_step, None)


def run(model, vocab: int, prompts: list[list[int]], steps: int, forced: list[list[int]] | None = None, join_after: int = 0, mid_prefill: bool = False):
    """Greedy rows through one generator; with `join_after`, the rest of the
    prompts start once the first ones have decoded two tokens (with
    `mid_prefill`: after the first prefill chunk, joining the group that is
    still reading). With `forced`, row i is fed forced[i] (teacher forcing)
    whatever it samples. Returns each row's decode logits, step by step."""
    rec = Recorder(model)
    gen = make_generator(rec, vocab)
    rows = [Row(i, ids, RowSampling(GREEDY, vocab, ids)) for i, ids in enumerate(prompts)]
    logits = {row: [] for row in rows}
    first, later = (rows[:join_after], rows[join_after:]) if join_after else (rows, [])
    gen.start(first)
    if later and mid_prefill:
        _step(gen, rec, logits, forced)
        assert gen.prefilling, "the first group is still reading"
        gen.start(later)
    elif later:
        while min(len(logits[row]) for row in first) < 2:
            _step(gen, rec, logits, forced)
        gen.start(later)
    while min(len(v) for v in logits.values()) < steps:
        _step(gen, rec, logits, forced)
    return [np.array(mx.stack(logits[row][:steps]).astype(mx.float32)) for row in rows]


def _step(gen, rec, logits, forced) -> None:
    order = list(gen.decoding)
    before = len(rec.calls)
    gen.step()
    if not order:
        return
    batch = rec.calls[before]
    for i, row in enumerate(order):
        n = len(logits[row])
        logits[row].append(batch[i])
        if forced is None:
            gen.force(row, int(mx.argmax(batch[i]).item()))
        elif n < len(forced[row.rid]):
            gen.force(row, forced[row.rid][n])


def check_batched_equals_alone(model, vocab: int, prompts: list[list[int]], steps: int = 6) -> float:
    alone = [run(model, vocab, [p], steps)[0] for p in prompts]
    tokens = [a.argmax(-1).tolist() for a in alone]
    worst = 0.0
    for join_after, mid_prefill in ((0, False), (2, False), (2, True)):
        batched = run(model, vocab, prompts, steps, forced=tokens, join_after=join_after, mid_prefill=mid_prefill)
        for a, b in zip(alone, batched):
            worst = max(worst, float(np.abs(a - b).max()))
    assert worst <= LOGIT_TOLERANCE
    return worst


def prompts_of(vocab: int, lengths=(130, 1, 70, 8, 200)) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(5, vocab, size=n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def qwen35(tiny_model):
    from worker.runtime.loader import load

    loaded = load(tiny_model)
    return loaded, json.loads((tiny_model / "config.json").read_text())["text_config"]["vocab_size"]


def test_hybrid_model_rows_batched_compute_what_they_compute_alone(qwen35):
    """Qwen3.5: gated-delta ArraysCache (chunked prefill with row masks) and
    attention KV caches; prompts of different lengths over several chunks,
    one of a single token, rows joining while others decode."""
    (loaded, vocab) = qwen35
    assert {type(c).__name__ for c in make_prompt_cache(loaded.model)} == {"ArraysCache", "KVCache"}
    check_batched_equals_alone(loaded.model, vocab, prompts_of(vocab))


def random_model(module, config: dict):
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model


def test_sliding_window_model_rows_batched_compute_what_they_compute_alone():
    """Gemma 3: RotatingKVCache layers with a window shorter than the
    prompts, so rows rotate, beside plain KV layers."""
    from mlx_lm.models import gemma3_text

    config = dict(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        head_dim=16,
        num_key_value_heads=2,
        vocab_size=256,
        sliding_window=8,
        sliding_window_pattern=2,
        query_pre_attn_scalar=16,
    )
    model = random_model(gemma3_text, config)
    assert {type(c).__name__ for c in make_prompt_cache(model)} == {"RotatingKVCache", "KVCache"}
    check_batched_equals_alone(model, 256, prompts_of(256), steps=12)


def test_attention_only_model_rows_batched_compute_what_they_compute_alone():
    from mlx_lm.models import qwen3

    config = dict(
        model_type="qwen3",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        vocab_size=256,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )
    model = random_model(qwen3, config)
    check_batched_equals_alone(model, 256, prompts_of(256))


def test_caches_without_batch_support_are_detected():
    assert batchable([KVCache(), KVCache()])
    assert not batchable([KVCache(), ChunkedKVCache(8)])
    assert not batchable([QuantizedKVCache()])


# -- the scheduler: failures, memory guard, one-at-a-time fallback --------------


def submit(s, n: int, start: int = 0, **kw) -> None:
    """n requests sampled at the default temperature, each with a seed of its
    own: unseeded, one could draw an end-of-turn token before max_tokens on
    some run, and a test counting tokens would fail at random."""
    kw.setdefault("max_tokens", 12)
    for i in range(start, start + n):
        fields = {"seed": 1000 + i} | kw
        s.submit(Generate(rid=i, prompt=f"<|im_start|>user\nQuestion {i}<|im_end|>\n", id_json=str(i), **fields), 0.0)


PROMPT_SHORT = "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"


class InputShapes(Recorder):
    """A model that keeps the shape of every call's inputs: (rows, tokens)."""

    def __init__(self, model):
        super().__init__(model)
        self.shapes: list[tuple[int, int]] = []

    def __call__(self, inputs, cache=None):
        self.shapes.append(inputs.shape)
        return super().__call__(inputs, cache)


def test_a_request_arriving_while_a_long_prompt_reads_joins_its_group(qwen35):
    """A short request that comes after a long prompt started reading joins
    that prefill group at its next chunk: its first token comes long before
    the long prompt's, and a forward still reads about prefill_step prompt
    tokens (the long row's pieces shrink while the short one reads, and
    grow back once it has left)."""
    loaded, _ = qwen35
    model = InputShapes(loaded.model)
    shapes = model.shapes
    s, lines = scheduler_for(loaded, model, prefill_step=128, compile_decode=False)
    long = "<|im_start|>user\n" + "Tell me about the river and the mill. " * 150 + "<|im_end|>\n<|im_start|>assistant\n"
    s.submit(Generate(rid=1, prompt=long, id_json='"long"', max_tokens=4, temperature=0.0), 0.0)
    s.step()
    assert s.generator.prefilling, "the long prompt reads over several chunks"
    s.submit(Generate(rid=2, prompt=PROMPT_SHORT, id_json='"short"', max_tokens=4, temperature=0.0), 0.0)
    while s.has_work:
        s.step()
    first = [e["id"] for e in events(lines) if e["ev"] == "gen_token"]
    assert first.index("short") < first.index("long")
    assert {e["id"]: e["finish_reason"] for e in events(lines) if e.get("done")} == {"long": "length", "short": "length"}
    chunks = [(rows, width) for rows, width in shapes if width > 1]
    assert any(rows == 2 for rows, _ in chunks), "the short prompt was read in the long one's group"
    assert max(rows * width for rows, width in chunks) <= 128, chunks
    # Once the short one has left, the long one reads prefill_step pieces
    # again, after at most one piece that brings it back onto their grid.
    joint = [i for i, (rows, _) in enumerate(chunks) if rows == 2]
    assert (1, 128) in chunks[joint[-1] + 1 : joint[-1] + 3], chunks


def test_a_row_leaving_a_group_mid_prefill_leaves_the_others_reading(qwen35):
    """The long prompt is cancelled while a row that joined its group still
    reads: the joiner reads on alone, in prefill_step pieces again, and
    ends as it would alone."""
    loaded, _ = qwen35
    medium = "<|im_start|>user\n" + "Herons wait by the bridge. " * 40 + "<|im_end|>\n<|im_start|>assistant\n"
    long = "<|im_start|>user\n" + "Tell me about the river and the mill. " * 150 + "<|im_end|>\n<|im_start|>assistant\n"
    model = InputShapes(loaded.model)
    shapes = model.shapes
    s, lines = scheduler_for(loaded, model, prefill_step=128, compile_decode=False)
    s.submit(Generate(rid=1, prompt=long, id_json='"long"', max_tokens=4, temperature=0.0), 0.0)
    s.step()
    s.submit(Generate(rid=2, prompt=medium, id_json='"medium"', max_tokens=6, temperature=0.0), 0.0)
    s.step()
    assert len(s.generator.prefilling) == 2, "the medium prompt reads in the long one's group"
    s.cancel(1)
    after = len(shapes)
    while s.has_work:
        s.step()
    ends = {e["id"]: e for e in events(lines) if e.get("done") or e["ev"] == "error"}
    assert ends["long"]["finish_reason"] == "cancelled"
    assert ends["medium"]["finish_reason"] == "length" and ends["medium"]["gen_tokens"] == 6
    assert (1, 128) in shapes[after:], shapes


class Failing(Recorder):
    def __init__(self, model):
        super().__init__(model)
        self.fail = False

    def __call__(self, inputs, cache=None):
        if self.fail:
            self.fail = False
            raise RuntimeError("injected failure")
        return super().__call__(inputs, cache)


def test_a_failed_batch_step_ends_every_active_row_once_and_the_worker_goes_on(qwen35):
    loaded, _ = qwen35
    model = Failing(loaded.model)
    # Op by op: a compiled step replays its trace without calling the
    # wrapper, and a failure while tracing falls back to the model's forward.
    s, lines = scheduler_for(loaded, model, compile_decode=False)
    submit(s, 3, max_tokens=50)
    while len(s.generator.decoding) < 3:
        s.step()
    submit(s, 1, start=3)  # starts reading its prompt in the failing step
    model.fail = True
    s.step()
    ends = ends_by_id(lines)
    assert sorted(ends) == [0, 1, 2]
    assert all(len(v) == 1 and v[0]["ev"] == "error" and v[0]["code"] == "worker_crashed" for v in ends.values())
    # The decode batch is gone; the prefill group's own state is intact.
    assert [row.rid for row in s.generator.rows] == [3] and [row.rid for row in s.streams] == [3]
    s.drain()
    ends = ends_by_id(lines)
    assert ends[3][0]["ev"] == "gen_token" and ends[3][0]["gen_tokens"] == 12
    assert all(len(v) == 1 for v in ends.values())


def test_an_exception_in_one_rows_stream_ends_that_row_alone(qwen35):
    loaded, _ = qwen35
    s, lines = scheduler_for(loaded)
    submit(s, 3)
    s.step()
    victim = next(row for row in s.streams if row.rid == 1)
    stream = s.streams[victim]

    def broken(token):
        raise ValueError("detokenizer broke")

    stream.feed = broken
    s.drain()
    ends = ends_by_id(lines)
    assert [e["ev"] for e in ends[1]] == ["error"] and "detokenizer broke" in ends[1][0]["msg"]
    assert [e["gen_tokens"] for e in ends[0] + ends[2]] == [12, 12]


def test_a_fault_in_the_scheduler_itself_ends_the_active_requests_once(qwen35):
    loaded, _ = qwen35
    s, lines = scheduler_for(loaded)
    submit(s, 2)
    s.step()
    real = s._stream

    def broken(out):
        s._stream = real
        raise RuntimeError("scheduler bug")

    s._stream = broken
    s.step()
    ends = ends_by_id(lines)
    assert sorted(ends) == [0, 1] and all([e["ev"] for e in v] == ["error"] for v in ends.values())
    submit(s, 1, start=2)
    s.drain()
    assert ends_by_id(lines)[2][0]["gen_tokens"] == 12 and not s.streams


def test_memory_guard_holds_rows_back_until_others_end(qwen35):
    loaded, _ = qwen35
    probe, _ = scheduler_for(loaded)
    one_row = probe._projected_bytes([40])
    s, lines = scheduler_for(loaded, batch_memory=one_row + one_row // 2)
    submit(s, 3, max_tokens=6)
    s.step()
    assert (s.figures["active_rows"], s.figures["waiting_rows"]) == (1, 2)
    assert 0 < s.figures["rows_cache_bytes"] <= one_row
    s.drain()
    assert sorted(ends_by_id(lines)) == [0, 1, 2]
    assert s.figures["rows_cache_bytes"] == 0


def test_an_idle_release_of_never_keeps_the_buffers(qwen35):
    loaded, _ = qwen35
    for release_s, expected in ((5.0, 5.0), (math.inf, None)):
        s, _ = scheduler_for(loaded, idle_release_s=release_s)
        submit(s, 1, max_tokens=2)
        assert s.idle_release_in(0.0) is None  # busy
        s.drain()
        left = s.idle_release_in(s.idle_since)
        assert left == expected, release_s


class ChunkedKV:
    """A dense model whose attention keeps mlx-lm's chunked KV cache (llama4's),
    which has no batch form; its chunk is longer than any test prompt."""

    def __init__(self, model):
        self.model = model

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, inputs, cache=None):
        return self.model(inputs, cache=cache)

    def make_cache(self):
        return [ChunkedKVCache(4096) for _ in self.model.layers]


def test_unbatchable_caches_run_one_request_at_a_time(dense_model):
    from worker.runtime.loader import load

    loaded = load(dense_model)
    s, lines = scheduler_for(loaded, ChunkedKV(loaded.model), max_batch=8)
    assert s.max_batch == 1
    submit(s, 3)
    s.step()
    assert (s.figures["active_rows"], s.figures["waiting_rows"]) == (1, 2)
    s.drain()
    assert [v[0]["gen_tokens"] for _, v in sorted(ends_by_id(lines).items())] == [12, 12, 12]


class Passes(Recorder):
    """A model that keeps every call's logits and how many tokens each row read."""

    def __init__(self, model):
        super().__init__(model)
        self.lengths: list[int] = []

    def __call__(self, inputs, cache=None):
        self.lengths.append(inputs.shape[1])
        return super().__call__(inputs, cache=cache)


@contextmanager
def positions_read(module):
    """The lengths (positions per row) of the module's calls while it lasts."""
    lengths: list[int] = []
    original = type(module).__call__

    def counted(self, inputs, *args, **kwargs):
        if self is module:
            lengths.append(inputs.shape[1])
        return original(self, inputs, *args, **kwargs)

    type(module).__call__ = counted  # Python looks a call up on the type
    try:
        yield lengths
    finally:
        type(module).__call__ = original


# The chat marker of the tests' seeded chats (<|im_start|>'s id stands in).
MARKER = 7


def seeded_chat(rng, system: list[int] | None = None) -> list[int]:
    """<|im_start|>system..., <|im_start|>user..., <|im_start|>assistant\n
    as ids: a 30-token system prompt (drawn unless given), then a 36-token
    user message, both drawn from rng in that order."""
    system = rng.integers(10, 200, size=30).tolist() if system is None else system
    user = rng.integers(10, 200, size=36).tolist()
    return [MARKER] + system + [MARKER] + user + [MARKER, 8, 9]


def read_chat_prompt(model, vocab: int, ids: list[int], marker: int, steps: int, defer: bool = False) -> tuple[list[int], list[int]]:
    """A lone greedy row of the model itself: its first `steps` tokens and
    the passes it took (tokens read per row in each call of the model's
    body, which a lone prompt's last chunk calls without the head)."""
    with positions_read(getattr(model, "language_model", model).model) as lengths:
        gen = TokenGenerator(model, vocab, PrefixCache(model, 0), 64, marker)
        gen.defer_from = 0 if defer else None
        row = Row(0, ids, RowSampling(GREEDY, vocab, ids))
        gen.start([row])
        tokens: list[int] = []
        while len(tokens) < steps:
            tokens += [token for _, token in gen.step() if token is not None]
    return tokens, lengths


def test_a_chat_prompt_reads_in_the_passes_mlx_lm_takes(dense_model, qwen35):
    """An attention-only model reads a lone chat prompt, its last token
    included, in one pass (no pass of its own for the assistant's opener
    after the last message start, nor for a short piece past a chunk), whose
    last logits give the first token: one pass fewer than mlx-lm's prompt
    and first step, and mlx-lm's greedy tokens. A hybrid model ends a chunk
    at each message start, where its prefix-cache snapshots are taken (on
    a GPU, all but the last); its last chunk reads the last token too."""
    from mlx_lm.generate import generate_step

    from worker.runtime.loader import load

    chat = seeded_chat(np.random.default_rng(5))
    loaded = load(dense_model)
    vocab = loaded.model.args.vocab_size
    tokens, lengths = read_chat_prompt(loaded.model, vocab, chat, MARKER, 8)
    # 71 tokens with a 64-token step: the 7 past the step fold into the
    # pass; then one-token passes (run ahead: one past the last token read).
    assert lengths[0] == len(chat) and set(lengths[1:]) == {1}
    theirs = [int(t) for t, _ in generate_step(mx.array(chat), loaded.model, max_tokens=8)]
    assert tokens == theirs
    hybrid, hybrid_vocab = qwen35
    cut, lengths = read_chat_prompt(hybrid.model, hybrid_vocab, chat, MARKER, 2)
    assert lengths[:3] == [31, 37, 3] and set(lengths[3:]) == {1}
    through, lengths = read_chat_prompt(hybrid.model, hybrid_vocab, chat, MARKER, 2, defer=True)
    assert lengths[:2] == [31, 40] and set(lengths[2:]) == {1}
    assert through == cut


def test_on_a_cpu_a_lone_prompt_reads_through_its_last_cut_from_cpu_defer_from_tokens(qwen35, monkeypatch):
    """A CPU pass costs its tokens' arithmetic: a short chat prompt keeps
    its last cut (the snapshot taken before the first token), and one of
    CPU_DEFER_FROM tokens or more reads through it, its snapshot left to a
    ghost row after the first token; the tokens are the same."""
    if mx.default_device() == mx.gpu:
        pytest.skip("a GPU reads through every lone prompt's last cut")
    from worker.engine import generator as generator_module

    loaded, vocab = qwen35
    chat = seeded_chat(np.random.default_rng(5))

    def passes() -> tuple[list[int], list[int]]:
        with positions_read(loaded.model.language_model.model) as lengths:
            gen = TokenGenerator(loaded.model, vocab, PrefixCache(loaded.model, 1 << 30), 64, MARKER)
            gen.start([Row(0, chat, RowSampling(GREEDY, vocab, chat))])
            tokens: list[int] = []
            while len(tokens) < 4 or gen.prefilling:
                tokens += [token for _, token in gen.step() if token is not None]
        return tokens[:4], lengths

    assert generator_module.CPU_DEFER_FROM > len(chat)
    cut, lengths = passes()
    assert lengths[:3] == [31, 37, 3] and 37 not in lengths[3:]
    monkeypatch.setattr(generator_module, "CPU_DEFER_FROM", len(chat))
    through, lengths = passes()
    assert lengths[:2] == [31, 40] and 37 in lengths[2:]  # the ghost's pass
    assert through == cut
    monkeypatch.setattr(generator_module, "CPU_DEFER_FROM", len(chat) + 1)
    assert passes()[1][:3] == [31, 37, 3]


def test_a_hybrid_prompts_last_snapshot_is_read_after_its_first_token(qwen35, monkeypatch):
    """Where snapshots are deferred (a GPU's default), a hybrid model's
    lone chat prompt reads through its last message start with a prefix
    cache too; after its first token is pending, a ghost row reads the
    prompt from the system prompt's snapshot up to that start and stores
    the snapshot there. The tokens are those of a worker without a cache,
    and the next turn resumes there with the tokens a cold read gives. A
    last message past DEFER_AT_MOST tokens keeps its cut."""
    from worker.engine import generator as generator_module

    loaded, vocab = qwen35
    model = loaded.model
    rng = np.random.default_rng(5)
    chat = seeded_chat(rng)

    def read(ids: list[int], cache: PrefixCache) -> tuple[list[int], list[int], Row]:
        """The first tokens, and the passes taken until no row reads."""
        steps.clear()
        with positions_read(getattr(model, "language_model", model).model) as lengths:
            gen = TokenGenerator(model, vocab, cache, 64, MARKER)
            gen.defer_from = 0
            row = Row(0, ids, RowSampling(GREEDY, vocab, ids))
            gen.start([row])
            tokens: list[int] = []
            while len(tokens) < 6 or gen.prefilling:
                tokens += [token for _, token in gen.step() if token is not None]
                steps.append((len(lengths), len(tokens)))
        return tokens, lengths, row

    steps: list[tuple[int, int]] = []  # (passes so far, tokens so far) after each step
    cold, _, _ = read(chat, PrefixCache(model, 0))
    cache = PrefixCache(model, 1 << 30)
    tokens, lengths, _ = read(chat, cache)
    assert tokens == cold
    # The ghost's pass (37 tokens, from the snapshot at 31) comes in a step
    # after the one that read the first token.
    ghost = lengths.index(37)
    assert lengths[:2] == [31, 40] and set(lengths[2:ghost] + lengths[ghost + 1 :]) == {1}
    built = next(i for i, (passes, _) in enumerate(steps) if passes > ghost)
    assert built > 0 and steps[built - 1][1] >= 1
    assert sorted(len(e.tokens) for e in cache._entries.values()) == [31, 68]
    following = chat + tokens[:4] + [MARKER] + rng.integers(10, 200, size=12).tolist() + [MARKER, 8, 9]
    want, _, _ = read(following, PrefixCache(model, 0))
    got, _, row = read(following, cache)
    assert row.cached == 68 and got == want
    # A ghost that cannot start (here: its snapshot cannot be restored) is
    # dropped; the request goes on.
    failing = PrefixCache(model, 1 << 30)
    resume = failing.resume
    monkeypatch.setattr(failing, "resume", lambda adapter, ids, cuts: resume(adapter, ids, cuts) if len(ids) == len(chat) else 1 / 0)
    tokens, lengths, _ = read(chat, failing)
    assert tokens == cold and 37 not in lengths
    assert sorted(len(e.tokens) for e in failing._entries.values()) == [31]
    monkeypatch.setattr(generator_module, "DEFER_AT_MOST", 36)  # the last message is 37 tokens
    _, lengths, _ = read(chat, PrefixCache(model, 1 << 30))
    assert lengths[:3] == [31, 37, 3]


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_a_folded_chunk_computes_its_last_layer_at_the_last_position_only(dense_model, qwen35, kind):
    """The last layer of a lone prompt's last chunk takes the positions before
    the last and then the last in two calls (mlx never runs the first one's
    output); the last position's hidden state and every cache are those of
    one call over the whole chunk. An array mask (a padded batch) is left
    whole."""
    from mlx.utils import tree_flatten

    from worker.runtime.loader import load
    from worker.runtime.parts import last_position_only, model_parts

    model = load(dense_model).model if kind == "dense" else qwen35[0].model
    _, body, _ = model_parts(model)
    ids = mx.array(np.random.default_rng(3).integers(10, 200, size=(1, 41)))
    want_cache = make_prompt_cache(model)
    want = body(ids, cache=want_cache)[:, -1]
    layer = body.layers[-1]
    with positions_read(layer) as seen:
        got_cache = make_prompt_cache(model)
        with last_position_only(body):
            got = body(ids, cache=got_cache)
        assert body.layers[-1] is layer
        with last_position_only(body):
            body.layers[-1](mx.zeros((1, 3, got.shape[-1])), mx.zeros((1, 1, 3, 3), dtype=mx.bool_), None)
    assert seen == [40, 1, 3]
    assert got.shape[1] == 1
    assert mx.abs(got[:, -1] - want).max().item() <= LOGIT_TOLERANCE

    def arrays(cache) -> list[mx.array]:
        return [v for _, v in tree_flatten(cache.state) if isinstance(v, mx.array)]

    for a, b in zip(want_cache, got_cache):
        assert len(arrays(a)) == len(arrays(b)) > 0
        for x, y in zip(arrays(a), arrays(b)):
            assert x.shape == y.shape and mx.abs(x - y).max().item() <= LOGIT_TOLERANCE


def test_a_chat_with_deferred_snapshots_through_the_scheduler(qwen35):
    """Two turns of a chat through the worker's scheduler with deferred
    snapshots: each request ends once, the ghost row streams nothing and
    counts in no figure, the worker goes idle once it is done, and the
    second turn resumes from the snapshot at the first prompt's last
    message start."""
    loaded, _ = qwen35
    s, lines = scheduler_for(loaded, prefix_cache_bytes=1 << 30)
    s.generator.defer_from = 0
    first = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhere does the river bend?<|im_end|>\n<|im_start|>assistant\n"
    s.submit(Generate(rid=1, prompt=first, id_json='"t1"', max_tokens=8, temperature=0.0), 0.0)
    with positions_read(loaded.model.language_model.model) as lengths:
        while s.has_work:
            s.step()
            assert s.figures["active_rows"] <= 1
    assert not s.generator and s.figures["active_rows"] == 0
    ids = s.codec.encode(first)
    user, assistant = message_starts(ids, s.generator.chat_marker)
    # Read through the assistant's start, then the ghost's pass up to it.
    assert lengths[:2] == [user, len(ids) - user] and assistant - user in lengths[2:]
    reply = "".join(e["token"] for e in events(lines) if e["ev"] == "gen_token" and not e.get("done"))
    second = first + reply + "<|im_end|>\n<|im_start|>user\nAnd the mill?<|im_end|>\n<|im_start|>assistant\n"
    s.submit(Generate(rid=2, prompt=second, id_json='"t2"', max_tokens=8, temperature=0.0), 0.0)
    while s.has_work:
        s.step()
    ends = ends_by_id(lines)
    assert sorted(ends) == ["t1", "t2"] and all(len(v) == 1 and v[0].get("done") for v in ends.values())
    assert {e.get("id") for e in events(lines)} == {"t1", "t2"}
    assert ends["t2"][0]["cached_tokens"] == assistant


def test_rows_starting_together_keep_their_cut_and_ghosts_start_one_at_a_time(qwen35):
    """Two hybrid chat prompts that start together keep their cut at the
    last message start (where deferred, each ghost would be a pass of its
    own); ghost rows queued together read their prefixes in steps of their
    own, one after the other, and store their snapshots."""
    loaded, vocab = qwen35
    model = loaded.model
    rng = np.random.default_rng(6)
    system = rng.integers(10, 200, size=30).tolist()
    chats = [seeded_chat(rng, system) for _ in range(2)]
    body = getattr(model, "language_model", model).model
    cache = PrefixCache(model, 1 << 30)
    with positions_read(body) as lengths:
        gen = TokenGenerator(model, vocab, cache, 64, MARKER)
        gen.defer_from = 0
        gen.start([Row(i, ids, RowSampling(GREEDY, vocab, ids)) for i, ids in enumerate(chats)])
        for _ in range(6):
            gen.step()
    assert lengths[:3] == [31, 37, 3] and not gen._deferred
    cache = PrefixCache(model, 1 << 30)
    with positions_read(body) as lengths:
        gen = TokenGenerator(model, vocab, cache, 64, MARKER)
        gen._deferred.extend(Row(i, ids[:69], RowSampling(GREEDY, vocab, ids), ghost=True) for i, ids in enumerate(chats))
        while gen:
            gen.step()
    # The first reads the system prompt (its snapshot stored on the way)
    # and its message; the second, started after it, resumes at the system
    # prompt (together they would have read both in the same two passes).
    assert lengths == [31, 37, 37]
    assert sorted(len(e.tokens) for e in cache._entries.values()) == [31, 68, 68]


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_prompts_starting_together_on_an_idle_batch_read_their_last_tokens_in_their_pass(dense_model, qwen35, kind):
    """Prompts of different lengths that start together while no row
    decodes read their last tokens in their one (padded) chunk, the logits
    taken at each row's own last token: that pass gives every row's first
    token, no decode step reads the prompts' last tokens, and each row's
    greedy tokens are those it gives alone."""
    from worker.runtime.loader import load

    if kind == "dense":
        loaded = load(dense_model)
        model, vocab = loaded.model, loaded.model.args.vocab_size
    else:
        model, vocab = qwen35[0].model, qwen35[1]
    rng = np.random.default_rng(4)
    prompts = [rng.integers(10, 200, size=n).tolist() for n in (5, 9, 14)]

    def read(group: list[list[int]]) -> tuple[list[list[int]], list[int]]:
        with positions_read(getattr(model, "language_model", model).model) as lengths:
            gen = TokenGenerator(model, vocab, PrefixCache(model, 0), 64, None)
            rows = [Row(i, ids, RowSampling(GREEDY, vocab, ids)) for i, ids in enumerate(group)]
            gen.start(rows)
            tokens: dict[int, list[int]] = {i: [] for i in range(len(rows))}
            while min(len(t) for t in tokens.values()) < 6:
                for row, token in gen.step():
                    if token is not None:
                        tokens[row.rid].append(token)
        return [tokens[i][:6] for i in range(len(rows))], lengths

    together, lengths = read(prompts)
    assert lengths[0] == 14 and set(lengths[1:]) == {1}, lengths
    assert together == [read([p])[0][0] for p in prompts]


def test_prompts_arriving_together_are_read_in_one_pass(dense_model):
    """32 prompts of 53-80 tokens start together: each row's piece is 64
    tokens, and the few left past it fold into the same pass, so every row
    joins the decode batch after one forward."""
    from worker.runtime.loader import load

    loaded = load(dense_model)
    vocab = loaded.model.args.vocab_size
    rng = np.random.default_rng(9)
    prompts = [rng.integers(10, 200, size=int(n)).tolist() for n in rng.integers(53, 81, size=32)]
    rec = Passes(loaded.model)
    gen = TokenGenerator(rec, vocab, PrefixCache(rec, 0), 512, None)
    gen.start([Row(i, ids, RowSampling(GREEDY, vocab, ids)) for i, ids in enumerate(prompts)])
    gen.step()
    assert rec.lengths == [max(len(p) for p in prompts) - 1]
    assert not gen.prefilling and len(gen.decoding) == 32
