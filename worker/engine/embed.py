"""Embeddings: the model's hidden state at the last token of each input.

Done as Qwen3-Embedding is used: every input ends with the end-of-text
token (`<|endoftext|>` where the vocabulary has it, as Qwen3-Embedding's
own examples append it; else the tokenizer's end-of-sequence token). Its
tokenizer.json appends that token itself (a post-processor), older copies
do not: the tokenizer's own post-processing runs, and the token is added
only where it did not. The decoder's layers and final norm run without
the LM head; the vector is the hidden state at that last token,
L2-normalised, and with `dimensions` cut to its first values and
normalised again (Matryoshka truncation).

Batching: the inputs of every request waiting are taken in arrival order
(each request's sorted by length) into forwards of at most BATCH_TOKENS
padded tokens. Rows are padded on the right, which needs no mask: under
causal attention, and the causal recurrences of linear-attention layers, a
row's last real token sees only the tokens before it, exactly as when it
runs alone. An input longer than LONG_TOKENS runs alone, in chunks of the
prefill step through a cache, as a prompt's prefill does. One forward
(one chunk) per step, between the generator's steps, so requests that
generate on the same worker wait at most one forward between tokens.
"""

from __future__ import annotations

import base64
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from ipc.events import BAD_REQUEST, WORKER_CRASHED, encode_cancelled_done, encode_done, encode_embedding, encode_error
from ipc.messages import DEFAULT_MAX_PROMPT_BYTES, Embed, utf8_len
from worker.runtime.parts import text_model
from worker.text.prompts import model_limit
from worker.text.tokenizer import TextCodec

log = logging.getLogger("worker")

# Padded tokens (rows x the longest row) one batched forward may take.
BATCH_TOKENS = 4096
# Inputs longer than this run alone, chunk by chunk, not padded into a batch.
LONG_TOKENS = 512

Emit = Callable[[bytes], None]


class EmbedError(Exception):
    """A request this model cannot embed, fit for a bad_request line."""


def end_token(codec: TextCodec) -> int:
    """The token every input ends with: Qwen3-Embedding's `<|endoftext|>`
    where the vocabulary has it, else the end-of-sequence token."""
    eod = codec.tokenizer.token_to_id("<|endoftext|>")
    if eod is not None:
        return eod
    if codec.eos_ids:
        return min(codec.eos_ids)
    raise EmbedError("the tokenizer has neither <|endoftext|> nor an end-of-sequence token to pool at")


def decoder(model) -> Callable:
    """The model without its LM head (worker.runtime.parts)."""
    body = getattr(text_model(model), "model", None)
    if body is None or not callable(body):
        raise EmbedError(f"{type(model).__module__} has no decoder stack to take hidden states from")
    return body


def pool_last(hidden: mx.array, lengths: list[int]) -> mx.array:
    """Each row's hidden state at its last real token, in float32, L2-normalised."""
    rows = hidden[mx.arange(len(lengths)), mx.array([n - 1 for n in lengths])].astype(mx.float32)
    return rows / mx.maximum(mx.linalg.norm(rows, axis=-1, keepdims=True), 1e-12)


def truncated(vector: np.ndarray, dimensions: int | None) -> np.ndarray:
    """The first `dimensions` values, normalised again."""
    if dimensions is None or dimensions >= vector.shape[-1]:
        return vector
    cut = vector[:dimensions]
    return cut / max(float(np.linalg.norm(cut)), 1e-12)


@dataclass(eq=False)
class _Request:
    msg: Embed
    left: int  # inputs not answered yet
    prompt_tokens: int
    arrived: float
    first_ms: float | None = None


@dataclass(eq=False)
class _Input:
    request: _Request
    index: int
    ids: list[int]


@dataclass(eq=False)
class _Long:
    """An input running alone, chunk by chunk."""

    item: _Input
    cache: list
    done: int = 0  # tokens read so far
    hidden: mx.array | None = field(default=None)


