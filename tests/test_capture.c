/* test_capture.c: capture pools, the private memory of CUDA graphs, on the
 * host backend with emulated captures (tide_host_capture_*).
 *
 * - Routing: allocations of a stream being captured (and of a stream joined
 *   to its capture) go to the pool, in the pool's own segments; other
 *   streams keep the usual memory; a begin on a stream not being captured
 *   routes that stream; no capture, no query (the fast path).
 * - Frees: a pool's block freed in a capture is taken again by the same
 *   capture; a block of the usual memory freed by a capture, or a free that
 *   would need an event on a stream being captured, waits for the capture
 *   to end, and no event is recorded on a capturing stream.
 * - Life: two graphs share a pool; tide_empty_cache leaves a pool with users
 *   alone; the last release returns its memory to the device, also of
 *   blocks freed after it; a stream's destruction leaves its pool memory.
 * - Growth: pages mapped into a pool during a capture and between replays,
 *   blocks never moving and keeping their data.
 * - Checkpoint and restore, including a segment that grew and whose free
 *   blocks merged since the checkpoint (what PyTorch up to 2.10 cannot
 *   restore), blocks freed and allocated since, segments made since; exact
 *   stats afterwards.
 * - Faults: every backend call of a growth in a capture, and of a restore,
 *   made to fail: the pool stays consistent and works after.
 * - capture_detection, and bad input.
 * After every step the layout of every arena is checked: blocks cover each
 * segment, no two free blocks touch, free blocks are in the bins, allocated
 * ones in the live map, unmapped ones in the unmapped list on unmapped
 * pages, and the arena's stats are the sums over its blocks. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "memory/arena_table.h"
#include "testutil.h"

#define MiB ((size_t)1 << 20)
#define KiB ((size_t)1 << 10)
#define PAGE (2 * MiB)

/* ------------------------------------------------------------------------ */
/* Helpers                                                                   */
/* ------------------------------------------------------------------------ */

static tide_allocator *make(const char *conf) {
  char text[256];
  snprintf(text, sizeof text, "host_capacity:4GiB%s%s", conf ? "," : "", conf ? conf : "");
  return tu_create(text);
}

static tide_stream new_stream(tide_allocator *a) {
  tide_stream s = NULL;
  tu_assert_ok(tide_stream_create(a, &s));
  return s;
}

static void *must_malloc(tide_allocator *a, size_t size, tide_stream s) {
  void *p = tide_malloc(a, size, s);
  if (!p) fail_msg("tide_malloc(%zu) failed: %s", size, tide_last_error());
  return p;
}

static tide_stats pool_stats(tide_pool *pool) {
  tide_stats st;
  tu_assert_ok(tide_pool_get_stats(pool, &st));
  return st;
}

static int64_t allocated(const tide_stats *st) { return st->allocated_bytes[0].current; }
static int64_t reserved(const tide_stats *st) { return st->reserved_bytes[0].current; }

/* The arena whose segments hold addr, and the segment. */
static _tide_arena *arena_holding(tide_allocator *a, const void *ptr, _tide_segment **seg_out) {
  uintptr_t addr = (uintptr_t)ptr;
  _tide_arena **arenas;
  size_t n = _tide_arenas_snapshot(a, &arenas);
  _tide_arena *found = NULL;
  for (size_t i = 0; i < n && !found; i++)
    for (int k = 0; k < 2 && !found; k++)
      for (_tide_segment *seg = arenas[i]->pools[k].segments; seg; seg = seg->next)
        if (addr >= seg->base && addr < seg->base + seg->size) {
          found = arenas[i];
          if (seg_out) *seg_out = seg;
          break;
        }
  free(arenas);
  if (!found) fail_msg("%p lies in no segment", ptr);
  return found;
}

/* The capture pool (its id) whose memory holds ptr; 0 for the usual memory. */
static uint64_t pool_holding(tide_allocator *a, const void *ptr) {
  return arena_holding(a, ptr, NULL)->pool_id;
}

static uintptr_t segment_base(tide_allocator *a, const void *ptr) {
  _tide_segment *seg = NULL;
  arena_holding(a, ptr, &seg);
  return seg->base;
}

static bool in_bins(const _tide_bins *bins, const _tide_block *b) {
  for (const _tide_block *x = bins->head[b->bin]; x; x = x->link_next)
    if (x == b) return true;
  return false;
}

static bool in_unmapped(const _tide_pool *pool, const _tide_block *b) {
  for (const _tide_block *x = pool->unmapped; x; x = x->link_next)
    if (x == b) return true;
  return false;
}

/* One arena's layout and stats, under its lock. */
static void check_arena(tide_allocator *a, _tide_arena *arena) {
  int64_t alloc_bytes = 0, requested = 0, allocations = 0, split_bytes = 0, split_blocks = 0;
  int64_t pending = 0, mapped = 0;
  size_t live = 0, page = a->page_size;
  for (int k = 0; k < 2; k++) {
    for (_tide_segment *seg = arena->pools[k].segments; seg; seg = seg->next) {
      uintptr_t at = seg->base;
      const _tide_block *prev = NULL;
      for (const _tide_block *b = seg->first; b; prev = b, b = b->next) {
        if (b->addr != at || b->prev != prev || b->segment != seg || b->size == 0)
          fail_msg("segment %p: block at %p (%zu bytes) breaks the chain at %p", (void *)seg->base,
                   (void *)b->addr, b->size, (void *)at);
        if (prev && prev->state == _TIDE_FREE && b->state == _TIDE_FREE)
          fail_msg("free blocks at %p and %p touch", (void *)prev->addr, (void *)b->addr);
        bool split = b->prev || b->next;
        switch (b->state) {
        case _TIDE_FREE:
          if (!in_bins(&arena->pools[k].bins, b)) fail_msg("free %p not in a bin", (void *)b->addr);
          if (split) split_bytes += (int64_t)b->size, split_blocks++;
          break;
        case _TIDE_QUICK:
          live++;
          if (split) split_bytes += (int64_t)b->size, split_blocks++;
          break;
        case _TIDE_ALLOCATED:
          if (_tide_arena_live(arena, b->addr) != b)
            fail_msg("allocated %p not in the live map", (void *)b->addr);
          live++;
          alloc_bytes += (int64_t)b->size;
          requested += (int64_t)b->requested;
          allocations++;
          break;
        case _TIDE_PENDING: pending += (int64_t)b->size; break;
        case _TIDE_UNMAPPED:
          if (!in_unmapped(&arena->pools[k], b))
            fail_msg("unmapped %p not listed", (void *)b->addr);
          if (seg->expandable)
            for (size_t i = (b->addr - seg->base) / page;
                 i < (b->addr + b->size - seg->base) / page; i++)
              if (seg->pages[i]) fail_msg("unmapped %p has page %zu mapped", (void *)b->addr, i);
          break;
        default: fail_msg("block %p in state %d", (void *)b->addr, b->state);
        }
        if (b->state != _TIDE_UNMAPPED && seg->expandable)
          for (size_t i = (b->addr - seg->base) / page;
               i <= (b->addr + b->size - 1 - seg->base) / page; i++)
            if (!seg->pages[i]) fail_msg("block %p uses unmapped page %zu", (void *)b->addr, i);
        at += b->size;
      }
      if (at != seg->base + seg->size) fail_msg("segment %p not covered", (void *)seg->base);
      mapped += (int64_t)seg->mapped;
    }
  }
  _tide_arena_stats reported; /* as reported: the raw ones count quick blocks */
  _tide_arena_stats_read(arena, &reported);
  const _tide_arena_stats *s = &reported;
  assert_int_equal(s->cur[_TIDE_ST_ALLOCATED][0], alloc_bytes);
  assert_int_equal(s->cur[_TIDE_ST_REQUESTED][0], requested);
  assert_int_equal(s->cur[_TIDE_ST_ALLOCATIONS][0], allocations);
  assert_int_equal(s->cur[_TIDE_ST_INACTIVE_SPLIT][0], split_bytes);
  assert_int_equal(s->cur[_TIDE_ST_INACTIVE_SPLIT_BLOCKS][0], split_blocks);
  assert_int_equal(s->cur[_TIDE_ST_PENDING][0], pending);
  assert_int_equal(s->cur[_TIDE_ST_RESERVED][0], mapped);
  assert_int_equal(arena->live.count, live);
}

