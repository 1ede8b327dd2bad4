"""What a quantized (`kv_bits = 8`) cache adds to one row's decode step.

The attention layers alone, no weights: each layer writes the new key and
value into its cache and attends over it, one row (`--rows`), the query heads of a KV
head as in Qwen3-8B (32 query heads, 8 KV heads of 128, 36 layers by
default), `--context` tokens filled in a buffer of 256-token steps, buffers
written in place as a worker's are (the caller drops its references before
the step's eval). The ways:

- `bf16-eager`: mlx-lm's plain cache: two writes at the offset, mlx's fused
  attention over the filled slice (the baseline of the ratios);
- `bf16-traced`: the compiled step's form: writes at a column array, the
  whole buffer attended under a mask;
- `q8-traced`: the compiled step over an 8-bit cache: keys and values
  quantized, six writes (packed values, scales, biases), two quantized
  matmuls with a masked softmax between;
- `q8-eager`: the same op by op, the filled slices copied contiguous (what
  mlx's CUDA quantized matmul takes);
- `q8-eager-full`: op by op over the whole buffer under a mask, no copies;
- `q8one-traced`, `q8one-eager-full`: keys and values of a layer in one
  buffer, quantized by one call and written by three writes;
- `q8-dequantized`: op by op, the whole buffer dequantized by mlx's
  `dequantize`, then its filled tokens through mlx's fused attention;
- `q8-bytes`: the same with the buffer dequantized by an elementwise
  function of its bytes, compiled once (the buffer's shape does not
  change: one fused kernel a tensor, each byte a value, times its group's
  scale, plus its bias), in place of mlx's quantized kernels;
- `q8-split-traced`, `q8-split-eager-full`: `q8-traced` and
  `q8-eager-full` with the values' product split into blocks of 256
  keys, one batch entry each, and summed: mlx's CUDA kernel for `x @ W`
  (0.32.4, `qmm_naive`) gives each tile of rows and head dimension one
  thread block that walks every key, so a decode step's product runs on
  one block a KV head (8 of an H100's 132 multiprocessors for Qwen3-8B's
  heads), however long the cache.

Each round times every way (the order reversed on odd rounds), each the
median of `--steps` steps after `--warm` unmeasured ones; ratios are the
way's step time over `bf16-eager`'s in the same round. Meaningful on a GPU,
where these steps are bound by their kernels' count rather than their bytes.

    python -m bench.kv_step --rounds 5             # on a GPU
    python -m bench.kv_step --rows 8 --rounds 5    # eight rows
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial

WAYS = (
    "bf16-eager",
    "bf16-traced",
    "q8-traced",
    "q8-eager",
    "q8-eager-full",
    "q8one-traced",
    "q8one-eager-full",
    "q8-dequantized",
    "q8-bytes",
    "q8-split-traced",
    "q8-split-eager-full",
    "q8-kernel",
    "q8-kernel-traced",
)
# Keys a block of the split values' product (`q8-split-*`): the buffers'
# 256-token step, so that every capacity splits whole.
SPLIT = 256


def ways(rows: int, cuda: bool) -> tuple[str, ...]:
    """The ways measured for this many rows: keys and values in one buffer
    only for one row, where each is a contiguous half of it (mlx's CUDA
    quantized matmul takes contiguous operands only); the CUDA kernel only
    on CUDA."""
    return tuple(w for w in WAYS if not (w.startswith("q8one") and rows > 1) and not (w.startswith("q8-kernel") and not cuda))


def dequantize_bytes(packed, scales, biases, group_size: int):
    """mlx's 8-bit affine dequantization as elementwise ops on the packed
    bytes: byte j of a row is its value j (mlx packs value i at bits 8i of
    a little-endian word), times its group's scale, plus its bias."""
    import mlx.core as mx

    values = packed.view(mx.uint8).astype(scales.dtype)
    grouped = values.reshape(*scales.shape, group_size) * scales[..., None] + biases[..., None]
    return grouped.reshape(*packed.shape[:-1], -1)


def check_bytes(group_size: int, dim: int) -> None:
    """Fails unless `dequantize_bytes` gives what mlx's dequantize gives."""
    import mlx.core as mx

    x = mx.random.normal((2, 3, 40, dim), key=mx.random.key(0)).astype(mx.bfloat16)
    packed = mx.quantize(x, group_size=group_size, bits=8)
    ours, theirs = dequantize_bytes(*packed, group_size=group_size), mx.dequantize(*packed, group_size=group_size, bits=8)
    if not mx.allclose(ours.astype(mx.float32), theirs.astype(mx.float32), rtol=1e-2, atol=1e-2).item():
        raise SystemExit("the bytes' dequantization differs from mlx's (leave q8-bytes out of --ways)")


