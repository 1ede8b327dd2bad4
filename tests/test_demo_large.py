"""The benchmark-sized demo models (4b, 8b and the hybrid shapes), built with
few layers: the real widths, heads and kernels at a fraction of the bytes."""

import json
import subprocess

import pytest

from harness.procs import build_demo_model
from harness.worker import WorkerProc


@pytest.fixture(scope="module")
def dense_8b(models_dir):
    return build_demo_model(models_dir / "8b-2-q4", "--size", "8b", "--layers", "2", "--q4")


@pytest.fixture(scope="module")
def hybrid_4b(models_dir):
    return build_demo_model(models_dir / "4b-hybrid-4-q4", "--size", "4b-hybrid", "--layers", "4", "--q4")


def safetensors_header(path):
    data = path.read_bytes()
    return json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])


def test_8b_has_qwen3_8b_attention_shape_and_demo_vocabulary(dense_8b, tiny_model):
    config = json.loads((dense_8b / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (4096, 12288, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (32, 8, 128)
    assert config["vocab_size"] == json.loads((tiny_model / "config.json").read_text())["text_config"]["vocab_size"]
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    index = json.loads((dense_8b / "model.safetensors.index.json").read_text())
    header = {}
    for shard in set(index["weight_map"].values()):
        header.update(safetensors_header(dense_8b / shard))
    assert set(index["weight_map"]) == set(header) - {"__metadata__"}
    # 4096 inputs packed eight to a uint32; one scale and bias per 64.
    assert header["model.layers.1.mlp.down_proj.weight"]["shape"] == [4096, 12288 // 8]
    assert header["model.layers.1.mlp.down_proj.scales"]["shape"] == [4096, 12288 // 64]
    assert header["model.layers.0.self_attn.k_proj.weight"]["shape"] == [1024, 4096 // 8]
    assert header["lm_head.weight"]["dtype"] == "U32"


def test_8b_loads_and_generates_text_in_a_worker(dense_8b):
    worker = WorkerProc.started(dense_8b, "--max-batch", "2")
    try:
        final = worker.generate(prompt="<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", max_tokens=6, temperature=0.0)
        assert final["gen_tokens"] >= 1
        # Every id of the demo vocabulary has text.
        assert final["text"]
    finally:
        assert worker.close() == 0


def test_hybrid_has_qwen3_5_4b_shape(hybrid_4b):
    config = json.loads((hybrid_4b / "config.json").read_text())
    text = config["text_config"]
    assert (config["model_type"], text["hidden_size"], text["num_hidden_layers"]) == ("qwen3_5", 2560, 4)
    assert (text["linear_num_key_heads"], text["linear_num_value_heads"], text["head_dim"]) == (16, 32, 256)
    index = json.loads((hybrid_4b / "model.safetensors.index.json").read_text())
    header = safetensors_header(hybrid_4b / index["weight_map"]["language_model.model.layers.0.linear_attn.in_proj_qkv.weight"])
    # Keys and queries of 16 heads, values of 32, each 128 wide; the
    # convolution is not quantized and keeps MLX's (channels, kernel, 1).
    assert header["language_model.model.layers.0.linear_attn.in_proj_qkv.scales"]["shape"] == [2 * 16 * 128 + 32 * 128, 2560 // 64]
    assert header["language_model.model.layers.0.linear_attn.conv1d.weight"]["shape"] == [8192, 4, 1]
    assert header["language_model.model.layers.0.linear_attn.A_log"]["dtype"] == "F32"
    assert "language_model.model.layers.3.self_attn.q_proj.weight" in index["weight_map"]


def test_hybrid_layers_come_in_fours(tmp_path):
    with pytest.raises(subprocess.CalledProcessError):
        build_demo_model(tmp_path / "bad", "--size", "9b-hybrid", "--layers", "2")
    assert not (tmp_path / "bad" / "config.json").exists()
