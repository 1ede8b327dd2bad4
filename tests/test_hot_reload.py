"""Adapter files changed on disk reach running workers without a restart."""

import hashlib
import os

import numpy as np
import pytest

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
    rename_over(live, adapter_bytes(tmp_path, tiny_model, seed=3, broken=broken))
    err = pool.wait_for(lambda e: e["ev"] == "adapter_error" and e["model"] == "live")
    assert err["code"] == "adapter_error" and ("truncated" in err["msg"] or "shape mismatch" in err["msg"]), err
    assert greedy("live") == texts["v1"]
    # A later good write still gets through.
    rename_over(live, content["v2"])
    pool.wait_for(lambda e: e["ev"] == "adapter_loaded" and e["model"] == "live" and e["sha256"] == sha(content["v2"]))
    assert greedy("live") == texts["v2"]
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
    loaded = pool.wait_for(lambda e: e["ev"] == "adapter_loaded" and e["model"] == "live" and e["config_sha256"] == config)
    assert loaded["lora"] == str(live) and loaded["sha256"] == weights
    assert pool.close() == 0
