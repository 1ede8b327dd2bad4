"""OpenAI's JSON shapes, to and from the pool's own.

A request body becomes the same ClientLine a stdin line becomes: its pool
fields, as the body's JSON decoded them, go through
supervisor.requests.from_fields, so both surfaces share one validation and
one set of limits, and the body is decoded once. What only HTTP has (stream, stream_options,
max_completion_tokens, content parts) is read here. Answers are built as
bytes; the per-token stream chunks from a prefix and suffix made once per
request.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import msgspec

from ipc import sampling
from ipc.events import (
    ADAPTER_ERROR,
    BAD_REQUEST,
    INSUFFICIENT_MEMORY,
    INTERNAL,
    LOAD_FAILED,
    MODEL_FAILED,
    OVERLOADED,
    SHUTTING_DOWN,
    UNKNOWN_MODEL,
    UNLOADED,
    WORKER_CRASHED,
)
from ipc.messages import MAX_TOP_LOGPROBS
from supervisor.httpapi.logprobs import chat_logprobs, completion_logprobs
from supervisor.httpapi.tools import TemplateInfo, ToolError, ToolRequest, forced_format, hermes_messages, history_calls, read_tools
from supervisor.requests import BadRequest, ClientLine, from_fields

# Fields a body shares with a stdin line, copied as they are (null = absent).
POOL_FIELDS = (*sampling.NAMES, "lora", "stop", "response_format", "allow_special_tokens", "speculative")

# The pool's error codes as HTTP statuses and OpenAI error types.
STATUS = {
    BAD_REQUEST: (400, "invalid_request_error"),
    ADAPTER_ERROR: (400, "invalid_request_error"),
    UNKNOWN_MODEL: (404, "invalid_request_error"),
    OVERLOADED: (429, "rate_limit_error"),
    INSUFFICIENT_MEMORY: (507, "server_error"),
    LOAD_FAILED: (503, "server_error"),
    MODEL_FAILED: (503, "server_error"),
    WORKER_CRASHED: (503, "server_error"),
    UNLOADED: (503, "server_error"),
    SHUTTING_DOWN: (503, "server_error"),
    INTERNAL: (500, "server_error"),
}

_encode = msgspec.json.Encoder().encode


class HttpError(Exception):
    """An answer in OpenAI's error shape with its HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param

    @classmethod
    def from_pool(cls, code: str | None, message: str) -> HttpError:
        """The pool's `error` line (code, msg) as an HTTP error."""
        status, type_ = STATUS.get(code or "", (500, "server_error"))
        return cls(status, message, type_, code, "model" if code == UNKNOWN_MODEL else None)

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code, self.param)

    def renamed(self, names: dict[str, str]) -> HttpError:
        """The same error with the chat fields in `names` called by another
        API's names for them (`max_tokens`: Responses' `max_output_tokens`),
        in `param` and where the message quotes them."""
        if not names:
            return self
        quoted = re.compile(r"""(['"])(%s)(?=['"\[.])""" % "|".join(map(re.escape, names)))
        message = quoted.sub(lambda m: m.group(1) + names[m.group(2)], self.message)
        param = self.param if self.param is None else names.get(self.param, self.param)
        return type(self)(self.status, message, self.type, self.code, param)


def error_body(message: str, type_: str, code: str | None, param: str | None = None) -> bytes:
    return _encode({"error": {"message": message, "type": type_, "param": param, "code": code}})


def bad(message: str, param: str | None = None) -> HttpError:
    return HttpError(400, message, code=BAD_REQUEST, param=param)


# -- requests --------------------------------------------------------------------


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class HttpFields(msgspec.Struct):
    """What a body carries that a stdin line does not; anything else OpenAI
    defines and the pool does not use (user, presence_penalty...) is ignored."""

    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_completion_tokens: sampling.MaxTokens | None = None
    n: int | None = None
    logprobs: Any = None
    top_logprobs: Any = None
    echo: bool | None = None
    reasoning_effort: str | None = None


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


# The roles of a Chat Completions message, as OpenAI's API takes them.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: Any = None
    tool_call_id: str | None = None
    name: str | None = None
    function_call: Any = None  # the legacy form of one tool call


