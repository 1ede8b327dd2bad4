"""A short request that arrives while a long prompt is being read: its
first token through a real worker process, against the same short request
on an idle worker, measured in the same run (alternated).

The long request is written first; once the worker's heartbeat has said
it is busy twice (the long prompt has started reading), the short one is
written. Times are the worker's own (`ttft_ms` of each final line: from
when the request reached the worker).

    python -m bench.late_arrival [--size small|0.8b] [--long-tokens 3000] [--runs 5] [--tag X]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

SHORT = "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
SENTENCE = "The river bends past the old mill, and the herons wait by the stone bridge. "


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small")
    p.add_argument("--long-tokens", type=int, default=3000, help="about how many tokens the long prompt has (default 3000)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--tag", default="")
    args = p.parse_args()

    from tokenizers import Tokenizer

    from bench.common import backend, demo_model, load_average, machine, summary, tagged, write_result
    from harness.worker import WorkerProc
    from ipc.framing import encode_frame
    from ipc.messages import Generate

    model = demo_model(args.size)
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    per = len(tokenizer.encode(SENTENCE, add_special_tokens=False).ids)
    long = "<|im_start|>user\n" + SENTENCE * max(1, args.long_tokens // per) + "<|im_end|>\n<|im_start|>assistant\n"
    long_tokens = len(tokenizer.encode(long, add_special_tokens=False).ids)
    result: dict = {"model": model.name, "backend": backend(), "machine": machine(), "long_prompt_tokens": long_tokens, "runs": args.runs}
    before = load_average()
    times: dict[str, list[float]] = {"short_alone": [], "long_alone": [], "short_behind_long": [], "long_with_short": []}
    w = WorkerProc.started(model, "--heartbeat", "0.02", "--prefix-cache-bytes", "0")
    rid = 0

    def frame(prompt: str) -> tuple[bytes, bytes]:
        nonlocal rid
        rid += 1
        return encode_frame(Generate(rid=rid, id_json=str(rid), prompt=prompt, max_tokens=2, temperature=0.0)), str(rid).encode()

    try:
        for _ in range(args.runs):
            for name, prompt in (("short_alone", SHORT), ("long_alone", long)):
                data, key = frame(prompt)
                w.send_raw(data)
                times[name].append(w.figures([key], 0.0)["worker_ttft_total_tokens"][0][0])
            long_frame, long_key = frame(long)
            w.send_raw(long_frame)
            busy = 0
            while busy < 2:
                line, _ = w.next_stamped(60)
                busy += line.startswith(b'@@lattice {"ev":"heartbeat","busy":true')
            short_frame, short_key = frame(SHORT)
            w.send_raw(short_frame)
            figures = w.figures([long_key, short_key], 0.0)["worker_ttft_total_tokens"]
            times["long_with_short"].append(figures[0][0])
            times["short_behind_long"].append(figures[1][0])
    finally:
        w.close()
    med = {name: statistics.median(v) for name, v in times.items()}
    result["ttft_ms"] = {name: summary(v, 1) for name, v in times.items()}
    result["short_behind_long_vs_alone"] = round(med["short_behind_long"] / med["short_alone"], 2)
    result["short_behind_long_vs_long_alone"] = round(med["short_behind_long"] / med["long_alone"], 3)
    result["long_with_short_vs_alone"] = round(med["long_with_short"] / med["long_alone"], 3)
    result["load_average"] = {"before": before, "after": load_average()}
    write_result(tagged(f"late-arrival-{result['backend']}-{args.size}", args.tag), result)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
