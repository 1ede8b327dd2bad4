"""Speculative decoding in the batched engine (worker.engine.speculate), in one
process: a row decoded with drafts gives the tokens it gives without them,
greedy or seeded, on an attention-only and a hybrid (gated-delta) model,
beside rows that draft well, badly or not at all, with adapters, grammars,
stop strings, reasoning budgets and cancels."""

from __future__ import annotations

import itertools
import json
import math
import re

import mlx.core as mx
import numpy as np
import pytest

from ipc.messages import Generate, read_response_format
from tests.conftest import greedy_steps
from worker.runtime.loader import load

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="float32 tolerances of the CPU path")

# How far apart the two best logits of a plain greedy step must be for the
# speculative run to be held to the same token: a verify forward reads
# several tokens at once, which moves logits by float noise (~1e-6).
TIE = 1e-3

# The demo model's greedy text falls into loops that prompt lookup drafts well.
LOOPY = "<|im_start|>user\nThe river and the mill. The river and the mill.<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = [
    LOOPY,
    "<|im_start|>user\nHello<|im_end|>\n",
    "<|im_start|>user\nTell me a story about the sea and the ships.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite it again: the heron waits by the bridge, the heron waits.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def hybrid(tiny_model):
    return load(tiny_model)


@pytest.fixture(scope="module")
def dense(dense_model):
    return load(dense_model)


def scheduler(loaded, draft: str | None = "ngram", **kw):
    from worker.engine.scheduler import Scheduler
    from worker.text.tokenizer import TextCodec

    lines: list[bytes] = []
    kw.setdefault("batch_memory", 1 << 30)
    kw.setdefault("prefix_cache_bytes", 0)
    s = Scheduler(loaded, TextCodec(loaded.path, loaded.config), lines.append, draft=draft, **kw)
    if s.speculator is not None:
        # Every step takes one tick: which steps draft depends on the rows
        # alone, not on this machine's speed (the worker's timing has tests
        # of its own, and test_pace).
        s.speculator._clock = itertools.count().__next__
    return s, lines


def events(lines: list[bytes]) -> list[dict]:
    return [json.loads(line[len(b"@@lattice ") :]) for line in b"".join(lines).splitlines()]


def done_lines(lines: list[bytes]) -> dict:
    return {e["id"]: e for e in events(lines) if e.get("done")}


def texts(lines: list[bytes]) -> dict:
    out: dict = {}
    for e in events(lines):
        if e["ev"] == "gen_token":
            out[e["id"]] = out.get(e["id"], "") + e["token"]
    return out


def generate(loaded, prompts, draft="ngram", per_request=None, **kw):
    """Runs the prompts as one batch; returns (ids by rid, final lines by id, text by id, scheduler)."""
    s, lines = scheduler(loaded, draft)
    for i, prompt in enumerate(prompts):
        fields = dict(max_tokens=40, temperature=0.0, repetition_penalty=1.0) | kw | ((per_request or {}).get(i, {}))
        s.submit(Generate(rid=i, prompt=prompt, id_json=str(i), **fields), 0.0)
    ids = s.drain()
    return ids, done_lines(lines), texts(lines), s


def assert_same_greedy(loaded, prompts, plain: dict, drafted: dict, n: int) -> None:
    """Equal tokens, except from a step where the plain run's best two
    logits tie within TIE (then the rest may differ)."""
    from worker.text.tokenizer import TextCodec

    codec = TextCodec(loaded.path, loaded.config)
    for rid, ids in plain.items():
        if drafted[rid] == ids:
            continue
        first = next(i for i, (a, b) in enumerate(zip(ids, drafted[rid])) if a != b)
        _, margins = greedy_steps(loaded.model, codec, prompts[rid], n)
        assert margins[first] < TIE, (rid, first, ids, drafted[rid])


