"""Thin float32 products kept from sgemm, against a baseline, on the CPU.

    python -m bench.cpu_gemv [--size small] [--model DIR] [--rows 1,2,4,8] [--against off|sgemv] [--runs 5] [--max-tokens 128]

Two worker processes of the same model, side by side: one as shipped
(worker/runtime/gemv_forward.c: one-row products through OpenBLAS's sgemv,
2 to 16 rows times a weight matrix through its thin kernel, e.g. the decode
steps of up to 16 requests) and one with `LATTICE_CPU_GEMV` set to
`--against`: `off` (every product through OpenBLAS's sgemm) or `sgemv`
(sgemv for products of up to 3 rows, a row at a time, and sgemm for the
rest, without the kernel). Both are started and warmed up first; then each
round sends the same greedy request, `--rows` copies at once, to one, then
the other, the order alternating. Reported per side: decode tokens/s (every
request's tokens after its first, over the time from the earliest first
token to the last end, as this process received them) and the first token
(the slowest); per round the ratio shipped/baseline of decode tokens/s;
median, min and max over the rounds. Results go to
bench/results/cpu-gemv-<model>[-tag].json after every round.
"""

from __future__ import annotations

import argparse
import sys

from bench.common import backend, demo_model, load_average, machine, model_arguments, summary, tagged, write_result
from harness.worker import WorkerProc

PROMPT = "<|im_start|>user\nTell me about the river, the mill and the bridge.<|im_end|>\n<|im_start|>assistant\n"


def measure(worker: WorkerProc, rows: int, max_tokens: int) -> dict:
    request = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0, "repetition_penalty": 1.0}
    got = worker.generate_many([request] * rows)
    decode_s = (max(got["done_ms"]) - min(got["ttft_ms"])) / 1000
    return {
        "decode_tok_s": round((got["tokens"] - rows) / decode_s, 2),
        "ttft_ms": round(max(got["ttft_ms"]), 1),
        "tokens": got["tokens"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(p)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--rows", default="1", help="concurrent copies of the request, comma-separated (default %(default)s)")
    p.add_argument("--against", choices=("off", "sgemv"), default="off", help="the baseline's LATTICE_CPU_GEMV (default %(default)s)")
    args = p.parse_args()
    if backend() != "cpu":
        p.error("this compares two CPU paths; MLX computes on a GPU here")

    model = args.model.expanduser().resolve() if args.model else demo_model(args.size, args.q4)
    sides = {"shipped": {}, args.against: {"LATTICE_CPU_GEMV": args.against}}
    result = {"model": str(model), "max_tokens": args.max_tokens, "runs": args.runs, "against": args.against, "machine": machine(), "rows": {}}
    name = tagged(f"cpu-gemv-{model.name}", args.tag)
    workers = {side: WorkerProc.started(model, env=env) for side, env in sides.items()}
    try:
        for w in workers.values():
            measure(w, 1, args.max_tokens)  # warm-up: compiled steps, kernels
        for rows in [int(x) for x in args.rows.split(",")]:
            entry = result["rows"].setdefault(str(rows), {"rounds": []})
            for w in workers.values():
                measure(w, rows, 8)  # this batch size's compiled steps
            for round_ in range(args.runs):
                order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
                got = {side: measure(workers[side], rows, args.max_tokens) for side in order}
                got["ratio"] = round(got["shipped"]["decode_tok_s"] / got[args.against]["decode_tok_s"], 3)
                entry["rounds"].append(got)
                entry["ratio"] = summary([r["ratio"] for r in entry["rounds"]])
                for side in sides:
                    entry[side] = {
                        "decode_tok_s": summary([r[side]["decode_tok_s"] for r in entry["rounds"]]),
                        "ttft_ms": summary([r[side]["ttft_ms"] for r in entry["rounds"]]),
                    }
                result["load_avg_now"] = load_average()
                write_result(name, result)
                print(
                    f"{rows} rows, round {round_ + 1}: shipped {got['shipped']['decode_tok_s']} tok/s (first token {got['shipped']['ttft_ms']} ms), "
                    f"{args.against} {got[args.against]['decode_tok_s']} tok/s ({got[args.against]['ttft_ms']} ms), ratio {got['ratio']}",
                    flush=True,
                )
            print(
                f"{rows} rows: decode tok/s shipped over {args.against}: median {entry['ratio']['median']} (min {entry['ratio']['min']}, max {entry['ratio']['max']})"
            )
    finally:
        for w in workers.values():
            w.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
