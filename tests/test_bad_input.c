/* test_bad_input.c: what users get wrong, and that the allocator survives
 * it: double frees, pointers it never handed out (stack, heap, NULL+1, from
 * another allocator), interior and misaligned pointers, wrong sizes to
 * tide_free_sized, impossible sizes, a NULL allocator or NULL outputs to
 * every function, unknown and destroyed streams, bad memory limits, bad
 * configuration text and TIDALLOC_CONF, and the process-wide allocator's
 * rules (configuration after first use, use after tide_shutdown).
 *
 * Each error must come with its status and a message, must change nothing,
 * and afterwards the allocator must still allocate, keep data and count
 * exactly. The allocator tests run with expandable and with fixed segments. */
#include <math.h>
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

#define BOGUS_STREAM ((tide_stream)(uintptr_t)0x5eed0001)

typedef struct fixture {
  tide_allocator *a;
  tide_stream side;
  uint64_t seq;
} fixture;

static int setup(void **state) {
  fixture *f = calloc(1, sizeof *f);
  if (!f) return -1;
  f->a = tu_create((const char *)*state);
  tu_assert_ok(tide_stream_create(f->a, &f->side));
  *state = f;
  return 0;
}

static int teardown(void **state) {
  fixture *f = *state;
  tide_status rc = tide_stream_destroy(f->a, f->side);
  tide_status rc2 = tide_destroy(f->a);
  free(f);
  if (rc != TIDE_OK || rc2 != TIDE_OK) {
    print_error("teardown: tide_stream_destroy %s, tide_destroy %s: %s\n", tide_status_name(rc),
                tide_status_name(rc2), tide_last_error());
    return -1;
  }
  return 0;
}

/* ------------------------------------------------------------------------ */
/* Helpers                                                                   */
/* ------------------------------------------------------------------------ */

/* A block with its pattern written. */
static void *alloc_filled(fixture *f, size_t size, tide_stream stream, uint64_t *seq) {
  void *p = tide_malloc(f->a, size, stream);
  if (!p)
    fail_msg("tide_malloc(%zu): %s: %s", size, tide_status_name(tide_last_status()),
             tide_last_error());
  *seq = ++f->seq;
  tu_fill(p, size, *seq, TU_PATTERN_DEFAULT);
  return p;
}

static size_t block_size(fixture *f, void *p) {
  void *base = NULL;
  size_t size = 0;
  tu_assert_ok(tide_block_info(f->a, p, &base, &size, NULL));
  assert_ptr_equal(base, p);
  return size;
}

/* The stats equal the sums over `n` live blocks of `requested` bytes, and
 * reserved memory is what the device holds. */
static void expect_live(fixture *f, void *const *ptrs, const size_t *requested, size_t n) {
  int64_t bytes = 0, asked = 0;
  for (size_t i = 0; i < n; i++) {
    bytes += (int64_t)block_size(f, ptrs[i]);
    asked += (int64_t)requested[i];
  }
  tide_stats st = tu_stats(f->a);
  assert_int_equal(st.allocated_bytes[TIDE_POOL_ALL].current, bytes);
  assert_int_equal(st.requested_bytes[TIDE_POOL_ALL].current, asked);
  assert_int_equal(st.allocations[TIDE_POOL_ALL].current, (int64_t)n);
  assert_int_equal((uint64_t)st.reserved_bytes[TIDE_POOL_ALL].current,
                   tide_host_bytes_in_use(f->a));
}

/* After an error: a new block can be allocated, keeps its data, is counted
 * and freed, and the stats come back to what they were. */
static void still_works(fixture *f) {
  tide_stats before = tu_stats(f->a);
  size_t size = 3 * TU_MiB + 100;
  uint64_t seq;
  void *p = alloc_filled(f, size, NULL, &seq);
  size_t bsize = block_size(f, p);
  tide_stats during = tu_stats(f->a);
  assert_int_equal(during.allocated_bytes[0].current,
                   before.allocated_bytes[0].current + (int64_t)bsize);
  assert_int_equal(during.requested_bytes[0].current,
                   before.requested_bytes[0].current + (int64_t)size);
  assert_int_equal(during.allocations[0].current, before.allocations[0].current + 1);
  tu_assert_pattern(p, size, seq, TU_PATTERN_DEFAULT);
  tu_assert_ok(tide_free_sized(f->a, p, size, NULL));
  tide_stats after = tu_stats(f->a);
  assert_int_equal(after.allocated_bytes[0].current, before.allocated_bytes[0].current);
  assert_int_equal(after.requested_bytes[0].current, before.requested_bytes[0].current);
  assert_int_equal(after.allocations[0].current, before.allocations[0].current);
  assert_int_equal((uint64_t)after.reserved_bytes[0].current, tide_host_bytes_in_use(f->a));
  tu_assert_ok(tide_check(f->a));
}

/* `expr` fails with `want` and a message containing `needle`. */
#define expect_error(expr, want, needle)                                                           \
  do {                                                                                             \
    tide_clear_error();                                                                            \
    tu_assert_status((expr), (want));                                                              \
    tu_assert_last_error((want), (needle));                                                        \
  } while (0)

/* ------------------------------------------------------------------------ */
/* Pointers                                                                  */
/* ------------------------------------------------------------------------ */