@pytest.mark.parametrize("which", ["dense", "hybrid"])
def test_greedy_rows_give_the_tokens_of_plain_decoding(which, request):
    loaded = request.getfixturevalue(which)
    plain, plain_done, _, _ = generate(loaded, PROMPTS, draft=None)
    drafted, done, _, s = generate(loaded, PROMPTS)
    assert_same_greedy(loaded, PROMPTS, plain, drafted, 40)
    # Speculation ran and kept drafts, or this test proves nothing.
    assert sum(d["accepted_tokens"] for d in done.values()) > 20
    assert all(0 <= d["accepted_tokens"] <= d["drafted_tokens"] for d in done.values())
    assert "drafted_tokens" not in json.dumps(plain_done)
    # The verify forwards took the compiled step's traces.
    assert any(str(shape[0]).startswith("verify") for shape in s.compiled._block_shapes)
    figures = s.figures
    assert figures["drafted_tokens"] == sum(d["drafted_tokens"] for d in done.values())
    assert figures["accepted_tokens"] == sum(d["accepted_tokens"] for d in done.values())


def test_the_gated_delta_roll_back_by_feeding_kept_tokens_again_gives_the_same_tokens(hybrid, second_model):
    """The roll-back used on Metal (state from before the step, kept tokens
    fed again), run here on the CPU, which keeps per-position states; the
    drafts of a demo model of another seed are kept in part."""
    plain, _, _, _ = generate(hybrid, PROMPTS, draft=None, max_tokens=24)
    s, lines = scheduler(hybrid, str(second_model))
    s.speculator.per_position = False
    for i, prompt in enumerate(PROMPTS):
        s.submit(Generate(rid=i, prompt=prompt, id_json=str(i), max_tokens=24, temperature=0.0, repetition_penalty=1.0), 0.0)
    ids = s.drain()
    done = done_lines(lines)
    assert_same_greedy(hybrid, PROMPTS, plain, ids, 24)
    assert any(0 < d["accepted_tokens"] < d["drafted_tokens"] for d in done.values()), done


@pytest.mark.parametrize("which", ["dense", "hybrid"])
def test_seeded_sampled_rows_reproduce_and_match_plain_decoding(which, request):
    """Each position's draw uses the plain step's noise (the row's key split
    once per token), so a seeded row gives plain decoding's tokens. Rows
    without a repetition penalty fall into the loops that prompt lookup
    drafts; with one (rows 0 and 3), sampled text rarely repeats a bigram,
    so row 0 samples cooler to be drafted too."""
    loaded = request.getfixturevalue(which)
    kw = dict(temperature=0.8, top_k=40, top_p=0.95, repetition_penalty=1.1, max_tokens=32)
    seeds = {i: {"seed": 11 + i} for i in range(len(PROMPTS))}
    seeds[0]["temperature"] = 0.5
    for i in (1, 2):
        seeds[i]["repetition_penalty"] = 1.0
    plain, _, _, _ = generate(loaded, PROMPTS, draft=None, per_request=seeds, **kw)
    first, done, _, _ = generate(loaded, PROMPTS, per_request=seeds, **kw)
    again, _, _, _ = generate(loaded, PROMPTS, per_request=seeds, **kw)
    assert first == again == plain
    assert sum(d["drafted_tokens"] for d in done.values()) > 0


def test_rows_with_different_acceptance_share_a_batch(hybrid):
    """A row that drafts well, one that drafts badly, a sampled one and one
    that asked for no speculation, in one batch: each gives its plain tokens,
    and each keeps its own counts."""
    per = {1: {"speculative": False}, 2: {"temperature": 0.9, "seed": 5}}
    plain, _, _, _ = generate(hybrid, PROMPTS, draft=None, per_request=per)
    drafted, done, _, _ = generate(hybrid, PROMPTS, per_request=per)
    assert drafted[2] == plain[2]
    greedy = [0, 1, 3]
    assert_same_greedy(hybrid, PROMPTS, {i: plain[i] for i in greedy}, drafted, 40)
    assert "drafted_tokens" not in done[1]
    rates = {i: done[i]["accepted_tokens"] / max(1, done[i]["drafted_tokens"]) for i in (0, 2, 3)}
    assert done[0]["accepted_tokens"] > 10
    assert len({round(r, 2) for r in rates.values()}) > 1, rates


