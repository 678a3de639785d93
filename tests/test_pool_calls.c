/* test_pool_calls.c: the calls a caller that routes pools itself needs
 * (PyTorch's allocator interface, through the shim of python/tidalloc/shim),
 * on the host backend with emulated captures:
 * - tide_pool_malloc puts blocks in the pool's segments, not the usual memory;
 * - tide_free_home frees a block on its own stream whatever the hint, so
 *   that a block freed with a wrong hint is reused at once by its stream and
 *   no event is recorded on the hint's stream;
 * - tide_capture_watch_begin/_end defer a free that would record an event
 *   on a stream being captured, until the watch and the capture end;
 * - tide_pool_allocated and tide_checkpoint_allocated list exactly the
 *   allocated blocks, and with a restore's delta give PyTorch's
 *   CheckpointDelta (freed: everything allocated before; allocated: the
 *   checkpoint's blocks);
 * - tide_layout_get's segments tile with their blocks and agree with the
 *   stats; bad arguments are refused with a message. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "memory/core.h"
#include "testutil.h"

#define MiB ((size_t)1 << 20)
#define KiB ((size_t)1 << 10)

static tide_allocator *make(void) { return tu_create("host_capacity:4GiB"); }

static tide_stream new_stream(tide_allocator *a) {
  tide_stream s = NULL;
  tu_assert_ok(tide_stream_create(a, &s));
  return s;
}

static bool listed(void *const *list, size_t n, const void *p) {
  for (size_t i = 0; i < n; i++)
    if (list[i] == p) return true;
  return false;
}

/* The capture pool (0: usual memory) of the segment holding ptr. */
static uint64_t pool_of(tide_allocator *a, const void *ptr) {
  tide_layout l;
  tu_assert_ok(tide_layout_get(a, &l));
  uint64_t id = UINT64_MAX;
  for (size_t i = 0; i < l.num_segments; i++) {
    const tide_segment_view *s = &l.segments[i];
    if ((uintptr_t)ptr >= s->address && (uintptr_t)ptr < s->address + s->size) id = s->capture_pool;
  }
  tide_layout_free(&l);
  if (id == UINT64_MAX) fail_msg("%p is in no segment", ptr);
  return id;
}

static void test_pool_malloc_goes_to_pool(void **state) {
  (void)state;
  tide_allocator *a = make();
  tide_stream s = new_stream(a);
  tide_pool *pool = NULL;
  tu_assert_ok(tide_pool_create(a, &pool));
  void *in_pool = tide_pool_malloc(pool, 3 * MiB, s);
  void *small_in_pool = tide_pool_malloc(pool, 4 * KiB, s);
  void *usual = tide_malloc(a, 3 * MiB, s);
  assert_non_null(in_pool);
  assert_non_null(small_in_pool);
  assert_non_null(usual);
  assert_int_equal(pool_of(a, in_pool), tide_pool_id(pool));
  assert_int_equal(pool_of(a, small_in_pool), tide_pool_id(pool));
  assert_int_equal(pool_of(a, usual), 0);
  tide_stats st;
  tu_assert_ok(tide_pool_get_stats(pool, &st));
  assert_int_equal(st.allocations[0].current, 2);
  tu_assert_ok(tide_free_home(a, in_pool, NULL));
  tu_assert_ok(tide_free(a, small_in_pool, s));
  tu_assert_ok(tide_free(a, usual, s));
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_pool_release(pool));
  tu_assert_ok(tide_stream_destroy(a, s));
  tu_assert_ok(tide_destroy(a));
}

