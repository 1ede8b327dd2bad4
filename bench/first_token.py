"""Where a lone request's first token goes, in one process: the worker's
scheduler against mlx-lm's `stream_generate` on the same prompt.

For each of `--runs` alternated runs, one request (greedy, 4 tokens):

- `ours`: submitted to the worker's scheduler and stepped until its first
  token line is written; the client-side first token (no sync added) and,
  in a second pass with `mx.synchronize()` after every step, the time of
  each step up to it (admission and prefill chunk, then the decode steps);
- `ours_cleared`: the same after `mx.clear_cache()`, as a request finds a
  worker that has handed MLX's buffers back;
- `mlx_lm`: `stream_generate`'s first yield.

    python -m bench.first_token [--size small|0.8b | --model DIR] [--runs 5] [--prompt-index 0]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small")
    p.add_argument("--model", type=Path, help="a model dir instead of a demo model (e.g. `lattice-pool demo-model --size 4b --layers 3 DIR`)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--prompt-index", type=int, default=0, help="which of bench.batch's prompts")
    p.add_argument("--tag", default="")
    args = p.parse_args()

    from bench.common import backend, load_average, load_model, machine, median, tagged, write_result

    path, loaded, codec = load_model(args.model or args.size)
    size = path.name if args.model else args.size
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from bench.chat import user_messages
    from ipc.messages import Generate
    from worker.engine.scheduler import Scheduler

    tokenizer = load_tokenizer(loaded.path)
    texts = user_messages(codec.tokenizer, args.prompt_index + 1, 24)
    prompt = f"<|im_start|>user\n{texts[args.prompt_index]}<|im_end|>\n<|im_start|>assistant\n"
    ids = codec.encode(prompt)
    first: list[float] = []
    scheduler = Scheduler(loaded, codec, lambda data: first.append(time.perf_counter()), batch_memory=1 << 30, prefix_cache_bytes=0, max_batch=8)
    scheduler.warm_up()

    def ours(clear: bool, synced: bool) -> tuple[float, list[float]]:
        if clear:
            mx.clear_cache()
        first.clear()
        steps = []
        t0 = time.perf_counter()
        scheduler.submit(Generate(rid=1, prompt=prompt, max_tokens=4, temperature=0.0, repetition_penalty=1.0), t0)
        while scheduler.has_work:
            s0 = time.perf_counter()
            scheduler.step()
            if synced:
                mx.synchronize()
                if not first or len(steps) < 8:
                    steps.append((time.perf_counter() - s0) * 1000)
        return (first[0] - t0) * 1000, steps

    def theirs() -> float:
        t0 = time.perf_counter()
        stream = stream_generate(loaded.model, tokenizer, ids, max_tokens=1)
        try:
            next(stream)
            return (time.perf_counter() - t0) * 1000
        finally:
            # Closed at once: a suspended stream_generate holds its `with
            # mx.stream(...)`, and so the default stream, until it ends.
            stream.close()

    variants = {
        "ours": lambda: ours(False, False)[0],
        "ours_cleared": lambda: ours(True, False)[0],
        "mlx_lm": theirs,
    }
    load_before = load_average()
    for name, fn in variants.items():
        print(f"warm-up {name}: {fn():.1f} ms", flush=True)
    runs = {name: [] for name in variants}
    for _ in range(args.runs):
        for name, fn in variants.items():
            runs[name].append(fn())
        print({name: round(v[-1], 1) for name, v in runs.items()}, flush=True)
    steps = {"warm": ours(False, True)[1], "cleared": ours(True, True)[1]}
    ttft = {name: round(median(v), 2) for name, v in runs.items()}
    result = {
        "size": size,
        "prompt_tokens": len(ids),
        "runs": args.runs,
        "ttft_ms": ttft,
        "ttft_runs_ms": {name: [round(x, 2) for x in v] for name, v in runs.items()},
        "synced_step_ms": {name: [round(x, 2) for x in v] for name, v in steps.items()},
        "ratio_ours_vs_mlx_lm": round(ttft["ours"] / ttft["mlx_lm"], 3),
        "ratio_cleared_vs_mlx_lm": round(ttft["ours_cleared"] / ttft["mlx_lm"], 3),
        "machine": machine(),
        "load_average": {"before": load_before, "after": load_average()},
    }
    write_result(tagged(f"first-token-{backend()}-{size}", args.tag), result)
    for name, value in ttft.items():
        print(f"{name:14}{value:9.2f} ms to the first token")
    print(f"steps (synced), warm: {result['synced_step_ms']['warm']}")
    print(f"steps (synced), cleared: {result['synced_step_ms']['cleared']}")
    print(f"ours / mlx-lm: {result['ratio_ours_vs_mlx_lm']} (kept buffers), {result['ratio_cleared_vs_mlx_lm']} (emptied)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
