"""The worker's tunable defaults, importable before MLX loads (the command
line reads them first; worker/__main__.py says why MLX must come later)."""

# Shared with the pool, which sends a worker at most max_batch requests,
# and sets how many LoRA adapters it keeps in memory (max_adapters): beyond
# them the least recently used one that no request runs with is dropped
# (worker.lora.manager).
from ipc.messages import DEFAULT_MAX_ADAPTERS as MAX_ADAPTERS, DEFAULT_MAX_BATCH as MAX_BATCH, MAX_WAITING  # noqa: F401

# Prompt tokens a request reads per prefill chunk: running requests wait at
# most one chunk per token. On a CPU prefill throughput is within 4% from 128
# to 512 tokens per chunk while the wait grows with the chunk, so 256; on a GPU
# a chunk's time is mostly fixed cost (H200: 61 ms for 512 tokens, 76 ms for
# 2048), so 512. docs/performance.md, "Continuous batching", has the figures.
PREFILL_STEP_CPU = 256
PREFILL_STEP_GPU = 512

# Memory for reusable prompt state of earlier requests (worker.cache.prefix_cache):
# PREFIX_CACHE_BYTES on a CPU; on a GPU an eighth of its memory
# (PREFIX_CACHE_GPU_SHARE), never less. A long prompt's snapshots are large,
# and a hybrid model keeps up to three of one prompt (a checkpoint, the
# system prompt's end, the last message start): at 26k tokens each of the
# 0.8b shape's took 295-312 MB (the 8B shape's would take 3.8 GB), so with
# 512 MiB on an H100 each pushed the one before out, and another question on
# the same system prompt read its state back from disk, 1.4 s against
# 0.11-0.23 s from memory (docs/performance.md §13).
PREFIX_CACHE_BYTES = 512 * 1024 * 1024
PREFIX_CACHE_GPU_SHARE = 8


def prefix_cache_bytes(on_gpu: bool, device_bytes: int, unused_bytes: int | None = None) -> int:
    """The prefix cache's default budget on a device of `device_bytes`, of
    which `unused_bytes` nothing holds now (other models' workers on the same
    GPU hold the rest): never more than a quarter of that."""
    if not on_gpu:
        return PREFIX_CACHE_BYTES
    share = device_bytes // PREFIX_CACHE_GPU_SHARE
    if unused_bytes is not None:
        share = min(share, unused_bytes // 4)
    return max(PREFIX_CACHE_BYTES, share)


# Seconds a worker stays idle before it hands MLX's buffer cache back
# (--idle-release). The next request reuses cached buffers; one that finds
# the cache empty allocates each anew, and on CUDA allocations are costly:
# while the worker emptied its cache whenever its batch did, a lone 0.8b
# request on an H200 waited 258-276 ms for its first token, against 59-68 ms
# for the one-at-a-time worker before it, which never did (docs/performance.md
# §9). Chat turns a minute apart stay warm.
IDLE_RELEASE_S = 60.0

# How long the engine thread may keep the GIL from a side thread that waits
# for it (sys.setswitchinterval, in ms; Python's own is 5). The token-mask
# thread needs the GIL for a moment before and after each batch of masks,
# and a small model's engine thread on a GPU is busy in Python for most of a
# step, giving the GIL up only when it blocks or the interval runs out: with
# 5 ms a constrained step's masks came back late. H200, 0.8b, 8 rows, 151k
# vocabulary, JSON schema vs none: 0.826-1.034x with 5 ms, 0.91-0.959x with
# 0.5 (docs/performance.md §9, "Sixteenth to eighteenth leases").
GIL_SWITCH_MS = 0.5
