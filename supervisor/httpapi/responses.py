"""OpenAI's Responses API (`POST /v1/responses`) on the same pool.

A body is read as the chat request it means (`instructions` as the system
turn, `input` as text or items: messages, `function_call`,
`function_call_output`; `tools` and `tool_choice` in Responses' flat shape;
`max_output_tokens`, `reasoning.effort`, `text.format`) and run through the
chat path; the answer is a `response` object whose `output` holds
`reasoning`, `message` and `function_call` items, or its stream of events
(`response.created`, `response.output_item.added`,
`response.output_text.delta`, ..., `response.completed`), each with its
`sequence_number`.

`previous_response_id` continues a conversation: the pool keeps each
stored response's conversation (input and output, without its
`instructions`, as OpenAI does) in memory, at most MAX_RESPONSES of them
and MAX_BYTES in all, least recently used out, and lost on restart. A
response made with `"store": false` is not kept.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec

from supervisor.httpapi.shapes import SSE_HEADERS, HttpError, Options, bad, json_object, optional_bool, optional_object, translated_chat_request
from supervisor.httpapi.tools import TemplateInfo

PREFIX = "resp_"

log = logging.getLogger("lattice.http")
MAX_RESPONSES = 256
MAX_BYTES = 64 * 1024 * 1024
_encode = msgspec.json.Encoder().encode


def error(exc: HttpError) -> HttpError:
    return exc  # OpenAI's error shape, as the chat's


class ResponseStore:
    """Conversations of stored responses, by response id: bounded in count
    and bytes, least recently used out."""

    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES):
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, tuple[bytes, int]] = OrderedDict()
        self._bytes = 0

    def put(self, response_id: str, messages: list[dict]) -> None:
        data = _encode(messages)
        if len(data) > self.max_bytes:
            return
        self._items[response_id] = (data, len(data))
        self._bytes += len(data)
        while len(self._items) > self.max_responses or self._bytes > self.max_bytes:
            _, (_, size) = self._items.popitem(last=False)
            self._bytes -= size

    def get(self, response_id: str) -> list[dict] | None:
        found = self._items.get(response_id)
        if found is None:
            return None
        self._items.move_to_end(response_id)
        return msgspec.json.decode(found[0])


# -- the request --------------------------------------------------------------------------


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad("message content must be a string or a list of parts", "input")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise bad(f"content part of type {part.get('type') if isinstance(part, dict) else None!r} is not supported: text only", "input")
        texts.append(part["text"])
    return "".join(texts)


def _input_messages(value: Any) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise bad('"input" must be a string or a list of items', "input")
    out: list[dict] = []
    for item in value:
        if not isinstance(item, dict):
            raise bad("each input item must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("user", "assistant", "system"):
                raise bad(f"input message role {item.get('role')!r} is not user, assistant, system or developer", "input")
            out.append({"role": role, "content": _text(item.get("content"))})
        elif kind == "function_call":
            call = {"id": str(item.get("call_id", "")), "type": "function", "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": output if isinstance(output, str) else _text(output)})
        elif kind == "reasoning":
            continue  # earlier turns' reasoning: chat templates drop it too
        elif kind == "additional_tools":
            # Codex's leading item of its own tool namespaces, run on its
            # side; the pool serves the request's function tools.
            continue
        else:
            raise bad(f"input items of type {kind!r} are not supported", "input")
    return out


def _tools(data: dict, chat: dict) -> list[str]:
    """The body's function tools into `chat`; returns the types of the
    other tools it gave, which are left out: OpenAI's hosted tools
    (web_search, file_search, image_generation, ...) and Codex's own kinds
    run on OpenAI's side or in the client's, and an agent sends them with
    its function tools in every request (refusing them refused the agent)."""
    tools = data.get("tools")
    skipped: list[str] = []
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools must be a list", "tools")
        converted = []
        for tool in tools:
            if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
                raise bad("each tool must be an object with a type", "tools")
            if tool["type"] != "function":
                skipped.append(tool["type"][:40])
                continue
            function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
            converted.append({"type": "function", "function": function})
        if converted or not skipped:
            chat["tools"] = converted
    choice = data.get("tool_choice")
    if isinstance(choice, dict):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}} if choice.get("type") == "function" else "invalid"
    elif choice is not None:
        chat["tool_choice"] = choice
    if data.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = data["parallel_tool_calls"]
    return skipped


# Chat fields as this API names them, for its errors.
NAMES = {"max_tokens": "max_output_tokens", "messages": "input"}


def request(body: bytes, request_id: str, model_name: Callable, template: Callable[[str], TemplateInfo], app) -> tuple:
    data = json_object(body)
    if data.get("input") is None:
        raise bad('missing "input" field', "input")
    history: list[dict] = []
    previous = data.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str):
            raise bad("previous_response_id must be a string", "previous_response_id")
        found = app.stored.get(previous)
        if found is None:
            raise HttpError(
                404,
                f"previous response {previous[:100]!r} is not kept here (the pool keeps the last {MAX_RESPONSES} stored responses, in memory)",
                code="not_found",
                param="previous_response_id",
            )
        history = found
    conversation = history + _input_messages(data["input"])
    instructions = data.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions must be a string", "instructions")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    chat: dict = {"model": data.get("model"), "messages": messages}
    for ours, theirs in (("max_tokens", "max_output_tokens"), ("temperature", "temperature"), ("top_p", "top_p"), ("stream", "stream")):
        if data.get(theirs) is not None:
            chat[ours] = data[theirs]
    for name in ("top_k", "repetition_penalty", "seed", "lora", "reasoning_budget"):
        if data.get(name) is not None:
            chat[name] = data[name]
    reasoning = optional_object(data, "reasoning")
    if reasoning is not None and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    fmt = (optional_object(data, "text") or {}).get("format")
    store = optional_bool(data, "store", True)
    metadata = optional_object(data, "metadata") or {}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    skipped = _tools(data, chat)
    if skipped:
        log.info("http: request %s: tools of type %s left out (function tools only)", request_id, ", ".join(sorted(set(skipped))))
    msg, opts = translated_chat_request(data, chat, request_id, model_name, template, NAMES)
    opts.extra = {
        "conversation": conversation,
        "store": store,
        "echo": {
            "instructions": instructions,
            "previous_response_id": previous,
            "tools": data.get("tools") or [],
            "tool_choice": data.get("tool_choice", "auto"),
            "parallel_tool_calls": data.get("parallel_tool_calls", True),
            "temperature": data.get("temperature"),
            "top_p": data.get("top_p"),
            "max_output_tokens": data.get("max_output_tokens"),
            "metadata": metadata,
            "text": {"format": fmt if isinstance(fmt, dict) else {"type": "text"}},
            "store": store,
        },
    }
    return msg, opts


# -- the answer -------------------------------------------------------------------------


def reply_maker(app):
    def make(request_id: str, created: int, opts: Options, index: int) -> ResponsesReply:
        return ResponsesReply(request_id, opts.model, opts.extra, app.stored)

    make.chat = True  # type: ignore[attr-defined]
    return make


def counted(tokens: int) -> dict:
    """/v1/responses/input_tokens's answer."""
    return {"object": "response.input_tokens", "input_tokens": tokens}


