/* test_allocator.c: unit tests of the device allocator on the host backend —
 * sizes and rounding, bins, the live map, splitting and merging, fixed and
 * expandable segments, stream-ordered reuse, limits, garbage collection,
 * the out-of-memory path, statistics, the trace and the snapshot. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "memory/core.h"

#define MiB ((size_t)1 << 20)

static tide_allocator *make(const char *conf) {
  tide_config *c = NULL;
  assert_int_equal(tide_config_new(&c), TIDE_OK);
  assert_int_equal(tide_config_parse(c, "backend:host"), TIDE_OK);
  if (conf) {
    int rc = tide_config_parse(c, conf);
    if (rc) fail_msg("config %s: %s", conf, tide_last_error());
  }
  tide_allocator *a = NULL;
  int rc = tide_create(0, c, &a);
  if (rc) fail_msg("tide_create: %s", tide_last_error());
  tide_config_free(c);
  return a;
}

static tide_stats stats_of(tide_allocator *a) {
  tide_stats s;
  assert_int_equal(tide_get_stats(a, &s), TIDE_OK);
  return s;
}

static void destroy_clean(tide_allocator *a) {
  assert_int_equal(tide_empty_cache(a), TIDE_OK);
  tide_stats s = stats_of(a);
  assert_int_equal(s.allocated_bytes[0].current, 0);
  assert_int_equal(s.reserved_bytes[0].current, 0);
  assert_int_equal(tide_host_bytes_in_use(a), 0);
  assert_int_equal(tide_destroy(a), TIDE_OK);
}

/* ------------------------------------------------------------------------ */

static void test_round_size(void **state) {
  (void)state;
  _tide_conf_values conf = {0};
  assert_int_equal(_tide_round_size(&conf, 1), 512);
  assert_int_equal(_tide_round_size(&conf, 512), 512);
  assert_int_equal(_tide_round_size(&conf, 513), 1024);
  assert_int_equal(_tide_round_size(&conf, 3 * MiB + 1), 3 * MiB + 512);
  for (int i = 0; i < TIDE_ROUNDUP_INTERVALS; i++) conf.roundup_divisions[i] = 4;
  /* Four steps between powers of two: 1280 -> 1536, 5 MiB + 1 -> 6 MiB. */
  assert_int_equal(_tide_round_size(&conf, 1280), 1536);
  assert_int_equal(_tide_round_size(&conf, 5 * MiB + 1), 6 * MiB);
  assert_int_equal(_tide_round_size(&conf, 8 * MiB), 8 * MiB);
  assert_int_equal(_tide_round_size(&conf, 1500), 1536);
}

static void test_fixed_segment_sizes(void **state) {
  (void)state;
  size_t g = 2 * MiB;
  assert_int_equal(_tide_fixed_segment_size(512, g), 2 * MiB);
  assert_int_equal(_tide_fixed_segment_size(1 * MiB, g), 2 * MiB);
  assert_int_equal(_tide_fixed_segment_size(1 * MiB + 512, g), 20 * MiB);
  assert_int_equal(_tide_fixed_segment_size(10 * MiB - 512, g), 20 * MiB);
  assert_int_equal(_tide_fixed_segment_size(10 * MiB, g), 10 * MiB);
  assert_int_equal(_tide_fixed_segment_size(31 * MiB, g), 32 * MiB);
}

static void test_bins_best_fit(void **state) {
  (void)state;
  static _tide_bins bins;
  static _tide_segment seg;
  _tide_block blocks[6];
  size_t sizes[6] = {4096, 2048, 3 * MiB, 3 * MiB + 4096, 3 * MiB, 64 * MiB};
  memset(&bins, 0, sizeof bins);
  for (int i = 0; i < 6; i++) {
    memset(&blocks[i], 0, sizeof blocks[i]);
    blocks[i].size = sizes[i];
    blocks[i].addr = (uintptr_t)(0x100000000ull - (uint64_t)i * 0x1000000ull);
    blocks[i].segment = &seg;
    _tide_bins_insert(&bins, &blocks[i]);
  }
  assert_ptr_equal(_tide_bins_best_fit(&bins, 1024), &blocks[1]);
  assert_ptr_equal(_tide_bins_best_fit(&bins, 2560), &blocks[0]);
  /* Two blocks of 3 MiB: the lower address wins. */
  assert_ptr_equal(_tide_bins_best_fit(&bins, 2 * MiB), &blocks[4]);
  assert_ptr_equal(_tide_bins_best_fit(&bins, 3 * MiB + 512), &blocks[3]);
  assert_ptr_equal(_tide_bins_best_fit(&bins, 5 * MiB), &blocks[5]);
  assert_null(_tide_bins_best_fit(&bins, 65 * MiB));
  assert_ptr_equal(_tide_bins_largest(&bins), &blocks[5]);
  _tide_bins_remove(&bins, &blocks[5]);
  assert_null(_tide_bins_best_fit(&bins, 5 * MiB));
  for (int i = 0; i < 5; i++) _tide_bins_remove(&bins, &blocks[i]);
  assert_int_equal(bins.count, 0);
  assert_null(_tide_bins_best_fit(&bins, 512));
  /* Bins never decrease with size. */
  for (size_t s = 512, last = 0; s < ((size_t)1 << 40); s += s / 7 + 512) {
    uint32_t b = _tide_bin_of(s / 512 * 512);
    assert_true(b >= last);
    last = b;
  }
}

