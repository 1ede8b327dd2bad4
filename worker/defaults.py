"""The worker's tunable defaults, importable before MLX loads (the command
line reads them first; worker/__main__.py says why MLX must come later)."""

# Requests decoded together. Measured on a 2-core CPU: docs/performance.md,
# "Continuous batching".
MAX_BATCH = 8

# Prompt tokens a row reads per prefill chunk: running rows wait at most one
# chunk per token. docs/performance.md, "Continuous batching", has the
# measurement behind it.
PREFILL_STEP = 512

# Memory for reusable prompt state of earlier requests (worker.prefix_cache).
PREFIX_CACHE_BYTES = 512 * 1024 * 1024

# The bound of a worker's waiting line: a request beyond it is refused with
# `overloaded` (the supervisor keeps its own queue and sends a few at a time).
MAX_WAITING = 1024
