"""Embeddings over HTTP: OpenAI's `/v1/embeddings`, Ollama's `/api/embed`
and its older `/api/embeddings`.

Each body becomes the pool's `embed` op (supervisor.embeddings checks its
`input`), run on a model of kind "embedding"; `Vectors` is the request's
sink: it keeps each input's vector (base64 of float32, as the worker
wrote it) until the last one, then the answer is built in the route's
shape. What a request holds is bounded by its inputs (MAX_EMBED_INPUTS)
times the model's vector length.
"""

from __future__ import annotations

import array
import asyncio
import base64
import logging
import sys
import time

import msgspec

from ipc.events import INTERNAL, PREFIX
from supervisor.embeddings import embed_inputs
from supervisor.httpapi import ollama
from supervisor.httpapi.shapes import HttpError, bad, json_object
from supervisor.requests import BadRequest, ClientLine, parse_line

log = logging.getLogger("lattice.http")
_encode = msgspec.json.Encoder().encode
_SKIP = len(PREFIX)


class _Vector(msgspec.Struct, tag_field="ev", tag="embedding"):
    index: int
    embedding: str
    prompt_tokens: int = 0


class _Done(msgspec.Struct, tag_field="ev", tag="gen_token"):
    prompt_tokens: int = 0
    total_ms: float = 0.0
    finish_reason: str | None = None


class _Error(msgspec.Struct, tag_field="ev", tag="error"):
    msg: str = ""
    code: str | None = None


_line = msgspec.json.Decoder(_Vector | _Done | _Error)


def floats(b64: str) -> list[float]:
    """A vector the worker wrote (base64 of little-endian float32) as numbers."""
    values = array.array("f", base64.b64decode(b64))
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


class Vectors:
    """The sink of one embeddings request: its vectors by input index, then
    `ended` with `error` or `prompt_tokens` set."""

    def __init__(self, request_id: str, count: int):
        self.request_id = request_id
        self.vectors: list[str | None] = [None] * count
        self.changed = asyncio.Event()
        self.ended = False
        self.error: HttpError | None = None
        self.prompt_tokens = 0
        self.worker_ms = 0.0  # the request's time in its worker

    def write(self, data: bytes) -> None:
        for line in data.splitlines():
            if self.ended:
                break
            try:
                event = _line.decode(line[_SKIP:])
                if isinstance(event, _Vector):
                    self.vectors[event.index] = event.embedding
                    continue
            except (msgspec.DecodeError, msgspec.ValidationError, IndexError):
                # A sink must not raise into the slot whatever it is given.
                log.error("http: unreadable line for request %s: %r", self.request_id, line[:200])
                self._end(HttpError(500, "internal error: the model's answer could not be read", "server_error", INTERNAL))
                break
            if isinstance(event, _Error):
                self._end(HttpError.from_pool(event.code, event.msg))
            elif event.finish_reason == "cancelled":
                self._end(HttpError(503, "the request was cancelled: its model was unloaded or the pool is shutting down", "server_error", "cancelled"))
            elif None in self.vectors:
                self._end(HttpError(500, "internal error: the model left inputs without a vector", "server_error", INTERNAL))
            else:
                self.prompt_tokens = event.prompt_tokens
                self.worker_ms = event.total_ms
                self._end(None)
        self.changed.set()

    def _end(self, error: HttpError | None) -> None:
        self.ended = True
        self.error = error


class Request(msgspec.Struct):
    """How to answer: the route's shape, and what it asked for."""

    model: str
    count: int
    shape: str  # "openai", "ollama" (/api/embed) or "legacy" (/api/embeddings)
    base64: bool = False
    keep_alive: float | None | bool = False  # Ollama's; False: none given
    started: int = 0  # time.monotonic_ns()


def _line_for(body: dict, request_id: str) -> ClientLine:
    try:
        return parse_line(_encode({"op": "embed", "id": request_id, **body}))
    except BadRequest as exc:
        msg = exc.msg.removeprefix("malformed request: ")
        raise bad(msg, "dimensions" if "dimensions" in msg else "truncate" if "truncate" in msg else None) from None


def openai_request(body: bytes, request_id: str, model_name) -> tuple[ClientLine, Request]:
    data = json_object(body)
    model = model_name(data.get("model"))
    fmt = data.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise bad('encoding_format must be "float" or "base64"', "encoding_format")
    try:
        count = len(embed_inputs(data.get("input")))
    except ValueError as exc:
        raise bad(str(exc), "input") from None
    # OpenAI refuses an input over the model's context rather than cut it.
    line = _line_for({"model": model, "input": data["input"], "dimensions": data.get("dimensions"), "truncate": False}, request_id)
    return line, Request(model, count, "openai", base64=fmt == "base64", started=time.monotonic_ns())


def ollama_request(body: bytes, request_id: str, model_name, legacy: bool) -> tuple[ClientLine, Request]:
    data = json_object(body)
    model = model_name(data.get("model"))
    keep = ollama.keep_alive_seconds(data.get("keep_alive"))
    if legacy:
        given = data.get("prompt")
        if not isinstance(given, str) or not given:
            raise bad("prompt must be a non-empty string", "prompt")
    else:
        given = data.get("input")
        if not (isinstance(given, str) or (isinstance(given, list) and all(isinstance(x, str) for x in given))):
            raise bad("input must be a string or a list of strings", "input")
    count = 1 if isinstance(given, str) else len(given)
    # Ollama cuts an input over the context unless truncate is false.
    fields = {"model": model, "input": given, "truncate": data.get("truncate", True) is not False, "dimensions": data.get("dimensions")}
    line = _line_for(fields, request_id)
    return line, Request(model, count, "legacy" if legacy else "ollama", keep_alive=keep, started=time.monotonic_ns())


def answer(request: Request, vectors: Vectors) -> bytes:
    tokens = vectors.prompt_tokens
    if request.shape == "openai":
        data = [{"object": "embedding", "index": i, "embedding": v if request.base64 else floats(v)} for i, v in enumerate(vectors.vectors)]
        return _encode({"object": "list", "data": data, "model": request.model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
    if request.shape == "legacy":
        return _encode({"embedding": floats(vectors.vectors[0])})
    total = time.monotonic_ns() - request.started
    # As on /api/chat: what came before the worker began (a load, a wait).
    load = total - min(total, int(vectors.worker_ms * 1e6))
    return _encode(
        {
            "model": request.model,
            "embeddings": [floats(v) for v in vectors.vectors],
            "total_duration": total,
            "load_duration": load,
            "prompt_eval_count": tokens,
        }
    )
