"""ipc.worker_events: every worker line read once, into a typed event."""

from __future__ import annotations

import pytest

from ipc.events import encode_cancelled_done, encode_done, encode_error, encode_event, encode_token
from ipc.worker_events import (
    TOKEN,
    AdapterError,
    AdapterFigures,
    AdapterLoaded,
    AdapterUnloaded,
    Done,
    Error,
    Heartbeat,
    Malformed,
    Other,
    Ready,
    WorkerStats,
    event_name,
    holds,
    is_token,
    line_id,
    read_line,
    token_block,
)


def test_line_classification():
    assert event_name(encode_token('"done":true')) == "gen_token"
    assert read_line(encode_token('","done":true,"x":"')) is TOKEN
    assert isinstance(read_line(encode_done(tok_s=0, ttft_ms=0, prompt_tokens=0, gen_tokens=0, total_ms=0)), Done)
    assert event_name(encode_event("heartbeat")) == "heartbeat"
    assert event_name(b"garbage\n") == ""


def test_each_kind_becomes_its_struct():
    done = read_line(encode_done(tok_s=12.5, ttft_ms=3.25, prompt_tokens=9, gen_tokens=64, total_ms=5120, finish_reason="stop", id_json='"r1"'))
    assert isinstance(done, Done) and (done.gen_tokens, done.tok_s, done.finish_reason) == (64, 12.5, "stop")
    assert read_line(encode_error("no prompt", "bad_request", "7")) == Error(msg="no prompt", code="bad_request")
    assert read_line(encode_event("heartbeat", busy=True)) == Heartbeat(busy=True)
    ready = read_line(encode_event("ready", model="m", format="q4", lora=None, load_ms=812, weights_bytes=3))
    assert ready == Ready(model="m", format="q4", load_ms=812)
    stats = read_line(encode_event("worker_stats", model="m", format="bf16", weights_bytes=10, rss_bytes=40, active_rows=3, max_batch=8))
    assert isinstance(stats, WorkerStats) and (stats.rss_bytes, stats.active_rows, stats.max_batch, stats.waiting_rows) == (40, 3, 8, 0)
    assert read_line(encode_event("adapter_loaded", model="m", lora="/a", sha256="ab")) == AdapterLoaded(lora="/a", sha256="ab")
    assert read_line(encode_event("adapter_error", model="m", lora="/a", code="adapter_error", msg="bad")) == AdapterError(lora="/a", msg="bad")
    assert read_line(encode_event("adapter_unloaded", model="m", lora="/a", resident=True)) == AdapterUnloaded(lora="/a", resident=True)
    listed = {"lora": "/a", "sha256": "ab", "config_sha256": None, "bytes": 7, "rows": 1}
    stats = read_line(encode_event("worker_stats", model="m", adapter_bytes=9, adapters=[listed], max_adapters=2))
    assert stats.adapters == [AdapterFigures(lora="/a", sha256="ab", bytes=7, rows=1)] and (stats.adapter_bytes, stats.max_adapters) == (9, 2)
    assert read_line(encode_event("mystery", model="m")) == Other("mystery")


@pytest.mark.parametrize(
    "line, terminal",
    [
        (b"hello from a stray print\n", False),
        (b'@@lattice {"ev":"loading",broken}\n', False),
        (b'@@lattice {"ev":"gen_tok\n', False),
        (b'@@lattice {"ev":"mystery","x":"\xff"}\n', False),
        (b'@@lattice {"ev":"gen_token","token":"","done":true,"gen_tokens":"many"}\n', True),
        (b'@@lattice {"ev":"error","msg":3,"code":[]}\n', True),
        (b'@@lattice {"ev":"heartbeat","busy":"yes"}\n', False),
    ],
)
def test_what_cannot_be_read_is_malformed(line, terminal):
    event = read_line(line)
    assert isinstance(event, Malformed) and event.terminal is terminal


def test_the_id_is_read_from_the_tail():
    tricky = 'a","id":"forged'  # the text escapes its quotes, so it cannot end the line
    assert line_id(encode_token(tricky, '"r,\\"id\\":1"')) == b'"r,\\"id\\":1"'
    assert line_id(encode_token(tricky)) is None
    assert line_id(encode_token("x", "42")) == b"42"
    assert line_id(encode_cancelled_done("-1.5")) == b"-1.5"
    assert line_id(encode_error("no", "bad_request", '"é"')) == '"é"'.encode()
    assert line_id(encode_done(tok_s=0, ttft_ms=0, prompt_tokens=0, gen_tokens=0, total_ms=0)) is None
    block = encode_token("a", "1") + encode_token("b", "1")
    assert is_token(block) and not is_token(block + encode_cancelled_done("1"))


def test_a_block_of_token_lines_is_counted():
    block = encode_token("a", "1") + encode_token("b\n", '"x"') + encode_token("c")
    assert token_block(block) == 3
    assert token_block(block + encode_cancelled_done("1")) == 0
    assert token_block(block + encode_event("heartbeat", busy=True)) == 0
    assert token_block(encode_event("heartbeat", busy=True) + block) == 0


def test_a_block_says_whose_lines_it_holds():
    block = encode_token("a", "11") + encode_token("b", '"1"')
    assert holds(block, b"11", 2) and holds(block, b'"1"', 2)
    assert not holds(block, b"1", 2) and not holds(block, b'"11"', 2) and not holds(block, None, 2)
    assert holds(block + encode_token("c"), None, 3)
