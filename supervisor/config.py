"""The pool's configuration: `configs/*.toml`, decoded with msgspec.

Unknown or mistyped keys are errors that name the key and the file, because
a silently ignored typo (`keep_alvie`) is worse than a refusal to start.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from ipc.group import HostSpec
from ipc.messages import AUTO_MAX_BATCH, DEFAULT_MAX_ADAPTER_BYTES, DEFAULT_MAX_ADAPTERS, DEFAULT_MAX_PROMPT_BYTES, MAX_ADAPTERS_LIMIT, MAX_WAITING
from ipc.sampling import SamplingFields

Duration = str | int | float
Size = str | int
# Requests in flight at one worker: the pool never sends more than the
# worker's waiting line holds. "auto": the worker sizes it from its device's
# free memory and a row's cache (worker.runtime.batch_size).
MaxBatch = Annotated[int, Meta(ge=1, le=MAX_WAITING)] | Literal["auto"]
# LoRA adapters one worker keeps in memory (docs/adapters.md).
MaxAdapters = Annotated[int, Meta(ge=1, le=MAX_ADAPTERS_LIMIT)]


class ConfigError(Exception):
    pass


class GenerationDefaults(SamplingFields, forbid_unknown_fields=True):
    """Pool-wide defaults for fields a request leaves out (chat_metal's
    otherwise): the sampling fields, bounded as a request's are, since a
    default ends up in requests."""

    allow_special_tokens: bool | None = None


class DraftModel(msgspec.Struct, forbid_unknown_fields=True):
    """`draft = { model = PATH, tokens = K }`: a small model with the same
    tokenizer drafts up to K tokens a step."""

    model: str
    tokens: Annotated[int, Meta(ge=1, le=32)] = 4


class WarmFile(msgspec.Struct, forbid_unknown_fields=True):
    """A warm prompt read from a file: `{ file = "~/agent/system.txt" }`."""

    file: str


# A warm prompt given inline travels on the worker's command line, where
# Linux takes at most 128 KiB per argument; longer ones go in a file.
MAX_WARM_TEXT = 64 * 1024


class ModelEntry(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    path: str
    # Other names that mean this model (an agent asking for a hosted model
    # by its name, say): each resolves to this entry and its one worker.
    aliases: Annotated[list[Annotated[str, Meta(min_length=1, max_length=200)]], Meta(max_length=64)] = []
    # What the name serves: "chat" (generation) or "embedding" (vectors:
    # /v1/embeddings, Ollama's /api/embed, the `embed` op; docs/http.md).
    kind: Literal["chat", "embedding"] = "chat"
    lora: str | None = None
    tokenizer_dir: str | None = None
    preload: bool = False
    keep_alive: Duration | None = None
    max_batch: MaxBatch | None = None
    max_adapters: MaxAdapters | None = None
    # One model over several processes or machines (docs/scaling.md).
    ranks: Annotated[int, Meta(ge=1, le=256)] = 1
    hosts: list[str | HostSpec] | None = None
    parallel: Literal["pipeline", "tensor"] | None = None
    backend: Literal["ring", "jaccl", "jaccl-ring", "nccl"] = "ring"
    port: Annotated[int, Meta(ge=1, le=65535)] | None = None
    # False keeps the embedding and LM head whole on every rank: more memory
    # per rank, no logits between ranks at each token (docs/scaling.md).
    split_vocab: bool = True
    # True: `path` may appear after the pool starts (a volume mounted later,
    # a download in progress); otherwise a missing path refuses the start.
    optional: bool = False
    # Speculative decoding (docs/engine.md): "ngram" (prompt lookup), "mtp"
    # (the checkpoint's own MTP head), or a draft model with the same tokenizer.
    draft: Literal["ngram", "mtp"] | DraftModel | None = None
    # Tokens a request's prompt and reply may take together (default: the
    # model config's max_position_embeddings with its rope scaling).
    max_context: Annotated[int, Meta(ge=2)] | None = None
    # Overrides the pool's prefix_cache_disk_bytes for this model.
    prefix_cache_disk_bytes: Size | None = None
    # How the model writes tool calls (docs/http.md, "Tool calls"); unset,
    # it is read from the chat template.
    tool_parser: Literal["qwen3", "qwen3_coder", "llama3_json", "mistral", "gemma", "deepseek"] | None = None
    # Prompt prefixes (ChatML text, or { file = PATH }) prefilled when the
    # worker starts and kept in its prefix cache (docs/context.md).
    warm_prompts: list[str | WarmFile] = []
    # Attention caches quantized to this many bits (docs/context.md), in
    # groups of kv_group_size values (a divisor of the head dimension).
    kv_bits: Literal[4, 8] | None = None
    kv_group_size: Literal[32, 64, 128] = 64
    # A row's attention cache stays in the model's dtype until it holds this
    # many tokens (0: quantized from the first; docs/context.md says why).
    quantized_kv_start: Annotated[int, Meta(ge=0)] = 0

    def __post_init__(self) -> None:
        if self.draft is not None and self.ranks > 1:
            raise ValueError(f"model {self.name!r}: speculative decoding (draft) does not run on a model split over ranks")
        parse_size(self.prefix_cache_disk_bytes)
        if self.quantized_kv_start and self.kv_bits is None:
            raise ValueError(f"model {self.name!r}: quantized_kv_start is set without kv_bits")
        if (self.kv_bits is not None or self.warm_prompts) and self.ranks > 1:
            raise ValueError(f"model {self.name!r}: kv_bits and warm_prompts are for a model in one process (ranks = 1)")
        for text in self.warm_prompts:
            if isinstance(text, str) and len(text.encode("utf-8", "surrogatepass")) > MAX_WARM_TEXT:
                raise ValueError(f"model {self.name!r}: a warm prompt over {MAX_WARM_TEXT} bytes goes in a file: {{ file = PATH }}")
        if self.ranks == 1:
            given = [k for k in ("hosts", "parallel", "port") if getattr(self, k) is not None]
            given += (["backend"] if self.backend != "ring" else []) + (["split_vocab"] if not self.split_vocab else [])
            if given:
                raise ValueError(f"model {self.name!r}: {', '.join(given)} set with ranks = 1; they apply to ranks > 1 only")
            return
        if self.lora is not None:
            raise ValueError(f"model {self.name!r}: a model split over ranks takes no lora")
        if self.hosts is not None and len(self.hosts) != self.ranks:
            raise ValueError(f"model {self.name!r}: {len(self.hosts)} hosts for ranks = {self.ranks}; give one host per rank")


class Config(msgspec.Struct, forbid_unknown_fields=True):
    model_cache: str = "~/.lattice/models"
    default_model: str | None = None
    max_loaded: Annotated[int, Meta(ge=1)] | None = None
    memory_budget: Size | None = None
    keep_alive: Duration | None = None
    stall_timeout: Annotated[float, Meta(gt=0)] = 120.0
    shutdown_grace: Annotated[float, Meta(ge=0)] = 30.0
    heartbeat_interval: Annotated[float, Meta(gt=0)] = 2.0
    stats_interval: Duration | None = None
    prefix_cache_bytes: Size | None = None
    # The prefix cache's files under the pool's cache dir, which outlive
    # workers and the pool (docs/context.md); unset: min(30 GiB, a quarter
    # of the free disk space), 0: memory only.
    prefix_cache_disk_bytes: Size | None = None
    # How long an idle worker keeps MLX's cache of freed buffers for its
    # next request before handing it back; "never" keeps it. On a GPU a
    # request that finds the cache empty allocates every buffer anew
    # (docs/engine.md).
    idle_release: Duration = "60s"
    # Decode steps replay a compiled graph (mx.compile) for rows without an
    # adapter; false builds every step op by op, as mlx-lm does.
    compile_decode: bool = True
    # Threads a worker fills structured-output token masks with (unset: a
    # quarter of the cores, 1 to 4; docs/structured-output.md).
    mask_threads: Annotated[int, Meta(ge=1, le=64)] | None = None
    # Requests decoded together by one worker; more wait in the pool, first
    # in first out. A [[models]] entry may set its own.
    max_batch: MaxBatch = AUTO_MAX_BATCH
    # Adapters one worker keeps in memory, least recently used out. A
    # [[models]] entry may set its own; entries that share a model path
    # share one worker when their tokenizer_dir, max_batch and max_adapters
    # agree, and max_context, prefix_cache_disk_bytes and warm_prompts
    # (supervisor.spec.ModelSpec.key).
    max_adapters: MaxAdapters = DEFAULT_MAX_ADAPTERS
    # Names one worker serves (configured ones and those requests name with
    # a `lora`). Beyond it the least recently used name with no request
    # queued or running leaves the worker, so a client naming adapter after
    # adapter cannot grow the pool's tables (and adapter watches) for ever.
    max_names: Annotated[int, Meta(ge=1)] = 64
    # Prometheus metrics on 127.0.0.1:PORT; 0 picks a free port (logged).
    metrics_port: Annotated[int, Meta(ge=0, le=65535)] | None = None
    # True: the default path (supervisor.control.default_socket_path); a
    # string: that path; False: no control socket.
    control_socket: str | bool = True
    # Bounds on what a client can make the pool hold (configs/example.toml).
    max_queued: Annotated[int, Meta(ge=1)] = 256
    max_queued_total: Annotated[int, Meta(ge=1)] = 1024
    max_prompt_bytes: Size = DEFAULT_MAX_PROMPT_BYTES
    max_adapter_bytes: Size = DEFAULT_MAX_ADAPTER_BYTES
    # Where a request's `lora` may name adapter files (unset: ~/.lattice/
    # adapters), besides the configured adapters and their directories
    # (supervisor.adapter_policy).
    adapter_dirs: list[str] | None = None
    # What an HTTP request's `lora` may name: the configured adapters only,
    # or files under adapter_dirs too, as on stdin.
    http_adapters: Literal["configured", "adapter_dirs"] = "configured"
    max_control_clients: Annotated[int, Meta(ge=1)] = 32
    control_idle_timeout: Duration | None = "5m"
    # An op line on the control socket, and a request to /metrics, must
    # arrive whole within this long of its first byte.
    control_request_timeout: Duration = "10s"
    max_metrics_connections: Annotated[int, Meta(ge=1)] = 8
    metrics_request_timeout: Duration = "10s"
    # The OpenAI-compatible HTTP surface (docs/http.md): "HOST:PORT" or
    # "PORT" (on 127.0.0.1); port 0 picks a free port (logged). A host
    # that is not loopback needs api_key (or $LATTICE_API_KEY).
    http: str | None = None
    api_key: str | None = None
    max_http_connections: Annotated[int, Meta(ge=1)] = 128
    max_http_body_bytes: Size = "8MiB"
    http_stream_buffer: Size = "256KiB"
    http_idle_timeout: Duration = "30s"
    # A request's head and body must arrive whole within this long of its
    # first byte, however it trickles in.
    http_request_timeout: Duration = "60s"
    # Web pages (their Origin, e.g. "http://localhost:3000") allowed to
    # call a pool without an API key; none by default.
    http_allowed_origins: list[str] = []
    # Which `model` values HTTP clients may name: "any" model the pool can
    # resolve except paths (configured names, model-cache dirs, Hugging Face
    # cache ids), or "configured" names only, for a machine shared with
    # people who should not load whatever is on its disk.
    http_models: Literal["any", "configured"] = "any"
    defaults: GenerationDefaults = msgspec.field(default_factory=GenerationDefaults)
    models: list[ModelEntry] = []

    def __post_init__(self) -> None:
        names = [n for m in self.models for n in (m.name, *m.aliases)]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"model names and aliases must be unique; repeated: {', '.join(dupes)}")
        # Parse once so a bad value fails at start-up, not at first use.
        parse_size(self.memory_budget)
        parse_size(self.prefix_cache_bytes)
        parse_size(self.prefix_cache_disk_bytes)
        if self.http is not None:
            split_address(self.http)
        for name in ("max_prompt_bytes", "max_adapter_bytes", "max_http_body_bytes", "http_stream_buffer"):
            if parse_size(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be at least 1 byte")
        for value in (self.keep_alive, self.stats_interval, self.control_idle_timeout, self.idle_release, *(m.keep_alive for m in self.models)):
            parse_duration(value)
        for name in ("http_idle_timeout", "http_request_timeout", "control_request_timeout", "metrics_request_timeout"):
            if parse_duration(getattr(self, name)) is None:
                raise ValueError(f"{name} must be a duration: a connection is never kept waiting forever")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is blank: give a key, or leave api_key out")


def split_address(text: str) -> tuple[str, int]:
    """("127.0.0.1", 8080) from "127.0.0.1:8080", "[::1]:8080", "localhost:8080" or "8080"."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host = "127.0.0.1"
    elif host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"http: not HOST:PORT: {text!r} (e.g. '127.0.0.1:8080')")
    return host, int(port)


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}


