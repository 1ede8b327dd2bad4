"""A request with `n` > 1: n rows in the pool (each its own Exchange, with
its own id, and seed + i when the request has a seed), answered as one
response with n choices. The rows share the prompt (the prefix cache may
serve it to the rows after the first) and run in one batch.

Choices looks to the server like one Exchange: `changed`, `ended`,
`error`, `started`, `overflowed`, take(), whole().
"""

from __future__ import annotations

import asyncio

import msgspec

from supervisor.httpapi.exchange import Exchange
from supervisor.httpapi.shapes import HttpError, Reply, usage


class Choices:
    def __init__(self, exchanges: list[Exchange], closer: Reply):
        self.exchanges = exchanges
        self.closer = closer  # writes the stream's usage chunk and [DONE]
        self.stream = exchanges[0].stream
        # One event for all: the pool's writes into any choice wake the response.
        self.changed = asyncio.Event()
        for exchange in exchanges:
            exchange.changed = self.changed
        self._closed = False

    @property
    def headers(self) -> list:
        return self.exchanges[0].headers

    @property
    def error(self) -> HttpError | None:
        return next((e.error for e in self.exchanges if e.error is not None), None)

    @property
    def ended(self) -> bool:
        return self.error is not None or all(e.ended for e in self.exchanges)

    @property
    def started(self) -> bool:
        return all(e.started for e in self.exchanges) or (self.ended and any(e.started for e in self.exchanges))

    @property
    def overflowed(self) -> bool:
        return any(e.overflowed for e in self.exchanges)

    def _usage(self) -> dict:
        figures = [e.usage for e in self.exchanges]
        first = figures[0]
        completion = sum(f["completion_tokens"] for f in figures)
        cached = (first.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return usage(first["prompt_tokens"], completion, cached)

    def take(self) -> bytes:
        ended = self.ended
        failed = [e for e in self.exchanges if e.error is not None]
        # An error's chunk ends the stream ([DONE]): the others' text first.
        parts = [e.take() for e in self.exchanges if e.error is None] + [e.take() for e in failed[:1]]
        data = b"".join(parts)
        if ended and not failed and not self._closed:
            self._closed = True
            data += self.closer.closing_chunks(self._usage() if self.closer.include_usage else None)
        if ended:
            self.changed.set()
        else:
            self.changed.clear()
        return data

    def whole(self) -> bytes:
        answers = [msgspec.json.decode(e.whole()) for e in self.exchanges]
        head = answers[0]
        head["choices"] = [a["choices"][0] for a in answers]
        head["usage"] = self._usage()
        return msgspec.json.encode(head)
