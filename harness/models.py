"""Models the tests and benchmarks build beside the demo model: a random
attention-only Qwen3 (every layer a trimmable KV cache) with the demo
model's tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# A tiny shape: a random draft that never agrees, or a dense model for tests.
TINY_DENSE = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def build_dense_model(out: Path, tokenizer_from: Path, dtype: str = "float32", **fields) -> Path:
    """A Qwen3 of the shape in `fields` (other config fields too), seeded
    random weights stored in `dtype`, the vocabulary and tokenizer files of
    `tokenizer_from`. The config is written last: a directory with one is a
    finished model."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3

    source = json.loads((tokenizer_from / "config.json").read_text())
    config = {
        "model_type": "qwen3",
        "rms_norm_eps": 1e-6,
        "vocab_size": source.get("text_config", source)["vocab_size"],
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        **fields,
    }
    mx.random.seed(7)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), {k: v.astype(getattr(mx, dtype)) for k, v in tree_flatten(model.parameters())})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, out / name)
    (out / "config.json").write_text(json.dumps(config))
    return out
