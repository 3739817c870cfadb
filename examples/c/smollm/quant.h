/*
 * Dequantization of GGUF tensors to f32, written from the block formats of the GGUF
 * specification (ggml): F32, F16, Q8_0 (blocks of 32: an f16 scale d, 32 int8 q;
 * x = d * q) and Q4_1 (blocks of 32: f16 scale d, f16 minimum m, 16 bytes of 4-bit q,
 * low nibbles elements 0..15, high nibbles 16..31; x = d * q + m).
 */
#ifndef SMOLLM_QUANT_H
#define SMOLLM_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "gguf.h"

/* The IEEE half-precision value of `bits` as a float (exact). */
float f16_to_f32(uint16_t bits);

/* Writes the `t->elements` values of `t` to `out`. Returns non-zero for a type it does
 * not know (gguf.c refuses those already). O(elements). */
int dequantize(const gguf_tensor *t, float *out);

#endif
