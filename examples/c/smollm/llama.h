/*
 * A GGUF Llama (SmolLM2) in f32: the weights dequantized at load, the forward pass of a
 * flat batch of token rows (each row its own token and position; prefill chunks and
 * decode tokens of many sequences mixed), with attention delegated to a callback, the
 * paged KV cache of kvpage in smollm.c. Rotary embedding on interleaved pairs
 * (2i, 2i + 1), as GGUF Llama weights expect.
 */
#ifndef SMOLLM_LLAMA_H
#define SMOLLM_LLAMA_H

#include <stddef.h>
#include <stdint.h>

#include "gguf.h"

typedef struct llama_hparams {
  uint32_t layers, heads, kv_heads, head_dim, hidden, ffn, vocab;
  float rms_eps, rope_base;
} llama_hparams;

typedef struct llama_layer {
  float *attn_norm, *wq, *wk, *wv, *wo, *ffn_norm, *gate, *up, *down;
} llama_layer;

typedef struct llama {
  llama_hparams hp;
  float *embed;  /* [vocab][hidden] */
  float *output; /* [vocab][hidden]; the embedding when tied */
  float *norm;
  llama_layer *layers;
  uint32_t max_positions;
  float *cos, *sin; /* [position][head_dim / 2] */
  /* Scratch for up to `max_rows` rows. */
  size_t max_rows;
  float *h, *x, *q, *k, *v, *att, *gate, *up;
} llama;

/* Stores the K/V of `rows` rows of layer `layer` and writes each row's attention into
 * `out` ([rows][heads][head_dim]); returns non-zero to stop the forward pass. */
typedef int (*llama_attend)(void *ctx, uint32_t layer, const float *q, const float *k,
                            const float *v, float *out, size_t rows);

/* Loads (dequantizes) the model of `f`, rotary tables for `max_positions`, scratch for
 * batches of `max_rows` rows. 0 on success; else a message in err. */
int llama_load(llama *m, const gguf_file *f, uint32_t max_positions, size_t max_rows, char *err,
               size_t err_len);
void llama_free(llama *m);

/* Runs `rows` rows (at most max_rows; positions below max_positions, tokens below
 * vocab: checked), then writes the logits after each row of `logit_rows` to
 * `logits` ([n_logits][vocab]). 0 on success; the callback's result otherwise, or -1
 * for a bad argument. O(rows × weights) plus attention. */
int llama_forward(llama *m, const uint32_t *tokens, const uint32_t *positions, size_t rows,
                  llama_attend attend, void *ctx, const uint32_t *logit_rows, size_t n_logits,
                  float *logits);

#endif
