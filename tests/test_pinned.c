/* test_pinned.c: the pinned host memory pool (tide_pinned_*) on the host
 * backend: size classes and alignment, reuse from the free lists, reuse
 * ordered by streams (held streams stand for long-running work), recorded
 * streams, tide_pinned_empty_cache, the stats, the out-of-memory path
 * (a request no host can pin, and failures injected into host_alloc), bad
 * pointers, double frees and bad streams, destroyed streams, teardown with
 * blocks in use, and several threads at once with data checked. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "testutil.h"

#define PAGE ((size_t)4096)

static tide_stats pstats(tide_allocator *a) {
  tide_stats st;
  memset(&st, 0xff, sizeof st);
  tu_assert_ok(tide_pinned_get_stats(a, &st));
  return st;
}

static uint64_t calls(tide_allocator *a, tide_backend_op op) { return tide_host_call_count(a, op); }

static tide_stream new_stream(tide_allocator *a) {
  tide_stream s = NULL;
  tu_assert_ok(tide_stream_create(a, &s));
  assert_non_null(s);
  return s;
}

/* ------------------------------------------------------------------------ */

static void pinned_sizes_and_alignment(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  static const struct {
    size_t size, block;
  } cases[] = {
      {1, 4 * TU_KiB},    {512, 4 * TU_KiB},     {4095, 4 * TU_KiB},
      {4096, 4 * TU_KiB}, {4097, 8 * TU_KiB},    {64 * TU_KiB + 1, 128 * TU_KiB},
      {TU_MiB, TU_MiB},   {1638400, 2 * TU_MiB}, {3 * TU_MiB + 1, 4 * TU_MiB},
  };
  enum { N = sizeof cases / sizeof cases[0] };
  void *p[N];
  int64_t blocks = 0, asked = 0, small = 0, large = 0;
  for (size_t i = 0; i < N; i++) {
    p[i] = tide_pinned_malloc(a, cases[i].size, NULL);
    if (!p[i]) fail_msg("pinned %zu bytes: %s", cases[i].size, tide_last_error());
    assert_int_equal((uintptr_t)p[i] % PAGE, 0);
    /* The whole class is the caller's: write all of it, then check it. */
    memset(p[i], (int)(i + 1), cases[i].block);
    blocks += (int64_t)cases[i].block;
    asked += (int64_t)cases[i].size;
    if (cases[i].block <= TU_MiB)
      small += (int64_t)cases[i].block;
    else
      large += (int64_t)cases[i].block;
  }
  for (size_t i = 0; i < N; i++) {
    const unsigned char *c = p[i];
    assert_int_equal(c[0], i + 1);
    assert_int_equal(c[cases[i].block - 1], i + 1);
  }
  tide_stats st = pstats(a);
  assert_int_equal(st.allocated_bytes[TIDE_POOL_ALL].current, blocks);
  assert_int_equal(st.allocated_bytes[TIDE_POOL_SMALL].current, small);
  assert_int_equal(st.allocated_bytes[TIDE_POOL_LARGE].current, large);
  assert_int_equal(st.requested_bytes[TIDE_POOL_ALL].current, asked);
  assert_int_equal(st.reserved_bytes[TIDE_POOL_ALL].current, blocks);
  assert_int_equal(st.allocations[TIDE_POOL_ALL].current, N);
  assert_int_equal(st.segments[TIDE_POOL_ALL].current, N);
  assert_int_equal(st.num_allocs, N);
  assert_int_equal(st.num_device_alloc, N);
  assert_int_equal(calls(a, TIDE_OP_HOST_ALLOC), N);
  /* The device's stats are not the pinned pool's. */
  assert_int_equal(tu_stats(a).allocated_bytes[TIDE_POOL_ALL].current, 0);
  assert_int_equal(tide_host_bytes_in_use(a), 0);

  for (size_t i = 0; i < N; i++) tu_assert_ok(tide_pinned_free(a, p[i], NULL));
  st = pstats(a);
  assert_int_equal(st.allocated_bytes[TIDE_POOL_ALL].current, 0);
  assert_int_equal(st.allocated_bytes[TIDE_POOL_ALL].peak, blocks);
  assert_int_equal(st.requested_bytes[TIDE_POOL_ALL].peak, asked);
  assert_int_equal(st.reserved_bytes[TIDE_POOL_ALL].current, blocks); /* cached */
  assert_int_equal(st.num_frees, N);
  assert_int_equal(st.inactive_split_bytes[TIDE_POOL_ALL].current, 0);
  assert_true(st.memory_limit == TIDE_NO_LIMIT); /* no limit applies, not 0 bytes */
  tu_assert_ok(tide_destroy(a));
}

