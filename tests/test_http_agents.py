"""What agents and apps need from the HTTP surface, end to end with the
real clients against a real `lattice-pool serve --http`: any local model by
name, thinking that never hides the answer, tool calls."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta

import openai
import pytest

from harness.http import post, split_thinking, with_http
from tests.conftest import shared_http_pool

HI = [{"role": "user", "content": "Tell me about the river."}]


@pytest.fixture(scope="module")
def agents(tiny_model, second_model, tmp_path_factory):
    """One pool: `tiny` configured, `tiny2` (another demo model) only a
    directory in the model cache, an empty Hugging Face cache."""
    root = tmp_path_factory.mktemp("agents")
    cache = root / "models"
    cache.mkdir()
    (cache / "tiny2").symlink_to(second_model)
    (root / "hub").mkdir()
    config = root / "pool.toml"
    config.write_text(f'[[models]]\nname = "tiny"\npath = "{tiny_model}"\npreload = true\naliases = ["claude-sonnet-4-5", "gpt-4o"]\n')
    yield from shared_http_pool(config, "tiny", env={"LATTICE_MODEL_CACHE": str(cache), "HF_HUB_CACHE": str(root / "hub")})


def client(pool) -> openai.OpenAI:
    return openai.OpenAI(base_url=pool.url, api_key="unused", max_retries=0, timeout=120)


def get(pool, path: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(pool.url + path, timeout=60) as response:
        return json.loads(response.read())


# -- any local model ---------------------------------------------------------------


def test_a_local_unconfigured_model_is_served_over_http(agents, tiny_model):
    listed = {m["id"]: m for m in get(agents, "/models")["data"]}
    assert listed["tiny"]["source"] == "configured" and listed["tiny"]["loaded"]
    assert listed["tiny2"]["source"] == "cache" and listed["tiny2"]["state"] == "unloaded"
    with client(agents) as c:
        reply = c.chat.completions.create(model="tiny2", messages=HI, max_tokens=6, temperature=0)
        assert reply.model == "tiny2" and reply.usage.completion_tokens == 6
        assert c.models.retrieve("tiny2").state in ("ready", "busy")
        # The same text stdin gives for the same model.
        request_id = "stdin-tiny2"
        agents.send({"model": "tiny2", "messages": HI, "max_tokens": 6, "temperature": 0, "id": request_id})
        assert agents.terminal(request_id)["ev"] == "gen_token"
        text = agents.text(request_id)
        message = reply.choices[0].message
        reasoning, answer = split_thinking(text)
        assert (getattr(message, "reasoning_content", None) or "") + (message.content or "") == reasoning + answer
    listed = {m["id"]: m for m in get(agents, "/models")["data"]}
    assert listed["tiny2"]["loaded"]


def test_paths_and_unknown_names_are_404(agents, tiny_model):
    for name in (str(tiny_model), "../models/tiny2", "no-such-model", "org/not-in-the-cache"):
        status, body = post(agents, "/chat/completions", json.dumps({"model": name, "messages": HI}).encode())
        assert status == 404 and body["error"]["code"] == "unknown_model" and body["error"]["param"] == "model", (name, body)


def test_http_models_configured_restricts_to_configured_names(tiny_model, tmp_path, spawn_pool):
    cache = tmp_path / "models"
    cache.mkdir()
    (cache / "tiny2").symlink_to(tiny_model)
    config = tmp_path / "pool.toml"
    config.write_text(f'http_models = "configured"\n[[models]]\nname = "tiny"\npath = "{tiny_model}"\n')
    pool = with_http(spawn_pool("--config", str(config), "--http", "0", env={"LATTICE_MODEL_CACHE": str(cache)}))
    assert [m["id"] for m in get(pool, "/models")["data"]] == ["tiny"]
    status, body = post(pool, "/chat/completions", json.dumps({"model": "tiny2", "messages": HI}).encode())
    assert status == 404 and "not configured" in body["error"]["message"]
    assert pool.close() == 0


# -- thinking never hides the answer -----------------------------------------------


def test_a_reply_that_never_closes_think_is_content(agents):
    """The demo's template opens <think>; cut off before </think>, the
    reply is the answer (README's snippet prints text), not reasoning."""
    with client(agents) as c:
        for seed in range(4):
            reply = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=12, seed=seed)
            message = reply.choices[0].message
            assert message.content and getattr(message, "reasoning_content", None) is None, message
        # Closed by the budget: the split as before.
        split = c.chat.completions.create(model="tiny", messages=HI, max_tokens=12, temperature=0, extra_body={"reasoning_budget": 3})
        assert split.choices[0].message.reasoning_content is not None


