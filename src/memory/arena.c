/* arena.c: the blocks of one stream — allocation by best fit with
 * splitting, freeing with merging, and stream-ordered reuse.
 *
 * Each stream has its own arena behind its own lock, so threads working on
 * different streams never wait for each other. A block freed on its own
 * stream is reusable at once (later work on that stream runs after the work
 * that used it); a block also used on other streams waits in the pending
 * list until events recorded on those streams complete.
 *
 * Below it: segment.c grows and releases the segments' memory,
 * stream_events.c says how far the stream has run, bins.c and ptrmap.c
 * hold the free and the live blocks. Above it, arena_table.c finds an
 * arena; nothing below calls back into this file. */
#include <stdlib.h>
#include <string.h>

#include "memory/quick.h"

/* ------------------------------------------------------------------------ */
/* Life of an arena                                                          */
/* ------------------------------------------------------------------------ */

int _tide_arena_create(struct tide_allocator *a, tide_stream stream, _tide_arena **out) {
  _tide_arena *arena = calloc(1, sizeof *arena);
  if (!arena) return _tide_error_set(TIDE_ERR_OOM, "out of host memory for a stream's arena");
  int rc = _tide_ptrmap_init(&arena->live);
  if (rc) {
    free(arena);
    return rc;
  }
  _tide_lock_init(&arena->lock);
  arena->stream = stream;
  arena->alloc = a;
  arena->pools[_TIDE_SMALL].kind = _TIDE_SMALL;
  arena->pools[_TIDE_LARGE].kind = _TIDE_LARGE;
  *out = arena;
  return TIDE_OK;
}

size_t _tide_arena_destroy(_tide_arena *arena, _tide_first_error *first) {
  const _tide_backend *be = &arena->alloc->backend;
  size_t unfreed = arena->live.count - arena->nquick;
  for (size_t i = 0; i < arena->npending; i++) {
    be->ops->event_destroy(be->ctx, arena->pending[i].event);
    if (--arena->pending[i].block->events == 0) unfreed++;
  }
  for (size_t i = 0; i < arena->nspare_events; i++)
    be->ops->event_destroy(be->ctx, arena->spare_events[i]);
  for (unsigned i = 0; i < arena->nidle_marks; i++)
    be->ops->event_destroy(be->ctx, arena->idle_marks[i].event);
  _tide_stale_drop_all(arena); /* before the pages' handles go with their segments */
  _tide_first_error_note(first, _tide_pool_teardown(arena, &arena->pools[_TIDE_SMALL]));
  _tide_first_error_note(first, _tide_pool_teardown(arena, &arena->pools[_TIDE_LARGE]));
  _tide_arena_release_spare_pages(arena);
  _tide_first_error_note(first, _tide_arena_retry_orphans(arena));
  if (arena->orphans_lost)
    _tide_first_error_note(first, _tide_error_set(TIDE_ERR_BACKEND,
                                                  "%zu piece(s) of memory the device backend "
                                                  "refused to give back could not be recorded "
                                                  "(out of host memory) and stay held",
                                                  arena->orphans_lost));
  _tide_blocks_free_all(arena);
  _tide_ptrmap_destroy(&arena->live);
  free(arena->pending);
  free(arena->spare_events);
  free(arena->orphans);
  free(arena->spare_pages);
  free(arena->stale);
  free(arena);
  return unfreed;
}

/* ------------------------------------------------------------------------ */
/* The allocator-wide allocated bytes                                        */
/* ------------------------------------------------------------------------ */

void _tide_arena_publish(_tide_arena *arena, int64_t delta) {
  arena->unpublished += delta;
  if (arena->unpublished < _TIDE_PUBLISH_BYTES && arena->unpublished > -_TIDE_PUBLISH_BYTES) return;
  _tide_arena_publish_now(arena);
}

void _tide_arena_publish_now(_tide_arena *arena) {
  _tide_global_add(&arena->alloc->allocated, arena->unpublished);
  arena->unpublished = 0;
}

/* ------------------------------------------------------------------------ */
/* Allocation                                                                */
/* ------------------------------------------------------------------------ */

/* PyTorch's limits on oversize blocks (those of at least max_split_size):
 * never hand one to a smaller request, nor one much larger than asked. */
static bool oversize_refused(const struct tide_allocator *a, size_t block, size_t rounded) {
  size_t max_split = a->conf.max_split_size;
  if (rounded < max_split) return block >= max_split;
  return block >= rounded + TIDE_LARGE_BUFFER;
}

static bool should_split(const struct tide_allocator *a, const _tide_block *b, size_t rounded) {
  size_t remaining = b->size - rounded;
  if (b->segment->pool == _TIDE_SMALL || b->segment->expandable) return remaining >= TIDE_MIN_BLOCK;
  return rounded < a->conf.max_split_size && remaining > TIDE_SMALL_SIZE;
}

/* Cut `rounded` bytes off the front of b; the rest goes back to the bins.
 * Without a record for the rest, b is handed out whole. */
static void split(_tide_arena *arena, _tide_block *b, size_t rounded) {
  _tide_block *rest = _tide_block_new(arena);
  if (!rest) return;
  rest->addr = b->addr + rounded;
  rest->size = b->size - rounded;
  rest->segment = b->segment;
  rest->state = _TIDE_FREE;
  rest->stamp = b->stamp;
  rest->prev = b;
  rest->next = b->next;
  if (b->next) b->next->prev = rest;
  b->next = rest;
  b->size = rounded;
  _tide_pool_insert(arena, rest);
}

