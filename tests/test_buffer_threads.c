/* test_buffer_threads.c: growable and ring buffers on the host backend — growth in
 * place, stream-ordered shrinking, mapping ahead (also on the worker), the
 * memory limit, stats, backend faults at every call and bad input. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <time.h>

#include <cmocka.h>

#include "testutil.h"

#define PAGE (2 * TU_MiB)

/* A buffer of options `o`, which must be made. */
static tide_buf *create(tide_allocator *a, const tide_buf_options *o) {
  tide_buf *b = NULL;
  tu_assert_ok(tide_buf_create(a, o, &b));
  assert_non_null(b);
  return b;
}

static tide_buf *make(tide_allocator *a, size_t capacity, size_t ahead, int async, int ring) {
  tide_buf_options o;
  tide_buf_options_init(&o);
  o.capacity = capacity;
  o.map_ahead = ahead;
  o.async_map_ahead = async;
  o.ring = ring;
  return create(a, &o);
}

/* A linear buffer whose stats join stream `s`'s arena. */
static tide_buf *make_on(tide_allocator *a, size_t capacity, tide_stream s) {
  tide_buf_options o;
  tide_buf_options_init(&o);
  o.capacity = capacity;
  o.stream = s;
  return create(a, &o);
}

/* One byte per 4 KiB, at offsets that are multiples of 4 KiB. */
static size_t first_mark(size_t from) { return (from + 4095) / 4096 * 4096; }

static void fill(unsigned char *p, size_t from, size_t to, unsigned seed) {
  for (size_t i = first_mark(from); i < to; i += 4096) p[i] = (unsigned char)(i / 4096 * 31 + seed);
}

static void check(const unsigned char *p, size_t from, size_t to, unsigned seed) {
  for (size_t i = first_mark(from); i < to; i += 4096)
    if (p[i] != (unsigned char)(i / 4096 * 31 + seed)) fail_msg("byte %zu lost", i);
}

static int64_t reserved(tide_allocator *a) {
  tide_stats st;
  tu_assert_ok(tide_get_stats(a, &st));
  return st.reserved_bytes[TIDE_POOL_ALL].current;
}

/* A shrink to nothing keeps the pages it maps ahead and records no event,
 * and a ring never shrinks: destroying either while queued work still reads
 * it would unmap under that work. destroy_after waits for the stream, and a
 * stream that cannot be waited for keeps the buffer whole. */
static void destroy_after_waits(tide_buf *(*build)(tide_allocator *), bool shrink) {
  tide_allocator *a = tu_create(NULL);
  tide_stream s;
  tu_assert_ok(tide_stream_create(a, &s));
  tide_buf *b = build(a);
  size_t used = tide_buf_capacity(b) / 4;
  if (shrink) tu_assert_ok(tide_buf_resize(b, used, s));
  fill(tide_buf_data(b), 0, used, 5);
  tu_assert_ok(tide_host_stream_hold(a, s)); /* queued work still reads it */
  if (shrink) tu_assert_ok(tide_buf_resize(b, 0, s));
  size_t mapped = tide_buf_mapped(b);
  assert_true(mapped >= used);
  tu_assert_status(tide_buf_destroy_after(b, s), TIDE_ERR_NOT_READY);
  tu_assert_last_error(TIDE_ERR_NOT_READY, "kept");
  assert_int_equal(tide_buf_mapped(b), mapped);
  check(tide_buf_data(b), 0, used, 5);
  tu_assert_ok(tide_host_stream_release(a, s));
  tu_assert_ok(tide_buf_destroy_after(b, s));
  assert_int_equal(tide_host_bytes_in_use(a), 0);
  tu_assert_status(tide_buf_destroy_after(NULL, s), TIDE_ERR_INVALID);
  tu_assert_ok(tide_stream_destroy(a, s));
  tu_assert_ok(tide_destroy(a));
}

static tide_buf *ahead_buffer(tide_allocator *a) { return make(a, 64 * TU_MiB, 8 * TU_MiB, 0, 0); }
static tide_buf *ring_buffer(tide_allocator *a) { return make(a, 8 * TU_MiB, 0, 0, 1); }

static void test_destroy_after_waits_for_pages_kept_ahead(void **state) {
  (void)state;
  destroy_after_waits(ahead_buffer, true);
}

static void test_destroy_after_waits_for_a_ring(void **state) {
  (void)state;
  destroy_after_waits(ring_buffer, false);
}

