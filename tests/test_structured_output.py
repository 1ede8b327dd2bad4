"""Structured output (docs/structured-output.md) through a real worker process: the batched
engine masks each constrained row with its response_format and leaves the
others alone.

The demo model has random weights and writes no JSON when left alone; every
reply below is valid only because of the mask.
"""

import json
import re

import jsonschema
import pytest

from harness.engine import ends_by_id, events as events_of, scheduler_for
from harness.worker import terminal, text_of
from ipc.messages import Cancel, Generate, read_response_format
from tests.conftest import GREEDY_MARGIN, shared_worker
from tests.schemas import PET

CHAT = "<|im_start|>user\nDescribe a pet as JSON.<|im_end|>\n<|im_start|>assistant\n"
FREE = "<|im_start|>user\nTell me about the river.<|im_end|>\n<|im_start|>assistant\n"

PET_SPEC = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}
PET_FORMAT = read_response_format(PET_SPEC)
JSON_OBJECT = read_response_format({"type": "json_object"})
DATE = r"[A-Z][a-z]{1,6} (19|20)[0-9]{2}-(0[1-9]|1[0-2])"
ARITHMETIC = r"""
start: expr
expr: term (OP term)~0..2
term: NUMBER | "(" inner ")"
inner: NUMBER (OP NUMBER)~1..2
OP: "+" | "-" | "*"
NUMBER: /[1-9][0-9]?/
"""


@pytest.fixture(scope="module")
def worker(tiny_model):
    yield from shared_worker(tiny_model, "--max-batch", "8")


@pytest.fixture(scope="module")
def grammar(tiny_model):
    """The worker's own compiler in this process, to replay a reply."""
    from worker.engine.constrain import Constraints
    from worker.text.tokenizer import TextCodec

    codec = TextCodec(tiny_model, json.loads((tiny_model / "config.json").read_text()))
    constraints = Constraints.for_codec(codec, json.loads((tiny_model / "config.json").read_text())["text_config"]["vocab_size"])

    def accepts_prefix(response_format, text: str) -> bool:
        """True when `text` is a prefix of a reply the format allows and
        not a complete one (ConstraintViolation when it is no prefix)."""
        row = constraints.row(response_format, [])
        for token in codec.encode(text):
            row.advance(token)
        return not row.accepting

    return accepts_prefix


_rid = iter(range(1, 1_000_000))


def request(**kw) -> Generate:
    rid = next(_rid)
    kw.setdefault("prompt", CHAT)
    kw.setdefault("temperature", 1.0)  # the other settings: chat_metal's defaults
    return Generate(rid=rid, id_json=str(rid), **kw)


def seeded(n: int, response_format: str | None, **kw) -> list[Generate]:
    return [request(seed=seed, response_format=response_format, **kw) for seed in range(n)]


def test_json_schema_replies_validate_for_20_seeds(worker):
    reqs = seeded(20, PET_FORMAT, max_tokens=160)
    events = worker.send_together(reqs)
    replies = [text_of(events[r.rid]) for r in reqs]
    assert [terminal(events[r.rid])["finish_reason"] for r in reqs] == ["stop"] * 20
    for reply in replies:
        jsonschema.validate(json.loads(reply), PET)
    assert len(set(replies)) > 10, "seeded rows should differ"


def test_constrained_and_free_rows_in_one_batch(worker, greedy_margins):
    free = request(prompt=FREE, temperature=0.0, max_tokens=40)
    alone = text_of(worker.send_together([free])[free.rid])
    with pytest.raises(ValueError):
        json.loads(alone)  # the premise: left alone, the model writes no JSON
    again = request(prompt=FREE, temperature=0.0, max_tokens=40)
    # One constrained row on the free row's prompt: it resumes from the
    # prefix cache's snapshot of it, which a constraint never touches.
    constrained = seeded(3, PET_FORMAT, max_tokens=160) + [request(prompt=FREE, seed=9, response_format=PET_FORMAT, max_tokens=160)]
    events = worker.send_together(constrained[:2] + [again] + constrained[2:])
    assert text_of(events[again.rid]) == alone
    assert terminal(events[again.rid])["cached_tokens"] > 0 and terminal(events[constrained[-1].rid])["cached_tokens"] > 0
    for r in constrained:
        assert terminal(events[r.rid])["finish_reason"] == "stop"
        jsonschema.validate(json.loads(text_of(events[r.rid])), PET)
    # Text equality is safe on any CPU: batching moves logits by float
    # noise, and every greedy choice of this prompt wins by far more.
    assert min(greedy_margins([FREE], 40)) > GREEDY_MARGIN


