/* test_capture_threads.c: capture pools used from several threads at once
 * (run under ThreadSanitizer by `make test`, as its name says).
 *
 * Two threads capture (emulated) into capture pools over and over, one of
 * them into a pool it shares with a third thread that grows that pool
 * outside captures; each capture allocates, frees and takes memory again,
 * and frees a block of the usual memory (deferred until the capture ends).
 * Two more threads allocate and free the usual memory on their streams
 * (their allocations and frees take the watched path while captures run),
 * and one reads statistics and snapshots and empties the cache. Every block
 * holds a pattern checked before it is freed; at the end everything is
 * freed, every pool released, and all memory must be back. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "testutil.h"

#define ROUNDS 300
#define SHAPE ((tu_pattern_shape){.full = 4096, .edge = 1024, .samples = 4})

typedef struct worker {
  tide_allocator *a;
  tide_pool *pool;
  tide_stream stream;
  uint64_t seed;
  _Atomic bool *stop;
  char failure[256];
} worker;

#define WORKER_CHECK(w, cond, ...)                                                                 \
  do {                                                                                             \
    if (!(cond) && !(w)->failure[0]) {                                                             \
      snprintf((w)->failure, sizeof(w)->failure, __VA_ARGS__);                                     \
      return NULL;                                                                                 \
    }                                                                                              \
  } while (0)

static void *capturer(void *arg) {
  worker *w = arg;
  tu_rng rng;
  tu_rng_seed(&rng, w->seed);
  for (int r = 0; r < ROUNDS && !w->failure[0]; r++) {
    void *usual = tide_malloc(w->a, tu_log_uniform(&rng, 512, 4 << 20), w->stream);
    WORKER_CHECK(w, usual, "round %d: usual memory: %s", r, tide_last_error());
    WORKER_CHECK(w, tide_host_capture_begin(w->a, w->stream) == TIDE_OK, "begin: %s",
                 tide_last_error());
    WORKER_CHECK(w, tide_capture_begin(w->a, w->stream, w->pool) == TIDE_OK,
                 "tide_capture_begin: %s", tide_last_error());
    WORKER_CHECK(w, tide_free(w->a, usual, w->stream) == TIDE_OK, "deferred free: %s",
                 tide_last_error());
    void *live[6];
    size_t sizes[6];
    for (int i = 0; i < 6; i++) {
      sizes[i] = tu_log_uniform(&rng, 512, 6 << 20);
      live[i] = tide_malloc(w->a, sizes[i], w->stream);
      WORKER_CHECK(w, live[i], "round %d: pool allocation: %s", r, tide_last_error());
      tu_fill(live[i], sizes[i], w->seed + (uint64_t)i, SHAPE);
      if (i % 2) { /* freed inside the capture, taken again by the next */
        WORKER_CHECK(
            w, tu_check(live[i - 1], sizes[i - 1], w->seed + (uint64_t)i - 1, SHAPE) == SIZE_MAX,
            "round %d: a pool block lost its data", r);
        WORKER_CHECK(w, tide_free(w->a, live[i - 1], w->stream) == TIDE_OK, "free: %s",
                     tide_last_error());
        live[i - 1] = NULL;
      }
    }
    WORKER_CHECK(w, tide_host_capture_end(w->a, w->stream) == TIDE_OK, "end");
    WORKER_CHECK(w, tide_capture_end(w->a, w->stream) == TIDE_OK, "tide_capture_end: %s",
                 tide_last_error());
    for (int i = 0; i < 6; i++) {
      if (!live[i]) continue;
      WORKER_CHECK(w, tu_check(live[i], sizes[i], w->seed + (uint64_t)i, SHAPE) == SIZE_MAX,
                   "round %d: a pool block lost its data", r);
      WORKER_CHECK(w, tide_free(w->a, live[i], w->stream) == TIDE_OK, "free: %s",
                   tide_last_error());
    }
    WORKER_CHECK(w, tide_pool_release(w->pool) == TIDE_OK, "release: %s", tide_last_error());
  }
  return NULL;
}

/* Grows the shared pool outside captures, on its own stream. */
static void *grower(void *arg) {
  worker *w = arg;
  tu_rng rng;
  tu_rng_seed(&rng, w->seed);
  for (int r = 0; r < ROUNDS && !w->failure[0]; r++) {
    WORKER_CHECK(w, tide_capture_begin(w->a, w->stream, w->pool) == TIDE_OK, "begin: %s",
                 tide_last_error());
    size_t size = tu_log_uniform(&rng, 1 << 20, 8 << 20);
    void *p = tide_malloc(w->a, size, w->stream);
    WORKER_CHECK(w, tide_capture_end(w->a, w->stream) == TIDE_OK, "end: %s", tide_last_error());
    WORKER_CHECK(w, tide_pool_release(w->pool) == TIDE_OK, "release: %s", tide_last_error());
    WORKER_CHECK(w, p, "growth: %s", tide_last_error());
    tu_fill(p, size, (uint64_t)r, SHAPE);
    WORKER_CHECK(w, tu_check(p, size, (uint64_t)r, SHAPE) == SIZE_MAX, "grown block lost data");
    WORKER_CHECK(w, tide_free(w->a, p, w->stream) == TIDE_OK, "free: %s", tide_last_error());
  }
  return NULL;
}

