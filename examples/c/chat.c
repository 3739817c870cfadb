/*
 * Two conversations with one system prompt, through kvpage's owned cache (tier 1 of
 * the C API): the second conversation reuses the system prompt's K/V through the
 * prefix cache, both decode in one batch, a third conversation forks from the first,
 * and every attention output is checked against a plain reference computed here.
 *
 * The "model" is a stand-in: keys, values and queries are a hash of (token, position,
 * layer, head, dim), so the program is deterministic and self-checking. Its output is
 * compared with expected/chat_c.txt by the tests.
 */
#include <kvpage.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { LAYERS = 2, KV_HEADS = 2, HEAD_DIM = 16, BLOCK = 4, Q_HEADS = 4, MAX_LEN = 64, MAX_SEQS = 4 };

/* A conversation: its sequence id and every token id it holds. */
typedef struct conversation {
  const char *name;
  kvpage_seq seq;
  uint32_t tokens[MAX_LEN];
  uint32_t len;
} conversation;

static void check(kvpage_result r, const kvpage_error *err, const char *what) {
  if (r != KVPAGE_OK) {
    fprintf(stderr, "%s failed: %s (%s)\n", what, kvpage_result_str(r), err->message);
    exit(1);
  }
}

/* The stand-in model: a value in [-1, 1) for (token, pos, layer, kind, head, dim),
 * kind 0 = key, 1 = value, 2 = query. */
static float model(uint32_t token, uint32_t pos, uint32_t layer, uint32_t kind, uint32_t head,
                   uint32_t dim) {
  uint32_t h = token * 2654435761u ^ pos * 40503u ^ layer * 97u ^ kind * 7919u ^ head * 131u ^
               dim * 17u;
  h ^= h >> 13;
  h *= 0x5bd1e995u;
  h ^= h >> 15;
  return (float)(h & 0xffffu) / 32768.0f - 1.0f;
}

/* K and V of positions first..first+n of `c` in one layer, [n][KV_HEADS][HEAD_DIM]. */
static void kv_rows(const conversation *c, uint32_t layer, uint32_t first, uint32_t n, float *k,
                    float *v) {
  uint32_t i, h, d;
  for (i = 0; i < n; i++)
    for (h = 0; h < KV_HEADS; h++)
      for (d = 0; d < HEAD_DIM; d++) {
        uint32_t pos = first + i, at = (i * KV_HEADS + h) * HEAD_DIM + d;
        k[at] = model(c->tokens[pos], pos, layer, 0, h, d);
        v[at] = model(c->tokens[pos], pos, layer, 1, h, d);
      }
}

/* Queries of positions first..first+n, [n][Q_HEADS][HEAD_DIM]. */
static void q_rows(const conversation *c, uint32_t layer, uint32_t first, uint32_t n, float *q) {
  uint32_t i, h, d;
  for (i = 0; i < n; i++)
    for (h = 0; h < Q_HEADS; h++)
      for (d = 0; d < HEAD_DIM; d++)
        q[(i * Q_HEADS + h) * HEAD_DIM + d] = model(c->tokens[first + i], first + i, layer, 2, h, d);
}

/* Largest difference between `out` (queries of positions first..first+n) and causal
 * attention computed from scratch in double precision. */
static double reference_error(const conversation *c, uint32_t layer, uint32_t first, uint32_t n,
                              const float *q, const float *out, float scale) {
  double worst = 0.0;
  uint32_t i, h, d, j;
  for (i = 0; i < n; i++)
    for (h = 0; h < Q_HEADS; h++) {
      uint32_t kvh = h / (Q_HEADS / KV_HEADS), ctx = first + i + 1;
      const float *qv = q + (i * Q_HEADS + h) * HEAD_DIM;
      double scores[MAX_LEN], max = -1e300, sum = 0.0;
      for (j = 0; j < ctx; j++) {
        double s = 0.0;
        for (d = 0; d < HEAD_DIM; d++) s += qv[d] * model(c->tokens[j], j, layer, 0, kvh, d);
        scores[j] = s * scale;
        if (scores[j] > max) max = scores[j];
      }
      for (j = 0; j < ctx; j++) sum += (scores[j] = exp(scores[j] - max));
      for (d = 0; d < HEAD_DIM; d++) {
        double want = 0.0, diff;
        for (j = 0; j < ctx; j++) want += scores[j] / sum * model(c->tokens[j], j, layer, 1, kvh, d);
        diff = fabs(want - out[(i * Q_HEADS + h) * HEAD_DIM + d]);
        if (diff > worst) worst = diff;
      }
    }
  return worst;
}