def test_json_object_replies_parse_and_cut_ones_are_prefixes(worker, grammar):
    # Free-form keys and strings are unbounded and a random model rarely
    # closes a string (about 1 reply in 20 within 120 tokens), so most
    # json_object replies run into max_tokens: those, and schema replies
    # cut at 12 tokens, must be a prefix the grammar accepts and say
    # `length` (the client can tell).
    objects = seeded(10, JSON_OBJECT, max_tokens=120)
    cut = seeded(4, PET_FORMAT, max_tokens=12)
    events = worker.send_together(objects + cut)
    for r in objects + cut:
        reply, done = text_of(events[r.rid]), terminal(events[r.rid])
        if done["finish_reason"] == "stop":
            assert r in objects and isinstance(json.loads(reply), dict)
        else:
            assert done["finish_reason"] == "length" and done["gen_tokens"] == r.max_tokens
            assert reply.startswith("{") and grammar(r.response_format, reply), reply
    assert all(text_of(events[r.rid]).startswith('{"name":"') for r in cut)


def test_regex_and_lark_grammar_replies_match(worker):
    dates = seeded(6, read_response_format({"type": "regex", "pattern": DATE}), max_tokens=40)
    sums = seeded(6, read_response_format({"type": "grammar", "grammar": ARITHMETIC}), max_tokens=60)
    # A reply that completes its grammar with its last allowed token is
    # complete: `stop`, not `length`.
    digits = seeded(2, read_response_format({"type": "regex", "pattern": "[0-9]"}), max_tokens=1)
    events = worker.send_together(dates + sums + digits)
    for r in dates + sums + digits:
        assert terminal(events[r.rid])["finish_reason"] == "stop"
    for r in dates:
        assert re.fullmatch(DATE, text_of(events[r.rid]))
    for r in sums:
        reply = text_of(events[r.rid])
        assert re.fullmatch(r"[0-9+\-*()]+", reply), reply
        assert isinstance(eval(reply, {"__builtins__": {}}), int)  # only digits, operators and parentheses
    for r in digits:
        assert re.fullmatch("[0-9]", text_of(events[r.rid]))


def test_think_then_json(worker, greedy_margins):
    think = CHAT + "<think>\n"
    reqs = seeded(3, PET_FORMAT, prompt=think, reasoning_budget=6, max_tokens=200)
    greedy = request(prompt=think, temperature=0.0, reasoning_budget=6, response_format=PET_FORMAT, max_tokens=200)
    free = request(prompt=think, temperature=0.0, reasoning_budget=6, max_tokens=20)
    events = worker.send_together(reqs + [greedy, free])
    for r in reqs + [greedy]:
        assert terminal(events[r.rid])["finish_reason"] == "stop"
        thinking, end, answer = text_of(events[r.rid]).partition("</think>")
        assert end and not thinking.lstrip().startswith("{")
        jsonschema.validate(json.loads(answer), PET)
    # The thinking is free (only an end-of-sequence token is masked) and the
    # budget closes it: greedy, it is the unconstrained row's thinking.
    free_thinking, end, _ = text_of(events[free.rid]).partition("</think>")
    assert end and text_of(events[greedy.rid]).startswith(free_thinking + "</think>")
    assert min(greedy_margins([think], 5)) > GREEDY_MARGIN


def test_cancel_mid_constraint(worker, grammar):
    long, other = request(seed=1, response_format=JSON_OBJECT, max_tokens=2000), request(seed=2, response_format=PET_FORMAT, max_tokens=160)
    worker.send(long)
    seen = [worker.next_event() for _ in range(5)]
    worker.send(other)
    worker.send(Cancel(rid=long.rid))
    events = worker.collect_by_id([long.rid, other.rid])
    done = terminal(events[long.rid])
    assert done["finish_reason"] == "cancelled" and done["gen_tokens"] < 2000
    assert grammar(JSON_OBJECT, text_of(seen + events[long.rid]))
    assert terminal(events[other.rid])["finish_reason"] == "stop"
    jsonschema.validate(json.loads(text_of(events[other.rid])), PET)


