/* fuzz.h: what the fuzz targets share: the libFuzzer entry point, a failure
 * that stops the run with a message (libFuzzer then saves the input), and a
 * reader that turns the input's bytes into choices.
 *
 * Each fuzz/fuzz_<target>.c is built two ways: with -fsanitize=fuzzer into a
 * libFuzzer program (`make fuzz`, build-fuzz/), and with fuzz/replay.c into a
 * program that runs every input of fuzz/corpus/<target>/ once, a test of
 * every build (ctest fuzz_<target>_replay). */
#ifndef TIDE_FUZZ_H
#define TIDE_FUZZ_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* A function of a target that only checks what happened (data patterns,
 * figures, the model's sums): left out of coverage feedback, whose counters
 * and comparisons there guide nothing and cost time at every step. */
#if defined(__clang__) && __clang_major__ >= 13
#define FZ_CHECK_ONLY __attribute__((no_sanitize("coverage")))
#else
#define FZ_CHECK_ONLY
#endif

/* Print what went wrong and abort: libFuzzer keeps the input as a crash. */
__attribute__((noreturn, format(printf, 1, 2))) static inline void fz_die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "fuzz check failed: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  abort();
}

#define FZ_CHECK(cond, ...)                                                                        \
  do {                                                                                             \
    if (!(cond)) fz_die(__VA_ARGS__);                                                              \
  } while (0)

/* The input as a stream of choices; past its end every choice is 0. */
typedef struct fz_reader {
  const uint8_t *data;
  size_t size, pos;
} fz_reader;

static inline int fz_more(const fz_reader *r) { return r->pos < r->size; }

static inline uint8_t fz_byte(fz_reader *r) { return r->pos < r->size ? r->data[r->pos++] : 0; }

static inline uint32_t fz_u16(fz_reader *r) {
  uint32_t lo = fz_byte(r);
  return lo | (uint32_t)fz_byte(r) << 8;
}

static inline uint64_t fz_u32(fz_reader *r) {
  uint64_t lo = fz_u16(r);
  return lo | (uint64_t)fz_u16(r) << 16;
}

/* One of n choices (n > 0) from one byte. */
static inline unsigned fz_pick(fz_reader *r, unsigned n) { return fz_byte(r) % n; }

#endif /* TIDE_FUZZ_H */
