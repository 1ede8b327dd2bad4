"""Embeddings requests on the pool's side: what `input` may be, its bounds,
and which models take which requests.

`input` is a text, a list of texts, a list of token ids or a list of such
lists (OpenAI's forms; Ollama's are the first two), at most
MAX_EMBED_INPUTS of them, none empty. Their text in UTF-8 bytes plus their
token ids count against max_prompt_bytes. A model's `kind` says what its
name serves: a chat model refuses embeddings, an embedding model refuses
generation, each with a bad_request that says so.
"""

from __future__ import annotations

from ipc.messages import MAX_EMBED_INPUTS, utf8_len
from supervisor.spec import ModelSpec

EMBEDDING = "embedding"


def embed_inputs(value: object) -> list[str | list[int]]:
    """The inputs of an `input` field; ValueError says what is wrong."""
    if isinstance(value, str):
        value = [value]
    elif not isinstance(value, list):
        raise ValueError('"input" must be a string, a list of strings, a list of token ids or a list of lists of token ids')
    elif value and all(_is_id(x) for x in value):
        value = [value]
    if not value:
        raise ValueError('"input" is empty')
    if len(value) > MAX_EMBED_INPUTS:
        raise ValueError(f'"input" has {len(value)} inputs; the limit is {MAX_EMBED_INPUTS} a request')
    for i, x in enumerate(value):
        if isinstance(x, str):
            if not x:
                raise ValueError(f"input {i} is an empty string")
        elif isinstance(x, list):
            if not x or not all(_is_id(t) for t in x):
                raise ValueError(f"input {i} must be a non-empty list of token ids (integers from 0)")
        else:
            raise ValueError(f"input {i} must be a string or a list of token ids")
    return value


def _is_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**31


def inputs_size(inputs: list[str | list[int]], limit: int) -> int:
    """What the inputs count against max_prompt_bytes: their UTF-8 bytes and
    their token ids, exact up to `limit`."""
    total = 0
    for x in inputs:
        total += utf8_len(x, limit) if isinstance(x, str) else len(x)
        if total > limit:
            break
    return total


def wrong_kind(spec: ModelSpec, embed: bool) -> str | None:
    """Why the name `spec` does not take this kind of request, if it does not."""
    if embed and spec.kind != EMBEDDING:
        return f'model {spec.name!r} is a chat model; embeddings need a model configured with kind = "embedding"'
    if not embed and spec.kind == EMBEDDING:
        return f'model {spec.name!r} is an embedding model (kind = "embedding"): it computes embeddings, not text'
    return None