static void double_free(void **state) {
  fixture *f = *state;
  uint64_t sa, sb;
  void *a = alloc_filled(f, TU_MiB, NULL, &sa);
  void *b = alloc_filled(f, TU_MiB, NULL, &sb);
  tu_assert_ok(tide_free(f->a, a, NULL));
  expect_error(tide_free(f->a, a, NULL), TIDE_ERR_DOUBLE_FREE, "double free");
  expect_error(tide_free(f->a, a, f->side), TIDE_ERR_DOUBLE_FREE, "double free");
  expect_error(tide_free_sized(f->a, a, TU_MiB, NULL), TIDE_ERR_DOUBLE_FREE, "double free");
  tu_assert_pattern(b, TU_MiB, sb, TU_PATTERN_DEFAULT);
  expect_live(f, (void *[]){b}, (size_t[]){TU_MiB}, 1);

  /* The freed block went back once: allocations of its size never overlap. */
  void *again[4];
  uint64_t seq[4];
  for (int i = 0; i < 4; i++) again[i] = alloc_filled(f, TU_MiB, NULL, &seq[i]);
  for (int i = 0; i < 4; i++) {
    assert_true((uintptr_t)again[i] + TU_MiB <= (uintptr_t)b ||
                (uintptr_t)b + TU_MiB <= (uintptr_t)again[i]);
    for (int j = 0; j < i; j++) assert_ptr_not_equal(again[i], again[j]);
  }
  for (int i = 0; i < 4; i++) tu_assert_pattern(again[i], TU_MiB, seq[i], TU_PATTERN_DEFAULT);
  for (int i = 0; i < 4; i++) tu_assert_ok(tide_free(f->a, again[i], NULL));
  tu_assert_ok(tide_free(f->a, b, NULL));
  still_works(f);
}

/* A free still waiting on another stream is freed already. */
static void double_free_while_pending(void **state) {
  fixture *f = *state;
  uint64_t seq;
  void *p = alloc_filled(f, 2 * TU_MiB, NULL, &seq);
  tu_assert_ok(tide_host_stream_hold(f->a, f->side));
  tu_assert_ok(tide_free(f->a, p, f->side)); /* pending until side's work is done */
  tide_stats st = tu_stats(f->a);
  assert_int_equal(st.allocations[0].current, 0);
  assert_true(st.active_blocks[0].current == 1);
  expect_error(tide_free(f->a, p, NULL), TIDE_ERR_DOUBLE_FREE, "double free");
  expect_error(tide_free(f->a, p, f->side), TIDE_ERR_DOUBLE_FREE, "double free");
  tu_assert_ok(tide_host_stream_release(f->a, f->side));
  tu_assert_ok(tide_empty_cache(f->a));
  st = tu_stats(f->a);
  assert_int_equal(st.active_blocks[0].current, 0);
  still_works(f);
}

/* Once the page of a freed block went back to the device, freeing it again
 * is still refused (its memory is not the allocator's any more). */
static void double_free_after_empty_cache(void **state) {
  fixture *f = *state;
  uint64_t seq;
  void *p = alloc_filled(f, 4 * TU_MiB, NULL, &seq);
  tu_assert_ok(tide_free(f->a, p, NULL));
  tu_assert_ok(tide_empty_cache(f->a));
  tide_clear_error();
  tide_status rc = tide_free(f->a, p, NULL);
  if (rc != TIDE_ERR_DOUBLE_FREE && rc != TIDE_ERR_BAD_POINTER)
    fail_msg("second free after tide_empty_cache: %s (%s)", tide_status_name(rc),
             tide_last_error());
  tu_assert_last_error(rc, NULL);
  still_works(f);
}

static void never_allocated(void **state) {
  fixture *f = *state;
  uint64_t seq;
  void *live = alloc_filled(f, TU_MiB, NULL, &seq);
  int on_stack = 0;
  void *on_heap = malloc(4096);
  assert_non_null(on_heap);
  void *bad[] = {&on_stack, on_heap, (void *)(uintptr_t)1, (void *)(uintptr_t)512};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    expect_error(tide_free(f->a, bad[i], NULL), TIDE_ERR_BAD_POINTER, "not allocated");
    expect_error(tide_free(f->a, bad[i], f->side), TIDE_ERR_BAD_POINTER, "not allocated");
    expect_error(tide_free_sized(f->a, bad[i], 4096, NULL), TIDE_ERR_BAD_POINTER, NULL);
    expect_error(tide_record_stream(f->a, bad[i], f->side), TIDE_ERR_BAD_POINTER, NULL);
    expect_error(tide_block_info(f->a, bad[i], NULL, NULL, NULL), TIDE_ERR_BAD_POINTER, NULL);
  }
  free(on_heap);
  tu_assert_pattern(live, TU_MiB, seq, TU_PATTERN_DEFAULT);
  expect_live(f, (void *[]){live}, (size_t[]){TU_MiB}, 1);
  tu_assert_ok(tide_free(f->a, live, NULL));
  still_works(f);
}

/* Inside a segment but in no block: the unmapped part of an expandable
 * segment, or the free rest of a fixed one. */
static void inside_segment_not_a_block(void **state) {
  fixture *f = *state;
  uint64_t seq;
  void *live = alloc_filled(f, 2 * TU_MiB, NULL, &seq);
  void *past = (char *)live + 4 * TU_MiB;
  tide_clear_error();
  tide_status rc = tide_free(f->a, past, NULL);
  if (rc != TIDE_ERR_BAD_POINTER && rc != TIDE_ERR_DOUBLE_FREE)
    fail_msg("free of %p, past the only block: %s (%s)", past, tide_status_name(rc),
             tide_last_error());
  tu_assert_last_error(rc, NULL);
  tu_assert_pattern(live, 2 * TU_MiB, seq, TU_PATTERN_DEFAULT);
  expect_live(f, (void *[]){live}, (size_t[]){2 * TU_MiB}, 1);
  tu_assert_ok(tide_free(f->a, live, NULL));
  still_works(f);
}

