/* error.c: the thread-local error of the last failed call, and the names of
 * status codes. The library reports every failure here and returns a code; it
 * never prints. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "base/internal.h"

#define TIDE_ERROR_LEN 1024

static _Thread_local char error_text[TIDE_ERROR_LEN];
static _Thread_local tide_status error_status;

/* Copy text into a buffer of `len` bytes, cutting it short if needed. */
static void copy_text(char *dst, size_t len, const char *src) {
  if (len == 0) return;
  size_t n = strlen(src);
  if (n >= len) n = len - 1;
  memmove(dst, src, n);
  dst[n] = '\0';
}

int _tide_error_set(tide_status status, const char *fmt, ...) {
  /* Format aside first: the arguments may include the current message. */
  char text[TIDE_ERROR_LEN];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(text, sizeof text, fmt, ap);
  va_end(ap);
  memcpy(error_text, text, sizeof error_text);
  error_status = status;
  return (int)status;
}

void _tide_error_prefix(const char *fmt, ...) {
  char prefix[256];
  char old[TIDE_ERROR_LEN];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(prefix, sizeof prefix, fmt, ap);
  va_end(ap);
  memcpy(old, error_text, sizeof old);
  copy_text(error_text, sizeof error_text, prefix);
  size_t used = strlen(error_text);
  copy_text(error_text + used, sizeof error_text - used, ": ");
  used = strlen(error_text);
  copy_text(error_text + used, sizeof error_text - used, old);
}

void _tide_error_save(_tide_saved_error *saved) {
  saved->status = error_status;
  copy_text(saved->text, sizeof saved->text, error_text);
}

int _tide_error_restore(const _tide_saved_error *saved) {
  copy_text(error_text, sizeof error_text, saved->text);
  error_status = saved->status;
  return (int)saved->status;
}

const char *_tide_format_bytes(uint64_t bytes, char *buf, size_t len) {
  static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = (double)bytes;
  size_t unit = 0;
  while (value >= 1024.0 && unit + 1 < sizeof units / sizeof units[0]) {
    value /= 1024.0;
    unit++;
  }
  if (unit == 0)
    snprintf(buf, len, "%llu B", (unsigned long long)bytes);
  else
    snprintf(buf, len, "%.2f %s", value, units[unit]);
  return buf;
}

const char *tide_last_error(void) { return error_text; }

tide_status tide_last_status(void) { return error_status; }

void tide_clear_error(void) {
  error_text[0] = '\0';
  error_status = TIDE_OK;
}

const char *tide_status_name(tide_status status) {
  switch (status) {
  case TIDE_OK: return "TIDE_OK";
  case TIDE_ERR_OOM: return "TIDE_ERR_OOM";
  case TIDE_ERR_INVALID: return "TIDE_ERR_INVALID";
  case TIDE_ERR_BAD_POINTER: return "TIDE_ERR_BAD_POINTER";
  case TIDE_ERR_DOUBLE_FREE: return "TIDE_ERR_DOUBLE_FREE";
  case TIDE_ERR_CONFIG: return "TIDE_ERR_CONFIG";
  case TIDE_ERR_STATE: return "TIDE_ERR_STATE";
  case TIDE_ERR_BACKEND: return "TIDE_ERR_BACKEND";
  case TIDE_ERR_UNAVAILABLE: return "TIDE_ERR_UNAVAILABLE";
  case TIDE_ERR_NOT_READY: return "TIDE_ERR_NOT_READY";
  }
  return "TIDE_ERR_UNKNOWN";
}

const char *tide_version(void) { return TIDE_VERSION_STRING; }
