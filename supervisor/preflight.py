"""Checks made before any model loads, so that what is wrong on the command
line or in the config is said at start, in one line each, rather than by a
worker that fails after a model has loaded (or by a first request)."""

from __future__ import annotations

from supervisor.config import Config
from supervisor.resolve import expand

# What a LoRA adapter directory holds (worker/lora/formats.py reads them).
ADAPTER_FILES = ("adapters.safetensors", "adapter_model.safetensors")


def config_paths(config: Config) -> list[str]:
    """Each configured model whose `path` or `tokenizer_dir` is not a
    directory now, unless its entry says it may appear later (`optional`).
    (Rank 0 of a model split over hosts runs here, so its path is here too.)
    A configured `lora` may appear later by design: it is watched."""
    problems = []
    for entry in config.models:
        if entry.optional:
            continue
        for key in ("path", "tokenizer_dir"):
            value = getattr(entry, key)
            if value is None:
                continue
            try:
                where = expand(value)
                found = where.is_dir()
                why = "not a directory" if where.exists() else "no such directory"
            except (OSError, ValueError, RuntimeError) as exc:
                found, why = False, str(exc)
            if not found:
                problems.append(f"model {entry.name!r}: {key} {value}: {why} (`optional = true` in its [[models]] entry allows a path that appears later)")
    return sorted(problems)


def lora_problem(value: str) -> str | None:
    """Why the adapter at `value` (a file, or a directory of one) cannot be
    read, or None. Its shape is checked by the worker against the model."""
    try:
        path = expand(value)
        if path.is_dir():
            if not any((path / name).is_file() for name in ADAPTER_FILES):
                return f"--lora {value}: a directory without {' or '.join(ADAPTER_FILES)}"
            return None
        if not path.exists():
            return f"--lora {value}: no such file or directory"
        with open(path, "rb") as f:
            f.read(1)
    except OSError as exc:
        return f"--lora {value}: {exc.strerror or exc}"
    except (ValueError, RuntimeError) as exc:
        return f"--lora {value}: {exc}"
    return None


def schema_problem(schema: dict) -> str | None:
    """Why llguidance (the worker's grammar compiler) refuses a JSON Schema,
    or None; the same compile the worker runs, without a tokenizer."""
    import llguidance  # only when a schema is given

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        error = llguidance.LLMatcher.validate_grammar(grammar, None)
    except (ValueError, TypeError, RecursionError) as exc:
        error = str(exc)
    return error or None