static void test_pool_malloc_bad_input(void **state) {
  (void)state;
  tide_allocator *a = make();
  assert_null(tide_pool_malloc(NULL, MiB, NULL));
  assert_int_equal(tide_last_status(), TIDE_ERR_INVALID);
  assert_non_null(strstr(tide_last_error(), "tide_pool_malloc"));
  tide_pool *pool = NULL;
  tu_assert_ok(tide_pool_create(a, &pool));
  assert_null(tide_pool_malloc(pool, 0, NULL));
  assert_int_equal(tide_last_status(), TIDE_ERR_INVALID);
  assert_non_null(strstr(tide_last_error(), "size 0"));
  assert_int_equal(tide_capture_watch_end(a), TIDE_ERR_STATE);
  assert_int_equal(tide_capture_watch_begin(NULL), TIDE_ERR_INVALID);
  size_t n = 7;
  assert_int_equal(tide_pool_allocated(NULL, NULL, 0, &n), TIDE_ERR_INVALID);
  assert_int_equal(tide_pool_allocated(pool, NULL, 0, NULL), TIDE_ERR_INVALID);
  assert_int_equal(tide_checkpoint_allocated(NULL, NULL, 0), 0);
  tide_layout l;
  assert_int_equal(tide_layout_get(NULL, &l), TIDE_ERR_INVALID);
  assert_null(l.segments);
  assert_int_equal(tide_free_home(a, (void *)(uintptr_t)0x1000, NULL), TIDE_ERR_BAD_POINTER);
  tu_assert_ok(tide_free_home(a, NULL, NULL));
  tu_assert_ok(tide_pool_release(pool));
  tu_assert_ok(tide_destroy(a));
}

/* A block freed with another stream as the hint is freed on its own stream:
 * the next allocation of that stream takes it at once, and no event is
 * recorded (tide_free on the hint's stream would record one and wait). */
static void test_free_home_uses_own_stream(void **state) {
  (void)state;
  tide_allocator *a = make();
  tide_stream s = new_stream(a), t = new_stream(a);
  void *keep_t = tide_malloc(a, 4 * KiB, t); /* t has an arena of its own */
  void *p = tide_malloc(a, 3 * MiB, s);
  assert_non_null(p);
  tu_assert_ok(tide_host_stream_hold(a, t)); /* an event on t would stay pending */
  uint64_t events = tide_host_call_count(a, TIDE_OP_EVENT_RECORD);
  tu_assert_ok(tide_free_home(a, p, t));
  assert_int_equal(tide_host_call_count(a, TIDE_OP_EVENT_RECORD), events);
  void *q = tide_malloc(a, 3 * MiB, s);
  assert_ptr_equal(q, p);
  tu_assert_ok(tide_free_home(a, q, s)); /* the right hint */
  assert_int_equal(tide_free_home(a, q, s), TIDE_ERR_DOUBLE_FREE);
  tu_assert_ok(tide_host_stream_release(a, t));
  tu_assert_ok(tide_free(a, keep_t, t));
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_stream_destroy(a, s));
  tu_assert_ok(tide_stream_destroy(a, t));
  tu_assert_ok(tide_destroy(a));
}

/* A free that succeeds leaves the calling thread's last error as it was,
 * whichever way the hint led (to the block's arena, to another stream's, to
 * a stream with no arena, or to none) and when a step of the free failed
 * and was worked around. */
static void test_free_home_success_leaves_no_error(void **state) {
  tide_allocator *a = tu_create(*state);
  tide_stream s = new_stream(a), t = new_stream(a), unused = new_stream(a);
  void *keep_t = tide_malloc(a, 4 * KiB, t);
  assert_non_null(keep_t);
  tide_stream hints[] = {s, t, unused, NULL};
  for (size_t i = 0; i < sizeof hints / sizeof hints[0]; i++) {
    void *p = tide_malloc(a, 3 * MiB, s);
    void *small = tide_malloc(a, 4 * KiB, s);
    assert_non_null(p);
    assert_non_null(small);
    tide_clear_error();
    tu_assert_ok(tide_free_home(a, p, hints[i]));
    tu_assert_ok(tide_free_home(a, small, hints[i]));
    if (tide_last_status() != TIDE_OK || tide_last_error()[0] != '\0')
      fail_msg("hint %zu: tide_free_home succeeded but left %s: \"%s\"", i,
               tide_status_name(tide_last_status()), tide_last_error());
  }
  /* A pool's blocks, of a stream whose usual memory holds nothing. */
  tide_stream only_pool = new_stream(a);
  tide_pool *pool = NULL;
  tu_assert_ok(tide_pool_create(a, &pool));
  tide_stream pool_hints[] = {only_pool, s, unused, NULL};
  for (size_t i = 0; i < sizeof pool_hints / sizeof pool_hints[0]; i++) {
    void *p = tide_pool_malloc(pool, 3 * MiB, only_pool);
    assert_non_null(p);
    tide_clear_error();
    tu_assert_ok(tide_free_home(a, p, pool_hints[i]));
    if (tide_last_status() != TIDE_OK || tide_last_error()[0] != '\0')
      fail_msg("pool block, hint %zu: tide_free_home succeeded but left %s: \"%s\"", i,
               tide_status_name(tide_last_status()), tide_last_error());
  }
  tu_assert_ok(tide_pool_release(pool));
  /* A block read on a stream destroyed since: no event can be recorded on
   * that stream, so the free waits instead, and succeeds. */
  for (int home = 0; home < 2; home++) {
    tide_stream gone = new_stream(a);
    void *p = tide_malloc(a, 3 * MiB, t);
    assert_non_null(p);
    tu_assert_ok(tide_record_stream(a, p, gone));
    tu_assert_ok(tide_stream_destroy(a, gone));
    tide_clear_error();
    tu_assert_ok(home ? tide_free_home(a, p, t) : tide_free(a, p, t));
    if (tide_last_status() != TIDE_OK || tide_last_error()[0] != '\0')
      fail_msg("%s of a block recorded on a destroyed stream succeeded but left %s: \"%s\"",
               home ? "tide_free_home" : "tide_free", tide_status_name(tide_last_status()),
               tide_last_error());
  }
  tu_assert_ok(tide_free(a, keep_t, t));
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_stream_destroy(a, s));
  tu_assert_ok(tide_stream_destroy(a, t));
  tu_assert_ok(tide_stream_destroy(a, unused));
  tu_assert_ok(tide_stream_destroy(a, only_pool));
  tu_assert_ok(tide_destroy(a));
}

