"""The part of Ollama's API that apps call, on the same pool: `/api/chat`,
`/api/generate` (NDJSON when streaming, Ollama's default), `/api/tags`,
`/api/ps`, `/api/show`, `/api/version`. Chat and generate bodies are read
as the chat (or, for a raw generate, the completion) request they mean and
run through that path; answers and errors (`{"error": "..."}`) are in
Ollama's shapes. `keep_alive` sets how long the model's worker stays after
the request (a duration or seconds; negative: for ever; 0: unloaded once
idle), in place of its configured keep_alive.
"""

from __future__ import annotations

import importlib.metadata
import json
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import msgspec

from supervisor.config import parse_duration
from supervisor.httpapi.logprobs import chat_entry
from supervisor.httpapi.models import list_models, model_name
from supervisor.httpapi.shapes import HttpError, Options, bad, chat_request, completion_request, json_object, optional_bool, optional_object
from supervisor.httpapi.tools import TemplateInfo
from supervisor.local_models import model_format
from supervisor.resolve import UnknownModel

PREFIX = "ollama-"
NDJSON_HEADERS = [(b"content-type", b"application/x-ndjson"), (b"cache-control", b"no-cache")]
_encode = msgspec.json.Encoder().encode

# Ollama's option names for the pool's request fields.
OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "num_predict": "max_tokens",
    "repeat_penalty": "repetition_penalty",
    "stop": "stop",
}
DONE_REASON = {"stop": "stop", "length": "length", "tool_calls": "stop"}


class OllamaError(HttpError):
    def body(self) -> bytes:
        return _encode({"error": self.message})


def error(exc: HttpError) -> HttpError:
    return OllamaError(exc.status, exc.message, exc.type, exc.code, exc.param)


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def keep_alive_seconds(value: Any) -> float | None | bool:
    """Ollama's keep_alive as seconds (None: for ever); False when absent."""
    if value is None:
        return False
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return None if value < 0 else float(value)
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("-"):
            return None
        try:
            return parse_duration(text)
        except ValueError:
            raise bad(f"keep_alive {value[:40]!r} is not a duration (e.g. '5m', 300, -1)", "keep_alive") from None
    raise bad("keep_alive must be a duration string or a number of seconds", "keep_alive")


def _common(data: dict, chat: dict, raw_completion: bool = False) -> None:
    options = optional_object(data, "options") or {}
    for theirs, ours in OPTIONS.items():
        value = options.get(theirs)
        if value is None or (theirs == "num_predict" and isinstance(value, int) and value < 0):
            continue  # num_predict -1: no limit of the client's; the pool's max_tokens holds
        chat[ours] = value
    chat["stream"] = optional_bool(data, "stream", True)
    fmt = data.get("format")
    if fmt == "json":
        chat["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    elif fmt not in (None, ""):
        raise bad('format must be "json" or a JSON schema', "format")
    if raw_completion:
        # The legacy completions' field: the count of alternatives.
        if data.get("logprobs"):
            chat["logprobs"] = data.get("top_logprobs") or 0
    else:
        for name in ("logprobs", "top_logprobs"):
            if data.get(name) is not None:
                chat[name] = data[name]
    think = data.get("think")
    if think is False:
        chat["reasoning_budget"] = 0
    elif isinstance(think, str):
        chat["reasoning_effort"] = think


# The roles of an Ollama chat message.
OLLAMA_ROLES = ("system", "user", "assistant", "tool")


def _messages(raw: Any) -> list[dict]:
    if not isinstance(raw, list):
        raise bad('"messages" must be a list', "messages")
    out = []
    for m in raw:
        if not isinstance(m, dict):
            raise bad("each message must be an object", "messages")
        if m.get("images"):
            raise bad("images are not supported: text only", "messages")
        if m.get("role") not in OLLAMA_ROLES:
            # A chat template writes any role it is given into the prompt.
            raise bad(f"message role {m.get('role')!r} is not one of {', '.join(OLLAMA_ROLES)}", "messages")
        message = {"role": m["role"], "content": m.get("content") or ""}
        calls = m.get("tool_calls")
        if calls:
            if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls):
                raise bad('tool_calls must be a list of {"function": {"name": ..., "arguments": {...}}}', "messages")
            message["tool_calls"] = [
                {
                    "id": f"call_{i}",
                    "type": "function",
                    "function": {"name": c["function"].get("name"), "arguments": json.dumps(c["function"].get("arguments") or {})},
                }
                for i, c in enumerate(calls)
            ]
        if m.get("tool_name") is not None:
            message["name"] = m["tool_name"]
        out.append(message)
    return out


