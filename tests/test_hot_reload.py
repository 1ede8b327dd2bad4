"""Adapter files changed on disk reach running workers without a restart."""

import asyncio
import hashlib
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest

from harness.procs import wait_for
from tests.lora_files import lora_pairs, targets_of, write_mlx

CHAT = "<|im_start|>user\nTell me about the river.<|im_end|>\n<|im_start|>assistant\n"


def adapter_bytes(tmp_path, tiny_model, seed, strength=1.0, broken=None) -> bytes:
    pairs = lora_pairs(targets_of(tiny_model), seed=seed, strength=strength)
    if broken == "shape":
        first = sorted(pairs)[0]
        a, b = pairs[first]
        pairs[first] = (np.concatenate([a, a[:, :1]], axis=1), b)
    path = write_mlx(tmp_path / f"gen-{seed}-{strength}-{broken}.safetensors", pairs, alpha=8.0)
    data = path.read_bytes()
    path.unlink()
    if broken == "truncated":
        data = data[: len(data) // 2]
    return data


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def rewrite_in_place(path, data):
    with open(path, "r+b" if path.exists() else "wb") as f:
        f.truncate(0)
        f.write(data)


def rename_over(path, data):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def delete_then_create(path, data):
    path.unlink()
    path.write_bytes(data)


@pytest.fixture
def setup(tmp_path, tiny_model, spawn_pool):
    adapters = tmp_path / "adapters"
    adapters.mkdir()
    v1 = adapter_bytes(tmp_path, tiny_model, seed=1)
    v2 = adapter_bytes(tmp_path, tiny_model, seed=2)
    (adapters / "v1.safetensors").write_bytes(v1)
    (adapters / "v2.safetensors").write_bytes(v2)
    live = tmp_path / "live" / "style.safetensors"
    live.parent.mkdir()
    live.write_bytes(v1)
    config = tmp_path / "pool.toml"
    config.write_text(
        "\n".join(
            f'[[models]]\nname = "{name}"\npath = "{tiny_model}"\nlora = "{path}"\npreload = true\n'
            for name, path in (("v1", adapters / "v1.safetensors"), ("v2", adapters / "v2.safetensors"), ("live", live))
        )
    )
    pool = spawn_pool("--config", str(config))
    for name in ("v1", "v2", "live"):
        pool.wait_ev("ready", model=name)
    counter = iter(range(10_000))

    def greedy(model):
        request_id = f"{model}-{next(counter)}"
        pool.send({"model": model, "id": request_id, "prompt": CHAT, "max_tokens": 24, "temperature": 0})
        done = pool.terminal(request_id)
        assert done["ev"] == "gen_token", done
        return pool.text(request_id)

    texts = {"v1": greedy("v1"), "v2": greedy("v2")}
    assert texts["v1"] != texts["v2"]
    assert greedy("live") == texts["v1"]
    return pool, live, {"v1": v1, "v2": v2}, texts, greedy


@pytest.mark.parametrize("style", [rewrite_in_place, rename_over, delete_then_create], ids=lambda f: f.__name__)
def test_each_rewrite_style_reloads(setup, style):
    pool, live, content, texts, greedy = setup
    style(live, content["v2"])
    loaded = pool.wait_for(lambda e: e["ev"] == "adapter_loaded" and e["model"] == "live" and e["sha256"] == sha(content["v2"]))
    assert loaded["lora"] == str(live)
    assert greedy("live") == texts["v2"]
    style(live, content["v1"])
    pool.wait_for(lambda e: e["ev"] == "adapter_loaded" and e["model"] == "live" and e["sha256"] == sha(content["v1"]))
    assert greedy("live") == texts["v1"]
    assert pool.close() == 0


@pytest.mark.parametrize("broken", ["truncated", "shape"])
def test_broken_files_keep_the_old_adapter(setup, tmp_path, tiny_model, broken):
    pool, live, content, texts, greedy = setup
    mark = len(pool.events)
    rename_over(live, adapter_bytes(tmp_path, tiny_model, seed=3, broken=broken))
    err = pool.wait_for(lambda e: e["ev"] == "adapter_error" and e["model"] == "live")
    assert err["code"] == "adapter_error" and ("truncated" in err["msg"] or "shape mismatch" in err["msg"]), err
    # The read is tried again (a write can be read half done) and the
    # failure told once, not once per try (four identical lines).
    wait_for(lambda: pool.stderr.count(b"retrying the reload") >= 3, 60, message="three retries of the reload")
    assert greedy("live") == texts["v1"]
    # A later good write still gets through.
    rename_over(live, content["v2"])
    pool.wait_for(lambda e: e["ev"] == "adapter_loaded" and e["model"] == "live" and e["sha256"] == sha(content["v2"]))
    assert greedy("live") == texts["v2"]
    assert [e["ev"] for e in pool.events[mark:] if e["ev"].startswith("adapter_") and e["model"] == "live"] == ["adapter_error", "adapter_loaded"]
    assert pool.close() == 0


def test_deleted_file_keeps_the_adapter_and_is_reported(setup):
    pool, live, content, texts, greedy = setup
    live.unlink()
    err = pool.wait_for(lambda e: e["ev"] == "adapter_error" and e["model"] == "live")
    assert "deleted" in err["msg"]
    assert greedy("live") == texts["v1"]
    live.write_bytes(content["v2"])
    pool.wait_for(lambda e: e["ev"] == "adapter_loaded" and e["model"] == "live" and e["sha256"] == sha(content["v2"]))
    assert greedy("live") == texts["v2"]
    assert pool.close() == 0


def test_reload_op_forces_a_reread(setup):
    pool, live, content, texts, greedy = setup
    pool.send({"op": "reload", "model": "live"})
    assert pool.wait_for(lambda e: e["ev"] == "adapter_loaded" and e["model"] == "live")["sha256"] == sha(content["v1"])
    assert pool.close() == 0


def test_rapid_rewrites_while_requests_stream(setup, tmp_path, tiny_model):
    pool, live, content, texts, greedy = setup
    styles = [rewrite_in_place, rename_over, delete_then_create]
    versions = [adapter_bytes(tmp_path, tiny_model, seed=10 + i % 3, strength=1.0 + i / 100) for i in range(50)]
    for i, data in enumerate(versions):
        pool.send({"model": "live", "id": f"stream-{i}", "prompt": CHAT, "max_tokens": 8, "seed": i})
        styles[i % 3](live, data)
    for i in range(50):
        done = pool.terminal(f"stream-{i}")
        assert done["ev"] == "gen_token" and done["gen_tokens"] == 8, done
    last = sha(versions[-1])
    pool.wait_for(lambda e: e["ev"] == "adapter_loaded" and e["model"] == "live" and e["sha256"] == last, timeout=60)
    # The last version is what serves now: same text as a worker started on it.
    (tmp_path / "adapters" / "v1.safetensors").write_bytes(versions[-1])
    pool.wait_for(lambda e: e["ev"] == "adapter_loaded" and e["model"] == "v1" and e["sha256"] == last)
    assert greedy("live") == greedy("v1")
    assert pool.close() == 0


def test_adapter_directories_reload_too(tmp_path, tiny_model, spawn_pool):
    """A PEFT adapter given as its directory: a new config alone is a new adapter."""
    from tests.lora_files import write_peft

    pairs = lora_pairs(targets_of(tiny_model), seed=4)
    live = write_peft(tmp_path / "adapters" / "style", pairs, r=4, alpha=8.0)
    config = tmp_path / "pool.toml"
    config.write_text(f'[[models]]\nname = "live"\npath = "{tiny_model}"\nlora = "{live}"\npreload = true\n')
    pool = spawn_pool("--config", str(config))
    pool.wait_ev("ready", model="live")
    weights = sha((live / "adapter_model.safetensors").read_bytes())
    write_peft(live, pairs, r=4, alpha=16.0)  # same tensors, twice the scale
    config = sha((live / "adapter_config.json").read_bytes())
    # Written at once after `ready`, perhaps before the watch has looked:
    # its first look compares with the files as they were when the worker
    # was asked to read them, so one write is enough.
    loaded = pool.wait_for(lambda e: e["ev"] == "adapter_loaded" and e["model"] == "live" and e["config_sha256"] == config, timeout=60)
    assert loaded["lora"] == str(live) and loaded["sha256"] == weights
    assert pool.close() == 0


@pytest.fixture
def one_adapter(tmp_path, tiny_model, spawn_pool):
    """A pool with one model whose adapter file the test breaks."""
    live = tmp_path / "live" / "style.safetensors"
    live.parent.mkdir()
    v1 = adapter_bytes(tmp_path, tiny_model, seed=1)
    live.write_bytes(v1)
    config = tmp_path / "pool.toml"
    config.write_text(f'[[models]]\nname = "live"\npath = "{tiny_model}"\nlora = "{live}"\npreload = true\n')
    pool = spawn_pool("--config", str(config))
    pool.wait_ev("ready", model="live")
    counter = iter(range(10_000))

    def greedy():
        request_id = f"r{next(counter)}"
        pool.send({"model": "live", "id": request_id, "prompt": CHAT, "max_tokens": 24, "temperature": 0})
        done = pool.terminal(request_id)
        assert done["ev"] == "gen_token", done
        return pool.text(request_id)

    return pool, live, v1, greedy


def kill_worker(pool) -> None:
    pool.send({"op": "status"})
    os.kill(pool.wait_ev("status")["models"][0]["pid"], signal.SIGKILL)


def test_an_adapter_deleted_or_looped_survives_a_worker_restart(one_adapter):
    """The adapter in memory outlives its file: a restart after the file was
    deleted, or turned into a symlink loop, used to exit 78 and fail the
    model. The restarted worker now starts from the pool's private copy of
    what it had loaded, and says so."""
    pool, live, v1, greedy = one_adapter
    text = greedy()
    pool.send({"op": "status"})
    argv = psutil.Process(pool.wait_ev("status")["models"][0]["pid"]).cmdline()
    copies = Path(argv[argv.index("--adapter-copies") + 1])
    assert copies.parent.name.startswith("lattice-pool-adapters-") and stat.S_IMODE(copies.parent.stat().st_mode) == 0o700
    live.unlink()
    assert "deleted" in pool.wait_ev("adapter_error", model="live")["msg"]
    for breakage in ("deleted", "a symlink loop"):
        kill_worker(pool)
        said = pool.wait_for(lambda e: e["ev"] == "adapter_error" and "last good copy" in e["msg"])
        assert said["lora"] == str(live) and str(live) in said["msg"] and sha(v1) in said["msg"], breakage
        pool.wait_ev("ready", model="live")
        assert greedy() == text, breakage
        if breakage == "deleted":
            live.symlink_to(live)
            assert greedy() == text  # the configured name still reaches this worker
    assert not [e for e in pool.events if e["ev"] == "failed"]
    assert pool.close() == 0
    assert not copies.parent.exists(), "the copies outlived the pool"


def test_a_fifo_in_place_of_the_adapter_is_refused_without_blocking(one_adapter, tmp_path, tiny_model):
    """Opening a FIFO blocks until a writer comes: the worker's loader thread
    hung there, hot reload ended for it, and `reload` got no answer."""
    pool, live, v1, greedy = one_adapter
    text = greedy()
    live.unlink()
    os.mkfifo(live)
    assert "is a FIFO, not a regular file" in pool.wait_for(lambda e: e["ev"] == "adapter_error" and "FIFO" in e["msg"])["msg"]
    pool.send({"op": "reload", "model": "live"})
    assert "FIFO" in pool.wait_for(lambda e: e["ev"] == "adapter_error" and "FIFO" in e["msg"])["msg"]
    assert greedy() == text
    v2 = adapter_bytes(tmp_path, tiny_model, seed=2)
    live.unlink()
    live.write_bytes(v2)
    pool.wait_for(lambda e: e["ev"] == "adapter_loaded" and e["sha256"] == sha(v2))
    assert greedy() != text
    assert pool.close() == 0


def test_copies_left_by_a_sigkilled_pool_are_removed_by_the_next(tmp_path, tiny_model, spawn_pool):
    """A SIGKILLed pool cannot remove its adapter copies; the next pool
    started with the same $TMPDIR removes those of pools that are gone, and
    only those."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid no process has now
    stale = tmp / f"lattice-pool-adapters-{gone.pid}-abc"
    (stale / "w").mkdir(parents=True)
    (stale / "w" / "copy").write_bytes(b"x")
    running = tmp / f"lattice-pool-adapters-{os.getpid()}-abc"  # a pool of a running process
    other = tmp / "lattice-pool-adaptersX"
    for path in (running, other):
        path.mkdir()
    live = tmp_path / "style.safetensors"
    live.write_bytes(adapter_bytes(tmp_path, tiny_model, seed=1))
    config = tmp_path / "pool.toml"
    config.write_text(f'[[models]]\nname = "live"\npath = "{tiny_model}"\nlora = "{live}"\npreload = true\n')

    first = spawn_pool("--config", str(config), env={"TMPDIR": str(tmp)})
    first.wait_ev("ready", model="live")
    assert not stale.exists() and running.exists() and other.exists()
    mine = tmp / f"lattice-pool-adapters-{first.proc.pid}-"
    assert [p for p in tmp.iterdir() if str(p).startswith(str(mine))], list(tmp.iterdir())
    first.proc.kill()
    first.proc.wait()
    assert [p for p in tmp.iterdir() if str(p).startswith(str(mine))], "copies are left after a SIGKILL"

    second = spawn_pool("--config", str(config), env={"TMPDIR": str(tmp)})
    second.wait_ev("ready", model="live")
    assert not [p for p in tmp.iterdir() if str(p).startswith(str(mine))]
    assert running.exists() and other.exists()
    assert second.close() == 0


def test_a_save_before_the_watch_first_looks_is_a_change(tmp_path):
    """The watch is armed once the worker has read the adapter; a save
    between the pool asking for that read and the watch's first look is
    still seen, as the first look compares with the files' identity noted
    when the read was asked for."""
    from supervisor.adapter_prints import fingerprint
    from supervisor.adapters import FileWatcher

    live = tmp_path / "style.safetensors"
    live.write_bytes(b"first")
    asked = fingerprint(str(live))
    saved = tmp_path / "saved.tmp"
    saved.write_bytes(b"second version")
    os.replace(saved, live)  # an editor's save: a new inode

    async def first_report() -> list:
        seen, reports = asyncio.Event(), []

        def changed(adapter: str, exists: bool) -> None:
            reports.append((adapter, exists))
            seen.set()

        watcher = FileWatcher(asyncio.get_running_loop(), changed)
        watcher.add(str(live), asked)
        try:
            await asyncio.wait_for(seen.wait(), 30)
        finally:
            watcher.stop()
        return reports

    assert asyncio.run(first_report()) == [(str(live), True)]
