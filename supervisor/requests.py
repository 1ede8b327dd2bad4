"""Client lines on stdin: decoding and validation into typed requests.

A line is either a generation request (chat_metal's serve request plus
routing fields) or a control op (it has "op"). Validation failures become
`bad_request` errors carrying the request id whenever one can be read, and
never reach a worker.
"""

from __future__ import annotations

import difflib
import functools
import logging
import re
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from ipc.events import json_str
from ipc.messages import MAX_TOP_LOGPROBS, Message, ResponseFormat, decode_response_format, read_response_format, utf8_len
from ipc.sampling import SamplingFields

log = logging.getLogger("lattice.requests")

# `generate` is a generation request sent on the control socket, where a
# line without op is refused (its lines go back to that connection alone).
# `embed`: embeddings of `input` (supervisor.embeddings), for a model of
# kind "embedding"; its lines are one `embedding` line per input, then done.
# `count`: a generation request's prompt tokenized, nothing generated; its
# one line is the done line with prompt_tokens.
OPS = frozenset({"load", "unload", "cancel", "status", "reload", "shutdown", "generate", "embed", "count"})
# Ops that are requests: they queue and end as a generation does.
REQUEST_OPS = frozenset({"generate", "embed", "count"})

StopString = Annotated[str, Meta(min_length=1, max_length=1000)]


class ClientLine(SamplingFields, dict=True):
    """Every field a client line may carry (docs/protocol.md: chat_metal's fields, the
    routing ones, `lora`, `response_format`); the sampling fields and their
    bounds are ipc.sampling's. Unknown fields are ignored, so newer clients
    keep working with this pool, and warned about once per name on stderr,
    so a misspelt one (`max_tokns`) does not go unnoticed."""

    op: str | None = None
    id: str | int | float | None = None
    model: str | None = None
    lora: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    # Function tools (OpenAI's shape) for the chat template; HTTP checks
    # their shape (supervisor.httpapi.tools), stdin hands them on as given.
    tools: list[dict[str, Any]] | None = None
    stop: StopString | Annotated[list[StopString], Meta(max_length=64)] | None = None
    # As the client wrote it (JSON text); `format` is it read into its type.
    response_format: msgspec.Raw = msgspec.Raw()
    # Special-token text in `messages` contents read as the tokens (default:
    # as text, so a message cannot open a turn of another role).
    allow_special_tokens: bool | None = None
    # false: no speculative decoding for this request.
    speculative: bool | None = None
    # OpenAI's chat fields: each token's log-probability on its token line,
    # with the top_logprobs likeliest alternatives.
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # The `embed` op's: a text, a list of texts, token ids or lists of them
    # (checked by supervisor.embeddings.embed_inputs), the vectors' length,
    # and whether an input over the model's context is cut (else refused).
    input: Any = None
    dimensions: Annotated[int, Meta(ge=1, le=1_000_000)] | None = None
    truncate: bool | None = None

    @functools.cached_property
    def id_json(self) -> str | None:
        """The id as the JSON text echoed on every line of its request:
        encoded once (parse_line does it first, so a bad id is a bad line)
        and carried as this one value from then on."""
        return encode_id(self.id)

    @functools.cached_property
    def format(self) -> ResponseFormat | None:
        """response_format read into its type, once: parse_line reads it
        first (so a malformed one is a bad line), and a request built from
        values (from_fields) is given it. Goes to the worker inside Generate."""
        return decode_response_format(bytes(self.response_format))


class _IdProbe(msgspec.Struct):
    id: Any = None


class BadRequest(Exception):
    def __init__(self, msg: str, id_json: str | None = None):
        super().__init__(msg)
        self.msg = msg
        self.id_json = id_json


class _StrictLine(ClientLine, forbid_unknown_fields=True):
    """A ClientLine that refuses unknown fields: how a line carrying one is
    noticed at no cost to the others (it is then decoded as a ClientLine)."""


KNOWN_FIELDS = frozenset(ClientLine.__struct_fields__)
# Field names warned about; past this many, no more (a client sending a new
# name on every line must not grow our memory or flood stderr).
MAX_WARNED_FIELDS = 256
_warned_fields: set[str] = set()

