"""Benchmark-sized demo models: the shapes of the 4B-9B models people run,
with random weights made tensor by tensor, so that an 8B model is written in
seconds to a minute and never held whole in memory.

`4b` and `8b` are Qwen3-4B and Qwen3-8B (every layer full attention, 128-dim
heads); `4b-hybrid` and `9b-hybrid` are Qwen3.5-4B and Qwen3.5-9B (three
gated-delta layers to one attention layer, 256-dim heads). The vocabulary is
the demo tokenizer's (1,024 rows, not the real 151,936 or 248,320), so every
id the model samples has text: the real models' embedding and LM head are
larger by 0.4-2.0B parameters; the layers are theirs. `layers` cuts the depth
(a 2-layer model of the 8b width runs the 8b kernels at a fraction of the
bytes).

Weights are mx.random noise (seeded; see _noise) scaled by 1/sqrt(fan-in),
plus the demo's bigram embedding and LM head (worker.demo.build), written
in MLX's layout in shards of at most SHARD_BYTES with an index, as
mlx_lm.convert writes them; `q4` quantizes each tensor as it is made (affine, group 64),
as `nn.quantize` would.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

# name: (model_type, hidden, layers, intermediate, heads, kv_heads, head_dim, tied embeddings)
LARGE = {
    "4b": ("qwen3", 2560, 36, 9728, 32, 8, 128, True),
    "8b": ("qwen3", 4096, 36, 12288, 32, 8, 128, False),
    "4b-hybrid": ("qwen3_5", 2560, 32, 9216, 16, 4, 256, True),
    "9b-hybrid": ("qwen3_5", 4096, 32, 12288, 16, 4, 256, False),
}
# Qwen3.5's gated-delta heads at 4B and 9B: key heads, value heads, key dim, value dim.
_HYBRID_LINEAR = (16, 32, 128, 128)
SHARD_BYTES = 2 * 1024**3
NOISE_ROWS = 1024
GROUP_SIZE = 64


def text_config(size: str, vocab: int, eos_id: int, layers: int | None) -> dict:
    kind, hidden, depth, inter, heads, kv_heads, head_dim, tied = LARGE[size]
    config = {
        "model_type": kind if kind == "qwen3" else "qwen3_5_text",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers or depth,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": 40960 if kind == "qwen3" else 262144,
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "eos_token_id": eos_id,
    }
    if kind == "qwen3":
        config["rope_theta"] = 1000000.0
        return config
    k_heads, v_heads, k_dim, v_dim = _HYBRID_LINEAR
    config.update(
        {
            "linear_num_key_heads": k_heads,
            "linear_num_value_heads": v_heads,
            "linear_key_head_dim": k_dim,
            "linear_value_head_dim": v_dim,
            "linear_conv_kernel_dim": 4,
            "full_attention_interval": 4,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10],
            },
        }
    )
    return config


def model_config(size: str, vocab: int, eos_id: int, layers: int | None, seed: int) -> dict:
    text = text_config(size, vocab, eos_id, layers)
    demo = {"seed": seed, "size": size, "layers": text["num_hidden_layers"]}
    if LARGE[size][0] == "qwen3":
        return {"architectures": ["Qwen3ForCausalLM"], **text, "lattice_demo": demo}
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": text["tie_word_embeddings"],
        "eos_token_id": eos_id,
        "lattice_demo": demo,
    }


def _noise(shape: tuple[int, ...], std: float):
    """Uniform noise of standard deviation `std` (lazy, bf16). Only the first
    NOISE_ROWS rows are drawn and the rest repeat them: drawing every value
    of an 8B model takes minutes on a CPU, and a matrix product's speed does
    not depend on whether its rows repeat."""
    import mlx.core as mx

    bound = std * math.sqrt(3.0)
    rows = shape[0]
    block = mx.random.uniform(-bound, bound, (min(rows, NOISE_ROWS), *shape[1:]), dtype=mx.bfloat16)
    if rows <= NOISE_ROWS:
        return block
    return mx.tile(block, (-(-rows // NOISE_ROWS),) + (1,) * (len(shape) - 1))[:rows]


def _value(name: str, shape: tuple[int, ...], embed: np.ndarray, head: np.ndarray):
    """One tensor's value in MLX's layout (lazy): the rules of
    worker.demo.build.build_weights, with noise scaled to the fan-in so that
    36 layers keep the residual stream near the embedding's scale."""
    import mlx.core as mx

    if name.endswith("embed_tokens.weight"):
        return mx.array(embed, dtype=mx.bfloat16)
    if name.endswith("lm_head.weight"):
        return mx.array(head, dtype=mx.bfloat16)
    if name.endswith("A_log"):
        return mx.log(mx.random.uniform(1.0, 16.0, shape))  # stays float32, as in Qwen3.5 checkpoints
    if name.endswith("dt_bias"):
        return mx.ones(shape, dtype=mx.bfloat16)
    if name.endswith("norm.weight"):
        # MLX's norms multiply by the weight itself (HF's Qwen3.5 stores weight - 1).
        return 1.0 + _noise(shape, 0.02)
    if name.endswith("conv1d.weight"):
        return _noise(shape, 0.2)
    return _noise(shape, 0.5 / math.sqrt(shape[-1]) if len(shape) > 1 else 0.02)