static void test_ptrmap_against_reference(void **state) {
  (void)state;
  enum { N = 20000 };
  _tide_ptrmap m;
  static _tide_block blocks[N];
  static bool in[N];
  assert_int_equal(_tide_ptrmap_init(&m), TIDE_OK);
  uint64_t x = 12345;
  for (int step = 0; step < 200000; step++) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    int i = (int)((x >> 33) % N);
    blocks[i].addr = 0x7f0000000000ull + (uintptr_t)i * 512u * 37u;
    if (in[i]) {
      assert_ptr_equal(_tide_ptrmap_remove(&m, blocks[i].addr), &blocks[i]);
      in[i] = false;
    } else {
      assert_int_equal(_tide_ptrmap_reserve_one(&m), TIDE_OK);
      _tide_ptrmap_put(&m, &blocks[i]);
      in[i] = true;
    }
    if (step % 997 == 0) {
      size_t count = 0;
      for (int j = 0; j < N; j++) {
        if (!blocks[j].addr) continue;
        assert_ptr_equal(_tide_ptrmap_find(&m, blocks[j].addr), in[j] ? &blocks[j] : NULL);
        count += in[j];
      }
      assert_int_equal(m.count, count);
    }
  }
  _tide_ptrmap_destroy(&m);
}

/* ------------------------------------------------------------------------ */

static void test_malloc_alignment_and_data(void **state) {
  (void)state;
  tide_allocator *a = make(NULL);
  void *p[64];
  for (int i = 0; i < 64; i++) {
    size_t size = (size_t)(i * 7919 % 3000000) + 1;
    p[i] = tide_malloc(a, size, NULL);
    assert_non_null(p[i]);
    assert_int_equal((uintptr_t)p[i] % 512, 0);
    memset(p[i], i, size);
  }
  for (int i = 0; i < 64; i++) {
    size_t size = (size_t)(i * 7919 % 3000000) + 1;
    assert_int_equal(((unsigned char *)p[i])[size - 1], (unsigned char)i);
    assert_int_equal(((unsigned char *)p[i])[0], (unsigned char)i);
  }
  for (int i = 0; i < 64; i++) assert_int_equal(tide_free(a, p[i], NULL), TIDE_OK);
  destroy_clean(a);
}

static void test_split_and_merge_fixed(void **state) {
  (void)state;
  tide_allocator *a = make("expandable_segments:False");
  char *x = tide_malloc(a, 4096, NULL), *y = tide_malloc(a, 4096, NULL);
  char *z = tide_malloc(a, 4096, NULL);
  /* One 2 MiB small segment, carved in address order. */
  assert_ptr_equal(y, x + 4096);
  assert_ptr_equal(z, y + 4096);
  tide_stats s = stats_of(a);
  assert_int_equal(s.reserved_bytes[TIDE_POOL_SMALL].current, 2 * MiB);
  assert_int_equal(s.segments[0].current, 1);
  assert_int_equal(s.allocated_bytes[0].current, 3 * 4096);
  assert_int_equal(s.inactive_split_bytes[0].current, 2 * MiB - 3 * 4096);
  /* Free the middle and the first: once merged, 8 KiB fits at x. */
  assert_int_equal(tide_free(a, y, NULL), TIDE_OK);
  assert_int_equal(tide_free(a, x, NULL), TIDE_OK);
  char *w = tide_malloc(a, 8192, NULL);
  assert_ptr_equal(w, x);
  assert_int_equal(tide_free(a, w, NULL), TIDE_OK);
  assert_int_equal(tide_free(a, z, NULL), TIDE_OK);
  s = stats_of(a);
  assert_int_equal(s.allocated_bytes[0].current, 0);
  assert_int_equal(s.reserved_bytes[0].current, 2 * MiB);
  destroy_clean(a);
}

static void test_fixed_large_segments(void **state) {
  (void)state;
  tide_allocator *a = make("expandable_segments:False");
  void *p = tide_malloc(a, 5 * MiB, NULL);
  tide_stats s = stats_of(a);
  assert_int_equal(s.reserved_bytes[TIDE_POOL_LARGE].current, 20 * MiB);
  /* 20 MiB - 5 MiB > 1 MiB: split, so a second 5 MiB fits the same segment. */
  void *q = tide_malloc(a, 5 * MiB, NULL);
  s = stats_of(a);
  assert_int_equal(s.reserved_bytes[0].current, 20 * MiB);
  assert_int_equal(s.segments[0].current, 1);
  void *r = tide_malloc(a, 31 * MiB, NULL);
  s = stats_of(a);
  assert_int_equal(s.reserved_bytes[0].current, 52 * MiB);
  tide_free(a, p, NULL);
  tide_free(a, q, NULL);
  tide_free(a, r, NULL);
  assert_int_equal(tide_empty_cache(a), TIDE_OK);
  s = stats_of(a);
  assert_int_equal(s.segments[0].current, 0);
  assert_int_equal(s.segments_released, 2);
  destroy_clean(a);
}

