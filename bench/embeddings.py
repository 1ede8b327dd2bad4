"""Embeddings throughput: a batch of 64 short texts through the pool's
/v1/embeddings against the same model's forward in one process.

    python -m bench.embeddings [--size small] [--rounds 6] [--requests 5] [--texts 64]

Pool: one `lattice-pool serve --http` with the demo model configured as
kind = "embedding"; each request carries all the texts (base64 vectors,
as the openai client asks for them), timed from the request's first byte
to its parsed answer. Baseline: mlx-lm's model of the same dir in a process
of its own with the worker's compute setup (OpenBLAS and float32 on CPU,
bench.mlx_lm_baseline's "matched"): the same ids (the end-of-text token
appended), right-padded into one batch, `model.model` (no LM head), the
last token's state normalised, read back into numpy; timed per batch
after a warm-up. Rounds alternate which side goes first; each side's
round figure is the median of its requests. ratio = baseline seconds /
pool seconds per batch (throughput of the pool over the baseline's); the
goal is >= 0.9.

Each round also sends the batch as the stdin `embed` op: `stdin.added_ms`
is the client's time to its done line minus the worker's own time for the
request, i.e. what the pool's path adds, free of the forward's noise.

Writes bench/results/embeddings-<backend>-<size>.json after every round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import NOISY, backend, demo_model, machine, summary, tagged, write  # noqa: E402

WORDS = "river mill bridge stone water spring old town road field light morning".split()


def texts(n: int) -> list[str]:
    """n short texts (5 to 12 words), the same in every run."""
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(5 + i % 8)) + "." for i in range(n)]


# -- the baseline, in a process of its own ----------------------------------------


def baseline_main(model: Path, n: int, runs: int) -> None:
    from bench.mlx_lm_baseline import load_model

    model_, tokenizer = load_model(model, "matched")
    import mlx.core as mx
    import numpy as np

    tok = tokenizer._tokenizer if hasattr(tokenizer, "_tokenizer") else tokenizer
    eod = tok.convert_tokens_to_ids("<|endoftext|>")
    ids = [tok.encode(t, add_special_tokens=False) + [eod] for t in texts(n)]
    lengths = [len(x) for x in ids]
    width = max(lengths)
    batch = mx.array([x + [eod] * (width - len(x)) for x in ids])
    last = mx.array([n - 1 for n in lengths])

    def once() -> float:
        t0 = time.perf_counter()
        hidden = model_.model(batch)
        rows = hidden[mx.arange(len(lengths)), last].astype(mx.float32)
        vectors = rows / mx.linalg.norm(rows, axis=-1, keepdims=True)
        np.array(vectors)
        return time.perf_counter() - t0

    once()  # warm-up
    for _ in range(runs):
        print(json.dumps({"seconds": once(), "tokens": sum(lengths)}), flush=True)


def baseline(model: Path, n: int, runs: int) -> dict:
    from bench.common import json_lines_of

    rows = json_lines_of("bench.embeddings", "--baseline", "--model", str(model), "--texts", str(n), "--requests", str(runs))
    return {"seconds": statistics.median(r["seconds"] for r in rows), "tokens": rows[0]["tokens"]}


# -- the pool -----------------------------------------------------------------------


def pool_side(url: str, n: int, runs: int) -> dict:
    import urllib.request

    body = json.dumps({"model": "emb", "input": texts(n), "encoding_format": "base64"}).encode()
    times, tokens = [], 0
    for _ in range(runs):
        request = urllib.request.Request(url + "/embeddings", data=body, headers={"content-type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as response:
            answer = json.loads(response.read())
        times.append(time.perf_counter() - t0)
        assert len(answer["data"]) == n
        tokens = answer["usage"]["prompt_tokens"]
    return {"seconds": statistics.median(times), "tokens": tokens}


def stdin_side(pool, n: int, runs: int) -> dict:
    """The same batch as the stdin `embed` op: the client's time to its done
    line, and that minus the worker's own time for it (the done line's
    total_ms, from the request's arrival at the worker to its last vector):
    what the pool's path (parsing, the pipes, one line per vector, stdout)
    adds to the worker's work."""
    client, added = [], []
    for i in range(runs):
        request_id = f"bench-{time.monotonic_ns()}-{i}"
        t0 = time.monotonic()
        pool.send({"op": "embed", "id": request_id, "model": "emb", "input": texts(n)})
        done = pool.terminal(request_id, timeout=600)
        assert done["ev"] == "gen_token", done
        client.append((done["_at"] - t0) * 1000)
        added.append(client[-1] - done["total_ms"])
    return {"client_ms": summary(client, 1), "added_ms": summary(added, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", help="demo model size (default small)")
    p.add_argument("--model", type=Path, help="a model dir instead of a demo model")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--requests", type=int, default=5, help="timed batches per side and round (default 5)")
    p.add_argument("--texts", type=int, default=64)
    p.add_argument("--tag", default="")
    p.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    model = args.model or demo_model(args.size)
    if args.baseline:
        baseline_main(model, args.texts, args.requests)
        return 0

    import re
    import tempfile

    from harness.pool import PoolProc
    from harness.procs import wait_for

    config = Path(tempfile.mkdtemp()) / "pool.toml"
    config.write_text(f'[[models]]\nname = "emb"\npath = "{model}"\nkind = "embedding"\npreload = true\n')
    pool = PoolProc("--config", str(config), "--http", "127.0.0.1:0", "--no-control-socket")
    try:
        pool.wait_ev("ready", model="emb", timeout=600)
        port = int(wait_for(lambda: re.search(rb"http on http://127\.0\.0\.1:(\d+)/v1", pool.stderr), 60, message="the http log line").group(1))
        url = f"http://127.0.0.1:{port}/v1"
        pool_side(url, args.texts, 1)  # warm-up: the first batch's shapes
        name = tagged(f"embeddings-{backend()}-{args.model.name if args.model else args.size}", args.tag)
        result = {
            "benchmark": "embeddings",
            "what": f"{args.texts} short texts in one request: pool /v1/embeddings vs the same model's forward in one process (mlx-lm, matched setup)",
            "model": str(model),
            "machine": machine(),
            "note": NOISY,
            "rounds": [],
        }
        for i in range(args.rounds):
            sides = ["pool", "baseline"] if i % 2 == 0 else ["baseline", "pool"]
            figures = {}
            for side in sides:
                figures[side] = pool_side(url, args.texts, args.requests) if side == "pool" else baseline(model, args.texts, args.requests)
            ratio = figures["baseline"]["seconds"] / figures["pool"]["seconds"]
            result["rounds"].append({"first": sides[0], **figures, "ratio": round(ratio, 3)})
            ratios = [r["ratio"] for r in result["rounds"]]
            result["ratio"] = summary(ratios)
            result["pool_texts_per_s"] = summary([args.texts / r["pool"]["seconds"] for r in result["rounds"]], 1)
            result["baseline_texts_per_s"] = summary([args.texts / r["baseline"]["seconds"] for r in result["rounds"]], 1)
            result["prompt_tokens"] = figures["pool"]["tokens"]
            result["rounds"][-1]["stdin"] = stdin_side(pool, args.texts, args.requests)
            result["stdin_added_ms"] = summary([r["stdin"]["added_ms"]["median"] for r in result["rounds"]], 1)
            write(name, result)
            print(
                f"round {i + 1}: pool {figures['pool']['seconds'] * 1000:.1f} ms, baseline {figures['baseline']['seconds'] * 1000:.1f} ms, ratio {ratio:.3f}",
                file=sys.stderr,
            )
    finally:
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
