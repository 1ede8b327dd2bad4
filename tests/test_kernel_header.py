"""The precompiled header CPU workers build for the kernels mlx compiles."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from worker.runtime.kernel_cache import CPU_ENV
from worker.runtime.kernel_header import FLAGS, OFF_ENV, PREAMBLE, build_header, header_path

INCLUDE = Path(mx.__file__).parent / "include"
ROOT = Path(__file__).resolve().parents[1]
needs_compiler = pytest.mark.skipif(
    sys.platform != "linux" or shutil.which("g++") is None or not (INCLUDE / PREAMBLE).is_file(),
    reason="mlx compiles CPU kernels with g++ on Linux",
)


def test_the_header_sits_where_g_plus_plus_looks_for_mlxs_quoted_include(tmp_path):
    got = header_path(tmp_path, "0.32.4")
    assert got == tmp_path / "mlx" / "0.32.4" / "cpu" / "mlx" / "backend" / "cpu" / "compiled_preamble.h.gch"


def test_turned_off_or_without_a_compiler_nothing_is_built(tmp_path):
    assert "is off" in build_header(tmp_path, "0.32.4", INCLUDE, {OFF_ENV: "off", "PATH": os.environ["PATH"]})
    assert "no no-such-compiler on PATH" in build_header(tmp_path, "0.32.4", INCLUDE, {"PATH": os.environ["PATH"]}, "no-such-compiler")
    assert "none (no " in build_header(tmp_path, "0.32.4", tmp_path / "no-include", {"PATH": os.environ["PATH"]})
    assert not list(tmp_path.rglob("*.gch"))


@needs_compiler
def test_a_failing_compiler_leaves_no_header_and_is_reported(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "g++"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo 'g++ 0'; exit 0; }\necho 'cannot write it' >&2\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    said = build_header(tmp_path / "k", "0.32.4", INCLUDE, {"PATH": str(bin_dir)})
    assert said.startswith("none (g++ failed") and "cannot write it" in said
    assert not [p for p in (tmp_path / "k").rglob("*") if p.is_file()]


@needs_compiler
def test_built_once_then_kept_and_built_again_for_another_compiler(tmp_path):
    env = {"PATH": os.environ["PATH"]}
    said = build_header(tmp_path, mx.__version__, INCLUDE, env)
    target = header_path(tmp_path, mx.__version__)
    assert said.startswith(f"{target} (built in") and target.stat().st_size > 0
    built = target.stat().st_mtime_ns
    assert build_header(tmp_path, mx.__version__, INCLUDE, env) == f"{target} (built before)"
    assert target.stat().st_mtime_ns == built
    stamp = target.with_name("compiled_preamble.stamp")
    stamp.write_text(stamp.read_text().replace("mlx ", "mlx was "))
    assert "(built in" in build_header(tmp_path, mx.__version__, INCLUDE, env)
    assert sorted(p.name for p in target.parent.iterdir()) == ["compiled_preamble.h.gch", "compiled_preamble.stamp"]


@needs_compiler
def test_a_kernel_source_as_mlx_writes_it_compiles_through_the_header(tmp_path):
    build_header(tmp_path, mx.__version__, INCLUDE, {"PATH": os.environ["PATH"]})
    source = header_path(tmp_path, mx.__version__).parents[3] / "kernel.cpp"
    source.write_text(f'#include "{PREAMBLE.as_posix()}"\nextern "C" void k(float* a) {{ a[0] = mlx::core::detail::Sigmoid()(a[0]); }}\n')
    # -H names each header read, "!" marking a precompiled one it used.
    cmd = ["g++", *FLAGS, "-shared", "-Winvalid-pch", "-H", "-I", str(INCLUDE), str(source), "-o", str(tmp_path / "k.so")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"! {header_path(tmp_path, mx.__version__)}" in done.stderr
    assert "invalid" not in done.stderr


@needs_compiler
def test_mlx_compiles_a_workers_kernels_through_the_header(tmp_path):
    # A g++ that notes which headers each compile read, in front of the real one.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "headers.log"
    shim = bin_dir / "g++"
    shim.write_text(f'#!/bin/sh\nexec {shutil.which("g++")} -H "$@" 2>>{log}\n')
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    kernels = tmp_path / "kernels"
    code = (
        "import os; from pathlib import Path; from worker.runtime.kernel_cache import keep_cpu_kernels;"
        "d = keep_cpu_kernels(os.environ);"
        "import mlx.core as mx; mx.set_default_device(mx.cpu);"
        "from worker.runtime.kernel_header import build_header;"
        "print(build_header(d, mx.__version__, Path(mx.__file__).parent / 'include', os.environ));"
        "f = mx.compile(lambda x: mx.tanh(mx.sin(x) * 1.75) + x * 0.375); mx.eval(f(mx.ones((7,))))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TMPDIR"} | {CPU_ENV: str(kernels), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "(built in" in done.stdout
    assert list((kernels / "mlx" / mx.__version__ / "cpu").glob("*.so"))
    assert f"! {header_path(kernels, mx.__version__)}" in log.read_text()
