/*
 * The byte-level BPE tokenizer of a GGUF `gpt2` vocabulary (tokenizer.ggml.tokens,
 * .merges, .token_type): control tokens (`<|im_start|>`, ...) are matched whole in the
 * text; the rest is pre-tokenized as SmolLM2's tokenizer does (every number character
 * alone, then GPT-2's split into contractions, words, numbers, punctuation runs and
 * whitespace; exact for ASCII, and for the common Unicode spaces, numbers, punctuation,
 * symbols and emoji, other code points counting as letters), each piece's bytes become
 * GPT-2's printable characters and are merged by rank.
 */
#ifndef SMOLLM_BPE_H
#define SMOLLM_BPE_H

#include <stddef.h>
#include <stdint.h>

#include "gguf.h"

/* A string -> id hash table (open addressing), keys borrowed. */
typedef struct strmap {
  const char **keys;
  uint32_t *lens;
  uint32_t *values;
  size_t cap; /* power of two */
} strmap;

typedef struct bpe {
  uint32_t n_vocab;
  gguf_str *tokens;   /* id -> token text (in the file) */
  uint8_t *is_control;
  strmap vocab;       /* token text -> id */
  strmap merges;      /* "left right" -> rank */
  uint32_t *controls; /* ids of control tokens */
  size_t n_controls;
  uint32_t eos;
} bpe;

/* Builds the tokenizer from `f`'s metadata (which must outlive it). 0 on success. */
int bpe_load(bpe *b, const gguf_file *f, char *err, size_t err_len);
void bpe_free(bpe *b);

/* Token ids of `text` (`len` bytes) into a new array `*ids` (free it) of `*n`. 0 on
 * success; non-zero (message in err) when out of memory or a piece has no token. */
int bpe_encode(const bpe *b, const char *text, size_t len, uint32_t **ids, size_t *n, char *err,
               size_t err_len);

/* Bytes of the text of `ids`, control tokens left out, into a new NUL-terminated
 * string (free it); NULL when out of memory. Ids past the vocabulary are skipped. */
char *bpe_decode(const bpe *b, const uint32_t *ids, size_t n);

#endif
