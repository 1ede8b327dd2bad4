"""A hybrid model's first-token passes, in one process: the worker's chunked
gated-delta prefill against mlx-lm's token-by-token loop, and the ways a
chat prompt can be split into forward passes.

The model's forward over one chat prompt (fresh caches, synced at the end),
for each gated-delta implementation and each split:

- `one pass`: the whole prompt;
- `all but last, then last`: mlx-lm's `generate_step` split;
- `cut, then rest`: the worker's split of a hybrid prompt, which ends a
  chunk at the last message start so that the next turn can resume from a
  prefix-cache snapshot there.

Each round times every (implementation, split) pair once, in an order that
flips every round, after two warm-up passes of each; `launch` is the time
spent in `mx.async_eval`, handing the passes to mlx (on a GPU, where kernels
are launched). Results go to bench/results/prefill-passes-<backend>-<size>[-tag].json
after every round: medians and ranges in ms.

    python -m bench.prefill_passes [--size small|0.8b | --model DIR] [--runs 7]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small")
    p.add_argument("--model", type=Path, help="a model dir instead of a demo model")
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--tag", default="")
    args = p.parse_args()

    from bench.common import backend, load_average, load_model, machine, summary, tagged, write_result

    path, loaded, codec = load_model(args.model or args.size)
    size = path.name if args.model else args.size
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    import worker.runtime.gated_delta as gd
    from bench.chat import user_messages
    from worker.cache.prefix_cache import message_starts
    from worker.runtime.rebind import rebind

    model = loaded.model

    def bind(update) -> int:
        """Points the model's gated-delta modules at `update`."""
        return rebind(model, "gated_delta_update", update, lambda current: current in (gd.gated_delta_update, gd._ORIGINAL))

    if not bind(gd.gated_delta_update):
        print("this model has no gated-delta layers", file=sys.stderr)
        return 2
    ids = codec.encode(f"<|im_start|>user\n{user_messages(codec.tokenizer, 1, 48)[0]}<|im_end|>\n<|im_start|>assistant\n")
    marker = codec.encode("<|im_start|>")
    cut = max(message_starts(ids, marker[0] if len(marker) == 1 else None), default=0)
    splits = {"one pass": [ids], "all but last, then last": [ids[:-1], ids[-1:]]}
    if 0 < cut < len(ids):
        splits["cut, then rest"] = [ids[:cut], ids[cut:]]
    kinds = {"chunked": gd.gated_delta_update, "mlx-lm loop": gd._ORIGINAL}

    def run(kind: str, pieces: list[list[int]]) -> tuple[float, float]:
        bind(kinds[kind])
        cache = make_prompt_cache(model)
        mx.synchronize()
        t0 = time.perf_counter()
        launch = 0.0
        for piece in pieces:
            out = model(mx.array([piece], dtype=mx.uint32), cache=cache)
            t = time.perf_counter()
            mx.async_eval(out, [c.state for c in cache])
            launch += time.perf_counter() - t
        mx.argmax(out[:, -1, :], axis=-1).item()
        return (time.perf_counter() - t0) * 1000, launch * 1000

    pairs = [(kind, split) for kind in kinds for split in splits]
    try:
        for pair in pairs:
            for _ in range(2):
                run(pair[0], splits[pair[1]])
        result = {"size": size, "backend": backend(), "prompt_tokens": len(ids), "cut": cut, "machine": machine(), "rounds": []}
        name = tagged(f"prefill-passes-{backend()}-{size}", args.tag)
        for r in range(args.runs):
            order = pairs if r % 2 == 0 else pairs[::-1]
            result["rounds"].append({f"{kind} / {split}": [round(x, 2) for x in run(kind, splits[split])] for kind, split in order})
            result["ms"] = {
                key: {"total": summary([x[key][0] for x in result["rounds"]], 1), "launch": summary([x[key][1] for x in result["rounds"]], 1)}
                for key in result["rounds"][0]
            }
            result["load_average"] = load_average()
            write_result(name, result)
            print(f"round {r + 1}: {result['rounds'][-1]}", flush=True)
    finally:
        bind(gd.gated_delta_update)
    for key, v in result["ms"].items():
        print(f"{key:38s} total {v['total']['median']:7.1f} ms ({v['total']['min']}-{v['total']['max']})  launch {v['launch']['median']:6.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