static void test_expandable_maps_pages_on_demand(void **state) {
  (void)state;
  tide_allocator *a = make("release_holes:False,load_handles:False");
  void *p = tide_malloc(a, 3 * MiB, NULL);
  tide_stats s = stats_of(a);
  assert_int_equal(s.pages_mapped, 2);
  assert_int_equal(s.reserved_bytes[0].current, 4 * MiB);
  /* Packed from the front: the second block starts right after the first
   * and maps one more page. */
  char *q = tide_malloc(a, 2 * MiB, NULL);
  assert_ptr_equal(q, (char *)p + 3 * MiB);
  s = stats_of(a);
  assert_int_equal(s.pages_mapped, 3);
  assert_int_equal(s.reserved_bytes[0].current, 6 * MiB);
  assert_int_equal(s.reserved_bytes[0].current, (int64_t)tide_host_bytes_in_use(a));
  tide_free(a, p, NULL);
  /* p's whole first page is free: empty_cache unmaps it; q's pages stay. */
  assert_int_equal(tide_empty_cache(a), TIDE_OK);
  s = stats_of(a);
  assert_int_equal(s.pages_unmapped, 1);
  assert_int_equal(s.reserved_bytes[0].current, 4 * MiB);
  memset(q, 7, 2 * MiB);
  tide_free(a, q, NULL);
  destroy_clean(a);
}

static void test_page_aware_placement(void **state) {
  (void)state;
  tide_allocator *a = make("release_holes:True");
  void *p = tide_malloc(a, 3 * MiB, NULL);
  /* A page-sized block goes where it keeps one page to itself (page
   * aligned) rather than straddling two pages behind p. */
  char *q = tide_malloc(a, 2 * MiB, NULL);
  assert_ptr_equal(q, (char *)p + 4 * MiB);
  assert_int_equal(stats_of(a).pages_mapped, 3);
  tide_free(a, p, NULL);
  /* p's two pages are p's alone: both go back, q's page stays. */
  assert_int_equal(tide_empty_cache(a), TIDE_OK);
  tide_stats s = stats_of(a);
  assert_int_equal(s.pages_unmapped, 2);
  assert_int_equal(s.reserved_bytes[0].current, 2 * MiB);
  memset(q, 7, 2 * MiB);
  tide_free(a, q, NULL);
  destroy_clean(a);
}

/* Large blocks below a page pack from the front: on a page each, eight
 * caches just past 1 MiB would hold eight pages, each with a gap below
 * 1 MiB behind its block that no large request fits. */
static void test_sub_page_large_blocks_pack(void **state) {
  (void)state;
  tide_allocator *a = make("release_holes:True");
  enum { N = 8 };
  const size_t size = MiB + 4096;
  char *p[N];
  for (int i = 0; i < N; i++) {
    p[i] = tide_malloc(a, size, NULL);
    assert_non_null(p[i]);
    if (i) assert_ptr_equal(p[i], p[i - 1] + size);
  }
  tide_stats s = stats_of(a);
  assert_int_equal(s.reserved_bytes[0].current, 5 * 2 * MiB); /* 8.03 MiB in 5 pages */
  for (int i = 0; i < N; i++) tide_free(a, p[i], NULL);
  destroy_clean(a);
}

/* Free pages stay mapped while growth keeps reserved memory within the
 * memory limit (408 MiB here): no pressure, nothing unmapped. */
static void test_release_waits_for_the_limit(void **state) {
  (void)state;
  tide_allocator *a = make("release_holes:True,memory_limit:408MiB");
  void *first = tide_malloc(a, 2 * MiB, NULL);
  void *big = tide_malloc(a, 400 * MiB, NULL);
  assert_int_equal(stats_of(a).reserved_bytes[0].current, 402 * MiB);
  /* first's page becomes whole and free; 4 MiB more fit under the limit,
   * so growth maps two pages and unmaps none. */
  tide_free(a, first, NULL);
  void *more = tide_malloc(a, 4 * MiB, NULL);
  tide_stats s = stats_of(a);
  assert_int_equal(s.pages_unmapped, 0);
  assert_int_equal(s.reserved_bytes[0].current, 406 * MiB);
  /* At the limit, the old free page is recycled instead of added to. */
  void *last = tide_malloc(a, 4 * MiB, NULL);
  s = stats_of(a);
  assert_int_equal(s.pages_unmapped, 1);
  assert_int_equal(s.reserved_bytes[0].current, 408 * MiB);
  tide_free(a, big, NULL);
  tide_free(a, more, NULL);
  tide_free(a, last, NULL);
  destroy_clean(a);
}

static void test_release_reuses_physical_pages(void **state) {
  (void)state;
  tide_allocator *a = make("release_holes:True,load_handles:False,memory_limit:10MiB");
  void *x = tide_malloc(a, 4 * MiB, NULL), *y = tide_malloc(a, 4 * MiB, NULL);
  tide_stats s = stats_of(a);
  assert_int_equal(s.num_device_alloc, 4);
  tide_free(a, x, NULL);
  /* 6 MiB does not fit x's hole; growing would pass the limit, so
   * x's two pages are unmapped first and their handles mapped again at the
   * end: one page is new, none is released. */
  void *z = tide_malloc(a, 6 * MiB, NULL);
  assert_non_null(z);
  s = stats_of(a);
  assert_int_equal(s.pages_unmapped, 2);
  assert_int_equal(s.pages_mapped, 4 + 3);
  assert_int_equal(s.num_device_alloc, 5);
  assert_int_equal(s.num_device_free, 0);
  assert_int_equal(s.reserved_bytes[0].current, 10 * MiB);
  assert_int_equal(s.reserved_bytes[0].current, (int64_t)tide_host_bytes_in_use(a));
  memset(z, 3, 6 * MiB);
  tide_free(a, y, NULL);
  tide_free(a, z, NULL);
  destroy_clean(a);
}

/* Growth that extends the free block at one end of a hole may recycle the
 * free block at its other end: only the block the new pages join is kept. */