/* Give the front `head` bytes of free block b back to the bins, keeping the
 * rest in b. Without a record, b stays whole. */
static bool split_head(_tide_arena *arena, _tide_block *b, size_t head) {
  _tide_block *front = _tide_block_new(arena);
  if (!front) return false;
  front->addr = b->addr;
  front->size = head;
  front->segment = b->segment;
  front->state = _TIDE_FREE;
  front->stamp = b->stamp;
  front->prev = b->prev;
  front->next = b;
  if (b->prev)
    b->prev->next = front;
  else
    b->segment->first = front;
  b->prev = front;
  b->addr += head;
  b->size -= head;
  _tide_pool_insert(arena, front);
  return true;
}

/* Placement inside a free block of an expandable segment, judged by pages.
 * A block costs the pages only it keeps mapped ("lone": a page it shares
 * with a live neighbour is paid for already); among places of equal cost,
 * the one touching the fewest pages wins, so that when a neighbour dies its
 * pages can go (a multi-page block flush against a short-lived neighbour
 * would otherwise hold a partial page at each end); then the front. */
typedef struct placement_cost {
  size_t lone, touched;
} placement_cost;

static placement_cost cost_at(uintptr_t x, size_t size, uintptr_t base, size_t page,
                              size_t left_page, size_t right_page) {
  size_t first = (x - base) / page, last = (x + size - 1 - base) / page;
  placement_cost c = {last - first + 1, last - first + 1};
  if (left_page >= first && left_page <= last) c.lone--;
  if (right_page >= first && right_page <= last && right_page != left_page) c.lone--;
  return c;
}

static inline bool holds_live(const _tide_block *b) {
  return b && b->state != _TIDE_FREE && b->state != _TIDE_UNMAPPED;
}

static inline uintptr_t page_up(uintptr_t x, uintptr_t base, size_t page) {
  return base + (x - base + page - 1) / page * page;
}

static inline uintptr_t page_down(uintptr_t x, uintptr_t base, size_t page) {
  return base + (x - base) / page * page;
}

/* The address for `size` bytes in free block f: flush against either end,
 * or starting or ending on a page boundary near either end. */
static uintptr_t best_offset(const _tide_block *f, size_t size, size_t page) {
  uintptr_t base = f->segment->base, lo = f->addr, end = f->addr + f->size, hi = end - size;
  size_t left_page = holds_live(f->prev) ? (lo - 1 - base) / page : SIZE_MAX;
  size_t right_page = holds_live(f->next) ? (end - base) / page : SIZE_MAX;
  const uintptr_t candidates[] = {
      page_up(lo, base, page),   page_up(lo + size, base, page) - size, hi,
      page_down(hi, base, page), page_down(end, base, page) - size,
  };
  uintptr_t best = lo;
  placement_cost bc = cost_at(lo, size, base, page, left_page, right_page);
  for (size_t i = 0; i < sizeof candidates / sizeof *candidates; i++) {
    uintptr_t x = candidates[i];
    if (x < lo || x > hi) continue;
    placement_cost c = cost_at(x, size, base, page, left_page, right_page);
    if (c.lone < bc.lone || (c.lone == bc.lone && c.touched < bc.touched)) {
      best = x;
      bc = c;
    }
  }
  return best;
}

/* Hand out `rounded` bytes of free block b, the rest going back to the
 * bins. When free pages are recycled (release_holes), blocks of a handle
 * or more in expandable segments go where they keep the fewest pages
 * mapped: that bets on pages being unmapped as neighbours die, which only
 * recycling does. Blocks below a handle pack from the front, where they
 * share pages best. That includes the large pool's blocks of 1-2 MiB: put
 * on a page of their own, each would strand the rest of the page behind
 * its neighbour, a gap below 1 MiB that no large request fits (a KV cache
 * of 24 layers crossing 1 MiB held 24 pages for 12 pages of data). */
static void place(_tide_arena *arena, _tide_block *b, size_t rounded) {
  size_t unit = arena->alloc->page_size * b->segment->handle_pages;
  if (b->segment->expandable && b->segment->pool == _TIDE_LARGE && rounded >= unit &&
      arena->alloc->conf.release_holes) {
    uintptr_t x = best_offset(b, rounded, unit);
    if (x > b->addr && !split_head(arena, b, x - b->addr)) return;
  }
  if (b->size - rounded >= TIDE_MIN_BLOCK) split(arena, b, rounded);
}

static void maybe_collect_garbage(_tide_arena *arena) {
  struct tide_allocator *a = arena->alloc;
  double threshold = a->conf.gc_threshold;
  if (TIDE_LIKELY(threshold <= 0.0)) return;
  size_t target = (size_t)(threshold * (double)atomic_load(&a->limit));
  if ((size_t)atomic_load_explicit(&a->reserved.cur, memory_order_relaxed) > target)
    _tide_arena_collect_garbage(arena, target);
}

/* ------------------------------------------------------------------------ */
/* Quick blocks (quick.h has the hits)                                       */
/* ------------------------------------------------------------------------ */

/* What the quick blocks add to the raw stats (quick.h). */
typedef struct quick_tally {
  int64_t bytes[TIDE_POOL_KINDS], requested[TIDE_POOL_KINDS], blocks[TIDE_POOL_KINDS];
  uint64_t oversize;
} quick_tally;

