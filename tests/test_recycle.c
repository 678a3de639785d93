/* test_recycle.c: growth that reuses the pages of freed blocks (under
 * pressure: the memory limit reached) without waiting for the stream. The pages leave their segment
 * at once, their handles are mapped again where growth needs them, and their old addresses stay
 * mapped until the work queued before the free is done (idle marks), so a kernel still reading the
 * freed block reads what it held. Checked on the host backend: no stream synchronization in a
 * concatenating loop, old addresses still readable while the stream is
 * held, all of them unmapped once it is released, and tide_check after
 * every step. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "testutil.h"

#define CONF "backend:host,host_capacity:4GiB,memory_limit:400MiB"

/* One step of a growing cache: a block `grow` larger than the last, the
 * last copied in and freed, then a small block after it so holes stay
 * apart. Returns the new cache. */
static uint8_t *concat_step(tide_allocator *a, tide_stream s, uint8_t *cache, size_t *size,
                            size_t grow, void **pins, int i) {
  uint8_t *next = tide_malloc(a, *size + grow, s);
  assert_non_null(next);
  if (cache) {
    memcpy(next, cache, *size); /* the host backend's memory is the CPU's */
    tu_assert_ok(tide_free(a, cache, s));
  }
  memset(next + *size, (uint8_t)i, grow);
  *size += grow;
  assert_non_null(pins[i] = tide_malloc(a, 2 * TU_MiB + 4096, s));
  tu_assert_ok(tide_check(a));
  return next;
}

static void check_cache(const uint8_t *cache, size_t grow, int steps) {
  for (int i = 0; i < steps; i++)
    for (size_t k = 0; k < grow; k += 4096)
      assert_int_equal(cache[(size_t)i * grow + k], (uint8_t)i);
}

/* state: the configuration (capture_detection too: PyTorch's, where a
 * capture may begin unannounced and the stream is asked instead). */
static void test_no_synchronization(void **state) {
  tide_allocator *a = tu_create(*state);
  void *pins[64];
  size_t size = 0, grow = 3 * TU_MiB;
  uint8_t *cache = NULL;
  for (int i = 0; i < 40; i++) cache = concat_step(a, NULL, cache, &size, grow, pins, i);
  tide_stats st = tu_stats(a);
  assert_true(st.pages_unmapped > 0); /* pages were recycled */
  assert_int_equal(tide_host_call_count(a, TIDE_OP_STREAM_SYNCHRONIZE), 0);
  assert_int_equal(st.stream_waits, 0);
  check_cache(cache, grow, 40);
  tu_assert_ok(tide_free(a, cache, NULL));
  for (int i = 0; i < 40; i++) tu_assert_ok(tide_free(a, pins[i], NULL));
  tu_assert_ok(tide_empty_cache(a));
  st = tu_stats(a);
  assert_int_equal(st.reserved_bytes[TIDE_POOL_ALL].current, 0);
  assert_int_equal(tide_host_bytes_in_use(a), 0);
  tu_assert_ok(tide_destroy(a));
}

/* While the stream is held (its queued work never completes), a freed
 * block's old address stays mapped with its data, even after its pages
 * were taken for growth elsewhere; once released, the next growth unmaps
 * them. */
static void test_old_addresses_stay_until_idle(void **state) {
  (void)state;
  tide_allocator *a = tu_create(CONF);
  tide_stream s;
  tu_assert_ok(tide_stream_create(a, &s));
  void *pins[64];
  size_t size = 0, grow = 3 * TU_MiB;
  uint8_t *cache = NULL, *old[12];
  for (int i = 0; i < 4; i++) cache = concat_step(a, s, cache, &size, grow, pins, i);
  tu_assert_ok(tide_host_stream_hold(a, s));
  /* A limit close above what the held steps keep live: they must recycle. */
  tu_assert_ok(tide_set_memory_limit(a, 104 * TU_MiB));
  uint64_t unmapped_before = tu_stats(a).pages_unmapped;
  for (int i = 4; i < 12; i++) {
    old[i] = cache;
    cache = concat_step(a, s, cache, &size, grow, pins, i);
  }
  assert_true(tu_stats(a).pages_unmapped > unmapped_before); /* recycled while held */
  assert_int_equal(tide_host_call_count(a, TIDE_OP_STREAM_SYNCHRONIZE), 0);
  /* Every freed cache of the held stream is still mapped, since work
   * queued before its free may read it: a read of an unmapped page would
   * fault here. (Its bytes are those of whoever got the physical pages
   * since: on a device, stream order runs the old readers first.) */
  unsigned sum = 0;
  for (int i = 4; i < 12; i++)
    for (size_t k = 0; k < (size_t)i * grow; k += 4096) sum += ((volatile uint8_t *)old[i])[k];
  (void)sum;
  tu_assert_ok(tide_host_stream_release(a, s));
  tu_assert_ok(tide_set_memory_limit(a, 400 * TU_MiB));
  for (int i = 12; i < 16; i++) cache = concat_step(a, s, cache, &size, grow, pins, i);
  check_cache(cache, grow, 16);
  tu_assert_ok(tide_free(a, cache, s));
  for (int i = 0; i < 16; i++) tu_assert_ok(tide_free(a, pins[i], s));
  tu_assert_ok(tide_empty_cache(a));
  assert_int_equal(tu_stats(a).reserved_bytes[TIDE_POOL_ALL].current, 0);
  assert_int_equal(tide_host_bytes_in_use(a), 0);
  tu_assert_ok(tide_stream_destroy(a, s));
  tu_assert_ok(tide_destroy(a));
}