static void test_growth_keeps_address_and_data(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tide_buf *b = make(a, 256 * TU_MiB, 0, 0, 0);
  unsigned char *base = tide_buf_data(b);
  size_t len = 0;
  for (int step = 1; step <= 40; step++) {
    size_t next = (size_t)step * 3 * TU_MiB + 12345;
    tu_assert_ok(tide_buf_resize(b, next, NULL));
    assert_ptr_equal(tide_buf_data(b), base);
    check(base, 0, len, 7);
    fill(base, len, next, 7);
    len = next;
  }
  assert_int_equal(tide_buf_length(b), len);
  assert_int_equal(tide_buf_mapped(b), (len + PAGE - 1) / PAGE * PAGE);
  tide_stats st;
  tu_assert_ok(tide_get_stats(a, &st));
  assert_int_equal(st.allocated_bytes[TIDE_POOL_ALL].current, (int64_t)len);
  assert_int_equal(st.reserved_bytes[TIDE_POOL_LARGE].current, (int64_t)tide_buf_mapped(b));
  assert_int_equal(st.allocations[TIDE_POOL_ALL].current, 1);
  assert_int_equal(tide_host_bytes_in_use(a), tide_buf_mapped(b));
  tu_assert_ok(tide_check(a));
  char *json = NULL, want[96];
  size_t json_len = 0;
  tu_assert_ok(tide_snapshot_json(a, &json, &json_len));
  snprintf(want, sizeof want, "\"capacity\": %zu, \"length\": %zu", tide_buf_capacity(b), len);
  assert_non_null(strstr(json, want)); /* the snapshot shows the buffer */
  tide_string_free(json);
  tu_assert_ok(tide_buf_destroy(b));
  tu_assert_ok(tide_get_stats(a, &st));
  assert_int_equal(st.allocated_bytes[TIDE_POOL_ALL].current, 0);
  assert_int_equal(reserved(a), 0);
  assert_int_equal(tide_host_bytes_in_use(a), 0);
  tu_assert_ok(tide_destroy(a));
}

static void test_shrink_waits_for_the_stream(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tide_stream s;
  tu_assert_ok(tide_stream_create(a, &s));
  tide_buf *b = make(a, 64 * TU_MiB, 0, 0, 0);
  tu_assert_ok(tide_buf_resize(b, 20 * TU_MiB, s));
  fill(tide_buf_data(b), 0, 20 * TU_MiB, 3);
  tu_assert_ok(tide_host_stream_hold(a, s)); /* queued work still reads the tail */
  tu_assert_ok(tide_buf_resize(b, 4 * TU_MiB, s));
  assert_int_equal(tide_buf_length(b), 4 * TU_MiB);
  tu_assert_ok(tide_buf_resize(b, 3 * TU_MiB, s)); /* a later call sees the stream busy */
  assert_int_equal(tide_buf_mapped(b), 20 * TU_MiB);
  check(tide_buf_data(b), 0, 20 * TU_MiB, 3); /* nothing unmapped under the stream */
  /* Destroying would unmap under the stream: refused, the buffer kept. */
  tu_assert_status(tide_buf_destroy(b), TIDE_ERR_NOT_READY);
  tu_assert_last_error(TIDE_ERR_NOT_READY, "kept");
  check(tide_buf_data(b), 0, 20 * TU_MiB, 3);
  tu_assert_ok(tide_host_stream_release(a, s));
  tu_assert_ok(tide_buf_resize(b, 2 * TU_MiB, s));
  assert_int_equal(tide_buf_mapped(b), 2 * TU_MiB);
  assert_int_equal(tide_host_bytes_in_use(a), 2 * TU_MiB);
  check(tide_buf_data(b), 0, 2 * TU_MiB, 3);
  tu_assert_ok(tide_buf_destroy(b));
  tu_assert_ok(tide_stream_destroy(a, s));
  tu_assert_ok(tide_destroy(a));
}

static void test_regrowth_cancels_pending_release(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tide_stream s;
  tu_assert_ok(tide_stream_create(a, &s));
  tide_buf *b = make(a, 64 * TU_MiB, 0, 0, 0);
  tu_assert_ok(tide_buf_resize(b, 16 * TU_MiB, s));
  tu_assert_ok(tide_host_stream_hold(a, s));
  tu_assert_ok(tide_buf_resize(b, 2 * TU_MiB, s));
  uint64_t maps = tide_host_call_count(a, TIDE_OP_MAP);
  tu_assert_ok(tide_buf_resize(b, 16 * TU_MiB, s)); /* the pages are still there */
  assert_int_equal(tide_host_call_count(a, TIDE_OP_MAP), maps);
  tu_assert_ok(tide_host_stream_release(a, s));
  tu_assert_ok(tide_buf_resize(b, 16 * TU_MiB, s));
  assert_int_equal(tide_buf_mapped(b), 16 * TU_MiB);
  tu_assert_ok(tide_buf_destroy(b));
  tu_assert_ok(tide_stream_destroy(a, s));
  tu_assert_ok(tide_destroy(a));
}

static void test_map_ahead_avoids_backend_calls(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tide_buf *b = make(a, 256 * TU_MiB, 16 * TU_MiB, 0, 0);
  tu_assert_ok(tide_buf_resize(b, 1 * TU_MiB, NULL));
  assert_int_equal(tide_buf_mapped(b), 18 * TU_MiB);
  uint64_t maps = tide_host_call_count(a, TIDE_OP_MAP);
  for (size_t len = 1 * TU_MiB; len <= 18 * TU_MiB; len += TU_MiB / 2)
    tu_assert_ok(tide_buf_resize(b, len, NULL));
  /* Only growth past the mapped pages maps, and then a whole window ahead. */
  assert_true(tide_host_call_count(a, TIDE_OP_MAP) - maps <= 9);
  assert_true(tide_buf_mapped(b) >= 18 * TU_MiB + 16 * TU_MiB);
  tu_assert_ok(tide_buf_reserve_ahead(b, 100 * TU_MiB));
  assert_int_equal(tide_buf_mapped(b), 100 * TU_MiB);
  assert_int_equal(tide_buf_length(b), 18 * TU_MiB);
  tu_assert_ok(tide_buf_destroy(b));
  tu_assert_ok(tide_destroy(a));
}

