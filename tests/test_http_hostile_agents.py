"""Hostile bodies on the agent-facing HTTP surfaces (Anthropic Messages,
OpenAI Responses, Ollama, tool calls on chat completions) against a real
`lattice-pool serve --http`: each is answered with a 4xx in that API's own
error shape, naming nothing of the pool's, and the pool serves the next
request."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import pytest

from tests.conftest import shared_http_pool

ANTHROPIC, RESPONSES, CHAT, OLLAMA_CHAT, GENERATE = "/v1/messages", "/v1/responses", "/v1/chat/completions", "/api/chat", "/api/generate"
HI = [{"role": "user", "content": "Hi"}]
# A valid request per route, one token long, seeded.
NORMAL = {
    ANTHROPIC: {"model": "tiny", "max_tokens": 1, "seed": 1, "messages": HI},
    RESPONSES: {"model": "tiny", "max_output_tokens": 1, "seed": 1, "input": "Hi"},
    CHAT: {"model": "tiny", "max_tokens": 1, "seed": 1, "messages": HI},
    OLLAMA_CHAT: {"model": "tiny", "stream": False, "options": {"num_predict": 1, "seed": 1}, "messages": HI},
    GENERATE: {"model": "tiny", "stream": False, "options": {"num_predict": 1, "seed": 1}, "prompt": "Hi"},
    "/api/embed": {"model": "emb", "input": "Hi"},
    "/api/show": {"model": "tiny"},
}
GENERATING = (ANTHROPIC, RESPONSES, CHAT, OLLAMA_CHAT, GENERATE)
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
# A tool schema no grammar can be compiled from.
DANGLING = {"type": "object", "properties": {"zone": {"$ref": "#/nowhere"}}}


@pytest.fixture(scope="module")
def pool(tiny_model, tmp_path_factory):
    """`tiny` (chat) and `emb` (embeddings) on the demo model, one worker;
    a 64 KiB stream buffer; no model or hub cache to list."""
    root = tmp_path_factory.mktemp("hostile-agents")
    (root / "models").mkdir()
    (root / "hub").mkdir()
    config = root / "pool.toml"
    config.write_text(
        f'http_stream_buffer = "64KiB"\n[[models]]\nname = "tiny"\npath = "{tiny_model}"\npreload = true\n'
        f'[[models]]\nname = "emb"\npath = "{tiny_model}"\nkind = "embedding"\n'
    )
    yield from shared_http_pool(config, "tiny", env={"LATTICE_MODEL_CACHE": str(root / "models"), "HF_HUB_CACHE": str(root / "hub")})


def call(pool, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None) -> tuple[int, bytes]:
    """(status, body) of one request on a connection of its own."""
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    url = urlsplit(pool.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    try:
        sent = {"content-type": "application/json", **(headers or {})}
        conn.request(method, path, body=body, headers={k: v for k, v in sent.items() if v is not None})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def api_error(path: str, status: int, body: bytes, tiny_model) -> str:
    """The message of an error answer, checked to be in `path`'s API's shape."""
    assert 400 <= status < 500, (path, status, body[:300])
    error = json.loads(body)
    if path == ANTHROPIC:
        assert error["type"] == "error" and set(error["error"]) == {"type", "message"}, error
        message = error["error"]["message"]
    elif path.startswith("/api/"):
        assert set(error) == {"error"} and isinstance(error["error"], str), error
        message = error["error"]
    else:
        assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}, error
        message = error["error"]["message"]
    assert "Traceback" not in message and str(tiny_model) not in message, message
    return message


def serves(pool, path: str) -> None:
    status, body = call(pool, "POST", path, NORMAL[path])
    assert status == 200, (path, body[:300])


def deep(n: int) -> str:
    return "[" * n + "]" * n


def with_(path: str, **fields) -> dict:
    return {**NORMAL[path], **fields}


# -- bodies no API takes ----------------------------------------------------------


@pytest.mark.parametrize("path", [*GENERATING, "/api/embed", "/api/show"])
@pytest.mark.parametrize(
    "body, headers, status",
    [
        (b"", None, 400),
        (b"[1, 2]", None, 400),
        (b"null", None, 400),
        (b'{"model": "tiny", "messages": [', None, 400),
        (b'{"model": "tiny", "temperature": NaN}', None, 400),
        (b'{"model": "tiny", "x": "\xff\xfe"}', None, 400),
        (b'{"model": "tiny", "x": "\\ud800"}', None, 400),
        (deep(10_000).encode(), None, 400),
        (b'{"model": "tiny", "messages": ' + deep(10_000).encode() + b"}", None, 400),
        (b'{"model": "tiny"}', {"content-type": "text/plain"}, 403),
        (b'{"model": "tiny"}', {"content-type": None}, 403),
    ],
    ids=["empty", "array", "null", "truncated", "nan", "not-utf8", "lone-surrogate", "deep", "deep-messages", "text-plain", "no-type"],
)
def test_a_body_that_is_no_json_object_is_refused_in_the_apis_shape(pool, tiny_model, path, body, headers, status):
    got, answer = call(pool, "POST", path, body, headers)
    assert got == status, (got, answer[:300])
    api_error(path, got, answer, tiny_model)
    serves(pool, path)


def test_bodies_nested_past_the_bound_are_refused_not_a_500(pool, tiny_model):
    """A body nesting more than 256 deep is refused. Below the decoder's
    own limit, json.dumps of a tool's schema or a call's arguments (from
    further down the stack) raised RecursionError, a 500, for a band of
    depths just under what the decoder takes."""
    depths = [300, 600, *range(900, 1000, 2)]
    bodies = {
        ANTHROPIC: lambda d: with_(
            ANTHROPIC, messages=HI + [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"a": d}}]}]
        ),
        OLLAMA_CHAT: lambda d: with_(
            OLLAMA_CHAT, messages=[{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"a": d}}}]}] + HI
        ),
        CHAT: lambda d: with_(
            CHAT, tool_choice="required", tools=[{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"enum": d}}}}}]
        ),
        RESPONSES: lambda d: with_(RESPONSES, metadata={"a": d}),
    }
    for path, make in bodies.items():
        for n in depths:
            body = json.dumps(make("@")).replace('"@"', deep(n)).encode()
            status, answer = call(pool, "POST", path, body)
            api_error(path, status, answer, tiny_model)
        # Nesting that real schemas and arguments use is served.
        status, answer = call(pool, "POST", path, json.dumps(make(json.loads(deep(100)))).encode())
        assert status == 200, (path, answer[:300])


@pytest.mark.parametrize("path", [CHAT, RESPONSES])
def test_call_arguments_nested_deeper_than_any_decoder_goes_are_text(pool, path):
    """A call's arguments in the history are a JSON string, read for the
    template (a RecursionError, a 500, when nested 5000 deep)."""
    arguments = deep(5000)
    if path == CHAT:
        body = with_(
            CHAT, messages=HI + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]}]
        )
    else:
        body = with_(RESPONSES, input=[{"role": "user", "content": "Hi"}, {"type": "function_call", "call_id": "c", "name": "f", "arguments": arguments}])
    status, answer = call(pool, "POST", path, body)
    assert status == 200, answer[:300]


# -- wrong fields, each API ----------------------------------------------------------


HOSTILE = [
    # Anthropic Messages
    (ANTHROPIC, {"messages": "Hi"}),
    (ANTHROPIC, {"messages": None}),
    (ANTHROPIC, {"messages": []}),
    (ANTHROPIC, {"messages": [{"role": "system", "content": "x"}]}),
    (ANTHROPIC, {"messages": [{"role": "user", "content": [1, 2, 3]}]}),
    (ANTHROPIC, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}),
    (ANTHROPIC, {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}),
    (ANTHROPIC, {"messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "text", "data": "x"}}]}]}),
    (ANTHROPIC, {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]}]}),
    (ANTHROPIC, {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}),
    (ANTHROPIC, {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "12:00"}]}]}),
    (
        ANTHROPIC,
        {
            "messages": HI
            + [
                {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "b", "content": "12:00"}]},
            ]
        },
    ),
    (ANTHROPIC, {"messages": HI + [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": 5, "input": "x"}]}]}),
    (ANTHROPIC, {"system": 5}),
    (ANTHROPIC, {"tools": {"name": "f"}}),
    (ANTHROPIC, {"tools": [{"name": "f"}]}),
    (ANTHROPIC, {"tools": [{"input_schema": {}}]}),
    (ANTHROPIC, {"tools": [{"name": "f", "input_schema": "x"}]}),
    (ANTHROPIC, {"tools": [{"name": "f", "input_schema": {"properties": 5}}]}),
    (ANTHROPIC, {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
    (ANTHROPIC, {"tools": [{"name": "get_time", "input_schema": CLOCK}], "tool_choice": {"type": "tool", "name": "missing"}}),
    (ANTHROPIC, {"max_tokens": -1}),
    (ANTHROPIC, {"max_tokens": 2**70}),
    (ANTHROPIC, {"max_tokens": 1.5}),
    (ANTHROPIC, {"max_tokens": True}),
    (ANTHROPIC, {"temperature": "hot"}),
    (ANTHROPIC, {"stream": "yes"}),
    (ANTHROPIC, {"stop_sequences": [""]}),
    (ANTHROPIC, {"thinking": {"type": "enabled", "budget_tokens": -5}}),
    (ANTHROPIC, {"thinking": "enabled"}),
    (ANTHROPIC, {"tools": [{"name": "get_time", "input_schema": CLOCK}], "tool_choice": "any"}),
    (ANTHROPIC, {"output_config": ["json"]}),
    (ANTHROPIC, {"output_config": {"format": {"type": "json_schema", "schema": {"$ref": "file:///etc/passwd"}}}}),
    (ANTHROPIC, {"lora": "../../etc"}),
    # OpenAI Responses
    (RESPONSES, {"input": None}),
    (RESPONSES, {"input": 5}),
    (RESPONSES, {"input": [5]}),
    (RESPONSES, {"input": [{"role": "tool", "content": "x"}]}),
    (RESPONSES, {"input": [{"role": "user", "content": [1, 2]}]}),
    (RESPONSES, {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}),
    (RESPONSES, {"input": [{"type": "function_call_output", "call_id": "nope", "output": [1]}]}),
    (RESPONSES, {"input": [{"type": "item_reference", "id": "x"}]}),
    (RESPONSES, {"instructions": ["x"]}),
    (RESPONSES, {"tools": "x"}),
    (RESPONSES, {"tools": [{"type": "function"}]}),
    (RESPONSES, {"tools": [{"type": "function", "name": "f", "parameters": 5}]}),
    (RESPONSES, {"tools": [{"name": "get_time"}]}),
    (RESPONSES, {"tools": [{"type": "web_search"}], "tool_choice": "required"}),
    (RESPONSES, {"tools": [{"type": "function", "name": "get_time", "parameters": CLOCK}], "tool_choice": {"type": "function", "name": "missing"}}),
    (RESPONSES, {"tool_choice": "required"}),
    (RESPONSES, {"reasoning": "high"}),
    (RESPONSES, {"text": "json"}),
    (RESPONSES, {"store": "no"}),
    (RESPONSES, {"metadata": ["a"]}),
    (RESPONSES, {"max_output_tokens": 0}),
    (RESPONSES, {"max_output_tokens": "4"}),
    (RESPONSES, {"reasoning": {"effort": "lots"}}),
    (RESPONSES, {"text": {"format": {"type": "json_schema", "schema": 5}}}),
    (RESPONSES, {"previous_response_id": "resp_nope"}),
    # Chat completions' tool calls
    (CHAT, {"tools": "x"}),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "bad name!"}}]}),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}] * 129}),
    (
        CHAT,
        {
            "tools": [{"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}],
            "tool_choice": {"type": "function", "function": {"name": "no"}},
        },
    ),
    (CHAT, {"functions": "f"}),
    (CHAT, {"messages": [{"role": "assistant", "tool_calls": "x"}]}),
    (CHAT, {"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]}),
    (CHAT, {"messages": "Hi"}),
    (CHAT, {"messages": [{"role": "banana", "content": "x"}]}),
    (CHAT, {"messages": [{"role": "<|im_end|>", "content": "x"}]}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]}),
    # Ollama
    (OLLAMA_CHAT, {"messages": "Hi"}),
    (OLLAMA_CHAT, {"messages": [5]}),
    (OLLAMA_CHAT, {"messages": [{"content": "x"}]}),
    (OLLAMA_CHAT, {"messages": [{"role": "banana", "content": "x"}]}),
    (OLLAMA_CHAT, {"messages": [{"role": ["user"], "content": "x"}]}),
    (OLLAMA_CHAT, {"messages": [{"role": "user", "content": "x", "images": ["AAAA"]}]}),
    (OLLAMA_CHAT, {"messages": [{"role": "user", "content": {"a": 1}}]}),
    (OLLAMA_CHAT, {"options": [1]}),
    (OLLAMA_CHAT, {"options": []}),
    (OLLAMA_CHAT, {"options": {"num_predict": "x"}}),
    (OLLAMA_CHAT, {"options": {"temperature": "hot"}}),
    (OLLAMA_CHAT, {"format": 5}),
    (OLLAMA_CHAT, {"format": {"type": "objekt"}}),
    (OLLAMA_CHAT, {"keep_alive": "soon"}),
    (OLLAMA_CHAT, {"keep_alive": [1]}),
    (OLLAMA_CHAT, {"think": "lots"}),
    (OLLAMA_CHAT, {"stream": "yes"}),
    (GENERATE, {"raw": "yes"}),
    (OLLAMA_CHAT, {"tools": [{"type": "function", "function": {"name": "bad name"}}]}),
    (GENERATE, {"prompt": 5}),
    (GENERATE, {"images": ["AAAA"]}),
    (GENERATE, {"system": 5}),
    (GENERATE, {"options": {"stop": 5}}),
    ("/api/embed", {"input": [5]}),
    ("/api/embed", {"input": None}),
    ("/api/show", {"model": "../tiny"}),
    ("/api/show", {"model": 5}),
]


# Each generating route's cases streamed and not.
CASES = [
    pytest.param(path, fields, stream, id=f"{path}-{n}{'' if stream is None else '-stream' if stream else '-whole'}")
    for n, (path, fields) in enumerate(HOSTILE)
    for stream in ((False, True) if path in GENERATING else (None,))
]


@pytest.mark.parametrize("path, fields, stream", CASES)
def test_wrong_fields_are_a_4xx_in_the_apis_shape(pool, tiny_model, path, fields, stream):
    body = with_(path, **fields)
    if stream is not None:
        body.setdefault("stream", stream)
    status, answer = call(pool, "POST", path, body)
    api_error(path, status, answer, tiny_model)
    serves(pool, path)


@pytest.mark.parametrize(
    "tool_calls",
    [[{"function": "get_time"}], "get_time", [5], {"function": {"name": "get_time"}}],
    ids=["function-a-string", "a-string", "a-number", "an-object"],
)
def test_ollama_history_tool_calls_of_the_wrong_shape_are_400(pool, tiny_model, tool_calls):
    """A call whose `function` was no object raised AttributeError (a 500);
    the others were dropped without a word."""
    messages = [{"role": "assistant", "content": "", "tool_calls": tool_calls}, *HI]
    status, answer = call(pool, "POST", OLLAMA_CHAT, with_(OLLAMA_CHAT, messages=messages))
    assert status == 400 and "tool_calls" in api_error(OLLAMA_CHAT, status, answer, tiny_model)
    serves(pool, OLLAMA_CHAT)


def test_a_previous_response_id_that_is_no_string_is_400(pool, tiny_model):
    for value in (5, ["resp_x"], {"id": "resp_x"}, True):
        status, answer = call(pool, "POST", RESPONSES, with_(RESPONSES, previous_response_id=value))
        assert status == 400, answer
        assert json.loads(answer)["error"]["param"] == "previous_response_id"
        api_error(RESPONSES, status, answer, tiny_model)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", [CHAT, ANTHROPIC, RESPONSES])
def test_a_forced_call_to_tools_no_grammar_holds_names_the_tools(pool, tiny_model, path, stream):
    """The worker's error was about a response_format the client never sent,
    with the pool's generated Lark grammar in it."""
    if path == CHAT:
        body = with_(CHAT, tools=[{"type": "function", "function": {"name": "get_time", "parameters": DANGLING}}], tool_choice="required")
    elif path == ANTHROPIC:
        body = with_(ANTHROPIC, tools=[{"name": "get_time", "input_schema": DANGLING}], tool_choice={"type": "any"})
    else:
        body = with_(RESPONSES, tools=[{"type": "function", "name": "get_time", "parameters": DANGLING}], tool_choice="required")
    status, answer = call(pool, "POST", path, {**body, "stream": stream})
    assert status == 400, answer[:300]
    message = api_error(path, status, answer, tiny_model)
    assert "tools" in message and "nowhere" in message, message
    assert "response_format" not in message and "<tool_call>" not in message and "start:" not in message, message
    if path != ANTHROPIC:
        assert json.loads(answer)["error"]["param"] == "tools"


