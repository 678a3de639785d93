/* segment.c: segments, the ranges of device memory blocks are carved from.
 *
 * A fixed segment is one physical allocation, mapped whole at creation and
 * sized as PyTorch sizes its segments. An expandable segment reserves a
 * virtual range as large as the device and maps pages into it only where
 * blocks need them; free pages are unmapped again when the cache is emptied.
 * Its blocks cover the whole range: mapped ones are free or in use, the rest
 * are unmapped blocks kept in address order. Growth maps the fewest pages it
 * can: next to the free block before a hole, or the one after it, or
 * bridging both (the lowest such place among equals), so that partial pages
 * already mapped are used before new ones. Until its stream first frees a
 * block, an arena maps each growth of a large request as one handle (a
 * load handle, load_handles): a model's weights, loaded first and kept,
 * then take a mapping each instead of one per page or handle. Pages taken
 * out of a segment while work queued before their free may still read
 * them stay mapped at their old address, stale, until the stream is past
 * that work (_tide_stale_settle, by stream_events.c's idle marks).
 *
 * Every backend call here can fail. A failure leaves the segment as it was
 * before the call (undoing the steps already done), or, where the backend
 * refuses to give memory back, keeps the handle or range as an orphan to be
 * retried: nothing is lost and no block changes state. */
#include <stdlib.h>
#include <string.h>

#include "memory/core.h"

static inline size_t round_up(size_t v, size_t to) { return (v + to - 1) / to * to; }
static inline size_t round_down(size_t v, size_t to) { return v / to * to; }

/* ------------------------------------------------------------------------ */
/* Sizes                                                                     */
/* ------------------------------------------------------------------------ */

static unsigned divisions_for(const _tide_conf_values *conf, size_t size) {
  int index = 63 - __builtin_clzll((unsigned long long)size) - 20; /* 1 MiB is interval 0 */
  if (index < 0) index = 0;
  if (index >= TIDE_ROUNDUP_INTERVALS) index = TIDE_ROUNDUP_INTERVALS - 1;
  return conf->roundup_divisions[index];
}

/* PyTorch's rounding to one of `divisions` steps between powers of two. */
static size_t round_to_division(size_t size, unsigned divisions) {
  if ((size & (size - 1)) == 0) return size;
  size_t floor2 = (size_t)1 << (63 - __builtin_clzll((unsigned long long)size));
  size_t step = floor2 >> (31 - __builtin_clz(divisions));
  if (step == 0) return floor2 << 1;
  size_t down = size & ~(step - 1);
  return down == size ? size : down + step;
}

size_t _tide_round_size(const _tide_conf_values *conf, size_t size) {
  if (size < TIDE_MIN_BLOCK) return TIDE_MIN_BLOCK;
  unsigned divisions = divisions_for(conf, size);
  if (divisions > 1 && size > TIDE_MIN_BLOCK * divisions) return round_to_division(size, divisions);
  return round_up(size, TIDE_MIN_BLOCK);
}

size_t _tide_fixed_segment_size(size_t rounded, size_t granularity) {
  size_t size;
  if (rounded <= TIDE_SMALL_SIZE)
    size = TIDE_SMALL_BUFFER;
  else if (rounded < TIDE_MIN_LARGE_ALLOC)
    size = TIDE_LARGE_BUFFER;
  else
    size = round_up(rounded, TIDE_ROUND_LARGE);
  return round_up(size, granularity);
}

/* ------------------------------------------------------------------------ */
/* Segment lists                                                             */
/* ------------------------------------------------------------------------ */

static void segment_link(_tide_pool *pool, _tide_segment *seg) {
  seg->prev = NULL;
  seg->next = pool->segments;
  if (pool->segments) pool->segments->prev = seg;
  pool->segments = seg;
}

static void segment_unlink(_tide_pool *pool, _tide_segment *seg) {
  if (seg->prev)
    seg->prev->next = seg->next;
  else
    pool->segments = seg->next;
  if (seg->next) seg->next->prev = seg->prev;
}

static void segment_counted(_tide_arena *arena, _tide_segment *seg, int delta) {
  _tide_stat_add(&arena->stats, _TIDE_ST_SEGMENTS, seg->pool, delta);
  arena->stats.counters[delta > 0 ? _TIDE_CT_SEGMENTS_CREATED : _TIDE_CT_SEGMENTS_RELEASED]++;
}

/* Physical memory taken from the device under the limit, and given back. */
static int hold_bytes(_tide_arena *arena, int pool, size_t bytes, size_t request) {
  int rc = _tide_budget_take(arena->alloc, bytes, request);
  if (!rc) _tide_stat_add(&arena->stats, _TIDE_ST_RESERVED, pool, (int64_t)bytes);
  return rc;
}

static void drop_bytes(_tide_arena *arena, int pool, size_t bytes) {
  _tide_budget_give(arena->alloc, bytes);
  _tide_stat_add(&arena->stats, _TIDE_ST_RESERVED, pool, -(int64_t)bytes);
}

/* A handle held for pool `from` now serves pool `to`: its bytes move from
 * one pool's stats to the other's. */
static void move_bytes(_tide_arena *arena, int from, int to, size_t bytes) {
  if (from == to) return;
  _tide_stat_add(&arena->stats, _TIDE_ST_RESERVED, from, -(int64_t)bytes);
  _tide_stat_add(&arena->stats, _TIDE_ST_RESERVED, to, (int64_t)bytes);
}

/* Physical memory from the backend, counted as a device allocation. */
static int create_handle(_tide_arena *arena, size_t size, _tide_handle *h) {
  int rc = _tide_mem_create(arena->alloc, size, h);
  if (!rc) arena->stats.counters[_TIDE_CT_DEVICE_ALLOC]++;
  return rc;
}

/* Give an unmapped handle back: its bytes leave the budget, or, if the
 * backend refuses, it becomes an orphan that keeps them. */
static bool release_handle(_tide_arena *arena, int pool, _tide_handle h, size_t size) {
  if (_tide_mem_release(arena->alloc, h)) {
    _tide_orphan(arena, pool, 0, 0, h, size, 0, 0);
    return false;
  }
  drop_bytes(arena, pool, size);
  arena->stats.counters[_TIDE_CT_DEVICE_FREE]++;
  return true;
}

/* ------------------------------------------------------------------------ */
/* The unmapped list (address order)                                         */
/* ------------------------------------------------------------------------ */

static void unmapped_insert(_tide_pool *pool, _tide_block *b) {
  _tide_block *prev = NULL, *at = pool->unmapped;
  while (at && at->addr < b->addr) {
    prev = at;
    at = at->link_next;
  }
  b->link_prev = prev;
  b->link_next = at;
  if (prev)
    prev->link_next = b;
  else
    pool->unmapped = b;
  if (at) at->link_prev = b;
}

static void unmapped_remove(_tide_pool *pool, _tide_block *b) {
  if (b->link_prev)
    b->link_prev->link_next = b->link_next;
  else
    pool->unmapped = b->link_next;
  if (b->link_next) b->link_next->link_prev = b->link_prev;
  b->link_prev = b->link_next = NULL;
}

/* ------------------------------------------------------------------------ */
/* Orphans: what the backend refused to give back                            */
/* ------------------------------------------------------------------------ */

void _tide_orphan(_tide_arena *arena, int pool, uintptr_t map_addr, size_t map_size,
                  _tide_handle handle, size_t handle_size, uintptr_t range, size_t range_size) {
  if (arena->norphans == arena->orphans_cap) {
    size_t cap = arena->orphans_cap ? arena->orphans_cap * 2 : 8;
    _tide_orphan_rec *grown = realloc(arena->orphans, cap * sizeof *grown);
    if (!grown) {
      /* Out of host memory as well: it cannot be retried, but it is said. */
      arena->orphans_lost++;
      return;
    }
    arena->orphans = grown;
    arena->orphans_cap = cap;
  }
  arena->orphans[arena->norphans++] = (_tide_orphan_rec){
      .map_addr = map_addr,
      .map_size = map_size,
      .handle = handle,
      .handle_size = handle_size,
      .range = range,
      .range_size = range_size,
      .pool = pool,
  };
}

