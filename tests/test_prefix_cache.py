"""Prefix cache: earlier requests' model state reused, output unchanged."""

import pytest
from hypothesis import given, settings, strategies as st

from harness.engine import engine_for, run
from harness.prompts import SYSTEM, chatml
from harness.worker import WorkerProc, terminal, text_of
from ipc.messages import Generate, Message
from tests.conftest import GREEDY_MARGIN, float32_margins, keep_alive_across_tests, release
from worker.cache.prefix_cache import chunk_ends, message_starts

QUESTIONS = [
    "Where does the river bend?",
    "Who built the mill, and when did it stop turning?",
    "Tell me about the bridge.",
    "And what grows along the bank in spring?",
]


@given(
    n=st.integers(1, 300),
    cuts=st.lists(st.integers(-5, 320), max_size=8),
    step=st.integers(1, 64),
    fold=st.integers(0, 16),
    data=st.data(),
)
@settings(max_examples=200, deadline=None)
def test_chunk_plan_after_a_cut_is_the_tail_of_the_full_plan(n, cuts, step, fold, data):
    full = chunk_ends(n, cuts, step, 0, fold)
    assert full[-1] == n and full == sorted(set(full))
    assert all(b - a <= step + fold for a, b in zip([0] + full, full))
    inside = [c for c in cuts if 0 < c < n]
    assert set(inside) <= set(full)
    # No piece of `fold` tokens or fewer is left alone before a cut or the end,
    # unless the cut before it made it so.
    bounds = set(inside) | {0, n}
    assert all(b - a > fold or a in bounds for a, b in zip([0] + full, full) if b in bounds)
    start = data.draw(st.sampled_from([0] + inside))
    assert chunk_ends(n, cuts, step, start, fold) == [e for e in full if e > start]


def test_message_starts_skip_position_zero():
    assert message_starts([7, 1, 2, 7, 3, 7], 7) == [3, 5]
    assert message_starts([1, 2, 3], None) == []


# -- real worker processes ----------------------------------------------------


@pytest.fixture(scope="module")
def pair(tiny_model):
    """The same model twice: with the prefix cache and without it. A small
    prefill step makes every message span several chunks."""
    cached = WorkerProc(tiny_model, "--prefill-step", "16")
    plain = WorkerProc(tiny_model, "--prefill-step", "16", "--prefix-cache-bytes", "0")
    for w in (cached, plain):
        keep_alive_across_tests(w.pid)
    for w in (cached, plain):
        w.wait_ready()
    yield cached, plain
    for w in (cached, plain):
        release(w.pid)
        assert w.close() == 0


_rid = iter(range(1, 1_000_000))


def ask(w, **kw):
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 24)
    w.send(Generate(rid=next(_rid), **kw))
    events = w.collect()
    return text_of(events), terminal(events)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


def test_multi_turn_messages_same_output_with_and_without_cache(pair):
    cached, plain = pair
    messages = [Message("system", SYSTEM)]
    for turn, question in enumerate(QUESTIONS):
        messages.append(Message("user", question))
        text_c, done_c = ask(cached, messages=list(messages), id_json=f'"t{turn}"')
        text_p, done_p = ask(plain, messages=list(messages), id_json=f'"t{turn}"')
        assert text_c == text_p and text_c
        assert done_c["gen_tokens"] == done_p["gen_tokens"] and done_c["prompt_tokens"] == done_p["prompt_tokens"]
        assert "cached_tokens" not in done_p
        if turn == 0:
            assert "cached_tokens" not in done_c
        else:
            assert 0 < done_c["cached_tokens"] < done_c["prompt_tokens"]
            assert [k for k in done_c if k != "_line"][-3:] == ["finish_reason", "cached_tokens", "id"]
        # The template drops reasoning from history, as Qwen's does.
        messages.append(Message("assistant", "<think>\nhm\n</think>\n\n" + text_c))