static void test_release_far_end_of_hole(void **state) {
  (void)state;
  tide_allocator *a = make("release_holes:True,load_handles:False");
  void *pin0 = tide_malloc(a, 2 * MiB, NULL), *f1 = tide_malloc(a, 4 * MiB, NULL);
  void *h = tide_malloc(a, 8 * MiB, NULL), *f2 = tide_malloc(a, 8 * MiB, NULL);
  void *pin1 = tide_malloc(a, 2 * MiB, NULL);
  tide_free(a, h, NULL);
  assert_int_equal(tide_empty_cache(a), TIDE_OK);                /* pages 3-6 unmapped: the hole */
  tide_free(a, f1, NULL);                                        /* pages 1-2 free, left of it */
  tide_free(a, f2, NULL);                                        /* pages 7-10 free, right of it */
  assert_int_equal(tide_set_memory_limit(a, 16 * MiB), TIDE_OK); /* at the limit */
  tide_stats s = stats_of(a);
  assert_int_equal(s.reserved_bytes[0].current, 16 * MiB);
  uint64_t unmapped = s.pages_unmapped, created = s.num_device_alloc;
  /* 12 MiB: two pages at the hole's far end join f2's block; f1's pages,
   * at the near end, are not extended, so they are recycled for them. */
  char *p = tide_malloc(a, 12 * MiB, NULL);
  assert_ptr_equal(p, (char *)f2 - 4 * MiB);
  s = stats_of(a);
  assert_int_equal(s.pages_unmapped, unmapped + 2);
  assert_int_equal(s.num_device_alloc, created);
  assert_int_equal(s.reserved_bytes[0].current, 16 * MiB);
  memset(p, 5, 12 * MiB);
  tide_free(a, p, NULL);
  tide_free(a, pin0, NULL);
  tide_free(a, pin1, NULL);
  destroy_clean(a);
}

/* mapping_ns sums the time of the backend's calls that create, map, make
 * accessible, unmap and release memory: it grows with growth and with giving
 * memory back, and not at all on the cached path. */
static void test_mapping_time(void **state) {
  (void)state;
  tide_allocator *a = make(NULL);
  assert_int_equal(stats_of(a).mapping_ns, 0);
  void *x = tide_malloc(a, 4 * MiB, NULL);
  assert_non_null(x);
  uint64_t grown = stats_of(a).mapping_ns;
  assert_true(grown > 0);
  tide_free(a, x, NULL);
  for (int i = 0; i < 100; i++) {
    void *y = tide_malloc(a, 4 * MiB, NULL);
    assert_non_null(y);
    tide_free(a, y, NULL);
  }
  assert_int_equal(stats_of(a).mapping_ns, grown);
  assert_int_equal(tide_reset_peak_stats(a), TIDE_OK); /* a sum, not a peak */
  assert_int_equal(stats_of(a).mapping_ns, grown);
  assert_int_equal(tide_empty_cache(a), TIDE_OK);
  assert_true(stats_of(a).mapping_ns > grown);
  destroy_clean(a);
}

/* device_queries counts the queries of the device's free memory and
 * device_query_ns their time: growth asks, the cached path does not, and
 * allocations of changing sizes ask once per _TIDE_DEVICE_CHECK_EVERY (256)
 * of them at most. */
static void test_device_queries(void **state) {
  (void)state;
  tide_allocator *a = make(NULL);
  assert_int_equal(stats_of(a).device_queries, 0);
  void *x = tide_malloc(a, 4 * MiB, NULL);
  assert_non_null(x);
  tide_stats grown = stats_of(a);
  assert_true(grown.device_queries >= 1);
  assert_true(grown.device_query_ns > 0);
  tide_free(a, x, NULL);
  for (int i = 0; i < 1000; i++) { /* one size: quick reuse, no query */
    void *y = tide_malloc(a, 4 * MiB, NULL);
    assert_non_null(y);
    tide_free(a, y, NULL);
  }
  assert_int_equal(stats_of(a).device_queries, grown.device_queries);
  void *held = NULL;
  for (int i = 0; i < 1024; i++) { /* sizes that change: past the quick blocks */
    void *y = tide_malloc(a, (size_t)(1 + i % 9) * 512 * 1024, NULL);
    assert_non_null(y);
    if (held) tide_free(a, held, NULL);
    held = y;
  }
  tide_free(a, held, NULL);
  tide_stats churned = stats_of(a);
  assert_true(churned.device_queries > grown.device_queries);
  assert_true(churned.device_queries - grown.device_queries <= 1024 / 256 + churned.mappings);
  assert_true(churned.device_query_ns > grown.device_query_ns);
  destroy_clean(a);
}

/* Growth far from the device's low-water mark takes the device's free
 * memory from the last reading: a query per growth would only cost a driver
 * call. Near the mark every growth asks (a 64 MiB device: its mark, a 64th,
 * is 1 MiB, and two marks of room are left only below 61 MiB). */
static void test_growth_asks_the_device_near_its_mark(void **state) {
  (void)state;
  tide_allocator *a = make("host_capacity:64MiB,load_handles:False");
  void *held[64] = {0};
  held[0] = tide_malloc(a, 2 * MiB, NULL); /* the first growth reads the device */
  assert_non_null(held[0]);
  uint64_t first = stats_of(a).device_queries;
  assert_true(first >= 1);
  for (int i = 1; i < 8; i++) { /* to 16 MiB of 64: far from the mark */
    held[i] = tide_malloc(a, 2 * MiB, NULL);
    assert_non_null(held[i]);
  }
  tide_stats far = stats_of(a);
  assert_true(far.mappings >= 8);
  assert_int_equal(far.device_queries, first);
  int n = 8;
  while (n < 64 && (held[n] = tide_malloc(a, 2 * MiB, NULL)) != NULL) n++;
  tide_stats near = stats_of(a);
  assert_true(n >= 30); /* the 64 MiB device filled to its last pages */
  /* Each growth within two marks (and the last, refused one) asked. */
  assert_true(near.device_queries >= far.device_queries + 2);
  assert_true(near.device_queries <= far.device_queries + (uint64_t)(n - 8) + 2);
  for (int i = 0; i < n; i++) tide_free(a, held[i], NULL);
  tide_destroy(a);
}

