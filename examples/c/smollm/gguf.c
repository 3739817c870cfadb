/* GGUF reader: see gguf.h. Every read goes through `cursor`, which checks bounds. */
#include "gguf.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"

typedef struct cursor {
  const uint8_t *base;
  size_t size;
  size_t pos;
  char *err;
  size_t err_len;
} cursor;


static int take(cursor *c, size_t n, const uint8_t **out, const char *what) {
  if (n > c->size - c->pos)
    return smollm_fail(c->err, c->err_len,
                       "truncated file: %s needs %zu bytes at offset %zu, file is %zu",
                       what, n, c->pos, c->size);
  *out = c->base + c->pos;
  c->pos += n;
  return 0;
}

static uint32_t le32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t le64(const uint8_t *p) { return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32; }

static int read_u32(cursor *c, uint32_t *out, const char *what) {
  const uint8_t *p = NULL;
  if (take(c, 4, &p, what)) return 1;
  *out = le32(p);
  return 0;
}

static int read_u64(cursor *c, uint64_t *out, const char *what) {
  const uint8_t *p = NULL;
  if (take(c, 8, &p, what)) return 1;
  *out = le64(p);
  return 0;
}

static int read_str(cursor *c, gguf_str *out, const char *what) {
  uint64_t len;
  const uint8_t *p = NULL;
  if (read_u64(c, &len, what)) return 1;
  if (len > c->size - c->pos)
    return smollm_fail(c->err, c->err_len,
                       "damaged file: %s of %llu bytes at offset %zu, file is %zu",
                       what, (unsigned long long)len, c->pos, c->size);
  if (take(c, (size_t)len, &p, what)) return 1;
  out->ptr = (const char *)p;
  out->len = (size_t)len;
  return 0;
}

/* Bytes of a scalar metadata type; 0 for strings, arrays and unknown types. */
static size_t scalar_size(uint32_t type) {
  switch (type) {
  case GGUF_U8: case GGUF_I8: case GGUF_BOOL: return 1;
  case GGUF_U16: case GGUF_I16: return 2;
  case GGUF_U32: case GGUF_I32: case GGUF_F32: return 4;
  case GGUF_U64: case GGUF_I64: case GGUF_F64: return 8;
  default: return 0;
  }
}

static int read_kv(cursor *c, gguf_kv *kv) {
  if (read_str(c, &kv->key, "metadata key") || read_u32(c, &kv->type, "metadata type")) return 1;
  kv->elem_type = 0;
  kv->count = 1;
  kv->value = c->base + c->pos;
  if (kv->type == GGUF_STRING) {
    gguf_str s;
    return read_str(c, &s, "metadata string");
  }
  if (kv->type == GGUF_ARRAY) {
    uint64_t i;
    if (read_u32(c, &kv->elem_type, "array type") || read_u64(c, &kv->count, "array length"))
      return 1;
    kv->value = c->base + c->pos;
    if (kv->elem_type == GGUF_STRING) {
      if (kv->count > (c->size - c->pos) / 8)
        return smollm_fail(c->err, c->err_len,
                           "damaged file: array %.*s of %llu strings past the end",
                           (int)kv->key.len, kv->key.ptr, (unsigned long long)kv->count);
      for (i = 0; i < kv->count; i++) {
        gguf_str s;
        if (read_str(c, &s, "array string")) return 1;
      }
      return 0;
    }
    if (scalar_size(kv->elem_type) == 0)
      return smollm_fail(c->err, c->err_len, "unsupported array type %u for %.*s", kv->elem_type,
                         (int)kv->key.len, kv->key.ptr);
    if (kv->count > (c->size - c->pos) / scalar_size(kv->elem_type))
      return smollm_fail(c->err, c->err_len, "damaged file: array %.*s of %llu items past the end",
                         (int)kv->key.len, kv->key.ptr, (unsigned long long)kv->count);
    c->pos += (size_t)kv->count * scalar_size(kv->elem_type);
    return 0;
  }
  if (scalar_size(kv->type) == 0)
    return smollm_fail(c->err, c->err_len, "unknown metadata type %u for %.*s", kv->type,
                       (int)kv->key.len, kv->key.ptr);
  {
    const uint8_t *p = NULL;
    return take(c, scalar_size(kv->type), &p, "metadata value");
  }
}

/* Bytes of `elements` elements of `type`; 0 for an unknown type or a partial block. */
static uint64_t tensor_bytes(uint32_t type, uint64_t elements) {
  switch (type) {
  case GGUF_T_F32: return elements <= UINT64_MAX / 4 ? elements * 4 : 0;
  case GGUF_T_F16: return elements <= UINT64_MAX / 2 ? elements * 2 : 0;
  case GGUF_T_Q4_1: return elements % 32 == 0 ? elements / 32 * 20 : 0;
  case GGUF_T_Q8_0: return elements % 32 == 0 ? elements / 32 * 34 : 0;
  default: return 0;
  }
}