def test_raw_chatml_turns_resume_from_the_previous_history(pair, tokenizer):
    cached, plain = pair
    im_start = tokenizer.token_to_id("<|im_start|>")
    turns: list[tuple[str, str]] = []
    previous = None
    for question in QUESTIONS[:3]:
        turns.append(("user", question))
        prompt = chatml(turns)
        text_c, done_c = ask(cached, prompt=prompt)
        text_p, _ = ask(plain, prompt=prompt)
        assert text_c == text_p
        if previous is not None:
            # The previous prompt left a snapshot where its reply began.
            ids = tokenizer.encode(previous, add_special_tokens=False).ids
            expected = max(i for i, t in enumerate(ids) if t == im_start)
            assert done_c["cached_tokens"] == expected
        previous = prompt
        turns.append(("assistant", text_c))


def test_shared_system_prompt_serves_a_new_conversation(pair, tokenizer):
    cached, plain = pair
    system = SYSTEM + " Answer in one line."
    ask(cached, prompt=chatml([("user", "First conversation.")], system))
    prompt = chatml([("user", "A different conversation entirely.")], system)
    text_c, done_c = ask(cached, prompt=prompt)
    text_p, _ = ask(plain, prompt=prompt)
    assert text_c == text_p
    system_block = tokenizer.encode(f"<|im_start|>system\n{system}<|im_end|>\n", add_special_tokens=False).ids
    assert done_c["cached_tokens"] == len(system_block)


def test_repeated_prompt_still_runs_its_last_token(pair):
    cached, plain = pair
    prompt = chatml([("user", "Say something about stones.")], SYSTEM)
    first = ask(cached, prompt=prompt, temperature=0.8, seed=3)
    second = ask(cached, prompt=prompt, temperature=0.8, seed=3)
    reference = ask(plain, prompt=prompt, temperature=0.8, seed=3)
    assert first[0] == second[0] == reference[0]
    assert 0 < second[1]["cached_tokens"] < second[1]["prompt_tokens"]


@float32_margins
def test_rows_of_one_batch_resume_and_store_their_own_snapshots(pair, tokenizer, greedy_margins):
    cached, plain = pair
    im_start = tokenizer.token_to_id("<|im_start|>")
    systems = [f"{SYSTEM} Conversation {i}." for i in range(3)]
    firsts = [chatml([("user", q)], system) for q, system in zip(QUESTIONS, systems)]
    rids = [next(_rid) for _ in firsts]
    events = cached.send_together([Generate(rid=r, id_json=str(r), prompt=p, temperature=0.0, max_tokens=24) for r, p in zip(rids, firsts)])
    replies = [text_of(events[r]) for r in rids]
    seconds = [chatml([("user", q), ("assistant", reply), ("user", "Go on.")], system) for q, reply, system in zip(QUESTIONS, replies, systems)]
    rids = [next(_rid) for _ in seconds]
    events = cached.send_together([Generate(rid=r, id_json=str(r), prompt=p, temperature=0.0, max_tokens=24) for r, p in zip(rids, seconds)])
    for rid, first, second in zip(rids, firsts, seconds):
        ids = tokenizer.encode(first, add_special_tokens=False).ids
        # Each row resumed from its own conversation's snapshot.
        assert terminal(events[rid])["cached_tokens"] == max(i for i, t in enumerate(ids) if t == im_start)
        assert text_of(events[rid]) == ask(plain, prompt=second)[0]
    # Batched and resumed, a row's logits move by float noise only; these
    # greedy choices win by far more.
    assert min(greedy_margins(seconds, 24)) > GREEDY_MARGIN


def test_budget_too_small_for_a_snapshot_caches_nothing(tiny_model):
    w = WorkerProc(tiny_model, "--prefix-cache-bytes", "1000")
    try:
        w.wait_ready()
        for _ in range(2):
            _, done = ask(w, prompt=chatml([("user", "Hello there.")], SYSTEM))
            assert "cached_tokens" not in done
    finally:
        assert w.close() == 0


# -- in-process: eviction, adapter keys, trimmable models ------------------------


