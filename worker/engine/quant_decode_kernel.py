"""A decode step's attention over an 8- or 4-bit cache, as one CUDA kernel.

mlx-cuda (0.32.4) reads a quantized cache through two quantized matmuls,
and its kernel for the values' product (`x @ W`, `qmm_naive`) gives each
tile of query rows and head dimension one thread block that walks every
cached token: a decode step of Qwen3-8B's heads runs that product on 8
blocks however long the cache. On an H100 the 8B shape's lone row at 32k
tokens then decoded at 0.27x its rate over a bf16 cache, the attention
over the packed cache taking about 26 ms a step where bf16's took 1.3.

This kernel splits the cached tokens instead (flash-decoding): each thread
block takes TILES tiles of THREADS tokens of one row's KV head, scores them
from the packed keys (a thread a token: q . k summed group by group as
scale * (q_g . w) + bias * sum(q_g), the bytes read once), keeps a running
softmax over its tiles, and adds each tile's values (dequantized as they
are read, coalesced: a thread a packed word) into its output in shared
memory. A second kernel merges the blocks' outputs by their maxima and
sums, in the queries' dtype. Everything is float32 inside; the queries,
masks (boolean or additive, broadcast over heads) and slices of a
cache's buffer (strided along the token axis) are read where they lie,
so none is copied: a layer's attention is two kernels.

Each thread issues all its loads of a tile (its token's packed key and
groups' scales and biases; U tokens' packed values at a time) before any
arithmetic on them, so that they wait for the memory together: 36 layers
of Qwen3-8B's heads over 32k tokens took 2.76 ms against 2.95 with a
load waited for before the next was issued (an H100, the kernels alone).
"""

from __future__ import annotations

import functools
import math
import struct

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

THREADS = 128  # tokens a tile: a thread a token while scoring
ROWS_AT_MOST = 32  # query rows a KV head (queries a head x heads a KV head)
# Thread blocks a step aims for (about four a multiprocessor of an H100):
# fewer leave multiprocessors idle, more write more partial outputs. At 32k
# tokens of Qwen3-8B's heads, aiming for 256, 512, 1024 and 2048 took 2.78,
# 2.76, 2.87 and 3.05 ms for 36 layers on an H100.
BLOCKS_AIMED = 512
TILES_AT_MOST = 64
# The worker's steps take the kernel over caches of this many tokens or
# more; below, mlx's quantized matmuls keep them. On an H100, 36 layers of
# Qwen3-8B's heads at 8k tokens took 4.6 ms a step this way against 8.4
# (op by op) and 9.9 (traced) through mlx's (bench.kv_step); a whole 8B
# step at 2k tokens was no faster this way (one round of
# bench.long_context), the step there bound by its kernels' count.
FROM_TOKENS = 8192

