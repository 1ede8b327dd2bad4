"""Anthropic's Messages API (`POST /v1/messages`) on the same pool.

A body is read as the chat request it means (system, messages with their
content blocks, tools, tool_choice, thinking, stop_sequences) and run
through the chat path, so limits, templates, tool formats and grammars are
the chat's; the answer is written in Anthropic's shapes: a `message` with
content blocks (`thinking`, `text`, `tool_use`), or its stream of events
(`message_start`, `content_block_start` / `_delta` / `_stop`,
`message_delta`, `message_stop`), and errors as
`{"type":"error","error":{"type":...,"message":...}}`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec

from supervisor.httpapi.shapes import SSE_HEADERS, HttpError, Options, bad, json_object, optional_object, translated_chat_request
from supervisor.httpapi.tools import TemplateInfo

PREFIX = "msg_"
_encode = msgspec.json.Encoder().encode

STOP_REASON = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    507: "api_error",
}


class AnthropicError(HttpError):
    def body(self) -> bytes:
        return error_body(self.status, self.message)


def error_body(status: int, message: str) -> bytes:
    return _encode({"type": "error", "error": {"type": ERROR_TYPE.get(status, "api_error"), "message": message}})


def error(exc: HttpError) -> HttpError:
    return AnthropicError(exc.status, exc.message, exc.type, exc.code, exc.param)


# -- the request --------------------------------------------------------------------------


def _text_of(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or a list of content blocks", "messages")
    texts = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise bad(f"{where}: only text blocks are supported here", "messages")
        texts.append(block["text"])
    return "".join(texts)


def _messages(data: dict) -> list[dict]:
    out = []
    system = data.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text_of(system, "system")})
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad('"messages" must be a non-empty list', "messages")
    # The ids of the tool_use blocks of the message before: a tool_result
    # answers one of them, as Anthropic's API requires.
    offered: set[str] = set()
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise bad('each message needs "role" user or assistant', "messages")
        role, content = message["role"], message.get("content")
        asked, offered = offered, set()
        if isinstance(content, str) or content is None:
            out.append({"role": role, "content": content or ""})
            continue
        if not isinstance(content, list):
            raise bad("message content must be a string or a list of content blocks", "messages")
        texts: list[str] = []
        calls: list[dict] = []
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind in ("thinking", "redacted_thinking"):
                continue  # earlier turns' thinking: chat templates drop it too
            elif kind == "tool_use" and role == "assistant":
                offered.add(str(block.get("id", "")))
                calls.append(
                    {
                        "id": str(block.get("id", "")),
                        "type": "function",
                        "function": {"name": block.get("name"), "arguments": json.dumps(block.get("input") or {})},
                    }
                )
            elif kind == "tool_result" and role == "user":
                if str(block.get("tool_use_id", "")) not in asked:
                    raise bad("a tool_result block's tool_use_id names no tool_use block of the assistant message before it", "messages")
                if texts:
                    out.append({"role": "user", "content": "".join(texts)})
                    texts = []
                result = _text_of(block.get("content"), "tool_result content")
                if block.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": result})
            else:
                raise bad(
                    f"content block of type {kind!r} is not supported{' in ' + role + ' messages' if kind in ('tool_use', 'tool_result') else ''}", "messages"
                )
        if calls:
            out.append({"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls})
        elif texts or not any(m["role"] == "tool" for m in out[-1:]):
            out.append({"role": role, "content": "".join(texts)})
    return out


def _tools(data: dict, body: dict) -> None:
    tools = data.get("tools")
    if tools is None:
        return
    if not isinstance(tools, list):
        raise bad("tools must be a list", "tools")
    converted = []
    for tool in tools:
        if not isinstance(tool, dict) or "input_schema" not in tool:
            raise bad("each tool needs name and input_schema (client tools only)", "tools")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        converted.append({"type": "function", "function": function})
    body["tools"] = converted
    choice = optional_object(data, "tool_choice")
    if choice is not None:
        kind = choice.get("type")
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or (
            {"type": "function", "function": {"name": choice.get("name")}} if kind == "tool" else "invalid"
        )
        if choice.get("disable_parallel_tool_use"):
            body["parallel_tool_calls"] = False


# Chat fields as this API names them, for its errors.
NAMES = {"stop": "stop_sequences", "reasoning_budget": "thinking.budget_tokens"}


def request(body: bytes, request_id: str, model_name: Callable, template: Callable[[str], TemplateInfo], app) -> tuple:
    data = json_object(body)
    chat: dict = {"model": data.get("model"), "messages": _messages(data)}
    for ours, theirs in (
        ("max_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("stream", "stream"),
        ("stop", "stop_sequences"),
    ):
        if data.get(theirs) is not None:
            chat[ours] = data[theirs]
    thinking = optional_object(data, "thinking")
    if thinking is not None:
        if thinking.get("type") == "enabled" and isinstance(thinking.get("budget_tokens"), int):
            chat["reasoning_budget"] = thinking["budget_tokens"]
        elif thinking.get("type") == "disabled":
            chat["reasoning_budget"] = 0
    output = optional_object(data, "output_config")
    if output is not None:
        if output.get("effort") is not None:
            chat["reasoning_effort"] = "xhigh" if output["effort"] == "max" else output["effort"]
        fmt = output.get("format")
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.get("schema")}}
    for name in ("reasoning_budget", "repetition_penalty", "seed", "lora", "response_format"):
        if data.get(name) is not None:
            chat[name] = data[name]
    _tools(data, chat)
    return translated_chat_request(data, chat, request_id, model_name, template, NAMES)


# -- the answer -------------------------------------------------------------------------


def reply_maker(app):
    def make(request_id: str, created: int, opts: Options, index: int) -> MessagesReply:
        return MessagesReply(request_id, opts.model)

    make.chat = True  # type: ignore[attr-defined]
    return make


def counted(tokens: int) -> dict:
    """/v1/messages/count_tokens's answer."""
    return {"input_tokens": tokens}