static void tally_quick(const _tide_arena *arena, quick_tally *t) {
  memset(t, 0, sizeof *t);
  for (unsigned i = 0; i < arena->nquick; i++) {
    const _tide_block *b = arena->quick[i];
    int pool = b->segment->pool + 1;
    t->bytes[0] += (int64_t)b->size;
    t->bytes[pool] += (int64_t)b->size;
    t->requested[0] += (int64_t)b->requested;
    t->requested[pool] += (int64_t)b->requested;
    t->blocks[0]++;
    t->blocks[pool]++;
    t->oversize += b->size >= arena->alloc->conf.max_split_size;
  }
}

void _tide_arena_stats_read(const _tide_arena *arena, _tide_arena_stats *out) {
  quick_tally t;
  tally_quick(arena, &t);
  *out = arena->stats;
  for (int p = 0; p < TIDE_POOL_KINDS; p++) {
    out->cur[_TIDE_ST_ALLOCATED][p] -= t.bytes[p];
    out->cur[_TIDE_ST_REQUESTED][p] -= t.requested[p];
    out->cur[_TIDE_ST_ALLOCATIONS][p] -= t.blocks[p];
  }
  out->counters[_TIDE_CT_OVERSIZE] -= t.oversize;
}

void _tide_arena_track_active(_tide_arena *arena) {
  quick_tally t;
  tally_quick(arena, &t);
  _tide_arena_stats *s = &arena->stats;
  for (int p = 0; p < TIDE_POOL_KINDS; p++) {
    int64_t bytes = s->cur[_TIDE_ST_ALLOCATED][p] - t.bytes[p] + s->cur[_TIDE_ST_PENDING][p];
    int64_t blocks =
        s->cur[_TIDE_ST_ALLOCATIONS][p] - t.blocks[p] + s->cur[_TIDE_ST_PENDING_BLOCKS][p];
    if (bytes > s->active_peak[0][p]) s->active_peak[0][p] = bytes;
    if (blocks > s->active_peak[1][p]) s->active_peak[1][p] = blocks;
  }
}

/* A quick block becomes an ordinary free block: out of the live map and of
 * the raw stats, merged. */
static void unquick(_tide_arena *arena, _tide_block *b) {
  _tide_count_raw(arena, b, -1);
  _tide_count_cached(arena, b, -1);
  _tide_ptrmap_remove(&arena->live, b->addr);
  _tide_arena_free_block(arena, b);
}

void _tide_arena_flush_quick(_tide_arena *arena) {
  while (arena->nquick) {
    _tide_block *b = arena->quick[0];
    _tide_quick_remove(arena, 0);
    unquick(arena, b);
  }
}

/* Keep a block just freed on its own stream for reuse as it is; the oldest
 * quick block makes room by going to the bins. */
static void put_quick(_tide_arena *arena, _tide_block *b) {
  if (arena->nquick == _TIDE_QUICK_SLOTS) {
    _tide_block *oldest = arena->quick[0];
    _tide_quick_remove(arena, 0);
    unquick(arena, oldest);
  }
  _tide_quick_put(arena, b);
}

static bool releasable(const _tide_block *b, size_t page);
static int by_stamp(const void *x, const void *y);

/* Bytes that growth by `rounded` bytes would map. */
static size_t growth_bytes(const _tide_arena *arena, _tide_pool *pool, size_t rounded, size_t page,
                           _tide_growth *g) {
  if (_tide_pool_plan_growth(arena, pool, rounded, page, g) == TIDE_OK) return g->count * page;
  return (rounded + page - 1) / page * page;
}

/* The release policy: memory by pressure (docs/design.md, "Memory by
 * pressure"). Free pages stay mapped until growth would pass the memory
 * limit, or take the device's free memory below its low-water mark; below
 * both, nothing is unmapped and no stream is waited for. A page unmapped
 * without need would likely be mapped again, and each remap costs driver
 * calls the program waits for; memory nobody asks for costs nothing to
 * keep. Under pressure, growth first recycles the cache's free pages, and
 * the allocator gives pages back when the device runs low for others. */

/* Bytes growth may add before the allocator is under pressure (negative
 * when already past): the room below the memory limit, and the device's
 * free memory above its low-water mark (asked of the device near the mark). */
static int64_t growth_headroom(const _tide_arena *arena) {
  struct tide_allocator *a = arena->alloc;
  int64_t reserved = atomic_load_explicit(&a->reserved.cur, memory_order_relaxed);
  int64_t room = (int64_t)atomic_load_explicit(&a->limit, memory_order_relaxed) - reserved;
  int64_t device_room;
  if (_tide_device_room(a, &device_room) && device_room < room) room = device_room;
  return room;
}

/* Unmap free pages of the candidates (oldest first) until `need` bytes are
 * released. A handle is unmapped whole, so a candidate asked for less than
 * one of its handles gives one: room would otherwise never be made where
 * handles are larger than the request. Returns the bytes. */
static size_t release_candidates(_tide_arena *arena, _tide_block **candidates, size_t n,
                                 size_t need) {
  struct tide_allocator *a = arena->alloc;
  size_t released = 0;
  for (size_t i = 0; i < n && released < need; i++) {
    size_t before = arena->nspare_pages, limit = need - released;
    size_t handle = a->page_size * candidates[i]->segment->handle_pages;
    if (limit < handle) limit = handle;
    int64_t held = atomic_load(&a->reserved.cur);
    if (_tide_release_block(arena, candidates[i], limit)) break;
    for (size_t k = before; k < arena->nspare_pages; k++) released += arena->spare_pages[k].size;
    released += (size_t)(held - atomic_load(&a->reserved.cur));
  }
  return released;
}