static void pinned_reuse_by_class(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  void *p = tide_pinned_malloc(a, 1000, NULL);
  assert_non_null(p);
  tu_assert_ok(tide_pinned_free(a, p, NULL));
  /* Same class (4 KiB): the cached block, no new pinning. */
  void *q = tide_pinned_malloc(a, 3000, NULL);
  assert_ptr_equal(q, p);
  assert_int_equal(calls(a, TIDE_OP_HOST_ALLOC), 1);
  /* Another class is pinned anew. */
  void *r = tide_pinned_malloc(a, 5000, NULL);
  assert_non_null(r);
  assert_ptr_not_equal(r, p);
  assert_int_equal(calls(a, TIDE_OP_HOST_ALLOC), 2);
  /* Newest first: the block freed last comes back first. */
  void *s = tide_pinned_malloc(a, 4096, NULL);
  tu_assert_ok(tide_pinned_free(a, q, NULL));
  tu_assert_ok(tide_pinned_free(a, s, NULL));
  assert_ptr_equal(tide_pinned_malloc(a, 10, NULL), s);
  assert_ptr_equal(tide_pinned_malloc(a, 10, NULL), q);
  assert_int_equal(calls(a, TIDE_OP_HOST_ALLOC), 3);
  tide_stats st = pstats(a);
  assert_int_equal(st.requested_bytes[TIDE_POOL_ALL].current, 5000 + 10 + 10);
  assert_int_equal(st.allocated_bytes[TIDE_POOL_ALL].current, 8192 + 4096 + 4096);
  tu_assert_ok(tide_pinned_free(a, q, NULL));
  tu_assert_ok(tide_pinned_free(a, r, NULL));
  tu_assert_ok(tide_pinned_free(a, s, NULL));
  tu_assert_ok(tide_destroy(a));
}

/* A block freed on its own stream is that stream's at once, and other
 * streams' only once the stream's work before the free is done. */
static void pinned_own_stream_then_others(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tide_stream s = new_stream(a);
  tu_assert_ok(tide_host_stream_hold(a, s));
  void *p = tide_pinned_malloc(a, 8000, s);
  assert_non_null(p);
  tu_assert_ok(tide_pinned_free(a, p, s));
  assert_int_equal(pstats(a).active_bytes[TIDE_POOL_ALL].current, 0);
  void *q = tide_pinned_malloc(a, 8000, s);
  assert_ptr_equal(q, p); /* at once, although s is held */
  tu_assert_ok(tide_pinned_free(a, q, s));
  /* The default stream must not take it while s's work runs. */
  void *r = tide_pinned_malloc(a, 8000, NULL);
  assert_non_null(r);
  assert_ptr_not_equal(r, p);
  tu_assert_ok(tide_host_stream_release(a, s));
  void *t = tide_pinned_malloc(a, 8000, NULL);
  assert_ptr_equal(t, p);
  assert_int_equal(calls(a, TIDE_OP_HOST_ALLOC), 2);
  tu_assert_ok(tide_pinned_free(a, r, NULL));
  tu_assert_ok(tide_pinned_free(a, t, NULL));
  tu_assert_ok(tide_stream_destroy(a, s));
  tu_assert_ok(tide_destroy(a));
}

