"""N concurrent requests to one model: the batched worker vs the same worker
one request at a time vs mlx-lm, all in one run.

For each N, N greedy requests (no repetition penalty, as batch_generate's
defaults) with different prompts (40-80 tokens) are sent at once; each of
`--rounds` rounds starts every side afresh, warms it up and runs each N:

- `batched`: with `--through worker` (the default) our worker
  (`--max-batch` = the largest N) driven over its pipes; with `--through
  serve`, `lattice-pool serve` with `max_batch` = the largest N, the
  requests (with ids) written to its stdin at once and its stdout read as a
  client reads it;
- `one_at_a_time`: the same with max_batch 1, which serves them one after
  another as the worker and the pool did before batching;
- `mlx_lm_batch_generate`: mlx-lm's continuous-batching engine driven as
  `batch_generate` drives it (defaults: prefill batches of 8, up to 32 rows)
  on the same prompts, in its own process, on the worker's compute setup
  (`matched`: float32 + OpenBLAS on CPU, chunked gated-delta prefill);
- `mlx_lm_stream_generate`: for N = 1, `stream_generate` on the first prompt.

Every side warms up alike: in each round it runs the whole series of N
twice in one process, and the second pass is the one measured (the first
is kept as `cold`). On CUDA this matters: mlx builds a cuDNN attention graph
for every new prefill shape (mlx-lm's cold N = 1 first token on an H200:
4.8-8 s), and `stream_generate` is measured after a run of its own on the
same prompt.

Figures: aggregate tok/s (generated tokens / time from sending to the last
final line), TTFT p50 and p99 over the N requests (client side, from the
send), and the slowest TTFT over a lone request's; for our sides also the
decode rate each request saw inside the worker (tokens after the first /
time after the first, from its final line), the first token's time
from the request's arrival in the worker, and what the pipes and the relay
add to it (client's first token less the worker's, per request); medians
over rounds, ratios
per round then their median; the results file is written after every
round, so a run stopped at a time limit keeps what it finished. Prefix
caches are off: the same prompts repeat. Goals: at N = 8 aggregate
>= 1.0x batch_generate; N = 1 >= 0.98x stream_generate; slowest TTFT at
N = 8 <= 10x a lone request's on 2 CPU cores (<= 3x on an H200).

    python -m bench.batch [--size small|0.8b] [--model DIR] [--max-tokens 128] [--n 1,2,4,8,16] [--rounds 3] [--through worker|serve]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from pathlib import Path

from bench import mlx_lm_baseline
from bench.chat import user_messages
from bench.common import backend, bandwidth, demo_model, load_average, machine, median, model_arguments, percentile, tagged, weights_bytes, write_result
from harness.pool import PoolProc
from harness.worker import WorkerProc


class WorkerSide:
    """Requests sent straight to a worker process over its pipes."""

    def __init__(self, model: Path, max_batch: int | str):
        self.client = WorkerProc.started(model, "--max-batch", str(max_batch), "--prefix-cache-bytes", "0")

    def run(self, prompts: list[str], max_tokens: int) -> dict:
        return self.client.generate_many([dict(prompt=p, max_tokens=max_tokens, temperature=0.0, repetition_penalty=1.0) for p in prompts])

    def close(self) -> None:
        self.client.close()


class ServeSide:
    """Requests sent through `lattice-pool serve`, as its stdin client does."""

    _ids = itertools.count(1)

    def __init__(self, model: Path, max_batch: int | str):
        self.dir = tempfile.TemporaryDirectory(prefix="lattice-bench-batch-")
        config = Path(self.dir.name) / "pool.toml"
        config.write_text(f'prefix_cache_bytes = 0\nmax_batch = {json.dumps(max_batch)}\n[[models]]\nname = "m"\npath = "{model}"\npreload = true\n')
        # INFO: the worker logs its choice of decode step way per batch size
        # (on CUDA), printed at close.
        self.pool = PoolProc("--config", str(config), "--no-control-socket", "--log-level", "INFO")
        self.ready = self.pool.wait_ev("ready", model="m", timeout=600)

    def run(self, prompts: list[str], max_tokens: int) -> dict:
        requests = [
            {"id": f"b{next(self._ids)}", "model": "m", "prompt": p, "max_tokens": max_tokens, "temperature": 0.0, "repetition_penalty": 1.0} for p in prompts
        ]
        return self.pool.generate_many(requests)

    def close(self) -> None:
        try:
            assert self.pool.close() == 0
        finally:
            self.pool.kill()
            self.dir.cleanup()
        for line in self.pool.stderr.decode(errors="replace").splitlines():
            if "decode steps of" in line:
                print(f"  worker: {line.strip()}", file=sys.stderr)


SIDES = {"worker": WorkerSide, "serve": ServeSide}


def ours(side_cls, model: Path, max_batch: int | str, prompts: list[str], sizes: list[int], max_tokens: int) -> tuple[dict[int, dict], dict[int, dict]]:
    """One round: a fresh process, a warm-up batch, each N once (cold),
    then each N again (measured)."""
    side = side_cls(model, max_batch)
    try:
        ready = getattr(side, "ready", None)
        if ready:
            print(f"max_batch {max_batch}: {ready.get('max_batch')} ({ready.get('max_batch_why')})", file=sys.stderr)
        side.run(prompts[: max(sizes)], 8)
        cold = {n: side.run(prompts[:n], max_tokens) for n in sizes}
        measured = {n: side.run(prompts[:n], max_tokens) for n in sizes}
        for n, run in measured.items():
            slowest = max(range(n), key=lambda i: run["ttft_ms"][i])
            ttft, total, tokens = run["worker_ttft_total_tokens"][slowest]
            print(f"  N={n} slowest first token: {run['ttft_ms'][slowest]:.0f} ms from the send; in the worker {ttft:.0f} ms, {tokens} tokens", file=sys.stderr)
        return measured, cold
    finally:
        side.close()


def mlx_lm(model: Path, ids: list[list[int]], sizes: list[int], max_tokens: int) -> tuple[dict[int, dict], dict[int, dict], dict]:
    """One round of mlx-lm in a process of its own: batch runs for each N
    (after a warm-up) twice, the second measured, then a stream_generate
    run (after one of its own)."""
    lines = mlx_lm_baseline.run(
        model,
        "matched",
        "--max-tokens",
        str(max_tokens),
        "--prompts-ids",
        json.dumps(ids),
        "--batch-sizes",
        ",".join(map(str, sizes)),
        "--rounds",
        "2",
        "--prompt-ids",
        json.dumps(ids[0]),
        "--greedy",
        "--seeds",
        "1",
    )
    cold = {line["n"]: line for line in lines if line.get("round") == 0}
    batch = {line["n"]: line for line in lines if line.get("round") == 1}
    stream = next(line for line in lines if "n" not in line)
    return batch, cold, {"ttft_ms": [stream["ttft_ms"]], "tokens": stream["tokens"], "wall_s": stream["total_s"], "decode_s": stream["decode_s"]}


def agg(run: dict) -> float:
    return run["tokens"] / run["wall_s"]


def worker_decode(run: dict) -> float:
    """The median over the run's requests of the decode rate the worker saw."""
    return median([(n - 1) / (total - ttft) * 1000 for ttft, total, n in run["worker_ttft_total_tokens"] if n > 1 and total > ttft])