class Unload(Exception):
    """A body with nothing to generate and keep_alive 0: Ollama's way to
    unload a model now (`ollama stop`); the route answers it without a
    request."""

    def __init__(self, model: str, generate: bool):
        super().__init__(model)
        self.model = model
        self.generate = generate


def unloaded_body(model: str, generate: bool) -> bytes:
    return _encode({"model": model, "created_at": _now(), **_empty(generate), "done_reason": "unload", "done": True})


def _empty(generate: bool) -> dict:
    return {"response": ""} if generate else {"message": {"role": "assistant", "content": ""}}


class _Api:
    """One of the two generating routes."""

    PREFIX = PREFIX
    error = staticmethod(error)

    def __init__(self, generate: bool):
        self.generate = generate

    def request(self, body: bytes, request_id: str, model_name: Callable, template: Callable[[str], TemplateInfo], app) -> tuple:
        data = json_object(body)
        keep = keep_alive_seconds(data.get("keep_alive"))
        raw = False
        # Ollama's clients load a model with a body that asks for nothing
        # (no prompt, no messages) and unload it with that and keep_alive 0.
        load = data.get("prompt" if self.generate else "messages") in (None, "", [])
        if load and keep is not False and keep == 0:
            raise Unload(model_name(data.get("model")), self.generate)
        if load:
            # Counted, not generated (the `count` op): it waits for the
            # worker as a request does, and fails as one does.
            msg, opts = chat_request({"model": data.get("model"), "messages": [{"role": "user", "content": ""}]}, request_id, model_name, template)
            msg.op = "count"
            opts.stream = False
            opts.extra = {"keep_alive": keep, "raw": False, "load": True}
            return msg, opts
        if self.generate:
            prompt = data.get("prompt") or ""
            if not isinstance(prompt, str):
                raise bad("prompt must be a string", "prompt")
            if data.get("images"):
                raise bad("images are not supported: text only", "images")
            raw = optional_bool(data, "raw", False)
            if raw:
                body_ = {"model": data.get("model"), "prompt": prompt}
            else:
                system = data.get("system")
                body_ = {
                    "model": data.get("model"),
                    "messages": ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}],
                }
        else:
            body_ = {"model": data.get("model"), "messages": _messages(data.get("messages"))}
            if data.get("tools") is not None:
                body_["tools"] = data["tools"]
        _common(data, body_, raw)
        try:
            if raw:
                msg, opts = completion_request(body_, request_id, model_name)
            else:
                msg, opts = chat_request(body_, request_id, model_name, template)
        except HttpError as exc:
            raise exc.renamed({ours: f"options.{theirs}" for theirs, ours in OPTIONS.items()}) from None
        opts.include_usage = True
        opts.extra = {"keep_alive": keep, "raw": raw}
        return msg, opts

    def after(self, app, msg, opts: Options) -> None:
        """The request's keep_alive, for its worker from now on."""
        keep = opts.extra["keep_alive"]
        if keep is False:
            return
        try:
            spec = app.pool.resolve(msg.model, msg.lora)
        except UnknownModel:  # its path broke meanwhile; the request said so
            return
        app.pool.keep_alive(spec, keep)

    def reply_maker(self, app):
        generate = self.generate

        def make(request_id: str, created: int, opts: Options, index: int) -> OllamaReply:
            return OllamaReply(opts.model, generate, opts.extra["raw"], opts.stream, opts.extra.get("load", False))

        make.chat = True  # type: ignore[attr-defined]
        return make


