// Storage element conversions, host and device.
//
// Device (nvcc, __CUDA_ARCH__): PTX `cvt` for f16 / bf16 (no cuda_fp16.h needed).
// Host (emulation): bit-exact software round-to-nearest-even matching the Rust `half`
// crate and host-std's `Element::narrow` (NaN stays NaN, quiet). The 8-bit codecs are
// integer / IEEE arithmetic on both sides, bit-exact with host-std's `quant` module
// (`Code::scale_for`, `Code::encode`, `fp8::encode`). On sm_89 and later the FP8 E4M3
// conversions use the hardware's (PTX `cvt` with `.e4m3x2`, see KVP_NATIVE_FP8), which
// give the same codes and values: below sm_89 and on the host, the software ones.
#pragma once
#include "layout.cuh"

// 1 where the device code is compiled for sm_89 or later (Ada, Hopper, Blackwell): PTX
// ISA 7.8's `cvt.rn.f16x2.e4m3x2` and `cvt.rn.satfinite.e4m3x2.f32` exist there. 0 in
// the host passes (emulation, nvcc's host side) and for older targets.
#if defined(__CUDACC__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define KVP_NATIVE_FP8 1
#else
#define KVP_NATIVE_FP8 0
#endif

namespace kvp {

KVP_HD uint32_t f32_bits(float x) { return __float_as_uint(x); }
KVP_HD float f32_from_bits(uint32_t b) { return __uint_as_float(b); }

// f16 bits -> f32 (exact).
KVP_HD float f16_to_f32(uint16_t h) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1Fu;
    const uint32_t m = h & 0x3FFu;
    if (e == 0) {
        // Zero or subnormal: m * 2^-24, exact in f32.
        const float v = (float)m * 5.9604644775390625e-8f;
        return f32_from_bits(f32_bits(v) | sign);
    }
    if (e == 31) {
        return f32_from_bits(m == 0 ? (sign | 0x7F800000u) : (sign | 0x7FC00000u | (m << 13)));
    }
    return f32_from_bits(sign | ((e + 112u) << 23) | (m << 13));
#endif
}

// f32 -> f16 bits, round to nearest even; overflow to infinity; NaN stays NaN.
KVP_HD uint16_t f32_to_f16(float x) {
#ifdef __CUDA_ARCH__
    uint16_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
#else
    const uint32_t b = f32_bits(x);
    const uint32_t sign = (b >> 16) & 0x8000u;
    const uint32_t a = b & 0x7FFFFFFFu;
    if (a >= 0x7F800000u) {
        if (a == 0x7F800000u) return (uint16_t)(sign | 0x7C00u);
        return (uint16_t)(sign | 0x7E00u | ((a & 0x7FFFFFu) >> 13));
    }
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); // >= 65520 rounds to inf
    if (a < 0x38800000u) {                                     // below 2^-14: subnormal
        if (a <= 0x33000000u) return (uint16_t)sign;           // <= 2^-25 rounds to 0
        const uint32_t e = a >> 23;
        const uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
        const uint32_t shift = 126u - e; // 14..24
        uint32_t q = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1u);
        const uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u))) ++q;
        return (uint16_t)(sign | q);
    }
    uint32_t h = ((((a >> 23) - 112u) << 10) | ((a & 0x7FFFFFu) >> 13));
    const uint32_t rem = a & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h; // a carry bumps the exponent
    return (uint16_t)(sign | h);
#endif
}

// bf16 bits -> f32 (exact: the top half of an f32).
KVP_HD float bf16_to_f32(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }

// f32 -> bf16 bits, round to nearest even; NaN stays NaN (quiet).
KVP_HD uint16_t f32_to_bf16(float x) {
#ifdef __CUDA_ARCH__
    uint16_t h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
#else
    const uint32_t b = f32_bits(x);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((b >> 16) | 0x40u);
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
#endif
}

// Largest magnitude of an 8-bit code: 127 (int8), 448 (fp8 e4m3).
KVP_HD float code_max(uint32_t dtype) { return dtype == KVP_DTYPE_INT8 ? 127.0f : 448.0f; }

