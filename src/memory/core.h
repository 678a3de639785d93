/* core.h: the memory layer — blocks, bins, the live map, segments, pools,
 * arenas and the allocator's state — and the functions of its files up to
 * arena.c, lowest first: trace.c, ptrmap.c, bins.c, device_memory.c,
 * stream_events.c, segment.c, arena.c. Its inline code is that of the
 * lowest files only (the live map's lookups, the trace's test), so that no
 * file reaches a higher one through it; arena.c's inline quick path is
 * quick.h's, the table of arenas arena_table.h's (tests/layers_check.sh,
 * HEADER_AT). It includes only the layers below (base/, backend/); the
 * features (features/features.h) and the API (api/) build on it.
 * Everything here is guarded by the lock of the arena that owns it, unless
 * a comment says otherwise. */
#ifndef TIDE_CORE_H
#define TIDE_CORE_H

#include <pthread.h>

#include "backend/backend.h"
#include "base/internal.h"
#include "base/lock.h"

/* ------------------------------------------------------------------------ */
/* Blocks                                                                    */
/* ------------------------------------------------------------------------ */

enum {
  _TIDE_SMALL = 0, /* pool index inside an arena; stats use it + 1 */
  _TIDE_LARGE = 1,
};

typedef enum _tide_block_state {
  _TIDE_FREE = 0,      /* mapped and in a bin */
  _TIDE_ALLOCATED = 1, /* handed to the user, in the arena's live map */
  _TIDE_PENDING = 2,   /* freed, waiting for events of other streams */
  _TIDE_UNMAPPED = 3,  /* virtual space without pages (expandable segments) */
  _TIDE_QUICK = 4,     /* just freed, kept unmerged for a request of its size */
} _tide_block_state;

#define _TIDE_INLINE_STREAMS 2

typedef struct _tide_block {
  uintptr_t addr;
  size_t size;
  size_t requested;                          /* allocated blocks: what the user asked for */
  struct _tide_block *prev, *next;           /* neighbours in address order, same segment */
  struct _tide_block *link_prev, *link_next; /* bin, unmapped or pending list */
  struct _tide_segment *segment;
  uint64_t stamp;   /* arena clock when it became free (gc age) */
  uint32_t bin;     /* free blocks: their bin */
  uint8_t state;    /* _tide_block_state */
  uint8_t nstreams; /* streams recorded with tide_record_stream */
  uint16_t events;  /* pending: events still outstanding */
  tide_stream streams[_TIDE_INLINE_STREAMS];
  tide_stream *more_streams; /* beyond the inline ones (malloc'd) */
  uint32_t more_cap;
} _tide_block;

/* A free block that absorbs another keeps the later of their stamps: queued
 * work may touch any of its pages until the stream is past the newest free
 * (stale pages are unmapped by that rule, see arena.c). */
static inline void _tide_block_newest_stamp(_tide_block *into, const _tide_block *from) {
  if (from->stamp > into->stamp) into->stamp = from->stamp;
}

static inline bool _tide_block_is_split(const _tide_block *b) {
  return b->prev != NULL || b->next != NULL;
}

/* ------------------------------------------------------------------------ */
/* Bins: free mapped blocks by size, for best fit (bins.c)                   */
/* ------------------------------------------------------------------------ */

/* Sizes are multiples of 512 B. Below 1 MiB every size has its own bin (all
 * blocks in it are the same size, so any of them is the best fit); above,
 * each power of two is cut into 64 bins (1.6% wide) that are searched for
 * the smallest fitting block, lowest address first. A two-level bitmap finds
 * the next non-empty bin in a few instructions. */
#define _TIDE_EXACT_BINS 2048u
#define _TIDE_SUB_BITS 6u
#define _TIDE_BIN_COUNT (_TIDE_EXACT_BINS + 33u * (1u << _TIDE_SUB_BITS))
#define _TIDE_BIN_WORDS ((_TIDE_BIN_COUNT + 63u) / 64u)

typedef struct _tide_bins {
  uint64_t summary[(_TIDE_BIN_WORDS + 63u) / 64u];
  uint64_t map[_TIDE_BIN_WORDS];
  _tide_block *head[_TIDE_BIN_COUNT];
  size_t count; /* blocks in all bins */
} _tide_bins;

uint32_t _tide_bin_of(size_t size);
void _tide_bins_insert(_tide_bins *bins, _tide_block *b);
void _tide_bins_remove(_tide_bins *bins, _tide_block *b);
/* The smallest block of at least `size` bytes (lowest address among equals
 * in the graded bins), or NULL. Not removed. */
_tide_block *_tide_bins_best_fit(const _tide_bins *bins, size_t size);
/* The largest free block, or NULL. */
_tide_block *_tide_bins_largest(const _tide_bins *bins);
/* Up to `cap` free blocks of the bins into `out` (cost: the free blocks, not
 * every block of the segments); returns how many. */
size_t _tide_bins_collect(const _tide_bins *bins, _tide_block **out, size_t cap);

/* ------------------------------------------------------------------------ */
/* The live map: allocated blocks by address (ptrmap.c)                      */
/* ------------------------------------------------------------------------ */

