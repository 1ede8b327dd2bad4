"""Hot reload latency: adapter file closed -> `adapter_loaded` on the pool's
stdout, for 1 MB and 10 MB adapters, against the same reload forced by the
`reload` op (no file watching) in the same run.

    python -m bench.reload [--rounds 10]

Runs a real `lattice-pool serve` on a demo model and writes
bench/results/reload.json. The goal is file closed -> adapter_loaded <= 200 ms.
"""

from __future__ import annotations

import argparse
import hashlib
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

from harness.pool import PoolProc  # noqa: E402
from harness.procs import build_demo_model  # noqa: E402
from tests.lora_files import targets_of  # noqa: E402


def adapter_bytes(model_dir: Path, target_bytes: int, seed: int) -> bytes:
    """A chat_metal-format adapter on every linear layer, ranked to ~target_bytes."""
    targets = targets_of(model_dir)
    per_rank = sum(4 * (d_in + d_out) for d_in, d_out in targets.values())
    rank = max(1, target_bytes // per_rank)
    rng = np.random.default_rng(seed)
    tensors = {}
    for module, (d_in, d_out) in sorted(targets.items()):
        tensors[f"model.{module}.lora_a"] = rng.normal(0, d_in**-0.5, (d_in, rank)).astype(np.float32)
        tensors[f"model.{module}.lora_b"] = rng.normal(0, 0.01, (rank, d_out)).astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "a.safetensors"
        save_file(tensors, str(path), metadata={"alpha": str(rank)})
        return path.read_bytes()


def loaded_with(pool: PoolProc, digest: str) -> float:
    pool.wait_for(lambda e: e["ev"] == "adapter_loaded" and e.get("sha256") == digest, timeout=60)
    return time.perf_counter()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--size", default="small", choices=["tiny", "small"])
    args = parser.parse_args()
    results = {"machine": f"{platform.machine()} {os.cpu_count()} cores", "python": platform.python_version(), "sizes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = tmp / "model"
        build_demo_model(model, "--size", args.size)
        for label, size in (("1MB", 1 << 20), ("10MB", 10 << 20)):
            live = tmp / label / "adapter.safetensors"
            live.parent.mkdir()
            versions = [adapter_bytes(model, size, seed) for seed in range(args.rounds + 1)]
            live.write_bytes(versions[0])
            config = tmp / f"{label}.toml"
            config.write_text(f'[[models]]\nname = "m"\npath = "{model}"\nlora = "{live}"\npreload = true\n')
            pool = PoolProc("--config", str(config), "--log-level", "WARNING")
            try:
                pool.wait_ev("ready", model="m")
                watched, forced = [], []
                for data in versions[1:]:
                    digest = hashlib.sha256(data).hexdigest()
                    tmp_file = live.with_name("adapter.tmp")
                    tmp_file.write_bytes(data)
                    os.replace(tmp_file, live)
                    t0 = time.perf_counter()  # the file is complete and in place
                    watched.append((loaded_with(pool, digest) - t0) * 1000)
                    t0 = time.perf_counter()
                    pool.send({"op": "reload", "model": "m"})
                    forced.append((loaded_with(pool, digest) - t0) * 1000)
            finally:
                pool.close()
            row = {
                "adapter_bytes": len(versions[0]),
                "watched_ms_median": round(statistics.median(watched), 1),
                "watched_ms_max": round(max(watched), 1),
                "reload_op_ms_median": round(statistics.median(forced), 1),
                "ratio_watched_vs_op": round(statistics.median(watched) / statistics.median(forced), 2),
            }
            results["sizes"][label] = row
            print(
                f"{label:>5} ({row['adapter_bytes'] / 1e6:.1f} MB): file closed -> adapter_loaded median {row['watched_ms_median']} ms "
                f"(max {row['watched_ms_max']}), reload op {row['reload_op_ms_median']} ms, ratio {row['ratio_watched_vs_op']}x"
            )
    out = ROOT / "bench" / "results" / "reload.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