def test_a_stop_string_inside_a_drafted_block_ends_the_row_there(hybrid):
    _, _, plain_text, _ = generate(hybrid, [LOOPY], draft=None, max_tokens=60)
    # A stop string from well inside the loop, where blocks of drafts are kept.
    text = plain_text[0]
    # The demo model's text loops, so any short piece of it comes round early:
    # half the text, from a quarter in, first ends past the middle.
    stop = text[len(text) // 4 : len(text) // 4 + len(text) // 2]
    _, plain_done, plain_text, _ = generate(hybrid, [LOOPY], draft=None, max_tokens=60, stop=[stop])
    s, lines = scheduler(hybrid)
    # Every step takes one tick: on a loaded machine the worker's own timing
    # could judge drafts slower and switch them off before the stop string.
    s.speculator._clock = itertools.count().__next__
    blocks: list[int] = []
    stream = s._stream

    def record(out):
        blocks.append(sum(1 for row, t in out if t is not None))
        stream(out)

    s._stream = record
    s.submit(Generate(rid=0, prompt=LOOPY, id_json="0", max_tokens=60, temperature=0.0, repetition_penalty=1.0, stop=[stop]), 0.0)
    s.drain()
    done = done_lines(lines)[0]
    assert texts(lines)[0] == plain_text[0] and done["finish_reason"] == plain_done[0]["finish_reason"] == "stop"
    assert done["gen_tokens"] == plain_done[0]["gen_tokens"]
    # The step that met the stop string gave more tokens than it streamed.
    assert blocks[-1] > 1 and done["accepted_tokens"] > 0


def test_cancel_mid_draft_ends_that_row_and_spares_the_others(hybrid):
    plain, _, _, _ = generate(hybrid, PROMPTS, draft=None)
    s, lines = scheduler(hybrid)
    for i, prompt in enumerate(PROMPTS):
        s.submit(Generate(rid=i, prompt=prompt, id_json=str(i), max_tokens=40, temperature=0.0, repetition_penalty=1.0), 0.0)
    while s.speculator.drafted == 0:
        s.step()
    s.cancel(0)
    ids = s.drain()
    done = done_lines(lines)
    assert done[0]["finish_reason"] == "cancelled" and "drafted_tokens" in done[0]
    assert_same_greedy(hybrid, PROMPTS, {i: plain[i] for i in (1, 2, 3)}, ids, 40)
    assert [e for e in events(lines) if e.get("id") == 0 and (e["ev"] == "error" or e.get("done"))] == [done[0]]


def test_a_reasoning_budget_forces_think_end_where_plain_decoding_does(hybrid):
    prompt = "<|im_start|>user\nThe river and the mill.<|im_end|>\n<|im_start|>assistant\n<think>\n"
    kw = dict(max_tokens=40, reasoning_budget=7)
    plain, _, plain_text, _ = generate(hybrid, [prompt, LOOPY], draft=None, **kw)
    drafted, done, text, _ = generate(hybrid, [prompt, LOOPY], **kw)
    assert_same_greedy(hybrid, [prompt, LOOPY], plain, drafted, 40)
    assert "</think>" in text[0] and text[0].index("</think>") == plain_text[0].index("</think>")
    assert done[0]["drafted_tokens"] > 0


# -- a draft model ---------------------------------------------------------------


@pytest.mark.parametrize("which", ["dense", "hybrid"])
def test_a_draft_model_gives_the_tokens_of_plain_decoding(which, request, second_model, dense_model):
    """Attention-only target drafted by itself (every draft kept: the
    whole-block path), hybrid target drafted by a demo model of another
    seed (some kept, some not)."""
    loaded = request.getfixturevalue(which)
    draft = str(dense_model if which == "dense" else second_model)
    kw = dict(max_tokens=16)
    prompts = PROMPTS[:3]
    plain, _, _, _ = generate(loaded, prompts, draft=None, **kw)
    drafted, done, _, s = generate(loaded, prompts, draft=draft, **kw)
    assert_same_greedy(loaded, prompts, plain, drafted, 16)
    kept = sum(d["accepted_tokens"] for d in done.values())
    assert kept > 10 and s.speculator.weights_bytes > 0
    if which == "dense":
        assert all(d["accepted_tokens"] == d["drafted_tokens"] for d in done.values())
    seeds = {i: {"seed": 3 + i, "temperature": 0.8} for i in range(len(prompts))}
    plain, _, _, _ = generate(loaded, prompts, draft=None, per_request=seeds, **kw)
    drafted, _, _, _ = generate(loaded, prompts, draft=draft, per_request=seeds, **kw)
    assert drafted == plain


@pytest.mark.parametrize("which", ["dense_model", "second_model"])
def test_a_draft_models_compiled_drafts_are_its_op_by_op_drafts(which, request):
    """The draft model's read of a row's new tokens and its chained
    forwards, as one compiled block, give the tokens and leave the cache
    that reading and stepping op by op do."""
    from worker.engine.drafters import ModelDrafter

    model = load(request.getfixturevalue(which)).model
    sides = [ModelDrafter(model), ModelDrafter(model)]
    sides[1]._drafted_compiled = lambda *args: None
    prompts = [[5 + (7 * i + r) % 300 for i in range(30 + 9 * r)] for r in range(3)]
    states = [[d.state(p) for p in prompts] for d in sides]
    for step in range(4):
        pending = [11 + step, 40 + step, 77]
        got = [d.propose(st, pending, [4, 4, 4]) for d, st in zip(sides, states)]
        assert got[0] == got[1] and all(len(x) == 4 for x in got[0])
        for st in states:
            for state, p, draft in zip(st, pending, got[0]):
                state.extend([p, *draft[: step % 3]])  # the target kept some of each
    assert any(str(shape[0]).startswith("draft") for shape in sides[0].compiled._block_shapes)
    for a, b in zip(sides[0]._cache.layers, sides[1]._cache.layers):
        if hasattr(a, "keys"):
            assert np.array_equal(np.array(a.offset), np.array(b.offset))
        else:
            assert np.allclose(np.array(a[1]), np.array(b[1]), atol=1e-4)


def test_a_drafter_that_never_matches_stops_drafting_and_steps_plain(hybrid, dense_model):
    """A random attention-only model never agrees with the demo model: each
    row stops drafting after a few misses, each pause twice the last, and
    the rest of the text comes from plain steps."""
    plain, _, _, _ = generate(hybrid, PROMPTS, draft=None, max_tokens=48)
    s, lines = scheduler(hybrid, str(dense_model))
    for i, prompt in enumerate(PROMPTS):
        s.submit(Generate(rid=i, prompt=prompt, id_json=str(i), max_tokens=48, temperature=0.0, repetition_penalty=1.0), 0.0)
    kinds: list[bool] = []
    s._ended_ids = {}  # what drain() collects
    while s.has_work:
        before = s.speculator.verified
        s.step()
        kinds.append(s.speculator.verified > before)
    done = done_lines(lines)
    assert all(d["accepted_tokens"] == 0 for d in done.values())
    assert all(d["drafted_tokens"] <= 16 for d in done.values()), done
    # Drafting phases of 6 steps, pauses of 16 then 32 steps: none at the end.
    assert any(kinds[:8]) and not any(kinds[-20:]), kinds
    assert_same_greedy(hybrid, PROMPTS, plain, s._ended_ids, 48)


def test_the_worker_times_plain_steps_in_probes(dense, dense_model):
    """A model drafted by itself keeps every draft from the first step, so
    no plain step times its batch size: once the batch size has lasted, it
    is probed (PROBE_STEPS plain steps in a row, all but the first timed as
    its reference), and the rest of the steps speculate."""
    from worker.engine.pace import JUDGE_AFTER, PROBE_STEPS

    s, lines = scheduler(dense, str(dense_model))
    s.submit(Generate(rid=0, prompt=LOOPY, id_json="0", max_tokens=96, temperature=0.0, repetition_penalty=1.0), 0.0)
    kinds: list[str] = []
    while s.has_work:
        decoding = bool(s.generator.decoding)
        before = s.speculator.verified
        s.step()
        if decoding:
            kinds.append("s" if s.speculator.verified > before else "p")
    assert done_lines(lines)[0]["accepted_tokens"] > 0
    text = "".join(kinds)
    at = text.find("p" * PROBE_STEPS, text.find("s"))
    # Probed once the batch size had lasted JUDGE_AFTER speculative steps.
    assert at >= 0 and text[:at].count("s") >= JUDGE_AFTER, text
    assert text[at + PROBE_STEPS] == "s", text
    assert len(s.speculator.pace._plain[1]) == PROBE_STEPS - 1


def test_a_step_that_traced_a_new_shape_or_followed_an_idle_batch_is_not_timed(hybrid):
    s, _ = scheduler(hybrid)
    spec = s.speculator
    gen = s.generator
    gen.decoding = [object()]
    spec._last = (0.0, "plain", 1, 1, "plain", spec._traces(gen))
    s.compiled.traces += 1
    spec._account(5.0, gen)
    assert spec.pace.reference(1) is None
    spec._last = (5.0, "plain", 1, 1, "plain", spec._traces(gen))
    spec._account(5.01, gen)
    assert spec.pace.reference(1) == pytest.approx(0.01)
    # The batch emptied between the two steps.
    spec._mark(6.0, gen, "plain", 1)
    spec.idle()
    spec._mark(9.0, gen, "plain", 1)
    spec._account(9.01, gen)
    assert spec.pace.reference(1) == pytest.approx(0.01)
    gen.decoding = []


class PolicyRow:
    """What the speculator's row policy reads of a row."""

    speculative, draft_limit, broken, drafted, accepted = True, 8, None, 0, 0

    def __init__(self, rid: int):
        self.rid, self.ids = rid, [5, 6, 7]


class ModelLike:
    """A drafter as the policy sees it: a model's (not prompt lookup)."""

    name = "model"

    def state(self, tokens):
        return list(tokens)


def test_prompt_lookup_copies_what_followed_and_goes_round_a_loop():
    from worker.engine.drafters import NgramDrafter

    lookup = NgramDrafter()
    # What followed the latest earlier (1, 2): a copy from the prompt.
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 1]
    assert lookup.propose([lookup.state(prompt)], [2], [4]) == [[3, 4, 5, 6]]
    assert lookup.propose([lookup.state(prompt + [2])], [None], [3]) == [[3, 4, 5]]
    # A reply repeating (5, 6, 7): the match is 3 tokens back, and the draft
    # goes on round the loop past the known tokens, up to the limit.
    loop = [9, 5, 6, 7, 5, 6, 7, 5, 6]
    assert lookup.propose([lookup.state(loop)], [7], [7]) == [[5, 6, 7, 5, 6, 7, 5]]
    assert lookup.propose([lookup.state(loop + [7])], [None], [5]) == [[5, 6, 7, 5, 6]]
    # Nothing to follow, or no room: no draft.
    assert lookup.propose([lookup.state([1, 2, 3])], [4], [4]) == [[]]
    assert lookup.propose([lookup.state(prompt)], [2], [0]) == [[]]


