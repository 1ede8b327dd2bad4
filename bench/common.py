"""Shared pieces of the benchmarks: demo models, machine facts, summaries,
result files. The processes they drive come from harness/.

Every benchmark measures its baseline in the same run and writes its figures
to bench/results/<name>-<backend>.json, with the machine and its load.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from harness.engine import events
from harness.procs import ROOT, build_demo_model
from worker.runtime.kernel_cache import cpu_model

RESULTS = ROOT / "bench" / "results"
# Said once, at import, so it tells the machine and its load as the run began.
NOISY = (
    f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at the start: figures move with the machine's"
    " load; ratios come from sides measured in the same run, alternated"
)
MODELS = Path(os.environ.get("LATTICE_BENCH_MODELS", Path.home() / ".cache" / "lattice-bench"))


def model_arguments(p) -> None:
    """The model a decode benchmark runs on, and how much it generates."""
    p.add_argument(
        "--size",
        default="small",
        help="demo model size to build and use (default small): tiny, small, 0.8b, 4b, 8b, 4b-hybrid, 9b-hybrid, dense and head128 (bench.dense); a -q4 suffix for 4-bit",
    )
    p.add_argument("--q4", action="store_true", help="the demo model in MLX 4-bit (as a -q4 suffix)")
    p.add_argument("--model", type=Path, help="a model dir instead of a demo model")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--tag", default="", help="suffix for the results file name")


def demo_model(size: str, q4: bool = False) -> Path:
    """A demo model of the given size (`8b-q4`: 4-bit), built once by the
    demo-model builder."""
    if size.endswith("-q4"):
        size, q4 = size[: -len("-q4")], True
    path = MODELS / (size + ("-q4" if q4 else ""))
    if (path / "config.json").is_file():
        return path
    if size in ("dense", "head128"):  # bench.dense; in a process of its own, as the builder runs
        subprocess.run([sys.executable, "-m", "bench.dense", str(path), size], check=True, cwd=ROOT)
    else:
        build_demo_model(path, "--size", size, *(["--q4"] if q4 else []))
    return path


def load_model(model: str | Path):
    """(dir, Loaded, TextCodec): `model` (a demo model size, built once, or
    a model dir) loaded in this process as a worker loads it. OpenBLAS goes
    in first, as in a worker, so this runs before anything imports mlx."""
    from worker.runtime.cpu_backend import load_openblas

    load_openblas()
    from worker.runtime.loader import load
    from worker.text.tokenizer import TextCodec

    path = model if isinstance(model, Path) else demo_model(model)
    loaded = load(path)
    return path, loaded, TextCodec(path, loaded.config)


def weights_bytes(model: Path) -> int:
    """Bytes of the model's safetensors files: what one decode step reads."""
    return sum(p.stat().st_size for p in model.glob("*.safetensors"))


# Memory bandwidth by the vendor's datasheet, bytes/s, for the fraction of
# the limit a single stream reaches (one decode step reads every weight).
DATASHEET_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12}


def bandwidth(info: dict, given_gb_s: float | None) -> float | None:
    if given_gb_s:
        return given_gb_s * 1e9
    gpu = info.get("gpu", "")
    return next((bw for name, bw in DATASHEET_BANDWIDTH.items() if name in gpu), None)


def backend() -> str:
    """'cuda', 'metal' or 'cpu', asked of a fresh interpreter so that the
    caller need not import mlx (the CPU path must load OpenBLAS first)."""
    code = "import mlx.core as mx; print('metal' if mx.metal.is_available() else ('cuda' if mx.cuda.is_available() else 'cpu'))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version as _version

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
    info["cpu"] = cpu_model()
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


def first_line_ms(scheduler, written: list[float], msg) -> float:
    """Submits `msg` to a scheduler in this process whose emit appends
    time.perf_counter() to `written`, steps it until it has no work, and
    returns the milliseconds from the submission to its first line."""
    written.clear()
    t0 = time.perf_counter()
    scheduler.submit(msg, t0)
    while scheduler.has_work:
        scheduler.step()
    return (written[0] - t0) * 1000


def decode_rate(scheduler, prompts: list[list[int]], steps: int) -> float:
    """Tokens per second of `steps` greedy decode steps of a batch of the
    given prompts (one row each) in a Scheduler of this process, after
    their prefill and a few steps (on CUDA, after the step's choice)."""
    import mlx.core as mx

    from ipc.sampling import Sampling
    from worker.engine.generator import Row
    from worker.engine.sampling import RowSampling

    greedy = Sampling(temperature=0.0)
    gen = scheduler._generator(scheduler.prefix_cache)
    rows = [Row(i, ids, RowSampling(greedy, scheduler.vocab_size, ids)) for i, ids in enumerate(prompts)]
    gen.start(rows)
    while gen.prefilling:
        gen.step()
    for _ in range(4):
        gen.step()
    gen.step_until_chosen(len(rows))
    mx.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        gen.step()
    mx.synchronize()
    rate = len(rows) * steps / (time.perf_counter() - t0)
    gen.remove(rows)
    return rate


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def json_lines_of(module: str, *args: str) -> list[dict]:
    """`python -m module args` in a process of its own; its JSON lines. The
    process leads a session of its own, as the pool's workers and
    harness.worker's do: with the kernel's autogroup scheduling a session is
    one group for CPU shares, so on a shared machine every side competes on
    the same terms."""
    from harness.procs import child_env

    out = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=child_env(), cwd=ROOT, start_new_session=True)
    if out.returncode:
        raise RuntimeError(out.stderr)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


class TokenClock:
    """The emit callback of a worker's Scheduler in one process, timing one
    request at a time: `start(scheduler)` before submitting it, then
    `times()`, when each of its tokens was first written, from the start.
    A line can carry several tokens (a token whose bytes end inside a
    character is written with the next one), so each token is timed at
    the line that first shows it; the final line, its row gone by then,
    says how many there were."""

    def __init__(self):
        self.stamps: list[tuple[float, int]] = []
        self.lines: list[bytes] = []
        self._live: list = []  # the request's RowStream, once it has one
        self._scheduler = None
        self._t0 = 0.0

    def start(self, scheduler) -> float:
        self.stamps.clear()
        self.lines.clear()
        self._live.clear()
        self._scheduler = scheduler
        self._t0 = time.perf_counter()
        return self._t0

    def __call__(self, data: bytes) -> None:
        now = time.perf_counter()
        self.lines.append(data)
        streams = self._scheduler.streams if self._scheduler is not None else {}
        if not self._live and streams:
            self._live.append(next(iter(streams.values())))
        done = re.search(rb'"gen_tokens":(\d+)', data)
        self.stamps.append((now, int(done.group(1)) if done else len(self._live[0].generated) if self._live else 0))

    def times(self) -> list[float]:
        times: list[float] = []
        for t, count in self.stamps:
            times += [t - self._t0] * (count - len(times))
        # A reply of no token (its first was an end of turn) still has its
        # first line: that is its first token's time.
        return times or [self.stamps[0][0] - self._t0]

    def text(self) -> str:
        return "".join(e["token"] for e in events(self.lines) if e.get("ev") == "gen_token" and not e.get("done"))

    def done(self) -> dict:
        """The request's final line."""
        return next(e for e in reversed(events(self.lines)) if e.get("done"))
