"""Decode tok/s and TTFT: our worker process vs mlx-lm's stream_generate.

Same model, same prompt ids, same sampler settings (chat_metal's defaults),
same number of runs, all in one invocation. Two baselines:

- `matched`: mlx-lm's generation loop on the worker's compute setup; the
  ratio is the cost of the worker itself (pipes, sampler, detokenizer,
  event lines). Goal: >= 0.98.
- `defaults`: mlx-lm as installed (on CPU: bf16 weights, bundled BLAS); the
  ratio is what the worker's CPU path gains. Goal on CPU: >= 2x.

    python -m bench.worker [--size small|0.8b] [--model DIR] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench import mlx_lm_baseline
from bench.common import (
    backend,
    demo_model,
    load_average,
    machine,
    median,
    model_arguments,
    tagged,
    write_result,
)
from harness.worker import WorkerProc

PROMPT = "<|im_start|>user\nTell me about the river, the mill and the bridge.<|im_end|>\n<|im_start|>assistant\n"
SAMPLER = dict(temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.1)


def ours(model: Path, max_tokens: int, seeds: list[int]) -> list[dict]:
    w = WorkerProc.started(model)
    try:
        w.generate(prompt=PROMPT, max_tokens=max_tokens, seed=0, **SAMPLER)  # warm-up
        runs = []
        for seed in seeds:
            done = w.generate(prompt=PROMPT, max_tokens=max_tokens, seed=seed, **SAMPLER)
            decode_s = done["last_token_s"] - done["client_ttft_ms"] / 1000
            runs.append({"ttft_ms": done["client_ttft_ms"], "tokens": done["gen_tokens"], "decode_s": decode_s})
        return runs
    finally:
        w.close()


def mlx_lm(model: Path, setup: str, ids: list[int], max_tokens: int, seeds: list[int]) -> list[dict]:
    return mlx_lm_baseline.run(model, setup, "--prompt-ids", json.dumps(ids), "--max-tokens", str(max_tokens), "--seeds", ",".join(map(str, seeds)))


def summary(runs: list[dict]) -> dict:
    rates = [(r["tokens"] - 1) / r["decode_s"] for r in runs if r["tokens"] > 1 and r["decode_s"] > 0]
    return {
        "decode_tok_s": round(median(rates), 2),
        "ttft_ms": round(median([r["ttft_ms"] for r in runs]), 1),
        "tokens": [r["tokens"] for r in runs],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(p)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--baselines", default="matched,defaults")
    args = p.parse_args()

    from tokenizers import Tokenizer

    model = args.model or demo_model(args.size)
    ids = Tokenizer.from_file(str(model / "tokenizer.json")).encode(PROMPT, add_special_tokens=False).ids
    seeds = list(range(1, args.runs + 1))
    load_before = load_average()
    result = {
        "model": str(model),
        "size": args.size if not args.model else None,
        "backend": backend(),
        "prompt_tokens": len(ids),
        "max_tokens": args.max_tokens,
        "machine": machine(),
    }
    result["worker"] = summary(ours(model, args.max_tokens, seeds))
    for setup in args.baselines.split(","):
        base = summary(mlx_lm(model, setup, ids, args.max_tokens, seeds))
        base["decode_ratio"] = round(result["worker"]["decode_tok_s"] / base["decode_tok_s"], 3)
        base["ttft_ratio"] = round(base["ttft_ms"] / result["worker"]["ttft_ms"], 3)
        result[f"mlx_lm_{setup}"] = base
    result["load_average"] = {"before": load_before, "after": load_average()}
    name = f"worker-{result['backend']}-{args.size if not args.model else model.name}"
    write_result(tagged(name, args.tag), result)
    w = result["worker"]
    print(f"{'':22}{'decode tok/s':>14}{'TTFT ms':>10}{'decode ratio':>14}{'TTFT ratio':>12}")
    print(f"{'worker':22}{w['decode_tok_s']:>14}{w['ttft_ms']:>10}")
    for setup in args.baselines.split(","):
        b = result[f"mlx_lm_{setup}"]
        print(f"{'mlx-lm ' + setup:22}{b['decode_tok_s']:>14}{b['ttft_ms']:>10}{b['decode_ratio']:>14}{b['ttft_ratio']:>12}")
    print("ratios: worker / mlx-lm for decode, mlx-lm / worker for TTFT (higher is better for the worker)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
