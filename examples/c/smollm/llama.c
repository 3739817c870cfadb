/* The Llama forward pass in f32: see llama.h. */
#include "llama.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "quant.h"


/* The f32 values of tensor `name`, which must be [cols] (rows 0) or [rows][cols]. */
static float *load_tensor(const gguf_file *f, const char *name, uint64_t rows, uint64_t cols,
                          char *err, size_t err_len) {
  const gguf_tensor *t = gguf_tensor_find(f, name);
  float *out;
  if (!t) {
    smollm_fail(err, err_len, "tensor %s missing", name);
    return NULL;
  }
  if (t->dims[0] != cols || (rows ? t->n_dims != 2 || t->dims[1] != rows : t->n_dims != 1)) {
    smollm_fail(err, err_len, "tensor %s has shape %llux%llu, expected %llux%llu", name,
                (unsigned long long)t->dims[0], (unsigned long long)t->dims[1],
                (unsigned long long)cols, (unsigned long long)(rows ? rows : 1));
    return NULL;
  }
  out = malloc((size_t)t->elements * sizeof *out);
  if (!out) {
    smollm_fail(err, err_len, "out of memory for tensor %s", name);
    return NULL;
  }
  if (dequantize(t, out)) {
    free(out);
    smollm_fail(err, err_len, "tensor %s: unsupported type %u", name, t->type);
    return NULL;
  }
  return out;
}

static int read_hparams(llama_hparams *hp, const gguf_file *f, char *err, size_t err_len) {
  gguf_str arch;
  uint32_t rope_dims;
  const gguf_tensor *embed = gguf_tensor_find(f, "token_embd.weight");
  if (gguf_get_str(f, "general.architecture", &arch, err, err_len)) return 1;
  if (!gguf_str_eq(arch, "llama"))
    return smollm_fail(err, err_len, "architecture %.*s, not llama", (int)arch.len, arch.ptr);
  if (gguf_get_u32(f, "llama.block_count", &hp->layers, err, err_len) ||
      gguf_get_u32(f, "llama.attention.head_count", &hp->heads, err, err_len) ||
      gguf_get_u32(f, "llama.attention.head_count_kv", &hp->kv_heads, err, err_len) ||
      gguf_get_u32(f, "llama.embedding_length", &hp->hidden, err, err_len) ||
      gguf_get_u32(f, "llama.feed_forward_length", &hp->ffn, err, err_len) ||
      gguf_get_f32(f, "llama.attention.layer_norm_rms_epsilon", &hp->rms_eps, err, err_len))
    return 1;
  hp->rope_base = 10000.0f;
  if (gguf_find(f, "llama.rope.freq_base") &&
      gguf_get_f32(f, "llama.rope.freq_base", &hp->rope_base, err, err_len))
    return 1;
  if (hp->layers == 0 || hp->layers > 1024 || hp->heads == 0 || hp->kv_heads == 0 ||
      hp->heads % hp->kv_heads != 0 || hp->hidden % hp->heads != 0 || hp->ffn == 0 ||
      hp->hidden > 65536 || hp->ffn > 262144)
    return smollm_fail(err, err_len,
                       "unsupported shape: %u layers, %u heads, %u KV heads, width %u",
                       hp->layers, hp->heads, hp->kv_heads, hp->hidden);
  hp->head_dim = hp->hidden / hp->heads;
  if (hp->head_dim % 2 != 0) return smollm_fail(err, err_len, "odd head dim %u", hp->head_dim);
  if (gguf_find(f, "llama.rope.dimension_count")) {
    if (gguf_get_u32(f, "llama.rope.dimension_count", &rope_dims, err, err_len)) return 1;
    if (rope_dims != hp->head_dim) return smollm_fail(err, err_len, "partial rotary embedding");
  }
  if (!(hp->rope_base > 1.0f) || !(hp->rms_eps >= 0.0f))
    return smollm_fail(err, err_len, "bad rope base or rms epsilon");
  if (!embed || embed->n_dims != 2 || embed->dims[1] > UINT32_MAX)
    return smollm_fail(err, err_len, "token_embd.weight missing or not a matrix");
  hp->vocab = (uint32_t)embed->dims[1];
  return 0;
}

