/* Dequantization: see quant.h. */
#include "quant.h"

#include <math.h>
#include <string.h>

float f16_to_f32(uint16_t bits) {
  uint32_t sign = (uint32_t)(bits >> 15), exp = (bits >> 10) & 0x1f, mant = bits & 0x3ff;
  float v;
  if (exp == 0)
    v = ldexpf((float)mant, -24); /* zero and subnormals: mant * 2^-24 */
  else if (exp == 31)
    v = mant ? NAN : INFINITY;
  else
    v = ldexpf((float)(mant | 0x400), (int)exp - 25);
  return sign ? -v : v;
}

static uint16_t le16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

int dequantize(const gguf_tensor *t, float *out) {
  const uint8_t *p = t->data;
  uint64_t i, blocks = t->elements / 32;
  int j;
  switch (t->type) {
  case GGUF_T_F32:
    for (i = 0; i < t->elements; i++) {
      uint32_t bits = (uint32_t)p[4 * i] | (uint32_t)p[4 * i + 1] << 8 |
                      (uint32_t)p[4 * i + 2] << 16 | (uint32_t)p[4 * i + 3] << 24;
      memcpy(&out[i], &bits, 4);
    }
    return 0;
  case GGUF_T_F16:
    for (i = 0; i < t->elements; i++) out[i] = f16_to_f32(le16(p + 2 * i));
    return 0;
  case GGUF_T_Q8_0:
    for (i = 0; i < blocks; i++, p += 34) {
      float d = f16_to_f32(le16(p));
      for (j = 0; j < 32; j++) {
        int q = p[2 + j] & 0x80 ? (int)p[2 + j] - 256 : (int)p[2 + j]; /* int8 */
        out[32 * i + (uint64_t)j] = d * (float)q;
      }
    }
    return 0;
  case GGUF_T_Q4_1:
    for (i = 0; i < blocks; i++, p += 20) {
      float d = f16_to_f32(le16(p)), m = f16_to_f32(le16(p + 2));
      for (j = 0; j < 16; j++) {
        out[32 * i + (uint64_t)j] = d * (float)(p[4 + j] & 0x0f) + m;
        out[32 * i + 16 + (uint64_t)j] = d * (float)(p[4 + j] >> 4) + m;
      }
    }
    return 0;
  default:
    return 1;
  }
}
