"""Where workers keep the kernels mlx compiles at run time (CUDA and CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from worker.runtime.kernel_cache import (
    CPU_ENV,
    ENV,
    THRASHING_CHECK,
    UNUSED_FOR_DAYS,
    cpu_kernel_dir,
    cpu_model,
    keep_cpu_kernels,
    keep_kernels,
    kernel_cache_dir,
    no_thrashing_abort,
    prune_versions,
)

DAY = 86400.0


def test_kernels_go_to_the_users_cache_dir_per_mlx_version_and_gpu(tmp_path):
    got = kernel_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}, "0.32.4", "NVIDIA H200 / sm_90")
    assert got == tmp_path / "lattice-pool" / "mlx-kernels" / "0.32.4" / "NVIDIA-H200-sm_90"
    assert kernel_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}, "0.32.4", "../..") == tmp_path / "lattice-pool" / "mlx-kernels" / "0.32.4" / "gpu"
    assert kernel_cache_dir({}, "0.32.4", "x").is_relative_to(Path.home())


def test_a_directory_the_user_chose_stands(tmp_path):
    assert kernel_cache_dir({ENV: str(tmp_path), "XDG_CACHE_HOME": "/elsewhere"}, "0.32.4", "gpu") is None


@pytest.mark.skipif(mx.cuda.is_available(), reason="the CPU backend compiles no CUDA kernels")
def test_without_cuda_nothing_is_set(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert keep_kernels() is None
    assert ENV not in os.environ and not (tmp_path / "lattice-pool").exists()


def test_the_demo_model_and_the_kernels_share_one_cache_root(monkeypatch, tmp_path):
    from supervisor.demo import demo_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert demo_dir() == tmp_path / "lattice-pool" / "demo-model"
    assert kernel_cache_dir(os.environ, "0.32.4", "gpu").parents[2] == tmp_path / "lattice-pool"
    # The XDG spec ignores a relative path: it would move with the working directory.
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert demo_dir() == Path.home() / ".cache" / "lattice-pool" / "demo-model"
    assert kernel_cache_dir(os.environ, "0.32.4", "gpu") == Path.home() / ".cache" / "lattice-pool" / "mlx-kernels" / "0.32.4" / "gpu"


def test_the_cache_thrashing_check_is_off_unless_the_user_set_it():
    env = {}
    assert no_thrashing_abort(env) and env == {THRASHING_CHECK: "0"}
    env = {THRASHING_CHECK: "1"}
    assert not no_thrashing_abort(env) and env == {THRASHING_CHECK: "1"}


def test_cpu_kernels_go_to_the_users_cache_dir_per_cpu_model(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    got = cpu_kernel_dir(env, "AMD EPYC 7B13 64-Core Processor")
    assert got == tmp_path / "lattice-pool" / "mlx-kernels" / "cpu-AMD-EPYC-7B13-64-Core-Processor"
    assert cpu_kernel_dir(env, "../..") == tmp_path / "lattice-pool" / "mlx-kernels" / "cpu-cpu"
    assert cpu_kernel_dir(env | {CPU_ENV: str(tmp_path / "mine")}, "x") == tmp_path / "mine"


def test_the_cpu_model_is_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Gold 6338\n\nprocessor\t: 1\nmodel name\t: other\n")
    assert cpu_model(info) == "Intel(R) Xeon(R) Gold 6338"
    info.write_text("processor\t: 0\nCPU part\t: 0xd0c\n")  # ARM names none
    assert cpu_model(info) and cpu_model(tmp_path / "missing")


@pytest.mark.skipif(sys.platform != "linux", reason="mlx compiles CPU kernels with a C++ compiler on Linux")
def test_a_worker_keeps_its_cpu_kernels_in_that_dir_and_mlx_compiles_into_it(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    got = keep_cpu_kernels(env)
    assert got is not None and got.is_dir() and env["TMPDIR"] == str(got)
    blocked = tmp_path / "file"
    blocked.write_text("")
    env = {CPU_ENV: str(blocked / "sub")}
    assert keep_cpu_kernels(env) is None and "TMPDIR" not in env
    # mlx follows it: a compiled function of its own (a kernel no other test
    # makes, so it is compiled here) lands under that dir.
    mine = tmp_path / "kernels"
    code = (
        "import os; from worker.runtime.kernel_cache import keep_cpu_kernels; keep_cpu_kernels(os.environ);"
        "import mlx.core as mx; mx.set_default_device(mx.cpu);"
        "f = mx.compile(lambda x: mx.sin(mx.cos(x) * 3.25) - x * 0.125); mx.eval(f(mx.ones((5,))))"
    )
    child = {k: v for k, v in os.environ.items() if k != "TMPDIR"} | {CPU_ENV: str(mine)}
    subprocess.run([sys.executable, "-c", code], env=child, check=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert list((mine / "mlx" / mx.__version__ / "cpu").glob("*.so"))


def test_a_worker_says_where_its_cpu_kernels_are_and_prunes_old_versions(tiny_model):
    from harness.procs import wait_for
    from harness.worker import WorkerProc

    old = None
    if sys.platform == "linux":
        old = Path(os.environ[CPU_ENV]) / "mlx" / "0.0.1"
        (old / "cpu").mkdir(parents=True, exist_ok=True)
        (old / "cpu" / "kernel.so").write_bytes(b"x")
        then = old.stat().st_mtime - (UNUSED_FOR_DAYS + 1) * DAY
        os.utime(old, (then, then))
    w = WorkerProc.started(tiny_model)
    try:
        if old is not None:
            # Logged before ready; its pipe is read by a thread of its own.
            needle = f"CPU kernels compiled at run time are kept in {os.environ[CPU_ENV]}".encode()
            assert wait_for(lambda: needle in w.stderr, 30), w.stderr.decode(errors="replace")
            if not mx.cuda.is_available():
                assert wait_for(lambda: b"CPU kernels' precompiled header: " in w.stderr, 30), w.stderr.decode(errors="replace")
            assert wait_for(lambda: f"removed {old}: ".encode() in w.stderr, 30), w.stderr.decode(errors="replace")
            assert not old.exists()
            assert (old.parent / mx.__version__).is_dir()
    finally:
        w.close()


def test_versions_unused_for_long_are_removed_the_running_one_marked_used(tmp_path):
    now = 1_000_000_000.0
    ages = {"0.30.0": 40, "0.31.1": 10, "0.32.4": 90, "0.29.0rc1": 31, "cpu-AMD-EPYC": 90, "notes": 90}
    for name, days in ages.items():
        (tmp_path / name).mkdir()
        os.utime(tmp_path / name, (now - days * DAY, now - days * DAY))
    (tmp_path / "0.28.0").write_text("a file, not a version's directory")
    (tmp_path / "0.27.0").symlink_to(tmp_path / "notes")
    os.utime(tmp_path / "0.27.0", (now - 90 * DAY, now - 90 * DAY), follow_symlinks=False)

    removed = prune_versions(tmp_path, "0.32.4", now=now)

    assert sorted(p.name for p in removed) == ["0.29.0rc1", "0.30.0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.27.0", "0.28.0", "0.31.1", "0.32.4", "cpu-AMD-EPYC", "notes"]
    assert (tmp_path / "0.32.4").stat().st_mtime == now
    # A later start of the same version keeps what it marked.
    assert prune_versions(tmp_path, "0.31.1", now=now + (UNUSED_FOR_DAYS - 1) * DAY) == []


def test_a_root_that_cannot_be_made_prunes_nothing_and_raises_nothing(tmp_path, caplog):
    (tmp_path / "file").write_text("not a directory")
    assert prune_versions(tmp_path / "file" / "mlx", "0.32.4") == []
    assert "cannot prune old mlx versions' kernels" in caplog.text