def summary(runs: list[dict]) -> dict:
    """Median over rounds of each figure."""
    ttfts = [sorted(r["ttft_ms"]) for r in runs]
    out = {
        "aggregate_tok_s": round(median([agg(r) for r in runs]), 1),
        "ttft_p50_ms": round(median([percentile(t, 50) for t in ttfts]), 1),
        "ttft_p99_ms": round(median([percentile(t, 99) for t in ttfts]), 1),
        "ttft_max_ms": round(median([t[-1] for t in ttfts]), 1),
        "tokens": [r["tokens"] for r in runs],
    }
    if all("worker_ttft_total_tokens" in r for r in runs):
        out["worker_decode_tok_s"] = round(median([worker_decode(r) for r in runs]), 1)
        # From the request's arrival in the worker: the client's figure less
        # this is what the pipes and the pool's relay add.
        out["worker_ttft_p50_ms"] = round(median([percentile(sorted(t[0] for t in r["worker_ttft_total_tokens"]), 50) for r in runs]), 1)
        # Paired per request, then the median over requests and rounds.
        out["relay_ttft_ms"] = round(median([median([c - w[0] for c, w in zip(r["ttft_ms"], r["worker_ttft_total_tokens"])]) for r in runs]), 2)
    if all(r.get("decode_s") for r in runs):
        out["decode_tok_s"] = round(median([(r["tokens"] - 1) / r["decode_s"] for r in runs]), 1)
    return out


