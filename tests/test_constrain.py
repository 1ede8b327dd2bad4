"""Structured output in-process on the real demo model: worker.constrain's
masks over the model's real logits, sampled by the worker's Sampler.

The demo model has random weights and writes no JSON when left alone; every
reply below is valid only because of the mask.
"""

import json
import re

import jsonschema
import mlx.core as mx
import msgspec
import numpy as np
import pytest

from ipc.framing import decode_payload, encode_frame
from ipc.messages import Generate
from supervisor.requests import BadRequest, parse_line, response_format_text
from tests.constrained_decode import Row, Sampler, decode
from tests.schemas import PET
from worker.constrain import BatchMasks, ConstraintError, ConstraintViolation, Constraints
from worker.streamer import ThinkBudget

CHAT = "<|im_start|>user\nDescribe a pet as JSON.<|im_end|>\n<|im_start|>assistant\n"
SEEDS = range(20)

PET_FORMAT = json.dumps({"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}})

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
def lm(tiny_model):
    from worker.loader import load
    from worker.text import TextCodec

    loaded = load(tiny_model)
    codec = TextCodec(tiny_model, loaded.config)
    vocab = loaded.config["text_config"]["vocab_size"]
    return loaded.model, codec, Constraints.for_codec(codec, vocab), BatchMasks(vocab, codec.eos_ids)


def sampler(vocab, seed):
    # chat_metal's defaults except a temperature of 1.0
    return Sampler(vocab_size=vocab, temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.1, seed=seed)


def run(lm, response_format, *, prompt=CHAT, seeds=SEEDS, max_tokens=160, budget=None, keep_logits=False):
    model, codec, constraints, masks = lm
    ids = codec.encode(prompt)
    rows = [
        Row(
            sampler(constraints.vocab_size, seed),
            constraints.row(response_format, ids) if response_format else None,
            ThinkBudget(codec.think_start, codec.think_end, budget, ids) if budget is not None else None,
        )
        for seed in seeds
    ]
    return decode(model, ids, rows, masks, max_tokens=max_tokens, eos=codec.eos_ids, think_end=codec.think_end, keep_logits=keep_logits)


def texts(lm, decoded):
    return [lm[1].decode(r.ids) for r in decoded.rows]


def test_json_schema_replies_validate_for_20_seeds(lm):
    decoded = run(lm, PET_FORMAT)
    replies = texts(lm, decoded)
    assert [r.finish for r in decoded.rows] == ["stop"] * 20
    for reply in replies:
        jsonschema.validate(json.loads(reply), PET)
    assert len(set(replies)) > 10, "seeded rows should differ"


def test_unconstrained_model_writes_no_json(lm):
    # The premise of every test here: without the mask there is no JSON.
    for reply in texts(lm, run(lm, None, seeds=range(5), max_tokens=40)):
        with pytest.raises(ValueError):
            json.loads(reply)


def test_json_object_replies_parse(lm):
    # Free-form keys and strings are unbounded and a random model rarely
    # closes a string (about 1 reply in 20 within 200 tokens here), so most
    # replies run into max_tokens: those must be a prefix the grammar
    # accepted and say `length` (the client can tell).
    _, codec, constraints, _ = lm
    fmt = '{"type":"json_object"}'
    decoded = run(lm, fmt, max_tokens=120)
    for r in decoded.rows:
        reply = codec.decode(r.ids)
        assert reply.startswith("{")
        if r.finish == "stop":
            assert isinstance(json.loads(reply), dict)
        else:
            assert r.finish == "length" and len(r.ids) == 120
            replay = constraints.row(fmt, [])
            for token in r.ids:
                replay.advance(token)
            assert not replay.accepting


def test_json_object_accepts_objects_and_nothing_else(lm):
    # llguidance writes strings canonically: \u escapes only for control
    # characters, so é comes out raw.
    _, codec, constraints, masks = lm
    fmt = '{"type":"json_object"}'
    value = {"a": [1, -2.5e3, True, None, {"b": 'x \\ " é\n'}], "": {}, "c": []}
    row = constraints.row(fmt, [])
    for token in codec.encode(json.dumps(value, separators=(",", ":"), ensure_ascii=False)):
        assert token in allowed_ids(masks, masks.fill([row])[0])
        row.advance(token)
    assert row.accepting and set(codec.eos_ids) <= allowed_ids(masks, masks.fill([row])[0])
    for bad in ("[1]", '"text"', '{"a":1,}', "{'a':1}"):
        row = constraints.row(fmt, [])
        with pytest.raises(ConstraintViolation):
            for token in codec.encode(bad):
                row.advance(token)
            if not row.accepting:
                raise ConstraintViolation("incomplete")


def test_regex_replies_match(lm):
    replies = texts(lm, run(lm, json.dumps({"type": "regex", "pattern": DATE}), max_tokens=40))
    for reply in replies:
        assert re.fullmatch(DATE, reply), reply


def test_lark_grammar_replies_parse(lm):
    decoded = run(lm, json.dumps({"type": "grammar", "grammar": ARITHMETIC}), max_tokens=60)
    assert {r.finish for r in decoded.rows} == {"stop"}
    for reply in texts(lm, decoded):
        assert re.fullmatch(r"[0-9+\-*()]+", reply), reply
        assert isinstance(eval(reply, {"__builtins__": {}}), int)  # only digits, operators and parentheses


def test_think_then_json(lm):
    _, codec, _, _ = lm
    decoded = run(lm, PET_FORMAT, prompt=CHAT + "<think>\n", budget=6, max_tokens=200)
    for r in decoded.rows:
        assert r.finish == "stop"
        at = r.ids.index(codec.think_end)
        assert at == 5, "the budget forces </think> after 6 thinking tokens, the prompt's newline included"
        thinking = codec.decode(r.ids[:at])
        assert not thinking.lstrip().startswith("{")
        jsonschema.validate(json.loads(codec.decode(r.ids[at + 1 :])), PET)


def test_a_closed_think_block_constrains_at_once(lm):
    _, codec, constraints, _ = lm
    closed = codec.encode(CHAT + "<think>\n\n</think>\n\n")
    assert constraints.row(PET_FORMAT, closed).active
    assert not constraints.row(PET_FORMAT, codec.encode(CHAT + "<think>\n")).active


def test_waiting_row_may_not_end_before_think_closes(lm):
    _, codec, constraints, masks = lm
    waiting = constraints.row(PET_FORMAT, codec.encode(CHAT + "<think>\n"))
    allowed = allowed_ids(masks, masks.fill([waiting])[0])
    assert not allowed & codec.eos_ids
    assert len(allowed) == masks.vocab_size - len(codec.eos_ids)


def test_constrained_and_free_rows_in_one_batch(lm):
    decoded = run(lm, None, seeds=[3, 4], max_tokens=80, keep_logits=True)
    assert decoded.masked_logits[0] is decoded.raw_logits[0], "no constrained row: logits untouched"
    model, codec, constraints, masks = lm
    ids = codec.encode(CHAT)
    rows = [Row(sampler(masks.vocab_size, 3), constraints.row(PET_FORMAT, ids)), Row(sampler(masks.vocab_size, 4))]
    mixed = decode(model, ids, rows, masks, max_tokens=80, eos=codec.eos_ids, keep_logits=True)
    for raw, masked in zip(mixed.raw_logits, mixed.masked_logits):
        assert raw.shape[0] == 2
        assert np.array_equal(np.array(masked[1]), np.array(raw[1])), "the free row is bit-identical"
    row0 = np.array(mixed.masked_logits[0][0])
    assert np.isinf(row0).sum() > masks.vocab_size - 5, "the first step of the constrained row allows only '{'"
    jsonschema.validate(json.loads(codec.decode(rows[0].ids)), PET)
    with pytest.raises(ValueError):
        json.loads(codec.decode(rows[1].ids))


def test_max_tokens_cut_is_a_prefix_reported_as_length(lm):
    _, codec, constraints, _ = lm
    decoded = run(lm, PET_FORMAT, seeds=range(4), max_tokens=12)
    for r in decoded.rows:
        assert r.finish == "length" and len(r.ids) == 12
        reply = codec.decode(r.ids)
        assert reply.startswith('{"name":"')
        replay = constraints.row(PET_FORMAT, [])
        for token in r.ids:
            replay.advance(token)
        assert not replay.accepting
        with pytest.raises(ValueError):
            json.loads(reply)


def allowed_ids(masks, row_bits) -> set[int]:
    bits = np.unpackbits(np.ascontiguousarray(row_bits).view(np.uint8), bitorder="little")[: masks.vocab_size]
    return set(np.nonzero(bits)[0].tolist())


def test_eos_is_allowed_only_when_the_grammar_accepts(lm):
    _, codec, constraints, masks = lm
    row = constraints.row(json.dumps({"type": "regex", "pattern": "ab+"}), [])
    steps = []
    for token in codec.encode("abb"):
        steps.append(allowed_ids(masks, masks.fill([row])[0]) & codec.eos_ids)
        row.advance(token)
    steps.append(allowed_ids(masks, masks.fill([row])[0]) & codec.eos_ids)
    assert steps[0] == set() and steps[-1] == set(codec.eos_ids)
    assert row.accepting and not row.done


def test_a_complete_grammar_is_done(lm):
    _, codec, constraints, _ = lm
    row = constraints.row(json.dumps({"type": "regex", "pattern": "yes|no"}), [])
    for token in codec.encode("no"):
        assert not row.done
        row.advance(token)
    assert row.done


def test_a_forced_token_that_breaks_the_grammar_raises(lm):
    _, codec, constraints, _ = lm
    row = constraints.row(PET_FORMAT, [])
    with pytest.raises(ConstraintViolation):
        row.advance(codec.encode("x")[0])


@pytest.mark.parametrize(
    "response_format, message",
    [
        ({"type": "xml"}, "unknown response_format type 'xml'; expected one of json_object, json_schema, regex, grammar"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "missing required field `schema`"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}, "invalid JSON schema in response_format: Invalid type: objekt"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": 5, "maximum": 1}}}, "minimum (5) is greater than maximum (1)"),
        ({"type": "json_schema", "json_schema": {"schema": {"properties": {"a": {"$ref": "#/$defs/gone"}}}}}, "'/$defs/gone' does not exist"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "[a-"}}}, "unclosed character class"),
        ({"type": "regex", "pattern": "([a-z"}, "invalid regex in response_format"),
        ({"type": "regex", "pattern": 7}, "invalid response_format field 'pattern': Expected `str`, got `int`"),
        ({"type": "grammar", "grammar": "start: undefined_rule"}, 'unknown name: "undefined_rule"'),
    ],
)
def test_bad_formats_are_rejected_before_any_token(lm, response_format, message):
    _, _, constraints, _ = lm
    with pytest.raises(ConstraintError) as err:
        constraints.row(json.dumps(response_format), [])
    assert message in str(err.value)


