/* arena_table.c: the arenas of an allocator. The own arena of each stream,
 * made on first use and found through the table of streams (arena_table.h,
 * inline), this thread's cache or the arena table; the arenas of capture
 * pools (their pools are pool.c's); and what is done over every arena:
 * freeing a block wherever it is, finding the block that holds an address,
 * giving cached memory back. The allocator's entry points (allocator.c) and
 * the features (buffers, pools, sharing, statistics) reach arenas through
 * here; arena.c and the files below it do not call it. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "memory/arena_table.h"

/* ------------------------------------------------------------------------ */
/* Arenas by stream                                                          */
/* ------------------------------------------------------------------------ */

/* Behind the allocator's table of streams (arena_table.h), for streams it
 * has no room for: the last arenas this thread used, keyed by allocator id
 * and stream; ids are never reused, so an entry of a destroyed allocator
 * never matches. */
#define ARENA_CACHE 8
static _Thread_local struct {
  uint64_t id;
  tide_stream stream;
  _tide_arena *arena;
} arena_cache[ARENA_CACHE];

static inline unsigned cache_slot(uint64_t id, tide_stream stream) {
  uintptr_t h = (uintptr_t)stream * 0x9E3779B1u + (uintptr_t)id;
  return (unsigned)(h >> 4) % ARENA_CACHE;
}

/* The stream's own arena (not one of its capture pool arenas). */
static _tide_arena *find_arena_locked(tide_allocator *a, tide_stream stream) {
  size_t n = atomic_load(&a->narenas);
  for (size_t i = 0; i < n; i++)
    if (a->arenas[i]->stream == stream && a->arenas[i]->pool_id == 0) return a->arenas[i];
  return NULL;
}

/* With one arena its own stats are the allocator's, at no cost. A second
 * arena makes the allocator-wide allocated bytes a shared counter, started
 * from the first arena's stats under its lock (arenas read the flag under
 * their own lock, so no update is missed). */
static void share_peak(tide_allocator *a, _tide_arena *first) {
  _tide_lock_acquire(&first->lock);
  _tide_arena_stats reported;
  _tide_arena_stats_read(first, &reported);
  atomic_store(&a->allocated.cur, reported.cur[_TIDE_ST_ALLOCATED][0]);
  atomic_store(&a->allocated.peak, first->stats.peak[_TIDE_ST_ALLOCATED][0]);
  atomic_store(&a->shared_peak, true);
  atomic_store(&a->hit_extras, true);
  _tide_lock_release(&first->lock);
}

/* An arena for a stream that does not exist could never give its cache
 * back (nothing to synchronize): none is made or given to one. */
static int check_arena_stream(tide_allocator *a, tide_stream stream) {
  const _tide_backend *be = &a->backend;
  if (be->ops->stream_check && be->ops->stream_check(be->ctx, stream))
    return _tide_error_set(TIDE_ERR_INVALID,
                           "stream %p is not a stream of this device (unknown "
                           "or destroyed): nothing was allocated",
                           (void *)stream);
  return TIDE_OK;
}

static int add_arena_locked(tide_allocator *a, tide_stream stream, _tide_arena **out) {
  size_t n = atomic_load(&a->narenas);
  int bad = check_arena_stream(a, stream);
  if (bad) return bad;
  if (n == a->arenas_cap) {
    size_t cap = a->arenas_cap ? a->arenas_cap * 2 : 8;
    _tide_arena **grown = realloc(a->arenas, cap * sizeof *grown);
    if (!grown) return _tide_error_set(TIDE_ERR_OOM, "out of host memory for arenas");
    a->arenas = grown;
    a->arenas_cap = cap;
  }
  int rc = _tide_arena_create(a, stream, out);
  if (rc) return rc;
  if (n == 1) share_peak(a, a->arenas[0]);
  a->arenas[n] = *out;
  atomic_store(&a->narenas, n + 1);
  return TIDE_OK;
}

/* The table of streams of a fast path that is off. */
static _tide_stream_slot no_streams[_TIDE_STREAM_SLOTS];

void _tide_fast_paths_update(tide_allocator *a, bool captures_watched) {
  _tide_stream_slot *all = captures_watched ? no_streams : a->streams;
  atomic_store_explicit(&a->free_streams, all, memory_order_release);
  atomic_store_explicit(&a->malloc_streams, a->plain_rounding ? all : no_streams,
                        memory_order_release);
}

/* Enter a new own arena in the table of streams, if it has room. Under
 * arenas_mutex: the stream first, then the arena, which readers look at
 * first. */
