// emulation_selftest_kernels.cuh: the kernels that check the CUDA emulation itself.
//
// They compile with nvcc (checked with `nvcc -x cu -std=c++17 -c ... -Werror all-warnings`)
// and as host C++ through compat.cuh; emulation_selftest.cpp launches them with
// `kvp_emu::launch` and compares with host computations. Some of them are wrong on purpose
// (a missing `__syncthreads`, a thread that skips a barrier) or rely on the emulation running
// CTAs and fibers one at a time (the run-order logs): those say so.
#ifndef KVP_EMULATION_SELFTEST_KERNELS_CUH
#define KVP_EMULATION_SELFTEST_KERNELS_CUH

#include "../compat.cuh"

#define KVP_EMU_FULL_MASK 0xffffffffu

/// Linear index of the thread in its CTA (x fastest).
__device__ inline unsigned kvp_emu_test_thread() {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

/// Linear index of the CTA in the grid (x fastest).
__device__ inline unsigned kvp_emu_test_cta() {
    return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
}

struct KvpEmuReduceParams {
    const float* in;  // threads per CTA * CTAs
    float* out;       // one sum per CTA
};

/// Sum of each CTA's inputs by a shared-memory tree with a barrier per level; any block
/// shape and any thread count up to 1024.
extern "C" __global__ void kvp_emu_test_block_reduce(const KvpEmuReduceParams p) {
    __shared__ float partial[1024];
    const unsigned n = blockDim.x * blockDim.y * blockDim.z;
    const unsigned t = kvp_emu_test_thread();
    const unsigned cta = kvp_emu_test_cta();
    partial[t] = p.in[cta * n + t];
    __syncthreads();
    for (unsigned active = n; active > 1;) {
        const unsigned half = (active + 1) / 2;
        if (t + half < active) partial[t] += partial[t + half];
        __syncthreads();
        active = half;
    }
    if (t == 0) p.out[cta] = partial[0];
}

struct KvpEmuWarpParams {
    const float* f;    // one per thread
    const int* i;      // one per thread
    float* xor_sum;    // per thread: its warp's sum of f by xor butterflies
    int* down_sum;     // per warp: sum of i by shuffle-down (lane 0's result)
    unsigned* bcast;   // per thread: lane 5's value of 7t+3
    unsigned* ballot;  // per thread: ballot of (i % 3 == 0)
    float* half_sum;   // per thread: its half-warp's sum of f (width 16)
    int* scan;         // per thread: inclusive prefix sum of i in the warp (shuffle-up)
    int half_only;     // 1: only the width-16 sum (blocks with a partial last warp)
};

/// Warp shuffles: xor, down, broadcast, up, ballot, and xor with width 16. Blocks with
/// `half_only` set may have a partial last warp of a multiple of 16 lanes.
extern "C" __global__ void kvp_emu_test_warp(const KvpEmuWarpParams p) {
    const unsigned n = blockDim.x;
    const unsigned t = kvp_emu_test_cta() * n + threadIdx.x;
    const unsigned lane = threadIdx.x % 32;
    float h = p.f[t];
    for (int o = 8; o > 0; o /= 2) h += __shfl_xor_sync(KVP_EMU_FULL_MASK, h, o, 16);
    p.half_sum[t] = h;
    if (p.half_only) return;

    float f = p.f[t];
    for (int o = 16; o > 0; o /= 2) f += __shfl_xor_sync(KVP_EMU_FULL_MASK, f, o);
    p.xor_sum[t] = f;

    int v = p.i[t];
    for (unsigned o = 16; o > 0; o /= 2) v += __shfl_down_sync(KVP_EMU_FULL_MASK, v, o);
    if (lane == 0) p.down_sum[t / 32] = v;

    p.bcast[t] = __shfl_sync(KVP_EMU_FULL_MASK, 7u * t + 3u, 5);
    p.ballot[t] = __ballot_sync(KVP_EMU_FULL_MASK, p.i[t] % 3 == 0);

    int s = p.i[t];
    for (unsigned o = 1; o < 32; o *= 2) {
        const int up = __shfl_up_sync(KVP_EMU_FULL_MASK, s, o);
        if (lane >= o) s += up;
    }
    p.scan[t] = s;
}

struct KvpEmuPoisonParams {
    float* out;         // 2 * threads per CTA * CTAs: the CTA's dynamic shared memory
    unsigned* aligned;  // per CTA: 1 if the dynamic shared pointer is 16-byte aligned
};

/// Reads its dynamic shared memory (2 floats per thread) back after writing part of it:
/// CTA 0 writes every element of the first half, the others only the even ones; nobody
/// writes the second half.
extern "C" __global__ void kvp_emu_test_poison(const KvpEmuPoisonParams p) {
    KVP_DYNAMIC_SHARED(float, smem);
    const unsigned n = blockDim.x, t = threadIdx.x, cta = kvp_emu_test_cta();
    if (t == 0) p.aligned[cta] = (reinterpret_cast<unsigned long long>(smem) % 16) == 0 ? 1u : 0u;
    if (cta == 0 || t % 2 == 0) smem[t] = static_cast<float>(t);
    __syncthreads();
    p.out[cta * 2 * n + t] = smem[t];
    p.out[cta * 2 * n + n + t] = smem[n + t];
}

struct KvpEmuShiftParams {
    const float* in;
    float* out;
    int sync;  // 0: the barrier between the write and the read is missing (a bug on purpose)
};

/// out[t] = in[t + 1 mod n] through dynamic shared memory; correct only with `sync` set.
extern "C" __global__ void kvp_emu_test_shift(const KvpEmuShiftParams p) {
    KVP_DYNAMIC_SHARED(float, smem);
    const unsigned n = blockDim.x, t = threadIdx.x, base = kvp_emu_test_cta() * n;
    smem[t] = p.in[base + t];
    if (p.sync) __syncthreads();
    p.out[base + t] = smem[(t + 1) % n];
}

struct KvpEmuDeadlockParams {
    int mode;
    unsigned* after;  // per thread: set when it passed the barrier
};

/// Wrong on purpose, one way per mode:
/// 0: thread 0 returns before a `__syncthreads` the others wait at;
/// 1: half a warp waits at `__syncwarp`, the other half at `__shfl_xor_sync`;
/// 2: lane 0 returns before a shuffle the other lanes wait at;
/// 3: in warp 1, half the lanes wait at `__syncthreads`, half at `__shfl_sync`;
/// 4: thread 0 waits at `__syncthreads_count`, the others at `__syncthreads`.
extern "C" __global__ void kvp_emu_test_deadlock(const KvpEmuDeadlockParams p) {
    const unsigned t = threadIdx.x, lane = t % 32;
    float v = 1.0f;
    if (p.mode == 0) {
        if (t == 0) return;
        __syncthreads();
    } else if (p.mode == 1) {
        if (lane < 16) {
            __syncwarp(KVP_EMU_FULL_MASK);
        } else {
            v = __shfl_xor_sync(KVP_EMU_FULL_MASK, v, 1);
        }
    } else if (p.mode == 2) {
        if (lane == 0) return;
        v = __shfl_xor_sync(KVP_EMU_FULL_MASK, v, 1);
    } else if (p.mode == 3) {
        if (t < 48) {
            __syncthreads();
        } else {
            v = __shfl_sync(KVP_EMU_FULL_MASK, v, 0);
        }
    } else {
        if (t == 0) {
            v = static_cast<float>(__syncthreads_count(1));
        } else {
            __syncthreads();
        }
    }
    p.after[t] = v == 1.0f ? 1u : 2u;
}

struct KvpEmuIndexParams {
    unsigned* out;         // 12 per thread: threadIdx, blockIdx, blockDim, gridDim
    unsigned* cta_log;     // emulation only: linear CTA indices in the order the CTAs ran
    unsigned* thread_log;  // emulation only: CTA 0's thread indices in the order they ran
    unsigned* cursor;      // [0]: CTAs logged, [1]: threads logged
};

/// Writes every built-in index of every thread, and (relying on the emulation running one
/// CTA and one fiber at a time) the order in which CTAs and CTA 0's threads first ran.
extern "C" __global__ void kvp_emu_test_index(const KvpEmuIndexParams p) {
    const unsigned n = blockDim.x * blockDim.y * blockDim.z;
    const unsigned t = kvp_emu_test_thread(), cta = kvp_emu_test_cta();
    if (t == 0) p.cta_log[p.cursor[0]++] = cta;
    if (cta == 0) p.thread_log[p.cursor[1]++] = t;
    unsigned* o = p.out + 12u * (cta * n + t);
    o[0] = threadIdx.x;
    o[1] = threadIdx.y;
    o[2] = threadIdx.z;
    o[3] = blockIdx.x;
    o[4] = blockIdx.y;
    o[5] = blockIdx.z;
    o[6] = blockDim.x;
    o[7] = blockDim.y;
    o[8] = blockDim.z;
    o[9] = gridDim.x;
    o[10] = gridDim.y;
    o[11] = gridDim.z;
}

struct KvpEmuTrapParams {
    unsigned* ran;  // per thread of every CTA (linear CTA index * threads + linear thread index)
};

/// Thread 3 of CTA 1 traps; every other thread marks that it ran.
extern "C" __global__ void kvp_emu_test_trap(const KvpEmuTrapParams p) {
    if (blockIdx.x == 1 && threadIdx.x == 3) __trap();
    p.ran[kvp_emu_test_cta() * blockDim.x * blockDim.y * blockDim.z + kvp_emu_test_thread()] = 1;
}

struct KvpEmuVoteParams {
    int* out;  // 4 per thread: count of t % 3 == 0, and of true, or of the last thread, or of 0
};

/// CTA-wide votes: `__syncthreads_count`, `__syncthreads_and`, `__syncthreads_or`.
extern "C" __global__ void kvp_emu_test_cta_vote(const KvpEmuVoteParams p) {
    const unsigned t = threadIdx.x;
    int* o = p.out + 4 * (kvp_emu_test_cta() * blockDim.x + t);
    o[0] = __syncthreads_count(t % 3 == 0);
    o[1] = __syncthreads_and(t < blockDim.x);
    o[2] = __syncthreads_or(t + 1 == blockDim.x);
    o[3] = __syncthreads_or(0);
}

/// Floats of the local array of kvp_emu_test_stack (96 KiB: more than the default fiber stack).
#define KVP_EMU_TEST_STACK_FLOATS (24 * 1024)

struct KvpEmuStackParams {
    float* out;  // per thread: the sum of its local array, filled before a barrier
};

/// A large local array per thread, written before a barrier and summed after it: fibers need
/// stacks of more than 96 KiB, and must not share them.
extern "C" __global__ void kvp_emu_test_stack(const KvpEmuStackParams p) {
    float local[KVP_EMU_TEST_STACK_FLOATS];
    const unsigned t = kvp_emu_test_cta() * blockDim.x + threadIdx.x;
    for (unsigned i = 0; i < KVP_EMU_TEST_STACK_FLOATS; ++i)
        local[i] = static_cast<float>((t + i) % 4);
    __syncthreads();
    float sum = 0.0f;
    for (unsigned i = 0; i < KVP_EMU_TEST_STACK_FLOATS; ++i) sum += local[i];
    p.out[t] = sum;
}

struct KvpEmuBarrierLoopParams {
    unsigned rounds;
    unsigned* out;  // per thread: rounds passed
};

/// `rounds` barriers in a row (measures the cost of the fiber switches).
extern "C" __global__ void kvp_emu_test_barrier_loop(const KvpEmuBarrierLoopParams p) {
    unsigned r = 0;
    for (; r < p.rounds; ++r) __syncthreads();
    p.out[blockIdx.x * blockDim.x + threadIdx.x] = r;
}

#endif  // KVP_EMULATION_SELFTEST_KERNELS_CUH