static const float SCALE = 0.25f; /* 1 / sqrt(HEAD_DIM) */
static const double TOLERANCE = 1e-2; /* K/V are stored as f16 */

/* Writes the K/V of positions first..len of `c` in every layer, runs prefill attention
 * for them and checks it; then commits the sequence. */
static void prefill(kvpage_cache *cache, conversation *c, uint32_t first) {
  uint32_t n = c->len - first, layer;
  size_t kv_len = (size_t)n * KV_HEADS * HEAD_DIM, q_len = (size_t)n * Q_HEADS * HEAD_DIM;
  float *k = malloc(kv_len * sizeof *k), *v = malloc(kv_len * sizeof *v);
  float *q = malloc(q_len * sizeof *q), *out = malloc(q_len * sizeof *out);
  kvpage_error err;
  double worst = 0.0;
  if (!k || !v || !q || !out) exit(1);
  for (layer = 0; layer < LAYERS; layer++) {
    double e;
    kv_rows(c, layer, first, n, k, v);
    check(kvpage_cache_write_kv(cache, c->seq, layer, first, n, k, kv_len, v, kv_len, &err), &err,
          "write_kv");
    q_rows(c, layer, first, n, q);
    check(kvpage_cache_prefill(cache, layer, &c->seq, &n, 1, q, q_len, out, q_len, Q_HEADS, SCALE,
                               &err),
          &err, "prefill");
    e = reference_error(c, layer, first, n, q, out, SCALE);
    if (e > worst) worst = e;
  }
  check(kvpage_cache_commit(cache, c->seq, NULL, &err), &err, "commit");
  printf("  prefill of %s, positions %u..%u: matches the reference: %s\n", c->name, first, c->len,
         worst < TOLERANCE ? "yes" : "NO");
  free(k);
  free(v);
  free(q);
  free(out);
}

/* One decode step for the conversations in `batch`: each appends one token, writes its
 * K/V, and all attend in one call per layer. */
static void decode_step(kvpage_cache *cache, conversation **batch, uint32_t n, uint32_t step) {
  kvpage_seq seqs[MAX_SEQS];
  float k[KV_HEADS * HEAD_DIM], v[KV_HEADS * HEAD_DIM];
  float q[MAX_SEQS * Q_HEADS * HEAD_DIM], out[MAX_SEQS * Q_HEADS * HEAD_DIM];
  kvpage_error err;
  double worst = 0.0;
  uint32_t i, layer;
  for (i = 0; i < n; i++) {
    conversation *c = batch[i];
    uint32_t next = (c->tokens[c->len - 1] * 31u + step * 7u + i) % 1000u;
    check(kvpage_cache_append_tokens(cache, c->seq, &next, 1, &err), &err, "append_tokens");
    c->tokens[c->len++] = next;
    seqs[i] = c->seq;
  }
  for (layer = 0; layer < LAYERS; layer++) {
    for (i = 0; i < n; i++) {
      conversation *c = batch[i];
      kv_rows(c, layer, c->len - 1, 1, k, v);
      check(kvpage_cache_write_kv(cache, c->seq, layer, c->len - 1, 1, k, sizeof k / sizeof *k, v,
                                  sizeof v / sizeof *v, &err),
            &err, "write_kv");
      q_rows(c, layer, c->len - 1, 1, q + i * Q_HEADS * HEAD_DIM);
    }
    check(kvpage_cache_decode(cache, layer, seqs, n, q, (size_t)n * Q_HEADS * HEAD_DIM, out,
                              (size_t)n * Q_HEADS * HEAD_DIM, Q_HEADS, SCALE, &err),
          &err, "decode");
    for (i = 0; i < n; i++) {
      double e = reference_error(batch[i], layer, batch[i]->len - 1, 1,
                                 q + i * Q_HEADS * HEAD_DIM, out + i * Q_HEADS * HEAD_DIM, SCALE);
      if (e > worst) worst = e;
    }
  }
  for (i = 0; i < n; i++) check(kvpage_cache_commit(cache, batch[i]->seq, NULL, &err), &err, "commit");
  printf("  decode step %u: %u sequences in one batch, matches the reference: %s\n", step, n,
         worst < TOLERANCE ? "yes" : "NO");
}