/* Allocated blocks, and quick blocks (freed, kept whole for reuse). A key
 * and its block share a slot: a lookup reads one cache line. */
typedef struct _tide_ptrmap_entry {
  uintptr_t key; /* 0: empty */
  _tide_block *value;
} _tide_ptrmap_entry;

typedef struct _tide_ptrmap {
  _tide_ptrmap_entry *slots;
  size_t mask;    /* capacity - 1 */
  unsigned shift; /* 64 - log2(capacity) */
  size_t count;
} _tide_ptrmap;

int _tide_ptrmap_init(_tide_ptrmap *m);
void _tide_ptrmap_destroy(_tide_ptrmap *m);
/* Double the table (ptrmap.c). */
int _tide_ptrmap_grow(_tide_ptrmap *m);
/* Close the hole left at slot i by a removal (ptrmap.c). */
void _tide_ptrmap_close_hole(_tide_ptrmap *m, size_t i);

static inline size_t _tide_ptrmap_slot(const _tide_ptrmap *m, uintptr_t addr) {
  /* Fibonacci hashing: the top bits of the product mix every bit of the
   * address (the 512-byte alignment's zeros included, harmlessly). */
  return (size_t)(((uint64_t)addr * UINT64_C(0x9E3779B97F4A7C15)) >> m->shift);
}

/* Capacity for one more entry, so that an insert after it cannot fail; the
 * load stays at most one half, so probes stay short. */
static inline int _tide_ptrmap_reserve_one(_tide_ptrmap *m) {
  if (TIDE_UNLIKELY((m->count + 1) * 2 > m->mask + 1)) return _tide_ptrmap_grow(m);
  return TIDE_OK;
}

/* Insert after _tide_ptrmap_reserve_one succeeded. */
static inline void _tide_ptrmap_put(_tide_ptrmap *m, _tide_block *b) {
  size_t i = _tide_ptrmap_slot(m, b->addr);
  while (m->slots[i].key) i = (i + 1) & m->mask;
  m->slots[i].key = b->addr;
  m->slots[i].value = b;
  m->count++;
}

static inline _tide_block *_tide_ptrmap_find(const _tide_ptrmap *m, uintptr_t addr) {
  if (TIDE_UNLIKELY(!addr)) return NULL;
  size_t i = _tide_ptrmap_slot(m, addr);
  if (TIDE_LIKELY(m->slots[i].key == addr)) return m->slots[i].value; /* most lookups */
  while (m->slots[i].key) {
    i = (i + 1) & m->mask;
    if (m->slots[i].key == addr) return m->slots[i].value;
  }
  return NULL;
}

static inline _tide_block *_tide_ptrmap_remove(_tide_ptrmap *m, uintptr_t addr) {
  if (TIDE_UNLIKELY(!addr)) return NULL;
  size_t i = _tide_ptrmap_slot(m, addr);
  while (m->slots[i].key != addr) {
    if (!m->slots[i].key) return NULL;
    i = (i + 1) & m->mask;
  }
  _tide_block *found = m->slots[i].value;
  _tide_ptrmap_close_hole(m, i);
  m->count--;
  return found;
}

/* ------------------------------------------------------------------------ */
/* Segments and pools (segment.c)                                            */
/* ------------------------------------------------------------------------ */

typedef struct _tide_segment {
  uintptr_t base;
  size_t size;   /* virtual bytes; fixed segments: also physical */
  size_t mapped; /* physical bytes held */
  struct _tide_arena *arena;
  struct _tide_segment *prev, *next; /* the pool's segments */
  _tide_handle *pages;               /* expandable: a handle per page, 0 when unmapped */
  size_t npages;
  /* expandable: the pages each of its handles holds: 1, or, in a segment
   * for large requests, the allocator's handle_pages; then mapped memory is
   * whole handles at multiples of handle_pages pages from the base. A load
   * handle (load_handles) is a whole number of those, from such a multiple:
   * the page table names it on each of its pages. */
  uint16_t handle_pages;
  uint32_t load_handles; /* expandable: load handles mapped in it now */
  _tide_handle handle;   /* fixed: its one handle */
  _tide_block *first;    /* lowest block; blocks cover [base, base+size) */
  uint8_t pool;          /* _TIDE_SMALL or _TIDE_LARGE */
  uint8_t expandable;
} _tide_segment;

typedef struct _tide_pool {
  _tide_bins bins;       /* free mapped blocks */
  _tide_block *unmapped; /* unmapped blocks, address order */
  _tide_segment *segments;
  uint8_t kind; /* _TIDE_SMALL or _TIDE_LARGE */
} _tide_pool;

/* ------------------------------------------------------------------------ */
/* Statistics (stats.c)                                                      */
/* ------------------------------------------------------------------------ */

enum {
  _TIDE_ST_ALLOCATED = 0,
  _TIDE_ST_REQUESTED,
  _TIDE_ST_PENDING, /* freed, waiting on streams (active = allocated + pending) */
  _TIDE_ST_INACTIVE_SPLIT,
  _TIDE_ST_RESERVED,
  _TIDE_ST_ALLOCATIONS,
  _TIDE_ST_PENDING_BLOCKS,
  _TIDE_ST_INACTIVE_SPLIT_BLOCKS,
  _TIDE_ST_SEGMENTS,
  _TIDE_ST_COUNT
};

