"""OpenAI's JSON shapes, to and from the pool's own.

A request body becomes the same ClientLine a stdin line becomes: its pool
fields are copied into a stdin-style line and run through
supervisor.requests.parse_line, so both surfaces share one validation and
one set of limits. What only HTTP has (stream, stream_options,
max_completion_tokens, content parts) is read here. Answers are built as
bytes; the per-token stream chunks from a prefix and suffix made once per
request.
"""

from __future__ import annotations

import re

from typing import Any, Callable

import msgspec

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
from supervisor.requests import BadRequest, ClientLine, PositiveInt, parse_line

# Fields a body shares with a stdin line, copied as they are (null = absent).
POOL_FIELDS = ("lora", "max_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed", "stop", "response_format", "reasoning_budget")

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
    def from_pool(cls, code: str | None, message: str) -> "HttpError":
        """The pool's `error` line (code, msg) as an HTTP error."""
        status, type_ = STATUS.get(code or "", (500, "server_error"))
        return cls(status, message, type_, code, "model" if code == UNKNOWN_MODEL else None)

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code, self.param)


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
    max_completion_tokens: PositiveInt | None = None
    n: int | None = None
    logprobs: Any = None
    echo: bool | None = None
    tools: list | None = None


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None


class Options(msgspec.Struct):
    """How to answer: the request as the pool runs it aside."""

    model: str
    stream: bool
    include_usage: bool


def _convert(value: object, kind: Any, where: str) -> Any:
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as exc:
        what, _, at = str(exc).partition(" - at `$")
        path = (where + at.rstrip("`")).lstrip(".")
        raise bad(f"invalid field {path!r}: {what}" if path else what, path.partition(".")[0].partition("[")[0] or None) from None


def _decode(body: bytes) -> tuple[dict, HttpFields]:
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise bad(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise bad("request body is not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise bad("request body must be a JSON object")
    fields = _convert(data, HttpFields, "")
    if fields.n not in (None, 1):
        raise bad("n must be 1: one choice per request", "n")
    if fields.logprobs not in (None, False, 0):
        raise bad("logprobs are not supported", "logprobs")
    if fields.echo:
        raise bad("echo is not supported", "echo")
    if fields.tools:
        raise bad("tools are not supported", "tools")
    return data, fields


def _pool_line(data: dict, fields: HttpFields, request_id: str, model: str) -> dict:
    line = {name: data[name] for name in POOL_FIELDS if name in data}
    if fields.max_completion_tokens is not None:
        line["max_tokens"] = fields.max_completion_tokens
    line["model"] = model
    line["id"] = request_id
    return line


def _client_line(line: dict) -> ClientLine:
    try:
        return parse_line(_encode(line))
    except BadRequest as exc:
        msg = exc.msg.removeprefix("malformed request: ")
        # OpenAI names the offending field in `param`.
        field = re.match(r"invalid field '([^'.\[]+)", msg)
        raise bad(msg, field.group(1) if field else "response_format" if "response_format" in msg else None) from None


def _options(fields: HttpFields, model: str) -> Options:
    usage = bool(fields.stream and fields.stream_options and fields.stream_options.include_usage)
    return Options(model=model, stream=bool(fields.stream), include_usage=usage)


def _flatten(message: ChatMessage) -> dict:
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise bad(f"message content of type {part.type!r} is not supported: text only", "messages")
            texts.append(part.text)
        content = "".join(texts)
    # OpenAI's newer name for the system role; chat templates know "system".
    role = "system" if message.role == "developer" else message.role
    return {"role": role, "content": content or ""}


def chat_request(body: bytes, request_id: str, model_name: Callable[[object], str]) -> tuple[ClientLine, Options]:
    """A /v1/chat/completions body as the pool's request. model_name(value)
    gives the configured name the body's `model` means (or raises)."""
    data, fields = _decode(body)
    model = model_name(data.get("model"))
    if data.get("messages") is None:
        raise bad('missing "messages" field', "messages")
    messages = _convert(data["messages"], list[ChatMessage], "messages")
    line = _pool_line(data, fields, request_id, model)
    line["messages"] = [_flatten(m) for m in messages]
    return _client_line(line), _options(fields, model)


def completion_request(body: bytes, request_id: str, model_name: Callable[[object], str]) -> tuple[ClientLine, Options]:
    """A /v1/completions body: its prompt is used verbatim, like a stdin `prompt`."""
    data, fields = _decode(body)
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


class Reply:
    """The JSON of one request's answer, as OpenAI writes it for one of the
    two endpoints: whole (`message`), or as SSE chunks."""

    def __init__(self, chat: bool, request_id: str, created: int, model: str, include_usage: bool):
        self.chat = chat
        self.request_id = request_id
        self.include_usage = include_usage
        head = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion", "created": created, "model": model}
        self._head = head
        null_usage = b',"usage":null' if include_usage else b""
        # One chunk per text piece: the prefix and suffix around its JSON string.
        opened = _encode(head)[:-1]
        if chat:
            self._prefix = {kind: b"data: " + opened + b',"choices":[{"index":0,"delta":{"%s":' % kind.encode() for kind in ("content", "reasoning_content")}
            self._suffix = b'},"logprobs":null,"finish_reason":null}]' + null_usage + b"}\n\n"
        else:
            self._prefix = {"content": b"data: " + opened + b',"choices":[{"index":0,"text":'}
            self._suffix = b',"logprobs":null,"finish_reason":null}]' + null_usage + b"}\n\n"

    def piece(self, text: str, reasoning: bool = False) -> bytes:
        """The SSE chunk of one piece of text (reasoning: a reasoning_content delta)."""
        return self.raw_piece(_encode(text), reasoning)

    def raw_piece(self, text_json: bytes, reasoning: bool) -> bytes:
        """The same, from the text already as a JSON string."""
        return self._prefix["reasoning_content" if reasoning else "content"] + text_json + self._suffix

    def _chunk(self, choices: list, **extra: object) -> bytes:
        body = {**self._head, "choices": choices, **extra}
        return b"data: " + _encode(body) + b"\n\n"

    def first(self) -> bytes:
        """The chat stream's first chunk: the assistant role, no text yet."""
        extra = {"usage": None} if self.include_usage else {}
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}], **extra)

    def last(self, finish_reason: str, figures: dict | None) -> bytes:
        """The closing chunks: the finish reason, the usage when asked for, [DONE]."""
        extra = {"usage": None} if self.include_usage else {}
        if self.chat:
            choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason}
        out = self._chunk([choice], **extra)
        if figures is not None:
            out += self._chunk([], usage=figures)
        return out + b"data: [DONE]\n\n"

    def whole(self, text: str, reasoning: str | None, finish_reason: str, figures: dict) -> bytes:
        """The non-streamed answer."""
        head = {**self._head, "object": "chat.completion" if self.chat else "text_completion"}
        if self.chat:
            message = {"role": "assistant", "content": text}
            if reasoning is not None:
                message["reasoning_content"] = reasoning
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return _encode({**head, "choices": [choice], "usage": figures})


def stream_error(error: HttpError) -> bytes:
    """An error after the stream began: OpenAI's clients raise on a data
    chunk that holds "error"; [DONE] still closes the stream."""
    return b"data: " + error.body() + b"\n\ndata: [DONE]\n\n"