BAD_FORMATS = [
    ({"type": "xml"}, "unknown response_format type 'xml'; expected one of json_object, json_schema, regex, grammar"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "missing required field `schema`"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}, "invalid JSON schema in response_format: Invalid type: objekt"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": 5, "maximum": 1}}}, "minimum (5) is greater than maximum (1)"),
    ({"type": "json_schema", "json_schema": {"schema": {"properties": {"a": {"$ref": "#/$defs/gone"}}}}}, "'/$defs/gone' does not exist"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "[a-"}}}, "unclosed character class"),
    ({"type": "regex", "pattern": "([a-z"}, "invalid regex in response_format"),
    ({"type": "regex", "pattern": 7}, "invalid response_format field 'pattern': Expected `str`, got `int`"),
    ({"type": "grammar", "grammar": "start: undefined_rule"}, 'unknown name: "undefined_rule"'),
    # $ref loops no value can get out of: llguidance compiled them to "end at once" (empty replies, finish stop).
    ({"type": "json_schema", "json_schema": {"schema": {"$ref": "#"}}}, "loops back with no way out: no JSON value can match the schema"),
    (
        {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}}},
        "the \"$ref\" '#/$defs/a' at # loops back with no way out",
    ),
    (
        {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}}},
        "the \"$ref\" '#' at #/properties/next loops back with no way out",
    ),
]


def test_bad_formats_are_rejected_before_any_token(worker):
    # A malformed shape is refused as it is read, by the supervisor, and
    # never reaches a worker (a Generate carries the format typed); what
    # has the shape but does not compile is sent straight to the worker,
    # whose compiler must refuse it.
    sent = []
    for fmt, message in BAD_FORMATS:
        try:
            typed = read_response_format(fmt)
        except ValueError as exc:
            assert message in str(exc)
            continue
        sent.append((request(response_format=typed), message))
    assert len(sent) == len(BAD_FORMATS) - 3
    good = request(seed=3, response_format=PET_FORMAT, max_tokens=160)
    events = worker.send_together([r for r, _ in sent[:4]] + [good] + [r for r, _ in sent[4:]])
    for r, message in sent:
        [error] = events[r.rid]
        assert error["ev"] == "error" and error["code"] == "bad_request" and message in error["msg"], error
    jsonschema.validate(json.loads(text_of(events[good.rid])), PET)


def test_free_steps_never_touch_the_masks_and_a_broken_row_ends_alone(tiny_model):
    """In-process, on the real engine: a step with no constrained row fills
    no mask; a forced token the grammar rejects (sampling, being masked,
    cannot) ends that row alone with an error."""
    from worker.runtime.loader import load

    s, lines = scheduler_for(load(tiny_model))
    filled = []
    fill_async = s.masks.fill_async
    s.masks.fill_async = lambda rows: filled.append(rows) or fill_async(rows)
    free = [request(temperature=0.0, max_tokens=8) for _ in range(2)]
    for r in free:
        s.submit(r, 0.0)
    s.drain()
    assert not filled
    victim, kept = (request(seed=seed, response_format=PET_FORMAT, max_tokens=160) for seed in (1, 2))
    bystander = request(temperature=0.0, max_tokens=8)
    for r in (victim, kept, bystander):
        s.submit(r, 0.0)
    while len(s.generator.decoding) < 3:
        s.step()
    # As a row with a reasoning budget is: the batch no longer runs ahead.
    victim_row = next(row for row in s.streams if row.rid == victim.rid)
    victim_row.may_force = True
    s.step()
    s.generator.force(victim_row, s.codec.encode("x")[0])
    s.drain()
    ends = ends_by_id(lines)
    assert ends[victim.rid][0]["code"] == "worker_crashed"
    assert """breaks the response_format: Parser Error: token "x" doesn't satisfy the grammar;""" in ends[victim.rid][0]["msg"]
    assert ends[kept.rid][0]["finish_reason"] == "stop" and ends[bystander.rid][0]["gen_tokens"] == 8
    assert filled and all(len(rows) <= 3 and any(r is None for r in rows) for rows in filled[:3])
    assert all(len(v) == 1 for v in ends.values())