enum {
  _TIDE_CT_ALLOCS = 0,
  _TIDE_CT_FREES,
  _TIDE_CT_PAGES_MAPPED,
  _TIDE_CT_PAGES_UNMAPPED,
  _TIDE_CT_SEGMENTS_CREATED,
  _TIDE_CT_SEGMENTS_RELEASED,
  _TIDE_CT_DEVICE_ALLOC,
  _TIDE_CT_DEVICE_FREE,
  _TIDE_CT_OVERSIZE,
  _TIDE_CT_MAPPINGS,   /* handles mapped into expandable segments */
  _TIDE_CT_UNMAPPINGS, /* and unmapped from them (or from where they were) */
  _TIDE_CT_COUNT
};

/* One arena's stats: [stat][0 all, 1 small, 2 large]. Active bytes and
 * blocks are allocated plus pending; their peak is the allocated peak except
 * while blocks are pending, when active_peak records it (so the common case,
 * nothing pending, costs nothing extra). */
typedef struct _tide_arena_stats {
  int64_t cur[_TIDE_ST_COUNT][TIDE_POOL_KINDS];
  int64_t peak[_TIDE_ST_COUNT][TIDE_POOL_KINDS];
  int64_t active_peak[2][TIDE_POOL_KINDS]; /* [0] bytes, [1] blocks */
  uint64_t counters[_TIDE_CT_COUNT];
} _tide_arena_stats;

/* Record the active peak after a change, while blocks are pending. */
static inline void _tide_track_active(_tide_arena_stats *s) {
  if (TIDE_LIKELY(s->cur[_TIDE_ST_PENDING_BLOCKS][0] == 0)) return;
  for (int p = 0; p < TIDE_POOL_KINDS; p++) {
    int64_t bytes = s->cur[_TIDE_ST_ALLOCATED][p] + s->cur[_TIDE_ST_PENDING][p];
    int64_t blocks = s->cur[_TIDE_ST_ALLOCATIONS][p] + s->cur[_TIDE_ST_PENDING_BLOCKS][p];
    if (bytes > s->active_peak[0][p]) s->active_peak[0][p] = bytes;
    if (blocks > s->active_peak[1][p]) s->active_peak[1][p] = blocks;
  }
}

/* A stat of the whole allocator that must be exact across arenas. */
typedef struct _tide_global_stat {
  _Atomic int64_t cur;
  _Atomic int64_t peak;
} _tide_global_stat;

static inline void _tide_global_add(_tide_global_stat *g, int64_t delta) {
  int64_t now = atomic_fetch_add_explicit(&g->cur, delta, memory_order_relaxed) + delta;
  int64_t peak = atomic_load_explicit(&g->peak, memory_order_relaxed);
  while (now > peak && !atomic_compare_exchange_weak_explicit(
                           &g->peak, &peak, now, memory_order_relaxed, memory_order_relaxed)) {
  }
}

/* Change a stat of pool `pool` (and of all pools); a rise may set a peak. */
static inline void _tide_stat_up(_tide_arena_stats *s, int stat, int pool, int64_t delta) {
  int64_t all = s->cur[stat][0] += delta;
  int64_t one = s->cur[stat][pool + 1] += delta;
  if (all > s->peak[stat][0]) s->peak[stat][0] = all;
  if (one > s->peak[stat][pool + 1]) s->peak[stat][pool + 1] = one;
}

static inline void _tide_stat_down(_tide_arena_stats *s, int stat, int pool, int64_t delta) {
  s->cur[stat][0] -= delta;
  s->cur[stat][pool + 1] -= delta;
}

static inline void _tide_stat_add(_tide_arena_stats *s, int stat, int pool, int64_t delta) {
  if (delta >= 0)
    _tide_stat_up(s, stat, pool, delta);
  else
    _tide_stat_down(s, stat, pool, -delta);
}

/* ------------------------------------------------------------------------ */
/* Arenas (arena.c)                                                          */
/* ------------------------------------------------------------------------ */

/* A free of a block used by other streams: the event that must complete. */
typedef struct _tide_pending {
  _tide_event event;
  _tide_block *block;
  tide_stream stream;
} _tide_pending;

typedef struct _tide_orphan_rec {
  uintptr_t map_addr;
  size_t map_size;
  _tide_handle handle;
  size_t handle_size;
  uintptr_t range;
  size_t range_size;
  int pool;
} _tide_orphan_rec;

typedef struct _tide_block_chunk {
  struct _tide_block_chunk *next;
  _tide_block blocks[];
} _tide_block_chunk;

/* Blocks freed last, kept whole and unmerged: a request of exactly their
 * size (the commonest pattern: the same shapes every step) takes one back
 * without splitting or merging anything. A block of exactly the requested
 * size is a best fit, so this changes no placement decision: any other
 * request merges them into the bins first. */
#define _TIDE_QUICK_SLOTS 8

/* Idle marks an arena keeps in flight (see idle_marks). */
#define _TIDE_IDLE_MARKS 4