/* A map_ahead below a page maps the next page only once the length comes
 * within map_ahead of the mapped end, and a map_ahead of a page keeps one
 * to two pages beyond the length: the fewest pages covering length +
 * map_ahead, for growth and shrink alike. */
static void test_map_ahead_is_bytes_not_pages(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  const size_t ahead = 256 * TU_KiB;
  tide_buf *b = make(a, 64 * TU_MiB, ahead, 0, 0);
  for (size_t len = 32 * TU_KiB; len <= 16 * TU_MiB; len += 32 * TU_KiB) {
    tu_assert_ok(tide_buf_resize(b, len, NULL));
    size_t want = (len + ahead + PAGE - 1) / PAGE * PAGE;
    if (tide_buf_mapped(b) != want)
      fail_msg("length %zu: %zu bytes mapped, expected %zu", len, tide_buf_mapped(b), want);
  }
  tu_assert_ok(tide_buf_resize(b, 5 * TU_MiB, NULL)); /* a shrink keeps as much ahead */
  tu_assert_ok(tide_check(a));
  assert_int_equal(tide_buf_mapped(b), 6 * TU_MiB);
  tu_assert_ok(tide_buf_destroy(b));
  b = make(a, 64 * TU_MiB, PAGE, 0, 0);
  tu_assert_ok(tide_buf_resize(b, 3 * TU_MiB, NULL)); /* partial page + one ahead */
  assert_int_equal(tide_buf_mapped(b), 3 * PAGE);
  tu_assert_ok(tide_buf_resize(b, 4 * TU_MiB, NULL)); /* two whole pages + one ahead */
  assert_int_equal(tide_buf_mapped(b), 3 * PAGE);
  tu_assert_ok(tide_buf_destroy(b));
  assert_int_equal(reserved(a), 0);
  tu_assert_ok(tide_destroy(a));
}

/* map_ahead_fraction bounds map_ahead by the length: a short buffer maps
 * only the pages its length needs, a long one the whole pages within the
 * fraction of its length ahead, and never more than map_ahead; growth and
 * shrink alike. */
static void test_map_ahead_fraction_bounds_it_by_the_length(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tide_buf_options o;
  tide_buf_options_init(&o);
  o.capacity = 2048 * TU_MiB;
  o.map_ahead = 32 * TU_MiB;
  o.map_ahead_fraction = 0.01;
  tide_buf *b = create(a, &o);
  for (size_t len = 4 * TU_MiB; len <= 2048 * TU_MiB; len += 4 * TU_MiB) {
    tu_assert_ok(tide_buf_resize(b, len, NULL));
    size_t ahead = len / 100 < o.map_ahead ? len / 100 : o.map_ahead;
    size_t want = (len + ahead) / PAGE * PAGE; /* whole pages ahead only */
    if (want < len) want = (len + PAGE - 1) / PAGE * PAGE;
    if (want > o.capacity) want = o.capacity;
    if (tide_buf_mapped(b) != want)
      fail_msg("length %zu: %zu bytes mapped, expected %zu", len, tide_buf_mapped(b), want);
  }
  tu_assert_ok(tide_buf_resize(b, 100 * TU_MiB, NULL)); /* 1 MiB ahead: no whole page */
  tu_assert_ok(tide_check(a));
  assert_int_equal(tide_buf_mapped(b), 100 * TU_MiB);
  tu_assert_ok(tide_buf_resize(b, 99 * TU_MiB, NULL)); /* the partial page, no more */
  assert_int_equal(tide_buf_mapped(b), 100 * TU_MiB);
  tu_assert_ok(tide_buf_resize(b, 1020 * TU_MiB, NULL)); /* 10.2 MiB ahead: 5 pages */
  assert_int_equal(tide_buf_mapped(b), 1030 * TU_MiB);
  tu_assert_ok(tide_buf_destroy(b));
  o.map_ahead_fraction = -0.5;
  assert_int_equal(tide_buf_create(a, &o, &b), TIDE_ERR_INVALID);
  o.map_ahead_fraction = 1.5;
  assert_int_equal(tide_buf_create(a, &o, &b), TIDE_ERR_INVALID);
  assert_int_equal(reserved(a), 0);
  tu_assert_ok(tide_destroy(a));
}

/* A buffer growing a page at a time next to cached free memory in segments
 * of 4 MiB handles: each growth releases a cached handle (two pages) rather
 * than none, so reserved memory stays under the limit instead of adding the
 * buffer on top of the cache (the streaming workload in grow mode held 1.19
 * x allocated when requests below a handle released nothing). */
