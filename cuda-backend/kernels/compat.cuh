// TEMPORARY stand-in for the EMU helper's compat.cuh (nvcc side only), replaced by
// `git checkout cuda-emu -- cuda-backend/kernels/compat.cuh` once it is committed.
#pragma once
#ifdef __CUDACC__
#define KVP_HD __host__ __device__ inline
#define KVP_DYNAMIC_SHARED(T, name)                                                    \
    extern __shared__ __align__(16) unsigned char kvp_smem[];                          \
    T *name = reinterpret_cast<T *>(kvp_smem)
#else
#include "emulation.hpp"
#endif
