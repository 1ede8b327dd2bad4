"""`max_batch = "auto"`: how many requests a worker decodes together, from
the machine and the model. Pure arithmetic, importable without MLX.

On a GPU (CUDA or Metal) a decode step reads every weight once whatever the
rows, so more rows are nearly free until their caches fill memory: the
number is the cache memory over one row's cache at SIZING_TOKENS, as vLLM
sizes its batch against the memory left after the weights, within
[1, GPU_MAX]. A row that grows past SIZING_TOKENS is still safe: the memory
guard (worker.engine.scheduler, `batch_memory`) holds new rows back while the
running ones' caches would not fit.

On a CPU every row costs compute: on 2 cores the aggregate still grew from 8
to 16 rows, but each request slowed to a third of a lone one's speed and the
last first token came 8.7x later, against half speed and 4.5x at 8
(docs/performance.md, "Continuous batching"), so CPU_MAX rows, fewer only
where memory holds fewer.
"""

from __future__ import annotations

from dataclasses import dataclass

CPU_MAX = 8
GPU_MAX = 64
# Tokens of prompt and reply one row is sized for: a long chat turn. The
# model's whole context (40k tokens for Qwen3, 262k for Qwen3.5) would give
# an 8B model 5 rows on an H200 while almost every request is far shorter.
SIZING_TOKENS = 4096
# Of the device memory the weights and the prefix cache's budget leave,
# what caches may take: the rest is
# for activations, a prefill chunk's scratch and MLX's buffer cache.
FREE_SHARE = 0.75


@dataclass(frozen=True)
class BatchSize:
    rows: int
    why: str


def auto_max_batch(*, processor: str, free_bytes: int, guard_bytes: int, row_fixed_bytes: int, row_token_bytes: int, context: int | None) -> BatchSize:
    """Rows for a worker on `processor` ("cpu", "cuda" or "metal") with
    `free_bytes` of device memory left after loading (less the prefix
    cache's budget), a memory guard of
    `guard_bytes` for rows' caches, one row's cache taking `row_fixed_bytes`
    plus `row_token_bytes` a token, and a model context of `context` tokens
    (None: unknown)."""
    tokens = min(SIZING_TOKENS, context) if context else SIZING_TOKENS
    row = max(1, row_fixed_bytes + row_token_bytes * tokens)
    budget = min(int(max(free_bytes, 0) * FREE_SHARE), guard_bytes)
    fit = max(1, budget // row)
    cap = CPU_MAX if processor == "cpu" else GPU_MAX
    rows = min(fit, cap)
    held = f"{_gib(budget)} for caches holds {fit} rows of {_mib(row)} ({tokens} tokens each)"
    if rows == cap:
        why = f"auto: {rows}, the {processor} cap ({held})"
    else:
        why = f"auto: {rows}: {held}"
    return BatchSize(rows, why)


def batch_cache_bytes(rows: int, longest: int, row_fixed_bytes: int, row_token_bytes: int) -> int:
    """Cache bytes of a batch of `rows` rows whose longest holds `longest`
    tokens: attention caches are padded to the longest row and grow in
    256-token steps."""
    width = -(-longest // 256) * 256
    return rows * (row_fixed_bytes + width * row_token_bytes)


def rows_memory_at_most(*, batch_memory: int, max_batch: int, row_fixed_bytes: int, row_token_bytes: int, context: int | None) -> int:
    """The most a worker's rows' caches take: its memory guard, or max_batch
    rows at the model's context where that is less (at SIZING_TOKENS a row
    for a model that states none, as `auto_max_batch` sizes them). The pool
    leaves it out of the budgets of workers started beside this one."""
    return min(batch_memory, batch_cache_bytes(max_batch, context or SIZING_TOKENS, row_fixed_bytes, row_token_bytes))


# The rows' caches may take a 1/BATCH_MEMORY_SHARE of the device's memory by
# default (the memory guard, `batch_memory`).
BATCH_MEMORY_SHARE = 4


def default_batch_memory(device_bytes: int, unused_bytes: int, prefix_bytes: int) -> int:
    """The memory guard's default: a quarter of the device's memory, and no
    more than FREE_SHARE of what nothing holds after loading (`unused_bytes`,
    other processes' use subtracted where the device says it: a second
    model's worker on a GPU), less the prefix cache's budget."""
    return max(0, min(device_bytes // BATCH_MEMORY_SHARE, int((unused_bytes - prefix_bytes) * FREE_SHARE)))


def gpu_memory(info: dict) -> int | None:
    """The GPU's memory in mx.device_info(): Metal calls it memory_size,
    CUDA total_memory (which, read as memory_size alone, left a CUDA worker
    sizing itself by the host's RAM)."""
    size = info.get("memory_size") or info.get("total_memory")
    return int(size) if size else None


def _gib(n: int) -> str:
    return f"{n / 1024**3:.1f} GiB"


def _mib(n: int) -> str:
    return f"{n / 1024**2:.1f} MiB"