_SOURCE = r"""
    constexpr int PER_WORD = 32 / BITS;
    constexpr int WORDS = D / PER_WORD;
    constexpr int NG = D / GS;
    constexpr int WORDS_A_GROUP = GS / PER_WORD;
    constexpr int TG = T / WORDS;
    constexpr int NT = T / TG;
    constexpr int U = NT < 8 ? NT : 8;
    constexpr int RC = (R * PER_WORD <= 64) ? R : (64 / PER_WORD);
    constexpr uint32_t LOW = (1u << BITS) - 1u;
    const float NEG_INF = __int_as_float(static_cast<int>(0xff800000u));

    extern __shared__ float smem[];
    float* qs = smem;
    float* qsum = qs + R * D;
    float* sc = qsum + R * NG;
    float* outs = sc + R * T;
    float* run_max = outs + R * D;
    float* run_sum = run_max + R;
    float* alpha = run_sum + R;

    const int tid = threadIdx.x;
    const int kv_heads = kw_shape[1];
    const int S = kw_shape[2];
    const int bh = blockIdx.y;
    const int b = bh / kv_heads;
    const int h = bh % kv_heads;
    const int chunk = blockIdx.x;

    // Row r of a KV head is query r % L of its head r / L: the queries'
    // (B, heads, L, D) read where they lie, scaled (SCALE: a float's bits).
    const float scale = __int_as_float(SCALE);
    const int per_kv = R / L;
    for (int i = tid; i < R * D; i += T) {
        const int r = i / D;
        const int d = i % D;
        qs[i] = scale * float(q[b * q_strides[0] + (h * per_kv + r / L) * q_strides[1] + (r % L) * q_strides[2] + d * q_strides[3]]);
        outs[i] = 0.f;
    }
    if (tid < R) {
        run_max[tid] = NEG_INF;
        run_sum[tid] = 0.f;
    }
    __syncthreads();
    for (int i = tid; i < R * NG; i += T) {
        const float* x = qs + (i / NG) * D + (i % NG) * GS;
        float s = 0.f;
        for (int d = 0; d < GS; ++d) s += x[d];
        qsum[i] = s;
    }
    __syncthreads();

    const uint32_t* kwp = kw + b * kw_strides[0] + h * kw_strides[1];
    const auto* ksp = ks + b * ks_strides[0] + h * ks_strides[1];
    const auto* kbp = kb + b * kb_strides[0] + h * kb_strides[1];
    const uint32_t* vwp = vw + b * vw_strides[0] + h * vw_strides[1];
    const auto* vsp = vs + b * vs_strides[0] + h * vs_strides[1];
    const auto* vbp = vb + b * vb_strides[0] + h * vb_strides[1];
    const auto* mp = mask + b * mask_strides[0];

    const int warp = tid / 32;
    const int lane = tid % 32;
    const int word = tid % WORDS;
    const int tgroup = tid / WORDS;
    const int vgroup = word * PER_WORD / GS;

    for (int tile = 0; tile < TILES; ++tile) {
        const int t0 = (chunk * TILES + tile) * T;
        if (t0 >= S) break;
        const int tok = t0 + tid;

        // Scores: a thread a token, its packed key and its groups' scales
        // and biases loaded before any arithmetic, so that every load of
        // the tile is in flight at once (a load waited for before the next
        // is issued costs the memory's latency each).
        float s[R];
        if (tok < S) {
            const uint4* kr = reinterpret_cast<const uint4*>(kwp + tok * kw_strides[2]);
            uint4 kq[WORDS / 4];
#pragma unroll
            for (int i = 0; i < WORDS / 4; ++i) kq[i] = kr[i];
            float ks_g[NG];
            float kb_g[NG];
#pragma unroll
            for (int g = 0; g < NG; ++g) {
                ks_g[g] = float(ksp[tok * ks_strides[2] + g]);
                kb_g[g] = float(kbp[tok * kb_strides[2] + g]);
            }
#pragma unroll
            for (int r = 0; r < R; ++r) s[r] = 0.f;
#pragma unroll
            for (int g = 0; g < NG; ++g) {
                float a[R];
#pragma unroll
                for (int r = 0; r < R; ++r) a[r] = 0.f;
#pragma unroll
                for (int w4 = g * WORDS_A_GROUP / 4; w4 < (g + 1) * WORDS_A_GROUP / 4; ++w4) {
                    const uint32_t ws[4] = {kq[w4].x, kq[w4].y, kq[w4].z, kq[w4].w};
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
#pragma unroll
                        for (int k = 0; k < PER_WORD; ++k) {
                            const float x = float((ws[j] >> (k * BITS)) & LOW);
                            const int d = (w4 * 4 + j) * PER_WORD + k;
#pragma unroll
                            for (int r = 0; r < R; ++r) a[r] += qs[r * D + d] * x;
                        }
                    }
                }
#pragma unroll
                for (int r = 0; r < R; ++r) s[r] += ks_g[g] * a[r] + kb_g[g] * qsum[r * NG + g];
            }
            if (MASK != 0) {
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    const auto m = mp[(r % L) * mask_strides[1] + tok * mask_strides[2]];
                    if (MASK == 1) {
                        if (float(m) == 0.f) s[r] = NEG_INF;
                    } else {
                        s[r] += float(m);
                    }
                }
            }
        } else {
#pragma unroll
            for (int r = 0; r < R; ++r) s[r] = NEG_INF;
        }
#pragma unroll
        for (int r = 0; r < R; ++r) sc[r * T + tid] = s[r];
        __syncthreads();

        // The running softmax: a warp a row.
        for (int r = warp; r < R; r += T / 32) {
            float m = NEG_INF;
            for (int i = lane; i < T; i += 32) m = fmaxf(m, sc[r * T + i]);
            for (int off = 16; off > 0; off /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, off));
            const float old = run_max[r];
            const float top = fmaxf(old, m);
            float sum = 0.f;
            for (int i = lane; i < T; i += 32) {
                const float p = top == NEG_INF ? 0.f : __expf(sc[r * T + i] - top);
                sc[r * T + i] = p;
                sum += p;
            }
            for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffff, sum, off);
            if (lane == 0) {
                const float a = old == NEG_INF ? 0.f : __expf(old - top);
                alpha[r] = a;
                run_sum[r] = run_sum[r] * a + sum;
                run_max[r] = top;
            }
        }
        __syncthreads();
        for (int i = tid; i < R * D; i += T) outs[i] *= alpha[i / D];
        __syncthreads();

        // Values: a thread a packed word of every TG-th token.
#pragma unroll 1
        for (int r0 = 0; r0 < R; r0 += RC) {
            float acc[RC][PER_WORD];
#pragma unroll
            for (int rr = 0; rr < RC; ++rr)
#pragma unroll
                for (int k = 0; k < PER_WORD; ++k) acc[rr][k] = 0.f;
            // U tokens' words, scales and biases loaded, then added in.
#pragma unroll 1
            for (int n0 = 0; n0 < NT; n0 += U) {
                uint32_t w[U];
                float vs_g[U];
                float vb_g[U];
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int t = t0 + tgroup + (n0 + u) * TG;
                    const bool in = t < S;
                    w[u] = in ? vwp[t * vw_strides[2] + word] : 0u;
                    vs_g[u] = in ? float(vsp[t * vs_strides[2] + vgroup]) : 0.f;
                    vb_g[u] = in ? float(vbp[t * vb_strides[2] + vgroup]) : 0.f;
                }
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    // Past the cache's end p is 0 and so is v.
                    const int i = tgroup + (n0 + u) * TG;
                    float v[PER_WORD];
#pragma unroll
                    for (int k = 0; k < PER_WORD; ++k) v[k] = vs_g[u] * float((w[u] >> (k * BITS)) & LOW) + vb_g[u];
#pragma unroll
                    for (int rr = 0; rr < RC; ++rr) {
                        if (r0 + rr < R) {
                            const float p = sc[(r0 + rr) * T + i];
#pragma unroll
                            for (int k = 0; k < PER_WORD; ++k) acc[rr][k] += p * v[k];
                        }
                    }
                }
            }
#pragma unroll
            for (int rr = 0; rr < RC; ++rr) {
                if (r0 + rr < R) {
#pragma unroll
                    for (int k = 0; k < PER_WORD; ++k) atomicAdd(&outs[(r0 + rr) * D + word * PER_WORD + k], acc[rr][k]);
                }
            }
        }
        __syncthreads();
    }

    const size_t at = (size_t)bh * gridDim.x + chunk;
    for (int i = tid; i < R * D; i += T) o[at * R * D + i] = outs[i];
    if (tid < R) {
        stats[(at * R + tid) * 2] = run_max[tid];
        stats[(at * R + tid) * 2 + 1] = run_sum[tid];
    }
"""

