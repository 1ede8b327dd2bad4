"""Swapping a function mlx-lm's model files call, for one model's modules.

mlx-lm's model files import their helpers by name (`from .base import
scaled_dot_product_attention`, `from .gated_delta import
gated_delta_update`), so a replacement has to be bound in each module that
looks the name up; mlx-lm's files stay untouched.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


def rebind(model, name: str, replacement: Callable, replaces: Callable[[object], bool]) -> int:
    """Binds `name` to `replacement` in every module defining one of the
    model's layers whose current binding `replaces` accepts; returns how many
    modules were rebound."""
    rebound = 0
    for module_name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(module_name)
        if module is not None and replaces(getattr(module, name, None)):
            setattr(module, name, replacement)
            rebound += 1
    return rebound