static int read_tensor_info(cursor *c, gguf_tensor *t, uint64_t *offset) {
  uint32_t d;
  if (read_str(c, &t->name, "tensor name") || read_u32(c, &t->n_dims, "tensor dims")) return 1;
  if (t->n_dims == 0 || t->n_dims > 4)
    return smollm_fail(c->err, c->err_len, "tensor %.*s has %u dimensions (1 to 4 supported)",
                       (int)t->name.len, t->name.ptr, t->n_dims);
  t->elements = 1;
  for (d = 0; d < 4; d++) t->dims[d] = 1;
  for (d = 0; d < t->n_dims; d++) {
    if (read_u64(c, &t->dims[d], "tensor dimension")) return 1;
    if (t->dims[d] == 0 || t->dims[d] > UINT64_MAX / t->elements)
      return smollm_fail(c->err, c->err_len, "tensor %.*s: bad dimension %llu", (int)t->name.len,
                         t->name.ptr, (unsigned long long)t->dims[d]);
    t->elements *= t->dims[d];
  }
  if (read_u32(c, &t->type, "tensor type") || read_u64(c, offset, "tensor offset")) return 1;
  t->bytes = tensor_bytes(t->type, t->elements);
  if (t->bytes == 0)
    return smollm_fail(c->err, c->err_len, "tensor %.*s: unsupported type %u for %llu elements",
                       (int)t->name.len, t->name.ptr, t->type, (unsigned long long)t->elements);
  return 0;
}

static int parse(gguf_file *f, char *err, size_t err_len) {
  cursor c = {f->bytes, f->size, 0, err, err_len};
  const uint8_t *magic = NULL;
  uint64_t i, alignment = 32, data_start;
  uint64_t *offsets;
  const gguf_kv *align_kv;
  if (take(&c, 4, &magic, "magic")) return 1;
  if (memcmp(magic, "GGUF", 4) != 0)
    return smollm_fail(err, err_len, "not a GGUF file (bad magic)");
  if (read_u32(&c, &f->version, "version")) return 1;
  if (f->version != 2 && f->version != 3)
    return smollm_fail(err, err_len, "GGUF version %u not supported (2 or 3)", f->version);
  if (read_u64(&c, &f->n_tensors, "tensor count") || read_u64(&c, &f->n_kv, "metadata count"))
    return 1;
  /* Each entry takes at least 12 bytes: counts beyond that are damage, not allocations. */
  if (f->n_kv > f->size / 12 || f->n_tensors > f->size / 12)
    return smollm_fail(err, err_len,
                       "damaged file: %llu metadata entries and %llu tensors in %zu bytes",
                       (unsigned long long)f->n_kv, (unsigned long long)f->n_tensors, f->size);
  f->kv = calloc((size_t)f->n_kv + 1, sizeof *f->kv);
  f->tensors = calloc((size_t)f->n_tensors + 1, sizeof *f->tensors);
  offsets = calloc((size_t)f->n_tensors + 1, sizeof *offsets);
  if (!f->kv || !f->tensors || !offsets) {
    free(offsets);
    return smollm_fail(err, err_len, "out of memory for the GGUF tables");
  }
  for (i = 0; i < f->n_kv; i++)
    if (read_kv(&c, &f->kv[i])) goto fail_offsets;
  for (i = 0; i < f->n_tensors; i++)
    if (read_tensor_info(&c, &f->tensors[i], &offsets[i])) goto fail_offsets;
  align_kv = gguf_find(f, "general.alignment");
  if (align_kv) {
    if (align_kv->type != GGUF_U32) {
      smollm_fail(err, err_len, "general.alignment is not a u32");
      goto fail_offsets;
    }
    alignment = le32(align_kv->value);
    if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
      smollm_fail(err, err_len, "general.alignment %llu is not a power of two",
                  (unsigned long long)alignment);
      goto fail_offsets;
    }
  }
  data_start = (c.pos + alignment - 1) / alignment * alignment;
  for (i = 0; i < f->n_tensors; i++) {
    gguf_tensor *t = &f->tensors[i];
    if (offsets[i] % alignment != 0 || data_start > f->size || offsets[i] > f->size - data_start ||
        t->bytes > f->size - data_start - offsets[i]) {
      smollm_fail(err, err_len, "damaged file: tensor %.*s (%llu bytes at data offset %llu) is not "
                  "inside the %zu-byte file or not aligned to %llu", (int)t->name.len, t->name.ptr,
                  (unsigned long long)t->bytes, (unsigned long long)offsets[i], f->size,
                  (unsigned long long)alignment);
      goto fail_offsets;
    }
    t->data = f->bytes + data_start + offsets[i];
  }
  free(offsets);
  return 0;
fail_offsets:
  free(offsets);
  return 1;
}