def test_least_recently_used_snapshot_is_evicted_first(engine):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from worker.cache.prefix_cache import PrefixCache

    model = engine.loaded.model
    pc = PrefixCache(model, budget_bytes=1 << 30)
    prompts = [engine.codec.encode(chatml([("user", f"Conversation number {i}.")])) for i in range(3)]
    starts = [message_starts(ids, engine.generator.chat_marker) for ids in prompts]

    def store(ids, end):
        cache = make_prompt_cache(model)
        model(mx.array(ids[:end])[None], cache=cache)
        pc.store(None, ids[:end], cache)

    for ids, cuts in zip(prompts[:2], starts[:2]):
        store(ids, cuts[-1])
    one = pc.used // 2
    assert len(pc) == 2 and one > 0
    pc.budget = 2 * one + one // 2
    _, hit = pc.resume(None, prompts[0], starts[0])  # touches the first entry
    assert hit == starts[0][-1]
    store(prompts[2], starts[2][-1])
    assert len(pc) == 2 and pc.used <= pc.budget
    assert pc.resume(None, prompts[0], starts[0])[1] == starts[0][-1]
    assert pc.resume(None, prompts[1], starts[1])[1] == 0
    assert pc.resume(None, prompts[2], starts[2])[1] == starts[2][-1]


def test_snapshots_are_keyed_by_adapter_content(engine, tiny_model, tmp_path):
    """Requests with different adapters never resume from each other's
    state; two paths holding the same adapter share it."""
    import shutil

    from tests.lora_files import lora_pairs, targets_of, write_peft

    one = write_peft(tmp_path / "one", lora_pairs(targets_of(tiny_model), seed=31, strength=2.0), r=4, alpha=8.0)
    same = shutil.copytree(one, tmp_path / "same")
    other = write_peft(tmp_path / "other", lora_pairs(targets_of(tiny_model), seed=32, strength=2.0), r=4, alpha=8.0)
    first = chatml([("user", "Adapter keyed question.")], "Adapter test system.")
    second = chatml([("user", "Adapter keyed question."), ("assistant", "ok"), ("user", "More.")], "Adapter test system.")
    run(engine, prompt=first, lora=str(one))
    ids_one, done = run(engine, prompt=second, lora=str(one))
    assert done["cached_tokens"] > 0
    ids_other, done = run(engine, prompt=second, lora=str(other))
    assert "cached_tokens" not in done and ids_other != ids_one
    ids_base, done = run(engine, prompt=second, lora=None)
    assert "cached_tokens" not in done and ids_base not in (ids_one, ids_other)
    ids_same, done = run(engine, prompt=second, lora=str(same))
    assert done["cached_tokens"] > 0 and ids_same == ids_one


def test_attention_only_model_trims_to_the_common_prefix(dense_model):
    cached = engine_for(dense_model)
    plain = engine_for(dense_model, prefix_cache_bytes=0)
    codec = cached.codec
    assert cached.prefix_cache.trimmable
    turns = [("user", QUESTIONS[0])]
    ids, done = run(cached, prompt=chatml(turns, SYSTEM))
    assert ids == run(plain, prompt=chatml(turns, SYSTEM))[0] and "cached_tokens" not in done
    first_ids = codec.encode(chatml(turns, SYSTEM))
    # The user rewrites the end of the question: the stored prompt is cut
    # back to where the two prompts part.
    edited = chatml([("user", QUESTIONS[0][:-1] + " today?")], SYSTEM)
    edited_ids = codec.encode(edited)
    common = next(i for i, (a, b) in enumerate(zip(first_ids, edited_ids)) if a != b)
    ids_c, done = run(cached, prompt=edited)
    assert ids_c == run(plain, prompt=edited)[0]
    assert done["cached_tokens"] == common
    # One snapshot per prompt; a longer one replaces its own prefixes.
    turns = [("user", QUESTIONS[0][:-1] + " today?"), ("assistant", codec.decode(ids_c)), ("user", QUESTIONS[1])]
    longer = chatml(turns, SYSTEM)
    ids_l, done = run(cached, prompt=longer)
    assert ids_l == run(plain, prompt=longer)[0]
    # A lone prompt's last token is read with its last chunk (its logits
    # give the first token), so the stored prompt is whole.
    assert done["cached_tokens"] == len(edited_ids)


