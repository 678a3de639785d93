/* test_load_handles.c: load handles (load_handles) on the host backend. Until
 * a stream first frees a block, each growth of a segment for large requests
 * maps its pages as one physical handle; after that, handles of the usual
 * size. A load handle is unmapped only whole: a block left in part of it
 * keeps all of it; failures while mapping one leave nothing behind; sharing
 * exports it as one piece. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "testutil.h"

#define CONF "backend:host,host_capacity:4GiB"

static uint64_t mappings(tide_allocator *a) { return tu_stats(a).mappings; }
static uint64_t unmappings(tide_allocator *a) { return tu_stats(a).unmappings; }
static int64_t reserved(tide_allocator *a) {
  return tu_stats(a).reserved_bytes[TIDE_POOL_ALL].current;
}

static void *alloc_ok(tide_allocator *a, size_t size) {
  void *p = tide_malloc(a, size, NULL);
  if (!p) fail_msg("tide_malloc(%zu) failed: %s", size, tide_last_error());
  return p;
}

/* Three 64 MiB blocks before any free: three mappings. After a free, a
 * 128 MiB block maps its 64 pages one by one (2 MiB handles below
 * handle_threshold_mb). */
static void test_one_handle_per_growth_until_a_free(void **state) {
  (void)state;
  tide_allocator *a = tu_create(CONF);
  void *p[3];
  for (int i = 0; i < 3; i++) p[i] = alloc_ok(a, 64 * TU_MiB);
  assert_int_equal(mappings(a), 3);
  assert_int_equal(tide_host_mappings(a), 3);
  assert_int_equal(tide_host_call_count(a, TIDE_OP_CREATE), 3);
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_free(a, p[1], NULL));
  void *q = alloc_ok(a, 128 * TU_MiB);
  assert_int_equal(mappings(a), 3 + 64);
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_free(a, q, NULL));
  tu_assert_ok(tide_free(a, p[0], NULL));
  tu_assert_ok(tide_free(a, p[2], NULL));
  tu_assert_ok(tide_destroy(a));
}

/* load_handles:False maps every growth in handles of the usual size. */
static void test_off(void **state) {
  (void)state;
  tide_allocator *a = tu_create(CONF ",load_handles:False");
  void *p = alloc_ok(a, 64 * TU_MiB);
  assert_int_equal(mappings(a), 32);
  tu_assert_ok(tide_free(a, p, NULL));
  tu_assert_ok(tide_destroy(a));
}

/* Requests below a page never go to the large pool's handles: the small
 * pool maps page by page as before, load phase or not. */
static void test_small_requests_unchanged(void **state) {
  (void)state;
  tide_allocator *a = tu_create(CONF), *b = tu_create(CONF ",load_handles:False");
  void *p[600], *q[600];
  for (int i = 0; i < 600; i++) {
    p[i] = alloc_ok(a, 300 * TU_KiB);
    q[i] = alloc_ok(b, 300 * TU_KiB);
  }
  assert_int_equal(mappings(a), mappings(b));
  tu_assert_ok(tide_check(a));
  for (int i = 0; i < 600; i++) {
    tu_assert_ok(tide_free(a, p[i], NULL));
    tu_assert_ok(tide_free(b, q[i], NULL));
  }
  tu_assert_ok(tide_destroy(a));
  tu_assert_ok(tide_destroy(b));
}

/* Freed whole, load handles go back with one unmap each. */
static void test_released_whole(void **state) {
  (void)state;
  tide_allocator *a = tu_create(CONF);
  void *p = alloc_ok(a, 64 * TU_MiB), *q = alloc_ok(a, 96 * TU_MiB);
  assert_int_equal(reserved(a), (int64_t)(160 * TU_MiB));
  tu_assert_ok(tide_free(a, p, NULL));
  tu_assert_ok(tide_free(a, q, NULL));
  tu_assert_ok(tide_empty_cache(a));
  assert_int_equal(reserved(a), 0);
  assert_int_equal(unmappings(a), 2);
  assert_int_equal(tide_host_mappings(a), 0);
  assert_int_equal(tide_host_bytes_in_use(a), 0);
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_destroy(a));
}

/* A block left in part of a load handle keeps the whole handle mapped (and
 * counted as reserved) until it goes; the handle then goes in one unmap. */
static void test_partly_used_stays_whole(void **state) {
  (void)state;
  tide_allocator *a = tu_create(CONF);
  void *p = alloc_ok(a, 64 * TU_MiB);
  tu_assert_ok(tide_free(a, p, NULL));
  void *q = alloc_ok(a, 8 * TU_MiB); /* best fit: inside the freed block */
  assert_true((uintptr_t)q >= (uintptr_t)p && (uintptr_t)q < (uintptr_t)p + 64 * TU_MiB);
  assert_int_equal(mappings(a), 1);
  tu_assert_ok(tide_empty_cache(a));
  assert_int_equal(reserved(a), (int64_t)(64 * TU_MiB));
  assert_int_equal(unmappings(a), 0);
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_free(a, q, NULL));
  tu_assert_ok(tide_empty_cache(a));
  assert_int_equal(reserved(a), 0);
  assert_int_equal(unmappings(a), 1);
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_destroy(a));
}

/* A load handle that the backend refuses to create, map or make
 * accessible: the allocation fails with the backend's message, nothing is
 * left held, and the next one maps its load handle. */
