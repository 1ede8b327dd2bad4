import hashlib
import json

from harness.procs import build_demo_model


def digest(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_same_seed_same_bytes_other_seed_other_weights(tiny_model, second_model, tmp_path):
    again = build_demo_model(tmp_path / "again")
    assert digest(again) == digest(tiny_model)
    other = digest(second_model)
    assert other["model.safetensors"] != digest(tiny_model)["model.safetensors"]
    assert other["tokenizer.json"] == digest(tiny_model)["tokenizer.json"]


def test_layout_looks_like_a_hugging_face_qwen3_5(tiny_model):
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["model_type"] == "qwen3_5"
    assert config["text_config"]["num_hidden_layers"] == 4
    tok_config = json.loads((tiny_model / "tokenizer_config.json").read_text())
    specials = {v["content"] for v in tok_config["added_tokens_decoder"].values()}
    assert {"<|im_start|>", "<|im_end|>", "<think>", "</think>"} <= specials
    assert tok_config["eos_token"] == "<|im_end|>"
    header_len = int.from_bytes((tiny_model / "model.safetensors").read_bytes()[:8], "little")
    header = json.loads((tiny_model / "model.safetensors").read_bytes()[8 : 8 + header_len])
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in header
    assert header["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"]["dtype"] == "BF16"


def test_q4_is_mlx_quantized(tiny_q4_model):
    config = json.loads((tiny_q4_model / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    data = (tiny_q4_model / "model.safetensors").read_bytes()
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    assert any(k.endswith(".scales") for k in header)
