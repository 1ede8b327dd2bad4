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

- Thin products skip sgemm: OpenBLAS's sgemm packs the weight matrix
  before every multiplication, so a lone request's decode step (one row per
  matmul) cost about what eight rows cost. `gemv_forward.c`, compiled once
  with the system's C compiler into the pool's cache dir and opened ahead
  of OpenBLAS, provides libmlx's `cblas_sgemm`: one-row (and one-column)
  products go to OpenBLAS's `cblas_sgemv`; 2 to 16 rows times a weight
  matrix (a small batch's decode step, a speculative verify) to a kernel
  of its own that reads the matrix once (x86-64 with AVX2 and FMA; where
  OpenBLAS runs several threads, 2 to 4 rows, a large product split among
  as many); other products of up to 3 rows to sgemv a row at a time; the
  rest to `cblas_sgemm`. Without a C compiler (mlx needs one on Linux for
  its compiled kernels anyway) every call goes to sgemm, as before.

`LATTICE_CPU_BLAS=bundled` keeps mlx's own BLAS (for comparisons);
`LATTICE_CPU_GEMV=off` sends thin products to sgemm too, and
`LATTICE_CPU_GEMV=sgemv` keeps sgemv but not the kernel;
`OPENBLAS_NUM_THREADS` sets OpenBLAS's threads, and the kernel's (default:
cores - 1; workers that run at the same time should split the cores
between them).
"""

from __future__ import annotations

import ctypes
import fnmatch
import hashlib
import importlib.metadata
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ipc.paths import pool_cache_dir

log = logging.getLogger("worker")

BLAS_ENV = "LATTICE_CPU_BLAS"
GEMV_ENV = "LATTICE_CPU_GEMV"
GEMV_SOURCE = Path(__file__).with_name("gemv_forward.c")
# A compiler that hangs must not hold a worker's start for long.
COMPILE_TIMEOUT_S = 60
COMPILE_FLAGS = ("-O2", "-shared", "-fPIC", "-pthread")


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


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the OS says)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


_loaded: str | None = None


def load_openblas() -> str | None:
    """Puts OpenBLAS in the process' global symbol scope; returns its path,
    or None when it is not wanted or not usable here. Must run before
    `mlx.core` is imported; once it has loaded, a second call returns the
    same path."""
    global _loaded
    if _loaded is not None:
        return _loaded
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
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(max(1, usable_cores() - 1)))
    with tempfile.TemporaryDirectory(prefix="lattice-blas-") as tmp:
        links = Path(tmp)
        (links / "libopenblas.so.0").symlink_to(openblas)
        (links / "libgfortran.so.5").symlink_to(gfortran)
        for lib in bundled.iterdir():  # gfortran's own mangled dependencies
            if not (links / lib.name).exists():
                (links / lib.name).symlink_to(lib)
        library = str(links / "libopenblas.so.0")
        try:
            # Opened privately first: the forwarding library must enter the
            # global scope before OpenBLAS does, and only once OpenBLAS is
            # known to load (it calls into it).
            own = ctypes.CDLL(library)
        except OSError as exc:
            log.warning("OpenBLAS not loaded (%s); using mlx's bundled BLAS", exc)
            return None
        route = os.environ.get(GEMV_ENV, "on")
        if route != "off":
            try:
                forward_thin_products(own, pool_cache_dir(os.environ) / "cpu-blas", kernel=route != "sgemv")
            except Exception as exc:  # a speed-up: it never stops a start
                log.warning("thin float32 products go through sgemm: %s", exc)
        # Already open: this adds it to the global scope, after the forwarding library.
        ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
    _loaded = str(openblas)
    return _loaded


def forward_thin_products(openblas: ctypes.CDLL, directory: Path, kernel: bool = True) -> None:
    """Opens gemv_forward.c's library (compiled into `directory` when it is
    not there yet) in the global scope, wired to `openblas`, its thin
    kernel on or off; where it cannot be built or opened, sgemm goes on
    serving every product."""
    # The kernel splits a product among as many threads as OpenBLAS has.
    kernel_threads = max(1, int(openblas.openblas_get_num_threads())) if kernel else 0
    for attempt in range(2):
        built = _gemv_library(directory)
        if built is None:
            return None
        # The dynamic loader knows a library by the path it was opened by:
        # a file built again after a failed open is opened by another one.
        path = built if attempt == 0 else built.with_name(f".{built.name}.{os.getpid()}.so")
        try:
            if path != built:
                path.unlink(missing_ok=True)
                os.link(built, path)
            # Opened privately and wired first: only a library that is what
            # it should be enters the global scope, where libmlx binds to it.
            forward = ctypes.CDLL(str(path))
            forward.lattice_gemv_init(ctypes.cast(openblas.cblas_sgemm, ctypes.c_void_p), ctypes.cast(openblas.cblas_sgemv, ctypes.c_void_p), kernel_threads)
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        except (OSError, AttributeError) as exc:
            # A damaged file in the cache: built again once.
            log.warning("cannot open %s (%s)%s", built, exc, "; building it again" if attempt == 0 else "")
            built.unlink(missing_ok=True)
            continue
        finally:
            if path != built:
                path.unlink(missing_ok=True)  # mapped already; the cache keeps `built`
        return


def _gemv_library(directory: Path) -> Path | None:
    """The compiled gemv_forward.c in `directory`, named by its source and
    the machine, compiled there when missing; None when it cannot be
    compiled (no C compiler, or one that fails)."""
    source = GEMV_SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(COMPILE_FLAGS).encode() + platform.machine().encode()).hexdigest()[:16]
    built = directory / f"gemv-forward-{digest}.so"
    if built.is_file():
        return built
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        log.info("no C compiler: thin float32 products go through sgemm")
        return None
    tmp = directory / f".{built.name}.{os.getpid()}.tmp"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # Compiled to a file of its own, then renamed into place: workers
        # starting together never open a half-written library.
        subprocess.run(
            [*shlex.split(compiler), *COMPILE_FLAGS, "-o", str(tmp), str(GEMV_SOURCE)],
            check=True,
            capture_output=True,
            timeout=COMPILE_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
        os.replace(tmp, built)
        for old in directory.glob("gemv-forward-*.so"):
            if old != built:
                old.unlink(missing_ok=True)  # another source's (a process using it keeps its mapping)
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        detail = exc.stderr.decode(errors="replace").strip()[-300:] if isinstance(exc, subprocess.CalledProcessError) and exc.stderr else str(exc)
        log.warning("cannot compile %s with %s (%s): thin float32 products go through sgemm", GEMV_SOURCE.name, compiler, detail)
        tmp.unlink(missing_ok=True)
        return None
    return built


def thin_products_forwarded() -> int | None:
    """sgemm calls served by sgemv or the thin kernel so far in this
    process; None when thin products are not forwarded (libmlx's sgemm is
    OpenBLAS's or mlx's own)."""
    return _from_forwarding("lattice_gemv_forwarded")


def thin_kernel_products() -> int | None:
    """Of those, the products the thin kernel computed; None when the
    kernel is not in use (not forwarded, no AVX2 and FMA, or
    `LATTICE_CPU_GEMV=sgemv`)."""
    return _from_forwarding("lattice_gemv_in_kernel") if _from_forwarding("lattice_gemv_kernel_rows") else None


def thin_routes() -> str:
    """Where thin products go, for the worker's log line."""
    rows = _from_forwarding("lattice_gemv_kernel_rows")
    if rows is None:
        return ""
    if not rows:
        return "; products of up to 3 rows through its sgemv"
    return f"; one-row products through its sgemv, 2 to {rows} rows times a weight matrix through the thin kernel"


def _from_forwarding(name: str) -> int | None:
    """A figure the forwarding library reports; None when it is not loaded."""
    try:
        fn = getattr(ctypes.CDLL(None), name)
    except AttributeError:
        return None
    fn.restype = ctypes.c_ulonglong
    return int(fn())


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