/* Freed naming another stream: reused only after that stream's work. */
static void pinned_free_on_other_stream(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tide_stream s = new_stream(a);
  void *p = tide_pinned_malloc(a, 100 * TU_KiB, NULL);
  assert_non_null(p);
  tu_assert_ok(tide_host_stream_hold(a, s));
  tu_assert_ok(tide_pinned_free(a, p, s));
  tide_stats st = pstats(a);
  assert_int_equal(st.allocated_bytes[TIDE_POOL_ALL].current, 0);
  assert_int_equal(st.active_bytes[TIDE_POOL_ALL].current, 128 * TU_KiB);
  assert_int_equal(st.active_blocks[TIDE_POOL_ALL].current, 1);
  assert_int_equal(st.active_bytes[TIDE_POOL_SMALL].current, 128 * TU_KiB);
  /* Not even its own stream may take it while s is busy with it. */
  void *q = tide_pinned_malloc(a, 100 * TU_KiB, NULL);
  assert_non_null(q);
  assert_ptr_not_equal(q, p);
  st = pstats(a);
  assert_int_equal(st.active_bytes[TIDE_POOL_ALL].current, 256 * TU_KiB);
  assert_int_equal(st.active_bytes[TIDE_POOL_ALL].peak, 256 * TU_KiB);
  assert_int_equal(st.allocated_bytes[TIDE_POOL_ALL].peak, 128 * TU_KiB);
  tu_assert_ok(tide_host_stream_release(a, s));
  void *r = tide_pinned_malloc(a, 100 * TU_KiB, NULL);
  assert_ptr_equal(r, p);
  st = pstats(a);
  assert_int_equal(st.active_bytes[TIDE_POOL_ALL].current, 256 * TU_KiB);
  assert_int_equal(st.active_blocks[TIDE_POOL_ALL].current, 2);
  tu_assert_ok(tide_pinned_free(a, q, NULL));
  tu_assert_ok(tide_pinned_free(a, r, NULL));
  tu_assert_ok(tide_stream_destroy(a, s));
  tu_assert_ok(tide_destroy(a));
}

static void pinned_record_stream(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tide_stream s = new_stream(a), s2 = new_stream(a);
  void *p = tide_pinned_malloc(a, 2 * TU_MiB, NULL);
  assert_non_null(p);
  tu_assert_ok(tide_host_stream_hold(a, s));
  tu_assert_ok(tide_pinned_record_stream(a, p, s));
  tu_assert_ok(tide_pinned_record_stream(a, p, s)); /* twice is once */
  tu_assert_ok(tide_pinned_record_stream(a, p, s2));
  tu_assert_ok(tide_pinned_record_stream(a, p, NULL)); /* its own stream: nothing */
  uint64_t records = calls(a, TIDE_OP_EVENT_RECORD);
  tu_assert_ok(tide_pinned_free(a, p, NULL));
  /* One event each on s and s2, and one on its own stream. */
  assert_int_equal(calls(a, TIDE_OP_EVENT_RECORD) - records, 3);
  assert_int_equal(pstats(a).active_bytes[TIDE_POOL_LARGE].current, 2 * TU_MiB);
  void *q = tide_pinned_malloc(a, 2 * TU_MiB, NULL);
  assert_ptr_not_equal(q, p);
  tu_assert_ok(tide_host_stream_release(a, s));
  void *r = tide_pinned_malloc(a, 2 * TU_MiB, NULL);
  assert_ptr_equal(r, p);
  assert_int_equal(pstats(a).active_blocks[TIDE_POOL_ALL].current, 2);

  /* Recorded only on its own stream: reused at once. */
  tu_assert_ok(tide_pinned_record_stream(a, r, NULL));
  tu_assert_ok(tide_pinned_free(a, r, NULL));
  assert_ptr_equal(tide_pinned_malloc(a, 2 * TU_MiB, NULL), r);
  tu_assert_ok(tide_pinned_free(a, q, NULL));
  tu_assert_ok(tide_pinned_free(a, r, NULL));
  tu_assert_ok(tide_stream_destroy(a, s));
  tu_assert_ok(tide_stream_destroy(a, s2));
  tu_assert_ok(tide_destroy(a));
}