/* While watched, a block recorded on a stream being captured and freed
 * waits for the capture to end: its event would be a node of the graph. */
static void test_watch_defers_free_on_captured_stream(void **state) {
  (void)state;
  tide_allocator *a = make();
  tide_stream s = new_stream(a), c = new_stream(a);
  void *p = tide_malloc(a, 3 * MiB, s);
  tu_assert_ok(tide_record_stream(a, p, c));
  tu_assert_ok(tide_capture_watch_begin(a));
  tu_assert_ok(tide_host_capture_begin(a, c));
  uint64_t events = tide_host_call_count(a, TIDE_OP_EVENT_RECORD);
  tu_assert_ok(tide_free_home(a, p, c));
  assert_int_equal(tide_host_call_count(a, TIDE_OP_EVENT_RECORD), events);
  void *q = tide_malloc(a, 3 * MiB, s);
  assert_ptr_not_equal(q, p); /* p is not free yet */
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_host_capture_end(a, c));
  tu_assert_ok(tide_capture_watch_end(a));
  tu_assert_ok(tide_stream_synchronize(a, c));
  void *again = tide_malloc(a, 3 * MiB, s); /* the deferred free went through: p is free */
  assert_ptr_equal(again, p);
  tu_assert_ok(tide_free(a, again, s));
  tu_assert_ok(tide_free(a, q, s));
  tide_stats st;
  tu_assert_ok(tide_get_stats(a, &st));
  assert_int_equal(st.allocations[0].current, 0);
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_stream_destroy(a, s));
  tu_assert_ok(tide_stream_destroy(a, c));
  tu_assert_ok(tide_destroy(a));
}

