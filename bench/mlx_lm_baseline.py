"""`python -m bench.mlx_lm_baseline`: mlx-lm's own stream_generate on a model,
printing one JSON line of timings per run. Runs in its own process so that
the setup under test is the only difference:

- `defaults`: mlx-lm as a user gets it (weights as stored, mlx's bundled BLAS
  on CPU, mlx-lm's sequential gated-delta loop off Metal);
- `matched`: the worker's compute setup (OpenBLAS and float32 on CPU, the
  chunked gated-delta prefill), so only the generation loop differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--setup", choices=("defaults", "matched"), required=True)
    p.add_argument("--prompt-ids", required=True, help="JSON list of token ids")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seeds", default="1,2,3")
    args = p.parse_args()

    if args.setup == "matched":
        from worker.cpu_backend import load_openblas

        load_openblas()
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_logits_processors, make_sampler
    from mlx_lm.utils import load

    model, tokenizer = load(str(args.model))
    if args.setup == "matched":
        from worker import gated_delta
        from worker.cpu_backend import use_float32

        use_float32(model)
        mx.eval(model.parameters())
        gated_delta.install(model)
    ids = json.loads(args.prompt_ids)
    # chat_metal's default sampler: temperature 0.7, top-k 50, top-p 0.9,
    # repetition penalty 1.1 (mlx-lm looks back 20 tokens; the worker at all).
    sampler = make_sampler(temp=0.7, top_p=0.9, top_k=50)
    processors = make_logits_processors(repetition_penalty=1.1)
    runs = [0] + [int(s) for s in args.seeds.split(",")]  # run 0 warms up
    for i, seed in enumerate(runs):
        mx.random.seed(seed)
        t0 = time.perf_counter()
        first = last = None
        n = 0
        for response in stream_generate(
            model, tokenizer, ids, max_tokens=args.max_tokens, sampler=sampler, logits_processors=processors
        ):
            now = time.perf_counter()
            first = first or now
            last = now
            n += 1
        if i:
            print(json.dumps({"ttft_ms": (first - t0) * 1000, "tokens": n, "decode_s": last - first}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