static void pinned_empty_cache(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tide_stream s = new_stream(a);
  void *keep = tide_pinned_malloc(a, 10 * TU_KiB, NULL);
  void *p[4];
  for (int i = 0; i < 4; i++) {
    p[i] = tide_pinned_malloc(a, (size_t)(i + 1) * 300 * TU_KiB, NULL);
    assert_non_null(p[i]);
  }
  for (int i = 0; i < 4; i++) tu_assert_ok(tide_pinned_free(a, p[i], NULL));
  int64_t kept = 16 * TU_KiB;
  assert_int_equal(pstats(a).reserved_bytes[TIDE_POOL_ALL].current,
                   kept + (int64_t)(512 * TU_KiB + TU_MiB + TU_MiB + 2 * TU_MiB));
  tu_assert_ok(tide_pinned_empty_cache(a));
  tide_stats st = pstats(a);
  assert_int_equal(st.reserved_bytes[TIDE_POOL_ALL].current, kept);
  assert_int_equal(st.segments[TIDE_POOL_ALL].current, 1);
  assert_int_equal(st.segments_released, 4);
  assert_int_equal(st.num_device_free, 4);
  assert_int_equal(calls(a, TIDE_OP_HOST_FREE), 4);
  /* The block in use is untouched. */
  memset(keep, 7, 16 * TU_KiB);
  /* A freed pointer whose memory went back is no pinned memory any more. */
  tu_assert_status(tide_pinned_free(a, p[0], NULL), TIDE_ERR_BAD_POINTER);

  /* Blocks held up by streams: waited for, and kept if the wait cannot end. */
  void *pend = tide_pinned_malloc(a, 5000, NULL);
  void *own = tide_pinned_malloc(a, 70 * TU_KiB, s);
  tu_assert_ok(tide_host_stream_hold(a, s));
  tu_assert_ok(tide_pinned_free(a, pend, s)); /* waits for s */
  tu_assert_ok(tide_pinned_free(a, own, s));  /* free, but s's work may use it */
  tu_assert_status(tide_pinned_empty_cache(a), TIDE_ERR_NOT_READY);
  tu_assert_last_error(TIDE_ERR_NOT_READY, "held");
  assert_int_equal(pstats(a).reserved_bytes[TIDE_POOL_ALL].current,
                   kept + (int64_t)(8 * TU_KiB + 128 * TU_KiB));
  tu_assert_ok(tide_host_stream_release(a, s));
  tu_assert_ok(tide_pinned_empty_cache(a));
  st = pstats(a);
  assert_int_equal(st.reserved_bytes[TIDE_POOL_ALL].current, kept);
  assert_int_equal(st.active_bytes[TIDE_POOL_ALL].current, kept);
  tu_assert_ok(tide_pinned_free(a, keep, NULL));
  tu_assert_ok(tide_pinned_empty_cache(a));
  assert_int_equal(pstats(a).reserved_bytes[TIDE_POOL_ALL].current, 0);
  assert_int_equal(calls(a, TIDE_OP_HOST_ALLOC), calls(a, TIDE_OP_HOST_FREE));
  tu_assert_ok(tide_pinned_empty_cache(a)); /* nothing to do */
  tu_assert_ok(tide_stream_destroy(a, s));
  tu_assert_ok(tide_destroy(a));
}

/* ------------------------------------------------------------------------ */
/* Out of memory                                                             */
/* ------------------------------------------------------------------------ */

static void pinned_oom_returns_cache_and_fails(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  void *cached = tide_pinned_malloc(a, 4096, NULL);
  tu_assert_ok(tide_pinned_free(a, cached, NULL));
  /* No host can pin 1 PiB (it does not even fit the address space). */
  assert_null(tide_pinned_malloc(a, (size_t)1 << 50, NULL));
  tu_assert_last_error(TIDE_ERR_OOM, "out of pinned host memory");
  tu_assert_last_error(TIDE_ERR_OOM, "1.00 PiB");
  tu_assert_last_error(TIDE_ERR_OOM, "tide_pinned_free");
  tide_stats st = pstats(a);
  assert_int_equal(st.num_ooms, 1);
  assert_int_equal(st.num_alloc_retries, 1);
  assert_int_equal(st.num_sync_all_streams, 1);
  assert_int_equal(st.reserved_bytes[TIDE_POOL_ALL].current, 0); /* the cache went back */
  assert_int_equal(calls(a, TIDE_OP_HOST_ALLOC), 3);             /* 1 + try + retry */
  /* The pool still works. */
  void *p = tide_pinned_malloc(a, 4096, NULL);
  assert_non_null(p);
  tu_assert_ok(tide_pinned_free(a, p, NULL));
  tu_assert_ok(tide_destroy(a));
}