static void interior_and_misaligned(void **state) {
  fixture *f = *state;
  uint64_t seq;
  void *p = alloc_filled(f, TU_MiB, NULL, &seq);
  size_t offsets[] = {512, 4096, TU_MiB - 512, 1, 3, 511, 513};
  for (size_t i = 0; i < sizeof offsets / sizeof offsets[0]; i++) {
    void *q = (char *)p + offsets[i];
    expect_error(tide_free(f->a, q, NULL), TIDE_ERR_BAD_POINTER, "not the start of a block");
    expect_error(tide_free_sized(f->a, q, TU_MiB, NULL), TIDE_ERR_BAD_POINTER, NULL);
    expect_error(tide_record_stream(f->a, q, f->side), TIDE_ERR_BAD_POINTER, NULL);
    /* Still allocated, untouched and counted. */
    tu_assert_pattern(p, TU_MiB, seq, TU_PATTERN_DEFAULT);
    expect_live(f, (void *[]){p}, (size_t[]){TU_MiB}, 1);
  }
  tu_assert_ok(tide_free(f->a, p, NULL));
  still_works(f);
}

/* The header promises the block *containing* a pointer. */
static void block_info_of_interior_pointer(void **state) {
  fixture *f = *state;
  uint64_t seq;
  void *p = alloc_filled(f, TU_MiB, f->side, &seq);
  void *base = NULL;
  size_t size = 0;
  tide_stream stream = NULL;
  tide_status rc = tide_block_info(f->a, (char *)p + 4096, &base, &size, &stream);
  tide_status rc_free = tide_free(f->a, p, f->side);
  if (rc != TIDE_OK)
    fail_msg("tide_block_info(%p + 4096), a pointer inside a live block: %s (%s); the header "
             "says it gives the block containing the pointer",
             p, tide_status_name(rc), tide_last_error());
  assert_ptr_equal(base, p);
  assert_true(size >= TU_MiB);
  assert_ptr_equal(stream, f->side);
  tu_assert_ok(rc_free);
  still_works(f);
}

static void from_another_allocator(void **state) {
  fixture *f = *state;
  tide_allocator *other = tu_create("host_capacity:1GiB");
  void *q = tide_malloc(other, TU_MiB, NULL);
  assert_non_null(q);
  tu_fill(q, TU_MiB, 77, TU_PATTERN_DEFAULT);
  uint64_t seq;
  void *p = alloc_filled(f, TU_MiB, NULL, &seq);
  expect_error(tide_free(f->a, q, NULL), TIDE_ERR_BAD_POINTER, "not allocated by this");
  expect_error(tide_free_sized(f->a, q, TU_MiB, NULL), TIDE_ERR_BAD_POINTER, NULL);
  expect_error(tide_record_stream(f->a, q, NULL), TIDE_ERR_BAD_POINTER, NULL);
  expect_error(tide_block_info(f->a, q, NULL, NULL, NULL), TIDE_ERR_BAD_POINTER, NULL);
  expect_error(tide_free(other, p, NULL), TIDE_ERR_BAD_POINTER, NULL);
  /* Both blocks untouched and still their allocator's. */
  tu_assert_pattern(q, TU_MiB, 77, TU_PATTERN_DEFAULT);
  tu_assert_pattern(p, TU_MiB, seq, TU_PATTERN_DEFAULT);
  tu_assert_ok(tide_block_info(other, q, NULL, NULL, NULL));
  expect_live(f, (void *[]){p}, (size_t[]){TU_MiB}, 1);
  tu_assert_ok(tide_free(other, q, NULL));
  tu_assert_ok(tide_destroy(other));
  tu_assert_ok(tide_free(f->a, p, NULL));
  still_works(f);
}

/* A block of another device's allocator (the host backend's second
 * emulated device): not ours, and both allocators stay as they were. */
static void from_another_device(void **state) {
  fixture *f = *state;
  tide_allocator *other = NULL;
  tide_config *c = tu_config("host_devices:2,host_capacity:256MiB");
  tu_assert_ok(tide_create(1, c, &other));
  tide_config_free(c);
  void *q = tide_malloc(other, 2 * TU_MiB, NULL);
  assert_non_null(q);
  tu_fill(q, 2 * TU_MiB, 78, TU_PATTERN_DEFAULT);
  uint64_t seq;
  void *p = alloc_filled(f, TU_MiB, NULL, &seq);
  expect_error(tide_free(f->a, q, NULL), TIDE_ERR_BAD_POINTER, "not allocated by this");
  expect_error(tide_free(f->a, q, f->side), TIDE_ERR_BAD_POINTER, "not allocated by this");
  expect_error(tide_free_sized(f->a, q, 2 * TU_MiB, NULL), TIDE_ERR_BAD_POINTER, NULL);
  expect_error(tide_record_stream(f->a, q, NULL), TIDE_ERR_BAD_POINTER, NULL);
  expect_error(tide_free(other, p, NULL), TIDE_ERR_BAD_POINTER, "device 1");
  tu_assert_pattern(q, 2 * TU_MiB, 78, TU_PATTERN_DEFAULT);
  tu_assert_ok(tide_check(other));
  tu_assert_ok(tide_free(other, q, NULL));
  tu_assert_ok(tide_destroy(other));
  tu_assert_ok(tide_free(f->a, p, NULL));
  still_works(f);
}

