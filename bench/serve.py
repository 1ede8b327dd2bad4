"""End to end: decode tok/s through `lattice-pool serve` vs mlx-lm direct, in
one run, every side loaded at once.

    python -m bench.serve [--size tiny|small|0.8b|4b|8b[-q4]] [--rounds 5] [--tokens 256] [--skip worker] [--tag T]

Both sides decode greedily from the same prompt with the same weights.
"serve" is seen as a client sees it: the arrival times of token lines on
the pool's stdout, the worker behind the supervisor (its default
settings). "worker" is the same worker program driven over its own pipes,
no supervisor, timed the same way: serve/worker is the supervisor's share,
worker/mlx-lm the engine's. "mlx-lm" is mlx_lm.stream_generate in this
process, timed at each yielded token, on the worker's compute setup (on a
CPU float32 weights and OpenBLAS, as `bench.batch` runs it).

Every side is loaded before the first round and stays loaded, and each
round runs one request per side back to back, the order rotating from
round to round: the sides of a round run seconds apart, under the same
state of the host. On the lent GPU machines that matters: a lone row of a
4B-8B model is bound by the host launching its kernels, and there the
host's speed moved mlx-lm's own decode rate by up to 1.8x within minutes
on one machine, so sides measured in processes minutes apart
(`bench.batch --through serve`) compare the machine's moments as much as
the engines.
Decode rate = (tokens - 1) / (time of the last token - time of the first),
so prompt processing stays out of it (the same prompt every round: the
pool's prefix cache would make its first token incomparable). Tokens are
counted, not lines: a character split across tokens arrives as one line,
so for the pool and the worker the count is the done line's gen_tokens
and the last token's time is the done line's arrival. Each side warms up
first. The goal is serve >= 0.98x mlx-lm. The results file
(bench/results/serve-<backend>-<size>[-tag].json) is written after every
round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import NOISY, backend, demo_model, machine, summary, tagged, write  # noqa: E402
from bench.mlx_lm_baseline import load_model  # noqa: E402
from harness.pool import PoolProc  # noqa: E402
from harness.worker import WorkerProc  # noqa: E402

PROMPT = "<|im_start|>user\nTell me about the river and the mill.<|im_end|>\n<|im_start|>assistant\n"


def decode_rates(done: dict) -> tuple[float, int]:
    """(client-side decode tok/s, tokens) of a request's final event: tokens
    after the first over the time from the first token line to the done line."""
    n = done["gen_tokens"]
    return (n - 1) / ((done["client_total_ms"] - done["client_ttft_ms"]) / 1000.0), n


WARM_TOKENS = 64
GREEDY = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0}


class Serve:
    """A `lattice-pool serve` on one model, timed as its client sees it."""

    def __init__(self, model: Path):
        self.pool = PoolProc("--model-dir", str(model))
        self.ready = self.pool.wait_ev("ready")

    def decode(self, tokens: int) -> tuple[float, int, float]:
        """(client-side decode tok/s, tokens, the worker's own decode tok/s)."""
        done = self.pool.generate({"prompt": PROMPT, "max_tokens": tokens, **GREEDY})
        own = (done["gen_tokens"] - 1) / ((done["total_ms"] - done["ttft_ms"]) / 1000.0)
        return (*decode_rates(done), own)

    def close(self) -> None:
        assert self.pool.close() == 0


class Worker:
    """The worker program over its own pipes, as the supervisor drives it."""

    def __init__(self, model: Path):
        self.w = WorkerProc.started(model)

    def decode(self, tokens: int) -> tuple[float, int]:
        return decode_rates(self.w.generate(prompt=PROMPT, max_tokens=tokens, **GREEDY))

    def close(self) -> None:
        self.w.close()


class Direct:
    """mlx-lm's own generation loop, in this process, on the worker's compute
    setup (bench.mlx_lm_baseline's `matched`: on a CPU float32 weights and
    OpenBLAS, which this process loads before anything imports mlx)."""

    def __init__(self, model: Path):
        self.model, self.tokenizer = load_model(model, "matched")
        from mlx_lm.sample_utils import make_sampler

        self.sampler = make_sampler(temp=0.0)

    def decode(self, tokens: int) -> tuple[float, int]:
        from mlx_lm import stream_generate

        times = []
        for _ in stream_generate(self.model, self.tokenizer, PROMPT, max_tokens=tokens, sampler=self.sampler):
            times.append(time.perf_counter())
        return (len(times) - 1) / (times[-1] - times[0]), len(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="tiny", help="demo model size (default tiny, the built-in demo): tiny, small, 0.8b, 4b, 8b; a -q4 suffix for 4-bit")
    p.add_argument("--rounds", type=int, default=5, help="requests per side (default 5)")
    p.add_argument("--tokens", type=int, default=256, help="max tokens per request (default 256)")
    p.add_argument("--skip", choices=["worker"], action="append", default=[], help="leave a side out (the worker without the supervisor: one model copy less)")
    p.add_argument("--tag", default="", help="suffix for the results file name")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)

    name = tagged(f"serve-{backend()}-{args.size}", args.tag)
    model = demo_model(args.size)
    direct = Direct(model)
    serve = Serve(model)
    bare = None if "worker" in args.skip else Worker(model)
    decoders = {"serve": serve.decode, "mlx_lm": direct.decode}
    if bare is not None:
        decoders["worker"] = bare.decode
    rates: dict[str, list[float]] = {"serve": [], "serve_worker_reported": [], "worker": [], "mlx_lm": []}
    counts: dict[str, set] = {"serve": set(), "worker": set(), "mlx_lm": set()}

    def run(side: str) -> None:
        # serve's decode also gives the worker's own rate.
        rate, n, *own = decoders[side](args.tokens)
        rates[side].append(rate)
        counts[side].add(n)
        if own:
            rates["serve_worker_reported"].append(own[0])

    sides = list(decoders)
    try:
        # A short reply's worth, so that the first measured round finds its
        # kernels built (and a worker that times its two ways of stepping
        # in a request rather than in its own warm-up, done with that).
        for decode in decoders.values():
            decode(WARM_TOKENS)
        for r in range(args.rounds):
            k = r % len(sides)
            for side in sides[k:] + sides[:k]:
                run(side)
            result = _result(args, serve.ready, rates, counts)
            write(name, result, args.out)
    finally:
        serve.close()
        if bare is not None:
            bare.close()
    _report(args, result)
    return 0


