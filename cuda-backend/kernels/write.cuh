// kvp_write_kv: store the K and V of new tokens of one layer at their slots (the CUDA
// twin of host-std's `kernels::write_kv`). Launch contract: params.h.
#pragma once
#include "dtype.cuh"
#include "layout.cuh"
#include "warp.cuh"

namespace kvp {

__device__ __forceinline__ void write_row(const KvpWriteParams &p) {
    const uint32_t lane = threadIdx.x % 32u;
    const uint32_t row = blockIdx.y * KVP_WRITE_WARPS + threadIdx.x / 32u;
    const KvpGeometry &g = p.geo;
    // Whole warps leave together: the shuffles below see full warps only.
    if (row >= 2u * g.kv_heads) return;
    const uint32_t head = row / 2u, kv = row % 2u;
    const uint32_t token = blockIdx.x;
    const uint32_t hd = g.head_dim;
    const float *src = (kv == 0 ? p.k : p.v) + ((uint64_t)token * g.kv_heads + head) * hd;
    const uint32_t slot = __ldg(p.slots + token);
    const uint32_t block = slot_block(slot, g.block_size);
    const uint32_t off = slot_offset(slot, g.block_size);
    const uint64_t at = row_offset(g, block, p.layer, kv, head, off);
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
        float absmax = 0.0f;
        for (uint32_t d = lane; d < hd; d += 32u) absmax = fmaxf(absmax, fabsf(__ldg(src + d)));
        absmax = warp_max(absmax);
        const float s = scale_for(g.dtype, absmax);
        for (uint32_t d = lane; d < hd; d += 32u) bytes[at + d] = encode8(g.dtype, __ldg(src + d), s);
        if (lane < 4u) {
            // Little-endian f32, byte by byte (the row's scale need not be 4-aligned).
            const uint64_t so = scale_offset(g, block, p.layer, kv, head, off);
            bytes[so + lane] = (uint8_t)(__float_as_uint(s) >> (8u * lane));
        }
        break;
    }
    }
}

// kvp_write_kv_stored: the same scatter with k and v already in the storage dtype (f32,
// f16 or bf16; host-std's write_kv_as): copied as they are, no rounding.
__device__ __forceinline__ void write_row_stored(const KvpWriteParams &p) {
    const uint32_t lane = threadIdx.x % 32u;
    const uint32_t row = blockIdx.y * KVP_WRITE_WARPS + threadIdx.x / 32u;
    const KvpGeometry &g = p.geo;
    if (row >= 2u * g.kv_heads) return;
    const uint32_t head = row / 2u, kv = row % 2u;
    const uint32_t token = blockIdx.x;
    const uint32_t hd = g.head_dim;
    const uint64_t src = ((uint64_t)token * g.kv_heads + head) * hd;
    const uint32_t slot = __ldg(p.slots + token);
    const uint64_t at = row_offset(g, slot_block(slot, g.block_size), p.layer, kv, head, slot_offset(slot, g.block_size));
    const void *in = kv == 0 ? static_cast<const void *>(p.k) : static_cast<const void *>(p.v);
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
