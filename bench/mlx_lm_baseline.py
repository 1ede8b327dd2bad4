"""`python -m bench.mlx_lm_baseline`: mlx-lm's own generation on a model,
printing one JSON line of timings per run. Runs in its own process so that
the setup under test is the only difference:

- `defaults`: mlx-lm as a user gets it (weights as stored, mlx's bundled BLAS
  on CPU, mlx-lm's sequential gated-delta loop off Metal);
- `matched`: the worker's compute setup (OpenBLAS and float32 on CPU, the
  chunked gated-delta prefill), so only the generation loop differs.

Two modes: `stream_generate` runs (one prompt, `--seeds`, chat_metal's
default sampler), and with `--batch-sizes` the continuous-batching engine
behind `batch_generate` (greedy) on the first N of `--prompts-ids`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def run(model: Path, setup: str, *args: str) -> list[dict]:
    """This module in a process of its own (for the setup to hold); its JSON
    lines (bench.common.json_lines_of)."""
    from bench.common import json_lines_of

    return json_lines_of("bench.mlx_lm_baseline", "--model", str(model), "--setup", setup, *args)


def load_model(path: Path, setup: str):
    if setup == "matched":
        from worker.runtime.cpu_backend import load_openblas

        load_openblas()
    import mlx.core as mx
    from mlx_lm.utils import load

    model, tokenizer = load(str(path))
    if setup == "matched":
        from worker.runtime import gated_delta
        from worker.runtime.cpu_backend import use_float32

        use_float32(model)
        mx.eval(model.parameters())
        gated_delta.install(model)
    return model, tokenizer


def stream_runs(model, tokenizer, ids: list[int], max_tokens: int, seeds: list[int], greedy: bool) -> None:
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    if greedy:
        sampler, processors = None, None
    else:
        # chat_metal's default sampler: temperature 0.7, top-k 50, top-p 0.9,
        # repetition penalty 1.1 (mlx-lm looks back 20 tokens; the worker at all).
        sampler = make_sampler(temp=0.7, top_p=0.9, top_k=50)
        processors = make_logits_processors(repetition_penalty=1.1)
    runs = [0] + seeds  # run 0 warms up
    for i, seed in enumerate(runs):
        mx.random.seed(seed)
        t0 = time.perf_counter()
        first = last = None
        n = 0
        for _ in stream_generate(model, tokenizer, ids, max_tokens=max_tokens, sampler=sampler, logits_processors=processors):
            now = time.perf_counter()
            first = first or now
            last = now
            n += 1
        if i:
            print(json.dumps({"ttft_ms": (first - t0) * 1000, "tokens": n, "decode_s": last - first, "total_s": last - t0}), flush=True)


def batch_run(model, tokenizer, prompts: list[list[int]], max_tokens: int) -> dict:
    """batch_generate's loop (insert every prompt, then next_generated()
    until all are done), with a clock on each request's first token."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, stop_tokens=[[t] for t in tokenizer.eos_token_ids])
    t0 = time.perf_counter()
    uids = gen.insert(prompts, [max_tokens] * len(prompts))
    first: dict[int, float] = {}
    tokens = 0
    while responses := gen.next_generated():
        now = time.perf_counter()
        for r in responses:
            first.setdefault(r.uid, now)
            if r.finish_reason != "stop":
                tokens += 1
    wall = time.perf_counter() - t0
    gen.close()
    return {"ttft_ms": [(first[u] - t0) * 1000 for u in uids], "tokens": tokens, "wall_s": wall}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--setup", choices=("defaults", "matched"), required=True)
    p.add_argument("--prompt-ids", help="JSON list of token ids (stream_generate runs)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--greedy", action="store_true", help="stream_generate greedy instead of chat_metal's sampler")
    p.add_argument("--prompts-ids", help="JSON list of prompts' token ids (batch runs)")
    p.add_argument("--batch-sizes", help="comma-separated N: a batch run on the first N prompts each")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()

    model, tokenizer = load_model(args.model, args.setup)
    if args.prompt_ids:
        stream_runs(model, tokenizer, json.loads(args.prompt_ids), args.max_tokens, [int(s) for s in args.seeds.split(",")], args.greedy)
    if args.batch_sizes:
        prompts = json.loads(args.prompts_ids)
        sizes = [int(n) for n in args.batch_sizes.split(",")]
        batch_run(model, tokenizer, prompts[: max(sizes)], 8)  # warm-up
        for rnd in range(args.rounds):
            for n in sizes:
                result = batch_run(model, tokenizer, prompts[:n], args.max_tokens)
                print(json.dumps({"n": n, "round": rnd, **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