int llama_load(llama *m, const gguf_file *f, uint32_t max_positions, size_t max_rows, char *err,
               size_t err_len) {
  llama_hparams *hp = &m->hp;
  uint32_t l, half, p, i;
  size_t kv_dim;
  memset(m, 0, sizeof *m);
  if (read_hparams(hp, f, err, err_len)) return 1;
  kv_dim = (size_t)hp->kv_heads * hp->head_dim;
  m->embed = load_tensor(f, "token_embd.weight", hp->vocab, hp->hidden, err, err_len);
  m->norm = load_tensor(f, "output_norm.weight", 0, hp->hidden, err, err_len);
  if (!m->embed || !m->norm) goto fail;
  /* Tied embeddings: without an output matrix, logits use the embedding table. */
  m->output = gguf_tensor_find(f, "output.weight")
                  ? load_tensor(f, "output.weight", hp->vocab, hp->hidden, err, err_len)
                  : m->embed;
  m->layers = calloc(hp->layers, sizeof *m->layers);
  if (!m->output || !m->layers) goto fail;
  for (l = 0; l < hp->layers; l++) {
    llama_layer *y = &m->layers[l];
    char name[64];
#define LOAD(field, suffix, rows, cols)                                           \
  snprintf(name, sizeof name, "blk.%u.%s.weight", l, suffix);                    \
  if (!(y->field = load_tensor(f, name, rows, cols, err, err_len))) goto fail;
    LOAD(attn_norm, "attn_norm", 0, hp->hidden)
    LOAD(wq, "attn_q", hp->hidden, hp->hidden)
    LOAD(wk, "attn_k", kv_dim, hp->hidden)
    LOAD(wv, "attn_v", kv_dim, hp->hidden)
    LOAD(wo, "attn_output", hp->hidden, hp->hidden)
    LOAD(ffn_norm, "ffn_norm", 0, hp->hidden)
    LOAD(gate, "ffn_gate", hp->ffn, hp->hidden)
    LOAD(up, "ffn_up", hp->ffn, hp->hidden)
    LOAD(down, "ffn_down", hp->hidden, hp->ffn)
#undef LOAD
  }
  /* Angles as the Rust example (and candle) compute them: inverse frequency
   * 1 / base^(2i / head_dim) in f32, times the position in f32. */
  half = hp->head_dim / 2;
  m->max_positions = max_positions;
  m->cos = malloc((size_t)max_positions * half * sizeof *m->cos);
  m->sin = malloc((size_t)max_positions * half * sizeof *m->sin);
  m->max_rows = max_rows;
  m->h = malloc(max_rows * hp->hidden * sizeof(float));
  m->x = malloc(max_rows * hp->hidden * sizeof(float));
  m->q = malloc(max_rows * hp->hidden * sizeof(float));
  m->att = malloc(max_rows * hp->hidden * sizeof(float));
  m->k = malloc(max_rows * kv_dim * sizeof(float));
  m->v = malloc(max_rows * kv_dim * sizeof(float));
  m->gate = malloc(max_rows * hp->ffn * sizeof(float));
  m->up = malloc(max_rows * hp->ffn * sizeof(float));
  if (!m->cos || !m->sin || !m->h || !m->x || !m->q || !m->att || !m->k || !m->v || !m->gate ||
      !m->up) {
    smollm_fail(err, err_len, "out of memory for the rotary tables and scratch");
    goto fail;
  }
  for (i = 0; i < half; i++) {
    float inv_freq = 1.0f / powf(hp->rope_base, (float)(2 * i) / (float)hp->head_dim);
    for (p = 0; p < max_positions; p++) {
      float angle = (float)p * inv_freq;
      m->cos[(size_t)p * half + i] = cosf(angle);
      m->sin[(size_t)p * half + i] = sinf(angle);
    }
  }
  return 0;
fail:
  llama_free(m);
  return 1;
}

void llama_free(llama *m) {
  uint32_t l;
  if (m->layers)
    for (l = 0; l < m->hp.layers; l++) {
      llama_layer *y = &m->layers[l];
      free(y->attn_norm); free(y->wq); free(y->wk); free(y->wv); free(y->wo);
      free(y->ffn_norm); free(y->gate); free(y->up); free(y->down);
    }
  if (m->output != m->embed) free(m->output);
  free(m->embed); free(m->norm); free(m->layers); free(m->cos); free(m->sin);
  free(m->h); free(m->x); free(m->q); free(m->k); free(m->v); free(m->att);
  free(m->gate); free(m->up);
  memset(m, 0, sizeof *m);
}

/* Dot product in a fixed order: 8 interleaved partial sums, then the tail, so a row's
 * result does not depend on how rows are batched. */
static float dot(const float *a, const float *b, size_t n) {
  float acc[8] = {0};
  size_t i, l;
  float tail = 0.0f;
  for (i = 0; i + 8 <= n; i += 8)
    for (l = 0; l < 8; l++) acc[l] += a[i + l] * b[i + l];
  for (; i < n; i++) tail += a[i] * b[i];
  return (((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))) +
         tail;
}

