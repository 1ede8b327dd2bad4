"""An 8-turn chat growing to ~2k tokens: TTFT per turn with and without the
prefix cache.

Two worker processes on the same model, one started with
`--prefix-cache-bytes 0`; each turn sends the whole conversation as
`messages` (stateless, as Lattice Studio does) to both, greedy, and records
the worker-reported `ttft_ms`. Goal: with the cache, turn 8 <= 1.2 x turn 1.

    python -m bench.chat [--size small|0.8b] [--turns 8] [--target-tokens 2000]
"""

from __future__ import annotations

import argparse
import sys

from bench.common import backend, demo_model, load_average, machine, tagged, write_result
from harness.worker import WorkerProc


def user_messages(tokenizer, turns: int, tokens_each: int) -> list[str]:
    from worker.demo.build import corpus_text

    lines = [line for line in corpus_text().splitlines() if line.strip()]
    out, i = [], 0
    for _ in range(turns):
        text = ""
        while len(tokenizer.encode(text, add_special_tokens=False).ids) < tokens_each:
            text += lines[i % len(lines)] + " "
            i += 1
        out.append(text.strip())
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--target-tokens", type=int, default=2000)
    p.add_argument("--reply-tokens", type=int, default=64)
    p.add_argument("--system-tokens", type=int, default=150)
    p.add_argument("--tag", default="", help="suffix for the results file name")
    args = p.parse_args()

    from tokenizers import Tokenizer

    from ipc.messages import Message

    model = demo_model(args.size)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    per_user = max(16, (args.target_tokens - args.system_tokens - (args.turns - 1) * args.reply_tokens) // args.turns - 10)
    system = user_messages(tok, 1, args.system_tokens)[0]
    questions = user_messages(tok, args.turns + 1, per_user)[1:]
    load_before = load_average()
    cached = WorkerProc.started(model)
    plain = WorkerProc.started(model, "--prefix-cache-bytes", "0")
    rows = []
    try:
        messages = [Message("system", system)]
        for turn, question in enumerate(questions, 1):
            messages.append(Message("user", question))
            req = dict(messages=list(messages), temperature=0.0, max_tokens=args.reply_tokens)
            a, b = cached.generate(**req), plain.generate(**req)
            rows.append(
                {
                    "turn": turn,
                    "prompt_tokens": a["prompt_tokens"],
                    "cached_tokens": a.get("cached_tokens", 0),
                    "ttft_ms_cached": a["ttft_ms"],
                    "ttft_ms_plain": b["ttft_ms"],
                    "same_reply": a["text"] == b["text"],
                }
            )
            print(rows[-1], file=sys.stderr, flush=True)
            messages.append(Message("assistant", a["text"]))
    finally:
        cached.close()
        plain.close()
    first, last = rows[0], rows[-1]
    result = {
        "size": args.size,
        "backend": backend(),
        "turns": rows,
        "last_over_first_cached": round(last["ttft_ms_cached"] / first["ttft_ms_cached"], 3),
        "last_over_first_plain": round(last["ttft_ms_plain"] / first["ttft_ms_plain"], 3),
        "last_turn_speedup": round(last["ttft_ms_plain"] / last["ttft_ms_cached"], 2),
        "machine": machine(),
        "load_average": {"before": load_before, "after": load_average()},
    }
    write_result(tagged(f"chat-{result['backend']}-{args.size}", args.tag), result)
    print(f"{'turn':>5}{'prompt':>8}{'cached':>8}{'TTFT cache ms':>15}{'TTFT no-cache ms':>18}{'speedup':>9}{'same':>6}")
    for r in rows:
        print(
            f"{r['turn']:>5}{r['prompt_tokens']:>8}{r['cached_tokens']:>8}{r['ttft_ms_cached']:>15}{r['ttft_ms_plain']:>18}"
            f"{r['ttft_ms_plain'] / r['ttft_ms_cached']:>9.2f}{'yes' if r['same_reply'] else 'NO':>6}"
        )
    print(f"turn {last['turn']} / turn 1 TTFT: with cache {result['last_over_first_cached']}, without {result['last_over_first_plain']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
