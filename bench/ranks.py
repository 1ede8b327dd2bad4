"""One model over two processes vs one: decode tok/s and each process's memory.

The same worker command, once as one process and once with `--ranks 2`
(an MLX ring group over 127.0.0.1, the model split by mlx-lm's pipeline),
alternated `--runs` times, each run a fresh worker: a warm-up request,
then `--requests` seeded requests one at a time (chat_metal's sampler
settings), then a stats request for each rank's measured RSS, USS and
weights. On one machine the split cannot be faster (the ranks take turns
on the same cores, plus a hand-over per token); what it buys is memory per
process, the figure that lets a model too large for one machine run on
several.

    python -m bench.ranks [--size 0.8b] [--model DIR] [--max-tokens N] [--runs N] [--ranks N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.common import backend, demo_model, load_average, machine, median, model_arguments, tagged, write_result
from harness.worker import WorkerProc
from ipc.messages import Stats

PROMPT = "<|im_start|>user\nTell me about the river, the mill and the bridge.<|im_end|>\n<|im_start|>assistant\n"
SAMPLER = dict(temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.1)


def run(model: Path, ranks: int, max_tokens: int, requests: int, extra: list[str]) -> dict:
    args = ["--ranks", str(ranks), *extra] if ranks > 1 else []
    w = WorkerProc(model, *args)
    try:
        ready = w.wait_ready(600)
        w.generate(prompt=PROMPT, max_tokens=8, seed=0, **SAMPLER)  # warm-up
        rates, ttfts, tokens = [], [], []
        for seed in range(1, requests + 1):
            done = w.generate(prompt=PROMPT, max_tokens=max_tokens, seed=seed, **SAMPLER)
            decode_s = done["last_token_s"] - done["client_ttft_ms"] / 1000
            if done["gen_tokens"] > 1 and decode_s > 0:
                rates.append((done["gen_tokens"] - 1) / decode_s)
            ttfts.append(done["client_ttft_ms"])
            tokens.append(done["gen_tokens"])
        w.send(Stats())
        stats = w.next_event(60, skip=(b"heartbeat", b"loading"))
        assert stats["ev"] == "worker_stats", stats
        per_rank = stats.get("ranks") or [{"rank": 0, **{k: stats[k] for k in ("rss_bytes", "uss_bytes", "weights_bytes")}}]
        return {
            "load_ms": ready["load_ms"],
            "decode_tok_s": median(rates),
            "ttft_ms": median(ttfts),
            "tokens": tokens,
            "ranks": [{k: r[k] for k in ("rank", "rss_bytes", "uss_bytes", "weights_bytes")} for r in per_rank],
        }
    finally:
        w.close()


def combine(runs: list[dict]) -> dict:
    """Medians over the runs; memory per rank (median RSS of each rank)."""
    n = len(runs[0]["ranks"])
    return {
        "decode_tok_s": round(median([r["decode_tok_s"] for r in runs]), 2),
        "ttft_ms": round(median([r["ttft_ms"] for r in runs]), 1),
        "load_ms": int(median([r["load_ms"] for r in runs])),
        "per_rank": [
            {
                "rank": i,
                "rss_bytes": int(median([r["ranks"][i]["rss_bytes"] for r in runs])),
                "uss_bytes": int(median([r["ranks"][i]["uss_bytes"] for r in runs])),
                "weights_bytes": runs[0]["ranks"][i]["weights_bytes"],
            }
            for i in range(n)
        ],
        "runs": runs,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(p)
    p.set_defaults(size="0.8b", max_tokens=64)
    p.add_argument("--runs", type=int, default=3, help="fresh workers of each kind, alternated (default 3)")
    p.add_argument("--requests", type=int, default=3, help="requests per worker after the warm-up (default 3)")
    p.add_argument("--ranks", type=int, default=2, help="processes of the split worker (default 2)")
    p.add_argument("--worker-arg", action="append", default=[], help="extra worker flag for the split worker (e.g. --parallel=tensor, --backend=nccl)")
    args = p.parse_args()

    model = args.model or demo_model(args.size)
    load_before = load_average()
    single, split = [], []
    for _ in range(args.runs):
        single.append(run(model, 1, args.max_tokens, args.requests, []))
        split.append(run(model, args.ranks, args.max_tokens, args.requests, args.worker_arg))
    one, many = combine(single), combine(split)
    largest = max(r["rss_bytes"] for r in many["per_rank"])
    result = {
        "model": str(model),
        "size": args.size if not args.model else None,
        "backend": backend(),
        "max_tokens": args.max_tokens,
        "ranks": args.ranks,
        "worker_args": args.worker_arg,
        "machine": machine(),
        "one_process": one,
        "split": many,
        "decode_ratio": round(many["decode_tok_s"] / one["decode_tok_s"], 3),
        "largest_rank_rss_ratio": round(largest / one["per_rank"][0]["rss_bytes"], 3),
        "largest_rank_weights_ratio": round(max(r["weights_bytes"] for r in many["per_rank"]) / one["per_rank"][0]["weights_bytes"], 3),
        "total_rss_ratio": round(sum(r["rss_bytes"] for r in many["per_rank"]) / one["per_rank"][0]["rss_bytes"], 3),
        "load_average": {"before": load_before, "after": load_average()},
    }
    name = f"ranks-{result['backend']}-{args.size if not args.model else model.name}"
    write_result(tagged(name, args.tag), result)
    mb = 1e6
    print(f"{'':14}{'decode tok/s':>14}{'TTFT ms':>10}{'RSS per rank (MB)':>34}")
    for label, r in (("1 process", one), (f"{args.ranks} ranks", many)):
        rss = ", ".join(f"{x['rss_bytes'] / mb:.0f}" for x in r["per_rank"])
        print(f"{label:14}{r['decode_tok_s']:>14}{r['ttft_ms']:>10}{rss:>34}")
    print(
        f"split / one process: decode {result['decode_ratio']}x, largest rank's RSS {result['largest_rank_rss_ratio']}x "
        f"(weights {result['largest_rank_weights_ratio']}x), all ranks' RSS {result['total_rss_ratio']}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