static void check_all(tide_allocator *a) {
  _tide_arena **arenas;
  size_t n = _tide_arenas_snapshot(a, &arenas);
  int64_t reserved_sum = 0;
  for (size_t i = 0; i < n; i++) {
    _tide_lock_acquire(&arenas[i]->lock);
    check_arena(a, arenas[i]);
    reserved_sum += arenas[i]->stats.cur[_TIDE_ST_RESERVED][0];
    _tide_lock_release(&arenas[i]->lock);
  }
  free(arenas);
  assert_int_equal(atomic_load(&a->reserved.cur), reserved_sum);
  assert_int_equal((int64_t)tide_host_bytes_in_use(a), reserved_sum);
}

static void destroy_clean(tide_allocator *a) {
  tu_assert_ok(tide_empty_cache(a));
  check_all(a);
  tide_stats st = tu_stats(a);
  assert_int_equal(allocated(&st), 0);
  assert_int_equal(reserved(&st), 0);
  assert_int_equal(tide_host_bytes_in_use(a), 0);
  assert_null(a->captures.pools);                      /* every pool went */
  assert_int_equal(atomic_load(&a->capture_watch), 0); /* nothing routed or deferred */
  tu_assert_ok(tide_destroy(a));
}

/* Begin a capture on s (emulated) that allocates to pool. */
static void capture_begin(tide_allocator *a, tide_stream s, tide_pool *pool) {
  tu_assert_ok(tide_host_capture_begin(a, s));
  tu_assert_ok(tide_capture_begin(a, s, pool));
}

static void capture_end(tide_allocator *a, tide_stream s) {
  tu_assert_ok(tide_host_capture_end(a, s));
  tu_assert_ok(tide_capture_end(a, s));
}

/* ------------------------------------------------------------------------ */
/* Routing                                                                   */
/* ------------------------------------------------------------------------ */

static void test_capture_goes_to_pool(void **state) {
  (void)state;
  tide_allocator *a = make(NULL);
  tide_stream s = new_stream(a), t = new_stream(a), j = new_stream(a);
  void *before = must_malloc(a, MiB, s);
  tide_pool *pool = NULL;
  tu_assert_ok(tide_pool_create(a, &pool));
  uint64_t id = tide_pool_id(pool);
  assert_true(id != 0);
  tide_stats all0 = tu_stats(a);

  capture_begin(a, s, pool);
  void *p = must_malloc(a, 3 * MiB, s);
  void *q = must_malloc(a, 4 * KiB, s);
  assert_int_equal(pool_holding(a, p), id);
  assert_int_equal(pool_holding(a, q), id);
  /* A stream forked into the capture shares its id: its blocks go there too. */
  tu_assert_ok(tide_host_capture_join(a, j, s));
  void *m = must_malloc(a, 2 * MiB, j);
  assert_int_equal(pool_holding(a, m), id);
  /* Another stream meanwhile keeps the usual memory. */
  void *r = must_malloc(a, MiB, t);
  assert_int_equal(pool_holding(a, r), 0);
  tide_pool *seen = NULL;
  tu_assert_ok(tide_capture_pool(a, j, &seen));
  assert_ptr_equal(seen, pool);
  assert_int_equal(tide_capture_pool(a, t, &seen), TIDE_ERR_INVALID);
  assert_null(seen);
  check_all(a);

  /* The pool's stats are its blocks; the allocator's include them. */
  tide_stats ps = pool_stats(pool), all = tu_stats(a);
  assert_int_equal(allocated(&ps), 3 * MiB + 4 * KiB + 2 * MiB);
  assert_int_equal(ps.allocations[0].current, 3);
  assert_true(reserved(&ps) >= (int64_t)(6 * MiB));
  assert_int_equal(allocated(&all), allocated(&all0) + allocated(&ps) + (int64_t)MiB);
  assert_int_equal(reserved(&all), reserved(&all0) + reserved(&ps) + (int64_t)PAGE);
  /* The snapshot names the pool of each segment. */
  char *json = NULL, needle[64];
  tu_assert_ok(tide_snapshot_json(a, &json, NULL));
  snprintf(needle, sizeof needle, "\"capture_pool\": %llu", (unsigned long long)id);
  assert_non_null(strstr(json, needle));
  assert_non_null(strstr(json, "\"capture_pool\": 0"));
  tide_string_free(json);

  capture_end(a, s);
  void *after = must_malloc(a, MiB, s);
  assert_int_equal(pool_holding(a, after), 0);
  assert_int_equal(tide_capture_pool(a, s, &seen), TIDE_ERR_INVALID);
  for (void **x = (void *[]){before, p, q, after, NULL}; *x; x++) tu_assert_ok(tide_free(a, *x, s));
  tu_assert_ok(tide_free(a, m, j));
  tu_assert_ok(tide_free(a, r, t));
  tu_assert_ok(tide_pool_release(pool)); /* the graph's */
  tu_assert_ok(tide_pool_release(pool)); /* the creator's: memory goes back */
  check_all(a);
  destroy_clean(a);
}

/* Without a capture the fast paths ask the backend nothing; a begin on a
 * stream not being captured routes that stream without asking either. */
static void test_no_capture_no_query(void **state) {
  (void)state;
  tide_allocator *a = make(NULL);
  tide_stream s = new_stream(a), t = new_stream(a);
  for (int i = 0; i < 1000; i++) {
    void *p = must_malloc(a, (size_t)(i % 7 + 1) * 100 * KiB, i % 2 ? s : NULL);
    tu_assert_ok(tide_free(a, p, i % 2 ? s : NULL));
  }
  assert_int_equal(tide_host_call_count(a, TIDE_OP_CAPTURE_STATUS), 0);
  assert_int_equal(atomic_load(&a->capture_watch), 0);

  tide_pool *pool = NULL;
  tu_assert_ok(tide_pool_create(a, &pool));
  tu_assert_ok(tide_capture_begin(a, t, pool)); /* t is not being captured: t itself */
  uint64_t asked = tide_host_call_count(a, TIDE_OP_CAPTURE_STATUS);
  void *p = must_malloc(a, 5 * MiB, t);
  assert_int_equal(pool_holding(a, p), tide_pool_id(pool));
  void *g = must_malloc(a, 5 * MiB, s);
  assert_int_equal(pool_holding(a, g), 0);
  assert_int_equal(tide_host_call_count(a, TIDE_OP_CAPTURE_STATUS), asked);
  tu_assert_ok(tide_capture_end(a, t));
  assert_int_equal(atomic_load(&a->capture_watch), 0);
  tu_assert_ok(tide_free(a, p, t));
  tu_assert_ok(tide_free(a, g, s));
  tu_assert_ok(tide_pool_release(pool));
  tu_assert_ok(tide_pool_release(pool));
  destroy_clean(a);
}

/* ------------------------------------------------------------------------ */
/* Frees during a capture                                                    */
/* ------------------------------------------------------------------------ */

static void test_free_and_reuse_in_capture(void **state) {
  (void)state;
  tide_allocator *a = make(NULL);
  tide_stream s = new_stream(a);
  /* A free block of the usual memory of just the size the capture asks. */
  void *g = must_malloc(a, MiB, s);
  tu_assert_ok(tide_free(a, g, s));
  tide_pool *pool = NULL;
  tu_assert_ok(tide_pool_create(a, &pool));
  capture_begin(a, s, pool);
  void *p = must_malloc(a, MiB, s);
  assert_true(p != g);
  assert_int_equal(pool_holding(a, p), tide_pool_id(pool));
  tu_assert_ok(tide_free(a, p, s));
  /* The graph orders the free before the next allocation: the same block. */
  void *q = must_malloc(a, MiB, s);
  assert_ptr_equal(q, p);
  tu_assert_ok(tide_free(a, q, s));
  void *big = must_malloc(a, 3 * MiB, s); /* merges, grows: still the pool's */
  assert_int_equal(pool_holding(a, big), tide_pool_id(pool));
  tu_assert_ok(tide_free(a, big, s));
  check_all(a);
  capture_end(a, s);
  /* The pool's free blocks never serve the usual memory. */
  void *after = must_malloc(a, MiB, s);
  assert_ptr_equal(after, g);
  tu_assert_ok(tide_free(a, after, s));
  tu_assert_ok(tide_pool_release(pool));
  tu_assert_ok(tide_pool_release(pool));
  destroy_clean(a);
}

