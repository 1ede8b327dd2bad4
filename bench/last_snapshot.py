"""A hybrid chat prompt's last snapshot taken before its first token or
after it, in one process, side by side.

A hybrid model (Qwen3.5's gated-delta layers) keeps a prefix-cache
snapshot at the prompt's last message start, where the next turn resumes.
`cut`: the prompt's chunks end there, so `<|im_start|>assistant\\n` is read
in a pass of its own before the first token. `deferred`: the prompt is
read through it, and after the first token a ghost row reads the last
message again up to there and stores the snapshot (the worker's default on
a GPU, and on a CPU from 4,096 tokens of prompt; docs/engine.md).

Each round runs both sides, alternated (which goes first flips every
round), each on a fresh scheduler with an empty prefix cache: a chat of a
system prompt and a user message of `--message-tokens`, `--max-tokens`
greedy tokens (its first token, its decode rate, its time until the
worker is idle, the ghost's pass included), then the next turn (the reply
and a new message) and its first token, which resumes from the snapshot.
Greedy text must be the same on both sides.

`--context-tokens N` puts N tokens of tool definitions in the system
prompt: an agent's long prefix, where the cut's snapshot copies a long
attention cache before the first token.

Results go to bench/results/last-snapshot-<backend>-<size>[-tag].json after
every round: medians and ranges of the ratios deferred / cut.

    python -m bench.last_snapshot [--size small|0.8b] [--runs 5] [--max-tokens 64] [--message-tokens 40] [--context-tokens 0]
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--message-tokens", type=int, default=40)
    p.add_argument("--context-tokens", type=int, default=0, help="tokens of tool definitions in the system prompt (default none)")
    p.add_argument("--tag", default="")
    args = p.parse_args()

    from bench.common import TokenClock, backend, load_average, load_model, machine, summary, tagged, write_result

    # First: on a CPU it puts OpenBLAS under mlx before mlx is imported.
    path, loaded, codec = load_model(args.size)
    from bench.chat import user_messages
    from bench.long_context import long_text
    from harness.prompts import SYSTEM
    from ipc.messages import Generate
    from worker.engine.scheduler import Scheduler

    first, second = user_messages(codec.tokenizer, 2, args.message_tokens)
    system = long_text(codec, args.context_tokens) if args.context_tokens else SYSTEM
    turn1 = f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{first}<|im_end|>\n<|im_start|>assistant\n"
    clock = TokenClock()

    def ask(s: Scheduler, rid: int, prompt: str) -> tuple[list[float], float, dict]:
        """Token times, the time until the worker is idle, the final line."""
        t0 = clock.start(s)
        s.submit(Generate(rid=rid, prompt=prompt, max_tokens=args.max_tokens, temperature=0.0, repetition_penalty=1.0), t0)
        while s.has_work:
            s.step()
        return clock.times(), time.perf_counter() - t0, clock.done()

    def side(deferred: bool) -> dict:
        s = Scheduler(loaded, codec, clock, batch_memory=8 << 30, prefix_cache_bytes=1 << 30, max_batch=8)
        s.warm_up()
        s.generator.defer_from = 0 if deferred else None
        times, idle, _ = ask(s, 1, turn1)
        reply = clock.text()
        turn2 = turn1 + f"{reply}<|im_end|>\n<|im_start|>user\n{second}<|im_end|>\n<|im_start|>assistant\n"
        times2, _, done2 = ask(s, 2, turn2)
        return {
            "text": reply + "\x00" + clock.text(),
            "ttft_ms": round(times[0] * 1000, 2),
            "tok_s": round((len(times) - 1) / (times[-1] - times[0]), 1) if len(times) > 1 else 0.0,
            "tokens": len(times),
            "idle_ms": round(idle * 1000, 1),
            "next_ttft_ms": round(times2[0] * 1000, 2),
            "next_cached": done2.get("cached_tokens", 0),
            "next_text_tokens": len(times2),
        }

    result = {
        "size": args.size,
        "backend": backend(),
        "prompt_tokens": len(codec.encode(turn1)),
        "max_tokens": args.max_tokens,
        "machine": machine(),
        "rounds": [],
    }
    name = tagged(f"last-snapshot-{backend()}-{args.size}", args.tag)
    sides = (("cut", False), ("deferred", True))
    for r in range(args.runs):
        got = {label: side(deferred) for label, deferred in (sides if r % 2 == 0 else sides[::-1])}
        result["same_text"] = result.get("same_text", True) and got["cut"].pop("text") == got["deferred"].pop("text")
        result["rounds"].append(got)
        rounds = result["rounds"]
        for key in ("ttft_ms", "tok_s", "idle_ms", "next_ttft_ms"):
            result[f"{key}_ratio"] = summary([x["deferred"][key] / x["cut"][key] for x in rounds if x["cut"][key]])
        result["load_average"] = load_average()
        write_result(name, result)
        print(f"round {r + 1}: {got}", flush=True)
    ratios = {key: result[f"{key}_ratio"] for key in ("ttft_ms", "tok_s", "idle_ms", "next_ttft_ms")}
    print(f"deferred / cut: {ratios}; greedy text the same: {result['same_text']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