def _result(args, ready: dict, rates: dict[str, list[float]], counts: dict[str, set]) -> dict:
    serve_rates, direct_rates, bare_rates = rates["serve"], rates["mlx_lm"], rates["worker"]
    paired = [s / d for s, d in zip(serve_rates, direct_rates)]
    ratio = statistics.median(paired)
    result = {
        "note": NOISY,
        "machine": machine(),
        "model": {"demo_size": args.size, "format": ready["format"], "load_ms": ready["load_ms"]},
        "max_tokens": args.tokens,
        "rounds": len(serve_rates),
        "tokens_generated": {k: sorted(v) for k, v in counts.items() if v},
        "decode_tok_s": {
            "serve_client_side": summary(serve_rates, 2),
            "serve_worker_reported": summary(rates["serve_worker_reported"], 2),
            "mlx_lm_direct": summary(direct_rates, 2),
        },
        # Per round (its sides ran seconds apart), then the median.
        "serve_over_mlx_lm": summary(paired),
        "per_round_tok_s": {k: [round(x, 2) for x in v] for k, v in rates.items() if v},
        "goal": 0.98,
        "meets_goal": ratio >= 0.98,
    }
    if bare_rates:
        result["decode_tok_s"]["worker_without_supervisor"] = summary(bare_rates, 2)
        result["serve_over_worker_without_supervisor"] = summary([s / b for s, b in zip(serve_rates, bare_rates)])
        result["worker_without_supervisor_over_mlx_lm"] = summary([b / d for b, d in zip(bare_rates, direct_rates)])
    return result


def _report(args, result: dict) -> None:
    d = result["decode_tok_s"]
    print(NOISY)
    print(f"demo model {args.size} ({result['model']['format']}), {args.tokens} tokens, greedy, {result['rounds']} rounds")
    alone = f"  worker alone {d['worker_without_supervisor']['median']}" if "worker_without_supervisor" in d else ""
    print(
        f"decode tok/s  serve {d['serve_client_side']['median']} (worker says {d['serve_worker_reported']['median']}){alone}  mlx-lm {d['mlx_lm_direct']['median']}"
    )
    ratio = result["serve_over_mlx_lm"]
    shares = ""
    if "serve_over_worker_without_supervisor" in result:
        shares = f" = supervisor share {result['serve_over_worker_without_supervisor']['median']} x engine share {result['worker_without_supervisor_over_mlx_lm']['median']}"
    print(f"serve/mlx-lm {ratio['median']} ({ratio['min']}-{ratio['max']}; goal >= 0.98: {'met' if result['meets_goal'] else 'MISSED'}){shares}")


if __name__ == "__main__":
    sys.exit(main())
