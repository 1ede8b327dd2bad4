"""Fast CPU inference on Linux: OpenBLAS behind mlx, float32 weights.

The mlx-cpu wheel links a bundled reference (netlib) BLAS, about 40x slower
than OpenBLAS on a float32 GEMM, and runs bf16/fp16 matmuls and quantized
matmuls with bf16 scales through slow single-threaded loops. So on CPU the
worker computes in float32 and makes OpenBLAS provide the BLAS symbols:

- `load_openblas()` opens the OpenBLAS from the `ngsolve-openblas` wheel with
  RTLD_GLOBAL before mlx is imported, so libmlx's `cblas_sgemm` binds to it
  (global scope first). PyPI's other OpenBLAS wheels do not fit: scipy-openblas
  prefixes its symbols (`scipy_cblas_sgemm`), cmeel-openblas is built for
  AVX-512 only. That OpenBLAS needs `libgfortran.so.5`, which a clean machine
  may lack; mlx-cpu bundles one under a mangled name, so a private directory
  of symlinks (found through OpenBLAS's `$ORIGIN` rpath) serves it.
- `use_float32(model)` casts floating parameters (quantization scales and
  biases included) to float32 on CPU. Memory: bf16/fp16 weights double;
  4-bit weights grow about 11% (fp32 scales and biases per group of 64).

`LATTICE_CPU_BLAS=bundled` keeps mlx's own BLAS (for comparisons);
`OPENBLAS_NUM_THREADS` sets OpenBLAS's threads (default: cores - 1; workers
that run at the same time should split the cores between them).
"""

from __future__ import annotations

import ctypes
import fnmatch
import importlib.metadata
import logging
import os
import sys
import tempfile
from pathlib import Path

log = logging.getLogger("worker")

BLAS_ENV = "LATTICE_CPU_BLAS"


def _dist_file(dist: str, pattern: str) -> Path | None:
    """An installed file of a distribution, found without importing it
    (importing ngsolve_openblas would try to load the library itself)."""
    try:
        files = importlib.metadata.distribution(dist).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in sorted(files, key=str):
        if fnmatch.fnmatch(f.name, pattern):
            return Path(f.locate()).resolve()
    return None


def load_openblas() -> str | None:
    """Puts OpenBLAS in the process' global symbol scope; returns its path,
    or None when it is not wanted or not usable here. Must run before
    `mlx.core` is imported."""
    if sys.platform != "linux" or os.environ.get(BLAS_ENV, "openblas") == "bundled":
        return None
    if "mlx.core" in sys.modules:
        log.warning("OpenBLAS not loaded: mlx was imported first")
        return None
    # Only the mlx-cpu build carries the reference BLAS worth replacing.
    openblas = _dist_file("ngsolve-openblas", "libopenblas*.so*")
    gfortran = _dist_file("mlx-cpu", "libgfortran*.so*")
    if openblas is None or gfortran is None:
        return None
    bundled = gfortran.parent
    # OpenBLAS threads spin while they wait: with one per core, any other
    # busy process (the UI, the supervisor, a second worker) preempts one of
    # them and every GEMM stalls; measured on 2 cores, TTFT jumped 3-10x. One
    # core is left free unless the user says otherwise.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) - 1)))
    with tempfile.TemporaryDirectory(prefix="lattice-blas-") as tmp:
        links = Path(tmp)
        (links / "libopenblas.so.0").symlink_to(openblas)
        (links / "libgfortran.so.5").symlink_to(gfortran)
        for lib in bundled.iterdir():  # gfortran's own mangled dependencies
            if not (links / lib.name).exists():
                (links / lib.name).symlink_to(lib)
        try:
            ctypes.CDLL(str(links / "libopenblas.so.0"), mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            log.warning("OpenBLAS not loaded (%s); using mlx's bundled BLAS", exc)
            return None
    return str(openblas)


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def sgemm_provider() -> str | None:
    """The file that `cblas_sgemm` resolves to in the global scope."""
    process = ctypes.CDLL(None)
    try:
        fn = process.cblas_sgemm
    except AttributeError:
        return None
    info = _DlInfo()
    if not process.dladdr(ctypes.cast(fn, ctypes.c_void_p), ctypes.byref(info)):
        return None
    return os.path.realpath(info.dli_fname.decode())


def use_float32(model) -> bool:
    """Casts the model's floating parameters to float32 when mlx computes on
    the CPU; returns whether it did."""
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        return False
    model.set_dtype(mx.float32)
    return True
