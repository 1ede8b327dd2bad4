"""Hypothesis fuzz of the stdin decoder: whatever bytes a client sends, the
endpoint gets a valid request or a BadRequest, and nothing else."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ipc.framing import decode_payload, encode_frame
from ipc.messages import Generate
from supervisor.config import Config
from supervisor.endpoint import TOO_LONG, LineSplitter
from supervisor.requests import OPS, BadRequest, ClientLine, encode_id, parse_line, stop_list
from supervisor.resolve import Resolver, UnknownModel
from tests.faults import FAKE_ENV, FakeModels

# Seeded and without an example database, so every run checks the same cases.
FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=400, suppress_health_check=[HealthCheck.too_slow])

FIELDS = ["op", "id", "model", "lora", "prompt", "messages", "max_tokens", "temperature", "top_k", "top_p",
          "repetition_penalty", "seed", "reasoning_budget", "stop"]
VALID = [
    b'{"prompt":"<|im_start|>user\\nHi<|im_end|>\\n","model":"m","id":"r1","max_tokens":64,"temperature":0.7,"top_k":50,'
    b'"top_p":0.9,"repetition_penalty":1.1,"seed":42,"reasoning_budget":256,"stop":["\\n\\n"]}',
    b'{"messages":[{"role":"user","content":"Hi \\u00e9"}],"id":7,"stop":"x"}',
    b'{"op":"cancel","id":3.5}',
    b'{"op":"load","model":"qwen","lora":"/a/b.safetensors"}',
    b'{"op":"status"}',
]

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
field_values = json_values | st.sampled_from(sorted(OPS)) | st.lists(st.fixed_dictionaries({"role": st.text(max_size=5), "content": st.text(max_size=20)}), max_size=3)
requests = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), field_values, max_size=8)


@pytest.fixture(scope="module")
def resolver(tmp_path_factory):
    cache = tmp_path_factory.mktemp("empty-cache")
    return Resolver(Config(model_cache=str(cache)))


def check(line: bytes, resolver: Resolver) -> None:
    """The property: a BadRequest, or a request every later stage accepts."""
    try:
        msg = parse_line(line)
    except BadRequest as exc:
        assert isinstance(exc.msg, str) and exc.msg
        if exc.id_json is not None:
            json.loads(exc.id_json)
        return
    assert isinstance(msg, ClientLine)
    id_json = encode_id(msg.id)
    if id_json is not None:
        assert json.loads(id_json) == msg.id and type(json.loads(id_json)) is type(msg.id)
    try:
        resolver.resolve(msg.model, msg.lora)
    except UnknownModel:
        pass
    if msg.op is not None:
        assert msg.op in OPS
        return
    assert (msg.prompt is None) != (msg.messages is None)
    frame = encode_frame(Generate(rid=1, prompt=msg.prompt, messages=msg.messages, stop=stop_list(msg.stop), id_json=id_json))
    assert decode_payload(frame[4:]).prompt == msg.prompt


@FUZZ
@given(st.binary(max_size=300))
@example(b'{"prompt":"x","model":"\\u0000"}')
@example(b'{"prompt":"x","model":"m","lora":"a\\u0000b"}')
@example(b'{"prompt":"x","model":"' + b"y" * 5000 + b'"}')
@example(b'{"prompt":"\\ud800"}')
@example(b'{"prompt":"x","id":1e999}')
@example(b'{"prompt":"x","id":123456789012345678901234567890}')
@example(b'{"prompt":"x","id":true}')
@example(b'{"prompt":"\xff\xfe"}')
def test_random_bytes(resolver, data):
    check(data, resolver)


@FUZZ
@given(requests)
def test_objects_with_wrong_types(resolver, obj):
    check(json.dumps(obj).encode(), resolver)


@FUZZ
@given(st.sampled_from(VALID), st.data())
def test_truncations_and_bit_flips_of_valid_lines(resolver, line, data):
    cut = data.draw(st.integers(0, len(line)))
    check(line[:cut], resolver)
    at = data.draw(st.integers(0, len(line) - 1))
    flipped = bytearray(line)
    flipped[at] ^= 1 << data.draw(st.integers(0, 7))
    check(bytes(flipped), resolver)


def test_the_valid_lines_are_valid(resolver):
    for line in VALID:
        parse_line(line)
        check(line, resolver)


def reference_split(stream: bytes, max_line: int) -> list:
    """What the splitter must produce for the whole stream at once."""
    parts = stream.split(b"\n")
    lines, tail = parts[:-1], parts[-1]
    out = [TOO_LONG if len(x) > max_line else x for x in lines]
    if tail:
        out.append(TOO_LONG if len(tail) > max_line else tail)
    return out


@FUZZ
@given(st.lists(st.binary(max_size=12) | st.sampled_from([b"\n", b"\n\n", b"abcdefgh\n"]), max_size=20), st.integers(1, 10), st.data())
def test_line_splitter_is_chunking_independent(pieces, max_line, data):
    """Any chunking of a stream gives the same lines; a line longer than the
    limit becomes TOO_LONG exactly once, even when it ends at EOF."""
    stream = b"".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    splitter = LineSplitter(max_line)
    out = []
    for start, end in zip([0, *cuts], [*cuts, len(stream)]):
        out += splitter.feed(stream[start:end])
    out += splitter.finish()
    assert out == reference_split(stream, max_line)


def test_msgspec_rejects_what_the_property_relies_on():
    """Lone surrogates and invalid UTF-8 never reach a ClientLine, so every
    string in one can be encoded for the worker."""
    for line in (b'{"prompt":"\\udc00"}', b'{"prompt":"\xed\xa0\x80"}'):
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
            msgspec.json.decode(line, type=ClientLine)


def test_a_model_reference_that_is_no_path_does_not_end_the_pool(tmp_path, spawn_pool):
    """A NUL byte in "model" used to raise ValueError out of the resolver,
    ending the stdin task and with it the whole pool."""
    fakes = FakeModels(tmp_path)
    fakes.add("a")
    pool = spawn_pool("--config", fakes.config(), env=FAKE_ENV)
    pool.send({"model": "\u0000", "id": "nul", "prompt": "x"})
    pool.send({"model": "a", "id": "lora", "lora": "x\u0000", "prompt": "x"})
    pool.send({"op": "load", "model": "y" * 5000, "id": "load"})
    pool.sent_ids.append("load")  # an op's error carries its id
    pool.send({"model": "a", "id": "ok", "prompt": "x", "max_tokens": 2})
    assert pool.terminal("nul")["code"] == "unknown_model"
    assert pool.terminal("lora")["code"] == "unknown_model"
    assert pool.terminal("load")["code"] == "unknown_model"
    assert pool.terminal("ok")["gen_tokens"] == 2
    assert pool.close() == 0
