// compat.cuh: the one header every kernel source includes first.
//
// The kernels are written once, in CUDA C++, and compiled two ways:
// - by nvcc (`__CUDACC__` defined): CUDA's own built-ins are used; this header only adds the
//   two kvpage macros below and includes nothing heavy (no cuda_fp16.h: the kernels own
//   their f16/bf16 conversions);
// - by a host C++17 compiler for tests: this header includes emulation.hpp, which defines
//   the CUDA subset the kernels may use (qualifiers, built-ins, barriers, warp shuffles,
//   shared memory, vector types, math) and `kvp_emu::launch`. See emulation.hpp for what is
//   and is not emulated.
//
// Macros available in both builds:
// - `KVP_HD`: `__host__ __device__ inline`, for index arithmetic and conversions that host
//   tests call directly.
// - `KVP_DYNAMIC_SHARED(T, name);` declares `T* name` pointing at the CTA's dynamic shared
//   memory (16-byte aligned). In emulation that memory is filled with 0xFF bytes at every
//   CTA start, so reading an element no thread wrote gives NaN.
// - `KVP_UNROLL` before a loop: `#pragma unroll` under nvcc, nothing on the host (g++ warns
//   about an unknown `#pragma unroll`, and GCC 12 cannot silence that warning by pragma).
// `KVP_EMULATION` is defined in host builds only.
#ifndef KVP_COMPAT_CUH
#define KVP_COMPAT_CUH

#if defined(__CUDACC__)
#define KVP_DYNAMIC_SHARED(T, name)                                   \
    extern __shared__ __align__(16) unsigned char kvp_dynamic_smem[]; \
    T* name = reinterpret_cast<T*>(kvp_dynamic_smem)
#define KVP_UNROLL _Pragma("unroll")
#else
#define KVP_UNROLL
#include "emulation.hpp"
#endif

#define KVP_HD __host__ __device__ inline

#endif  // KVP_COMPAT_CUH