static void test_buffer_growth_releases_larger_handles(void **state) {
  (void)state;
  tide_allocator *a = tu_create("handle_size_mb:4,handle_threshold_mb:0,memory_limit:66MiB");
  void *p = tide_malloc(a, 64 * TU_MiB, NULL);
  assert_non_null(p);
  tu_assert_ok(tide_free(a, p, NULL)); /* cached: 16 handles of 4 MiB */
  assert_int_equal(reserved(a), 64 * TU_MiB);
  tide_buf *b = make(a, 64 * TU_MiB, 0, 0, 0);
  for (size_t len = PAGE; len <= 64 * TU_MiB; len += PAGE) {
    tu_assert_ok(tide_buf_resize(b, len, NULL));
    if (reserved(a) > (int64_t)(64 * TU_MiB + PAGE))
      fail_msg("buffer at %zu bytes: %lld bytes reserved, the ceiling is 64 MiB", len,
               (long long)reserved(a));
  }
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_buf_destroy(b));
  tu_assert_ok(tide_destroy(a));
}

/* A buffer's growth makes room from free blocks the stream is known to be
 * past (freed before a completed idle mark) without waiting for the stream:
 * here the stream is held, so a synchronization could never end, and the
 * room still comes from the cache instead of piling pages on top of it. */
static void test_buffer_room_from_idle_blocks_does_not_wait(void **state) {
  (void)state;
  tide_allocator *a = tu_create("handle_size_mb:2,memory_limit:8MiB,load_handles:False");
  tide_stream s;
  tu_assert_ok(tide_stream_create(a, &s));
  void *p = tide_malloc(a, 8 * TU_MiB, s);
  assert_non_null(p);
  tu_assert_ok(tide_free(a, p, s)); /* 8 MiB cached, the reserved peak */
  tide_buf *b = make_on(a, 8 * TU_MiB, s);
  /* The first page's room waits for the stream once; everything freed
   * before is idle from then on. */
  tu_assert_ok(tide_buf_resize(b, PAGE, s));
  assert_int_equal(reserved(a), 8 * TU_MiB);
  uint64_t waits = tide_host_call_count(a, TIDE_OP_STREAM_SYNCHRONIZE);
  uint64_t unmapped = tu_stats(a).pages_unmapped;
  tu_assert_ok(tide_host_stream_hold(a, s));
  tu_assert_ok(tide_buf_resize(b, 3 * PAGE, s));
  assert_int_equal(reserved(a), 8 * TU_MiB);
  assert_int_equal(tu_stats(a).pages_unmapped - unmapped, 2);
  assert_int_equal(tide_host_call_count(a, TIDE_OP_STREAM_SYNCHRONIZE), waits);
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_host_stream_release(a, s));
  tu_assert_ok(tide_buf_destroy(b));
  tu_assert_ok(tide_stream_destroy(a, s));
  tu_assert_ok(tide_destroy(a));
}

/* A buffer's pages are driver mappings like a segment's handles: they count
 * in the mappings and unmappings stats (a ring's twice), and their calls'
 * time in mapping_ns. */
static void test_buffer_pages_count_as_mappings(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tide_stats before = tu_stats(a);
  tide_buf *b = make(a, 16 * TU_MiB, 0, 0, 0);
  tu_assert_ok(tide_buf_resize(b, 3 * PAGE, NULL));
  assert_int_equal(tu_stats(a).mappings - before.mappings, 3);
  uint64_t mapped_ns = tu_stats(a).mapping_ns;
  assert_true(mapped_ns > before.mapping_ns);
  tu_assert_ok(tide_buf_destroy(b));
  assert_int_equal(tu_stats(a).unmappings - before.unmappings, 3);
  assert_true(tu_stats(a).mapping_ns > mapped_ns);
  tide_buf *ring = make(a, 2 * PAGE, 0, 0, 1);
  assert_int_equal(tu_stats(a).mappings - before.mappings, 3 + 4);
  tu_assert_ok(tide_buf_destroy(ring));
  assert_int_equal(tu_stats(a).unmappings - before.unmappings, 3 + 4);
  tu_assert_ok(tide_destroy(a));
}

/* At the memory limit, free blocks cached in the segments are given back
 * before a buffer's growth (or a ring's creation) fails, as tide_malloc
 * does. */
static void test_buffer_at_the_limit_takes_cached_memory(void **state) {
  (void)state;
  tide_allocator *a = tu_create("host_capacity:64MiB");
  void *p = tide_malloc(a, 48 * TU_MiB, NULL);
  assert_non_null(p);
  tu_assert_ok(tide_free(a, p, NULL)); /* 48 MiB cached */
  tide_buf *b = make(a, 60 * TU_MiB, 0, 0, 0);
  tu_assert_ok(tide_buf_resize(b, 40 * TU_MiB, NULL));
  assert_true(reserved(a) <= 64 * (int64_t)TU_MiB);
  tu_assert_ok(tide_buf_destroy(b));
  p = tide_malloc(a, 48 * TU_MiB, NULL);
  assert_non_null(p);
  tu_assert_ok(tide_free(a, p, NULL));
  tide_buf *ring = make(a, 24 * TU_MiB, 0, 0, 1);
  assert_non_null(ring);
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_buf_destroy(ring));
  /* The worker mapping ahead into a full device stops without failing the
   * next resize; the growth that needs the pages gets the cache back. */
  b = make(a, 60 * TU_MiB, 8 * TU_MiB, 1, 0);
  tu_assert_ok(tide_buf_resize(b, 40 * TU_MiB, NULL));
  tu_assert_ok(tide_check(a)); /* the worker is idle: 48 MiB mapped */
  p = tide_malloc(a, 16 * TU_MiB, NULL);
  assert_non_null(p);
  tu_assert_ok(tide_free(a, p, NULL));                 /* 64 MiB reserved: the limit */
  tu_assert_ok(tide_buf_resize(b, 42 * TU_MiB, NULL)); /* the worker wants 50 MiB */
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_buf_resize(b, 44 * TU_MiB, NULL));
  tu_assert_ok(tide_buf_resize(b, 50 * TU_MiB, NULL)); /* past the mapped pages */
  tu_assert_ok(tide_check(a));
  assert_true(tide_buf_mapped(b) >= 50 * TU_MiB);
  tu_assert_ok(tide_buf_destroy(b));
  tu_assert_ok(tide_destroy(a));
}