@pytest.mark.parametrize("model", ["tiny_model", "dense_model"])
def test_a_resumed_cache_is_copied_once_with_room_for_the_prompt_and_first_token(model, request, monkeypatch):
    """A hit copies a snapshot's attention state once, into a buffer whose
    capacity is on the compiled decode step's grid and holds the rest of
    the prompt: neither the prompt's first write nor the first decode step
    makes another copy of it. The text is the uncached run's."""
    from worker.engine import compiled_step

    model_dir = request.getfixturevalue(model)
    cached = engine_for(model_dir)
    plain = engine_for(model_dir, prefix_cache_bytes=0)
    first = chatml([("user", QUESTIONS[0])], SYSTEM * 20)
    second = chatml([("user", QUESTIONS[1])], SYSTEM * 20)
    run(cached, prompt=first)
    regrown = []
    grow = compiled_step._grow

    def watched(c, col, width):
        before = c.keys.shape[2]
        grow(c, col, width)
        if c.keys.shape[2] != before:
            regrown.append((col, before, c.keys.shape[2]))

    monkeypatch.setattr(compiled_step, "_grow", watched)
    ids, done = run(cached, prompt=second)
    assert done["cached_tokens"] > 0.5 * done["prompt_tokens"]
    assert ids == run(plain, prompt=second)[0]
    assert not regrown


def test_adapter_swap_never_resumes_from_another_adapters_state(tiny_model, tmp_path):
    from ipc.messages import LoadAdapter
    from tests.lora_files import lora_pairs, targets_of, write_peft

    adapter = str(write_peft(tmp_path / "adapter", lora_pairs(targets_of(tiny_model), seed=11, strength=2.0), r=4, alpha=8.0))
    first = chatml([("user", QUESTIONS[0])], SYSTEM)
    second = chatml([("user", QUESTIONS[0]), ("assistant", "It bends twice."), ("user", QUESTIONS[1])], SYSTEM)
    cached = WorkerProc(tiny_model)
    adapted = WorkerProc(tiny_model, "--prefix-cache-bytes", "0")
    try:
        cached.wait_ready()
        adapted.wait_ready()
        ask(cached, prompt=first)
        base_text, done = ask(cached, prompt=second)
        assert done["cached_tokens"] > 0
        assert cached.ask(LoadAdapter(path=adapter))["ev"] == "adapter_loaded"
        text, done = ask(cached, prompt=second, lora=adapter)
        assert "cached_tokens" not in done
        assert text == ask(adapted, prompt=second, lora=adapter)[0] != base_text
        third = second + text + "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n"
        text, done = ask(cached, prompt=third, lora=adapter)
        assert done["cached_tokens"] > 0 and text == ask(adapted, prompt=third, lora=adapter)[0]
        text, done = ask(cached, prompt=second)
        assert done["cached_tokens"] > 0 and text == base_text
    finally:
        assert cached.close() == 0
        assert adapted.close() == 0


def test_the_default_budget_is_512_mib_on_a_cpu_and_an_eighth_of_a_gpus_memory():
    from worker.runtime.defaults import PREFIX_CACHE_BYTES, prefix_cache_bytes

    gib = 1024**3
    assert PREFIX_CACHE_BYTES == gib // 2
    assert prefix_cache_bytes(False, 80 * gib) == gib // 2
    assert prefix_cache_bytes(True, 80 * gib) == 10 * gib  # an H100
    assert prefix_cache_bytes(True, 2 * gib) == gib // 2  # never below the CPU's
    # Beside other workers on the GPU: a quarter of what they left.
    assert prefix_cache_bytes(True, 80 * gib, 20 * gib) == 5 * gib
    assert prefix_cache_bytes(True, 80 * gib, 70 * gib) == 10 * gib
    assert prefix_cache_bytes(True, 80 * gib, gib) == gib // 2
    assert prefix_cache_bytes(False, 80 * gib, gib) == gib // 2