/* One more try at an orphan: unmap, release, unreserve, in that order. */
static bool stale_adopt(_tide_arena *arena, _tide_handle h, int pool);

bool _tide_orphan_mapped_in(const _tide_arena *arena, uintptr_t lo, uintptr_t hi) {
  for (size_t i = 0; i < arena->norphans; i++) {
    const _tide_orphan_rec *o = &arena->orphans[i];
    if (o->map_addr && o->map_addr < hi && o->map_addr + o->map_size > lo) return true;
  }
  return false;
}

static bool mappings_orphaned(const _tide_arena *arena) {
  for (size_t i = 0; i < arena->norphans; i++)
    if (arena->orphans[i].map_addr) return true;
  return false;
}

static bool retry_orphan(_tide_arena *arena, _tide_orphan_rec *o, bool unmapped_only) {
  const _tide_backend *be = &arena->alloc->backend;
  if (o->map_addr && unmapped_only) return false;
  if (o->map_addr) {
    if (_tide_mem_unmap(arena->alloc, o->map_addr, o->map_size)) return false;
    o->map_addr = 0;
  }
  /* A page's handle still mapped at a stale address is released after that
   * unmap: the stale page takes it over, bytes and all. */
  if (o->handle && arena->nstale && stale_adopt(arena, o->handle, o->pool)) o->handle = 0;
  /* A handle whose mapping is another orphan (a growable buffer's undo
   * keeps them apart) goes only once no orphaned mapping is left: released
   * while mapped, it would hold its memory with its bytes no longer
   * reserved. */
  if (o->handle && mappings_orphaned(arena)) return false;
  if (o->handle) {
    if (_tide_mem_release(arena->alloc, o->handle)) return false;
    drop_bytes(arena, o->pool, o->handle_size);
    arena->stats.counters[_TIDE_CT_DEVICE_FREE]++;
    o->handle = 0;
  }
  /* A range with an orphaned mapping still inside waits for it: the
   * backend refuses to unreserve memory that is mapped. */
  if (o->range && _tide_orphan_mapped_in(arena, o->range, o->range + o->range_size)) return false;
  if (o->range) {
    if (be->ops->unreserve(be->ctx, o->range, o->range_size)) return false;
    o->range = 0;
  }
  return true;
}

int _tide_arena_retry_orphans(_tide_arena *arena) {
  _tide_saved_error saved;
  _tide_error_save(&saved);
  size_t kept = 0;
  /* A second round for the handles that waited for the orphaned mappings
   * the first unmapped (each mapping is tried once per call). */
  for (int round = 0; round < 2; round++) {
    kept = 0;
    for (size_t i = 0; i < arena->norphans; i++)
      if (!retry_orphan(arena, &arena->orphans[i], round == 1))
        arena->orphans[kept++] = arena->orphans[i];
    arena->norphans = kept;
  }
  if (kept)
    return _tide_error_set(TIDE_ERR_BACKEND,
                           "the device backend still refuses to give "
                           "back %zu piece(s) of memory: %s",
                           kept, tide_last_error());
  _tide_error_restore(&saved);
  return TIDE_OK;
}

/* ------------------------------------------------------------------------ */
/* Fixed segments                                                            */
/* ------------------------------------------------------------------------ */

/* Undo the first steps of a fixed segment's creation. Whatever the backend
 * refuses becomes an orphan (its bytes stay held until it is retried). */
static void undo_fixed(_tide_arena *arena, int pool, uintptr_t addr, size_t size, _tide_handle h,
                       bool mapped) {
  const _tide_backend *be = &arena->alloc->backend;
  if (mapped && _tide_mem_unmap(arena->alloc, addr, size)) {
    _tide_orphan(arena, pool, addr, size, h, size, addr, size);
    return;
  }
  if (h)
    release_handle(arena, pool, h, size);
  else
    drop_bytes(arena, pool, size);
  if (be->ops->unreserve(be->ctx, addr, size)) _tide_orphan(arena, pool, 0, 0, 0, 0, addr, size);
}

static int grow_fixed(_tide_arena *arena, _tide_pool *pool, size_t size, _tide_block **out) {
  struct tide_allocator *a = arena->alloc;
  const _tide_backend *be = &a->backend;
  size_t seg_size = _tide_fixed_segment_size(size, a->granularity);
  _tide_segment *seg = calloc(1, sizeof *seg);
  _tide_block *b = _tide_block_new(arena);
  uintptr_t addr = 0;
  _tide_handle h = 0;
  _tide_saved_error saved;
  int rc;
  if (!seg || !b) {
    rc = _tide_error_set(TIDE_ERR_OOM, "out of host memory for segment records");
    goto fail;
  }
  if ((rc = hold_bytes(arena, pool->kind, seg_size, size))) goto fail;
  if ((rc = be->ops->reserve(be->ctx, seg_size, a->granularity, &addr))) {
    drop_bytes(arena, pool->kind, seg_size);
    goto fail;
  }
  if ((rc = create_handle(arena, seg_size, &h)) ||
      (rc = _tide_mem_map(arena->alloc, addr, seg_size, h))) {
    _tide_error_save(&saved);
    undo_fixed(arena, pool->kind, addr, seg_size, h, false);
    _tide_error_restore(&saved);
    goto fail;
  }
  if ((rc = _tide_mem_set_access(arena->alloc, addr, seg_size))) {
    _tide_error_save(&saved);
    undo_fixed(arena, pool->kind, addr, seg_size, h, true);
    _tide_error_restore(&saved);
    goto fail;
  }
  seg->base = addr;
  seg->size = seg->mapped = seg_size;
  seg->arena = arena;
  seg->handle = h;
  seg->pool = pool->kind;
  seg->first = b;
  segment_link(pool, seg);
  b->addr = addr;
  b->size = seg_size;
  b->segment = seg;
  b->state = _TIDE_FREE;
  segment_counted(arena, seg, +1);
  _tide_trace(a, TIDE_TRACE_MAP, pool->kind + 1, addr, seg_size, arena->stream);
  *out = b;
  return TIDE_OK;
fail:
  free(seg);
  if (b) _tide_block_delete(arena, b);
  return rc;
}

/* Give a fixed segment whose one block is free back to the device. */
static int release_fixed(_tide_arena *arena, _tide_block *b) {
  struct tide_allocator *a = arena->alloc;
  const _tide_backend *be = &a->backend;
  _tide_segment *seg = b->segment;
  _tide_pool *pool = &arena->pools[seg->pool];
  int rc = _tide_mem_unmap(arena->alloc, seg->base, seg->size);
  if (rc) return rc; /* nothing changed: the block stays free and cached */
  _tide_pool_remove(arena, b);
  if (!release_handle(arena, seg->pool, seg->handle, seg->size)) rc = tide_last_status();
  if (be->ops->unreserve(be->ctx, seg->base, seg->size)) {
    if (!rc) rc = tide_last_status();
    _tide_orphan(arena, seg->pool, 0, 0, 0, 0, seg->base, seg->size);
  }
  _tide_trace(a, TIDE_TRACE_UNMAP, seg->pool + 1, seg->base, seg->size, arena->stream);
  segment_counted(arena, seg, -1);
  segment_unlink(pool, seg);
  _tide_block_delete(arena, b);
  free(seg);
  return rc;
}

/* ------------------------------------------------------------------------ */
/* Expandable segments                                                       */
/* ------------------------------------------------------------------------ */

/* The pages per handle of the segment a growth for `size` bytes of `pool`
 * maps into. Large requests (at least TIDE_HANDLES_PER_REQUEST handles of
 * handle_pages pages) of an arena already holding handle_threshold bytes
 * (TIDE_HANDLES_BEFORE_LARGE such handles' worth unless set) go to segments
 * of large handles; the rest to segments of one page per handle, whose free
 * pages can be unmapped one by one. The memory a partly used large handle
 * keeps is then small against what the arena holds, and small workloads
 * never split their memory between the two kinds of segment. */