/* Pages a shrink let go wait for its stream; once it is past them,
 * tide_empty_cache gives them back without another call on the buffer. */
static void test_empty_cache_takes_pages_a_shrink_let_go(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tide_stream s;
  tu_assert_ok(tide_stream_create(a, &s));
  tide_buf *b = make_on(a, 64 * TU_MiB, s);
  tu_assert_ok(tide_buf_resize(b, 32 * TU_MiB, s));
  tu_assert_ok(tide_host_stream_hold(a, s));
  tu_assert_ok(tide_buf_resize(b, 0, s)); /* the pages wait for s */
  assert_int_equal(reserved(a), 32 * TU_MiB);
  tu_assert_ok(tide_empty_cache(a)); /* s is held: they keep waiting */
  assert_int_equal(reserved(a), 32 * TU_MiB);
  tu_assert_ok(tide_host_stream_release(a, s));
  tu_assert_ok(tide_empty_cache(a));
  assert_int_equal(reserved(a), 0);
  assert_int_equal(tide_buf_mapped(b), 0);
  tu_assert_ok(tide_buf_destroy(b));
  tu_assert_ok(tide_stream_destroy(a, s));
  tu_assert_ok(tide_destroy(a));
}

/* A buffer that grows at the memory limit gets the pages another buffer's
 * shrink let go, once their stream is waited for, as tide_malloc does
 * (host_queue_depth: the stream's work completes only when waited for). */
static void test_growth_at_the_limit_takes_pages_a_shrink_let_go(void **state) {
  (void)state;
  tide_allocator *a = tu_create("host_capacity:64MiB,host_queue_depth:1000000");
  tide_stream s;
  tu_assert_ok(tide_stream_create(a, &s));
  tide_buf *shrunk = make_on(a, 64 * TU_MiB, s), *grown = make_on(a, 64 * TU_MiB, s);
  tu_assert_ok(tide_buf_resize(shrunk, 48 * TU_MiB, s));
  tu_assert_ok(tide_buf_resize(shrunk, 0, s)); /* its pages wait for s */
  assert_int_equal(reserved(a), 48 * TU_MiB);
  tu_assert_ok(tide_buf_resize(grown, 48 * TU_MiB, s)); /* 16 MiB free without them */
  assert_int_equal(tide_buf_mapped(shrunk), 0);
  assert_int_equal(reserved(a), 48 * TU_MiB);
  tu_assert_ok(tide_buf_destroy(grown));
  tu_assert_ok(tide_buf_destroy(shrunk));
  tu_assert_ok(tide_stream_destroy(a, s));
  tu_assert_ok(tide_destroy(a));
}

static void test_worker_maps_ahead(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tide_buf *b = make(a, 512 * TU_MiB, 32 * TU_MiB, 1, 0);
  unsigned char *p = tide_buf_data(b);
  size_t len = 0;
  for (int i = 1; i <= 200; i++) {
    size_t next = (size_t)i * 2 * TU_MiB + 777;
    tu_assert_ok(tide_buf_resize(b, next, NULL));
    fill(p, len, next, 5);
    len = next;
  }
  check(p, 0, len, 5);
  tu_assert_ok(tide_check(a)); /* waits for the worker to be idle */
  tu_assert_ok(tide_buf_resize(b, TU_MiB, NULL));
  check(p, 0, TU_MiB, 5);
  tu_assert_ok(tide_buf_destroy(b));
  assert_int_equal(tide_host_bytes_in_use(a), 0);
  assert_int_equal(reserved(a), 0);
  tu_assert_ok(tide_destroy(a));
}

/* Until the buffer has `bytes` mapped; false after 5 s. */
static bool mapped_within(tide_buf *b, size_t bytes) {
  for (int i = 0; i < 5000 && tide_buf_mapped(b) != bytes; i++) {
    struct timespec ms = {0, 1000000};
    nanosleep(&ms, NULL);
  }
  return tide_buf_mapped(b) == bytes;
}

/* The worker never maps while a shrink's pages wait for their stream. A
 * growth meanwhile asks it for more; once a later call lets those pages go,
 * it must wake up and map (tide_check waits for it: it would wait forever).
 * And a shrink takes back what it was asked for: it never maps ahead of a
 * length the buffer no longer has. */
