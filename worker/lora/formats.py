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
mix of two versions. Only regular files are read, never more than
`max_adapter_bytes` of one. This module is numpy only; the MLX side is
worker.lora.layers.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np
import safetensors

from ipc.messages import DEFAULT_MAX_ADAPTER_BYTES

log = logging.getLogger("worker")

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
    sha256: str  # of the weights file's bytes: what `sha256sum` prints for it
    config_sha256: str | None  # of adapter_config.json's bytes, when it was used
    format: str  # "peft" | "mlx" | "mlx-lm"
    # `layers.N.<module>` -> (A (d_in, r), scale * B (r, d_out)), float32.
    pairs: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def key(self) -> str:
        """One hash of everything that sets what the adapter computes: two
        adapters with the same key compute the same thing."""
        if self.config_sha256 is None:
            return self.sha256
        return hashlib.sha256(f"{self.sha256}:{self.config_sha256}".encode()).hexdigest()


@dataclass
class _Pair:
    peft_name: str  # the module's name as PEFT's rank_pattern sees it
    a: str | None = None  # tensor keys
    b: str | None = None


def read_adapter(path: Path, targets: Targets, max_bytes: int = DEFAULT_MAX_ADAPTER_BYTES) -> AdapterWeights:
    """Reads, validates and scales the adapter at `path` (file or directory)."""
    return _read(path, targets, max_bytes)[0]