static size_t handle_pages_for(const _tide_arena *arena, const _tide_pool *pool, size_t size) {
  const struct tide_allocator *a = arena->alloc;
  size_t big = a->handle_pages, handle = big * a->page_size;
  if (big > 1 && pool->kind == _TIDE_LARGE && size >= TIDE_HANDLES_PER_REQUEST * handle &&
      arena->stats.cur[_TIDE_ST_RESERVED][0] >= (int64_t)a->handle_threshold)
    return big;
  return 1;
}

static int new_expandable(_tide_arena *arena, _tide_pool *pool, size_t size) {
  struct tide_allocator *a = arena->alloc;
  const _tide_backend *be = &a->backend;
  size_t page = a->page_size;
  size_t per_handle = handle_pages_for(arena, pool, size);
  size_t va = round_up(a->total_memory > size ? a->total_memory : size, page * per_handle);
  _tide_segment *seg = calloc(1, sizeof *seg);
  _tide_block *b = _tide_block_new(arena);
  _tide_handle *pages = calloc(va / page, sizeof *pages);
  uintptr_t addr = 0;
  int rc;
  if (!seg || !b || !pages) {
    rc = _tide_error_set(TIDE_ERR_OOM, "out of host memory for segment records");
    goto fail;
  }
  if ((rc = be->ops->reserve(be->ctx, va, page, &addr))) goto fail;
  seg->base = addr;
  seg->size = va;
  seg->arena = arena;
  seg->pages = pages;
  seg->npages = va / page;
  seg->handle_pages = (uint16_t)per_handle;
  seg->pool = pool->kind;
  seg->expandable = 1;
  seg->first = b;
  segment_link(pool, seg);
  b->addr = addr;
  b->size = va;
  b->segment = seg;
  b->state = _TIDE_UNMAPPED;
  unmapped_insert(pool, b);
  segment_counted(arena, seg, +1);
  return TIDE_OK;
fail:
  free(seg);
  free(pages);
  if (b) _tide_block_delete(arena, b);
  return rc;
}

/* Keep an unmapped page's handle for the growth that follows; false when
 * there is no room to note it (then it is released). */
static bool keep_spare(_tide_arena *arena, _tide_handle h, size_t size, int pool) {
  if (!_tide_grow_array((void **)&arena->spare_pages, &arena->spare_pages_cap,
                        arena->nspare_pages + 1, sizeof *arena->spare_pages))
    return false;
  arena->spare_pages[arena->nspare_pages++] =
      (struct _tide_spare_page){.handle = h, .size = size, .pool = pool};
  return true;
}

/* Release pages [first, first+count) of a segment, already unmapped, or keep
 * their handles as spares while room is being made for a growth. */
/* A handle still mapped at a stale address is released only after that
 * unmap: the stale page takes it over (its bytes stay reserved until then). */
static bool stale_adopt(_tide_arena *arena, _tide_handle h, int pool) {
  for (size_t i = 0; i < arena->nstale; i++) {
    struct _tide_stale_page *sp = &arena->stale[i];
    if (sp->handle != h || sp->owned) continue;
    move_bytes(arena, pool, sp->pool, sp->size);
    sp->owned = true;
    return true;
  }
  return false;
}

static void give_back_handle(_tide_arena *arena, int pool, _tide_handle h, size_t size) {
  if (!(arena->nstale && stale_adopt(arena, h, pool))) release_handle(arena, pool, h, size);
}

/* ------------------------------------------------------------------------ */
/* The page table                                                            */
/* ------------------------------------------------------------------------ */

/* Every page names the handle that maps it. A handle is handle_pages pages
 * from a multiple of them, or, for a load handle, a longer run of such
 * units: a handle is mapped in one place of the table at a time, so its run
 * is the pages around i that name it. */
size_t _tide_handle_extent(const _tide_segment *seg, size_t i, size_t *start) {
  size_t unit = seg->handle_pages, lo = i - i % unit, hi = lo + unit;
  _tide_handle h = seg->pages[i];
  if (seg->load_handles && h) {
    while (lo >= unit && seg->pages[lo - unit] == h) lo -= unit;
    while (hi < seg->npages && seg->pages[hi] == h) hi += unit;
  }
  *start = lo;
  return hi - lo;
}

/* Note handle h as mapping `count` pages from page i (a handle's first
 * page). */
static void note_handle(_tide_segment *seg, size_t i, size_t count, _tide_handle h) {
  for (size_t j = i; j < i + count; j++) seg->pages[j] = h;
  if (count > seg->handle_pages) seg->load_handles++;
}

/* Note the `count` pages from page i, one handle's, as unmapped. */
static void forget_handle(_tide_segment *seg, size_t i, size_t count) {
  for (size_t j = i; j < i + count; j++) seg->pages[j] = 0;
  if (count > seg->handle_pages) seg->load_handles--;
}

/* Release the handles of pages [first, first+count) of a segment (whole
 * handles, already unmapped), or keep them as spares while room is being
 * made for a growth. */
static void release_pages(_tide_arena *arena, _tide_segment *seg, size_t first, size_t count) {
  for (size_t i = first, start, n; i < first + count; i += n) {
    n = _tide_handle_extent(seg, i, &start);
    size_t size = n * arena->alloc->page_size;
    _tide_handle h = seg->pages[i];
    if (!(arena->keep_spare_pages && keep_spare(arena, h, size, seg->pool)))
      give_back_handle(arena, seg->pool, h, size);
    forget_handle(seg, i, n);
  }
}

void _tide_arena_release_spare_pages(_tide_arena *arena) {
  for (size_t i = 0; i < arena->nspare_pages; i++) {
    const struct _tide_spare_page *sp = &arena->spare_pages[i];
    give_back_handle(arena, sp->pool, sp->handle, sp->size);
  }
  arena->nspare_pages = 0;
}

/* A stale page's handle after its unmap, if the page owned it: to the stale
 * page that still maps it elsewhere, which releases it in turn, or back. */
static void stale_handle_done(_tide_arena *arena, const struct _tide_stale_page *sp) {
  if (sp->owned && !stale_adopt(arena, sp->handle, sp->pool))
    release_handle(arena, sp->pool, sp->handle, sp->size);
}

/* Unmap stale page i and forget it; its handle goes back if it is owned.
 * A refused unmap keeps it (to try again), or at teardown makes it an
 * orphan. Returns the backend's status. */
static int unmap_stale_page(_tide_arena *arena, size_t i, bool orphan_on_failure) {
  struct _tide_stale_page sp = arena->stale[i];
  int rc = _tide_mem_unmap(arena->alloc, sp.addr, sp.size);
  if (rc && !orphan_on_failure) return rc;
  arena->stats.counters[_TIDE_CT_UNMAPPINGS] += !rc;
  arena->stale[i] = arena->stale[--arena->nstale];
  if (rc) {
    _tide_orphan(arena, sp.pool, sp.addr, sp.size, sp.owned ? sp.handle : 0, sp.owned ? sp.size : 0,
                 0, 0);
    return rc;
  }
  stale_handle_done(arena, &sp);
  return TIDE_OK;
}

/* A stale page that was unmapped: out of the list (a hole, handle 0, until
 * compact_stale), its handle given back if it is owned. */
static void stale_unmapped(_tide_arena *arena, size_t i) {
  struct _tide_stale_page sp = arena->stale[i];
  arena->stale[i].handle = 0;
  stale_handle_done(arena, &sp);
}

static void compact_stale(_tide_arena *arena) {
  size_t kept = 0;
  for (size_t i = 0; i < arena->nstale; i++)
    if (arena->stale[i].handle) arena->stale[kept++] = arena->stale[i];
  arena->nstale = kept;
}

typedef struct stale_ref {
  uintptr_t addr;
  size_t size;
  size_t index;
} stale_ref;

static int by_addr(const void *a, const void *b) {
  uintptr_t x = ((const stale_ref *)a)->addr, y = ((const stale_ref *)b)->addr;
  return (x > y) - (x < y);
}