def steps(measured: tuple[str, ...], rows: int, layers: int, heads: int, kv_heads: int, dim: int, capacity: int, group_size: int):
    """way -> (buffers(), step(buffers, q, k, col, end)): a step over all
    layers, for each way measured."""
    import mlx.core as mx

    from worker.engine import quant_decode_kernel as kernel

    per_kv = heads // kv_heads
    words = dim * 8 // 32
    columns = mx.arange(capacity)
    scale = dim**-0.5

    def packed(rows_of_heads: int) -> tuple:
        shape = (rows, rows_of_heads, capacity)
        return (mx.zeros((*shape, words), mx.uint32), mx.zeros((*shape, dim // group_size), mx.bfloat16), mx.zeros((*shape, dim // group_size), mx.bfloat16))

    def write(buffer, x, col):
        return mx.slice_update(buffer, x, col, axes=(2,))

    from_bytes = mx.compile(partial(dequantize_bytes, group_size=group_size))

    def quantized_attention(q, keys: tuple, values: tuple, mask, split: bool = False):
        grouped = (q * scale).reshape(rows, kv_heads, per_kv, dim)
        s = mx.quantized_matmul(grouped, *keys, transpose=True, group_size=group_size, bits=8)
        if mask is not None:
            s = mx.where(mask, s, mx.finfo(s.dtype).min)
        w = mx.softmax(s, axis=-1, precise=True)
        if not split:
            return mx.quantized_matmul(w, *values, transpose=False, group_size=group_size, bits=8).reshape(rows, heads, 1, dim)
        # One product a SPLIT-token block of the keys (a batch axis of the
        # call), summed after: mlx's kernel for `x @ W` gives each (rows,
        # head dimension) tile one thread block that walks every key, and a
        # decode step has a tile a KV head.
        n = w.shape[-1] // SPLIT
        blocks = w.reshape(rows, kv_heads, per_kv, n, SPLIT).swapaxes(2, 3)
        parts = mx.quantized_matmul(blocks, *(x.reshape(rows, kv_heads, n, SPLIT, x.shape[-1]) for x in values), transpose=False, group_size=group_size, bits=8)
        return parts.astype(mx.float32).sum(axis=2).astype(q.dtype).reshape(rows, heads, 1, dim)

    def layer(way: str, buffers: list, q, k, col, end):
        k = k + q[:, :kv_heads] * 0  # each layer waits for the one before, as in a model
        # Values apart from keys: a trace merges the same op on the same
        # input, which for mlx's quantize (three outputs) fails in 0.32.
        v = k * 0.5
        if way == "bf16-eager":
            keys, values = buffers
            keys[..., end - 1 : end, :] = k
            values[..., end - 1 : end, :] = v
            return [keys, values], mx.fast.scaled_dot_product_attention(q, keys[..., :end, :], values[..., :end, :], scale=scale)
        mask = (columns <= col)[None, None, None, :]
        if way == "bf16-traced":
            keys, values = write(buffers[0], k, col), write(buffers[1], v, col)
            return [keys, values], mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
        if way.startswith("q8one"):
            both = mx.quantize(mx.concatenate([k, v], axis=1), group_size=group_size, bits=8)
            if way == "q8one-traced":
                kv = tuple(write(b, x, col) for b, x in zip(buffers[0], both))
            else:
                kv = buffers[0]
                for b, x in zip(kv, both):
                    b[..., end - 1 : end, :] = x
            return [kv], quantized_attention(q, tuple(x[:, :kv_heads] for x in kv), tuple(x[:, kv_heads:] for x in kv), mask)
        qk, qv = mx.quantize(k, group_size=group_size, bits=8), mx.quantize(v, group_size=group_size, bits=8)
        if way in ("q8-traced", "q8-split-traced", "q8-kernel-traced"):
            keys = tuple(write(b, x, col) for b, x in zip(buffers[0], qk))
            values = tuple(write(b, x, col) for b, x in zip(buffers[1], qv))
            if way == "q8-kernel-traced":
                return [keys, values], kernel.attention(q, keys, values, scale, mask, group_size, 8)
            return [keys, values], quantized_attention(q, keys, values, mask, split=way == "q8-split-traced")
        keys, values = buffers
        for b, x in zip(keys + values, qk + qv):
            b[..., end - 1 : end, :] = x
        if way == "q8-kernel":
            return [keys, values], kernel.attention(q, tuple(x[..., :end, :] for x in keys), tuple(x[..., :end, :] for x in values), scale, None, group_size, 8)
        if way == "q8-eager":
            filled = lambda t: tuple(mx.contiguous(x[..., :end, :]) for x in t)  # noqa: E731
            return [keys, values], quantized_attention(q, filled(keys), filled(values), None)
        if way in ("q8-dequantized", "q8-bytes"):
            full = from_bytes if way == "q8-bytes" else lambda *t: mx.dequantize(*t, group_size=group_size, bits=8)
            return [keys, values], mx.fast.scaled_dot_product_attention(q, full(*keys)[..., :end, :], full(*values)[..., :end, :], scale=scale)
        return [keys, values], quantized_attention(q, keys, values, (columns < end)[None, None, None, :], split=way == "q8-split-eager-full")

    def buffers(way: str) -> list:
        if way.startswith("bf16"):
            return [[mx.zeros((rows, kv_heads, capacity, dim), mx.bfloat16) for _ in range(2)] for _ in range(layers)]
        if way.startswith("q8one"):
            return [[packed(2 * kv_heads)] for _ in range(layers)]
        return [[packed(kv_heads), packed(kv_heads)] for _ in range(layers)]

    def make(way: str):
        def step(all_buffers, q, k, col, end=None):
            written = []
            for b in all_buffers:
                new, q = layer(way, b, q, k, col, end)
                written.append(new)
            return written, q

        return mx.compile(step) if way.endswith("traced") else step

    return {way: (lambda way=way: buffers(way), make(way), way.endswith("traced")) for way in measured}


def time_way(made, rows: int, heads: int, kv_heads: int, dim: int, context: int, n: int, warm: int) -> float:
    """The median step time (ms) of one way over n steps after `warm`."""
    import mlx.core as mx

    buffers, step, traced = made
    held = [buffers()]
    mx.eval(held[0])
    q = mx.random.normal((rows, heads, 1, dim)).astype(mx.bfloat16)
    k = mx.random.normal((rows, kv_heads, 1, dim)).astype(mx.bfloat16)
    mx.eval(q, k)
    times = []
    for i in range(warm + n):
        end = context - warm - n + i + 1
        col = mx.array([end - 1])
        mx.eval(col)
        t0 = time.perf_counter()
        current = held.pop()
        # A traced step takes the column as an array only (a Python int would be a constant of its trace).
        written, out = step(current, q, k, col) if traced else step(current, q, k, col, end)
        # The old buffers go before the eval, so that the writes are in place.
        del current
        held.append(written)
        del written
        mx.eval(held[0], out)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warm:]) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1, help="rows decoding together (keys and values in one buffer: one row only)")
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--context", type=int, default=2000)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warm", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ways", default="", help="comma-separated ways to time (default: all; bf16-eager always, the ratios' baseline)")
    p.add_argument("--tag", default="")
    args = p.parse_args()

    from worker.runtime.cpu_backend import load_openblas

    load_openblas()
    from bench.common import backend, machine, summary, tagged, write_result

    capacity = -(-(args.context + 1) // 256) * 256
    measured = ways(args.rows, backend() == "cuda")
    if args.ways:
        asked = {"bf16-eager", *args.ways.split(",")}
        if unknown := asked - set(WAYS):
            p.error(f"no such way: {', '.join(sorted(unknown))}")
        if unavailable := asked - set(measured):
            p.error(f"not measured with {args.rows} rows on {backend()}: {', '.join(sorted(unavailable))}")
        measured = tuple(w for w in measured if w in asked)
    if "q8-bytes" in measured:
        check_bytes(args.group_size, args.head_dim)
    made = steps(measured, args.rows, args.layers, args.heads, args.kv_heads, args.head_dim, capacity, args.group_size)
    name = tagged(f"kv-step-{backend()}" + (f"-rows{args.rows}" if args.rows > 1 else ""), args.tag)
    result = {"machine": machine(), "args": vars(args), "capacity": capacity, "rounds": []}
    shape = (args.rows, args.heads, args.kv_heads, args.head_dim, args.context)
    for way in measured:  # each way's kernels built once, before any timing
        time_way(made[way], *shape, n=2, warm=2)
    for r in range(args.rounds):
        ms = {way: round(time_way(made[way], *shape, args.steps, args.warm), 3) for way in (measured if r % 2 == 0 else measured[::-1])}
        result["rounds"].append(ms)
        result["ratios_to_bf16_eager"] = {way: summary([x[way] / x["bf16-eager"] for x in result["rounds"]]) for way in measured}
        result["ms_a_step"] = {way: summary([x[way] for x in result["rounds"]]) for way in measured}
        write_result(name, result)
        print(f"round {r}: " + "; ".join(f"{w} {ms[w]:.3f} ms" for w in measured), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