typedef struct _tide_arena {
  _tide_lock lock;
  unsigned nquick;
  bool freed_any;                        /* a block was freed here: the stream's loading is over */
  _tide_block *quick[_TIDE_QUICK_SLOTS]; /* oldest first */
  tide_stream stream;
  bool stream_gone; /* destroyed through tide_stream_destroy */
  struct tide_allocator *alloc;
  _tide_pool pools[2];
  _tide_ptrmap live;
  _tide_block *spare; /* unused block records */
  _tide_block_chunk *chunks;
  _tide_pending *pending; /* events to wait for, in record order */
  size_t npending, pending_cap;
  _tide_event *spare_events; /* created events ready for reuse */
  size_t nspare_events, spare_events_cap;
  _tide_orphan_rec *orphans; /* what the backend failed to give back */
  /* Pages unmapped to make room for a growth that follows at once: their
   * physical handles are mapped again instead of released and created anew
   * (each of those is a backend call). Still counted as reserved. */
  struct _tide_spare_page {
    _tide_handle handle;
    size_t size; /* bytes: one page or several */
    int pool;
  } * spare_pages;
  size_t nspare_pages, spare_pages_cap;
  bool keep_spare_pages; /* release_pages keeps handles instead of releasing */
  size_t norphans, orphans_cap;
  /* Orphans that could not be recorded (no host memory for the list): held
   * by the backend until the process ends, reported by tide_check and
   * tide_destroy. */
  size_t orphans_lost;
  uint64_t clock; /* allocations so far: the gc clock */
  /* Events recorded on the arena's stream when pages had to be unmapped to
   * make room, each with the clock then (oldest first). Once one completes,
   * a free block stamped before its clock is touched by no queued work, so
   * its pages can be unmapped without waiting for the stream. */
  struct _tide_idle_mark {
    _tide_event event;
    uint64_t clock;
  } idle_marks[_TIDE_IDLE_MARKS];
  unsigned nidle_marks;
  uint64_t idle_before; /* free blocks stamped before this clock are idle */
  /* Allocations past the quick blocks until the next asks the device how
   * much it has free, and the bytes others held at the last such check
   * (arena.c, yield_to_device). */
  unsigned device_check_countdown;
  int64_t others_held;
  /* Pages unmapped from their segment without waiting for the stream (see
   * release_for): still mapped at their old address until work queued
   * before their free is done (stamp < idle_before), their handles mapped
   * again by growth meanwhile, or, once `owned`, released after the unmap
   * (counted as reserved until then). */
  struct _tide_stale_page {
    uintptr_t addr;
    size_t size; /* of the mapping: its handle's */
    _tide_handle handle;
    uint64_t stamp;
    int pool;
    bool owned;
  } * stale;
  size_t nstale, stale_cap;
  bool defer_unmap; /* release_expandable leaves the pages mapped as stale ones */
  _tide_arena_stats stats;
  int64_t unpublished; /* allocated bytes not yet added to the allocator's */
  /* Capture pools (pool.c): the blocks a stream allocated in one pool have
   * an arena of their own, so a pool never shares memory with the stream's
   * arena and stream-ordered reuse works inside it as anywhere. */
  uint64_t pool_id;       /* 0: the stream's own arena; _TIDE_UNUSED_ARENA: none */
  struct tide_pool *pool; /* the capture pool (NULL for the stream's own arena) */
  bool keep_cache;        /* its pool has users: free memory may back graph replays */
} _tide_arena;

/* The pool_id of an arena left by a pool that is gone, for the next pool. */
#define _TIDE_UNUSED_ARENA UINT64_MAX

/* With several streams, each arena adds its allocated bytes to the shared
 * allocator-wide counter once the change since the last addition reaches
 * this many bytes: streams on different threads then rarely write a shared
 * cache line, and the allocator-wide peak is within this much per stream of
 * the exact value (reads first add every arena's remainder). */
#define _TIDE_PUBLISH_BYTES ((int64_t)2 << 20)
void _tide_arena_publish(_tide_arena *arena, int64_t delta);
/* Add the arena's unpublished bytes to the shared counters now. */
void _tide_arena_publish_now(_tide_arena *arena);
/* The live (allocated) block at addr, or NULL: quick blocks, which share the
 * live map, are not live. */
static inline _tide_block *_tide_arena_live(_tide_arena *arena, uintptr_t addr) {
  _tide_block *b = _tide_ptrmap_find(&arena->live, addr);
  return b && b->state == _TIDE_ALLOCATED ? b : NULL;
}

int _tide_arena_create(struct tide_allocator *a, tide_stream stream, _tide_arena **out);
/* Release everything the arena holds. Returns how many blocks were still
 * allocated or pending; what the backend refused to give back (and orphans
 * lost) is noted in *first. */
size_t _tide_arena_destroy(_tide_arena *arena, _tide_first_error *first);

/* Block records (bins.c), under the arena lock; _tide_blocks_free_all frees
 * every record of a dying arena. */
_tide_block *_tide_block_new(_tide_arena *arena);
void _tide_block_delete(_tide_arena *arena, _tide_block *b);
void _tide_blocks_free_all(_tide_arena *arena);
/* Put a free block into / take it out of its pool's bins, keeping the
 * inactive-split stats. */
