"""Structured output costs, in one process: llguidance's token mask per step
and a schema's compile time (its first-token cost), on the demo tokenizer
and on a 151k-token byte-level BPE; then decode tok/s with a JSON-schema
constraint vs none in the same run, through the in-process batched loop of
tests/constrained_decode.py, with the mask overlapped with the forward pass
and without.

    python -m bench.constrain [--size small] [--tokens 128] [--rounds 3] [--tag X]

The 151k tokenizer is trained locally on this Python's standard library
sources (nothing downloaded) and cached beside the demo models; the
"-151k" model is the demo model of that size with its vocabulary (embedding
and LM head) widened to 151,936 rows and that tokenizer, so the mask and the
LM head are both real-sized.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

from bench.common import MODELS, demo_model, load_average, machine, summary, tagged, write_result
from tests.schemas import PET, PET_VALUE

REAL_VOCAB = 151_936  # Qwen2/3's padded vocabulary
REAL_TOKENS = 151_643

# The tests' schema plus a free-text field. For llguidance the costly steps
# are inside length-bounded strings (about 1.5 ms at 151k), free text is cheap.
PET_NOTES = {**PET, "properties": {**PET["properties"], "notes": {"type": "string"}}, "required": [*PET["required"], "notes"]}
PET_NOTES_VALUE = {**PET_VALUE, "notes": "Sleeps under the stairs, eats socks, and barks at the postman every single morning."}
OBJECT_VALUE = {"order": 1182, "items": [{"sku": "A-17", "qty": 2, "price": 9.5}, {"sku": "B-3", "qty": 1}], "paid": True, "memo": None}
# Long enough that every row runs to max_tokens, so both sides decode the same count.
LONG = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string", "minLength": 40, "maxLength": 80}, "minItems": 16, "maxItems": 16}},
    "required": ["notes"],
    "additionalProperties": False,
}


def schema_format(schema: dict, name: str = "bench") -> str:
    return json.dumps({"type": "json_schema", "json_schema": {"name": name, "schema": schema}})


def real_vocab_tokenizer() -> Path:
    path = MODELS / "bpe-151k" / "tokenizer.json"
    if path.is_file():
        return path
    from worker.demo_model import train_tokenizer

    def lines():
        for source in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
            try:
                yield from source.read_text("utf-8").splitlines(keepends=True)
            except (UnicodeDecodeError, OSError):
                continue

    tok = train_tokenizer(REAL_TOKENS, lines())
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def real_vocab_model(size: str) -> Path:
    """The demo model of `size` with a 151,936-row vocabulary and the 151k tokenizer."""
    path = MODELS / f"{size}-151k"
    if (path / "config.json").is_file():
        return path
    from worker import demo_model as dm

    # A bench-only shape: the demo builder pads the embedding and LM head to
    # the configured vocabulary (rows past its own tokenizer are zero).
    dm.BENCH_SHAPES[size] = {**dm.BENCH_SHAPES.get(size, {}), "vocab_size": REAL_VOCAB}
    try:
        dm.build(path, size=size)
    finally:
        dm.BENCH_SHAPES.pop(size)
    (path / "tokenizer.json").write_bytes(real_vocab_tokenizer().read_bytes())
    _fill_padded_rows(path / "model.safetensors", dm.tokenizer_vocab(dm.train_tokenizer(1024)))
    return path


def _fill_padded_rows(weights: Path, real_rows: int) -> None:
    """The builder leaves rows past its tokenizer zero; here those ids are
    real tokens of the 151k tokenizer, so give them copies of real rows
    (zero embeddings would make a constrained row's forward pass run on
    zeros, not what a real model does)."""
    import mlx.core as mx
    import numpy as np

    arrays = mx.load(str(weights))
    pick = mx.array(np.random.default_rng(0).integers(0, real_rows, size=REAL_VOCAB - real_rows))
    for name in ("model.language_model.embed_tokens.weight", "lm_head.weight"):
        if name in arrays:
            arrays[name] = mx.concatenate([arrays[name][:real_rows], arrays[name][pick]])
    mx.save_safetensors(str(weights), arrays, metadata={"format": "pt"})


def mask_costs(tokenizer_json: str, vocab: int, eos: set[int], encode, rounds: int) -> dict:
    """Per-step mask fill and apply times walking valid replies, compile
    times, and a batch of 8 rows filled at once."""
    import llguidance
    import mlx.core as mx

    from worker.constrain import BatchMasks, Constraints

    t0 = time.perf_counter()
    constraints = Constraints(tokenizer_json, vocab, eos)
    constraints.prepare()
    view_ms = (time.perf_counter() - t0) * 1000
    masks = BatchMasks(vocab, eos)
    out: dict = {"vocab": vocab, "tokenizer_view_ms": round(view_ms, 1)}

    cases = {
        "json_schema": (schema_format(PET_NOTES), json.dumps(PET_NOTES_VALUE, separators=(",", ":"))),
        "json_object": ('{"type":"json_object"}', json.dumps(OBJECT_VALUE, separators=(",", ":"))),
    }
    logits = mx.zeros((1, vocab), dtype=mx.float32)
    for name, (text, reply) in cases.items():
        ids = encode(reply)
        fills, applies = [], []
        for _ in range(rounds):
            row = constraints.row(text, [])
            for token in ids:
                t = time.perf_counter()
                bits = masks.fill([row])
                fills.append((time.perf_counter() - t) * 1e6)
                t = time.perf_counter()
                mx.eval(masks.apply(logits, bits))
                applies.append((time.perf_counter() - t) * 1e6)
                row.advance(token)
            assert row.accepting, f"{name}: the valid reply was not accepted"
        out[name] = {
            "reply_tokens": len(ids),
            "fill_us": summary(fills, 1) | {"mean": round(statistics.mean(fills), 1), "p99": round(sorted(fills)[int(0.99 * len(fills))], 1)},
            "apply_us": summary(applies, 1),
        }

    # Compile = a cache miss (a distinct schema name), then the first mask.
    compile_ms, first_ms = [], []
    for i in range(max(rounds, 5)):
        text = schema_format(PET_NOTES, name=f"pet{i}")
        t = time.perf_counter()
        row = constraints.row(text, [])
        compile_ms.append((time.perf_counter() - t) * 1000)
        masks.fill([row])
        first_ms.append((time.perf_counter() - t) * 1000)
    t = time.perf_counter()
    for _ in range(100):
        constraints.row(schema_format(PET_NOTES), [])
    out["schema_compile_ms"] = summary(compile_ms, 2)
    out["schema_compile_and_first_mask_ms"] = summary(first_ms, 2)
    out["cached_schema_row_ms"] = round((time.perf_counter() - t) * 10, 3)

    # 8 rows at the same point of the same schema, filled by llguidance's
    # thread pool in one call.
    ids = encode(json.dumps(PET_NOTES_VALUE, separators=(",", ":")))
    batch = []
    for _ in range(rounds):
        rows = [constraints.row(schema_format(PET_NOTES), []) for _ in range(8)]
        for token in ids:
            t = time.perf_counter()
            masks.fill(rows)
            batch.append((time.perf_counter() - t) * 1e6)
            for r in rows:
                r.advance(token)
    out["batch8_fill_us"] = summary(batch, 1) | {"mean": round(statistics.mean(batch), 1)}
    out["llguidance"] = llguidance.__version__
    return out


def overlap_check(model_dir: Path, tokenizer: Path, steps: int, rounds: int) -> dict:
    """Do masks filled on BatchMasks' side thread overlap with a forward pass
    on mlx's CPU backend? One decode step of the model, and the masks of 1
    or 8 rows of the 151k tokenizer at the start of a length-bounded string,
    llguidance's costliest kind of step (free text is cheap: its precomputed
    slices cover it): each alone, one after the other, and overlapped."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from tokenizers import Tokenizer

    from worker.constrain import BatchMasks, Constraints
    from worker.loader import load

    model = load(model_dir).model
    tok = Tokenizer.from_file(str(tokenizer))
    eos = {tok.token_to_id("<|im_end|>")}
    constraints = Constraints(tok.to_str(), REAL_VOCAB, eos)
    masks = BatchMasks(REAL_VOCAB, eos)
    prefix = tok.encode('{"name":"', add_special_tokens=False).ids
    cache = make_prompt_cache(model)
    y = mx.array([[1]], dtype=mx.uint32)
    mx.eval(model(y, cache=cache))

    def fresh_rows(n: int) -> list:
        # A matcher keeps the mask of its current state: each step gets new rows.
        rows = [constraints.row(schema_format(PET_NOTES), []) for _ in range(n)]
        for r in rows:
            for token in prefix:
                r.advance(token)
        return rows

    def run(kind: str, n: int) -> float:
        batches = [fresh_rows(n) for _ in range(steps)]
        t0 = time.perf_counter()
        for rows in batches:
            if kind == "forward":
                mx.eval(model(y, cache=cache))
            elif kind == "fill":
                masks.fill(rows)
            elif kind == "sequential":
                mx.eval(model(y, cache=cache))
                masks.fill(rows)
            else:
                logits = model(y, cache=cache)
                pending = masks.fill_async(rows)
                mx.eval(logits)
                pending.result()
        return (time.perf_counter() - t0) / steps * 1000

    out: dict = {"model": model_dir.name}
    for n in (1, 8):
        runs: dict[str, list[float]] = {k: [] for k in ("forward", "fill", "sequential", "overlapped")}
        for _ in range(rounds):
            for kind in runs:
                runs[kind].append(run(kind, n))
        med = {k: round(statistics.median(v), 3) for k, v in runs.items()}
        hidden = (med["sequential"] - med["overlapped"]) / med["fill"]
        out[f"rows{n}"] = {"ms_per_step": med, "share_of_fill_hidden": round(hidden, 2)}
    return out