def test_compiled_grammars_are_cached_and_bounded(lm):
    _, codec, constraints, _ = lm
    small = Constraints(codec.tokenizer.to_str(), constraints.vocab_size, codec.eos_ids, cache_size=2)
    formats = [json.dumps({"type": "regex", "pattern": p}) for p in ("a+", "b+", "c+")]
    first = small.compile(formats[0])
    assert small.compile(formats[0]) is first
    second, third = small.compile(formats[1]), small.compile(formats[2])
    assert small.compile(formats[2]) is third and small.compile(formats[1]) is second
    assert small.compile(formats[0]) is not first, "the least recently used grammar was dropped"
    # rows get their own copies: one row's progress is not another's
    a, b = small.row(formats[0], []), small.row(formats[0], [])
    a.advance(codec.encode("a")[0])
    assert a.accepting and not b.accepting


# -- the request side ---------------------------------------------------------


def test_client_line_keeps_the_response_format_text():
    line = b'{"id":"j","prompt":"hi","response_format": {"type":"json_schema","json_schema":{"name":"p","schema":{"type":"object"}}}}'
    msg = parse_line(line)
    text = response_format_text(msg)
    assert json.loads(text) == {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}}
    gen = Generate(rid=1, prompt="hi", response_format=text)
    assert decode_payload(encode_frame(gen)[4:]) == gen
    assert response_format_text(parse_line(b'{"prompt":"hi","response_format":null}')) is None
    assert response_format_text(parse_line(b'{"prompt":"hi"}')) is None