int gguf_open(gguf_file *f, const char *path, char *err, size_t err_len) {
  FILE *fp;
  long size;
  memset(f, 0, sizeof *f);
  fp = fopen(path, "rb");
  if (!fp) return smollm_fail(err, err_len, "cannot open %s", path);
  if (fseek(fp, 0, SEEK_END) != 0 || (size = ftell(fp)) < 0 || fseek(fp, 0, SEEK_SET) != 0) {
    fclose(fp);
    return smollm_fail(err, err_len, "cannot read the size of %s", path);
  }
  f->size = (size_t)size;
  f->bytes = malloc(f->size ? f->size : 1);
  if (!f->bytes) {
    fclose(fp);
    return smollm_fail(err, err_len, "out of memory reading %s (%zu bytes)", path, f->size);
  }
  if (fread(f->bytes, 1, f->size, fp) != f->size) {
    fclose(fp);
    gguf_close(f);
    return smollm_fail(err, err_len, "cannot read %s", path);
  }
  fclose(fp);
  if (parse(f, err, err_len)) {
    gguf_close(f);
    return 1;
  }
  return 0;
}

void gguf_close(gguf_file *f) {
  free(f->bytes);
  free(f->kv);
  free(f->tensors);
  memset(f, 0, sizeof *f);
}

int gguf_str_eq(gguf_str s, const char *c) {
  size_t n = strlen(c);
  return s.len == n && memcmp(s.ptr, c, n) == 0;
}

const gguf_kv *gguf_find(const gguf_file *f, const char *key) {
  uint64_t i;
  for (i = 0; i < f->n_kv; i++)
    if (gguf_str_eq(f->kv[i].key, key)) return &f->kv[i];
  return NULL;
}

const gguf_tensor *gguf_tensor_find(const gguf_file *f, const char *name) {
  uint64_t i;
  for (i = 0; i < f->n_tensors; i++)
    if (gguf_str_eq(f->tensors[i].name, name)) return &f->tensors[i];
  return NULL;
}

static int find_typed(const gguf_file *f, const char *key, const gguf_kv **out, char *err,
                      size_t err_len) {
  *out = gguf_find(f, key);
  if (!*out) return smollm_fail(err, err_len, "metadata %s missing", key);
  return 0;
}

int gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out, char *err, size_t err_len) {
  const gguf_kv *kv;
  uint64_t v;
  if (find_typed(f, key, &kv, err, err_len)) return 1;
  switch (kv->type) {
  case GGUF_U8: v = kv->value[0]; break;
  case GGUF_U16: v = (uint64_t)kv->value[0] | (uint64_t)kv->value[1] << 8; break;
  case GGUF_U32: v = le32(kv->value); break;
  case GGUF_I32:
    if (le32(kv->value) >> 31) return smollm_fail(err, err_len, "metadata %s is negative", key);
    v = le32(kv->value);
    break;
  case GGUF_U64: case GGUF_I64: v = le64(kv->value); break;
  default:
    return smollm_fail(err, err_len, "metadata %s is not an integer (type %u)", key, kv->type);
  }
  if (v > UINT32_MAX) return smollm_fail(err, err_len, "metadata %s = %llu is too large", key,
                                         (unsigned long long)v);
  *out = (uint32_t)v;
  return 0;
}

int gguf_get_f32(const gguf_file *f, const char *key, float *out, char *err, size_t err_len) {
  const gguf_kv *kv;
  uint32_t bits;
  if (find_typed(f, key, &kv, err, err_len)) return 1;
  if (kv->type != GGUF_F32) return smollm_fail(err, err_len, "metadata %s is not an f32", key);
  bits = le32(kv->value);
  memcpy(out, &bits, 4);
  return 0;
}

int gguf_get_str(const gguf_file *f, const char *key, gguf_str *out, char *err, size_t err_len) {
  const gguf_kv *kv;
  const uint8_t *p = NULL;
  if (find_typed(f, key, &kv, err, err_len)) return 1;
  if (kv->type != GGUF_STRING) return smollm_fail(err, err_len, "metadata %s is not a string", key);
  p = kv->value;
  *out = gguf_next_string(&p);
  return 0;
}

int gguf_get_array(const gguf_file *f, const char *key, uint32_t elem_type, const gguf_kv **out,
                   char *err, size_t err_len) {
  if (find_typed(f, key, out, err, err_len)) return 1;
  if ((*out)->type != GGUF_ARRAY || (*out)->elem_type != elem_type)
    return smollm_fail(err, err_len, "metadata %s is not an array of type %u", key, elem_type);
  return 0;
}

gguf_str gguf_next_string(const uint8_t **pos) {
  gguf_str s;
  s.len = (size_t)le64(*pos);
  s.ptr = (const char *)*pos + 8;
  *pos += 8 + s.len;
  return s;
}
