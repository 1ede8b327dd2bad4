import json
from pathlib import Path

import pytest

from ipc.events import RawJSON, encode_done, encode_error, encode_event, encode_token, tokens_per_second

GOLDEN = [json.loads(line) for line in (Path(__file__).parent / "data" / "chat_metal_events.jsonl").read_text("utf-8").split("\n") if line.strip()]


def test_golden_file_is_complete():
    assert len(GOLDEN) == 42
    assert {g["kind"] for g in GOLDEN} == {"gen_token", "done", "ready", "error_missing_prompt", "error_malformed"}


@pytest.mark.parametrize("case", [g for g in GOLDEN if g["kind"] == "gen_token"], ids=lambda g: repr(g["token"]))
def test_token_lines_are_byte_identical(case):
    assert encode_token(case["token"]) == case["line"].encode("utf-8") + b"\n"


@pytest.mark.parametrize("case", [g for g in GOLDEN if g["kind"] == "done"], ids=lambda g: g["line"][-40:])
def test_done_lines_are_byte_identical(case):
    line = encode_done(
        tok_s=case["tok_s"],
        ttft_ms=case["ttft_ms"],
        prompt_tokens=case["prompt_tokens"],
        gen_tokens=case["gen_tokens"],
        total_ms=case["total_ms"],
    )
    assert line == case["line"].encode("utf-8") + b"\n"


def test_ready_and_error_lines_are_byte_identical():
    by_kind = {g["kind"]: g["line"].encode() + b"\n" for g in GOLDEN}
    assert encode_event("ready") == by_kind["ready"]
    assert encode_error('missing "prompt" field') == by_kind["error_missing_prompt"]
    assert encode_error("malformed request: expected value at line 1 column 1") == by_kind["error_malformed"]


def test_additive_fields_follow_chat_metal_fields_in_order():
    line = encode_done(tok_s=1.0, ttft_ms=2.0, prompt_tokens=3, gen_tokens=4, total_ms=5, finish_reason="stop", cached_tokens=7, id_json='"r1"')
    assert line.endswith(b'"total_ms":5,"finish_reason":"stop","cached_tokens":7,"id":"r1"}\n')
    assert encode_token("x", "17") == b'@@lattice {"ev":"gen_token","token":"x","done":false,"id":17}\n'
    assert encode_error("nope", "bad_request", '"a"') == b'@@lattice {"ev":"error","msg":"nope","code":"bad_request","id":"a"}\n'


def test_every_line_is_json_with_ev_first():
    for line in (encode_token("a\x07b"), encode_event("ready", model="m", lora=None, load_ms=3, ok=True, xs=[1, "2"], d={"k": 1.5}, raw=RawJSON("[1]"))):
        assert line.startswith(b'@@lattice {"ev":') and line.endswith(b"}\n") and line.count(b"\n") == 1
        json.loads(line[10:])


def test_tok_s_definition():
    assert tokens_per_second(64, 5187) == pytest.approx(12.338538)
    assert tokens_per_second(5, 0) == 0.0
