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

/* Character classes of the pre-tokenizer's regular expression: \s, \p{L}, \p{N} and the
 * rest (punctuation, symbols, marks). */
enum cls { C_SPACE, C_LETTER, C_NUMBER, C_OTHER };

/* The code point at s[0..n) (n > 0) and its length in `*len`; a byte that does not start
 * a valid sequence is taken alone, as a letter-like code point 0x80000 + byte. */
static uint32_t next_cp(const uint8_t *s, size_t n, size_t *len) {
  uint32_t c = s[0];
  size_t want = c < 0x80 ? 1 : (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3
              : (c & 0xf8) == 0xf0 ? 4 : 0;
  size_t i;
  if (want == 0 || want > n) {
    *len = 1;
    return 0x80000 + c;
  }
  c &= want == 1 ? 0x7f : want == 2 ? 0x1f : want == 3 ? 0x0f : 0x07;
  for (i = 1; i < want; i++) {
    if ((s[i] & 0xc0) != 0x80) {
      *len = 1;
      return 0x80000 + s[0];
    }
    c = c << 6 | (s[i] & 0x3f);
  }
  *len = want;
  return c;
}

static int in(uint32_t c, uint32_t lo, uint32_t hi) { return c >= lo && c <= hi; }

/* ASCII exactly; beyond it the common Unicode spaces, numbers, punctuation, symbols,
 * marks and emoji, and letters otherwise (an approximation of the Unicode tables). */
static enum cls classify(uint32_t c) {
  if (c < 0x80) {
    if (c == ' ' || in(c, '\t', '\r')) return C_SPACE;
    if (in(c, '0', '9')) return C_NUMBER;
    if (in(c | 0x20, 'a', 'z')) return C_LETTER;
    return C_OTHER;
  }
  if (c == 0x85 || c == 0xa0 || c == 0x1680 || in(c, 0x2000, 0x200a) || c == 0x2028 ||
      c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000)
    return C_SPACE;
  if (c == 0xb2 || c == 0xb3 || c == 0xb9 || in(c, 0xbc, 0xbe) || in(c, 0x660, 0x669) ||
      in(c, 0x6f0, 0x6f9) || in(c, 0x966, 0x96f) || c == 0x2070 || in(c, 0x2074, 0x2079) ||
      in(c, 0x2080, 0x2089) || in(c, 0x2150, 0x2189) || in(c, 0x2460, 0x249b) ||
      in(c, 0x2776, 0x2793) || c == 0x3007 || in(c, 0xff10, 0xff19))
    return C_NUMBER;
  if (c == 0xaa || c == 0xb5 || c == 0xba) return C_LETTER;
  if (in(c, 0xa1, 0xbf) || c == 0xd7 || c == 0xf7 || in(c, 0x300, 0x36f) ||
      in(c, 0x2010, 0x2027) || in(c, 0x2030, 0x205e) || in(c, 0x20a0, 0x20ff) ||
      in(c, 0x2190, 0x245f) || in(c, 0x2500, 0x2775) || in(c, 0x2794, 0x2bff) ||
      in(c, 0x3001, 0x3006) || in(c, 0x3008, 0x3020) || c == 0x3030 || c == 0x200d ||
      in(c, 0xfe00, 0xfe0f) || in(c, 0xff01, 0xff0f) || in(c, 0xff1a, 0xff20) ||
      in(c, 0xff3b, 0xff40) || in(c, 0xff5b, 0xff65) || in(c, 0x1f000, 0x1faff))
    return C_OTHER;
  return C_LETTER;
}

/* The class of the code point at s[0..n) (n > 0), its length in `*len`. */
static enum cls class_at(const uint8_t *s, size_t n, size_t *len) {
  return classify(next_cp(s, n, len));
}

/* End of the run of class `k` starting at `i`. */
static size_t run_end(const uint8_t *s, size_t n, size_t i, enum cls k) {
  size_t len;
  while (i < n && class_at(s + i, n - i, &len) == k) i += len;
  return i;
}

/* Length of the GPT-2 pre-tokenizer's match at the start of s[0..n) (n > 0):
 * 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
static size_t gpt2_match(const uint8_t *s, size_t n) {
  size_t j = 0, k, len, last = 0;
  enum cls c;
  if (s[0] == '\'' && n >= 2) {
    if (s[1] == 's' || s[1] == 't' || s[1] == 'm' || s[1] == 'd') return 2;
    if (n >= 3 && ((s[1] == 'r' && s[2] == 'e') || (s[1] == 'v' && s[2] == 'e') ||
                   (s[1] == 'l' && s[2] == 'l')))
      return 3;
  }
  if (s[0] == ' ') j = 1;
  if (j < n && (c = class_at(s + j, n - j, &len)) != C_SPACE) return run_end(s, n, j, c);
  /* A whitespace run: \s+(?!\S) takes all of it when it ends the text, else all but its
   * last character (which goes with the next word); a single one before a non-space:
   * \s+. */
  for (k = 0; k < n && class_at(s + k, n - k, &len) == C_SPACE; k += len) last = k;
  if (k == n || last == 0) return k;
  return last;
}

/* Pre-tokenizes and encodes text without control tokens: every number character alone
 * (SmolLM2's Digits pre-tokenizer), then the GPT-2 split of the text between them. */
static int encode_text(const bpe *b, const uint8_t *s, size_t n, ids_buf *o, char *err,
                       size_t err_len) {
  size_t i = 0, len;
  while (i < n) {
    size_t end, m;
    if (class_at(s + i, n - i, &len) == C_NUMBER) {
      if (encode_piece(b, (const char *)s + i, len, o, err, err_len)) return 1;
      i += len;
      continue;
    }
    for (end = i; end < n && class_at(s + end, n - end, &len) != C_NUMBER; end += len) {
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