def bandwidth_fraction(result: dict, table: dict, weights: int, bw: float | None) -> dict:
    """At N = 1, each side's decode rate times the bytes a step reads, over
    the memory bandwidth: how close a lone stream gets to the limit."""
    if not bw or 1 not in table.get("batched", {}):
        return {}
    rates = {"batched": table["batched"][1].get("worker_decode_tok_s")}
    if 1 in table.get("mlx_lm_stream_generate", {}):
        rates["mlx_lm_stream_generate"] = table["mlx_lm_stream_generate"][1].get("decode_tok_s")
    return {name: round(rate * weights / bw, 3) for name, rate in rates.items() if rate}


def tabulate(result: dict, sides: dict, colds: dict, names: list[str], sizes: list[int]) -> None:
    """The rounds so far: each side's figures, the cold ones, the ratios."""
    table = {name: {n: summary(runs) for n, runs in by_n.items()} for name, by_n in sides.items()}
    result["sides"] = table
    result["cold"] = {name: {n: summary(runs) for n, runs in by_n.items()} for name, by_n in colds.items()}
    lone = table["batched"][1]["ttft_p50_ms"] if 1 in sizes else None
    ratios = {}
    for n in sizes:
        r = {}
        for name in names[1:]:
            if n in sides[name]:
                # Per round (the sides ran close in time), then the median.
                per_round = [agg(a) / agg(b) for a, b in zip(sides["batched"][n], sides[name][n])]
                r[f"aggregate_vs_{name}"] = round(median(per_round), 3)
                r[f"aggregate_vs_{name}_range"] = [round(min(per_round), 3), round(max(per_round), 3)]
        if lone:
            r["slowest_ttft_vs_lone"] = round(table["batched"][n]["ttft_max_ms"] / lone, 2)
        ratios[n] = r
    if 1 in sizes and 1 in sides.get("mlx_lm_stream_generate", {}):
        ours_ttft = [r["ttft_ms"][0] for r in sides["batched"][1]]
        theirs = [r["ttft_ms"][0] for r in sides["mlx_lm_stream_generate"][1]]
        ttft = [a / b for a, b in zip(ours_ttft, theirs)]
        ratios[1]["ttft_vs_stream_generate"] = round(median(ttft), 3)
        ratios[1]["ttft_vs_stream_generate_range"] = [round(min(ttft), 3), round(max(ttft), 3)]
        decode = [worker_decode(a) / ((b["tokens"] - 1) / b["decode_s"]) for a, b in zip(sides["batched"][1], sides["mlx_lm_stream_generate"][1])]
        ratios[1]["decode_vs_stream_generate"] = round(median(decode), 3)
        ratios[1]["decode_vs_stream_generate_range"] = [round(min(decode), 3), round(max(decode), 3)]
    result["ratios"] = ratios
    result["bandwidth_fraction_n1"] = bandwidth_fraction(result, table, result["weights_bytes"], result["bandwidth_bytes_s"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(p)
    p.add_argument("--n", default="1,2,4,8,16", help="comma-separated numbers of concurrent requests")
    p.add_argument("--through", choices=sorted(SIDES), default="worker", help="what the requests go through (default worker)")
    p.add_argument("--skip", default="", help="comma-separated sides to leave out: one_at_a_time, mlx_lm")
    p.add_argument("--rounds", type=int, default=5, help="rounds, each a fresh process per side (default 5)")
    p.add_argument("--max-batch", default="auto", help="our side's max_batch: auto (the default) or a number; the one-at-a-time side has 1")
    p.add_argument("--bandwidth", type=float, help="the device's memory bandwidth in GB/s (default: the datasheet's for an H200 or H100)")
    args = p.parse_args()
    max_batch = args.max_batch if args.max_batch == "auto" else int(args.max_batch)

    from tokenizers import Tokenizer

    model = args.model or demo_model(args.size, args.q4)
    size = model.name if args.model else (args.size + ("-q4" if args.q4 and not args.size.endswith("-q4") else ""))
    sizes = [int(n) for n in args.n.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    prompts = [f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n" for text in user_messages(tokenizer, max(sizes), 24)]
    ids = [tokenizer.encode(p, add_special_tokens=False).ids for p in prompts]
    side = SIDES[args.through]
    info = machine()
    result = {
        "model": str(model),
        "size": None if args.model else size,
        "backend": backend(),
        "through": args.through,
        "max_batch": max_batch,
        "weights_bytes": weights_bytes(model),
        "bandwidth_bytes_s": bandwidth(info, args.bandwidth),
        "prompt_tokens": [len(i) for i in ids],
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "machine": info,
        "load_average": {"before": load_average()},
    }
    names = ["batched"]
    if "one_at_a_time" not in skip:
        names.append("one_at_a_time")
    if "mlx_lm" not in skip:
        names += ["mlx_lm_batch_generate", "mlx_lm_stream_generate"]
    sides: dict[str, dict[int, list[dict]]] = {name: {} for name in names}
    colds: dict[str, dict[int, list[dict]]] = {name: {} for name in names if name != "mlx_lm_stream_generate"}
    # Rounds alternate the sides, so that a busy spell on a shared machine
    # hits all of them.
    for done in range(args.rounds):
        rounds, cold_rounds = {}, {}
        rounds["batched"], cold_rounds["batched"] = ours(side, model, max_batch, prompts, sizes, args.max_tokens)
        if "one_at_a_time" in sides:
            rounds["one_at_a_time"], cold_rounds["one_at_a_time"] = ours(side, model, 1, prompts, sizes, args.max_tokens)
        if "mlx_lm_batch_generate" in sides:
            rounds["mlx_lm_batch_generate"], cold_rounds["mlx_lm_batch_generate"], stream = mlx_lm(model, ids, sizes, args.max_tokens)
            rounds["mlx_lm_stream_generate"] = {1: stream}
        for into, got in ((sides, rounds), (colds, cold_rounds)):
            for name, by_n in got.items():
                for n, run in by_n.items():
                    into[name].setdefault(n, []).append(run)
        # Written after every round: a run stopped at a time limit still
        # leaves the rounds it finished.
        result["rounds_done"] = done + 1
        result["load_average"]["after"] = load_average()
        tabulate(result, sides, colds, names, sizes)
        file_name = f"batch-{result['backend']}-{size}" + ("-serve" if args.through == "serve" else "")
        write_result(tagged(file_name, args.tag), result)
    table, ratios = result["sides"], result["ratios"]

    print(
        f"{'N':>3} {'side':24}{'agg tok/s':>11}{'TTFT p50':>10}{'TTFT p99':>10}{'TTFT max':>10}{'in worker':>11}{'wk TTFT':>9}{'cold agg':>10}{'cold max':>10}"
    )
    for n in sizes:
        for name in table:
            if n in table[name]:
                s = table[name][n]
                c = result["cold"].get(name, {}).get(n, {})
                print(
                    f"{n:>3} {name:24}{s['aggregate_tok_s']:>11}{s['ttft_p50_ms']:>10}{s['ttft_p99_ms']:>10}{s['ttft_max_ms']:>10}"
                    f"{s.get('worker_decode_tok_s', ''):>11}{s.get('worker_ttft_p50_ms', ''):>9}{c.get('aggregate_tok_s', ''):>10}{c.get('ttft_max_ms', ''):>10}"
                )
        print(f"    ratios: {ratios[n]}")
    print(f"fraction of the memory-bandwidth limit at N = 1: {result['bandwidth_fraction_n1'] or 'no bandwidth figure (--bandwidth)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
