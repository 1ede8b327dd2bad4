"""Log-probabilities as OpenAI writes them.

A worker's token line carries one entry per generated token (docs/protocol.md):
`token` (its text), `logprob`, `top_logprobs` (the likeliest tokens, each
with its text and logprob), and `bytes` only where the text cannot give the
token's bytes back (a token that holds part of a character). These turn
them into the chat shape (`choices[].logprobs.content[]`, each with `bytes`
as a list of byte values) and the legacy completions shape (parallel
lists, text offsets).
"""

from __future__ import annotations


def _with_bytes(entry: dict) -> dict:
    raw = entry.get("bytes")
    return {"token": entry["token"], "logprob": entry["logprob"], "bytes": raw if raw is not None else list(entry["token"].encode("utf-8"))}


def chat_entry(entry: dict) -> dict:
    return {**_with_bytes(entry), "top_logprobs": [_with_bytes(t) for t in entry.get("top_logprobs") or ()]}


def chat_logprobs(entries: list[dict]) -> dict:
    """A chat choice's (or chunk's) `logprobs` object."""
    return {"content": [chat_entry(e) for e in entries], "refusal": None}


def completion_logprobs(entries: list[dict], offset: int) -> dict:
    """A completions choice's `logprobs`, its text starting at character
    `offset` of the answer."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e.get("top_logprobs") or ()} for e in entries],
        "text_offset": offsets,
    }
