"""Which model directory a request's `model` field means."""

from __future__ import annotations

import os
from pathlib import Path

from ipc.group import HostSpec, encode_hosts
from ipc.paths import pool_cache_dir
from supervisor.adapter_policy import AdapterPolicy
from supervisor.config import Config, ModelEntry, parse_duration, parse_size
from supervisor.local_models import hub_snapshot, is_hub_id, is_model_dir, lmstudio_dir
from supervisor.spec import GroupSpec, ModelSpec


class UnknownModel(Exception):
    pass


class AdapterRefused(UnknownModel):
    """A `lora` the adapter policy refuses: a bad_request, not an unknown model."""


def group_of(entry: ModelEntry) -> GroupSpec | None:
    """The GroupSpec of an entry run on more than one rank."""
    if entry.ranks == 1:
        return None
    hosts = None if entry.hosts is None else encode_hosts([h if isinstance(h, HostSpec) else HostSpec(ssh=h) for h in entry.hosts])
    return GroupSpec(entry.ranks, hosts, entry.parallel, entry.backend, entry.port, entry.split_vocab)


def draft_of(entry: ModelEntry) -> dict:
    """The ModelSpec fields of an entry's `draft`."""
    draft = entry.draft
    if draft is None:
        return {}
    if isinstance(draft, str):
        return {"draft": draft}
    return {"draft": str(expand(draft.model)), "draft_tokens": draft.tokens}


def expand(path: str) -> Path:
    return Path(os.path.expandvars(path)).expanduser().resolve()


def model_cache_dir(config: Config) -> Path:
    env = os.environ.get("LATTICE_MODEL_CACHE")
    return expand(env if env else config.model_cache)


