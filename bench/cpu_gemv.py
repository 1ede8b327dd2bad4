"""One-row float32 products through sgemv against sgemm, on the CPU.

    python -m bench.cpu_gemv [--size small] [--model DIR] [--runs 5] [--max-tokens 128]

Two worker processes of the same model, side by side: one as shipped (its
one-row products, a lone request's decode steps, go to OpenBLAS's sgemv
through worker/runtime/gemv_forward.c) and one with `LATTICE_CPU_GEMV=off`
(every product through OpenBLAS's sgemm, the baseline). Both are started
and warmed up first; then each round sends the same greedy request to one,
then the other, the order alternating. Reported per side: decode tokens/s
(the tokens after the first over the time from the first token to the last,
as this process received them) and the first token; per round the ratio
forwarded/sgemm of decode tokens/s; median, min and max over the rounds.
Results go to bench/results/cpu-gemv-<model>[-tag].json after every round.
"""

from __future__ import annotations

import argparse
import sys

from bench.common import backend, demo_model, load_average, machine, model_arguments, summary, tagged, write_result
from harness.worker import WorkerProc

PROMPT = "<|im_start|>user\nTell me about the river, the mill and the bridge.<|im_end|>\n<|im_start|>assistant\n"
SIDES = {"sgemv": {}, "sgemm": {"LATTICE_CPU_GEMV": "off"}}


def measure(worker: WorkerProc, max_tokens: int) -> dict:
    done = worker.generate(prompt=PROMPT, max_tokens=max_tokens, temperature=0.0, repetition_penalty=1.0)
    decode_s = done["last_token_s"] - done["client_ttft_ms"] / 1000
    return {
        "decode_tok_s": round((done["gen_tokens"] - 1) / decode_s, 2),
        "ttft_ms": round(done["client_ttft_ms"], 1),
        "tokens": done["gen_tokens"],
        "text": done["text"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(p)
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    if backend() != "cpu":
        p.error("this compares two CPU paths; MLX computes on a GPU here")

    model = args.model.expanduser().resolve() if args.model else demo_model(args.size, args.q4)
    result = {"model": str(model), "max_tokens": args.max_tokens, "runs": args.runs, "machine": machine(), "rounds": []}
    name = tagged(f"cpu-gemv-{model.name}", args.tag)
    workers = {side: WorkerProc.started(model, env=env) for side, env in SIDES.items()}
    try:
        for w in workers.values():
            measure(w, args.max_tokens)  # warm-up: compiled steps, kernels
        for round_ in range(args.runs):
            order = list(SIDES) if round_ % 2 == 0 else list(reversed(SIDES))
            got = {side: measure(workers[side], args.max_tokens) for side in order}
            got["ratio"] = round(got["sgemv"]["decode_tok_s"] / got["sgemm"]["decode_tok_s"], 3)
            got["same_text"] = got["sgemv"].pop("text") == got["sgemm"].pop("text")
            result["rounds"].append(got)
            result["ratio"] = summary([r["ratio"] for r in result["rounds"]])
            for side in SIDES:
                result[side] = {
                    "decode_tok_s": summary([r[side]["decode_tok_s"] for r in result["rounds"]]),
                    "ttft_ms": summary([r[side]["ttft_ms"] for r in result["rounds"]]),
                }
            result["load_avg_now"] = load_average()
            write_result(name, result)
            print(
                f"round {round_ + 1}: sgemv {got['sgemv']['decode_tok_s']} tok/s (first token {got['sgemv']['ttft_ms']} ms), "
                f"sgemm {got['sgemm']['decode_tok_s']} tok/s ({got['sgemm']['ttft_ms']} ms), ratio {got['ratio']}, same text {got['same_text']}",
                flush=True,
            )
    finally:
        for w in workers.values():
            w.close()
    print(
        f"decode tok/s, one-row products through sgemv over sgemm: median {result['ratio']['median']} (min {result['ratio']['min']}, max {result['ratio']['max']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