/* Destroying the allocator with stale pages left unmaps them. */
static void test_destroy_with_stale_pages(void **state) {
  (void)state;
  tide_allocator *a = tu_create(CONF);
  tide_stream s;
  tu_assert_ok(tide_stream_create(a, &s));
  void *pins[64];
  size_t size = 0, grow = 3 * TU_MiB;
  uint8_t *cache = NULL;
  tu_assert_ok(tide_host_stream_hold(a, s));
  for (int i = 0; i < 8; i++) cache = concat_step(a, s, cache, &size, grow, pins, i);
  tu_assert_ok(tide_host_stream_release(a, s));
  tu_assert_ok(tide_free(a, cache, s));
  for (int i = 0; i < 8; i++) tu_assert_ok(tide_free(a, pins[i], s));
  tu_assert_ok(tide_stream_destroy(a, s));
  tu_assert_ok(tide_destroy(a));
}

/* Random frees and allocations on a stream held now and then (its queued
 * work not done, so the pages it freed stay mapped as stale ones): no
 * allocation may fail while the device has room. Growth that would have
 * to wait for the held stream maps elsewhere instead: the far end of the
 * hole, or a new virtual range. */
static void held_stream_workload(uint64_t seed) {
  tide_allocator *a = tu_create("backend:host,host_capacity:256MiB");
  tide_stream s;
  tu_assert_ok(tide_stream_create(a, &s));
  void *live[64] = {0};
  bool held = false;
  tu_rng r;
  tu_rng_seed(&r, seed);
  for (int step = 0; step < 3000; step++) {
    int i = (int)tu_below(&r, 64);
    if (tu_below(&r, 100) < 5) {
      tu_assert_ok(held ? tide_host_stream_release(a, s) : tide_host_stream_hold(a, s));
      held = !held;
    } else if (live[i]) {
      tu_assert_ok(tide_free(a, live[i], s));
      live[i] = NULL;
    } else {
      size_t size = (size_t)(tu_below(&r, 24) + 1) << 19; /* 0.5 .. 12 MiB */
      live[i] = tide_malloc(a, size, s);
      int64_t reserved = tu_stats(a).reserved_bytes[TIDE_POOL_ALL].current;
      if (!live[i] && reserved + (int64_t)size < 200 * (int64_t)TU_MiB)
        fail_msg("seed %llu, step %d: %zu bytes refused with %lld MiB reserved of 256: %s",
                 (unsigned long long)seed, step, size, (long long)(reserved / (int64_t)TU_MiB),
                 tide_last_error());
    }
  }
  tu_assert_ok(tide_check(a));
  if (held) tu_assert_ok(tide_host_stream_release(a, s));
  for (int i = 0; i < 64; i++)
    if (live[i]) tu_assert_ok(tide_free(a, live[i], s));
  tu_assert_ok(tide_empty_cache(a));
  assert_int_equal(tide_host_bytes_in_use(a), 0);
  tu_assert_ok(tide_stream_destroy(a, s));
  tu_assert_ok(tide_destroy(a));
}

static void test_growth_does_not_wait_for_a_held_stream(void **state) {
  (void)state;
  for (uint64_t seed = 1; seed <= 40; seed++) held_stream_workload(seed);
}

/* handle_size_mb:16 with 2 MiB pages: a request of at least four 16 MiB
 * handles grows a segment of 8-page handles (one mapping each); smaller ones
 * stay on one handle per page; a partly used large handle stays mapped when
 * the cache is emptied, the free ones go, whole. */
