// Paged attention (decode and chunked prefill) through block tables, and the reduce of
// context partitions. Launch contract: params.h. The CPU reference is host-std's
// `kernels::paged_attention` (SeqQuery semantics: a sequence's `queries` new tokens are
// the last of its `context_len`; query token i sees tokens 0 ..= context_len - queries + i).
//
// One CTA = (sequence, KV head, tile of R (4 or 8) query rows, context partition),
// KVP_ATT_THREADS threads. The partition's tokens go through in chunks of
// KVP_ATT_CHUNK with an online (running-max) softmax, f32 throughout:
//   0. the chunk's block ids and rows, read from the block table once per CTA;
//   1. scores: TPT threads per token, each one or two vector loads of the K row (16
//      bytes; 8 for the 8-bit codes, see dtype.cuh), KVP_ATT_UNROLL tokens at once;
//      dot with every row's query (each thread keeps its slice of the queries in
//      registers), shuffle-reduced in the group;
//   2. softmax: one warp per row: new max, exp, sum, rescale factor;
//   3. values: TV threads per token, one vector load of the V row each, accumulated
//      into per-thread registers [rows][elements of the vector] for every row.
// At the end the token groups' partial outputs are summed in shared memory (the query
// buffer, no longer needed) and written: normalised to `out` when the launch has one
// partition, unnormalised with (max, sum) to the scratch otherwise.
// Consecutive threads load consecutive vectors of a contiguous
// [token][head_dim] tile, so a warp's loads coalesce; K/V bytes are read once per tile
// of rows (all query heads of a GQA group of up to 8 heads share them).
#pragma once
#include "dtype.cuh"
#include "layout.cuh"
#include "warp.cuh"