def _quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """What nn.quantize turns into 4 bits: Linear and Embedding weights
    whose rows split into whole groups (not the gated-delta conv, norms or
    per-head vectors)."""
    module = name.rsplit(".", 1)[0]
    return name.endswith(".weight") and len(shape) == 2 and shape[-1] % GROUP_SIZE == 0 and not module.endswith(("norm", "conv1d"))


def write_weights(out: Path, config: dict, embed: np.ndarray, head: np.ndarray, seed: int, q4: bool) -> int:
    """The model's tensors made one at a time and written in shards, each
    evaluated and dropped before the next is made; returns their bytes."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(config)
    # Built lazily: mlx's own initial values are never computed.
    model = model_cls(args_cls.from_dict(config))
    hidden = config.get("text_config", config)["hidden_size"]
    embed = np.pad(embed, ((0, 0), (0, hidden - embed.shape[1])))
    head = np.pad(head, ((0, 0), (0, hidden - head.shape[1])))
    # Large embeddings keep the residual stream dominated by the current token.
    embed = embed / np.sqrt((embed**2).mean(axis=1, keepdims=True) + 1e-6) * 8.0
    mx.random.seed(seed)
    files: list[Path] = []
    shard: dict = {}
    weight_map: dict[str, int] = {}
    shard_bytes = total = 0

    def save() -> None:
        files.append(out / f".shard-{len(files)}.safetensors")
        mx.eval(list(shard.values()))
        mx.save_safetensors(str(files[-1]), shard, metadata={"format": "mlx"})
        shard.clear()

    for name, param in sorted(tree_flatten(model.parameters())):
        shape = tuple(param.shape)
        value = _value(name, shape, embed, head)
        tensors = {name: value}
        if q4 and _quantizable(name, shape):
            w, scales, biases = mx.quantize(value, GROUP_SIZE, 4)
            base = name[: -len(".weight")]
            tensors = {name: w, base + ".scales": scales, base + ".biases": biases}
        size = sum(t.nbytes for t in tensors.values())
        if shard and shard_bytes + size > SHARD_BYTES:
            save()
            shard_bytes = 0
        shard.update(tensors)
        weight_map.update(dict.fromkeys(tensors, len(files)))
        shard_bytes += size
        total += size
    save()
    names = [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    for path, name in zip(files, names):
        path.rename(out / name)
    index = {"metadata": {"total_size": total}, "weight_map": {k: names[i] for k, i in sorted(weight_map.items())}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def build(out: Path, embed: np.ndarray, head: np.ndarray, eos_id: int, *, size: str, q4: bool, seed: int, layers: int | None) -> None:
    """Config and weights of a large demo model, into `out`: `embed` and
    `head` are the vocabulary's rows of the embedding and the LM head (up to
    the hidden size wide)."""
    config = model_config(size, embed.shape[0], eos_id, layers, seed)
    if q4:
        quant = {"group_size": GROUP_SIZE, "bits": 4, "mode": "affine"}
        config["quantization"] = quant
        config["quantization_config"] = quant
    write_weights(out, config, embed, head, seed, q4)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
