"""The constrained-decoding libraries side by side: llguidance (the one the
worker uses), outlines-core and xgrammar, on the same tokenizers and
grammars: what each compiles and enforces, its tokenizer view, compile time
and mask time per token. docs/structured-output.md quotes the results.

Not a project dependency: run it in a scratch environment,

    python3 -m venv /tmp/cmp && /tmp/cmp/bin/pip install -e . outlines-core
    /tmp/cmp/bin/pip install --no-deps xgrammar && /tmp/cmp/bin/pip install apache-tvm-ffi pydantic
    /tmp/cmp/bin/python -m bench.constrain_libraries

xgrammar imports torch and transformers when it loads, although its
tokenizer view, compiler and matcher take plain lists and any DLPack array
(numpy here); without those packages installed, empty stand-in modules let
it load, and no measured call touches them.
"""

from __future__ import annotations

import importlib.machinery
import json
import statistics
import sys
import time
import types

import numpy as np

from bench.common import machine, write_result
from tests.schemas import PET, PET_VALUE

# Each must be rejected: it breaks exactly one rule of PET.
BAD = {
    "integer bounds": dict(PET_VALUE, age=31),
    "string maxLength": dict(PET_VALUE, name="x" * 9),
    "enum": dict(PET_VALUE, kind="fish"),
    "array maxItems": dict(PET_VALUE, tags=["a", "b", "c", "d"]),
    "additionalProperties": dict(PET_VALUE, extra=1),
    "$ref + pattern": dict(PET_VALUE, home={"city": "lisbon", "zip": 10021}),
}
OBJECT = {"a": [1, {"b": "x y"}], "c": None}
REGEX, REGEX_GOOD, REGEX_BAD = r"[A-Z][a-z]{2,8} [0-9]{1,3}(\.[0-9]{1,2})?", "Hello 42.5", "hello 42"
LARK = 'start: expr\nexpr: term (("+"|"-") term)*\nterm: NUMBER | "(" expr ")"\nNUMBER: /[0-9]{1,4}/\n'
EBNF = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= number | "(" expr ")"\nnumber ::= [0-9] | [0-9][0-9] | [0-9][0-9][0-9]\n'
ARITH_GOOD, ARITH_BAD = "(1+22)-3", "(1+)"
INVALID = {"regex": ("regex", "([a-z"), "schema": ("schema", {"type": "objekt"}), "lark": ("lark", "start: foo")}


