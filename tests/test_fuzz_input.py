"""Hypothesis fuzz of the stdin decoder: whatever bytes a client sends, the
endpoint gets a valid request or a BadRequest, and nothing else; then a
corpus of hostile lines (nesting deeper than any decoder recurses, symlink
loops as model and adapter paths) through a real pool's stdin and control
socket, which answer every line and go on."""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from harness.fakes import FAKE_ENV, FakeModels
from harness.pool import RawPool
from harness.procs import wait_for
from ipc.framing import decode_payload, encode_frame
from ipc.messages import Generate
from supervisor.config import Config
from supervisor.endpoint import TOO_LONG_HEAD, LineSplitter, TooLong, read_line
from supervisor.requests import MAX_ID_BYTES, OPS, BadRequest, ClientLine, encode_id, parse_line, stop_list
from supervisor.resolve import AdapterRefused, Resolver, UnknownModel

# Seeded and without an example database, so every run checks the same cases.
FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=400, suppress_health_check=[HealthCheck.too_slow])

FIELDS = [
    "op",
    "id",
    "model",
    "lora",
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "seed",
    "reasoning_budget",
    "stop",
]
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
field_values = (
    json_values | st.sampled_from(sorted(OPS)) | st.lists(st.fixed_dictionaries({"role": st.text(max_size=5), "content": st.text(max_size=20)}), max_size=3)
)
requests = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), field_values, max_size=8)


@pytest.fixture(scope="module")
def resolver(tmp_path_factory):
    cache = tmp_path_factory.mktemp("empty-cache")
    return Resolver(Config(model_cache=str(cache)))


@pytest.fixture(scope="module")
def loops(tmp_path_factory) -> list[str]:
    """Paths that are symlink loops: one link to itself, two to each other,
    and names inside them."""
    root = tmp_path_factory.mktemp("loops")
    (root / "self").symlink_to(root / "self")
    (root / "ping").symlink_to(root / "pong")
    (root / "pong").symlink_to(root / "ping")
    return [str(root / "self"), str(root / "ping"), str(root / "self" / "model"), str(root / "pong" / "adapter.safetensors")]


def check(line: bytes, resolver: Resolver) -> BadRequest | None:
    """The property: a BadRequest, or a request every later stage accepts.
    Returns the BadRequest, if any."""
    try:
        msg = parse_line(line)
    except BadRequest as exc:
        assert isinstance(exc.msg, str) and exc.msg
        if exc.id_json is not None:
            json.loads(exc.id_json)
        return exc
    assert isinstance(msg, ClientLine)
    id_json = encode_id(msg.id)
    if id_json is not None:
        # One canonical echo per value (7.0 is 7), and a short one.
        assert json.loads(id_json) == msg.id and encode_id(json.loads(id_json)) == id_json
        assert len(id_json.encode()) <= 6 * MAX_ID_BYTES + 2
    for lora_paths in (True, False):  # stdin's rule, HTTP's
        try:
            resolver.resolve(msg.model, msg.lora, lora_paths=lora_paths)
        except AdapterRefused as exc:
            # One answer whatever the file is: it tells nothing of it.
            assert str(exc) == resolver.adapters.refusal(msg.lora, lora_paths)
        except UnknownModel:
            pass
    if msg.op is not None:
        assert msg.op in OPS
        return
    assert (msg.prompt is None) != (msg.messages is None)
    frame = encode_frame(Generate(rid=1, prompt=msg.prompt, messages=msg.messages, stop=stop_list(msg.stop), id_json=id_json))
    assert decode_payload(frame[4:]).prompt == msg.prompt
    return None


@FUZZ
@given(st.binary(max_size=300))
@example(b'{"prompt":"x","model":"\\u0000"}')
@example(b'{"prompt":"x","model":"m","lora":"a\\u0000b"}')
@example(b'{"prompt":"x","lora":"/x/${HOME}"}')
@example(b'{"prompt":"x","lora":"~/.bashrc"}')
@example(b'{"prompt":"x","lora":"/etc/passwd"}')
@example(b'{"prompt":"x","lora":"/dev/zero"}')
@example(b'{"prompt":"x","lora":"/proc/self/environ"}')
@example(b'{"op":"load","model":"m","lora":"/etc"}')
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