static void test_quick_reuse_and_flush(void **state) {
  (void)state;
  tide_allocator *a = make(NULL);
  void *x = tide_malloc(a, 1000, NULL);
  void *keep = tide_malloc(a, 512, NULL);
  tide_free(a, x, NULL);
  /* The same size comes back at once, from the quick list. */
  void *y = tide_malloc(a, 1000, NULL);
  assert_ptr_equal(x, y);
  tide_free(a, y, NULL);
  tide_free(a, keep, NULL);
  /* Another size merges the quick blocks first: the best fit is the whole
   * free page again, from its start, and reserved does not grow. */
  int64_t before = stats_of(a).reserved_bytes[0].current;
  void *z = tide_malloc(a, 1 * MiB, NULL);
  assert_ptr_equal(z, x);
  assert_int_equal(stats_of(a).reserved_bytes[0].current, before);
  tide_free(a, z, NULL);
  destroy_clean(a);
}

static void test_stream_ordered_reuse(void **state) {
  (void)state;
  tide_allocator *a = make(NULL);
  tide_stream side;
  assert_int_equal(tide_stream_create(a, &side), TIDE_OK);
  assert_int_equal(tide_host_stream_hold(a, side), TIDE_OK);
  void *p = tide_malloc(a, 64 * 1024, NULL);
  assert_int_equal(tide_record_stream(a, p, side), TIDE_OK);
  assert_int_equal(tide_free(a, p, NULL), TIDE_OK);
  tide_stats s = stats_of(a);
  assert_int_equal(s.allocated_bytes[0].current, 0);
  assert_int_equal(s.active_bytes[0].current, 64 * 1024);
  assert_int_equal(s.active_blocks[0].current, 1);
  /* While the side stream still works, the block must not come back. */
  void *q = tide_malloc(a, 64 * 1024, NULL);
  assert_ptr_not_equal(p, q);
  /* empty_cache cannot wait for a held stream: the block stays pending. */
  tide_empty_cache(a);
  assert_int_equal(stats_of(a).active_blocks[0].current, 2);
  assert_int_equal(tide_host_stream_release(a, side), TIDE_OK);
  void *r = tide_malloc(a, 64 * 1024, NULL);
  assert_ptr_equal(r, p);
  s = stats_of(a);
  assert_int_equal(s.active_bytes[0].current, 2 * 64 * 1024);
  assert_int_equal(s.active_bytes[0].peak, 2 * 64 * 1024);
  tide_free(a, q, NULL);
  tide_free(a, r, NULL);
  assert_int_equal(tide_stream_destroy(a, side), TIDE_OK);
  destroy_clean(a);
}

static void test_free_on_other_stream(void **state) {
  (void)state;
  tide_allocator *a = make(NULL);
  tide_stream side;
  assert_int_equal(tide_stream_create(a, &side), TIDE_OK);
  void *p = tide_malloc(a, 4096, NULL);
  assert_int_equal(tide_host_stream_hold(a, side), TIDE_OK);
  /* Freed on `side`: reusable only after side's queued work. */
  assert_int_equal(tide_free(a, p, side), TIDE_OK);
  void *q = tide_malloc(a, 4096, NULL);
  assert_ptr_not_equal(p, q);
  /* A double free is caught while the block waits. */
  assert_int_equal(tide_free(a, p, NULL), TIDE_ERR_DOUBLE_FREE);
  tide_host_stream_release(a, side);
  void *r = tide_malloc(a, 4096, NULL);
  assert_ptr_equal(r, p);
  tide_free(a, q, NULL);
  tide_free(a, r, NULL);
  tide_stream_destroy(a, side);
  destroy_clean(a);
}

static void test_arena_per_stream(void **state) {
  (void)state;
  tide_allocator *a = make(NULL);
  tide_stream s1, s2;
  assert_int_equal(tide_stream_create(a, &s1), TIDE_OK);
  assert_int_equal(tide_stream_create(a, &s2), TIDE_OK);
  void *p1 = tide_malloc(a, 4096, s1), *p2 = tide_malloc(a, 4096, s2);
  tide_stream where = NULL;
  size_t size = 0;
  assert_int_equal(tide_block_info(a, p1, NULL, &size, &where), TIDE_OK);
  assert_ptr_equal(where, s1);
  assert_int_equal(size, 4096);
  assert_int_equal(tide_block_info(a, p2, NULL, NULL, &where), TIDE_OK);
  assert_ptr_equal(where, s2);
  /* Each stream has its own small segment. */
  assert_int_equal(stats_of(a).segments[0].current, 2);
  assert_int_equal(stats_of(a).allocated_bytes[0].peak, 8192);
  tide_free(a, p1, s1);
  tide_free(a, p2, s2);
  tide_stream_destroy(a, s1);
  tide_stream_destroy(a, s2);
  destroy_clean(a);
}

/* More streams than the table of streams has slots: those beyond it, and
 * those whose home slot another took, go through the slower lookups, with
 * the same results. A block freed on its stream comes back on that stream
 * only. */