def _usage(figures: dict) -> dict:
    cached = (figures.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": figures["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": figures["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": figures["total_tokens"],
    }


def _call_item(call: dict, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": "fc_" + call["id"].removeprefix("call_"),
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": status,
    }


class ResponsesReply:
    """One Responses answer, whole or as its events (the Exchange's Reply
    interface); keeps the conversation when the response is stored."""

    chat = True
    include_usage = True
    headers = SSE_HEADERS

    def __init__(self, request_id: str, model: str, extra: dict, store: ResponseStore):
        self.request_id = request_id
        self.model = model
        self.extra = extra
        self.store = store
        self.created = int(time.time())
        self._seq = 0
        self._items: list[dict] = []  # output items finished so far
        self._open: dict | None = None  # the item being written
        self._kind: bool | None = None  # True reasoning, False text
        self._text: list[str] = []

    def _response(self, status: str, output: list[dict], figures: dict | None, incomplete: dict | None = None) -> dict:
        return {
            "id": self.request_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "usage": _usage(figures) if figures is not None else None,
            "error": None,
            "incomplete_details": incomplete,
            "truncation": "disabled",
            **self.extra["echo"],
        }

    def _event(self, kind: str, data: dict) -> bytes:
        body = {"type": kind, "sequence_number": self._seq, **data}
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encode(body) + b"\n\n"

    def first(self) -> bytes:
        created = self._response("in_progress", [], None)
        return self._event("response.created", {"response": created}) + self._event("response.in_progress", {"response": created})

    def _close(self) -> bytes:
        item = self._open
        if item is None:
            return b""
        self._open = None
        index = len(self._items)
        text = "".join(self._text)
        self._text = []
        if self._kind:
            item["content"] = [{"type": "reasoning_text", "text": text}]
            out = self._event("response.reasoning_text.done", {"item_id": item["id"], "output_index": index, "content_index": 0, "text": text})
        else:
            part = {"type": "output_text", "text": text, "annotations": []}
            item["content"] = [part]
            item["status"] = "completed"
            out = self._event("response.output_text.done", {"item_id": item["id"], "output_index": index, "content_index": 0, "text": text, "logprobs": []})
            out += self._event("response.content_part.done", {"item_id": item["id"], "output_index": index, "content_index": 0, "part": part})
        self._items.append(item)
        return out + self._event("response.output_item.done", {"output_index": index, "item": item})

    def piece(self, text: str, reasoning: bool = False) -> bytes:
        out = b""
        if self._open is None or self._kind is not reasoning:
            out += self._close()
            self._kind = reasoning
            index = len(self._items)
            if reasoning:
                self._open = {"type": "reasoning", "id": "rs_" + secrets.token_hex(12), "summary": []}
                out += self._event("response.output_item.added", {"output_index": index, "item": {**self._open, "content": []}})
            else:
                self._open = {"type": "message", "id": "msg_" + secrets.token_hex(12), "status": "in_progress", "role": "assistant", "content": []}
                out += self._event("response.output_item.added", {"output_index": index, "item": dict(self._open)})
                part = {"type": "output_text", "text": "", "annotations": []}
                out += self._event("response.content_part.added", {"item_id": self._open["id"], "output_index": index, "content_index": 0, "part": part})
        self._text.append(text)
        index = len(self._items)
        if reasoning:
            return out + self._event("response.reasoning_text.delta", {"item_id": self._open["id"], "output_index": index, "content_index": 0, "delta": text})
        return out + self._event(
            "response.output_text.delta", {"item_id": self._open["id"], "output_index": index, "content_index": 0, "delta": text, "logprobs": []}
        )

    def raw_piece(self, raw: bytes, reasoning: bool) -> bytes:
        return self.piece(msgspec.json.decode(raw), reasoning)

    def tool_calls(self, calls: list[dict]) -> bytes:
        out = self._close()
        for call in calls:
            index = len(self._items)
            item = _call_item(call)
            out += self._event("response.output_item.added", {"output_index": index, "item": {**item, "arguments": "", "status": "in_progress"}})
            out += self._event("response.function_call_arguments.delta", {"item_id": item["id"], "output_index": index, "delta": item["arguments"]})
            out += self._event(
                "response.function_call_arguments.done", {"item_id": item["id"], "output_index": index, "name": item["name"], "arguments": item["arguments"]}
            )
            out += self._event("response.output_item.done", {"output_index": index, "item": item})
            self._items.append(item)
        return out

    def _finish(self, finish_reason: str, figures: dict) -> dict:
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        response = self._response("incomplete" if incomplete else "completed", self._items, figures, incomplete)
        self._keep()
        return response

    def _keep(self) -> None:
        if not self.extra["store"]:
            return
        text = "".join(i["content"][0]["text"] for i in self._items if i["type"] == "message")
        calls = [
            {"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
            for i in self._items
            if i["type"] == "function_call"
        ]
        answer: dict = {"role": "assistant", "content": text or (None if calls else "")}
        if calls:
            answer["tool_calls"] = calls
        self.store.put(self.request_id, self.extra["conversation"] + [answer])

    def last(self, finish_reason: str, figures: dict | None) -> bytes:
        out = self._close()
        response = self._finish(finish_reason, figures or {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0})
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return out + self._event(kind, {"response": response})

    def whole(self, text: str, reasoning: str | None, finish_reason: str, figures: dict, tool_calls: list[dict] | None = None) -> bytes:
        if reasoning:
            self._items.append(
                {"type": "reasoning", "id": "rs_" + secrets.token_hex(12), "summary": [], "content": [{"type": "reasoning_text", "text": reasoning}]}
            )
        if tool_calls:
            text = text.strip()
        if text or not tool_calls:
            part = {"type": "output_text", "text": text, "annotations": []}
            self._items.append({"type": "message", "id": "msg_" + secrets.token_hex(12), "status": "completed", "role": "assistant", "content": [part]})
        self._items.extend(_call_item(call) for call in tool_calls or ())
        return _encode(self._finish(finish_reason, figures))

    def stream_error(self, error: HttpError) -> bytes:
        return self._event("error", {"code": error.code, "message": error.message, "param": error.param})
