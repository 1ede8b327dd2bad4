"""Measured memory of this worker: the process as the OS sees it, and MLX's own view."""

from __future__ import annotations

import ctypes

import mlx.core as mx
import psutil

from ipc.worker_events import rss_uss
from worker.runtime.batch_size import gpu_memory

try:  # glibc's; musl and macOS have none
    _malloc_trim = ctypes.CDLL(None).malloc_trim
except (AttributeError, OSError):
    _malloc_trim = None


def memory_figures() -> dict[str, int]:
    return {
        **rss_uss(),
        "mlx_active_bytes": int(mx.get_active_memory()),
        "mlx_peak_bytes": int(mx.get_peak_memory()),
        "mlx_cache_bytes": int(mx.get_cache_memory()),
    }


def processor() -> str:
    """What computes: `metal` (Apple silicon), `cuda` (an NVIDIA GPU) or `cpu`."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    return "metal" if mx.metal.is_available() else "cuda"


def device_memory() -> int:
    """Memory of the device MLX computes on: the GPU's, else the machine's RAM."""
    size = gpu_memory(mx.device_info()) if mx.default_device() == mx.gpu else None
    return size or int(psutil.virtual_memory().total)


def trim_heap() -> None:
    """Hands the free lists of glibc's malloc back to the OS: it keeps freed
    small blocks (loading a model, reading adapters, compiling kernels on
    CUDA) in the process, counted in its RSS. About 2 ms."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def release_free_memory() -> None:
    """Hands all freed memory back: MLX's buffer cache, then the heap's."""
    mx.clear_cache()
    trim_heap()
