"""One stream, in one process: the worker's scheduler against mlx-lm's
`stream_generate` on the same model and prompt, and where each side's time
goes.

- `--runs` rounds, sides alternated (which goes first flips every round):
  one greedy request of `--max-tokens` on the same chat prompt; first token
  and decode tokens/s of each side, each of the worker's tokens timed at
  the line that first shows it (a token whose bytes end inside a character
  is written with the next one). mlx-lm stops at the tokenizer's EOS
  only, the worker at every end-of-turn token too, so both decode rates are
  taken over the first tokens of as many as the shorter reply has.
- fresh prompts (`--fresh`, of growing length, each new to both sides):
  the first token where the shapes of the prompt's passes are new, as a
  user's new message finds them (on CUDA mlx builds kernels and attention
  graphs per new shape). Each side gets its own text of the same number of
  tokens. Then another new text of that many tokens for each side: the
  first token where the shapes are built and the content is new (a prompt
  with one more character would not do: mlx-lm reads a prompt's last token
  in a pass of its own, so its first pass over n + 1 tokens has the shape
  of the n-token prompt's, while the worker's one pass has a new one).
- both sides run the same loaded model, whose modules the worker's loader
  has pointed at its chunked gated-delta prefill (mlx-lm's loop over the
  prompt's tokens is what a process of mlx-lm's own runs on CUDA and the
  CPU), so for a hybrid model the comparison is of the engines over the
  same prefill arithmetic; `bench.batch --through serve` runs mlx-lm in a
  process of its own.
- with `--traced`: a third side, the worker's scheduler with a lone row's
  decode step kept in the compiled trace (on CUDA the worker otherwise
  times its steps both ways and keeps the faster; docs/engine.md), in the
  same rounds.
- with `--top-p P`: both sides sample at temperature 0.7 with top-p P
  (no top-k; mlx-lm through `make_sampler`, each of the worker's requests
  seeded by its round) instead of reading the likeliest token, so a step
  includes each side's sampler over the model's whole vocabulary.
- with `--profile`: cProfile of one run of each side, of one fresh first
  token and of another new prompt's of the same length right after it, the
  top functions by own time (on a GPU a function's own
  time includes the mlx calls it makes, whose kernel launches happen there).

Results go to bench/results/one-stream-<backend>-<size>[-tag].json after
every round: medians and ranges of the ratios ours / mlx-lm.

    python -m bench.one_stream [--size small|0.8b|8b|8b-q4 | --model DIR] [--runs 5] [--max-tokens 256] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

TEMPERATURE = 0.7


def _top(profile: cProfile.Profile, lines: int = 25) -> str:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(lines)
    return out.getvalue()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small")
    p.add_argument("--model", type=Path, help="a model dir instead of a demo model")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--fresh", type=int, default=8, help="fresh prompts for the first-token series (0: none)")
    p.add_argument("--traced", action="store_true", help="a third side: a lone row's decode step in the compiled trace")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--top-p", type=float, default=0.0, help="sample at temperature 0.7 with this top-p instead of greedy")
    p.add_argument("--tag", default="")
    args = p.parse_args()

    from bench.common import TokenClock, backend, load_average, load_model, machine, summary, tagged, write_result

    path, loaded, codec = load_model(args.model or args.size)
    size = path.name if args.model else args.size
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from bench.chat import user_messages
    from ipc.messages import Generate
    from worker.engine.scheduler import Scheduler

    tokenizer = load_tokenizer(loaded.path)
    clock = TokenClock()

    def scheduler_of(traced: bool) -> Scheduler:
        made = Scheduler(loaded, codec, clock, batch_memory=8 << 30, prefix_cache_bytes=0, max_batch=8)
        if traced and made.compiled is not None:
            made.compiled.choice = None
            made.compiled.lone_attention_eager = False
        made.warm_up()
        return made

    scheduler = scheduler_of(False)
    traced_scheduler = scheduler_of(True) if args.traced else None
    rid = 0

    def chat(text: str) -> str:
        return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"

    def ours(prompt: str, n: int, through: Scheduler = scheduler) -> list[float]:
        """The time each of the request's tokens was first written, from its
        submission (the last token's line comes with the final line, in one
        write)."""
        nonlocal rid
        rid += 1
        t0 = clock.start(through)
        sampled = {"temperature": TEMPERATURE, "top_k": 0, "top_p": args.top_p, "seed": rid} if args.top_p else {"temperature": 0.0}
        through.submit(Generate(rid=rid, prompt=prompt, max_tokens=n, repetition_penalty=1.0, **sampled), t0)
        while through.has_work:
            through.step()
        return clock.times()

    def traced(prompt: str, n: int) -> list[float]:
        return ours(prompt, n, traced_scheduler)

    def theirs(prompt: str, n: int) -> list[float]:
        t0 = time.perf_counter()
        steps = stream_generate(loaded.model, tokenizer, codec.encode(prompt), max_tokens=n, sampler=sampler)
        return [time.perf_counter() - t0 for _ in steps]

    sampler = make_sampler(temp=TEMPERATURE, top_p=args.top_p) if args.top_p else None

    def rate(times: list[float], tokens: int) -> float:
        """Decode tokens/s over the first `tokens` tokens."""
        return (tokens - 1) / (times[tokens - 1] - times[0]) if tokens > 1 else 0.0

    base = chat(user_messages(codec.tokenizer, 1, 48)[0])
    sides = (ours, theirs, traced) if args.traced else (ours, theirs)
    for side in sides:
        side(base, 32)
        side(base, 32)
    result = {
        "size": size,
        "backend": backend(),
        "prompt_tokens": len(codec.encode(base)),
        "max_tokens": args.max_tokens,
        "sampling": {"temperature": TEMPERATURE, "top_p": args.top_p} if args.top_p else "greedy",
        "machine": machine(),
        "rounds": [],
    }
    name = tagged(f"one-stream-{backend()}-{size}", args.tag)
    for r in range(args.runs):
        got = {side.__name__: side(base, args.max_tokens) for side in (sides if r % 2 == 0 else sides[::-1])}
        tokens = min(len(times) for times in got.values())
        result["rounds"].append(
            {
                ("mlx_lm" if side == "theirs" else side): {"ttft_ms": round(times[0] * 1000, 2), "tok_s": round(rate(times, tokens), 1), "tokens": len(times)}
                for side, times in got.items()
            }
        )
        rounds = result["rounds"]
        result["decode_ratio"] = summary([x["ours"]["tok_s"] / x["mlx_lm"]["tok_s"] for x in rounds])
        result["ttft_ratio"] = summary([x["ours"]["ttft_ms"] / x["mlx_lm"]["ttft_ms"] for x in rounds])
        if args.traced:
            result["traced_decode_ratio"] = summary([x["traced"]["tok_s"] / x["mlx_lm"]["tok_s"] for x in rounds])
        result["load_average"] = load_average()
        write_result(name, result)
        print(f"round {r + 1}: {rounds[-1]} (decode rates over the first {tokens} tokens)", flush=True)

    def as_long_as(text: str, n: int) -> str:
        """A chat prompt of `text`, cut to n tokens (or as near as the
        tokenizer's merges at the cut allow)."""
        ids = codec.encode(text)
        k = n
        for _ in range(8):
            prompt = chat(codec.tokenizer.decode(ids[:k]))
            got = len(codec.encode(prompt))
            if got == n:
                break
            k += n - got
        return prompt

    if args.fresh:
        texts = user_messages(codec.tokenizer, 2 * args.fresh, 30)
        fresh = result["fresh"] = []
        for i in range(args.fresh):
            words = 1 + i % 6
            mine = chat(" ".join(texts[2 * i : 2 * i + words]) + f" ({i})")
            n = len(codec.encode(mine))
            other = as_long_as(" ".join(texts[2 * i + 1 :] + texts[: 2 * i + 1]) + f" ({i})", n)
            first = ((ours, mine), (theirs, other)) if i % 2 == 0 else ((theirs, other), (ours, mine))
            ms = {side.__name__: side(prompt, 1)[0] * 1000 for side, prompt in first}
            same = {
                side.__name__: side(as_long_as(" ".join(texts[2 * i + j :] + texts[: 2 * i + j]) + f" [{i}]", n), 1)[0] * 1000
                for j, (side, _) in enumerate(first, 2)
            }
            fresh.append(
                {
                    "tokens": n,
                    "mlx_lm_tokens": len(codec.encode(other)),
                    "ours_ms": round(ms["ours"], 1),
                    "mlx_lm_ms": round(ms["theirs"], 1),
                    "ours_same_length_ms": round(same["ours"], 1),
                    "mlx_lm_same_length_ms": round(same["theirs"], 1),
                }
            )
            print(f"fresh {fresh[-1]}", flush=True)
        result["fresh_ratio"] = summary([x["ours_ms"] / x["mlx_lm_ms"] for x in fresh])
        result["same_length_ratio"] = summary([x["ours_same_length_ms"] / x["mlx_lm_same_length_ms"] for x in fresh])
        write_result(name, result)

    if args.profile:
        for label, fn in (
            ("ours", lambda: ours(base, args.max_tokens)),
            ("mlx_lm", lambda: theirs(base, args.max_tokens)),
            ("ours_fresh_first_token", lambda: ours(chat(texts[0] + " profiled"), 1) if args.fresh else None),
            (
                "ours_first_token_same_length",
                lambda: ours(as_long_as(texts[1] + " profiled", len(codec.encode(chat(texts[0] + " profiled")))), 1) if args.fresh else None,
            ),
        ):
            profile = cProfile.Profile()
            profile.enable()
            fn()
            profile.disable()
            print(f"== {label}\n{_top(profile)}", flush=True)
    traced_line = f"; the lone step traced: {result['traced_decode_ratio']}" if args.traced else ""
    print(f"decode ours / mlx-lm: {result['decode_ratio']}; first token: {result['ttft_ratio']}{traced_line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
