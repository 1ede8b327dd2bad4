"""LoRA adapter files: the three formats users bring, read and checked before
any of it reaches the model.

- PEFT: `adapter_model.safetensors` (+ `adapter_config.json`), keys
  `base_model.model.model.[language_model.]layers.N.<module>.lora_A.weight`,
  A (r, d_in), B (d_out, r); scale lora_alpha/r, lora_alpha/sqrt(r) with
  rsLoRA, per module through rank_pattern/alpha_pattern. Without a config,
  alpha is `__metadata__.alpha`, else r.
- chat_metal's MLX file: `model.layers.N.<module>.lora_a` / `.lora_b`,
  A (d_in, r), B (r, d_out); scale `__metadata__.alpha`/r, else 1.
- mlx-lm adapter dirs: `adapters.safetensors` + `adapter_config.json` whose
  `lora_parameters.scale` is the absolute multiplier.

The weights file is read once into memory and hashed, and everything is
parsed from those bytes, so a writer rewriting it in place cannot hand us a
mix of two versions. This module is numpy only; the MLX side is worker.lora.layers.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
import safetensors

PEFT_FILE = "adapter_model.safetensors"
MLX_LM_FILE = "adapters.safetensors"
CONFIG_FILE = "adapter_config.json"

# Where decoder layers sit in the names PEFT and mlx-lm write, for text-only
# and multimodal (language_model) checkpoints alike.
_LAYER_PREFIXES = ("model.", "model.language_model.", "language_model.model.", "language_model.")
_PEFT_ROOT = "base_model.model."
_KEY = re.compile(r"^(?P<prefix>.*?)layers\.(?P<n>\d+)\.(?P<rel>.+)\.(?P<part>lora_A\.weight|lora_B\.weight|lora_a|lora_b)$")
_PEFT_PARTS = ("lora_A.weight", "lora_B.weight")

_FLOAT_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16}

# PEFT's LoraConfig defaults, for a config that leaves them out.
_PEFT_DEFAULT_R = 8
_PEFT_DEFAULT_ALPHA = 8

Targets = Mapping[str, tuple[int, int]]
"""Linear layers an adapter may target: `layers.N.<module>` -> (d_in, d_out)."""


class AdapterError(Exception):
    """An adapter that cannot be used; the message names the offending keys."""


@dataclass(frozen=True)
class AdapterWeights:
    sha256: str
    format: str  # "peft" | "mlx" | "mlx-lm"
    # `layers.N.<module>` -> (A (d_in, r), scale * B (r, d_out)), float32.
    pairs: dict[str, tuple[np.ndarray, np.ndarray]]


@dataclass
class _Pair:
    peft_name: str  # the module's name as PEFT's rank_pattern sees it
    a: str | None = None  # tensor keys
    b: str | None = None


def read_adapter(path: Path, targets: Targets) -> AdapterWeights:
    """Reads, validates and scales the adapter at `path` (file or directory).

    `sha256` covers the weights file's bytes, then adapter_config.json's when
    one was used: two adapters with the same hash compute the same thing.
    """
    try:
        return _read(path, targets)
    except AdapterError as exc:
        raise AdapterError(f"adapter {path}: {exc}") from None


def _read(path: Path, targets: Targets) -> AdapterWeights:
    weights_file = _weights_file(path)
    data = _read_bytes(weights_file)
    digest = hashlib.sha256(data)
    tensors, metadata = _parse_safetensors(data, weights_file.name)
    del data
    style = _key_style(tensors)
    config_file = weights_file.with_name(CONFIG_FILE)
    config_bytes = _read_bytes(config_file) if config_file.is_file() else None
    config = _parse_json(config_bytes) if config_bytes is not None else None
    if style == "peft":
        fmt = "peft"
    elif config is not None and "lora_parameters" in config:
        fmt = "mlx-lm"
    else:
        # A config beside chat_metal's single file is not about it.
        fmt, config, config_bytes = "mlx", None, None
    if config_bytes is not None:
        digest.update(config_bytes)
    pairs = _pairs(tensors, style, targets)
    scales = _scales(fmt, pairs, tensors, metadata, config)
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for module, pair in pairs.items():
        a, b = _oriented(style, tensors[pair.a], tensors[pair.b])
        out[module] = (a, b * np.float32(scales[module]))
    return AdapterWeights(sha256=digest.hexdigest(), format=fmt, pairs=out)


def _weights_file(path: Path) -> Path:
    if path.is_dir():
        for name in (PEFT_FILE, MLX_LM_FILE):
            if (path / name).is_file():
                return path / name
        raise AdapterError(f"directory has neither {PEFT_FILE} nor {MLX_LM_FILE}")
    if not path.exists():
        raise AdapterError("no such file or directory")
    return path


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise AdapterError(f"cannot read {path.name}: {exc.strerror or exc}") from None


def _parse_safetensors(data: bytes, name: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Tensors as float arrays (fp16/bf16 widened to float32), plus metadata."""
    try:
        raw = safetensors.deserialize(data)
        header_len = int.from_bytes(data[:8], "little")
        metadata = json.loads(data[8 : 8 + header_len]).get("__metadata__") or {}
    except Exception as exc:  # the parser's own error types vary by version
        raise AdapterError(f"{name} is unreadable (truncated or corrupt): {exc}") from None
    tensors: dict[str, np.ndarray] = {}
    bad_dtype = []
    for key, info in raw:
        dtype, shape, buf = info["dtype"], info["shape"], info["data"]
        if dtype == "BF16":
            # bf16 is the top half of a float32: widen it bit for bit.
            tensors[key] = (np.frombuffer(buf, np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
        elif dtype in _FLOAT_DTYPES:
            tensors[key] = np.frombuffer(buf, _FLOAT_DTYPES[dtype]).astype(np.float32).reshape(shape)
        else:
            bad_dtype.append(f"{key} ({dtype})")
    if bad_dtype:
        raise AdapterError(f"LoRA weights must be floating point: {_names(bad_dtype)}")
    if not tensors:
        raise AdapterError(f"{name} holds no tensors")
    return tensors, metadata


def _parse_json(data: bytes) -> dict:
    try:
        config = json.loads(data)
    except ValueError as exc:
        raise AdapterError(f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} is not a JSON object")
    return config


def _key_style(tensors: Mapping[str, np.ndarray]) -> str:
    peft = [k for k in tensors if k.endswith(_PEFT_PARTS)]
    mlx = [k for k in tensors if k.endswith((".lora_a", ".lora_b"))]
    if peft and mlx:
        raise AdapterError(f"mixes PEFT keys ({_names(peft)}) with MLX keys ({_names(mlx)})")
    if not peft and not mlx:
        raise AdapterError(f"no LoRA tensors (.lora_A.weight/.lora_B.weight or .lora_a/.lora_b); unmapped keys: {_names(tensors)}")
    return "peft" if peft else "mlx"


def _pairs(tensors: Mapping[str, np.ndarray], style: str, targets: Targets) -> dict[str, _Pair]:
    pairs: dict[str, _Pair] = {}
    unmapped = []
    for key in tensors:
        name = key[len(_PEFT_ROOT) :] if style == "peft" and key.startswith(_PEFT_ROOT) else key
        m = _KEY.match(name)
        module = f"layers.{int(m['n'])}.{m['rel']}" if m else None
        if m is None or m["prefix"] not in _LAYER_PREFIXES or module not in targets:
            unmapped.append(key)
            continue
        pair = pairs.setdefault(module, _Pair(peft_name=name.rsplit(".", 2 if style == "peft" else 1)[0]))
        if m["part"] in ("lora_A.weight", "lora_a"):
            pair.a = key
        else:
            pair.b = key
    if unmapped:
        raise AdapterError(f"unmapped keys (no linear layer of that name in the model's decoder layers): {_names(unmapped)}")
    no_b = [p.a for p in pairs.values() if p.b is None]
    no_a = [p.b for p in pairs.values() if p.a is None]
    if no_b or no_a:
        parts = ([f"A without B: {_names(no_b)}"] if no_b else []) + ([f"B without A: {_names(no_a)}"] if no_a else [])
        raise AdapterError("incomplete pairs: " + "; ".join(parts))
    _check_shapes(tensors, style, pairs, targets)
    non_finite = [k for p in pairs.values() for k in (p.a, p.b) if not np.isfinite(tensors[k]).all()]
    if non_finite:
        raise AdapterError(f"non-finite values (NaN or Inf) in: {_names(non_finite)}")
    return pairs


def _check_shapes(tensors: Mapping[str, np.ndarray], style: str, pairs: Mapping[str, _Pair], targets: Targets) -> None:
    wrong, ranks = [], []
    for module, pair in pairs.items():
        d_in, d_out = targets[module]
        a, b = tensors[pair.a], tensors[pair.b]
        if a.ndim != 2 or b.ndim != 2:
            wrong.append(f"{pair.a} {a.shape} / {pair.b} {b.shape} are not matrices")
            continue
        # A's rank axis sets r (axis 0 in PEFT, 1 in MLX); B must agree with it.
        r = _rank(style, a)
        want_a = (r, d_in) if style == "peft" else (d_in, r)
        want_b = (d_out, r) if style == "peft" else (r, d_out)
        if a.shape != want_a:
            wrong.append(f"{pair.a} is {a.shape}, the layer needs {want_a} (d_in={d_in})")
        elif b.shape != want_b:
            b_rank = b.shape[1] if style == "peft" else b.shape[0]
            if b.shape == ((d_out, b_rank) if style == "peft" else (b_rank, d_out)):
                ranks.append(f"{pair.a} has rank {r} but {pair.b} has rank {b_rank}")
            else:
                wrong.append(f"{pair.b} is {b.shape}, the layer needs {want_b} (d_out={d_out})")
    if wrong:
        raise AdapterError(f"shape mismatch with the model: {_names(wrong)}")
    if ranks:
        raise AdapterError(f"inconsistent ranks: {_names(ranks)}")


def _rank(style: str, a: np.ndarray) -> int:
    return a.shape[0] if style == "peft" else a.shape[1]


def _oriented(style: str, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A as (d_in, r) and B as (r, d_out), so the forward pass is x @ A @ B."""
    if style == "peft":
        return np.ascontiguousarray(a.T), np.ascontiguousarray(b.T)
    return a, b


def _scales(fmt: str, pairs: Mapping[str, _Pair], tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str], config: dict | None) -> dict[str, float]:
    style = "peft" if fmt == "peft" else "mlx"
    ranks = {m: _rank(style, tensors[p.a]) for m, p in pairs.items()}
    if fmt == "mlx-lm":
        return _mlx_lm_scales(config, ranks)
    if fmt == "peft" and config is not None:
        return _peft_scales(config, pairs, ranks)
    alpha = _metadata_alpha(metadata)
    if alpha is None:
        # PEFT without a config: alpha = r. chat_metal's file: scale 1.
        return {m: 1.0 for m in ranks}
    return {m: alpha / r for m, r in ranks.items()}


def _metadata_alpha(metadata: Mapping[str, str]) -> float | None:
    if "alpha" not in metadata:
        return None
    try:
        alpha = float(metadata["alpha"])
    except (TypeError, ValueError):
        alpha = math.nan
    if not math.isfinite(alpha):
        raise AdapterError(f"__metadata__.alpha is not a finite number: {metadata['alpha']!r}")
    return alpha


def _number(config: dict, key: str, default: float | None = None, where: str = CONFIG_FILE) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise AdapterError(f"{where}: {key} must be a positive number, got {value!r}")
    return float(value)


def _peft_scales(config: dict, pairs: Mapping[str, _Pair], ranks: Mapping[str, int]) -> dict[str, float]:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"{CONFIG_FILE}: peft_type {peft_type!r} is not supported, only LORA")
    if config.get("use_dora"):
        raise AdapterError(f"{CONFIG_FILE}: DoRA adapters (use_dora) are not supported")
    if config.get("modules_to_save"):
        raise AdapterError(f"{CONFIG_FILE}: modules_to_save ({config['modules_to_save']}) cannot be applied as an adapter")
    r = _number(config, "r", _PEFT_DEFAULT_R)
    alpha = _number(config, "lora_alpha", _PEFT_DEFAULT_ALPHA)
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora"))
    scales, wrong = {}, []
    for module, pair in pairs.items():
        module_r = _number(rank_pattern, _pattern_key(rank_pattern, pair.peft_name), r, "rank_pattern")
        module_alpha = _number(alpha_pattern, _pattern_key(alpha_pattern, pair.peft_name), alpha, "alpha_pattern")
        if ranks[module] != module_r:
            wrong.append(f"{pair.a} has rank {ranks[module]}, the config says r={module_r:g}")
        scales[module] = module_alpha / (math.sqrt(module_r) if rslora else module_r)
    if wrong:
        raise AdapterError(f"inconsistent ranks: {_names(wrong)}")
    return scales


def _pattern_key(patterns: Mapping[str, object], module: str) -> str:
    """PEFT's rule: the first pattern that matches the end of the module name
    on a dot boundary, else the name itself (which then matches nothing)."""
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", module):
            return pattern
    return module


def _mlx_lm_scales(config: dict, ranks: Mapping[str, int]) -> dict[str, float]:
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise AdapterError(f"{CONFIG_FILE}: fine_tune_type {kind!r} is not supported, only lora")
    params = config.get("lora_parameters")
    if not isinstance(params, dict):
        raise AdapterError(f"{CONFIG_FILE}: lora_parameters must be an object")
    scale = params.get("scale")
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
        raise AdapterError(f"{CONFIG_FILE}: lora_parameters.scale must be a number, got {scale!r}")
    rank = params.get("rank")
    if rank is not None:
        wrong = [f"{m} has rank {r}" for m, r in ranks.items() if r != rank]
        if wrong:
            raise AdapterError(f"inconsistent ranks: lora_parameters.rank is {rank} but {_names(wrong)}")
    return {m: float(scale) for m in ranks}


def _names(items, limit: int = 8) -> str:
    items = list(items)
    shown = ", ".join(str(i) for i in items[:limit])
    return shown + (f" (and {len(items) - limit} more)" if len(items) > limit else "")
