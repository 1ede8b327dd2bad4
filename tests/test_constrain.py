"""worker.engine.constrain in-process on the demo tokenizer: what the grammar
allows, when a row is done, the masks and their bounds; and the request
side's checks of response_format. The engine's use of it, through a real
worker: tests/test_structured_output.py."""

import json

import mlx.core as mx
import msgspec
import numpy as np
import pytest

from harness.engine import allowed_ids
from ipc.framing import decode_payload, encode_frame
from ipc.messages import Generate, JsonSchemaFormat, JsonSchemaSpec, RegexFormat, decode_response_format, read_response_format
from supervisor.requests import BadRequest, parse_line
from tests.schemas import PET, PET_VALUE
from worker.engine.constrain import BatchMasks, Constraints, ConstraintViolation

CHAT = "<|im_start|>user\nDescribe a pet as JSON.<|im_end|>\n<|im_start|>assistant\n"
PET_FORMAT = read_response_format({"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}})


@pytest.fixture(scope="module")
def kit(tiny_model):
    from worker.text.tokenizer import TextCodec

    config = json.loads((tiny_model / "config.json").read_text())
    codec = TextCodec(tiny_model, config)
    vocab = config["text_config"]["vocab_size"]
    return codec, Constraints.for_codec(codec, vocab), BatchMasks(vocab, codec.eos_ids)


def test_json_object_accepts_objects_and_nothing_else(kit):
    # llguidance writes strings canonically: \u escapes only for control
    # characters, so é comes out raw.
    codec, constraints, masks = kit
    fmt = decode_response_format('{"type":"json_object"}')
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


def test_a_closed_think_block_constrains_at_once(kit):
    codec, constraints, _ = kit
    closed = codec.encode(CHAT + "<think>\n\n</think>\n\n")
    assert constraints.row(PET_FORMAT, closed).active
    assert not constraints.row(PET_FORMAT, codec.encode(CHAT + "<think>\n")).active


def test_waiting_row_may_not_end_before_think_closes(kit):
    codec, constraints, masks = kit
    waiting = constraints.row(PET_FORMAT, codec.encode(CHAT + "<think>\n"))
    allowed = allowed_ids(masks, masks.fill([waiting])[0])
    assert not allowed & codec.eos_ids
    assert len(allowed) == masks.vocab_size - len(codec.eos_ids)


def test_eos_is_allowed_only_when_the_grammar_accepts(kit):
    codec, constraints, masks = kit
    row = constraints.row(RegexFormat("ab+"), [])
    steps = []
    for token in codec.encode("abb"):
        steps.append(allowed_ids(masks, masks.fill([row])[0]) & codec.eos_ids)
        row.advance(token)
    steps.append(allowed_ids(masks, masks.fill([row])[0]) & codec.eos_ids)
    assert steps[0] == set() and steps[-1] == set(codec.eos_ids)
    assert row.accepting and not row.done


def test_a_complete_grammar_is_done(kit):
    codec, constraints, _ = kit
    row = constraints.row(RegexFormat("yes|no"), [])
    for token in codec.encode("no"):
        assert not row.done
        row.advance(token)
    assert row.done


def test_a_forced_token_that_breaks_the_grammar_raises(kit):
    codec, constraints, _ = kit
    row = constraints.row(PET_FORMAT, [])
    with pytest.raises(ConstraintViolation):
        row.advance(codec.encode("x")[0])


def test_compiled_grammars_are_cached_and_bounded(kit):
    codec, constraints, _ = kit
    small = Constraints(codec.tokenizer.to_str(), constraints.vocab_size, codec.eos_ids, cache_size=2)
    formats = [RegexFormat(p) for p in ("a+", "b+", "c+")]
    first = small.compile(formats[0])
    assert small.compile(formats[0]) is first
    second, third = small.compile(formats[1]), small.compile(formats[2])
    assert small.compile(formats[2]) is third and small.compile(formats[1]) is second
    assert small.compile(formats[0]) is not first, "the least recently used grammar was dropped"
    # rows get their own copies: one row's progress is not another's
    a, b = small.row(formats[0], []), small.row(formats[0], [])
    a.advance(codec.encode("a")[0])
    assert a.accepting and not b.accepting


def test_rows_of_one_grammar_copy_separately_compiled_matchers(kit):
    # Copies of one llguidance matcher share its lexer behind a lock: rows
    # filling their masks side by side must copy different ones.
    codec, constraints, masks = kit
    several = Constraints(codec.tokenizer.to_str(), constraints.vocab_size, codec.eos_ids, lexers=2)
    a, b, c = (several.row(PET_FORMAT, []) for _ in range(3))
    lexers = several.compile(PET_FORMAT).lexers
    assert len(lexers) == 2, "one more matcher while every one is in use, up to the bound"
    assert a in lexers[0].rows and b in lexers[1].rows and c in lexers[0].rows
    del b
    d = several.row(PET_FORMAT, [])
    assert d in lexers[1].rows and len(several.compile(PET_FORMAT).lexers) == 2, "a matcher no live row copies is reused"
    # every matcher allows the same tokens along a valid reply
    for token in codec.encode(json.dumps(PET_VALUE, separators=(",", ":"))):
        bits = masks.fill([a, c, d])
        assert (bits[0] == bits[1]).all() and (bits[0] == bits[2]).all()
        assert token in allowed_ids(masks, bits[0])
        for row in (a, c, d):
            row.advance(token)
    assert a.accepting and c.accepting and d.accepting


# -- the request side ---------------------------------------------------------


def test_a_client_line_carries_its_response_format_typed_to_the_worker():
    line = b'{"id":"j","prompt":"hi","response_format": {"type":"json_schema","json_schema":{"name":"p","schema":{"type":"object"}}}}'
    msg = parse_line(line)
    assert msg.format == JsonSchemaFormat(JsonSchemaSpec({"type": "object"}, name="p"))
    gen = Generate(rid=1, prompt="hi", response_format=msg.format)
    assert decode_payload(encode_frame(gen)[4:]) == gen
    for absent in (b"null", b'{"type":"text"}'):
        assert parse_line(b'{"prompt":"hi","response_format":' + absent + b"}").format is None
    assert parse_line(b'{"prompt":"hi"}').format is None


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


def test_masks_apply_to_mlx_logits_of_any_dtype(kit):
    codec, constraints, masks = kit
    row = constraints.row(RegexFormat("ab"), [])
    logits = mx.zeros((2, masks.vocab_size), dtype=mx.bfloat16)
    out = masks(logits, [None, row])
    assert out.dtype == mx.bfloat16
    allowed = np.nonzero(np.isfinite(np.array(out[1].astype(mx.float32))))[0].tolist()
    assert allowed and all(codec.decode([t]) in ("a", "ab") for t in allowed)
    assert np.isfinite(np.array(out[0].astype(mx.float32))).all()


def test_masks_filled_on_the_side_thread_equal_the_direct_ones(kit):
    codec, constraints, masks = kit
    rows = [constraints.row(PET_FORMAT, []), None, constraints.row(PET_FORMAT, codec.encode(CHAT + "<think>\n")), constraints.row(PET_FORMAT, [])]
    for token in codec.encode('{"name":"'):
        rows[0].advance(token)
    assert np.array_equal(masks.fill_async(rows).result(), masks.fill(rows))
    assert masks.fill_async([None, None]).result() is None
