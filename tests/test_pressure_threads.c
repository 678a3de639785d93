/* test_pressure_threads.c: two allocators on one emulated device
 * (host_shared), as two processes on one GPU, each used by a thread of its
 * own. One holds a large cache and keeps allocating from it; the other's
 * allocations, which the device cannot hold while that cache is there,
 * wait for the first to give pages back instead of failing, whether they
 * come a few pages at a time or each is larger than the device's free
 * memory (the waiting allocator's claim shows the first one its need),
 * and tide_check holds while they wait. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "testutil.h"

#define SHARED "backend:host,host_capacity:256MiB,host_shared:True,load_handles:False"

/* A thread's allocator, its stop flag and the failures it met. */
typedef struct worker {
  tide_allocator *a;
  atomic_bool stop;
  atomic_int failures;
} worker;

/* Large blocks of changing sizes from the cache, until told to stop, with
 * a pause after each, as work between allocations: a's checks of the
 * device (every 256 allocations) come 5 ms or more apart, longer than b's
 * failing growth takes, so b gets its pages only by waiting. */
static void *churn(void *arg) {
  worker *w = arg;
  void *held[4] = {0};
  for (unsigned i = 0; !atomic_load(&w->stop); i++) {
    size_t size = 2 * TU_MiB * (1 + i % 7) + 4096 * (i % 5);
    void *p = tide_malloc(w->a, size, NULL);
    if (!p) {
      atomic_fetch_add(&w->failures, 1);
      continue;
    }
    if (held[i % 4] && tide_free(w->a, held[i % 4], NULL) != TIDE_OK)
      atomic_fetch_add(&w->failures, 1);
    held[i % 4] = p;
    nanosleep(&(struct timespec){.tv_nsec = 20000}, NULL);
  }
  for (int i = 0; i < 4; i++)
    if (held[i]) tide_free(w->a, held[i], NULL);
  return NULL;
}

/* tide_check in a loop: the counts agree at every moment, claims included. */
static void *check_loop(void *arg) {
  worker *c = arg;
  while (!atomic_load(&c->stop)) {
    if (tide_check(c->a) != TIDE_OK) atomic_fetch_add(&c->failures, 1);
    nanosleep(&(struct timespec){.tv_nsec = 200000}, NULL);
  }
  return NULL;
}

/* a caches 200 MiB of the 256 and keeps allocating from its cache; b takes
 * `first_mib`, then `count` allocations of `each_mib` that the device can
 * hold only once a gives pages back. Each must wait for that, not fail. */
static void b_waits_for_a(size_t first_mib, size_t each_mib, int count) {
  worker w = {.a = tu_create(SHARED)};
  tide_allocator *b = tu_create(SHARED);
  void *big = tide_malloc(w.a, 200 * TU_MiB, NULL);
  assert_non_null(big);
  tu_assert_ok(tide_free(w.a, big, NULL)); /* 200 MiB cached by a */
  pthread_t t, tc;
  worker c = {.a = b}; /* the thread that checks b */
  assert_int_equal(pthread_create(&t, NULL, churn, &w), 0);
  assert_int_equal(pthread_create(&tc, NULL, check_loop, &c), 0);
  void *first = tide_malloc(b, first_mib * TU_MiB, NULL);
  assert_non_null(first);
  void *more[32] = {0};
  assert_true(count <= 32);
  for (int i = 0; i < count; i++) {
    more[i] = tide_malloc(b, each_mib * TU_MiB, NULL);
    if (!more[i]) fail_msg("b's allocation %d failed: %s", i, tide_last_error());
  }
  atomic_store(&w.stop, true);
  atomic_store(&c.stop, true);
  assert_int_equal(pthread_join(t, NULL), 0);
  assert_int_equal(pthread_join(tc, NULL), 0);
  assert_int_equal(atomic_load(&w.failures), 0);
  assert_int_equal(atomic_load(&c.failures), 0);
  assert_true(tu_stats(b).others_wait_ns > 0);
  tu_assert_ok(tide_check(w.a));
  tu_assert_ok(tide_check(b));
  tu_assert_ok(tide_free(b, first, NULL));
  for (int i = 0; i < count; i++) tu_assert_ok(tide_free(b, more[i], NULL));
  tu_assert_ok(tide_destroy(w.a));
  tu_assert_ok(tide_destroy(b));
}