class Llguidance:
    name = "llguidance"

    def __init__(self, tok, vocab, eos):
        import llguidance
        from llguidance.numpy import fill_next_token_bitmask

        self.lib, self._fill = llguidance, fill_next_token_bitmask
        t = time.perf_counter()
        self.tokenizer = llguidance.LLTokenizer(tok.to_str(), n_vocab=vocab, eos_token=eos)
        self.view_s = time.perf_counter() - t
        self.bits = np.full((1, (vocab + 31) // 32), -1, dtype=np.int32)

    def compile(self, kind, src):
        m = self.lib.LLMatcher
        grammar = {
            "schema": lambda: m.grammar_from_json_schema(json.dumps(src), defaults={"whitespace_flexible": False}),
            "object": lambda: m.grammar_from_json_schema('{"type":"object"}', defaults={"whitespace_flexible": False}),
            "regex": lambda: m.grammar_from_regex(src),
            "lark": lambda: m.grammar_from_lark(src),
        }.get(kind)
        if grammar is None:
            return None
        matcher = m(self.tokenizer, grammar(), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def start(self, compiled):
        return compiled.deep_copy()

    def fill(self, state):
        self._fill(state, self.bits, 0)

    def advance(self, state, token):
        return state.consume_token(token)

    def accepts_end(self, state, eos):
        return state.is_accepting()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok, vocab, eos):
        import outlines_core

        from worker.text.tokenizer import _byte_decoder

        self.lib = outlines_core
        t = time.perf_counter()
        inverse = _byte_decoder()
        added = {i: a.content for i, a in tok.get_added_tokens_decoder().items()}
        by_bytes: dict[bytes, list[int]] = {}
        for i in range(tok.get_vocab_size()):
            if i != eos[0]:
                piece = added[i].encode() if i in added else bytes(inverse[c] for c in tok.id_to_token(i))
                by_bytes.setdefault(piece, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos[0], by_bytes)
        self.view_s = time.perf_counter() - t
        self.bits = np.zeros((vocab + 31) // 32, dtype=np.int32)

    def compile(self, kind, src):
        build = self.lib.json_schema.build_regex_from_schema
        regex = {
            "schema": lambda: build(json.dumps(src), whitespace_pattern=""),
            "object": lambda: build('{"type":"object"}', whitespace_pattern=""),
            "regex": lambda: src,
        }.get(kind)
        return None if regex is None else self.lib.Index(regex(), self.vocabulary)

    def start(self, compiled):
        return self.lib.Guide(compiled)

    def fill(self, state):
        state.write_mask_into(self.bits.ctypes.data, self.bits.size, 4)

    def advance(self, state, token):
        try:
            state.advance(token, return_tokens=False)
            return True
        except ValueError:
            return False

    def accepts_end(self, state, eos):
        return state.is_finished()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab, eos):
        for missing in ("torch", "transformers"):
            try:
                __import__(missing)
            except ImportError:
                sys.modules[missing] = _stand_in(missing)
        import xgrammar

        self.lib = xgrammar
        t = time.perf_counter()
        strings = [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
        info = xgrammar.TokenizerInfo(strings, xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=eos)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.view_s = time.perf_counter() - t
        self.bits = np.full((1, (vocab + 31) // 32), -1, dtype=np.int32)

    def compile(self, kind, src):
        c = self.compiler
        return {
            "schema": lambda: c.compile_json_schema(json.dumps(src), any_whitespace=False),
            "object": lambda: c.compile_builtin_json_grammar(),
            "regex": lambda: c.compile_grammar(self.lib.Grammar.from_regex(src)),
            "ebnf": lambda: c.compile_grammar(src),
        }.get(kind, lambda: None)()

    def start(self, compiled):
        return self.lib.GrammarMatcher(compiled)

    def fill(self, state):
        state.fill_next_token_bitmask(self.bits, 0)

    def advance(self, state, token):
        return state.accept_token(token)

    def accepts_end(self, state, eos):
        return state.accept_token(eos[0])


def _stand_in(name: str) -> types.ModuleType:
    class Anything:
        def __getattr__(self, attr):
            return Anything()

        def __call__(self, *args, **kwargs):
            return Anything()

        def __mro_entries__(self, bases):
            return (object,)

    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)

    def attribute(attr: str):
        if attr.startswith("__"):  # not a package: no __path__, no submodules
            raise AttributeError(attr)
        # Classes (torch.Tensor) must stay classes: callers isinstance() with them.
        return type(attr, (), {}) if attr[:1].isupper() else Anything()

    module.__getattr__ = attribute
    return module


def accepts(lib, compiled, ids, eos) -> bool:
    state = lib.start(compiled)
    return all(lib.advance(state, t) for t in ids) and lib.accepts_end(state, eos)


def mask_times_us(lib, compiled, ids, rounds=20) -> list[float]:
    times = []
    for _ in range(rounds):
        state = lib.start(compiled)
        for t in ids:
            t0 = time.perf_counter()
            lib.fill(state)
            times.append((time.perf_counter() - t0) * 1e6)
            assert lib.advance(state, t), "a valid reply was rejected"
    return times


def stats(times: list[float]) -> dict:
    ordered = sorted(times)
    return {"median": round(statistics.median(times), 1), "mean": round(statistics.mean(times), 1), "p99": round(ordered[int(0.99 * len(ordered))], 1)}


def timed(fn):
    t0 = time.perf_counter()
    value = fn()
    return value, round((time.perf_counter() - t0) * 1000, 1)


def compare(lib, encode, eos) -> dict:
    out: dict = {"tokenizer_view_ms": round(lib.view_s * 1000, 1)}
    cov: dict = {}
    compiled, out["schema_compile_ms"] = timed(lambda: lib.compile("schema", PET))
    seps = next(s for s in ((",", ":"), (", ", ": ")) if accepts(lib, compiled, encode(json.dumps(PET_VALUE, separators=s)), eos))
    for feature, bad in BAD.items():
        cov[feature] = not accepts(lib, compiled, encode(json.dumps(bad, separators=seps)), eos)
    ids = encode(json.dumps(PET_VALUE, separators=seps))
    out["schema_mask_us"] = stats(mask_times_us(lib, compiled, ids)) | {"tokens": len(ids)}
    compiled, out["json_object_compile_ms"] = timed(lambda: lib.compile("object", None))
    ids = next(ids for s in ((",", ":"), (", ", ": ")) if accepts(lib, compiled, ids := encode(json.dumps(OBJECT, separators=s)), eos))
    cov["json_object"] = True
    out["json_object_mask_us"] = stats(mask_times_us(lib, compiled, ids))
    compiled, out["regex_compile_ms"] = timed(lambda: lib.compile("regex", REGEX))
    cov["regex"] = accepts(lib, compiled, encode(REGEX_GOOD), eos) and not accepts(lib, compiled, encode(REGEX_BAD), eos)
    grammar = lib.compile("lark", LARK)
    cov["lark"] = grammar is not None
    grammar = grammar or lib.compile("ebnf", EBNF)
    if grammar is not None:
        cov["cfg (lark or ebnf)"] = accepts(lib, grammar, encode(ARITH_GOOD), eos) and not accepts(lib, grammar, encode(ARITH_BAD), eos)
    errors = {}
    for what, (kind, src) in INVALID.items():
        try:
            errors[what] = "compiled" if lib.compile(kind, src) is not None else "unsupported"
        except Exception as exc:  # each library has its own error types
            errors[what] = f"rejected: {str(exc).strip().splitlines()[0][:120]}"
    out["enforced"] = cov
    out["invalid_input"] = errors
    return out


def main() -> int:
    from tokenizers import Tokenizer

    from bench.common import demo_model
    from bench.constrain import REAL_VOCAB, real_vocab_tokenizer

    tokenizers = {
        "demo": (Tokenizer.from_file(str(demo_model("tiny") / "tokenizer.json")), None),
        "bpe-151k": (Tokenizer.from_file(str(real_vocab_tokenizer())), REAL_VOCAB),
    }
    result: dict = {"machine": machine(), "versions": {}, "tokenizers": {}}
    for label, (tok, vocab) in tokenizers.items():
        vocab = vocab or tok.get_vocab_size()
        eos = [tok.token_to_id("<|im_end|>")]
        encode = lambda s, tok=tok: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
        result["tokenizers"][label] = {"tokens": tok.get_vocab_size(), "vocab": vocab}
        for cls in (Llguidance, OutlinesCore, Xgrammar):
            lib = cls(tok, vocab, eos)
            result["tokenizers"][label][lib.name] = compare(lib, encode, eos)
            print(label, lib.name, json.dumps(result["tokenizers"][label][lib.name]), file=sys.stderr)
    from importlib.metadata import version

    result["versions"] = {name: version(name) for name in ("llguidance", "outlines-core", "xgrammar")}
    write_result("constrain-libraries", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