def test_a_row_is_judged_on_its_last_drafting_steps_and_new_rows_inherit_a_failing_drafters_pause():
    from worker.engine.drafters import NgramDrafter
    from worker.engine.speculate import ROW_JUDGE_AFTER, ROW_PAUSE, Speculator

    spec = Speculator(ModelLike(), 4)
    first = PolicyRow(0)
    spec.join([first])
    for _ in range(ROW_JUDGE_AFTER):
        assert spec._may_draft(first)
        spec._judge(first, 4, 0)
    assert not spec._may_draft(first)  # two misses, not six
    # Rows that join while the drafter misses start paused as long as the
    # row that missed, each next one twice as long, and draft at once when
    # some row's window keeps drafts.
    later = [PolicyRow(1), PolicyRow(2)]
    spec.join(later)
    pauses = [spec._rows[row].off_until - spec.steps for row in later]
    assert pauses == [ROW_PAUSE, 2 * ROW_PAUSE]
    spec.steps += ROW_PAUSE
    assert spec._may_draft(later[0]) and not spec._may_draft(later[1])
    for _ in range(ROW_JUDGE_AFTER):
        spec._judge(later[0], 4, 3)
    assert spec._may_draft(later[1]) and spec._join_pause == 0
    fresh = PolicyRow(3)
    spec.join([fresh])
    assert spec._may_draft(fresh)
    # Prompt lookup's rows start afresh whatever earlier rows' text gave.
    lookup = Speculator(NgramDrafter(), 4)
    lookup.join([first])
    for _ in range(ROW_JUDGE_AFTER):
        lookup._judge(first, 4, 0)
    lookup.join([fresh])
    assert not lookup._may_draft(first) and lookup._may_draft(fresh)


