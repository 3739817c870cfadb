// kvp_copy_blocks: every (src, dst) block copy of a step in one launch (copy-on-write).
// Launch contract: params.h.
#pragma once
#include "layout.cuh"

namespace kvp {

__device__ __forceinline__ void copy_pair(const KvpCopyParams &p) {
    const uint32_t src = __ldg(p.pairs + 2ull * blockIdx.x);
    const uint32_t dst = __ldg(p.pairs + 2ull * blockIdx.x + 1);
    const uint64_t n = p.bytes_per_block;
    const uint8_t *s = static_cast<const uint8_t *>(p.arena) + (uint64_t)src * n;
    uint8_t *d = static_cast<uint8_t *>(p.arena) + (uint64_t)dst * n;
    const uint64_t threads = blockDim.x;
    const uint64_t stride = (uint64_t)gridDim.y * threads * KVP_COPY_UNROLL;
    if (n % 16u == 0) {
        // Block starts are 16-byte aligned (the arena is): KVP_COPY_UNROLL independent
        // 16-byte loads in flight per thread, each step of a warp one contiguous 512 B.
        const uint4 *s16 = reinterpret_cast<const uint4 *>(s);
        uint4 *d16 = reinterpret_cast<uint4 *>(d);
        const uint64_t v = n / 16u;
        for (uint64_t base = (uint64_t)blockIdx.y * threads * KVP_COPY_UNROLL + threadIdx.x; base < v;
             base += stride) {
            uint4 r[KVP_COPY_UNROLL];
KVP_UNROLL
            for (int u = 0; u < KVP_COPY_UNROLL; ++u) {
                const uint64_t i = base + (uint64_t)u * threads;
                if (i < v) r[u] = __ldg(s16 + i);
            }
KVP_UNROLL
            for (int u = 0; u < KVP_COPY_UNROLL; ++u) {
                const uint64_t i = base + (uint64_t)u * threads;
                if (i < v) d16[i] = r[u];
            }
        }
    } else {
        // Odd block sizes (tiny geometries): bytes.
        for (uint64_t i = (uint64_t)blockIdx.y * threads + threadIdx.x; i < n; i += (uint64_t)gridDim.y * threads)
            d[i] = s[i];
    }
}

} // namespace kvp

extern "C" __global__ void __launch_bounds__(KVP_COPY_THREADS) kvp_copy_blocks(const KvpCopyParams p) {
    kvp::copy_pair(p);
}