def _event(name: str, data: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _encode(data) + b"\n\n"


class MessagesReply:
    """One Messages answer, whole or as its events (the Exchange's Reply
    interface)."""

    chat = True
    include_usage = True
    headers = SSE_HEADERS

    def __init__(self, request_id: str, model: str):
        self.request_id = request_id
        self.model = model
        self._block = -1  # index of the open content block
        self._kind: bool | None = None  # the open block: True thinking, False text, None none

    def _message(self, content: list, stop_reason: str | None, usage: dict) -> dict:
        return {
            "id": self.request_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": None,
            "usage": usage,
        }

    def first(self) -> bytes:
        return _event("message_start", {"type": "message_start", "message": self._message([], None, {"input_tokens": 0, "output_tokens": 0})})

    def _close(self) -> bytes:
        if self._kind is None:
            return b""
        out = b""
        if self._kind:
            # Anthropic signs its thinking; a local model's is unsigned.
            out += _event("content_block_delta", {"type": "content_block_delta", "index": self._block, "delta": {"type": "signature_delta", "signature": ""}})
        self._kind = None
        return out + _event("content_block_stop", {"type": "content_block_stop", "index": self._block})

    def piece(self, text: str, reasoning: bool = False) -> bytes:
        out = b""
        if self._kind is not reasoning:
            out += self._close()
            self._block += 1
            self._kind = reasoning
            block = {"type": "thinking", "thinking": "", "signature": ""} if reasoning else {"type": "text", "text": ""}
            out += _event("content_block_start", {"type": "content_block_start", "index": self._block, "content_block": block})
        delta = {"type": "thinking_delta", "thinking": text} if reasoning else {"type": "text_delta", "text": text}
        return out + _event("content_block_delta", {"type": "content_block_delta", "index": self._block, "delta": delta})

    def raw_piece(self, raw: bytes, reasoning: bool) -> bytes:
        return self.piece(msgspec.json.decode(raw), reasoning)

    def tool_calls(self, calls: list[dict]) -> bytes:
        out = self._close()
        for call in calls:
            self._block += 1
            block = {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"], "input": {}}
            out += _event("content_block_start", {"type": "content_block_start", "index": self._block, "content_block": block})
            out += _event(
                "content_block_delta",
                {"type": "content_block_delta", "index": self._block, "delta": {"type": "input_json_delta", "partial_json": call["function"]["arguments"]}},
            )
            out += _event("content_block_stop", {"type": "content_block_stop", "index": self._block})
        return out

    def last(self, finish_reason: str, figures: dict | None) -> bytes:
        figures = figures or {}
        usage = {"input_tokens": figures.get("prompt_tokens", 0), "output_tokens": figures.get("completion_tokens", 0)}
        out = self._close()
        out += _event(
            "message_delta",
            {"type": "message_delta", "delta": {"stop_reason": STOP_REASON.get(finish_reason, "end_turn"), "stop_sequence": None}, "usage": usage},
        )
        return out + _event("message_stop", {"type": "message_stop"})

    def whole(self, text: str, reasoning: str | None, finish_reason: str, figures: dict, tool_calls: list[dict] | None = None) -> bytes:
        content: list[dict] = []
        if reasoning:
            content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
        if tool_calls:
            text = text.strip()
        if text:
            content.append({"type": "text", "text": text})
        for call in tool_calls or ():
            content.append(
                {
                    "type": "tool_use",
                    "id": "toolu_" + call["id"].removeprefix("call_"),
                    "name": call["function"]["name"],
                    "input": json.loads(call["function"]["arguments"]),
                }
            )
        usage = {"input_tokens": figures["prompt_tokens"], "output_tokens": figures["completion_tokens"]}
        cached = (figures.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached:
            usage["cache_read_input_tokens"] = cached
        return _encode(self._message(content, STOP_REASON.get(finish_reason, "end_turn"), usage))

    def stream_error(self, error: HttpError) -> bytes:
        return _event("error", msgspec.json.decode(error_body(error.status, error.message)))