def test_an_adapter_row_and_a_json_schema_row_share_a_drafted_batch(tiny_model, tmp_path):
    """The adapter row is verified with its adapter; the JSON row's drafts
    (copied from its prompt) are cut to what its grammar allows and each
    position is drawn under its mask: both give their plain tokens, and
    the JSON parses."""
    from tests.lora_files import lora_pairs, targets_of, write_peft

    adapter = str(write_peft(tmp_path / "style", lora_pairs(targets_of(tiny_model), rank=4, seed=2), r=4, alpha=8.0))
    pet = {
        "type": "object",
        "properties": {"kind": {"enum": ["cat", "dog", "bird"]}, "tags": {"type": "array", "items": {"enum": ["loyal", "loud", "shy"]}, "maxItems": 4}},
        "required": ["kind", "tags"],
        "additionalProperties": False,
    }
    schema = read_response_format({"type": "json_schema", "json_schema": {"name": "pet", "schema": pet}})
    per = {0: {"lora": adapter}, 1: {"response_format": schema, "max_tokens": 60}, 2: {"lora": None}}
    copy = '<|im_start|>user\nCopy {"kind":"dog","tags":["loyal","shy","loud"]}<|im_end|>\n<|im_start|>assistant\n'
    prompts = [LOOPY, copy, PROMPTS[2]]
    # A model of its own for each run: a scheduler wraps its layers for adapters.
    plain, _, plain_text, _ = generate(load(tiny_model), prompts, draft=None, per_request=per, max_tokens=24)
    drafted, done, text, _ = generate(load(tiny_model), prompts, per_request=per, max_tokens=24)
    assert drafted == plain and text == plain_text
    assert plain_text[0] != generate(load(tiny_model), [LOOPY], draft=None, max_tokens=24)[2][0], "the adapter changes the text"
    assert json.loads(text[1])["kind"] in ("cat", "dog", "bird")
    assert done[1]["finish_reason"] == "stop"
    assert done[0]["accepted_tokens"] > 0 and done[1]["drafted_tokens"] > 0