static void test_allocated_and_checkpoint_delta(void **state) {
  (void)state;
  tide_allocator *a = make();
  tide_stream s = new_stream(a);
  tide_pool *pool = NULL;
  tu_assert_ok(tide_pool_create(a, &pool));
  void *x = tide_pool_malloc(pool, MiB + 512, s);
  void *y = tide_pool_malloc(pool, 2 * MiB, s);
  void *z = tide_pool_malloc(pool, 64 * KiB, s);
  assert_true(x && y && z);
  void *now[8];
  size_t n = 0;
  tu_assert_ok(tide_pool_allocated(pool, now, 8, &n));
  assert_int_equal(n, 3);
  assert_true(listed(now, n, x) && listed(now, n, y) && listed(now, n, z));
  tu_assert_ok(tide_pool_allocated(pool, NULL, 0, &n)); /* counting only */
  assert_int_equal(n, 3);

  tide_checkpoint *ck = NULL;
  tu_assert_ok(tide_pool_checkpoint(pool, &ck));
  void *in_ck[8];
  assert_int_equal(tide_checkpoint_allocated(ck, in_ck, 8), 3);
  assert_int_equal(tide_checkpoint_allocated(ck, in_ck, 1), 3); /* the count, one written */
  tu_assert_ok(tide_free(a, y, s));
  void *w = tide_pool_malloc(pool, 512 * KiB, s);
  assert_non_null(w);

  tide_restore_delta d;
  tu_assert_ok(tide_pool_restore(pool, ck, &d));
  /* PyTorch's delta: freed = released + kept, allocated = the checkpoint's. */
  size_t nck = tide_checkpoint_allocated(ck, in_ck, 8);
  size_t kept = 0;
  for (size_t i = 0; i < nck; i++) kept += !listed(d.restored, d.nrestored, in_ck[i]);
  assert_int_equal(d.nrestored, 1);
  assert_ptr_equal(d.restored[0], y);
  assert_int_equal(d.nreleased, 1);
  assert_ptr_equal(d.released[0], w);
  assert_int_equal(kept, 2); /* x and z were allocated before and after */
  tu_assert_ok(tide_pool_allocated(pool, now, 8, &n));
  assert_int_equal(n, 3);
  assert_true(listed(now, n, x) && listed(now, n, y) && listed(now, n, z));
  tide_restore_delta_free(&d);
  tide_checkpoint_free(ck);
  for (void **p = (void *[]){x, y, z, NULL}; *p; p++) tu_assert_ok(tide_free_home(a, *p, NULL));
  tu_assert_ok(tide_pool_allocated(pool, now, 8, &n));
  assert_int_equal(n, 0);
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_pool_release(pool));
  tu_assert_ok(tide_stream_destroy(a, s));
  tu_assert_ok(tide_destroy(a));
}

static void test_layout_tiles_and_agrees(void **state) {
  (void)state;
  tide_allocator *a = make();
  tide_stream s = new_stream(a);
  void *p[6];
  size_t sizes[6] = {3 * MiB, 512, 100 * KiB, 5 * MiB + 3, 2 * MiB, 64};
  for (int i = 0; i < 6; i++) p[i] = tide_malloc(a, sizes[i], s);
  tu_assert_ok(tide_free(a, p[1], s));
  tu_assert_ok(tide_free(a, p[3], s));
  tide_layout l;
  tu_assert_ok(tide_layout_get(a, &l));
  assert_true(l.num_segments > 0);
  uint64_t allocated = 0, requested = 0, mapped = 0, blocks = 0;
  for (size_t i = 0; i < l.num_segments; i++) {
    const tide_segment_view *sv = &l.segments[i];
    uint64_t at = sv->address;
    for (size_t j = sv->first_block; j < sv->first_block + sv->num_blocks; j++) {
      const tide_block_view *b = &l.blocks[j];
      assert_int_equal(b->address, at);
      at += b->size;
      if (b->state == TIDE_BLOCK_ALLOCATED) {
        allocated += b->size;
        requested += b->requested;
      }
      if (b->state != TIDE_BLOCK_UNMAPPED) mapped += b->size;
    }
    assert_int_equal(at, sv->address + sv->size);
    blocks += sv->num_blocks;
  }
  assert_int_equal(blocks, l.num_blocks);
  tide_stats st;
  tu_assert_ok(tide_get_stats(a, &st));
  assert_int_equal(allocated, (uint64_t)st.allocated_bytes[0].current);
  assert_int_equal(requested, (uint64_t)st.requested_bytes[0].current);
  assert_int_equal(mapped, (uint64_t)st.reserved_bytes[0].current);
  tide_layout_free(&l);
  assert_null(l.blocks);
  for (int i = 0; i < 6; i++)
    if (i != 1 && i != 3) tu_assert_ok(tide_free(a, p[i], s));
  tu_assert_ok(tide_stream_destroy(a, s));
  tu_assert_ok(tide_destroy(a));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_pool_malloc_goes_to_pool),
      cmocka_unit_test(test_pool_malloc_bad_input),
      cmocka_unit_test(test_free_home_uses_own_stream),
      cmocka_unit_test_prestate(test_free_home_success_leaves_no_error, "host_capacity:4GiB"),
      cmocka_unit_test_prestate(test_free_home_success_leaves_no_error,
                                "host_capacity:4GiB,capture_detection:True"),
      cmocka_unit_test(test_watch_defers_free_on_captured_stream),
      cmocka_unit_test(test_allocated_and_checkpoint_delta),
      cmocka_unit_test(test_layout_tiles_and_agrees),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