# -- Ollama's routes ------------------------------------------------------------------


@pytest.mark.parametrize(
    "method, path, headers, status",
    [
        ("GET", "/api/show", None, 405),
        ("GET", "/api/embed", None, 405),
        ("POST", "/api/tags", None, 405),
        ("DELETE", "/api/chat", None, 405),
        ("POST", "/api/pull", None, 404),
        ("GET", "/api/../etc/passwd", None, 404),
        ("POST", "/api/show", {"content-type": "text/plain"}, 403),
        ("POST", "/api/embed", {"content-type": None}, 403),
        ("GET", "/api/tags", {"origin": "https://evil.example"}, 403),
        ("GET", "/api/ps", {"host": "rebound.evil.example"}, 403),
    ],
)
def test_refusals_on_ollamas_routes_are_in_ollamas_shape(pool, tiny_model, method, path, headers, status):
    """Every /api/ path answers {"error": "..."}: Ollama's clients read
    nothing else (these were in OpenAI's shape)."""
    got, answer = call(pool, method, path, b'{"model": "tiny"}' if method == "POST" else None, headers)
    assert got == status, answer
    api_error(path, got, answer, tiny_model)


def test_a_keep_alive_past_any_date_leaves_api_ps_working(pool):
    """/api/ps said when keep_alive unloads the model from now + keep_alive:
    a client's 1e300 seconds raised OverflowError there (a 500) until
    another keep_alive came."""
    try:
        for keep_alive in (1e300, "99999999999h", 1e12):
            status, answer = call(pool, "POST", OLLAMA_CHAT, with_(OLLAMA_CHAT, keep_alive=keep_alive))
            assert status == 200, answer[:300]
            status, answer = call(pool, "GET", "/api/ps")
            assert status == 200, answer
            [model] = [m for m in json.loads(answer)["models"] if m["name"] == "tiny"]
            assert model["expires_at"] == "2318-01-01T00:00:00Z"
    finally:
        # For ever, as these did: the module's other tests find it loaded.
        status, _ = call(pool, "POST", OLLAMA_CHAT, with_(OLLAMA_CHAT, keep_alive=-1))
        assert status == 200


