/* test_pressure.c: memory given back under pressure, not by a ratio. On the
 * host backend: without pressure a churning workload unmaps nothing and
 * waits for nothing; under a limit it recycles; an allocator whose device another one fills
 * (host_shared: two allocators on one emulated device, as two processes on
 * one GPU) gives its cached pages back so that the other can grow; and a
 * growth that takes the device below its low-water mark recycles its own
 * cache first. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "testutil.h"

#define SHARED "backend:host,host_capacity:256MiB,host_shared:True,load_handles:False"

/* Blocks of sizes that keep changing, allocated and freed in a loop, each
 * one past the quick blocks (no two in a row of one size): returns the
 * number of allocations made. */
static int churn(tide_allocator *a, int rounds, size_t unit) {
  void *held[4] = {0};
  for (int i = 0; i < rounds; i++) {
    size_t size = unit * (size_t)(1 + i % 7) + 4096 * (size_t)(i % 5);
    void *p = tide_malloc(a, size, NULL);
    assert_non_null(p);
    memset(p, i & 0xff, 4096);
    if (held[i % 4]) tu_assert_ok(tide_free(a, held[i % 4], NULL));
    held[i % 4] = p;
  }
  for (int i = 0; i < 4; i++)
    if (held[i]) tu_assert_ok(tide_free(a, held[i], NULL));
  return rounds;
}

/* No pressure: nothing unmapped, no stream waited for, whatever the churn. */
static void test_no_pressure_no_release(void **state) {
  (void)state;
  tide_allocator *a = tu_create("backend:host,host_capacity:4GiB");
  churn(a, 2000, 3 * TU_MiB);
  tide_stats st = tu_stats(a);
  assert_int_equal(st.unmappings, 0);
  assert_int_equal(st.stream_waits, 0);
  assert_int_equal(tide_host_call_count(a, TIDE_OP_STREAM_SYNCHRONIZE), 0);
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_destroy(a));
}

/* The same churn (75 MiB allocated at most, partial pages of five live
 * blocks on top, 104 MiB reserved uncapped) under a limit of 100 MiB
 * stays under it, recycling. */
static void test_limit_recycles(void **state) {
  (void)state;
  tide_allocator *a = tu_create("backend:host,host_capacity:4GiB,memory_limit:100MiB");
  churn(a, 2000, 3 * TU_MiB);
  tide_stats st = tu_stats(a);
  assert_true(st.reserved_bytes[TIDE_POOL_ALL].peak <= 100 * (int64_t)TU_MiB);
  assert_true(st.unmappings > 0);
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_destroy(a));
}

static size_t device_free(tide_allocator *a) {
  tide_info info;
  tu_assert_ok(tide_get_info(a, &info));
  return (size_t)info.free_memory;
}

/* Two allocators on one emulated device: what one holds, the other sees
 * gone from the device's free memory. */
static void test_shared_device_counts_both(void **state) {
  (void)state;
  tide_allocator *a = tu_create(SHARED), *b = tu_create(SHARED);
  assert_int_equal(device_free(b), 256 * TU_MiB);
  void *p = tide_malloc(a, 100 * TU_MiB, NULL);
  assert_non_null(p);
  assert_int_equal(device_free(b), 156 * TU_MiB);
  assert_null(tide_malloc(b, 200 * TU_MiB, NULL)); /* the device's, not b's limit */
  tu_assert_ok(tide_free(a, p, NULL));
  tu_assert_ok(tide_empty_cache(a));
  assert_int_equal(device_free(b), 256 * TU_MiB);
  tu_assert_ok(tide_destroy(a));
  tu_assert_ok(tide_destroy(b));
}

/* a caches 200 MiB; b then takes the device below its low-water mark (a
 * 64th: 4 MiB). a's next allocations notice that another took memory and
 * give cached pages back, so that b's next growth finds room. */
static void test_cache_given_back_to_another(void **state) {
  (void)state;
  tide_allocator *a = tu_create(SHARED), *b = tu_create(SHARED);
  void *big = tide_malloc(a, 200 * TU_MiB, NULL);
  assert_non_null(big);
  tu_assert_ok(tide_free(a, big, NULL));
  void *mine = tide_malloc(b, 54 * TU_MiB, NULL);
  assert_non_null(mine);
  assert_int_equal(device_free(b), 2 * TU_MiB);
  assert_null(tide_malloc(b, 6 * TU_MiB, NULL)); /* a holds the rest, cached */
  /* b waited for a to give memory back before it failed (half a second of
   * 5 ms naps, a not allocating meanwhile), and its stats say how long. */
  assert_true(tu_stats(b).others_wait_ns >= 250 * 1000 * 1000ull);
  assert_int_equal(tu_stats(a).others_wait_ns, 0);
  int64_t cached = tu_stats(a).reserved_bytes[TIDE_POOL_ALL].current;
  churn(a, 600, 2 * TU_MiB); /* large blocks from a's cache: no growth of its own */
  int64_t after = tu_stats(a).reserved_bytes[TIDE_POOL_ALL].current;
  assert_true(after < cached);
  assert_true(device_free(b) >= 8 * TU_MiB); /* the mark and the shortfall, given back */
  void *more = tide_malloc(b, 6 * TU_MiB, NULL);
  assert_non_null(more);
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_check(b));
  tu_assert_ok(tide_free(b, more, NULL));
  tu_assert_ok(tide_free(b, mine, NULL));
  tu_assert_ok(tide_destroy(a));
  tu_assert_ok(tide_destroy(b));
}

/* An allocator alone on the device, near full: its growth recycles its own
 * cache rather than take the device's last free memory, and its routine
 * allocations do not give its cache back (nobody else took any). */
static void test_own_growth_recycles_near_the_mark(void **state) {
  (void)state;
  tide_allocator *a = tu_create(SHARED);
  void *x = tide_malloc(a, 120 * TU_MiB, NULL), *y = tide_malloc(a, 120 * TU_MiB, NULL);
  assert_non_null(x);
  assert_non_null(y);
  tu_assert_ok(tide_free(a, x, NULL));          /* 120 MiB cached, 16 MiB free */
  void *z = tide_malloc(a, 130 * TU_MiB, NULL); /* does not fit x's place */
  assert_non_null(z);
  tide_stats st = tu_stats(a);
  assert_true(st.unmappings > 0);
  assert_int_equal(st.others_wait_ns, 0);       /* nobody else to wait for */
  assert_int_equal(device_free(a), 4 * TU_MiB); /* x's pages recycled down to the mark */
  tu_assert_ok(tide_free(a, z, NULL));
  uint64_t unmapped = tu_stats(a).unmappings;
  churn(a, 600, 2 * TU_MiB);
  assert_int_equal(tu_stats(a).unmappings, unmapped);
  tu_assert_ok(tide_free(a, y, NULL));
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_destroy(a));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_no_pressure_no_release),
      cmocka_unit_test(test_limit_recycles),
      cmocka_unit_test(test_shared_device_counts_both),
      cmocka_unit_test(test_cache_given_back_to_another),
      cmocka_unit_test(test_own_growth_recycles_near_the_mark),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
