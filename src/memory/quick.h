/* quick.h: the quick path of an arena, inline so that tide_malloc and
 * tide_free (allocator.c) finish a hit without a call: taking back a quick
 * block (just freed on its own stream, kept whole; see _TIDE_QUICK_SLOTS)
 * and keeping one, with the stats each changes. arena.c does the rest
 * with the same functions. Everything here runs under the arena lock. */
#ifndef TIDE_QUICK_H
#define TIDE_QUICK_H

#include "memory/core.h"

/* ------------------------------------------------------------------------ */
/* Stats                                                                     */
/* ------------------------------------------------------------------------ */

/* An arena's allocated and requested bytes, allocations and oversize count
 * go on counting a quick block as allocated (with the size last asked for
 * it): these are its raw stats, and what is reported
 * (_tide_arena_stats_read) subtracts the blocks of the quick list, at most
 * eight. A quick hit then changes only the inactive-split stats, and the
 * requested bytes when a size other than the last one is asked for.
 *
 * The raw stats rise only while the quick list is empty: a block that was
 * not quick is counted after the list went to the bins (best fit merges it
 * first anyway; _tide_count_allocation makes sure), and a quick hit that
 * asks for more than its block's last size takes the last quick block (or
 * merges the others first). So a raw stat never exceeds its peak, and
 * its peak is exact: each value the peak took was the true one (no quick
 * block then), and a quick hit raises the true value at most back to the
 * raw one. */
static TIDE_ALWAYS_INLINE void _tide_count_raw(_tide_arena *arena, const _tide_block *b, int sign) {
  _tide_arena_stats *s = &arena->stats;
  int kind = b->segment->pool;
  if (sign > 0) {
    _tide_stat_up(s, _TIDE_ST_ALLOCATED, kind, (int64_t)b->size);
    _tide_stat_up(s, _TIDE_ST_REQUESTED, kind, (int64_t)b->requested);
    _tide_stat_up(s, _TIDE_ST_ALLOCATIONS, kind, 1);
  } else {
    _tide_stat_down(s, _TIDE_ST_ALLOCATED, kind, (int64_t)b->size);
    _tide_stat_down(s, _TIDE_ST_REQUESTED, kind, (int64_t)b->requested);
    _tide_stat_down(s, _TIDE_ST_ALLOCATIONS, kind, 1); /* active only falls: no peak */
  }
  if (TIDE_UNLIKELY(b->size >= arena->alloc->conf.max_split_size))
    s->counters[_TIDE_CT_OVERSIZE] += (uint64_t)(int64_t)sign;
}

/* Record the active peak (allocated plus pending) while blocks are pending. */
static TIDE_ALWAYS_INLINE void _tide_count_active(_tide_arena *arena) {
  if (TIDE_UNLIKELY(arena->stats.cur[_TIDE_ST_PENDING_BLOCKS][0] != 0))
    _tide_arena_track_active(arena);
}

/* With several arenas, the allocator-wide allocated bytes change too. */
static inline void _tide_count_shared(_tide_arena *arena, int64_t delta) {
  if (TIDE_UNLIKELY(atomic_load_explicit(&arena->alloc->shared_peak, memory_order_relaxed)))
    _tide_arena_publish(arena, delta);
}

/* Block b, not a quick one, allocated (b->requested set). */
static inline void _tide_count_allocation(_tide_arena *arena, const _tide_block *b) {
  if (TIDE_UNLIKELY(arena->nquick)) _tide_arena_flush_quick(arena); /* see above */
  _tide_count_raw(arena, b, +1);
  arena->stats.counters[_TIDE_CT_ALLOCS]++;
  _tide_count_active(arena);
  _tide_count_shared(arena, (int64_t)b->size);
}

/* Allocated block b freed, not into the quick list. */
static inline void _tide_count_free(_tide_arena *arena, const _tide_block *b) {
  _tide_count_raw(arena, b, -1);
  _tide_count_shared(arena, -(int64_t)b->size);
}

/* A quick block counts as free memory, as it would in a bin. */
static TIDE_ALWAYS_INLINE void _tide_count_cached(_tide_arena *arena, const _tide_block *b,
                                                  int sign) {
  if (!_tide_block_is_split(b)) return;
  int kind = b->segment->pool;
  if (sign > 0) {
    _tide_stat_up(&arena->stats, _TIDE_ST_INACTIVE_SPLIT, kind, (int64_t)b->size);
    _tide_stat_up(&arena->stats, _TIDE_ST_INACTIVE_SPLIT_BLOCKS, kind, 1);
  } else {
    _tide_stat_down(&arena->stats, _TIDE_ST_INACTIVE_SPLIT, kind, (int64_t)b->size);
    _tide_stat_down(&arena->stats, _TIDE_ST_INACTIVE_SPLIT_BLOCKS, kind, 1);
  }
}

/* Whether quick block b, out of the list, may be allocated for `size`
 * bytes without a rise of the raw requested bytes while other quick blocks
 * remain (see above). */
static TIDE_ALWAYS_INLINE bool _tide_quick_take_keeps_raw(const _tide_arena *arena,
                                                          const _tide_block *b, size_t size) {
  return size <= b->requested || arena->nquick == 0;
}

/* Quick block b, out of the list, allocated again for `size` bytes, which
 * _tide_quick_take_keeps_raw allows (the shared counter: _tide_hit_extras;
 * the active peak, while blocks are pending: _tide_count_active). */
