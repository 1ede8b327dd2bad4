"""Model directories: validation, loading through mlx-lm's architectures, format."""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ipc.files import FileRefused, check_regular, read_json

Progress = Callable[[int, int], None]

_DTYPE_NAMES = {mx.bfloat16: "bf16", mx.float16: "fp16", mx.float32: "fp32"}
# The architectures built here without mlx-lm's full loader (see
# `_build_native`): module names of mlx_lm.models that no model_type is
# remapped to or from there, so config.json's model_type names the module.
NATIVE_TYPES = frozenset({"qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen3", "qwen3_moe", "qwen2", "qwen2_moe", "llama", "gemma3_text"})
# What MLX's own `quantization` table may hold for one setting for every
# layer; anything more (a table per layer) goes to mlx-lm's loader.
_UNIFORM_QUANT_KEYS = {"group_size", "bits", "mode"}

log = logging.getLogger("lattice.worker")


class ModelDirError(Exception):
    """The directory is not a loadable model; the worker exits 78 (EX_CONFIG)."""


@dataclass
class LoadedModel:
    model: nn.Module
    config: dict
    path: Path
    format: str
    weights_bytes: int


def read_config(path: Path) -> dict:
    if not path.is_dir():
        raise ModelDirError(f"model dir {path} does not exist or is not a directory")
    config_path = path / "config.json"
    try:
        config = read_json(config_path)
    except FileNotFoundError:
        raise ModelDirError(f"{path} has no config.json") from None
    except FileRefused as exc:
        raise ModelDirError(f"config {exc}") from None
    except OSError as exc:
        raise ModelDirError(f"cannot read {config_path}: {exc.strerror}") from None
    except ValueError as exc:
        raise ModelDirError(f"cannot parse {config_path}: {exc}") from exc
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelDirError(f"{config_path} has no model_type")
    weights = sorted(path.glob("model*.safetensors"))
    if not weights:
        raise ModelDirError(f"{path} has no model*.safetensors weights")
    for weight in weights:
        # Refused before mlx opens it: a FIFO would block the load until the
        # watchdog kills it, and a device would be read without end.
        try:
            check_regular(weight)
        except FileRefused as exc:
            raise ModelDirError(f"weight file {exc}") from None
        except OSError as exc:
            raise ModelDirError(f"cannot read weight file {weight}: {exc.strerror}") from None
    return config


def model_format(config: dict, model: nn.Module) -> str:
    quant = config.get("quantization") or {}
    if quant:
        mode = quant.get("mode", "affine")
        return f"q{quant.get('bits', 4)}" if mode == "affine" else str(mode)
    counts: dict[str, int] = {}
    for _, p in tree_flatten(model.parameters()):
        name = _DTYPE_NAMES.get(p.dtype)
        if name:
            counts[name] = counts.get(name, 0) + p.size
    return max(counts, key=counts.get) if counts else "unknown"


@dataclass
class LazyModel:
    """A model dir read as far as its structure: weights not yet in memory."""

    model: nn.Module
    config: dict
    path: Path
    format: str


def open_lazy(path: Path) -> LazyModel:
    """The model built from its dir, weights mapped but not read, so it can
    still be split over processes (worker.group.model) before they are."""
    config = read_config(path)
    try:
        built = _build_native(path, config)
    except Exception as exc:
        # mlx-lm's loader knows more formats; it gives the final answer.
        log.debug("model %s: built in full by mlx-lm (%s)", path, exc)
        built = None
    if built is not None:
        model, config = built
        return LazyModel(model, config, path, model_format(config, model))
    from mlx_lm.utils import load_model

    try:
        # Any failure here (unknown architecture, torn safetensors, shape
        # mismatch) is a property of the directory: retrying cannot help.
        model, config = load_model(path, lazy=True)
        return LazyModel(model, config, path, model_format(config, model))
    except Exception as exc:
        raise ModelDirError(f"cannot load {path}: {exc}") from exc


