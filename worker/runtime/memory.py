"""Measured memory of this worker: the process as the OS sees it, and MLX's own view."""

from __future__ import annotations

import ctypes

import mlx.core as mx
import psutil

from ipc.worker_events import rss_uss
from worker.runtime.batch_size import gpu_memory

# MLX keeps freed buffers for reuse, by default until they fill its memory
# limit: 95 % of the GPU on CUDA, whatever other processes hold. A batch
# whose rows leave one by one frees buffers of a new size every step (its
# caches and a hybrid model's recurrent states, one row fewer each time),
# so the cache can grow towards the whole GPU, which is what a second
# worker on one H100 met: a 0.8b worker of 64 rows ran out of memory in
# its warm-up beside a first one, with 77 of the 80 GB free by nvidia-smi
# (with 8 rows it started). A worker keeps at most a quarter of its batch
# memory cached, and at least MIN_BUFFER_CACHE, so that a step's scratch
# buffers are still reused from one step to the next.
BUFFER_CACHE_SHARE = 4
MIN_BUFFER_CACHE = 1 << 30


def buffer_cache_limit(batch_memory: int) -> int:
    """The most bytes of freed buffers MLX may keep for a worker whose rows'
    caches may take `batch_memory`."""
    return max(MIN_BUFFER_CACHE, batch_memory // BUFFER_CACHE_SHARE)


def bound_buffer_cache(batch_memory: int) -> int:
    """Sets this process's MLX cache limit for `batch_memory`; returns it."""
    limit = buffer_cache_limit(batch_memory)
    mx.set_cache_limit(limit)
    return limit


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


def unused_device_memory(held_elsewhere: int = 0) -> int:
    """Memory of the device that nothing holds now, or only this process's
    cache of freed buffers: the device's memory less this process's MLX
    buffers in use and `held_elsewhere` (what the pool's other workers on
    this machine hold or may take: their weights, prefix cache budgets and
    the most their rows' caches take, most of it not allocated yet); on
    CUDA no more than the driver's figure for the whole GPU (other
    processes' use subtracted) plus that cache."""
    unused = device_memory() - int(mx.get_active_memory()) - held_elsewhere
    if mx.default_device() == mx.gpu:
        free = mx.device_info().get("free_memory")
        if free:
            return min(unused, int(free) + int(mx.get_cache_memory()))
    return unused


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