# -- running ahead (TokenGenerator.run_ahead, the GPU order) ----------------------


def replies(lines: list[bytes]) -> dict:
    """Each request's text, end and tokens, without its timings."""
    out: dict = {}
    for e in events_of(lines):
        text, _ = out.setdefault(e["id"], ["", None])
        if e["ev"] == "gen_token" and not e.get("done"):
            out[e["id"]][0] = text + e["token"]
        elif e["ev"] == "error":
            out[e["id"]][1] = e["code"]
        else:
            out[e["id"]][1] = (e["finish_reason"], e["gen_tokens"], e.get("cached_tokens"))
    return out


def drive(s, first: list[Generate], later: dict[int, Generate], cancel: dict[int, int], watch: int | None = None) -> tuple[int, int]:
    """Steps the scheduler until all is done, submitting `later[k]` and
    cancelling the rid `cancel[k]` after step k; returns the steps taken
    with a pass queued ahead, and those while the rid `watch` was decoding."""
    for r in first:
        s.submit(r, 0.0)
    ahead = ahead_watched = k = 0
    while s.has_work:
        s.step()
        k += 1
        if s.generator._ahead is not None:
            ahead += 1
            ahead_watched += any(row.rid == watch for row in s.generator.decoding)
        if k in later:
            s.submit(later[k], 0.0)
        if k in cancel:
            s.cancel(cancel[k])
    return ahead, ahead_watched


def fixed(rid: int, **kw) -> Generate:
    kw.setdefault("prompt", CHAT)
    kw.setdefault("temperature", 1.0)
    return Generate(rid=rid, id_json=str(rid), **kw)


def test_a_batch_run_ahead_draws_what_the_step_by_step_order_draws(tiny_model):
    """On a GPU a constrained batch queues its next forward pass before it
    reads its tokens. Forced on here, it must draw the very tokens the
    step-by-step order draws: sampled and greedy constrained rows, a free
    row, a row joining mid-stream and one cancelled mid-stream."""
    from worker.runtime.loader import load

    loaded = load(tiny_model)
    first = [
        fixed(1, seed=1, response_format=PET_FORMAT, max_tokens=160),
        fixed(2, temperature=0.0, response_format=JSON_OBJECT, max_tokens=200),
        fixed(3, prompt=FREE, temperature=0.0, max_tokens=30),
    ]
    later = {6: fixed(4, seed=4, response_format=PET_FORMAT, max_tokens=160)}
    out = {}
    # Each in both orders, the CPU's and the GPU's (which hands a pass
    # built ahead to mlx only next step, and builds a step-by-step pass
    # after the masks start): on mlx's CPU backend the GPU's order computes
    # the same, later.
    for run_ahead in (False, True):
        for on_gpu in (False, True):
            s, lines = scheduler_for(loaded, run_ahead=run_ahead)
            s.generator.on_gpu = on_gpu
            ahead, _ = drive(s, first, later, cancel={12: 2})
            out[run_ahead, on_gpu] = replies(lines), ahead
    plain, plain_ahead = out[False, False]
    assert plain_ahead == 0 and out[False, True][1] == 0
    assert out[True, False][1] > 20 and out[True, True][1] > 20
    assert all(got == plain for got, _ in out.values())
    assert plain[2][1] == "cancelled" or plain[2][1][0] == "cancelled"
    for rid in (1, 4):
        assert plain[rid][1][0] == "stop"
        jsonschema.validate(json.loads(plain[rid][0]), PET)