/* Whether stale page sp overlaps [lo, hi). */
static bool stale_overlaps(const struct _tide_stale_page *sp, uintptr_t lo, uintptr_t hi) {
  return sp->addr < hi && sp->addr + sp->size > lo;
}

/* Unmap the idle stale pages of [lo, hi): those of one size next to each
 * other (the handles of one released run, mostly) with one backend call.
 * Returns how many stale mappings in the range are left. */
static size_t unmap_idle_runs(_tide_arena *arena, uintptr_t lo, uintptr_t hi, uint64_t idle_before,
                              stale_ref *refs, int *failed) {
  size_t n = 0, left = 0;
  for (size_t i = 0; i < arena->nstale; i++) {
    const struct _tide_stale_page *sp = &arena->stale[i];
    if (!stale_overlaps(sp, lo, hi)) continue;
    if (sp->stamp < idle_before)
      refs[n++] = (stale_ref){sp->addr, sp->size, i};
    else
      left++;
  }
  qsort(refs, n, sizeof *refs, by_addr);
  for (size_t k = 0, end; k < n; k = end) {
    size_t size = refs[k].size;
    for (end = k + 1;
         end < n && refs[end].size == size && refs[end].addr == refs[end - 1].addr + size; end++) {
    }
    size_t done = 0;
    int rc = _tide_mem_unmap_run(arena->alloc, refs[k].addr, size, end - k, &done);
    for (size_t j = k; j < k + done; j++) stale_unmapped(arena, refs[j].index);
    arena->stats.counters[_TIDE_CT_UNMAPPINGS] += done;
    left += end - k - done;
    if (rc && !*failed) *failed = rc; /* its message stays the thread's */
  }
  compact_stale(arena);
  return left;
}

size_t _tide_stale_unmap(_tide_arena *arena, uintptr_t lo, uintptr_t hi, uint64_t idle_before,
                         int *failed) {
  _tide_saved_error saved;
  _tide_error_save(&saved);
  size_t left = 0;
  *failed = TIDE_OK;
  stale_ref *refs = arena->nstale ? malloc(arena->nstale * sizeof *refs) : NULL;
  if (refs) {
    left = unmap_idle_runs(arena, lo, hi, idle_before, refs, failed);
    free(refs);
  } else { /* no room to sort them: a page at a time */
    for (size_t i = arena->nstale; i-- > 0;) {
      const struct _tide_stale_page *sp = &arena->stale[i];
      if (!stale_overlaps(sp, lo, hi)) continue;
      int rc = sp->stamp < idle_before ? unmap_stale_page(arena, i, false) : TIDE_ERR_NOT_READY;
      if (rc == TIDE_OK) continue;
      left++;
      if (rc != TIDE_ERR_NOT_READY && !*failed) *failed = rc; /* its message stays the thread's */
    }
  }
  if (!*failed) _tide_error_restore(&saved);
  return left;
}

int _tide_stale_settle(_tide_arena *arena, uintptr_t lo, uintptr_t hi, bool wait) {
  _tide_saved_error saved;
  _tide_error_save(&saved);
  _tide_idle_marks_poll(arena);
  int failed;
  size_t left = _tide_stale_unmap(arena, lo, hi, arena->idle_before, &failed);
  if (!wait) {
    _tide_error_restore(&saved);
    return TIDE_OK;
  }
  if (left && !failed) {
    int rc = _tide_stream_settle(arena);
    if (rc) return rc == TIDE_ERR_BACKEND ? rc : TIDE_ERR_NOT_READY;
    left = _tide_stale_unmap(arena, lo, hi, arena->idle_before, &failed);
  }
  if (!left) return TIDE_OK;
  return failed ? failed
                : _tide_error_set(TIDE_ERR_BACKEND, "%zu stale pages in [%p, %p) stay mapped", left,
                                  (void *)lo, (void *)hi);
}

void _tide_stale_drop_all(_tide_arena *arena) {
  while (arena->nstale) unmap_stale_page(arena, arena->nstale - 1, true);
}

/* Note the handles of pages [first, first + count) (whole handles) as
 * stale, of a block freed at `stamp`; room was made for them. */
static void note_stale(_tide_arena *arena, const _tide_segment *seg, size_t first, size_t count,
                       uint64_t stamp) {
  size_t page = arena->alloc->page_size;
  for (size_t i = first, start, n; i < first + count; i += n) {
    n = _tide_handle_extent(seg, i, &start);
    arena->stale[arena->nstale++] = (struct _tide_stale_page){.addr = seg->base + i * page,
                                                              .size = n * page,
                                                              .handle = seg->pages[i],
                                                              .stamp = stamp,
                                                              .pool = seg->pool};
  }
}

/* Undo the mapping of pages [first, first+count) (whole handles): unmap and
 * release each handle; one the backend will not unmap is kept as an orphan. */
static void unmap_new_pages(_tide_arena *arena, _tide_segment *seg, size_t first, size_t count) {
  size_t page = arena->alloc->page_size;
  for (size_t i = first, start, n; i < first + count; i += n) {
    n = _tide_handle_extent(seg, i, &start);
    uintptr_t at = seg->base + i * page;
    if (_tide_mem_unmap(arena->alloc, at, n * page)) {
      _tide_orphan(arena, seg->pool, at, n * page, seg->pages[i], n * page, 0, 0);
      forget_handle(seg, i, n);
    } else {
      release_pages(arena, seg, i, n);
    }
  }
}

/* The orphan whose handle is still mapped from `at` (an undo's unmap the
 * backend refused, and refused again on retry), or SIZE_MAX. */
static size_t orphan_mapped_at(const _tide_arena *arena, uintptr_t at) {
  for (size_t i = 0; i < arena->norphans; i++) {
    const _tide_orphan_rec *o = &arena->orphans[i];
    if (o->map_addr == at && o->handle && !o->range) return i;
  }
  return SIZE_MAX;
}

/* Take the handle of orphan i, mapped where growth wants pages, as theirs:
 * mapping over it would fail, and it holds its bytes already. */
static _tide_handle adopt_orphan(_tide_arena *arena, size_t i, int pool) {
  _tide_orphan_rec o = arena->orphans[i];
  arena->orphans[i] = arena->orphans[--arena->norphans];
  move_bytes(arena, o.pool, pool, o.handle_size);
  return o.handle;
}

/* What a growth does with each spare handle. */
enum { SPARE_UNUSED, SPARE_PLANNED, SPARE_MAPPED };

/* How growth maps a run of pages: handle by handle, each an orphan's handle
 * still mapped there, a spare handle, or a new one. */
typedef struct run_piece {
  size_t spare; /* index into the spare handles, or SIZE_MAX */
  bool orphan;
  size_t pages;
} run_piece;

/* Whether a run of `count` pages of segment seg is mapped as one handle: a
 * large request's growth while the arena's stream has freed nothing yet
 * (load_handles). A program loading a model allocates its weights first and
 * keeps them, so such handles are freed, if ever, whole; one handle per
 * weight instead of one per handle_pages takes far fewer driver calls
 * (the driver charges by the call, whatever the mapping's size). An
 * orphaned mapping in the segment keeps the run in single handles (an
 * orphan is adopted only where it fits one). */
static bool load_run(const _tide_arena *arena, const _tide_segment *seg, size_t count) {
  return arena->alloc->conf.load_handles && !arena->freed_any && arena->nquick == 0 &&
         seg->pool == _TIDE_LARGE && count > seg->handle_pages && !arena->norphans;
}

/* Plan the handles of a run of `count` pages from `start` in segment seg
 * (a whole number of its handles): orphans where they are mapped, spare
 * handles of the segment's size, then new handles. Returns the pieces, with
 * *created the pages of new handles; or 0 with an error when an orphaned
 * mapping of another size lies where a handle would go. */