# -- through the pool ------------------------------------------------------------


def test_a_pool_model_with_prompt_lookup_reports_its_drafts(tiny_model, tmp_path, spawn_pool):
    """`draft = "ngram"` in a [[models]] entry: the final line carries the
    counts, a request with speculative false gets chat_metal's line, and
    status sums the name's counts. `draft = "mtp"` on a checkpoint without
    an MTP head fails its requests, saying why."""
    config = tmp_path / "pool.toml"
    config.write_text(
        f'[[models]]\nname = "a"\npath = "{tiny_model}"\npreload = true\ndraft = "ngram"\n\n[[models]]\nname = "m"\npath = "{tiny_model}"\ndraft = "mtp"\n'
    )
    pool = spawn_pool("--config", str(config))
    pool.wait_ev("ready", model="a")
    request = {"model": "a", "prompt": LOOPY, "max_tokens": 30, "temperature": 0, "repetition_penalty": 1.0}
    pool.send(request | {"id": 1})
    pool.send(request | {"id": 2, "speculative": False})
    one, two = pool.terminal(1), pool.terminal(2)
    assert pool.text(1) == pool.text(2)
    assert one["accepted_tokens"] > 0 and one["drafted_tokens"] >= one["accepted_tokens"]
    # The second request may find the first one's prompt in the prefix cache
    # (then chat_metal's line carries cached_tokens); either way no draft counts.
    assert re.search(rb',"finish_reason":"length"(,"cached_tokens":\d+)?,"id":2}\n$', two["_line"]) and "drafted_tokens" not in two
    pool.send({"op": "status"})
    row = next(r for r in pool.wait_ev("status")["models"] if r["model"] == "a")
    assert (row["drafted_tokens"], row["accepted_tokens"]) == (one["drafted_tokens"], one["accepted_tokens"])
    pool.send({"model": "m", "prompt": "x", "max_tokens": 2, "id": 3})
    end = pool.terminal(3)
    assert end["code"] == "load_failed" and 'draft = "mtp"' in end["msg"] and "carries no mtp.* weights" in end["msg"], end
    assert pool.close() == 0