void _tide_pool_insert(_tide_arena *arena, _tide_block *b);
void _tide_pool_remove(_tide_arena *arena, _tide_block *b);
/* Keep what the backend failed to give back, to retry later: a mapping to
 * unmap, a handle to release (its bytes stay reserved until then), a range
 * to unreserve. Zero fields mean "nothing of that kind". */
void _tide_orphan(_tide_arena *arena, int pool, uintptr_t map_addr, size_t map_size,
                  _tide_handle handle, size_t handle_size, uintptr_t range, size_t range_size);
int _tide_arena_malloc(_tide_arena *arena, size_t size, size_t rounded, void **out);
/* The arena's stats as reported: its raw stats less the quick blocks,
 * which they count as allocated (quick.h). */
void _tide_arena_stats_read(const _tide_arena *arena, _tide_arena_stats *out);
/* Record the active peak (allocated plus pending, of the stats as
 * reported) while blocks are pending. */
void _tide_arena_track_active(_tide_arena *arena);
/* Return a free (or just unmapped) block to its pool: merge, bin. */
void _tide_arena_free_block(_tide_arena *arena, _tide_block *b);
int _tide_arena_free(_tide_arena *arena, _tide_block *b, tide_stream stream);
/* Merge the quick blocks into the bins. */
void _tide_arena_flush_quick(_tide_arena *arena);
/* Complete what events allow; with `wait`, wait for all of them. */
int _tide_arena_process_events(_tide_arena *arena, bool wait);
/* Return cached memory: whole free fixed segments and whole free pages. */
int _tide_arena_release_cached(_tide_arena *arena);
/* Return cached memory, oldest first, until reserved falls to `target`. */
int _tide_arena_collect_garbage(_tide_arena *arena, size_t target);
/* The block of the arena whose range holds addr, or NULL. */
const _tide_block *_tide_arena_containing_block(const _tide_arena *arena, uintptr_t addr);
/* A user pointer that is not a live block: classify it for the message. */
int _tide_arena_explain_pointer(_tide_arena *arena, uintptr_t addr);

/* For capture pools (pool.c, checkpoint.c), under the arena lock. A free
 * deferred by a capture: counted as freed, out of the live map, pending
 * (but on no event) until _tide_arena_finish_deferred orders it after the
 * streams it was freed on and recorded on (it may then wait on events).
 * A free on a stream that does not exist is refused, the block unchanged. */
int _tide_arena_defer_free(_tide_arena *arena, _tide_block *b, tide_stream stream);
int _tide_arena_finish_deferred(_tide_arena *arena, _tide_block *b, tide_stream stream);
/* A deferred free whose every use the capture's graph orders before the
 * arena's stream's next work: free now, with no event (one recorded on a
 * capturing stream would join the graph and never complete). */
void _tide_arena_finish_ordered(_tide_arena *arena, _tide_block *b);
/* Count block b, linked in its segment, as allocated (restored by a
 * checkpoint) or as freed (released by one); the live map is the caller's. */
void _tide_arena_count_restored(_tide_arena *arena, _tide_block *b, size_t requested);
void _tide_arena_count_released(_tide_arena *arena, _tide_block *b);

/* How far the arena's stream has run (stream_events.c), under the arena
 * lock. A spare event, or a new one; give it back for reuse (destroyed
 * when there is no room to keep it). */
int _tide_event_take(_tide_arena *arena, _tide_event *out);
void _tide_event_give(_tide_arena *arena, _tide_event e);
/* Whether idle marks may be recorded on the arena's stream now (under
 * capture_detection, a driver query: ask once per release). */
bool _tide_idle_marks_usable(const _tide_arena *arena);
/* Retire the idle marks whose events completed, moving idle_before up to
 * their clocks. */
void _tide_idle_marks_poll(_tide_arena *arena);
/* Record an idle mark now, when there is room and marks are `usable`
 * (_tide_idle_marks_usable); best effort. */
void _tide_idle_mark_add(_tide_arena *arena, bool usable);
/* Wait for the arena's stream: work queued on it may still touch free
 * blocks (a block freed on its own stream is free at once). A capture
 * pool's arena waits for the whole device instead (graphs replay on any
 * stream), and not while a capture is watched (TIDE_ERR_NOT_READY). After
 * it, everything freed so far is idle. */
int _tide_stream_settle(_tide_arena *arena);
/* Block until a block freed at `stamp` is idle: wait for an idle mark after
 * its free, or without one, for the stream. */
int _tide_idle_wait(_tide_arena *arena, uint64_t stamp);

/* Segments (segment.c), under the arena lock. */
size_t _tide_round_size(const _tide_conf_values *conf, size_t size);
size_t _tide_fixed_segment_size(size_t rounded, size_t granularity);
/* A free mapped block of at least `size` bytes made by new memory: a new
 * fixed segment, or pages mapped into an expandable one. Not in a bin. */
int _tide_pool_grow(_tide_arena *arena, _tide_pool *pool, size_t size, _tide_block **out);
/* Where growth by `size` bytes would map pages: the unmapped block, and the
 * run of pages in it that, with the free blocks on either side, makes room
 * for `size` bytes. Of all places, the one that maps the fewest pages (the
 * lowest among equals). */
