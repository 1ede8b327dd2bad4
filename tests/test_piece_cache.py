import json
import random

import pytest
from tokenizers import Tokenizer

from worker.text import piece_cache
from worker.text.piece_cache import PieceCache
from worker.text.tokenizer import TextCodec

FRAGMENTS = [
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<|endoftext|>",
    "system\n",
    "user\n",
    "assistant\n",
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "é",
    "e\u0301",
    "日本語",
    "🙂",
    "<|im_",
    "start|>",
    "def f(x):\n    return x\n",
    '{"name": "read_file", "parameters": {"path": "string"}}',
]


@pytest.fixture(scope="module")
def codec(tiny_model):
    return TextCodec(tiny_model, json.loads((tiny_model / "config.json").read_text()))


def random_prompt(rng: random.Random) -> str:
    """Turns of random fragments, some of them past the length worth keeping."""
    turns = []
    for _ in range(rng.randint(1, 5)):
        body = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 40)))
        if rng.random() < 0.4:
            body += "".join(rng.choice(FRAGMENTS[5:]) for _ in range(rng.randint(1500, 2500)))
        turns.append(f"<|im_start|>{rng.choice(['system', 'user', 'assistant'])}\n{body}<|im_end|>\n")
    lead = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 3)))
    return lead + "".join(turns) + "<|im_start|>assistant\n"


def test_kept_pieces_give_the_ids_of_the_whole_prompt(codec):
    assert codec.pieces is not None
    rng = random.Random(7)
    prompts = [random_prompt(rng) for _ in range(60)]
    assert sum(len(p) >= piece_cache.MIN_PIECE_CHARS for p in prompts) >= 10
    for prompt in prompts + prompts:  # the second time from the kept pieces
        assert codec.encode(prompt) == codec.tokenizer.encode(prompt, add_special_tokens=False).ids


def count_tokenized(codec, monkeypatch) -> list[int]:
    """The lengths of the texts the codec's piece cache hands its tokenizer
    from now on, filled as it tokenizes."""
    seen: list[int] = []
    real = codec.tokenizer

    class Counting:
        def encode(self, text, add_special_tokens=True):
            seen.append(len(text))
            return real.encode(text, add_special_tokens=add_special_tokens)

    monkeypatch.setattr(codec.pieces, "_tokenizer", Counting())
    return seen


def test_a_long_system_prompt_is_tokenized_once(codec, monkeypatch):
    system = "".join(f"{i}: tool {i} reads a file and returns its text\n" for i in range(400))
    first = f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nWhich tool?<|im_end|>\n<|im_start|>assistant\n"
    codec.encode(first)
    real = codec.tokenizer
    seen = count_tokenized(codec, monkeypatch)
    second = first.replace("Which tool?", "How do I run the tests?")
    assert codec.encode(second) == real.encode(second, add_special_tokens=False).ids
    assert seen and max(seen) < 100  # only the new turns were tokenized


def test_a_stored_prefix_taught_from_its_ids_is_not_tokenized_again(tiny_model, monkeypatch):
    """A restarted worker learns its stored prefixes' text from their token
    ids (TextCodec.learn), so that the first request that sends one again
    tokenizes only its new turns, and gets the tokenizer's own ids."""
    fresh = TextCodec(tiny_model, json.loads((tiny_model / "config.json").read_text()))
    system = "".join(f"{i}: tool {i} lists a folder and returns its names\n" for i in range(400))
    head = f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"
    real = fresh.tokenizer
    fresh.learn(real.encode(head, add_special_tokens=False).ids)
    seen = count_tokenized(fresh, monkeypatch)
    prompt = head + "Which folder?<|im_end|>\n<|im_start|>assistant\n"
    assert fresh.encode(prompt) == real.encode(prompt, add_special_tokens=False).ids
    assert seen and max(seen) < 100


def test_kept_pieces_are_bounded(codec, monkeypatch):
    cache = PieceCache.for_tokenizer(codec.tokenizer)
    monkeypatch.setattr(piece_cache, "MAX_TEXT_CHARS", 3 * piece_cache.MIN_PIECE_CHARS)
    monkeypatch.setattr(piece_cache, "MAX_PIECES", 2)
    for i in range(6):
        cache.encode(f"<|im_start|>system\n{i}" + "x " * piece_cache.MIN_PIECE_CHARS + "<|im_end|>\n")
        assert len(cache._ids) <= 2 and cache._chars <= 3 * piece_cache.MIN_PIECE_CHARS
    big = "<|im_start|>system\n" + "y" * (3 * piece_cache.MIN_PIECE_CHARS + 1)
    assert cache.encode(big) == codec.tokenizer.encode(big, add_special_tokens=False).ids
    assert big not in cache._ids


def edited(tiny_model, change) -> Tokenizer:
    spec = json.loads((tiny_model / "tokenizer.json").read_text())
    change(spec)
    return Tokenizer.from_str(json.dumps(spec))


def test_a_tokenizer_where_a_cut_could_move_a_match_is_never_cut(tiny_model):
    def stripping(spec):
        next(t for t in spec["added_tokens"] if t["content"] == "<|im_start|>")["lstrip"] = True

    def overlapping(spec):
        top = max(t["id"] for t in spec["added_tokens"])
        spec["added_tokens"].append(
            {"id": top + 1, "content": "x<|im", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
        )

    assert PieceCache.for_tokenizer(edited(tiny_model, lambda spec: None)) is not None
    assert PieceCache.for_tokenizer(edited(tiny_model, stripping)) is None
    assert PieceCache.for_tokenizer(edited(tiny_model, overlapping)) is None