static void test_precapture_free_deferred(void **state) {
  (void)state;
  tide_allocator *a = make(NULL);
  tide_stream s = new_stream(a), t = new_stream(a);
  void *g = must_malloc(a, MiB, s);
  void *h = must_malloc(a, 2 * MiB, t);
  tu_assert_ok(tide_record_stream(a, h, s)); /* used by s too */
  tide_pool *pool = NULL;
  tu_assert_ok(tide_pool_create(a, &pool));
  capture_begin(a, s, pool);
  tide_stats st0 = tu_stats(a);
  uint64_t records = tide_host_call_count(a, TIDE_OP_EVENT_RECORD);

  tu_assert_ok(tide_free(a, g, s)); /* freed by the capture */
  tu_assert_ok(tide_free(a, h, t)); /* would need an event on s, being captured */
  assert_int_equal(tide_host_call_count(a, TIDE_OP_EVENT_RECORD), records);
  tide_stats st = tu_stats(a);
  assert_int_equal(allocated(&st), allocated(&st0) - (int64_t)(3 * MiB));
  assert_int_equal(st.active_bytes[0].current, allocated(&st0)); /* still in use */
  assert_int_equal(tide_free(a, g, s), TIDE_ERR_DOUBLE_FREE);
  void *p = must_malloc(a, MiB, s); /* the capture's, from the pool */
  assert_int_equal(pool_holding(a, p), tide_pool_id(pool));
  check_all(a);

  /* The begin ends but s is still being captured: not reusable yet. */
  tu_assert_ok(tide_capture_end(a, s));
  void *q = must_malloc(a, MiB, s);
  assert_true(q != g);
  assert_int_equal(pool_holding(a, q), 0);
  tu_assert_ok(tide_free(a, q, s)); /* the usual memory, freed in the capture: deferred too */
  void *r = must_malloc(a, 2 * MiB, t);
  assert_true(r != h);
  tu_assert_ok(tide_free(a, r, t));
  assert_int_equal(tide_host_call_count(a, TIDE_OP_EVENT_RECORD), records);

  tu_assert_ok(tide_host_capture_end(a, s));
  /* Now the frees happen: g and q on their own stream, h after s. */
  void *again = must_malloc(a, MiB, s);
  assert_true(again == g || again == q);
  void *again_h = must_malloc(a, 2 * MiB, t);
  assert_true(again_h == h || again_h == r);
  assert_true(tide_host_call_count(a, TIDE_OP_EVENT_RECORD) > records);
  check_all(a);
  tu_assert_ok(tide_free(a, again, s));
  tu_assert_ok(tide_free(a, again_h, t));
  tu_assert_ok(tide_free(a, p, s));
  tide_stats end = tu_stats(a);
  assert_int_equal(end.active_bytes[0].current, 0);
  assert_int_equal(atomic_load(&a->capture_watch), 0);
  tu_assert_ok(tide_pool_release(pool));
  tu_assert_ok(tide_pool_release(pool));
  destroy_clean(a);
}

/* The emulated capture behaves as the driver: no waiting for a capturing
 * stream, and an event recorded in it never completes. */
static void test_emulated_capture(void **state) {
  (void)state;
  tide_allocator *a = make(NULL);
  tide_stream s = new_stream(a), t = new_stream(a);
  const _tide_backend *be = &a->backend;
  bool capturing = true;
  uint64_t id = 7, id2 = 0;
  tu_assert_ok(be->ops->stream_capture_status(be->ctx, s, &capturing, &id));
  assert_false(capturing);
  assert_int_equal(id, 0);
  assert_int_equal(tide_host_capture_begin(a, NULL), TIDE_ERR_INVALID);
  assert_int_equal(tide_host_capture_end(a, s), TIDE_ERR_INVALID);
  assert_int_equal(tide_host_capture_join(a, t, s), TIDE_ERR_INVALID);
  tu_assert_ok(tide_host_capture_begin(a, s));
  assert_int_equal(tide_host_capture_begin(a, s), TIDE_ERR_INVALID);
  tu_assert_ok(be->ops->stream_capture_status(be->ctx, s, &capturing, &id));
  assert_true(capturing && id != 0);
  tu_assert_ok(tide_host_capture_join(a, t, s));
  tu_assert_ok(be->ops->stream_capture_status(be->ctx, t, &capturing, &id2));
  assert_int_equal(id2, id);
  tu_assert_ok(be->ops->stream_capture_status(be->ctx, NULL, &capturing, &id2));
  assert_false(capturing);
  assert_int_equal(tide_stream_synchronize(a, s), TIDE_ERR_NOT_READY);
  _tide_event e;
  tu_assert_ok(be->ops->event_create(be->ctx, &e));
  tu_assert_ok(be->ops->event_record(be->ctx, e, s));
  assert_int_equal(be->ops->event_query(be->ctx, e), TIDE_ERR_NOT_READY);
  assert_int_equal(be->ops->event_synchronize(be->ctx, e), TIDE_ERR_NOT_READY);
  tu_assert_ok(tide_host_capture_end(a, t)); /* ends it for every stream of it */
  tu_assert_ok(be->ops->stream_capture_status(be->ctx, s, &capturing, &id));
  assert_false(capturing);
  assert_int_equal(be->ops->event_query(be->ctx, e), TIDE_ERR_NOT_READY); /* still the graph's */
  tu_assert_ok(be->ops->event_record(be->ctx, e, s));
  tu_assert_ok(be->ops->event_query(be->ctx, e));
  tu_assert_ok(be->ops->event_destroy(be->ctx, e));
  tu_assert_ok(tide_stream_synchronize(a, s));
  destroy_clean(a);
}

/* ------------------------------------------------------------------------ */
/* Life of a pool                                                            */
/* ------------------------------------------------------------------------ */

static void test_two_graphs_share_a_pool(void **state) {
  (void)state;
  tide_allocator *a = make(NULL);
  tide_stream s = new_stream(a);
  tide_pool *pool = NULL;
  tu_assert_ok(tide_pool_create(a, &pool));
  capture_begin(a, s, pool); /* graph 1 */
  void *out1 = must_malloc(a, 8 * MiB, s);
  void *tmp = must_malloc(a, 3 * MiB, s);
  tu_assert_ok(tide_free(a, tmp, s));
  capture_end(a, s);
  capture_begin(a, s, pool); /* graph 2, same pool */
  void *out2 = must_malloc(a, 8 * MiB, s);
  capture_end(a, s);
  assert_int_equal(pool_holding(a, out2), tide_pool_id(pool));
  assert_int_equal(segment_base(a, out2), segment_base(a, out1));
  uint64_t held = tide_host_bytes_in_use(a);
  assert_true(held >= 16 * MiB);

  tu_assert_ok(tide_pool_release(pool)); /* the creator's */
  tu_assert_ok(tide_free(a, out1, s));
  tu_assert_ok(tide_free(a, out2, s));
  tu_assert_ok(tide_empty_cache(a)); /* the graphs still replay into it */
  assert_int_equal(tide_host_bytes_in_use(a), held);
  tu_assert_ok(tide_pool_release(pool)); /* graph 1 destroyed */
  tu_assert_ok(tide_empty_cache(a));
  assert_int_equal(tide_host_bytes_in_use(a), held);
  tide_stats ps = pool_stats(pool);
  assert_int_equal(allocated(&ps), 0);
  assert_int_equal(reserved(&ps), (int64_t)held);
  tu_assert_ok(tide_pool_release(pool)); /* graph 2 destroyed: all goes back */
  assert_int_equal(tide_host_bytes_in_use(a), 0);
  tide_stats st = tu_stats(a);
  assert_int_equal(reserved(&st), 0);
  assert_null(a->captures.pools);
  destroy_clean(a);
}

/* The last release with a block still allocated: the rest goes back at
 * once, that block once it is freed and the cache emptied. */