def test_response_format_json_lands_in_content(agents):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}}, "required": ["n", "ok"], "additionalProperties": False}
    with client(agents) as c:
        for seed in range(3):
            reply = c.chat.completions.create(
                model="tiny",
                messages=HI,
                max_tokens=80,
                seed=seed,
                temperature=1.0,
                response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
            )
            assert set(json.loads(reply.choices[0].message.content)) == {"n", "ok"}
        # Thinking first when asked for.
        thought = c.chat.completions.create(
            model="tiny",
            messages=HI,
            max_tokens=60,
            temperature=0,
            extra_body={"reasoning_budget": 4},
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )
        assert thought.choices[0].message.reasoning_content and json.loads(thought.choices[0].message.content)
        # reasoning_effort is a reasoning_budget: "minimal" thinks not at all.
        minimal = c.chat.completions.create(model="tiny", messages=HI, max_tokens=6, temperature=0, reasoning_effort="minimal")
        assert minimal.choices[0].message.reasoning_content == "" and minimal.choices[0].message.content
    status, body = post(agents, "/chat/completions", json.dumps({"model": "tiny", "messages": HI, "reasoning_effort": "lots"}).encode())
    assert status == 400 and body["error"]["param"] == "reasoning_effort"


# -- tool calls ----------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}},
}
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def streamed(chunks) -> tuple[str, list[dict], str]:
    """(content, tool calls, finish_reason) of a chat stream, put together
    the way OpenAI's clients do."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            call["name"] += (delta.function.name or "") if delta.function else ""
            call["arguments"] += (delta.function.arguments or "") if delta.function else ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def check_call(name: str, arguments: str) -> None:
    tool = {t["function"]["name"]: t for t in TOOLS}[name]
    args = json.loads(arguments)
    assert set(tool["function"]["parameters"]["required"]) <= set(args) <= set(tool["function"]["parameters"]["properties"])


def test_tools_are_rendered_by_the_chat_template(agents):
    """The demo's template lists the tools in a system turn: the prompt
    grows, and stdin (same messages and tools) gives the same prompt."""
    with client(agents) as c:
        bare = c.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, temperature=0)
        auto = c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=4, temperature=0)
        chunks = list(
            c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=4, temperature=0, stream=True, stream_options={"include_usage": True})
        )
    assert auto.usage.prompt_tokens > bare.usage.prompt_tokens + 50
    assert auto.choices[0].finish_reason == "length" and not auto.choices[0].message.tool_calls
    assert chunks[-1].usage.prompt_tokens == auto.usage.prompt_tokens
    agents.send({"id": "stdin-tools", "model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 1, "temperature": 0})
    assert agents.terminal("stdin-tools")["prompt_tokens"] == auto.usage.prompt_tokens


def test_a_forced_call_parses_at_temperature_1(agents):
    with client(agents) as c:
        for seed in range(5):
            # One call each (parallel_tool_calls false), then up to 8 in one reply.
            parallel = seed == 4
            reply = c.chat.completions.create(
                model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel, max_tokens=600, temperature=1.0, seed=seed
            )
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls" and (len(choice.message.tool_calls) >= 1 if parallel else len(choice.message.tool_calls) == 1), choice
            for call in choice.message.tool_calls:
                assert call.type == "function" and call.id.startswith("call_")
                check_call(call.function.name, call.function.arguments)
        named = c.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            parallel_tool_calls=False,
            max_tokens=200,
            temperature=1.0,
            seed=9,
        )
        [call] = named.choices[0].message.tool_calls
        assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
        content, calls, finish = streamed(
            c.chat.completions.create(
                model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=600, temperature=1.0, seed=3, stream=True
            )
        )
        again = c.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=600, temperature=1.0, seed=3
        )
    assert finish == "tool_calls" and content == ""
    assert [(k["name"], k["arguments"]) for k in calls] == [(t.function.name, t.function.arguments) for t in again.choices[0].message.tool_calls]


def test_forced_parallel_calls_cut_by_max_tokens_keep_the_complete_ones(agents):
    """A forced reply of several calls (this seed writes three or more),
    cut by max_tokens inside its second: the first comes back whole, the
    cut one is dropped, and finish_reason says "length"; streamed too."""
    kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=True, temperature=1.0, seed=40, max_tokens=60)
    with client(agents) as c:
        whole = c.chat.completions.create(**kwargs)
        content, streamed_calls, finish = streamed(c.chat.completions.create(stream=True, **kwargs))
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None, choice
    calls = [(k.function.name, k.function.arguments) for k in choice.message.tool_calls]
    assert len(calls) == 1 and calls[0][0] == "get_weather"
    check_call(*calls[0])
    assert finish == "length" and content == "" and [(k["name"], k["arguments"]) for k in streamed_calls] == calls


def test_tool_results_fed_back(agents):
    """An assistant turn with tool_calls and the tool's result, rendered by
    the template as stdin renders them; the reply goes on."""
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
    ]
    with client(agents) as c:
        reply = c.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=4, temperature=0)
    assert reply.choices[0].message.content is not None
    stdin_history = [{**m, "content": m["content"] or ""} for m in history]
    stdin_history[1]["tool_calls"] = [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}}]
    agents.send({"id": "stdin-history", "model": "tiny", "messages": stdin_history, "tools": TOOLS, "max_tokens": 1, "temperature": 0})
    assert agents.terminal("stdin-history")["prompt_tokens"] == reply.usage.prompt_tokens


def test_auto_reads_a_well_formed_call_and_returns_a_malformed_one_as_text(agents):
    """With tool_choice auto the model chooses; a response_format makes the
    tiny model write a call (or a broken one) on purpose."""
    good = '<tool_call>\\n\\{"name": "get_time", "arguments": \\{"zone": "UTC"\\}\\}\\n</tool_call>'
    broken = '<tool_call>\\n\\{"name": "get_time", "arguments": \\{"zone"\\n</tool_call>'
    with client(agents) as c:
        for stream in (False, True):
            kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=60, temperature=0)
            called = c.chat.completions.create(**kwargs, response_format={"type": "regex", "pattern": "Let me see\\. " + good}, stream=stream)
            text = c.chat.completions.create(**kwargs, response_format={"type": "regex", "pattern": broken}, stream=stream)
            if stream:
                content, calls, finish = streamed(called)
                assert (content.strip(), finish) == ("Let me see.", "tool_calls")
                assert [(k["name"], json.loads(k["arguments"])) for k in calls] == [("get_time", {"zone": "UTC"})]
                content, calls, finish = streamed(text)
                assert calls == [] and finish == "stop" and content.startswith("<tool_call>")
            else:
                message = called.choices[0].message
                assert called.choices[0].finish_reason == "tool_calls" and message.content == "Let me see."
                assert [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls] == [("get_time", {"zone": "UTC"})]
                assert text.choices[0].finish_reason == "stop" and text.choices[0].message.content.startswith("<tool_call>")
                assert not text.choices[0].message.tool_calls


def test_legacy_functions_map_to_tools(agents):
    body = {
        "model": "tiny",
        "messages": ASK,
        "functions": [CLOCK["function"]],
        "function_call": {"name": "get_time"},
        "max_tokens": 200,
        "temperature": 1.0,
        "seed": 1,
    }
    status, reply = post(agents, "/chat/completions", json.dumps(body).encode())
    assert status == 200 and reply["choices"][0]["finish_reason"] == "tool_calls", reply
    assert reply["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_time"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools"),
        ({"tools": [CLOCK, CLOCK]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_bad_tool_fields_are_400(agents, extra, param):
    status, body = post(agents, "/chat/completions", json.dumps({"model": "tiny", "messages": ASK, **extra}).encode())
    assert status == 400 and body["error"]["param"] == param, body


# -- the rest of the chat surface -------------------------------------------------------


def test_n_choices_are_rows_of_their_own(agents):
    """n > 1: one row per choice; seeded, choice i is what seed + i gives
    alone; streamed, the choices' deltas put together give the same."""
    kwargs = dict(model="tiny", messages=HI, max_tokens=8, temperature=1.0, extra_body={"reasoning_budget": 2})
    with client(agents) as c:
        many = c.chat.completions.create(n=3, seed=11, **kwargs)
        alone = [c.chat.completions.create(seed=11 + i, **kwargs) for i in range(3)]
        chunks = list(c.chat.completions.create(n=3, seed=11, stream=True, stream_options={"include_usage": True}, **kwargs))
        completions = c.completions.create(model="tiny", prompt="<|im_start|>user\nHi<|im_end|>\n", n=2, max_tokens=4, temperature=0)
    assert [ch.index for ch in many.choices] == [0, 1, 2]
    assert [ch.message.content for ch in many.choices] == [a.choices[0].message.content for a in alone]
    assert many.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert many.usage.prompt_tokens == alone[0].usage.prompt_tokens
    texts = {i: "" for i in range(3)}
    finishes = {}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert [texts[i] for i in range(3)] == [a.choices[0].message.content for a in alone]
    assert set(finishes) == {0, 1, 2}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == many.usage.completion_tokens
    assert [ch.index for ch in completions.choices] == [0, 1] and completions.choices[0].text == completions.choices[1].text
    status, body = post(agents, "/chat/completions", json.dumps({"model": "tiny", "messages": HI, "n": 9}).encode())
    assert status == 400 and body["error"]["param"] == "n"


