"""A request's prompt as token ids, checked against what the model can take."""

from __future__ import annotations

import msgspec

from ipc.context import context_limit
from ipc.events import BAD_REQUEST
from ipc.messages import DEFAULT_MAX_PROMPT_BYTES, Generate, utf8_len
from worker.text.tokenizer import SpecialTextError, TextCodec


class RequestError(Exception):
    """A request this model cannot serve; `code` is one of the protocol's error codes (docs/protocol.md)."""

    def __init__(self, code: str, msg: str):
        super().__init__(msg)
        self.code = code
        self.msg = msg


def model_limit(config: dict, key: str) -> int | None:
    """An integer from the model's config.json, top level or text_config."""
    value = config.get(key) or (config.get("text_config") or {}).get(key)
    return value if isinstance(value, int) else None


class PromptReader:
    def __init__(self, codec: TextCodec, config: dict, max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES, max_context: int | None = None):
        self.codec = codec
        self.max_prompt_bytes = max_prompt_bytes
        # Tokens a sequence may hold, prompt and reply: the pool's
        # max_context for this model, else the model config's limit.
        self.max_context = max_context or context_limit(config)

    def ids(self, req: Generate) -> list[int]:
        """The prompt's token ids; RequestError when there is none, the chat
        template fails, or the prompt or the model's context is too small for
        it (a count is of any length: it asks whether the prompt fits)."""
        kept_as_text: list[tuple[int, int]] = []
        if req.prompt is not None:
            text = req.prompt  # the client's own template: its special tokens are meant
        elif req.messages is not None:
            try:
                if req.allow_special_tokens:
                    text = self.codec.render(req.messages, req.tools)
                else:
                    text, kept_as_text = self.codec.render_marked(req.messages, req.tools)
            except SpecialTextError as exc:
                raise RequestError(BAD_REQUEST, str(exc)) from None
            except Exception as exc:  # a user's template may raise anything
                raise RequestError(BAD_REQUEST, f"chat template failed: {exc}") from exc
        else:
            raise RequestError(BAD_REQUEST, 'missing "prompt" field')
        # Before tokenizing: a huge prompt would cost seconds and gigabytes to refuse after.
        if utf8_len(text, self.max_prompt_bytes) > self.max_prompt_bytes:
            raise RequestError(BAD_REQUEST, f"prompt is longer than max_prompt_bytes ({self.max_prompt_bytes} bytes)")
        ids = self.codec.encode_keeping_text(text, kept_as_text)
        if not ids:
            raise RequestError(BAD_REQUEST, "prompt is empty after tokenization")
        if self.max_context and len(ids) >= self.max_context and not req.count_only:
            raise RequestError(BAD_REQUEST, f"prompt has {len(ids)} tokens; the model's context is {self.max_context} tokens")
        return ids

    def fit(self, req: Generate, ids: list[int]) -> Generate:
        """The request with its reply fitted into the context: a prompt of P
        tokens leaves max_context - P for it. A max_tokens that someone set
        (the request or the pool's defaults) is a promise the reply may be
        that long, so a larger one is refused, naming both numbers; one left
        to the default is lowered to the room left, as vLLM does."""
        if not self.max_context:
            return req
        room = self.max_context - len(ids)
        if req.max_tokens <= room:
            return req
        if req.clip_max_tokens:
            return msgspec.structs.replace(req, max_tokens=room)
        raise RequestError(
            BAD_REQUEST,
            f"prompt ({len(ids)} tokens) plus max_tokens ({req.max_tokens}) is {len(ids) + req.max_tokens} tokens; "
            f"the model's context is {self.max_context} tokens",
        )
