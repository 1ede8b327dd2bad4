"""Supervisor -> worker messages: one tagged union of msgspec Structs.

The worker answers with `@@lattice` lines only (see ipc.events), so this file
holds every typed message that crosses the pipe in the other direction.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from ipc.sampling import Sampling

# Requests a worker decodes together (its --max-batch; the pool's max_batch),
# measured on a 2-core CPU: docs/performance.md, "Continuous batching".
DEFAULT_MAX_BATCH = 8
# max_batch left to the worker to size (worker.runtime.batch_size).
AUTO_MAX_BATCH = "auto"
# LoRA adapters one worker keeps in memory (its --max-adapters; the pool's
# max_adapters); beyond them the least recently used one that no request
# runs with is dropped, and read again when a request needs it.
DEFAULT_MAX_ADAPTERS = 8
MAX_ADAPTERS_LIMIT = 1024
# The bound of a worker's waiting line: a request beyond it is refused with
# `overloaded`. The pool has at most max_batch requests at a worker, so
# max_batch may not exceed it.
MAX_WAITING = 1024

# Bounds both sides enforce (the pool's config may change them): prompt text
# is refused above this many UTF-8 bytes before it is tokenized, and an
# adapter file above this size before it is read.
DEFAULT_MAX_PROMPT_BYTES = 1 << 20
DEFAULT_MAX_ADAPTER_BYTES = 1 << 30

# The most alternatives a request may ask for with each token's
# log-probability (OpenAI's top_logprobs bound).
MAX_TOP_LOGPROBS = 20


def utf8_len(text: str, limit: int) -> int:
    """UTF-8 bytes of `text`, exact up to `limit`; above it, some number
    above `limit`: a text longer than the limit in characters is longer in
    bytes too, so it is never encoded just to be refused."""
    if text.isascii() or len(text) > limit:
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


class Message(msgspec.Struct, frozen=True, omit_defaults=True):
    role: str
    content: str
    # OpenAI's tool-calling fields (an assistant's calls, a tool result's
    # call id and function name), handed to the chat template as they are.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class Generate(Sampling, tag="generate", frozen=True):
    """One generation request. `rid` is the supervisor's own number for it;
    `id_json` is the client's id, already encoded, echoed on every line.
    Its sampling fields (ipc.sampling) hold values: the request's, else the
    pool's defaults, else chat_metal's."""

    rid: int
    prompt: str | None = None
    messages: list[Message] | None = None
    # Function tools in OpenAI's shape ({"type":"function","function":{...}}),
    # rendered by the chat template (its `tools` variable) with `messages`.
    tools: list[dict[str, Any]] | None = None
    stop: list[str] = []
    id_json: str | None = None
    # The client's response_format, read once by the supervisor (which
    # refuses a malformed one before any worker is touched); the worker
    # compiles it.
    response_format: ResponseFormat | None = None
    # The adapter this request runs with (docs/adapters.md): its path as the
    # supervisor resolved it, or None for the base model.
    lora: str | None = None
    # Special-token text (`<|im_start|>`) in `messages` contents is read as
    # the token only when this is set; otherwise as the characters it is.
    allow_special_tokens: bool = False
    # False: this request decodes without drafts even when the worker has a
    # drafter (speculative decoding); its final line then has no draft counts.
    speculative: bool = True
    # max_tokens came from no one (neither the request nor the pool's
    # defaults): where the prompt leaves less room in the model's context,
    # the worker lowers it to that room instead of refusing the request.
    clip_max_tokens: bool = False
    # None: no log-probabilities. k (0..MAX_TOP_LOGPROBS): each generated
    # token's log-probability and its k likeliest alternatives ride on the
    # token lines (docs/protocol.md); computed only for rows that ask.
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # The `count` op: the prompt is rendered and tokenized as a generation's
    # would be, and the worker answers at once with the final line alone
    # (its prompt_tokens), generating nothing and holding no place in the batch.
    count_only: bool = False


# -- response_format (docs/structured-output.md): OpenAI's shape plus regex and Lark grammar --
# The supervisor reads a client's into these Structs, once; the worker gets
# it typed inside Generate. Unknown fields inside are ignored, as OpenAI adds some over time.

MAX_RESPONSE_FORMAT_BYTES = 256 * 1024


class JsonSchemaSpec(msgspec.Struct, frozen=True):
    schema: dict[str, Any]
    name: str | None = None
    description: str | None = None
    # Accepted for OpenAI compatibility; the schema is always enforced.
    strict: bool | None = None


class JsonObjectFormat(msgspec.Struct, tag_field="type", tag="json_object", frozen=True):
    pass


class JsonSchemaFormat(msgspec.Struct, tag_field="type", tag="json_schema", frozen=True):
    json_schema: JsonSchemaSpec


class RegexFormat(msgspec.Struct, tag_field="type", tag="regex", frozen=True):
    pattern: str


class GrammarFormat(msgspec.Struct, tag_field="type", tag="grammar", frozen=True):
    """`grammar` is in Lark syntax."""

    grammar: str


ResponseFormat = JsonObjectFormat | JsonSchemaFormat | RegexFormat | GrammarFormat
RESPONSE_FORMAT_TYPES = ("json_object", "json_schema", "regex", "grammar")

_json_value = msgspec.json.Decoder()
_json_size = msgspec.json.Encoder()


def decode_response_format(text: bytes | str) -> ResponseFormat | None:
    """A response_format given as JSON text (a stdin line's): None for none
    (empty, null, or OpenAI's {"type": "text"}). Raises ValueError with a
    message fit for a bad_request event."""
    if len(text) > MAX_RESPONSE_FORMAT_BYTES:
        raise ValueError(f"response_format is {len(text)} bytes; the limit is {MAX_RESPONSE_FORMAT_BYTES}")
    if not text:
        return None
    try:
        value = _json_value.decode(text)
    except msgspec.DecodeError as exc:
        raise ValueError(f"response_format is not valid JSON: {exc}") from exc
    return _read_format(value)


def read_response_format(value: object) -> ResponseFormat | None:
    """The same for one given as values (an HTTP body's, already decoded);
    the bound is on JSON bytes, so it is measured as JSON."""
    if value is not None and len(text := _json_size.encode(value)) > MAX_RESPONSE_FORMAT_BYTES:
        raise ValueError(f"response_format is {len(text)} bytes; the limit is {MAX_RESPONSE_FORMAT_BYTES}")
    return _read_format(value)


def _read_format(value: object) -> ResponseFormat | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError('response_format must be an object with a "type"')
    kind = value.get("type")
    if kind == "text":
        # OpenAI's default, sent by clients that set it explicitly: plain
        # text, no constraint, as if absent.
        return None
    if kind is None:
        raise ValueError(f'response_format needs a "type": one of {", ".join(RESPONSE_FORMAT_TYPES)}')
    if kind not in RESPONSE_FORMAT_TYPES:
        raise ValueError(f"unknown response_format type {kind!r}; expected one of {', '.join(RESPONSE_FORMAT_TYPES)}")
    try:
        return msgspec.convert(value, ResponseFormat)
    except msgspec.ValidationError as exc:
        what, _, where = str(exc).partition(" - at `$")
        where = where.rstrip("`")
        raise ValueError(f"invalid response_format{where and ' field ' + repr(where.lstrip('.'))}: {what}") from exc


class Cancel(msgspec.Struct, tag="cancel", frozen=True):
    rid: int


# Adapter messages (docs/adapters.md). The worker handles them in the order they
# come, off the token path, and answers each with one `adapter_loaded` or
# `adapter_error` event naming the path (`adapter_unloaded` for
# UnloadAdapter). A request waits for every adapter message about its
# adapter sent before it; rows already running keep the version they
# started with.


class LoadAdapter(msgspec.Struct, tag="load_adapter", frozen=True):
    """Makes the adapter at `path` resident: read and validated unless it
    already is (then answered at once with the version in memory)."""

    path: str


class ReloadAdapter(msgspec.Struct, tag="reload_adapter", frozen=True):
    """Reads `path` again (its file changed): new rows get the new version;
    a bad file keeps the previous one."""

    path: str


class UnloadAdapter(msgspec.Struct, tag="unload_adapter", frozen=True):
    """Drops the adapter at `path` from memory once no row uses it; a later
    request for it reads it again."""

    path: str


# -- embeddings (models of kind "embedding"; docs/http.md) --------------------
# Inputs one Embed carries (OpenAI's own bound on a request's inputs): the
# supervisor refuses more before any worker sees them.
MAX_EMBED_INPUTS = 2048


class Embed(msgspec.Struct, tag="embed", frozen=True):
    """Embeddings of several inputs, each a text or the model's token ids.
    The worker answers with one `embedding` line per input, in any order,
    each holding one vector (`index` says which input): so every line stays
    one vector long however many inputs come; then one final `gen_token`
    done line (prompt_tokens: every input's, gen_tokens 0), or one error.
    An input longer than the model's context is cut to it when `truncate`
    is set, else the request is refused."""

    rid: int
    inputs: list[str | list[int]]
    # Keep the first `dimensions` values (then normalised again), as
    # Matryoshka-trained models (Qwen3-Embedding) and OpenAI's API allow.
    dimensions: int | None = None
    truncate: bool = False
    id_json: str | None = None


class Stats(msgspec.Struct, tag="stats", frozen=True):
    # Echoed in the worker_stats line that answers it: the reader thread
    # answers at once, so a line measured before `ready` can reach the pool
    # after it; the number tells the pool which request a line answers.
    seq: int = 0


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True):
    pass


ToWorker = Generate | Embed | Cancel | LoadAdapter | ReloadAdapter | UnloadAdapter | Stats | Shutdown