/* Release at once (unmapping now) up to `need` bytes of the candidates,
 * oldest first. The oldest may be idle already, freed before an idle mark
 * that the stream has passed: those go without waiting; only if they are
 * not enough is the stream waited for, as far as the next candidate's free
 * (an idle mark after it) where marks are `usable`, else whole. A growable
 * buffer's worker makes room this way while the program keeps launching
 * work: a synchronization would stall it for the queue. */
static void release_now(_tide_arena *arena, _tide_block **candidates, size_t n, size_t need,
                        bool marks) {
  size_t idle = 0, released = 0;
  if (marks) _tide_idle_marks_poll(arena);
  while (idle < n && candidates[idle]->stamp < arena->idle_before) idle++;
  if (idle) released = release_candidates(arena, candidates, idle, need);
  for (size_t i = idle; i < n && released < need; i++) {
    if (candidates[i]->stamp >= arena->idle_before) {
      int rc = marks ? _tide_idle_wait(arena, candidates[i]->stamp) : _tide_stream_settle(arena);
      if (rc != TIDE_OK) return;
    }
    released += release_candidates(arena, candidates + i, 1, need - released);
  }
}

/* The pages per handle of the segment growth `g` maps into; 0 when the
 * growth makes a new segment (not known yet). Read before any release: a
 * release may merge the growth's unmapped block into another. */
static unsigned growth_handle_pages(const _tide_growth *g) {
  return g->unmapped ? g->unmapped->segment->handle_pages : 0;
}

/* Release up to `need` bytes of the candidates for a segment's growth,
 * oldest first, waiting for the stream as little as it can. Pages whose
 * handles the growth maps again stay mapped at their old address until the
 * stream is past them (deferred): stream order keeps their old readers
 * first, and nothing waits. Any other page would stay reserved there beside
 * the growth's new handles, so it is unmapped at once, which needs the work
 * queued before its free to be done. Those idle already go in the first
 * pass; only if the first pass is not enough does the second wait for the
 * busy ones (_tide_idle_wait: as far as an idle mark after the free; if a
 * wait fails, such pages stay cached). A load handle (load_handles), which
 * no growth maps again, is deferred too: it stays reserved at its old
 * address until the stream is past it, once for each load handle. */
static void release_deferred(_tide_arena *arena, _tide_block **candidates, size_t n, size_t need,
                             unsigned handle_pages) {
  _tide_idle_marks_poll(arena);
  size_t released = 0;
  bool cannot_wait = false;
  for (int pass = 0; pass < 2; pass++) {
    for (size_t i = 0; i < n && released < need; i++) {
      _tide_block *b = candidates[i];
      if (!b) continue; /* released in the first pass */
      bool deferred = b->segment->handle_pages == handle_pages;
      bool busy = !deferred && b->stamp >= arena->idle_before;
      if (busy &&
          (pass == 0 || cannot_wait || (cannot_wait = _tide_idle_wait(arena, b->stamp) != TIDE_OK)))
        continue; /* it stays cached */
      candidates[i] = NULL;
      arena->defer_unmap = deferred;
      released += release_candidates(arena, &b, 1, need - released);
      arena->defer_unmap = false;
    }
  }
}

/* Whether growth `g` extends free block b: the pages it maps join b, on the
 * side of the unmapped block where they start or end. A free block at the
 * other end of a large hole is not extended and may be released. */
static bool next_to_growth(const _tide_block *b, const _tide_growth *g, size_t page) {
  const _tide_block *u = g->unmapped;
  if (!u) return false;
  uintptr_t lo = u->segment->base + g->first * page, hi = lo + g->count * page;
  return (b == u->prev && lo == u->addr) || (b == u->next && hi == u->addr + u->size);
}

/* Before growth of `need` bytes would put the allocator under pressure,
 * unmap just as many free pages inside the segments (oldest first) as keep
 * it out of it, so that growth reuses physical memory instead of adding to
 * it. A handle is unmapped whole, so a candidate gives at least one, even
 * where that is more than asked: the rest is reused by the next growth.
 * The free blocks the growth extends are left alone. `for_segment`: the
 * room is for a segment's growth, which maps the handles again (unmapping
 * may be deferred); otherwise for memory outside the segments (growable
 * buffers), released at once. */
static void release_for(_tide_arena *arena, size_t need, const _tide_growth *growth,
                        bool for_segment) {
  struct tide_allocator *a = arena->alloc;
  const _tide_growth g = *growth;
  if (arena->nstale) _tide_stale_settle(arena, 0, UINTPTR_MAX, false);
  int64_t headroom = growth_headroom(arena);
  if (headroom >= (int64_t)need) return;
  /* Past the limit or the low-water mark already (a limit lowered, or
   * another process's growth), the shortfall includes what brings it back. */
  need = (size_t)(((int64_t)need - headroom + (int64_t)a->page_size - 1) / (int64_t)a->page_size) *
         a->page_size;
  size_t cap = arena->pools[0].bins.count + arena->pools[1].bins.count, n = 0;
  if (!cap) return;
  _tide_block **candidates = malloc(cap * sizeof *candidates);
  if (!candidates) return;
  /* Free blocks come from the bins: walking every block of the segments
   * would cost as much as the program has live blocks, at every growth. */
  for (int kind = 0; kind < 2; kind++) {
    size_t end = n + _tide_bins_collect(&arena->pools[kind].bins, candidates + n, cap - n);
    for (size_t i = n; i < end; i++) {
      _tide_block *b = candidates[i];
      if (b->segment->expandable && !next_to_growth(b, &g, a->page_size) &&
          releasable(b, a->page_size))
        candidates[n++] = b; /* keep: n <= i, so the list compacts in place */
    }
  }
  if (n) {
    qsort(candidates, n, sizeof *candidates, by_stamp);
    /* The unmapped pages' handles are mapped again by the growth that
     * follows: no release, no create. Pages no queued work can touch go
     * first, without waiting for the stream; only if they are not enough
     * does the stream get synchronized (after which every free block is
     * idle). */
    arena->keep_spare_pages = true;
    bool marks = _tide_idle_marks_usable(arena); /* under capture_detection, a driver query */
    if (for_segment && marks && arena->pool_id == 0) {
      /* Pages are taken out of their segment at once but stay mapped at
       * their old address until the stream is past the work queued before
       * their free: growth maps their handles again meanwhile, stream
       * order keeping the old readers first, and nothing waits. Only
       * handles of the growth's size can be mapped again; any other stays
       * reserved at its old address until then, beside the growth's new
       * ones, so those are released at once. */
      release_deferred(arena, candidates, n, need, growth_handle_pages(&g));
    } else {
      release_now(arena, candidates, n, need, marks);
    }
    arena->keep_spare_pages = false;
    _tide_idle_mark_add(arena, marks);
  }
  free(candidates);
}

