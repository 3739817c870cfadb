/*
 * A reader of GGUF files (version 2 and 3): the header, the metadata, the tensor infos
 * and the data section. The whole file is read into memory; every length, count and
 * offset is checked against the file size while parsing, so a damaged or truncated file
 * is refused with a message, never read out of bounds.
 */
#ifndef SMOLLM_GGUF_H
#define SMOLLM_GGUF_H

#include <stddef.h>
#include <stdint.h>

/* Metadata value types of the GGUF specification. */
enum gguf_type {
  GGUF_U8 = 0, GGUF_I8 = 1, GGUF_U16 = 2, GGUF_I16 = 3, GGUF_U32 = 4, GGUF_I32 = 5,
  GGUF_F32 = 6, GGUF_BOOL = 7, GGUF_STRING = 8, GGUF_ARRAY = 9, GGUF_U64 = 10,
  GGUF_I64 = 11, GGUF_F64 = 12
};

/* Tensor element types this reader knows the block size of (ggml numbering). */
enum gguf_tensor_type { GGUF_T_F32 = 0, GGUF_T_F16 = 1, GGUF_T_Q4_1 = 3, GGUF_T_Q8_0 = 8 };

/* A string inside the file: not NUL-terminated. */
typedef struct gguf_str {
  const char *ptr;
  size_t len;
} gguf_str;

/* One metadata entry. Scalars and strings are at `value`; an array of `count` items of
 * `elem_type` starts at `value` (strings in an array are length-prefixed, checked). */
typedef struct gguf_kv {
  gguf_str key;
  uint32_t type;
  uint32_t elem_type;
  uint64_t count;
  const uint8_t *value;
} gguf_kv;

typedef struct gguf_tensor {
  gguf_str name;
  uint32_t n_dims;
  uint64_t dims[4]; /* dims[0] is the innermost (contiguous) dimension */
  uint32_t type;
  uint64_t elements;
  uint64_t bytes;
  const uint8_t *data; /* inside the file's data section, `bytes` long */
} gguf_tensor;

typedef struct gguf_file {
  uint8_t *bytes;
  size_t size;
  uint32_t version;
  uint64_t n_kv;
  gguf_kv *kv;
  uint64_t n_tensors;
  gguf_tensor *tensors;
} gguf_file;

/* Reads and checks `path`. On failure returns non-zero with a message in `err` and
 * leaves nothing allocated. */
int gguf_open(gguf_file *f, const char *path, char *err, size_t err_len);
void gguf_close(gguf_file *f);

/* Entries by key; NULL when missing. */
const gguf_kv *gguf_find(const gguf_file *f, const char *key);
const gguf_tensor *gguf_tensor_find(const gguf_file *f, const char *name);

/* Typed getters: 0 on success; non-zero (message in err) for a missing key or another
 * type. Integers accept any integer type whose value fits. */
int gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out, char *err, size_t err_len);
int gguf_get_f32(const gguf_file *f, const char *key, float *out, char *err, size_t err_len);
int gguf_get_str(const gguf_file *f, const char *key, gguf_str *out, char *err, size_t err_len);
/* An array of `elem_type` items. */
int gguf_get_array(const gguf_file *f, const char *key, uint32_t elem_type, const gguf_kv **out,
                   char *err, size_t err_len);

/* Walks a string array (already checked): item `*pos` into `out`, `*pos` advanced. */
gguf_str gguf_next_string(const uint8_t **pos);

int gguf_str_eq(gguf_str s, const char *c);

#endif