static void test_large_handles(void **state) {
  (void)state;
  tide_allocator *a =
      tu_create("host_capacity:1GiB,handle_size_mb:16,handle_threshold_mb:0,load_handles:False");
  void *small = tide_malloc(a, 6 * TU_MiB, NULL);
  assert_non_null(small);
  tide_stats st = tu_stats(a);
  assert_int_equal(st.mappings, 3); /* three pages, a handle each */
  void *big = tide_malloc(a, 64 * TU_MiB, NULL);
  assert_non_null(big);
  st = tu_stats(a);
  assert_int_equal(st.mappings, 3 + 4);
  assert_int_equal(st.pages_mapped, 3 + 32);
  assert_int_equal(st.segments[TIDE_POOL_LARGE].current, 2);
  assert_int_equal(tide_host_bytes_in_use(a), 70 * TU_MiB);
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_free(a, big, NULL));
  /* 20 MiB from the free 64: the first handle and part of the second. */
  void *part = tide_malloc(a, 20 * TU_MiB, NULL);
  assert_non_null(part);
  assert_int_equal(tu_stats(a).mappings, 7); /* a free block fitted */
  tu_assert_ok(tide_empty_cache(a));
  st = tu_stats(a);
  assert_int_equal(st.unmappings, 2); /* the last two handles */
  assert_int_equal(st.reserved_bytes[TIDE_POOL_ALL].current, (int64_t)(6 + 32) * TU_MiB);
  assert_int_equal(tide_host_bytes_in_use(a), 38 * TU_MiB);
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_free(a, part, NULL));
  tu_assert_ok(tide_free(a, small, NULL));
  tu_assert_ok(tide_empty_cache(a));
  assert_int_equal(tide_host_bytes_in_use(a), 0);
  assert_int_equal(tide_host_mappings(a), 0);
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_destroy(a));
}

/* handle_threshold_mb:128: the first large request, in an arena holding
 * less, grows the segment of one page per handle; once the arena holds
 * 128 MiB, the next one gets large handles. */
static void test_large_handles_after_threshold(void **state) {
  (void)state;
  tide_allocator *a =
      tu_create("host_capacity:1GiB,handle_size_mb:16,handle_threshold_mb:128,load_handles:False");
  void *first = tide_malloc(a, 130 * TU_MiB, NULL);
  assert_non_null(first);
  tide_stats st = tu_stats(a);
  assert_int_equal(st.mappings, 65); /* a handle per page */
  assert_int_equal(st.segments[TIDE_POOL_LARGE].current, 1);
  void *second = tide_malloc(a, 64 * TU_MiB, NULL);
  assert_non_null(second);
  st = tu_stats(a);
  assert_int_equal(st.mappings, 65 + 4); /* four 16 MiB handles */
  assert_int_equal(st.segments[TIDE_POOL_LARGE].current, 2);
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_free(a, second, NULL));
  tu_assert_ok(tide_free(a, first, NULL));
  tu_assert_ok(tide_empty_cache(a));
  assert_int_equal(tide_host_bytes_in_use(a), 0);
  tu_assert_ok(tide_destroy(a));
}

/* Free pages unmapped to make room for a growth into a segment of large
 * handles cannot be mapped there (their handles hold one page): they go back
 * before the growth creates its handles, so reserved memory never holds
 * both. */
static void test_large_handles_after_unmapped_pages(void **state) {
  (void)state;
  tide_allocator *a =
      tu_create("host_capacity:1GiB,handle_size_mb:4,handle_threshold_mb:0,memory_limit:20MiB");
  void *p[3];
  for (int i = 0; i < 3; i++) assert_non_null(p[i] = tide_malloc(a, 6 * TU_MiB, NULL));
  for (int i = 0; i < 3; i++) tu_assert_ok(tide_free(a, p[i], NULL));
  void *big = tide_malloc(a, 20 * TU_MiB, NULL); /* five 4 MiB handles */
  assert_non_null(big);
  tide_stats st = tu_stats(a);
  assert_int_equal(st.segments[TIDE_POOL_LARGE].current, 2);
  assert_int_equal(st.reserved_bytes[TIDE_POOL_ALL].current, 20 * TU_MiB);
  assert_int_equal(st.reserved_bytes[TIDE_POOL_ALL].peak, 20 * TU_MiB);
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_free(a, big, NULL));
  tu_assert_ok(tide_destroy(a));
}

