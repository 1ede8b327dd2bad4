"""Model directories: validation, loading through mlx-lm's architectures, format."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ipc.files import FileRefused, check_regular, read_capped

Progress = Callable[[int, int], None]

_DTYPE_NAMES = {mx.bfloat16: "bf16", mx.float16: "fp16", mx.float32: "fp32"}


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
        config = json.loads(read_capped(config_path))
    except FileNotFoundError:
        raise ModelDirError(f"{path} has no config.json") from None
    except FileRefused as exc:
        raise ModelDirError(f"config {exc}") from None
    except OSError as exc:
        raise ModelDirError(f"cannot read {config_path}: {exc.strerror}") from None
    except ValueError as exc:
        raise ModelDirError(f"cannot parse {config_path}: {exc}") from exc
    except RecursionError:
        # Python's json recurses per level: a hostile file is a bad dir, not a crash.
        raise ModelDirError(f"cannot parse {config_path}: it nests too deeply") from None
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
    from mlx_lm.utils import load_model

    read_config(path)
    try:
        # Any failure here (unknown architecture, torn safetensors, shape
        # mismatch) is a property of the directory: retrying cannot help.
        model, config = load_model(path, lazy=True)
        return LazyModel(model, config, path, model_format(config, model))
    except Exception as exc:
        raise ModelDirError(f"cannot load {path}: {exc}") from exc


def materialise(lazy: LazyModel, progress: Progress | None = None, cpu_float32: bool = True) -> LoadedModel:
    """Reads the weights in slices, so that `progress(bytes_loaded,
    bytes_total)` can report as the file is read. On CPU the weights become
    float32 (worker.runtime.cpu_backend says why)."""
    from worker.runtime import gated_delta
    from worker.runtime.cpu_backend import use_float32

    model = lazy.model
    try:
        if cpu_float32:
            use_float32(model)  # still lazy: converted as it is read
        _materialise(model, progress)
    except Exception as exc:
        raise ModelDirError(f"cannot load {lazy.path}: {exc}") from exc
    gated_delta.install(model)
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