static void pinned_injected_failure_retried(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  void *cached = tide_pinned_malloc(a, 4096, NULL);
  tu_assert_ok(tide_pinned_free(a, cached, NULL));
  uint64_t frees = calls(a, TIDE_OP_HOST_FREE);
  tu_assert_ok(tide_host_fail_call(a, TIDE_OP_HOST_ALLOC, 1));
  void *p = tide_pinned_malloc(a, 8192, NULL);
  if (!p) fail_msg("the retry should have succeeded: %s", tide_last_error());
  assert_int_equal(calls(a, TIDE_OP_HOST_FREE) - frees, 1); /* the cache went first */
  tide_stats st = pstats(a);
  assert_int_equal(st.num_alloc_retries, 1);
  assert_int_equal(st.num_ooms, 0);
  assert_int_equal(st.reserved_bytes[TIDE_POOL_ALL].current, 8192);
  assert_int_equal(st.allocated_bytes[TIDE_POOL_ALL].current, 8192);

  /* Both tries fail: NULL, the backend's status, both causes, nothing held. */
  tu_assert_ok(tide_host_fail_call(a, TIDE_OP_HOST_ALLOC, 1));
  tu_assert_ok(tide_host_fail_call(a, TIDE_OP_ANY, 2));
  assert_null(tide_pinned_malloc(a, 3 * TU_MiB, NULL));
  tu_assert_last_error(TIDE_ERR_BACKEND, "injected failure: host_alloc");
  tu_assert_last_error(TIDE_ERR_BACKEND, "again after the pinned cache was returned");
  tu_assert_last_error(TIDE_ERR_BACKEND, "of any operation");
  st = pstats(a);
  assert_int_equal(st.num_alloc_retries, 2);
  assert_int_equal(st.reserved_bytes[TIDE_POOL_ALL].current, 8192);
  assert_int_equal(st.allocations[TIDE_POOL_ALL].current, 1);
  tu_assert_ok(tide_pinned_free(a, p, NULL));
  tu_assert_ok(tide_destroy(a));
}

/* A free records an event on each other stream that used the block and
 * one on its own stream. An event that cannot be had is replaced by waiting
 * for the stream; when that fails too, the free fails and changes nothing. */
static void pinned_free_faults(void **state) {
  (void)state;
  static const tide_backend_op ops[] = {TIDE_OP_EVENT_CREATE, TIDE_OP_EVENT_RECORD};
  for (size_t k = 0; k < sizeof ops / sizeof ops[0]; k++) {
    for (uint64_t n = 1; n <= 2; n++) { /* 1: the other stream's event, 2: its own */
      for (int sync_fails = 0; sync_fails <= 1; sync_fails++) {
        tide_allocator *a = tu_create(NULL);
        tide_stream s = new_stream(a);
        void *p = tide_pinned_malloc(a, 4096, NULL);
        assert_non_null(p);
        tu_assert_ok(tide_pinned_record_stream(a, p, s));
        uint64_t syncs = calls(a, TIDE_OP_STREAM_SYNCHRONIZE);
        tu_assert_ok(tide_host_fail_call(a, ops[k], n));
        if (sync_fails) tu_assert_ok(tide_host_fail_call(a, TIDE_OP_STREAM_SYNCHRONIZE, 1));
        tide_status rc = tide_pinned_free(a, p, NULL);
        assert_int_equal(calls(a, TIDE_OP_STREAM_SYNCHRONIZE) - syncs, 1);
        if (sync_fails) {
          tu_assert_status(rc, TIDE_ERR_BACKEND);
          tu_assert_last_error(TIDE_ERR_BACKEND, "the block is still allocated");
          tu_assert_last_error(TIDE_ERR_BACKEND, "injected failure: stream_synchronize");
          assert_int_equal(pstats(a).allocations[TIDE_POOL_ALL].current, 1);
          assert_int_equal(pstats(a).active_blocks[TIDE_POOL_ALL].current, 1);
          tu_assert_ok(tide_pinned_free(a, p, NULL));
        } else {
          tu_assert_ok(rc);
        }
        tide_stats st = pstats(a);
        assert_int_equal(st.allocations[TIDE_POOL_ALL].current, 0);
        assert_int_equal(st.num_frees, 1);
        /* It is reusable, and nothing was lost. */
        assert_ptr_equal(tide_pinned_malloc(a, 4096, NULL), p);
        tu_assert_ok(tide_pinned_free(a, p, NULL));
        tu_assert_ok(tide_pinned_empty_cache(a));
        st = pstats(a);
        assert_int_equal(st.reserved_bytes[TIDE_POOL_ALL].current, 0);
        assert_int_equal(st.active_blocks[TIDE_POOL_ALL].current, 0);
        tu_assert_ok(tide_stream_destroy(a, s));
        tu_assert_ok(tide_destroy(a));
      }
    }
  }
}