namespace kvp {

template <class S, int HD> struct AttShape {
    static constexpr int EPV = (int)sizeof(typename S::Vec) / S::bytes; // elements per vector
    static constexpr int VECS = HD / EPV;              // vectors per token row
    static constexpr int TPT = VECS < 32 ? VECS : 32;  // score threads per token
    static constexpr int QK_VECS = VECS / TPT;         // vectors per score thread
    static constexpr int QK_GROUPS = KVP_ATT_THREADS / TPT;
    static constexpr int TV = VECS;                    // value threads per token
    static constexpr int V_GROUPS = KVP_ATT_THREADS / TV;
    static_assert(VECS * EPV == HD, "head dim is a whole number of vectors");
    static_assert(QK_VECS * TPT == VECS, "score threads split the row evenly");
    static_assert(TV <= KVP_ATT_THREADS && KVP_ATT_THREADS % TV == 0, "value groups");
};

// The K or V row `row` of the tile at element offset `tile` of the block starting at
// element `block`, as vectors.
template <class S, int HD>
__device__ __forceinline__ const typename S::Vec *kv_row(const KvpAttentionParams &p, uint64_t block,
                                                         uint64_t tile, uint32_t row) {
    const uint64_t elem = block + tile + (uint64_t)row * HD;
    return reinterpret_cast<const typename S::Vec *>(static_cast<const uint8_t *>(p.arena) + elem * S::bytes);
}

// The scale of that row (8-bit storage: one byte per element, the block_size f32 scales
// after the block_size * HD codes); 1 for the float dtypes.
template <class S, int HD>
__device__ __forceinline__ float kv_scale(const KvpAttentionParams &p, uint64_t block, uint64_t tile,
                                          uint32_t row) {
    if constexpr (S::scaled) {
        const uint64_t at = block + tile + (uint64_t)p.geo.block_size * HD + 4ull * row;
        return __ldg(reinterpret_cast<const float *>(static_cast<const uint8_t *>(p.arena) + at));
    } else {
        return 1.0f;
    }
}

template <class S, int HD, int R> __device__ __forceinline__ void attention_cta(const KvpAttentionParams &p) {
    using A = AttShape<S, HD>;
    constexpr int C = KVP_ATT_CHUNK;
    constexpr int U = KVP_ATT_UNROLL;
    __shared__ float4 q4[R * HD / 4]; // queries [R][HD]; after the loop: the output sums
    __shared__ float s_s[R * C];      // scores, then probabilities, of the chunk
    __shared__ float m_s[R], l_s[R], a_s[R];
    __shared__ uint32_t lim_s[R];
    __shared__ uint64_t blk_s[C]; // element offset of the block of each token of the chunk
    __shared__ uint32_t row_s[C]; // its row in the block
    float *q_s = reinterpret_cast<float *>(q4);

    const KvpGeometry &g = p.geo;
    const uint32_t kvh = blockIdx.x % g.kv_heads;
    const uint32_t tile = blockIdx.x / g.kv_heads;
    const uint32_t part = blockIdx.y;
    const KvpSeqDesc sq = p.seqs[blockIdx.z];
    const uint32_t group = p.q_heads / g.kv_heads;
    const uint32_t all_rows = sq.queries * group;
    const uint32_t row0 = tile * R;
    // CTA-uniform exits, before any barrier. Partition starts in 64 bits: the last
    // partition of a context near 2^32 tokens may start past it.
    const uint64_t p0_wide = (uint64_t)part * p.partition_tokens;
    if (row0 >= all_rows || p0_wide >= sq.context_len) return;
    const uint32_t p0 = (uint32_t)p0_wide;
    const uint32_t rows = all_rows - row0 < (uint32_t)R ? all_rows - row0 : (uint32_t)R;
    const uint32_t first_visible = sq.context_len - sq.queries; // tokens before the queries
    const uint32_t last_limit = first_visible + (row0 + rows - 1) / group + 1;
    const uint64_t part_end = p0_wide + p.partition_tokens;
    uint32_t end = part_end < sq.context_len ? (uint32_t)part_end : sq.context_len;
    end = end < last_limit ? end : last_limit;
    const uint32_t tid = threadIdx.x;
    // Rows past `rows` (a GQA group smaller than R, the last tile of a prefill) are
    // skipped in the arithmetic; their registers stay allocated.
    const int live = (int)rows;

    for (uint32_t i = tid; i < (uint32_t)(R * HD); i += KVP_ATT_THREADS) {
        const uint32_t j = i / HD, d = i % HD;
        float x = 0.0f;
        if (j < rows) {
            const uint32_t r = row0 + j;
            const uint64_t at = query_offset(sq.q_start + r / group, kvh * group + r % group, p.q_heads, HD);
            x = __ldg(p.q + at + d);
        }
        q_s[i] = x;
    }
    if (tid < (uint32_t)R) {
        lim_s[tid] = tid < rows ? first_visible + (row0 + tid) / group + 1 : 0u;
        m_s[tid] = -INFINITY;
        l_s[tid] = 0.0f;
    }
    __syncthreads();

    const uint32_t *bt = p.block_table + (uint64_t)sq.row * p.table_stride;
    const uint64_t k_tile = tile_offset(g, p.layer, 0, kvh);
    const uint64_t v_tile = tile_offset(g, p.layer, 1, kvh);
    const uint32_t lane = tid % 32u, warp = tid / 32u;
    const uint32_t qg = tid / A::TPT, qj = tid % A::TPT;
    const uint32_t vg = tid / A::TV, vv = tid % A::TV;
    float acc[R][A::EPV];
KVP_UNROLL
    for (int r = 0; r < R; ++r)
KVP_UNROLL
        for (int e = 0; e < A::EPV; ++e) acc[r][e] = 0.0f;
    // The score threads' slices of every row's query: the same dims for every token.
    float qr[R][A::QK_VECS * A::EPV];
KVP_UNROLL
    for (int r = 0; r < R; ++r)
KVP_UNROLL
        for (int v = 0; v < A::QK_VECS; ++v)
KVP_UNROLL
            for (int e = 0; e < A::EPV; ++e) qr[r][v * A::EPV + e] = q_s[r * HD + (qj + v * A::TPT) * A::EPV + e];

    // c0 + n <= end: no wrap-around, whatever the context length.
    for (uint32_t c0 = p0, n = 0; c0 < end; c0 += n) {
        n = end - c0 < (uint32_t)C ? end - c0 : (uint32_t)C;
        // 0. Where the chunk's tokens are: one block-table read and division per token
        // for the whole CTA (the previous chunk's last barrier freed blk_s / row_s).
        for (uint32_t t = tid; t < n; t += KVP_ATT_THREADS) {
            const uint32_t abs_t = c0 + t;
            blk_s[t] = block_offset(g, __ldg(bt + abs_t / g.block_size));
            row_s[t] = abs_t % g.block_size;
        }
        __syncthreads();
        // 1. Scores, U tokens per thread group and pass (their loads in flight
        // together). The loop bound is CTA-uniform, so every lane reaches the shuffles.
        for (uint32_t t0 = 0; t0 < n; t0 += A::QK_GROUPS * U) {
            typename S::Vec raw[U][A::QK_VECS];
KVP_UNROLL
            for (int u = 0; u < U; ++u) {
                const uint32_t t = t0 + qg + u * A::QK_GROUPS;
                if (t < n) {
                    const typename S::Vec *krow = kv_row<S, HD>(p, blk_s[t], k_tile, row_s[t]);
KVP_UNROLL
                    for (int v = 0; v < A::QK_VECS; ++v) raw[u][v] = __ldg(krow + qj + v * A::TPT);
                } else {
KVP_UNROLL
                    for (int v = 0; v < A::QK_VECS; ++v) raw[u][v] = typename S::Vec{};
                }
            }
KVP_UNROLL
            for (int u = 0; u < U; ++u) {
                float dot[R];
KVP_UNROLL
                for (int r = 0; r < R; ++r) dot[r] = 0.0f;
KVP_UNROLL
                for (int v = 0; v < A::QK_VECS; ++v) {
                    float x[A::EPV];
                    S::unpack(raw[u][v], x);
KVP_UNROLL
                    for (int r = 0; r < R; ++r)
                        if (r < live)
KVP_UNROLL
                            for (int e = 0; e < A::EPV; ++e) dot[r] += qr[r][v * A::EPV + e] * x[e];
                }
KVP_UNROLL
                for (int r = 0; r < R; ++r)
                    if (r < live) // CTA-uniform: whole warps shuffle or skip together
KVP_UNROLL
                        for (int mask = A::TPT / 2; mask > 0; mask >>= 1)
                            dot[r] += __shfl_xor_sync(0xffffffffu, dot[r], mask);
                const uint32_t t = t0 + qg + u * A::QK_GROUPS;
                if (t < n && qj == 0) {
                    const float ks = p.scale * kv_scale<S, HD>(p, blk_s[t], k_tile, row_s[t]);
KVP_UNROLL
                    for (int r = 0; r < R; ++r) s_s[r * C + t] = c0 + t < lim_s[r] ? dot[r] * ks : -INFINITY;
                }
            }
        }
        __syncthreads();
        // 2. Online softmax, one warp per row.
        for (uint32_t r = warp; r < (uint32_t)R; r += KVP_ATT_THREADS / 32) {
            float mx = -INFINITY;
            for (uint32_t t = lane; t < n; t += 32u) mx = fmaxf(mx, s_s[r * C + t]);
            mx = warp_max(mx);
            const float m_old = m_s[r];
            const float m_new = fmaxf(m_old, mx);
            float sum = 0.0f;
            for (uint32_t t = lane; t < n; t += 32u) {
                const float e = m_new == -INFINITY ? 0.0f : expf(s_s[r * C + t] - m_new);
                s_s[r * C + t] = e;
                sum += e;
            }
            sum = warp_sum(sum);
            if (lane == 0) {
                const float alpha = m_new == -INFINITY ? 1.0f : expf(m_old - m_new);
                a_s[r] = alpha;
                l_s[r] = l_s[r] * alpha + sum;
                m_s[r] = m_new;
            }
        }
        __syncthreads();
        // 3. Values.
KVP_UNROLL
        for (int r = 0; r < R; ++r) {
            const float alpha = a_s[r];
KVP_UNROLL
            for (int e = 0; e < A::EPV; ++e) acc[r][e] *= alpha;
        }
        for (uint32_t t0 = vg; t0 < n; t0 += A::V_GROUPS * U) {
            typename S::Vec raw[U];
            float vs[U];
KVP_UNROLL
            for (int u = 0; u < U; ++u) {
                const uint32_t t = t0 + u * A::V_GROUPS;
                raw[u] = t < n ? __ldg(kv_row<S, HD>(p, blk_s[t], v_tile, row_s[t]) + vv) : typename S::Vec{};
                vs[u] = t < n ? kv_scale<S, HD>(p, blk_s[t], v_tile, row_s[t]) : 0.0f;
            }
KVP_UNROLL
            for (int u = 0; u < U; ++u) {
                const uint32_t t = t0 + u * A::V_GROUPS;
                if (t < n) {
                    float x[A::EPV];
                    S::unpack(raw[u], x);
KVP_UNROLL
                    for (int r = 0; r < R; ++r) {
                        if (r < live) {
                            const float pr = s_s[r * C + t] * vs[u];
KVP_UNROLL
                            for (int e = 0; e < A::EPV; ++e) acc[r][e] += pr * x[e];
                        }
                    }
                }
            }
        }
        __syncthreads();
    }

    // Sum the token groups' partial outputs into q_s (free since the last barrier).
    for (uint32_t i = tid; i < (uint32_t)(R * HD); i += KVP_ATT_THREADS) q_s[i] = 0.0f;
    if (A::TV < 32) {
        // Groups inside a warp first: lanes vv, vv + TV, ... hold the same elements.
KVP_UNROLL
        for (int r = 0; r < R; ++r)
            if (r < live)
KVP_UNROLL
                for (int e = 0; e < A::EPV; ++e)
KVP_UNROLL
                    for (int mask = A::TV; mask < 32; mask <<= 1)
                        acc[r][e] += __shfl_xor_sync(0xffffffffu, acc[r][e], mask);
    }
    __syncthreads();
    const bool leader = A::TV >= 32 || lane < (uint32_t)A::TV;
    for (uint32_t w = 0; w < KVP_ATT_THREADS / 32; ++w) {
        if (warp == w && leader) {
KVP_UNROLL
            for (int r = 0; r < R; ++r)
KVP_UNROLL
                for (int e = 0; e < A::EPV; ++e) q_s[r * HD + vv * A::EPV + e] += acc[r][e];
        }
        __syncthreads();
    }

    const uint64_t stat_len = scratch_stat_len(p.scratch_rows, p.q_heads, p.num_partitions);
    for (uint32_t i = tid; i < rows * HD; i += KVP_ATT_THREADS) {
        const uint32_t j = i / HD, d = i % HD;
        const uint32_t r = row0 + j;
        const uint32_t q_row = sq.q_start + r / group, q_head = kvh * group + r % group;
        if (p.num_partitions == 1) {
            p.out[query_offset(q_row, q_head, p.q_heads, HD) + d] = q_s[i] / l_s[j];
        } else {
            const uint64_t st = scratch_stat(q_row, q_head, part, p.q_heads, p.num_partitions);
            p.scratch[2 * stat_len + st * HD + d] = q_s[i];
            if (d == 0) {
                p.scratch[st] = m_s[j];
                p.scratch[stat_len + st] = l_s[j];
            }
        }
    }
}

// Combines the partitions of one (query token, query head): out = sum_p e^(m_p - M) acc_p
// / sum_p e^(m_p - M) l_p over the partitions holding tokens the row sees.
__device__ __forceinline__ void reduce_row(const KvpAttentionParams &p) {
    const KvpSeqDesc sq = p.seqs[blockIdx.x];
    const uint32_t qi = blockIdx.y, q_head = blockIdx.z;
    if (qi >= sq.queries) return;
    const uint32_t limit = sq.context_len - sq.queries + qi + 1;
    const uint32_t parts = (limit + p.partition_tokens - 1) / p.partition_tokens;
    const uint32_t q_row = sq.q_start + qi;
    const uint32_t hd = p.geo.head_dim;
    const uint64_t stat_len = scratch_stat_len(p.scratch_rows, p.q_heads, p.num_partitions);
    const uint64_t st0 = scratch_stat(q_row, q_head, 0, p.q_heads, p.num_partitions);
    const float *m = p.scratch + st0;
    const float *l = p.scratch + stat_len + st0;
    const float *acc = p.scratch + 2 * stat_len + st0 * hd;
    float mx = -INFINITY;
    for (uint32_t i = 0; i < parts; ++i) mx = fmaxf(mx, m[i]);
    float sum = 0.0f;
    for (uint32_t i = 0; i < parts; ++i) sum += expf(m[i] - mx) * l[i];
    const float inv = 1.0f / sum;
    float *o = p.out + query_offset(q_row, q_head, p.q_heads, hd);
    for (uint32_t d = threadIdx.x; d < hd; d += blockDim.x) {
        float x = 0.0f;
        for (uint32_t i = 0; i < parts; ++i) x += expf(m[i] - mx) * acc[(uint64_t)i * hd + d];
        o[d] = x * inv;
    }
}

} // namespace kvp