static void release_holes(_tide_arena *arena, _tide_pool *pool, size_t rounded) {
  _tide_growth g;
  size_t need = growth_bytes(arena, pool, rounded, arena->alloc->page_size, &g);
  release_for(arena, need, &g, true);
}

void _tide_arena_make_room(_tide_arena *arena, size_t bytes) {
  const struct tide_allocator *a = arena->alloc;
  if (!a->conf.release_holes || !a->conf.expandable_segments) return;
  const _tide_growth none = {0};
  /* The blocks freed last wait whole for a request of their size (quick
   * reuse), outside the bins where room is looked for. */
  _tide_arena_flush_quick(arena);
  /* Not deferred: the pages' handles are not mapped again here, so only
   * unmapping them now makes room. */
  release_for(arena, bytes, &none, false);
  /* The pages' handles are not mapped again by a segment: give them back. */
  if (arena->nspare_pages) _tide_arena_release_spare_pages(arena);
}

/* Now and then (_TIDE_DEVICE_CHECK_EVERY), ask the device how much it has
 * free. When others (another process, another allocator) took more since
 * the last check and the device is below its low-water mark, give back
 * cached pages, as many again as the mark above it, so that their growth
 * finds room. Not when this allocator's own growth took the device low:
 * its growth recycles its cache by itself, and giving it back would only
 * have it mapped again. A countdown otherwise. */
static void yield_to_device(_tide_arena *arena) {
  struct tide_allocator *a = arena->alloc;
  if (TIDE_LIKELY(arena->device_check_countdown-- > 0)) return;
  arena->device_check_countdown = _TIDE_DEVICE_CHECK_EVERY - 1;
  size_t free_bytes;
  if (!_tide_device_free(a, &free_bytes)) return;
  int64_t others = _tide_others_hold(a, free_bytes);
  bool others_grew = others > arena->others_held;
  arena->others_held = others;
  if (others_grew && free_bytes < _tide_low_water(a))
    _tide_arena_make_room(arena, _tide_low_water(a));
}

/* A free block of at least `rounded` bytes from the bins, or from new
 * memory when nothing fits. Not in a bin. */
static int take_best_fit(_tide_arena *arena, size_t rounded, _tide_block **out) {
  struct tide_allocator *a = arena->alloc;
  _tide_pool *pool = &arena->pools[rounded <= TIDE_SMALL_SIZE ? _TIDE_SMALL : _TIDE_LARGE];
  /* Quick blocks merge first, so the choice is the best fit over all free
   * memory, as if they had been merged when freed. */
  _tide_arena_flush_quick(arena);
  if (!arena->keep_cache && a->conf.release_holes && a->conf.expandable_segments)
    yield_to_device(arena);
  _tide_block *b = _tide_bins_best_fit(&pool->bins, rounded);
  if (b && TIDE_UNLIKELY(a->conf.max_split_size != SIZE_MAX) &&
      oversize_refused(a, b->size, rounded))
    b = NULL;
  if (b) {
    _tide_pool_remove(arena, b);
    *out = b;
    return TIDE_OK;
  }
  /* A capture pool's free pages may be written by graph replays: only growth. */
  if (!arena->keep_cache) {
    maybe_collect_garbage(arena);
    if (a->conf.release_holes && a->conf.expandable_segments) release_holes(arena, pool, rounded);
  }
  int rc = _tide_pool_grow(arena, pool, rounded, out);
  if (TIDE_UNLIKELY(arena->nspare_pages)) _tide_arena_release_spare_pages(arena);
  return rc;
}