static void test_worker_after_pending_release(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tide_stream s;
  tu_assert_ok(tide_stream_create(a, &s));
  tide_buf *b = make(a, 64 * TU_MiB, 4 * PAGE, 1, 0);
  tu_assert_ok(tide_buf_resize(b, 8 * PAGE, s));
  assert_true(mapped_within(b, 12 * PAGE));
  tu_assert_ok(tide_host_stream_hold(a, s));
  tu_assert_ok(tide_buf_resize(b, 2 * PAGE, s));  /* pages 6.. wait for s */
  tu_assert_ok(tide_buf_resize(b, 10 * PAGE, s)); /* the worker is asked for 14 */
  tu_assert_ok(tide_host_stream_release(a, s));
  tu_assert_ok(tide_buf_resize(b, 10 * PAGE - 1, s)); /* pages 10, 11 go */
  if (!mapped_within(b, 14 * PAGE))
    fail_msg("the worker did not map ahead once the release was settled: %zu bytes mapped",
             tide_buf_mapped(b));
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_host_stream_hold(a, s));
  tu_assert_ok(tide_buf_resize(b, PAGE, s)); /* 5 pages wanted now, 14 mapped */
  tu_assert_ok(tide_host_stream_release(a, s));
  tu_assert_ok(tide_buf_resize(b, PAGE - 1, s)); /* pages 5.. go */
  tu_assert_ok(tide_check(a));
  assert_int_equal(tide_buf_mapped(b), 5 * PAGE);
  assert_int_equal(reserved(a), 5 * PAGE);
  tu_assert_ok(tide_buf_destroy(b));
  tu_assert_ok(tide_stream_destroy(a, s));
  tu_assert_ok(tide_destroy(a));
}

/* A thread that grows and shrinks a buffer with a worker, and creates and
 * destroys rings, until told to stop. cmocka's assertions belong to the
 * test's thread: it keeps its first failure for the test to report. */
typedef struct churn {
  tide_allocator *a;
  atomic_bool stop;
  uint64_t rng;
  tide_status failed;
  char why[256];
} churn;

static bool churn_ok(churn *c, tide_status st) {
  if (st != TIDE_OK && c->failed == TIDE_OK) {
    c->failed = st;
    snprintf(c->why, sizeof c->why, "%s", tide_last_error());
  }
  return st == TIDE_OK;
}

static tide_status churn_create(churn *c, size_t capacity, size_t ahead, int ring, tide_buf **b) {
  tide_buf_options o;
  tide_buf_options_init(&o);
  o.capacity = capacity;
  o.map_ahead = ahead;
  o.async_map_ahead = ahead != 0;
  o.ring = ring;
  return tide_buf_create(c->a, &o, b);
}

static void *churn_main(void *arg) {
  churn *c = arg;
  tide_buf *b = NULL, *ring = NULL;
  if (!churn_ok(c, churn_create(c, 64 * TU_MiB, PAGE, 0, &b))) return NULL;
  while (!atomic_load(&c->stop) && c->failed == TIDE_OK) {
    churn_ok(c, tide_buf_resize(b, (size_t)(tu_splitmix(&c->rng) % (64 * TU_MiB)), NULL));
    if (churn_ok(c, churn_create(c, 8 * PAGE, 0, 1, &ring))) churn_ok(c, tide_buf_destroy(ring));
  }
  churn_ok(c, tide_buf_destroy(b));
  return NULL;
}

/* tide_check while other threads change buffers: it must see each buffer
 * with its stats in the arenas, never one without the other. */
static void test_check_while_buffers_change(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  churn c[2] = {{.a = a, .rng = 1}, {.a = a, .rng = 2}};
  pthread_t t[2];
  for (int i = 0; i < 2; i++) assert_int_equal(pthread_create(&t[i], NULL, churn_main, &c[i]), 0);
  tide_status checked = TIDE_OK;
  char why[512] = "";
  int rounds = 0;
  struct timespec start, now;
  clock_gettime(CLOCK_MONOTONIC, &start);
  do { /* a second, or 50000 checks */
    for (int i = 0; i < 500 && checked == TIDE_OK; i++)
      if ((checked = tide_check(a)) != TIDE_OK) snprintf(why, sizeof why, "%s", tide_last_error());
    clock_gettime(CLOCK_MONOTONIC, &now);
  } while (checked == TIDE_OK && now.tv_sec - start.tv_sec < 1 && ++rounds < 100);
  for (int i = 0; i < 2; i++) {
    atomic_store(&c[i].stop, true);
    assert_int_equal(pthread_join(t[i], NULL), 0);
  }
  if (checked != TIDE_OK) fail_msg("%s", why);
  for (int i = 0; i < 2; i++)
    if (c[i].failed != TIDE_OK) fail_msg("a buffer call failed: %s", c[i].why);
  assert_int_equal(reserved(a), 0);
  tu_assert_ok(tide_destroy(a));
}

/* One thread grows and shrinks a buffer at the memory limit, with a block
 * cached each round so that growth must give the cache back, while another
 * runs tide_check: the giving back must not deadlock with the check (which
 * holds the arena table and waits for buffers), and every call succeeds. */