def test_rows_that_may_be_forced_keep_the_batch_from_running_ahead(tiny_model):
    """A reasoning budget forces </think> in place of a token already drawn,
    which a pass queued ahead would have fed: while such a row decodes the
    batch steps one by one, and the replies are those of that order."""
    from worker.runtime.loader import load

    loaded = load(tiny_model)
    think = CHAT + "<think>\n"
    first = [
        fixed(1, prompt=think, temperature=0.0, reasoning_budget=6, response_format=PET_FORMAT, max_tokens=200),
        fixed(2, seed=2, response_format=JSON_OBJECT, max_tokens=300),
    ]
    out = {}
    for run_ahead in (False, True):
        s, lines = scheduler_for(loaded, run_ahead=run_ahead)
        counts = drive(s, first, {}, {}, watch=1)
        out[run_ahead] = replies(lines), counts
    (plain, _), (piped, (ahead, ahead_watched)) = out[False], out[True]
    assert piped == plain
    assert "</think>" in plain[1][0] and plain[1][1][0] == "stop"
    assert ahead_watched == 0
    assert plain[2][1][1] > plain[1][1][1] + 5 and ahead > 0, "the other row decodes on, ahead, after the budgeted one ends"


def test_a_whole_resumed_prompt_joins_a_batch_that_ran_ahead(tiny_model):
    """A prompt resumed whole from the prefix cache would join the decode
    batch at once; a batch that has run ahead is a token further on, so it
    joins after the next step instead, and draws what it draws otherwise."""
    from worker.engine.scheduler import Scheduler
    from worker.runtime.loader import load
    from worker.text.tokenizer import TextCodec

    loaded = load(tiny_model)
    # Ends at a message start: the prefix cache keeps a snapshot there,
    # which holds all of the prompt but its last token.
    prompt = "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>"
    out = {}
    for run_ahead in (False, True):
        lines: list[bytes] = []
        s = Scheduler(loaded, TextCodec(tiny_model, loaded.config), lines.append, batch_memory=1 << 30, run_ahead=run_ahead)
        drive(s, [fixed(1, prompt=prompt, temperature=0.0, max_tokens=2)], {}, {})
        ahead, _ = drive(s, [fixed(2, seed=2, response_format=JSON_OBJECT, max_tokens=60)], {4: fixed(3, prompt=prompt, temperature=0.0, max_tokens=20)}, {})
        out[run_ahead] = replies(lines), ahead
    (plain, plain_ahead), (piped, piped_ahead) = out[False], out[True]
    assert piped == plain and plain_ahead == 0 and piped_ahead > 0
    n = len(TextCodec(tiny_model, loaded.config).encode(prompt))
    assert plain[3][1] == ("length", 20, n - 1)


