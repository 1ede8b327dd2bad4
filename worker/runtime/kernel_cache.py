"""Where mlx keeps the kernels it compiles at run time.

On CUDA mlx compiles many of its kernels (and every fused kernel of a
compiled graph) with NVRTC on first use and keeps them on disk, by default
under the system's temp dir (`/tmp/mlx/<version>/ptx`), which many systems
empty at every boot. Compiling them all again is most of a first start: a
0.8b worker on an H200 was ready after 154 s with an empty cache (195 s with
compiled decode steps) against 15-17 s with a full one (docs/performance.md).
Workers keep them in the user's cache dir instead, one directory per mlx
version and GPU (mlx's file names do not say which architecture a kernel
was built for). A `MLX_PTX_CACHE_DIR` set by the user stands.

On Linux mlx compiles the fused kernels of compiled graphs for the CPU
with the system's C++ compiler, into `$TMPDIR/mlx/<version>/cpu` (it has no
setting of its own for that directory). With an empty one a worker of the
default demo model was ready after 35.5 s on a 2-core machine, against
0.48 s with its kernels there (bench/kernel_cache.py), and after 10.8 s
with the precompiled header worker.runtime.kernel_header builds for them. Workers on Linux run with `$TMPDIR` in the
user's cache dir, one directory per CPU model (mlx's file names do not say
which instructions a kernel uses), or in `LATTICE_CPU_KERNELS` where that
is set. A worker's other temporary files (a group's hostfile, the BLAS
links) are made and removed there too.

The same goes for mlx's check on its CUDA caches of compiled graphs, which
a long-lived worker would trip (no_thrashing_abort).

The CUDA and the CPU kernels are kept in a directory per mlx version, and
an upgrade of mlx leaves the old one behind (a CPU one holds a 50 MB
precompiled header). A worker marks its own version's directories as used
when it starts and removes the other versions' that no worker has used for
UNUSED_FOR_DAYS days (prune_versions), so the kernels of a version still
run from another environment stay.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from ipc.paths import pool_cache_dir

log = logging.getLogger("worker")

ENV = "MLX_PTX_CACHE_DIR"
CPU_ENV = "LATTICE_CPU_KERNELS"
THRASHING_CHECK = "MLX_ENABLE_CACHE_THRASHING_CHECK"
UNUSED_FOR_DAYS = 30
_VERSION = re.compile(r"\d+\.\d+(\.\d+)?([.+-][A-Za-z0-9.+-]*)?")


def kernel_cache_dir(env: Mapping[str, str], mlx_version: str, gpu: str) -> Path | None:
    """The directory for this mlx and GPU, or None when the user chose one."""
    if env.get(ENV):
        return None
    return pool_cache_dir(env) / "mlx-kernels" / mlx_version / _slug(gpu, "gpu")


def _slug(name: str, default: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or default


def cpu_kernel_dir(env: Mapping[str, str], cpu: str) -> Path:
    """The worker's $TMPDIR, under which mlx keeps its compiled CPU kernels."""
    if env.get(CPU_ENV):
        return Path(env[CPU_ENV]).expanduser()
    return pool_cache_dir(env) / "mlx-kernels" / f"cpu-{_slug(cpu, 'cpu')}"


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (Linux), else the machine's architecture."""
    try:
        with cpuinfo.open(encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.machine() or "cpu"


def keep_cpu_kernels(env: MutableMapping[str, str]) -> Path | None:
    """On Linux, points the worker's $TMPDIR at cpu_kernel_dir; returns it,
    or None where mlx compiles no CPU kernels with a C++ compiler or the
    directory cannot be made. Runs before anything makes a temp file."""
    if sys.platform != "linux":
        return None
    path = cpu_kernel_dir(env, cpu_model())
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.warning("cannot keep compiled CPU kernels in %s (%s): mlx keeps them in the temp dir", path, exc.strerror)
        return None
    env["TMPDIR"] = str(path)
    tempfile.tempdir = None  # Python's own temp files follow it too
    return path


def gpu_name() -> str:
    """The GPU's architecture (or name), which a kernel directory is for."""
    import mlx.core as mx

    try:
        info = mx.device_info()
    except Exception:  # a build without it: one directory for any GPU
        info = {}
    return str(info.get("architecture") or info.get("device_name") or "gpu")


def keep_kernels() -> Path | None:
    """On CUDA, points mlx's kernel cache at kernel_cache_dir; returns it.
    mlx reads the variable when it first compiles a kernel, so this runs
    before the model loads."""
    import mlx.core as mx

    if not mx.cuda.is_available():
        return None
    path = kernel_cache_dir(os.environ, mx.__version__, gpu_name())
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.warning("cannot keep compiled kernels in %s (%s): mlx keeps them in its temp dir", path, exc.strerror)
        return None
    os.environ[ENV] = str(path)
    return path


def no_thrashing_abort(env: MutableMapping[str, str]) -> bool:
    """Turns off mlx's cache thrashing check on CUDA unless the user set it;
    True when it did. mlx keeps a cuDNN attention graph per prefill shape and
    a CUDA graph per captured op sequence in LRU caches, and counts their
    misses over the process's whole life: past twice a cache's capacity
    (512 for attention graphs) every further miss raises "Cache thrashing
    is happening". Nearly every fresh prompt length is a new attention
    shape, so a long-lived worker would start failing requests after some
    hundreds of them; without the check the caches still evict as before.
    Runs before anything imports mlx: the caches read it when they are made."""
    if THRASHING_CHECK in env:
        return False
    env[THRASHING_CHECK] = "0"
    return True


def prune_versions(root: Path, version: str, now: float | None = None, unused_for_s: float = UNUSED_FOR_DAYS * 86400) -> list[Path]:
    """Marks `root/<version>` as used now and removes the other versions'
    directories under `root` unused for `unused_for_s`; returns those it
    removed. Only names that read as versions are touched (the CUDA
    directories' root also holds the CPU ones). Never raises: what cannot
    be read or removed stays."""
    now = time.time() if now is None else now
    removed: list[Path] = []
    try:
        mine = root / version
        mine.mkdir(parents=True, exist_ok=True)
        os.utime(mine, (now, now))
        entries = list(os.scandir(root))
    except OSError as exc:
        log.warning("cannot prune old mlx versions' kernels in %s (%s)", root, exc.strerror)
        return removed
    for entry in entries:
        try:
            if entry.name == version or not _VERSION.fullmatch(entry.name) or not entry.is_dir(follow_symlinks=False):
                continue
            if now - entry.stat(follow_symlinks=False).st_mtime < unused_for_s:
                continue
            shutil.rmtree(entry.path)
            removed.append(Path(entry.path))
        except OSError as exc:
            log.warning("cannot remove old mlx kernels in %s (%s)", entry.path, exc.strerror)
    return removed