static void *limit_churn_main(void *arg) {
  churn *c = arg;
  tide_buf *b = NULL;
  tide_buf_options o;
  tide_buf_options_init(&o);
  o.capacity = 48 * TU_MiB;
  o.map_ahead = 8 * TU_MiB;
  o.async_map_ahead = 1;
  if (!churn_ok(c, tide_buf_create(c->a, &o, &b))) return NULL;
  for (int round = 0; round < 200 && c->failed == TIDE_OK; round++) {
    void *p = tide_malloc(c->a, 16 * TU_MiB, NULL);
    if (!p) {
      churn_ok(c, tide_last_status());
      break;
    }
    churn_ok(c, tide_free(c->a, p, NULL));
    churn_ok(c, tide_buf_resize(b, (size_t)(round % 5 + 1) * 8 * TU_MiB, NULL));
    churn_ok(c, tide_buf_resize(b, 0, NULL));
  }
  churn_ok(c, tide_buf_destroy(b));
  atomic_store(&c->stop, true);
  return NULL;
}

static void test_check_while_buffers_reclaim(void **state) {
  (void)state;
  tide_allocator *a = tu_create("host_capacity:64MiB");
  churn c = {.a = a, .rng = 3};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, limit_churn_main, &c), 0);
  tide_status checked = TIDE_OK;
  char why[512] = "";
  while (!atomic_load(&c.stop) && checked == TIDE_OK)
    if ((checked = tide_check(a)) != TIDE_OK) snprintf(why, sizeof why, "%s", tide_last_error());
  assert_int_equal(pthread_join(t, NULL), 0);
  if (checked != TIDE_OK) fail_msg("%s", why);
  if (c.failed != TIDE_OK) fail_msg("a call failed: %s", c.why);
  tu_assert_ok(tide_destroy(a));
}

static void test_ring_maps_pages_twice(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tide_buf *b = make(a, 8 * TU_MiB, 0, 0, 1);
  unsigned char *p = tide_buf_data(b);
  size_t w = tide_buf_capacity(b);
  assert_int_equal(w, 8 * TU_MiB);
  assert_int_equal(tide_buf_length(b), w);
  assert_int_equal(tide_host_bytes_in_use(a), w); /* physical: once */
  for (size_t i = 0; i < w; i += 4093) p[i] = (unsigned char)(i * 7);
  for (size_t i = 0; i < w; i += 4093) assert_int_equal(p[w + i], (unsigned char)(i * 7));
  p[w + 5] = 0xAB; /* and the other way */
  assert_int_equal(p[5], 0xAB);
  /* A window across the end is one contiguous run. */
  memset(p + w - 100, 0x11, 200);
  assert_int_equal(p[50], 0x11);
  tu_assert_status(tide_buf_resize(b, TU_MiB, NULL), TIDE_ERR_INVALID);
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_buf_destroy(b));
  assert_int_equal(tide_host_bytes_in_use(a), 0);
  tu_assert_ok(tide_destroy(a));
}

static void test_limit_and_capacity(void **state) {
  (void)state;
  tide_allocator *a = tu_create("memory_limit:16MiB");
  tide_buf *b = make(a, 64 * TU_MiB, 0, 0, 0);
  tu_assert_ok(tide_buf_resize(b, 10 * TU_MiB, NULL));
  fill(tide_buf_data(b), 0, 10 * TU_MiB, 9);
  tu_assert_status(tide_buf_resize(b, 30 * TU_MiB, NULL), TIDE_ERR_OOM);
  tu_assert_last_error(TIDE_ERR_OOM, "limit");
  assert_int_equal(tide_buf_length(b), 10 * TU_MiB);
  assert_int_equal(tide_buf_mapped(b), 10 * TU_MiB);
  assert_int_equal(reserved(a), 10 * TU_MiB);
  check(tide_buf_data(b), 0, 10 * TU_MiB, 9);
  tu_assert_status(tide_buf_resize(b, 65 * TU_MiB, NULL), TIDE_ERR_INVALID);
  tu_assert_last_error(TIDE_ERR_INVALID, "capacity");
  /* A ring larger than the limit is refused whole. */
  tide_buf_options o;
  tide_buf_options_init(&o);
  o.capacity = 32 * TU_MiB;
  o.ring = 1;
  tide_buf *r = NULL;
  tu_assert_status(tide_buf_create(a, &o, &r), TIDE_ERR_OOM);
  assert_null(r);
  assert_int_equal(reserved(a), 10 * TU_MiB);
  tu_assert_ok(tide_buf_destroy(b));
  tu_assert_ok(tide_destroy(a));
}

static void test_bad_input(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tide_buf_options o;
  tide_buf_options_init(&o);
  tide_buf *b = NULL;
  tu_assert_status(tide_buf_create(a, &o, &b), TIDE_ERR_INVALID); /* capacity 0 */
  tu_assert_status(tide_buf_create(a, NULL, &b), TIDE_ERR_INVALID);
  o.capacity = TU_MiB;
  tu_assert_status(tide_buf_create(NULL, &o, &b), TIDE_ERR_INVALID);
  tu_assert_status(tide_buf_create(a, &o, NULL), TIDE_ERR_INVALID);
  o.stream = (tide_stream)(uintptr_t)0x1234;
  tu_assert_status(tide_buf_create(a, &o, &b), TIDE_ERR_INVALID); /* unknown stream */
  tu_assert_status(tide_buf_resize(NULL, 1, NULL), TIDE_ERR_INVALID);
  tu_assert_status(tide_buf_reserve_ahead(NULL, 1), TIDE_ERR_INVALID);
  tu_assert_status(tide_buf_destroy(NULL), TIDE_ERR_INVALID);
  assert_null(tide_buf_data(NULL));
  assert_int_equal(tide_buf_length(NULL), 0);
  tu_assert_ok(tide_destroy(a));
}

