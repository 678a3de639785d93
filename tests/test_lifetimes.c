/* test_lifetimes.c: what a handle's lifetime promises.
 *
 * - A correct program is never told it leaked: a block freed on another
 *   stream, or recorded on one, is back once that stream is waited for, so
 *   tide_destroy and tide_shutdown count it as freed.
 * - Handles used after they went (a growable buffer destroyed, a capture
 *   pool after its last release, an allocator destroyed) are refused with
 *   TIDE_ERR_INVALID and a message, and the check never reads freed memory
 *   (the AddressSanitizer run would say so).
 * - A stream belongs to the device that made it: a stream of another
 *   allocator's emulated device is not one of this device's. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "testutil.h"

/* ------------------------------------------------------------------------ */
/* Frees on other streams are not leaks                                      */
/* ------------------------------------------------------------------------ */

static void free_on_created_stream_then_destroy(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tide_stream s = NULL;
  tu_assert_ok(tide_stream_create(a, &s));
  void *p = tide_malloc(a, 4096, NULL);
  assert_non_null(p);
  tu_assert_ok(tide_free(a, p, s));
  tu_assert_ok(tide_stream_synchronize(a, s));
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_destroy(a));
}

static void record_stream_then_destroy(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tide_stream s = NULL;
  tu_assert_ok(tide_stream_create(a, &s));
  void *p = tide_malloc(a, 3 * TU_MiB, NULL);
  assert_non_null(p);
  tu_assert_ok(tide_record_stream(a, p, s));
  tu_assert_ok(tide_free(a, p, NULL));
  tu_assert_ok(tide_stream_synchronize(a, s));
  tu_assert_ok(tide_destroy(a));
}

static void allocated_on_one_stream_freed_on_another(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tide_stream s1 = NULL, s2 = NULL;
  tu_assert_ok(tide_stream_create(a, &s1));
  tu_assert_ok(tide_stream_create(a, &s2));
  void *p = tide_malloc(a, 1000, s1);
  assert_non_null(p);
  tu_assert_ok(tide_free(a, p, s2));
  tu_assert_ok(tide_stream_synchronize(a, s2));
  tu_assert_ok(tide_destroy(a)); /* the streams go with it */
}

/* A block whose free still waits for a held stream is in use by that
 * stream: that one is counted (the message must stay true). */
static void free_waiting_on_held_stream_is_counted(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tide_stream s = NULL;
  tu_assert_ok(tide_stream_create(a, &s));
  void *p = tide_malloc(a, 4096, NULL);
  assert_non_null(p);
  tu_assert_ok(tide_host_stream_hold(a, s));
  tu_assert_ok(tide_free(a, p, s));
  tu_assert_status(tide_destroy(a), TIDE_ERR_STATE);
  tu_assert_last_error(TIDE_ERR_STATE, "1 block(s)");
}

/* ------------------------------------------------------------------------ */
/* Growable buffers after destroy                                            */
/* ------------------------------------------------------------------------ */

static tide_buf *make_buffer(tide_allocator *a, bool async) {
  tide_buf_options o;
  tide_buf_options_init(&o);
  o.capacity = 64 * TU_MiB;
  o.map_ahead = async ? 4 * TU_MiB : 0;
  o.async_map_ahead = async;
  tide_buf *b = NULL;
  tu_assert_ok(tide_buf_create(a, &o, &b));
  return b;
}

static void buffer_destroyed_twice(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tide_buf *b = make_buffer(a, true);
  tu_assert_ok(tide_buf_resize(b, 3 * TU_MiB, NULL));
  tu_assert_ok(tide_buf_destroy(b));
  tu_assert_status(tide_buf_destroy(b), TIDE_ERR_INVALID);
  tu_assert_last_error(TIDE_ERR_INVALID, "not a live growable buffer");
  tu_assert_status(tide_buf_destroy_after(b, NULL), TIDE_ERR_INVALID);
  tu_assert_last_error(TIDE_ERR_INVALID, "tide_buf_destroy_after");
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_destroy(a));
}

