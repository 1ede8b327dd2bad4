"""Which models HTTP clients may name, and `/v1/models`.

An HTTP client may name any model the pool can resolve, as a stdin client
may, except paths on the pool's machine: configured names, directories in
the model cache, Hugging Face ids in the local hub cache (and `demo` when
the pool serves the demo model). `http_models = "configured"` narrows that
to configured names. `/v1/models` lists what may be named: configured
names first, then the model cache's directories, then the hub cache's
models, each with the pool's state for it.
"""

from __future__ import annotations

import asyncio

from ipc.context import read_context_limit
from ipc.events import BAD_REQUEST, UNKNOWN_MODEL
from supervisor.httpapi.shapes import HttpError
from supervisor.httpapi.tools import TemplateInfo, template_info
from supervisor.local_models import cache_models, hub_models
from supervisor.pool import Pool
from supervisor.resolve import UnknownModel

# What GET /v1/models lists at most: a hub cache of thousands of repos
# must not make one answer (and its scan) without bound.
MAX_LISTED = 1000


def model_name(pool: Pool, value: object) -> str:
    """The name a body's `model` means, once it is known to resolve; an
    HttpError (404 `unknown_model`, 400) otherwise."""
    if value is None:
        name = pool.default_model()
        if name is None:
            raise HttpError(400, f'no "model" given and no default: {len(pool.config.models)} models are configured', code=BAD_REQUEST, param="model")
        return name
    if not isinstance(value, str):
        raise HttpError(400, "model must be a string", code=BAD_REQUEST, param="model")
    if pool.configured(value) is not None:
        return value
    if pool.config.http_models == "configured":
        raise HttpError(404, f"model {value!r} is not configured; GET /v1/models lists the models", code=UNKNOWN_MODEL, param="model")
    try:
        pool.resolve(value, paths=False)
    except UnknownModel as exc:
        raise HttpError(404, f"{exc}; GET /v1/models lists the models", code=UNKNOWN_MODEL, param="model") from None
    return value


def model_object(pool: Pool, name: str, source: str) -> dict:
    try:
        spec = pool.resolve(name, paths=False)
    except UnknownModel:  # a path that broke; its requests say why
        return {"id": name, "object": "model", "created": 0, "owned_by": "lattice-pool", "loaded": False, "state": "failed", "source": source}
    running = pool.model_state(spec)
    if running.worker is not None:
        context = running.max_context
    elif source == "configured":
        context = spec.max_context or read_context_limit(spec.path)
    else:  # not read for every model on disk: /v1/models answers from the loop
        context = None
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "lattice-pool",
        "loaded": running.loaded,
        "state": running.state,
        "source": source,
        "max_context": context,
        # "chat" or "embedding": which routes take it (/v1/chat/completions
        # or /v1/embeddings).
        "kind": spec.kind,
    }


def _local(pool: Pool) -> list[tuple[str, str]]:
    """(name, source) of the models on disk; runs in a thread (it reads
    directories and imports huggingface_hub)."""
    found = [(m.name, "cache") for m in cache_models(pool.model_cache)]
    found += [(m.name, "hub") for m in hub_models()]
    return found


async def list_models(pool: Pool) -> list[dict]:
    names = [(entry.name, "configured") for entry in pool.config.models]
    if pool.config.http_models != "configured":
        names += await asyncio.to_thread(_local, pool)
    seen: set[str] = set()
    data = []
    for name, source in names:
        if name in seen or len(data) >= MAX_LISTED:
            continue
        seen.add(name)
        data.append(model_object(pool, name, source))
    return data


def one_model(pool: Pool, name: str) -> dict:
    """GET /v1/models/NAME."""
    name = model_name(pool, name)
    return model_object(pool, name, "configured" if pool.configured(name) is not None else "local")


def chat_template(pool: Pool, name: str) -> TemplateInfo:
    """What the chat template of the model `name` (already checked by
    model_name) does with tools; its configured `tool_parser` wins."""
    spec = pool.resolve(name)
    entry = pool.configured(name)
    return template_info(spec.tokenizer_dir or spec.path, entry.tool_parser if entry is not None else None)