typedef struct _tide_growth {
  _tide_block *unmapped;
  size_t first, count; /* page index in the segment, pages to map */
  bool blocked;        /* stale pages lie there: mapping waits for the stream */
} _tide_growth;
/* TIDE_ERR_OOM (no message) when no unmapped block of the pool can hold it.
 * Places without stale pages (of `arena`) win over places with them. */
int _tide_pool_plan_growth(const _tide_arena *arena, _tide_pool *pool, size_t size, size_t page,
                           _tide_growth *out);
/* Unmap the whole pages inside a free block of an expandable segment (at
 * most `limit` bytes of them), or release the fixed segment it fills. */
int _tide_release_block(_tide_arena *arena, _tide_block *b, size_t limit);
/* Release every segment of the pool (allocator teardown). */
int _tide_pool_teardown(_tide_arena *arena, _tide_pool *pool);
/* The pages of the handle that maps page i of expandable segment seg, from
 * page *start: seg->handle_pages, or more for a load handle. */
size_t _tide_handle_extent(const _tide_segment *seg, size_t i, size_t *start);
/* Release every whole free page and fixed segment of the pool. */
int _tide_pool_release_cached(_tide_arena *arena, _tide_pool *pool);
/* Release expandable segments that have no page mapped. */
int _tide_pool_release_empty_segments(_tide_arena *arena, _tide_pool *pool);
/* Give back the spare pages growth did not use. */
void _tide_arena_release_spare_pages(_tide_arena *arena);
/* Unmap the stale pages in [lo, hi) stamped before `idle_before`; returns
 * how many in the range are left. A refused unmap keeps its page, and the
 * first such failure's status goes to *failed with its message (else the
 * thread's error is left as it was) (segment.c). */
size_t _tide_stale_unmap(_tide_arena *arena, uintptr_t lo, uintptr_t hi, uint64_t idle_before,
                         int *failed);
/* Unmap every stale page at once and give back the owned handles
 * (teardown, or once the stream is known idle). */
void _tide_stale_drop_all(_tide_arena *arena);
/* Unmap the stale pages in [lo, hi) that are idle; with `wait`, wait for
 * the stream first if some are not, so that none is left, or fail with
 * why (a refused unmap, or TIDE_ERR_NOT_READY when the stream cannot be
 * waited for). Without `wait` it is best effort and keeps the thread's
 * error. */
int _tide_stale_settle(_tide_arena *arena, uintptr_t lo, uintptr_t hi, bool wait);
/* Try again to give back what the backend refused earlier. */
int _tide_arena_retry_orphans(_tide_arena *arena);
/* Whether an orphaned mapping overlaps [lo, hi) (segment.c). */
bool _tide_orphan_mapped_in(const _tide_arena *arena, uintptr_t lo, uintptr_t hi);
/* The address-ordered list of unmapped blocks of a pool. */
void _tide_unmapped_insert(_tide_pool *pool, _tide_block *b);
void _tide_unmapped_remove(_tide_pool *pool, _tide_block *b);

/* ------------------------------------------------------------------------ */
/* Capture state (its pools, captures and deferred frees are pool.c's)       */
/* ------------------------------------------------------------------------ */

/* What the allocator holds of capture pools (features/features.h has the
 * types it points to); arenas only know their pool's id (pool_id). */
typedef struct _tide_captures {
  pthread_mutex_t mutex; /* before arenas_mutex and arena locks, never after */
  struct _tide_capture *active;
  struct tide_pool *pools;
  struct _tide_deferred *deferred;
  int unlisted; /* deferrals and retries in progress: their frees may be off the list */
  int watchers; /* tide_capture_watch_begin calls not yet ended: captures routed elsewhere */
  uint64_t next_pool_id;
  struct _tide_reach *reach; /* graph nodes reached per capture and stream (graph_reuse.c) */
} _tide_captures;

/* Whether `stream` is being captured now, and the id of its capture (the
 * backend's answer; a backend without captures says no). */
static inline int _tide_capture_status(const _tide_backend *be, tide_stream stream, bool *capturing,
                                       uint64_t *id) {
  *capturing = false;
  *id = 0;
  if (!be->ops->stream_capture_status) return TIDE_OK;
  return be->ops->stream_capture_status(be->ctx, stream, capturing, id);
}

/* With capture_detection and nothing watched: whether a call on `stream`
 * must take the capture path (it is being captured, or asking failed, which
 * that path reports). */
static inline bool _tide_capture_detected(const _tide_backend *be, tide_stream stream) {
  bool capturing;
  uint64_t id;
  return _tide_capture_status(be, stream, &capturing, &id) != TIDE_OK || capturing;
}

/* ------------------------------------------------------------------------ */
/* The allocator's state (its entry points: allocator.c)                     */
/* ------------------------------------------------------------------------ */

typedef struct _tide_trace_ring {
  _tide_lock lock;
  tide_trace_event *events;
  size_t cap;
  uint64_t next; /* sequence number of the next event */
} _tide_trace_ring;

