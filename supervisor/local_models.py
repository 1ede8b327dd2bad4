"""Models already on this machine, where people keep them: the model cache
(`$LATTICE_MODEL_CACHE`, default ~/.lattice/models) and the Hugging Face
hub cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
~/.cache/huggingface/hub), where mlx-lm and `huggingface-cli download` put
them, and LM Studio's model directory (~/.lmstudio/models/PUBLISHER/MODEL). The hub cache is read through
huggingface_hub's own API (snapshot resolution, scan_cache_dir), never by
parsing its layout here; `pull` downloads into it.

huggingface_hub is imported only when one of these is needed: the pool
that never meets an `org/name` reference never pays for the import.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from ipc.files import FileRefused, check_regular, read_json

# A Hub repo id: `org/name` (huggingface_hub validates it again).
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
# What a model needs and nothing else: no PyTorch .bin, no GGUF.
PULL_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "*.tiktoken"]
# A safetensors header larger than this is no model file we read for its dtypes.
_MAX_HEADER = 64 * 1024 * 1024
_DTYPES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}


def is_hub_id(ref: str) -> bool:
    return _HUB_ID.fullmatch(ref) is not None


def hub_snapshot(repo_id: str) -> Path | None:
    """The snapshot directory that `refs/main` names for `repo_id` in the
    local hub cache, or None; never goes to the network."""
    if not is_hub_id(repo_id):
        return None
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:
        # Not cached (LocalEntryNotFoundError), an id huggingface_hub
        # refuses, an unreadable cache: not a model here.
        return None
    return path if path.is_dir() else None


def hub_cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


# -- listing -----------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalModel:
    name: str  # what `model` / `--model` accepts
    format: str
    size: int
    where: Path


def _safetensors_dtypes(path: Path, counts: dict[str, int]) -> None:
    check_regular(path)  # a FIFO would block `list` for good
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            return
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER:
            return
        header = json.loads(f.read(n))
    for name, tensor in header.items():
        if name == "__metadata__" or not isinstance(tensor, dict):
            continue
        shape = tensor.get("shape") or []
        size = 1
        for d in shape:
            size *= d
        dtype = _DTYPES.get(tensor.get("dtype"), str(tensor.get("dtype")).lower())
        counts[dtype] = counts.get(dtype, 0) + size


def model_format(model_dir: Path) -> str:
    """As the worker's `ready` says it: `q4`/`q8` for MLX-quantized dirs,
    else the dtype most weights have (from the safetensors headers)."""
    try:
        config = read_json(model_dir / "config.json")
        quant = config.get("quantization") or {} if isinstance(config, dict) else {}
        if quant:
            mode = quant.get("mode", "affine")
            return f"q{quant.get('bits', 4)}" if mode == "affine" else str(mode)
        counts: dict[str, int] = {}
        for weights in sorted(model_dir.glob("model*.safetensors")):
            _safetensors_dtypes(weights, counts)
    except (OSError, FileRefused, ValueError, RecursionError, struct.error, AttributeError, TypeError):
        return "?"
    return max(counts, key=counts.get) if counts else "?"


def is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("model*.safetensors"))


def dir_size(path: Path) -> int:
    total = 0
    for entry in path.iterdir():
        try:
            if entry.is_file():
                total += entry.stat().st_size
        except OSError:
            continue
    return total


def dir_model(name: str, path: Path) -> LocalModel | None:
    """The model directory at `path` under `name`, or None if it is none."""
    try:
        if path.is_dir() and is_model_dir(path):
            return LocalModel(name, model_format(path), dir_size(path), path)
    except OSError:
        pass
    return None


def cache_models(cache: Path) -> list[LocalModel]:
    """Model dirs directly under the model cache."""
    try:
        entries = sorted(cache.iterdir())
    except OSError:
        return []
    return [m for m in (dir_model(p.name, p) for p in entries) if m is not None]


def lmstudio_dir() -> Path:
    """LM Studio's model directory: `publisher/model-dir` under it."""
    return Path.home() / ".lmstudio" / "models"


def lmstudio_models() -> list[LocalModel]:
    """MLX model dirs in LM Studio's directory, as `publisher/model`."""
    found = []
    try:
        publishers = sorted(p for p in lmstudio_dir().iterdir() if p.is_dir())
    except OSError:
        return []
    for publisher in publishers:
        try:
            dirs = sorted(publisher.iterdir())
        except OSError:
            continue
        found += [m for m in (dir_model(f"{publisher.name}/{d.name}", d) for d in dirs) if m is not None]
    return found


def hub_models() -> list[LocalModel]:
    """Model repos in the hub cache whose `main` snapshot (else latest)
    holds a config.json and safetensors weights."""
    from huggingface_hub import scan_cache_dir

    try:
        info = scan_cache_dir()
    except Exception:
        # No cache yet (CacheNotFound), or one we cannot read.
        return []
    found = []
    for repo in info.repos:
        if repo.repo_type != "model" or not repo.revisions:
            continue
        main = [r for r in repo.revisions if "main" in r.refs]
        revision = main[0] if main else max(repo.revisions, key=lambda r: r.last_modified)
        path = Path(revision.snapshot_path)
        if is_model_dir(path):
            found.append(LocalModel(repo.repo_id, model_format(path), revision.size_on_disk, path))
    return sorted(found, key=lambda m: m.name.lower())


# -- pulling -------------------------------------------------------------------------------


class PullError(Exception):
    """Why a download failed, in one line for a person."""


def pull(repo_id: str, revision: str | None = None) -> Path:
    """Downloads a model repo into the hub cache (huggingface_hub's progress
    bars on stderr) and returns its snapshot directory."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    if not is_hub_id(repo_id):
        raise PullError(f"{repo_id!r} is not a Hugging Face model id (ORG/NAME, e.g. mlx-community/Qwen3-0.6B-4bit)")
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=PULL_PATTERNS))
    except RevisionNotFoundError:
        raise PullError(f"{repo_id} has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise PullError(f"{repo_id} is not on {constants.ENDPOINT}, or is private or gated (log in with `hf auth login`)") from None
    except LocalEntryNotFoundError as exc:
        where = f"and it is not in the Hugging Face cache ({constants.HF_HUB_CACHE})"
        if constants.HF_HUB_OFFLINE:
            raise PullError(f"offline (HF_HUB_OFFLINE is set) {where}") from None
        why = exc.__cause__ or exc.__context__
        reason = f"{type(why).__name__}: {why}" if why is not None else str(exc).splitlines()[0]
        raise PullError(f"cannot reach {constants.ENDPOINT} ({one_line(reason)}) {where}") from None
    except HFValidationError as exc:
        raise PullError(one_line(str(exc))) from None
    except OSError as exc:
        raise PullError(f"cannot write into {constants.HF_HUB_CACHE}: {exc.strerror or exc}") from None


def one_line(text: str) -> str:
    return " ".join(text.split())


def short_path(path: Path) -> str:
    home = str(Path.home())
    text = str(path)
    return "~" + text[len(home) :] if text.startswith(home + os.sep) else text