/* y[r][o] = x[r] · w[o] for `rows` rows of `in` and `out` outputs; w is [out][in]. The
 * outputs are taken in tiles so a tile of w stays in cache across the rows. */
static void matmul(float *y, const float *x, const float *w, size_t rows, size_t in,
                   size_t out) {
  enum { TILE = 16 };
  size_t o0, r, o;
  for (o0 = 0; o0 < out; o0 += TILE) {
    size_t o1 = o0 + TILE < out ? o0 + TILE : out;
    for (r = 0; r < rows; r++)
      for (o = o0; o < o1; o++) y[r * out + o] = dot(x + r * in, w + o * in, in);
  }
}

/* RMS norm as candle computes it: x / sqrt(mean(x²) + eps) * alpha, the sum in order. */
static void rms_norm(float *out, const float *x, const float *alpha, size_t rows, size_t dim,
                     float eps) {
  size_t r, i;
  for (r = 0; r < rows; r++) {
    const float *xr = x + r * dim;
    float sum2 = 0.0f, m;
    for (i = 0; i < dim; i++) sum2 += xr[i] * xr[i];
    m = sqrtf(sum2 / (float)dim + eps);
    for (i = 0; i < dim; i++) out[r * dim + i] = xr[i] / m * alpha[i];
  }
}

/* Rotates every head of each row (width `width`) at its position, pairs (2i, 2i+1). */
static void rope(const llama *m, float *x, const uint32_t *positions, size_t rows, size_t width) {
  size_t half = m->hp.head_dim / 2, r, h, i;
  for (r = 0; r < rows; r++) {
    const float *c = m->cos + (size_t)positions[r] * half;
    const float *s = m->sin + (size_t)positions[r] * half;
    for (h = 0; h < width; h += m->hp.head_dim) {
      float *head = x + r * width + h;
      for (i = 0; i < half; i++) {
        float a = head[2 * i], b = head[2 * i + 1];
        head[2 * i] = a * c[i] - b * s[i];
        head[2 * i + 1] = a * s[i] + b * c[i];
      }
    }
  }
}

int llama_forward(llama *m, const uint32_t *tokens, const uint32_t *positions, size_t rows,
                  llama_attend attend, void *ctx, const uint32_t *logit_rows, size_t n_logits,
                  float *logits) {
  const llama_hparams *hp = &m->hp;
  size_t hidden = hp->hidden, kv_dim = (size_t)hp->kv_heads * hp->head_dim, ffn = hp->ffn;
  size_t r, i;
  uint32_t l;
  int rc;
  if (rows > m->max_rows || n_logits > rows) return -1;
  for (r = 0; r < rows; r++) {
    if (tokens[r] >= hp->vocab || positions[r] >= m->max_positions) return -1;
    memcpy(m->h + r * hidden, m->embed + (size_t)tokens[r] * hidden, hidden * sizeof(float));
  }
  for (r = 0; r < n_logits; r++)
    if (logit_rows[r] >= rows) return -1;
  for (l = 0; l < hp->layers; l++) {
    const llama_layer *y = &m->layers[l];
    rms_norm(m->x, m->h, y->attn_norm, rows, hidden, hp->rms_eps);
    matmul(m->q, m->x, y->wq, rows, hidden, hidden);
    matmul(m->k, m->x, y->wk, rows, hidden, kv_dim);
    matmul(m->v, m->x, y->wv, rows, hidden, kv_dim);
    rope(m, m->q, positions, rows, hidden);
    rope(m, m->k, positions, rows, kv_dim);
    if ((rc = attend(ctx, l, m->q, m->k, m->v, m->att, rows)) != 0) return rc;
    matmul(m->x, m->att, y->wo, rows, hidden, hidden);
    for (i = 0; i < rows * hidden; i++) m->h[i] = m->x[i] + m->h[i];
    rms_norm(m->x, m->h, y->ffn_norm, rows, hidden, hp->rms_eps);
    matmul(m->gate, m->x, y->gate, rows, hidden, ffn);
    matmul(m->up, m->x, y->up, rows, hidden, ffn);
    for (i = 0; i < rows * ffn; i++) {
      float g = m->gate[i];
      m->gate[i] = g / (expf(-g) + 1.0f) * m->up[i];
    }
    matmul(m->x, m->gate, y->down, rows, ffn, hidden);
    for (i = 0; i < rows * hidden; i++) m->h[i] = m->x[i] + m->h[i];
  }
  for (r = 0; r < n_logits; r++)
    rms_norm(m->x + r * hidden, m->h + (size_t)logit_rows[r] * hidden, m->norm, 1, hidden,
             hp->rms_eps);
  matmul(logits, m->x, m->output, n_logits, hidden, hp->vocab);
  return 0;
}