static void test_release_with_live_block(void **state) {
  (void)state;
  tide_allocator *a = make(NULL);
  tide_stream s = new_stream(a);
  tide_pool *pool = NULL;
  tu_assert_ok(tide_pool_create(a, &pool));
  capture_begin(a, s, pool);
  void *keep = must_malloc(a, 3 * MiB, s);
  void *gone = must_malloc(a, 9 * MiB, s);
  tu_assert_ok(tide_free(a, gone, s));
  capture_end(a, s);
  assert_true(tide_host_bytes_in_use(a) >= 12 * MiB);
  tu_assert_ok(tide_pool_release(pool));
  tu_assert_ok(tide_pool_release(pool));
  assert_int_equal(tide_host_bytes_in_use(a), 2 * PAGE);    /* keep's two pages */
  assert_int_equal(tide_pool_retain(pool), TIDE_ERR_STATE); /* released */
  assert_int_equal(tide_capture_begin(a, s, pool), TIDE_ERR_STATE);
  check_all(a);
  tu_assert_ok(tide_free(a, keep, s));
  assert_non_null(a->captures.pools);
  destroy_clean(a); /* empty_cache returns the rest and the pool goes */
}

/* A graph replays on whatever stream the program launches it on (PyTorch
 * captures on a side stream and replays on the current one), writing the
 * blocks its capture freed: the stream of the pool's arena says nothing of
 * that work. The last release gives the pool's pages back only once the
 * whole device is done; while a replay still runs (a held stream) they stay,
 * and go with the first tide_empty_cache after it. */
static void test_release_waits_for_replays(void **state) {
  (void)state;
  tide_allocator *a = make(NULL);
  tide_stream s = new_stream(a), r = new_stream(a);
  tide_pool *pool = NULL;
  tu_assert_ok(tide_pool_create(a, &pool));
  capture_begin(a, s, pool);
  void *tmp = must_malloc(a, 9 * MiB, s); /* an intermediate, freed in the capture */
  tu_assert_ok(tide_free(a, tmp, s));
  capture_end(a, s);
  uint64_t held = tide_host_bytes_in_use(a);
  assert_true(held >= 9 * MiB);
  tu_assert_ok(tide_host_stream_hold(a, r)); /* the graph replayed on r, still running */
  tu_assert_ok(tide_pool_release(pool));
  assert_int_equal(tide_pool_release(pool), TIDE_ERR_NOT_READY); /* the last user */
  assert_non_null(strstr(tide_last_error(), "next tide_empty_cache"));
  assert_non_null(strstr(tide_last_error(), "held"));
  assert_int_equal(tide_host_bytes_in_use(a), held); /* the replay's pages stay mapped */
  assert_int_equal(tide_pool_retain(pool), TIDE_ERR_STATE);
  check_all(a);
  assert_int_equal(tide_empty_cache(a), TIDE_ERR_NOT_READY);
  assert_int_equal(tide_host_bytes_in_use(a), held);
  tu_assert_ok(tide_host_stream_release(a, r)); /* the replay is done */
  tu_assert_ok(tide_stream_destroy(a, r));
  destroy_clean(a);
}

/* A graph's output outlives the graph and is read on another stream than
 * the capture's (without tide_record_stream, as PyTorch reads a replay's
 * output on the replay's stream); freed there, its pages go only once that
 * read is done. */
static void test_output_outlives_pool(void **state) {
  (void)state;
  tide_allocator *a = make(NULL);
  tide_stream s = new_stream(a), r = new_stream(a);
  tide_pool *pool = NULL;
  tu_assert_ok(tide_pool_create(a, &pool));
  capture_begin(a, s, pool);
  void *out = must_malloc(a, 9 * MiB, s);
  capture_end(a, s);
  tu_assert_ok(tide_pool_release(pool));
  tu_assert_ok(tide_pool_release(pool)); /* nothing runs: the free pages go */
  uint64_t held = tide_host_bytes_in_use(a);
  assert_true(held >= 9 * MiB);
  tu_assert_ok(tide_host_stream_hold(a, r)); /* a kernel on r reads the output */
  tu_assert_ok(tide_free_home(a, out, r));   /* the tensor goes while it runs */
  assert_int_equal(tide_empty_cache(a), TIDE_ERR_NOT_READY);
  assert_int_equal(tide_host_bytes_in_use(a), held);
  check_all(a);
  tu_assert_ok(tide_host_stream_release(a, r));
  tu_assert_ok(tide_stream_destroy(a, r));
  destroy_clean(a);
}

/* Waiting for the whole device while a stream is being captured would
 * invalidate the capture: a pool released then keeps its memory, without
 * that wait, until a tide_empty_cache after the capture. */
static void test_release_during_another_capture(void **state) {
  (void)state;
  tide_allocator *a = make(NULL);
  tide_stream s = new_stream(a), t = new_stream(a);
  tide_pool *gone = NULL, *busy = NULL;
  tu_assert_ok(tide_pool_create(a, &gone));
  tu_assert_ok(tide_pool_create(a, &busy));
  capture_begin(a, s, gone);
  void *tmp = must_malloc(a, 9 * MiB, s);
  tu_assert_ok(tide_free(a, tmp, s));
  capture_end(a, s);
  assert_true(tide_host_bytes_in_use(a) >= 9 * MiB);
  capture_begin(a, t, busy);
  void *p = must_malloc(a, 3 * MiB, t);
  uint64_t held = tide_host_bytes_in_use(a);
  uint64_t syncs = tide_host_call_count(a, TIDE_OP_DEVICE_SYNCHRONIZE);
  tu_assert_ok(tide_pool_release(gone));
  assert_int_equal(tide_pool_release(gone), TIDE_ERR_NOT_READY);
  assert_non_null(strstr(tide_last_error(), "capture"));
  assert_int_equal(tide_host_call_count(a, TIDE_OP_DEVICE_SYNCHRONIZE), syncs);
  assert_int_equal(tide_host_bytes_in_use(a), held);
  assert_int_equal(tide_empty_cache(a), TIDE_ERR_NOT_READY); /* the capture goes on */
  assert_int_equal(tide_host_call_count(a, TIDE_OP_DEVICE_SYNCHRONIZE), syncs);
  void *q = must_malloc(a, 3 * MiB, t); /* and still allocates to its pool */
  assert_int_equal(pool_holding(a, q), tide_pool_id(busy));
  tu_assert_ok(tide_free(a, q, t));
  tu_assert_ok(tide_free(a, p, t));
  capture_end(a, t);
  tu_assert_ok(tide_empty_cache(a)); /* the released pool's memory goes now */
  tide_stats ps = pool_stats(busy);
  assert_int_equal(tide_host_bytes_in_use(a), reserved(&ps)); /* only busy's */
  check_all(a);
  tu_assert_ok(tide_pool_release(busy));
  tu_assert_ok(tide_pool_release(busy));
  destroy_clean(a);
}

/* The arenas of a pool that is gone serve the next pool, whose stats
 * start from zero; the allocator's keep the history. */
static void test_next_pool_starts_from_zero(void **state) {
  (void)state;
  tide_allocator *a = make(NULL);
  tide_stream s = new_stream(a);
  tide_pool *first = NULL, *next = NULL;
  tu_assert_ok(tide_pool_create(a, &first));
  tu_assert_ok(tide_capture_begin(a, s, first));
  void *x = must_malloc(a, 3 * MiB, s);
  void *y = must_malloc(a, MiB, s);
  tu_assert_ok(tide_free(a, x, s));
  tu_assert_ok(tide_free(a, y, s));
  tu_assert_ok(tide_capture_end(a, s));
  tu_assert_ok(tide_pool_release(first));
  tu_assert_ok(tide_pool_release(first)); /* gone: its arena is free for the next */
  size_t arenas = atomic_load(&a->narenas);
  tide_stats all1 = tu_stats(a);
  tu_assert_ok(tide_pool_create(a, &next));
  tu_assert_ok(tide_capture_begin(a, s, next));
  void *z = must_malloc(a, 2 * MiB, s);
  assert_int_equal(atomic_load(&a->narenas), arenas); /* the same arena, taken again */
  tide_stats ps = pool_stats(next), all2 = tu_stats(a);
  assert_int_equal(ps.num_allocs, 1);
  assert_int_equal(ps.num_frees, 0);
  assert_int_equal(allocated(&ps), 2 * MiB);
  assert_int_equal(ps.allocated_bytes[0].peak, 2 * MiB);
  assert_int_equal(ps.pages_mapped, 1);
  assert_int_equal(all2.num_allocs, all1.num_allocs + 1);
  assert_int_equal(all2.num_frees, all1.num_frees);
  assert_int_equal(all2.pages_mapped, all1.pages_mapped + 1);
  assert_true(all2.active_bytes[0].peak >= all1.active_bytes[0].peak);
  assert_true(all2.segments_created == all1.segments_created + 1);
  tu_assert_ok(tide_free(a, z, s));
  tu_assert_ok(tide_capture_end(a, s));
  tu_assert_ok(tide_pool_release(next));
  tu_assert_ok(tide_pool_release(next));
  check_all(a);
  destroy_clean(a);
}

