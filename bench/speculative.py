"""Speculative decoding against plain decoding, in one process, side by side.

    python -m bench.speculative [--size small] [--runs 5] [--rows 1,8] [--max-tokens 128]
    python -m bench.speculative --size 8b [--layers 2] [--q4]   # the 8B shape as target

Four cases, each run through two schedulers of the worker on the same
target model, one plain and one with a drafter, alternated, `--runs`
rounds after a warm-up round:

On a large demo shape (`4b`, `8b`, `4b-hybrid`, `9b-hybrid`) the target is
the demo model with its layers' output projections scaled by 0.1
(`damped`): the same shapes and costs, but a residual stream that stays
near the token's embedding, as in the small demo models, so that drafts
made from its own layers agree with it often; and embedding rows of tokens
the demo corpus never pairs (near zero) given a direction of their own.

- `draft-agrees`: a draft model built here from the target itself, sharing
  its embedding, final norm and LM head: on a hybrid (Qwen3.5-shaped)
  target two of its decoder layers (the first, linear attention, and the
  first full-attention one), on an attention-only (Qwen3-shaped, `4b`,
  `8b`) target its first layer. The demo model's embedding and head hold
  bigram statistics, so the two agree often (the acceptance is measured
  and reported).
- `mtp`: the MTP head `demo-model --mtp` writes (worker.demo.build.add_mtp:
  the target's own full-attention layer over the next token's embedding and
  a little of the target's hidden state), added beside the target's files
  here; `draft = "mtp"`.
- `lookup`: prompt lookup (`ngram`) on a request to rewrite a paragraph.
- `draft-never`: a random attention-only model with the same tokenizer,
  which never agrees: the worker must stop drafting and keep plain speed.

Each request is greedy without repetition penalty, and every round checks
that each request's text with the drafter is the text without it. One
stream (1 row) and concurrent rows (`--rows`). Reported: tokens/s of each
side and the ratio drafted/plain per round (median, min, max), twice: over
the whole requests (`ratios`: reading the prompt included, which no drafter
speeds up) and over their decoding alone (`decode_ratios`: the tokens after
each row's first, over the time from the rows' first first token to their
last end, as the worker timed them: what mlx-lm reports as generation
tokens/s); and the acceptance.
Results go to bench/results/speculative-<backend>-<size>[-tag].json after
every round.

`--parts rollback` instead measures the two ways a hybrid model's
gated-delta state can be put back after a partly rejected draft: the
verify forward with the chunked recurrence plus a second forward of the
kept tokens (what the worker does), against the verify forward with the
token-by-token recurrence, which keeps every position's state (the other
way; its cost is at least this forward's).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

PARAGRAPH = (
    "The mill stood by the river for a hundred years. Every morning the miller opened the gate, "
    "and the water turned the wheel, and the wheel turned the stones. The village brought its grain "
    "in carts, and the miller weighed it, and ground it, and sent it back as flour."
)
PROMPTS = {
    "draft-agrees": "<|im_start|>user\nTell me about the river and the mill.<|im_end|>\n<|im_start|>assistant\n",
    "lookup": f"<|im_start|>user\nRewrite this paragraph, word for word:\n{PARAGRAPH}<|im_end|>\n<|im_start|>assistant\n",
    "draft-never": "<|im_start|>user\nTell me about the river and the mill.<|im_end|>\n<|im_start|>assistant\n",
    "mtp": "<|im_start|>user\nTell me about the river and the mill.<|im_end|>\n<|im_start|>assistant\n",
}


def _weights(model_dir: Path) -> dict:
    import mlx.core as mx

    weights = {}
    for file in sorted(model_dir.glob("model*.safetensors")):
        weights.update(mx.load(str(file)))  # lazy: only what is kept is read
    return weights


def layers_draft(target: Path, out: Path) -> Path:
    """A hybrid target's first decoder layer (linear attention) and its first
    full-attention layer, or an attention-only target's first layer, with
    its embedding, final norm and LM head."""
    import shutil

    import mlx.core as mx

    if (out / "config.json").is_file():
        return out
    config = json.loads((target / "config.json").read_text())
    text = config.get("text_config", config)
    hybrid = "full_attention_interval" in text
    full = text["full_attention_interval"] - 1 if hybrid else None
    out.mkdir(parents=True, exist_ok=True)
    keep = {}
    for key, value in _weights(target).items():
        if ".layers." not in key:
            keep[key] = value
        elif ".layers.0." in key:
            keep[key] = value
        elif hybrid and f".layers.{full}." in key:
            keep[key.replace(f".layers.{full}.", ".layers.1.")] = value
    mx.save_safetensors(str(out / "model.safetensors"), keep)
    text["num_hidden_layers"] = 2 if hybrid else 1
    if hybrid:
        text["full_attention_interval"] = 2
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target / name, out / name)
    return out


# The large demo shapes' layers (noise at 0.5/sqrt(fan-in)) move the
# residual stream far from the token's embedding over 36 layers, so that no
# small drafter agrees with them; their output projections are scaled by
# this for the speed cases, which leaves every shape and cost as it was.
DAMP = 0.1
DAMPED = ("o_proj", "out_proj", "down_proj")


def damped(target: Path, out: Path) -> Path:
    """The target with its layers' output projections (attention's o_proj,
    the gated-delta out_proj, the MLP's down_proj) scaled by DAMP, so the
    residual stream stays near the token's embedding, as in the small demo
    models, and drafts from its own layers agree with it often."""
    import shutil

    import mlx.core as mx

    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for file in sorted(target.glob("model*.safetensors")):
        arrays, metadata = mx.load(str(file), return_metadata=True)
        for key in arrays:
            module, _, leaf = key.rpartition(".")
            if module.endswith(DAMPED) and leaf in ("weight", "scales", "biases") and arrays[key].dtype != mx.uint32:
                arrays[key] = arrays[key] * DAMP  # affine 4-bit: scaling its scales and biases scales the weight
            elif key.endswith("embed_tokens.weight") and arrays[key].dtype != mx.uint32:
                arrays[key] = _whole_rows(arrays[key])
        mx.save_safetensors(str(out / file.name), arrays, metadata=metadata)
    for item in target.iterdir():
        if not item.name.endswith(".safetensors"):
            shutil.copy(item, out / item.name)
    return out


def _whole_rows(embed):
    """The embedding with its near-zero rows (tokens the demo corpus' bigrams
    never saw) given a seeded direction at the others' scale (RMS 8): an
    MTP head RMS-norms the embedding, which would blow their noise up."""
    import mlx.core as mx

    rms = mx.sqrt((embed.astype(mx.float32) ** 2).mean(axis=1, keepdims=True))
    noise = mx.random.normal(embed.shape, key=mx.random.key(5))
    noise = noise / mx.sqrt((noise**2).mean(axis=1, keepdims=True)) * 8.0
    return mx.where(rms < 1.0, noise, embed.astype(mx.float32)).astype(embed.dtype)


def with_mtp(target: Path, out: Path) -> Path:
    """The target's files (linked) with `demo-model --mtp`'s head beside them."""
    from worker.demo.build import add_mtp

    if (out / "mtp.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for item in target.iterdir():
        if not (out / item.name).exists():
            (out / item.name).symlink_to(item.resolve())
    add_mtp(out)
    return out


def random_draft(target: Path, out: Path) -> Path:
    """A random attention-only model (Qwen3) with the target's tokenizer."""
    from harness.models import TINY_DENSE, build_dense_model

    if (out / "config.json").is_file():
        return out
    return build_dense_model(out, target, **TINY_DENSE)


