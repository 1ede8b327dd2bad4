"""Thin float32 products through sgemv against sgemm, on the CPU.

    python -m bench.cpu_gemv [--size small] [--model DIR] [--rows 1,2,3] [--runs 5] [--max-tokens 128]

Two worker processes of the same model, side by side: one as shipped (its
thin products, at most 3 rows, e.g. the decode steps of up to 3 requests,
go to OpenBLAS's sgemv through worker/runtime/gemv_forward.c) and one with
`LATTICE_CPU_GEMV=off` (every product through OpenBLAS's sgemm, the
baseline). Both are started and warmed up first; then each round sends the
same greedy request, `--rows` copies at once, to one, then the other, the
order alternating. Reported per side: decode tokens/s (every request's
tokens after its first, over the time from the earliest first token to the
last end, as this process received them) and the first token (the
slowest); per round the ratio forwarded/sgemm of decode tokens/s; median,
min and max over the rounds. Results go to
bench/results/cpu-gemv-<model>[-tag].json after every round.
"""

from __future__ import annotations

import argparse
import sys

from bench.common import backend, demo_model, load_average, machine, model_arguments, summary, tagged, write_result
from harness.worker import WorkerProc

PROMPT = "<|im_start|>user\nTell me about the river, the mill and the bridge.<|im_end|>\n<|im_start|>assistant\n"
SIDES = {"sgemv": {}, "sgemm": {"LATTICE_CPU_GEMV": "off"}}


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
    args = p.parse_args()
    if backend() != "cpu":
        p.error("this compares two CPU paths; MLX computes on a GPU here")

    model = args.model.expanduser().resolve() if args.model else demo_model(args.size, args.q4)
    result = {"model": str(model), "max_tokens": args.max_tokens, "runs": args.runs, "machine": machine(), "rows": {}}
    name = tagged(f"cpu-gemv-{model.name}", args.tag)
    workers = {side: WorkerProc.started(model, env=env) for side, env in SIDES.items()}
    try:
        for w in workers.values():
            measure(w, 1, args.max_tokens)  # warm-up: compiled steps, kernels
        for rows in [int(x) for x in args.rows.split(",")]:
            entry = result["rows"].setdefault(str(rows), {"rounds": []})
            for w in workers.values():
                measure(w, rows, 8)  # this batch size's compiled steps
            for round_ in range(args.runs):
                order = list(SIDES) if round_ % 2 == 0 else list(reversed(SIDES))
                got = {side: measure(workers[side], rows, args.max_tokens) for side in order}
                got["ratio"] = round(got["sgemv"]["decode_tok_s"] / got["sgemm"]["decode_tok_s"], 3)
                entry["rounds"].append(got)
                entry["ratio"] = summary([r["ratio"] for r in entry["rounds"]])
                for side in SIDES:
                    entry[side] = {
                        "decode_tok_s": summary([r[side]["decode_tok_s"] for r in entry["rounds"]]),
                        "ttft_ms": summary([r[side]["ttft_ms"] for r in entry["rounds"]]),
                    }
                result["load_avg_now"] = load_average()
                write_result(name, result)
                print(
                    f"{rows} rows, round {round_ + 1}: sgemv {got['sgemv']['decode_tok_s']} tok/s (first token {got['sgemv']['ttft_ms']} ms), "
                    f"sgemm {got['sgemm']['decode_tok_s']} tok/s ({got['sgemm']['ttft_ms']} ms), ratio {got['ratio']}",
                    flush=True,
                )
            print(
                f"{rows} rows: decode tok/s through sgemv over sgemm: median {entry['ratio']['median']} (min {entry['ratio']['min']}, max {entry['ratio']['max']})"
            )
    finally:
        for w in workers.values():
            w.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