static void stream_table_add(tide_allocator *a, _tide_arena *arena) {
  unsigned i = _tide_stream_home(arena->stream);
  for (unsigned probes = 0; probes < _TIDE_STREAM_SLOTS; probes++) {
    if (!atomic_load_explicit(&a->streams[i].arena, memory_order_relaxed)) {
      atomic_store_explicit(&a->streams[i].stream, arena->stream, memory_order_relaxed);
      atomic_store_explicit(&a->streams[i].arena, arena, memory_order_release);
      return;
    }
    i = (i + 1) & (_TIDE_STREAM_SLOTS - 1);
  }
}

static _tide_arena *arena_slow(tide_allocator *a, tide_stream stream, bool create) {
  pthread_mutex_lock(&a->arenas_mutex);
  _tide_arena *arena = find_arena_locked(a, stream);
  if (!arena && create) {
    if (add_arena_locked(a, stream, &arena))
      arena = NULL;
    else
      stream_table_add(a, arena);
  }
  pthread_mutex_unlock(&a->arenas_mutex);
  if (arena) {
    unsigned slot = cache_slot(a->id, stream);
    arena_cache[slot].id = a->id;
    arena_cache[slot].stream = stream;
    arena_cache[slot].arena = arena;
  }
  return arena;
}

_tide_arena *_tide_arena_lookup(tide_allocator *a, tide_stream stream, bool create) {
  unsigned slot = cache_slot(a->id, stream);
  if (TIDE_LIKELY(arena_cache[slot].id == a->id && arena_cache[slot].stream == stream))
    return arena_cache[slot].arena;
  return arena_slow(a, stream, create);
}

_tide_arena *_tide_arena_get(tide_allocator *a, tide_stream stream) {
  return _tide_arena_of(a, stream, true);
}

/* Add an arena's history to the allocator's retired stats (its current
 * ones are all zero: it holds nothing). The active peak is folded in as it
 * is summed (the larger of the allocated and active peaks), so the
 * allocator's stats do not change. */
static void retire_stats(_tide_arena_stats *to, _tide_arena_stats *from) {
  for (int st = 0; st < _TIDE_ST_COUNT; st++)
    for (int p = 0; p < TIDE_POOL_KINDS; p++) to->peak[st][p] += from->peak[st][p];
  for (int k = 0; k < 2; k++)
    for (int p = 0; p < TIDE_POOL_KINDS; p++) {
      int stat = k == 0 ? _TIDE_ST_ALLOCATED : _TIDE_ST_ALLOCATIONS;
      int64_t peak = from->peak[stat][p];
      to->active_peak[k][p] += from->active_peak[k][p] > peak ? from->active_peak[k][p] : peak;
    }
  for (int c = 0; c < _TIDE_CT_COUNT; c++) to->counters[c] += from->counters[c];
  memset(from, 0, sizeof *from);
}

/* Capture pool arenas stay in the table when their pool goes (snapshots of
 * the table hold them): an unused one is given to the next pool. Under
 * arenas_mutex. */
static void give_to_pool(tide_allocator *a, _tide_arena *arena, struct tide_pool *pool,
                         uint64_t pool_id, tide_stream stream) {
  _tide_lock_acquire(&arena->lock);
  if (arena->pool_id == _TIDE_UNUSED_ARENA) retire_stats(&a->retired_stats, &arena->stats);
  arena->stream = stream;
  arena->stream_gone = false;
  arena->pool = pool;
  arena->pool_id = pool_id;
  arena->keep_cache = true;
  _tide_lock_release(&arena->lock);
}

int _tide_arena_of_pool(tide_allocator *a, struct tide_pool *pool, uint64_t pool_id,
                        tide_stream stream, _tide_arena **out) {
  pthread_mutex_lock(&a->arenas_mutex);
  size_t n = atomic_load(&a->narenas);
  _tide_arena *unused = NULL;
  int rc = TIDE_OK;
  *out = NULL;
  for (size_t i = 0; i < n && !*out; i++) {
    if (a->arenas[i]->pool_id == pool_id && a->arenas[i]->stream == stream) *out = a->arenas[i];
    if (!unused && a->arenas[i]->pool_id == _TIDE_UNUSED_ARENA) unused = a->arenas[i];
  }
  if (!*out && unused) {
    /* As for a new arena: the stream must exist (a begin may outlive it). */
    rc = check_arena_stream(a, stream);
    if (!rc) {
      give_to_pool(a, unused, pool, pool_id, stream);
      *out = unused;
    }
  } else if (!*out && (rc = add_arena_locked(a, stream, out)) == TIDE_OK) {
    give_to_pool(a, *out, pool, pool_id, stream);
  }
  pthread_mutex_unlock(&a->arenas_mutex);
  return rc;
}

