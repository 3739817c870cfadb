/*
 * Feeds every function of the C API bad input — null pointers, zero sizes, stale,
 * never-issued and foreign ids, double release, buffers too short, configurations that
 * cannot fit, a wrong dtype, rotary parameters that do not fit, keys shared with a
 * fork, damaged sequence blobs — and checks that each call returns its code, fills the
 * error struct, changes nothing (statistics and lengths are compared before and after)
 * and that every object works normally afterwards (its results equal those of an object
 * that never saw a bad call). Run under AddressSanitizer, UBSan and
 * LeakSanitizer by the tests: nothing may crash or leak.
 */
#include <kvpage.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static unsigned checks, failures;
static kvpage_error err;

/* One bad (or good) call: its code must be `want`; a failure must fill `err`. */
static void expect(kvpage_result got, kvpage_result want, const char *call, int line) {
  checks++;
  if (got != want) {
    failures++;
    printf("line %d: %s returned %u (%s), want %u (%s)\n", line, call, got, kvpage_result_str(got),
           want, kvpage_result_str(want));
  } else if (got != KVPAGE_OK && (err.code != got || err.message[0] == '\0')) {
    failures++;
    printf("line %d: %s did not fill the error struct\n", line, call);
  }
  memset(&err, 0xAB, sizeof err); /* a stale struct must not pass the next check */
}
#define EXPECT(want, call) expect((call), (want), #call, __LINE__)

static void expect_true(int ok, const char *what, int line) {
  checks++;
  if (!ok) {
    failures++;
    printf("line %d: %s\n", line, what);
  }
}
#define EXPECT_TRUE(cond) expect_true((cond), #cond, __LINE__)

static int same_stats(const kvpage_stats *a, const kvpage_stats *b) {
  return a->total_blocks == b->total_blocks && a->free_blocks == b->free_blocks &&
         a->cached_blocks == b->cached_blocks && a->used_blocks == b->used_blocks &&
         a->live_seqs == b->live_seqs && a->tokens_stored == b->tokens_stored &&
         a->logical_tokens == b->logical_tokens;
}

static void section(const char *name, unsigned before) {
  printf("%s: %u checks\n", name, checks - before);
}

enum { LAYERS = 2, KV_HEADS = 2, HEAD_DIM = 8, BLOCK = 4, Q_HEADS = 4, ROW = KV_HEADS * HEAD_DIM };
static const kvpage_geometry GEOMETRY = {LAYERS, KV_HEADS, HEAD_DIM, BLOCK, KVPAGE_DTYPE_F16};

static kvpage_cache_params cache_params(uint32_t blocks) {
  kvpage_cache_params p = kvpage_cache_default_params(GEOMETRY);
  p.capacity_bytes = 0;
  p.capacity_blocks = blocks;
  p.max_seqs = 4;
  p.max_seq_len = 32;
  p.threads = 1;
  return p;
}

static float value(uint32_t i) { return (float)((i * 2654435761u) >> 20 & 0xff) / 128.0f - 1.0f; }

/* A normal workload on a cache: a prompt, its K/V, a decode. Writes the attention
 * output to `out` (Q_HEADS * HEAD_DIM floats); returns 0 on success. */
static int workload(kvpage_cache *c, float *out) {
  uint32_t prompt[6] = {1, 2, 3, 4, 5, 6}, layer, i, reused = 0;
  float k[6 * ROW], v[6 * ROW], q[Q_HEADS * HEAD_DIM];
  kvpage_seq s;
  kvpage_error e;
  for (i = 0; i < 6 * ROW; i++) k[i] = value(i), v[i] = value(i + 1000);
  for (i = 0; i < Q_HEADS * HEAD_DIM; i++) q[i] = value(i + 2000);
  if (kvpage_cache_create_with_prompt(c, 9, prompt, 6, &s, &reused, &e) != KVPAGE_OK) return 1;
  for (layer = 0; layer < LAYERS; layer++)
    if (kvpage_cache_write_kv(c, s, layer, reused, 6 - reused, k + reused * ROW,
                              (6 - reused) * ROW, v + reused * ROW, (6 - reused) * ROW,
                              &e) != KVPAGE_OK)
      return 1;
  if (kvpage_cache_decode(c, 1, &s, 1, q, Q_HEADS * HEAD_DIM, out, Q_HEADS * HEAD_DIM, Q_HEADS,
                          0.35f, &e) != KVPAGE_OK)
    return 1;
  return kvpage_cache_release(c, s, &e) != KVPAGE_OK;
}

static void result_codes(void) {
  unsigned before = checks, code, other;
  for (code = 0; code <= KVPAGE_RESULT_LAST; code++) {
    const char *s = kvpage_result_str(code);
    int distinct = s != NULL && strcmp(s, "unknown result code") != 0;
    for (other = 0; distinct && other < code; other++)
      distinct = strcmp(s, kvpage_result_str(other)) != 0;
    EXPECT_TRUE(distinct);
  }
  EXPECT_TRUE(strcmp(kvpage_result_str(9999), "unknown result code") == 0);
  EXPECT_TRUE(kvpage_version() == KVPAGE_VERSION_MAJOR * 10000 + KVPAGE_VERSION_MINOR * 100 +
                                      KVPAGE_VERSION_PATCH);
  section("result codes and version", before);
}

static void cache_configs(void) {
  unsigned before = checks;
  kvpage_cache *c = NULL;
  kvpage_cache_params p = cache_params(16);
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_new(NULL, &c, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_new(&p, NULL, &err));
  p.capacity_blocks = 0; /* neither capacity */
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_cache_new(&p, &c, &err));
  p = cache_params(16);
  p.capacity_bytes = 1 << 20; /* both */
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_cache_new(&p, &c, &err));
  p = cache_params(16);
  p.geometry.dtype = 9;
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_cache_new(&p, &c, &err));
  p = cache_params(16);
  p.geometry.head_dim = 4096; /* over the kernels' maximum */
  EXPECT(KVPAGE_ERR_BAD_CONFIG, kvpage_cache_new(&p, &c, &err));
  p = cache_params(16);
  p.geometry.layers = 0;
  EXPECT(KVPAGE_ERR_BAD_CONFIG, kvpage_cache_new(&p, &c, &err));
  p = cache_params(16);
  p.max_seqs = 0;
  EXPECT(KVPAGE_ERR_BAD_CONFIG, kvpage_cache_new(&p, &c, &err));
  p = cache_params(16);
  p.capacity_blocks = 0;
  p.capacity_bytes = 10; /* less than one block */
  EXPECT(KVPAGE_ERR_BAD_CONFIG, kvpage_cache_new(&p, &c, &err));
  p = cache_params(16);
  p.capacity_blocks = 0;
  p.capacity_bytes = UINT64_MAX; /* does not fit in memory */
  EXPECT_TRUE(kvpage_cache_new(&p, &c, &err) != KVPAGE_OK);
  memset(&err, 0, sizeof err);
  p = cache_params(16);
  EXPECT_TRUE(p.max_namespaces == KVPAGE_CACHE_NAMESPACES);
  p.max_namespaces = 257; /* over the core's namespace table limit */
  EXPECT(KVPAGE_ERR_BAD_CONFIG, kvpage_cache_new(&p, &c, &err));
  p.max_namespaces = UINT32_MAX;
  EXPECT(KVPAGE_ERR_BAD_CONFIG, kvpage_cache_new(&p, &c, &err));
  EXPECT_TRUE(c == NULL); /* no out-parameter written on failure */
  EXPECT(KVPAGE_OK, kvpage_cache_free(NULL, &err));
  section("cache configurations", before);
}

