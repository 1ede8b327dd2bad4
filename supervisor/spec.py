"""What a model name stands for, as plain values: the base model, its
adapter and the worker's settings. Every part of the supervisor passes these
around, so this module imports nothing of the supervisor; the resolver
builds them from the config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ipc.messages import AUTO_MAX_BATCH, DEFAULT_MAX_ADAPTERS


@dataclass(frozen=True)
class GroupSpec:
    """A model run as one MLX distributed group of `ranks` processes."""

    ranks: int
    # The worker's --hosts (JSON): a string, so that the spec stays hashable
    # (it is part of the worker's key).
    hosts: str | None
    parallel: str | None
    backend: str
    port: int | None
    split_vocab: bool


@dataclass(frozen=True)
class ModelSpec:
    """A name for a (base model, adapter) pair. Names whose `key` is equal
    share one worker (docs/adapters.md); `name_key` tells the names apart."""

    name: str
    path: Path
    lora: Path | None = None
    tokenizer_dir: Path | None = None
    keep_alive: float | None = None
    max_batch: int | str = AUTO_MAX_BATCH  # a number or "auto"
    max_adapters: int = DEFAULT_MAX_ADAPTERS
    group: GroupSpec | None = None
    # Speculative decoding: "ngram" or a draft model's directory, and the
    # most tokens drafted per step.
    draft: str | None = None
    draft_tokens: int = 4
    max_context: int | None = None  # None: the model config's
    prefix_disk_bytes: int | None = None  # None: the pool's prefix_cache_disk_bytes
    # ("text", TEXT) or ("file", PATH) per warm prompt.
    warm_prompts: tuple[tuple[str, str], ...] = ()
    kv: tuple[int, int, int] | None = None  # (kv_bits, kv_group_size, quantized_kv_start); None: the model's dtype
    # "chat" or "embedding": which requests the name takes. Not part of the
    # worker's key: a worker computes both, so a chat name and an embedding
    # name of one model share it.
    kind: str = "chat"

    @property
    def key(self) -> tuple:
        """The worker: its base model and everything on its command line."""
        return (
            self.path,
            self.tokenizer_dir,
            self.max_batch,
            self.max_adapters,
            self.group,
            self.draft,
            self.draft_tokens,
            self.max_context,
            self.prefix_disk_bytes,
            self.warm_prompts,
            self.kv,
        )

    @property
    def name_key(self) -> tuple[str, Path | None]:
        return (self.name, self.lora)