CHAT = _Api(generate=False)
GENERATE = _Api(generate=True)


class OllamaReply:
    """One answer of /api/chat or /api/generate, whole or as NDJSON lines
    (the Exchange's Reply interface)."""

    chat = True
    include_usage = True
    headers = NDJSON_HEADERS

    def __init__(self, model: str, generate: bool, raw: bool, stream: bool, load: bool = False):
        self.model = model
        self.generate = generate
        self.raw = raw
        self.stream = stream
        self.load = load  # a body that asked for nothing: the model loaded, nothing generated
        self.started = time.monotonic_ns()
        self.request_id = model
        self.worker_ms = (0.0, 0.0)  # (first token, whole request) as its worker timed them

    def _line(self, data: dict) -> bytes:
        return _encode({"model": self.model, "created_at": _now(), **data}) + b"\n"

    def _body(self, text: str, thinking: str | None, calls: list[dict] | None = None) -> dict:
        if self.generate:
            body: dict = {"response": text}
            if thinking:
                body["thinking"] = thinking
            return body
        message: dict = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = [{"function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}} for c in calls]
        return {"message": message}

    def first(self) -> bytes:
        return b""

    def logprob_piece(self, text: str, reasoning: bool, entries: list[dict]) -> bytes:
        line = msgspec.json.decode(self.piece(text, reasoning))
        return self._line({**line, "logprobs": [chat_entry(e) for e in entries]})

    def piece(self, text: str, reasoning: bool = False) -> bytes:
        if reasoning and not self.raw:
            return self._line({**self._body("", text), "done": False})
        return self._line({**self._body(text, None), "done": False})

    def raw_piece(self, raw: bytes, reasoning: bool) -> bytes:
        return self.piece(msgspec.json.decode(raw), reasoning)

    def tool_calls(self, calls: list[dict]) -> bytes:
        return self._line({**self._body("", None, calls), "done": False})

    def timed(self, ttft_ms: float, total_ms: float) -> None:
        self.worker_ms = (ttft_ms, total_ms)

    def _done(self, finish_reason: str, figures: dict) -> dict:
        # Ollama's clients show prompt_eval_count / prompt_eval_duration and
        # eval_count / eval_duration as rates. The worker's clock starts when
        # the request reaches it: what came before (a load, a wait for a
        # place in the batch) is the load's share, its first token's time the
        # prompt's, the rest the reply's; the three add up to the total.
        total = time.monotonic_ns() - self.started
        ttft_ms, worker_ms = self.worker_ms
        worker = min(total, int(worker_ms * 1e6))
        prompt = min(worker, int(ttft_ms * 1e6))
        return {
            "done": True,
            "done_reason": DONE_REASON.get(finish_reason, "stop"),
            "total_duration": total,
            "load_duration": total - worker,
            "prompt_eval_count": figures.get("prompt_tokens", 0),
            "prompt_eval_duration": prompt,
            "eval_count": figures.get("completion_tokens", 0),
            "eval_duration": worker - prompt,
        }

    def last(self, finish_reason: str, figures: dict | None, logprobs: list[dict] | None = None) -> bytes:
        entries = {} if logprobs is None else {"logprobs": [chat_entry(e) for e in logprobs]}
        return self._line({**self._body("", None), **entries, **self._done(finish_reason, figures or {})})

    def whole(
        self, text: str, reasoning: str | None, finish_reason: str, figures: dict, tool_calls: list[dict] | None = None, logprobs: list[dict] | None = None
    ) -> bytes:
        if self.load:
            return _encode({"model": self.model, "created_at": _now(), **_empty(self.generate), "done_reason": "load", "done": True})
        if self.raw and reasoning:
            text, reasoning = reasoning + text, None
        if tool_calls:
            text = text.strip()
        entries = {} if logprobs is None else {"logprobs": [chat_entry(e) for e in logprobs]}
        return _encode({"model": self.model, "created_at": _now(), **self._body(text, reasoning, tool_calls), **entries, **self._done(finish_reason, figures)})

    def stream_error(self, error: HttpError) -> bytes:
        return _encode({"error": error.message}) + b"\n"


# -- information routes ---------------------------------------------------------------


def _details(name: str, pool) -> dict:
    try:
        path = pool.resolve(name).path
        fmt = model_format(path)
    except Exception:
        fmt = "?"
    return {"parent_model": "", "format": "safetensors", "family": "", "families": None, "parameter_size": "", "quantization_level": fmt.upper()}


FOREVER = datetime(2318, 1, 1, tzinfo=UTC)


def _expires(pool, name: str) -> str:
    """When keep_alive unloads the model; for ever is far off, as Ollama says
    it (so is a client's keep_alive of 1e300 seconds, past any datetime)."""
    left = pool.model_state(pool.resolve(name)).expires_in
    at = FOREVER.timestamp() if left is None else min(time.time() + left, FOREVER.timestamp())
    return datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")


def _entry(name: str, pool, size: int, extra: dict | None = None) -> dict:
    return {"name": name, "model": name, "modified_at": _now(), "size": size, "digest": "", "details": _details(name, pool), **(extra or {})}


def _weights_on_disk(name: str, pool) -> int:
    """Bytes of the model's weight files (Ollama's `size` in its list)."""
    try:
        return sum(f.stat().st_size for f in pool.resolve(name).path.glob("*.safetensors"))
    except Exception:  # a path that broke meanwhile: no size, not a failed listing
        return 0


def _running(name: str, pool, row) -> dict:
    """An entry of Ollama's running list: `size` and `size_vram` are the
    worker's measured memory (mlx's arrays, weights included), all of it on
    the device when it computes on a GPU (with no row, not measured: the
    weight files' size, as in the list of models)."""
    size = max(row.mlx_active_bytes, row.weights_bytes) if row is not None else _weights_on_disk(name, pool)
    on_gpu = row is not None and row.processor in ("cuda", "metal")
    return _entry(name, pool, size, {"expires_at": _expires(pool, name), "size_vram": size if on_gpu else 0})


def _version() -> str:
    try:
        return importlib.metadata.version("lattice-pool")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


async def info(app, path: str, body: bytes) -> bytes:
    pool = app.pool
    if path == "/api/version":
        return _encode({"version": _version()})
    if path == "/api/tags":
        return _encode({"models": [_entry(m["id"], pool, _weights_on_disk(m["id"], pool)) for m in await list_models(pool)]})
    if path == "/api/ps":
        live = [m for m in await list_models(pool) if m["loaded"]]
        rows = {row.model: row for row in (await pool.status()).models if row.lora is None} if live else {}
        return _encode({"models": [_running(m["id"], pool, rows.get(m["id"])) for m in live]})
    # /api/show
    data = json_object(body)
    name = data.get("model", data.get("name"))
    try:
        name = model_name(pool, name)
    except HttpError as exc:
        raise HttpError(404 if exc.status == 404 else exc.status, f"model {str(name)[:100]!r} not found" if exc.status == 404 else exc.message) from None
    entry = pool.configured(name)
    return _encode(
        {
            "modelfile": "",
            "parameters": "",
            "template": "",
            "details": _details(name, pool),
            "model_info": {},
            "capabilities": ["embedding"] if entry is not None and entry.kind == "embedding" else ["completion", "tools", "thinking"],
            "modified_at": _now(),
            "license": "",
            "lora": entry.lora if entry is not None else None,
        }
    )