def run_batch(scheduler, prompt: str, rows: int, max_tokens: int, rid0: int) -> tuple[float, dict, list]:
    """Seconds for `rows` copies of the request; their ids; their final lines."""
    from ipc.messages import Generate

    scheduler._lines.clear()
    before = len(scheduler.emitted)
    start = time.perf_counter()
    for i in range(rows):
        scheduler.submit(Generate(rid=rid0 + i, prompt=prompt, max_tokens=max_tokens, temperature=0.0, repetition_penalty=1.0, id_json=str(rid0 + i)), 0.0)
    ids = scheduler.drain()
    took = time.perf_counter() - start
    finals = [json.loads(line[len(b"@@lattice ") :]) for line in scheduler.emitted[before:] if b'"done":true' in line]
    return took, ids, finals


def decode_rate(finals: list[dict]) -> float:
    """Tokens/s of the rows' decoding: every token after a row's first, over
    the time from the earliest first token to the last end (the worker's
    ttft_ms and total_ms, both from the requests' common arrival)."""
    window = max(f["total_ms"] for f in finals) - min(f["ttft_ms"] for f in finals)
    return round(sum(f["gen_tokens"] - 1 for f in finals) / (window / 1000), 1)


def speed(args, results, write) -> None:
    from bench.common import summary
    from worker.demo.large import LARGE
    from worker.engine.scheduler import Scheduler
    from worker.runtime.loader import load
    from worker.text.tokenizer import TextCodec

    target = args.model_dir
    demo = json.loads((target / "config.json").read_text()).get("lattice_demo", {})
    if demo.get("size") in LARGE:
        target = damped(target, target.parent / f"{target.name}-agree")
    # The target with an MTP head beside it: the same weights for every case.
    model_dir = with_mtp(target, target.parent / f"{target.name}-mtp")
    loaded = load(model_dir)
    codec = TextCodec(model_dir, loaded.config)
    drafts = {
        "draft-agrees": str(layers_draft(target, target.parent / f"{target.name}-draft2")),
        "mtp": "mtp",
        "lookup": "ngram",
        "draft-never": str(random_draft(target, target.parent / f"{target.name}-random")),
    }
    rows_list = [int(x) for x in args.rows.split(",")]

    def scheduler(draft):
        emitted: list[bytes] = []

        def emit(data: bytes) -> None:
            emitted.extend(data.splitlines(keepends=True))

        s = Scheduler(loaded, codec, emit, batch_memory=1 << 34, max_batch=max(rows_list), prefix_cache_bytes=0, draft=draft, draft_tokens=args.draft_tokens)
        s.emitted = emitted
        return s

    plain = scheduler(None)
    rid = 0
    for case in args.cases.split(","):
        drafted = scheduler(drafts[case])
        for rows in rows_list:
            key = f"{case}/{rows}"
            entry = results["cases"].setdefault(
                key,
                {
                    "ratios": [],
                    "plain_tok_s": [],
                    "draft_tok_s": [],
                    "decode_ratios": [],
                    "plain_decode_tok_s": [],
                    "draft_decode_tok_s": [],
                    "accepted": [],
                    "drafted": [],
                    "same_text": [],
                },
            )
            for round_ in range(args.runs + 1):
                order = [("plain", plain), ("draft", drafted)] if round_ % 2 == 0 else [("draft", drafted), ("plain", plain)]
                got = {}
                for side, s in order:
                    took, ids, finals = run_batch(s, PROMPTS[case], rows, args.max_tokens, rid)
                    rid += rows
                    got[side] = (took, [ids[k] for k in sorted(ids)], finals)
                if round_ == 0:
                    continue  # warm-up: traces, kernels, the worker's first timings
                (tp, plain_ids, plain_finals), (td, draft_ids, finals) = got["plain"], got["draft"]
                tokens = sum(len(x) for x in plain_ids)
                entry["plain_tok_s"].append(round(tokens / tp, 1))
                entry["draft_tok_s"].append(round(sum(len(x) for x in draft_ids) / td, 1))
                entry["ratios"].append(round(tp / td * sum(len(x) for x in draft_ids) / tokens, 3))
                entry["drafted"].append(sum(f.get("drafted_tokens", 0) for f in finals))
                entry["accepted"].append(sum(f.get("accepted_tokens", 0) for f in finals))
                entry["same_text"].append(draft_ids == plain_ids)
                assert draft_ids == plain_ids, f"{key}: greedy text differs with the drafter"
                entry["plain_decode_tok_s"].append(decode_rate(plain_finals))
                entry["draft_decode_tok_s"].append(decode_rate(finals))
                entry["decode_ratios"].append(round(entry["draft_decode_tok_s"][-1] / entry["plain_decode_tok_s"][-1], 3))
                entry["summary"] = summary(entry["ratios"])
                entry["decode_summary"] = summary(entry["decode_ratios"])
                entry["acceptance"] = round(sum(entry["accepted"]) / max(1, sum(entry["drafted"])), 3)
                write()
                print(
                    f"{key} round {round_}: plain {entry['plain_tok_s'][-1]} tok/s, drafted {entry['draft_tok_s'][-1]} tok/s, "
                    f"ratio {entry['ratios'][-1]}, decoding alone {entry['decode_ratios'][-1]}, kept {entry['accepted'][-1]}/{entry['drafted'][-1]}",
                    flush=True,
                )


