/* test_validate.c: tide_check, the consistency check, finds what it is
 * meant to find. Each test builds an allocator with blocks in every state
 * (allocated, quick, free, pending, unmapped pages, both pools, two
 * streams), breaks one invariant by hand through the internal structures,
 * expects TIDE_ERR_STATE with a message naming the broken part, then mends
 * it and expects TIDE_OK again, so a check that always fails would not pass
 * either. The check must also pass through a life of ordinary calls. */
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

typedef struct world {
  tide_allocator *a;
  tide_stream side;
  void *live[6];
  void *pinned;
} world;

/* Blocks in every state: allocated in both pools and on two streams, a
 * quick block, free blocks, a free pending on a held stream, and unmapped
 * pages between them. */
static int setup(void **state) {
  world *w = calloc(1, sizeof *w);
  if (!w) return -1;
  w->a = tu_create((const char *)*state);
  tu_assert_ok(tide_stream_create(w->a, &w->side));
  static const size_t sizes[] = {4096, 300 * TU_KiB, 3 * TU_MiB, 6 * TU_MiB, 1000, 5 * TU_MiB};
  for (int i = 0; i < 6; i++) {
    w->live[i] = tide_malloc(w->a, sizes[i], i < 4 ? NULL : w->side);
    assert_non_null(w->live[i]);
  }
  void *gone = tide_malloc(w->a, 2 * TU_MiB, NULL);
  void *quick = tide_malloc(w->a, 512 * TU_KiB, NULL);
  void *pending = tide_malloc(w->a, 8 * TU_MiB, NULL);
  assert_non_null(gone);
  assert_non_null(quick);
  assert_non_null(pending);
  tu_assert_ok(tide_free(w->a, gone, NULL));
  tu_assert_ok(tide_empty_cache(w->a)); /* pages of `gone` go back: an unmapped hole */
  tu_assert_ok(tide_free(w->a, quick, NULL));
  tu_assert_ok(tide_host_stream_hold(w->a, w->side));
  tu_assert_ok(tide_free(w->a, pending, w->side)); /* waits for the held stream */
  w->pinned = tide_pinned_malloc(w->a, 10000, NULL);
  assert_non_null(w->pinned);
  tu_assert_ok(tide_check(w->a));
  *state = w;
  return 0;
}

static int teardown(void **state) {
  world *w = *state;
  tu_assert_ok(tide_host_stream_release(w->a, w->side));
  for (int i = 0; i < 6; i++) tu_assert_ok(tide_free(w->a, w->live[i], NULL));
  tu_assert_ok(tide_pinned_free(w->a, w->pinned, NULL));
  tu_assert_ok(tide_empty_cache(w->a));
  tu_assert_ok(tide_check(w->a));
  tu_assert_ok(tide_stream_destroy(w->a, w->side));
  tu_assert_ok(tide_destroy(w->a));
  free(w);
  return 0;
}

/* The check finds the breakage and names it. */
#define expect_broken(w, needle)                                                                   \
  do {                                                                                             \
    tide_clear_error();                                                                            \
    tu_assert_status(tide_check((w)->a), TIDE_ERR_STATE);                                          \
    tu_assert_last_error(TIDE_ERR_STATE, (needle));                                                \
  } while (0)

static _tide_arena *arena_of(world *w, tide_stream stream) {
  for (size_t i = 0; i < atomic_load(&w->a->narenas); i++)
    if (w->a->arenas[i]->stream == stream) return w->a->arenas[i];
  fail_msg("no arena for stream %p", (void *)stream);
  return NULL;
}

static _tide_block *block_at(world *w, const void *p) {
  _tide_arena *arena = arena_of(w, NULL);
  _tide_block *b = (_tide_block *)_tide_arena_containing_block(arena, (uintptr_t)p);
  assert_non_null(b);
  return b;
}

/* A free block of the default stream's arena in `kind`'s pool. */
static _tide_block *some_free_block(world *w, int kind) {
  _tide_arena *arena = arena_of(w, NULL);
  for (_tide_segment *seg = arena->pools[kind].segments; seg; seg = seg->next)
    for (_tide_block *b = seg->first; b; b = b->next)
      if (b->state == _TIDE_FREE) return b;
  skip(); /* nothing to break in this layout */
  return NULL;
}

/* ------------------------------------------------------------------------ */