# The blocks' outputs merged: a thread an output value, each block's part
# weighted by exp(its maximum - the largest), over the weighted sums.
_MERGE = r"""
    const int i = cg::this_grid().thread_rank();
    const int blocks = o_shape[2];
    const int R = o_shape[3];
    const int D = o_shape[4];
    const int bh = i / (R * D);
    const int r = (i / D) % R;
    const int d = i % D;
    if (bh >= o_shape[0] * o_shape[1]) return;
    const float NEG_INF = __int_as_float(static_cast<int>(0xff800000u));
    const float* st = stats + (size_t)bh * blocks * R * 2 + r * 2;
    float top = NEG_INF;
#pragma unroll 8
    for (int n = 0; n < blocks; ++n) top = fmaxf(top, st[n * R * 2]);
    float num = 0.f;
    float den = 0.f;
    if (top != NEG_INF) {
        const float* op = o + (size_t)bh * blocks * R * D + r * D + d;
#pragma unroll 8
        for (int n = 0; n < blocks; ++n) {
            const float m = st[n * R * 2];
            if (m == NEG_INF) continue;
            const float w = __expf(m - top);
            num += w * op[(size_t)n * R * D];
            den += w * st[n * R * 2 + 1];
        }
    }
    out[i] = static_cast<T>(den > 0.f ? num / den : 0.f);
"""