/* The usual memory, while captures come and go. */
static void *plain(void *arg) {
  worker *w = arg;
  tu_rng rng;
  tu_rng_seed(&rng, w->seed);
  void *slots[16] = {0};
  size_t sizes[16] = {0};
  for (int r = 0; r < ROUNDS * 20 && !w->failure[0]; r++) {
    unsigned i = (unsigned)tu_below(&rng, 16);
    if (slots[i]) {
      WORKER_CHECK(w, tu_check(slots[i], sizes[i], i, SHAPE) == SIZE_MAX, "usual block lost data");
      WORKER_CHECK(w, tide_free(w->a, slots[i], w->stream) == TIDE_OK, "free: %s",
                   tide_last_error());
    }
    sizes[i] = tu_log_uniform(&rng, 512, 2 << 20);
    slots[i] = tide_malloc(w->a, sizes[i], w->stream);
    WORKER_CHECK(w, slots[i], "malloc: %s", tide_last_error());
    tu_fill(slots[i], sizes[i], i, SHAPE);
  }
  for (int i = 0; i < 16; i++)
    if (slots[i]) WORKER_CHECK(w, tide_free(w->a, slots[i], w->stream) == TIDE_OK, "free");
  return NULL;
}

static void *observer(void *arg) {
  worker *w = arg;
  while (!atomic_load(w->stop)) {
    tide_stats st;
    WORKER_CHECK(w, tide_get_stats(w->a, &st) == TIDE_OK, "stats");
    WORKER_CHECK(w, tide_pool_get_stats(w->pool, &st) == TIDE_OK, "pool stats");
    char *json = NULL;
    WORKER_CHECK(w, tide_snapshot_json(w->a, &json, NULL) == TIDE_OK, "snapshot");
    tide_string_free(json);
    tide_status rc = tide_empty_cache(w->a); /* may meet a stream being captured */
    WORKER_CHECK(w, rc == TIDE_OK || rc == TIDE_ERR_NOT_READY, "empty_cache: %s",
                 tide_last_error());
  }
  return NULL;
}

static void test_capture_threads(void **state) {
  (void)state;
  tide_allocator *a = tu_create("host_capacity:8GiB");
  tide_pool *shared = NULL, *own = NULL;
  tu_assert_ok(tide_pool_create(a, &shared));
  tu_assert_ok(tide_pool_create(a, &own));
  _Atomic bool stop = false;
  enum { WORKERS = 6 };
  worker w[WORKERS];
  void *(*fn[WORKERS])(void *) = {capturer, capturer, grower, plain, plain, observer};
  tide_pool *pools[WORKERS] = {shared, own, shared, NULL, NULL, shared};
  pthread_t t[WORKERS];
  for (int i = 0; i < WORKERS; i++) {
    w[i] = (worker){.a = a, .pool = pools[i], .seed = 100u + (uint64_t)i, .stop = &stop};
    tu_assert_ok(tide_stream_create(a, &w[i].stream));
  }
  for (int i = 0; i < WORKERS; i++) assert_int_equal(pthread_create(&t[i], NULL, fn[i], &w[i]), 0);
  for (int i = 0; i < WORKERS - 1; i++) pthread_join(t[i], NULL);
  atomic_store(&stop, true);
  pthread_join(t[WORKERS - 1], NULL);
  for (int i = 0; i < WORKERS; i++)
    if (w[i].failure[0]) fail_msg("worker %d: %s", i, w[i].failure);

  tu_assert_ok(tide_pool_release(shared));
  tu_assert_ok(tide_pool_release(own));
  for (int i = 0; i < WORKERS; i++) tu_assert_ok(tide_stream_destroy(a, w[i].stream));
  tu_assert_ok(tide_empty_cache(a));
  tide_stats st = tu_stats(a);
  /* Every worker did its rounds. */
  assert_true(st.num_allocs >= 2 * ROUNDS * 7 + ROUNDS + 2 * ROUNDS * 20);
  assert_int_equal(st.allocated_bytes[0].current, 0);
  assert_int_equal(st.active_bytes[0].current, 0);
  assert_int_equal(st.reserved_bytes[0].current, 0);
  assert_int_equal(tide_host_bytes_in_use(a), 0);
  tu_assert_ok(tide_destroy(a));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_capture_threads),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