static void buffer_used_after_destroy(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tide_buf *b = make_buffer(a, false);
  tu_assert_ok(tide_buf_resize(b, TU_MiB, NULL));
  tu_assert_ok(tide_buf_destroy(b));
  tu_assert_status(tide_buf_resize(b, 2 * TU_MiB, NULL), TIDE_ERR_INVALID);
  tu_assert_last_error(TIDE_ERR_INVALID, "tide_buf_resize: not a live growable buffer");
  tu_assert_status(tide_buf_reserve_ahead(b, 2 * TU_MiB), TIDE_ERR_INVALID);
  tu_assert_last_error(TIDE_ERR_INVALID, "tide_buf_reserve_ahead");
  assert_null(tide_buf_data(b));
  assert_int_equal(tide_buf_length(b), 0);
  assert_int_equal(tide_buf_capacity(b), 0);
  assert_int_equal(tide_buf_mapped(b), 0);
  /* Nothing changed: a new buffer works, the allocator is consistent. */
  tide_buf *c = make_buffer(a, false);
  tu_assert_ok(tide_buf_resize(c, 5 * TU_MiB, NULL));
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_buf_destroy(c));
  tu_assert_ok(tide_destroy(a));
}

/* Destroying the allocator destroys its buffers: their handles go too. */
static void buffer_after_its_allocator(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tide_buf *b = make_buffer(a, true);
  tu_assert_ok(tide_buf_resize(b, TU_MiB, NULL));
  tu_assert_status(tide_destroy(a), TIDE_ERR_STATE); /* the buffer was still there */
  tu_assert_status(tide_buf_resize(b, 2 * TU_MiB, NULL), TIDE_ERR_INVALID);
  tu_assert_status(tide_buf_destroy(b), TIDE_ERR_INVALID);
}

/* ------------------------------------------------------------------------ */
/* Capture pools after their last release                                    */
/* ------------------------------------------------------------------------ */

static void pool_used_after_last_release(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tide_pool *p = NULL;
  tu_assert_ok(tide_pool_create(a, &p));
  void *x = tide_pool_malloc(p, 4096, NULL);
  assert_non_null(x);
  tu_assert_ok(tide_free(a, x, NULL));
  tu_assert_ok(tide_pool_release(p)); /* the last user: the pool goes */
  tu_assert_ok(tide_empty_cache(a));
  tu_assert_status(tide_pool_retain(p), TIDE_ERR_INVALID);
  tu_assert_last_error(TIDE_ERR_INVALID, "not a live tidalloc capture pool");
  tu_assert_status(tide_pool_release(p), TIDE_ERR_INVALID);
  assert_null(tide_pool_malloc(p, 4096, NULL));
  tu_assert_last_error(TIDE_ERR_INVALID, "gone after its last release");
  assert_int_equal(tide_pool_id(p), 0);
  tide_stats st;
  tu_assert_status(tide_pool_get_stats(p, &st), TIDE_ERR_INVALID);
  tu_assert_status(tide_capture_begin(a, NULL, p), TIDE_ERR_INVALID);
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_destroy(a));
}

static void pool_after_its_allocator(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tide_pool *p = NULL;
  tu_assert_ok(tide_pool_create(a, &p));
  tu_assert_ok(tide_destroy(a));
  tu_assert_status(tide_pool_retain(p), TIDE_ERR_INVALID);
  assert_null(tide_pool_malloc(p, 4096, NULL));
}

/* ------------------------------------------------------------------------ */
/* Allocators after destroy                                                  */
/* ------------------------------------------------------------------------ */

static void allocator_used_after_destroy(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tu_assert_ok(tide_destroy(a));
  tu_assert_status(tide_destroy(a), TIDE_ERR_INVALID);
  tu_assert_last_error(TIDE_ERR_INVALID, "not a live tidalloc allocator");
  assert_null(tide_malloc(a, 4096, NULL));
  tu_assert_status(tide_free(a, (void *)(uintptr_t)0x10000, NULL), TIDE_ERR_INVALID);
  tu_assert_status(tide_check(a), TIDE_ERR_INVALID);
  tide_stream s = NULL;
  tu_assert_status(tide_stream_create(a, &s), TIDE_ERR_INVALID);
}

