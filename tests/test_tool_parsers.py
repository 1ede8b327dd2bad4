"""Tool calls per model family: a call rendered by the family's own chat
template (its assistant turn, kept under tests/data/tool_templates) parses
back to the same call; the format is detected from the template; a forced
call's grammar, walked at random by llguidance over the demo tokenizer,
always gives text that parses; malformed calls are text."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from harness.engine import allowed_ids
from harness.procs import ROOT
from ipc.messages import GrammarFormat
from supervisor.httpapi import tool_parsers
from supervisor.httpapi.tool_parsers import Call, detect, grammar, parse
from worker.text.tokenizer import _compile_template

TEMPLATES = ROOT / "tests" / "data" / "tool_templates"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}, "days": {"type": "integer", "minimum": 1, "maximum": 9}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "days"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 4}}, "required": ["zone"]}},
}
TOOLS = [WEATHER, TIME]

# (template file, format, what the template writes before and after the reply)
FAMILIES = [
    ("qwen3", "qwen3", "<|im_start|>assistant\n", "<|im_end|>\n"),
    ("qwen3_coder", "qwen3_coder", "<|im_start|>assistant\n", "<|im_end|>\n"),
    ("llama3_json", "llama3_json", "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    ("mistral", "mistral", "", "</s>"),
    ("mistral_v11", "mistral", "", "</s>"),
    ("gemma", "gemma", "<start_of_turn>model\n", "<end_of_turn>\n"),
    ("deepseek", "deepseek", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"),
    ("deepseek_v31", "deepseek", "<｜Assistant｜></think>", "<｜end▁of▁sentence｜>"),
]
ONE_CALL = {"llama3_json"}  # Llama 3.1's template renders one call per turn

CALLS = [
    ("get_weather", {"city": "Paris", "days": 3, "unit": "c"}),
    ("get_time", {"zone": "CET"}),
]


def rendered_reply(template: str, calls: list[tuple[str, dict]], head: str, tail: str) -> str:
    message = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}} for i, (name, args) in enumerate(calls)],
    }
    text = _compile_template(template).render(messages=[message], eos_token="</s>")
    assert text.startswith(head) and text.endswith(tail), text
    return text[len(head) : len(text) - len(tail)]


@pytest.mark.parametrize("family, fmt, head, tail", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_a_call_rendered_by_the_family_template_parses_back(family, fmt, head, tail):
    template = (TEMPLATES / f"{family}.jinja").read_text()
    assert detect(template) == fmt
    calls = CALLS[:1] if family in ONE_CALL else CALLS
    reply = rendered_reply(template, calls, head, tail)
    content, parsed = parse(fmt, reply, TOOLS)
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls, reply


def test_text_before_the_calls_is_content():
    reply = 'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    assert parse("qwen3", reply, TOOLS) == ("Let me look.", [Call("get_time", '{"zone": "UTC"}')])
    mistral = 'Sure. [TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]'
    assert parse("mistral", mistral, TOOLS) == ("Sure.", [Call("get_time", '{"zone": "UTC"}')])


def test_qwen3_coder_values_take_their_schema_types():
    reply = "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    _, [call] = parse("qwen3_coder", reply, TOOLS)
    assert json.loads(call.arguments) == {"city": "42", "days": 3}


@pytest.mark.parametrize(
    "fmt, reply",
    [
        ("qwen3", "plain text, no call"),
        ("qwen3", '<tool_call>\n{"name": "get_time", "arguments": {"zone": \n</tool_call>'),
        ("qwen3", '<tool_call>\n{"arguments": {}}\n</tool_call>'),
        ("qwen3", "<tool_call>\n[1, 2]\n</tool_call>"),
        ("qwen3_coder", "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC"),
        ("llama3_json", '{"name": "get_time", "parameters": {"zone": '),
        ("llama3_json", "Hello there."),
        ("mistral", '[TOOL_CALLS][{"name": 3}]'),
        ("mistral", '[TOOL_CALLS]get_time[ARGS]{"zone"'),
        ("gemma", "[get_time(zone='UTC'"),
        ("gemma", "[__import__('os').system('true')]"),
        ("gemma", "[1 + 2]"),
        ("deepseek", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{"zone"\n```<｜tool▁call▁end｜>'),
    ],
)
def test_malformed_calls_are_text(fmt, reply):
    assert parse(fmt, reply, TOOLS) is None


def test_every_format_detects_on_the_demo_template_as_qwen3():
    from worker.demo.build import CHAT_TEMPLATE

    assert detect(CHAT_TEMPLATE) == "qwen3" and detect(None) == "qwen3"
    assert set(tool_parsers.FORMATS) == {f[1] for f in FAMILIES}


# -- forced calls: every sentence of the grammar parses ----------------------------


@pytest.fixture(scope="module")
def walker(tiny_model):
    from worker.engine.constrain import BatchMasks, Constraints
    from worker.text.tokenizer import TextCodec

    config = json.loads((tiny_model / "config.json").read_text())
    codec = TextCodec(tiny_model, config)
    vocab = config["text_config"]["vocab_size"]
    return codec, Constraints.for_codec(codec, vocab), BatchMasks(vocab, codec.eos_ids)


def random_sentence(walker, lark: str, seed: int, limit: int = 600) -> str:
    """Tokens drawn uniformly from what the grammar allows, until it is done
    (or accepts, with some chance at each step)."""
    codec, constraints, masks = walker
    rng = random.Random(seed)
    row = constraints.row(GrammarFormat(lark), [])
    ids = []
    for _ in range(limit):
        if row.done or (row.accepting and rng.random() < 0.3):
            break
        allowed = sorted(allowed_ids(masks, masks.fill([row])[0]) - codec.eos_ids)
        token = rng.choice(allowed)
        row.advance(token)
        ids.append(token)
    assert row.accepting, codec.decode(ids)
    return codec.decode(ids)


@pytest.mark.parametrize("fmt", tool_parsers.FORMATS)
@pytest.mark.parametrize("parallel", [False, True])
def test_a_forced_call_always_parses(walker, fmt, parallel):
    np.random.seed(0)
    for seed in range(3):
        for tools in (TOOLS, [TIME]):
            text = random_sentence(walker, grammar(fmt, tools, parallel), seed)
            found = parse(fmt, text, tools)
            assert found is not None, (fmt, text)
            content, calls = found
            assert content == "" and calls and (parallel or len(calls) == 1)
            names = {t["function"]["name"]: t for t in tools}
            for call in calls:
                required = names[call.name]["function"]["parameters"]["required"]
                assert set(required) <= set(json.loads(call.arguments)), text


@pytest.mark.parametrize("fmt", tool_parsers.FORMATS)
def test_a_forced_reply_cut_inside_a_call_keeps_the_calls_before_it(walker, fmt):
    """max_tokens may end a forced reply of several calls anywhere: what is
    kept is always the first calls, whole; cut inside the last call's
    name, every call before it."""
    lark = grammar(fmt, TOOLS, True)
    for seed in range(40):
        text = random_sentence(walker, lark, seed)
        full = parse(fmt, text, TOOLS)[1]
        if len(full) >= 2:
            break
    else:
        pytest.fail("no sentence of two calls")
    for at in range(1, len(text), 7):
        found = tool_parsers.complete_calls(fmt, text[:at], TOOLS)
        kept = [] if found is None else found[1]
        assert found is None or found[0] == ""
        assert kept == full[: len(kept)], (text[:at], kept)
    inside_last = text.rfind(full[-1].name) + 1
    assert tool_parsers.complete_calls(fmt, text[:inside_last], TOOLS)[1] == full[:-1]


# -- the HTTP side: streaming hold-back, templates without tools ------------------


def reader_run(fmt: str, pieces: list[str], parallel: bool = True):
    from supervisor.httpapi.tools import ToolReader, ToolRequest

    reader = ToolReader(ToolRequest(TOOLS, "auto", parallel), fmt)
    out = "".join(reader.feed(p) for p in pieces)
    rest, calls = reader.finish()
    return out, rest, calls


@pytest.mark.parametrize("split", [1, 3, 1000])
def test_a_stream_sends_content_until_a_call_may_begin(split):
    reply = 'Checking.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    pieces = [reply[i : i + split] for i in range(0, len(reply), split)]
    out, rest, calls = reader_run("qwen3", pieces)
    assert out == "Checking.\n" and rest == "" and calls == [Call("get_time", '{"zone": "UTC"}')]
    # A marker's start that turns out to be text goes out after all.
    text = "a <tool b <tool_cal"
    out, rest, calls = reader_run("qwen3", [text[i : i + split] for i in range(0, len(text), split)])
    assert out + rest == text and calls == []
    # Held from the marker on, and given back as text when it does not parse.
    broken = "x <tool_call>{oops"
    out, rest, calls = reader_run("qwen3", [broken[i : i + split] for i in range(0, len(broken), split)])
    assert (out, rest, calls) == ("x ", "<tool_call>{oops", [])


def test_leading_markers_hold_only_at_the_start():
    out, rest, calls = reader_run("llama3_json", [" ", '{"name": "get_time", ', '"parameters": {"zone": "CET"}}'])
    assert out == "" and rest == "" and calls == [Call("get_time", '{"zone": "CET"}')]
    out, rest, calls = reader_run("llama3_json", ["Use ", '{"name": "get_time"}'])
    assert out + rest == 'Use {"name": "get_time"}' and calls == []
    two = '[get_time(zone="UTC"), get_time(zone="CET")]'
    assert reader_run("gemma", [two], parallel=False)[2] == [Call("get_time", '{"zone": "UTC"}')]


def test_a_template_without_tools_gets_them_as_qwen_writes_them():
    from supervisor.httpapi.shapes import chat_request
    from supervisor.httpapi.tools import TemplateInfo

    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Time?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
        ],
        "tools": TOOLS,
    }
    plain, _ = chat_request(body, "r1", lambda v: v, lambda name: TemplateInfo("qwen3", False))
    assert plain.tools is None
    roles = [m.role for m in plain.messages]
    assert roles == ["system", "user", "assistant", "user"]
    assert plain.messages[0].content.startswith("Be brief.\n\n# Tools") and '"name": "get_weather"' in plain.messages[0].content
    assert plain.messages[2].content == '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    assert plain.messages[3].content == "<tool_response>\n12:00\n</tool_response>"
    templated, opts = chat_request(body, "r2", lambda v: v, lambda name: TemplateInfo("qwen3", True))
    assert templated.tools == TOOLS and opts.tool_format == "qwen3"
    assert templated.messages[2].tool_calls == [{"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}]
    assert templated.messages[3].tool_call_id == "c1"


def test_the_tool_parser_config_key_names_every_format():
    import typing

    from supervisor.config import ModelEntry

    hint = typing.get_type_hints(ModelEntry)["tool_parser"]
    assert set(typing.get_args(typing.get_args(hint)[0])) == set(tool_parsers.FORMATS)


def test_the_responses_store_is_bounded_in_count_and_bytes():
    from supervisor.httpapi.responses import ResponseStore

    store = ResponseStore(max_responses=3, max_bytes=1000)
    for i in range(5):
        store.put(f"r{i}", [{"role": "user", "content": str(i)}])
    assert [store.get(f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
    store.put("big", [{"role": "user", "content": "x" * 600}])
    store.put("big2", [{"role": "user", "content": "y" * 600}])
    assert store.get("big") is None and store.get("big2") is not None
    store.put("huge", [{"role": "user", "content": "z" * 2000}])
    assert store.get("huge") is None
