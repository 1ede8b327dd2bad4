"""Models where users keep them: Hugging Face hub ids found in the local HF
cache (laid out here as huggingface_hub lays it out: blobs, snapshots of
symlinks, refs/main, with real demo model files), `lattice-pool list`, and
`pull` without a network (the tests never download anything)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from harness.cli import CHAT, cli, events

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache_with(hub: Path, repo_id: str, model_dir: Path, commit: str = COMMIT) -> Path:
    """`repo_id` in a hub cache at `hub`: each file a blob named by its
    hash, linked from snapshots/<commit>/, which refs/main names."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for f in sorted(model_dir.iterdir()):
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, tiny_model, tiny_q4_model) -> Path:
    home = tmp_path_factory.mktemp("hf")
    hub_cache_with(home / "hub", "org/tiny", tiny_model)
    hub_cache_with(home / "hub", "mlx-community/tiny-4bit", tiny_q4_model)
    # Not a model lattice-pool can run: no safetensors weights.
    other = home / "plain"
    other.mkdir()
    (other / "config.json").write_text("{}")
    hub_cache_with(home / "hub", "org/not-a-model", other)
    return home


def offline(hf_home: Path, **extra: str) -> dict[str, str]:
    return {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", **extra}


def test_hub_ids_in_the_hf_cache_resolve_after_names_and_the_model_cache(hf_home, tiny_model, spawn_pool, tmp_path):
    snapshot = hf_home / "hub" / "models--org--tiny" / "snapshots" / COMMIT
    out = cli("run", "--model", "org/tiny", "--json", "--prompt", CHAT, "--max-tokens", "3", env=offline(hf_home))
    assert out.returncode == 0, out.stderr
    ready = next(e for e in events(out.stdout) if e["ev"] == "ready")
    assert ready["model"] == "org/tiny" and ready["format"] == "bf16"

    # Through HF_HUB_CACHE too, and by request: the pool resolves `model` per line.
    env = {"HF_HUB_CACHE": str(hf_home / "hub"), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "elsewhere")}
    pool = spawn_pool("--model-dir", str(tiny_model), env=env)
    pool.send({"id": 1, "model": "mlx-community/tiny-4bit", "prompt": CHAT, "max_tokens": 2})
    assert pool.terminal(1)["gen_tokens"] == 2
    assert pool.wait_ev("ready", model="mlx-community/tiny-4bit")["format"] == "q4"
    pool.send({"id": 2, "model": "org/absent", "prompt": CHAT})
    missing = pool.terminal(2)
    assert missing["code"] == "unknown_model" and "lattice-pool pull" in missing["msg"]
    pool.send({"op": "status"})
    assert {r["model"] for r in pool.wait_ev("status")["models"]} == {"tiny", "mlx-community/tiny-4bit"}
    assert pool.close() == 0
    assert snapshot.is_dir()


def test_list_shows_the_model_cache_and_the_hf_cache(hf_home, models_dir, tiny_model):
    out = cli("list", env=offline(hf_home, LATTICE_MODEL_CACHE=str(models_dir)))
    assert out.returncode == 0, out.stderr
    header, *lines = out.stdout.decode().splitlines()
    assert header.split() == ["NAME", "FORMAT", "SIZE", "WHERE"]
    rows = {line.split()[0]: line.split() for line in lines}
    assert rows["tiny"][1] == "bf16" and rows["tiny"][-1] == str(tiny_model)
    assert rows["org/tiny"][1] == "bf16" and rows["mlx-community/tiny-4bit"][1] == "q4"
    assert rows["org/tiny"][-1] == str(hf_home / "hub" / "models--org--tiny" / "snapshots" / COMMIT)
    assert "org/not-a-model" not in rows

    as_json = json.loads(cli("list", "--json", env=offline(hf_home, LATTICE_MODEL_CACHE=str(models_dir))).stdout)
    listed = {m["name"]: m for m in as_json}
    size = sum(f.stat().st_size for f in tiny_model.iterdir())
    assert listed["tiny"]["size_bytes"] == listed["org/tiny"]["size_bytes"] == size


def test_pull_without_a_network_says_why_in_one_line(hf_home, tmp_path):
    empty = tmp_path / "hf-empty"
    # Offline by setting: the clear reason, the cache it looked in.
    out = cli("pull", "org/absent", env=offline(empty))
    assert out.returncode == 1 and out.stdout == b""
    assert out.stderr.decode().count("\n") == 1, out.stderr
    assert b"cannot download org/absent: offline (HF_HUB_OFFLINE is set)" in out.stderr and str(empty).encode() in out.stderr
    # No route to the Hub: an endpoint on loopback that nothing listens on.
    out = cli("pull", "org/absent", env={"HF_HOME": str(empty), "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert out.returncode == 1 and out.stderr.decode().count("\n") == 1, out.stderr
    assert b"cannot reach http://127.0.0.1:9" in out.stderr
    # A model already in the cache is there, offline or not.
    out = cli("pull", "org/tiny", env=offline(hf_home))
    assert out.returncode == 0, out.stderr
    assert b"org/tiny (bf16) is in " in out.stdout and b"lattice-pool chat --model org/tiny" in out.stdout
    bad = cli("pull", "not a repo id", env=offline(hf_home))
    assert bad.returncode == 1 and b"not a Hugging Face model id" in bad.stderr
