"""N requests that reach an idle worker together, in one process: their
first tokens from the one forward that reads their prompts (the worker's
default) or from a decode step over all of them after it, side by side.

When a prefill group ends every prompt in one chunk and no row decodes,
that chunk reads the prompts' last tokens too and its logits at each row's
last token give the first tokens (`folded`). `stepped` leaves the last
tokens to the first decode step, as a group that joins running rows does:
one more forward over the N rows before any first token.

Each round runs both sides, alternated (which goes first flips every
round), on one scheduler each: N greedy chat prompts of different lengths
submitted at once, stepped until every request ends; each request's
first token from its submission, and the greedy text of each, which must
be the same on both sides.

Results go to bench/results/burst-<backend>-<size>[-tag].json after every
round: medians and ranges of the ratios folded / stepped.

    python -m bench.burst [--size small|0.8b|8b] [--n 8] [--runs 5] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--tag", default="")
    args = p.parse_args()

    from bench.common import backend, load_average, load_model, machine, summary, tagged, write_result

    # First: on a CPU it puts OpenBLAS under mlx before mlx is imported.
    path, loaded, codec = load_model(args.size)
    from bench.chat import user_messages
    from harness.engine import events
    from ipc.messages import Generate
    from worker.engine.scheduler import Scheduler

    texts = user_messages(codec.tokenizer, args.n, 24)
    prompts = [f"<|im_start|>user\n{' '.join(texts[: 1 + i % 3])} ({i})<|im_end|>\n<|im_start|>assistant\n" for i in range(args.n)]
    lines: list[bytes] = []
    stamps: dict[str, float] = {}

    def emit(data: bytes) -> None:
        now = time.perf_counter()
        lines.append(data)
        for e in events([data]):
            stamps.setdefault(e.get("id", ""), now)

    def scheduler(folded: bool) -> Scheduler:
        s = Scheduler(loaded, codec, emit, batch_memory=8 << 30, prefix_cache_bytes=0, max_batch=max(8, args.n))
        s.warm_up()
        if not folded:
            s.generator._parts = None
        return s

    sides = {"folded": scheduler(True), "stepped": scheduler(False)}

    def burst(s: Scheduler) -> tuple[list[float], list[str]]:
        lines.clear()
        stamps.clear()
        t0 = time.perf_counter()
        for i, prompt in enumerate(prompts):
            s.submit(Generate(rid=i + 1, id_json=f'"r{i}"', prompt=prompt, max_tokens=args.max_tokens, temperature=0.0, repetition_penalty=1.0), t0)
        while s.has_work:
            s.step()
        got = events(lines)
        text = ["".join(e["token"] for e in got if e.get("id") == f"r{i}" and e.get("ev") == "gen_token") for i in range(args.n)]
        return [(stamps[f"r{i}"] - t0) * 1000 for i in range(args.n)], text

    for s in sides.values():
        burst(s)  # the prompts' shapes built on both sides
    result = {"size": args.size, "backend": backend(), "n": args.n, "max_tokens": args.max_tokens, "machine": machine(), "rounds": [], "same_text": True}
    name = tagged(f"burst-{backend()}-{args.size}-n{args.n}", args.tag)
    order = list(sides)
    for r in range(args.runs):
        got = {label: burst(sides[label]) for label in (order if r % 2 == 0 else order[::-1])}
        result["same_text"] = result["same_text"] and got["folded"][1] == got["stepped"][1]
        result["rounds"].append(
            {label: {"first_token_p50_ms": round(statistics.median(ms), 1), "first_token_max_ms": round(max(ms), 1)} for label, (ms, _) in got.items()}
        )
        rounds = result["rounds"]
        for key in ("first_token_p50_ms", "first_token_max_ms"):
            result[f"{key}_ratio"] = summary([x["folded"][key] / x["stepped"][key] for x in rounds])
        result["load_average"] = load_average()
        write_result(name, result)
        print(f"round {r + 1}: {rounds[-1]}", flush=True)
    print(
        f"folded / stepped: p50 {result['first_token_p50_ms_ratio']}, slowest {result['first_token_max_ms_ratio']}; greedy text the same: {result['same_text']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
