"""Where mlx keeps the CUDA kernels it compiles at run time.

On CUDA mlx compiles many of its kernels (and every fused kernel of a
compiled graph) with NVRTC on first use and keeps them on disk, by default
under the system's temp dir (`/tmp/mlx/<version>/ptx`), which many systems
empty at every boot. Compiling them all again is most of a first start: a
0.8b worker on an H200 was ready after 154 s with an empty cache (195 s with
compiled decode steps) against 15-17 s with a full one (docs/performance.md).
Workers keep them in the user's cache dir instead, one directory per mlx
version and GPU (mlx's file names do not say which architecture a kernel
was built for). A `MLX_PTX_CACHE_DIR` set by the user stands.

The same goes for mlx's check on its CUDA caches of compiled graphs, which
a long-lived worker would trip (no_thrashing_abort).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from ipc.paths import pool_cache_dir

log = logging.getLogger("worker")

ENV = "MLX_PTX_CACHE_DIR"
THRASHING_CHECK = "MLX_ENABLE_CACHE_THRASHING_CHECK"


def kernel_cache_dir(env: Mapping[str, str], mlx_version: str, gpu: str) -> Path | None:
    """The directory for this mlx and GPU, or None when the user chose one."""
    if env.get(ENV):
        return None
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", gpu).strip("-.") or "gpu"
    return pool_cache_dir(env) / "mlx-kernels" / mlx_version / slug


def keep_kernels() -> Path | None:
    """On CUDA, points mlx's kernel cache at kernel_cache_dir; returns it.
    mlx reads the variable when it first compiles a kernel, so this runs
    before the model loads."""
    import mlx.core as mx

    if not mx.cuda.is_available():
        return None
    try:
        info = mx.device_info()
    except Exception:  # a build without it: one directory for any GPU
        info = {}
    path = kernel_cache_dir(os.environ, mx.__version__, str(info.get("architecture") or info.get("device_name") or "gpu"))
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
