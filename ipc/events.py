"""The `@@lattice` event line encoder, byte-identical to chat_metal.

chat_metal escapes `"`, `\\`, `\\n`, `\\r`, `\\t` with their short forms and
every other control character below 0x20 as `\\u00XX` (lowercase hex), so
`\\b` becomes `\\u0008` -- unlike serde_json or msgspec, which is why this
module writes JSON by hand. Non-ASCII text is written as raw UTF-8. The
timing floats of the final line carry exactly one decimal, rounded the way
Rust's `{:.1}` rounds the exact binary value (Python's `%.1f` does the same).
"""

from __future__ import annotations

import math
import re

PREFIX = b"@@lattice "

# A token line's layout, the one place it is written: TOKEN_HEAD, the token
# as a JSON string, NOT_FINAL (or, on the request's last line, FINAL and its
# figures), then for a request with an id ID_TAIL and the id, and LINE_END.
# Inside the JSON string every quote is escaped, so the last NOT_FINAL and
# the last ID_TAIL of a line are those fields: ipc.worker_events reads them
# back by these bytes, without decoding JSON.
TOKEN_HEAD = PREFIX + b'{"ev":"gen_token","token":'
NOT_FINAL = b',"done":false'
FINAL = b',"done":true'
ID_TAIL = b',"id":'
LINE_END = b"}\n"
_TOKEN_END = NOT_FINAL + LINE_END
_TOKEN_ID = NOT_FINAL + ID_TAIL
_DONE_HEAD = TOKEN_HEAD + b'""' + FINAL

_ESCAPES = {i: f"\\u{i:04x}" for i in range(0x20)}
_ESCAPES.update({ord('"'): '\\"', ord("\\"): "\\\\", ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t"})
_NEEDS_ESCAPE = re.compile(r'["\\\x00-\x1f]')


class RawJSON(str):
    """A value that is already a JSON fragment (an echoed request id)."""

    __slots__ = ()


def json_str(s: str) -> str:
    if _NEEDS_ESCAPE.search(s) is None:
        return '"' + s + '"'
    return '"' + s.translate(_ESCAPES) + '"'


def _utf8(text: str) -> bytes:
    # Lone surrogates can arrive through JSON \ud800 escapes; never emit them.
    return text.encode("utf-8", "replace")


def fixed1(x: float) -> str:
    return "%.1f" % x


def json_value(v: object) -> str:
    if v is None:
        return "null"
    if v is True:
        return "true"
    if v is False:
        return "false"
    if isinstance(v, RawJSON):
        return str(v)
    if isinstance(v, str):
        return json_str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            return "null"
        return repr(v)
    if isinstance(v, dict):
        return "{" + ",".join(json_str(k) + ":" + json_value(x) for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(json_value(x) for x in v) + "]"
    raise TypeError(f"cannot encode {type(v).__name__} in an event")


def encode_event(ev: str, **fields: object) -> bytes:
    """`@@lattice {"ev":EV,...fields in the given order}` + newline."""
    body = '{"ev":' + json_str(ev)
    for key, value in fields.items():
        body += "," + json_str(key) + ":" + json_value(value)
    return PREFIX + _utf8(body) + b"}\n"


def encode_token(token: str, id_json: str | None = None) -> bytes:
    """A non-final gen_token line; the hot path of the whole pool."""
    tail = _TOKEN_END if id_json is None else _TOKEN_ID + id_json.encode() + LINE_END
    return TOKEN_HEAD + _utf8(json_str(token)) + tail


def encode_token_logprobs(token: str, logprobs: list, id_json: str | None = None) -> bytes:
    """A non-final gen_token line of a request that asked for log-probabilities:
    `logprobs` (an entry per token whose text the line holds or held back
    before it) goes between the token and "done", so a plain line is
    chat_metal's, byte for byte, and the id still ends the line."""
    tail = b',"done":false}\n' if id_json is None else b',"done":false,"id":' + id_json.encode() + b"}\n"
    return b'@@lattice {"ev":"gen_token","token":' + _utf8(json_str(token)) + b',"logprobs":' + _utf8(json_value(logprobs)) + tail


def encode_done(
    *,
    tok_s: float,
    ttft_ms: float,
    prompt_tokens: int,
    gen_tokens: int,
    total_ms: int,
    finish_reason: str | None = None,
    cached_tokens: int | None = None,
    drafted_tokens: int | None = None,
    accepted_tokens: int | None = None,
    id_json: str | None = None,
) -> bytes:
    """The final gen_token line: chat_metal's fields, then the additive ones."""
    body = ',"tok_s":%s,"ttft_ms":%s,"prompt_tokens":%d,"gen_tokens":%d,"total_ms":%d' % (
        fixed1(tok_s),
        fixed1(ttft_ms),
        prompt_tokens,
        gen_tokens,
        total_ms,
    )
    if finish_reason is not None:
        body += ',"finish_reason":' + json_str(finish_reason)
    if cached_tokens is not None:
        body += ',"cached_tokens":%d' % cached_tokens
    # Only for a request that ran with a drafter (speculative decoding), so
    # a plain request's line is chat_metal's, byte for byte.
    if drafted_tokens is not None:
        body += ',"drafted_tokens":%d,"accepted_tokens":%d' % (drafted_tokens, accepted_tokens or 0)
    line = _DONE_HEAD + _utf8(body)
    if id_json is not None:
        line += ID_TAIL + _utf8(id_json)
    return line + LINE_END


def encode_embedding(index: int, vector_b64: str, prompt_tokens: int, id_json: str | None = None) -> bytes:
    """One input's vector of an embeddings request (base64 of its float32
    values, little-endian, as OpenAI's `encoding_format: base64`): one line
    per input, so a line is one vector long whatever the request."""
    tail = "" if id_json is None else ',"id":' + id_json
    body = '{"ev":"embedding","index":%d,"prompt_tokens":%d,"embedding":"%s"%s}\n' % (index, prompt_tokens, vector_b64, tail)
    return PREFIX + body.encode()


def tokens_per_second(gen_tokens: int, total_ms: int) -> float:
    """chat_metal's definition: gen_tokens / (total_ms / 1000), 0.0 for 0 ms."""
    return gen_tokens / (total_ms / 1000.0) if total_ms > 0 else 0.0


def encode_error(msg: str, code: str | None = None, id_json: str | None = None) -> bytes:
    fields: dict[str, object] = {"msg": msg}
    if code is not None:
        fields["code"] = code
    if id_json is not None:
        fields["id"] = RawJSON(id_json)
    return encode_event("error", **fields)


def encode_cancelled_done(id_json: str | None, prompt_tokens: int = 0) -> bytes:
    """The terminal line of a request cancelled before it produced anything."""
    return encode_done(
        tok_s=0.0,
        ttft_ms=0.0,
        prompt_tokens=prompt_tokens,
        gen_tokens=0,
        total_ms=0,
        finish_reason="cancelled",
        id_json=id_json,
    )


# Error codes of docs/protocol.md; a client may branch on them, so they never change.
BAD_REQUEST = "bad_request"
UNKNOWN_MODEL = "unknown_model"
LOAD_FAILED = "load_failed"
MODEL_FAILED = "model_failed"
WORKER_CRASHED = "worker_crashed"
OVERLOADED = "overloaded"
INSUFFICIENT_MEMORY = "insufficient_memory"
ADAPTER_ERROR = "adapter_error"
UNLOADED = "unloaded"
SHUTTING_DOWN = "shutting_down"
# Beyond docs/protocol.md: something unexpected went wrong while handling one line,
# op or connection; the pool logged it with its traceback and goes on.
INTERNAL = "internal"
