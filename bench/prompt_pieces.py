"""A prefix-cache hit's first token with the prompt's long pieces kept
tokenized between requests, against the same worker tokenizing every
prompt whole, in one process.

The worker's scheduler gets an agent's prompt: a long system prompt
(`--tokens` of tool definitions) and a short question; the first request
reads it all, then each round asks a new question on the same prefix on
each side, alternating which goes first. Every request is a hit in the
prefix cache's memory tier; the sides differ only in the tokenizing.

    python -m bench.prompt_pieces [--size tiny] [--tokens 26000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="tiny")
    p.add_argument("--tokens", type=int, default=26000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--tag", default="")
    args = p.parse_args()

    from bench.common import backend, first_line_ms, load_average, load_model, machine, summary, tagged, write_result

    path, loaded, codec = load_model(args.size)
    from bench.long_context import QUESTIONS, chat, long_text
    from ipc.messages import Generate
    from worker.engine.scheduler import Scheduler

    system = long_text(codec, args.tokens)
    first: list[float] = []
    scheduler = Scheduler(loaded, codec, lambda data: first.append(time.perf_counter()), batch_memory=8 << 30, prefix_cache_bytes=8 << 30, max_batch=8)
    scheduler.warm_up()
    kept = codec.pieces
    if kept is None:
        print("this tokenizer keeps no pieces: nothing to compare", file=sys.stderr)
        return 1
    rid = 0

    def first_token_ms(question: str) -> float:
        nonlocal rid
        rid += 1
        return first_line_ms(scheduler, first, Generate(rid=rid, prompt=chat(system, question), max_tokens=1, temperature=0.0, repetition_penalty=1.0))

    sides = {"kept": kept, "whole": None}
    cold = first_token_ms(QUESTIONS[0])
    print(f"cold: {cold:.0f} ms", flush=True)
    load_before = load_average()
    runs: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            codec.pieces = sides[name]
            runs[name].append(first_token_ms(f"({r}, {name}) {QUESTIONS[r % len(QUESTIONS)]}"))
        codec.pieces = kept
        ratios = [w / k for w, k in zip(runs["whole"], runs["kept"])]
        result = {
            "size": args.size,
            "prefix_tokens": args.tokens,
            "cold_ms": round(cold, 1),
            "first_token_ms": {name: summary(v, 1) for name, v in runs.items()},
            "runs_ms": {name: [round(x, 1) for x in v] for name, v in runs.items()},
            "whole_over_kept": summary(ratios),
            "machine": machine(),
            "load_average": {"before": load_before, "after": load_average()},
        }
        write_result(tagged(f"prompt-pieces-{backend()}-{args.size}", args.tag), result)
        print(f"round {r}: kept {runs['kept'][-1]:.1f} ms, whole {runs['whole'][-1]:.1f} ms", flush=True)
    s = result["first_token_ms"]
    print(f"first token of a hit, median of {args.rounds}: kept {s['kept']['median']} ms ({s['kept']['min']}-{s['kept']['max']}), ")
    print(f"whole {s['whole']['median']} ms ({s['whole']['min']}-{s['whole']['max']}); whole / kept {result['whole_over_kept']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