/* ------------------------------------------------------------------------ */
/* Bad input                                                                 */
/* ------------------------------------------------------------------------ */

static void pinned_bad_pointers(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  int local = 0;
  tu_assert_ok(tide_pinned_free(a, NULL, NULL));
  tu_assert_status(tide_pinned_free(a, &local, NULL), TIDE_ERR_BAD_POINTER);
  tu_assert_last_error(TIDE_ERR_BAD_POINTER, "not pinned memory of this allocator");

  char *p = tide_pinned_malloc(a, 100, NULL);
  assert_non_null(p);
  tu_assert_status(tide_pinned_free(a, p + 8, NULL), TIDE_ERR_BAD_POINTER);
  tu_assert_last_error(TIDE_ERR_BAD_POINTER, "lies 8 bytes into the block");
  tu_assert_status(tide_pinned_record_stream(a, p + 8, NULL), TIDE_ERR_BAD_POINTER);
  assert_int_equal(pstats(a).allocations[TIDE_POOL_ALL].current, 1);

  tu_assert_ok(tide_pinned_free(a, p, NULL));
  tu_assert_status(tide_pinned_free(a, p, NULL), TIDE_ERR_DOUBLE_FREE);
  tu_assert_last_error(TIDE_ERR_DOUBLE_FREE, "double free");
  tu_assert_status(tide_pinned_free(a, p + 64, NULL), TIDE_ERR_DOUBLE_FREE);
  tu_assert_status(tide_pinned_record_stream(a, p, NULL), TIDE_ERR_DOUBLE_FREE);
  tide_stats st = pstats(a);
  assert_int_equal(st.num_frees, 1);
  assert_int_equal(st.allocations[TIDE_POOL_ALL].current, 0);
  tu_assert_status(tide_pinned_record_stream(a, NULL, NULL), TIDE_ERR_INVALID);

  /* Device memory and pinned memory are not each other's. */
  void *d = tide_malloc(a, 4096, NULL);
  assert_non_null(d);
  tu_assert_status(tide_pinned_free(a, d, NULL), TIDE_ERR_BAD_POINTER);
  tu_assert_last_error(TIDE_ERR_BAD_POINTER, "device memory from tide_malloc");
  tu_assert_status(tide_pinned_free(a, (char *)d + 512, NULL), TIDE_ERR_BAD_POINTER);
  tu_assert_last_error(TIDE_ERR_BAD_POINTER, "device memory");
  void *q = tide_pinned_malloc(a, 100, NULL);
  tu_assert_status(tide_free(a, q, NULL), TIDE_ERR_BAD_POINTER);
  tu_assert_ok(tide_free(a, d, NULL));
  tu_assert_ok(tide_pinned_free(a, q, NULL));

  /* Sizes. */
  assert_null(tide_pinned_malloc(a, 0, NULL));
  tu_assert_last_error(TIDE_ERR_INVALID, "size 0");
  assert_null(tide_pinned_malloc(a, SIZE_MAX, NULL));
  tu_assert_last_error(TIDE_ERR_INVALID, "larger than any host");
  assert_null(tide_pinned_malloc(a, ((size_t)1 << 52) + 1, NULL));
  tu_assert_last_error(TIDE_ERR_INVALID, NULL);
  tu_assert_ok(tide_destroy(a));
}

static void pinned_bad_streams(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tide_stream bogus = (tide_stream)(uintptr_t)0x12345;
  assert_null(tide_pinned_malloc(a, 100, bogus));
  tu_assert_last_error(TIDE_ERR_INVALID, "not a stream of this device");
  void *p = tide_pinned_malloc(a, 100, NULL);
  tu_assert_status(tide_pinned_free(a, p, bogus), TIDE_ERR_INVALID);
  tu_assert_last_error(TIDE_ERR_INVALID, "still allocated");
  tu_assert_status(tide_pinned_record_stream(a, p, bogus), TIDE_ERR_INVALID);
  tide_stream gone = new_stream(a);
  tu_assert_ok(tide_stream_destroy(a, gone));
  assert_null(tide_pinned_malloc(a, 100, gone));
  tu_assert_last_error(TIDE_ERR_INVALID, NULL);
  tu_assert_status(tide_pinned_free(a, p, gone), TIDE_ERR_INVALID);
  assert_int_equal(pstats(a).allocations[TIDE_POOL_ALL].current, 1);
  tu_assert_ok(tide_pinned_free(a, p, NULL));
  tu_assert_ok(tide_destroy(a));
}