# -- log-probabilities ------------------------------------------------------------------

# How far a logprob from the pool's worker (batched, compiled step, float32)
# may be from this process's mlx-lm forward of the same tokens: measured
# within 3e-6 on a 2-core CPU, so the room is for other CPUs' BLAS kernels.
LOGPROB_TOLERANCE = 1e-3


def reference_logprobs(model_dir, messages, entries, top: int) -> None:
    """Feeds the reply's tokens to mlx-lm in this process and checks each
    entry against the log-softmax of its logits: the chosen token's value,
    and the `top` likeliest values (in order; ties may order ids apart)."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    from ipc.messages import Message
    from worker.runtime.cpu_backend import use_float32
    from worker.text.tokenizer import TextCodec

    model, _ = mlx_lm.load(str(model_dir))
    use_float32(model)  # as the worker computes on a CPU
    codec = TextCodec(model_dir, json.loads((model_dir / "config.json").read_text()))
    prompt = codec.encode(codec.render([Message(**m) for m in messages]))
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[0, -1]
    for entry in entries:
        logits = logits.astype(mx.float32)
        lsm = logits - mx.logsumexp(logits)
        order = mx.argsort(-lsm)[: max(top, 8)].tolist()
        values = lsm.tolist()
        # The reply's token among the likeliest here, by its bytes.
        token = next(t for t in order if list(codec.token_bytes(t)) == entry.bytes)
        assert abs(values[token] - entry.logprob) < LOGPROB_TOLERANCE, (entry, values[token])
        assert [round(t.logprob, 6) for t in entry.top_logprobs] == sorted((round(t.logprob, 6) for t in entry.top_logprobs), reverse=True)
        for mine, theirs in zip(entry.top_logprobs, order[:top]):
            assert abs(mine.logprob - values[theirs]) < LOGPROB_TOLERANCE, (mine, values[theirs])
        logits = model(mx.array([[token]]), cache=cache)[0, -1]


def test_logprobs_are_the_models_log_softmax(agents, tiny_model):
    """Greedy, no penalty: each token's logprob and the top 5 equal the
    log-softmax of mlx-lm's logits in this process; the chosen token leads
    its alternatives; streamed and whole agree; /v1/completions' legacy
    shape carries the same figures."""
    kwargs = dict(model="tiny", messages=HI, max_tokens=8, temperature=0, logprobs=True, top_logprobs=5, extra_body={"repetition_penalty": 1.0})
    with client(agents) as c:
        whole = c.chat.completions.create(**kwargs)
        chunks = list(c.chat.completions.create(stream=True, **kwargs))
        legacy = c.completions.create(model="tiny", prompt="<|im_start|>user\nHi<|im_end|>\n", max_tokens=4, temperature=0, logprobs=2)
        for bad_fields, param in (
            ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
            ({"top_logprobs": 2}, "top_logprobs"),
            ({"logprobs": 3}, "logprobs"),
        ):
            with pytest.raises(openai.BadRequestError) as caught:
                c.chat.completions.create(model="tiny", messages=HI, max_tokens=2, extra_body=bad_fields)
            assert caught.value.status_code == 400 and caught.value.body["param"] == param, caught.value.body
    entries = whole.choices[0].logprobs.content
    assert len(entries) == whole.usage.completion_tokens == 8
    message = whole.choices[0].message
    assert "".join(e.token for e in entries) == (getattr(message, "reasoning_content", None) or "") + (message.content or "")
    for e in entries:
        assert len(e.top_logprobs) == 5 and e.bytes == list(e.token.encode())
        assert e.token in [t.token for t in e.top_logprobs] and e.logprob >= e.top_logprobs[0].logprob - 1e-6
    streamed = [e for chunk in chunks if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert all(abs(a.logprob - b.logprob) < LOGPROB_TOLERANCE for a, b in zip(streamed, entries))
    reference_logprobs(tiny_model, HI, entries, 5)
    # stdin: the same fields; the entries ride on the token lines.
    agents.send(
        {"id": "stdin-lp", "model": "tiny", "messages": HI, "max_tokens": 3, "temperature": 0, "repetition_penalty": 1.0, "logprobs": True, "top_logprobs": 5}
    )
    assert agents.terminal("stdin-lp")["gen_tokens"] == 3
    lines = [e for e in agents.of("stdin-lp") if not e.get("done")]
    assert [x["token"] for e in lines for x in e["logprobs"]] == [e.token for e in entries[:3]]
    assert all(re.fullmatch(rb'@@lattice \{"ev":"gen_token","token":".*","logprobs":\[.*\],"done":false,"id":"stdin-lp"\}\n', e["_line"]) for e in lines)
    agents.send({"id": "stdin-lp-bad", "model": "tiny", "messages": HI, "top_logprobs": 2})
    assert agents.terminal("stdin-lp-bad")["code"] == "bad_request"
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4 and all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)] and "".join(lp.tokens) == legacy.choices[0].text


# -- Anthropic Messages ---------------------------------------------------------------


def anthropic_client(pool, **kwargs):
    import anthropic

    return anthropic.Anthropic(base_url=pool.url.removesuffix("/v1"), api_key=kwargs.pop("api_key", "unused"), max_retries=0, timeout=120, **kwargs)


def test_anthropic_messages_whole_and_streamed(agents):
    with anthropic_client(agents) as c:
        whole = c.messages.create(
            model="tiny", max_tokens=12, system="Be brief.", messages=ASK, extra_body={"temperature": 0}, thinking={"type": "enabled", "budget_tokens": 3}
        )
        with c.messages.stream(
            model="tiny", max_tokens=12, system="Be brief.", messages=ASK, extra_body={"temperature": 0}, thinking={"type": "enabled", "budget_tokens": 3}
        ) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_message()
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert [b.type for b in whole.content] == ["thinking", "text"] and whole.stop_reason == "max_tokens"
    assert whole.usage.output_tokens == 12 and whole.usage.input_tokens > 0
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert (final.content[0].thinking, final.content[1].text) == (whole.content[0].thinking, whole.content[1].text)
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_start" in kinds


def test_anthropic_tool_use_round_trip(agents):
    tools = [{"name": "get_time", "description": "The time", "input_schema": CLOCK["function"]["parameters"]}]
    with anthropic_client(agents) as c:
        first = c.messages.create(
            model="tiny",
            max_tokens=200,
            messages=ASK,
            tools=tools,
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            extra_body={"temperature": 1.0},
        )
        [use] = [b for b in first.content if b.type == "tool_use"]
        assert first.stop_reason == "tool_use" and use.name == "get_time" and use.input["zone"] in ("UTC", "CET") and use.id.startswith("toolu_")
        with c.messages.stream(
            model="tiny", max_tokens=200, messages=ASK, tools=tools, tool_choice={"type": "tool", "name": "get_time"}, extra_body={"temperature": 1.0}
        ) as stream:
            streamed_use = [b for b in stream.get_final_message().content if b.type == "tool_use"]
        assert streamed_use and streamed_use[0].name == "get_time" and streamed_use[0].input["zone"] in ("UTC", "CET")
        history = ASK + [
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "12:00"}]},
        ]
        after = c.messages.create(model="tiny", max_tokens=4, messages=history, tools=tools, extra_body={"temperature": 0})
    assert after.stop_reason == "max_tokens" and after.usage.input_tokens > first.usage.input_tokens


def test_an_alias_is_served_by_its_models_worker_under_the_name_asked_for(agents):
    with anthropic_client(agents) as c:
        by_alias = c.messages.create(model="claude-sonnet-4-5", max_tokens=6, messages=ASK, extra_body={"temperature": 0})
        by_name = c.messages.create(model="tiny", max_tokens=6, messages=ASK, extra_body={"temperature": 0})
    chat = client(agents).chat.completions.create(model="gpt-4o", messages=ASK, max_tokens=6, temperature=0)
    assert by_alias.model == "claude-sonnet-4-5" and chat.model == "gpt-4o"
    assert [b.text for b in by_alias.content if b.type == "text"] == [b.text for b in by_name.content if b.type == "text"]
    listed = [m["id"] for m in get(agents, "/models")["data"]]
    assert "tiny" in listed and "claude-sonnet-4-5" not in listed
    agents.send({"op": "status"})
    rows = [row["model"] for row in agents.wait_ev("status")["models"]]
    assert rows.count("tiny") == 1 and not {"claude-sonnet-4-5", "gpt-4o"} & set(rows)


def test_anthropic_count_tokens_is_the_prompt_a_message_would_run(agents):
    import anthropic

    tools = [{"name": "get_time", "description": "The time", "input_schema": CLOCK["function"]["parameters"]}]
    with anthropic_client(agents) as c:
        for extra in ({}, {"system": "Be brief."}, {"system": "Be brief.", "tools": tools}):
            counted = c.messages.count_tokens(model="tiny", messages=ASK, **extra)
            ran = c.messages.create(model="tiny", max_tokens=1, messages=ASK, **extra)
            assert counted.input_tokens == ran.usage.input_tokens > 0, extra
        plain = c.messages.count_tokens(model="tiny", messages=ASK).input_tokens
        assert c.messages.count_tokens(model="tiny", messages=ASK, tools=tools).input_tokens > plain
        with pytest.raises(anthropic.NotFoundError) as exc:
            c.messages.count_tokens(model="no-such-model", messages=ASK)
        assert exc.value.body["error"]["type"] == "not_found_error"
        with pytest.raises(anthropic.BadRequestError) as exc:
            c.messages.count_tokens(model="tiny", messages=[])
        assert exc.value.body["type"] == "error" and exc.value.body["error"]["type"] == "invalid_request_error"


def test_anthropic_errors_in_its_shape(agents):
    import anthropic

    with anthropic_client(agents) as c:
        with pytest.raises(anthropic.NotFoundError) as exc:
            c.messages.create(model="no-such-model", max_tokens=4, messages=ASK)
        assert exc.value.body["type"] == "error" and exc.value.body["error"]["type"] == "not_found_error"
        with pytest.raises(anthropic.BadRequestError) as exc:
            c.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}])
        assert exc.value.body["error"]["type"] == "invalid_request_error"


def test_x_api_key_is_accepted_like_the_bearer_key(tiny_model, tmp_path, spawn_pool):
    import anthropic

    config = tmp_path / "pool.toml"
    config.write_text(f'api_key = "s3cret"\n[[models]]\nname = "tiny"\npath = "{tiny_model}"\n')
    pool = with_http(spawn_pool("--config", str(config), "--http", "0"))
    with anthropic_client(pool, api_key="wrong") as c:
        with pytest.raises(anthropic.AuthenticationError) as exc:
            c.messages.create(model="tiny", max_tokens=4, messages=ASK)
        assert exc.value.body["error"]["type"] == "authentication_error"
    with anthropic_client(pool, api_key="s3cret") as c:
        with pytest.raises(anthropic.NotFoundError):  # past the key: the model is unknown
            c.messages.create(model="nope", max_tokens=4, messages=ASK)
    assert pool.close() == 0


# -- OpenAI Responses -----------------------------------------------------------------


def test_responses_text_streaming_and_previous_response(agents):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"], "additionalProperties": False}
    kwargs = dict(
        model="tiny",
        input="Tell me about the river.",
        instructions="Be brief.",
        max_output_tokens=60,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "n", "schema": schema}},
        extra_body={"reasoning_budget": 3},
    )
    with client(agents) as c:
        whole = c.responses.create(**kwargs)
        with c.responses.stream(**kwargs) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_response()
        follow = c.responses.create(model="tiny", previous_response_id=whole.id, input="And the sea?", max_output_tokens=4, temperature=0)
        unkept = c.responses.create(model="tiny", input="Hi", max_output_tokens=2, temperature=0, store=False)
        with pytest.raises(openai.NotFoundError):
            c.responses.create(model="tiny", previous_response_id=unkept.id, input="Hi", max_output_tokens=2)
    assert whole.id.startswith("resp_") and whole.status == "completed" and set(json.loads(whole.output_text)) == {"n"}
    assert [item.type for item in whole.output] == ["reasoning", "message"] and whole.usage.output_tokens > 0
    assert final.output_text == whole.output_text and [item.type for item in final.output] == ["reasoning", "message"]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed" and "response.output_text.delta" in kinds
    assert [e for e in kinds if e.startswith("response.output_item")] == ["response.output_item.added", "response.output_item.done"] * 2
    assert follow.status == "incomplete" and follow.incomplete_details.reason == "max_output_tokens" and follow.usage.output_tokens == 4
    # The follow-up's prompt is the first exchange (without its instructions) and the new input.
    conversation = [
        {"role": "user", "content": "Tell me about the river."},
        {"role": "assistant", "content": whole.output_text},
        {"role": "user", "content": "And the sea?"},
    ]
    agents.send({"id": "stdin-follow", "model": "tiny", "messages": conversation, "max_tokens": 1})
    assert agents.terminal("stdin-follow")["prompt_tokens"] == follow.usage.input_tokens


def test_responses_input_tokens_is_the_prompt_a_response_would_run(agents):
    import openai as openai_module

    tools = [{"type": "function", "name": "get_time", "description": "The time", "parameters": CLOCK["function"]["parameters"]}]
    with client(agents) as c:
        for extra in ({}, {"instructions": "Be brief."}, {"instructions": "Be brief.", "tools": tools}):
            counted = c.responses.input_tokens.count(model="tiny", input="What is the river?", **extra)
            ran = c.responses.create(model="tiny", input="What is the river?", max_output_tokens=2, store=False, **extra)
            assert counted.object == "response.input_tokens" and counted.input_tokens == ran.usage.input_tokens > 0, extra
        with pytest.raises(openai_module.NotFoundError):
            c.responses.input_tokens.count(model="no-such-model", input="Hi")


def test_responses_leave_out_hosted_tools_an_agent_sends_with_its_functions(agents):
    functions = [{"type": "function", "name": "get_time", "description": "The time", "parameters": CLOCK["function"]["parameters"]}]
    hosted = [{"type": "web_search"}, {"type": "image_generation"}, {"type": "custom", "name": "apply_patch", "format": {"type": "text"}}]
    with client(agents) as c:
        mixed = c.responses.create(model="tiny", input=ASK, tools=functions + hosted, tool_choice="required", max_output_tokens=200, temperature=0, store=False)
        plain = c.responses.create(model="tiny", input=ASK, tools=functions, tool_choice="required", max_output_tokens=200, temperature=0, store=False)
        assert mixed.usage.input_tokens == plain.usage.input_tokens
        assert [(i.type, getattr(i, "name", None)) for i in mixed.output] == [(i.type, getattr(i, "name", None)) for i in plain.output]
        assert any(i.type == "function_call" and i.name == "get_time" for i in mixed.output)
        # Codex opens its input with an item of its own tool namespaces.
        codex_input = [
            {"type": "additional_tools", "role": "developer", "id": "at_1", "tools": [{"type": "namespace", "name": "collaboration", "tools": []}]},
            *ASK,
        ]
        codex = c.responses.create(
            model="tiny", input=codex_input, tools=functions + hosted, tool_choice="required", max_output_tokens=200, temperature=0, store=False
        )
        assert codex.usage.input_tokens == plain.usage.input_tokens


def test_responses_function_calls_round_trip(agents):
    tools = [{"type": "function", "name": "get_time", "description": "The time", "parameters": CLOCK["function"]["parameters"]}]
    with client(agents) as c:
        first = c.responses.create(
            model="tiny", input=ASK, tools=tools, tool_choice="required", parallel_tool_calls=False, max_output_tokens=200, temperature=1.0
        )
        [call] = [item for item in first.output if item.type == "function_call"]
        assert call.name == "get_time" and json.loads(call.arguments)["zone"] in ("UTC", "CET") and first.status == "completed"
        with c.responses.stream(
            model="tiny", input=ASK, tools=tools, tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=200, temperature=1.0
        ) as stream:
            kinds = [event.type for event in stream]
            streamed = [item for item in stream.get_final_response().output if item.type == "function_call"]
        assert streamed and streamed[0].name == "get_time" and "response.function_call_arguments.done" in kinds
        after = c.responses.create(
            model="tiny",
            previous_response_id=first.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}],
            tools=tools,
            max_output_tokens=4,
            temperature=0,
        )
    assert after.usage.input_tokens > first.usage.input_tokens and after.output_text is not None


# -- Ollama's API -----------------------------------------------------------------------


def ollama_client(pool):
    import ollama

    return ollama.Client(host=pool.url.removesuffix("/v1"), timeout=120)


def test_ollama_chat_generate_and_listing(agents, tiny_model):
    with ollama_client(agents) as c:
        ollama_calls(agents, c, tiny_model)


def ollama_calls(agents, c, tiny_model) -> None:
    import ollama

    options = {"temperature": 0, "num_predict": 10}
    whole = c.chat(model="tiny", messages=ASK, options=options, think=True)
    parts = list(c.chat(model="tiny", messages=ASK, options=options, think=True, stream=True))
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 10 and whole.prompt_eval_count > 0
    # Rates a client shows (tokens over durations) have durations to divide
    # by, and the parts make up the whole.
    for done in (whole, parts[-1]):
        assert done.prompt_eval_duration > 0 and done.eval_duration > 0 and done.load_duration >= 0
        assert done.load_duration + done.prompt_eval_duration + done.eval_duration == done.total_duration
    # (Cut short inside its thinking: the whole reply is content, the stream's was thinking.)
    assert "".join((p.message.thinking or "") + p.message.content for p in parts) == (whole.message.thinking or "") + whole.message.content
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    scored = c.chat(model="tiny", messages=ASK, options=options, logprobs=True, top_logprobs=2)
    streamed_scores = [e for p in c.chat(model="tiny", messages=ASK, options=options, logprobs=True, top_logprobs=2, stream=True) for e in p.logprobs or ()]
    assert len(scored.logprobs) == 10 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in scored.logprobs)
    assert [e.token for e in streamed_scores] == [e.token for e in scored.logprobs]
    generated = c.generate(model="tiny", prompt="Tell me about the river.", options=options, think=False)
    assert generated.done and generated.eval_count == 10 and generated.response
    raw = "".join(p.response for p in c.generate(model="tiny", prompt="<|im_start|>user\nHi<|im_end|>\n", raw=True, options=options, stream=True))
    assert raw
    forced = c.chat(
        model="tiny",
        messages=ASK,
        tools=[CLOCK],
        format={"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]},
        options={"num_predict": 40, "temperature": 0},
    )
    assert set(json.loads(forced.message.content)) == {"a"}
    listed = {m.model: m for m in c.list().models}
    assert list(listed)[:1] == ["tiny"] and "tiny2" in listed
    # Sizes as Ollama gives them: the weight files on disk, the memory the
    # running worker holds (on the GPU when it computes there).
    assert listed["tiny"].size == sum(f.stat().st_size for f in tiny_model.glob("*.safetensors")) > 0
    [running] = [m for m in c.ps().models if m.model == "tiny"]
    assert running.size >= listed["tiny"].size and running.size_vram in (0, running.size)
    assert "tools" in c.show("tiny").capabilities
    with pytest.raises(ollama.ResponseError) as exc:
        c.chat(model="no-such-model", messages=ASK)
    assert exc.value.status_code == 404
    version = json.loads(__import__("urllib.request").request.urlopen(agents.url.removesuffix("/v1") + "/api/version", timeout=30).read())
    assert version["version"]


def test_ollama_loads_with_an_empty_request_and_unloads_with_keep_alive_zero(agents):
    import ollama

    with ollama_client(agents) as c:
        loaded = c.generate(model="tiny2")
        assert loaded.done and loaded.done_reason == "load" and loaded.response == ""
        assert "tiny2" in [m.model for m in c.ps().models]
        again = c.chat(model="tiny2", messages=[])
        assert again.done and again.done_reason == "load" and again.message.content == ""
        gone = c.generate(model="tiny2", keep_alive=0)
        assert gone.done and gone.done_reason == "unload"
        assert "tiny2" not in [m.model for m in c.ps().models]
        # Unloading what is not loaded is no fault; an unknown name is.
        assert c.chat(model="tiny2", messages=[], keep_alive=0).done_reason == "unload"
        with pytest.raises(ollama.ResponseError) as exc:
            c.generate(model="no-such-model", keep_alive=0)
        assert exc.value.status_code == 404


def test_ollama_keep_alive_zero_unloads_after_the_request(agents):
    with ollama_client(agents) as c:
        c.generate(model="tiny2", prompt="Hi", options={"num_predict": 2, "temperature": 0}, keep_alive=0)
        agents.wait_ev("unloaded", model="tiny2", timeout=60)
        c.generate(model="tiny", prompt="Hi", options={"num_predict": 2, "temperature": 0}, keep_alive="1h")
        [entry] = [m for m in c.ps().models if m.model == "tiny"]
        # keep_alive "1h" from now: not the configured never (far off), not gone.
        assert timedelta(minutes=50) < entry.expires_at - datetime.now(UTC) < timedelta(minutes=70)