static void test_destroy_takes_buffers_left(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tide_buf *b = make(a, 64 * TU_MiB, 4 * TU_MiB, 1, 0);
  tu_assert_ok(tide_buf_resize(b, 10 * TU_MiB, NULL));
  make(a, 4 * TU_MiB, 0, 0, 1);
  tu_assert_status(tide_destroy(a), TIDE_ERR_STATE);
  tu_assert_last_error(TIDE_ERR_STATE, "buffer");
}

/* Fail the n-th backend call of growth, shrink and ring creation in turn:
 * each failure comes back as an error with the buffer as it was, and no page
 * is lost or leaked. */
static void test_faults_at_every_call(void **state) {
  (void)state;
  unsigned sites = 0;
  for (uint64_t n = 1;; n++) {
    tide_allocator *a = tu_create(NULL);
    tide_stream s;
    tu_assert_ok(tide_stream_create(a, &s));
    tide_buf *b = make(a, 64 * TU_MiB, 4 * TU_MiB, 0, 0);
    tu_assert_ok(tide_buf_resize(b, 3 * TU_MiB, s));
    fill(tide_buf_data(b), 0, 3 * TU_MiB, 1);
    uint64_t before = tide_host_call_count(a, TIDE_OP_ANY);
    tu_assert_ok(tide_host_fail_call(a, TIDE_OP_ANY, n));
    tide_status grow = tide_buf_resize(b, 20 * TU_MiB, s);
    int grow_said_why = grow == TIDE_OK || tide_last_error()[0] != '\0';
    tide_status shrink = grow == TIDE_OK ? tide_buf_resize(b, TU_MiB, s) : TIDE_OK;
    tide_status settle = !grow && !shrink ? tide_buf_resize(b, TU_MiB / 2, s) : TIDE_OK;
    tide_buf_options o;
    tide_buf_options_init(&o);
    o.capacity = 6 * TU_MiB;
    o.ring = 1;
    tide_buf *r = NULL;
    tide_status ring = tide_buf_create(a, &o, &r);
    int failed = grow || shrink || settle || ring;
    uint64_t calls = tide_host_call_count(a, TIDE_OP_ANY) - before;
    tu_assert_ok(tide_host_fail_call(a, TIDE_OP_ANY, 0));
    if (grow) {
      assert_int_equal(tide_buf_length(b), 3 * TU_MiB);
      assert_true(grow_said_why);
    }
    size_t keep = tide_buf_length(b) < TU_MiB ? tide_buf_length(b) : TU_MiB;
    check(tide_buf_data(b), 0, keep, 1);
    tu_assert_ok(tide_check(a)); /* stats exact, refused pages kept as orphans */
    if (ring == TIDE_OK) tu_assert_ok(tide_buf_destroy(r));
    tu_assert_ok(tide_buf_destroy(b));
    tu_assert_ok(tide_stream_synchronize(a, s));
    /* Every page that was taken is given back (a refused unmap or release
     * keeps its bytes held, so count only where the backend agreed). */
    if (reserved(a) != 0) assert_int_equal((uint64_t)reserved(a), tide_host_bytes_in_use(a));
    tu_assert_ok(tide_stream_destroy(a, s));
    tide_destroy(a);
    if (!failed && n > calls) break;
    sites++;
  }
  assert_true(sites > 10);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_growth_keeps_address_and_data),
      cmocka_unit_test(test_shrink_waits_for_the_stream),
      cmocka_unit_test(test_regrowth_cancels_pending_release),
      cmocka_unit_test(test_map_ahead_avoids_backend_calls),
      cmocka_unit_test(test_map_ahead_is_bytes_not_pages),
      cmocka_unit_test(test_map_ahead_fraction_bounds_it_by_the_length),
      cmocka_unit_test(test_buffer_growth_releases_larger_handles),
      cmocka_unit_test(test_buffer_room_from_idle_blocks_does_not_wait),
      cmocka_unit_test(test_buffer_pages_count_as_mappings),
      cmocka_unit_test(test_buffer_at_the_limit_takes_cached_memory),
      cmocka_unit_test(test_empty_cache_takes_pages_a_shrink_let_go),
      cmocka_unit_test(test_growth_at_the_limit_takes_pages_a_shrink_let_go),
      cmocka_unit_test(test_worker_maps_ahead),
      cmocka_unit_test(test_worker_after_pending_release),
      cmocka_unit_test(test_check_while_buffers_change),
      cmocka_unit_test(test_check_while_buffers_reclaim),
      cmocka_unit_test(test_ring_maps_pages_twice),
      cmocka_unit_test(test_limit_and_capacity),
      cmocka_unit_test(test_bad_input),
      cmocka_unit_test(test_destroy_takes_buffers_left),
      cmocka_unit_test(test_destroy_after_waits_for_pages_kept_ahead),
      cmocka_unit_test(test_destroy_after_waits_for_a_ring),
      cmocka_unit_test(test_faults_at_every_call),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
