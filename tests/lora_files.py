"""Seeded LoRA adapters written in each on-disk format, and reference models
with the same update merged into their weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

# Module groups of a Qwen3.5 decoder layer (3 of 4 layers are linear attention).
GROUPS = {
    "attention": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
    "mlp": ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"),
    "linear_attn": ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b", "linear_attn.in_proj_a", "linear_attn.out_proj"),
}


def targets_of(model_dir: Path) -> dict[str, tuple[int, int]]:
    """`layers.N.<module>` -> (d_in, d_out) of a demo model, from its config."""
    tc = json.loads((model_dir / "config.json").read_text())["text_config"]
    h, inter = tc["hidden_size"], tc["intermediate_size"]
    q = tc["num_attention_heads"] * tc["head_dim"]
    kv = tc["num_key_value_heads"] * tc["head_dim"]
    lk = tc["linear_num_key_heads"] * tc["linear_key_head_dim"]
    lv = tc["linear_num_value_heads"] * tc["linear_value_head_dim"]
    nv = tc["linear_num_value_heads"]
    shapes = {
        "self_attn.q_proj": (h, 2 * q),  # queries and their output gate
        "self_attn.k_proj": (h, kv),
        "self_attn.v_proj": (h, kv),
        "self_attn.o_proj": (q, h),
        "mlp.gate_proj": (h, inter),
        "mlp.up_proj": (h, inter),
        "mlp.down_proj": (inter, h),
        "linear_attn.in_proj_qkv": (h, 2 * lk + lv),
        "linear_attn.in_proj_z": (h, lv),
        "linear_attn.in_proj_b": (h, nv),
        "linear_attn.in_proj_a": (h, nv),
        "linear_attn.out_proj": (lv, h),
    }
    interval = tc["full_attention_interval"]
    out = {}
    for n in range(tc["num_hidden_layers"]):
        full = (n + 1) % interval == 0
        for rel, dims in shapes.items():
            if rel.startswith("self_attn.") == full or rel.startswith("mlp."):
                out[f"layers.{n}.{rel}"] = dims
    return out


def lora_pairs(targets, groups=tuple(GROUPS), rank: int = 4, seed: int = 0, strength: float = 1.0):
    """PEFT-oriented factors: module -> (A (r, d_in), B (d_out, r)), float32.

    Sized so that scale * B @ A is about as large as the demo weights: the
    adapter must visibly change the output, not drown it.
    """
    rng = np.random.default_rng(seed)
    rels = {rel for g in groups for rel in GROUPS[g]}
    pairs = {}
    for module, (d_in, d_out) in sorted(targets.items()):
        if module.split(".", 2)[2] in rels:
            a = rng.normal(0.0, 1.0 / np.sqrt(d_in), size=(rank, d_in)).astype(np.float32)
            b = rng.normal(0.0, 0.03 * strength, size=(d_out, rank)).astype(np.float32)
            pairs[module] = (a, b)
    return pairs


def deltas(pairs, scale) -> dict[str, np.ndarray]:
    """The merged update of each module, W + delta, in W's (d_out, d_in) layout."""
    scale_of = scale if callable(scale) else (lambda module: scale)
    return {m: scale_of(m) * (b.astype(np.float64) @ a.astype(np.float64)) for m, (a, b) in pairs.items()}


def peft_key(module: str, part: str, language_model: bool = True) -> str:
    root = "base_model.model.model.language_model." if language_model else "base_model.model.model."
    return f"{root}{module}.lora_{part}.weight"


