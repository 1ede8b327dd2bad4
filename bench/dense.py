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
import sys
from pathlib import Path


def build(out: Path, tokenizer_from: Path) -> Path:
    from harness.models import build_dense_model

    demo = json.loads((tokenizer_from / "config.json").read_text())
    shape = {"hidden_size": 768, "num_hidden_layers": 6, "intermediate_size": 2304, "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64}
    return build_dense_model(out, tokenizer_from, **shape, eos_token_id=demo.get("eos_token_id"))


if __name__ == "__main__":
    from bench.common import demo_model

    build(Path(sys.argv[1]), demo_model("tiny"))