def decode_speed(model_dir: Path, tokens: int, rounds: int, batches: list[int]) -> dict:
    import mlx.core as mx

    from tests.constrained_decode import Row, Sampler, decode
    from worker.constrain import BatchMasks, Constraints
    from worker.loader import load
    from worker.text import TextCodec

    loaded = load(model_dir)
    codec = TextCodec(model_dir, loaded.config)
    vocab = loaded.config["text_config"]["vocab_size"]
    constraints = Constraints.for_codec(codec, vocab)
    constraints.prepare()
    masks = BatchMasks(vocab, codec.eos_ids)
    prompt = codec.encode("<|im_start|>user\nList sixteen notes about the river.<|im_end|>\n<|im_start|>assistant\n")
    text = schema_format(LONG)
    variants = {"none": (False, True), "json_schema": (True, True), "json_schema_no_overlap": (True, False)}

    def once(batch: int, constrained: bool, overlap: bool) -> tuple[float, list[str]]:
        rows = [
            Row(
                Sampler(vocab_size=vocab, temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.1, seed=seed),
                constraints.row(text, prompt) if constrained else None,
            )
            for seed in range(batch)
        ]
        decoded = decode(loaded.model, prompt, rows, masks, max_tokens=tokens, eos=frozenset(), overlap=overlap)
        return batch * decoded.steps / decoded.seconds, [r.finish for r in rows]

    out: dict = {"model": model_dir.name, "vocab": vocab, "tokens": tokens}
    for batch in batches:
        once(batch, True, True)  # warm-up: kernels and the grammar compile here
        runs: dict[str, list[float]] = {v: [] for v in variants}
        finishes = set()
        for _ in range(rounds):
            for name, (constrained, overlap) in variants.items():
                rate, finish = once(batch, constrained, overlap)
                runs[name].append(rate)
                finishes.update(finish)
        assert finishes == {"length"}, f"every row should run to max_tokens, got {finishes}"
        med = {name: statistics.median(v) for name, v in runs.items()}
        out[f"batch{batch}"] = {
            "tok_s": {name: summary(v, 1) for name, v in runs.items()},
            "ratio_json_schema_vs_none": round(med["json_schema"] / med["none"], 3),
            "ratio_no_overlap_vs_none": round(med["json_schema_no_overlap"] / med["none"], 3),
        }
        print(f"{model_dir.name} batch {batch}: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in med.items()), file=sys.stderr)
    del loaded
    mx.clear_cache()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--tag", default="")
    args = p.parse_args()

    from worker.cpu_backend import load_openblas

    load_openblas()
    import mlx.core as mx
    from tokenizers import Tokenizer

    backend = "metal" if mx.metal.is_available() else ("cuda" if mx.cuda.is_available() else "cpu")
    load_before = load_average()
    demo = demo_model(args.size)
    real = real_vocab_model(args.size)
    result: dict = {"machine": machine(), "backend": backend, "masks": {}, "decode": {}}
    for label, model_dir in (("demo", demo), ("bpe-151k", real)):
        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        vocab = json.loads((model_dir / "config.json").read_text())["text_config"]["vocab_size"]
        eos = {tok.token_to_id("<|im_end|>")}
        masks = mask_costs(tok.to_str(), vocab, eos, lambda s: tok.encode(s, add_special_tokens=False).ids, args.rounds)
        masks["tokenizer_tokens"] = tok.get_vocab_size()
        result["masks"][label] = masks
        print(f"{label}: {json.dumps(masks)}", file=sys.stderr)
    result["overlap"] = overlap_check(demo, real_vocab_tokenizer(), steps=30, rounds=5)
    print(f"overlap: {json.dumps(result['overlap'])}", file=sys.stderr)
    batches = [int(b) for b in args.batches.split(",")]
    for label, model_dir in (("demo", demo), ("bpe-151k", real)):
        result["decode"][label] = decode_speed(model_dir, args.tokens, args.rounds, batches)
    result["load_average"] = {"before": load_before, "after": load_average()}
    write_result(tagged(f"constrain-{backend}-{args.size}", args.tag), result)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