static void wrong_size(void **state) {
  fixture *f = *state;
  uint64_t s1, s2;
  void *p = alloc_filled(f, 1000, NULL, &s1);
  void *q = alloc_filled(f, 5 * TU_MiB + 7, NULL, &s2);
  size_t wrong_p[] = {1024, 999, 1001, 0, 512, SIZE_MAX};
  for (size_t i = 0; i < sizeof wrong_p / sizeof wrong_p[0]; i++) {
    expect_error(tide_free_sized(f->a, p, wrong_p[i], NULL), TIDE_ERR_INVALID, "nothing was freed");
    expect_error(tide_free_sized(f->a, p, wrong_p[i], f->side), TIDE_ERR_INVALID, NULL);
  }
  expect_error(tide_free_sized(f->a, q, 5 * TU_MiB, NULL), TIDE_ERR_INVALID, NULL);
  expect_error(tide_free_sized(f->a, q, block_size(f, q), f->side), TIDE_ERR_INVALID, NULL);
  tu_assert_pattern(p, 1000, s1, TU_PATTERN_DEFAULT);
  tu_assert_pattern(q, 5 * TU_MiB + 7, s2, TU_PATTERN_DEFAULT);
  expect_live(f, (void *[]){p, q}, (size_t[]){1000, 5 * TU_MiB + 7}, 2);
  tu_assert_ok(tide_free_sized(f->a, p, 1000, NULL));
  tu_assert_ok(tide_free_sized(f->a, q, 5 * TU_MiB + 7, f->side));
  expect_live(f, NULL, NULL, 0);
  still_works(f);
}

/* ------------------------------------------------------------------------ */
/* Sizes, limits, streams                                                    */
/* ------------------------------------------------------------------------ */

static void impossible_sizes(void **state) {
  fixture *f = *state;
  size_t invalid[] = {0, SIZE_MAX, SIZE_MAX - 511, (size_t)1 << 60, ((size_t)1 << 52) + 1};
  for (size_t i = 0; i < sizeof invalid / sizeof invalid[0]; i++) {
    tide_clear_error();
    void *p = tide_malloc(f->a, invalid[i], NULL);
    if (p) fail_msg("tide_malloc(%zu) returned %p", invalid[i], p);
    tu_assert_last_error(TIDE_ERR_INVALID, NULL);
  }
  /* Possible sizes, larger than the device: out of memory, said so. (Up to
   * the largest accepted size, 1 << 52, works as well, but costs seconds
   * under AddressSanitizer: the page table of an expandable segment that
   * large is allocated before its address range is refused.) */
  size_t too_big[] = {(size_t)1 << 46, (size_t)1 << 40, 2 * TU_GiB};
  for (size_t i = 0; i < sizeof too_big / sizeof too_big[0]; i++) {
    tide_clear_error();
    void *p = tide_malloc(f->a, too_big[i], f->side);
    if (p) fail_msg("tide_malloc(%zu) on a 1 GiB device returned %p", too_big[i], p);
    tu_assert_last_error(TIDE_ERR_OOM, "out of memory");
  }
  expect_live(f, NULL, NULL, 0);
  still_works(f);
}

static void memory_limits(void **state) {
  fixture *f = *state;
  double bad[] = {0.0, -0.5, 1.5, NAN, INFINITY, -INFINITY};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    expect_error(tide_set_memory_fraction(f->a, bad[i]), TIDE_ERR_INVALID, "fraction");
  assert_int_equal(tu_stats(f->a).memory_limit, TU_GiB); /* unchanged */
  still_works(f);

  /* A limit below one page: allocations that need new memory fail with a
   * message naming it (cached memory would still serve them: none is left). */
  tu_assert_ok(tide_empty_cache(f->a));
  tu_assert_ok(tide_set_memory_limit(f->a, 4096));
  tide_clear_error();
  assert_null(tide_malloc(f->a, 4 * TU_MiB, NULL));
  tu_assert_last_error(TIDE_ERR_OOM, "memory limit");
  tu_assert_ok(tide_set_memory_limit(f->a, 0));
  still_works(f);
  tu_assert_ok(tide_set_memory_fraction(f->a, 0.5));
  assert_int_equal(tu_stats(f->a).memory_limit, TU_GiB / 2);
  tu_assert_ok(tide_set_memory_fraction(f->a, 1.0));
  still_works(f);

  /* A fraction too small for one byte is a limit of 0 bytes: the stat says
   * 0, what is enforced (not "no limit"), and the message names it. With no
   * limit the stat is the device's memory; pinned memory has none. */
  tu_assert_ok(tide_empty_cache(f->a));
  tu_assert_ok(tide_set_memory_fraction(f->a, 1e-300));
  assert_int_equal(tu_stats(f->a).memory_limit, 0);
  tide_clear_error();
  assert_null(tide_malloc(f->a, 4 * TU_MiB, NULL));
  tu_assert_last_error(TIDE_ERR_OOM, "memory limit 0 B");
  tu_assert_ok(tide_set_memory_fraction(f->a, 1.0));
  tide_info info;
  tu_assert_ok(tide_get_info(f->a, &info));
  assert_int_equal(tu_stats(f->a).memory_limit, info.total_memory);
  tide_stats pinned;
  tu_assert_ok(tide_pinned_get_stats(f->a, &pinned));
  assert_true(pinned.memory_limit == TIDE_NO_LIMIT);
  still_works(f);
}

static void bad_streams(void **state) {
  fixture *f = *state;
  expect_error(tide_stream_destroy(f->a, NULL), TIDE_ERR_INVALID, NULL);
  expect_error(tide_stream_destroy(f->a, BOGUS_STREAM), TIDE_ERR_INVALID, NULL);
  expect_error(tide_stream_synchronize(f->a, BOGUS_STREAM), TIDE_ERR_INVALID, NULL);
  expect_error(tide_host_stream_hold(f->a, BOGUS_STREAM), TIDE_ERR_INVALID, NULL);
  expect_error(tide_host_stream_release(f->a, BOGUS_STREAM), TIDE_ERR_INVALID, NULL);
  tide_stream gone;
  tu_assert_ok(tide_stream_create(f->a, &gone));
  tu_assert_ok(tide_stream_destroy(f->a, gone));
  expect_error(tide_stream_destroy(f->a, gone), TIDE_ERR_INVALID, NULL);
  expect_error(tide_stream_synchronize(f->a, gone), TIDE_ERR_INVALID, NULL);

  /* A free ordered after an unknown stream cannot be ordered: refused, and
   * the block stays allocated. */
  uint64_t seq;
  void *p = alloc_filled(f, TU_MiB, NULL, &seq);
  expect_error(tide_free(f->a, p, BOGUS_STREAM), TIDE_ERR_INVALID, "still allocated");
  expect_error(tide_free(f->a, p, gone), TIDE_ERR_INVALID, "still allocated");
  tu_assert_pattern(p, TU_MiB, seq, TU_PATTERN_DEFAULT);
  expect_live(f, (void *[]){p}, (size_t[]){TU_MiB}, 1);
  tu_assert_ok(tide_free(f->a, p, NULL));
  still_works(f);
}