static TIDE_ALWAYS_INLINE void _tide_count_quick_take(_tide_arena *arena, const _tide_block *b,
                                                      size_t size) {
  _tide_count_cached(arena, b, -1);
  if (TIDE_UNLIKELY(size != b->requested))
    _tide_stat_add(&arena->stats, _TIDE_ST_REQUESTED, b->segment->pool,
                   (int64_t)size - (int64_t)b->requested);
  arena->stats.counters[_TIDE_CT_ALLOCS]++;
}

/* Allocated block b freed into the quick list (the shared counter:
 * _tide_hit_extras). */
static TIDE_ALWAYS_INLINE void _tide_count_quick_put(_tide_arena *arena, const _tide_block *b) {
  _tide_count_cached(arena, b, +1);
}

/* ------------------------------------------------------------------------ */
/* The quick list                                                            */
/* ------------------------------------------------------------------------ */

static inline void _tide_quick_remove(_tide_arena *arena, unsigned i) {
  arena->nquick--;
  for (; i < arena->nquick; i++) arena->quick[i] = arena->quick[i + 1];
}

/* The most recently freed quick block of exactly `rounded` bytes, out of
 * the list (its stats are the taker's). Quick blocks stay in the live
 * map, so taking one back needs no map work. */
static inline _tide_block *_tide_quick_take(_tide_arena *arena, size_t rounded) {
  for (unsigned i = arena->nquick; i-- > 0;) {
    _tide_block *b = arena->quick[i];
    if (b->size != rounded) continue;
    _tide_quick_remove(arena, i);
    return b;
  }
  return NULL;
}

/* Keep b, allocated and just freed on its own stream, for reuse as it is;
 * the list has room. */
static TIDE_ALWAYS_INLINE void _tide_quick_put(_tide_arena *arena, _tide_block *b) {
  _tide_count_quick_put(arena, b);
  arena->freed_any = true; /* load_handles: the loading is over */
  b->state = _TIDE_QUICK;
  b->stamp = arena->clock;
  arena->quick[arena->nquick++] = b;
}

/* ------------------------------------------------------------------------ */
/* Hits                                                                      */
/* ------------------------------------------------------------------------ */

/* Hits leave two things to their caller, so that tide_malloc and tide_free
 * reach calls only in tail position (no registers to save on the way in):
 * the shared counter and the trace, both off unless several arenas exist or
 * tracing is on. _tide_hit_extras does them. */
static TIDE_ALWAYS_INLINE bool _tide_hit_has_extras(const struct tide_allocator *a) {
  return atomic_load_explicit(&a->hit_extras, memory_order_relaxed);
}

static inline void _tide_hit_extras(_tide_arena *arena, const _tide_block *b, bool alloc,
                                    tide_stream stream) {
  int64_t size = (int64_t)b->size;
  _tide_count_shared(arena, alloc ? size : -size);
  _tide_trace(arena->alloc, alloc ? TIDE_TRACE_ALLOC : TIDE_TRACE_FREE, b->segment->pool + 1,
              b->addr, b->size, stream);
}

/* Quick block b, out of the list, allocated for `size` bytes (extras: see
 * above; the active peak: _tide_count_quick_take). */
static TIDE_ALWAYS_INLINE void _tide_arena_hand_back(_tide_arena *arena, _tide_block *b,
                                                     size_t size) {
  _tide_count_quick_take(arena, b, size);
  b->state = _TIDE_ALLOCATED;
  b->requested = size;
  arena->clock++;
}

/* tide_malloc's hit: the newest quick block when it has exactly `rounded`
 * bytes, allocated (extras: see above), or NULL when the arena's full path
 * must run (another size, which may be an older quick block, pending
 * blocks, whose events it polls and whose active peak it keeps, a
 * destroyed stream). Only the newest: taking another shifts the list, a
 * loop the compiler makes a call of. */
static TIDE_ALWAYS_INLINE _tide_block *_tide_arena_malloc_quick(_tide_arena *arena, size_t size,
                                                                size_t rounded) {
  unsigned n = arena->nquick;
  /* Events wait only for pending blocks: no pending block, no events. */
  if (TIDE_UNLIKELY(n == 0 || arena->stats.cur[_TIDE_ST_PENDING_BLOCKS][0] != 0 ||
                    arena->stream_gone))
    return NULL;
  _tide_block *b = arena->quick[n - 1];
  if (TIDE_UNLIKELY(b->size != rounded)) return NULL;
  /* _tide_quick_take_keeps_raw, before b leaves the list: the full path
   * merges the others first. */
  if (TIDE_UNLIKELY(size > b->requested && n > 1)) return NULL;
  arena->nquick = n - 1;
  _tide_arena_hand_back(arena, b, size);
  return b;
}

/* tide_free's hit: allocated block b, freed on the arena's own stream (the
 * caller found the arena by that stream) and recorded on no other, kept as
 * a quick block (extras: see above). False when the full path
 * (_tide_arena_free) must run: other streams to order the free after, or a
 * full quick list. */
static TIDE_ALWAYS_INLINE bool _tide_arena_free_quick(_tide_arena *arena, _tide_block *b) {
  if (TIDE_UNLIKELY(b->nstreams || arena->nquick == _TIDE_QUICK_SLOTS)) return false;
  _tide_quick_put(arena, b); /* stays in the live map */
  return true;
}

#endif /* TIDE_QUICK_H */