static size_t plan_run(_tide_arena *arena, const _tide_segment *seg, uintptr_t start, size_t count,
                       run_piece *pieces, uint8_t *spare_state, size_t *created) {
  size_t page = arena->alloc->page_size, size = seg->handle_pages * page, n = 0, spare = 0;
  *created = 0;
  if (load_run(arena, seg, count)) {
    pieces[0] = (run_piece){.spare = SIZE_MAX, .pages = count};
    *created = count;
    return 1;
  }
  for (size_t p = 0; p < count; p += pieces[n].pages, n++) {
    uintptr_t at = start + p * page;
    size_t o = arena->norphans ? orphan_mapped_at(arena, at) : SIZE_MAX;
    if (o != SIZE_MAX || (arena->norphans && _tide_orphan_mapped_in(arena, at, at + size))) {
      /* An orphan is taken as it is, where the run holds it whole. */
      size_t pages = o != SIZE_MAX ? arena->orphans[o].map_size / page : 0;
      if (o == SIZE_MAX || arena->orphans[o].map_size % size || p + pages > count) {
        _tide_error_set(TIDE_ERR_BACKEND,
                        "memory the device backend refused to unmap is still mapped at %p, "
                        "where growth would map",
                        (void *)at);
        return 0;
      }
      pieces[n] = (run_piece){.spare = SIZE_MAX, .orphan = true, .pages = pages};
      continue;
    }
    while (spare < arena->nspare_pages && arena->spare_pages[spare].size != size) spare++;
    if (spare < arena->nspare_pages) {
      spare_state[spare] = SPARE_PLANNED;
      pieces[n] = (run_piece){.spare = spare++, .pages = seg->handle_pages};
      continue;
    }
    pieces[n] = (run_piece){.spare = SIZE_MAX, .pages = seg->handle_pages};
    *created += seg->handle_pages;
  }
  return n;
}

/* Give back the spare handles in state `state`; with SPARE_PLANNED, the
 * growth is over and the list empties. Spares a growth does not map go back
 * before it makes new handles: held at once, both would raise reserved
 * memory's peak. */
static void give_back_spares(_tide_arena *arena, const uint8_t *spare_state, uint8_t state) {
  for (size_t k = 0; k < arena->nspare_pages; k++)
    if (spare_state[k] == state)
      give_back_handle(arena, arena->spare_pages[k].pool, arena->spare_pages[k].handle,
                       arena->spare_pages[k].size);
  if (state == SPARE_PLANNED) arena->nspare_pages = 0;
}

/* Map handle `at` (a page index) of a run as planned by `pc`: its handle
 * (new, spare or the orphan's) noted in the page table. *created counts the
 * pages of new handles made. */
static int map_piece(_tide_arena *arena, _tide_segment *seg, size_t at, const run_piece *pc,
                     size_t *created) {
  size_t n = pc->pages, size = n * arena->alloc->page_size;
  uintptr_t addr = seg->base + at * arena->alloc->page_size;
  _tide_handle h = 0;
  if (pc->orphan) {
    note_handle(seg, at, n, adopt_orphan(arena, orphan_mapped_at(arena, addr), seg->pool));
    return TIDE_OK;
  }
  if (pc->spare != SIZE_MAX) {
    h = arena->spare_pages[pc->spare].handle;
    const struct _tide_spare_page *sp = &arena->spare_pages[pc->spare];
    move_bytes(arena, sp->pool, seg->pool, sp->size);
  } else {
    int rc = create_handle(arena, size, &h);
    if (rc) return rc;
    *created += n;
  }
  int rc = _tide_mem_map(arena->alloc, addr, size, h);
  if (rc) {
    _tide_saved_error saved;
    _tide_error_save(&saved);
    give_back_handle(arena, seg->pool, h, size); /* gives its bytes back */
    return _tide_error_restore(&saved);
  }
  note_handle(seg, at, n, h);
  return TIDE_OK;
}

/* Map `count` pages from page index `first` as planned by plan_run, then
 * make the whole run accessible with one call (the expensive one). All or
 * nothing. Every spare handle is mapped or given back. */
static int map_pieces(_tide_arena *arena, _tide_segment *seg, size_t first, size_t count,
                      size_t request, run_piece *pieces, uint8_t *spare_state) {
  struct tide_allocator *a = arena->alloc;
  size_t page = a->page_size, budgeted = 0, created = 0, done = 0;
  uintptr_t start = seg->base + first * page;
  size_t n = plan_run(arena, seg, start, count, pieces, spare_state, &budgeted);
  if (!n) return tide_last_status();
  give_back_spares(arena, spare_state, SPARE_UNUSED);
  /* Spare and orphan handles hold their bytes already; only new ones take budget. */
  int rc = hold_bytes(arena, seg->pool, budgeted * page, request);
  bool held = rc == TIDE_OK;
  for (size_t i = 0; i < n && !rc; i++) {
    if (pieces[i].spare != SIZE_MAX) spare_state[pieces[i].spare] = SPARE_MAPPED;
    rc = map_piece(arena, seg, first + done, &pieces[i], &created);
    if (!rc) done += pieces[i].pages;
  }
  give_back_spares(arena, spare_state, SPARE_PLANNED); /* those never reached */
  if (!rc) rc = _tide_mem_set_access(arena->alloc, start, count * page);
  if (rc) {
    _tide_saved_error saved;
    _tide_error_save(&saved);
    unmap_new_pages(arena, seg, first, done); /* each gives its bytes back */
    if (held) drop_bytes(arena, seg->pool, (budgeted - created) * page); /* never created */
    return _tide_error_restore(&saved);
  }
  seg->mapped += count * page;
  arena->stats.counters[_TIDE_CT_PAGES_MAPPED] += count;
  for (size_t i = 0; i < n; i++) arena->stats.counters[_TIDE_CT_MAPPINGS] += !pieces[i].orphan;
  _tide_trace(a, TIDE_TRACE_MAP, seg->pool + 1, start, count * page, arena->stream);
  return TIDE_OK;
}

/* Map `count` pages from page index `first`: spare, orphaned or new
 * handles (see plan_run), mapped, then made accessible. All or nothing. */
static int map_pages(_tide_arena *arena, _tide_segment *seg, size_t first, size_t count,
                     size_t request) {
  size_t page = arena->alloc->page_size;
  uintptr_t start = seg->base + first * page;
  /* Pages left mapped here by an earlier release go first; if the stream
   * cannot be waited for (held), the memory is not to be had now. */
  if (arena->nstale && _tide_stale_settle(arena, start, start + count * page, true))
    return _tide_error_set(TIDE_ERR_OOM,
                           "no free pages: those at %p are still mapped for work "
                           "queued on stream %p: %s",
                           (void *)start, (void *)arena->stream, tide_last_error());
  run_piece *pieces = malloc(count * sizeof *pieces);
  uint8_t *spare_state = calloc(arena->nspare_pages + 1, sizeof *spare_state);
  int rc = pieces && spare_state
               ? map_pieces(arena, seg, first, count, request, pieces, spare_state)
               : _tide_error_set(TIDE_ERR_OOM, "out of host memory to plan a growth");
  free(pieces);
  free(spare_state);
  return rc;
}

/* Merge free block `m` with the free blocks on either side of it. */
static _tide_block *merge_free_neighbours(_tide_arena *arena, _tide_block *m) {
  if (m->prev && m->prev->state == _TIDE_FREE) {
    _tide_block *p = m->prev;
    _tide_pool_remove(arena, p);
    p->size += m->size;
    p->next = m->next;
    if (m->next) m->next->prev = p;
    _tide_block_newest_stamp(p, m);
    _tide_block_delete(arena, m);
    m = p;
  }
  if (m->next && m->next->state == _TIDE_FREE) {
    _tide_block *n = m->next;
    _tide_pool_remove(arena, n);
    m->size += n->size;
    m->next = n->next;
    if (n->next) n->next->prev = m;
    _tide_block_newest_stamp(m, n);
    _tide_block_delete(arena, n);
  }
  return m;
}

/* Insert record `m` for [addr, addr+size) after block `after` (NULL: first
 * of the segment), splitting it off the unmapped block that held it. */
