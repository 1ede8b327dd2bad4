"""The worker's tunable defaults, importable before MLX loads (the command
line reads them first; worker/__main__.py says why MLX must come later)."""

# Requests decoded together. Measured on a 2-core CPU: docs/performance.md,
# "Continuous batching".
MAX_BATCH = 8

# Prompt tokens a request reads per prefill chunk: running requests wait at
# most one chunk per token. On a CPU prefill throughput is within 4% from 128
# to 512 tokens per chunk while the wait grows with the chunk, so 256; on a GPU
# a chunk's time is mostly fixed cost (H200: 61 ms for 512 tokens, 76 ms for
# 2048), so 512. docs/performance.md, "Continuous batching", has the figures.
PREFILL_STEP_CPU = 256
PREFILL_STEP_GPU = 512

# Memory for reusable prompt state of earlier requests (worker.prefix_cache).
PREFIX_CACHE_BYTES = 512 * 1024 * 1024

# The bound of a worker's waiting line: a request beyond it is refused with
# `overloaded` (the supervisor keeps its own queue and sends a few at a time).
MAX_WAITING = 1024

# LoRA adapters a worker keeps in memory; beyond them the least recently
# used one that no request runs with is dropped (worker.lora.manager).
MAX_ADAPTERS = 8
