/* Byte-level BPE: see bpe.h. */
#include "bpe.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"

enum { CONTROL_TYPE = 3, MAX_PIECE = 4096 };


/* ---- string map ---- */

static uint64_t hash(const char *s, size_t n) {
  uint64_t h = 1469598103934665603ull;
  size_t i;
  for (i = 0; i < n; i++) h = (h ^ (uint8_t)s[i]) * 1099511628211ull;
  return h;
}

static int map_init(strmap *m, size_t entries) {
  m->cap = 16;
  while (m->cap < entries * 2) m->cap *= 2;
  m->keys = calloc(m->cap, sizeof *m->keys);
  m->lens = calloc(m->cap, sizeof *m->lens);
  m->values = calloc(m->cap, sizeof *m->values);
  return m->keys && m->lens && m->values ? 0 : 1;
}

static void map_free(strmap *m) {
  free(m->keys);
  free(m->lens);
  free(m->values);
  memset(m, 0, sizeof *m);
}

/* Inserts unless the key is there already (the first id of a duplicate wins). */
static void map_put(strmap *m, const char *key, size_t len, uint32_t value) {
  size_t i = (size_t)hash(key, len) & (m->cap - 1);
  while (m->keys[i]) {
    if (m->lens[i] == len && memcmp(m->keys[i], key, len) == 0) return;
    i = (i + 1) & (m->cap - 1);
  }
  m->keys[i] = key;
  m->lens[i] = (uint32_t)len;
  m->values[i] = value;
}

static int map_get(const strmap *m, const char *key, size_t len, uint32_t *value) {
  size_t i = (size_t)hash(key, len) & (m->cap - 1);
  while (m->keys[i]) {
    if (m->lens[i] == len && memcmp(m->keys[i], key, len) == 0) {
      *value = m->values[i];
      return 1;
    }
    i = (i + 1) & (m->cap - 1);
  }
  return 0;
}

/* ---- GPT-2's byte <-> printable character mapping ---- */

/* The code point byte `b` is written as: printable Latin-1 bytes stay, the others
 * become 256, 257, ... in byte order. */
static uint32_t byte_char(uint8_t b) {
  uint32_t n = 0, c;
  if ((b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae)) return b;
  for (c = 0; c < b; c++)
    if (!((c >= '!' && c <= '~') || (c >= 0xa1 && c <= 0xac) || (c >= 0xae))) n++;
  return 256 + n;
}

/* UTF-8 of code point `c` (< 0x800) into `out`; its length. */
static size_t utf8(uint32_t c, char *out) {
  if (c < 0x80) {
    out[0] = (char)c;
    return 1;
  }
  out[0] = (char)(0xc0 | (c >> 6));
  out[1] = (char)(0x80 | (c & 0x3f));
  return 2;
}

/* ---- loading ---- */

int bpe_load(bpe *b, const gguf_file *f, char *err, size_t err_len) {
  const gguf_kv *tokens, *merges, *types;
  gguf_str model;
  const uint8_t *p;
  uint64_t i;
  memset(b, 0, sizeof *b);
  if (gguf_get_str(f, "tokenizer.ggml.model", &model, err, err_len)) return 1;
  if (!gguf_str_eq(model, "gpt2"))
    return smollm_fail(err, err_len, "tokenizer %.*s, not gpt2 (byte-level BPE)", (int)model.len,
                       model.ptr);
  if (gguf_get_array(f, "tokenizer.ggml.tokens", GGUF_STRING, &tokens, err, err_len) ||
      gguf_get_array(f, "tokenizer.ggml.merges", GGUF_STRING, &merges, err, err_len) ||
      gguf_get_u32(f, "tokenizer.ggml.eos_token_id", &b->eos, err, err_len))
    return 1;
  if (tokens->count == 0 || tokens->count > UINT32_MAX / 2 || merges->count > UINT32_MAX / 2)
    return smollm_fail(err, err_len, "vocabulary of %llu tokens and %llu merges",
                       (unsigned long long)tokens->count, (unsigned long long)merges->count);
  b->n_vocab = (uint32_t)tokens->count;
  b->tokens = calloc(b->n_vocab, sizeof *b->tokens);
  b->is_control = calloc(b->n_vocab, 1);
  b->controls = calloc(b->n_vocab, sizeof *b->controls);
  if (!b->tokens || !b->is_control || !b->controls || map_init(&b->vocab, b->n_vocab) ||
      map_init(&b->merges, (size_t)merges->count)) {
    bpe_free(b);
    return smollm_fail(err, err_len, "out of memory for the tokenizer");
  }
  for (p = tokens->value, i = 0; i < tokens->count; i++) {
    b->tokens[i] = gguf_next_string(&p);
    map_put(&b->vocab, b->tokens[i].ptr, b->tokens[i].len, (uint32_t)i);
  }
  for (p = merges->value, i = 0; i < merges->count; i++) {
    gguf_str m = gguf_next_string(&p);
    map_put(&b->merges, m.ptr, m.len, (uint32_t)i);
  }
  types = gguf_find(f, "tokenizer.ggml.token_type");
  if (types && types->type == GGUF_ARRAY && types->elem_type == GGUF_I32 &&
      types->count == tokens->count) {
    for (i = 0; i < tokens->count; i++) {
      const uint8_t *t = types->value + 4 * i;
      if (t[0] == CONTROL_TYPE && t[1] == 0 && t[2] == 0 && t[3] == 0 && b->tokens[i].len > 0) {
        b->is_control[i] = 1;
        b->controls[b->n_controls++] = (uint32_t)i;
      }
    }
  }
  if (b->eos >= b->n_vocab) {
    bpe_free(b);
    return smollm_fail(err, err_len, "end-of-sequence id past the vocabulary");
  }
  return 0;
}

