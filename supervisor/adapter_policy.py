"""Which adapters a request's `lora` may name: a policy, not a door.

A request's `lora` is client text that would otherwise become a file the
pool reads, watches and names in its answers. It may name:

- a configured adapter: by the name of a `[[models]]` entry that has a
  `lora`, or by that `lora` as the config writes it (or its full path);
- on stdin and the control socket (and over HTTP only with
  `http_adapters = "adapter_dirs"`), a regular file of at most
  `max_adapter_bytes` under one of the allowed roots (`adapter_dirs`,
  default `~/.lattice/adapters`, plus the directories of the configured
  adapters), or a directory there whose weights file is one.

Request text is never expanded (`~`, `$VAR`): that would hand the pool's
environment to whoever writes a request. Symlinks are followed before the
root check, so a link out of a root leads nowhere. Only `stat` is used:
nothing is opened, so a FIFO or a device cannot block, and nothing is read.
Every refusal says the same thing, whether the path is missing, outside the
roots, of another type or too large, so a refusal discloses nothing about
the file.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from supervisor.config import Config, parse_size

DEFAULT_ADAPTER_DIR = "~/.lattice/adapters"

# The weights files a directory adapter holds, in the order the worker
# looks for them (worker.lora.formats: PEFT's, then mlx-lm's).
DIRECTORY_WEIGHTS = ("adapter_model.safetensors", "adapters.safetensors")
# File stems that say nothing of the adapter: its directory names it.
_GENERIC_STEMS = frozenset({"adapter_model", "adapters", "adapter"})

# Client text longer than this is cut in the refusal: the answer stays small.
_QUOTE_CHARS = 120


class AdapterPolicy:
    def __init__(self, config: Config, expand: Callable[[str], Path]):
        self.max_bytes = parse_size(config.max_adapter_bytes)
        self.http_paths = config.http_adapters == "adapter_dirs"
        # Configured adapters, by every text a request may use for one.
        self.configured: dict[str, Path] = {}
        # A configured adapter's name (its first entry's), for labels.
        self._names: dict[Path, str] = {}
        roots = [DEFAULT_ADAPTER_DIR] if config.adapter_dirs is None else list(config.adapter_dirs)
        dirs: list[Path] = []
        for entry in config.models:
            if not entry.lora:
                continue
            try:
                path = expand(entry.lora)
            except (OSError, ValueError, RuntimeError):
                continue  # its model says why when it is used
            self.configured[entry.name] = path
            self.configured.setdefault(entry.lora, path)
            self.configured.setdefault(str(path), path)
            self._names.setdefault(path, entry.name)
            dirs.append(path.parent)
        found = [root for root in (_root(text, expand) for text in roots) if root is not None]
        self.roots: tuple[Path, ...] = tuple(dict.fromkeys([*found, *dirs]))

    def adapter(self, lora: str, *, paths: bool, check_file: bool = True) -> Path | None:
        """The adapter `lora` names, or None where the policy refuses it
        (`refusal` says why). `paths`: whether a file under the roots may
        be named (else configured adapters only); `check_file` False skips
        the file checks, for ops on a name already known (unload, reload)
        whose file may have gone meanwhile."""
        configured = self.configured.get(lora)
        if configured is not None:
            return configured
        return self._allowed_file(lora, check_file) if paths else None

    def name_of(self, lora: Path | str | None) -> str:
        """The adapter's name, for metric labels: its configured name, else
        its file's stem (its directory's name for a directory, or for a
        file named like every other adapter's); "" for none."""
        if not lora:
            return ""
        path = Path(lora)
        configured = self._names.get(path)
        if configured is not None:
            return configured
        stem = path.name.removesuffix(".safetensors")
        return path.parent.name if stem in _GENERIC_STEMS and path.parent.name else stem

    def _allowed_file(self, lora: str, check_file: bool) -> Path | None:
        try:
            path = Path(lora).resolve(strict=check_file)
        except (OSError, ValueError, RuntimeError):
            return None  # missing, a NUL byte, a loop, a name too long
        if not any(path.is_relative_to(root) for root in self.roots):
            return None
        if check_file and not self._regular_adapter(path):
            return None
        return path

    def _regular_adapter(self, path: Path) -> bool:
        try:
            st = os.stat(path)
            if stat.S_ISDIR(st.st_mode):
                # The weights file the worker would read, and only it.
                for name in DIRECTORY_WEIGHTS:
                    try:
                        st = os.stat(path / name)
                        break
                    except FileNotFoundError:
                        continue
                else:
                    return False
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and st.st_size <= self.max_bytes

    def refusal(self, lora: str, paths: bool) -> str:
        """The one answer to every refused `lora`: it names no property of the file."""
        quoted = repr(lora if len(lora) <= _QUOTE_CHARS else lora[:_QUOTE_CHARS] + "...")
        if not paths:
            return f"lora {quoted} is not a configured adapter: over HTTP, lora names the adapter of a configured model, by that model's name"
        return (
            f"lora {quoted} is not an adapter this pool serves: name a configured adapter, or a regular file "
            f"of at most max_adapter_bytes ({self.max_bytes} bytes) under adapter_dirs"
        )


def _root(text: str, expand: Callable[[str], Path]) -> Path | None:
    try:
        return expand(text)
    except (OSError, ValueError, RuntimeError):
        return None