size_t _tide_arenas_snapshot(tide_allocator *a, _tide_arena ***out) {
  pthread_mutex_lock(&a->arenas_mutex);
  size_t n = atomic_load(&a->narenas);
  *out = malloc((n ? n : 1) * sizeof **out);
  if (!*out)
    n = 0;
  else if (n)
    memcpy(*out, a->arenas, n * sizeof **out);
  pthread_mutex_unlock(&a->arenas_mutex);
  return n;
}

/* ------------------------------------------------------------------------ */
/* Over every arena                                                          */
/* ------------------------------------------------------------------------ */

/* Wait for pending frees and give every cached page back, in every arena:
 * what PyTorch does before it gives up. Returns the first failure. */
int _tide_arenas_release_cached(tide_allocator *a) {
  _tide_arena **arenas;
  size_t n = _tide_arenas_snapshot(a, &arenas);
  _tide_first_error first = {0};
  for (size_t i = 0; i < n; i++) {
    _tide_lock_acquire(&arenas[i]->lock);
    /* A capture pool with users keeps its memory: graphs replay into it. */
    if (!arenas[i]->keep_cache) {
      _tide_first_error_note(&first, _tide_arena_process_events(arenas[i], true));
      _tide_first_error_note(&first, _tide_arena_release_cached(arenas[i]));
    }
    _tide_lock_release(&arenas[i]->lock);
  }
  free(arenas);
  return _tide_first_error_end(&first);
}

/* Look for the block in every arena: a free on another stream than the
 * allocation's, of a block of a capture pool, or a bad pointer. */
tide_status _tide_free_slow(tide_allocator *a, uintptr_t addr, size_t size, bool sized,
                            tide_stream stream) {
  _tide_arena **arenas;
  size_t n = _tide_arenas_snapshot(a, &arenas);
  int rc = TIDE_OK;
  for (size_t i = 0; i < n; i++) {
    _tide_lock_acquire(&arenas[i]->lock);
    _tide_block *b = _tide_arena_live(arenas[i], addr);
    if (b) {
      if (sized && b->requested != size)
        rc = _tide_error_set(TIDE_ERR_INVALID,
                             "tide_free_sized(%p): size %zu given, but %zu bytes were asked "
                             "for; nothing was freed",
                             (void *)addr, size, b->requested);
      else
        rc = _tide_arena_free(arenas[i], b, stream);
      _tide_lock_release(&arenas[i]->lock);
      free(arenas);
      return (tide_status)rc;
    }
    _tide_lock_release(&arenas[i]->lock);
  }
  for (size_t i = 0; i < n && !rc; i++) {
    _tide_lock_acquire(&arenas[i]->lock);
    rc = _tide_arena_explain_pointer(arenas[i], addr);
    _tide_lock_release(&arenas[i]->lock);
  }
  free(arenas);
  if (rc) return (tide_status)rc;
  return (tide_status)_tide_error_set(TIDE_ERR_BAD_POINTER,
                                      "%p was not allocated by this tidalloc allocator (device "
                                      "%d): it is outside all of its segments",
                                      (void *)addr, a->device);
}

tide_status _tide_block_info(tide_allocator *a, uintptr_t addr, void **base, size_t *size,
                             tide_stream *stream) {
  _tide_arena **arenas;
  size_t n = _tide_arenas_snapshot(a, &arenas);
  int rc = -1;
  for (size_t i = 0; i < n && rc < 0; i++) {
    _tide_lock_acquire(&arenas[i]->lock);
    const _tide_block *b = _tide_arena_containing_block(arenas[i], addr);
    if (b && b->state == _TIDE_ALLOCATED) {
      if (base) *base = (void *)b->addr;
      if (size) *size = b->size;
      if (stream) *stream = arenas[i]->stream;
      rc = TIDE_OK;
    } else if (b) {
      rc = _tide_arena_explain_pointer(arenas[i], addr);
    }
    _tide_lock_release(&arenas[i]->lock);
  }
  free(arenas);
  if (rc < 0)
    rc = _tide_error_set(TIDE_ERR_BAD_POINTER, "%p was not allocated by this tidalloc allocator",
                         (void *)addr);
  return (tide_status)rc;
}