void bpe_free(bpe *b) {
  free(b->tokens);
  free(b->is_control);
  free(b->controls);
  map_free(&b->vocab);
  map_free(&b->merges);
  memset(b, 0, sizeof *b);
}

/* ---- encoding ---- */

typedef struct ids_buf {
  uint32_t *ids;
  size_t n, cap;
} ids_buf;

static int push(ids_buf *o, uint32_t id) {
  if (o->n == o->cap) {
    size_t cap = o->cap ? o->cap * 2 : 64;
    uint32_t *grown = realloc(o->ids, cap * sizeof *grown);
    if (!grown) return 1;
    o->ids = grown;
    o->cap = cap;
  }
  o->ids[o->n++] = id;
  return 0;
}

/* BPE of one pre-tokenized piece of at most MAX_PIECE bytes. */
static int encode_chunk(const bpe *b, const char *s, size_t n, ids_buf *o, char *err,
                        size_t err_len) {
  char text[2 * MAX_PIECE], pair[4 * MAX_PIECE + 1];
  size_t start[MAX_PIECE], len[MAX_PIECE], syms = 0, i, at = 0;
  for (i = 0; i < n; i++) {
    start[syms] = at;
    len[syms] = utf8(byte_char((uint8_t)s[i]), text + at);
    at += len[syms++];
  }
  for (;;) {
    uint32_t best_rank = UINT32_MAX, rank;
    size_t best = 0;
    for (i = 0; i + 1 < syms; i++) {
      /* Adjacent symbols are adjacent in `text`: "left right" is built around them. */
      memcpy(pair, text + start[i], len[i]);
      pair[len[i]] = ' ';
      memcpy(pair + len[i] + 1, text + start[i + 1], len[i + 1]);
      if (map_get(&b->merges, pair, len[i] + 1 + len[i + 1], &rank) && rank < best_rank) {
        best_rank = rank;
        best = i;
      }
    }
    if (best_rank == UINT32_MAX) break;
    len[best] += len[best + 1];
    memmove(start + best + 1, start + best + 2, (syms - best - 2) * sizeof *start);
    memmove(len + best + 1, len + best + 2, (syms - best - 2) * sizeof *len);
    syms--;
  }
  for (i = 0; i < syms; i++) {
    uint32_t id;
    if (!map_get(&b->vocab, text + start[i], len[i], &id))
      return smollm_fail(err, err_len, "no token for \"%.*s\"", (int)len[i], text + start[i]);
    if (push(o, id)) return smollm_fail(err, err_len, "out of memory");
  }
  return 0;
}

/* BPE of one pre-tokenized piece; a giant one (a run of spaces) in MAX_PIECE chunks. */
static int encode_piece(const bpe *b, const char *s, size_t n, ids_buf *o, char *err,
                        size_t err_len) {
  while (n > 0) {
    size_t chunk = n < MAX_PIECE ? n : MAX_PIECE;
    if (encode_chunk(b, s, chunk, o, err, err_len)) return 1;
    s += chunk;
    n -= chunk;
  }
  return 0;
}

static int is_space(uint8_t c) { return c == ' ' || (c >= '\t' && c <= '\r'); }
static int is_digit(uint8_t c) { return c >= '0' && c <= '9'; }
static int is_letter(uint8_t c) { return (c | 0x20) >= 'a' && (c | 0x20) <= 'z' ? 1 : c >= 0x80; }
static int is_other(uint8_t c) { return !is_space(c) && !is_digit(c) && !is_letter(c); }

