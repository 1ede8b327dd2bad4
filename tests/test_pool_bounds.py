"""Bounds the pool keeps with no setting for them, through a real
supervisor with fake workers (tests.fakeworker): how many workers it keeps
loaded, and how many failed model dirs it remembers."""

from __future__ import annotations

import psutil
import pytest

from harness.fakes import FAKE_ENV, FakeModels
from harness.procs import said, wait_for
from supervisor.policy import DEFAULT_MEMORY_SHARE, MAX_FAILED_ROWS


@pytest.fixture
def fakes(tmp_path):
    return FakeModels(tmp_path)


def status(pool) -> dict[str, dict]:
    pool.send({"op": "status"})
    return {row["model"]: row for row in pool.wait_ev("status")["models"]}


def test_with_no_max_loaded_the_workers_that_fit_in_memory_stay_loaded(fakes, spawn_pool):
    """Every model named ran a worker of its own, without bound (ten model
    dirs named on stdin: eleven workers). Now, with neither max_loaded nor
    memory_budget set, as many stay as fit in three quarters of the
    machine's memory at the largest one's footprint. Here each model's
    (sparse) weights take 0.3 of it: two fit, the third evicts the least
    recently used."""
    weights = int(psutil.virtual_memory().total * DEFAULT_MEMORY_SHARE / 2.5) - (256 << 20)
    for name in "abc":
        with open(fakes.add(name, {}) / "model.safetensors", "wb") as f:
            f.truncate(weights)
    pool = spawn_pool("--config", fakes.config("heartbeat_interval = 0.1\n", preload=False), env=FAKE_ENV)
    for name in "abc":
        pool.send({"model": name, "id": name, "prompt": "x", "max_tokens": 1})
        assert pool.terminal(name)["ev"] == "gen_token"
    assert said(pool.stderr, b"evicted to make room for 'c'")
    assert pool.wait_ev("unloaded", model="a")
    assert sorted(status(pool)) == ["b", "c"]
    assert pool.close() == 0


def test_memory_budget_counts_gpu_buffers_that_rss_does_not_show(fakes, spawn_pool):
    """A GPU worker's weights, rows and prefix cache live in device memory,
    outside its RSS: eviction counts MLX's buffers where they are more. 'a'
    reports 600 MB of them; 'b' is estimated at its (empty) weights plus the
    600 MB overhead measured on 'a'; under a 1 GB budget 'a' makes room."""
    for name in "ab":
        fakes.add(name, {"mlx_active_bytes": 600_000_000})
    pool = spawn_pool("--config", fakes.config('memory_budget = "1GB"\nheartbeat_interval = 0.1\n', preload=False), env=FAKE_ENV)
    pool.send({"model": "a", "id": "a", "prompt": "x", "max_tokens": 1})
    assert pool.terminal("a")["ev"] == "gen_token"
    assert status(pool)["a"]["mlx_active_bytes"] == 600_000_000
    pool.send({"model": "b", "id": "b", "prompt": "x", "max_tokens": 1})
    assert pool.terminal("b")["ev"] == "gen_token"
    assert pool.wait_ev("unloaded", model="a")
    assert said(pool.stderr, b"evicted to make room for 'b'")
    assert sorted(status(pool)) == ["b"]
    assert pool.close() == 0


def test_failed_model_dirs_named_in_requests_leave_the_table_past_a_bound(fakes, spawn_pool, tmp_path):
    """Every failed dir stayed in status and `ps` for good. Past
    MAX_FAILED_ROWS the oldest go; a configured model that failed stays."""
    fakes.add("configured", {"boot_exit": 78})
    config = fakes.config("heartbeat_interval = 0.1\n")
    dirs = [fakes.add(f"dir{i}", {"boot_exit": 78}) for i in range(MAX_FAILED_ROWS + 2)]
    pool = spawn_pool("--config", config, env=FAKE_ENV)
    pool.wait_ev("failed", model="configured")
    for i, path in enumerate(dirs):
        pool.send({"model": str(path), "id": i, "prompt": "x"})
        assert pool.terminal(i)["code"] in ("load_failed", "model_failed")
    rows: dict[str, dict] = {}

    def trimmed() -> bool:
        rows.clear()
        rows.update(status(pool))
        return len(rows) == MAX_FAILED_ROWS + 1

    wait_for(trimmed, 30, message="failed rows to be dropped")
    assert "configured" in rows and str(dirs[0]) not in rows and str(dirs[1]) not in rows and str(dirs[-1]) in rows
    assert all(row["state"] == "failed" for row in rows.values())
    assert pool.close() == 0