/* Growth under pressure makes its room in whole handles: a small pool's
 * page (2 MiB) asks for less than the large pool's 4 MiB handles hold, and
 * a handle is unmapped only whole. `limit`: the memory_limit. */
static tide_stats small_growth_beside_a_free_handle(const char *limit) {
  char conf[160];
  snprintf(conf, sizeof conf,
           "host_capacity:1GiB,handle_size_mb:4,handle_threshold_mb:0,"
           "load_handles:False,memory_limit:%s",
           limit);
  tide_allocator *a = tu_create(conf);
  void *first = tide_malloc(a, 16 * TU_MiB, NULL), *second = tide_malloc(a, 16 * TU_MiB, NULL);
  assert_non_null(first);
  assert_non_null(second);
  assert_int_equal(tu_stats(a).reserved_bytes[TIDE_POOL_ALL].current, 32 * TU_MiB);
  tu_assert_ok(tide_free(a, first, NULL));
  void *small = tide_malloc(a, 512 * 1024, NULL); /* the small pool's first page */
  assert_non_null(small);
  tu_assert_ok(tide_check(a));
  tide_stats st = tu_stats(a);
  tu_assert_ok(tide_free(a, small, NULL));
  tu_assert_ok(tide_free(a, second, NULL));
  tu_assert_ok(tide_empty_cache(a));
  assert_int_equal(tide_host_bytes_in_use(a), 0);
  tu_assert_ok(tide_destroy(a));
  return st;
}

static void test_pressure_releases_whole_handles(void **state) {
  (void)state;
  /* At the limit, one 4 MiB handle of the free block goes for the 2 MiB
   * page: reserved stays at its peak. */
  tide_stats st = small_growth_beside_a_free_handle("32MiB");
  assert_int_equal(st.unmappings, 1);
  assert_int_equal(st.reserved_bytes[TIDE_POOL_ALL].current, 30 * TU_MiB);
  assert_int_equal(st.reserved_bytes[TIDE_POOL_ALL].peak, 32 * TU_MiB);
  /* Without pressure (no limit), nothing is released and the page adds. */
  st = small_growth_beside_a_free_handle("0");
  assert_int_equal(st.unmappings, 0);
  assert_int_equal(st.reserved_bytes[TIDE_POOL_ALL].peak, 34 * TU_MiB);
}

/* A small pool's page grown beside a free 16 MiB block of 4 MiB handles
 * that queued work may still read (no idle mark follows its free), under
 * memory_limit `limit`: the stats after the growth, and in *syncs the
 * stream synchronizations it took. */
static tide_stats small_growth_beside_a_busy_handle(const char *limit, uint64_t *syncs) {
  char conf[160];
  snprintf(conf, sizeof conf,
           "host_capacity:1GiB,handle_size_mb:4,handle_threshold_mb:0,"
           "load_handles:False,memory_limit:%s",
           limit);
  tide_allocator *a = tu_create(conf);
  tide_stream s;
  tu_assert_ok(tide_stream_create(a, &s));
  void *first = tide_malloc(a, 16 * TU_MiB, s), *second = tide_malloc(a, 16 * TU_MiB, s);
  assert_non_null(first);
  assert_non_null(second);
  tu_assert_ok(tide_free(a, first, s)); /* no idle mark yet: it may be in use */
  void *small = tide_malloc(a, 512 * 1024, s);
  assert_non_null(small);
  tide_stats st = tu_stats(a);
  *syncs = tide_host_call_count(a, TIDE_OP_STREAM_SYNCHRONIZE);
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_free(a, small, s));
  tu_assert_ok(tide_free(a, second, s));
  tu_assert_ok(tide_empty_cache(a));
  assert_int_equal(tide_host_bytes_in_use(a), 0);
  tu_assert_ok(tide_stream_destroy(a, s));
  tu_assert_ok(tide_destroy(a));
  return st;
}

/* Pages released for a growth that cannot map their handles again (4 MiB
 * handles for a small pool's 2 MiB page) are unmapped before the growth,
 * after one stream synchronization since the work queued before their free
 * may still read them: deferred, they would stay mapped, and reserved,
 * beside the growth's new page until the stream got past them (on a GPU,
 * the queue's length; the host backend's streams are done at once, so the
 * synchronization is what shows it here). */
