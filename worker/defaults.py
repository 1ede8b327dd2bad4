"""The worker's tunable defaults, importable before MLX loads (the command
line reads them first; worker/__main__.py says why MLX must come later)."""

# Shared with the pool, which sends a worker at most max_batch requests.
from ipc.messages import DEFAULT_MAX_BATCH as MAX_BATCH, MAX_WAITING  # noqa: F401

# Prompt tokens a request reads per prefill chunk: running requests wait at
# most one chunk per token. On a CPU prefill throughput is within 4% from 128
# to 512 tokens per chunk while the wait grows with the chunk, so 256; on a GPU
# a chunk's time is mostly fixed cost (H200: 61 ms for 512 tokens, 76 ms for
# 2048), so 512. docs/performance.md, "Continuous batching", has the figures.
PREFILL_STEP_CPU = 256
PREFILL_STEP_GPU = 512

# Memory for reusable prompt state of earlier requests (worker.prefix_cache).
PREFIX_CACHE_BYTES = 512 * 1024 * 1024

# LoRA adapters a worker keeps in memory; beyond them the least recently
# used one that no request runs with is dropped (worker.lora.manager).
MAX_ADAPTERS = 8