/* 52 MiB fit beside a's cache, 60 MiB more do not: b's growths take the
 * device below its low-water mark (4 MiB), a sees it and gives pages back,
 * and each of b's allocations that finds the device full waits for that. */
static void test_allocation_waits_for_another_to_give_back(void **state) {
  (void)state;
  b_waits_for_a(52, 3, 20);
}

/* Requests larger than the device's free memory and the two marks a gives
 * back at a time: a failed growth alone would show a nothing (it is rolled
 * back, the device stays at or above the mark), so b's claims do, until
 * a has given back enough for each. */
static void test_large_requests_wait_for_another_to_give_back(void **state) {
  (void)state;
  b_waits_for_a(52, 12, 2); /* the device at its mark: 12 MiB is three marks */
  b_waits_for_a(40, 20, 2); /* 16 MiB free, above the mark */
  b_waits_for_a(20, 60, 2); /* 36 MiB free, requests of 60 */
}

/* A growable buffer (a KV cache's storage) grows as tide_malloc allocates:
 * beside a's cache, b's buffer reaches 52 MiB, then grows by 12 MiB (three
 * marks, with the device at its mark), which it gets by waiting for a. */
static void test_growable_buffer_waits_for_another_to_give_back(void **state) {
  (void)state;
  worker w = {.a = tu_create(SHARED)};
  tide_allocator *b = tu_create(SHARED);
  void *big = tide_malloc(w.a, 200 * TU_MiB, NULL);
  assert_non_null(big);
  tu_assert_ok(tide_free(w.a, big, NULL)); /* 200 MiB cached by a */
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, churn, &w), 0);
  tide_buf_options o;
  tide_buf_options_init(&o);
  o.capacity = 128 * TU_MiB;
  tide_buf *buf = NULL;
  tu_assert_ok(tide_buf_create(b, &o, &buf));
  tu_assert_ok(tide_buf_resize(buf, 52 * TU_MiB, NULL));
  tide_status grown = tide_buf_resize(buf, 64 * TU_MiB, NULL);
  if (grown != TIDE_OK) fail_msg("b's buffer did not grow: %s", tide_last_error());
  atomic_store(&w.stop, true);
  assert_int_equal(pthread_join(t, NULL), 0);
  assert_int_equal(atomic_load(&w.failures), 0);
  assert_true(tu_stats(b).others_wait_ns > 0);
  tu_assert_ok(tide_check(w.a));
  tu_assert_ok(tide_check(b));
  tu_assert_ok(tide_buf_destroy(buf));
  tu_assert_ok(tide_destroy(w.a));
  tu_assert_ok(tide_destroy(b));
}

/* With nobody to give memory back, the error comes at once: no wait when
 * the allocator's own limit, not the device, stands in the way. */
static void test_own_limit_fails_without_waiting(void **state) {
  (void)state;
  tide_allocator *a = tu_create("backend:host,host_capacity:256MiB,memory_limit:64MiB");
  assert_null(tide_malloc(a, 100 * TU_MiB, NULL));
  assert_non_null(strstr(tide_last_error(), "memory limit"));
  tu_assert_ok(tide_destroy(a));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_allocation_waits_for_another_to_give_back),
      cmocka_unit_test(test_large_requests_wait_for_another_to_give_back),
      cmocka_unit_test(test_growable_buffer_waits_for_another_to_give_back),
      cmocka_unit_test(test_own_limit_fails_without_waiting),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