class Options(msgspec.Struct):
    """How to answer: the request as the pool runs it aside."""

    model: str
    stream: bool
    include_usage: bool
    tools: ToolRequest | None = None
    tool_format: str | None = None
    n: int = 1
    # Log-probabilities asked for: the number of alternatives per token
    # (None: none asked).
    logprobs: int | None = None
    extra: Any = None  # what another API's answer needs of its request (supervisor.httpapi.responses)


def _convert(value: object, kind: Any, where: str) -> Any:
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        what, _, at = str(exc).partition(" - at `$")
        path = (where + at.rstrip("`")).lstrip(".")
        raise bad(f"invalid field {path!r}: {what}" if path else what, path.partition(".")[0].partition("[")[0] or None) from None


# How deep a body's JSON may nest. The decoder goes as deep as Python's
# recursion limit allows; what a route then does with a body (json.dumps
# of a tool's schema or a call's arguments, a forced call's grammar)
# recurses as deep again, from further down the stack, and would fail with
# a RecursionError (a 500) where the decoder did not. A bound well below
# keeps all of it in reach.
MAX_DEPTH = 256


def _too_deep(data: object) -> bool:
    """Whether `data` nests more than MAX_DEPTH objects and arrays deep
    (level by level: no recursion)."""
    level = [data]
    for _ in range(MAX_DEPTH):
        level = [kid for node in level for kid in (node.values() if isinstance(node, dict) else node) if isinstance(kid, (dict, list))]
        if not level:
            return False
    return True


def optional_object(data: dict, key: str) -> dict | None:
    """A field that must be an object when given."""
    value = data.get(key)
    if value is not None and not isinstance(value, dict):
        raise bad(f"{key} must be an object", key)
    return value


def optional_bool(data: dict, key: str, default: bool) -> bool:
    """A field that must be a boolean when given."""
    value = data.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"{key} must be a boolean", key)
    return value