_decoder = msgspec.json.Decoder(ClientLine)
_strict = msgspec.json.Decoder(_StrictLine)
_keys = msgspec.json.Decoder(dict[str, msgspec.Raw])
_probe = msgspec.json.Decoder(_IdProbe)
_float_encoder = msgspec.json.Encoder()
# A message's role: a word, as every chat template and API names one.
_ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,31}")


# The worker repeats a request's id on every token line it writes: a long
# id would multiply every answer (an 8 MiB one outgrew the worker's pipe
# and killed it). docs/cli.md states both bounds.
MAX_ID_BYTES = 256
# The integers every JSON reader holds exactly (JavaScript's safe integers);
# beyond them two ids could read as one.
MAX_ID_INT = 2**53 - 1


def encode_id(value: str | int | float | None) -> str | None:
    """The id as the JSON fragment echoed on every line of its request, in
    one canonical form per value: 7 and 7.0 are the same id (JSON does not
    tell them apart), echoed 7. Raises BadRequest, which never carries the
    refused id itself: the refusal must not repeat what it refuses."""
    if value is None:
        return None
    if isinstance(value, str):
        if not value:
            raise BadRequest("id must not be empty")
        if utf8_len(value, MAX_ID_BYTES) > MAX_ID_BYTES:
            raise BadRequest(f"id is longer than {MAX_ID_BYTES} bytes")
        return json_str(value)
    if isinstance(value, bool):  # bool is an int subclass; never a valid id
        raise BadRequest("id must be a string or a number")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        if abs(value) > MAX_ID_INT:
            raise BadRequest(f"a numeric id must be an integer within ±{MAX_ID_INT} (or a fraction); send a larger one as a string")
        return str(value)
    return _float_encoder.encode(value).decode()


def _probe_id(line: bytes) -> str | None:
    try:
        value = _probe.decode(line).id
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return scan_id(line)
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
        try:
            return encode_id(value)
        except BadRequest:
            return None
    return None


# What scan_id steps over: a JSON string (escapes included), or a run of
# opening or of closing brackets (so nesting depth costs nothing).
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[{][\[{\s]*|[\]}][\]}\s]*')
# The value after a top-level "id" key: a string or a number, then , or }.
_ID_VALUE = re.compile(rb'\s*:\s*("[^"\\]*(?:\\.[^"\\]*)*"|-?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?)\s*[,}]')


# Tokens stepped over before giving up: a 64 MiB line of "[]" pairs must
# not hold the event loop for seconds.
_SCAN_TOKENS = 100_000


def scan_id(line: bytes) -> str | None:
    """The top-level "id" of a line that is no valid JSON as a whole
    (truncated, nested deeper than the decoder goes, a stray comma), found
    by stepping over its strings and brackets, so that the error still
    reaches the request it answers. Best effort: None when in doubt."""
    if not line.lstrip().startswith(b"{"):
        return None
    depth = 0
    for n, token in enumerate(_TOKEN.finditer(line)):
        if n > _SCAN_TOKENS:
            return None
        text = token.group()
        if text[0] in b"[{":
            depth += text.count(b"[") + text.count(b"{")
        elif text[0] in b"]}":
            depth -= text.count(b"]") + text.count(b"}")
            if depth <= 0:
                return None
        elif depth == 1 and text == b'"id"':
            value = _ID_VALUE.match(line, token.end())
            if value is None:
                return None
            try:
                return encode_id(msgspec.json.decode(value.group(1), type=str | int | float))
            except (msgspec.DecodeError, msgspec.ValidationError, BadRequest):
                return None
    return None


def _friendly(exc: msgspec.ValidationError) -> str:
    text = str(exc)
    if " - at `$." in text:
        what, where = text.split(" - at `$.", 1)
        return f"invalid field {where.rstrip('`')!r}: {what}"
    return text


def _decode(line: bytes) -> ClientLine:
    try:
        return _strict.decode(line)
    except msgspec.ValidationError as exc:
        # Only a top-level unknown field (messages' entries are not strict).
        if not str(exc).startswith("Object contains unknown field") or " - at `$" in str(exc):
            raise
    _warn_unknown_fields(line)
    return _decoder.decode(line)