@pytest.mark.parametrize(
    "value, message",
    [
        ('{"type":"yaml"}', "unknown response_format type 'yaml'"),
        ('"json"', 'response_format must be an object with a "type"'),
        ("{}", 'response_format needs a "type": one of json_object, json_schema, regex, grammar'),
        ('{"type":"regex"}', "missing required field `pattern`"),
        ('{"type":"grammar","grammar":["start"]}', "invalid response_format field 'grammar'"),
        ('{"type":"json_schema","json_schema":{"schema":true}}', "invalid response_format field 'json_schema.schema'"),
    ],
)
def test_malformed_response_format_is_a_bad_request_with_the_id(value, message):
    with pytest.raises(BadRequest) as err:
        parse_line(b'{"id":7,"prompt":"hi","response_format":' + value.encode() + b"}")
    assert message in err.value.msg and err.value.id_json == "7"


def test_oversized_response_format_is_rejected():
    pattern = "a" * 300_000
    with pytest.raises(BadRequest, match="the limit is"):
        parse_line(msgspec.json.encode({"prompt": "hi", "response_format": {"type": "regex", "pattern": pattern}}))


def test_masks_apply_to_mlx_logits_of_any_dtype(lm):
    _, codec, constraints, masks = lm
    row = constraints.row(json.dumps({"type": "regex", "pattern": "ab"}), [])
    logits = mx.zeros((2, masks.vocab_size), dtype=mx.bfloat16)
    out = masks(logits, [None, row])
    assert out.dtype == mx.bfloat16
    allowed = np.nonzero(np.isfinite(np.array(out[1].astype(mx.float32))))[0].tolist()
    assert allowed and all(codec.decode([t]) in ("a", "ab") for t in allowed)
    assert np.isfinite(np.array(out[0].astype(mx.float32))).all()


def test_masks_filled_on_the_side_thread_equal_the_direct_ones(lm):
    _, codec, constraints, masks = lm
    rows = [constraints.row(PET_FORMAT, []), None, constraints.row(PET_FORMAT, codec.encode(CHAT + "<think>\n")), constraints.row(PET_FORMAT, [])]
    for token in codec.encode('{"name":"'):
        rows[0].advance(token)
    assert np.array_equal(masks.fill_async(rows).result(), masks.fill(rows))
    assert masks.fill_async([None, None]).result() is None
