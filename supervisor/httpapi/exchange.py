"""One HTTP generation request: the pool's sink for its lines, and what
its response is made of.

The pool writes the request's `@@lattice` lines here (never blocking, like
every sink); the response task takes them out. A streamed request keeps
its SSE chunks in a buffer of at most `limit` bytes: a client that reads
slower than the model writes fills it, and past the bound the request is
cancelled and the connection dropped (`overflow`), so one slow reader
never holds memory without bound nor slows the other rows of its batch
(pausing the worker, as stdout does, would stall every row). A
non-streamed request keeps only its text.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec

from ipc.events import INTERNAL
from ipc.worker_events import TOKEN, Done, Error, event_body, read_line, token_json, token_text
from supervisor.httpapi.reasoning import ThinkSplitter
from supervisor.httpapi.shapes import HttpError, Reply, usage
from supervisor.httpapi.tools import ToolReader, call_objects


class _Scored(msgspec.Struct):
    """A token line of a request that asked for log-probabilities."""

    token: str = ""
    logprobs: list[dict] | None = None


_scored = msgspec.json.Decoder(_Scored)
log = logging.getLogger("lattice.http")


class Exchange:
    """Sink of one request. `changed` is set whenever there is more to send
    or the request has ended; `ended` once its terminal line came (then
    `error` or `finish_reason` say how)."""

    def __init__(
        self,
        reply: Reply,
        stream: bool,
        limit: int,
        opens_think: Callable[[], bool] | None,
        overflow: Callable[[], None],
        fault: Callable[[], None],
        tools: ToolReader | None = None,
        logprobs: bool = False,
    ):
        self.reply = reply
        self.tools = tools  # reads tool calls out of the answer
        self.stream = stream
        self.limit = limit
        self._opens_think = opens_think  # None: no reasoning split (completions)
        self._overflow = overflow
        self._fault = fault
        self.splitter: ThinkSplitter | None = None
        self.changed = asyncio.Event()
        self.ended = False
        self.overflowed = False
        self.error: HttpError | None = None
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.started = False  # a token came: a stream's headers may go
        self._closing = False  # the reply has ended: what is put now is its end (_put)
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._calls: list[dict] = []
        # Log-probabilities asked for: the worker's entries not yet sent (a
        # stream), or all of them (a whole answer).
        self.logprobs = logprobs
        self._entries: list[dict] = []

    @property
    def headers(self) -> list:
        """A stream's response headers: its API's (SSE, or Ollama's NDJSON)."""
        return self.reply.headers

    # -- the pool's side -------------------------------------------------------

    def write(self, data: bytes) -> None:
        # The slot writes here for a worker that serves other requests too:
        # a fault of this one request's rendering ends this request alone.
        try:
            self._write(data)
        except Exception:
            log.exception("http: request %s: its answer could not be rendered; cancelled", self.reply.request_id)
            if not self.ended:
                self._end_error(HttpError(500, "internal error while rendering the answer", "server_error", INTERNAL))
                self._fault()
            self.changed.set()

    def _write(self, data: bytes) -> None:
        # Each line read once, by ipc's reader, as the slot reads it.
        for line in data.splitlines(keepends=True):
            if self.ended or self.overflowed:
                break
            event = read_line(line)
            if isinstance(event, Error):
                self._end_error(self._pool_error(event))
            elif isinstance(event, Done):
                self._end_done(event)
            elif event is not TOKEN or not self._token(line):
                # The slot reads every terminal line before it gets here; a
                # sink must not raise into the slot whatever it is given.
                log.error("http: unreadable line for request %s: %r", self.reply.request_id, line[:200])
                self._end_error(HttpError(500, "internal error: the model's answer could not be read", "server_error", INTERNAL))
                break
        self.changed.set()

    def _pool_error(self, event: Error) -> HttpError:
        error = HttpError.from_pool(event.code, event.msg)
        if self.tools is not None and self.tools.tools.forced and "response_format" in event.msg:
            # A forced call's grammar is made of the tools' parameters (the
            # client sent no response_format): say so, without the grammar.
            first = event.msg.split("\n", 1)[0]
            detail = first.partition("JSON schema: ")[2] or first.partition("response_format: ")[2] or first
            error = HttpError(error.status, f"the tools' parameters cannot hold a forced call: {detail}", error.type, error.code, "tools")
        return error

    def _token(self, line: bytes) -> bool:
        """A non-final token line; False when its token is no JSON string."""
        if self.logprobs:
            return self._scored_token(line)
        token = token_json(line)
        if token is None:
            return False
        if self.stream and self.started and self._raw_piece(token):
            return True
        try:
            text = token_text(token)
        except msgspec.DecodeError:
            return False
        self._text_piece(text)
        return True

    def _scored_token(self, line: bytes) -> bool:
        """A token line with its tokens' log-probabilities, decoded whole."""
        try:
            event = _scored.decode(event_body(line))
        except (msgspec.DecodeError, msgspec.ValidationError):
            return False
        if event.logprobs:
            self._entries.extend(event.logprobs)
        self._text_piece(event.token)
        return True

    def _text_piece(self, text: str) -> None:
        if not self.started:
            self.started = True
            if self._opens_think is not None:
                self.splitter = ThinkSplitter(self._opens_think())
            if self.stream and self.reply.chat:
                self._put(self.reply.first(), counted=False)
        self._pieces(self.splitter.feed(text) if self.splitter else [(False, text)])

    def _raw_piece(self, raw: bytes) -> bool:
        """The stream's fast path: the token's JSON string as the worker
        wrote it goes into the chunk without being decoded and encoded
        again, unless it may hold a <think> tag (or the splitter holds text),
        or the line carries log-probabilities too."""
        if self.tools is not None or self.logprobs:
            return False
        if self.splitter is None:
            self._put(self.reply.raw_piece(raw, False))
            return True
        reasoning = self.splitter.settled()
        if reasoning is None or (reasoning and b"<" in raw):
            return False
        self._put(self.reply.raw_piece(raw, reasoning))
        return True

    def _pieces(self, pieces: list[tuple[bool, str]]) -> None:
        for reasoning, text in pieces:
            if self.tools is not None and not reasoning:
                text = self.tools.feed(text)
                if not text:
                    continue
            if self.stream and self.logprobs:
                # A line's entries go with the first piece of text after
                # them (text held back, as a tag may be, keeps them waiting).
                self._put(self.reply.logprob_piece(text, reasoning, self._entries))
                self._entries = []
            elif self.stream:
                self._put(self.reply.piece(text, reasoning))
            else:
                (self._reasoning if reasoning else self._text).append(text)

    def _put(self, chunk: bytes, counted: bool = True) -> None:
        """The bound on what the client has not taken is on what the model's
        pace adds. The stream's opening (which may echo the request: the
        Responses API's) and what goes out once the reply has ended (text
        held back till then, closing events that may repeat the whole
        answer) are bounded by the request itself, and say nothing of
        whether the client keeps up: they are not counted."""
        self._chunks.append(chunk)
        if not counted or self._closing:
            return
        self._buffered += len(chunk)
        if self._buffered > self.limit and not self.overflowed:
            self.overflowed = True
            self._overflow()

    def _end_done(self, event: Done) -> None:
        self._closing = True
        if self.splitter is not None:
            self._pieces(self.splitter.flush())
        if self.tools is not None and event.finish_reason != "cancelled":
            rest, calls = self.tools.finish(cut=event.finish_reason == "length")
            self.tools = None  # what is left goes out as plain text
            if rest:
                self._pieces([(False, rest)])
            self._calls = call_objects(calls, with_index=self.stream)
        self.ended = True
        if self.stream and event.finish_reason != "cancelled" and not self.started:
            self.started = True  # a reply with no text at all
            if self.reply.chat:
                self._put(self.reply.first(), counted=False)
        if event.finish_reason == "cancelled":
            # Not the client's doing (it would be gone): an unload, the
            # pool's shutdown, a cancel op naming this request.
            self._end_error(HttpError(503, "the request was cancelled: its model was unloaded or the pool is shutting down", "server_error", "cancelled"))
            return
        self.finish_reason = event.finish_reason or "stop"
        # Calls kept from a reply cut by max_tokens still say it was cut.
        if self._calls and self.finish_reason != "length":
            self.finish_reason = "tool_calls"
        self.usage = usage(event.prompt_tokens, event.gen_tokens, event.cached_tokens)
        # Only Ollama's answers carry durations; the worker's timings are the
        # part of them the HTTP side cannot see.
        timed = getattr(self.reply, "timed", None)
        if timed is not None:
            timed(event.ttft_ms, event.total_ms)
        if self.stream and self._calls:
            self._put(self.reply.tool_calls(self._calls))
        if self.stream and self.logprobs:
            self._put(self.reply.last(self.finish_reason, self.usage if self.reply.include_usage else None, self._entries or None))
        elif self.stream:
            self._put(self.reply.last(self.finish_reason, self.usage if self.reply.include_usage else None))

    def _end_error(self, error: HttpError) -> None:
        self._closing = True
        self.ended = True
        self.error = error
        if self.stream and self.started:
            self._put(self.reply.stream_error(error))

    # -- the response's side ---------------------------------------------------

    def take(self) -> bytes:
        """The stream's chunks so far, in one piece."""
        data = b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        if not self.ended:
            self.changed.clear()
        return data

    def whole(self) -> bytes:
        """The non-streamed answer of a request that ended with done."""
        splitter = self.splitter
        if splitter is not None and splitter.thought and splitter.inside:
            # The block never closed (max_tokens came first, or the model
            # never wrote </think>): as vLLM's Qwen3 reasoning parser does,
            # a reply without </think> is all answer, so `content` is never
            # empty for text the model did write.
            return self.reply.whole("".join(self._reasoning), None, self.finish_reason, self.usage, **self._logprobs())
        reasoning = "".join(self._reasoning) if splitter is not None and splitter.thought else None
        return self.reply.whole("".join(self._text), reasoning, self.finish_reason, self.usage, self._calls, **self._logprobs())

    def _logprobs(self) -> dict:
        # Only for the APIs that asked (whose replies take them).
        return {"logprobs": self._entries} if self.logprobs else {}