static void test_stream_destroy_keeps_pool(void **state) {
  (void)state;
  tide_allocator *a = make(NULL);
  tide_stream s = new_stream(a), t = new_stream(a);
  tide_pool *pool = NULL;
  tu_assert_ok(tide_pool_create(a, &pool));
  capture_begin(a, t, pool);
  void *p = must_malloc(a, 6 * MiB, t);
  capture_end(a, t);
  tu_assert_ok(tide_free(a, p, t));
  void *g = must_malloc(a, 6 * MiB, t);
  tu_assert_ok(tide_free(a, g, t));
  uint64_t held = tide_host_bytes_in_use(a);
  tu_assert_ok(tide_stream_destroy(a, t));
  tide_stats ps = pool_stats(pool);
  assert_int_equal(reserved(&ps), (int64_t)tide_host_bytes_in_use(a)); /* t's own cache went */
  assert_true(tide_host_bytes_in_use(a) < held);
  assert_true(reserved(&ps) >= (int64_t)(6 * MiB));
  /* The pool grows on another stream as well. */
  capture_begin(a, s, pool);
  void *q = must_malloc(a, 6 * MiB, s);
  capture_end(a, s);
  assert_int_equal(pool_holding(a, q), tide_pool_id(pool));
  tu_assert_ok(tide_free(a, q, s));
  check_all(a);
  for (int i = 0; i < 3; i++) tu_assert_ok(tide_pool_release(pool));
  assert_int_equal(tide_host_bytes_in_use(a), 0);
  destroy_clean(a);
}

/* ------------------------------------------------------------------------ */
/* Growth                                                                    */
/* ------------------------------------------------------------------------ */

static void test_pool_grows_during_and_between_captures(void **state) {
  (void)state;
  tide_allocator *a = make(NULL);
  tide_stream s = new_stream(a), t = new_stream(a);
  tide_pool *pool = NULL;
  tu_assert_ok(tide_pool_create(a, &pool));
  const size_t sizes[] = {3 * MiB, 5 * MiB + 512, 9 * MiB, 700 * KiB};
  void *blocks[8];
  capture_begin(a, s, pool);
  uint64_t maps = tide_host_call_count(a, TIDE_OP_MAP);
  uint64_t syncs = tide_host_call_count(a, TIDE_OP_STREAM_SYNCHRONIZE);
  tide_stats st0 = tu_stats(a);
  for (int i = 0; i < 4; i++) {
    blocks[i] = must_malloc(a, sizes[i], s);
    tu_fill(blocks[i], sizes[i], (uint64_t)i, TU_PATTERN_DEFAULT);
  }
  tide_stats st1 = tu_stats(a);
  assert_true(tide_host_call_count(a, TIDE_OP_MAP) > maps);
  assert_true(st1.pages_mapped > st0.pages_mapped);
  assert_int_equal(tide_host_call_count(a, TIDE_OP_STREAM_SYNCHRONIZE), syncs);
  /* The large blocks share one expandable segment. */
  assert_int_equal(segment_base(a, blocks[1]), segment_base(a, blocks[0]));
  assert_int_equal(segment_base(a, blocks[2]), segment_base(a, blocks[0]));
  capture_end(a, s);

  /* Between replays: the pool grows on another stream, outside a capture. */
  for (int i = 4; i < 8; i++) {
    tu_assert_ok(tide_capture_begin(a, t, pool));
    blocks[i] = must_malloc(a, 16 * MiB, t);
    tu_assert_ok(tide_capture_end(a, t));
    tu_assert_ok(tide_pool_release(pool)); /* nothing captured: the begin's use */
    assert_int_equal(pool_holding(a, blocks[i]), tide_pool_id(pool));
    tu_fill(blocks[i], 16 * MiB, (uint64_t)i, TU_PATTERN_DEFAULT);
  }
  tide_stats st2 = tu_stats(a);
  assert_true(st2.pages_mapped >= st1.pages_mapped + 32);
  for (int i = 0; i < 4; i++)
    tu_assert_pattern(blocks[i], sizes[i], (uint64_t)i, TU_PATTERN_DEFAULT);
  for (int i = 4; i < 8; i++)
    tu_assert_pattern(blocks[i], 16 * MiB, (uint64_t)i, TU_PATTERN_DEFAULT);
  check_all(a);
  tide_stats ps = pool_stats(pool);
  for (int i = 0; i < 8; i++) tu_assert_ok(tide_free(a, blocks[i], i < 4 ? s : t));
  tu_assert_ok(tide_empty_cache(a));
  tide_stats kept = pool_stats(pool);
  assert_int_equal(reserved(&kept), reserved(&ps)); /* in use: kept */
  assert_int_equal(allocated(&kept), 0);
  tu_assert_ok(tide_pool_release(pool));
  tu_assert_ok(tide_pool_release(pool));
  destroy_clean(a);
}

/* ------------------------------------------------------------------------ */
/* Checkpoint and restore                                                    */
/* ------------------------------------------------------------------------ */

static bool listed(void *const *list, size_t n, const void *p) {
  for (size_t i = 0; i < n; i++)
    if (list[i] == p) return true;
  return false;
}

static void assert_same_stats(const tide_stats *x, const tide_stats *y) {
  assert_int_equal(x->allocated_bytes[0].current, y->allocated_bytes[0].current);
  assert_int_equal(x->requested_bytes[0].current, y->requested_bytes[0].current);
  assert_int_equal(x->allocations[0].current, y->allocations[0].current);
  assert_int_equal(x->active_bytes[0].current, y->active_bytes[0].current);
  for (int k = 1; k < TIDE_POOL_KINDS; k++)
    assert_int_equal(x->allocated_bytes[k].current, y->allocated_bytes[k].current);
}

static void test_checkpoint_restore(void **state) {
  (void)state;
  tide_allocator *a = make(NULL);
  tide_stream s = new_stream(a);
  tide_pool *pool = NULL;
  tu_assert_ok(tide_pool_create(a, &pool));
  tu_assert_ok(tide_capture_begin(a, s, pool));
  void *x = must_malloc(a, MiB, s);
  void *y = must_malloc(a, 2 * MiB + 100, s);
  void *z = must_malloc(a, 512 * KiB, s);
  tide_checkpoint *ck = NULL;
  tu_assert_ok(tide_pool_checkpoint(pool, &ck));
  tide_stats at_ck = pool_stats(pool);
  tu_assert_ok(tide_free(a, y, s));
  void *w = must_malloc(a, MiB, s); /* in y's place */
  void *v = must_malloc(a, 8 * KiB, s);
  tu_assert_ok(tide_capture_end(a, s));
  tide_stream t = new_stream(a); /* a stream new to the pool: an arena newer than the checkpoint */
  tu_assert_ok(tide_capture_begin(a, t, pool));
  void *u = must_malloc(a, 5 * MiB, t);
  tu_assert_ok(tide_capture_end(a, t));
  tu_assert_ok(tide_pool_release(pool));

  tide_restore_delta d;
  tu_assert_ok(tide_pool_restore(pool, ck, &d));
  assert_int_equal(d.nrestored, 1);
  assert_ptr_equal(d.restored[0], y);
  assert_int_equal(d.nreleased, 3);
  assert_true(listed(d.released, d.nreleased, w) && listed(d.released, d.nreleased, v) &&
              listed(d.released, d.nreleased, u));
  tide_restore_delta_free(&d);
  assert_null(d.restored);
  tide_stats now = pool_stats(pool);
  assert_same_stats(&now, &at_ck);
  check_all(a);
  void *base = NULL;
  size_t size = 0;
  tu_assert_ok(tide_block_info(a, y, &base, &size, NULL));
  assert_ptr_equal(base, y);
  assert_int_equal(size, 2 * MiB + 512);
  assert_int_equal(tide_free(a, w, s), TIDE_ERR_DOUBLE_FREE); /* released */
  /* Restoring again changes nothing. */
  tu_assert_ok(tide_pool_restore(pool, ck, &d));
  assert_int_equal(d.nrestored + d.nreleased, 0);
  tide_restore_delta_free(&d);
  tu_assert_ok(tide_pool_restore(pool, ck, NULL));
  for (void **p = (void *[]){x, y, z, NULL}; *p; p++) tu_assert_ok(tide_free(a, *p, s));
  check_all(a);
  tide_checkpoint_free(ck);
  tu_assert_ok(tide_pool_release(pool));
  tu_assert_ok(tide_pool_release(pool));
  destroy_clean(a);
}

