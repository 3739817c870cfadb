/* Error messages of the smollm modules: a failing function formats its message into the
 * caller's `err` buffer (of `err_len` bytes) and returns 1. */
#ifndef SMOLLM_ERROR_H
#define SMOLLM_ERROR_H

#include <stddef.h>

#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
int smollm_fail(char *err, size_t err_len, const char *fmt, ...);

#endif