static void pinned_bad_allocator(void **state) {
  (void)state;
  tide_stats st;
  assert_null(tide_pinned_malloc(NULL, 100, NULL));
  tu_assert_last_error(TIDE_ERR_INVALID, "not a live tidalloc allocator");
  tu_assert_status(tide_pinned_free(NULL, &st, NULL), TIDE_ERR_INVALID);
  tu_assert_status(tide_pinned_record_stream(NULL, &st, NULL), TIDE_ERR_INVALID);
  tu_assert_status(tide_pinned_empty_cache(NULL), TIDE_ERR_INVALID);
  tu_assert_status(tide_pinned_get_stats(NULL, &st), TIDE_ERR_INVALID);
  tide_allocator *a = tu_create(NULL);
  tu_assert_status(tide_pinned_get_stats(a, NULL), TIDE_ERR_INVALID);
  tu_assert_ok(tide_destroy(a));
}

/* ------------------------------------------------------------------------ */
/* Streams that go, allocators that go                                       */
/* ------------------------------------------------------------------------ */

static void pinned_destroyed_stream(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tide_stream s = new_stream(a);
  void *cached = tide_pinned_malloc(a, 4096, s);
  void *live = tide_pinned_malloc(a, 8192, s);
  tu_assert_ok(tide_pinned_free(a, cached, s));
  tu_assert_ok(tide_stream_destroy(a, s));
  /* Its work is done: other streams take its cached block. */
  assert_ptr_equal(tide_pinned_malloc(a, 4096, NULL), cached);
  /* A block of the gone stream is freed naming a living one. */
  tu_assert_ok(tide_pinned_free(a, live, NULL));
  assert_ptr_equal(tide_pinned_malloc(a, 8192, NULL), live);
  /* A new stream (maybe with the old one's id) does not inherit anything
   * at once by mistake: it gets what is free and settled, nothing else. */
  tide_stream s2 = new_stream(a);
  tu_assert_ok(tide_pinned_free(a, cached, NULL));
  void *again = tide_pinned_malloc(a, 4096, s2);
  assert_ptr_equal(again, cached);
  tu_assert_ok(tide_pinned_free(a, again, s2));
  tu_assert_ok(tide_pinned_free(a, live, NULL));
  tu_assert_ok(tide_stream_destroy(a, s2));
  tu_assert_ok(tide_destroy(a));
}

static void pinned_destroy_with_blocks_in_use(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tide_stream s = new_stream(a);
  void *p = tide_pinned_malloc(a, 4096, NULL);
  void *q = tide_pinned_malloc(a, 4096, NULL);
  void *r = tide_pinned_malloc(a, 4096, NULL);
  assert_non_null(p);
  assert_non_null(r);
  tu_assert_ok(tide_host_stream_hold(a, s));
  tu_assert_ok(tide_pinned_free(a, q, s));    /* pending at teardown */
  tu_assert_ok(tide_pinned_free(a, r, NULL)); /* cached */
  tu_assert_status(tide_destroy(a), TIDE_ERR_STATE);
  tu_assert_last_error(TIDE_ERR_STATE, "2 block(s)");
}

/* ------------------------------------------------------------------------ */
/* Threads                                                                   */
/* ------------------------------------------------------------------------ */

#define THREADS 8
#define ROUNDS 1500
#define LIVE 12

typedef struct worker {
  tide_allocator *a;
  tide_stream stream, other;
  unsigned id;
  uint64_t allocs, failures;
} worker;

