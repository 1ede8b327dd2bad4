"""LoRA in process: every adapter format against weights merged by hand, on
real demo models (bf16 and 4-bit), and every way an adapter can be broken."""

import hashlib
import json
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.lora_files import (
    BAD_KINDS,
    GROUPS,
    deltas,
    lora_pairs,
    merge_into,
    peft_key,
    targets_of,
    use_only,
    write_bad,
    write_mlx,
    write_mlx_lm,
    write_peft,
)
from worker.lora.formats import AdapterError, read_adapter
from worker.lora.layers import AdaptedLinear, LoRASlots
from worker.runtime.loader import load

PROMPT = mx.array([[1, 5, 17, 200, 33, 41, 99, 7, 8, 300, 12, 64, 2]])
RANK, ALPHA = 4, 8.0  # every format below is written to scale by ALPHA / RANK


def as_np(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32))


def write_format(fmt: str, tmp_path, pairs):
    """The same update in each format; returns the path a user would pass."""
    if fmt == "peft":
        return write_peft(tmp_path / "peft", pairs, r=RANK, alpha=ALPHA)
    if fmt == "mlx":
        return write_mlx(tmp_path / "chat_metal.safetensors", pairs, alpha=ALPHA)
    return write_mlx_lm(tmp_path / "mlx_lm", pairs, rank=RANK, scale=ALPHA / RANK)


def model_at(path, dtype=None):
    model = load(path).model
    if dtype is not None:
        model.set_dtype(dtype)
    return model


def test_targets_are_every_linear_of_every_decoder_layer(tiny_model):
    slots = LoRASlots(model_at(tiny_model))
    assert dict(slots.targets) == targets_of(tiny_model)
    kinds = {key.split(".", 2)[2].split(".")[0] for key in slots.targets}
    assert kinds == {"self_attn", "linear_attn", "mlp"}


@pytest.mark.parametrize("group", sorted(GROUPS))
@pytest.mark.parametrize("fmt", ["peft", "mlx", "mlx-lm"])
def test_unfused_adapter_equals_merged_weights(tmp_path, tiny_model, fmt, group):
    """fp32 end to end, so any orientation or scale slip shows far above rounding."""
    targets = targets_of(tiny_model)
    # The demo's linear-attention path contributes little to its logits.
    pairs = lora_pairs(targets, groups=(group,), rank=RANK, seed=3, strength=10.0 if group == "linear_attn" else 1.0)
    model = model_at(tiny_model, mx.float32)
    base = as_np(model(PROMPT))
    slots = LoRASlots(model)
    weights = read_adapter(write_format(fmt, tmp_path, pairs), slots.targets)
    assert weights.format == fmt and set(weights.pairs) == set(pairs)
    use_only(slots, weights)
    adapted = as_np(model(PROMPT))

    reference = model_at(tiny_model, mx.float32)
    merge_into(reference, deltas(pairs, ALPHA / RANK))
    merged = as_np(reference(PROMPT))

    effect = np.abs(merged - base).max()
    assert effect > 0.5, f"the {group} adapter should change the logits"
    assert np.abs(adapted - merged).max() < 1e-3 * effect
    assert (adapted.argmax(-1) == merged.argmax(-1)).all()


@pytest.mark.parametrize("fmt", ["peft", "mlx", "mlx-lm"])
def test_bf16_adapter_is_within_rounding_of_merged_bf16_weights(tmp_path, tiny_model, fmt):
    targets = targets_of(tiny_model)
    pairs = lora_pairs(targets, rank=RANK, seed=4)
    model = model_at(tiny_model)
    base = as_np(model(PROMPT))
    slots = LoRASlots(model)
    use_only(slots, read_adapter(write_format(fmt, tmp_path, pairs), slots.targets))
    adapted = as_np(model(PROMPT))
    reference = model_at(tiny_model)
    merge_into(reference, deltas(pairs, ALPHA / RANK))
    merged = as_np(reference(PROMPT))
    effect = np.abs(merged - base).max()
    assert effect > 2.0
    # bf16 keeps 8 bits of mantissa: a few ulps at the logits' magnitude.
    assert np.abs(adapted - merged).max() < 0.05 * np.abs(merged).max()
    assert (adapted.argmax(-1) == merged.argmax(-1)).mean() >= 0.9


