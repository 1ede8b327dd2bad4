"""`lattice-pool demo-model DIR`: a tiny, real Qwen3.5 model built locally.

The directory looks like a Hugging Face download (config.json with a
`text_config`, HF tensor names, `model.safetensors`, `tokenizer.json`,
`tokenizer_config.json` with a ChatML template), so the worker loads it
through the same path as a real checkpoint. `--q4` writes MLX's 4-bit form
instead, as `mlx_lm.convert -q` would.

The tokenizer is a byte-level BPE trained on the corpus shipped in
worker/data. The weights are seeded noise, except the embedding and the LM
head, which hold a low-rank factorisation of the corpus' bigram log-probs:
the residual stream stays close to the current token's embedding, so the
model writes corpus-flavoured text instead of uniform noise. Everything is
deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable
from importlib import resources
from pathlib import Path

import numpy as np

from worker.demo.large import LARGE

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

# Qwen's ChatML template, reduced to roles and content: earlier turns' reasoning
# is dropped, as Qwen3 templates do, and the generation prompt opens a think
# block. With `tools` it renders them as Qwen3's does (a system turn listing
# them, calls as <tool_call> JSON, results as <tool_response> in a user
# turn), so tool calling runs through a real template end to end.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set call = call['function'] if call['function'] else call %}"
    "{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\\\"name\\\": \\\"' + call['name'] + '\\\", \\\"arguments\\\": ' }}"
    "{{- call['arguments'] if call['arguments'] is string else call['arguments'] | tojson }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)

SIZES = {
    # name: (hidden, layers, intermediate, heads, kv_heads, head_dim)
    "tiny": (128, 4, 384, 4, 2, 32),
    "small": (256, 8, 768, 8, 2, 32),
    "0.8b": (1024, 24, 3584, 8, 2, 256),
}

# Benchmark sizes take the rest of their shape from the real model too:
# linear-attention heads (key heads, value heads, key dim, value dim) and the
# padded vocabulary with tied embeddings. Rows past the tokenizer are zero, so
# they never win over a real token.
BENCH_SHAPES = {
    "0.8b": {"linear": (16, 16, 128, 128), "vocab_size": 248320, "tie_word_embeddings": True},
}
_DEMO_LINEAR = (2, 4, 32, 32)


def corpus_text() -> str:
    return resources.files("worker").joinpath("data/demo_corpus.txt").read_text("utf-8")


def train_tokenizer(vocab_size: int, lines: Iterable[str] | None = None):
    """A byte-level BPE with the demo's special tokens, trained on the demo
    corpus or on `lines`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if lines is None:
        lines = corpus_text().splitlines(keepends=True)
    tok.train_from_iterator(lines, trainer=trainer)
    return tok


def tokenizer_vocab(tok) -> int:
    return -(-tok.get_vocab_size() // 64) * 64


def text_config(size: str, vocab_size: int, eos_id: int) -> dict:
    hidden, layers, inter, heads, kv_heads, head_dim = SIZES[size]
    bench = BENCH_SHAPES.get(size, {})
    k_heads, v_heads, k_dim, v_dim = bench.get("linear", _DEMO_LINEAR)
    return {
        "model_type": "qwen3_5_text",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "linear_num_key_heads": k_heads,
        "linear_num_value_heads": v_heads,
        "linear_key_head_dim": k_dim,
        "linear_value_head_dim": v_dim,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "rms_norm_eps": 1e-6,
        "vocab_size": bench.get("vocab_size", vocab_size),
        "max_position_embeddings": 32768,
        "tie_word_embeddings": bench.get("tie_word_embeddings", False),
        "attention_bias": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
        },
        "eos_token_id": eos_id,
    }