static void test_release_of_other_handles_is_not_deferred(void **state) {
  (void)state;
  uint64_t syncs;
  tide_stats st = small_growth_beside_a_busy_handle("32MiB", &syncs); /* 34 MiB is past it */
  assert_int_equal(st.reserved_bytes[TIDE_POOL_ALL].peak, 32 * TU_MiB);
  assert_int_equal(st.reserved_bytes[TIDE_POOL_ALL].current, 30 * TU_MiB);
  assert_int_equal(syncs, 1);
  assert_int_equal(st.stream_waits, 1); /* the statistics say so too */
}

/* The same growth without pressure (no limit) leaves the busy handle
 * cached rather than wait for the stream: no synchronization, and the page
 * adds to reserved memory. */
static void test_busy_pages_stay_cached_without_pressure(void **state) {
  (void)state;
  uint64_t syncs;
  tide_stats st = small_growth_beside_a_busy_handle("0", &syncs);
  assert_int_equal(syncs, 0);
  assert_int_equal(st.stream_waits, 0);
  assert_int_equal(st.unmappings, 0);
  assert_int_equal(st.reserved_bytes[TIDE_POOL_ALL].current, 34 * TU_MiB);
}

/* Two 8 MiB blocks, x and y, and a 64 MiB growable buffer on the default
 * stream, x freed (with host_queue_depth, its readers may not be done). */
static tide_buf *buffer_beside_a_freed_block(tide_allocator *a, void **y) {
  void *x = tide_malloc(a, 8 * TU_MiB, NULL);
  *y = tide_malloc(a, 8 * TU_MiB, NULL);
  assert_non_null(x);
  assert_non_null(*y);
  tide_buf_options o;
  tide_buf_options_init(&o);
  o.capacity = 64 * TU_MiB;
  tide_buf *b;
  tu_assert_ok(tide_buf_create(a, &o, &b));
  tu_assert_ok(tide_free(a, x, NULL));
  return b;
}

/* A growable buffer making room at the limit takes free pages that queued
 * work may still read: it waits, but only as far as the idle mark recorded
 * after their free (an event), not for the whole stream, whose later work
 * then keeps the device busy. The stream's work never completes here
 * unless waited for (host_queue_depth). */
static void test_room_waits_for_the_mark_not_the_stream(void **state) {
  (void)state;
  tide_allocator *a = tu_create("backend:host,host_capacity:1GiB,memory_limit:16MiB,"
                                "host_queue_depth:1000000,load_handles:False");
  void *y;
  tide_buf *b = buffer_beside_a_freed_block(a, &y);
  /* x's first page: x is not idle and no mark follows its free, so the
   * stream is waited for. */
  tu_assert_ok(tide_buf_resize(b, 2 * TU_MiB, NULL));
  assert_int_equal(tide_host_call_count(a, TIDE_OP_STREAM_SYNCHRONIZE), 1);
  tu_assert_ok(tide_free(a, y, NULL));
  /* x's other pages, idle since that wait; each release records a mark,
   * the first of them after y's free. */
  for (size_t mib = 4; mib <= 8; mib += 2) tu_assert_ok(tide_buf_resize(b, mib * TU_MiB, NULL));
  assert_int_equal(tide_host_call_count(a, TIDE_OP_STREAM_SYNCHRONIZE), 1);
  assert_int_equal(tide_host_call_count(a, TIDE_OP_EVENT_SYNCHRONIZE), 0);
  /* y's page: the wait is for that mark. */
  tu_assert_ok(tide_buf_resize(b, 10 * TU_MiB, NULL));
  assert_int_equal(tide_host_call_count(a, TIDE_OP_STREAM_SYNCHRONIZE), 1);
  assert_int_equal(tide_host_call_count(a, TIDE_OP_EVENT_SYNCHRONIZE), 1);
  tide_stats st = tu_stats(a);
  assert_int_equal(st.stream_waits, 2);
  assert_int_equal(st.reserved_bytes[TIDE_POOL_ALL].peak, 16 * TU_MiB);
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_buf_destroy(b));
  tu_assert_ok(tide_empty_cache(a));
  assert_int_equal(tide_host_bytes_in_use(a), 0);
  tu_assert_ok(tide_destroy(a));
}

/* Below the limit the buffer's room leaves busy pages cached: here 16 MiB
 * allocated and a 24 MiB limit, so the first 8 MiB of the buffer add to
 * reserved memory, nothing waits; at the limit, it waits. */