static void link_after(_tide_segment *seg, _tide_block *after, _tide_block *m, uintptr_t addr,
                       size_t size) {
  m->addr = addr;
  m->size = size;
  m->segment = seg;
  m->prev = after;
  m->next = after ? after->next : seg->first;
  if (m->next) m->next->prev = m;
  if (after)
    after->next = m;
  else
    seg->first = m;
}

/* Widen growth `g` to every orphaned mapping it overlaps, whole: growth
 * takes an orphan's handle as it is (its bytes are held already), and a
 * load handle's orphan may be longer than the pages the growth needs. The
 * orphan lies in the unmapped block (its pages were given back to it);
 * one that does not is left to plan_run's refusal. */
static void widen_to_orphans(const _tide_arena *arena, _tide_growth *g, size_t page) {
  const _tide_block *u = g->unmapped;
  uintptr_t base = u->segment->base, lo = base + g->first * page, hi = lo + g->count * page;
  for (bool widened = true; widened;) {
    widened = false;
    for (size_t i = 0; i < arena->norphans; i++) {
      const _tide_orphan_rec *o = &arena->orphans[i];
      uintptr_t olo = o->map_addr, ohi = olo + o->map_size;
      if (!olo || !o->handle || o->range || olo >= hi || ohi <= lo) continue;
      if (olo < u->addr || ohi > u->addr + u->size || (olo >= lo && ohi <= hi)) continue;
      lo = olo < lo ? olo : lo;
      hi = ohi > hi ? ohi : hi;
      widened = true;
    }
  }
  g->first = (lo - base) / page;
  g->count = (hi - lo) / page;
}

/* Map the pages of plan `g` and return the free block they join (merged
 * with the free blocks around them). The unmapped block keeps what is left
 * on either side, split in two when the pages lie in its middle. */
static int map_planned(_tide_arena *arena, _tide_pool *pool, const _tide_growth *plan,
                       size_t request, _tide_block **out) {
  _tide_growth widened = *plan, *g = &widened;
  if (arena->norphans) widen_to_orphans(arena, g, arena->alloc->page_size);
  _tide_block *u = g->unmapped;
  _tide_segment *seg = u->segment;
  size_t page = arena->alloc->page_size;
  uintptr_t lo = seg->base + g->first * page, hi = lo + g->count * page;
  uintptr_t end = u->addr + u->size;
  bool head = lo > u->addr, tail = hi < end;
  _tide_block *m = NULL, *t = NULL;
  if ((head || tail) && !(m = _tide_block_new(arena)))
    return _tide_error_set(TIDE_ERR_OOM, "out of host memory for block records");
  if (head && tail && !(t = _tide_block_new(arena))) {
    _tide_block_delete(arena, m);
    return _tide_error_set(TIDE_ERR_OOM, "out of host memory for block records");
  }
  int rc = map_pages(arena, seg, g->first, g->count, request);
  if (rc) {
    if (m) _tide_block_delete(arena, m);
    if (t) _tide_block_delete(arena, t);
    return rc;
  }
  if (!m) { /* the whole unmapped block */
    unmapped_remove(pool, u);
    m = u;
  } else if (!head) { /* its front */
    link_after(seg, u->prev, m, lo, hi - lo);
    u->addr = hi;
    u->size = end - hi;
  } else { /* its back, or its middle */
    u->size = lo - u->addr;
    link_after(seg, u, m, lo, hi - lo);
    if (t) {
      link_after(seg, m, t, hi, end - hi);
      t->state = _TIDE_UNMAPPED;
      unmapped_insert(pool, t);
    }
  }
  m->state = _TIDE_FREE;
  m->stamp = arena->clock;
  *out = merge_free_neighbours(arena, m);
  return TIDE_OK;
}

static size_t free_size(const _tide_block *b) { return b && b->state == _TIDE_FREE ? b->size : 0; }

/* Pages to map beside a free neighbour of `beside` bytes for `size` bytes
 * free. A free neighbour as large as `size` is one best fit refused (an
 * oversize block): growth then adds a page to it. */
static size_t pages_beside(size_t beside, size_t size, size_t page) {
  return beside < size ? round_up(size - beside, page) / page : 1;
}

/* The cheapest way to make `size` bytes free around unmapped block `u`:
 * pages at its front (joining the free block before it), at its back
 * (joining the free block after it), or all of it (joining both). Returns
 * the number of pages, 0 when `size` does not fit there. */
static size_t plan_at(_tide_block *u, size_t size, size_t page, _tide_growth *g) {
  _tide_segment *seg = u->segment;
  size_t left = free_size(u->prev), right = free_size(u->next), upages = u->size / page;
  size_t first = (u->addr - seg->base) / page;
  size_t front = pages_beside(left, size, page), back = pages_beside(right, size, page);
  size_t count = 0;
  if (front <= upages && front <= back) {
    count = front;
    g->first = first;
  } else if (back <= upages) {
    count = back;
    g->first = first + upages - back;
  } else if (left + u->size + right >= size) {
    count = upages;
    g->first = first;
  }
  g->unmapped = u;
  g->count = count;
  return count;
}

/* Growth `g` planned in units of `per_handle` pages, in pages. */
static void in_pages(_tide_growth *g, size_t per_handle) {
  g->first *= per_handle;
  g->count *= per_handle;
}

/* Whether stale pages lie in the pages growth `g` would map. */
static bool stale_in_the_way(const _tide_arena *arena, const _tide_growth *g, size_t page) {
  uintptr_t lo = g->unmapped->segment->base + g->first * page, hi = lo + g->count * page;
  for (size_t i = 0; i < arena->nstale; i++)
    if (stale_overlaps(&arena->stale[i], lo, hi)) return true;
  return false;
}

/* Growth `g` in unmapped block u is blocked by stale pages: the pages at
 * the other end of u instead (joining the free block after it, if any),
 * when they are not blocked too. A deferred release leaves its stale pages
 * where growth meets the unmapped space, so the far end of a large hole is
 * usually clear, and using it beats waiting for a stream that may be held
 * (that wait would fail the allocation with memory to spare). */
static void avoid_stale(const _tide_arena *arena, _tide_block *u, size_t size, size_t page,
                        size_t per_handle, _tide_growth *g) {
  size_t unit = page * per_handle;
  size_t right = free_size(u->next), upages = u->size / unit;
  size_t count = pages_beside(right, size, unit);
  if (count > upages) return;
  _tide_growth back = {
      .unmapped = u, .first = (u->addr - u->segment->base) / unit + upages - count, .count = count};
  in_pages(&back, per_handle);
  if (back.first != g->first && !stale_in_the_way(arena, &back, page)) *g = back;
}

int _tide_pool_plan_growth(const _tide_arena *arena, _tide_pool *pool, size_t size, size_t page,
                           _tide_growth *out) {
  *out = (_tide_growth){0};
  size_t per_handle = handle_pages_for(arena, pool, size), unit = page * per_handle;
  for (_tide_block *u = pool->unmapped; u; u = u->link_next) {
    _tide_growth g;
    if (u->segment->handle_pages != per_handle || !plan_at(u, size, unit, &g)) continue;
    in_pages(&g, per_handle);
    g.blocked = arena->nstale && stale_in_the_way(arena, &g, page);
    if (g.blocked) avoid_stale(arena, u, size, page, per_handle, &g);
    bool better = !out->count || (out->blocked && !g.blocked) ||
                  (out->blocked == g.blocked && g.count < out->count);
    if (better) *out = g;
  }
  return out->count ? TIDE_OK : TIDE_ERR_OOM;
}

/* Every place growth could use holds stale pages: wait for their stream.
 * If it cannot be waited for now (held by a long kernel, say), a new
 * virtual range has none, and the memory is there to be had. Otherwise the
 * plan stays, and mapping fails with why. */
