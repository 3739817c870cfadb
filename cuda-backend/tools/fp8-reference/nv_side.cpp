// Compares the kernels' software FP8 E4M3 conversions with NVIDIA's host reference of
// the sm_89+ instructions the kernels use there (cuda_fp8.hpp: the host branches of
// __nv_cvt_fp8_to_halfraw, for cvt.rn.f16x2.e4m3x2, and __nv_cvt_float_to_fp8 with
// __NV_SATFINITE, for cvt.rn.satfinite.e4m3x2.f32):
// - decode: every code, in every byte of a word; bit-identical f32 for each non-NaN
//   code, a NaN for each NaN code (bits may differ: see fp8x4_decode);
// - encode: every one of the 2^32 f32 bit patterns, NaNs included; identical codes.
// Exit status 0 when all agree. Run by check.sh.
#include <cuda_fp8.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

extern "C" uint8_t kvp_fp8_encode(float y);
extern "C" void kvp_fp8x4_decode(uint32_t w, float *x);
extern "C" float kvp_f16_to_f32(uint16_t h);

namespace {

uint32_t bits(float f) {
    uint32_t b;
    std::memcpy(&b, &f, sizeof b);
    return b;
}

// The reference value of a code: NVIDIA's f16 of it, widened exactly.
float reference_decode(uint32_t code) {
    return kvp_f16_to_f32(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)code, __NV_E4M3).x);
}

unsigned check_decode() {
    unsigned bad = 0;
    for (uint32_t c = 0; c < 256; ++c) {
        const uint32_t codes[4] = {c, c ^ 0x55u, c ^ 0xAAu, c ^ 0xFFu};
        float x[4];
        kvp_fp8x4_decode(codes[0] | codes[1] << 8 | codes[2] << 16 | codes[3] << 24, x);
        for (int i = 0; i < 4; ++i) {
            const float want = reference_decode(codes[i]);
            const bool same = want != want ? x[i] != x[i] : bits(x[i]) == bits(want);
            if (!same && bad++ < 10)
                std::printf("decode %02x (byte %d): kernels %08x, reference %08x\n", codes[i], i, bits(x[i]),
                            bits(want));
        }
    }
    return bad;
}

uint64_t check_encode() {
    uint64_t bad = 0;
    for (uint64_t b = 0; b <= 0xFFFFFFFFull; ++b) {
        const uint32_t u = (uint32_t)b;
        float y;
        std::memcpy(&y, &u, sizeof y);
        const uint8_t want = __nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3);
        const uint8_t got = kvp_fp8_encode(y);
        if (got != want && bad++ < 10) std::printf("encode %08x: kernels %02x, reference %02x\n", u, got, want);
    }
    return bad;
}

} // namespace

int main() {
    const unsigned dec = check_decode();
    std::printf("decode: 256 codes x 4 bytes of a word, %u disagree\n", dec);
    const uint64_t enc = check_encode();
    std::printf("encode: 2^32 f32 bit patterns, %llu disagree\n", (unsigned long long)enc);
    return dec == 0 && enc == 0 ? 0 : 1;
}
