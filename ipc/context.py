"""A model's context limit, read from its config.json by one rule on both
sides: the worker refuses requests past it, the pool shows it (status, ps,
/v1/models) before the worker has started."""

from __future__ import annotations

import json
from pathlib import Path

# Rope scalings that stretch the positions a model was trained on by
# `factor`; others (llama3, longrope, default) already state the extended
# length in max_position_embeddings.
_STRETCHING = frozenset({"yarn", "linear", "dynamic"})


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def context_limit(config: dict) -> int | None:
    """Tokens a sequence may hold (prompt and generated ones), from a
    model's config: `max_position_embeddings` (top level or `text_config`),
    stretched by a yarn/linear/dynamic rope scaling's `factor` over the
    length it says the model was trained on; None when the config names none."""
    for section in (config, config.get("text_config")):
        if not isinstance(section, dict):
            continue
        limit = _int(section.get("max_position_embeddings"))
        if limit is None:
            continue
        scaling = section.get("rope_scaling") or section.get("rope_parameters")
        if isinstance(scaling, dict):
            kind = scaling.get("rope_type") or scaling.get("type")
            factor = scaling.get("factor")
            if kind in _STRETCHING and isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor > 1:
                trained = _int(scaling.get("original_max_position_embeddings")) or limit
                limit = max(limit, int(trained * factor))
        return limit
    return None


def read_context_limit(model_dir: Path) -> int | None:
    """context_limit of a model dir's config.json; None when it cannot be read."""
    try:
        config = json.loads((model_dir / "config.json").read_text("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return context_limit(config) if isinstance(config, dict) else None