static void settle_or_move(_tide_arena *arena, _tide_pool *pool, size_t size, size_t page,
                           _tide_growth *g) {
  uintptr_t lo = g->unmapped->segment->base + g->first * page;
  _tide_saved_error saved;
  _tide_error_save(&saved);
  _tide_growth moved;
  if (_tide_stale_settle(arena, lo, lo + g->count * page, true) != TIDE_OK &&
      new_expandable(arena, pool, size) == TIDE_OK &&
      _tide_pool_plan_growth(arena, pool, size, page, &moved) == TIDE_OK && !moved.blocked)
    *g = moved;
  _tide_error_restore(&saved);
}

static int grow_expandable(_tide_arena *arena, _tide_pool *pool, size_t size, _tide_block **out) {
  size_t page = arena->alloc->page_size;
  _tide_growth g;
  if (arena->nstale) _tide_stale_settle(arena, 0, UINTPTR_MAX, false); /* the idle ones */
  if (_tide_pool_plan_growth(arena, pool, size, page, &g)) {
    int rc = new_expandable(arena, pool, size);
    if (rc) return rc;
    if (_tide_pool_plan_growth(arena, pool, size, page, &g))
      return _tide_error_set(TIDE_ERR_OOM, "no virtual range can hold %zu bytes", size);
  }
  if (g.blocked) settle_or_move(arena, pool, size, page, &g);
  return map_planned(arena, pool, &g, size, out);
}

int _tide_pool_grow(_tide_arena *arena, _tide_pool *pool, size_t size, _tide_block **out) {
  struct tide_allocator *a = arena->alloc;
  size_t limit = atomic_load_explicit(&a->limit, memory_order_relaxed);
  if (size > limit) {
    char want[32], lim[32];
    return _tide_error_set(TIDE_ERR_OOM, "%s is more than the device or memory limit allows (%s)",
                           _tide_format_bytes(size, want, sizeof want),
                           _tide_format_bytes(limit, lim, sizeof lim));
  }
  /* A mapping the backend refused to undo may sit where growth would map. */
  if (TIDE_UNLIKELY(arena->norphans)) _tide_arena_retry_orphans(arena);
  if (a->conf.expandable_segments) return grow_expandable(arena, pool, size, out);
  return grow_fixed(arena, pool, size, out);
}

/* Unmap the handles of pages [first, first + count) (whole handles), one
 * call each. *done gets the pages unmapped, from the first. */
static int unmap_each(_tide_arena *arena, const _tide_segment *seg, size_t first, size_t count,
                      size_t *done) {
  size_t page = arena->alloc->page_size;
  *done = 0;
  for (size_t i = first, start, n; i < first + count; i += n) {
    n = _tide_handle_extent(seg, i, &start);
    int rc = _tide_mem_unmap(arena->alloc, seg->base + i * page, n * page);
    if (rc) return rc;
    *done += n;
    arena->stats.counters[_TIDE_CT_UNMAPPINGS]++;
  }
  return TIDE_OK;
}

/* Unmap the handles of pages [first, first + count) (whole handles) with
 * one call, or one a handle where load handles make their sizes differ.
 * *done gets the pages unmapped, from the first. */
static int unmap_handles(_tide_arena *arena, const _tide_segment *seg, size_t first, size_t count,
                         size_t *done) {
  if (seg->load_handles) return unmap_each(arena, seg, first, count, done);
  size_t n = seg->handle_pages, unmapped = 0;
  int rc = _tide_mem_unmap_run(arena->alloc, seg->base + first * arena->alloc->page_size,
                               n * arena->alloc->page_size, count / n, &unmapped);
  *done = unmapped * n;
  arena->stats.counters[_TIDE_CT_UNMAPPINGS] += unmapped;
  return rc;
}

/* Narrow [*lo, *hi) (whole units of handle_pages pages) to the handles that
 * lie inside it whole: a load handle reaching past either end stays. False
 * when none is left. */
static bool whole_handles(const _tide_segment *seg, size_t page, uintptr_t *lo, uintptr_t *hi) {
  size_t first = (*lo - seg->base) / page, end = (*hi - seg->base) / page, start;
  while (first < end) { /* past a handle that began before *lo */
    size_t n = _tide_handle_extent(seg, first, &start);
    if (start == first) break;
    first = start + n;
  }
  while (end > first) { /* back before a handle that ends after *hi */
    size_t n = _tide_handle_extent(seg, end - 1, &start);
    if (start + n == end) break;
    end = start;
  }
  *lo = seg->base + first * page;
  *hi = seg->base + end * page;
  return end > first;
}

/* Narrow [*lo, *hi) (whole handles) to the fewest handles at its low end
 * (`low`) or its high end that make `limit` bytes, one at least: a load
 * handle goes whole even where that is more than asked, or a free one might
 * never go (once it is unmapped, growth maps handles of the usual size). */
static void limit_handles(const _tide_segment *seg, size_t page, size_t limit, bool low,
                          uintptr_t *lo, uintptr_t *hi) {
  size_t first = (*lo - seg->base) / page, end = (*hi - seg->base) / page, start;
  if (low) {
    size_t at = first;
    do {
      at += _tide_handle_extent(seg, at, &start);
    } while (at < end && (at - first) * page < limit);
    *hi = seg->base + at * page;
  } else {
    size_t at = end;
    do {
      _tide_handle_extent(seg, at - 1, &start);
      at = start;
    } while (at > first && (end - at) * page < limit);
    *lo = seg->base + at * page;
  }
}

/* Unmap the whole pages inside free block `b` of an expandable segment, at
 * most `limit` bytes of them (a load handle goes whole). The block splits into a free head, the
 * unmapped middle (merged with unmapped neighbours) and a free tail. A
 * limited release takes the pages next to unmapped space, so that the hole
 * grows instead of a new one opening. `resume` gets the block after all of
 * them. */
static int release_expandable(_tide_arena *arena, _tide_block *b, size_t limit,
                              _tide_block **resume) {
  struct tide_allocator *a = arena->alloc;
  _tide_segment *seg = b->segment;
  _tide_pool *pool = &arena->pools[seg->pool];
  size_t page = a->page_size, unit = page * seg->handle_pages; /* a handle is unmapped whole */
  uintptr_t end = b->addr + b->size;
  uintptr_t lo = seg->base + round_up(b->addr - seg->base, unit);
  uintptr_t hi = seg->base + round_down(end - seg->base, unit);
  *resume = b->next;
  if (hi <= lo) return TIDE_OK;
  bool next_to_hole = b->prev && b->prev->state == _TIDE_UNMAPPED;
  if (seg->load_handles) {
    if (!whole_handles(seg, page, &lo, &hi)) return TIDE_OK;
    if (hi - lo > limit) limit_handles(seg, page, limit, next_to_hole, &lo, &hi);
  } else if (hi - lo > limit) {
    size_t keep = hi - lo - round_down(limit, unit);
    if (keep == hi - lo) return TIDE_OK;
    if (next_to_hole)
      hi -= keep;
    else
      lo += keep;
  }

  _tide_block *head = _tide_block_new(arena), *tail = _tide_block_new(arena);
  if (!head || !tail) {
    if (head) _tide_block_delete(arena, head);
    if (tail) _tide_block_delete(arena, tail);
    return _tide_error_set(TIDE_ERR_OOM, "out of host memory for block records");
  }
  size_t first = (lo - seg->base) / page, unmapped = 0;
  int rc = TIDE_OK;
  if (arena->defer_unmap) { /* left mapped until the stream is past them */
    size_t n = (hi - lo) / page;
    if (_tide_grow_array((void **)&arena->stale, &arena->stale_cap, arena->nstale + n,
                         sizeof *arena->stale)) {
      note_stale(arena, seg, first, n, b->stamp);
      unmapped = n;
    } else {
      rc = _tide_error_set(TIDE_ERR_OOM, "out of host memory for stale page records");
    }
  } else {
    rc = unmap_handles(arena, seg, first, (hi - lo) / page, &unmapped);
  }
  if (unmapped == 0) {
    _tide_block_delete(arena, head);
    _tide_block_delete(arena, tail);
    return rc;
  }
  _tide_saved_error saved;
  _tide_error_save(&saved);
  release_pages(arena, seg, first, unmapped);
  _tide_error_restore(&saved);
  seg->mapped -= unmapped * page;
  arena->stats.counters[_TIDE_CT_PAGES_UNMAPPED] += unmapped;
  _tide_trace(a, TIDE_TRACE_UNMAP, seg->pool + 1, lo, unmapped * page, arena->stream);

  _tide_pool_remove(arena, b);
  uintptr_t uhi = lo + unmapped * page;
  if (b->addr < lo) { /* free head before the hole */
    *head = (_tide_block){.addr = b->addr,
                          .size = lo - b->addr,
                          .segment = seg,
                          .state = _TIDE_FREE,
                          .stamp = b->stamp,
                          .prev = b->prev,
                          .next = b};
    if (b->prev)
      b->prev->next = head;
    else
      seg->first = head;
    b->prev = head;
  } else {
    _tide_block_delete(arena, head);
    head = NULL;
  }
  if (uhi < end) { /* free tail after it */
    *tail = (_tide_block){.addr = uhi,
                          .size = end - uhi,
                          .segment = seg,
                          .state = _TIDE_FREE,
                          .stamp = b->stamp,
                          .prev = b,
                          .next = b->next};
    if (b->next) b->next->prev = tail;
    b->next = tail;
  } else {
    _tide_block_delete(arena, tail);
    tail = NULL;
  }
  b->addr = lo;
  b->size = uhi - lo;
  b->state = _TIDE_UNMAPPED;
  bool listed = false;
  if (b->prev && b->prev->state == _TIDE_UNMAPPED) { /* the hole grows backwards */
    _tide_block *p = b->prev;
    p->size += b->size;
    p->next = b->next;
    if (b->next) b->next->prev = p;
    _tide_block_delete(arena, b);
    b = p;
    listed = true;
  }
  if (b->next && b->next->state == _TIDE_UNMAPPED) { /* ... and forwards */
    _tide_block *n = b->next;
    unmapped_remove(pool, n);
    b->size += n->size;
    b->next = n->next;
    if (n->next) n->next->prev = b;
    _tide_block_delete(arena, n);
  }
  if (!listed) unmapped_insert(pool, b);
  if (head) _tide_pool_insert(arena, head);
  if (tail) _tide_pool_insert(arena, tail);
  *resume = tail ? tail->next : b->next;
  return rc;
}