def rollback(args, results, write) -> None:
    """Verify forward (chunked) + re-run of the kept tokens, against the
    verify forward with the token-by-token recurrence."""
    import mlx.core as mx
    import mlx_lm.models.qwen3_5 as qwen3_5
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.models.gated_delta import gated_delta_update as stepwise

    from bench.common import summary
    from worker.runtime.loader import load

    loaded = load(args.model_dir)
    model = loaded.model
    chunked = qwen3_5.gated_delta_update  # the worker's chunked recurrence (load installs it off Metal)
    width, kept = args.draft_tokens + 1, (args.draft_tokens + 1) // 2
    for rows in [int(x) for x in args.rows.split(",")]:
        prompt = mx.array([[5 + (i * 7 + r) % 500 for i in range(200)] for r in range(rows)], dtype=mx.uint32)
        block = prompt[:, :width]

        def fresh():
            cache = make_prompt_cache(model)
            mx.eval(model(prompt, cache=cache))
            return cache

        def rerun(cache):
            saved = [list(c.cache) if hasattr(c, "cache") else None for c in cache]
            mx.eval(model(block, cache=cache))
            for c, arrays in zip(cache, saved):
                if arrays is not None:
                    c.cache = arrays
                else:
                    c.trim(width)
            mx.eval(model(block[:, :kept], cache=cache), [c.state for c in cache])

        def per_position(cache):
            qwen3_5.gated_delta_update = stepwise
            try:
                mx.eval(model(block, cache=cache), [c.state for c in cache])
            finally:
                qwen3_5.gated_delta_update = chunked

        entry = results["rollback"].setdefault(str(rows), {"rerun_ms": [], "per_position_ms": []})
        for round_ in range(args.runs + 1):
            for name, fn in (
                (("rerun_ms", rerun), ("per_position_ms", per_position)) if round_ % 2 == 0 else (("per_position_ms", per_position), ("rerun_ms", rerun))
            ):
                samples = []
                for _ in range(10):
                    cache = fresh()
                    start = time.perf_counter()
                    fn(cache)
                    samples.append((time.perf_counter() - start) * 1000)
                if round_:
                    entry[name].append(round(sorted(samples)[len(samples) // 2], 3))
            if round_:
                entry["rerun"] = summary(entry["rerun_ms"])
                entry["per_position"] = summary(entry["per_position_ms"])
                write()
                print(f"rollback rows={rows}: re-run {entry['rerun_ms'][-1]} ms, per-position {entry['per_position_ms'][-1]} ms", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--size",
        default="small",
        help="demo model to build (once) and use as the target (default small): tiny, small, 0.8b; 4b, 8b (Qwen3-4B/8B's shape, attention only); "
        "4b-hybrid, 9b-hybrid (Qwen3.5's)",
    )
    p.add_argument("--layers", type=int, help="with --size 4b/8b/4b-hybrid/9b-hybrid: that many layers of the shape (e.g. 2 for a quick CPU run)")
    p.add_argument("--q4", action="store_true", help="the target in MLX 4-bit")
    p.add_argument("--model", type=Path, help="a demo model dir (demo-model DIR --size 8b --layers 2) instead of --size")
    p.add_argument("--runs", type=int, default=5, help="measured rounds, each side once, alternated (default %(default)s)")
    p.add_argument("--rows", default="1,8", help="concurrent requests per round, comma-separated (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--draft-tokens", type=int, default=4, help="most tokens drafted per row and step (default %(default)s)")
    p.add_argument("--cases", default="draft-agrees,mtp,lookup,draft-never", help="comma-separated (default %(default)s)")
    p.add_argument("--parts", default="speed", choices=("speed", "rollback"))
    p.add_argument("--tag", default="", help="suffix for the results file name")
    args = p.parse_args()
    if args.layers is not None and args.model is not None:
        p.error("--layers builds a demo model; --model names one")

    from worker.runtime.cpu_backend import load_openblas

    load_openblas()
    from bench.common import MODELS, backend, build_demo_model, demo_model, load_average, machine, tagged, write_result

    size = args.size + ("-q4" if args.q4 else "")
    if args.model is not None:
        args.model_dir, size = args.model.expanduser().resolve(), args.model.name
    elif args.layers is not None:
        args.model_dir = MODELS / f"{size}-l{args.layers}"
        if not (args.model_dir / "config.json").is_file():
            build_demo_model(args.model_dir, "--size", args.size, "--layers", str(args.layers), *(["--q4"] if args.q4 else []))
        size = args.model_dir.name
    else:
        args.model_dir = demo_model(size)
    results = {"size": size, "max_tokens": args.max_tokens, "runs": args.runs, "machine": machine(), "cases": {}, "rollback": {}}
    name = tagged(f"speculative-{backend()}-{size}" + ("-rollback" if args.parts == "rollback" else ""), args.tag)

    def write() -> None:
        results["load_avg_now"] = load_average()
        write_result(name, results)

    (speed if args.parts == "speed" else rollback)(args, results, write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