static void test_failures_leave_nothing(void **state) {
  (void)state;
  const tide_backend_op ops[] = {TIDE_OP_CREATE, TIDE_OP_MAP, TIDE_OP_SET_ACCESS};
  for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
    tide_allocator *a = tu_create(CONF);
    tu_assert_ok(tide_host_fail_call(a, ops[i], 1));
    assert_null(tide_malloc(a, 64 * TU_MiB, NULL));
    assert_true(tide_last_error()[0] != '\0');
    assert_int_equal(reserved(a), 0);
    assert_int_equal(tide_host_bytes_in_use(a), 0);
    assert_int_equal(tide_host_mappings(a), 0);
    tu_assert_ok(tide_check(a));
    void *p = alloc_ok(a, 64 * TU_MiB);
    assert_int_equal(tide_host_mappings(a), 1);
    tu_assert_ok(tide_check(a));
    tu_assert_ok(tide_free(a, p, NULL));
    tu_assert_ok(tide_destroy(a));
  }
}

/* A block on a load handle is shared as that handle: 44 MiB placed at the
 * page after a 35 MiB filler has a handle of its own, [36, 80) MiB. A
 * block that a load handle and handles of the usual size map (a free tail
 * of the load phase taken with new pages after it) is shared as each of
 * them. The importer sees the exporter's writes. */
static void test_shared_as_whole_handles(void **state) {
  (void)state;
  tide_allocator *a = tu_create(CONF), *b = tu_create(CONF);
  uint8_t *filler = alloc_ok(a, 35 * TU_MiB), *p = alloc_ok(a, 44 * TU_MiB);
  assert_int_equal((uintptr_t)p - (uintptr_t)filler, 36 * TU_MiB);
  assert_int_equal(mappings(a), 2);
  tide_share_desc desc;
  tide_share_piece *pieces = NULL;
  tu_assert_ok(tide_share_export(a, p, &desc, &pieces));
  assert_int_equal(desc.num_pieces, 1);
  assert_int_equal(desc.offset, 0);
  assert_int_equal(pieces[0].size, 44 * TU_MiB);
  uint8_t *q = NULL;
  tu_assert_ok(tide_share_import(b, &desc, pieces, (void **)&q));
  tide_share_pieces_close(pieces, desc.num_pieces);
  for (size_t i = 0; i < 44 * TU_MiB; i += TU_MiB) p[i] = (uint8_t)(i >> 20);
  for (size_t i = 0; i < 44 * TU_MiB; i += TU_MiB) assert_int_equal(q[i], (uint8_t)(i >> 20));
  tu_assert_ok(tide_share_close(b, q));
  tu_assert_ok(tide_free(a, p, NULL));
  tu_assert_ok(tide_empty_cache(a)); /* p's load handle goes: nothing else frees it */
  /* The load phase ends with a free; 5 MiB then take the filler's free
   * last MiB and two new pages of 2 MiB after it. */
  tide_free(a, alloc_ok(a, 4096), NULL);
  uint8_t *r = alloc_ok(a, 5 * TU_MiB);
  assert_int_equal((uintptr_t)r - (uintptr_t)filler, 35 * TU_MiB);
  tu_assert_ok(tide_share_export(a, r, &desc, &pieces));
  assert_int_equal(desc.num_pieces, 3);
  assert_int_equal(desc.offset, 35 * TU_MiB);
  assert_int_equal(pieces[0].size, 36 * TU_MiB);
  assert_int_equal(pieces[1].size, 2 * TU_MiB);
  assert_int_equal(pieces[2].size, 2 * TU_MiB);
  tu_assert_ok(tide_share_import(b, &desc, pieces, (void **)&q));
  tide_share_pieces_close(pieces, desc.num_pieces);
  for (size_t i = 0; i < 5 * TU_MiB; i += TU_MiB) r[i] = (uint8_t)(7 + (i >> 20));
  for (size_t i = 0; i < 5 * TU_MiB; i += TU_MiB) assert_int_equal(q[i], (uint8_t)(7 + (i >> 20)));
  tu_assert_ok(tide_share_close(b, q));
  tu_assert_ok(tide_free(a, r, NULL));
  tu_assert_ok(tide_free(a, filler, NULL));
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_destroy(b));
  tu_assert_ok(tide_destroy(a));
}

/* Each stream's arena has its own load phase: a free on one stream does
 * not end another's. */
static void test_per_stream(void **state) {
  (void)state;
  tide_allocator *a = tu_create(CONF);
  tide_stream s = NULL;
  tu_assert_ok(tide_stream_create(a, &s));
  void *p = alloc_ok(a, 64 * TU_MiB);
  tu_assert_ok(tide_free(a, p, NULL));
  void *q = tide_malloc(a, 64 * TU_MiB, s);
  assert_non_null(q);
  assert_int_equal(mappings(a), 2);
  tu_assert_ok(tide_free(a, q, s));
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_stream_destroy(a, s));
  tu_assert_ok(tide_destroy(a));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_one_handle_per_growth_until_a_free),
      cmocka_unit_test(test_off),
      cmocka_unit_test(test_small_requests_unchanged),
      cmocka_unit_test(test_released_whole),
      cmocka_unit_test(test_partly_used_stays_whole),
      cmocka_unit_test(test_failures_leave_nothing),
      cmocka_unit_test(test_shared_as_whole_handles),
      cmocka_unit_test(test_per_stream),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