def nested(depth: int, opener: bytes) -> bytes:
    closer = b"]" if opener == b"[" else b"}"
    return opener * depth + b"0" + closer * depth


@settings(FUZZ, max_examples=30)
@given(
    st.integers(5_000, 150_000),
    st.sampled_from([b"[", b'{"k":']),
    st.sampled_from(["stop", "messages", "zz", "id"]),
    st.booleans(),
    st.booleans(),
)
def test_nesting_deeper_than_the_decoder_goes(resolver, depth, opener, field, id_first, op):
    """msgspec raises RecursionError past ~1000 levels, even inside a field
    it would skip; that used to end the pool. Now it is a BadRequest, which
    carries the line's id when the id is readable, before or after."""
    fields = [b'"' + field.encode() + b'":' + nested(depth, opener)]
    if field != "id":
        fields.insert(0 if not id_first else 1, b'"id":"deep"')
    fields.append(b'"op":"status"' if op else b'"prompt":"x"')
    if id_first:
        fields.reverse()
    error = check(b"{" + b",".join(fields) + b"}", resolver)
    assert error is not None
    assert error.id_json == (None if field == "id" else '"deep"')


@FUZZ
@given(requests, st.sets(st.sampled_from(["model", "lora"]), min_size=1), st.data())
@example({"prompt": "hi", "id": "a"}, {"lora"}, None)
@example({"op": "load"}, {"model"}, None)
def test_symlink_loops_as_model_and_adapter_paths(resolver, loops, obj, fields, data):
    """Path.resolve raised RuntimeError on a loop (before Python 3.13),
    which the resolver let through: the stdin task ended, and the pool with it."""
    for field in fields:
        obj[field] = data.draw(st.sampled_from(loops)) if data is not None else loops[0]
    check(json.dumps(obj).encode(), resolver)


@pytest.mark.parametrize(
    "line, id_json",
    [
        (b'{"id":"r5","prompt":"ab', '"r5"'),  # truncated
        (b'{"prompt":"x","id":7,}', "7"),  # a stray comma
        (b'{"id":"u8","prompt":"\xff"}', '"u8"'),  # not UTF-8
        (b'{"id":"q\\"x","prompt":', '"q\\"x"'),  # an escaped quote in the id
        (b'{"messages":[{"id":"inner"}],"prompt":', None),  # not the request's id
        (b'{"id":1e999,"prompt":"x"}', None),  # no number JSON can echo
        (b'{"id":[1],"prompt":"x"', None),
    ],
)
def test_the_id_of_an_undecodable_line_is_still_echoed(resolver, line, id_json):
    error = check(line, resolver)
    assert error is not None and error.id_json == id_json


@pytest.mark.parametrize(
    "value, id_json",
    [(7, "7"), (7.0, "7"), (-0.0, "0"), (7.25, "7.25"), (2**53 - 1, str(2**53 - 1)), (-(2**53 - 1), str(-(2**53 - 1))), ("é" * 128, '"' + "é" * 128 + '"')],
)
def test_ids_have_one_canonical_echo(value, id_json):
    """7 and 7.0 are one id (JSON cannot tell them apart, and a client
    cancelling 7.0 means 7); integers within JavaScript's safe range."""
    assert parse_line(json.dumps({"prompt": "x", "id": value}).encode()).id_json == id_json