int _tide_arena_malloc(_tide_arena *arena, size_t size, size_t rounded, void **out) {
  struct tide_allocator *a = arena->alloc;
  /* A destroyed stream takes no allocation (its cache could never be given
   * back: there is nothing to wait for), unless its handle names a live
   * stream again (the driver may reuse it for a new stream). */
  if (TIDE_UNLIKELY(arena->stream_gone)) {
    const _tide_backend *be = &a->backend;
    if (be->ops->stream_check && be->ops->stream_check(be->ctx, arena->stream))
      return _tide_error_set(TIDE_ERR_INVALID,
                             "stream %p was destroyed (tide_stream_destroy): nothing can be "
                             "allocated on it",
                             (void *)arena->stream);
    arena->stream_gone = false;
  }
  if (TIDE_UNLIKELY(arena->npending)) _tide_arena_process_events(arena, false);
  _tide_block *b = _tide_quick_take(arena, rounded);
  if (TIDE_LIKELY(b != NULL)) {
    if (!_tide_quick_take_keeps_raw(arena, b, size)) _tide_arena_flush_quick(arena);
    _tide_arena_hand_back(arena, b, size);
    _tide_count_active(arena);
    _tide_hit_extras(arena, b, true, arena->stream);
    *out = (void *)b->addr;
    return TIDE_OK;
  }
  if (_tide_ptrmap_reserve_one(&arena->live) != TIDE_OK) return TIDE_ERR_OOM;
  int rc = take_best_fit(arena, rounded, &b);
  if (rc) return rc;
  if (should_split(a, b, rounded)) place(arena, b, rounded);
  _tide_ptrmap_put(&arena->live, b); /* room reserved above, at b's final address */
  b->state = _TIDE_ALLOCATED;
  b->requested = size;
  _tide_count_allocation(arena, b);
  arena->clock++;
  _tide_trace(a, TIDE_TRACE_ALLOC, b->segment->pool + 1, b->addr, b->size, arena->stream);
  *out = (void *)b->addr;
  return TIDE_OK;
}

/* ------------------------------------------------------------------------ */
/* Freeing                                                                   */
/* ------------------------------------------------------------------------ */

void _tide_arena_free_block(_tide_arena *arena, _tide_block *b) {
  arena->freed_any = true;
  b->state = _TIDE_FREE;
  b->stamp = arena->clock;
  _tide_block *p = b->prev, *n = b->next;
  if (p && p->state == _TIDE_FREE) {
    _tide_pool_remove(arena, p);
    p->size += b->size;
    p->next = n;
    if (n) n->prev = p;
    _tide_block_newest_stamp(p, b);
    _tide_block_delete(arena, b);
    b = p;
  }
  if (n && n->state == _TIDE_FREE) {
    _tide_pool_remove(arena, n);
    b->size += n->size;
    b->next = n->next;
    if (n->next) n->next->prev = b;
    _tide_block_newest_stamp(b, n);
    _tide_block_delete(arena, n);
  }
  _tide_pool_insert(arena, b);
}

static tide_stream recorded_stream(const _tide_block *b, unsigned i) {
  return i < _TIDE_INLINE_STREAMS ? b->streams[i] : b->more_streams[i - _TIDE_INLINE_STREAMS];
}

/* Order the free after `s` without an event: wait for it, or, when it no
 * longer exists, for the default stream (its queued work came before). */
static int wait_instead(_tide_arena *arena, tide_stream s) {
  const _tide_backend *be = &arena->alloc->backend;
  _tide_note_stream_wait(arena->alloc);
  if (be->ops->stream_synchronize(be->ctx, s) == TIDE_OK) return TIDE_OK;
  if (tide_last_status() != TIDE_ERR_INVALID) return tide_last_status();
  return be->ops->stream_synchronize(be->ctx, NULL);
}

/* Record an event on each stream other than the arena's that used b, so
 * that b is reused only after them; a stream that cannot take an event is
 * waited for instead. All or nothing. */
static int record_events(_tide_arena *arena, _tide_block *b, tide_stream freed_on) {
  const _tide_backend *be = &arena->alloc->backend;
  unsigned want = b->nstreams + 1u;
  if (arena->npending + want > arena->pending_cap) {
    size_t cap = (arena->pending_cap + want) * 2;
    _tide_pending *grown = realloc(arena->pending, cap * sizeof *grown);
    if (!grown) return _tide_error_set(TIDE_ERR_OOM, "out of host memory for stream events");
    arena->pending = grown;
    arena->pending_cap = cap;
  }
  size_t start = arena->npending;
  int rc = TIDE_OK;
  for (unsigned i = 0; i <= b->nstreams && !rc; i++) {
    tide_stream s = i < b->nstreams ? recorded_stream(b, i) : freed_on;
    if (s == arena->stream) continue;
    bool seen = false;
    for (size_t j = start; j < arena->npending; j++) seen |= arena->pending[j].stream == s;
    if (seen) continue;
    _tide_event e;
    if ((rc = _tide_event_take(arena, &e))) {
      rc = wait_instead(arena, s);
      continue;
    }
    if ((rc = be->ops->event_record(be->ctx, e, s))) {
      _tide_event_give(arena, e);
      rc = wait_instead(arena, s);
      continue;
    }
    arena->pending[arena->npending++] = (_tide_pending){.event = e, .block = b, .stream = s};
  }
  if (rc) {
    for (size_t j = start; j < arena->npending; j++)
      _tide_event_give(arena, arena->pending[j].event);
    arena->npending = start;
    return rc;
  }
  b->events = (uint16_t)(arena->npending - start);
  return TIDE_OK;
}

static void forget_streams(_tide_block *b) {
  free(b->more_streams);
  b->more_streams = NULL;
  b->more_cap = 0;
  b->nstreams = 0;
}

static void count_pending(_tide_arena *arena, const _tide_block *b, int sign) {
  _tide_arena_stats *s = &arena->stats;
  int kind = b->segment->pool;
  if (sign > 0) {
    _tide_stat_up(s, _TIDE_ST_PENDING, kind, (int64_t)b->size);
    _tide_stat_up(s, _TIDE_ST_PENDING_BLOCKS, kind, 1);
    _tide_count_active(arena);
  } else {
    _tide_stat_down(s, _TIDE_ST_PENDING, kind, (int64_t)b->size);
    _tide_stat_down(s, _TIDE_ST_PENDING_BLOCKS, kind, 1);
  }
}