class AdapterReader:
    """How one worker reads adapters: within `max_bytes` per file and, with
    `copies` (a private directory the pool owns), keeping a copy of the
    exact bytes of every adapter read in full, so that a worker restarted
    after its adapter file was deleted or broken can start with the version
    it had (`last_good`)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_ADAPTER_BYTES, copies: Path | None = None):
        self.max_bytes = max_bytes
        self.copies = copies

    def read(self, path: Path, targets: Targets) -> AdapterWeights:
        weights, files = _read(path, targets, self.max_bytes)
        if self.copies is not None:
            try:
                self._keep(path, files)
            except OSError as exc:  # a copy is insurance: never a reason to refuse
                log.warning("no last-good copy of adapter %s: %s", path, exc)
        return weights

    def read_last_good(self, path: Path, targets: Targets) -> tuple[AdapterWeights, Path] | None:
        """The kept copy of the adapter last read in full from `path`, or None."""
        copy = self._last_good(path)
        if copy is None:
            return None
        return _read(copy, targets, self.max_bytes)[0], copy

    def _slot(self, path: Path) -> Path:
        return self.copies / hashlib.sha256(str(path).encode()).hexdigest()[:16]

    def _keep(self, path: Path, files: dict[str, bytes]) -> None:
        # Written aside, then renamed into place: a reader sees the old copy
        # or the new one, never a mix.
        slot = self._slot(path)
        self.copies.mkdir(mode=0o700, parents=True, exist_ok=True)
        fresh = Path(tempfile.mkdtemp(prefix=".new-", dir=self.copies))
        for name, data in files.items():
            (fresh / name).write_bytes(data)
        old = None
        if slot.exists():
            old = Path(tempfile.mkdtemp(prefix=".old-", dir=self.copies))
            slot.rename(old / "slot")
        fresh.rename(slot)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def _last_good(self, path: Path) -> Path | None:
        if self.copies is None:
            return None
        slot = self._slot(path)
        try:
            names = [n for n in os.listdir(slot) if n != CONFIG_FILE]
        except OSError:
            return None
        if len(names) != 1:
            return None
        # The directory reads like the original directory did, and like a
        # PEFT or mlx-lm file beside its config; any other file by its name.
        return slot if names[0] in (PEFT_FILE, MLX_LM_FILE) else slot / names[0]


def _read(path: Path, targets: Targets, max_bytes: int) -> tuple[AdapterWeights, dict[str, bytes]]:
    """The adapter and the bytes it came from: file name -> content."""
    try:
        return _read_checked(path, targets, max_bytes)
    except AdapterError as exc:
        raise AdapterError(f"adapter {path}: {exc}") from None
    except RecursionError:
        raise AdapterError(f"adapter {path}: a JSON document in it nests too deeply") from None


def _read_checked(path: Path, targets: Targets, max_bytes: int) -> tuple[AdapterWeights, dict[str, bytes]]:
    weights_file = _weights_file(path)
    data = _read_file(weights_file, max_bytes)
    sha256 = hashlib.sha256(data).hexdigest()
    tensors, metadata = _parse_safetensors(data, weights_file.name)
    files = {weights_file.name: data}
    del data
    style = _key_style(tensors)
    config_file = weights_file.with_name(CONFIG_FILE)
    config_bytes = _read_file(config_file, max_bytes, optional=True)
    config = _parse_json(config_bytes) if config_bytes is not None else None
    if style == "peft":
        fmt = "peft"
    elif config is not None and "lora_parameters" in config:
        fmt = "mlx-lm"
    else:
        # A config beside chat_metal's single file is not about it.
        fmt, config, config_bytes = "mlx", None, None
    config_sha256 = None
    if config_bytes is not None:
        config_sha256 = hashlib.sha256(config_bytes).hexdigest()
        files[CONFIG_FILE] = config_bytes
    pairs = _pairs(tensors, style, targets)
    scales = _scales(fmt, pairs, tensors, metadata, config)
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for module, pair in pairs.items():
        a, b = _oriented(style, tensors[pair.a], tensors[pair.b])
        out[module] = (a, b * np.float32(scales[module]))
    return AdapterWeights(sha256=sha256, config_sha256=config_sha256, format=fmt, pairs=out), files


# A worker out of descriptors or memory: no fault of the file, and it passes.
_TRANSIENT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})


def _cannot_read(what: str, exc: OSError) -> NoReturn:
    if exc.errno in _TRANSIENT_ERRNOS:
        raise exc
    raise AdapterError(f"cannot read {what}: {(exc.strerror or str(exc)).lower()}") from None


def _weights_file(path: Path) -> Path:
    try:
        st = os.stat(path)
    except OSError as exc:  # missing, a symlink loop, a name too long, ...
        _cannot_read("it", exc)
    if stat.S_ISDIR(st.st_mode):
        for name in (PEFT_FILE, MLX_LM_FILE):
            if (path / name).exists():
                return path / name
        raise AdapterError(f"directory has neither {PEFT_FILE} nor {MLX_LM_FILE}")
    return path


_KINDS = {stat.S_ISFIFO: "a FIFO", stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device", stat.S_ISSOCK: "a socket", stat.S_ISDIR: "a directory"}


def _read_file(path: Path, max_bytes: int, optional: bool = False) -> bytes | None:
    """The whole file, if it is a regular file of at most `max_bytes`.

    O_NONBLOCK makes the open of a FIFO return at once (a plain open waits
    for a writer, forever), and the type and size come from the open file,
    so nothing is read from a device or a FIFO, and nothing too large."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        if optional:
            return None
        raise AdapterError(f"cannot read {path.name}: no such file or directory") from None
    except OSError as exc:
        _cannot_read(path.name, exc)
    with os.fdopen(fd, "rb") as f:
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                kind = next((name for test, name in _KINDS.items() if test(st.st_mode)), "of another type")
                raise AdapterError(f"{path.name} is {kind}, not a regular file")
            if st.st_size > max_bytes:
                raise AdapterError(f"{path.name} is {st.st_size} bytes, more than max_adapter_bytes ({max_bytes})")
            # One byte more than its size tells a file that grows as it is read.
            data = f.read(st.st_size + 1)
            if len(data) > st.st_size:
                data += f.read(max_bytes + 1 - len(data))
        except OSError as exc:
            _cannot_read(path.name, exc)
    if len(data) > max_bytes:
        raise AdapterError(f"{path.name} grew past max_adapter_bytes ({max_bytes}) while it was read")
    return data


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
        raise AdapterError(f"no LoRA tensors (.lora_A.weight/.lora_B.weight or .lora_a/.lora_b); unmapped keys: {_names(sorted(tensors))}")
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
        raise AdapterError(f"unmapped keys (no linear layer of that name in the model's decoder layers): {_names(sorted(unmapped))}")
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