static void test_more_streams_than_slots(void **state) {
  (void)state;
  enum { STREAMS = 100 };
  tide_allocator *a = make(NULL);
  tide_stream s[STREAMS];
  void *p[STREAMS];
  for (int i = 0; i < STREAMS; i++) {
    assert_int_equal(tide_stream_create(a, &s[i]), TIDE_OK);
    p[i] = tide_malloc(a, 4096, s[i]);
    assert_non_null(p[i]);
  }
  for (int round = 0; round < 3; round++)
    for (int i = 0; i < STREAMS; i++) {
      tide_stream where = NULL;
      assert_int_equal(tide_block_info(a, p[i], NULL, NULL, &where), TIDE_OK);
      assert_ptr_equal(where, s[i]);
      assert_int_equal(tide_free(a, p[i], s[i]), TIDE_OK);
      void *again = tide_malloc(a, 4096, s[i]);
      assert_ptr_equal(again, p[i]); /* its own quick block, not another stream's */
    }
  tide_stats st = stats_of(a);
  assert_int_equal(st.allocated_bytes[0].current, STREAMS * 4096);
  assert_int_equal(st.allocations[0].current, STREAMS);
  assert_int_equal(tide_check(a), TIDE_OK);
  for (int i = 0; i < STREAMS; i++) {
    assert_int_equal(tide_free(a, p[i], s[i]), TIDE_OK);
    assert_int_equal(tide_stream_destroy(a, s[i]), TIDE_OK);
  }
  destroy_clean(a);
}

static void test_memory_limit(void **state) {
  (void)state;
  tide_allocator *a = make("memory_limit:64MiB,host_capacity:24GiB");
  void *p = tide_malloc(a, 40 * MiB, NULL);
  assert_non_null(p);
  assert_null(tide_malloc(a, 40 * MiB, NULL));
  assert_int_equal(tide_last_status(), TIDE_ERR_OOM);
  assert_non_null(strstr(tide_last_error(), "out of memory"));
  assert_non_null(strstr(tide_last_error(), "memory limit"));
  assert_int_equal(stats_of(a).num_ooms, 1);
  assert_int_equal(tide_set_memory_limit(a, 0), TIDE_OK);
  void *q = tide_malloc(a, 40 * MiB, NULL);
  assert_non_null(q);
  assert_int_equal(tide_set_memory_fraction(a, 0.0), TIDE_ERR_INVALID);
  assert_int_equal(tide_set_memory_fraction(a, 0.5), TIDE_OK);
  assert_int_equal(stats_of(a).memory_limit, 12 * (uint64_t)1 << 30);
  tide_free(a, p, NULL);
  tide_free(a, q, NULL);
  destroy_clean(a);
}

static void test_oom_frees_cache_and_retries(void **state) {
  (void)state;
  tide_allocator *a = make("host_capacity:64MiB,expandable_segments:False");
  void *p = tide_malloc(a, 40 * MiB, NULL);
  assert_non_null(p);
  tide_free(a, p, NULL);
  /* 40 MiB stays cached; 50 MiB more does not fit without releasing it. */
  void *q = tide_malloc(a, 50 * MiB, NULL);
  assert_non_null(q);
  tide_stats s = stats_of(a);
  assert_int_equal(s.num_alloc_retries, 1);
  assert_int_equal(s.num_ooms, 0);
  assert_int_equal(s.reserved_bytes[0].current, 50 * MiB);
  /* Nothing left to free: a real OOM with the whole story. */
  assert_null(tide_malloc(a, 20 * MiB, NULL));
  const char *msg = tide_last_error();
  assert_int_equal(tide_last_status(), TIDE_ERR_OOM);
  assert_non_null(strstr(msg, "tried to allocate 20.00 MiB"));
  assert_non_null(strstr(msg, "Allocated 50.00 MiB"));
  assert_non_null(strstr(msg, "reserved 50.00 MiB"));
  assert_non_null(strstr(msg, "device free"));
  assert_non_null(strstr(msg, "largest free block"));
  assert_non_null(strstr(msg, "Try:"));
  tide_free(a, q, NULL);
  destroy_clean(a);
}

static void test_garbage_collection_threshold(void **state) {
  (void)state;
  tide_allocator *a =
      make("memory_limit:100MiB,garbage_collection_threshold:0.5,expandable_segments:False");
  void *p[4];
  for (int i = 0; i < 4; i++) p[i] = tide_malloc(a, 12 * MiB, NULL);
  for (int i = 0; i < 4; i++) tide_free(a, p[i], NULL);
  assert_int_equal(stats_of(a).reserved_bytes[0].current, 48 * MiB);
  /* Reserved is under half the limit: nothing is collected. */
  void *q = tide_malloc(a, 30 * MiB, NULL);
  assert_int_equal(stats_of(a).reserved_bytes[0].current, 78 * MiB);
  /* Above it: cached segments go before growing, so no retry is needed. */
  void *r = tide_malloc(a, 30 * MiB, NULL);
  assert_non_null(r);
  tide_stats s = stats_of(a);
  assert_int_equal(s.num_alloc_retries, 0);
  assert_true(s.reserved_bytes[0].current <= (int64_t)(72 * MiB));
  tide_free(a, q, NULL);
  tide_free(a, r, NULL);
  destroy_clean(a);
}

