/* See error.h. */
#include "error.h"

#include <stdarg.h>
#include <stdio.h>

int smollm_fail(char *err, size_t err_len, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  if (err_len > 0) vsnprintf(err, err_len, fmt, ap);
  va_end(ap);
  return 1;
}