static bool fixed_and_whole(const _tide_block *b) {
  return !b->segment->expandable && !b->prev && !b->next;
}

int _tide_release_block(_tide_arena *arena, _tide_block *b, size_t limit) {
  if (b->state != _TIDE_FREE) return TIDE_OK;
  if (b->segment->expandable) {
    _tide_block *resume;
    return release_expandable(arena, b, limit, &resume);
  }
  return fixed_and_whole(b) ? release_fixed(arena, b) : TIDE_OK;
}

static bool orphan_inside(const _tide_arena *arena, const _tide_segment *seg) {
  for (size_t i = 0; i < arena->norphans; i++) {
    uintptr_t at = arena->orphans[i].map_addr;
    if (at && at >= seg->base && at < seg->base + seg->size) return true;
  }
  return false;
}

static bool stale_inside(const _tide_arena *arena, const _tide_segment *seg) {
  for (size_t i = 0; i < arena->nstale; i++)
    if (arena->stale[i].addr >= seg->base && arena->stale[i].addr < seg->base + seg->size)
      return true;
  return false;
}

static void release_empty_segment(_tide_arena *arena, _tide_pool *pool, _tide_segment *seg) {
  const _tide_backend *be = &arena->alloc->backend;
  _tide_block *b = seg->first;
  if (be->ops->unreserve(be->ctx, seg->base, seg->size))
    _tide_orphan(arena, seg->pool, 0, 0, 0, 0, seg->base, seg->size);
  unmapped_remove(pool, b);
  _tide_block_delete(arena, b);
  segment_counted(arena, seg, -1);
  segment_unlink(pool, seg);
  free(seg->pages);
  free(seg);
}

int _tide_pool_release_empty_segments(_tide_arena *arena, _tide_pool *pool) {
  _tide_segment *next;
  for (_tide_segment *seg = pool->segments; seg; seg = next) {
    next = seg->next;
    if (seg->expandable && seg->mapped == 0 && seg->first->state == _TIDE_UNMAPPED &&
        !seg->first->next && !orphan_inside(arena, seg) && !stale_inside(arena, seg))
      release_empty_segment(arena, pool, seg);
  }
  return TIDE_OK;
}

int _tide_pool_release_cached(_tide_arena *arena, _tide_pool *pool) {
  int first_error = TIDE_OK;
  _tide_saved_error saved = {0};
  _tide_segment *next_seg;
  for (_tide_segment *seg = pool->segments; seg; seg = next_seg) {
    next_seg = seg->next;
    int rc = TIDE_OK;
    if (!seg->expandable) {
      if (seg->first->state == _TIDE_FREE && fixed_and_whole(seg->first))
        rc = release_fixed(arena, seg->first);
    } else {
      for (_tide_block *b = seg->first, *resume; b; b = resume) {
        resume = b->next;
        if (b->state != _TIDE_FREE) continue;
        int brc = release_expandable(arena, b, SIZE_MAX, &resume);
        if (brc && !rc) rc = brc;
      }
    }
    if (rc && !first_error) {
      first_error = rc;
      _tide_error_save(&saved);
    }
  }
  _tide_pool_release_empty_segments(arena, pool);
  return first_error ? _tide_error_restore(&saved) : TIDE_OK;
}

/* ------------------------------------------------------------------------ */
/* Teardown                                                                  */
/* ------------------------------------------------------------------------ */

/* Unmap and release one handle at teardown; false (the error noted) when
 * the backend refuses: a handle still mapped is not released, and bytes
 * not released stay counted in the budget. */
static bool teardown_handle(_tide_arena *arena, uintptr_t at, size_t size, _tide_handle h,
                            _tide_first_error *first) {
  int rc = _tide_mem_unmap(arena->alloc, at, size);
  if (!rc) rc = _tide_mem_release(arena->alloc, h);
  if (rc) {
    _tide_error_prefix("at teardown, %zu bytes at %#lx", size, (unsigned long)at);
    _tide_first_error_note(first, rc);
    return false;
  }
  _tide_budget_give(arena->alloc, size);
  return true;
}

int _tide_pool_teardown(_tide_arena *arena, _tide_pool *pool) {
  const _tide_backend *be = &arena->alloc->backend;
  size_t page = arena->alloc->page_size;
  _tide_first_error first = {0};
  while (pool->segments) {
    _tide_segment *seg = pool->segments;
    bool all = true; /* every handle of the segment unmapped and released */
    if (seg->expandable) {
      for (size_t i = 0, start, n; i < seg->npages; i += n) {
        n = _tide_handle_extent(seg, i, &start);
        if (!seg->pages[i]) continue;
        all &= teardown_handle(arena, seg->base + i * page, n * page, seg->pages[i], &first);
      }
    } else {
      all = teardown_handle(arena, seg->base, seg->size, seg->handle, &first);
    }
    /* A range with a mapping left in it is not unreserved. */
    int rc = all ? be->ops->unreserve(be->ctx, seg->base, seg->size) : TIDE_OK;
    if (rc) {
      _tide_error_prefix("at teardown, the range of %zu bytes at %#lx", seg->size,
                         (unsigned long)seg->base);
      _tide_first_error_note(&first, rc);
    }
    segment_unlink(pool, seg);
    free(seg->pages);
    free(seg);
  }
  pool->unmapped = NULL;
  return _tide_first_error_end(&first);
}

/* ------------------------------------------------------------------------ */
/* For checkpoint restores (checkpoint.c)                                    */
/* ------------------------------------------------------------------------ */

void _tide_unmapped_insert(_tide_pool *pool, _tide_block *b) { unmapped_insert(pool, b); }

void _tide_unmapped_remove(_tide_pool *pool, _tide_block *b) { unmapped_remove(pool, b); }