def bigram_factors(tok, vocab: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Embedding and LM-head rows whose product approximates log P(next | token)."""
    counts = np.zeros((vocab, vocab), dtype=np.float64)
    for line in corpus_text().splitlines(keepends=True):
        ids = tok.encode(line).ids
        np.add.at(counts, (ids[:-1], ids[1:]), 1.0)
    logp = np.log((counts + 0.05) / (counts + 0.05).sum(axis=1, keepdims=True))
    logp -= logp.mean(axis=1, keepdims=True)
    u, s, vt = np.linalg.svd(logp)
    root = np.sqrt(s[:rank])
    return u[:, :rank] * root, vt[:rank].T * root


def _padded_factors(tok, vocab: int, padded: int, hidden: int) -> tuple[np.ndarray, np.ndarray]:
    embed, head = bigram_factors(tok, vocab, min(vocab, hidden))
    pad = ((0, padded - vocab), (0, hidden - embed.shape[1]))
    return np.pad(embed, pad), np.pad(head, pad)


def hf_name(mlx_name: str) -> str:
    if mlx_name.startswith("language_model.model."):
        return "model.language_model." + mlx_name[len("language_model.model.") :]
    return mlx_name[len("language_model.") :]


# Norms that HF stores as (weight - 1); mlx-lm's sanitize adds the 1 back.
_OFFSET_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "norm.weight", ".q_norm.weight", ".k_norm.weight")


def build_weights(config: dict, tok, seed: int) -> dict[str, np.ndarray]:
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_5

    tc = config["text_config"]
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config))
    rng = np.random.default_rng(seed)
    vocab = tokenizer_vocab(tok)
    if tc["vocab_size"] == vocab:
        embed, head = bigram_factors(tok, vocab, tc["hidden_size"])
    else:
        embed, head = _padded_factors(tok, vocab, tc["vocab_size"], tc["hidden_size"])
    # Large embeddings keep the residual stream dominated by the current token.
    embed = embed / np.sqrt((embed**2).mean(axis=1, keepdims=True) + 1e-6) * 8.0
    out: dict[str, np.ndarray] = {}
    for name, param in sorted(tree_flatten(model.parameters())):
        shape = tuple(param.shape)
        hf = hf_name(name)
        if name.endswith("embed_tokens.weight"):
            value = embed
        elif name.endswith("lm_head.weight"):
            value = head
        elif name.endswith("A_log"):
            value = np.log(rng.uniform(1.0, 16.0, size=shape))
        elif name.endswith("dt_bias"):
            value = np.ones(shape)
        elif name.endswith(_OFFSET_NORMS) and not name.endswith("linear_attn.norm.weight"):
            value = rng.normal(0.0, 0.02, size=shape)
        elif name.endswith("linear_attn.norm.weight"):
            value = 1.0 + rng.normal(0.0, 0.02, size=shape)
        elif name.endswith("conv1d.weight"):
            # MLX keeps (C, K, 1); the HF checkpoint layout is (C, 1, K).
            value = rng.normal(0.0, 0.2, size=shape).transpose(0, 2, 1)
        else:
            value = rng.normal(0.0, 0.02, size=shape)
        out[hf] = value.astype(np.float32)
    return out


def save_safetensors(path: Path, arrays: dict[str, np.ndarray]) -> None:
    import mlx.core as mx

    tensors = {}
    for name, value in arrays.items():
        arr = mx.array(value)
        # A_log stays fp32 in Qwen3.5 checkpoints; everything else is bf16.
        tensors[name] = arr if name.endswith("A_log") else arr.astype(mx.bfloat16)
    mx.save_safetensors(str(path), tensors, metadata={"format": "pt"})


# How much of the model's own hidden state the demo's MTP head mixes in:
# enough that the head reads it, little enough that it still agrees with
# the model (the next token's embedding carries the demo's bigram guess).
MTP_HIDDEN_MIX = 0.01


def mtp_weights(layer: dict, final_norm, hidden: int, hf_norms: bool) -> dict:
    """`mtp.*` weights of an MTP head that agrees with the demo model often:
    its decoder layer is the model's own full-attention layer (`layer`, by
    names inside the layer), fed the next token's embedding at the scale the
    model's embedding has (RMS 8) plus a little of the model's hidden state;
    its final norm is the model's. `hf_norms`: norm weights stored as
    weight - 1, as in a Hugging Face Qwen3.5 checkpoint."""
    import mlx.core as mx

    offset = 1.0 if hf_norms else 0.0
    eye = mx.eye(hidden)
    out = {f"mtp.layers.0.{k}": v for k, v in layer.items()}
    out["mtp.fc.weight"] = mx.concatenate([eye, MTP_HIDDEN_MIX * eye], axis=1)
    out["mtp.pre_fc_norm_embedding.weight"] = mx.full((hidden,), 8.0 - offset)
    out["mtp.pre_fc_norm_hidden.weight"] = mx.full((hidden,), 1.0 - offset)
    out["mtp.norm.weight"] = final_norm
    return out


def add_mtp(out: Path, inside: bool = False) -> None:
    """Adds an MTP head (mtp_weights) to the demo model in `out`: into its
    own weights file (`inside`, as a Hugging Face checkpoint carries it; a
    model in one file), or as `mtp.safetensors` beside its files."""
    import mlx.core as mx

    config = json.loads((out / "config.json").read_text())
    text = config.get("text_config", config)
    files = sorted(out.glob("model*.safetensors"))
    weights: dict = {}
    formats = set()
    for file in files:
        arrays, metadata = mx.load(str(file), return_metadata=True)  # lazy: only what is kept is read
        weights.update(arrays)
        formats.add(metadata.get("format"))
    base = next(b for b in ("model.language_model.", "language_model.model.", "model.") if b + "norm.weight" in weights)
    hybrid = "full_attention_interval" in text
    prefix = f"{base}layers.{text['full_attention_interval'] - 1 if hybrid else 0}."
    layer = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
    norm = weights[base + "norm.weight"]
    hf_norms = hybrid and formats != {"mlx"}
    head = mtp_weights(layer, norm, text["hidden_size"], hf_norms)
    head = {k: v.astype(norm.dtype) if k.startswith(("mtp.fc", "mtp.pre_fc")) else v for k, v in head.items()}
    metadata = {"format": "mlx" if formats == {"mlx"} else "pt"}
    if inside:
        (file,) = files
        mx.eval(list(weights.values()))  # read whole before the file is written over
        mx.save_safetensors(str(file), weights | head, metadata=metadata)
    else:
        mx.save_safetensors(str(out / "mtp.safetensors"), head, metadata=metadata)


def write_tokenizer_files(out: Path, tok, eos: str) -> None:
    tok.save(str(out / "tokenizer.json"))
    added = {}
    for token in SPECIAL_TOKENS:
        added[str(tok.token_to_id(token))] = {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            # Qwen marks think tags as ordinary added tokens, so they are shown.
            "special": token not in ("<think>", "</think>"),
        }
    config = {
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": eos,
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 32768,
        "tokenizer_class": "Qwen2Tokenizer",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def build(out: Path, *, q4: bool = False, seed: int = 0, size: str = "tiny", layers: int | None = None, mtp: bool = False) -> Path:
    tok = train_tokenizer(vocab_size=1024)
    eos = "<|im_end|>"
    if size in LARGE:
        return _build_large(out, tok, eos, q4=q4, seed=seed, size=size, layers=layers, mtp=mtp)
    if layers is not None:
        raise ValueError(f"layers applies to the sizes {', '.join(LARGE)}")
    eos_id = tok.token_to_id(eos)
    text = text_config(size, tokenizer_vocab(tok), eos_id)
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": text["tie_word_embeddings"],
        "eos_token_id": eos_id,
        "lattice_demo": {"seed": seed, "size": size},
    }
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".demo-", dir=out.parent))
    try:
        if q4:
            bf16 = staging / "bf16"
            build(bf16, seed=seed, size=size, mtp=mtp)
            quantize_dir(bf16, staging / "model")
        else:
            model_dir = staging / "model"
            model_dir.mkdir()
            save_safetensors(model_dir / "model.safetensors", build_weights(config, tok, seed))
            (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            if mtp:
                add_mtp(model_dir, inside=True)
            write_tokenizer_files(model_dir, tok, eos)
        for item in (staging / "model").iterdir():
            os.replace(item, out / item.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _build_large(out: Path, tok, eos: str, **kwargs) -> Path:
    """A benchmark-sized model (worker.demo.large), written beside `out`
    and moved in when whole, as build() does."""
    from worker.demo import large as demo_large

    mtp = kwargs.pop("mtp")
    vocab, hidden = tokenizer_vocab(tok), LARGE[kwargs["size"]][1]
    embed, head = bigram_factors(tok, vocab, min(vocab, hidden))
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".demo-", dir=out.parent))
    try:
        demo_large.build(staging, embed, head, tok.token_to_id(eos), **kwargs)
        if mtp:
            add_mtp(staging)
        write_tokenizer_files(staging, tok, eos)
        for item in staging.iterdir():
            os.replace(item, out / item.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def quantize_dir(src: Path, dst: Path, bits: int = 4, group_size: int = 64) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    model, config = load_model(src)
    nn.quantize(model, group_size=group_size, bits=bits)
    dst.mkdir(parents=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = json.loads((src / "config.json").read_text())
    quant = {"group_size": group_size, "bits": bits, "mode": "affine"}
    config["quantization"] = quant
    config["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    # mlx-lm's loader drops an MTP head: it is kept as it was, in a file of its own.
    head = {k: v for k, v in mx.load(str(src / "model.safetensors")).items() if k.startswith("mtp.")}
    if head:
        mx.save_safetensors(str(dst / "mtp.safetensors"), head, metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lattice-pool demo-model", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="directory to write the model into")
    parser.add_argument("--q4", action="store_true", help="write MLX 4-bit weights")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument(
        "--size",
        choices=sorted(SIZES) + list(LARGE),
        default="tiny",
        help="model size (default tiny); 4b, 8b: Qwen3-4B/8B's shape, 4b-hybrid, 9b-hybrid: Qwen3.5-4B/9B's, with the demo vocabulary",
    )
    parser.add_argument("--layers", type=int, help="layers of a 4b/8b/hybrid model (default: the real model's)")
    parser.add_argument(
        "--mtp",
        action="store_true",
        help='also write an MTP head (mtp.* weights, as Qwen3.5 checkpoints carry) that agrees with the model often, for draft = "mtp"',
    )
    args = parser.parse_args(argv)
    if args.layers is not None and (args.size not in LARGE or args.layers < 1):
        parser.error("--layers takes a positive number, with --size " + "/".join(LARGE))
    if args.layers is not None and LARGE[args.size][0] == "qwen3_5" and args.layers % 4:
        parser.error("a hybrid model's layers come in fours (three gated-delta layers, then one attention layer)")
    out = build(args.dir.expanduser().resolve(), q4=args.q4, seed=args.seed, size=args.size, layers=args.layers, mtp=args.mtp)
    print(f"demo model written to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