@pytest.mark.parametrize(
    "entry, needle",
    [('draft = "mtp"\nranks = 2', "split over ranks"), ('draft = "ngram"\nranks = 2', "split over ranks"), ("draft = { tokens = 4 }", "model")],
)
def test_draft_settings_a_pool_cannot_serve_are_refused_at_start(entry, needle, tmp_path):
    from supervisor.config import ConfigError, load_config

    config = tmp_path / "pool.toml"
    config.write_text(f'[[models]]\nname = "a"\npath = "/m"\n{entry}\n')
    with pytest.raises(ConfigError, match=needle):
        load_config(config)


def test_a_row_whose_lookup_finds_nothing_stops_trying_and_steps_plain(dense):
    """Sampled text on the random attention-only model rarely repeats: its
    rows' lookups find nothing, and after a few tries they pause, so the
    batch steps plain (pipelined) most of the time."""
    s, lines = scheduler(dense)
    for i, prompt in enumerate(PROMPTS):
        s.submit(Generate(rid=i, prompt=prompt, id_json=str(i), max_tokens=48, temperature=1.0, seed=i), 0.0)
    tried: list[bool] = []
    while s.has_work:
        tried.append(s.speculator.wants(s.generator.decoding))
        s.step()
    assert tried.count(True) < len(tried) // 2, tried


def test_logprobs_of_drafted_tokens_are_the_targets_and_a_grammar_masks_them(hybrid):
    """Rows that ask for log-probabilities, in a drafted batch beside one
    that does not: each kept draft token's logprob is the target's (what
    plain decoding reports), and a constrained row's alternatives are the
    tokens its grammar allows (the others at the floor)."""
    from worker.engine.sampling import FLOOR_LOGPROB

    schema = read_response_format({"type": "regex", "pattern": "(yes|no)( (yes|no)){5}"})
    per = [{"logprobs": 3}, {"logprobs": 20, "response_format": schema}, {}]
    prompts = [LOOPY, PROMPTS[1], PROMPTS[2]]

    def run(draft):
        s, lines = scheduler(hybrid, draft)
        for i, (prompt, fields) in enumerate(zip(prompts, per)):
            s.submit(Generate(rid=i, prompt=prompt, id_json=str(i), max_tokens=32, temperature=0.0, repetition_penalty=1.0, **fields), 0.0)
        s.drain()
        entries = [[x for e in events(lines) if e["id"] == i for x in e.get("logprobs", ())] for i in range(3)]
        return entries, done_lines(lines), texts(lines)

    plain, _, plain_text = run(None)
    drafted, done, text = run("ngram")
    assert done[0]["accepted_tokens"] > 0, "drafts were kept, or this proves nothing"
    assert text == plain_text
    for mine, theirs in zip(drafted, plain):
        assert [e["token"] for e in mine] == [e["token"] for e in theirs]
        assert all(abs(a["logprob"] - b["logprob"]) < 1e-4 for a, b in zip(mine, theirs))
    assert len(drafted[0]) == 32 and all(len(e["top_logprobs"]) == 3 for e in drafted[0])
    assert drafted[2] == [], "a row that does not ask gets none"
    answer = text[1]
    assert answer.replace("yes", "").replace("no", "").strip() == ""
    for e in drafted[1]:
        allowed = [t for t in e["top_logprobs"] if t["logprob"] > FLOOR_LOGPROB]
        assert allowed and e["token"] in [t["token"] for t in allowed]
        # Normalised over what the grammar allows: the alternatives' mass is
        # at most 1 and each one fits the pattern's alphabet.
        assert sum(math.exp(t["logprob"]) for t in allowed) <= 1 + 1e-5
        assert all(set(t["token"]) <= set("yesno ") for t in allowed), allowed


