"""Shared pieces of the benchmarks: a worker client, demo models, machine
facts, summaries, result files.

Every benchmark measures its baseline in the same run and writes its figures
to bench/results/<name>-<backend>.json, with the machine and its load.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
NOISY = "shared 2-core machine with other work running: figures are noisy; ratios come from runs in the same process, alternated"
MODELS = Path(os.environ.get("LATTICE_BENCH_MODELS", Path.home() / ".cache" / "lattice-bench"))


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def model_arguments(p) -> None:
    """The model a decode benchmark runs on, and how much it generates."""
    p.add_argument("--size", default="small", help="demo model size to build and use (default small)")
    p.add_argument("--model", type=Path, help="a model dir instead of a demo model")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--tag", default="", help="suffix for the results file name")


def demo_model(size: str) -> Path:
    """A demo model of the given size, built once by the demo-model builder."""
    path = MODELS / size
    if not (path / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "worker.demo_model", str(path), "--size", size], check=True, env=child_env(), cwd=ROOT)
    return path


def backend() -> str:
    """'cuda', 'metal' or 'cpu', asked of a fresh interpreter so that the
    caller need not import mlx (the CPU path must load OpenBLAS first)."""
    code = "import mlx.core as mx; print('metal' if mx.metal.is_available() else ('cuda' if mx.cuda.is_available() else 'cpu'))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _version

    try:
        return _version(dist)
    except PackageNotFoundError:
        return None


def machine() -> dict:
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_avg_at_start": load_average(),
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
    }
    if os.environ.get("OPENBLAS_NUM_THREADS"):
        info["openblas_threads"] = os.environ["OPENBLAS_NUM_THREADS"]
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        if gpu.returncode == 0:
            info["gpu"] = gpu.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def tagged(name: str, tag: str) -> str:
    return f"{name}-{tag}" if tag else name


def write_result(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)
    return path


def write(name: str, result: dict, out: Path | None = None) -> Path:
    """write_result, or to an explicit path."""
    if out is None:
        return write_result(name, result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return out


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


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


class WorkerClient:
    """A real worker process driven over its pipes, timing events as they come."""

    def __init__(self, model: Path, *args: str):
        from ipc.framing import encode_frame

        self._encode = encode_frame
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "worker", "--model", str(model), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=child_env(),
            cwd=ROOT,
        )
        self._rid = 0
        while self._event()["ev"] != "ready":
            pass

    def _event(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"worker exited with {self.proc.wait()}")
            event = json.loads(line[len(b"@@lattice ") :])
            if event["ev"] != "heartbeat":
                return event

    def ask(self, msg) -> dict:
        """Sends a message (Stats, LoadAdapter, ...) and returns the next event."""
        self.proc.stdin.write(self._encode(msg))
        self.proc.stdin.flush()
        return self._event()

    def generate(self, **kw) -> dict:
        """Runs one request; returns the final line plus client-side times."""
        from ipc.messages import Generate

        self._rid += 1
        t0 = time.perf_counter()
        self.proc.stdin.write(self._encode(Generate(rid=self._rid, **kw)))
        self.proc.stdin.flush()
        first = last = None
        text = []
        while True:
            event = self._event()
            if event["ev"] == "error":
                raise RuntimeError(event["msg"])
            now = time.perf_counter()
            if event["done"]:
                event["client_ttft_ms"] = ((first or now) - t0) * 1000
                event["client_total_ms"] = (now - t0) * 1000
                event["text"] = "".join(text)
                event["last_token_s"] = (last or now) - t0
                return event
            text.append(event["token"])
            first = first or now
            last = now

    def generate_many(self, requests: list[dict]) -> dict:
        """Sends the requests in one write (they reach the worker together)
        and reads their interleaved lines; returns per-request client-side
        first-token times, token counts, and the wall time to the last
        final line."""
        from ipc.messages import Generate

        frames = []
        ids = []
        for kw in requests:
            self._rid += 1
            ids.append(self._rid)
            frames.append(self._encode(Generate(rid=self._rid, id_json=str(self._rid), **kw)))
        t0 = time.perf_counter()
        self.proc.stdin.write(b"".join(frames))
        self.proc.stdin.flush()
        first: dict[int, float] = {}
        tokens: dict[int, int] = {}
        pending = set(ids)
        stdout = self.proc.stdout
        while pending:
            line = stdout.readline()
            if not line:
                raise RuntimeError(f"worker exited with {self.proc.wait()}")
            if line.startswith(b'@@lattice {"ev":"gen_token"') and b'"done":false' in line:
                # Token lines are read the way the supervisor relays them,
                # without decoding JSON: only the id at the tail matters.
                rid = int(line[line.rindex(b'"id":') + 5 : -2])
                if rid not in first:
                    first[rid] = time.perf_counter()
                continue
            event = json.loads(line[len(b"@@lattice ") :])
            if event["ev"] == "error":
                raise RuntimeError(event["msg"])
            if event["ev"] == "gen_token":
                tokens[event["id"]] = event["gen_tokens"]
                pending.discard(event["id"])
        wall = time.perf_counter() - t0
        return {"ttft_ms": [(first.get(i, t0 + wall) - t0) * 1000 for i in ids], "tokens": sum(tokens.values()), "wall_s": wall}

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.proc.stdout.close()
