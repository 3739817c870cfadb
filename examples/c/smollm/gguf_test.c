/*
 * Tests of the GGUF reader and the dequantization on a small file built here: the file
 * reads back (metadata, tensor values), and every truncation of it and a set of damaged
 * fields (lengths, counts, dimensions, types, offsets, alignment) are refused with a
 * message, never read out of bounds (run under the sanitizers by ctest).
 *
 *   smollm_gguf_test SCRATCH_FILE
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"
#include "quant.h"

static unsigned char buf[4096];
static size_t len;
static int failures;

static void put(const void *p, size_t n) {
  memcpy(buf + len, p, n);
  len += n;
}
static void u32(uint32_t v) {
  unsigned char b[4] = {(unsigned char)v, (unsigned char)(v >> 8), (unsigned char)(v >> 16),
                        (unsigned char)(v >> 24)};
  put(b, 4);
}
static void u64(uint64_t v) {
  u32((uint32_t)v);
  u32((uint32_t)(v >> 32));
}
static void str(const char *s) {
  u64(strlen(s));
  put(s, strlen(s));
}

/* Offsets of fields the damage cases overwrite. */
static size_t at_n_tensors, at_key_len, at_array_count, at_dims, at_type, at_offset, at_n_dims,
    at_align;

/* A GGUF v3 file: 4 metadata entries, a Q8_0 tensor [32] and an F32 tensor [2][2]. */
static void build(void) {
  int i;
  len = 0;
  put("GGUF", 4);
  u32(3);
  at_n_tensors = len;
  u64(2);
  u64(4);
  at_key_len = len;
  str("general.architecture"); u32(8); str("llama");
  str("general.alignment"); u32(4); at_align = len; u32(32);
  str("test.f32"); u32(6); { float f = 0.5f; put(&f, 4); }
  str("test.names"); u32(9); u32(8); at_array_count = len; u64(2); str("a"); str("bc");
  str("q"); at_n_dims = len; u32(1); at_dims = len; u64(32); at_type = len; u32(8); u64(0);
  str("w"); u32(2); u64(2); u64(2); u32(0); at_offset = len; u64(64);
  while (len % 32) buf[len++] = 0;
  /* Q8_0 block: d = 0.5 (f16 0x3800), q = -16..15. */
  buf[len++] = 0x00;
  buf[len++] = 0x38;
  for (i = 0; i < 32; i++) buf[len++] = (unsigned char)(i - 16);
  while (len % 32) buf[len++] = 0;
  for (i = 0; i < 4; i++) {
    float f = (float)i + 0.25f;
    put(&f, 4);
  }
}

static int write_file(const char *path) {
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(buf, 1, len, f) != len) {
    fprintf(stderr, "cannot write %s\n", path);
    exit(1);
  }
  return fclose(f);
}

static void expect_refused(const char *path, const char *what) {
  gguf_file g;
  char err[256] = "";
  write_file(path);
  if (gguf_open(&g, path, err, sizeof err) == 0) {
    fprintf(stderr, "FAIL: %s was accepted\n", what);
    gguf_close(&g);
    failures++;
  } else if (err[0] == '\0') {
    fprintf(stderr, "FAIL: %s refused without a message\n", what);
    failures++;
  }
}

int main(int argc, char **argv) {
  gguf_file g;
  char err[256];
  float q[32], w[4], f;
  uint32_t align;
  size_t full, n, i;
  gguf_str s;
  const gguf_kv *names;
  const uint8_t *p;
  if (argc != 2) return 2;
  build();
  write_file(argv[1]);
  if (gguf_open(&g, argv[1], err, sizeof err)) {
    fprintf(stderr, "FAIL: the valid file was refused: %s\n", err);
    return 1;
  }
  if (gguf_get_str(&g, "general.architecture", &s, err, sizeof err) || !gguf_str_eq(s, "llama") ||
      gguf_get_u32(&g, "general.alignment", &align, err, sizeof err) || align != 32 ||
      gguf_get_f32(&g, "test.f32", &f, err, sizeof err) || f != 0.5f ||
      gguf_get_array(&g, "test.names", GGUF_STRING, &names, err, sizeof err) ||
      names->count != 2 || gguf_get_u32(&g, "test.f32", &align, err, sizeof err) == 0 ||
      gguf_get_u32(&g, "missing", &align, err, sizeof err) == 0) {
    fprintf(stderr, "FAIL: metadata\n");
    failures++;
  }
  p = names->value;
  gguf_next_string(&p);
  if (!gguf_str_eq(gguf_next_string(&p), "bc")) failures++;
  if (dequantize(gguf_tensor_find(&g, "q"), q) || dequantize(gguf_tensor_find(&g, "w"), w)) {
    fprintf(stderr, "FAIL: dequantize\n");
    failures++;
  }
  for (i = 0; i < 32; i++)
    if (q[i] != 0.5f * ((float)i - 16.0f)) {
      fprintf(stderr, "FAIL: q[%zu] = %g\n", i, (double)q[i]);
      failures++;
    }
  for (i = 0; i < 4; i++)
    if (w[i] != (float)i + 0.25f) failures++;
  if (f16_to_f32(0x3c00) != 1.0f || f16_to_f32(0xc000) != -2.0f ||
      f16_to_f32(0x0001) != 5.9604644775390625e-8f || f16_to_f32(0x7bff) != 65504.0f) {
    fprintf(stderr, "FAIL: f16\n");
    failures++;
  }
  gguf_close(&g);

  /* Every truncation is refused. */
  full = len;
  for (n = 0; n < full; n++) {
    char what[64];
    build();
    len = n;
    snprintf(what, sizeof what, "the file cut to %zu bytes", n);
    expect_refused(argv[1], what);
  }
  /* Damaged fields. */
  build(); buf[0] = 'X'; expect_refused(argv[1], "a bad magic");
  build(); buf[4] = 9; expect_refused(argv[1], "version 9");
  build(); memset(buf + at_n_tensors, 0xff, 8); expect_refused(argv[1], "2^64-1 tensors");
  build(); memset(buf + at_key_len, 0xff, 8); expect_refused(argv[1], "a 2^64-1-byte key");
  build(); buf[at_key_len] = 200; expect_refused(argv[1], "a key past the end");
  build(); memset(buf + at_array_count + 4, 0x7f, 4); expect_refused(argv[1], "a huge array");
  build(); buf[at_n_dims] = 5; expect_refused(argv[1], "5 dimensions");
  build(); buf[at_dims] = 0; expect_refused(argv[1], "a zero dimension");
  build(); buf[at_dims] = 33; expect_refused(argv[1], "a partial Q8_0 block");
  build(); buf[at_type] = 99; expect_refused(argv[1], "an unknown tensor type");
  build(); buf[at_offset] = 96; expect_refused(argv[1], "a tensor past the end");
  build(); buf[at_offset] = 65; expect_refused(argv[1], "a misaligned tensor");
  build(); memset(buf + at_offset, 0xff, 8); expect_refused(argv[1], "an offset of 2^64-1");
  build(); buf[at_align] = 3; expect_refused(argv[1], "alignment 3");
  remove(argv[1]);
  if (failures) {
    fprintf(stderr, "%d failures\n", failures);
    return 1;
  }
  printf("gguf reader: valid file read, %zu truncations and 14 damaged fields refused\n", full);
  return 0;
}