#define _TIDE_MAGIC 0x7469646541l /* "tideA" */

/* A stream and its own arena, in the allocator's table of streams (below). */
#define _TIDE_STREAM_SLOTS 64u
typedef struct _tide_stream_slot {
  _Atomic(tide_stream) stream;
  _Atomic(struct _tide_arena *) arena; /* NULL: a free slot; set last, never changed */
} _tide_stream_slot;

struct tide_allocator {
  long magic;
  uint64_t id; /* unique for the process: arena caches key on it */
  int device;
  tide_config *config;
  _tide_conf_values conf; /* a copy of the resolved values */
  _tide_backend backend;
  size_t granularity;
  size_t page_size;
  size_t handle_pages;       /* pages of a large handle (handle_size_mb; 1: none) */
  size_t handle_threshold;   /* reserved bytes an arena holds before it makes large handles */
  bool plain_rounding;       /* no roundup_power2_divisions: sizes round to 512 B */
  size_t total_memory;       /* the device's */
  _Atomic size_t limit;      /* reserved may not exceed this */
  _tide_lock limits_lock;    /* the setters of memory_fraction and memory_limit */
  atomic_bool shared_peak;   /* several arenas: keep `allocated` (read under arena locks) */
  atomic_bool hit_extras;    /* shared_peak or tracing: quick hits have more to do (quick.h) */
  _Atomic int capture_watch; /* captures to route or frees deferred: see pool.c */
  atomic_bool capture_reuse; /* graph_capture_record_stream_reuse, switchable at run time */
  _Atomic int reuse_marked;  /* deferred frees with free markers (graph_reuse.c) */

  /* The own arena of each stream, by a hash of its handle with linear
   * probing. A stream keeps its arena as long as the allocator lives, so a
   * slot, once filled (under arenas_mutex), never changes: tide_malloc and
   * tide_free find the arena with a few loads, no lock and no thread-local
   * storage (a call in a shared library). Streams beyond the table's room
   * are found through the arena table. */
  _tide_stream_slot streams[_TIDE_STREAM_SLOTS];
  /* The tables the fast paths of tide_malloc and tide_free look streams up
   * in: `streams`, or an empty one while that fast path is off (captures are
   * watched; for tide_malloc also sizes rounded by roundup_power2_divisions),
   * so that the lookup they make anyway is also that test. */
  _Atomic(_tide_stream_slot *) malloc_streams, free_streams;
  /* Shared counters, each on its own cache line so that writing them does
   * not evict the read-mostly fields above from other cores (the allocator
   * is allocated 64-byte aligned for this). */
  _Alignas(64) _tide_global_stat reserved;  /* all arenas: physical bytes held */
  _Alignas(64) _tide_global_stat allocated; /* all arenas, once shared_peak is set */
  _Alignas(64) char after_counters;
  pthread_mutex_t arenas_mutex; /* guards the arena table */
  _tide_arena **arenas;
  _Atomic size_t narenas;
  size_t arenas_cap;
  /* The stats of arenas a pool that is gone left to the next pool: the
   * allocator's stats keep them, the new pool's start from zero. Under
   * arenas_mutex. */
  _tide_arena_stats retired_stats;
  pthread_mutex_t reclaim_mutex; /* one thread frees cached memory at a time */
  _Atomic uint64_t num_alloc_retries;
  _Atomic uint64_t num_ooms;
  _Atomic uint64_t num_sync_all_streams;
  _Atomic uint64_t stream_waits;    /* tide_stats.stream_waits */
  _Atomic uint64_t mapping_ns;      /* tide_stats.mapping_ns (device_memory.c) */
  _Atomic uint64_t device_queries;  /* tide_stats.device_queries (device_memory.c) */
  _Atomic uint64_t device_query_ns; /* tide_stats.device_query_ns */
  _Atomic uint64_t others_wait_ns;  /* tide_stats.others_wait_ns (features/others.c) */
  /* Bytes that waiting allocations hold as claims on the device's free
   * memory (features/others.c), reserved but in no arena: taken and given back
   * under an arena's lock, so that tide_check sees both counts move
   * together. */
  _Atomic int64_t claimed;
  /* The last reading of what others hold of the device, and when
   * (_tide_now_ns); others_seen_ns 0 before the first (device_memory.c). */
  _Atomic int64_t others_seen;
  _Atomic uint64_t others_seen_ns;
  _tide_trace_ring trace;
  struct _tide_pinned *pinned; /* the pinned host memory pool (pinned.c) */
  pthread_mutex_t bufs_mutex;  /* guards the list of growable buffers */
  /* A buffer's page step (budget, handle, mapping and stats of one page)
   * holds it shared; tide_check holds it alone, so it sees none half done. */
  pthread_rwlock_t bufs_pages;
  struct tide_buf *bufs;         /* live growable buffers (buffer.c) */
  _tide_captures captures;       /* capture pools (pool.c) */
  pthread_mutex_t imports_mutex; /* guards the list of imported memory */
  struct _tide_import *imports;  /* memory of other processes mapped here (share.c) */
};

/* The backend's calls that create, map, make accessible, unmap and release
 * device memory, each timed into tide_stats.mapping_ns (device_memory.c); their
 * arguments and results are the backend's (backend.h). */