static void test_room_leaves_busy_pages_below_the_limit(void **state) {
  (void)state;
  tide_allocator *a = tu_create("backend:host,host_capacity:1GiB,memory_limit:24MiB,"
                                "host_queue_depth:1000000,load_handles:False");
  void *y;
  tide_buf *b = buffer_beside_a_freed_block(a, &y); /* x busy: no mark after its free */
  for (size_t mib = 2; mib <= 8; mib += 2) tu_assert_ok(tide_buf_resize(b, mib * TU_MiB, NULL));
  tide_stats st = tu_stats(a);
  assert_int_equal(st.stream_waits, 0);
  assert_int_equal(tide_host_call_count(a, TIDE_OP_STREAM_SYNCHRONIZE), 0);
  assert_int_equal(st.reserved_bytes[TIDE_POOL_ALL].current, 24 * TU_MiB);
  /* 24 MiB + 2 is past the limit: x's pages go now, after a wait. */
  tu_assert_ok(tide_buf_resize(b, 10 * TU_MiB, NULL));
  st = tu_stats(a);
  assert_int_equal(st.stream_waits, 1);
  assert_int_equal(st.reserved_bytes[TIDE_POOL_ALL].current, 24 * TU_MiB);
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_buf_destroy(b));
  tu_assert_ok(tide_free(a, y, NULL));
  tu_assert_ok(tide_empty_cache(a));
  assert_int_equal(tide_host_bytes_in_use(a), 0);
  tu_assert_ok(tide_destroy(a));
}

/* The same for a segment's growth (release_deferred): the small pool grows
 * at the limit and takes 4 MiB handles of the large pool, which it cannot
 * map again, so they are unmapped at once, after waiting for their readers:
 * x's after a stream synchronization (no mark follows its free), y's after
 * the idle mark that the releases of x's pages recorded after y's free. */
static void test_growth_waits_for_the_mark_not_the_stream(void **state) {
  (void)state;
  tide_allocator *a = tu_create("backend:host,host_capacity:1GiB,handle_size_mb:4,"
                                "handle_threshold_mb:0,memory_limit:32MiB,"
                                "host_queue_depth:1000000,load_handles:False");
  void *x = tide_malloc(a, 16 * TU_MiB, NULL), *y = tide_malloc(a, 16 * TU_MiB, NULL);
  assert_non_null(x);
  assert_non_null(y);
  tu_assert_ok(tide_free(a, x, NULL));
  enum { SMALL = 17 };
  void *small[SMALL];
  assert_non_null(small[0] = tide_malloc(a, TU_MiB, NULL));
  assert_int_equal(tide_host_call_count(a, TIDE_OP_STREAM_SYNCHRONIZE), 1);
  tu_assert_ok(tide_free(a, y, NULL));
  /* x's other three handles go first (idle since that wait), two small
   * pages each; then y's first. */
  for (int i = 1; i < SMALL; i++) assert_non_null(small[i] = tide_malloc(a, TU_MiB, NULL));
  assert_int_equal(tide_host_call_count(a, TIDE_OP_STREAM_SYNCHRONIZE), 1);
  assert_int_equal(tide_host_call_count(a, TIDE_OP_EVENT_SYNCHRONIZE), 1);
  tide_stats st = tu_stats(a);
  assert_int_equal(st.stream_waits, 2);
  assert_int_equal(st.reserved_bytes[TIDE_POOL_ALL].peak, 32 * TU_MiB);
  tu_assert_ok(tide_check(a));
  for (int i = 0; i < SMALL; i++) tu_assert_ok(tide_free(a, small[i], NULL));
  tu_assert_ok(tide_empty_cache(a));
  assert_int_equal(tide_host_bytes_in_use(a), 0);
  tu_assert_ok(tide_destroy(a));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_prestate(test_no_synchronization, CONF),
      cmocka_unit_test_prestate(test_no_synchronization, CONF ",capture_detection:True"),
      cmocka_unit_test(test_old_addresses_stay_until_idle),
      cmocka_unit_test(test_destroy_with_stale_pages),
      cmocka_unit_test(test_growth_does_not_wait_for_a_held_stream),
      cmocka_unit_test(test_large_handles),
      cmocka_unit_test(test_large_handles_after_threshold),
      cmocka_unit_test(test_large_handles_after_unmapped_pages),
      cmocka_unit_test(test_pressure_releases_whole_handles),
      cmocka_unit_test(test_release_of_other_handles_is_not_deferred),
      cmocka_unit_test(test_busy_pages_stay_cached_without_pressure),
      cmocka_unit_test(test_room_waits_for_the_mark_not_the_stream),
      cmocka_unit_test(test_room_leaves_busy_pages_below_the_limit),
      cmocka_unit_test(test_growth_waits_for_the_mark_not_the_stream),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