@pytest.mark.parametrize(
    "value, why",
    [
        ("", "empty"),
        ("x" * 257, "longer than 256 bytes"),
        ("é" * 129, "longer than 256 bytes"),  # 258 bytes of UTF-8
        ("y" * (8 << 20), "longer than 256 bytes"),
        (123456789012345678901234567890, "integer within"),
        (2**53, "integer within"),
        (1e300, "integer within"),
    ],
)
def test_an_empty_long_or_huge_id_is_refused_without_echoing_it(resolver, value, why):
    """The worker repeats a request's id on every line it writes: an 8 MiB
    id outgrew its pipe and killed it. The refusal never repeats the id."""
    line = json.dumps({"prompt": "x", "id": value}).encode()
    for probe in (line, line[:-1]):  # decodable, and cut short (the id is then scanned for)
        error = check(probe, resolver)
        assert error is not None and error.id_json is None
    error = check(line, resolver)
    assert why in error.msg and len(error.msg) < 200


def test_an_over_long_line_is_answered_with_the_id_at_its_start():
    splitter = LineSplitter(1000)
    lines = splitter.feed(b'{"id":"head","prompt":"' + b"x" * 5000 + b'"}\n{"prompt":"' + b"x" * 5000 + b'","id":"tail"}\n')
    lines += splitter.feed(b'{"prompt":"say \\"id\\":\\"fake\\",' + b"x" * 5000 + b'"}\n')
    assert [type(line) for line in lines] == [TooLong] * 3
    ids = []
    for line in lines:
        with pytest.raises(BadRequest) as exc:
            read_line(line, 1000)
        assert "longer than 1000 bytes" in exc.value.msg
        ids.append(exc.value.id_json)
    # The second id is past the part kept; the third "id" is prompt text.
    assert ids == ['"head"', None, None]


def test_the_valid_lines_are_valid(resolver):
    for line in VALID:
        parse_line(line)
        check(line, resolver)


def reference_split(stream: bytes, max_line: int) -> list:
    """What the splitter must produce for the whole stream at once."""
    parts = stream.split(b"\n")
    lines, tail = parts[:-1], parts[-1]
    head = min(TOO_LONG_HEAD, max_line)
    out = [TooLong(x[:head]) if len(x) > max_line else x for x in lines]
    if tail:
        out.append(TooLong(tail[:head]) if len(tail) > max_line else tail)
    return out


@FUZZ
@given(st.lists(st.binary(max_size=12) | st.sampled_from([b"\n", b"\n\n", b"abcdefgh\n"]), max_size=20), st.integers(1, 10), st.data())
def test_line_splitter_is_chunking_independent(pieces, max_line, data):
    """Any chunking of a stream gives the same lines; a line longer than the
    limit becomes one TooLong (holding the line's start) exactly once, even
    when it ends at EOF."""
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
    assert pool.terminal("lora")["code"] == "bad_request"
    assert pool.terminal("load")["code"] == "unknown_model"
    assert pool.terminal("ok")["gen_tokens"] == 2
    assert pool.close() == 0


def test_an_8mib_id_is_refused_and_7_and_7_0_are_one_id(tiny_model, tmp_path, spawn_pool):
    """An 8 MiB id used to be repeated on every token line: over 4 MiB the
    worker was killed, retried and killed again, and the model ended
    `failed`. 7 and 7.0 ran as two requests at once."""
    config = tmp_path / "pool.toml"
    config.write_text(f'[[models]]\nname = "tiny"\npath = "{tiny_model}"\npreload = true\n')
    pool = spawn_pool("--config", str(config))
    pool.wait_ev("ready", model="tiny")
    huge = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
    pool.send(json.dumps({**huge, "id": "h" * (8 << 20)}).encode() + b"\n")
    refused = pool.wait_ev("error")
    assert refused["code"] == "bad_request" and "longer than 256 bytes" in refused["msg"] and "id" not in refused
    assert len(refused["_line"]) < 300
    pool.send(b'{"model":"tiny","prompt":"hi","id":""}\n')
    empty = pool.wait_ev("error")
    assert empty["code"] == "bad_request" and "empty" in empty["msg"] and "id" not in empty
    # In one write, so the first is surely still running when the others come.
    pool.send(b'{"model":"tiny","prompt":"hi","max_tokens":4000,"id":7}\n{"model":"tiny","prompt":"hi","max_tokens":4,"id":7.0}\n{"op":"cancel","id":7.0}\n')
    pool.sent_ids.append(7)
    duplicate = pool.wait_ev("error")
    assert duplicate["code"] == "bad_request" and "duplicate id 7" in duplicate["msg"]
    assert pool.terminal(7)["finish_reason"] == "cancelled"
    assert pool.generate({**huge, "id": "after"})["gen_tokens"] == 4
    assert not [e for e in pool.events if e["ev"] in ("restarting", "failed")]
    pool.send({"op": "status"})
    assert [m["state"] for m in pool.wait_ev("status")["models"]] == ["ready"]
    assert pool.close() == 0