def test_quantized_base_is_used_as_is_and_matches_dequantized_merge(tmp_path, tiny_q4_model):
    targets = targets_of(tiny_q4_model)
    pairs = lora_pairs(targets, rank=RANK, seed=5)
    model = model_at(tiny_q4_model, mx.float32)
    slots = LoRASlots(model)
    q_proj = model.layers[3].self_attn.q_proj
    assert isinstance(q_proj, nn.QuantizedLinear)
    packed = np.array(q_proj.weight)
    base = as_np(model(PROMPT))
    use_only(slots, read_adapter(write_peft(tmp_path / "a", pairs, r=RANK, alpha=ALPHA), slots.targets))
    adapted = as_np(model(PROMPT))
    wrapper = model.layers[3].self_attn.q_proj
    assert isinstance(wrapper, AdaptedLinear) and wrapper.base is q_proj
    assert np.array_equal(np.array(q_proj.weight), packed), "the 4-bit base must not be touched"

    # Reference: every targeted layer replaced by its dequantized weight plus the update.
    reference = model_at(tiny_q4_model, mx.float32)
    merged = deltas(pairs, ALPHA / RANK)
    for module, delta in merged.items():
        _, n, rel = module.split(".", 2)
        parent_path, leaf = rel.rsplit(".", 1)
        parent = reference.layers[int(n)]
        for part in parent_path.split("."):
            parent = getattr(parent, part)
        q = getattr(parent, leaf)
        w = np.array(mx.dequantize(q.weight, q.scales, q.biases, q.group_size, q.bits), dtype=np.float64)
        linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight = mx.array((w + delta).astype(np.float32))
        setattr(parent, leaf, linear)
    expected = as_np(reference(PROMPT))
    effect = np.abs(expected - base).max()
    assert effect > 0.5
    assert np.abs(adapted - expected).max() < 1e-3 * effect


def test_clear_restores_the_base_exactly_and_swaps_reproduce(tmp_path, tiny_model):
    targets = targets_of(tiny_model)
    model = model_at(tiny_model)
    # A and B take the layers' dtype: float32 on CPU (worker.runtime.cpu_backend).
    itemsize = model.layers[0].mlp.down_proj.weight.dtype.size
    slots = LoRASlots(model)
    base = as_np(model(PROMPT))
    one = read_adapter(write_peft(tmp_path / "one", lora_pairs(targets, seed=6), r=RANK, alpha=ALPHA), slots.targets)
    two = read_adapter(write_peft(tmp_path / "two", lora_pairs(targets, groups=("mlp",), rank=8, seed=7), r=8, alpha=16), slots.targets)
    use_only(slots, one)
    first = as_np(model(PROMPT))
    bytes_one = slots.nbytes
    assert bytes_one == sum(itemsize * RANK * (d_in + d_out) for d_in, d_out in targets.values())
    use_only(slots, two)
    second = as_np(model(PROMPT))
    use_only(slots, one)
    assert np.array_equal(as_np(model(PROMPT)), first)
    assert not np.array_equal(first, second) and not np.array_equal(second, base)
    use_only(slots, None)
    assert np.array_equal(as_np(model(PROMPT)), base)
    assert slots.nbytes == 0


def scale_of(weights, pairs, module) -> float:
    """The multiplier folded into B, recovered from what the reader produced."""
    a, b = pairs[module]
    got_a, got_b = weights.pairs[module]
    np.testing.assert_array_equal(got_a, a.T)
    return float((got_b * b.T).sum() / (b.T * b.T).sum())


def test_peft_scaling_rules(tmp_path, tiny_model):
    targets = targets_of(tiny_model)
    pairs = lora_pairs(targets, groups=("attention", "mlp"), rank=RANK, seed=8)
    q, down = "layers.3.self_attn.q_proj", "layers.0.mlp.down_proj"

    plain = read_adapter(write_peft(tmp_path / "plain", pairs, r=RANK, alpha=12), targets)
    assert scale_of(plain, pairs, q) == pytest.approx(12 / RANK)

    rs = read_adapter(write_peft(tmp_path / "rs", pairs, r=RANK, alpha=12, config={"use_rslora": True}), targets)
    assert scale_of(rs, pairs, q) == pytest.approx(12 / np.sqrt(RANK))

    # PEFT patterns match the end of the module name on a dot boundary.
    patterned = dict(pairs)
    patterned[down] = (np.tile(pairs[down][0], (2, 1)), np.tile(pairs[down][1], (1, 2)))
    cfg = {"rank_pattern": {"layers.0.mlp.down_proj": 2 * RANK}, "alpha_pattern": {"q_proj": 3}}
    pat = read_adapter(write_peft(tmp_path / "pat", patterned, r=RANK, alpha=12, config=cfg), targets)
    assert scale_of(pat, patterned, down) == pytest.approx(12 / (2 * RANK))
    assert scale_of(pat, patterned, q) == pytest.approx(3 / RANK)
    assert scale_of(pat, patterned, "layers.3.self_attn.k_proj") == pytest.approx(12 / RANK)

    bare = read_adapter(write_peft(tmp_path / "bare", pairs, r=RANK, alpha=0, with_config=False, language_model=False), targets)
    assert scale_of(bare, pairs, q) == pytest.approx(1.0)  # alpha = r
    meta = read_adapter(write_peft(tmp_path / "meta", pairs, r=RANK, alpha=0, with_config=False, metadata={"alpha": "6"}), targets)
    assert scale_of(meta, pairs, q) == pytest.approx(6 / RANK)
    # A file path works too, and finds the config beside it.
    by_file = read_adapter(tmp_path / "plain" / "adapter_model.safetensors", targets)
    assert by_file.sha256 == plain.sha256 and scale_of(by_file, pairs, q) == pytest.approx(12 / RANK)


