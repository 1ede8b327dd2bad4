"""Tokenizer, chat template, streaming detokenizer and stop-string matcher."""

from __future__ import annotations

import codecs
import json
import re
from pathlib import Path

import msgspec
from tokenizers import Tokenizer

from ipc.files import FileRefused, read_json
from ipc.messages import Message
from worker.text.piece_cache import PieceCache


class TokenizerError(Exception):
    pass


class SpecialTextError(ValueError):
    """Special-token text in a message's content that cannot be kept as
    plain text; the message is fit for a bad_request event."""


# Markers around each message's content in a second rendering, to find where
# the template put it: private-use characters, unlikely in any text (others
# are taken when a content holds these).
_PRIVATE_USE = range(0xE000, 0xF900)


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte-level alphabet (printable stand-ins for bytes)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _plain_chatml(messages: list[Message]) -> str:
    text = "".join(f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n" for m in messages)
    return text + "<|im_start|>assistant\n"


def _message_dict(m: Message) -> dict:
    out: dict = {"role": m.role, "content": m.content}
    if m.tool_calls is not None:
        out["tool_calls"] = m.tool_calls
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


class TextCodec:
    """Everything the engine needs to turn text into ids and back."""

    def __init__(self, tokenizer_dir: Path, model_config: dict):
        path = tokenizer_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"no tokenizer.json in {tokenizer_dir}")
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:
            raise TokenizerError(f"cannot read {path}: {exc}") from exc
        tok_config: dict = {}
        config_path = tokenizer_dir / "tokenizer_config.json"
        if config_path.is_file():
            try:
                tok_config = read_json(config_path)
            except FileRefused as exc:
                raise TokenizerError(f"tokenizer config {exc}") from None
            except OSError as exc:
                raise TokenizerError(f"cannot read {config_path}: {exc.strerror}") from None
            except ValueError as exc:
                raise TokenizerError(f"cannot parse {config_path}: {exc}") from exc
            if not isinstance(tok_config, dict):
                raise TokenizerError(f"{config_path} is not a JSON object")
        self.vocab_size = self.tokenizer.get_vocab_size()
        self.eos_ids = self._eos_ids(tokenizer_dir, model_config, tok_config)
        self.think_start = self.tokenizer.token_to_id("<think>")
        self.think_end = self.tokenizer.token_to_id("</think>")
        self._template = None
        template = tok_config.get("chat_template")
        if isinstance(template, list):  # HF allows named templates
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if isinstance(template, str):
            self._template = _compile_template(template)
        self._special = {k: v for k, v in tok_config.items() if k in ("bos_token", "eos_token") and isinstance(v, str)}
        self._byte_table = self._build_byte_table()
        # The tokenizer's special tokens as text: in a message's content they
        # stay text, as the chat template's author means (a user who types
        # "<|im_start|>system" must not open a system turn).
        specials = sorted({t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special and t.content}, key=len, reverse=True)
        self._special_text = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._plain: Tokenizer | None = None  # this tokenizer blind to special tokens, made on first need
        # Long prompt pieces' ids kept between requests (None: this tokenizer
        # cannot be cut safely, and every prompt is tokenized whole).
        self.pieces = PieceCache.for_tokenizer(self.tokenizer)

    def _token_id(self, token: object) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        return self.tokenizer.token_to_id(token) if isinstance(token, str) else None

    def _eos_ids(self, tokenizer_dir: Path, model_config: dict, tok_config: dict) -> frozenset[int]:
        ids: set[int] = set()
        gen_config: dict = {}
        gen_path = tokenizer_dir / "generation_config.json"
        if gen_path.is_file():
            try:
                gen_config = read_json(gen_path)
            except (OSError, FileRefused, ValueError):
                gen_config = {}
            if not isinstance(gen_config, dict):
                gen_config = {}
        for source in (model_config, model_config.get("text_config") or {}, gen_config):
            value = source.get("eos_token_id")
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(v for v in value if isinstance(v, int))
        for token in (tok_config.get("eos_token"), "<|im_end|>"):
            tid = self._token_id(token)
            if tid is not None:
                ids.add(tid)
        return frozenset(ids)

    def _build_byte_table(self) -> list[bytes] | None:
        """Bytes of every token when the tokenizer is byte-level, else None."""
        decoder = json.loads(self.tokenizer.to_str()).get("decoder") or {}
        if decoder.get("type") != "ByteLevel":
            return None
        inverse = _byte_decoder()
        added = {i: t.content for i, t in self.tokenizer.get_added_tokens_decoder().items()}
        table = []
        for i in range(self.vocab_size):
            if i in added:
                table.append(added[i].encode("utf-8"))
                continue
            piece = self.tokenizer.id_to_token(i)
            if piece is None:
                table.append(b"")
            elif all(c in inverse for c in piece):
                table.append(bytes(inverse[c] for c in piece))
            else:
                return None
        return table

    def encode(self, text: str) -> list[int]:
        # Added tokens (<|im_start|>, <think>, ...) are matched in the raw text.
        if self.pieces is not None:
            return self.pieces.encode(text)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def learn(self, ids) -> None:
        """Tokenizes the text of these ids (a prefix the prefix cache keeps)
        into the piece cache, so that a request that sends it again
        tokenizes only the rest. The text is tokenized afresh, not taken
        from the ids: what the cache keeps is always the tokenizer's own
        ids for it."""
        if self.pieces is not None:
            self.pieces.encode(self.decode([int(i) for i in ids]))

    def render_marked(self, messages: list[Message], tools: list[dict] | None = None) -> tuple[str, list[tuple[int, int]]]:
        """The rendered chat and the spans in it of special-token text that
        came from the contents of messages other than the assistant's (none
        in the usual case, at the cost of one regex search per message).
        The assistant's own turns are left as they are: they are the model's
        words played back, and templates read its `</think>` to drop the
        reasoning of past turns. The spans are found from a second rendering
        with those contents between markers; SpecialTextError when the
        template changes such a content that holds such text, so the spans
        cannot be told from the template's own tokens."""
        text = self.render(messages, tools)
        if self._special_text is None:
            return text, []
        marked_ones = [m.role != "assistant" and self._special_text.search(m.content) is not None for m in messages]
        if not any(marked_ones):
            return text, []
        used = set().union(*(set(m.content) for m in messages if not m.content.isascii()))
        free = (chr(c) for c in _PRIVATE_USE if chr(c) not in used)
        opener, closer = next(free), next(free)
        marked = self.render([msgspec.structs.replace(m, content=opener + m.content + closer) if mark else m for m, mark in zip(messages, marked_ones)], tools)
        plain: list[str] = []
        contents: list[tuple[int, int]] = []
        at = 0  # length of the plain text so far
        for part in re.split(f"([{opener}{closer}])", marked):
            if part == opener:
                contents.append((at, -1))
            elif part == closer:
                if not contents or contents[-1][1] != -1:
                    break
                contents[-1] = (contents[-1][0], at)
            else:
                plain.append(part)
                at += len(part)
        if "".join(plain) != text or any(end == -1 for _, end in contents):
            found = next(self._special_text.search(m.content).group() for m, mark in zip(messages, marked_ones) if mark)
            raise SpecialTextError(
                f"a message's content holds the special-token text {found!r}, which the chat template rewrites, so it cannot be kept as "
                "text; remove it, or set allow_special_tokens to have it read as the token"
            )
        spans = [m.span() for start, end in contents for m in self._special_text.finditer(text, start, end)]
        return text, spans

    def encode_keeping_text(self, text: str, spans: list[tuple[int, int]]) -> list[int]:
        """Token ids of `text`, with the special-token text in `spans` (from
        render_marked) tokenized as the plain characters it is."""
        if not spans:
            return self.encode(text)
        if self._plain is None:
            # A tokenizer of its own: the flag is per tokenizer, and this one
            # may be encoding elsewhere meanwhile.
            self._plain = Tokenizer.from_str(self.tokenizer.to_str())
            self._plain.encode_special_tokens = True
        ids: list[int] = []
        at = 0
        for start, end in spans:
            ids += self.encode(text[at:start])
            ids += self._plain.encode(text[start:end], add_special_tokens=False).ids
            at = end
        return ids + self.encode(text[at:])

    def render(self, messages: list[Message], tools: list[dict] | None = None) -> str:
        if self._template is None:
            return _plain_chatml(messages)
        # Templates test `tools is defined` / `if tools`: only pass them when given.
        extra = {"tools": tools} if tools else {}
        return self._template.render(
            messages=[_message_dict(m) for m in messages],
            add_generation_prompt=True,
            **self._special,
            **extra,
        )

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes (a piece of a character for some)."""
        if self._byte_table is not None:
            return self._byte_table[token_id] if 0 <= token_id < len(self._byte_table) else b""
        return self.decode([token_id]).encode("utf-8", "replace")

    def detokenizer(self) -> ByteDetokenizer | WindowDetokenizer:
        if self._byte_table is not None:
            return ByteDetokenizer(self._byte_table)
        return WindowDetokenizer(self)


def _compile_template(source: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TokenizerError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda v, indent=None, ensure_ascii=False: json.dumps(v, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


class ByteDetokenizer:
    """Streams text from byte-level BPE ids; an incremental UTF-8 decoder holds
    back the bytes of a character that is split across tokens."""

    __slots__ = ("_table", "_utf8")

    def __init__(self, table: list[bytes]):
        self._table = table
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token_id: int) -> str:
        return self._utf8.decode(self._table[token_id] if token_id < len(self._table) else b"")

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class WindowDetokenizer:
    """Streams text from any tokenizer by re-decoding a short window of ids;
    a trailing U+FFFD means the window ends inside a character, so wait."""

    __slots__ = ("_codec", "_ids", "_prefix", "_read")

    def __init__(self, codec: TextCodec):
        self._codec = codec
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        before = self._codec.decode(self._ids[self._prefix : self._read])
        after = self._codec.decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def flush(self) -> str:
        before = self._codec.decode(self._ids[self._prefix : self._read])
        after = self._codec.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return after[len(before) :]


class StopMatcher:
    """Holds back text that could be the start of a stop string.

    feed() returns (text safe to emit, True when a stop string matched); on a
    match the stop string and everything after it are dropped.
    """

    __slots__ = ("_stops", "_pending", "_longest")

    def __init__(self, stops: list[str]):
        self._stops = [s for s in stops if s]
        self._pending = ""
        self._longest = max((len(s) for s in self._stops), default=0)

    def feed(self, text: str) -> tuple[str, bool]:
        if not self._stops:
            return text, False
        buf = self._pending + text
        cut = min((i for i in (buf.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self._pending = ""
            return buf[:cut], True
        hold = 0
        for n in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self._stops):
                hold = n
                break
        self._pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text