static void *work(void *arg) {
  worker *w = arg;
  tu_rng rng;
  tu_rng_seed(&rng, 1000 + w->id);
  void *live[LIVE] = {0};
  size_t size[LIVE] = {0};
  uint64_t seq[LIVE] = {0};
  tu_pattern_shape shape = TU_PATTERN_DEFAULT;
  for (unsigned round = 0; round < ROUNDS; round++) {
    unsigned i = (unsigned)tu_below(&rng, LIVE);
    if (live[i]) {
      if (tu_check(live[i], size[i], seq[i], shape) != SIZE_MAX) w->failures++;
      uint64_t how = tu_below(&rng, 4);
      if (how == 0 && tide_pinned_record_stream(w->a, live[i], w->other) != TIDE_OK) w->failures++;
      tide_stream on = how == 1 ? w->other : w->stream;
      if (tide_pinned_free(w->a, live[i], on) != TIDE_OK) w->failures++;
      live[i] = NULL;
      continue;
    }
    size[i] = tu_log_uniform(&rng, 8, 600 * TU_KiB) & ~(size_t)7;
    seq[i] = ((uint64_t)w->id << 32) | round;
    live[i] = tide_pinned_malloc(w->a, size[i], w->stream);
    if (!live[i]) {
      w->failures++;
      continue;
    }
    w->allocs++;
    tu_fill(live[i], size[i], seq[i], shape);
  }
  for (unsigned i = 0; i < LIVE; i++) {
    if (!live[i]) continue;
    if (tu_check(live[i], size[i], seq[i], shape) != SIZE_MAX) w->failures++;
    if (tide_pinned_free(w->a, live[i], w->stream) != TIDE_OK) w->failures++;
  }
  return NULL;
}

static void pinned_threads(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  worker w[THREADS];
  pthread_t t[THREADS];
  for (unsigned i = 0; i < THREADS; i++) {
    w[i] = (worker){.a = a, .id = i, .stream = new_stream(a)};
  }
  for (unsigned i = 0; i < THREADS; i++) w[i].other = w[(i + 1) % THREADS].stream;
  for (unsigned i = 0; i < THREADS; i++)
    assert_int_equal(pthread_create(&t[i], NULL, work, &w[i]), 0);
  /* Meanwhile, the stats and the cache may be asked for. */
  for (int i = 0; i < 50; i++) {
    tide_stats st = pstats(a);
    assert_true(st.allocated_bytes[TIDE_POOL_ALL].current <=
                st.reserved_bytes[TIDE_POOL_ALL].current);
    if (i % 10 == 0) tu_assert_ok(tide_pinned_empty_cache(a));
  }
  uint64_t allocs = 0;
  for (unsigned i = 0; i < THREADS; i++) {
    assert_int_equal(pthread_join(t[i], NULL), 0);
    if (w[i].failures) fail_msg("thread %u: %llu failure(s)", i, (unsigned long long)w[i].failures);
    allocs += w[i].allocs;
  }
  tide_stats st = pstats(a);
  assert_int_equal(st.num_allocs, allocs);
  assert_int_equal(st.num_frees, allocs);
  assert_int_equal(st.allocated_bytes[TIDE_POOL_ALL].current, 0);
  assert_int_equal(st.requested_bytes[TIDE_POOL_ALL].current, 0);
  assert_true(st.allocated_bytes[TIDE_POOL_ALL].peak > 0);
  /* Frees on other streams wait for their events until the pool next looks. */
  tu_assert_ok(tide_pinned_empty_cache(a));
  st = pstats(a);
  assert_int_equal(st.active_blocks[TIDE_POOL_ALL].current, 0);
  assert_int_equal(st.reserved_bytes[TIDE_POOL_ALL].current, 0);
  assert_int_equal(calls(a, TIDE_OP_HOST_ALLOC), calls(a, TIDE_OP_HOST_FREE));
  assert_int_equal(st.num_device_alloc, calls(a, TIDE_OP_HOST_ALLOC));
  for (unsigned i = 0; i < THREADS; i++) tu_assert_ok(tide_stream_destroy(a, w[i].stream));
  tu_assert_ok(tide_destroy(a));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(pinned_sizes_and_alignment),
      cmocka_unit_test(pinned_reuse_by_class),
      cmocka_unit_test(pinned_own_stream_then_others),
      cmocka_unit_test(pinned_free_on_other_stream),
      cmocka_unit_test(pinned_record_stream),
      cmocka_unit_test(pinned_empty_cache),
      cmocka_unit_test(pinned_oom_returns_cache_and_fails),
      cmocka_unit_test(pinned_injected_failure_retried),
      cmocka_unit_test(pinned_free_faults),
      cmocka_unit_test(pinned_bad_pointers),
      cmocka_unit_test(pinned_bad_streams),
      cmocka_unit_test(pinned_bad_allocator),
      cmocka_unit_test(pinned_destroyed_stream),
      cmocka_unit_test(pinned_destroy_with_blocks_in_use),
      cmocka_unit_test(pinned_threads),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
