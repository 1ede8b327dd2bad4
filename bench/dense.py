"""Attention-only models for the CPU benchmarks: Qwen3's architecture (every
layer a trimmable KV cache, as Qwen3-4B/8B), seeded random weights and the
demo model's tokenizer.

- `dense`: hidden 768, 6 layers, 12 query / 4 KV heads of 64, MLP 2304,
  tied embeddings (42M parameters). Small enough that a forward pass on 2
  shared cores takes tens of milliseconds, so what a pass more or less
  costs shows through the noise; `demo-model --size 4b` is the real width
  but takes seconds a pass there.
- `head128`: one layer with one query and one KV head of 128 values, the
  head width of Qwen3-4B/8B. What a KV cache's bytes are per value (and so
  its ratios between formats) depends on the head width and the group
  size, which is 64 here as on those models; the rest of the model is as
  small as can be, so that 32k-token prefills in bf16 finish on a CPU.

    python -m bench.dense DIR [dense|head128]    (the benchmarks' `--size dense` / `--size head128` build it once)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SHAPES = {
    "dense": {"hidden_size": 768, "num_hidden_layers": 6, "intermediate_size": 2304, "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64},
    "head128": {"hidden_size": 128, "num_hidden_layers": 1, "intermediate_size": 256, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 128},
}


def build(out: Path, tokenizer_from: Path, shape: str = "dense") -> Path:
    from harness.models import build_dense_model

    demo = json.loads((tokenizer_from / "config.json").read_text())
    # head128 in bf16, as such models ship: its KV cache is then bf16 too.
    dtype = "bfloat16" if shape == "head128" else "float32"
    return build_dense_model(out, tokenizer_from, dtype, **SHAPES[shape], eos_token_id=demo.get("eos_token_id"), max_position_embeddings=40960)


if __name__ == "__main__":
    from bench.common import demo_model

    build(Path(sys.argv[1]), demo_model("tiny"), *sys.argv[2:3])