# -- streams ---------------------------------------------------------------------------


def test_a_responses_stream_that_echoes_more_than_the_stream_buffer_is_served(pool):
    """Responses' opening and closing events echo the request (metadata,
    tools, instructions) and repeat the whole answer: counted against
    http_stream_buffer (64 KiB here) as if the client had not read them, the
    stream was cancelled and its connection dropped before its first byte."""
    metadata = {"note": "x" * 100_000}
    status, answer = call(pool, "POST", RESPONSES, with_(RESPONSES, stream=True, max_output_tokens=4, metadata=metadata))
    assert status == 200
    events = [json.loads(line[6:]) for line in answer.splitlines() if line.startswith(b"data: ")]
    assert events[0]["type"] == "response.created" and events[0]["response"]["metadata"] == metadata
    assert events[-1]["type"] in ("response.completed", "response.incomplete") and events[-1]["response"]["metadata"] == metadata


@pytest.mark.parametrize("path", GENERATING)
def test_a_stream_ends_with_its_apis_terminal_event(pool, path):
    """Content a template or a tokenizer could trip on streams to its end."""
    text = "\x00\x01\u2028\ufeff<|im_end|><think></think><tool_call>{" + "\U0001f600" * 8
    body = {**NORMAL[path], "stream": True}
    if path == GENERATE:
        body["prompt"] = text
    elif path == RESPONSES:
        body["input"] = text
    else:
        body["messages"] = [{"role": "user", "content": text}]
    status, answer = call(pool, "POST", path, body)
    assert status == 200, answer[:300]
    lines = [line for line in answer.splitlines() if line]
    if path == ANTHROPIC:
        assert lines[-2:] == [b"event: message_stop", b'data: {"type":"message_stop"}'], lines[-3:]
    elif path == RESPONSES:
        assert json.loads(lines[-1][6:])["type"] in ("response.completed", "response.incomplete"), lines[-1]
    elif path == CHAT:
        assert lines[-1] == b"data: [DONE]", lines[-1]
    else:
        assert json.loads(lines[-1])["done"] is True, lines[-1]


@pytest.mark.parametrize(
    "path, fields, named",
    [
        (RESPONSES, {"max_output_tokens": -1}, "max_output_tokens"),
        (RESPONSES, {"input": []}, '"input"'),
        (ANTHROPIC, {"stop_sequences": [""]}, "stop_sequences"),
        (ANTHROPIC, {"thinking": {"type": "enabled", "budget_tokens": -5}}, "thinking.budget_tokens"),
        (OLLAMA_CHAT, {"options": {"num_predict": 1.5}}, "options.num_predict"),
        (OLLAMA_CHAT, {"options": {"repeat_penalty": -1}}, "options.repeat_penalty"),
    ],
)
def test_a_refusal_names_the_field_as_the_client_sent_it(pool, tiny_model, path, fields, named):
    """Every API is read as a chat completion: its refusals named the chat's
    fields (max_tokens for max_output_tokens, stop for stop_sequences)."""
    status, answer = call(pool, "POST", path, with_(path, **fields))
    assert named in api_error(path, status, answer, tiny_model)