/* A free ordered on a stream that does not exist is a caller's mistake. */
static int check_free_stream(_tide_arena *arena, tide_stream stream) {
  const _tide_backend *be = &arena->alloc->backend;
  if (stream == arena->stream || !be->ops->stream_check) return TIDE_OK;
  if (be->ops->stream_check(be->ctx, stream) == TIDE_OK) return TIDE_OK;
  return _tide_error_set(TIDE_ERR_INVALID,
                         "cannot free on stream %p: it is not a stream of this "
                         "device (unknown or destroyed); the block is still allocated",
                         (void *)stream);
}

int _tide_arena_free(_tide_arena *arena, _tide_block *b, tide_stream stream) {
  if (TIDE_UNLIKELY(b->nstreams || stream != arena->stream)) {
    int bad = check_free_stream(arena, stream);
    if (bad) return bad;
    int rc = record_events(arena, b, stream);
    if (rc) {
      return _tide_error_set((tide_status)rc,
                             "cannot free %p: ordering the free after the streams that used "
                             "it failed (%s); the block is still allocated",
                             (void *)b->addr, tide_last_error());
    }
    forget_streams(b);
  }
  if (b->events) {
    _tide_count_free(arena, b);
    _tide_trace(arena->alloc, TIDE_TRACE_FREE, b->segment->pool + 1, b->addr, b->size, stream);
    _tide_ptrmap_remove(&arena->live, b->addr);
    b->state = _TIDE_PENDING;
    count_pending(arena, b, +1);
    return TIDE_OK;
  }
  put_quick(arena, b); /* stays in the live map */
  _tide_hit_extras(arena, b, false, stream);
  return TIDE_OK;
}

int _tide_arena_process_events(_tide_arena *arena, bool wait) {
  const _tide_backend *be = &arena->alloc->backend;
  size_t kept = 0;
  _tide_first_error first = {0};
  for (size_t i = 0; i < arena->npending; i++) {
    _tide_pending p = arena->pending[i];
    if (wait) _tide_note_stream_wait(arena->alloc);
    int rc = wait ? be->ops->event_synchronize(be->ctx, p.event)
                  : be->ops->event_query(be->ctx, p.event);
    if (rc != TIDE_OK) {
      arena->pending[kept++] = p;
      if (wait || rc != TIDE_ERR_NOT_READY) _tide_first_error_note(&first, rc);
      continue;
    }
    _tide_event_give(arena, p.event);
    if (--p.block->events == 0) {
      count_pending(arena, p.block, -1);
      _tide_arena_free_block(arena, p.block);
    }
  }
  arena->npending = kept;
  return _tide_first_error_end(&first);
}

/* ------------------------------------------------------------------------ */
/* Giving memory back                                                        */
/* ------------------------------------------------------------------------ */

static bool holds_cache(const _tide_arena *arena) {
  return arena->pools[_TIDE_SMALL].bins.count || arena->pools[_TIDE_LARGE].bins.count ||
         arena->pools[_TIDE_SMALL].unmapped || arena->pools[_TIDE_LARGE].unmapped ||
         arena->norphans || arena->nstale;
}

int _tide_arena_release_cached(_tide_arena *arena) {
  _tide_arena_flush_quick(arena);
  if (!holds_cache(arena)) return TIDE_OK;
  int rc = _tide_stream_settle(arena);
  if (rc) return rc;
  size_t lost = arena->orphans_lost;
  int refused;
  _tide_stale_unmap(arena, 0, UINTPTR_MAX, arena->idle_before, &refused); /* kept to retry */
  /* Orphans first: a range may be unreserved only once nothing is mapped in it. */
  int orphans = arena->norphans ? _tide_arena_retry_orphans(arena) : TIDE_OK;
  _tide_first_error first = {0};
  _tide_first_error_note(&first, _tide_pool_release_cached(arena, &arena->pools[_TIDE_SMALL]));
  _tide_first_error_note(&first, _tide_pool_release_cached(arena, &arena->pools[_TIDE_LARGE]));
  /* What the backend refused just now gets one more try, and is reported
   * if it is still held. */
  if (arena->norphans) orphans = _tide_arena_retry_orphans(arena);
  _tide_first_error_note(&first, orphans);
  if (arena->orphans_lost > lost)
    _tide_first_error_note(&first, _tide_error_set(TIDE_ERR_BACKEND,
                                                   "the device backend refused to give back %zu "
                                                   "piece(s) of memory, which could not be "
                                                   "recorded to retry (out of host memory)",
                                                   arena->orphans_lost - lost));
  return _tide_first_error_end(&first);
}

/* Oldest free first; among equals, the lowest address (a stable order). */
static int by_stamp(const void *x, const void *y) {
  const _tide_block *a = *(_tide_block *const *)x, *b = *(_tide_block *const *)y;
  if (a->stamp != b->stamp) return (a->stamp > b->stamp) - (a->stamp < b->stamp);
  return (a->addr > b->addr) - (a->addr < b->addr);
}

static bool releasable(const _tide_block *b, size_t page) {
  if (!b->segment->expandable) return !b->prev && !b->next;
  page *= b->segment->handle_pages; /* a handle is unmapped whole */
  uintptr_t base = b->segment->base;
  size_t lo = (b->addr - base + page - 1) / page, hi = (b->addr + b->size - base) / page;
  return hi > lo;
}