class Embedder:
    def __init__(
        self,
        model,
        config: dict,
        codec: TextCodec,
        emit: Emit,
        *,
        max_context: int | None,
        chunk: int,
        max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
        route: Callable = lambda slots: None,
    ):
        self.model = model
        self.body = decoder(model)
        self.codec = codec
        self.emit = emit
        self.max_context = max_context
        self.chunk = chunk
        self.max_prompt_bytes = max_prompt_bytes
        # LoRA layers (worker.lora) take the routing of the last forward:
        # embeddings run on the base model.
        self._route = route
        self.hidden_size = model_limit(config, "hidden_size")
        self.vocab_size = model_limit(config, "vocab_size") or codec.vocab_size
        self.eod = end_token(codec)
        self.pending: deque[_Input] = deque()
        self.requests: dict[int, _Request] = {}
        self._long: _Long | None = None
        self._lines: list[bytes] = []
        self.running = False  # a forward is under way (the heartbeat's "busy")

    @property
    def has_work(self) -> bool:
        return bool(self.pending) or self._long is not None

    # -- requests in --------------------------------------------------------

    def submit(self, msg: Embed, arrived: float) -> None:
        try:
            # Before tokenizing, as for a prompt: a huge input would cost
            # seconds and gigabytes to refuse after.
            size = sum(utf8_len(x, self.max_prompt_bytes) if isinstance(x, str) else len(x) for x in msg.inputs)
            if size > self.max_prompt_bytes:
                raise EmbedError(f"input is longer than max_prompt_bytes ({self.max_prompt_bytes} bytes of text and token ids)")
            inputs = [self._ids(x, msg.truncate, i) for i, x in enumerate(msg.inputs)]
            if not inputs:
                raise EmbedError("no input to embed")
            if msg.dimensions is not None and (msg.dimensions < 1 or (self.hidden_size and msg.dimensions > self.hidden_size)):
                raise EmbedError(f"dimensions must be from 1 to the model's {self.hidden_size}, not {msg.dimensions}")
        except EmbedError as exc:
            log.info("embeddings %s rejected: %s", msg.id_json or msg.rid, exc)
            self.emit(encode_error(str(exc), BAD_REQUEST, msg.id_json))
            return
        request = _Request(msg, len(inputs), sum(len(ids) for ids in inputs), arrived)
        self.requests[msg.rid] = request
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        self.pending.extend(_Input(request, i, inputs[i]) for i in order)

    def _ids(self, given: str | list[int], truncate: bool, index: int) -> list[int]:
        if isinstance(given, str):
            if not given:
                raise EmbedError(f"input {index} is empty")
            try:
                ids = self.codec.tokenizer.encode(given, add_special_tokens=True).ids
            except Exception as exc:  # text the tokenizer cannot take (a lone surrogate)
                raise EmbedError(f"input {index} cannot be tokenized: {exc}") from None
        else:
            if not given:
                raise EmbedError(f"input {index} has no token ids")
            bad = next((t for t in given if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise EmbedError(f"input {index}: token id {bad} is outside the vocabulary (0 to {self.vocab_size - 1})")
            ids = list(given)
        if ids and ids[-1] == self.eod:
            ids.pop()
        limit = self.max_context
        if limit and len(ids) + 1 > limit:
            if not truncate:
                raise EmbedError(f"input {index} has {len(ids) + 1} tokens; the model's context is {limit} tokens")
            del ids[limit - 1 :]
        ids.append(self.eod)
        return ids

    def cancel(self, rid: int) -> bool:
        """Ends a request here (finish_reason cancelled); False when it is not here."""
        request = self.requests.pop(rid, None)
        if request is None:
            return False
        self.pending = deque(x for x in self.pending if x.request is not request)
        if self._long is not None and self._long.item.request is request:
            self._long = None
        self.emit(encode_cancelled_done(request.msg.id_json, request.prompt_tokens))
        return True

    # -- the loop -----------------------------------------------------------

    def step(self) -> None:
        """One forward: the next batch of short inputs, or the next chunk
        of a long one. A failure ends the requests of its inputs alone."""
        self.running = True
        try:
            if self._long is None and self.pending and len(self.pending[0].ids) > LONG_TOKENS:
                item = self.pending.popleft()
                self._long = _Long(item, self._cache())
            if self._long is not None:
                self._chunk(self._long)
            else:
                self._batch(self._take())
        finally:
            self.running = False
            if self._lines:
                self.emit(b"".join(self._lines))
                self._lines.clear()

    def _take(self) -> list[_Input]:
        batch = [self.pending.popleft()]
        longest = len(batch[0].ids)
        while self.pending and len(self.pending[0].ids) <= LONG_TOKENS:
            width = max(longest, len(self.pending[0].ids))
            if width * (len(batch) + 1) > BATCH_TOKENS:
                break
            longest = width
            batch.append(self.pending.popleft())
        return batch

    def _batch(self, batch: list[_Input]) -> None:
        lengths = [len(x.ids) for x in batch]
        width = max(lengths)
        rows = mx.array([x.ids + [self.eod] * (width - len(x.ids)) for x in batch])
        try:
            self._route([None] * len(batch))
            vectors = pool_last(self.body(rows), lengths)
            mx.eval(vectors)
        except Exception as exc:
            self._failed(batch, exc)
            return
        self._answer(batch, np.array(vectors))

    def _cache(self) -> list:
        return make_prompt_cache(self.model)

    def _chunk(self, long: _Long) -> None:
        ids = long.item.ids
        piece = ids[long.done : long.done + self.chunk]
        try:
            self._route([None])
            hidden = self.body(mx.array([piece]), cache=long.cache)
            long.done += len(piece)
            if long.done < len(ids):
                mx.eval([c.state for c in long.cache])
                return
            vector = pool_last(hidden, [len(piece)])
            mx.eval(vector)
        except Exception as exc:
            self._long = None
            self._failed([long.item], exc)
            return
        self._long = None
        self._answer([long.item], np.array(vector))

    def _answer(self, batch: list[_Input], vectors: np.ndarray) -> None:
        now = time.perf_counter()
        for item, vector in zip(batch, vectors):
            request = item.request
            if self.requests.get(request.msg.rid) is not request:
                continue  # cancelled or failed meanwhile
            data = truncated(vector, request.msg.dimensions).astype("<f4").tobytes()
            self._lines.append(encode_embedding(item.index, base64.b64encode(data).decode("ascii"), len(item.ids), request.msg.id_json))
            if request.first_ms is None:
                request.first_ms = (now - request.arrived) * 1000
            request.left -= 1
            if request.left == 0:
                del self.requests[request.msg.rid]
                total_ms = int((now - request.arrived) * 1000)
                self._lines.append(
                    encode_done(
                        tok_s=0.0,
                        ttft_ms=request.first_ms,
                        prompt_tokens=request.prompt_tokens,
                        gen_tokens=0,
                        total_ms=total_ms,
                        finish_reason="stop",
                        id_json=request.msg.id_json,
                    )
                )

    def _failed(self, batch: list[_Input], exc: Exception) -> None:
        log.exception("an embeddings forward failed; ending its requests", exc_info=exc)
        for request in {item.request for item in batch}:
            if self.requests.pop(request.msg.rid, None) is None:
                continue
            self.pending = deque(x for x in self.pending if x.request is not request)
            self._lines.append(encode_error(f"embedding failed in the worker: {exc}", WORKER_CRASHED, request.msg.id_json))

    def warm_up(self) -> None:
        """One small batch, so the first request's kernels are built."""
        rows = mx.array([[self.eod] * 4, [self.eod] * 4])
        self._route([None, None])
        mx.eval(pool_last(self.body(rows), [4, 2]))