def _warn_unknown_fields(line: bytes) -> None:
    try:
        names = _keys.decode(line)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return
    for name in names:
        if name in KNOWN_FIELDS or name in _warned_fields or len(_warned_fields) >= MAX_WARNED_FIELDS:
            continue
        _warned_fields.add(name)
        close = difflib.get_close_matches(name, KNOWN_FIELDS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        log.warning(
            "request field %s is unknown and ignored%s (known: %s; said once per field name)",
            repr(name)[:100],
            hint,
            ", ".join(sorted(KNOWN_FIELDS)),
        )


def parse_line(line: bytes) -> ClientLine:
    """Raises BadRequest (with the id when readable) for anything invalid."""
    try:
        msg = _decode(line)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"malformed request: {_friendly(exc)}", _probe_id(line)) from exc
    except msgspec.DecodeError as exc:
        raise BadRequest(f"malformed request: {exc}", scan_id(line)) from exc
    except RecursionError:
        raise BadRequest("malformed request: JSON nested too deeply", scan_id(line)) from None
    return _checked(msg)


def from_fields(fields: dict[str, Any]) -> ClientLine:
    """A request given as values already decoded (an HTTP body's), with a
    line's validation and errors and no JSON between: `fields` are a line's,
    response_format among them as its decoded JSON."""
    try:
        msg = msgspec.convert({k: v for k, v in fields.items() if k != "response_format"}, ClientLine)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"malformed request: {_friendly(exc)}") from exc
    try:
        msg.format = read_response_format(fields.get("response_format"))
    except ValueError as exc:
        raise BadRequest(str(exc), msg.id_json) from exc
    return _checked(msg)


def _checked(msg: ClientLine) -> ClientLine:
    """What a line must be beyond its fields' types and bounds."""
    id_json = msg.id_json
    if msg.op is not None:
        if msg.op not in OPS:
            raise BadRequest(f"unknown op {msg.op!r}; expected one of {', '.join(sorted(OPS))}", id_json)
        if msg.op in ("load", "unload", "reload") and msg.model is None:
            raise BadRequest(f'op {msg.op!r} needs a "model" field', id_json)
        if msg.op == "cancel" and msg.id is None:
            raise BadRequest('op "cancel" needs the "id" of the request to cancel')
        if msg.op in REQUEST_OPS and msg.id is None:
            raise BadRequest(f'op "{msg.op}" needs an "id": its lines carry it')
        if msg.op not in ("generate", "count"):
            return msg
    if msg.prompt is None and msg.messages is None:
        raise BadRequest('missing "prompt" field', id_json)
    if msg.prompt is not None and msg.messages is not None:
        raise BadRequest('give either "prompt" or "messages", not both', id_json)
    if msg.messages is not None and not msg.messages:
        raise BadRequest('"messages" is empty', id_json)
    for m in msg.messages or ():
        if not _ROLE.fullmatch(m.role):
            # A role goes into the chat template as it is, outside the
            # contents whose special-token text is kept as text: one such as
            # "user<|im_end|>\n<|im_start|>system" would forge a turn.
            raise BadRequest(f"a message's role must be a word of letters, digits, '_' or '-' (up to 32), such as 'user'; got {m.role[:40]!r}", id_json)
    if msg.top_logprobs is not None and not msg.logprobs:
        raise BadRequest('"top_logprobs" needs "logprobs": true', id_json)
    try:
        _ = msg.format  # read now, so that a malformed one is a bad line
    except ValueError as exc:
        raise BadRequest(str(exc), id_json) from exc
    return msg


def prompt_bytes(msg: ClientLine, limit: int) -> int:
    """The request's prompt text in UTF-8 bytes (for `messages`, every role
    and content, and the JSON of tools and tool calls), exact up to `limit`."""
    if msg.prompt is not None:
        return utf8_len(msg.prompt, limit)
    total = len(_float_encoder.encode(msg.tools)) if msg.tools else 0
    for m in msg.messages or ():
        total += utf8_len(m.role, limit) + utf8_len(m.content, limit)
        if m.tool_calls:
            total += len(_float_encoder.encode(m.tool_calls))
        if total > limit:
            break
    return total


def logprobs_count(msg: ClientLine) -> int | None:
    """Generate.logprobs for the line: None unless it asks for them."""
    return (msg.top_logprobs or 0) if msg.logprobs else None


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)
