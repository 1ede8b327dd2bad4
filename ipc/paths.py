"""The pool's directory in the user's cache: the supervisor keeps the demo
model there and workers keep mlx's compiled CUDA kernels, by one rule."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path


def pool_cache_dir(env: Mapping[str, str]) -> Path:
    """`$XDG_CACHE_HOME/lattice-pool`, else `~/.cache/lattice-pool`. A
    relative XDG_CACHE_HOME is ignored, as the XDG spec says: it would move
    with the working directory."""
    base = Path(env.get("XDG_CACHE_HOME") or "").expanduser()
    if not base.is_absolute():
        base = Path.home() / ".cache"
    return base / "lattice-pool"
