"""One generation request, from prompt text to the final `@@lattice` line."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ipc.events import encode_done, encode_token, tokens_per_second
from ipc.messages import DEFAULT_MAX_PROMPT_BYTES, Generate, utf8_len
from worker.loader import LoadedModel
from worker.prefix_cache import DEFAULT_BUDGET_BYTES, PrefixCache, chunk_ends, message_starts
from worker.sampling import Sampler
from worker.text import StopMatcher, TextCodec

log = logging.getLogger("worker")

Emit = Callable[[bytes], None]


class RequestError(Exception):
    """A request this model cannot serve; `code` is a SPEC error code."""

    def __init__(self, code: str, msg: str):
        super().__init__(msg)
        self.code = code
        self.msg = msg


class ThinkBudget:
    """Counts tokens inside <think> and says when </think> must be forced."""

    __slots__ = ("start", "end", "budget", "inside", "count")

    def __init__(self, start: int | None, end: int | None, budget: int | None, prompt: list[int]):
        self.start, self.end = start, end
        self.budget = budget if (budget is not None and start is not None and end is not None) else None
        self.inside = False
        self.count = 0
        if self.budget is not None:
            # The generation prompt may already have opened the block.
            last_open = max((i for i, t in enumerate(prompt) if t == start), default=-1)
            last_close = max((i for i, t in enumerate(prompt) if t == end), default=-1)
            if last_open > last_close:
                self.inside = True
                self.count = len(prompt) - last_open - 1

    def must_close(self) -> bool:
        return self.budget is not None and self.inside and self.count >= self.budget

    def observe(self, token: int) -> None:
        if self.budget is None:
            return
        if token == self.start:
            self.inside, self.count = True, 0
        elif token == self.end:
            self.inside = False
        elif self.inside:
            self.count += 1


class Engine:
    def __init__(
        self,
        loaded: LoadedModel,
        codec: TextCodec,
        prefill_step: int = 512,
        prefix_cache_bytes: int = DEFAULT_BUDGET_BYTES,
        max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
    ):
        self.loaded = loaded
        self.max_prompt_bytes = max_prompt_bytes
        self.model = loaded.model
        self.codec = codec
        self.prefill_step = prefill_step
        self.prefix_cache = PrefixCache(self.model, prefix_cache_bytes)
        self.chat_marker = codec.tokenizer.token_to_id("<|im_start|>")
        self.max_positions = _max_positions(loaded.config)
        self.vocab_size = _vocab(loaded.config) or codec.vocab_size
        # Content sha256 of the active LoRA adapter (None: none). Anything
        # cached from model state must be keyed by it, never by the path.
        self.adapter_key: str | None = None

    def prompt_ids(self, req: Generate) -> list[int]:
        if req.prompt is not None:
            text = req.prompt
        elif req.messages is not None:
            try:
                text = self.codec.render(req.messages)
            except Exception as exc:  # a user's template may raise anything
                raise RequestError("bad_request", f"chat template failed: {exc}") from exc
        else:
            raise RequestError("bad_request", 'missing "prompt" field')
        if utf8_len(text, self.max_prompt_bytes) > self.max_prompt_bytes:
            raise RequestError("bad_request", f"prompt is longer than max_prompt_bytes ({self.max_prompt_bytes} bytes)")
        ids = self.codec.encode(text)
        if not ids:
            raise RequestError("bad_request", "prompt is empty after tokenization")
        if self.max_positions and len(ids) >= self.max_positions:
            raise RequestError("bad_request", f"prompt has {len(ids)} tokens; the model's context is {self.max_positions}")
        return ids

    def _logits(self, tokens: mx.array, cache: list) -> mx.array:
        return self.model(tokens[None], cache=cache)[:, -1, :]

    def prefill(self, ids: list[int], cancelled: threading.Event, reuse: bool = True) -> tuple[mx.array | None, list, int]:
        """Runs all but the last prompt token through the model in chunks,
        resuming from the prefix cache when it can; returns the last
        position's logits (None when cancelled), the cache, and how many
        prompt tokens came from the prefix cache."""
        n = len(ids)
        cuts = message_starts(ids, self.chat_marker)
        if reuse:
            cache, start = self.prefix_cache.resume(self.adapter_key, ids, cuts)
            keep = self.prefix_cache.snapshot_points(n, cuts)
        else:
            cache, start, keep = make_prompt_cache(self.model), 0, set()
        prompt = mx.array(ids, dtype=mx.uint32)
        begin = start
        for end in chunk_ends(n - 1, cuts, self.prefill_step, start):
            if cancelled.is_set():
                return None, cache, start
            self.model(prompt[None, begin:end], cache=cache)
            mx.eval([c.state for c in cache])
            if end in keep:
                self.prefix_cache.store(self.adapter_key, ids[:end], cache)
            begin = end
        return self._logits(prompt[begin:], cache), cache, start

    def run(self, req: Generate, emit: Emit, cancelled: threading.Event) -> tuple[str, list[int]]:
        """Streams one request through `emit`, ending with exactly one final
        line; returns the finish_reason and the generated ids. RequestError
        is raised before any token line is written."""
        t0 = time.perf_counter()
        ids = self.prompt_ids(req)
        codec = self.codec
        id_json = req.id_json
        sampler = Sampler(
            vocab_size=self.vocab_size,
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            repetition_penalty=req.repetition_penalty,
            seed=req.seed,
        )
        sampler.observe_prompt(ids)
        think = ThinkBudget(codec.think_start, codec.think_end, req.reasoning_budget, ids)
        detok = codec.detokenizer()
        stops = StopMatcher(req.stop)
        eos = codec.eos_ids
        max_tokens = req.max_tokens

        ttft_ms = 0.0
        generated: list[int] = []
        finish = "length"
        stop_string = False
        logits, cache, cached = self.prefill(ids, cancelled)
        if logits is None:
            finish = "cancelled"
        else:
            y = mx.array([codec.think_end]) if think.must_close() else sampler(logits, None)
            mx.async_eval(y)
            while True:
                nxt = None
                if len(generated) + 1 < max_tokens:
                    # Queue the next step before reading this token, so the
                    # device works while Python streams the text.
                    nxt = sampler(self._logits(y, cache), y)
                    mx.async_eval(nxt)
                token = y.item()
                if cancelled.is_set():
                    finish = "cancelled"
                    break
                if token in eos:
                    finish = "stop"
                    break
                generated.append(token)
                think.observe(token)
                text, hit = stops.feed(detok.add(token))
                if text:
                    if not ttft_ms:
                        ttft_ms = (time.perf_counter() - t0) * 1000.0
                    emit(encode_token(text, id_json))
                if hit:
                    finish, stop_string = "stop", True
                    break
                if nxt is None:
                    break
                if think.must_close():
                    # The sampled token was never fed to the model: replace it.
                    nxt = mx.array([codec.think_end])
                y = nxt
        if not stop_string:
            tail, hit = stops.feed(detok.flush())
            if hit:
                finish = "stop"
            else:
                tail += stops.flush()
            if tail:
                if not ttft_ms:
                    ttft_ms = (time.perf_counter() - t0) * 1000.0
                emit(encode_token(tail, id_json))
        total_ms = int((time.perf_counter() - t0) * 1000.0)
        gen_tokens = len(generated)
        emit(
            encode_done(
                tok_s=tokens_per_second(gen_tokens, total_ms),
                ttft_ms=ttft_ms,
                prompt_tokens=len(ids),
                gen_tokens=gen_tokens,
                total_ms=total_ms,
                finish_reason=finish,
                cached_tokens=cached or None,
                id_json=id_json,
            )
        )
        return finish, generated

    def warm_up(self) -> None:
        """One short prefill and two decode steps through the real request path,
        so kernels compile before `ready` and the first request pays nothing."""
        ids = self.codec.encode("<|im_start|>user\nwarm up<|im_end|>\n") or [0, 0]
        sampler = Sampler(
            vocab_size=self.vocab_size,
            temperature=0.7,
            top_k=50,
            top_p=0.9,
            repetition_penalty=1.1,
            seed=0,
        )
        sampler.observe_prompt(ids)
        logits, cache, _ = self.prefill(ids if len(ids) > 1 else ids * 2, threading.Event(), reuse=False)
        y = sampler(logits, None)
        for _ in range(2):
            y = sampler(self._logits(y, cache), y)
        mx.eval(y)
        greedy = Sampler(vocab_size=self.vocab_size, temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=1.0, seed=0)
        mx.eval(greedy(self._logits(y, cache), y))
        mx.clear_cache()


def _vocab(config: dict) -> int | None:
    value = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return value if isinstance(value, int) else None


def _max_positions(config: dict) -> int | None:
    value = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
    return value if isinstance(value, int) else None