class Resolver:
    def __init__(self, config: Config):
        self.config = config
        self.cache = model_cache_dir(config)
        # Names and aliases alike (the config keeps them all distinct).
        self.by_name: dict[str, ModelEntry] = {n: m for m in config.models for n in (m.name, *m.aliases)}
        self.default_keep_alive = parse_duration(config.keep_alive)
        self.adapters = AdapterPolicy(config, expand)
        # A configured model keeps the paths it first resolved to: its worker
        # stays the same one when a path on disk later breaks (a symlink
        # turned into a loop), and goes on with what it has loaded.
        self._configured: dict[str, ModelSpec] = {}
        # Hub ids found in the HF cache, by id: each request for one costs
        # no look-up, and it keeps its snapshot (and worker) when a later
        # `pull` moves refs/main. Bounded by what the cache holds.
        self._hub: dict[str, Path] = {}

    def _from_entry(self, entry: ModelEntry, lora: Path | None) -> ModelSpec:
        if lora is not None:
            return self._entry_spec(entry, lora)
        spec = self._configured.get(entry.name)
        if spec is None:
            spec = self._configured[entry.name] = self._entry_spec(entry, None)
        return spec

    def _entry_spec(self, entry: ModelEntry, lora: Path | None) -> ModelSpec:
        keep = parse_duration(entry.keep_alive) if entry.keep_alive is not None else self.default_keep_alive
        adapter = lora if lora is not None else (expand(entry.lora) if entry.lora else None)
        return ModelSpec(
            name=entry.name,
            path=expand(entry.path),
            lora=adapter,
            tokenizer_dir=expand(entry.tokenizer_dir) if entry.tokenizer_dir else None,
            keep_alive=keep,
            max_batch=entry.max_batch if entry.max_batch is not None else self.config.max_batch,
            max_adapters=entry.max_adapters if entry.max_adapters is not None else self.config.max_adapters,
            group=group_of(entry),
            **draft_of(entry),
            max_context=entry.max_context,
            prefix_disk_bytes=parse_size(entry.prefix_cache_disk_bytes),
            kv=(entry.kv_bits, entry.kv_group_size, entry.quantized_kv_start) if entry.kv_bits is not None else None,
            warm_prompts=tuple(("text", w) if isinstance(w, str) else ("file", str(expand(w.file))) for w in entry.warm_prompts),
            kind=entry.kind,
        )

    def default_ref(self) -> str | None:
        if self.config.default_model is not None:
            return self.config.default_model
        if len(self.config.models) == 1:
            return self.config.models[0].name
        return None

    def resolve(self, ref: str | None, lora: str | None = None, *, paths: bool = True, lora_paths: bool | None = None, check_lora: bool = True) -> ModelSpec:
        """A configured name, a directory under the model cache, a Hugging
        Face id in the local HF cache, or (unless `paths` is False: what an
        HTTP client names) a path; with the adapter `lora` names where the
        adapter policy allows it, else AdapterRefused.
        lora_paths: whether `lora` may name a file under adapter_dirs (None:
        as for an HTTP request); check_lora: AdapterPolicy.adapter's
        check_file."""
        adapter = None
        if lora:
            allowed = self.adapters.http_paths if lora_paths is None else lora_paths
            adapter = self.adapters.adapter(lora, paths=allowed, check_file=check_lora)
            if adapter is None:
                raise AdapterRefused(self.adapters.refusal(lora, allowed))
        try:
            return self._resolve(ref, adapter, paths)
        except (OSError, ValueError, RuntimeError) as exc:
            # Client text becomes a path here: a NUL byte, an over-long name or
            # a symlink loop (RuntimeError from Path.resolve before Python
            # 3.13) is a bad reference, not a reason for the endpoint to fail.
            what = (f"model {ref!r}" if ref is not None else "the default model") + (f" with lora {lora!r}" if lora is not None else "")
            raise UnknownModel(f"{what} is not a usable path: {exc}") from exc

    def _resolve(self, ref: str | None, adapter: Path | None, paths: bool) -> ModelSpec:
        if ref is None:
            ref = self.default_ref()
            if ref is None:
                count = len(self.config.models)
                raise UnknownModel(f'no "model" given and no default: {count} models are configured, set "model" or default_model')
        entry = self.by_name.get(ref)
        if entry is not None:
            return self._from_entry(entry, adapter)
        if "/" not in ref and ref not in (".", ".."):
            cached = self.cache / ref
            if cached.is_dir():
                return self._unconfigured(ref, cached.resolve(), adapter)
        snapshot = self._hub_snapshot(ref)
        if snapshot is not None:
            return self._unconfigured(ref, snapshot, adapter)
        found = self._lmstudio(ref) or self._demo(ref)
        if found is not None:
            return self._unconfigured(ref, found, adapter)
        candidate = expand(ref) if paths else None
        if candidate is not None and ("/" in ref or ref.startswith("~")) and candidate.is_dir():
            return self._unconfigured(ref, candidate, adapter)
        known = ", ".join(sorted(self.by_name)) or "none configured"
        hub = ", not in the Hugging Face cache (lattice-pool pull ORG/NAME fetches one)" if is_hub_id(ref) else ""
        path = ", not a model path" if paths else ""
        raise UnknownModel(f"unknown model {ref!r}: not a configured name ({known}), not a directory in {self.cache}{hub}{path}")

    @staticmethod
    def _lmstudio(ref: str) -> Path | None:
        """`publisher/model` in LM Studio's model directory."""
        path = lmstudio_dir() / ref if is_hub_id(ref) else None
        return path.resolve() if path is not None and is_model_dir(path) else None

    @staticmethod
    def _demo(ref: str) -> Path | None:
        """`demo`: the built-in demo model, once generated (supervisor.demo)."""
        path = pool_cache_dir(os.environ) / "demo-model"
        return path if ref == "demo" and is_model_dir(path) else None

    def _unconfigured(self, ref: str, path: Path, adapter: Path | None) -> ModelSpec:
        """A model found on disk rather than in the config: the pool's settings."""
        return ModelSpec(
            name=ref, path=path, lora=adapter, keep_alive=self.default_keep_alive, max_batch=self.config.max_batch, max_adapters=self.config.max_adapters
        )

    def _hub_snapshot(self, ref: str) -> Path | None:
        path = self._hub.get(ref)
        if path is None and is_hub_id(ref):
            path = hub_snapshot(ref)
            if path is not None:
                path = self._hub[ref] = path.resolve()
        return path