int _tide_mem_create(struct tide_allocator *a, size_t size, _tide_handle *h);
int _tide_mem_release(struct tide_allocator *a, _tide_handle h);
int _tide_mem_map(struct tide_allocator *a, uintptr_t addr, size_t size, _tide_handle h);
int _tide_mem_set_access(struct tide_allocator *a, uintptr_t addr, size_t size);
int _tide_mem_unmap(struct tide_allocator *a, uintptr_t addr, size_t size);
int _tide_mem_unmap_run(struct tide_allocator *a, uintptr_t addr, size_t page, size_t count,
                        size_t *done);
/* Reserve physical budget under the memory limit; give it back (device_memory.c). */
int _tide_budget_take(struct tide_allocator *a, size_t bytes, size_t request);
void _tide_budget_give(struct tide_allocator *a, size_t bytes);

/* The device's free memory the allocator leaves to others before growth
 * recycles its own cache instead, and below which it gives cached pages
 * back: other processes, and what allocates outside the allocator (the
 * CUDA context, libraries, kernels' local memory), need room to grow, and
 * a process that holds a cache it does not use must not be what makes them
 * run out. A 64th of the device: 1.25 GiB of an 80 GB card, enough for the
 * workspaces and local memory of the usual libraries, little enough that a
 * program filling the card alone loses no room it could use (pressure only
 * recycles; growth still takes the device's last free bytes). */
#define _TIDE_LOW_WATER_SHARE 64u
static inline size_t _tide_low_water(const struct tide_allocator *a) {
  return a->total_memory / _TIDE_LOW_WATER_SHARE;
}

/* The device's free memory, or false where the backend cannot say; the
 * error a failed query leaves is not the caller's. Counted and timed into
 * tide_stats.device_queries and device_query_ns (device_memory.c). */
bool _tide_device_free(struct tide_allocator *a, size_t *free_bytes);

/* Bytes of the device that others hold (other processes, other allocators,
 * what allocates outside the allocator), with `free_bytes` free. */
static inline int64_t _tide_others_hold(const struct tide_allocator *a, size_t free_bytes) {
  return (int64_t)a->total_memory - (int64_t)free_bytes -
         atomic_load_explicit(&a->reserved.cur, memory_order_relaxed);
}

/* The device's free memory above its low-water mark, for growth: from the
 * last reading while it is recent and far from the mark, else asked of the
 * device; false where the backend cannot say (device_memory.c). */
bool _tide_device_room(struct tide_allocator *a, int64_t *room);

/* How often an arena's allocations past the quick blocks ask the device how
 * much it has free: every this many. Counted, not timed, so that a program
 * makes the same calls every run (the fault sweeps rely on it); a busy
 * program makes thousands of such allocations a second, so another
 * process's growth finds the pages given back within milliseconds, and the
 * query's cost (a driver call) spreads over as many allocations. */
#define _TIDE_DEVICE_CHECK_EVERY 256u

/* The calling thread is about to block until a stream or event is done. */
static inline void _tide_note_stream_wait(struct tide_allocator *a) {
  atomic_fetch_add_explicit(&a->stream_waits, 1, memory_order_relaxed);
}

/* A live allocator: not NULL, aligned as allocators are (a stray pointer
 * must not be read at a misaligned address), and with its magic number. */
static inline bool _tide_allocator_valid(const struct tide_allocator *a) {
  return a && (uintptr_t)a % _Alignof(struct tide_allocator) == 0 && a->magic == _TIDE_MAGIC;
}

/* At the entry of a public call: `fail` out, with a message naming the
 * call, unless `a` is a live allocator. */
#define _TIDE_CHECK_ALLOCATOR(a, fail)                                                             \
  do {                                                                                             \
    if (TIDE_UNLIKELY(!_tide_allocator_valid(a))) {                                                \
      _tide_error_set(TIDE_ERR_INVALID,                                                            \
                      "%s: not a live tidalloc allocator (NULL, destroyed "                        \
                      "or corrupted handle)",                                                      \
                      __func__);                                                                   \
      return fail;                                                                                 \
    }                                                                                              \
  } while (0)

/* Trace (trace.c). */
int _tide_trace_init(_tide_trace_ring *ring, size_t cap);
void _tide_trace_destroy(_tide_trace_ring *ring);
void _tide_trace_push_slow(struct tide_allocator *a, tide_trace_kind kind, int pool, uintptr_t addr,
                           size_t size, tide_stream stream);
static inline void _tide_trace(struct tide_allocator *a, tide_trace_kind kind, int pool,
                               uintptr_t addr, size_t size, tide_stream stream) {
  if (TIDE_UNLIKELY(a->trace.cap != 0)) _tide_trace_push_slow(a, kind, pool, addr, size, stream);
}

/* Before `bytes` are mapped outside the segments (a growable buffer), unmap
 * free pages inside them as growth would (release_holes), so that reserved
 * memory stays near the allocated peak. Under the arena lock (arena.c). */
void _tide_arena_make_room(_tide_arena *arena, size_t bytes);

#endif /* TIDE_CORE_H */