/* The case PyTorch up to 2.10 cannot restore: after the checkpoint the
 * expandable segment grows and its free blocks merge across what were
 * separate blocks; the checkpoint is smaller. */
static void test_restore_grown_and_merged(void **state) {
  (void)state;
  const size_t third = 1536 * KiB;
  /* Blocks packed from the front, so that the layout is known. */
  tide_allocator *a = make("release_holes:False");
  tide_stream s = new_stream(a);
  tide_pool *pool = NULL;
  tu_assert_ok(tide_pool_create(a, &pool));
  capture_begin(a, s, pool);
  void *x = must_malloc(a, third, s);
  void *y = must_malloc(a, third, s);
  void *z = must_malloc(a, third, s);
  assert_ptr_equal(y, (char *)x + third);
  assert_ptr_equal(z, (char *)y + third);
  tu_fill(x, third, 1, TU_PATTERN_DEFAULT);
  tu_fill(z, third, 3, TU_PATTERN_DEFAULT);
  tu_assert_ok(tide_free(a, y, s));
  capture_end(a, s);
  _tide_segment *seg = NULL;
  arena_holding(a, x, &seg);
  size_t mapped_at_ck = seg->mapped;
  assert_int_equal(mapped_at_ck, 3 * PAGE);
  tide_checkpoint *ck = NULL;
  tu_assert_ok(tide_pool_checkpoint(pool, &ck));
  tide_stats at_ck = pool_stats(pool);

  /* Grow and merge: z goes, a large block maps new pages, then goes too. */
  tu_assert_ok(tide_capture_begin(a, s, pool));
  tu_assert_ok(tide_free(a, z, s));
  void *w = must_malloc(a, 9 * MiB, s);
  tu_assert_ok(tide_free(a, w, s));
  /* A segment of the small pool, newer; the request merges w's free block. */
  void *small = must_malloc(a, 4 * KiB, s);
  tu_assert_ok(tide_capture_end(a, s));
  tu_assert_ok(tide_pool_release(pool));
  assert_true(seg->mapped > mapped_at_ck);
  /* x, then one free block over what were y, z, the tail and the new pages. */
  assert_ptr_equal((void *)seg->first->addr, x);
  assert_int_equal(seg->first->next->state, _TIDE_FREE);
  assert_int_equal(seg->first->next->addr + seg->first->next->size, seg->base + seg->mapped);
  size_t grown = seg->mapped;
  tide_stats before = pool_stats(pool);

  tide_restore_delta d;
  tu_assert_ok(tide_pool_restore(pool, ck, &d));
  assert_int_equal(d.nrestored, 1);
  assert_ptr_equal(d.restored[0], z);
  assert_int_equal(d.nreleased, 1);
  assert_ptr_equal(d.released[0], small);
  tide_restore_delta_free(&d);
  check_all(a);
  /* The layout: x, free (y's place), z, free up to the grown end, unmapped. */
  const _tide_block *b = seg->first;
  assert_true(b->addr == (uintptr_t)x && b->state == _TIDE_ALLOCATED && b->size == third);
  b = b->next;
  assert_true(b->addr == (uintptr_t)y && b->state == _TIDE_FREE && b->size == third);
  b = b->next;
  assert_true(b->addr == (uintptr_t)z && b->state == _TIDE_ALLOCATED && b->size == third);
  b = b->next;
  assert_true(b->state == _TIDE_FREE && b->addr + b->size == seg->base + grown);
  b = b->next;
  assert_true(b->state == _TIDE_UNMAPPED && b->addr + b->size == seg->base + seg->size && !b->next);
  /* Exact stats: allocated as at the checkpoint; pages stay mapped. */
  tide_stats now = pool_stats(pool);
  assert_same_stats(&now, &at_ck);
  assert_int_equal(reserved(&now), reserved(&before));
  assert_int_equal(seg->mapped, grown);
  assert_true(now.inactive_split_bytes[2].current == (int64_t)(grown - 2 * third));
  tu_assert_pattern(x, third, 1, TU_PATTERN_DEFAULT);
  tu_assert_pattern(z, third, 3, TU_PATTERN_DEFAULT); /* its pages never went */
  /* It works on: allocate into the restored layout, free, merge. */
  tu_assert_ok(tide_capture_begin(a, s, pool));
  void *again = must_malloc(a, 4 * MiB, s);
  assert_int_equal(pool_holding(a, again), tide_pool_id(pool));
  tu_assert_ok(tide_free(a, again, s));
  tu_assert_ok(tide_free(a, z, s));
  tu_assert_ok(tide_free(a, x, s));
  tu_assert_ok(tide_capture_end(a, s));
  tu_assert_ok(tide_pool_release(pool));
  check_all(a);
  tide_checkpoint_free(ck);
  tu_assert_ok(tide_pool_release(pool));
  tu_assert_ok(tide_pool_release(pool));
  destroy_clean(a);
}

/* Fixed segments restore the same way. */
static void test_restore_fixed_segments(void **state) {
  (void)state;
  tide_allocator *a = make("expandable_segments:False");
  tide_stream s = new_stream(a);
  tide_pool *pool = NULL;
  tu_assert_ok(tide_pool_create(a, &pool));
  tu_assert_ok(tide_capture_begin(a, s, pool));
  void *x = must_malloc(a, 4 * MiB, s);
  void *y = must_malloc(a, 4 * MiB, s);
  tide_checkpoint *ck = NULL;
  tu_assert_ok(tide_pool_checkpoint(pool, &ck));
  tide_stats at_ck = pool_stats(pool);
  tu_assert_ok(tide_free(a, x, s));
  tu_assert_ok(tide_free(a, y, s));
  void *big = must_malloc(a, 30 * MiB, s); /* a new segment */
  void *mid = must_malloc(a, 6 * MiB, s);
  tu_assert_ok(tide_free(a, big, s));
  tu_assert_ok(tide_capture_end(a, s));
  tide_restore_delta d;
  tu_assert_ok(tide_pool_restore(pool, ck, &d));
  assert_int_equal(d.nrestored, 2);
  assert_true(listed(d.restored, 2, x) && listed(d.restored, 2, y));
  assert_int_equal(d.nreleased, 1);
  assert_ptr_equal(d.released[0], mid);
  tide_restore_delta_free(&d);
  tide_stats now = pool_stats(pool);
  assert_same_stats(&now, &at_ck);
  check_all(a);
  tu_assert_ok(tide_free(a, x, s));
  tu_assert_ok(tide_free(a, y, s));
  tide_checkpoint_free(ck);
  tu_assert_ok(tide_pool_release(pool));
  tu_assert_ok(tide_pool_release(pool));
  destroy_clean(a);
}

/* ------------------------------------------------------------------------ */
/* Faults                                                                    */
/* ------------------------------------------------------------------------ */

/* Every backend call of a growth in a capture, failed in turn: the call
 * fails with a message and changes nothing, the next one succeeds. */
