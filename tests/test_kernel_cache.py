"""Where workers keep the kernels mlx compiles at run time on CUDA."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import pytest

from worker.runtime.kernel_cache import ENV, THRASHING_CHECK, keep_kernels, kernel_cache_dir, no_thrashing_abort


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