def ref_chain(n: int, last: dict) -> dict:
    """A schema of n `$defs`, each naming the next: as deep as n nested objects,
    though the JSON nests three deep."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = last
    return {"type": "json_schema", "json_schema": {"schema": {"$ref": "#/$defs/d0", "$defs": defs}}}


TREE = {
    "type": "object",
    "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9}, "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
    "required": ["v", "kids"],
    "additionalProperties": False,
}


def test_ref_loops_and_ref_chains_are_refused_through_serve_and_recursion_with_a_way_out_is_not(tiny_model, spawn_pool):
    """A `$ref` loop with no way out was accepted and answered with an empty
    reply and finish_reason stop; a chain of 2,500 `$defs` overflowed
    llguidance's stack and killed the worker (SIGSEGV), twice with the retry."""
    pool = spawn_pool("--model-dir", str(tiny_model))
    pool.send({"id": "loop", "prompt": CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#"}}}})
    pool.send({"id": "chain", "prompt": CHAT, "response_format": ref_chain(2500, {"type": "string"})})
    pool.send({"id": "tree", "prompt": CHAT, "seed": 2, "max_tokens": 200, "response_format": {"type": "json_schema", "json_schema": {"schema": TREE}}})
    for request_id, message in (("loop", "no JSON value can match the schema"), ("chain", "nests more than 1000 subschemas deep")):
        pool.terminal(request_id)
        [error] = pool.of(request_id)
        assert error["ev"] == "error" and error["code"] == "bad_request" and message in error["msg"], error
    tree = pool.terminal("tree")
    assert tree["ev"] == "gen_token" and tree["gen_tokens"] > 0, tree
    if tree["finish_reason"] == "stop":  # a random model may nest until max_tokens
        jsonschema.validate(json.loads(pool.text("tree")), TREE)
    assert pool.close() == 0
    assert not [e for e in pool.events if e["ev"] == "restarting"]


def test_response_format_through_serve(tiny_model, spawn_pool):
    pool = spawn_pool("--model-dir", str(tiny_model))
    pool.send({"id": "pet", "prompt": CHAT, "temperature": 1.0, "seed": 4, "max_tokens": 160, "response_format": PET_SPEC})
    pool.send({"id": "shape", "prompt": CHAT, "response_format": {"type": "json_schema"}})
    pool.send({"id": "schema", "prompt": CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}})
    assert pool.terminal("pet")["finish_reason"] == "stop"
    jsonschema.validate(json.loads(pool.text("pet")), PET)
    for request_id, message in (("shape", "missing required field `json_schema`"), ("schema", "Invalid type: objekt")):
        pool.terminal(request_id)
        [error] = pool.of(request_id)
        assert error["ev"] == "error" and error["code"] == "bad_request" and message in error["msg"], error
    assert pool.close() == 0


def test_a_constrained_steps_tokens_are_written_before_its_draw_is_handed_over(tiny_model):
    """On mlx's CPU backend handing the masked draw over waits while the
    forward pass runs: a constrained row's token lines go out before it, as
    early as a free row's, and the replies are what they were."""
    from worker.engine.sampling import BatchSampler
    from worker.runtime.loader import load

    loaded = load(tiny_model)
    out = {}
    for early in (True, False):
        s, lines = scheduler_for(loaded)
        if not early:
            s.generator.on_read = None
        written_at_draw = []
        draw = s.generator.sampler.__class__.__call__

        def spy(sampler, logits, inputs, draw=draw, s=s, lines=lines, written_at_draw=written_at_draw):
            if any(row.constraint for row in s.generator.decoding):
                written_at_draw.append(len(events_of(lines)))
            return draw(sampler, logits, inputs)

        s.generator.sampler.__class__ = type("Spy", (BatchSampler,), {"__call__": spy})
        drive(s, [fixed(i, seed=i, response_format=PET_FORMAT, max_tokens=24) for i in range(2)] + [fixed(2, prompt=FREE, seed=7, max_tokens=24)], {}, {})
        out[early] = (replies(lines), written_at_draw)
    (early_replies, early_counts), (late_replies, late_counts) = out[True], out[False]
    assert early_replies == late_replies and len(early_counts) == len(late_counts)
    # Each draw after the first rows' first tokens found more lines written.
    assert sum(early_counts) > sum(late_counts)
    assert all(early >= late for early, late in zip(early_counts, late_counts))


def test_on_a_gpu_a_constrained_steps_tokens_are_streamed_after_its_forward_pass_is_launched(tiny_model, monkeypatch):
    """On a GPU launching a pass is the engine thread's work and the device
    computes only what was launched: a constrained step launches its
    forward pass, then streams the tokens it read (the GPU's order, forced
    on here; on mlx's CPU backend it computes the same)."""
    import mlx.core as mx

    import worker.engine.generator as generator_module
    from worker.runtime.loader import load

    seen: list[str] = []

    class Launches:
        def __getattr__(self, name):
            return getattr(mx, name)

        def async_eval(self, *arrays):
            shape = getattr(arrays[0], "shape", ())  # a prefill chunk hands over a list
            seen.append({2: "forward", 1: "draw"}.get(len(shape), "other"))
            return mx.async_eval(*arrays)

    monkeypatch.setattr(generator_module, "mx", Launches())
    s, lines = scheduler_for(load(tiny_model))
    s.generator.on_gpu, s.generator.hand_over_at_once = True, False
    read = s.generator.on_read

    def on_read(out):
        seen.append("read")
        read(out)

    s.generator.on_read = on_read
    drive(s, [fixed(i, seed=i, response_format=PET_FORMAT, max_tokens=24) for i in range(2)], {}, {})
    reads = [i for i, what in enumerate(seen) if what == "read"]
    assert len(reads) > 20
    assert all(seen[i - 1] == "forward" for i in reads), seen[:12]
    assert all(end[0] in ("stop", "length") for _, end in replies(lines).values())


def test_no_grammar_is_asked_anything_while_its_masks_fill(tiny_model, monkeypatch):
    """llguidance refuses a matcher that another thread is filling a mask
    with ("Already mutably borrowed": an H200 run with a 151k vocabulary,
    whose fills are slow enough to be caught). While a step's masks fill,
    the engine's thread leaves every matcher alone. Here each fill waits
    until the step has streamed its tokens, so a touch in that window is
    caught every time."""
    import threading

    from worker.engine.constrain import RowConstraint
    from worker.runtime.loader import load

    s, lines = scheduler_for(load(tiny_model))
    masks, generator = s.masks, s.generator
    real_fill, real_fill_async, read = masks.fill, masks.fill_async, generator.on_read
    filling, streamed = threading.Event(), threading.Event()
    touched: list[str] = []

    def fill(rows):
        try:
            assert streamed.wait(30), "the step never streamed its tokens"
            return real_fill(rows)
        finally:
            filling.clear()

    def fill_async(rows):
        if any(r is not None for r in rows):
            streamed.clear()
            filling.set()
        return real_fill_async(rows)

    def on_read(out):
        read(out)
        streamed.set()

    def watched(name):
        original = getattr(RowConstraint, name)

        def get(self):
            if filling.is_set():
                touched.append(name)
            return original.fget(self)

        return property(get)

    for name in ("done", "accepting", "active"):
        monkeypatch.setattr(RowConstraint, name, watched(name))
    masks.fill, masks.fill_async, generator.on_read = fill, fill_async, on_read
    short = read_response_format({"type": "regex", "pattern": "(yes|no), [a-z]{2,12}"})
    drive(
        s,
        [
            fixed(0, seed=0, response_format=PET_FORMAT, max_tokens=40),
            fixed(1, seed=1, response_format=short, max_tokens=40),
            fixed(2, seed=2, response_format=PET_FORMAT, max_tokens=40),
        ],
        {},
        {},
    )
    ends = replies(lines)
    assert len(ends) == 3 and all(end[0] in ("stop", "length") for _, end in ends.values())
    assert any(end[0] == "stop" for _, end in ends.values()), "a grammar completed (done was asked, after the fill)"
    assert touched == []


def test_a_schema_compiles_no_more_matchers_than_rows_of_it_ran_at_once(tiny_model):
    """Ended rows let go of the matcher they copied: a second batch of the
    same schema reuses the first one's matchers."""
    from worker.runtime.loader import load

    s, lines = scheduler_for(load(tiny_model), mask_threads=4)
    for batch in range(2):
        drive(s, [fixed(10 * batch + i, seed=i, response_format=PET_FORMAT, max_tokens=12) for i in range(3)], {}, {})
        lexers = s._constraints.compile(PET_FORMAT).lexers
        assert len(lexers) == 3 and all(len(lexer.rows) == 0 for lexer in lexers)
    assert len(replies(lines)) == 6


def test_a_failed_prefill_chunk_loses_no_token_of_the_decoding_rows(tiny_model):
    from worker.runtime.loader import load

    class FailingPrefill:
        def __init__(self, model):
            self.model, self.fail = model, False

        def __getattr__(self, name):
            return getattr(self.model, name)

        def __call__(self, inputs, cache=None):
            if self.fail and inputs.shape[1] > 1:
                self.fail = False
                raise RuntimeError("injected prefill failure")
            return self.model(inputs, cache=cache)

    loaded = load(tiny_model)
    texts = {}
    for inject in (False, True):
        model = FailingPrefill(loaded.model)
        s, lines = scheduler_for(loaded, model, compile_decode=False)
        for r in [fixed(i, prompt=FREE, temperature=0.0, max_tokens=12) for i in range(2)]:
            s.submit(r, 0.0)
        while len(s.generator.decoding) < 2 or any(not st.generated for st in s.streams.values()):
            s.step()
        s.submit(fixed(5, max_tokens=4), 0.0)
        model.fail = inject
        s.drain()
        texts[inject] = replies(lines)
    assert texts[True][5] == ["", "worker_crashed"]
    assert texts[True][0] == texts[False][0] and texts[True][1] == texts[False][1]
    assert texts[True][0][1][1] == 12