/* A block recorded on a stream that is gone by the time it is freed must
 * still be freeable (refusing the record up front would do as well). */
static void record_on_unknown_stream(void **state) {
  fixture *f = *state;
  uint64_t seq;
  void *p = alloc_filled(f, TU_MiB, NULL, &seq);
  tide_status rc = tide_record_stream(f->a, p, BOGUS_STREAM);
  if (rc != TIDE_OK) tu_assert_last_error(TIDE_ERR_INVALID, NULL);
  tide_status freed = tide_free(f->a, p, NULL);
  if (freed != TIDE_OK)
    fail_msg("after tide_record_stream(%p, unknown stream) returned %s, the block cannot be "
             "freed any more: %s: %s",
             p, tide_status_name(rc), tide_status_name(freed), tide_last_error());
  still_works(f);
}

static void record_on_destroyed_stream(void **state) {
  fixture *f = *state;
  tide_stream s;
  tu_assert_ok(tide_stream_create(f->a, &s));
  uint64_t seq;
  void *p = alloc_filled(f, TU_MiB, NULL, &seq);
  tu_assert_ok(tide_record_stream(f->a, p, s));
  tu_assert_ok(tide_stream_synchronize(f->a, s));
  tu_assert_ok(tide_stream_destroy(f->a, s));
  tide_status freed = tide_free(f->a, p, NULL);
  if (freed != TIDE_OK)
    fail_msg("a block recorded on a stream that was then destroyed cannot be freed: %s: %s",
             tide_status_name(freed), tide_last_error());
  still_works(f);
}

/* Allocating on a stream the backend does not know: refused, or if taken,
 * the allocator must still be able to give its cache back. */
static void malloc_on_unknown_stream(void **state) {
  fixture *f = *state;
  tide_clear_error();
  void *p = tide_malloc(f->a, TU_MiB, BOGUS_STREAM);
  if (!p) {
    tu_assert_last_error(TIDE_ERR_INVALID, NULL);
  } else {
    tu_assert_ok(tide_free(f->a, p, BOGUS_STREAM));
  }
  tide_status rc = tide_empty_cache(f->a);
  if (rc != TIDE_OK)
    fail_msg("tide_malloc on an unknown stream %s; tide_empty_cache then fails: %s: %s",
             p ? "succeeded" : "failed", tide_status_name(rc), tide_last_error());
  assert_int_equal(tide_host_bytes_in_use(f->a), 0);
  still_works(f);
}

/* A stream destroyed after blocks were allocated and freed on it: a new
 * allocation on it is refused (its cache could never be given back: there
 * is nothing to wait for), and emptying the cache still works. */
static void malloc_on_destroyed_stream(void **state) {
  fixture *f = *state;
  tide_stream s;
  tu_assert_ok(tide_stream_create(f->a, &s));
  uint64_t seq;
  void *p = alloc_filled(f, 3 * TU_MiB, s, &seq);
  tu_assert_ok(tide_free(f->a, p, s));
  tu_assert_ok(tide_stream_destroy(f->a, s));
  tide_clear_error();
  assert_null(tide_malloc(f->a, 3 * TU_MiB, s));
  tu_assert_last_error(TIDE_ERR_INVALID, "destroyed");
  tu_assert_ok(tide_empty_cache(f->a));
  tu_assert_ok(tide_check(f->a));
  assert_int_equal(tide_host_bytes_in_use(f->a), 0);
  still_works(f);
}

/* A block allocated on a stream that is then destroyed is freed on that
 * stream as on any other, device memory and pinned memory alike. */
static void free_on_destroyed_own_stream(void **state) {
  fixture *f = *state;
  tide_stream s;
  tu_assert_ok(tide_stream_create(f->a, &s));
  uint64_t seq;
  void *p = alloc_filled(f, TU_MiB, s, &seq);
  void *pinned = tide_pinned_malloc(f->a, 10000, s);
  assert_non_null(pinned);
  tu_assert_ok(tide_stream_destroy(f->a, s));
  tu_assert_pattern(p, TU_MiB, seq, TU_PATTERN_DEFAULT);
  tu_assert_ok(tide_free(f->a, p, s));
  tu_assert_ok(tide_pinned_free(f->a, pinned, s));
  tu_assert_ok(tide_empty_cache(f->a));
  tu_assert_ok(tide_pinned_empty_cache(f->a));
  tu_assert_ok(tide_check(f->a));
  tide_stats st;
  tu_assert_ok(tide_pinned_get_stats(f->a, &st));
  assert_int_equal(st.reserved_bytes[0].current, 0);
  still_works(f);
}

static void host_controls(void **state) {
  fixture *f = *state;
  expect_error(tide_host_fail_call(f->a, TIDE_OP_COUNT, 1), TIDE_ERR_INVALID, NULL);
  expect_error(tide_host_fail_call(f->a, (tide_backend_op)-1, 1), TIDE_ERR_INVALID, NULL);
  assert_int_equal(tide_host_call_count(f->a, TIDE_OP_COUNT), 0);
  assert_int_equal(tide_host_call_count(f->a, (tide_backend_op)-1), 0);
  assert_string_equal(tide_backend_op_name(TIDE_OP_COUNT), "unknown");
  assert_string_equal(tide_backend_op_name((tide_backend_op)-7), "unknown");
  assert_non_null(tide_status_name((tide_status)99));
  assert_non_null(tide_status_name((tide_status)-1));
  /* Disarming what was never armed is fine. */
  tu_assert_ok(tide_host_fail_call(f->a, TIDE_OP_MAP, 0));
  still_works(f);
}

