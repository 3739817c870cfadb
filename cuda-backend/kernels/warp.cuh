// Warp-wide reductions (every lane of the warp calls them, full mask).
#pragma once
#include "layout.cuh"

namespace kvp {

// Largest of `v` over the warp (all 32 lanes call it).
__device__ __forceinline__ float warp_max(float v) {
KVP_UNROLL
    for (int mask = 16; mask > 0; mask >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, mask));
    return v;
}

// Sum of `v` over the warp (all 32 lanes call it).
__device__ __forceinline__ float warp_sum(float v) {
KVP_UNROLL
    for (int mask = 16; mask > 0; mask >>= 1) v += __shfl_xor_sync(0xffffffffu, v, mask);
    return v;
}

} // namespace kvp
