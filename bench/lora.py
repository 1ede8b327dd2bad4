"""LoRA cost in a real worker: load time, and decode speed with a rank-16
adapter on every linear layer of the decoder vs no adapter, in one run.

    python -m bench.lora [--size small] [--rounds 5] [--tokens 128]

Builds a demo model with the real `demo-model` command, writes a seeded PEFT
adapter, drives one worker process over its pipes and writes
bench/results/lora.json. Adapter and no-adapter runs alternate, so drift on a
shared machine hits both sides alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.procs import build_demo_model  # noqa: E402
from harness.worker import WorkerProc  # noqa: E402
from ipc.messages import Generate, LoadAdapter, Stats, UnloadAdapter  # noqa: E402

PROMPT = "<|im_start|>user\nTell me about the river and the mill.<|im_end|>\n<|im_start|>assistant\n"


def model_targets(model_dir: Path) -> dict[str, tuple[int, int]]:
    """Every linear layer of every decoder layer: `layers.N.<module>` -> (d_in, d_out)."""
    from worker.lora.layers import LoRASlots
    from worker.runtime.loader import load

    return dict(LoRASlots(load(model_dir).model).targets)


def write_adapter(targets: dict[str, tuple[int, int]], out: Path, rank: int, seed: int = 0) -> int:
    """A PEFT adapter on each of the targets; returns its module count."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for module, (d_in, d_out) in sorted(targets.items()):
        key = f"base_model.model.model.language_model.{module}"
        tensors[f"{key}.lora_A.weight"] = rng.normal(0, d_in**-0.5, (rank, d_in)).astype(np.float32)
        tensors[f"{key}.lora_B.weight"] = rng.normal(0, 0.02, (d_out, rank)).astype(np.float32)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}))
    return len(targets)


def decode_rate(w: WorkerProc, tokens: int, seed: int, lora: str | None = None) -> float:
    """Decode tok/s of one request: tokens after the first over the time after it."""
    w.send(Generate(rid=seed, prompt=PROMPT, max_tokens=tokens, temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0, seed=seed, lora=lora))
    done = w.collect()[-1]
    assert done["ev"] == "gen_token", done
    decode_ms = done["total_ms"] - done["ttft_ms"]
    return (done["gen_tokens"] - 1) / (decode_ms / 1000.0)


def load(w: WorkerProc, path: str) -> tuple[float, int]:
    """(wall ms from LoadAdapter to adapter_loaded, the worker's own ms)."""
    t0 = time.perf_counter()
    w.send(LoadAdapter(path=path))
    event = w.next_event(timeout=300)
    assert event["ev"] == "adapter_loaded", event
    return (time.perf_counter() - t0) * 1000.0, event["ms"]


def unload(w: WorkerProc, path: str) -> float:
    """Wall ms from UnloadAdapter to adapter_unloaded."""
    t0 = time.perf_counter()
    w.send(UnloadAdapter(path=path))
    event = w.next_event(timeout=300)
    assert event["ev"] == "adapter_unloaded" and event["resident"], event
    return (time.perf_counter() - t0) * 1000.0


def summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2), "max": round(max(values), 2), "n": len(values)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small", choices=["tiny", "small"], help="demo model size (default small)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=9, help="measurements per side (default 9)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per decode request (default 128)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "lora.json")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="lattice-bench-lora-") as tmp:
        model_dir, adapter = Path(tmp) / "model", Path(tmp) / "adapter"
        build_demo_model(model_dir, "--size", args.size)
        modules = write_adapter(model_targets(model_dir), adapter, args.rank)
        w = WorkerProc(model_dir)
        try:
            w.wait_ready()
            decode_rate(w, 16, 0)  # first-request effects stay out of the figures
            base, lora, load_wall, load_worker, unload_wall = [], [], [], [], []
            for i in range(args.rounds):
                base.append(decode_rate(w, args.tokens, i + 1))
                wall, own = load(w, str(adapter))
                load_wall.append(wall)
                load_worker.append(own)
                if i == 0:
                    w.send(Stats())
                    adapter_bytes = w.next_event()["adapter_bytes"]
                lora.append(decode_rate(w, args.tokens, i + 1, str(adapter)))
                # Unloaded, so that the next round's LoadAdapter reads the file again.
                unload_wall.append(unload(w, str(adapter)))
        finally:
            w.close()

    result = {
        "note": "shared machine, numbers are noisy; adapter and no-adapter runs alternate in one worker",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "mlx": _version("mlx"),
            "mlx_lm": _version("mlx-lm"),
        },
        "model": {"demo_size": args.size, "format": "bf16"},
        "adapter": {"format": "peft", "rank": args.rank, "modules": modules, "adapter_bytes": adapter_bytes},
        "decode_tokens_per_request": args.tokens,
        "decode_tok_s": {"no_adapter": summary(base), "adapter": summary(lora)},
        "decode_ratio_adapter_over_none": round(statistics.median(lora) / statistics.median(base), 3),
        # Each adapter run over the no-adapter run just before it: less exposed to load drift.
        "decode_ratio_paired_median": round(statistics.median(x / y for x, y in zip(lora, base)), 3),
        "load_ms": {
            "load_adapter_to_adapter_loaded": summary(load_wall),
            "worker_reported_ms": summary(load_worker),
            "unload_to_adapter_unloaded": summary(unload_wall),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    d = result["decode_tok_s"]
    print(f"demo model {args.size}, rank-{args.rank} adapter on {modules} linear layers ({adapter_bytes} bytes); noisy shared machine")
    print(
        f"decode tok/s  no adapter {d['no_adapter']['median']}  adapter {d['adapter']['median']}  ratio {result['decode_ratio_adapter_over_none']} (paired {result['decode_ratio_paired_median']})"
    )
    s = result["load_ms"]
    print(
        f"load ms  LoadAdapter->adapter_loaded {s['load_adapter_to_adapter_loaded']['median']} (worker: {s['worker_reported_ms']['median']})  unload {s['unload_to_adapter_unloaded']['median']}"
    )
    print(f"written to {args.out}")
    return 0


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
