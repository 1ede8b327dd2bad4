"""Shared bits of the benchmarks: machine facts, summaries, result files."""

from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
NOISY = "shared 2-core machine with other work running: figures are noisy; ratios come from runs in the same process, alternated"


def version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _version

    try:
        return _version(dist)
    except PackageNotFoundError:
        return None


def machine() -> dict:
    return {
        "cpus": os.cpu_count(),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def summary(values: list[float], digits: int = 3) -> dict:
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "n": len(values),
    }


def write(name: str, result: dict, out: Path | None = None) -> Path:
    path = out or RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {path}")
    return path