/* ------------------------------------------------------------------------ */
/* NULL everywhere                                                           */
/* ------------------------------------------------------------------------ */

static void null_allocator(void **state) {
  (void)state;
  tide_allocator *n = NULL;
  tide_stats st;
  tide_info info;
  tide_stream s = NULL;
  char *json = NULL;
  size_t len = 0, count = 0;
  tide_trace_event ev[2];
  void *base = NULL;
  int x;
  expect_error(tide_destroy(n), TIDE_ERR_INVALID, NULL);
  tide_clear_error();
  assert_null(tide_malloc(n, 512, NULL));
  tu_assert_last_error(TIDE_ERR_INVALID, NULL);
  expect_error(tide_free(n, &x, NULL), TIDE_ERR_INVALID, NULL);
  expect_error(tide_free_sized(n, &x, 4, NULL), TIDE_ERR_INVALID, NULL);
  expect_error(tide_record_stream(n, &x, NULL), TIDE_ERR_INVALID, NULL);
  expect_error(tide_block_info(n, &x, &base, &len, &s), TIDE_ERR_INVALID, NULL);
  expect_error(tide_empty_cache(n), TIDE_ERR_INVALID, NULL);
  expect_error(tide_set_memory_fraction(n, 0.5), TIDE_ERR_INVALID, NULL);
  expect_error(tide_set_memory_limit(n, 1), TIDE_ERR_INVALID, NULL);
  expect_error(tide_stream_create(n, &s), TIDE_ERR_INVALID, NULL);
  expect_error(tide_stream_destroy(n, s), TIDE_ERR_INVALID, NULL);
  expect_error(tide_stream_synchronize(n, s), TIDE_ERR_INVALID, NULL);
  expect_error(tide_get_stats(n, &st), TIDE_ERR_INVALID, NULL);
  expect_error(tide_reset_peak_stats(n), TIDE_ERR_INVALID, NULL);
  expect_error(tide_snapshot_json(n, &json, &len), TIDE_ERR_INVALID, NULL);
  assert_null(json);
  expect_error(tide_trace_read(n, ev, 2, &count, NULL), TIDE_ERR_INVALID, NULL);
  expect_error(tide_get_info(n, &info), TIDE_ERR_INVALID, NULL);
  expect_error(tide_host_stream_hold(n, s), TIDE_ERR_INVALID, NULL);
  expect_error(tide_host_stream_release(n, s), TIDE_ERR_INVALID, NULL);
  expect_error(tide_host_fail_call(n, TIDE_OP_MAP, 1), TIDE_ERR_INVALID, NULL);
  assert_int_equal(tide_host_call_count(n, TIDE_OP_ANY), 0);
  assert_int_equal(tide_host_bytes_in_use(n), 0);
  tide_string_free(NULL);
  tide_config_free(NULL);

  /* A handle that is not an allocator at all. */
  long junk[64];
  memset(junk, 0x5a, sizeof junk);
  tide_allocator *fake = (tide_allocator *)junk;
  tide_clear_error();
  assert_null(tide_malloc(fake, 512, NULL));
  tu_assert_last_error(TIDE_ERR_INVALID, NULL);
  expect_error(tide_free(fake, &x, NULL), TIDE_ERR_INVALID, NULL);
  expect_error(tide_get_stats(fake, &st), TIDE_ERR_INVALID, NULL);
  expect_error(tide_empty_cache(fake), TIDE_ERR_INVALID, NULL);
}

static void null_outputs(void **state) {
  fixture *f = *state;
  tide_trace_event ev[2];
  size_t n = 0;
  expect_error(tide_get_stats(f->a, NULL), TIDE_ERR_INVALID, NULL);
  expect_error(tide_get_info(f->a, NULL), TIDE_ERR_INVALID, NULL);
  expect_error(tide_stream_create(f->a, NULL), TIDE_ERR_INVALID, NULL);
  expect_error(tide_snapshot_json(f->a, NULL, NULL), TIDE_ERR_INVALID, NULL);
  expect_error(tide_trace_read(f->a, NULL, 2, &n, NULL), TIDE_ERR_INVALID, NULL);
  expect_error(tide_trace_read(f->a, ev, 2, NULL, NULL), TIDE_ERR_INVALID, NULL);
  expect_error(tide_record_stream(f->a, NULL, f->side), TIDE_ERR_INVALID, NULL);
  tu_assert_ok(tide_free(f->a, NULL, NULL)); /* free(NULL) is a no-op */
  tu_assert_ok(tide_free_sized(f->a, NULL, 0, f->side));
  tide_clear_error();
  tide_status rc = tide_block_info(f->a, NULL, NULL, NULL, NULL);
  if (rc != TIDE_ERR_INVALID && rc != TIDE_ERR_BAD_POINTER)
    fail_msg("tide_block_info(NULL): %s", tide_status_name(rc));
  tu_assert_last_error(rc, NULL);
  expect_error(tide_create(0, NULL, NULL), TIDE_ERR_INVALID, NULL);
  expect_error(tide_config_new(NULL), TIDE_ERR_INVALID, NULL);
  expect_error(tide_config_process_get(NULL), TIDE_ERR_INVALID, NULL);
  expect_error(tide_config_process_set(NULL), TIDE_ERR_INVALID, NULL);
  still_works(f);
}

/* ------------------------------------------------------------------------ */
/* Configuration                                                             */
/* ------------------------------------------------------------------------ */