def write_peft(
    out: Path, pairs, *, r: int, alpha: float, config: dict | None = None, language_model: bool = True, with_config: bool = True, metadata=None
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for module, (a, b) in pairs.items():
        tensors[peft_key(module, "A", language_model)] = a
        tensors[peft_key(module, "B", language_model)] = b
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata=metadata)
    if with_config:
        cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": ["q_proj"], "bias": "none", "use_rslora": False}
        cfg.update(config or {})
        (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def write_mlx(path: Path, pairs, *, alpha: float | None) -> Path:
    """chat_metal's single file: A (d_in, r), B (r, d_out), alpha in metadata."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for module, (a, b) in pairs.items():
        tensors[f"model.{module}.lora_a"] = np.ascontiguousarray(a.T)
        tensors[f"model.{module}.lora_b"] = np.ascontiguousarray(b.T)
    save_file(tensors, str(path), metadata=None if alpha is None else {"alpha": str(alpha)})
    return path


def write_mlx_lm(out: Path, pairs, *, rank: int, scale: float) -> Path:
    """An `mlx_lm.lora` output dir: model-root-relative names, absolute scale."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for module, (a, b) in pairs.items():
        tensors[f"language_model.model.{module}.lora_a"] = np.ascontiguousarray(a.T)
        tensors[f"language_model.model.{module}.lora_b"] = np.ascontiguousarray(b.T)
    save_file(tensors, str(out / "adapters.safetensors"))
    config = {"fine_tune_type": "lora", "num_layers": -1, "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0}}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def merge_into(model, merged: dict[str, np.ndarray]) -> None:
    """Adds each delta to the model's own weight, computed in float64."""
    import mlx.core as mx

    layers = model.layers
    for module, delta in merged.items():
        _, n, rel = module.split(".", 2)
        layer = layers[int(n)]
        for part in rel.split("."):
            layer = getattr(layer, part)
        w = np.array(layer.weight.astype(mx.float32), dtype=np.float64)
        layer.weight = mx.array((w + delta).astype(np.float32)).astype(layer.weight.dtype)
    mx.eval(model.parameters())


def write_merged_model(base_dir: Path, out: Path, merged: dict[str, np.ndarray]) -> Path:
    """A model dir whose weights are the base's with the deltas merged in."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from worker.runtime.loader import load

    loaded = load(base_dir)
    merge_into(loaded.model, merged)
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(loaded.model.parameters())), metadata={"format": "mlx"})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base_dir / name, out / name)
    return out


# Each broken adapter, with a phrase its error must contain and the key (or
# file) it must name.
BAD_KINDS = ("truncated", "wrong_shape", "nan", "unknown_key", "a_without_b")


def write_bad(kind: str, out: Path, pairs, *, r: int = 4, alpha: float = 8) -> tuple[Path, str, str]:
    """A PEFT adapter dir broken in one way: (path, phrase, offending name)."""
    pairs = {m: (a.copy(), b.copy()) for m, (a, b) in pairs.items()}
    first = sorted(pairs)[0]
    extra = {}
    if kind == "wrong_shape":
        a, b = pairs[first]
        pairs[first] = (np.concatenate([a, a[:, :1]], axis=1), b)
        phrase, name = "shape mismatch", peft_key(first, "A")
    elif kind == "nan":
        pairs[first][1][0, 0] = np.nan
        phrase, name = "non-finite", peft_key(first, "B")
    elif kind == "unknown_key":
        name = "base_model.model.model.language_model.layers.0.mlp.fused_proj.lora_A.weight"
        extra[name] = pairs[first][0]
        phrase = "unmapped keys"
    elif kind in ("truncated", "a_without_b"):
        phrase, name = ("truncated", "adapter_model.safetensors") if kind == "truncated" else ("A without B", peft_key(first, "A"))
    else:
        raise ValueError(kind)
    write_peft(out, pairs, r=r, alpha=alpha)
    weights = out / "adapter_model.safetensors"
    if extra or kind == "a_without_b":
        from safetensors.numpy import load_file

        tensors = load_file(str(weights))
        tensors.update(extra)
        if kind == "a_without_b":
            del tensors[peft_key(first, "B")]
        save_file(tensors, str(weights))
    if kind == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    return out, phrase, name


def use_only(slots, weights) -> None:
    """Makes `weights` (None: no adapter) what every row of the next
    forwards runs with, in one slot, as a worker with one adapter does."""
    slots.update(add={} if weights is None else {0: weights}, drop=[0])
    slots.route([None if weights is None else 0])