static void validate_passes_through_ordinary_use(void **state) {
  world *w = *state;
  tu_rng rng;
  tu_rng_seed(&rng, 7);
  void *blocks[64] = {0};
  for (int step = 0; step < 2000; step++) {
    int k = (int)tu_below(&rng, 64);
    if (blocks[k]) {
      tu_assert_ok(tide_free(w->a, blocks[k], tu_below(&rng, 4) ? NULL : w->side));
      blocks[k] = NULL;
    } else {
      blocks[k] = tide_malloc(w->a, tu_log_uniform(&rng, 1, 16 * TU_MiB), NULL);
      assert_non_null(blocks[k]);
    }
    if (step % 97 == 0) { /* the side stream is held: its pending free stays */
      tide_status rc = tide_empty_cache(w->a);
      if (rc != TIDE_OK && rc != TIDE_ERR_NOT_READY)
        fail_msg("tide_empty_cache: %s: %s", tide_status_name(rc), tide_last_error());
    }
    tu_assert_ok(tide_check(w->a));
  }
  for (int k = 0; k < 64; k++) tu_assert_ok(tide_free(w->a, blocks[k], NULL));
  tu_assert_ok(tide_check(w->a));
}

static void validate_finds_a_gap(void **state) {
  world *w = *state;
  _tide_block *b = some_free_block(w, _TIDE_LARGE);
  b->size -= 512;
  expect_broken(w, "gap or overlap");
  b->size += 512;
  tu_assert_ok(tide_check(w->a));
}

static void validate_finds_a_broken_link(void **state) {
  world *w = *state;
  _tide_block *b = block_at(w, w->live[1]);
  _tide_block *prev = b->prev;
  b->prev = NULL;
  expect_broken(w, "prev link");
  b->prev = prev;
  tu_assert_ok(tide_check(w->a));
}

static void validate_finds_unmerged_free_blocks(void **state) {
  world *w = *state;
  /* An allocated block next to a free one says it is free: two free
   * neighbours that were never merged. */
  _tide_block *b = block_at(w, w->live[3]);
  bool free_neighbour =
      (b->next && b->next->state == _TIDE_FREE) || (b->prev && b->prev->state == _TIDE_FREE);
  if (!free_neighbour) skip();
  b->state = _TIDE_FREE;
  expect_broken(w, "not merged");
  b->state = _TIDE_ALLOCATED;
  tu_assert_ok(tide_check(w->a));
}

static void validate_finds_a_block_missing_from_its_bin(void **state) {
  world *w = *state;
  _tide_arena *arena = arena_of(w, NULL);
  _tide_block *b = some_free_block(w, _TIDE_LARGE);
  _tide_bins_remove(&arena->pools[_TIDE_LARGE].bins, b);
  expect_broken(w, "in its bins");
  _tide_bins_insert(&arena->pools[_TIDE_LARGE].bins, b);
  tu_assert_ok(tide_check(w->a));
}

static void validate_finds_a_block_in_the_wrong_bin(void **state) {
  world *w = *state;
  _tide_arena *arena = arena_of(w, NULL);
  _tide_block *b = some_free_block(w, _TIDE_LARGE);
  _tide_bins_remove(&arena->pools[_TIDE_LARGE].bins, b);
  size_t size = b->size;
  b->size = 512; /* binned by a size it does not have */
  _tide_bins_insert(&arena->pools[_TIDE_LARGE].bins, b);
  b->size = size;
  expect_broken(w, "belongs in bin");
  _tide_bins_remove(&arena->pools[_TIDE_LARGE].bins, b);
  _tide_bins_insert(&arena->pools[_TIDE_LARGE].bins, b);
  tu_assert_ok(tide_check(w->a));
}

static void validate_finds_a_lost_live_block(void **state) {
  world *w = *state;
  _tide_arena *arena = arena_of(w, NULL);
  _tide_block *b = _tide_ptrmap_remove(&arena->live, (uintptr_t)w->live[0]);
  assert_non_null(b);
  expect_broken(w, "not in the live map");
  assert_int_equal(_tide_ptrmap_reserve_one(&arena->live), TIDE_OK);
  _tide_ptrmap_put(&arena->live, b);
  tu_assert_ok(tide_check(w->a));
}

static void validate_finds_a_wrong_stat(void **state) {
  world *w = *state;
  _tide_arena *arena = arena_of(w, w->side);
  arena->stats.cur[_TIDE_ST_ALLOCATED][1] += 512;
  arena->stats.cur[_TIDE_ST_ALLOCATED][0] += 512;
  expect_broken(w, "allocated bytes of the small pool");
  arena->stats.cur[_TIDE_ST_ALLOCATED][1] -= 512;
  arena->stats.cur[_TIDE_ST_ALLOCATED][0] -= 512;
  tu_assert_ok(tide_check(w->a));
}

static void validate_finds_wrong_reserved_bytes(void **state) {
  world *w = *state;
  atomic_fetch_add(&w->a->reserved.cur, 4096);
  expect_broken(w, "reserved");
  atomic_fetch_sub(&w->a->reserved.cur, 4096);
  tu_assert_ok(tide_check(w->a));
}

