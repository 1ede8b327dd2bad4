"""One model in one process: see docs/architecture.md for its parts.

mlx-lm's package `__init__` imports its converter, which imports
transformers and huggingface_hub: about 1.5 s of CPU at every worker start
(three quarters of a small model's start), for names the worker never
uses. The worker needs only mlx-lm's submodules (the architectures, the
caches), which Python can import without running the package's
`__init__`. So the package is put in `sys.modules` unexecuted, and its
`__init__` runs the first time anything asks for one of its top-level
names (`from mlx_lm import load` in a benchmark, say), so nothing is lost
for code that wants them."""

from __future__ import annotations

import importlib.util
import sys


def _defer_mlx_lm_init() -> None:
    if "mlx_lm" in sys.modules:
        return
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return
    package = importlib.util.module_from_spec(spec)

    def __getattr__(name: str):
        # Dunder probes (copy, pickle, inspect) must not trigger the import.
        if name.startswith("__"):
            raise AttributeError(name)
        del package.__getattr__
        spec.loader.exec_module(package)
        try:
            return package.__dict__[name]
        except KeyError:
            raise AttributeError(f"module 'mlx_lm' has no attribute {name!r}") from None

    package.__getattr__ = __getattr__
    sys.modules["mlx_lm"] = package


_defer_mlx_lm_init()