static const char *const garbage_configs[] = {
    "garbage",
    "expandable_segments",
    "expandable_segments:maybe",
    "expandable_segments:",
    ":True",
    "no_such_key:1",
    "page_size_mb:0",
    "page_size_mb:-2",
    "page_size_mb:2x",
    "page_size_mb:99999999999999999999999",
    "memory_fraction:nan",
    "memory_fraction:2",
    "host_capacity:12 parsecs",
    "max_split_size_mb:1",
    "roundup_power2_divisions:[1:2,",
    "garbage_collection_threshold:1.0",
    "expandable_segments:True,,page_size_mb:zero",
    "expandable_segments:True,page_size_mb:4,bogus",
    "\x01\x02\xff:\xfe",
};

/* Every key's current value, to see that a refused text changed nothing. */
static void config_values(const tide_config *c, char values[][256]) {
  for (size_t i = 0; i < tide_config_option_count(); i++) {
    tide_option_info info;
    tu_assert_ok(tide_config_option(c, i, &info));
    snprintf(values[i], 256, "%s", info.value);
  }
}

static void bad_config_text(void **state) {
  (void)state;
  tide_config *c = NULL;
  tu_assert_ok(tide_config_new(&c));
  tu_assert_ok(tide_config_parse(c, "page_size_mb:4,expandable_segments:False"));
  size_t n = tide_config_option_count();
  char(*before)[256] = calloc(n, 256), (*after)[256] = calloc(n, 256);
  assert_non_null(before);
  assert_non_null(after);
  config_values(c, before);
  for (size_t i = 0; i < sizeof garbage_configs / sizeof garbage_configs[0]; i++) {
    tide_clear_error();
    tide_status rc = tide_config_parse(c, garbage_configs[i]);
    if (rc != TIDE_ERR_CONFIG)
      fail_msg("tide_config_parse(\"%s\"): %s, expected TIDE_ERR_CONFIG", garbage_configs[i],
               tide_status_name(rc));
    tu_assert_last_error(TIDE_ERR_CONFIG, NULL);
    config_values(c, after);
    for (size_t k = 0; k < n; k++)
      if (strcmp(before[k], after[k]) != 0)
        fail_msg("refused text \"%s\" changed option %zu: %s -> %s", garbage_configs[i], k,
                 before[k], after[k]);
  }
  expect_error(tide_config_set(c, "page_size_mb", "lots"), TIDE_ERR_CONFIG, "page_size_mb");
  expect_error(tide_config_set(c, "nope", "1"), TIDE_ERR_CONFIG, "nope");
  expect_error(tide_config_set(c, NULL, "1"), TIDE_ERR_INVALID, NULL);
  expect_error(tide_config_parse(c, NULL), TIDE_ERR_INVALID, NULL);
  expect_error(tide_config_parse(NULL, "page_size_mb:2"), TIDE_ERR_INVALID, NULL);
  /* The config still makes a working allocator. */
  tu_assert_ok(tide_config_parse(c, "backend:host,host_capacity:256MiB"));
  tide_allocator *a = NULL;
  tu_assert_ok(tide_create(0, c, &a));
  void *p = tide_malloc(a, TU_MiB, NULL);
  assert_non_null(p);
  tu_assert_ok(tide_free(a, p, NULL));
  tu_assert_ok(tide_destroy(a));
  tide_config_free(c);
  free(before);
  free(after);
}

/* Messages quote the user's text, made printable: bytes that are not
 * printable ASCII (here inside a list key) would make them unreadable. */
static void bad_config_message_is_printable(void **state) {
  (void)state;
  static const char *const texts[] = {
      "roundup_power2_divisions:[256:1,1\xb1\xb1:2]",
      "roundup_power2_divisions:[\x01\x7f:x]",
      "\xff\xfe:1",
      "page_size_mb:\x1b[31m",
  };
  tide_config *c = NULL;
  tu_assert_ok(tide_config_new(&c));
  for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
    tide_clear_error();
    tu_assert_status(tide_config_parse(c, texts[i]), TIDE_ERR_CONFIG);
    const char *msg = tide_last_error();
    for (const char *p = msg; *p; p++)
      if (*p < 0x20 || *p >= 0x7f)
        fail_msg("the message for text %zu has byte 0x%02x: %s", i, (unsigned char)*p, msg);
  }
  tide_config_free(c);
}

/* tide_create(..., NULL, ...) reads TIDALLOC_CONF: garbage there is a
 * configuration error, and a later good value works. */
static void bad_environment(void **state) {
  (void)state;
  for (size_t i = 0; i < sizeof garbage_configs / sizeof garbage_configs[0]; i++) {
    assert_int_equal(setenv("TIDALLOC_CONF", garbage_configs[i], 1), 0);
    tide_allocator *a = (tide_allocator *)(uintptr_t)1;
    tide_clear_error();
    tide_status rc = tide_create(0, NULL, &a);
    if (rc != TIDE_ERR_CONFIG)
      fail_msg("TIDALLOC_CONF=\"%s\": tide_create gave %s, expected TIDE_ERR_CONFIG",
               garbage_configs[i], tide_status_name(rc));
    assert_null(a);
    tu_assert_last_error(TIDE_ERR_CONFIG, "TIDALLOC_CONF");
  }
  assert_int_equal(setenv("TIDALLOC_CONF", "backend:host,host_capacity:128MiB", 1), 0);
  tide_allocator *a = NULL;
  tu_assert_ok(tide_create(0, NULL, &a));
  tide_stats st = tu_stats(a);
  assert_int_equal(st.memory_limit, 128 * TU_MiB);
  void *p = tide_malloc(a, TU_MiB, NULL);
  assert_non_null(p);
  tu_assert_ok(tide_free(a, p, NULL));
  tu_assert_ok(tide_destroy(a));
  assert_int_equal(unsetenv("TIDALLOC_CONF"), 0);
}