def json_object(body: bytes) -> dict:
    """A request body that must be a JSON object, for every API's route."""
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise bad(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad("request body is not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise bad("request body must be a JSON object")
    if body.count(b"[") + body.count(b"{") > MAX_DEPTH and _too_deep(data):
        raise bad(f"request body nests more than {MAX_DEPTH} objects and arrays deep")
    return data


def _http_fields(data: dict, chat: bool = True) -> HttpFields:
    fields = _convert(data, HttpFields, "")
    if fields.n is not None and not 1 <= fields.n <= MAX_CHOICES:
        raise bad(f"n must be 1 to {MAX_CHOICES}", "n")
    fields.logprobs = _logprobs(fields) if chat else _completion_logprobs(fields.logprobs)
    if fields.echo:
        raise bad("echo is not supported", "echo")
    return fields


def _top(value: object, name: str) -> int:
    if type(value) is not int or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise bad(f"{name} must be an integer from 0 to {MAX_TOP_LOGPROBS}", name)
    return value


def _logprobs(fields: HttpFields) -> int | None:
    """Chat's `logprobs` (a boolean) and `top_logprobs` as the count of
    alternatives per token, None when not asked for."""
    if fields.logprobs is not None and type(fields.logprobs) is not bool:
        raise bad("logprobs must be a boolean", "logprobs")
    top = None if fields.top_logprobs is None else _top(fields.top_logprobs, "top_logprobs")
    if top is not None and not fields.logprobs:
        raise bad("top_logprobs needs logprobs set to true", "top_logprobs")
    return (top or 0) if fields.logprobs else None


def _completion_logprobs(value: object) -> int | None:
    """The legacy completions' `logprobs`: the count of alternatives."""
    return None if value is None else _top(value, "logprobs")


# Choices one request may ask for (`n`): each is a row of its own in the
# model's batch (and counts against max_queued), so a bound.
MAX_CHOICES = 8

# OpenAI's reasoning_effort as the pool's reasoning_budget (tokens of
# thinking before </think> is forced); "high" and above leave it uncapped.
REASONING_EFFORT = {"none": 0, "minimal": 0, "low": 256, "medium": 1024, "high": None, "xhigh": None}


def _pool_line(data: dict, fields: HttpFields, request_id: str, model: str, constrained: bool = False) -> dict:
    line = {name: data[name] for name in POOL_FIELDS if data.get(name) is not None}
    if fields.max_completion_tokens is not None:
        line["max_tokens"] = fields.max_completion_tokens
    effort = fields.reasoning_effort
    if effort is not None:
        if effort not in REASONING_EFFORT:
            raise bad(f"reasoning_effort must be one of {', '.join(REASONING_EFFORT)}", "reasoning_effort")
        if "reasoning_budget" not in line and REASONING_EFFORT[effort] is not None:
            line["reasoning_budget"] = REASONING_EFFORT[effort]
    elif constrained and "reasoning_budget" not in line:
        # A reply held to a grammar (response_format, a forced tool call)
        # must reach its answer: the grammar starts after </think>, and a
        # thinking model can spend all of max_tokens before it. Unless the
        # client asks for thinking, the block is closed at once.
        line["reasoning_budget"] = 0
    if fields.logprobs is not None:
        line["logprobs"] = True
        line["top_logprobs"] = fields.logprobs
    line["model"] = model
    line["id"] = request_id
    return line


def _client_line(line: dict) -> ClientLine:
    try:
        return from_fields(line)
    except BadRequest as exc:
        msg = exc.msg.removeprefix("malformed request: ")
        # OpenAI names the offending field in `param`.
        field = re.match(r"invalid field '([^'.\[]+)", msg)
        raise bad(msg, field.group(1) if field else "response_format" if "response_format" in msg else None) from None


def _options(fields: HttpFields, model: str) -> Options:
    usage = bool(fields.stream and fields.stream_options and fields.stream_options.include_usage)
    return Options(model=model, stream=bool(fields.stream), include_usage=usage, n=fields.n or 1, logprobs=fields.logprobs)


def _flatten(message: ChatMessage) -> dict:
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise bad(f"message content of type {part.type!r} is not supported: text only", "messages")
            texts.append(part.text)
        content = "".join(texts)
    if message.role not in CHAT_ROLES:
        # A chat template writes any role it is given into the prompt.
        raise bad(f"message role {message.role!r} is not one of {', '.join(CHAT_ROLES)}", "messages")
    # OpenAI's newer name for the system role; chat templates know "system".
    # "function" is the legacy name of a tool result.
    role = {"developer": "system", "function": "tool"}.get(message.role, message.role)
    out: dict = {"role": role, "content": content or ""}
    calls = message.tool_calls
    if calls is None and message.function_call is not None:
        calls = [{"type": "function", "function": message.function_call}]
    if calls:
        try:
            out["tool_calls"] = history_calls(calls)
        except ToolError as exc:
            raise bad(str(exc), exc.param) from None
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def chat_request(
    data: dict, request_id: str, model_name: Callable[[object], str], template: Callable[[str], TemplateInfo] | None = None
) -> tuple[ClientLine, Options]:
    """A /v1/chat/completions body (decoded: json_object) as the pool's
    request. model_name(value) gives the name the body's `model` means (or
    raises); template(name) what the model's chat template does with tools."""
    fields = _http_fields(data)
    model = model_name(data.get("model"))
    if data.get("messages") is None:
        raise bad('missing "messages" field', "messages")
    messages = [_flatten(m) for m in _convert(data["messages"], list[ChatMessage], "messages")]
    try:
        tools = read_tools(data)
    except ToolError as exc:
        raise bad(str(exc), exc.param) from None
    info = None
    if template is not None and (tools is not None or any(m["role"] == "tool" or "tool_calls" in m for m in messages)):
        info = template(model)
        if not info.renders_tools:
            messages = hermes_messages(messages, tools.tools if tools else None)
    forced = tools is not None and tools.forced
    if forced and data.get("response_format") is not None:
        raise bad("response_format cannot be combined with a forced tool call (tool_choice required or a named function)", "response_format")
    line = _pool_line(data, fields, request_id, model, constrained=data.get("response_format") is not None or forced)
    line["messages"] = messages
    if tools is not None and info is not None:
        if info.renders_tools:
            line["tools"] = tools.tools
        if forced:
            line["response_format"] = msgspec.json.decode(forced_format(tools, info.format))
    options = _options(fields, model)
    if tools is not None and info is not None:
        options.tools, options.tool_format = tools, info.format
    return _client_line(line), options


def translated_chat_request(
    data: dict, chat: dict, request_id: str, model_name: Callable[[object], str], template: Callable[[str], TemplateInfo], names: dict[str, str]
) -> tuple[ClientLine, Options]:
    """chat_request for a body of another API (`data`, Anthropic's or
    Responses') made into a chat body (`chat`): its errors call the chat
    fields by that API's names (`names`: ours to theirs, for fields `data`
    does not name itself), and the answer always counts its tokens."""
    try:
        msg, opts = chat_request(chat, request_id, model_name, template)
    except HttpError as exc:
        raise exc.renamed({ours: theirs for ours, theirs in names.items() if ours not in data}) from None
    opts.include_usage = True
    return msg, opts


def completion_request(data: dict, request_id: str, model_name: Callable[[object], str]) -> tuple[ClientLine, Options]:
    """A /v1/completions body (decoded): its prompt is used verbatim, like a stdin `prompt`."""
    fields = _http_fields(data, chat=False)
    model = model_name(data.get("model"))
    prompt = data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if prompt is None:
        raise bad('missing "prompt" field', "prompt")
    if not isinstance(prompt, str):
        raise bad("prompt must be a string (or a list of one string)", "prompt")
    line = _pool_line(data, fields, request_id, model)
    line["prompt"] = prompt
    return _client_line(line), _options(fields, model)


# -- answers -----------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    figures = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens:
        figures["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return figures


SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]


class CountReply:
    """The answer of a token count route (the `count` op under another
    API's body): `body(tokens)` as JSON, never streamed (the Exchange's
    Reply interface)."""

    chat = False
    include_usage = True

    def __init__(self, body: Callable[[int], dict]):
        self.body = body

    def whole(self, text: str, reasoning: str | None, finish_reason: str, figures: dict, tool_calls: list[dict] | None = None) -> bytes:
        return msgspec.json.encode(self.body(figures["prompt_tokens"]))

    @staticmethod
    def maker(body: Callable[[int], dict]):
        def make(request_id: str, created: int, opts: Options, index: int) -> CountReply:
            return CountReply(body)

        make.chat = False  # type: ignore[attr-defined]
        return make


class Reply:
    """The JSON of one request's answer, as OpenAI writes it for one of the
    two endpoints: whole (`message`), or as SSE chunks."""

    headers = SSE_HEADERS  # a stream's

    def __init__(self, chat: bool, request_id: str, created: int, model: str, include_usage: bool, index: int = 0, closing: bool = True):
        self.chat = chat
        self.request_id = request_id
        self.include_usage = include_usage
        self.index = index
        # Whether last() ends the stream (usage, [DONE]); with n > 1 choices
        # the request does that once all have ended (supervisor.httpapi.choices).
        self.closing = closing
        self._offset = 0  # characters of the answer so far (completions' text_offset)
        head = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion", "created": created, "model": model}
        self._head = head
        null_usage = b',"usage":null' if include_usage else b""
        # One chunk per text piece: the prefix and suffix around its JSON string.
        opened = _encode(head)[:-1]
        if chat:
            self._prefix = {
                kind: b"data: " + opened + b',"choices":[{"index":%d,"delta":{"%s":' % (index, kind.encode()) for kind in ("content", "reasoning_content")
            }
            self._suffix = b'},"logprobs":null,"finish_reason":null}]' + null_usage + b"}\n\n"
        else:
            self._prefix = {"content": b"data: " + opened + b',"choices":[{"index":%d,"text":' % index}
            self._suffix = b',"logprobs":null,"finish_reason":null}]' + null_usage + b"}\n\n"

    @classmethod
    def maker(cls, chat: bool):
        """The server's factory of one choice's Reply."""

        def make(request_id: str, created: int, opts: Options, index: int) -> Reply:
            return cls(chat, request_id, created, opts.model, opts.include_usage, index=index, closing=opts.n == 1)

        make.chat = chat  # type: ignore[attr-defined]
        return make

    def stream_error(self, error: HttpError) -> bytes:
        return stream_error(error)

    def piece(self, text: str, reasoning: bool = False) -> bytes:
        """The SSE chunk of one piece of text (reasoning: a reasoning_content delta)."""
        return self.raw_piece(_encode(text), reasoning)

    def raw_piece(self, text_json: bytes, reasoning: bool) -> bytes:
        """The same, from the text already as a JSON string."""
        return self._prefix["reasoning_content" if reasoning else "content"] + text_json + self._suffix

    def _chunk(self, choices: list, **extra: object) -> bytes:
        body = {**self._head, "choices": choices, **extra}
        return b"data: " + _encode(body) + b"\n\n"

    def logprobs(self, entries: list[dict] | None) -> dict | None:
        """A choice's `logprobs` for the tokens of `entries` (the worker's)."""
        if entries is None:
            return None
        if self.chat:
            return chat_logprobs(entries)
        out = completion_logprobs(entries, self._offset)
        self._offset += sum(len(e["token"]) for e in entries)
        return out

    def logprob_piece(self, text: str, reasoning: bool, entries: list[dict]) -> bytes:
        """The SSE chunk of one piece of text with its tokens' log-probabilities."""
        extra = {"usage": None} if self.include_usage else {}
        if self.chat:
            choice = {"index": self.index, "delta": {"reasoning_content" if reasoning else "content": text}}
        else:
            choice = {"index": self.index, "text": text}
        return self._chunk([{**choice, "logprobs": self.logprobs(entries), "finish_reason": None}], **extra)

    def first(self) -> bytes:
        """The chat stream's first chunk: the assistant role, no text yet."""
        extra = {"usage": None} if self.include_usage else {}
        return self._chunk([{"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}], **extra)

    def last(self, finish_reason: str, figures: dict | None, logprobs: list[dict] | None = None) -> bytes:
        """The closing chunks: the finish reason, the usage when asked for,
        [DONE]; `logprobs`: entries of tokens no earlier chunk showed."""
        extra = {"usage": None} if self.include_usage else {}
        if self.chat:
            choice = {"index": self.index, "delta": {}, "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}
        else:
            choice = {"index": self.index, "text": "", "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}
        out = self._chunk([choice], **extra)
        if not self.closing:
            return out
        return out + self.closing_chunks(figures)

    def closing_chunks(self, figures: dict | None) -> bytes:
        """The usage chunk (when asked for) and [DONE]."""
        out = self._chunk([], usage=figures) if figures is not None else b""
        return out + b"data: [DONE]\n\n"

    def tool_calls(self, calls: list[dict]) -> bytes:
        """The stream's chunk of the reply's tool calls (each whole, with its `index`)."""
        extra = {"usage": None} if self.include_usage else {}
        return self._chunk([{"index": self.index, "delta": {"tool_calls": calls}, "logprobs": None, "finish_reason": None}], **extra)

    def whole(
        self, text: str, reasoning: str | None, finish_reason: str, figures: dict, tool_calls: list[dict] | None = None, logprobs: list[dict] | None = None
    ) -> bytes:
        """The non-streamed answer; `logprobs`: every token's entry, when asked for."""
        head = {**self._head, "object": "chat.completion" if self.chat else "text_completion"}
        if self.chat:
            message = {"role": "assistant", "content": text}
            if tool_calls:
                message = {"role": "assistant", "content": text.strip() or None, "tool_calls": tool_calls}
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            choice = {"index": self.index, "message": message, "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}
        else:
            choice = {"index": self.index, "text": text, "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}
        return _encode({**head, "choices": [choice], "usage": figures})


def stream_error(error: HttpError) -> bytes:
    """An error after the stream began: OpenAI's clients raise on a data
    chunk that holds "error"; [DONE] still closes the stream."""
    return b"data: " + error.body() + b"\n\ndata: [DONE]\n\n"