extern "C" __global__ void __launch_bounds__(KVP_REDUCE_THREADS) kvp_attention_reduce(const KvpAttentionParams p) {
    kvp::reduce_row(p);
}

// CTAs per SM each instance must fit (the register cap ptxas derives from it): 4 for the
// 4-row kernels (<= 128 registers), 3 for the 8-row ones (<= 168), so that a memory-bound
// decode keeps 12-16 warps per SM in flight. Checked: no spills (kernels/README.md).
#define KVP_ATT_MIN_CTAS(R) ((R) == 8 ? 3 : 4)

#define KVP_ATTENTION_KERNEL(name, S, HD, R)                                                               \
    extern "C" __global__ void __launch_bounds__(KVP_ATT_THREADS, KVP_ATT_MIN_CTAS(R)) name(const KvpAttentionParams p) { \
        kvp::attention_cta<kvp::S, HD, R>(p);                                                              \
    }

KVP_ATTENTION_KERNEL(kvp_attention_f32_hd64_r4, F32, 64, 4)
KVP_ATTENTION_KERNEL(kvp_attention_f32_hd64_r8, F32, 64, 8)
KVP_ATTENTION_KERNEL(kvp_attention_f32_hd128_r4, F32, 128, 4)
KVP_ATTENTION_KERNEL(kvp_attention_f32_hd128_r8, F32, 128, 8)
KVP_ATTENTION_KERNEL(kvp_attention_f32_hd256_r4, F32, 256, 4)
KVP_ATTENTION_KERNEL(kvp_attention_f32_hd256_r8, F32, 256, 8)
KVP_ATTENTION_KERNEL(kvp_attention_f16_hd64_r4, F16, 64, 4)
KVP_ATTENTION_KERNEL(kvp_attention_f16_hd64_r8, F16, 64, 8)
KVP_ATTENTION_KERNEL(kvp_attention_f16_hd128_r4, F16, 128, 4)
KVP_ATTENTION_KERNEL(kvp_attention_f16_hd128_r8, F16, 128, 8)
KVP_ATTENTION_KERNEL(kvp_attention_f16_hd256_r4, F16, 256, 4)
KVP_ATTENTION_KERNEL(kvp_attention_f16_hd256_r8, F16, 256, 8)
KVP_ATTENTION_KERNEL(kvp_attention_bf16_hd64_r4, Bf16, 64, 4)
KVP_ATTENTION_KERNEL(kvp_attention_bf16_hd64_r8, Bf16, 64, 8)
KVP_ATTENTION_KERNEL(kvp_attention_bf16_hd128_r4, Bf16, 128, 4)
KVP_ATTENTION_KERNEL(kvp_attention_bf16_hd128_r8, Bf16, 128, 8)
KVP_ATTENTION_KERNEL(kvp_attention_bf16_hd256_r4, Bf16, 256, 4)
KVP_ATTENTION_KERNEL(kvp_attention_bf16_hd256_r8, Bf16, 256, 8)
KVP_ATTENTION_KERNEL(kvp_attention_int8_hd64_r4, I8, 64, 4)
KVP_ATTENTION_KERNEL(kvp_attention_int8_hd64_r8, I8, 64, 8)
KVP_ATTENTION_KERNEL(kvp_attention_int8_hd128_r4, I8, 128, 4)
KVP_ATTENTION_KERNEL(kvp_attention_int8_hd128_r8, I8, 128, 8)
KVP_ATTENTION_KERNEL(kvp_attention_int8_hd256_r4, I8, 256, 4)
KVP_ATTENTION_KERNEL(kvp_attention_int8_hd256_r8, I8, 256, 8)
KVP_ATTENTION_KERNEL(kvp_attention_fp8_hd64_r4, Fp8, 64, 4)
KVP_ATTENTION_KERNEL(kvp_attention_fp8_hd64_r8, Fp8, 64, 8)
KVP_ATTENTION_KERNEL(kvp_attention_fp8_hd128_r4, Fp8, 128, 4)
KVP_ATTENTION_KERNEL(kvp_attention_fp8_hd128_r8, Fp8, 128, 8)
KVP_ATTENTION_KERNEL(kvp_attention_fp8_hd256_r4, Fp8, 256, 4)
KVP_ATTENTION_KERNEL(kvp_attention_fp8_hd256_r8, Fp8, 256, 8)