int _tide_arena_collect_garbage(_tide_arena *arena, size_t target) {
  struct tide_allocator *a = arena->alloc;
  _tide_arena_flush_quick(arena);
  size_t n = 0, cap = arena->pools[0].bins.count + arena->pools[1].bins.count;
  if (cap == 0) return TIDE_OK;
  _tide_block **candidates = malloc(cap * sizeof *candidates);
  if (!candidates)
    return _tide_error_set(TIDE_ERR_OOM, "out of host memory for garbage collection");
  for (int kind = 0; kind < 2; kind++)
    for (_tide_segment *seg = arena->pools[kind].segments; seg; seg = seg->next)
      for (_tide_block *b = seg->first; b; b = b->next)
        if (b->state == _TIDE_FREE && releasable(b, a->page_size) && n < cap) candidates[n++] = b;
  int rc = n || arena->nstale ? _tide_stream_settle(arena) : TIDE_OK;
  if (!rc && arena->nstale) {
    int refused;
    _tide_stale_unmap(arena, 0, UINTPTR_MAX, arena->idle_before, &refused); /* kept to retry */
  }
  qsort(candidates, n, sizeof *candidates, by_stamp);
  for (size_t i = 0; i < n && !rc; i++) {
    if ((size_t)atomic_load(&a->reserved.cur) <= target) break;
    rc = _tide_release_block(arena, candidates[i], SIZE_MAX);
  }
  free(candidates);
  _tide_pool_release_empty_segments(arena, &arena->pools[_TIDE_SMALL]);
  _tide_pool_release_empty_segments(arena, &arena->pools[_TIDE_LARGE]);
  return rc;
}

/* ------------------------------------------------------------------------ */
/* Pointers that are not live blocks                                         */
/* ------------------------------------------------------------------------ */

const _tide_block *_tide_arena_containing_block(const _tide_arena *arena, uintptr_t addr) {
  for (int kind = 0; kind < 2; kind++)
    for (const _tide_segment *seg = arena->pools[kind].segments; seg; seg = seg->next) {
      if (addr < seg->base || addr >= seg->base + seg->size) continue;
      for (const _tide_block *b = seg->first; b; b = b->next)
        if (addr >= b->addr && addr < b->addr + b->size) return b;
    }
  return NULL;
}

int _tide_arena_explain_pointer(_tide_arena *arena, uintptr_t addr) {
  _tide_arena_flush_quick(arena);
  const _tide_block *b = _tide_arena_containing_block(arena, addr);
  if (!b) return TIDE_OK;
  void *p = (void *)addr;
  switch (b->state) {
  case _TIDE_ALLOCATED:
    return _tide_error_set(TIDE_ERR_BAD_POINTER,
                           "%p is not the start of a block: it lies %zu bytes into the block "
                           "at %p of %zu bytes (pass the pointer tide_malloc returned)",
                           p, (size_t)(addr - b->addr), (void *)b->addr, b->size);
  case _TIDE_PENDING:
  case _TIDE_FREE:
    return _tide_error_set(TIDE_ERR_DOUBLE_FREE,
                           "%p lies in free memory: it was already freed (double free), or "
                           "is a pointer into a freed block",
                           p);
  default:
    return _tide_error_set(TIDE_ERR_BAD_POINTER,
                           "%p lies in an unmapped part of a segment: it was never allocated "
                           "(or was freed and its page returned)",
                           p);
  }
}

/* ------------------------------------------------------------------------ */
/* Capture pools: deferred frees and restored blocks                         */
/* ------------------------------------------------------------------------ */

int _tide_arena_defer_free(_tide_arena *arena, _tide_block *b, tide_stream stream) {
  /* Checked now, as an immediate free checks it: the free itself comes
   * once the capture ends, when refusing it could no longer be said. */
  int bad = check_free_stream(arena, stream);
  if (bad) return bad;
  _tide_count_free(arena, b);
  _tide_trace(arena->alloc, TIDE_TRACE_FREE, b->segment->pool + 1, b->addr, b->size, arena->stream);
  _tide_ptrmap_remove(&arena->live, b->addr);
  b->state = _TIDE_PENDING;
  count_pending(arena, b, +1);
  return TIDE_OK;
}

int _tide_arena_finish_deferred(_tide_arena *arena, _tide_block *b, tide_stream stream) {
  if (b->nstreams || stream != arena->stream) {
    int rc = record_events(arena, b, stream);
    if (rc) return rc; /* still deferred: tried again later */
    forget_streams(b);
    if (b->events) return TIDE_OK; /* now waits on events, pending as before */
  }
  count_pending(arena, b, -1);
  _tide_arena_free_block(arena, b);
  return TIDE_OK;
}

void _tide_arena_finish_ordered(_tide_arena *arena, _tide_block *b) {
  forget_streams(b);
  count_pending(arena, b, -1);
  _tide_arena_free_block(arena, b);
}

void _tide_arena_count_restored(_tide_arena *arena, _tide_block *b, size_t requested) {
  b->state = _TIDE_ALLOCATED;
  b->requested = requested;
  _tide_count_allocation(arena, b);
  _tide_trace(arena->alloc, TIDE_TRACE_ALLOC, b->segment->pool + 1, b->addr, b->size,
              arena->stream);
}

void _tide_arena_count_released(_tide_arena *arena, _tide_block *b) {
  _tide_count_free(arena, b);
  forget_streams(b);
  _tide_trace(arena->alloc, TIDE_TRACE_FREE, b->segment->pool + 1, b->addr, b->size, arena->stream);
}
