"""What an adapter is on disk, as the hot-reload watch compares it: its
files (worker.lora.formats reads them) and each file's identity, which a
save changes (a new inode, size or mtime)."""

from __future__ import annotations

import os
from pathlib import Path

from supervisor.adapter_policy import DIRECTORY_WEIGHTS

# A PEFT adapter given as its .safetensors file is configured by the JSON beside it.
_CONFIG_NAME = "adapter_config.json"

# (path, its identity) of each file of an adapter; identity None: missing.
Print = tuple[tuple[str, tuple | None], ...]


def adapter_files(adapter: str) -> list[Path]:
    """The files whose change changes what the worker reads for `adapter`
    (worker.lora.formats): a directory's weights files and config, or a
    weights file and, for .safetensors, the config beside it."""
    path = Path(adapter)
    if path.is_dir():
        return [path / name for name in (*DIRECTORY_WEIGHTS, _CONFIG_NAME)]
    if path.suffix == ".safetensors":
        return [path, path.parent / _CONFIG_NAME]
    return [path]


def _identity(path: Path) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode)


def fingerprint(adapter: str) -> Print:
    return tuple((str(f), _identity(f)) for f in adapter_files(adapter))
