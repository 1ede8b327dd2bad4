"""An attention-only model for the CPU benchmarks: Qwen3's architecture
(every layer a trimmable KV cache, as Qwen3-4B/8B), hidden 768, 6 layers,
12 query / 4 KV heads of 64, MLP 2304, tied embeddings, seeded random
weights (42M parameters) and the demo model's tokenizer. Small enough that
a forward pass on 2 shared cores takes tens of milliseconds, so what a pass
more or less costs shows through the noise; `demo-model --size 4b` is the
real width but takes seconds a pass there.

    python -m bench.dense DIR    (the benchmarks' `--size dense` builds it once)
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def build(out: Path, tokenizer_from: Path) -> Path:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3

    demo = json.loads((tokenizer_from / "config.json").read_text())
    config = {
        "model_type": "qwen3",
        "hidden_size": 768,
        "num_hidden_layers": 6,
        "intermediate_size": 2304,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "vocab_size": demo["text_config"]["vocab_size"],
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "eos_token_id": demo.get("eos_token_id"),
    }
    mx.random.seed(7)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, out / name)
    # Last: a directory with a config is a finished model (bench.common.demo_model).
    (out / "config.json").write_text(json.dumps(config))
    return out


if __name__ == "__main__":
    from bench.common import demo_model

    build(Path(sys.argv[1]), demo_model("tiny"))