def _build_native(path: Path, config: dict) -> tuple[nn.Module, dict] | None:
    """The model of a directory in the forms MLX writes itself (plain
    weights, or MLX quantization with one setting for every layer), built
    from its mlx-lm architecture module alone; None for any other form.

    mlx-lm's `load_model` lives in a module that imports transformers
    (over a second of CPU per worker start, worker/__init__.py says more),
    though for these forms building the model takes only the architecture:
    its args, the weights as stored, its own `sanitize`, the quantized
    layers where the file has scales, and a strict load that fails on any
    weight the structure does not expect. Anything else (Hugging Face
    quantization configs, per-layer tables, custom model files) returns
    None and takes mlx-lm's loader."""
    model_type = config.get("model_type")
    quant = config.get("quantization")
    if (
        model_type not in NATIVE_TYPES
        or any(key in config for key in ("model_file", "quantize_activations"))
        # mlx-lm writes its `quantization` table twice, the second time under
        # Hugging Face's key; any other quantization_config is theirs.
        or config.get("quantization_config", quant) != quant
        or "quantization_config" in (config.get("text_config") or {})
        or (quant is not None and (not isinstance(quant, dict) or set(quant) - _UNIFORM_QUANT_KEYS))
        or "__float__" in json.dumps(config)
    ):
        return None
    arch = importlib.import_module(f"mlx_lm.models.{model_type}")
    config = dict(config)
    generation = path / "generation_config.json"
    if generation.is_file():
        try:
            eos = read_json(generation).get("eos_token_id")
        except (OSError, ValueError, FileRefused, AttributeError):
            eos = None
        if eos:
            config["eos_token_id"] = eos
    weights: dict = {}
    for file in sorted(path.glob("model*.safetensors")):
        weights.update(mx.load(str(file)))
    model = arch.Model(arch.ModelArgs.from_dict(config))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    if quant is not None:
        nn.quantize(
            model,
            group_size=quant["group_size"],
            bits=quant["bits"],
            mode=quant.get("mode", "affine"),
            class_predicate=lambda name, module: hasattr(module, "to_quantized") and f"{name}.scales" in weights,
        )
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    return model, config


def materialise(lazy: LazyModel, progress: Progress | None = None, cpu_float32: bool = True) -> LoadedModel:
    """Reads the weights in slices, so that `progress(bytes_loaded,
    bytes_total)` can report as the file is read. On CPU the weights become
    float32 (worker.runtime.cpu_backend says why)."""
    from worker.runtime import cpu_attention, cpu_head, depthwise_conv, dequantized_rows, gated_delta, short_attention
    from worker.runtime.cpu_backend import use_float32

    model = lazy.model
    try:
        if cpu_float32:
            use_float32(model)  # still lazy: converted as it is read
        _materialise(model, progress)
    except Exception as exc:
        raise ModelDirError(f"cannot load {lazy.path}: {exc}") from exc
    gated_delta.install(model)
    dequantized_rows.install(model)
    depthwise_conv.install(model)
    short_attention.install(model)
    cpu_attention.install(model)
    cpu_head.install(model)
    total = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
    return LoadedModel(model=model, config=lazy.config, path=lazy.path, format=lazy.format, weights_bytes=total)


def load(path: Path, progress: Progress | None = None, cpu_float32: bool = True) -> LoadedModel:
    """The model dir loaded: open_lazy, then materialise."""
    return materialise(open_lazy(path), progress, cpu_float32)


def _materialise(model: nn.Module, progress: Progress | None) -> None:
    params = [p for _, p in tree_flatten(model.parameters())]
    total = sum(p.nbytes for p in params)
    loaded = 0
    batch: list[mx.array] = []
    batch_bytes = 0
    step = max(total // 20, 1)
    for p in params:
        batch.append(p)
        batch_bytes += p.nbytes
        if batch_bytes >= step:
            mx.eval(batch)
            loaded += batch_bytes
            batch, batch_bytes = [], 0
            if progress:
                progress(loaded, total)
    if batch:
        mx.eval(batch)
        if progress:
            progress(total, total)
