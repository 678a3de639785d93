/* testutil.h: what the stress, fault and bad-input tests share — an
 * allocator on the host backend made from a config string, a deterministic
 * PRNG, a data pattern written into blocks and checked before they are freed,
 * and assertions that print status names and the library's message.
 *
 * Include after <cmocka.h>. Everything is static inline so that a test that
 * uses only part of it still compiles without warnings. */
#ifndef TIDE_TESTUTIL_H
#define TIDE_TESTUTIL_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tidalloc_testing.h"

#define TU_KiB ((size_t)1 << 10)
#define TU_MiB ((size_t)1 << 20)
#define TU_GiB ((size_t)1 << 30)

/* ------------------------------------------------------------------------ */
/* Assertions with readable failures                                         */
/* ------------------------------------------------------------------------ */

/* `expr` (a tide_status) must be `want`; a failure names both statuses and
 * quotes the library's message. */
#define tu_assert_status(expr, want)                                                               \
  do {                                                                                             \
    tide_status tu_got_ = (expr);                                                                  \
    tide_status tu_want_ = (want);                                                                 \
    if (tu_got_ != tu_want_)                                                                       \
      fail_msg("%s:%d: %s returned %s, expected %s; last error: \"%s\"", __FILE__, __LINE__,       \
               #expr, tide_status_name(tu_got_), tide_status_name(tu_want_), tide_last_error());   \
  } while (0)

#define tu_assert_ok(expr) tu_assert_status((expr), TIDE_OK)

/* The calling thread's last error has status `want` and a message that
 * contains `needle` (NULL: any non-empty message). */
#define tu_assert_last_error(want, needle)                                                         \
  do {                                                                                             \
    tide_status tu_st_ = tide_last_status();                                                       \
    const char *tu_msg_ = tide_last_error();                                                       \
    const char *tu_needle_ = (needle);                                                             \
    if (tu_st_ != (want))                                                                          \
      fail_msg("%s:%d: last status %s, expected %s; message: \"%s\"", __FILE__, __LINE__,          \
               tide_status_name(tu_st_), tide_status_name(want), tu_msg_);                         \
    if (tu_msg_ == NULL || tu_msg_[0] == '\0')                                                     \
      fail_msg("%s:%d: %s came with an empty message", __FILE__, __LINE__,                         \
               tide_status_name(tu_st_));                                                          \
    if (tu_needle_ && !strstr(tu_msg_, tu_needle_))                                                \
      fail_msg("%s:%d: message of %s lacks \"%s\": \"%s\"", __FILE__, __LINE__,                    \
               tide_status_name(tu_st_), tu_needle_, tu_msg_);                                     \
  } while (0)

/* ------------------------------------------------------------------------ */
/* Allocators on the host backend                                            */
/* ------------------------------------------------------------------------ */

/* A config of the host backend with `text` ("key:value,...") applied. */
static inline tide_config *tu_config(const char *text) {
  tide_config *config = NULL;
  tu_assert_ok(tide_config_new(&config));
  tu_assert_ok(tide_config_parse(config, "backend:host"));
  if (text && *text) {
    tide_status rc = tide_config_parse(config, text);
    if (rc != TIDE_OK)
      fail_msg("config \"%s\" was refused: %s: %s", text, tide_status_name(rc), tide_last_error());
  }
  return config;
}

/* An allocator of device 0 on the host backend, configured by `text`. */
static inline tide_allocator *tu_create(const char *text) {
  tide_config *config = tu_config(text);
  tide_allocator *a = NULL;
  tide_status rc = tide_create(0, config, &a);
  tide_config_free(config);
  if (rc != TIDE_OK)
    fail_msg("tide_create(\"%s\") failed: %s: %s", text ? text : "", tide_status_name(rc),
             tide_last_error());
  assert_non_null(a);
  return a;
}

static inline tide_stats tu_stats(tide_allocator *a) {
  tide_stats st;
  memset(&st, 0, sizeof st);
  tu_assert_ok(tide_get_stats(a, &st));
  return st;
}

/* ------------------------------------------------------------------------ */
/* A deterministic PRNG (xoshiro256**, seeded by splitmix64)                 */
/* ------------------------------------------------------------------------ */

typedef struct tu_rng {
  uint64_t s[4];
} tu_rng;

static inline uint64_t tu_splitmix(uint64_t *x) {
  uint64_t z = (*x += UINT64_C(0x9E3779B97F4A7C15));
  z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
  z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
  return z ^ (z >> 31);
}

static inline void tu_rng_seed(tu_rng *r, uint64_t seed) {
  for (int i = 0; i < 4; i++) r->s[i] = tu_splitmix(&seed);
}

static inline uint64_t tu_rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static inline uint64_t tu_next(tu_rng *r) {
  uint64_t *s = r->s;
  uint64_t result = tu_rotl(s[1] * 5, 7) * 9;
  uint64_t t = s[1] << 17;
  s[2] ^= s[0];
  s[3] ^= s[1];
  s[1] ^= s[2];
  s[0] ^= s[3];
  s[2] ^= t;
  s[3] = tu_rotl(s[3], 45);
  return result;
}

/* Uniform in [0, n), n > 0. */
static inline uint64_t tu_below(tu_rng *r, uint64_t n) { return tu_next(r) % n; }

/* Uniform in [0, 1). */
static inline double tu_unit(tu_rng *r) { return (double)(tu_next(r) >> 11) * 0x1.0p-53; }

/* Log-uniform in [lo, hi]: every power of two in the range is equally likely. */
static inline size_t tu_log_uniform(tu_rng *r, size_t lo, size_t hi) {
  double l = log((double)lo), h = log((double)hi);
  size_t v = (size_t)exp(l + (h - l) * tu_unit(r));
  return v < lo ? lo : v > hi ? hi : v;
}

/* A number from an environment variable, or `fallback` if unset or bad. */
static inline uint64_t tu_env_u64(const char *name, uint64_t fallback) {
  const char *text = getenv(name);
  if (!text || !*text) return fallback;
  char *end = NULL;
  unsigned long long v = strtoull(text, &end, 0);
  return (end && *end == '\0') ? (uint64_t)v : fallback;
}

/* ------------------------------------------------------------------------ */
/* Data patterns                                                             */
/* ------------------------------------------------------------------------ */

/* The word a pattern keeps at byte offset `off` of the block at `base`,
 * allocated with sequence number `seq`: another block, another allocation
 * of the same address, or a shifted copy all read differently. */
static inline uint64_t tu_pattern_word(uintptr_t base, uint64_t seq, size_t off) {
  uint64_t x = (uint64_t)base ^ (seq * UINT64_C(0xD1B54A32D192ED03)) ^ ((uint64_t)off << 17);
  return tu_splitmix(&x);
}

/* How much of a block a pattern covers: the whole block up to `full` bytes;
 * beyond, the first and last `edge` bytes and `samples` words in between. */
typedef struct tu_pattern_shape {
  size_t full;
  size_t edge;
  unsigned samples;
} tu_pattern_shape;

#define TU_PATTERN_DEFAULT                                                                         \
  ((tu_pattern_shape){.full = 16 * TU_KiB, .edge = 4 * TU_KiB, .samples = 8})

/* Offset of the i-th sampled word of a pattern (inside the middle part). */
static inline size_t tu_sample_offset(uintptr_t base, uint64_t seq, size_t size, size_t edge,
                                      unsigned i) {
  size_t words = (size - 2 * edge) / 8;
  uint64_t x = (uint64_t)base + seq * 31u + i;
  return edge + (size_t)(tu_splitmix(&x) % words) * 8;
}

/* Visit every word of the pattern of `size` bytes at `base`: fn(p, expected)
 * returns false to stop; the offset of the word that stopped it is returned,
 * or SIZE_MAX after visiting all. */
typedef int (*tu_word_fn)(uint64_t *p, uint64_t expected);

static inline size_t tu_pattern_walk(void *ptr, size_t size, uint64_t seq, tu_pattern_shape shape,
                                     tu_word_fn fn) {
  uintptr_t base = (uintptr_t)ptr;
  size_t words = size / 8;
  if (size <= shape.full || size < 2 * shape.edge + 64) {
    for (size_t i = 0; i < words; i++)
      if (!fn((uint64_t *)(base + i * 8), tu_pattern_word(base, seq, i * 8))) return i * 8;
    return SIZE_MAX;
  }
  size_t edge_words = shape.edge / 8;
  for (size_t i = 0; i < edge_words; i++) {
    size_t head = i * 8, tail = (words - edge_words + i) * 8;
    if (!fn((uint64_t *)(base + head), tu_pattern_word(base, seq, head))) return head;
    if (!fn((uint64_t *)(base + tail), tu_pattern_word(base, seq, tail))) return tail;
  }
  for (unsigned i = 0; i < shape.samples; i++) {
    size_t off = tu_sample_offset(base, seq, size, shape.edge, i);
    if (!fn((uint64_t *)(base + off), tu_pattern_word(base, seq, off))) return off;
  }
  return SIZE_MAX;
}

static inline int tu_word_write(uint64_t *p, uint64_t expected) {
  *p = expected;
  return 1;
}

static inline int tu_word_check(uint64_t *p, uint64_t expected) { return *p == expected; }

/* Write the pattern of (ptr, seq) over `size` bytes. */
static inline void tu_fill(void *ptr, size_t size, uint64_t seq, tu_pattern_shape shape) {
  tu_pattern_walk(ptr, size, seq, shape, tu_word_write);
}

/* The offset of the first word that lost its pattern, or SIZE_MAX. */
static inline size_t tu_check(void *ptr, size_t size, uint64_t seq, tu_pattern_shape shape) {
  return tu_pattern_walk(ptr, size, seq, shape, tu_word_check);
}

#define tu_assert_pattern(ptr, size, seq, shape)                                                   \
  do {                                                                                             \
    size_t tu_bad_ = tu_check((ptr), (size), (seq), (shape));                                      \
    if (tu_bad_ != SIZE_MAX)                                                                       \
      fail_msg("%s:%d: block %p (%zu bytes, seq %llu) lost its data at offset %zu: read "          \
               "0x%016llx, wrote 0x%016llx",                                                       \
               __FILE__, __LINE__, (void *)(ptr), (size_t)(size), (unsigned long long)(seq),       \
               tu_bad_, (unsigned long long)*(uint64_t *)((uintptr_t)(ptr) + tu_bad_),             \
               (unsigned long long)tu_pattern_word((uintptr_t)(ptr), (seq), tu_bad_));             \
  } while (0)

#endif /* TIDE_TESTUTIL_H */
