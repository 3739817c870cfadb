// The kernels' FP8 E4M3 conversions (kernels/dtype.cuh, host build: the software path,
// the one sm_80 and the emulation run), behind a C ABI so that nv_side.cpp, which
// includes NVIDIA's headers, never sees the emulation's CUDA definitions.
#include "compat.cuh"
#include "dtype.cuh"

extern "C" uint8_t kvp_fp8_encode(float y) { return kvp::fp8_encode(y); }
extern "C" void kvp_fp8x4_decode(uint32_t w, float *x) { kvp::fp8x4_decode(w, x); }
extern "C" float kvp_f16_to_f32(uint16_t h) { return kvp::f16_to_f32(h); }
