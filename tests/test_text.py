import json

import pytest

from ipc.messages import Message
from worker.text import ByteDetokenizer, StopMatcher, TextCodec, WindowDetokenizer


@pytest.fixture(scope="module")
def codec(tiny_model):
    return TextCodec(tiny_model, json.loads((tiny_model / "config.json").read_text()))


SAMPLES = ["日本語の文章 🙂 é", "Grüße aus München! ✨", "Привет 東京", "plain ascii, tabs\tand\nnewlines"]


def stream(detok, ids):
    return [detok.add(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("text", SAMPLES)
def test_byte_detokenizer_never_splits_a_character(codec, text):
    ids = codec.encode(text)
    pieces = stream(codec.detokenizer(), ids)
    assert isinstance(codec.detokenizer(), ByteDetokenizer)
    assert "".join(pieces) == text == codec.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_samples_really_split_characters_across_tokens(codec):
    # Otherwise the tests above would prove nothing.
    split = [i for i in codec.encode("".join(SAMPLES)) if "\ufffd" in codec.decode([i])]
    assert len(split) >= 5


@pytest.mark.parametrize("text", SAMPLES)
def test_window_detokenizer_agrees(codec, text):
    ids = codec.encode(text)
    pieces = stream(WindowDetokenizer(codec), ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_special_tokens_are_recognised_in_prompt_text(codec):
    ids = codec.encode("<|im_start|>user\nhi<|im_end|>\n<think>\n")
    assert ids[0] == codec.tokenizer.token_to_id("<|im_start|>")
    assert codec.think_start in ids
    assert codec.tokenizer.token_to_id("<|im_end|>") in codec.eos_ids


def test_chat_template_renders_chatml(codec):
    text = codec.render([Message("system", "Be brief."), Message("user", "Hi")])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_plain_chatml_without_a_template(tiny_model, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((tiny_model / "tokenizer.json").read_bytes())
    codec = TextCodec(tmp_path, {})
    assert codec.render([Message("user", "Hi")]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "chunks, stops, emitted, hit",
    [
        (["Hello", " wor", "ld"], ["world"], "Hello ", True),
        (["ab", "c\n", "\nd"], ["\n\n"], "abc", True),
        (["a", "b", "c"], ["bd"], "abc", False),
        (["x<", "|e", "nd|>y"], ["<|end|>"], "x", True),
        (["no stops"], [], "no stops", False),
    ],
)
def test_stop_matcher(chunks, stops, emitted, hit):
    m = StopMatcher(stops)
    out, matched = "", False
    for c in chunks:
        text, matched = m.feed(c)
        out += text
        if matched:
            break
    if not matched:
        out += m.flush()
    assert (out, matched) == (emitted, hit)