static void test_max_split_size(void **state) {
  (void)state;
  tide_allocator *a = make("expandable_segments:False,max_split_size_mb:40");
  void *big = tide_malloc(a, 100 * MiB, NULL);
  tide_free(a, big, NULL);
  /* A small request never takes an oversize block. */
  void *small = tide_malloc(a, 30 * MiB, NULL);
  assert_true((char *)small < (char *)big || (char *)small >= (char *)big + 100 * MiB);
  /* A large request takes it only if it is not much larger (20 MiB). */
  void *near = tide_malloc(a, 90 * MiB, NULL);
  assert_ptr_equal(near, big);
  assert_int_equal(stats_of(a).oversize_allocations, 1);
  tide_free(a, near, NULL);
  tide_free(a, small, NULL);
  destroy_clean(a);
}

static void test_stats_and_peaks(void **state) {
  (void)state;
  tide_allocator *a = make(NULL);
  void *p = tide_malloc(a, 1000, NULL), *q = tide_malloc(a, 3 * MiB, NULL);
  tide_stats s = stats_of(a);
  assert_int_equal(s.allocated_bytes[0].current, 1024 + 3 * MiB);
  assert_int_equal(s.allocated_bytes[TIDE_POOL_SMALL].current, 1024);
  assert_int_equal(s.allocated_bytes[TIDE_POOL_LARGE].current, 3 * MiB);
  assert_int_equal(s.requested_bytes[0].current, 1000 + 3 * MiB);
  assert_int_equal(s.allocations[0].current, 2);
  assert_int_equal(s.num_allocs, 2);
  tide_free(a, q, NULL);
  s = stats_of(a);
  assert_int_equal(s.allocated_bytes[0].peak, 1024 + 3 * MiB);
  assert_int_equal(s.allocated_bytes[0].current, 1024);
  assert_int_equal(tide_reset_peak_stats(a), TIDE_OK);
  s = stats_of(a);
  assert_int_equal(s.allocated_bytes[0].peak, 1024);
  assert_int_equal(s.reserved_bytes[0].peak, s.reserved_bytes[0].current);
  assert_int_equal(s.num_frees, 1);
  tide_free(a, p, NULL);
  destroy_clean(a);
}

/* The stats against a model, after every step of random allocations and
 * frees in which most sizes repeat (quick hits), with pending frees, peak
 * resets and emptied caches between them: current and peak of allocated
 * and requested bytes and of allocations, per pool and in all, and the
 * oversize count, exactly; tide_check each step. */
typedef struct model_stat {
  int64_t cur, peak;
} model_stat;

typedef struct model {
  model_stat f[3][TIDE_POOL_KINDS]; /* allocated, requested, allocations */
  int64_t oversize;
} model;

static void model_change(model *m, int pool, int64_t bytes, int64_t requested, int sign) {
  const int64_t delta[3] = {sign * bytes, sign * requested, sign};
  for (int k = 0; k < 3; k++)
    for (int p = 0; p < TIDE_POOL_KINDS; p += p == 0 ? pool : TIDE_POOL_KINDS) {
      model_stat *x = &m->f[k][p];
      x->cur += delta[k];
      if (x->cur > x->peak) x->peak = x->cur;
    }
}

static void model_check(tide_allocator *a, const model *m, int step) {
  tide_stats s = stats_of(a);
  const tide_stat *got[3] = {s.allocated_bytes, s.requested_bytes, s.allocations};
  static const char *const names[3] = {"allocated", "requested", "allocations"};
  for (int k = 0; k < 3; k++)
    for (int p = 0; p < TIDE_POOL_KINDS; p++)
      if (got[k][p].current != m->f[k][p].cur || got[k][p].peak != m->f[k][p].peak)
        fail_msg("step %d: %s of pool %d: %lld (peak %lld), the model %lld (peak %lld)", step,
                 names[k], p, (long long)got[k][p].current, (long long)got[k][p].peak,
                 (long long)m->f[k][p].cur, (long long)m->f[k][p].peak);
  if ((int64_t)s.oversize_allocations != m->oversize)
    fail_msg("step %d: %llu oversize allocations, the model %lld", step,
             (unsigned long long)s.oversize_allocations, (long long)m->oversize);
  if (tide_check(a) != TIDE_OK) fail_msg("step %d: %s", step, tide_last_error());
}

static void model_reset(model *m) {
  for (int k = 0; k < 3; k++)
    for (int p = 0; p < TIDE_POOL_KINDS; p++) m->f[k][p].peak = m->f[k][p].cur;
}

static void run_stats_model(const char *conf, size_t max_split) {
  enum { SLOTS = 24, STEPS = 3000 };
  static const size_t sizes[] = {500, 512, 4096, 70000, MiB, 3 * MiB, 21 * MiB};
  tide_allocator *a = make(conf);
  tide_stream side;
  assert_int_equal(tide_stream_create(a, &side), TIDE_OK);
  void *p[SLOTS] = {0};
  size_t asked[SLOTS] = {0}, block[SLOTS] = {0};
  model m;
  memset(&m, 0, sizeof m);
  uint64_t x = 0x7469646551ull;
  for (int step = 0; step < STEPS; step++) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    unsigned r = (unsigned)(x >> 33), i = r % SLOTS, what = (r / SLOTS) % 100;
    if (what < 2) {
      assert_int_equal(tide_reset_peak_stats(a), TIDE_OK);
      model_reset(&m);
    } else if (what < 4) {
      assert_int_equal(tide_empty_cache(a), TIDE_OK);
    } else if (p[i]) {
      int pool = block[i] > MiB ? 2 : 1; /* blocks of the small pool are at most 1 MiB */
      if (what < 10) {                   /* a free that waits for the side stream */
        assert_int_equal(tide_record_stream(a, p[i], side), TIDE_OK);
      }
      assert_int_equal(tide_free(a, p[i], NULL), TIDE_OK);
      model_change(&m, pool, (int64_t)block[i], (int64_t)asked[i], -1);
      m.oversize -= block[i] >= max_split;
      p[i] = NULL;
    } else {
      size_t size = what < 80 ? sizes[r % 7] : 512 + (size_t)(r % 4096) * 64;
      p[i] = tide_malloc(a, size, NULL);
      if (!p[i]) fail_msg("step %d: %s", step, tide_last_error());
      assert_int_equal(tide_block_info(a, p[i], NULL, &block[i], NULL), TIDE_OK);
      asked[i] = size;
      int pool = size <= MiB ? 1 : 2;
      model_change(&m, pool, (int64_t)block[i], (int64_t)size, +1);
      m.oversize += block[i] >= max_split;
    }
    model_check(a, &m, step);
  }
  for (int i = 0; i < SLOTS; i++)
    if (p[i]) assert_int_equal(tide_free(a, p[i], NULL), TIDE_OK);
  assert_int_equal(tide_stream_destroy(a, side), TIDE_OK);
  destroy_clean(a);
}