/* Length of the GPT-2 pre-tokenizer's match at the start of s[0..n) (n > 0). */
static size_t gpt2_match(const uint8_t *s, size_t n) {
  size_t j = 0, k;
  if (s[0] == '\'' && n >= 2) {
    if (s[1] == 's' || s[1] == 't' || s[1] == 'm' || s[1] == 'd') return 2;
    if (n >= 3 && ((s[1] == 'r' && s[2] == 'e') || (s[1] == 'v' && s[2] == 'e') ||
                   (s[1] == 'l' && s[2] == 'l')))
      return 3;
  }
  if (s[0] == ' ') j = 1;
  if (j < n) {
    int (*cls)(uint8_t) = is_letter(s[j]) ? is_letter : is_digit(s[j]) ? is_digit
                          : is_other(s[j]) ? is_other : NULL;
    if (cls) {
      for (k = j; k < n && cls(s[k]); k++) {
      }
      return k;
    }
  }
  for (k = 0; k < n && is_space(s[k]); k++) {
  }
  /* \s+(?!\S): a run that ends the text, or all of it but its last character before a
   * non-space; a single space before a non-space: \s+. */
  if (k == n || k == 1) return k;
  return k - 1;
}

/* Pre-tokenizes and encodes text without control tokens. */
static int encode_text(const bpe *b, const uint8_t *s, size_t n, ids_buf *o, char *err,
                       size_t err_len) {
  size_t i = 0;
  while (i < n) {
    size_t end, m;
    if (is_digit(s[i])) {
      if (encode_piece(b, (const char *)s + i, 1, o, err, err_len)) return 1;
      i++;
      continue;
    }
    for (end = i; end < n && !is_digit(s[end]); end++) {
    }
    while (i < end) {
      m = gpt2_match(s + i, end - i);
      if (encode_piece(b, (const char *)s + i, m, o, err, err_len)) return 1;
      i += m;
    }
  }
  return 0;
}

int bpe_encode(const bpe *b, const char *text, size_t len, uint32_t **ids, size_t *n, char *err,
               size_t err_len) {
  ids_buf o = {NULL, 0, 0};
  size_t i = 0, plain = 0, c;
  while (i <= len) {
    size_t best_len = 0;
    uint32_t best = 0;
    for (c = 0; i < len && c < b->n_controls; c++) {
      gguf_str t = b->tokens[b->controls[c]];
      if (t.len > best_len && t.len <= len - i && memcmp(text + i, t.ptr, t.len) == 0) {
        best_len = t.len;
        best = b->controls[c];
      }
    }
    if (best_len > 0 || i == len) {
      if (encode_text(b, (const uint8_t *)text + plain, i - plain, &o, err, err_len)) goto fail;
      if (i == len) break;
      if (push(&o, best)) {
        smollm_fail(err, err_len, "out of memory");
        goto fail;
      }
      i += best_len;
      plain = i;
    } else {
      i++;
    }
  }
  *ids = o.ids;
  *n = o.n;
  return 0;
fail:
  free(o.ids);
  return 1;
}

/* ---- decoding ---- */

/* The byte of GPT-2 character `c`, or -1. */
static int char_byte(uint32_t c) {
  int byte;
  for (byte = 0; byte < 256; byte++)
    if (byte_char((uint8_t)byte) == c) return byte;
  return -1;
}

char *bpe_decode(const bpe *b, const uint32_t *ids, size_t n) {
  size_t total = 1, i, j, at = 0;
  char *out;
  int table[324];
  uint32_t c;
  for (c = 0; c < 324; c++) table[c] = char_byte(c);
  for (i = 0; i < n; i++)
    if (ids[i] < b->n_vocab) total += b->tokens[ids[i]].len;
  out = malloc(total);
  if (!out) return NULL;
  for (i = 0; i < n; i++) {
    gguf_str t;
    if (ids[i] >= b->n_vocab || b->is_control[ids[i]]) continue;
    t = b->tokens[ids[i]];
    for (j = 0; j < t.len;) {
      uint8_t c0 = (uint8_t)t.ptr[j];
      if (c0 < 0x80) {
        c = c0;
        j++;
      } else if ((c0 & 0xe0) == 0xc0 && j + 1 < t.len) {
        c = (uint32_t)(c0 & 0x1f) << 6 | ((uint8_t)t.ptr[j + 1] & 0x3f);
        j += 2;
      } else {
        j++;
        continue; /* not a GPT-2 character: skipped */
      }
      if (c < 324 && table[c] >= 0) out[at++] = (char)table[c];
    }
  }
  out[at] = '\0';
  return out;
}