# -- the checkpoint's MTP head ---------------------------------------------------


@pytest.fixture(scope="module")
def mtp_models(tiny_model, dense_model, tmp_path_factory):
    """The hybrid demo model with `demo-model --mtp`'s head in its own
    weights file (as a Hugging Face checkpoint carries it: mlx-lm's loader
    drops it), and the attention-only model with one in mtp.safetensors."""
    import shutil

    from worker.demo.build import add_mtp

    out = {}
    for which, source, inside in (("hybrid", tiny_model, True), ("dense", dense_model, False)):
        path = tmp_path_factory.mktemp(f"mtp-{which}")
        shutil.copytree(source, path, dirs_exist_ok=True)
        add_mtp(path, inside=inside)
        out[which] = load(path)
    return out


@pytest.mark.parametrize("which", ["dense", "hybrid"])
def test_the_mtp_head_drafts_and_rows_give_the_tokens_of_plain_decoding(which, mtp_models):
    loaded = mtp_models[which]
    plain, _, _, _ = generate(loaded, PROMPTS, draft=None)
    drafted, done, _, s = generate(loaded, PROMPTS, draft="mtp")
    assert_same_greedy(loaded, PROMPTS, plain, drafted, 40)
    assert sum(d["accepted_tokens"] for d in done.values()) > 20
    # The head's chained steps ran compiled (drafts it got wrong would have
    # been rejected, and the kept count above would fall).
    assert s.speculator.drafter.compiled.traces > 0
    assert all(0 <= d["accepted_tokens"] <= d["drafted_tokens"] for d in done.values())
    assert s.speculator.weights_bytes > 0
    # A seed gives its tokens with the head's drafts as without them.
    prompts = PROMPTS[::2]
    seeds = {i: {"seed": 7 + i, "temperature": 0.8} for i in range(len(prompts))}
    plain, _, _, _ = generate(loaded, prompts, draft=None, per_request=seeds, max_tokens=24)
    drafted, done, _, _ = generate(loaded, prompts, draft="mtp", per_request=seeds, max_tokens=24)
    assert drafted == plain
    assert sum(d["drafted_tokens"] for d in done.values()) > 0


def test_mtp_on_a_checkpoint_without_an_mtp_head_is_refused_clearly(hybrid, tmp_path):
    from supervisor.config import load_config
    from worker.engine.speculate import DraftError, speculator_for

    with pytest.raises(DraftError, match=r'draft = "mtp": .* carries no mtp\.\* weights'):
        speculator_for("mtp", 4, hybrid.model, hybrid.path, hybrid.config)
    config = tmp_path / "pool.toml"
    config.write_text('[[models]]\nname = "a"\npath = "/m"\ndraft = "mtp"\n')
    assert load_config(config).models[0].draft == "mtp"