@functools.cache
def _kernel(shared: int):
    """The kernel with this many bytes of shared memory (fixed per object)."""
    return mx.fast.cuda_kernel(
        name="lattice_quant_decode",
        input_names=["q", "kw", "ks", "kb", "vw", "vs", "vb", "mask"],
        output_names=["o", "stats"],
        source=_SOURCE,
        ensure_row_contiguous=False,
        shared_memory=shared,
    )


@functools.cache
def _merge_kernel():
    return mx.fast.cuda_kernel(name="lattice_quant_decode_merge", input_names=["o", "stats"], output_names=["out"], source=_MERGE)


def supported(queries_shape: tuple, keys: tuple, group_size: int, bits: int, mask) -> bool:
    """Whether the kernel takes this step (otherwise the caller's way does)."""
    B, heads, L, D = queries_shape
    kv_heads = keys[0].shape[1]
    # Whole 16-byte loads within a group: a group of 16 (8 bits) or 32 (4 bits) values or more.
    if bits not in (4, 8) or heads % kv_heads or D % group_size or group_size % (128 // bits):
        return False
    words = D * bits // 32
    if words % 4 or THREADS % words:
        return False
    if heads // kv_heads * L > ROWS_AT_MOST:
        return False
    return mask is None or isinstance(mask, str) or (mask.ndim >= 2 and (mask.ndim < 3 or mask.shape[-3] == 1))


def _mask(mask, B: int, L: int, S: int):
    """(kind, array): the mask as (B, L, S) (broadcast, not copied); kind 0
    none, 1 boolean, 2 additive."""
    if mask is None:
        return 0, mx.zeros((1, 1, 1), dtype=mx.bool_)
    if isinstance(mask, str):
        mask = create_causal_mask(L, S - L)
    if mask.ndim == 4:
        mask = mask[:, 0]
    return (1 if mask.dtype == mx.bool_ else 2), mx.broadcast_to(mask, (B, L, S))


def _tiles(rows_of_heads: int, S: int) -> int:
    want = S * rows_of_heads / (THREADS * BLOCKS_AIMED)
    return min(TILES_AT_MOST, 1 << max(0, math.ceil(math.log2(want)))) if want > 1 else 1


def reference(queries, keys: tuple, values: tuple, scale: float, mask, group_size: int, bits: int):
    """What `attention` computes, from the dequantized cache in float32 with
    mlx's own ops (slow: for checks)."""
    # Scales and biases in float32 first: mlx dequantizes in their dtype.
    k, v = (mx.dequantize(t[0], *(x.astype(mx.float32) for x in t[1:]), group_size=group_size, bits=bits) for t in (keys, values))
    B, heads, L, D = queries.shape
    kv_heads, S = k.shape[1], k.shape[2]
    q = queries.astype(mx.float32).reshape(B, kv_heads, heads // kv_heads, L, D) * scale
    scores = q @ mx.expand_dims(k, 2).swapaxes(-1, -2)  # (B, KV heads, G, L, S)
    kind, m = _mask(mask, B, L, S)
    if kind:
        m = m[:, None, None]
        scores = mx.where(m, scores, -math.inf) if kind == 1 else scores + m.astype(mx.float32)
    weights = mx.softmax(scores, axis=-1)
    return (weights @ mx.expand_dims(v, 2)).reshape(B, heads, L, D).astype(queries.dtype)


def check(dims: set[int], group_size: int, bits: int) -> str | None:
    """None if the kernel gives `reference`'s attention for a small cache of
    each head dimension on this GPU (a masked batch of two rows, one query
    each of four heads a KV head), else why not (mlx's JIT compiler may
    refuse it, or a GPU compute it otherwise)."""
    try:
        for D in sorted(dims):
            kv_heads, S = 2, 300
            heads = 4 * kv_heads
            keys_values = mx.random.normal((2, 2, kv_heads, S + 5, D), key=mx.random.key(D)).astype(mx.bfloat16)
            keys, values = (tuple(x[..., :S, :] for x in mx.quantize(t, group_size=group_size, bits=bits)) for t in keys_values)
            queries = mx.random.normal((2, heads, 1, D), key=mx.random.key(D + 1)).astype(mx.bfloat16)
            mask = (mx.arange(S)[None, :] >= mx.array([0, 37])[:, None]).reshape(2, 1, 1, S)
            if not supported(queries.shape, keys, group_size, bits, mask):
                continue
            got = attention(queries, keys, values, D**-0.5, mask, group_size, bits).astype(mx.float32)
            want = reference(queries, keys, values, D**-0.5, mask, group_size, bits).astype(mx.float32)
            if not mx.allclose(got, want, rtol=2e-2, atol=2e-2).item():
                return f"head dimension {D}: off by up to {mx.abs(got - want).max().item():.3g}"
    except Exception as e:  # a kernel that fails to build is reported: the caller keeps mlx's way
        return f"{type(e).__name__}: {e}"
    return None


def attention(queries, keys: tuple, values: tuple, scale: float, mask, group_size: int, bits: int):
    """softmax(q K^T * scale + mask) V over packed keys and values (each
    (B, KV heads, tokens, words), a buffer or a slice of one along its
    tokens), in the queries' dtype. The caller checks `supported` first."""
    B, heads, L, D = queries.shape
    kv_heads, S = keys[0].shape[1], keys[0].shape[2]
    R = heads // kv_heads * L
    kind, m = _mask(mask, B, L, S)
    tiles = _tiles(B * kv_heads, S)
    blocks = -(-S // (THREADS * tiles))
    shared = 4 * (2 * R * D + R * (D // group_size) + R * THREADS + 3 * R)
    scale_bits = struct.unpack("<i", struct.pack("<f", float(scale)))[0]
    template = [("T", THREADS), ("D", D), ("GS", group_size), ("BITS", bits), ("R", R), ("L", L), ("TILES", tiles), ("MASK", kind), ("SCALE", scale_bits)]
    o, stats = _kernel(shared)(
        inputs=[queries, *keys, *values, m],
        template=template,
        grid=(blocks * THREADS, B * kv_heads, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, kv_heads, blocks, R, D), (B, kv_heads, blocks, R, 2)],
        output_dtypes=[mx.float32, mx.float32],
    )
    (out,) = _merge_kernel()(
        inputs=[o, stats],
        template=[("T", queries.dtype)],
        grid=(B * kv_heads * R * D, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(B, kv_heads, R, D)],
        output_dtypes=[queries.dtype],
    )
    return out.reshape(B, heads, L, D)