static void cache_calls(void) {
  unsigned before = checks;
  kvpage_cache_params p = cache_params(8); /* 32 token slots */
  kvpage_cache *c = NULL, *fresh = NULL, *other = NULL;
  kvpage_seq s, gone, foreign, child = KVPAGE_SEQ_NONE;
  kvpage_stats st0, st1;
  uint32_t prompt[5] = {1, 2, 3, 4, 5}, len = 0, tokens[40] = {0};
  float k[5 * ROW] = {0}, v[5 * ROW] = {0}, q[6 * Q_HEADS * HEAD_DIM] = {0};
  float out[6 * Q_HEADS * HEAD_DIM], want[Q_HEADS * HEAD_DIM], got[Q_HEADS * HEAD_DIM];
  uint16_t raw[5 * ROW] = {0};
  kvpage_seq batch[5], keep_set[2];
  kvpage_context_shift shift;
  int64_t pos = 0;
  uint32_t nq[5] = {1, 1, 1, 1, 1};
  float nan_scale = (float)NAN;

  EXPECT(KVPAGE_OK, kvpage_cache_new(&p, &c, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_new(&p, &other, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_create(other, 0, &foreign, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_create_with_prompt(c, 1, prompt, 5, &s, NULL, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_create(c, 1, &gone, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_release(c, gone, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_stats(c, &st0, &err));

  /* Null pointers, in every position that takes one. */
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_create(NULL, 0, &child, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_create(c, 0, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_create_with_prompt(c, 1, NULL, 3, &child, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_create_with_prompt(c, 1, prompt, 3, NULL, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_append_tokens(c, s, NULL, 2, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_append(NULL, s, 1, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_commit(NULL, s, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_fork(c, s, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_truncate(NULL, s, 1, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_release(NULL, s, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_len(c, s, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_stats(c, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_geometry(NULL, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_evict_cached(NULL, 1, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_write_kv(c, s, 0, 0, 5, NULL, 5 * ROW, v, 5 * ROW, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_write_kv(c, s, 0, 0, 5, k, 5 * ROW, NULL, 5 * ROW, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_write_kv_raw(c, s, 0, 0, 5, KVPAGE_DTYPE_F16, NULL, 5 * ROW, raw, 5 * ROW, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_decode(c, 0, NULL, 1, q, Q_HEADS * HEAD_DIM, out, Q_HEADS * HEAD_DIM, Q_HEADS, 0.35f, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_decode(c, 0, &s, 1, NULL, Q_HEADS * HEAD_DIM, out, Q_HEADS * HEAD_DIM, Q_HEADS, 0.35f, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_decode(c, 0, &s, 1, q, Q_HEADS * HEAD_DIM, NULL, Q_HEADS * HEAD_DIM, Q_HEADS, 0.35f, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_prefill(c, 0, &s, NULL, 1, q, Q_HEADS * HEAD_DIM, out, Q_HEADS * HEAD_DIM, Q_HEADS, 0.35f, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_seq_rm(NULL, s, 0, 1, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_seq_add(NULL, s, 0, 1, 1, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_seq_cp(c, s, 0, 1, 0, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_seq_keep(c, s, NULL, 2, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_context_shift(c, s, 1, 1, NULL, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_seq_pos_min(c, s, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_seq_pos_max(NULL, s, &pos, &err));

  /* Pointers to something that is not a cache (here 16 zero bytes). */
  {
    uint64_t garbage[2] = {0, 0};
    kvpage_step step;
    kvpage_engine_counters counters;
    EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_cache_stats((kvpage_cache *)garbage, &st1, &err));
    EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_cache_free((kvpage_cache *)garbage, &err));
    EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_engine_step((kvpage_engine *)garbage, &step, &err));
    EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_scheduler_stats((kvpage_scheduler *)garbage, &counters, &err));
  }

  /* Stale (released), never-issued and foreign ids; double release. */
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_cache_release(c, gone, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_cache_len(c, gone, &len, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_cache_append(c, gone, 1, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_cache_append_tokens(c, KVPAGE_SEQ_NONE, prompt, 1, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_cache_commit(c, 12345, NULL, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_cache_fork(c, gone, &child, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_cache_truncate(c, gone, 0, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_cache_write_kv(c, gone, 0, 0, 1, k, ROW, v, ROW, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_cache_decode(c, 0, &gone, 1, q, Q_HEADS * HEAD_DIM, out, Q_HEADS * HEAD_DIM, Q_HEADS, 0.35f, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_cache_seq_rm(c, gone, 0, 0, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_cache_seq_add(c, gone, 0, 0, 1, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_cache_seq_cp(c, gone, 0, 0, 0, &child, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_cache_context_shift(c, gone, 0, 0, NULL, &shift, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_cache_seq_pos_min(c, gone, &pos, &err));
  /* A stale id anywhere in the set: nothing is released (`s` stays live). */
  keep_set[0] = s;
  keep_set[1] = gone;
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_cache_seq_keep(c, KVPAGE_SEQ_NONE, keep_set, 2, NULL, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_cache_seq_keep(c, gone, keep_set, 1, NULL, &err));
  EXPECT_TRUE(kvpage_cache_len(c, foreign, &len, &err) != KVPAGE_OK);
  memset(&err, 0, sizeof err);
  EXPECT_TRUE(child == KVPAGE_SEQ_NONE);

  /* Buffers too short, with the numbers. */
  EXPECT(KVPAGE_ERR_BUFFER_TOO_SMALL, kvpage_cache_write_kv(c, s, 0, 0, 5, k, 5 * ROW - 1, v, 5 * ROW, &err));
  EXPECT(KVPAGE_ERR_BUFFER_TOO_SMALL, kvpage_cache_write_kv(c, s, 0, 0, 5, k, 5 * ROW, v, 3, &err));
  EXPECT(KVPAGE_ERR_BUFFER_TOO_SMALL, kvpage_cache_decode(c, 0, &s, 1, q, Q_HEADS * HEAD_DIM - 1, out, Q_HEADS * HEAD_DIM, Q_HEADS, 0.35f, &err));
  EXPECT_TRUE(kvpage_cache_decode(c, 0, &s, 1, q, Q_HEADS * HEAD_DIM, out, 7, Q_HEADS, 0.35f, &err) == KVPAGE_ERR_BUFFER_TOO_SMALL && err.needed == Q_HEADS * HEAD_DIM && err.available == 7);
  memset(&err, 0, sizeof err);

  /* Wrong dtype, layer, heads, scale; positions not writable; too long; beyond length. */
  EXPECT(KVPAGE_ERR_DTYPE_MISMATCH, kvpage_cache_write_kv_raw(c, s, 0, 0, 5, KVPAGE_DTYPE_BF16, raw, 5 * ROW, raw, 5 * ROW, &err));
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_cache_write_kv_raw(c, s, 0, 0, 5, 77, raw, 5 * ROW, raw, 5 * ROW, &err));
  EXPECT(KVPAGE_ERR_BAD_LAYER, kvpage_cache_write_kv(c, s, LAYERS, 0, 5, k, 5 * ROW, v, 5 * ROW, &err));
  EXPECT(KVPAGE_ERR_BAD_LAYER, kvpage_cache_decode(c, LAYERS, &s, 1, q, Q_HEADS * HEAD_DIM, out, Q_HEADS * HEAD_DIM, Q_HEADS, 0.35f, &err));
  EXPECT(KVPAGE_ERR_BAD_HEADS, kvpage_cache_decode(c, 0, &s, 1, q, 3 * HEAD_DIM, out, 3 * HEAD_DIM, 3, 0.35f, &err));
  EXPECT(KVPAGE_ERR_BAD_HEADS, kvpage_cache_decode(c, 0, &s, 1, q, 0, out, 0, 0, 0.35f, &err));
  EXPECT(KVPAGE_ERR_BAD_SCALE, kvpage_cache_decode(c, 0, &s, 1, q, Q_HEADS * HEAD_DIM, out, Q_HEADS * HEAD_DIM, Q_HEADS, nan_scale, &err));
  EXPECT(KVPAGE_ERR_NOT_WRITABLE, kvpage_cache_write_kv(c, s, 0, 3, 5, k, 5 * ROW, v, 5 * ROW, &err));
  nq[0] = 6;
  EXPECT(KVPAGE_ERR_QUERIES_EXCEED_CONTEXT, kvpage_cache_prefill(c, 0, &s, nq, 1, q, 6 * Q_HEADS * HEAD_DIM, out, 6 * Q_HEADS * HEAD_DIM, Q_HEADS, 0.35f, &err));
  EXPECT(KVPAGE_ERR_SEQ_TOO_LONG, kvpage_cache_append_tokens(c, s, tokens, 40, &err));
  EXPECT(KVPAGE_ERR_BEYOND_LENGTH, kvpage_cache_truncate(c, s, 6, &err));
  /* Edits: ranges past the length or reversed, positions out of order or range. */
  EXPECT_TRUE(kvpage_cache_seq_rm(c, s, 2, 6, &err) == KVPAGE_ERR_BEYOND_LENGTH && err.needed == 6 && err.available == 5 && err.value == 2);
  memset(&err, 0, sizeof err);
  EXPECT(KVPAGE_ERR_BEYOND_LENGTH, kvpage_cache_seq_rm(c, s, 3, 2, &err));
  EXPECT(KVPAGE_ERR_BEYOND_LENGTH, kvpage_cache_seq_cp(c, s, 0, 9, 0, &child, &err));
  EXPECT(KVPAGE_ERR_BEYOND_LENGTH, kvpage_cache_context_shift(c, s, 4, 2, NULL, &shift, &err));
  EXPECT(KVPAGE_ERR_BEYOND_LENGTH, kvpage_cache_context_shift(c, s, 1, 0xFFFFFFFFu, NULL, &shift, &err));
  EXPECT(KVPAGE_ERR_BEYOND_LENGTH, kvpage_cache_seq_add(c, s, 0, 7, 1, &err));
  EXPECT(KVPAGE_ERR_BAD_POSITIONS, kvpage_cache_seq_add(c, s, 2, 5, -2, &err));
  EXPECT(KVPAGE_ERR_BAD_POSITIONS, kvpage_cache_seq_add(c, s, 0, 5, -1, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_seq_add(c, s, 4, 5, INT32_MAX, &err));
  EXPECT(KVPAGE_ERR_BAD_POSITIONS, kvpage_cache_seq_add(c, s, 4, 5, INT32_MAX, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_seq_add(c, s, 4, 5, -INT32_MAX, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_seq_pos_max(c, s, &pos, &err));
  EXPECT_TRUE(pos == 4);
  /* Too many position runs: each gap is a run, and a sequence holds 4. */
  EXPECT(KVPAGE_OK, kvpage_cache_seq_add(c, s, 4, 5, 3, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_seq_add(c, s, 3, 5, 3, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_seq_add(c, s, 2, 5, 3, &err));
  EXPECT_TRUE(kvpage_cache_seq_add(c, s, 1, 5, 3, &err) == KVPAGE_ERR_TOO_MANY_POSITION_RUNS && err.needed == 5 && err.available == 4);
  memset(&err, 0, sizeof err);
  EXPECT(KVPAGE_OK, kvpage_cache_seq_add(c, s, 2, 5, -3, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_seq_add(c, s, 3, 5, -3, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_seq_add(c, s, 4, 5, -3, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_seq_pos_min(c, s, &pos, &err));
  EXPECT_TRUE(pos == 0);
  EXPECT(KVPAGE_OK, kvpage_cache_seq_pos_max(c, s, &pos, &err));
  EXPECT_TRUE(pos == 4);
  batch[0] = batch[1] = batch[2] = batch[3] = batch[4] = s;
  EXPECT(KVPAGE_ERR_BATCH_TOO_LARGE, kvpage_cache_decode(c, 0, batch, 5, q, 5 * Q_HEADS * HEAD_DIM, out, 5 * Q_HEADS * HEAD_DIM, Q_HEADS, 0.35f, &err));
  /* Out of blocks: 2 of 8 are used; a 30-token prompt needs 8. */
  EXPECT_TRUE(kvpage_cache_create_with_prompt(c, 2, tokens, 30, &child, NULL, &err) == KVPAGE_ERR_OUT_OF_BLOCKS && err.needed == 8 && err.available == 6);
  memset(&err, 0, sizeof err);

  /* Zero sizes are no-ops. */
  EXPECT(KVPAGE_OK, kvpage_cache_seq_rm(c, s, 2, 2, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_seq_keep(c, s, NULL, 0, NULL, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_context_shift(c, s, 5, 0, NULL, &shift, &err));
  EXPECT_TRUE(shift.rotate_first == shift.rotate_end && shift.delta == 0);
  EXPECT(KVPAGE_OK, kvpage_cache_append(c, s, 0, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_append_tokens(c, s, NULL, 0, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_decode(c, 0, NULL, 0, NULL, 0, NULL, 0, Q_HEADS, 0.35f, &err));

  /* Nothing changed. */
  EXPECT(KVPAGE_OK, kvpage_cache_stats(c, &st1, &err));
  EXPECT_TRUE(same_stats(&st0, &st1));
  EXPECT(KVPAGE_OK, kvpage_cache_len(c, s, &len, &err));
  EXPECT_TRUE(len == 5);

  /* The cache works normally: its results equal a fresh cache's, bit for bit. */
  EXPECT(KVPAGE_OK, kvpage_cache_release(c, s, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_new(&p, &fresh, &err));
  EXPECT_TRUE(workload(c, got) == 0);
  EXPECT_TRUE(workload(fresh, want) == 0);
  EXPECT_TRUE(memcmp(got, want, sizeof got) == 0);
  EXPECT(KVPAGE_OK, kvpage_cache_free(fresh, &err));

  /* 8-bit storage: floats are quantized with a scale per token and head; codes given
     as they are carry no scale, so a raw write is refused and changes nothing. */
  {
    kvpage_cache_params p8 = cache_params(8);
    kvpage_cache *c8 = NULL;
    kvpage_seq s8;
    p8.geometry.dtype = KVPAGE_DTYPE_INT8;
    EXPECT(KVPAGE_OK, kvpage_cache_new(&p8, &c8, &err));
    EXPECT(KVPAGE_OK, kvpage_cache_create(c8, 0, &s8, &err));
    EXPECT(KVPAGE_OK, kvpage_cache_append(c8, s8, 5, &err));
    EXPECT(KVPAGE_OK, kvpage_cache_write_kv(c8, s8, 0, 0, 5, k, 5 * ROW, v, 5 * ROW, &err));
    EXPECT(KVPAGE_OK, kvpage_cache_decode(c8, 0, &s8, 1, q, Q_HEADS * HEAD_DIM, out, Q_HEADS * HEAD_DIM, Q_HEADS, 0.35f, &err));
    EXPECT(KVPAGE_ERR_DTYPE_MISMATCH, kvpage_cache_write_kv_raw(c8, s8, 0, 0, 5, KVPAGE_DTYPE_INT8, raw, 5 * ROW, raw, 5 * ROW, &err));
    /* Fixed scales: bad layers and scales refused, the setting unchanged; float
       storage has none to fix. */
    {
      float ks = -1.0f, vs = -1.0f;
      /* Compared as float variables: where float arithmetic is x87's (i386 without
         SSE), the literal 0.01f compares at long double precision. */
      const float k_fixed = 0.01f, v_fixed = 0.02f;
      EXPECT(KVPAGE_OK, kvpage_cache_set_kv_scales(c8, 1, k_fixed, v_fixed, &err));
      EXPECT(KVPAGE_ERR_BAD_LAYER, kvpage_cache_set_kv_scales(c8, LAYERS, k_fixed, v_fixed, &err));
      EXPECT(KVPAGE_ERR_BAD_SCALE, kvpage_cache_set_kv_scales(c8, 1, 0.0f, v_fixed, &err));
      EXPECT(KVPAGE_ERR_BAD_SCALE, kvpage_cache_set_kv_scales(c8, 1, k_fixed, nan_scale, &err));
      EXPECT(KVPAGE_ERR_BAD_SCALE, kvpage_cache_set_kv_scales(c8, 1, -k_fixed, v_fixed, &err));
      EXPECT(KVPAGE_ERR_BAD_LAYER, kvpage_cache_clear_kv_scales(c8, LAYERS, &err));
      EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_kv_scales(c8, 1, NULL, &vs, &err));
      EXPECT(KVPAGE_OK, kvpage_cache_kv_scales(c8, 1, &ks, &vs, &err));
      EXPECT_TRUE(ks == k_fixed && vs == v_fixed);
      EXPECT(KVPAGE_OK, kvpage_cache_kv_scales(c8, 0, &ks, &vs, &err));
      EXPECT_TRUE(ks == 0.0f && vs == 0.0f);
      EXPECT(KVPAGE_OK, kvpage_cache_write_kv(c8, s8, 1, 0, 5, k, 5 * ROW, v, 5 * ROW, &err));
      EXPECT(KVPAGE_OK, kvpage_cache_clear_kv_scales(c8, 1, &err));
      EXPECT(KVPAGE_ERR_DTYPE_MISMATCH, kvpage_cache_set_kv_scales(c, 0, 1.0f, 1.0f, &err));
      EXPECT(KVPAGE_ERR_DTYPE_MISMATCH, kvpage_cache_kv_scales(c, 0, &ks, &vs, &err));
    }
    EXPECT(KVPAGE_OK, kvpage_cache_free(c8, &err));
  }
  EXPECT(KVPAGE_OK, kvpage_cache_free(other, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_free(c, &err));
  section("cache calls", before);
}

/* Decodes the last token of `s` in layer 1 into `out` (Q_HEADS * HEAD_DIM floats). */
static kvpage_result decode_last(kvpage_cache *c, kvpage_seq s, float *out) {
  float q[Q_HEADS * HEAD_DIM];
  uint32_t i;
  for (i = 0; i < Q_HEADS * HEAD_DIM; i++) q[i] = value(i + 3000);
  return kvpage_cache_decode(c, 1, &s, 1, q, Q_HEADS * HEAD_DIM, out, Q_HEADS * HEAD_DIM, Q_HEADS, 0.35f, &err);
}

/* Re-rotating keys after a context shift: bad parameters, ranges and ids, and blocks
 * shared with a fork, are refused and change nothing, the stored keys included (a
 * decode before and after agrees bit for bit). */
static void rotate_calls(void) {
  unsigned before = checks;
  kvpage_cache_params p = cache_params(8);
  kvpage_cache *c = NULL;
  kvpage_seq s, child, gone;
  kvpage_stats st0, st1;
  kvpage_rope_params rope = {10000.0f, HEAD_DIM, KVPAGE_ROPE_HALF_SPLIT}, bad;
  kvpage_context_shift shift;
  float k[6 * ROW], v[6 * ROW], want[Q_HEADS * HEAD_DIM], got[Q_HEADS * HEAD_DIM];
  uint32_t layer, i, len = 0;

  for (i = 0; i < 6 * ROW; i++) k[i] = value(i + 4000), v[i] = value(i + 5000);
  EXPECT(KVPAGE_OK, kvpage_cache_new(&p, &c, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_create(c, 0, &s, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_append(c, s, 6, &err));
  for (layer = 0; layer < LAYERS; layer++)
    EXPECT(KVPAGE_OK, kvpage_cache_write_kv(c, s, layer, 0, 6, k, 6 * ROW, v, 6 * ROW, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_commit(c, s, NULL, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_fork(c, s, &child, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_create(c, 0, &gone, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_release(c, gone, &err));
  EXPECT(KVPAGE_OK, decode_last(c, s, want));
  EXPECT(KVPAGE_OK, kvpage_cache_stats(c, &st0, &err));

  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_rotate_keys(NULL, s, 0, 6, -2, &rope, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_rotate_keys(c, s, 0, 6, -2, NULL, &err));
  bad = rope, bad.pairing = 9;
  EXPECT_TRUE(kvpage_cache_rotate_keys(c, s, 0, 6, -2, &bad, &err) == KVPAGE_ERR_INVALID_ARGUMENT && err.value == 9);
  memset(&err, 0, sizeof err);
  bad = rope, bad.rotary_dims = 7;
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_cache_rotate_keys(c, s, 0, 6, -2, &bad, &err));
  bad = rope, bad.rotary_dims = HEAD_DIM + 2;
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_cache_rotate_keys(c, s, 0, 6, -2, &bad, &err));
  bad = rope, bad.rotary_dims = 0;
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_cache_rotate_keys(c, s, 0, 6, -2, &bad, &err));
  bad = rope, bad.base = (float)NAN;
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_cache_rotate_keys(c, s, 0, 6, -2, &bad, &err));
  bad = rope, bad.base = 1.0f;
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_cache_rotate_keys(c, s, 0, 6, -2, &bad, &err));
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_cache_rotate_keys(c, s, 4, 3, -2, &rope, &err));
  EXPECT_TRUE(kvpage_cache_rotate_keys(c, s, 0, 7, -2, &rope, &err) == KVPAGE_ERR_BEYOND_LENGTH && err.needed == 7 && err.available == 6);
  memset(&err, 0, sizeof err);
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_cache_rotate_keys(c, gone, 0, 1, -2, &rope, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_cache_rotate_keys(c, KVPAGE_SEQ_NONE, 0, 1, -2, &rope, &err));
  EXPECT_TRUE(kvpage_cache_rotate_keys(c, s, 2, 6, -2, &rope, &err) == KVPAGE_ERR_BLOCK_SHARED && err.needed == 2);
  memset(&err, 0, sizeof err);
  EXPECT(KVPAGE_ERR_BLOCK_SHARED, kvpage_cache_rotate_keys(c, child, 5, 6, -2, &rope, &err));
  /* A context shift with rope parameters checks them before it moves anything. */
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_context_shift(NULL, s, 1, 2, &rope, &shift, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_context_shift(c, s, 1, 2, &rope, NULL, &err));
  bad = rope, bad.pairing = 9;
  EXPECT_TRUE(kvpage_cache_context_shift(c, s, 1, 2, &bad, &shift, &err) == KVPAGE_ERR_INVALID_ARGUMENT && err.value == 9);
  memset(&err, 0, sizeof err);
  bad = rope, bad.rotary_dims = 7;
  EXPECT_TRUE(kvpage_cache_context_shift(c, s, 1, 2, &bad, &shift, &err) == KVPAGE_ERR_INVALID_ARGUMENT && err.value == 7);
  memset(&err, 0, sizeof err);
  bad = rope, bad.rotary_dims = HEAD_DIM + 2;
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_cache_context_shift(c, s, 1, 2, &bad, &shift, &err));
  bad = rope, bad.base = (float)NAN;
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_cache_context_shift(c, s, 1, 2, &bad, &shift, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_cache_context_shift(c, gone, 1, 2, &rope, &shift, &err));
  EXPECT(KVPAGE_ERR_BEYOND_LENGTH, kvpage_cache_context_shift(c, s, 5, 2, &rope, &shift, &err));

  /* Nothing changed, the keys included. */
  EXPECT(KVPAGE_OK, kvpage_cache_stats(c, &st1, &err));
  EXPECT_TRUE(same_stats(&st0, &st1));
  EXPECT(KVPAGE_OK, kvpage_cache_len(c, s, &len, &err));
  EXPECT_TRUE(len == 6);
  EXPECT(KVPAGE_OK, decode_last(c, s, got));
  EXPECT_TRUE(memcmp(got, want, sizeof got) == 0);

  /* Once the fork is gone the blocks are `s`'s alone: the rotation runs and changes
   * what the decode sees. */
  EXPECT(KVPAGE_OK, kvpage_cache_release(c, child, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_rotate_keys(c, s, 2, 6, -2, &rope, &err));
  EXPECT(KVPAGE_OK, decode_last(c, s, got));
  EXPECT_TRUE(memcmp(got, want, sizeof got) != 0);
  /* A context shift with rotation: tokens 3..6 move to 1..4 and are rotated by -2. */
  EXPECT(KVPAGE_OK, kvpage_cache_context_shift(c, s, 1, 2, &rope, &shift, &err));
  EXPECT_TRUE(shift.rotate_first == 1 && shift.rotate_end == 4 && shift.delta == -2);
  EXPECT(KVPAGE_OK, kvpage_cache_len(c, s, &len, &err));
  EXPECT_TRUE(len == 4);
  EXPECT(KVPAGE_OK, kvpage_cache_free(c, &err));
  section("rotate calls", before);
}

/* Saving and restoring a sequence: bad arguments, damaged blobs (every byte flipped in
 * turn, truncated, trailing bytes, another version, model or geometry), files that
 * cannot be written or read. Each fails with its code and the target cache's
 * statistics stay as they were; then a good restore decodes like the original. */
static void seq_blob_calls(void) {
  unsigned before = checks;
  kvpage_cache_params p = cache_params(8);
  kvpage_cache *c = NULL, *d = NULL, *other = NULL;
  kvpage_seq s, gone, r = KVPAGE_SEQ_NONE;
  kvpage_stats st0, st1;
  kvpage_fingerprint model = kvpage_fingerprint_from_u64(7), wrong = kvpage_fingerprint_from_u64(8);
  uint32_t prompt[5] = {1, 2, 3, 4, 5}, ids[8] = {0}, len = 0, layer, i;
  size_t size = 0, written = 0, n_ids = 0, accepted = 0;
  static uint8_t blob[4096], bad[4097];
  float k[5 * ROW], v[5 * ROW], q[Q_HEADS * HEAD_DIM], got[Q_HEADS * HEAD_DIM], want[Q_HEADS * HEAD_DIM];
  const char *missing = "/nonexistent-kvpage-dir/seq.kv", *file = "bad_input_seq.kvseq";

  for (i = 0; i < 5 * ROW; i++) k[i] = value(i + 3000), v[i] = value(i + 4000);
  for (i = 0; i < Q_HEADS * HEAD_DIM; i++) q[i] = value(i + 5000);
  EXPECT(KVPAGE_OK, kvpage_cache_new(&p, &c, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_new(&p, &d, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_create_with_prompt(c, 0, prompt, 5, &s, NULL, &err));
  for (layer = 0; layer < LAYERS; layer++)
    EXPECT(KVPAGE_OK, kvpage_cache_write_kv(c, s, layer, 0, 5, k, 5 * ROW, v, 5 * ROW, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_create(c, 0, &gone, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_release(c, gone, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_seq_save_size(c, s, 1, &size, &err));
  EXPECT_TRUE(size > 0 && size < sizeof blob);
  EXPECT(KVPAGE_OK, kvpage_cache_seq_save(c, s, prompt, 5, &model, blob, sizeof blob, &written, &err));
  EXPECT_TRUE(written == size);

  /* Null pointers; a stale id; ids that are not one per token; a short buffer. */
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_seq_save_size(NULL, s, 1, &size, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_seq_save_size(c, s, 1, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_seq_save(c, s, NULL, 5, &model, bad, sizeof bad, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_seq_save(c, s, prompt, 5, NULL, bad, sizeof bad, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_seq_save(c, s, prompt, 5, &model, NULL, size, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_seq_save_file(c, s, prompt, 5, &model, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_seq_restore(d, NULL, size, 0, &model, &r, NULL, NULL, 0, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_seq_restore(d, blob, size, 0, NULL, &r, NULL, NULL, 0, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_seq_restore(d, blob, size, 0, &model, NULL, NULL, NULL, 0, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_seq_restore_file(d, NULL, 0, &model, &r, NULL, NULL, 0, NULL, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_cache_seq_save_size(c, gone, 1, &written, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_cache_seq_save(c, gone, NULL, 0, &model, bad, sizeof bad, NULL, &err));
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_cache_seq_save(c, s, prompt, 4, &model, bad, sizeof bad, NULL, &err));
  EXPECT_TRUE(kvpage_cache_seq_save(c, s, prompt, 5, &model, bad, size - 1, NULL, &err) == KVPAGE_ERR_BUFFER_TOO_SMALL && err.needed == size && err.available == size - 1);
  memset(&err, 0, sizeof err);
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_cache_seq_save_file(c, s, prompt, 5, &model, "", &err));
  EXPECT(KVPAGE_ERR_IO, kvpage_cache_seq_save_file(c, s, prompt, 5, &model, missing, &err));

  /* Damaged blobs, another model or geometry, a short id buffer, a missing file. */
  EXPECT(KVPAGE_OK, kvpage_cache_stats(d, &st0, &err));
  EXPECT_TRUE(kvpage_cache_seq_restore(d, blob, size - 1, 0, &model, &r, NULL, NULL, 0, NULL, &err) == KVPAGE_ERR_BLOB_TRUNCATED && err.needed == size && err.available == size - 1);
  memset(&err, 0, sizeof err);
  EXPECT(KVPAGE_ERR_BLOB_TRUNCATED, kvpage_cache_seq_restore(d, blob, 3, 0, &model, &r, NULL, NULL, 0, NULL, &err));
  memcpy(bad, blob, size);
  bad[0] = 'X';
  EXPECT(KVPAGE_ERR_BLOB_FORMAT, kvpage_cache_seq_restore(d, bad, size, 0, &model, &r, NULL, NULL, 0, NULL, &err));
  memcpy(bad, blob, size);
  bad[8] = 2;
  EXPECT(KVPAGE_ERR_BLOB_VERSION, kvpage_cache_seq_restore(d, bad, size, 0, &model, &r, NULL, NULL, 0, NULL, &err));
  memcpy(bad, blob, size);
  bad[16] ^= 1;
  EXPECT_TRUE(kvpage_cache_seq_restore(d, bad, size, 0, &model, &r, NULL, NULL, 0, NULL, &err) == KVPAGE_ERR_BLOB_CORRUPT && err.value == 0);
  memcpy(bad, blob, size);
  bad[size - 10] ^= 0x40;
  EXPECT_TRUE(kvpage_cache_seq_restore(d, bad, size, 0, &model, &r, NULL, NULL, 0, NULL, &err) == KVPAGE_ERR_BLOB_CORRUPT && err.value == 3);
  memcpy(bad, blob, size);
  bad[size] = 0;
  EXPECT_TRUE(kvpage_cache_seq_restore(d, bad, size + 1, 0, &model, &r, NULL, NULL, 0, NULL, &err) == KVPAGE_ERR_BLOB_CORRUPT && err.value == 4);
  memset(&err, 0, sizeof err);
  EXPECT(KVPAGE_ERR_BLOB_MODEL, kvpage_cache_seq_restore(d, blob, size, 0, &wrong, &r, NULL, NULL, 0, NULL, &err));
  EXPECT_TRUE(kvpage_cache_seq_restore(d, blob, size, 0, &model, &r, NULL, ids, 4, NULL, &err) == KVPAGE_ERR_BUFFER_TOO_SMALL && err.needed == 5 && err.available == 4);
  memset(&err, 0, sizeof err);
  EXPECT(KVPAGE_ERR_IO, kvpage_cache_seq_restore_file(d, missing, 0, &model, &r, NULL, NULL, 0, NULL, &err));
  p.geometry.block_size = 2 * BLOCK;
  EXPECT(KVPAGE_OK, kvpage_cache_new(&p, &other, &err));
  EXPECT(KVPAGE_ERR_BLOB_GEOMETRY, kvpage_cache_seq_restore(other, blob, size, 0, &model, &r, NULL, NULL, 0, NULL, &err));
  /* Every byte flipped in turn: never accepted. */
  for (i = 0; i < size; i++) {
    memcpy(bad, blob, size);
    bad[i] ^= 0x5a;
    accepted += kvpage_cache_seq_restore(d, bad, size, 0, &model, &r, NULL, NULL, 0, NULL, NULL) == KVPAGE_OK;
  }
  EXPECT_TRUE(accepted == 0);
  EXPECT_TRUE(r == KVPAGE_SEQ_NONE); /* no out-parameter written on failure */
  EXPECT(KVPAGE_OK, kvpage_cache_stats(d, &st1, &err));
  EXPECT_TRUE(same_stats(&st0, &st1));

  /* A good restore, from the buffer and from a file: decodes like the original. */
  EXPECT(KVPAGE_OK, kvpage_cache_seq_restore(d, blob, size, 9, &model, &r, &len, ids, 8, &n_ids, &err));
  EXPECT_TRUE(len == 5 && n_ids == 5 && memcmp(ids, prompt, sizeof prompt) == 0);
  EXPECT(KVPAGE_OK, kvpage_cache_decode(c, 1, &s, 1, q, Q_HEADS * HEAD_DIM, want, Q_HEADS * HEAD_DIM, Q_HEADS, 0.35f, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_decode(d, 1, &r, 1, q, Q_HEADS * HEAD_DIM, got, Q_HEADS * HEAD_DIM, Q_HEADS, 0.35f, &err));
  EXPECT_TRUE(memcmp(got, want, sizeof got) == 0);
  EXPECT(KVPAGE_OK, kvpage_cache_release(d, r, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_seq_save_file(c, s, prompt, 5, &model, file, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_seq_restore_file(d, file, 0, &model, &r, &len, NULL, 0, NULL, &err));
  EXPECT_TRUE(len == 5 && remove(file) == 0);
  EXPECT(KVPAGE_OK, kvpage_cache_decode(d, 1, &r, 1, q, Q_HEADS * HEAD_DIM, got, Q_HEADS * HEAD_DIM, Q_HEADS, 0.35f, &err));
  EXPECT_TRUE(memcmp(got, want, sizeof got) == 0);
  EXPECT(KVPAGE_OK, kvpage_cache_free(other, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_free(d, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_free(c, &err));
  section("sequence blobs", before);
}

/* The persistent prefix cache: bad arguments, a wrong header, model or geometry (the
 * target cache unchanged), damaged blocks (skipped and counted, never served), a
 * missing file; then a good load whose prompt hits and decodes like the original. */
static void prefix_file_calls(void) {
  unsigned before = checks;
  kvpage_cache_params p = cache_params(8);
  kvpage_cache *c = NULL, *d = NULL, *other = NULL;
  kvpage_seq s, r;
  kvpage_stats st0, st1;
  kvpage_prefix_load_report rep;
  kvpage_fingerprint model = kvpage_fingerprint_from_u64(7), wrong = kvpage_fingerprint_from_u64(8);
  uint32_t prompt[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9}, layer, i, blocks = 0, reused = 0;
  uint64_t size = 0;
  size_t written = 0;
  static uint8_t file_bytes[8192], bad[8192];
  float k[9 * ROW], v[9 * ROW], q[Q_HEADS * HEAD_DIM], got[Q_HEADS * HEAD_DIM], want[Q_HEADS * HEAD_DIM];
  const char *missing = "/nonexistent-kvpage-dir/prefix.kvpc", *file = "bad_input_prefix.kvpc";

  for (i = 0; i < 9 * ROW; i++) k[i] = value(i + 6000), v[i] = value(i + 7000);
  for (i = 0; i < Q_HEADS * HEAD_DIM; i++) q[i] = value(i + 8000);
  EXPECT(KVPAGE_OK, kvpage_cache_new(&p, &c, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_new(&p, &d, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_create_with_prompt(c, 0, prompt, 9, &s, NULL, &err));
  for (layer = 0; layer < LAYERS; layer++)
    EXPECT(KVPAGE_OK, kvpage_cache_write_kv(c, s, layer, 0, 9, k, 9 * ROW, v, 9 * ROW, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_commit(c, s, NULL, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_prefix_save_size(c, &size, &err));
  EXPECT_TRUE(size > 96 && size < sizeof file_bytes);
  EXPECT(KVPAGE_OK, kvpage_cache_prefix_save(c, &model, file_bytes, sizeof file_bytes, &written, &blocks, &err));
  EXPECT_TRUE(written == size && blocks == 9 / BLOCK);

  /* Null pointers, a short buffer, an empty or unwritable path. */
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_prefix_save_size(NULL, &size, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_prefix_save_size(c, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_prefix_save(c, NULL, bad, sizeof bad, NULL, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_prefix_save(c, &model, NULL, 10, NULL, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_prefix_save_file(c, &model, NULL, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_prefix_load(d, NULL, 10, &model, &rep, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_prefix_load(d, file_bytes, written, NULL, &rep, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_prefix_load_file(d, NULL, &model, &rep, &err));
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_cache_prefix_load((kvpage_cache *)bad, file_bytes, written, &model, &rep, &err));
  EXPECT_TRUE(kvpage_cache_prefix_save(c, &model, bad, written - 1, NULL, NULL, &err) == KVPAGE_ERR_BUFFER_TOO_SMALL && err.needed == written && err.available == written - 1);
  memset(&err, 0, sizeof err);
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_cache_prefix_save_file(c, &model, "", NULL, &err));
  EXPECT(KVPAGE_ERR_IO, kvpage_cache_prefix_save_file(c, &model, missing, NULL, &err));
  EXPECT(KVPAGE_ERR_IO, kvpage_cache_prefix_load_file(d, missing, &model, &rep, &err));

  /* A wrong header, model or geometry: refused, the cache as it was. */
  EXPECT(KVPAGE_OK, kvpage_cache_stats(d, &st0, &err));
  memcpy(bad, file_bytes, written);
  bad[0] = 'X';
  EXPECT(KVPAGE_ERR_BLOB_FORMAT, kvpage_cache_prefix_load(d, bad, written, &model, &rep, &err));
  memcpy(bad, file_bytes, written);
  bad[8] = 2;
  EXPECT(KVPAGE_ERR_BLOB_VERSION, kvpage_cache_prefix_load(d, bad, written, &model, &rep, &err));
  memcpy(bad, file_bytes, written);
  bad[36] ^= 1;
  EXPECT(KVPAGE_ERR_BLOB_CORRUPT, kvpage_cache_prefix_load(d, bad, written, &model, &rep, &err));
  EXPECT(KVPAGE_ERR_BLOB_TRUNCATED, kvpage_cache_prefix_load(d, file_bytes, 50, &model, &rep, &err));
  EXPECT(KVPAGE_ERR_BLOB_MODEL, kvpage_cache_prefix_load(d, file_bytes, written, &wrong, &rep, &err));
  p.geometry.block_size = 2 * BLOCK;
  EXPECT(KVPAGE_OK, kvpage_cache_new(&p, &other, &err));
  EXPECT(KVPAGE_ERR_BLOB_GEOMETRY, kvpage_cache_prefix_load(other, file_bytes, written, &model, &rep, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_stats(d, &st1, &err));
  EXPECT_TRUE(same_stats(&st0, &st1));

  /* A damaged last byte of the first block: it and the chain below are skipped. */
  memcpy(bad, file_bytes, written);
  bad[96 + (written - 96) / blocks - 1] ^= 0x10;
  EXPECT(KVPAGE_OK, kvpage_cache_prefix_load(d, bad, written, &model, &rep, &err));
  EXPECT_TRUE(rep.records == blocks && rep.damaged == 1 && rep.orphaned == blocks - 1 && rep.loaded == 0);
  EXPECT(KVPAGE_OK, kvpage_cache_create_with_prompt(d, 0, prompt, 9, &r, &reused, &err));
  EXPECT_TRUE(reused == 0);
  EXPECT(KVPAGE_OK, kvpage_cache_release(d, r, &err));

  /* A good load through a file: the prompt hits and decodes like the original. */
  EXPECT(KVPAGE_OK, kvpage_cache_prefix_save_file(c, &model, file, &blocks, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_prefix_load_file(d, file, &model, &rep, &err));
  EXPECT_TRUE(remove(file) == 0);
  EXPECT_TRUE(rep.records == blocks && rep.loaded == blocks && rep.trailing_bytes == 0);
  EXPECT(KVPAGE_OK, kvpage_cache_create_with_prompt(d, 0, prompt, 9, &r, &reused, &err));
  EXPECT_TRUE(reused == 8);
  for (layer = 0; layer < LAYERS; layer++)
    EXPECT(KVPAGE_OK, kvpage_cache_write_kv(d, r, layer, 8, 1, k + 8 * ROW, ROW, v + 8 * ROW, ROW, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_decode(c, 1, &s, 1, q, Q_HEADS * HEAD_DIM, want, Q_HEADS * HEAD_DIM, Q_HEADS, 0.35f, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_decode(d, 1, &r, 1, q, Q_HEADS * HEAD_DIM, got, Q_HEADS * HEAD_DIM, Q_HEADS, 0.35f, &err));
  EXPECT_TRUE(memcmp(got, want, sizeof got) == 0);
  EXPECT(KVPAGE_OK, kvpage_cache_free(other, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_free(d, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_free(c, &err));
  section("prefix cache files", before);
}

/* KV cache events: a drain into buffers too small for a stored block, null pointers and
 * a non-cache are refused and consume nothing; small buffers drain everything in order;
 * a ring that overflows reports the gap; a clear is one event. */
static void kv_event_calls(void) {
  unsigned before = checks;
  kvpage_cache_params p = cache_params(8);
  kvpage_cache *c = NULL;
  kvpage_seq s;
  kvpage_kv_event ev[4];
  kvpage_events_report rep, zero;
  uint32_t prompt[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9}, tokens[8], n = 0;
  uint64_t seq = 0;
  static uint8_t bad[64];

  p.event_capacity = 4;
  p.hash_key = 99;
  memset(&zero, 0, sizeof zero);
  EXPECT(KVPAGE_OK, kvpage_cache_new(&p, &c, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_create_with_prompt(c, 3, prompt, 9, &s, NULL, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_commit(c, s, NULL, &err));

  rep = zero;
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_events_drain(NULL, ev, 4, tokens, 8, &rep, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_events_drain(c, NULL, 4, tokens, 8, &rep, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_events_drain(c, ev, 4, NULL, 8, &rep, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_events_drain(c, ev, 4, tokens, 8, NULL, &err));
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_cache_events_drain((kvpage_cache *)bad, ev, 4, tokens, 8, &rep, &err));
  EXPECT_TRUE(kvpage_cache_events_drain(c, ev, 4, tokens, BLOCK - 1, &rep, &err) == KVPAGE_ERR_BUFFER_TOO_SMALL && err.needed == BLOCK && err.available == BLOCK - 1);
  memset(&err, 0, sizeof err);
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_clear_prefix_cache(NULL, &n, &err));
  EXPECT_TRUE(memcmp(&rep, &zero, sizeof rep) == 0);

  /* Nothing was consumed: one event per call, in order, parent first. */
  EXPECT(KVPAGE_OK, kvpage_cache_events_drain(c, ev, 1, tokens, 8, &rep, &err));
  EXPECT_TRUE(rep.first_seq == 0 && rep.lost == 0 && rep.events == 1 && rep.tokens == BLOCK && rep.pending == 1);
  EXPECT_TRUE(ev[0].kind == KVPAGE_EVENT_STORED && ev[0].parent == KVPAGE_EVENT_NO_BLOCK && ev[0].namespace_id == 3);
  EXPECT_TRUE(ev[0].token_count == BLOCK && tokens[ev[0].tokens_offset] == 1 && tokens[BLOCK - 1] == 4);
  seq = ev[0].hash;
  EXPECT(KVPAGE_OK, kvpage_cache_events_drain(c, ev, 4, tokens, 8, &rep, &err));
  EXPECT_TRUE(rep.first_seq == 1 && rep.events == 1 && rep.pending == 0);
  EXPECT_TRUE(ev[0].seq == 1 && ev[0].parent_hash == seq && tokens[0] == 5);

  /* A clear of a held chain evicts nothing; released, it is one event. */
  EXPECT(KVPAGE_OK, kvpage_cache_clear_prefix_cache(c, &n, &err));
  EXPECT_TRUE(n == 0);
  EXPECT(KVPAGE_OK, kvpage_cache_release(c, s, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_clear_prefix_cache(c, &n, &err));
  EXPECT_TRUE(n == 2);
  EXPECT(KVPAGE_OK, kvpage_cache_events_drain(c, ev, 4, tokens, 8, &rep, &err));
  EXPECT_TRUE(rep.first_seq == 2 && rep.events == 1 && ev[0].kind == KVPAGE_EVENT_CLEARED);

  /* Three prompts of two blocks each overflow the 4-entry ring: the gap is reported. */
  for (n = 0; n < 3; n++) {
    prompt[0] = 10 + n;
    EXPECT(KVPAGE_OK, kvpage_cache_create_with_prompt(c, 0, prompt, 9, &s, NULL, &err));
    EXPECT(KVPAGE_OK, kvpage_cache_commit(c, s, NULL, &err));
    EXPECT(KVPAGE_OK, kvpage_cache_release(c, s, &err));
  }
  EXPECT(KVPAGE_OK, kvpage_cache_events_drain(c, ev, 0, NULL, 0, &rep, &err));
  EXPECT_TRUE(rep.lost > 0 && rep.first_seq == 3 + rep.lost && rep.events == 0 && rep.pending == 4);
  EXPECT(KVPAGE_OK, kvpage_cache_events_drain(c, ev, 4, tokens, 8, &rep, &err));
  EXPECT_TRUE(rep.lost == 0 && rep.events == 2 && rep.pending == 2);
  EXPECT(KVPAGE_OK, kvpage_cache_free(c, &err));

  /* An engine's cache: the same drain. */
  {
    kvpage_engine_params ep = kvpage_engine_default_params(GEOMETRY);
    kvpage_engine *e = NULL;
    kvpage_request id;
    ep.cache = p;
    ep.max_requests = 2;
    ep.scheduler.token_budget = 16;
    ep.scheduler.max_running = 2;
    EXPECT(KVPAGE_OK, kvpage_engine_new(&ep, &e, &err));
    EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_engine_events_drain(NULL, ev, 4, tokens, 8, &rep, &err));
    EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_engine_events_drain((kvpage_engine *)bad, ev, 4, tokens, 8, &rep, &err));
    EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_engine_events_drain(e, ev, 4, tokens, 8, NULL, &err));
    EXPECT(KVPAGE_OK, kvpage_engine_add_request(e, 0, prompt, 9, 4, &id, &err));
    EXPECT(KVPAGE_OK, kvpage_engine_events_drain(e, ev, 4, tokens, 8, &rep, &err));
    EXPECT_TRUE(rep.first_seq == 0 && rep.lost == 0 && rep.events == 0 && rep.pending == 0);
    EXPECT(KVPAGE_OK, kvpage_engine_free(e, &err));
  }
  section("kv cache events", before);
}

static kvpage_engine_params engine_params(void) {
  kvpage_engine_params p = kvpage_engine_default_params(GEOMETRY);
  p.cache = cache_params(16);
  p.max_requests = 4;
  p.scheduler.token_budget = 16;
  p.scheduler.max_running = 4;
  return p;
}

static void engine_calls(void) {
  unsigned before = checks;
  kvpage_engine_params p = engine_params();
  kvpage_engine *e = NULL;
  kvpage_request r = KVPAGE_REQUEST_NONE, r2 = KVPAGE_REQUEST_NONE;
  kvpage_step step;
  kvpage_step_seq seqs[4];
  kvpage_sampled sample;
  kvpage_finished fin[4];
  kvpage_engine_counters ec;
  uint32_t prompt[6] = {1, 2, 3, 4, 5, 6}, toks[8], state;
  size_t n = 0;
  float kv[6 * ROW] = {0}, q[6 * Q_HEADS * HEAD_DIM] = {0}, out[6 * Q_HEADS * HEAD_DIM];

  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_engine_new(NULL, &e, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_engine_new(&p, NULL, &err));
  p.max_requests = 0;
  EXPECT(KVPAGE_ERR_BAD_CONFIG, kvpage_engine_new(&p, &e, &err));
  p = engine_params();
  p.scheduler.preemption = 5;
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_engine_new(&p, &e, &err));
  p = engine_params();
  p.host_capacity_blocks = 4;
  p.host_capacity_bytes = 4096;
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_engine_new(&p, &e, &err));
  EXPECT_TRUE(e == NULL);
  p = engine_params();
  EXPECT(KVPAGE_OK, kvpage_engine_new(&p, &e, &err));

  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_engine_add_request(e, 0, NULL, 6, 2, &r, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_engine_add_request(e, 0, prompt, 6, 2, NULL, &err));
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_engine_add_request(e, 0, prompt, 0, 2, &r, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_engine_add_request_at(NULL, 0, prompt, 6, 2, KVPAGE_PRIORITY_HIGH, &r, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_engine_add_request_at(e, 0, prompt, 6, 2, KVPAGE_PRIORITY_HIGH, NULL, &err));
  EXPECT_TRUE(kvpage_engine_add_request_at(e, 0, prompt, 6, 2, 4, &r, &err) == KVPAGE_ERR_INVALID_ARGUMENT && err.value == 4);
  memset(&err, 0, sizeof err);
  EXPECT(KVPAGE_ERR_NO_STEP_IN_PROGRESS, kvpage_engine_commit_step(e, NULL, 0, fin, 4, &n, &err));
  EXPECT(KVPAGE_ERR_STALE_REQUEST, kvpage_engine_cancel(e, 77, &err));
  EXPECT(KVPAGE_ERR_STALE_REQUEST, kvpage_engine_request_state(e, KVPAGE_REQUEST_NONE, &state, &err));
  EXPECT(KVPAGE_OK, kvpage_engine_add_request(e, 0, prompt, 6, 2, &r, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_engine_step(e, NULL, &err));
  EXPECT(KVPAGE_OK, kvpage_engine_step(e, &step, &err));
  EXPECT(KVPAGE_ERR_STEP_IN_PROGRESS, kvpage_engine_step(e, &step, &err));
  EXPECT(KVPAGE_ERR_STEP_IN_PROGRESS, kvpage_engine_cancel(e, r, &err));
  EXPECT(KVPAGE_ERR_BUFFER_TOO_SMALL, kvpage_engine_step_seqs(e, seqs, 0, &n, &err));
  EXPECT(KVPAGE_OK, kvpage_engine_step_seqs(e, seqs, 4, &n, &err));
  EXPECT_TRUE(n == 1 && step.num_tokens == 6);
  EXPECT(KVPAGE_ERR_BUFFER_TOO_SMALL, kvpage_engine_write_kv(e, 0, kv, 6 * ROW - 1, kv, 6 * ROW, &err));
  EXPECT(KVPAGE_ERR_BAD_LAYER, kvpage_engine_write_kv(e, LAYERS, kv, 6 * ROW, kv, 6 * ROW, &err));
  EXPECT(KVPAGE_ERR_BUFFER_TOO_SMALL, kvpage_engine_attention(e, 0, q, 6 * Q_HEADS * HEAD_DIM, out, 5, Q_HEADS, 0.35f, &err));
  EXPECT(KVPAGE_ERR_BAD_HEADS, kvpage_engine_attention(e, 0, q, 6 * 3 * HEAD_DIM, out, 6 * 3 * HEAD_DIM, 3, 0.35f, &err));
  EXPECT(KVPAGE_OK, kvpage_engine_write_kv(e, 0, kv, 6 * ROW, kv, 6 * ROW, &err));
  EXPECT(KVPAGE_OK, kvpage_engine_write_kv(e, 1, kv, 6 * ROW, kv, 6 * ROW, &err));
  EXPECT(KVPAGE_OK, kvpage_engine_attention(e, 1, q, 6 * Q_HEADS * HEAD_DIM, out, 6 * Q_HEADS * HEAD_DIM, Q_HEADS, 0.35f, &err));
  EXPECT(KVPAGE_ERR_MISSING_SAMPLE, kvpage_engine_commit_step(e, NULL, 0, fin, 4, &n, &err));
  sample.request = r + (1ull << 32); /* another generation: stale */
  sample.token = 9;
  sample.stop = 0;
  EXPECT(KVPAGE_ERR_STALE_REQUEST, kvpage_engine_commit_step(e, &sample, 1, fin, 4, &n, &err));
  sample.request = r;
  EXPECT(KVPAGE_ERR_BUFFER_TOO_SMALL, kvpage_engine_commit_step(e, &sample, 1, fin, 0, &n, &err));
  EXPECT(KVPAGE_OK, kvpage_engine_commit_step(e, &sample, 1, fin, 4, &n, &err));
  EXPECT_TRUE(n == 0);
  EXPECT(KVPAGE_ERR_BUFFER_TOO_SMALL, kvpage_engine_request_tokens(e, r, toks, 3, &n, &err));
  EXPECT(KVPAGE_OK, kvpage_engine_request_tokens(e, r, toks, 8, &n, &err));
  EXPECT_TRUE(n == 7 && toks[6] == 9);
  EXPECT(KVPAGE_OK, kvpage_engine_fork(e, r, 1, 10, &r2, &err));
  EXPECT(KVPAGE_ERR_STALE_REQUEST, kvpage_engine_fork(e, 999, 0, 0, &r2, &err));
  EXPECT(KVPAGE_OK, kvpage_engine_cancel(e, r2, &err));
  EXPECT(KVPAGE_ERR_STALE_REQUEST, kvpage_engine_cancel(e, r2, &err)); /* cancelled twice */
  EXPECT(KVPAGE_OK, kvpage_engine_stats(e, &ec, NULL, &err));
  EXPECT_TRUE(ec.steps == 1 && ec.admitted == 1);
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_engine_stats(e, NULL, NULL, &err));
  EXPECT(KVPAGE_OK, kvpage_engine_free(e, &err));
  section("engine calls", before);
}

static void manager_and_scheduler_calls(void) {
  unsigned before = checks;
  kvpage_manager_config mc, too_big;
  kvpage_scheduler_config sc;
  kvpage_manager *m = NULL, *m2 = NULL;
  kvpage_scheduler *s = NULL;
  size_t bytes = 0, sbytes = 0;
  uint64_t *storage, *storage2, *sstorage;
  kvpage_step step;
  kvpage_request r;
  uint32_t prompt[3] = {7, 8, 9};
  size_t n;
  kvpage_finished fin[2];

  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_manager_config_for_geometry(NULL, 16, 4, 32, &mc, &err));
  EXPECT(KVPAGE_OK, kvpage_manager_config_for_geometry(&GEOMETRY, 16, 4, 32, &mc, &err));
  mc.instance = 3;
  mc.host_blocks = 8;
  too_big = mc;
  too_big.num_blocks = 0;
  EXPECT(KVPAGE_ERR_BAD_CONFIG, kvpage_manager_storage_size(&too_big, &bytes, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_manager_storage_size(&mc, NULL, &err));
  EXPECT(KVPAGE_OK, kvpage_manager_storage_size(&mc, &bytes, &err));
  storage = malloc(bytes + 8); /* malloc aligns to 8 or more */
  storage2 = malloc(bytes); /* malloc aligns to 8 or more */
  if (!storage || !storage2) exit(1);
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_manager_init(&mc, NULL, bytes, &m, &err));
  EXPECT_TRUE(kvpage_manager_init(&mc, storage, bytes - 1, &m, &err) == KVPAGE_ERR_STORAGE_TOO_SMALL && err.needed == bytes && err.available == bytes - 1);
  memset(&err, 0, sizeof err);
  EXPECT(KVPAGE_ERR_MISALIGNED, kvpage_manager_init(&mc, (char *)storage + 4, bytes, &m, &err));
  EXPECT_TRUE(m == NULL);
  EXPECT(KVPAGE_OK, kvpage_manager_init(&mc, storage, bytes, &m, &err));
  EXPECT(KVPAGE_OK, kvpage_manager_init(&mc, storage2, bytes, &m2, &err)); /* a twin */

  sc.max_requests = 2;
  sc.scheduler.token_budget = 8;
  sc.scheduler.max_running = 2;
  sc.scheduler.watermark_blocks = 0;
  sc.scheduler.preemption = KVPAGE_PREEMPT_SWAP;
  EXPECT(KVPAGE_OK, kvpage_scheduler_storage_size(&mc, &sc, &sbytes, &err));
  sstorage = malloc(sbytes); /* malloc aligns to 8 or more */
  if (!sstorage) exit(1);
  sc.max_requests = 0;
  EXPECT(KVPAGE_ERR_BAD_CONFIG, kvpage_scheduler_init(m, &sc, sstorage, sbytes, &s, &err));
  sc.max_requests = 2;
  EXPECT(KVPAGE_ERR_STORAGE_TOO_SMALL, kvpage_scheduler_init(m, &sc, sstorage, sbytes / 2, &s, &err));
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_scheduler_init((kvpage_manager *)sstorage, &sc, sstorage, sbytes, &s, &err));
  EXPECT(KVPAGE_OK, kvpage_scheduler_init(m, &sc, sstorage, sbytes, &s, &err));
  EXPECT(KVPAGE_OK, kvpage_scheduler_add_request(s, 0, prompt, 3, 1, &r, &err));
  EXPECT(KVPAGE_ERR_FOREIGN_MANAGER, kvpage_scheduler_step(s, m2, &step, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_scheduler_step(s, NULL, &step, &err));
  EXPECT(KVPAGE_OK, kvpage_scheduler_step(s, m, &step, &err));
  EXPECT_TRUE(step.num_seqs == 1 && step.num_tokens == 3);
  EXPECT(KVPAGE_ERR_FOREIGN_MANAGER, kvpage_scheduler_commit_step(s, m2, NULL, 0, fin, 2, &n, &err));
  {
    kvpage_sampled done = {0, 42, 1};
    done.request = r;
    EXPECT(KVPAGE_OK, kvpage_scheduler_commit_step(s, m, &done, 1, fin, 2, &n, &err));
    EXPECT_TRUE(n == 1 && fin[0].request == r && fin[0].reason == KVPAGE_FINISH_STOP);
  }
  EXPECT(KVPAGE_ERR_STALE_REQUEST, kvpage_scheduler_cancel(s, m, r, &err));
  free(sstorage);
  free(storage2);
  free(storage);
  section("manager and scheduler calls", before);
}

/* Tier 2: sequence operations, exports and swaps of a manager in caller memory. */
static void manager_seq_calls(void) {
  unsigned before = checks;
  kvpage_manager_config mc;
  kvpage_manager *m = NULL;
  size_t bytes = 0, n = 0;
  uint64_t *storage;
  kvpage_seq s, gone, child = KVPAGE_SEQ_NONE;
  kvpage_prompt_start start;
  kvpage_appended app;
  kvpage_stats st0, st1;
  kvpage_block_copy copies[8];
  uint32_t prompt[6] = {1, 2, 3, 4, 5, 6}, slots[64], blocks[8], len = 0, swapped = 9;
  uint32_t table[16], indptr[3], indices[8], last[2];
  kvpage_seq pair[2];
  uint64_t garbage[4] = {1, 2, 3, 4}; /* not a manager */
  kvpage_row_move moves[8];
  kvpage_edit ed;
  kvpage_context_shift shift;
  int64_t pos = 0;

  EXPECT(KVPAGE_OK, kvpage_manager_config_for_geometry(&GEOMETRY, 8, 4, 32, &mc, &err));
  mc.host_blocks = 0; /* no host tier: swaps are refused */
  EXPECT(KVPAGE_OK, kvpage_manager_storage_size(&mc, &bytes, &err));
  storage = malloc(bytes); /* malloc aligns to 8 or more */
  if (!storage) exit(1);
  EXPECT(KVPAGE_OK, kvpage_manager_init(&mc, storage, bytes, &m, &err));
  EXPECT(KVPAGE_OK, kvpage_manager_create_with_prompt(m, 1, prompt, 6, slots, 64, &start, &err));
  s = start.seq;
  EXPECT(KVPAGE_OK, kvpage_manager_create(m, 1, &gone, &err));
  EXPECT(KVPAGE_OK, kvpage_manager_release(m, gone, &err));
  /* Another sequence holds 2 of the 8 blocks. */
  EXPECT(KVPAGE_OK, kvpage_manager_create_with_prompt(m, 2, prompt, 6, slots, 64, &start, &err));
  EXPECT(KVPAGE_OK, kvpage_manager_stats(m, &st0, &err));

  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_manager_create(NULL, 0, &child, &err));
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_manager_create((kvpage_manager *)garbage, 0, &child, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_manager_create_with_prompt(m, 1, NULL, 6, slots, 64, &start, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_manager_append(m, s, 1, slots, 64, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_manager_append_tokens(m, s, NULL, 2, slots, 64, &app, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_manager_fork(m, s, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_manager_len(m, s, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_manager_block_table_csr(m, NULL, 1, indptr, 3, indices, 8, last, 2, &err));
  EXPECT(KVPAGE_ERR_BUFFER_TOO_SMALL, kvpage_manager_create_with_prompt(m, 1, prompt, 6, slots, 5, &start, &err));
  EXPECT(KVPAGE_ERR_BUFFER_TOO_SMALL, kvpage_manager_append(m, s, 3, slots, 2, &app, &err));
  EXPECT(KVPAGE_ERR_BUFFER_TOO_SMALL, kvpage_manager_blocks(m, s, blocks, 1, &n, &err));
  pair[0] = pair[1] = s;
  EXPECT(KVPAGE_ERR_BUFFER_TOO_SMALL, kvpage_manager_block_table_csr(m, pair, 2, indptr, 3, indices, 3, last, 2, &err));
  EXPECT(KVPAGE_ERR_BUFFER_TOO_SMALL, kvpage_manager_block_table_dense(m, pair, 2, 1, 0, table, 16, NULL, 0, &err));
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_manager_block_table_dense(m, pair, 2, 0, 0, table, 16, NULL, 0, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_manager_release(m, gone, &err)); /* double release */
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_manager_append(m, gone, 1, slots, 64, &app, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_manager_commit(m, KVPAGE_SEQ_NONE, 1, NULL, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_manager_fork(m, 4242, &child, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_manager_truncate(m, gone, 0, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_manager_len(m, gone, &len, &err));
  pair[1] = gone;
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_manager_block_table_csr(m, pair, 2, indptr, 3, indices, 8, last, 2, &err));
  EXPECT(KVPAGE_ERR_BEYOND_LENGTH, kvpage_manager_truncate(m, s, 7, &err));
  EXPECT(KVPAGE_ERR_SEQ_TOO_LONG, kvpage_manager_append(m, s, 40, slots, 64, &app, &err));
  EXPECT_TRUE(kvpage_manager_append(m, s, 26, slots, 64, &app, &err) == KVPAGE_ERR_OUT_OF_BLOCKS && err.needed == 6 && err.available == 4);
  memset(&err, 0, sizeof err);
  EXPECT(KVPAGE_ERR_NO_HOST_POOL, kvpage_manager_swap_out(m, s, copies, 8, &n, &err));
  EXPECT(KVPAGE_ERR_NO_HOST_POOL, kvpage_manager_swap_in(m, s, copies, 8, &n, &err));
  EXPECT(KVPAGE_OK, kvpage_manager_is_swapped(m, s, &swapped, &err));
  EXPECT_TRUE(swapped == 0);
  EXPECT_TRUE(child == KVPAGE_SEQ_NONE);
  /* Edits: null pointers, stale ids, short arrays, ranges past the length, positions. */
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_manager_seq_rm(NULL, s, 0, 1, copies, 8, moves, 8, &ed, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_manager_seq_rm(m, s, 1, 2, copies, 8, NULL, 8, &ed, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_manager_context_shift(m, s, 1, 1, copies, 8, moves, 8, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_manager_seq_cp(m, s, 0, 2, 1, moves, 8, NULL, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_manager_seq_keep(m, s, NULL, 1, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_manager_seq_pos_max(m, s, NULL, &err));
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_manager_seq_add((kvpage_manager *)garbage, s, 0, 1, 1, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_manager_seq_rm(m, gone, 0, 0, copies, 8, moves, 8, &ed, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_manager_context_shift(m, gone, 0, 0, copies, 8, moves, 8, &shift, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_manager_seq_cp(m, gone, 0, 0, 1, moves, 8, &child, NULL, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_manager_make_exclusive(m, gone, 0, 0, copies, 8, &n, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_manager_seq_pos_min(m, gone, &pos, &err));
  pair[0] = s;
  pair[1] = gone;
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_manager_seq_keep(m, KVPAGE_SEQ_NONE, pair, 2, NULL, &err));
  /* Removing token 1 of 6 moves 4 rows in 3 runs (offsets change): 2 slots are short. */
  EXPECT_TRUE(kvpage_manager_seq_rm(m, s, 1, 2, copies, 8, moves, 2, &ed, &err) == KVPAGE_ERR_BUFFER_TOO_SMALL && err.needed == 3 && err.available == 2);
  memset(&err, 0, sizeof err);
  EXPECT(KVPAGE_ERR_BUFFER_TOO_SMALL, kvpage_manager_seq_cp(m, s, 1, 6, 1, moves, 1, &child, NULL, &err));
  EXPECT(KVPAGE_ERR_BEYOND_LENGTH, kvpage_manager_seq_rm(m, s, 4, 7, copies, 8, moves, 8, &ed, &err));
  EXPECT(KVPAGE_ERR_BEYOND_LENGTH, kvpage_manager_context_shift(m, s, 5, 2, copies, 8, moves, 8, &shift, &err));
  EXPECT(KVPAGE_ERR_BEYOND_LENGTH, kvpage_manager_seq_cp(m, s, 2, 1, 1, moves, 8, &child, NULL, &err));
  EXPECT(KVPAGE_ERR_BAD_POSITIONS, kvpage_manager_seq_add(m, s, 3, 6, -3, &err));
  EXPECT_TRUE(child == KVPAGE_SEQ_NONE);

  EXPECT(KVPAGE_OK, kvpage_manager_stats(m, &st1, &err));
  EXPECT_TRUE(same_stats(&st0, &st1));
  EXPECT(KVPAGE_OK, kvpage_manager_len(m, s, &len, &err));
  EXPECT_TRUE(len == 6);
  /* Works afterwards: an append reports its slots, the CSR export agrees with blocks(). */
  EXPECT(KVPAGE_OK, kvpage_manager_append(m, s, 3, slots, 64, &app, &err));
  EXPECT(KVPAGE_OK, kvpage_manager_blocks(m, s, blocks, 8, &n, &err));
  EXPECT_TRUE(n == 3 && slots[0] == blocks[1] * BLOCK + 2 && slots[2] == blocks[2] * BLOCK);
  pair[1] = s;
  EXPECT(KVPAGE_OK, kvpage_manager_block_table_csr(m, pair, 2, indptr, 3, indices, 8, last, 2, &err));
  EXPECT_TRUE(indptr[0] == 0 && indptr[1] == 3 && indptr[2] == 6 && indices[4] == blocks[1] && last[0] == 1);
  /* Edits work: a removal reports its row moves and leaves a gap in the positions. */
  EXPECT(KVPAGE_OK, kvpage_manager_seq_rm(m, s, 1, 2, copies, 8, moves, 8, &ed, &err));
  EXPECT_TRUE(ed.copies == 0 && ed.moves == 4 && moves[0].count == 2);
  EXPECT(KVPAGE_OK, kvpage_manager_len(m, s, &len, &err));
  EXPECT(KVPAGE_OK, kvpage_manager_seq_pos_max(m, s, &pos, &err));
  EXPECT_TRUE(len == 8 && pos == 8);
  EXPECT(KVPAGE_OK, kvpage_manager_context_shift(m, s, 1, 4, copies, 8, moves, 8, &shift, &err));
  EXPECT_TRUE(shift.rotate_first == 1 && shift.rotate_end == 4 && shift.delta == -4);
  EXPECT(KVPAGE_OK, kvpage_manager_seq_pos_max(m, s, &pos, &err));
  EXPECT_TRUE(pos == 4);
  free(storage);
  section("manager sequence calls", before);
}

/* Retention: priorities, unpinning and namespace quotas of a tier-2 manager. */
static void manager_retention_calls(void) {
  unsigned before = checks;
  kvpage_manager_config mc;
  kvpage_manager *m = NULL;
  size_t bytes = 0;
  uint64_t *storage;
  uint64_t garbage[4] = {1, 2, 3, 4}; /* not a manager */
  kvpage_seq s, gone;
  kvpage_prompt_start start;
  kvpage_stats st0, st1;
  uint32_t prompt[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9}, slots[64], n = 9, held = 9;

  EXPECT(KVPAGE_OK, kvpage_manager_config_for_geometry(&GEOMETRY, 8, 4, 32, &mc, &err));
  mc.host_blocks = 0;
  mc.max_namespaces = 2;
  EXPECT(KVPAGE_OK, kvpage_manager_storage_size(&mc, &bytes, &err));
  storage = malloc(bytes);
  if (!storage) exit(1);
  EXPECT(KVPAGE_OK, kvpage_manager_init(&mc, storage, bytes, &m, &err));
  EXPECT(KVPAGE_OK, kvpage_manager_create_with_prompt(m, 1, prompt, 9, slots, 64, &start, &err));
  s = start.seq;
  EXPECT(KVPAGE_OK, kvpage_manager_commit(m, s, 9, NULL, &err));
  EXPECT(KVPAGE_OK, kvpage_manager_create(m, 1, &gone, &err));
  EXPECT(KVPAGE_OK, kvpage_manager_release(m, gone, &err));
  EXPECT(KVPAGE_OK, kvpage_manager_stats(m, &st0, &err));

  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_manager_set_priority(NULL, s, KVPAGE_PRIORITY_PINNED, &err));
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_manager_set_priority((kvpage_manager *)garbage, s, 0, &err));
  EXPECT_TRUE(kvpage_manager_set_priority(m, s, 4, &err) == KVPAGE_ERR_INVALID_ARGUMENT && err.value == 4);
  memset(&err, 0, sizeof err);
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_manager_set_range_priority(m, s, 0, 4, 99, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_manager_set_priority(m, gone, KVPAGE_PRIORITY_LOW, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_manager_set_range_priority(m, KVPAGE_SEQ_NONE, 0, 0, 0, &err));
  EXPECT_TRUE(kvpage_manager_set_range_priority(m, s, 2, 10, KVPAGE_PRIORITY_HIGH, &err) == KVPAGE_ERR_BEYOND_LENGTH && err.needed == 10 && err.available == 9 && err.value == 2);
  memset(&err, 0, sizeof err);
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_manager_unpin_cached(NULL, &n, &err));
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_manager_unpin_cached((kvpage_manager *)garbage, &n, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_manager_set_namespace_quota(NULL, 2, 4, 0, &err));
  EXPECT(KVPAGE_ERR_QUOTA_REFUSED, kvpage_manager_set_namespace_quota(m, 2, 4, 5, &err));
  EXPECT_TRUE(kvpage_manager_set_namespace_quota(m, 2, 8, 8, &err) == KVPAGE_ERR_QUOTA_REFUSED && err.needed == 8 && err.available == 5);
  memset(&err, 0, sizeof err);
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_manager_namespace_blocks(m, 2, NULL, &err));
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_manager_namespace_blocks((kvpage_manager *)garbage, 2, &n, &err));
  EXPECT(KVPAGE_OK, kvpage_manager_stats(m, &st1, &err));
  EXPECT_TRUE(same_stats(&st0, &st1));

  /* Quotas work: namespace 2 may hold 2 blocks, a 3-block prompt is refused. */
  EXPECT(KVPAGE_OK, kvpage_manager_set_namespace_quota(m, 2, 2, 1, &err));
  EXPECT(KVPAGE_OK, kvpage_manager_set_namespace_quota(m, 3, 8, 0, &err));
  EXPECT(KVPAGE_ERR_QUOTA_REFUSED, kvpage_manager_set_namespace_quota(m, 4, 8, 0, &err)); /* table full */
  EXPECT_TRUE(kvpage_manager_create_with_prompt(m, 2, prompt, 9, slots, 64, &start, &err) == KVPAGE_ERR_QUOTA_EXCEEDED && err.needed == 3 && err.available == 2);
  memset(&err, 0, sizeof err);
  EXPECT(KVPAGE_OK, kvpage_manager_create_with_prompt(m, 2, prompt, 8, slots, 64, &start, &err));
  EXPECT(KVPAGE_OK, kvpage_manager_namespace_blocks(m, 2, &held, &err));
  EXPECT_TRUE(held == 2);
  /* Pinned blocks stay through eviction until unpinned. */
  EXPECT(KVPAGE_OK, kvpage_manager_set_priority(m, s, KVPAGE_PRIORITY_PINNED, &err));
  EXPECT(KVPAGE_OK, kvpage_manager_release(m, s, &err));
  EXPECT(KVPAGE_OK, kvpage_manager_evict_cached(m, 8, &n, &err));
  EXPECT_TRUE(n == 0);
  EXPECT(KVPAGE_OK, kvpage_manager_unpin_cached(m, &n, &err));
  EXPECT_TRUE(n == 2);
  EXPECT(KVPAGE_OK, kvpage_manager_evict_cached(m, 8, &n, &err));
  EXPECT_TRUE(n == 2);
  free(storage);
  section("manager retention calls", before);
}

/* Priorities and quotas on the owned cache and the engine: null and foreign objects,
 * bad levels, stale ids, refused quotas change nothing; then they work. */
static void cache_retention_calls(void) {
  unsigned before = checks;
  kvpage_cache_params p = cache_params(8);
  kvpage_engine_params ep = engine_params();
  kvpage_cache *c = NULL;
  kvpage_engine *e = NULL;
  kvpage_seq s, gone, r = KVPAGE_SEQ_NONE;
  kvpage_stats st0, st1;
  uint64_t garbage[4] = {1, 2, 3, 4}; /* not a cache */
  uint32_t prompt[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9}, n = 99, reused = 99;

  EXPECT(KVPAGE_OK, kvpage_cache_new(&p, &c, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_create_with_prompt_at(c, 0, KVPAGE_PRIORITY_PINNED, prompt, 9, &s, &reused, &err));
  EXPECT_TRUE(reused == 0);
  EXPECT(KVPAGE_OK, kvpage_cache_commit(c, s, NULL, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_create(c, 0, &gone, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_release(c, gone, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_stats(c, &st0, &err));

  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_create_with_prompt_at(NULL, 0, 1, prompt, 9, &r, NULL, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_create_with_prompt_at(c, 0, 1, prompt, 9, NULL, NULL, &err));
  EXPECT_TRUE(kvpage_cache_create_with_prompt_at(c, 0, 7, prompt, 9, &r, NULL, &err) == KVPAGE_ERR_INVALID_ARGUMENT && err.value == 7);
  memset(&err, 0, sizeof err);
  EXPECT_TRUE(r == KVPAGE_SEQ_NONE);
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_cache_set_priority((kvpage_cache *)garbage, s, 1, &err));
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_cache_set_priority(c, s, 4, &err));
  EXPECT(KVPAGE_ERR_STALE_SEQ, kvpage_cache_set_priority(c, gone, 1, &err));
  EXPECT(KVPAGE_ERR_BEYOND_LENGTH, kvpage_cache_set_range_priority(c, s, 2, 10, 2, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_unpin_cached(NULL, &n, &err));
  EXPECT(KVPAGE_ERR_QUOTA_REFUSED, kvpage_cache_set_namespace_quota(c, 2, 4, 5, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_cache_namespace_blocks(c, 2, NULL, &err));
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_cache_namespace_blocks((kvpage_cache *)garbage, 2, &n, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_stats(c, &st1, &err));
  EXPECT_TRUE(same_stats(&st0, &st1));

  /* A quota refuses a prompt over it; pinned blocks stay until unpinned. */
  EXPECT(KVPAGE_OK, kvpage_cache_set_namespace_quota(c, 2, 2, 0, &err));
  EXPECT_TRUE(kvpage_cache_create_with_prompt_at(c, 2, 1, prompt, 9, &r, NULL, &err) == KVPAGE_ERR_QUOTA_EXCEEDED && err.needed == 3 && err.available == 2);
  memset(&err, 0, sizeof err);
  EXPECT(KVPAGE_OK, kvpage_cache_namespace_blocks(c, 2, &n, &err));
  EXPECT_TRUE(n == 0);
  EXPECT(KVPAGE_OK, kvpage_cache_release(c, s, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_evict_cached(c, 8, &n, &err));
  EXPECT_TRUE(n == 0);
  EXPECT(KVPAGE_OK, kvpage_cache_unpin_cached(c, &n, &err));
  EXPECT_TRUE(n == 2);
  EXPECT(KVPAGE_OK, kvpage_cache_free(c, &err));

  /* The engine's cache takes a quota too. */
  EXPECT(KVPAGE_OK, kvpage_engine_new(&ep, &e, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_engine_set_namespace_quota(NULL, 1, 4, 0, &err));
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_engine_set_namespace_quota((kvpage_engine *)garbage, 1, 4, 0, &err));
  EXPECT(KVPAGE_ERR_QUOTA_REFUSED, kvpage_engine_set_namespace_quota(e, 1, 4, 9, &err));
  EXPECT(KVPAGE_OK, kvpage_engine_set_namespace_quota(e, 1, 4, 1, &err));
  EXPECT(KVPAGE_OK, kvpage_engine_free(e, &err));

  /* The quota slots are the params' max_namespaces: none refuses every quota, more
   * than the default 8 takes a 9th, too many is refused at creation. */
  p.max_namespaces = 0;
  EXPECT(KVPAGE_OK, kvpage_cache_new(&p, &c, &err));
  EXPECT(KVPAGE_ERR_QUOTA_REFUSED, kvpage_cache_set_namespace_quota(c, 1, 4, 0, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_free(c, &err));
  p.max_namespaces = KVPAGE_CACHE_NAMESPACES + 1;
  EXPECT(KVPAGE_OK, kvpage_cache_new(&p, &c, &err));
  for (uint64_t ns = 1; ns <= KVPAGE_CACHE_NAMESPACES + 1; ns++) {
    EXPECT(KVPAGE_OK, kvpage_cache_set_namespace_quota(c, ns, 2, 0, &err));
  }
  EXPECT(KVPAGE_ERR_QUOTA_REFUSED, kvpage_cache_set_namespace_quota(c, 99, 2, 0, &err));
  EXPECT_TRUE(kvpage_cache_create_with_prompt_at(c, KVPAGE_CACHE_NAMESPACES + 1, 1, prompt, 9, &r, NULL, &err) == KVPAGE_ERR_QUOTA_EXCEEDED && err.needed == 3 && err.available == 2);
  memset(&err, 0, sizeof err);
  EXPECT(KVPAGE_OK, kvpage_cache_free(c, &err));
  ep.cache.max_namespaces = 0;
  EXPECT(KVPAGE_OK, kvpage_engine_new(&ep, &e, &err));
  EXPECT(KVPAGE_ERR_QUOTA_REFUSED, kvpage_engine_set_namespace_quota(e, 1, 4, 0, &err));
  EXPECT(KVPAGE_OK, kvpage_engine_free(e, &err));
  ep.cache.max_namespaces = UINT32_MAX;
  e = NULL;
  EXPECT(KVPAGE_ERR_BAD_CONFIG, kvpage_engine_new(&ep, &e, &err));
  EXPECT_TRUE(e == NULL);
  section("cache retention calls", before);
}

/* The backend selection of the cache and engine parameters: this library is built
 * without the cuda feature, so asking for CUDA is KVPAGE_ERR_UNSUPPORTED (a build with
 * it on a machine without a driver answers KVPAGE_ERR_DEVICE); bad selections are
 * KVPAGE_ERR_INVALID_ARGUMENT either way, and nothing is written on failure. */
static void backend_calls(void) {
  unsigned before = checks;
  kvpage_cache_params p = cache_params(16);
  kvpage_engine_params ep = engine_params();
  kvpage_cache *c = NULL;
  kvpage_engine *e = NULL;
  EXPECT_TRUE(p.backend == KVPAGE_BACKEND_CPU && p.device == 0 && p.device_q_heads == 0);
  EXPECT_TRUE(p.device_memory_fraction == 0.0 && p.device_max_step_tokens == 0);
  p.backend = 7;
  EXPECT_TRUE(kvpage_cache_new(&p, &c, &err) == KVPAGE_ERR_INVALID_ARGUMENT && err.value == 7);
  memset(&err, 0, sizeof err);
  p.backend = KVPAGE_BACKEND_CUDA; /* device_q_heads not set */
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_cache_new(&p, &c, &err));
  p.device_q_heads = Q_HEADS;
  p.device_memory_fraction = 1.5;
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_cache_new(&p, &c, &err));
  p.device_memory_fraction = 0.5;
  EXPECT(KVPAGE_ERR_UNSUPPORTED, kvpage_cache_new(&p, &c, &err));
  EXPECT_TRUE(c == NULL);
  ep.cache.backend = 7;
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_engine_new(&ep, &e, &err));
  ep.cache.backend = KVPAGE_BACKEND_CUDA;
  ep.cache.device_q_heads = Q_HEADS;
  EXPECT(KVPAGE_ERR_UNSUPPORTED, kvpage_engine_new(&ep, &e, &err));
  EXPECT_TRUE(e == NULL);
  EXPECT_TRUE(strcmp(kvpage_result_str(KVPAGE_ERR_DEVICE), "CUDA device failed or unavailable") == 0);
  p.backend = KVPAGE_BACKEND_CPU; /* the device fields are ignored */
  EXPECT(KVPAGE_OK, kvpage_cache_new(&p, &c, &err));
  EXPECT(KVPAGE_OK, kvpage_cache_free(c, &err));
  section("backend selection", before);
}

/* The KV event publisher: this library is built without the events-zmq feature, so
 * starting one is KVPAGE_ERR_UNSUPPORTED; bad arguments still get their codes. */
static void publisher_calls(void) {
  unsigned before = checks;
  kvpage_publisher_params pp;
  kvpage_publisher *pub = NULL;
  uint64_t garbage[4] = {1, 2, 3, 4}; /* not a publisher */
  kvpage_published done;
  char addr[64];

  memset(&pp, 0, sizeof pp);
  pp.endpoint = "tcp://127.0.0.1:*";
  pp.format = KVPAGE_WIRE_TAGGED_MAP;
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_publisher_start(NULL, &pub, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_publisher_start(&pp, NULL, &err));
  pp.format = 9;
  EXPECT_TRUE(kvpage_publisher_start(&pp, &pub, &err) == KVPAGE_ERR_INVALID_ARGUMENT && err.value == 9);
  memset(&err, 0, sizeof err);
  pp.format = KVPAGE_WIRE_POSITIONAL_ARRAY;
  pp.endpoint = NULL;
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_publisher_start(&pp, &pub, &err));
  pp.endpoint = "tcp://127.0.0.1:*";
  EXPECT(KVPAGE_ERR_UNSUPPORTED, kvpage_publisher_start(&pp, &pub, &err));
  EXPECT_TRUE(pub == NULL);
  EXPECT_TRUE(strcmp(kvpage_result_str(KVPAGE_ERR_UNSUPPORTED), "not supported by this build") == 0);
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_publisher_publish(NULL, NULL, 0, &done, &err));
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_publisher_publish((kvpage_publisher *)garbage, NULL, 0, &done, &err));
  EXPECT(KVPAGE_ERR_NULL_POINTER, kvpage_publisher_endpoint(NULL, addr, sizeof addr, NULL, &err));
  EXPECT(KVPAGE_ERR_INVALID_ARGUMENT, kvpage_publisher_free((kvpage_publisher *)garbage, &err));
  EXPECT(KVPAGE_OK, kvpage_publisher_free(NULL, &err));
  section("publisher calls", before);
}

int main(void) {
  result_codes();
  cache_configs();
  cache_calls();
  rotate_calls();
  seq_blob_calls();
  prefix_file_calls();
  kv_event_calls();
  engine_calls();
  manager_and_scheduler_calls();
  manager_seq_calls();
  manager_retention_calls();
  cache_retention_calls();
  backend_calls();
  publisher_calls();
  if (failures) {
    printf("%u of %u checks failed\n", failures, checks);
    return 1;
  }
  printf("all %u checks passed\n", checks);
  return 0;
}