/* ------------------------------------------------------------------------ */
/* Streams of another device                                                 */
/* ------------------------------------------------------------------------ */

static void stream_of_another_allocator(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL), *b = tu_create(NULL);
  tide_stream sa = NULL, sb = NULL;
  tu_assert_ok(tide_stream_create(a, &sa));
  tu_assert_ok(tide_stream_create(b, &sb));
  assert_true(sa != sb);
  /* Allocation on B's stream. */
  assert_null(tide_malloc(a, 4096, sb));
  tu_assert_last_error(TIDE_ERR_INVALID, "not a stream of this device");
  /* A free ordered on it: refused, the block still allocated. */
  void *p = tide_malloc(a, 4096, sa);
  assert_non_null(p);
  tu_assert_status(tide_free(a, p, sb), TIDE_ERR_INVALID);
  tu_assert_last_error(TIDE_ERR_INVALID, "still allocated");
  void *q = tide_malloc(a, 4096, NULL);
  assert_non_null(q);
  tu_assert_status(tide_free(a, q, sb), TIDE_ERR_INVALID);
  /* Recording it is taken as recording any stream the device cannot order
   * an event on: the free waits for the device instead. */
  tu_assert_ok(tide_record_stream(a, q, sb));
  tide_buf_options o;
  tide_buf_options_init(&o);
  o.capacity = 8 * TU_MiB;
  o.stream = sb;
  tide_buf *buf = NULL;
  tu_assert_status(tide_buf_create(a, &o, &buf), TIDE_ERR_INVALID);
  tu_assert_status(tide_stream_synchronize(a, sb), TIDE_ERR_INVALID);
  tu_assert_status(tide_stream_destroy(a, sb), TIDE_ERR_INVALID);
  /* Both allocators still work with their own streams. */
  tu_assert_ok(tide_free(a, p, sa));
  tu_assert_ok(tide_free(a, q, NULL)); /* after the device was waited for */
  void *r = tide_malloc(b, 4096, sb);
  assert_non_null(r);
  tu_assert_ok(tide_free(b, r, sb));
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_check(b));
  tu_assert_ok(tide_stream_destroy(b, sb));
  tu_assert_ok(tide_stream_destroy(a, sa));
  tu_assert_ok(tide_destroy(b));
  tu_assert_ok(tide_destroy(a));
}

/* Last: the process-wide allocators end here. */
static void shutdown_after_cross_stream_free(void **state) {
  (void)state;
  setenv("TIDALLOC_CONF", "backend:host", 1);
  tide_allocator *a = tide_device(0);
  if (!a) fail_msg("tide_device(0): %s", tide_last_error());
  tide_stream s = NULL;
  tu_assert_ok(tide_stream_create(a, &s));
  void *p = tide_malloc(a, 2 * TU_MiB, NULL);
  assert_non_null(p);
  tu_assert_ok(tide_free(a, p, s));
  tu_assert_ok(tide_stream_synchronize(a, s));
  tu_assert_ok(tide_shutdown());
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(free_on_created_stream_then_destroy),
      cmocka_unit_test(record_stream_then_destroy),
      cmocka_unit_test(allocated_on_one_stream_freed_on_another),
      cmocka_unit_test(free_waiting_on_held_stream_is_counted),
      cmocka_unit_test(buffer_destroyed_twice),
      cmocka_unit_test(buffer_used_after_destroy),
      cmocka_unit_test(buffer_after_its_allocator),
      cmocka_unit_test(pool_used_after_last_release),
      cmocka_unit_test(pool_after_its_allocator),
      cmocka_unit_test(allocator_used_after_destroy),
      cmocka_unit_test(stream_of_another_allocator),
      cmocka_unit_test(shutdown_after_cross_stream_free),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