static void test_faults_during_growth(void **state) {
  (void)state;
  tide_allocator *a = make(NULL);
  tide_stream s = new_stream(a);
  tide_pool *pool = NULL;
  tu_assert_ok(tide_pool_create(a, &pool));
  capture_begin(a, s, pool);
  void *first = must_malloc(a, 3 * MiB, s);
  tu_fill(first, 3 * MiB, 11, TU_PATTERN_DEFAULT);
  unsigned failed = 0;
  for (uint64_t n = 1; n < 64; n++) {
    tide_stats ps0 = pool_stats(pool);
    uint64_t held = tide_host_bytes_in_use(a);
    tu_assert_ok(tide_host_fail_call(a, TIDE_OP_ANY, n));
    void *p = tide_malloc(a, 7 * MiB, s);
    tu_assert_ok(tide_host_fail_call(a, TIDE_OP_ANY, 0));
    check_all(a);
    tu_assert_pattern(first, 3 * MiB, 11, TU_PATTERN_DEFAULT);
    if (!p) { /* changed nothing: the next try needs the same growth */
      failed++;
      assert_non_null(strstr(tide_last_error(), "injected failure"));
      tide_stats ps = pool_stats(pool);
      assert_int_equal(allocated(&ps), allocated(&ps0));
      assert_int_equal(reserved(&ps), reserved(&ps0));
      assert_int_equal(tide_host_bytes_in_use(a), held);
      continue;
    }
    assert_int_equal(pool_holding(a, p), tide_pool_id(pool));
    tu_assert_ok(tide_free(a, p, s));
    break; /* the fault came after the growth's last call */
  }
  assert_true(failed >= 4); /* the query, create, map and set_access at least */
  tide_stats st = tu_stats(a);
  assert_true(st.pages_mapped > 0);
  tu_assert_ok(tide_free(a, first, s));
  capture_end(a, s);
  tu_assert_ok(tide_pool_release(pool));
  tu_assert_ok(tide_pool_release(pool));
  destroy_clean(a);
}

/* A restore waits for frees of the pool's blocks on other streams; when that
 * fails (a held stream, an injected failure) nothing changes, and it
 * succeeds once the cause is gone. */
static void test_faults_during_restore(void **state) {
  (void)state;
  tide_allocator *a = make(NULL);
  tide_stream s = new_stream(a), t = new_stream(a);
  tide_pool *pool = NULL;
  tu_assert_ok(tide_pool_create(a, &pool));
  tu_assert_ok(tide_capture_begin(a, s, pool));
  void *x = must_malloc(a, 2 * MiB, s);
  void *y = must_malloc(a, 2 * MiB, s);
  tide_checkpoint *ck = NULL;
  tu_assert_ok(tide_pool_checkpoint(pool, &ck));
  tide_stats at_ck = pool_stats(pool);
  void *w = must_malloc(a, 5 * MiB, s);
  tu_assert_ok(tide_host_stream_hold(a, t));
  tu_assert_ok(tide_free(a, y, t)); /* waits for t's work */
  tu_assert_ok(tide_capture_end(a, s));
  tide_stats pending = pool_stats(pool);
  assert_true(pending.active_bytes[0].current > allocated(&pending));

  tide_restore_delta d = {.nrestored = 99};
  assert_int_equal(tide_pool_restore(pool, ck, &d), TIDE_ERR_NOT_READY);
  assert_int_equal(d.nrestored, 0);
  assert_non_null(strstr(tide_last_error(), "the pool is as it was"));
  tide_stats ps = pool_stats(pool);
  assert_same_stats(&ps, &pending);
  check_all(a);
  tu_assert_ok(tide_host_stream_release(a, t)); /* y's free can complete now */

  /* Each backend call of the restore failed in turn (waiting for y's free). */
  for (uint64_t n = 1;; n++) {
    tide_stats ps0 = pool_stats(pool);
    tu_assert_ok(tide_host_fail_call(a, TIDE_OP_ANY, n));
    tide_status rc = tide_pool_restore(pool, ck, &d);
    tu_assert_ok(tide_host_fail_call(a, TIDE_OP_ANY, 0));
    check_all(a);
    if (rc == TIDE_OK) {
      tide_restore_delta_free(&d);
      break;
    }
    assert_int_equal(rc, TIDE_ERR_BACKEND);
    assert_non_null(strstr(tide_last_error(), "injected failure"));
    tide_stats now = pool_stats(pool);
    assert_int_equal(allocated(&now), allocated(&ps0));
    assert_int_equal(now.allocations[0].current, ps0.allocations[0].current);
    assert_true(n < 8);
  }
  tide_stats now = pool_stats(pool);
  assert_same_stats(&now, &at_ck);
  assert_int_equal(tide_free(a, w, s), TIDE_ERR_DOUBLE_FREE);
  tu_assert_ok(tide_free(a, x, s));
  tu_assert_ok(tide_free(a, y, s)); /* allocated again by the restore */
  check_all(a);
  tide_checkpoint_free(ck);
  tu_assert_ok(tide_pool_release(pool));
  tu_assert_ok(tide_pool_release(pool));
  destroy_clean(a);
}

/* ------------------------------------------------------------------------ */
/* capture_detection and bad input                                           */
/* ------------------------------------------------------------------------ */

static void test_capture_detection(void **state) {
  (void)state;
  tide_allocator *a = make("capture_detection:True");
  tide_stream s = new_stream(a), t = new_stream(a);
  tu_assert_ok(tide_host_capture_begin(a, s)); /* nobody tells the allocator */
  void *p = must_malloc(a, 3 * MiB, s);
  void *g = must_malloc(a, 3 * MiB, t);
  tide_pool *pool = NULL;
  tu_assert_ok(tide_capture_pool(a, s, &pool));
  assert_true(tide_pool_id(pool) != 0);
  assert_int_equal(pool_holding(a, p), tide_pool_id(pool));
  assert_int_equal(pool_holding(a, g), 0);
  tu_assert_ok(tide_free(a, p, s));
  assert_ptr_equal(must_malloc(a, 3 * MiB, s), p); /* reused inside the capture */
  tu_assert_ok(tide_host_capture_end(a, s));
  void *after = must_malloc(a, 3 * MiB, s);
  assert_int_equal(pool_holding(a, after), 0);
  tu_assert_ok(tide_free(a, after, s));
  tu_assert_ok(tide_free(a, p, s));
  tu_assert_ok(tide_free(a, g, t));
  tu_assert_ok(tide_pool_release(pool)); /* the graph's, its only user */
  tide_stats st = tu_stats(a);
  check_all(a);
  tu_assert_ok(tide_empty_cache(a));
  st = tu_stats(a);
  assert_int_equal(reserved(&st), 0);
  destroy_clean(a);
}

/* With capture_detection, a free of `ptr` (of `size` bytes) on `by` while s
 * is being captured, unannounced, is the first call the capture makes: it
 * must be deferred (no event recorded, the block not handed out) and become
 * real after the capture. `other` is a stream never captured. */
static void expect_deferred(tide_allocator *a, tide_stream s, void *ptr, size_t size,
                            tide_stream by, tide_stream other) {
  assert_int_equal(atomic_load(&a->capture_watch), 0);
  uint64_t records = tide_host_call_count(a, TIDE_OP_EVENT_RECORD);
  tu_assert_ok(tide_host_capture_begin(a, s));
  tu_assert_ok(tide_free(a, ptr, by));
  assert_true(atomic_load(&a->capture_watch) > 0);
  assert_int_equal(tide_host_call_count(a, TIDE_OP_EVENT_RECORD), records);
  void *meanwhile = must_malloc(a, size, other);
  assert_true(meanwhile != ptr);
  check_all(a);
  tu_assert_ok(tide_host_capture_end(a, s));
  tu_assert_ok(tide_free(a, meanwhile, other)); /* makes the deferred free real */
  assert_int_equal(atomic_load(&a->capture_watch), 0);
}

/* capture_detection asks only the calling stream before its quick path:
 * frees that reach a capture before any allocation of it must still be
 * deferred — of the captured stream's own memory, of a block recorded on
 * it, of a block of a third stream recorded on it. */