// Whether `x` is neither NaN nor infinite (|x| at most FLT_MAX).
KVP_HD bool finite_f32(float x) { return fabsf(x) <= 3.4028234663852886e38f; }

// Scale of a row whose largest magnitude is `absmax`: absmax / max, or 1 for a zero or
// non-finite row (Code::scale_for).
KVP_HD float scale_for(uint32_t dtype, float absmax) {
    return (absmax > 0.0f && finite_f32(absmax)) ? absmax / code_max(dtype) : 1.0f;
}

// FP8 E4M3 (e4m3fn) code of y: nearest, ties to even, saturating to +-448 (infinities
// too), NaN -> 0x7F; a result of zero keeps y's sign.
//
// sm_89+: `cvt.rn.satfinite.e4m3x2.f32` rounds the same way (nearest even, and
// .satfinite clamps every finite or infinite magnitude past 448 to 448, keeping the
// sign); what it gives for NaN is 0x7F by NVIDIA's documentation (their cuda_fp8.hpp
// host reference canonicalises NaN to +NaN first), but the NaN case is selected here all
// the same, so the code of a NaN never depends on the hardware's NaN sign handling.
KVP_HD uint8_t fp8_encode(float y) {
#if KVP_NATIVE_FP8
    uint16_t pair; // high byte: the code of the first source (0), low byte: of y
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.0f), "f"(y));
    return y != y ? (uint8_t)0x7F : (uint8_t)(pair & 0xFFu);
#else
    const uint32_t b = f32_bits(y);
    const uint32_t a = b & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return 0x7F;
    const uint8_t sign = (b >> 31) ? 0x80 : 0x00;
    if (a >= 0x43E00000u) return sign | 0x7E; // >= 448
    const int exp = (int)(a >> 23) - 127;
    if (exp < -6) {
        // Subnormal range, step 2^-9: m = round_half_even(|y| * 512), 0..=8 (8 carries
        // into the smallest normal, code 0x08). |y| * 512 is exact.
        const float s = f32_from_bits(a) * 512.0f;
        uint32_t m = (uint32_t)s; // truncation, s < 8
        const float frac = s - (float)m;
        if (frac > 0.5f || (frac == 0.5f && (m & 1u))) ++m;
        return sign | (uint8_t)m;
    }
    const uint32_t man = a & 0x7FFFFFu;
    const uint32_t keep = man >> 20;
    const uint32_t rest = man & 0xFFFFFu;
    const uint32_t up = (rest > 0x80000u || (rest == 0x80000u && (keep & 1u))) ? 1u : 0u;
    uint32_t code = ((uint32_t)(exp + 7) << 3) + keep + up;
    if (code > 0x7Eu) code = 0x7Eu;
    return sign | (uint8_t)code;
#endif
}

// Int8 code of y: round half away from zero, clamp to +-127; NaN -> 0x80.
KVP_HD uint8_t int8_encode(float y) {
    if (y != y) return 0x80;
    float r = roundf(y);
    r = fminf(fmaxf(r, -127.0f), 127.0f);
    return (uint8_t)(int8_t)(int)r;
}

// Code of x in a row of scale s (Code::encode: the code of x / s).
KVP_HD uint8_t encode8(uint32_t dtype, float x, float s) {
    const float y = x / s;
    return dtype == KVP_DTYPE_INT8 ? int8_encode(y) : fp8_encode(y);
}

// Value of an int8 code (host-std's Code::Int8::decode: -128, which writes produce only
// for NaN input, is NaN).
KVP_HD float int8_decode(uint32_t b) {
    return b == 0x80u ? f32_from_bits(0x7FC00000u) : (float)(int8_t)(uint8_t)b;
}

// Value of an FP8 E4M3 code (fp8::decode): exact, NaN for S.1111.111.
KVP_HD float fp8_decode(uint32_t b) {
    const uint32_t sign = (b & 0x80u) << 24;
    const uint32_t e = (b >> 3) & 0x0Fu, m = b & 0x07u;
    if (e == 15u && m == 7u) return f32_from_bits(sign | 0x7FC00000u);
    if (e == 0u) return f32_from_bits(f32_bits((float)m * 0.001953125f) | sign); // m * 2^-9
    return f32_from_bits(sign | ((e + 120u) << 23) | (m << 20));
}