static void test_stats_follow_a_model(void **state) {
  (void)state;
  run_stats_model(NULL, SIZE_MAX);
  run_stats_model("expandable_segments:False", SIZE_MAX);
  run_stats_model("max_split_size_mb:20", 20 * MiB);
}

static void test_trace_ring(void **state) {
  (void)state;
  tide_allocator *a = make("trace:4");
  void *p = tide_malloc(a, 3 * MiB, NULL);
  tide_free(a, p, NULL);
  tide_trace_event ev[8];
  size_t n = 0;
  uint64_t dropped = 99;
  assert_int_equal(tide_trace_read(a, ev, 8, &n, &dropped), TIDE_OK);
  /* map, alloc, free */
  assert_int_equal(n, 3);
  assert_int_equal(dropped, 0);
  assert_int_equal(ev[0].kind, TIDE_TRACE_MAP);
  assert_int_equal(ev[1].kind, TIDE_TRACE_ALLOC);
  assert_int_equal(ev[1].addr, (uintptr_t)p);
  assert_int_equal(ev[2].kind, TIDE_TRACE_FREE);
  assert_true(ev[1].seq < ev[2].seq);
  tide_empty_cache(a); /* unmap + empty_cache: the ring of 4 overflows */
  assert_int_equal(tide_trace_read(a, ev, 8, &n, &dropped), TIDE_OK);
  assert_int_equal(n, 4);
  assert_int_equal(dropped, 1);
  assert_int_equal(ev[3].kind, TIDE_TRACE_EMPTY_CACHE);
  destroy_clean(a);
}

static void test_snapshot_json(void **state) {
  (void)state;
  tide_allocator *a = make(NULL);
  void *p = tide_malloc(a, 4096, NULL);
  char *json = NULL;
  size_t len = 0;
  assert_int_equal(tide_snapshot_json(a, &json, &len), TIDE_OK);
  assert_int_equal(strlen(json), len);
  assert_non_null(strstr(json, "\"kind\": \"expandable\""));
  assert_non_null(strstr(json, "\"state\": \"allocated\""));
  assert_non_null(strstr(json, "\"requested\": 4096"));
  tide_string_free(json);
  tide_free(a, p, NULL);
  destroy_clean(a);
}

static void test_destroy_reports_leaks(void **state) {
  (void)state;
  tide_allocator *a = make(NULL);
  assert_non_null(tide_malloc(a, 4096, NULL));
  assert_int_equal(tide_destroy(a), TIDE_ERR_STATE);
  assert_non_null(strstr(tide_last_error(), "1 block"));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_round_size),
      cmocka_unit_test(test_fixed_segment_sizes),
      cmocka_unit_test(test_bins_best_fit),
      cmocka_unit_test(test_ptrmap_against_reference),
      cmocka_unit_test(test_malloc_alignment_and_data),
      cmocka_unit_test(test_split_and_merge_fixed),
      cmocka_unit_test(test_fixed_large_segments),
      cmocka_unit_test(test_expandable_maps_pages_on_demand),
      cmocka_unit_test(test_page_aware_placement),
      cmocka_unit_test(test_sub_page_large_blocks_pack),
      cmocka_unit_test(test_release_reuses_physical_pages),
      cmocka_unit_test(test_release_far_end_of_hole),
      cmocka_unit_test(test_release_waits_for_the_limit),
      cmocka_unit_test(test_mapping_time),
      cmocka_unit_test(test_device_queries),
      cmocka_unit_test(test_growth_asks_the_device_near_its_mark),
      cmocka_unit_test(test_quick_reuse_and_flush),
      cmocka_unit_test(test_stream_ordered_reuse),
      cmocka_unit_test(test_free_on_other_stream),
      cmocka_unit_test(test_arena_per_stream),
      cmocka_unit_test(test_more_streams_than_slots),
      cmocka_unit_test(test_memory_limit),
      cmocka_unit_test(test_oom_frees_cache_and_retries),
      cmocka_unit_test(test_garbage_collection_threshold),
      cmocka_unit_test(test_max_split_size),
      cmocka_unit_test(test_stats_and_peaks),
      cmocka_unit_test(test_stats_follow_a_model),
      cmocka_unit_test(test_trace_ring),
      cmocka_unit_test(test_snapshot_json),
      cmocka_unit_test(test_destroy_reports_leaks),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