static void print_stats(kvpage_cache *cache, const char *when) {
  kvpage_stats s;
  kvpage_error err;
  check(kvpage_cache_stats(cache, &s, &err), &err, "stats");
  printf("%s: %u sequences; blocks: %u used, %u cached, %u free of %u; tokens stored %llu for "
         "%llu logical; blocks saved by sharing %llu; prefix-cache hits %llu tokens\n",
         when, s.live_seqs, s.used_blocks, s.cached_blocks, s.free_blocks, s.total_blocks,
         (unsigned long long)s.tokens_stored, (unsigned long long)s.logical_tokens,
         (unsigned long long)s.blocks_saved_by_sharing, (unsigned long long)s.prefix_hit_tokens);
}

int main(void) {
  static const uint32_t system_prompt[] = {101, 7, 42, 9, 300, 12, 5, 88, 61, 2, 17, 640};
  static const uint32_t user_a[] = {400, 401, 402, 403, 404};
  static const uint32_t user_b[] = {500, 501, 502, 503, 504, 505};
  const uint32_t sys_len = sizeof system_prompt / sizeof *system_prompt;
  kvpage_geometry g = {LAYERS, KV_HEADS, HEAD_DIM, BLOCK, KVPAGE_DTYPE_F16};
  kvpage_cache_params params = kvpage_cache_default_params(g);
  kvpage_cache *cache = NULL;
  kvpage_error err;
  conversation a = {"A", 0, {0}, 0}, b = {"B", 0, {0}, 0}, c = {"C", 0, {0}, 0};
  conversation *batch[MAX_SEQS];
  uint32_t reused, step = 1, i;

  if (kvpage_version() != KVPAGE_VERSION_MAJOR * 10000 + KVPAGE_VERSION_MINOR * 100 +
                              KVPAGE_VERSION_PATCH) {
    fprintf(stderr, "header and library versions differ\n");
    return 1;
  }
  printf("kvpage %s\n", kvpage_version_string());
  params.capacity_bytes = 0;
  params.capacity_blocks = 64;
  params.max_seqs = MAX_SEQS;
  params.max_seq_len = MAX_LEN;
  params.threads = 2;
  check(kvpage_cache_new(&params, &cache, &err), &err, "cache_new");
  printf("cache: %u blocks of %u tokens, f16, %u layers x %u KV heads x %u dims\n",
         params.capacity_blocks, BLOCK, LAYERS, KV_HEADS, HEAD_DIM);

  /* Two conversations: the system prompt, then each user's message. */
  memcpy(a.tokens, system_prompt, sizeof system_prompt);
  memcpy(a.tokens + sys_len, user_a, sizeof user_a);
  a.len = sys_len + sizeof user_a / sizeof *user_a;
  memcpy(b.tokens, system_prompt, sizeof system_prompt);
  memcpy(b.tokens + sys_len, user_b, sizeof user_b);
  b.len = sys_len + sizeof user_b / sizeof *user_b;

  check(kvpage_cache_create_with_prompt(cache, 1, a.tokens, a.len, &a.seq, &reused, &err), &err,
        "create_with_prompt");
  printf("conversation A: %u prompt tokens, %u reused from the prefix cache\n", a.len, reused);
  prefill(cache, &a, reused);
  check(kvpage_cache_create_with_prompt(cache, 1, b.tokens, b.len, &b.seq, &reused, &err), &err,
        "create_with_prompt");
  printf("conversation B: %u prompt tokens, %u reused from the prefix cache\n", b.len, reused);
  prefill(cache, &b, reused);
  print_stats(cache, "after both prompts");

  batch[0] = &a;
  batch[1] = &b;
  for (i = 0; i < 3; i++) decode_step(cache, batch, 2, step++);

  /* A second answer to A's question: C shares all of A's blocks until it writes. */
  check(kvpage_cache_fork(cache, a.seq, &c.seq, &err), &err, "fork");
  memcpy(c.tokens, a.tokens, sizeof a.tokens);
  c.len = a.len;
  printf("conversation C: forked from A at %u tokens\n", c.len);
  batch[2] = &c;
  for (i = 0; i < 3; i++) decode_step(cache, batch, 3, step++);
  print_stats(cache, "after the decode steps");

  check(kvpage_cache_release(cache, a.seq, &err), &err, "release");
  check(kvpage_cache_release(cache, b.seq, &err), &err, "release");
  check(kvpage_cache_release(cache, c.seq, &err), &err, "release");
  print_stats(cache, "after releasing all");
  check(kvpage_cache_free(cache, &err), &err, "cache_free");
  return 0;
}
