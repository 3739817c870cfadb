// kvp_write_kv: store the K and V of new tokens of one layer at their slots (the CUDA
// twin of host-std's `kernels::write_kv`). Launch contract: params.h.
#pragma once
#include "dtype.cuh"
#include "layout.cuh"
#include "warp.cuh"

namespace kvp {

// The row one warp of a write launch stores (blockIdx.x: the token; blockIdx.y and the
// warp: the row, K and V of each kv head) and where it lands: the prologue shared by
// write_row and write_row_stored.
struct WriteRow {
    uint32_t lane;  // this thread's lane in the warp
    uint32_t head;  // kv head
    uint32_t kv;    // 0: K, 1: V
    uint32_t block; // the token's slot: its block and its offset in the block
    uint32_t off;
    uint64_t src;   // element offset of the row in p.k / p.v ([tokens][kv_heads][head_dim])
    uint64_t at;    // element offset of the row in the arena (row_offset)
};

// Fills r for the calling thread; false when its warp has no row (past 2 * kv_heads):
// whole warps leave together, so the shuffles of the 8-bit path see full warps only.
__device__ __forceinline__ bool locate_row(const KvpWriteParams &p, WriteRow &r) {
    const KvpGeometry &g = p.geo;
    const uint32_t row = blockIdx.y * KVP_WRITE_WARPS + threadIdx.x / 32u;
    if (row >= 2u * g.kv_heads) return false;
    const uint32_t token = blockIdx.x;
    const uint32_t slot = __ldg(p.slots + token);
    r.lane = threadIdx.x % 32u;
    r.head = row / 2u;
    r.kv = row % 2u;
    r.block = slot_block(slot, g.block_size);
    r.off = slot_offset(slot, g.block_size);
    r.src = ((uint64_t)token * g.kv_heads + r.head) * g.head_dim;
    r.at = row_offset(g, r.block, p.layer, r.kv, r.head, r.off);
    return true;
}

__device__ __forceinline__ void write_row(const KvpWriteParams &p) {
    WriteRow r;
    if (!locate_row(p, r)) return;
    const KvpGeometry &g = p.geo;
    const uint32_t lane = r.lane, hd = g.head_dim;
    const uint64_t at = r.at;
    const float *src = (r.kv == 0 ? p.k : p.v) + r.src;
    switch (g.dtype) {
    case KVP_DTYPE_F32: {
        float *dst = static_cast<float *>(p.arena) + at;
        for (uint32_t d = lane; d < hd; d += 32u) dst[d] = __ldg(src + d);
        break;
    }
    case KVP_DTYPE_F16: {
        uint16_t *dst = static_cast<uint16_t *>(p.arena) + at;
        for (uint32_t d = lane; d < hd; d += 32u) dst[d] = f32_to_f16(__ldg(src + d));
        break;
    }
    case KVP_DTYPE_BF16: {
        uint16_t *dst = static_cast<uint16_t *>(p.arena) + at;
        for (uint32_t d = lane; d < hd; d += 32u) dst[d] = f32_to_bf16(__ldg(src + d));
        break;
    }
    default: { // 8-bit codes: one scale per row, stored after the tile's codes
        uint8_t *bytes = static_cast<uint8_t *>(p.arena);
        // fmaxf skips NaN, so non-finite values are counted apart: a row with a NaN or
        // an infinity stores a NaN scale (its codes as without it), host-std's rule
        // (quant::Code::quantize_row).
        float absmax = 0.0f, nan = 0.0f;
        for (uint32_t d = lane; d < hd; d += 32u) {
            const float x = __ldg(src + d);
            absmax = fmaxf(absmax, fabsf(x));
            if (!finite_f32(x)) nan = 1.0f;
        }
        absmax = warp_max(absmax);
        nan = warp_max(nan);
        // A fixed scale (the caller's, nonzero) in place of the row's own; the codes
        // saturate beyond it (host-std's quantize_row_at).
        const float fixed = r.kv == 0 ? p.k_scale : p.v_scale;
        const float s = fixed != 0.0f ? fixed : scale_for(g.dtype, absmax);
        for (uint32_t d = lane; d < hd; d += 32u) bytes[at + d] = encode8(g.dtype, __ldg(src + d), s);
        if (lane < 4u) {
            // Little-endian f32, byte by byte (the row's scale need not be 4-aligned).
            const uint64_t so = scale_offset(g, r.block, p.layer, r.kv, r.head, r.off);
            const uint32_t stored = nan != 0.0f ? 0x7fc00000u : __float_as_uint(s);
            bytes[so + lane] = (uint8_t)(stored >> (8u * lane));
        }
        break;
    }
    }
}

// kvp_write_kv_stored: the same scatter with k and v already in the storage dtype (f32,
// f16 or bf16; host-std's write_kv_as): copied as they are, no rounding.
__device__ __forceinline__ void write_row_stored(const KvpWriteParams &p) {
    WriteRow r;
    if (!locate_row(p, r)) return;
    const KvpGeometry &g = p.geo;
    const uint32_t lane = r.lane, hd = g.head_dim;
    const uint64_t src = r.src, at = r.at;
    const void *in = r.kv == 0 ? static_cast<const void *>(p.k) : static_cast<const void *>(p.v);
    if (g.dtype == KVP_DTYPE_F32) {
        const uint32_t *from = static_cast<const uint32_t *>(in) + src;
        uint32_t *dst = static_cast<uint32_t *>(p.arena) + at;
        for (uint32_t d = lane; d < hd; d += 32u) dst[d] = __ldg(from + d);
    } else {
        const uint16_t *from = static_cast<const uint16_t *>(in) + src;
        uint16_t *dst = static_cast<uint16_t *>(p.arena) + at;
        for (uint32_t d = lane; d < hd; d += 32u) dst[d] = __ldg(from + d);
    }
}

} // namespace kvp

extern "C" __global__ void __launch_bounds__(KVP_WRITE_WARPS * 32) kvp_write_kv(const KvpWriteParams p) {
    kvp::write_row(p);
}

extern "C" __global__ void __launch_bounds__(KVP_WRITE_WARPS * 32) kvp_write_kv_stored(const KvpWriteParams p) {
    kvp::write_row_stored(p);
}