static void test_detection_defers_first_frees(void **state) {
  (void)state;
  tide_allocator *a = make("capture_detection:True");
  tide_stream s = new_stream(a), t = new_stream(a), u = new_stream(a), w = new_stream(a);
  tu_assert_ok(tide_free(a, must_malloc(a, 4 * MiB, w), w)); /* ordinary: nothing watched */
  expect_deferred(a, s, must_malloc(a, MiB, s), MiB, s, w);
  void *h = must_malloc(a, 2 * MiB, t);
  tu_assert_ok(tide_record_stream(a, h, s));
  expect_deferred(a, s, h, 2 * MiB, t, w);
  void *k = must_malloc(a, 3 * MiB, u);
  tu_assert_ok(tide_record_stream(a, k, s));
  expect_deferred(a, s, k, 3 * MiB, t, w); /* freed on t: not t's block */
  check_all(a);
  destroy_clean(a);
}

/* Caches grown on stream s as a decoder grows its K and V caches by
 * concatenation: each step allocates the next, slightly larger, copies and
 * then frees the previous ones. Returns the unmappings it made. */
static uint64_t grow_caches(tide_allocator *a, tide_stream s) {
  enum { caches = 8, steps = 64 };
  void *old[caches] = {0};
  uint64_t before = tu_stats(a).unmappings;
  for (size_t step = 1; step <= steps; step++) {
    void *next[caches];
    for (int i = 0; i < caches; i++) next[i] = must_malloc(a, step * 256 * KiB, s);
    for (int i = 0; i < caches; i++) {
      if (old[i]) tu_assert_ok(tide_free(a, old[i], s));
      old[i] = next[i];
    }
  }
  uint64_t made = tu_stats(a).unmappings - before;
  for (int i = 0; i < caches; i++) tu_assert_ok(tide_free(a, old[i], s));
  return made;
}

/* The memory a capture pool holds counts against the memory limit like any
 * other (graphs replay into it): under a limit, the usual memory beside a
 * 64 MiB graph pool recycles its free pages and stays within the limit
 * with the pool, where without the pool and without a limit it recycles
 * nothing. */
static void test_pool_memory_counts_against_the_limit(void **state) {
  (void)state;
  tide_allocator *plain = make(NULL);
  assert_int_equal(grow_caches(plain, new_stream(plain)), 0);
  int64_t live_peak = tu_stats(plain).allocated_bytes[0].peak;
  destroy_clean(plain);

  char conf[64];
  int64_t limit = 64 * (int64_t)MiB + live_peak + live_peak / 10;
  snprintf(conf, sizeof conf, "memory_limit:%lld", (long long)limit);
  tide_allocator *a = make(conf);
  tide_stream s = new_stream(a), g = new_stream(a);
  tide_pool *pool = NULL;
  tu_assert_ok(tide_pool_create(a, &pool));
  capture_begin(a, g, pool); /* a graph whose 64 MiB of blocks its replays reuse */
  void *work = must_malloc(a, 64 * MiB, g);
  tu_assert_ok(tide_free(a, work, g));
  capture_end(a, g);
  tide_stats held = pool_stats(pool);
  assert_int_equal(reserved(&held), 64 * MiB);
  assert_true(grow_caches(a, s) > 0);
  assert_true(tu_stats(a).reserved_bytes[0].peak <= limit);
  check_all(a);
  tu_assert_ok(tide_pool_release(pool));
  tu_assert_ok(tide_pool_release(pool)); /* the graph's */
  destroy_clean(a);
}

static void test_bad_input(void **state) {
  (void)state;
  tide_allocator *a = make(NULL), *b = make(NULL);
  tide_stream s = new_stream(a);
  tide_pool *pool = NULL, *other = NULL;
  assert_int_equal(tide_pool_create(NULL, &pool), TIDE_ERR_INVALID);
  assert_int_equal(tide_pool_create(a, NULL), TIDE_ERR_INVALID);
  tu_assert_ok(tide_pool_create(a, &pool));
  tu_assert_ok(tide_pool_create(b, &other));
  assert_int_equal(tide_pool_id(NULL), 0);
  assert_int_equal(tide_pool_retain(NULL), TIDE_ERR_INVALID);
  assert_int_equal(tide_pool_release(NULL), TIDE_ERR_INVALID);
  assert_int_equal(tide_capture_begin(a, s, NULL), TIDE_ERR_INVALID);
  assert_int_equal(tide_capture_begin(a, s, other), TIDE_ERR_INVALID);
  assert_int_equal(tide_capture_end(a, s), TIDE_ERR_STATE);
  tide_checkpoint *ck = NULL, *ck_other = NULL;
  assert_int_equal(tide_pool_checkpoint(pool, NULL), TIDE_ERR_INVALID);
  tu_assert_ok(tide_pool_checkpoint(other, &ck_other));
  assert_int_equal(tide_pool_restore(pool, ck_other, NULL), TIDE_ERR_INVALID);
  assert_int_equal(tide_pool_restore(pool, NULL, NULL), TIDE_ERR_INVALID);

  capture_begin(a, s, pool);
  assert_int_equal(tide_capture_begin(a, s, pool), TIDE_ERR_STATE);
  void *p = must_malloc(a, MiB, s);
  tu_assert_ok(tide_pool_checkpoint(pool, &ck));
  tu_assert_ok(tide_pool_release(pool));                     /* ours, during the capture */
  assert_int_equal(tide_pool_release(pool), TIDE_ERR_STATE); /* only the capture's is left */
  assert_int_equal(tide_pool_restore(pool, ck, NULL), TIDE_ERR_STATE);
  capture_end(a, s);
  tu_assert_ok(tide_pool_restore(pool, ck, NULL));
  /* A free of a pool's block deferred by a capture (it needs an event on a
   * stream being captured) blocks a restore until the capture ends. */
  tide_stream t = new_stream(a);
  tide_pool *pool2 = NULL;
  tu_assert_ok(tide_pool_create(a, &pool2));
  capture_begin(a, t, pool2);
  tu_assert_ok(tide_free(a, p, t));
  assert_int_equal(tide_pool_restore(pool, ck, NULL), TIDE_ERR_STATE);
  assert_non_null(strstr(tide_last_error(), "capture"));
  capture_end(a, t);
  tu_assert_ok(tide_pool_restore(pool, ck, NULL)); /* p allocated again */
  tu_assert_ok(tide_free(a, p, s));
  tu_assert_ok(tide_pool_release(pool2));
  tu_assert_ok(tide_pool_release(pool2));
  tide_checkpoint_free(ck);
  tide_checkpoint_free(ck_other);
  tide_checkpoint_free(NULL);
  tide_restore_delta_free(NULL);
  tu_assert_ok(tide_pool_release(pool)); /* the graph's, the last */
  tu_assert_ok(tide_pool_release(other));
  destroy_clean(a);
  destroy_clean(b);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_capture_goes_to_pool),
      cmocka_unit_test(test_no_capture_no_query),
      cmocka_unit_test(test_free_and_reuse_in_capture),
      cmocka_unit_test(test_precapture_free_deferred),
      cmocka_unit_test(test_emulated_capture),
      cmocka_unit_test(test_two_graphs_share_a_pool),
      cmocka_unit_test(test_release_with_live_block),
      cmocka_unit_test(test_release_waits_for_replays),
      cmocka_unit_test(test_output_outlives_pool),
      cmocka_unit_test(test_release_during_another_capture),
      cmocka_unit_test(test_next_pool_starts_from_zero),
      cmocka_unit_test(test_stream_destroy_keeps_pool),
      cmocka_unit_test(test_pool_grows_during_and_between_captures),
      cmocka_unit_test(test_checkpoint_restore),
      cmocka_unit_test(test_restore_grown_and_merged),
      cmocka_unit_test(test_restore_fixed_segments),
      cmocka_unit_test(test_faults_during_growth),
      cmocka_unit_test(test_faults_during_restore),
      cmocka_unit_test(test_capture_detection),
      cmocka_unit_test(test_detection_defers_first_frees),
      cmocka_unit_test(test_pool_memory_counts_against_the_limit),
      cmocka_unit_test(test_bad_input),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