// Values of the four FP8 E4M3 codes of a little-endian word (byte i -> x[i]), as
// fp8_decode gives them.
//
// sm_89+: two `cvt.rn.f16x2.e4m3x2` (two codes to two f16 each; exact, every E4M3 value
// is an f16 normal) and four exact `cvt.f32.f16`, instead of some twenty integer
// operations per code. Identical values for every non-NaN code, zeros' signs included;
// a NaN code gives a NaN whose bits differ (f16 canonical NaN 0x7FFF, sign dropped,
// widened by the hardware, where fp8_decode gives sign | 0x7FC00000). The kernels only
// multiply the values, and a NaN operand makes a NaN result whatever its bits, so their
// outputs are the same on both paths.
KVP_HD void fp8x4_decode(uint32_t w, float *x) {
#if KVP_NATIVE_FP8
    uint32_t h[2];
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h[0]) : "h"((uint16_t)(w & 0xFFFFu)));
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h[1]) : "h"((uint16_t)(w >> 16)));
KVP_UNROLL
    for (int i = 0; i < 2; ++i) {
        x[2 * i] = f16_to_f32((uint16_t)(h[i] & 0xFFFFu));
        x[2 * i + 1] = f16_to_f32((uint16_t)(h[i] >> 16));
    }
#else
KVP_UNROLL
    for (int i = 0; i < 4; ++i) x[i] = fp8_decode((w >> (8 * i)) & 0xFFu);
#endif
}

// Storage tags of the attention kernels: `Vec`, the vector one thread loads (16 bytes;
// 8 for the 8-bit codes, so that every tag widens 4 or 8 elements per load and the
// register budget stays the same), widened to f32 bit-exactly as host-std's
// Element::widen / Code::decode; `scaled`: values are codes times a per-token scale.
struct F32 {
    using Vec = uint4;
    static constexpr int bytes = 4;
    static constexpr bool scaled = false;
    static __device__ __forceinline__ void unpack(const Vec &r, float *x) {
        x[0] = __uint_as_float(r.x);
        x[1] = __uint_as_float(r.y);
        x[2] = __uint_as_float(r.z);
        x[3] = __uint_as_float(r.w);
    }
};

struct F16 {
    using Vec = uint4;
    static constexpr int bytes = 2;
    static constexpr bool scaled = false;
    static __device__ __forceinline__ void unpack(const Vec &r, float *x) {
        const uint32_t w[4] = {r.x, r.y, r.z, r.w};
KVP_UNROLL
        for (int i = 0; i < 4; ++i) {
            x[2 * i] = f16_to_f32((uint16_t)(w[i] & 0xFFFFu));
            x[2 * i + 1] = f16_to_f32((uint16_t)(w[i] >> 16));
        }
    }
};

struct Bf16 {
    using Vec = uint4;
    static constexpr int bytes = 2;
    static constexpr bool scaled = false;
    static __device__ __forceinline__ void unpack(const Vec &r, float *x) {
        const uint32_t w[4] = {r.x, r.y, r.z, r.w};
KVP_UNROLL
        for (int i = 0; i < 4; ++i) {
            x[2 * i] = __uint_as_float(w[i] << 16);
            x[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
        }
    }
};

// 8-bit codes: `Codec::decode4(word, x)` gives the values, before scaling, of the four
// codes of a little-endian word.
template <class Codec> struct Codes8 {
    using Vec = uint2;
    static constexpr int bytes = 1;
    static constexpr bool scaled = true;
    static __device__ __forceinline__ void unpack(const Vec &r, float *x) {
        Codec::decode4(r.x, x);
        Codec::decode4(r.y, x + 4);
    }
};

struct Int8Codec {
    static KVP_HD void decode4(uint32_t w, float *x) {
KVP_UNROLL
        for (int i = 0; i < 4; ++i) x[i] = int8_decode((w >> (8 * i)) & 0xFFu);
    }
};

struct Fp8Codec {
    static KVP_HD void decode4(uint32_t w, float *x) { fp8x4_decode(w, x); }
};

using I8 = Codes8<Int8Codec>;
using Fp8 = Codes8<Fp8Codec>;

} // namespace kvp