# `lora` values that name files a client must not reach, or would if the
# text were expanded (tests/test_adapter_paths.py: the same over HTTP).
HOSTILE_LORAS = [
    "/etc/passwd",
    "/etc",
    "/",
    "/dev/zero",
    "/proc/self/environ",
    "/x/${HOME}",
    "$HOME/.bashrc",
    "~/.bashrc",
    "/usr/lib",
    "../../../../etc/shadow",
]


def hostile_corpus(loops: list[str]) -> tuple[list[bytes], list]:
    """Lines for a pool serving model "a" (and "looped", whose path is a
    loop), and the ids of those that must each end with one terminal line."""
    deep = nested(100_000, b"[")
    lines = [
        *VALID,
        b'{"id":"dn3","prompt":"x","stop":' + deep + b"}",
        b'{"prompt":"x","zz":' + deep + b',"id":"dn4"}',
        deep,
        b'{"op":"status","x":' + deep + b"}",
        json.dumps({"id": "lp1", "model": "a", "lora": loops[0], "prompt": "hi"}).encode(),
        json.dumps({"id": "lp2", "model": loops[1], "prompt": "hi"}).encode(),
        json.dumps({"id": "lp3", "model": "looped", "prompt": "hi"}).encode(),
        json.dumps({"op": "load", "model": loops[2], "id": "lp4"}).encode(),
        json.dumps({"op": "unload", "model": "a", "lora": loops[3]}).encode(),
        json.dumps({"op": "reload", "model": loops[0]}).encode(),
        *(json.dumps({"id": f"hl{n}", "model": "a", "lora": lora, "prompt": "hi"}).encode() for n, lora in enumerate(HOSTILE_LORAS)),
        json.dumps({"op": "load", "model": "a", "lora": "/etc", "id": "hl-load"}).encode(),
        b'{"id":"tr","prompt":"x"',
        b'{"id":"u8","prompt":"\xff\xfe"}',
        # Ids refused without being echoed, and a line longer than the
        # control socket takes whose id is still read from its start.
        b'{"id":"","model":"a","prompt":"x"}',
        b'{"id":123456789012345678901234567890,"model":"a","prompt":"x"}',
        b'{"id":"' + b"i" * (2 << 20) + b'","model":"a","prompt":"x"}',
        b'{"id":"big","model":"a","max_tokens":1,"prompt":"' + b"p" * (3 << 19) + b'"}',
    ]
    return lines, ["r1", 7, "dn3", "dn4", "lp1", "lp2", "lp3", "lp4", *(f"hl{n}" for n in range(len(HOSTILE_LORAS))), "hl-load", "tr", "u8", "big"]