def parse_size(value: Size | None) -> int | None:
    """Bytes from 12884901888, "12GiB", "512 MB"."""
    if value is None or isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {value!r} (use bytes or e.g. '12GiB', '512MB')")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_duration(value: Duration | None) -> float | None:
    """Seconds from 300, 2.5, "5m", "1h30m", "250ms"; None or a negative
    number means never (Ollama's keep_alive convention)."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return None if value < 0 else float(value)
    text = value.strip().lower()
    if text in ("never", "-1", "inf"):
        return None
    if text == "0":
        return 0.0  # Go's time.ParseDuration, which Ollama's clients follow, takes a bare 0
    if text.startswith("-"):
        # A negative duration ("-1m"): never, as Ollama reads it.
        parse_duration(text[1:])
        return None
    parts = re.findall(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)", text)
    if not parts or "".join(n + u for n, u in parts) != text.replace(" ", ""):
        raise ValueError(f"not a duration: {value!r} (use seconds or e.g. '30s', '5m', '1h')")
    return sum(float(n) * _SECONDS[u] for n, u in parts)


def _describe(exc: msgspec.ValidationError) -> str:
    text = str(exc)
    where = ""
    if " - at `$" in text:
        text, where = text.split(" - at `$", 1)
        where = where.rstrip("`").lstrip(".")
    unknown = re.fullmatch(r"Object contains unknown field `(.+)`", text)
    if unknown:
        place = f" in [{where}]" if where else ""
        return f"unknown key `{unknown.group(1)}`{place}"
    missing = re.fullmatch(r"Object missing required field `(.+)`", text)
    if missing:
        return f"missing key `{missing.group(1)}`" + (f" in [{where}]" if where else "")
    return f"key `{where}`: {text}" if where else text


def validate(config: Config) -> Config:
    """The checks of a config file, run again on a config that flags have
    changed since it was decoded (msgspec checks ranges only on decode)."""
    try:
        return msgspec.convert(msgspec.to_builtins(config), Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(_describe(exc)) from exc


def _unknown_keys(raw: object) -> list[str]:
    """Every key the config's tables do not know, each with the nearest
    known one: all of them at once, where the decoder stops at the first."""
    found: list[str] = []

    def check(table: object, struct: type, where: str) -> None:
        if not isinstance(table, dict):
            return
        known = struct.__struct_fields__
        for key in table:
            if key in known:
                continue
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean `{close[0]}`?)" if close else ""
            found.append(f"unknown key `{key}`" + (f" in [{where}]" if where else "") + hint)

    check(raw, Config, "")
    if isinstance(raw, dict):
        check(raw.get("defaults"), GenerationDefaults, "defaults")
        models = raw.get("models")
        for i, entry in enumerate(models if isinstance(models, list) else []):
            check(entry, ModelEntry, f"models[{i}]")
            hosts = entry.get("hosts") if isinstance(entry, dict) else None
            for j, host in enumerate(hosts if isinstance(hosts, list) else []):
                check(host, HostSpec, f"models[{i}].hosts[{j}]")
    return sorted(found)


def load_config(path: Path) -> Config:
    try:
        raw = tomllib.loads(path.read_text("utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
    unknown = _unknown_keys(raw)
    if unknown:
        raise ConfigError("\n".join(f"{path}: {line}" for line in unknown))
    try:
        return msgspec.convert(raw, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path}: {_describe(exc)}") from exc