def test_mlx_scaling_rules(tmp_path, tiny_model):
    targets = targets_of(tiny_model)
    pairs = lora_pairs(targets, groups=("linear_attn",), rank=RANK, seed=9)
    m = "layers.0.linear_attn.in_proj_qkv"
    assert scale_of(read_adapter(write_mlx(tmp_path / "a.safetensors", pairs, alpha=10), targets), pairs, m) == pytest.approx(10 / RANK)
    assert scale_of(read_adapter(write_mlx(tmp_path / "b.safetensors", pairs, alpha=None), targets), pairs, m) == pytest.approx(1.0)
    lm = read_adapter(write_mlx_lm(tmp_path / "lm", pairs, rank=RANK, scale=20.0), targets)
    assert lm.format == "mlx-lm" and scale_of(lm, pairs, m) == pytest.approx(20.0)
    # The file inside an mlx-lm dir is read with that dir's config.
    assert scale_of(read_adapter(tmp_path / "lm" / "adapters.safetensors", targets), pairs, m) == pytest.approx(20.0)


def sha256sum(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_sha256_is_what_sha256sum_prints_for_the_weights_file(tmp_path, tiny_model):
    targets = targets_of(tiny_model)
    pairs = lora_pairs(targets, groups=("mlp",), seed=10)
    single = write_mlx(tmp_path / "x.safetensors", pairs, alpha=8)
    (tmp_path / "adapter_config.json").write_text("{}")  # beside chat_metal's file, not about it
    read = read_adapter(single, targets)
    assert read.sha256 == sha256sum(single) and read.config_sha256 is None and read.key == read.sha256
    d = write_peft(tmp_path / "p", pairs, r=RANK, alpha=8)
    peft = read_adapter(d, targets)
    assert peft.sha256 == sha256sum(d / "adapter_model.safetensors")
    assert peft.config_sha256 == sha256sum(d / "adapter_config.json")
    # Same tensors, different alpha: the same weights file, but a different
    # adapter, so a different key (what cached model state is keyed by).
    other = read_adapter(write_peft(tmp_path / "q", pairs, r=RANK, alpha=16), targets)
    assert other.sha256 == peft.sha256 and other.config_sha256 != peft.config_sha256 and other.key != peft.key


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_each_broken_adapter_has_its_own_error(tmp_path, tiny_model, kind):
    targets = targets_of(tiny_model)
    path, phrase, name = write_bad(kind, tmp_path / kind, lora_pairs(targets, seed=11))
    with pytest.raises(AdapterError) as info:
        read_adapter(path, targets)
    msg = str(info.value)
    assert phrase in msg and name in msg and str(path) in msg
    others = {write_bad(k, tmp_path / f"other-{k}", lora_pairs(targets, seed=11))[1] for k in BAD_KINDS if k != kind}
    assert not any(p in msg for p in others), msg


def bad_message(tmp_path, targets, tensors=None, config=None, name="adapter_model.safetensors", metadata=None) -> str:
    tmp_path.mkdir(exist_ok=True)
    if tensors is not None:
        save_file(tensors, str(tmp_path / name), metadata=metadata)
    if config is not None:
        (tmp_path / "adapter_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(AdapterError) as info:
        read_adapter(tmp_path, targets)
    return str(info.value)


def test_more_ways_to_be_wrong(tmp_path, tiny_model):
    targets = targets_of(tiny_model)
    pairs = lora_pairs(targets, groups=("attention",), rank=RANK, seed=12)
    q = "layers.3.self_attn.q_proj"
    a, b = pairs[q]
    ok = {peft_key(q, "A"): a, peft_key(q, "B"): b}

    assert "neither adapter_model.safetensors nor adapters.safetensors" in bad_message(tmp_path / "empty", targets)
    assert "no such file" in str(pytest.raises(AdapterError, read_adapter, tmp_path / "missing.safetensors", targets).value)
    msg = bad_message(tmp_path / "rank", targets, {peft_key(q, "A"): a, peft_key(q, "B"): np.tile(b, (1, 2))}, {"r": RANK})
    assert "inconsistent ranks" in msg and peft_key(q, "B") in msg
    msg = bad_message(tmp_path / "cfg-rank", targets, ok, {"r": 2 * RANK, "lora_alpha": 8})
    assert "inconsistent ranks" in msg and "r=8" in msg
    assert "not valid JSON" in bad_message(tmp_path / "json", targets, ok, "{not json")
    assert "DoRA" in bad_message(tmp_path / "dora", targets, ok, {"r": RANK, "lora_alpha": 8, "use_dora": True})
    assert "floating point" in bad_message(tmp_path / "int", targets, {**ok, peft_key(q, "B"): b.astype(np.int32)}, {"r": RANK})
    assert "no LoRA tensors" in bad_message(tmp_path / "full", targets, {"model.layers.0.mlp.up_proj.weight": a})
    mixed = {peft_key(q, "A"): a, f"model.{q}.lora_b": b.T.copy()}
    assert "mixes PEFT keys" in bad_message(tmp_path / "mixed", targets, mixed)
    lm_rank = bad_message(
        tmp_path / "lm",
        targets,
        {f"model.{q}.lora_a": a.T.copy(), f"model.{q}.lora_b": b.T.copy()},
        {"lora_parameters": {"rank": 16, "scale": 2.0}},
        name="adapters.safetensors",
    )
    assert "lora_parameters.rank is 16" in lm_rank and q in lm_rank
    beyond = {peft_key("layers.9.self_attn.q_proj", "A"): a, peft_key("layers.9.self_attn.q_proj", "B"): b}
    assert "unmapped keys" in bad_message(tmp_path / "layer9", targets, beyond, {"r": RANK})
    vision = {k.replace("model.language_model.", "model.visual."): v for k, v in ok.items()}
    assert "unmapped keys" in bad_message(tmp_path / "vision", targets, vision, {"r": RANK})
    assert "not a finite number" in bad_message(
        tmp_path / "meta", targets, {f"model.{q}.lora_a": a.T.copy(), f"model.{q}.lora_b": b.T.copy()}, metadata={"alpha": "x"}, name="adapters.safetensors"
    )


def test_only_regular_files_within_the_size_limit_are_read(tmp_path, tiny_model):
    """A FIFO blocked the reader in open() for good (hot reload ended for
    that worker); a device or a huge file was read whole, several times."""
    targets = targets_of(tiny_model)
    pairs = lora_pairs(targets, groups=("mlp",), seed=13)
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    assert "fifo.safetensors is a FIFO, not a regular file" in str(pytest.raises(AdapterError, read_adapter, fifo, targets).value)
    assert "null is a character device" in str(pytest.raises(AdapterError, read_adapter, Path("/dev/null"), targets).value)
    in_dir = tmp_path / "fifo-dir"
    in_dir.mkdir()
    os.mkfifo(in_dir / "adapter_model.safetensors")
    assert "is a FIFO" in str(pytest.raises(AdapterError, read_adapter, in_dir, targets).value)
    # A config that is no regular file is refused, not taken for a missing one.
    peft = write_peft(tmp_path / "peft", pairs, r=RANK, alpha=ALPHA)
    (peft / "adapter_config.json").unlink()
    os.mkfifo(peft / "adapter_config.json")
    assert "adapter_config.json is a FIFO" in str(pytest.raises(AdapterError, read_adapter, peft, targets).value)
    single = write_mlx(tmp_path / "x.safetensors", pairs, alpha=ALPHA)
    size = single.stat().st_size
    assert read_adapter(single, targets, max_bytes=size).sha256
    too_big = str(pytest.raises(AdapterError, read_adapter, single, targets, max_bytes=size - 1).value)
    assert f"is {size} bytes, more than max_adapter_bytes ({size - 1})" in too_big
    loop = tmp_path / "loop.safetensors"
    loop.symlink_to(loop)
    assert "symbolic links" in str(pytest.raises(AdapterError, read_adapter, loop, targets).value)


def test_a_config_nested_too_deeply_is_an_adapter_error(tmp_path, tiny_model):
    targets = targets_of(tiny_model)
    peft = write_peft(tmp_path / "peft", lora_pairs(targets, groups=("mlp",), seed=14), r=RANK, alpha=ALPHA)
    (peft / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
    assert "nests too deeply" in str(pytest.raises(AdapterError, read_adapter, peft, targets).value)