def test_the_corpus_on_the_control_socket_and_on_stdin(tmp_path, loops):
    fakes = FakeModels(tmp_path)
    fakes.add("a")
    sock = tmp_path / "ctl.sock"
    config = fakes.config(f'control_socket = "{sock}"', preload=False)
    with open(config, "a") as f:
        # optional: a path that is no directory at start is otherwise refused then.
        f.write(f'\n[[models]]\nname = "looped"\npath = "{loops[0]}"\npreload = true\noptional = true\n')
    lines, ids = hostile_corpus(loops)
    pool = RawPool(config, stderr=None, env=FAKE_ENV)
    try:
        failed = pool.read_until(b'"ev":"failed"')  # "looped" cannot be preloaded; the pool goes on
        assert failed["model"] == "looped" and "not a usable path" in failed["reason"]
        # On the socket, every line gets its one reply, on a connection that stays open.
        with socket.socket(socket.AF_UNIX) as client:
            client.settimeout(60)
            client.connect(str(sock))
            client.sendall(b"".join(line + b"\n" for line in lines) + b'{"op":"status"}\n')
            replies = []
            buf = b""
            while [r["ev"] for r in replies].count("status") < 2:  # VALID's, then the last line's
                chunk = client.recv(65536)
                assert chunk, f"the pool closed the connection after {len(replies)} replies"
                buf += chunk
                *done, buf = buf.split(b"\n")
                replies += [json.loads(line[10:]) for line in done]
            assert len(replies) == len(lines) + 1 and replies[-1]["ev"] == "status", replies
            too_long = [r for r in replies if "longer than 1048576 bytes" in r.get("msg", "")]
            assert [r.get("id") for r in too_long] == [None, "big"]
        # On stdin, every line with an id ends once, and the pool serves on.
        writer = threading.Thread(target=pool.proc.stdin.write, args=(b"".join(line + b"\n" for line in lines),))
        writer.start()
        pool.send({"model": "a", "id": "after", "prompt": "x", "max_tokens": 2})
        while pool.read_until(b'"id":"after"').get("done") is not True:
            pass
        writer.join(60)
        assert pool.close() == 0
    finally:
        pool.kill()
    events = [json.loads(line[10:]) for line in pool.out.splitlines()]
    ends = [e["id"] for e in events if "id" in e and (e["ev"] == "error" or e.get("done") is True)]
    assert sorted(map(str, ends)) == sorted(map(str, ids + ["after"]))
    assert {e["code"] for e in events if str(e.get("id")).startswith("hl")} == {"bad_request"}


def test_the_corpus_over_http(tmp_path, loops, spawn_pool):
    """The same lines as request bodies, and the headers a web page or a
    slow client sends: every one is answered in OpenAI's shape with a 4xx
    (or served), none with a 500, and the pool serves on."""
    fakes = FakeModels(tmp_path)
    fakes.add("a")
    pool = spawn_pool("--config", fakes.config('http = "127.0.0.1:0"\nhttp_request_timeout = "2s"'), env=FAKE_ENV)
    found = wait_for(lambda: re.search(rb"http on http://127\.0\.0\.1:(\d+)/v1", pool.stderr), 60, message="the http log line")
    port = int(found.group(1))
    lines, _ = hostile_corpus(loops)
    json_type = {"content-type": "application/json"}
    asks = [("POST", path, line, json_type) for line in lines for path in ("/v1/completions", "/v1/chat/completions")]
    asks += [
        ("POST", "/v1/completions", b'{"model":"a","prompt":"x"}', {"content-type": "text/plain", "origin": "https://evil.example"}),
        ("POST", "/v1/completions", b'{"model":"a","prompt":"x"}', {}),
        ("GET", "/v1/models", b"", {"host": "rebound.evil.example"}),
        ("GET", "/v1/models", b"", {"origin": "null"}),
        ("POST", "/v1/chat/completions", b'{"model":"a","messages":[{"role":"user","content":"x"}],"functions":"f"}', json_type),
    ]
    statuses = []
    for method, path, body, headers in asks:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            conn.request(method, path, body=body or None, headers=headers)
            response = conn.getresponse()
            answer = json.loads(response.read())
        finally:
            conn.close()
        statuses.append(response.status)
        assert response.status in (200, 400, 403, 404, 413), (path, body[:80], response.status, answer)
        assert ("choices" in answer) if response.status == 200 else set(answer["error"]) == {"message", "type", "param", "code"}
    assert statuses[-5:] == [403, 403, 403, 403, 400]
    assert pool.close() == 0
