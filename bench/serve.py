"""End to end: decode tok/s through `lattice-pool serve` vs mlx-lm direct on
the demo model, in one run.

    python -m bench.serve [--size tiny] [--rounds 5] [--tokens 256]

Both sides decode greedily from the same prompt with the same weights.
"serve" is seen as a client sees it: the arrival times of token lines on
the pool's stdout, the worker behind the supervisor. "worker" is the same
worker program driven over its own pipes, no supervisor, timed the same
way: serve/worker is the supervisor's share, worker/mlx-lm the engine's.
"mlx-lm" is mlx_lm.stream_generate in this process, timed at each yielded
token.
Decode rate = (tokens - 1) / (time of the last token - time of the first),
so prompt processing stays out of it. Tokens are counted, not lines: a
character split across tokens arrives as one line, so for the pool and the
worker the count is the done line's gen_tokens and the last token's time is
the done line's arrival. Rounds alternate; each side warms up
first. The goal is serve >= 0.98x mlx-lm.
Writes bench/results/serve.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import NOISY, machine, summary, write  # noqa: E402
from harness.pool import PoolProc  # noqa: E402
from harness.procs import build_demo_model  # noqa: E402
from harness.worker import WorkerProc  # noqa: E402

PROMPT = "<|im_start|>user\nTell me about the river and the mill.<|im_end|>\n<|im_start|>assistant\n"


def decode_rates(done: dict) -> tuple[float, int]:
    """(client-side decode tok/s, tokens) of a request's final event: tokens
    after the first over the time from the first token line to the done line."""
    n = done["gen_tokens"]
    return (n - 1) / ((done["client_total_ms"] - done["client_ttft_ms"]) / 1000.0), n


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
    """mlx-lm's own generation loop, in this process."""

    def __init__(self, model: Path):
        from mlx_lm import load
        from mlx_lm.sample_utils import make_sampler

        self.model, self.tokenizer = load(str(model))
        self.sampler = make_sampler(temp=0.0)

    def decode(self, tokens: int) -> tuple[float, int]:
        from mlx_lm import stream_generate

        times = []
        for _ in stream_generate(self.model, self.tokenizer, PROMPT, max_tokens=tokens, sampler=self.sampler):
            times.append(time.perf_counter())
        return (len(times) - 1) / (times[-1] - times[0]), len(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="tiny", choices=["tiny", "small"], help="demo model size (default tiny, the built-in demo)")
    p.add_argument("--rounds", type=int, default=5, help="requests per side (default 5)")
    p.add_argument("--tokens", type=int, default=256, help="max tokens per request (default 256)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)

    serve_rates, direct_rates, worker_rates, bare_rates = [], [], [], []
    counts: dict[str, set] = {"serve": set(), "worker": set(), "mlx_lm": set()}
    with tempfile.TemporaryDirectory(prefix="lattice-bench-serve-") as tmp:
        model = Path(tmp) / "demo"
        build_demo_model(model, "--size", args.size)
        direct = Direct(model)
        serve = Serve(model)
        bare = Worker(model)
        try:
            serve.decode(16)
            bare.decode(16)
            direct.decode(16)
            for _ in range(args.rounds):
                rate, n, own = serve.decode(args.tokens)
                serve_rates.append(rate)
                worker_rates.append(own)
                counts["serve"].add(n)
                rate, n = bare.decode(args.tokens)
                bare_rates.append(rate)
                counts["worker"].add(n)
                rate, n = direct.decode(args.tokens)
                direct_rates.append(rate)
                counts["mlx_lm"].add(n)
        finally:
            serve.close()
            bare.close()

    ratio = statistics.median(serve_rates) / statistics.median(direct_rates)
    paired = statistics.median(s / d for s, d in zip(serve_rates, direct_rates))
    result = {
        "note": NOISY,
        "machine": machine(),
        "model": {"demo_size": args.size, "format": serve.ready["format"], "load_ms": serve.ready["load_ms"]},
        "max_tokens": args.tokens,
        "tokens_generated": {k: sorted(v) for k, v in counts.items()},
        "decode_tok_s": {
            "serve_client_side": summary(serve_rates, 2),
            "serve_worker_reported": summary(worker_rates, 2),
            "worker_without_supervisor": summary(bare_rates, 2),
            "mlx_lm_direct": summary(direct_rates, 2),
        },
        "serve_over_worker_without_supervisor": round(statistics.median(serve_rates) / statistics.median(bare_rates), 3),
        "worker_without_supervisor_over_mlx_lm": round(statistics.median(bare_rates) / statistics.median(direct_rates), 3),
        "serve_over_mlx_lm": round(ratio, 3),
        "serve_over_mlx_lm_paired_median": round(paired, 3),
        "goal": 0.98,
        "meets_goal": ratio >= 0.98,
    }
    d = result["decode_tok_s"]
    print(NOISY)
    print(f"demo model {args.size} ({result['model']['format']}), {args.tokens} tokens, greedy")
    print(
        f"decode tok/s  serve {d['serve_client_side']['median']} (worker says {d['serve_worker_reported']['median']})  "
        f"worker alone {d['worker_without_supervisor']['median']}  mlx-lm {d['mlx_lm_direct']['median']}"
    )
    print(
        f"serve/mlx-lm {result['serve_over_mlx_lm']} (paired {result['serve_over_mlx_lm_paired_median']}; "
        f"goal >= 0.98: {'met' if result['meets_goal'] else 'MISSED'}) = supervisor share {result['serve_over_worker_without_supervisor']}"
        f" x engine share {result['worker_without_supervisor_over_mlx_lm']}"
    )
    write("serve", result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