static void bad_devices(void **state) {
  (void)state;
  tide_config *c = tu_config("host_devices:2");
  tide_allocator *a = (tide_allocator *)(uintptr_t)1;
  expect_error(tide_create(-1, c, &a), TIDE_ERR_INVALID, "does not exist");
  assert_null(a);
  expect_error(tide_create(2, c, &a), TIDE_ERR_INVALID, "does not exist");
  assert_null(a);
  tu_assert_ok(tide_create(1, c, &a));
  tu_assert_ok(tide_destroy(a));
  tide_config_free(c);
  tide_clear_error();
  assert_null(tide_device(-1));
  tu_assert_last_error(TIDE_ERR_INVALID, "does not exist");
  assert_null(tide_device(1 << 20));
  tu_assert_last_error(TIDE_ERR_INVALID, "does not exist");
}

/* The process-wide allocator, in the order a program lives: garbage in the
 * environment, then configuration before first use, first use, a change
 * refused after it, shutdown, use after shutdown. Runs last: a process has
 * one life. */
static void process_wide_lifecycle(void **state) {
  (void)state;
  /* Garbage in the environment: the first use fails and says why. */
  assert_int_equal(setenv("TIDALLOC_CONF", "expandable_segments:perhaps", 1), 0);
  tide_clear_error();
  assert_null(tide_device(0));
  tu_assert_last_error(TIDE_ERR_CONFIG, "expandable_segments");
  expect_error(tide_config_process_set("page_size_mb:4"), TIDE_ERR_CONFIG, NULL);
  assert_int_equal(unsetenv("TIDALLOC_CONF"), 0);

  /* Configuration before first use is applied; a bad one changes nothing. */
  tu_assert_ok(tide_config_process_set("backend:host,host_capacity:256MiB,page_size_mb:2"));
  expect_error(tide_config_process_set("page_size_mb:zero"), TIDE_ERR_CONFIG, "page_size_mb");
  tide_allocator *a = tide_device(0);
  if (!a) fail_msg("tide_device(0): %s", tide_last_error());
  assert_ptr_equal(tide_device(0), a);
  tide_info info;
  tu_assert_ok(tide_get_info(a, &info));
  assert_int_equal(info.total_memory, 256 * TU_MiB);
  assert_int_equal(info.page_size, 2 * TU_MiB);

  /* After first use a change is refused, naming the key; the same values
   * are no change and are accepted. */
  expect_error(tide_config_process_set("page_size_mb:4"), TIDE_ERR_STATE, "page_size_mb");
  expect_error(tide_config_process_set("expandable_segments:False,host_capacity:1GiB"),
               TIDE_ERR_STATE, "host_capacity");
  tu_assert_ok(tide_config_process_set("page_size_mb:2"));
  tide_config *now = NULL;
  tu_assert_ok(tide_config_process_get(&now));
  char value[64];
  tu_assert_ok(tide_config_get(now, "page_size_mb", value, sizeof value));
  assert_string_equal(value, "2");
  tide_config_free(now);

  /* The allocator still works after the refusals. */
  void *p = tide_malloc(a, 3 * TU_MiB, NULL);
  assert_non_null(p);
  tu_fill(p, 3 * TU_MiB, 5, TU_PATTERN_DEFAULT);
  tu_assert_pattern(p, 3 * TU_MiB, 5, TU_PATTERN_DEFAULT);
  tu_assert_ok(tide_free(a, p, NULL));
  assert_int_equal(tu_stats(a).allocated_bytes[0].current, 0);

  tu_assert_ok(tide_shutdown());
  tide_clear_error();
  assert_null(tide_device(0));
  tu_assert_last_error(TIDE_ERR_STATE, "tide_shutdown");
  tide_clear_error();
  assert_null(tide_device(1));
  tu_assert_last_error(TIDE_ERR_STATE, NULL);
  /* A configuration nothing will use is refused, not silently kept. */
  expect_error(tide_config_process_set("page_size_mb:2"), TIDE_ERR_STATE, "tide_shutdown");
  tu_assert_ok(tide_shutdown()); /* twice is harmless */
}

/* ------------------------------------------------------------------------ */

#define BOTH(fn)                                                                                   \
  cmocka_unit_test_prestate_setup_teardown(fn, setup, teardown,                                    \
                                           (void *)"host_capacity:1GiB,"                           \
                                                   "expandable_segments:True"),                    \
      cmocka_unit_test_prestate_setup_teardown(fn, setup, teardown,                                \
                                               (void *)"host_capacity:1GiB,"                       \
                                                       "expandable_segments:False")

int main(void) {
  const struct CMUnitTest tests[] = {
      BOTH(double_free),
      BOTH(double_free_while_pending),
      BOTH(double_free_after_empty_cache),
      BOTH(never_allocated),
      BOTH(inside_segment_not_a_block),
      BOTH(interior_and_misaligned),
      BOTH(block_info_of_interior_pointer),
      BOTH(from_another_allocator),
      BOTH(from_another_device),
      BOTH(wrong_size),
      BOTH(impossible_sizes),
      BOTH(memory_limits),
      BOTH(bad_streams),
      BOTH(record_on_unknown_stream),
      BOTH(record_on_destroyed_stream),
      BOTH(malloc_on_unknown_stream),
      BOTH(malloc_on_destroyed_stream),
      BOTH(free_on_destroyed_own_stream),
      BOTH(host_controls),
      BOTH(null_outputs),
      cmocka_unit_test(null_allocator),
      cmocka_unit_test(bad_config_text),
      cmocka_unit_test(bad_config_message_is_printable),
      cmocka_unit_test(bad_environment),
      cmocka_unit_test(bad_devices),
      cmocka_unit_test(process_wide_lifecycle),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