static void validate_finds_an_unmapped_page_under_a_block(void **state) {
  world *w = *state;
  _tide_block *b = block_at(w, w->live[3]);
  _tide_segment *seg = b->segment;
  assert_true(seg->expandable);
  size_t page = w->a->page_size, i = (b->addr - seg->base) / page;
  _tide_handle h = seg->pages[i];
  seg->pages[i] = 0;
  seg->mapped -= page; /* the segment agrees, the block on the page does not */
  expect_broken(w, "which is not mapped");
  seg->pages[i] = h;
  seg->mapped += page;
  tu_assert_ok(tide_check(w->a));
}

/* In a segment of large handles (handle_size_mb:16, 8 pages each): a page
 * inside a handle that names another handle, and one that is unmapped while
 * the rest of its handle is not. */
static void validate_finds_a_broken_large_handle(void **state) {
  world *w = *state;
  void *big = tide_malloc(w->a, 64 * TU_MiB, NULL);
  assert_non_null(big);
  _tide_block *b = block_at(w, big);
  _tide_segment *seg = b->segment;
  assert_int_equal(seg->handle_pages, 8);
  size_t i = (b->addr - seg->base) / w->a->page_size;
  size_t head = i / 8 * 8;
  _tide_handle h = seg->pages[head + 3];
  assert_true(h && h == seg->pages[head]);
  seg->pages[head + 3] = seg->pages[head] + 1;
  expect_broken(w, "lies in the handle of 8 pages");
  seg->pages[head + 3] = 0;
  seg->mapped -= w->a->page_size; /* the mapped bytes agree, the handle does not */
  expect_broken(w, "lies in the handle of 8 pages");
  seg->mapped += w->a->page_size;
  seg->pages[head + 3] = h;
  tu_assert_ok(tide_check(w->a));
  tu_assert_ok(tide_free(w->a, big, NULL));
  tu_assert_ok(tide_check(w->a));
}

static void validate_finds_a_pending_block_without_its_event(void **state) {
  world *w = *state;
  _tide_arena *arena = arena_of(w, NULL);
  assert_true(arena->npending > 0);
  _tide_pending saved = arena->pending[--arena->npending];
  expect_broken(w, "pending");
  arena->pending[arena->npending++] = saved;
  tu_assert_ok(tide_check(w->a));
}

static void validate_finds_a_broken_quick_list(void **state) {
  world *w = *state;
  _tide_arena *arena = arena_of(w, NULL);
  assert_true(arena->nquick > 0);
  arena->nquick--;
  expect_broken(w, "quick");
  arena->nquick++;
  tu_assert_ok(tide_check(w->a));
}

static void validate_refuses_a_bad_handle(void **state) {
  (void)state;
  tide_clear_error();
  tu_assert_status(tide_check(NULL), TIDE_ERR_INVALID);
  tu_assert_last_error(TIDE_ERR_INVALID, "tide_check");
  long junk[64];
  memset(junk, 0x5a, sizeof junk);
  tu_assert_status(tide_check((tide_allocator *)junk), TIDE_ERR_INVALID);
}

#define BOTH(fn)                                                                                   \
  cmocka_unit_test_prestate_setup_teardown(fn, setup, teardown,                                    \
                                           (void *)"host_capacity:1GiB,"                           \
                                                   "expandable_segments:True"),                    \
      cmocka_unit_test_prestate_setup_teardown(fn, setup, teardown,                                \
                                               (void *)"host_capacity:1GiB,"                       \
                                                       "expandable_segments:False")

int main(void) {
  const struct CMUnitTest tests[] = {
      BOTH(validate_passes_through_ordinary_use),
      BOTH(validate_finds_a_gap),
      BOTH(validate_finds_a_broken_link),
      BOTH(validate_finds_unmerged_free_blocks),
      BOTH(validate_finds_a_block_missing_from_its_bin),
      BOTH(validate_finds_a_block_in_the_wrong_bin),
      BOTH(validate_finds_a_lost_live_block),
      BOTH(validate_finds_a_wrong_stat),
      BOTH(validate_finds_wrong_reserved_bytes),
      cmocka_unit_test_prestate_setup_teardown(validate_finds_an_unmapped_page_under_a_block, setup,
                                               teardown,
                                               (void *)"host_capacity:1GiB,"
                                                       "expandable_segments:True"),
      cmocka_unit_test_prestate_setup_teardown(validate_finds_a_broken_large_handle, setup,
                                               teardown,
                                               (void *)"host_capacity:1GiB,"
                                                       "expandable_segments:True,"
                                                       "handle_size_mb:16,handle_threshold_mb:0"),
      BOTH(validate_finds_a_pending_block_without_its_event),
      BOTH(validate_finds_a_broken_quick_list),
      cmocka_unit_test(validate_refuses_a_bad_handle),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
