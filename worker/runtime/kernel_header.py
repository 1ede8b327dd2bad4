"""A precompiled header for the CPU kernels mlx compiles at run time.

On Linux mlx compiles each fused kernel of a compiled graph with `g++`, one
compiler process a kernel, and every one of them first parses the same
headers (`mlx/backend/cpu/compiled_preamble.h`, 1.9 MB once preprocessed):
0.50 s of the 0.69 s a kernel took on a 2-core AMD EPYC, where a worker of
the default demo model compiles 61 kernels at its first start on a machine.

g++ reads `<header>.gch` in place of a header wherever it finds one in a
directory it searches before the header's own, and mlx's kernels include
the preamble with quotes, so the first directory searched is the kernel
source's: mlx's kernel directory. A CPU worker builds the preamble's
precompiled header there once (1.7 s on that machine; about 50 MB), and each
kernel then compiles in 0.17 s, to the same machine code (objdump of four
kernels, with and without it). That worker's first start went from 34.0 s
to 10.8 s to `ready` (medians of 5 rounds, bench/kernel_cache.py).

g++ checks a precompiled header against the compiler and the options that
built it and reads the text header where they differ: an mlx that changes
its compile command, or another g++, costs the time the header saves, never
a wrong kernel. The stamp beside the header names the compiler and mlx it
was built for; a worker builds it again where either has changed.
LATTICE_CPU_KERNEL_HEADER=off builds none.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

OFF_ENV = "LATTICE_CPU_KERNEL_HEADER"
PREAMBLE = Path("mlx", "backend", "cpu", "compiled_preamble.h")
# mlx 0.32's command for a kernel, less -shared (no bearing on a header):
# the header is used only where these match it.
FLAGS = ("-std=c++17", "-O3", "-Wall", "-fPIC")
# The most a build may take; past it the worker starts without the header
# (the build takes seconds; this bounds a compiler that hangs).
BUILD_TIMEOUT_S = 60.0


def header_path(kernel_dir: Path, mlx_version: str) -> Path:
    """Where g++ finds the header for mlx's kernel sources: mlx writes them
    to `<temp dir>/mlx/<version>/cpu`, and the worker's temp dir is
    kernel_dir (worker.runtime.kernel_cache)."""
    return kernel_dir / "mlx" / mlx_version / "cpu" / PREAMBLE.parent / (PREAMBLE.name + ".gch")


def _stamp(compiler: str, mlx_version: str, preamble: Path) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    digest = hashlib.sha256(preamble.read_bytes()).hexdigest()
    return f"{version.splitlines()[0] if version else compiler}\nmlx {mlx_version}\n{digest}\n"


def build_header(kernel_dir: Path, mlx_version: str, include_dir: Path, env: Mapping[str, str], compiler: str = "g++") -> str:
    """Builds the header unless it is there for this compiler and mlx, or
    turned off; says what it did, for the log. Never raises: without the
    header mlx compiles as it always does."""
    if env.get(OFF_ENV, "").lower() in ("off", "0", "false", "no"):
        return f"none ({OFF_ENV} is off)"
    preamble = include_dir / PREAMBLE
    found = shutil.which(compiler, path=env.get("PATH"))
    if found is None:
        return f"none (no {compiler} on PATH)"
    if not preamble.is_file():
        return f"none (no {preamble})"
    target = header_path(kernel_dir, mlx_version)
    stamp_file = target.with_name("compiled_preamble.stamp")
    partial = target.with_name(f".{os.getpid()}.gch.partial")
    try:
        stamp = _stamp(found, mlx_version, preamble)
        if target.is_file() and stamp_file.is_file() and stamp_file.read_text() == stamp:
            return f"{target} (built before)"
        target.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        cmd = [found, *FLAGS, "-I", str(include_dir), "-x", "c++-header", str(preamble), "-o", str(partial)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            return f"none ({compiler} failed: {done.stderr.strip()[-300:]})"
        # Replaced whole, so that a kernel compiled meanwhile by another
        # worker sharing the directory reads the old header or the new one.
        os.replace(partial, target)
        stamp_partial = stamp_file.with_name(f".{os.getpid()}.stamp.partial")
        stamp_partial.write_text(stamp)
        os.replace(stamp_partial, stamp_file)
        return f"{target} (built in {time.monotonic() - t0:.1f} s)"
    except subprocess.TimeoutExpired:
        return f"none ({compiler} took over {BUILD_TIMEOUT_S:.0f} s)"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"none ({exc})"
    finally:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
