/* arena_table.h: the arenas of an allocator (arena_table.c), as the features
 * and the API reach them: the own arena of a stream, found inline through
 * the allocator's table of streams on the fast paths, the arenas of capture
 * pools, and what is done over every arena. The files of memory/ below
 * arena_table.c do not include it: they work on one arena they are given. */
#ifndef TIDE_ARENA_TABLE_H
#define TIDE_ARENA_TABLE_H

#include "memory/core.h"

/* The home slot of a stream in a table of streams. */
static inline unsigned _tide_stream_home(tide_stream stream) {
  return (unsigned)(((uintptr_t)stream * UINT64_C(0x9E3779B97F4A7C15)) >> 58) &
         (_TIDE_STREAM_SLOTS - 1);
}

/* The stream's own arena in its home slot of a fast path's table of
 * streams, or NULL: the fast path looks no further (_tide_arena_of does). */
static TIDE_ALWAYS_INLINE _tide_arena *_tide_stream_arena_home(_tide_stream_slot *table,
                                                               tide_stream stream) {
  const _tide_stream_slot *slot = &table[_tide_stream_home(stream)];
  _tide_arena *arena = atomic_load_explicit(&slot->arena, memory_order_acquire);
  if (TIDE_LIKELY(arena != NULL) &&
      TIDE_LIKELY(atomic_load_explicit(&slot->stream, memory_order_relaxed) == stream))
    return arena;
  return NULL;
}

/* The stream's own arena from the allocator's table of streams, or NULL. */
static inline _tide_arena *_tide_stream_arena(struct tide_allocator *a, tide_stream stream) {
  unsigned i = _tide_stream_home(stream);
  for (unsigned probes = 0; probes < _TIDE_STREAM_SLOTS; probes++) {
    _tide_arena *arena = atomic_load_explicit(&a->streams[i].arena, memory_order_acquire);
    if (TIDE_UNLIKELY(!arena)) return NULL;
    if (TIDE_LIKELY(atomic_load_explicit(&a->streams[i].stream, memory_order_relaxed) == stream))
      return arena;
    i = (i + 1) & (_TIDE_STREAM_SLOTS - 1);
  }
  return NULL;
}

/* A stream's own arena not in the table of streams: this thread's cache,
 * then the arena table, where `create` makes it on first use; NULL with a
 * message for a stream the device does not know. */
_tide_arena *_tide_arena_lookup(struct tide_allocator *a, tide_stream stream, bool create);

/* The stream's own arena: the table of streams, this thread's cache, then
 * the arena table. */
static inline _tide_arena *_tide_arena_of(struct tide_allocator *a, tide_stream stream,
                                          bool create) {
  _tide_arena *arena = _tide_stream_arena(a, stream);
  if (TIDE_LIKELY(arena != NULL)) return arena;
  return _tide_arena_lookup(a, stream, create);
}

/* The arena of `stream`, created on first use; NULL with a message for a
 * stream the device does not know. */
_tide_arena *_tide_arena_get(struct tide_allocator *a, tide_stream stream);
/* Turn the fast paths of tide_malloc and tide_free on or off (off while
 * captures are watched). */
void _tide_fast_paths_update(struct tide_allocator *a, bool captures_watched);
/* The arena of `stream` in capture pool `pool` (whose id is pool_id), made
 * on first use (an unused arena is taken again first). */
int _tide_arena_of_pool(struct tide_allocator *a, struct tide_pool *pool, uint64_t pool_id,
                        tide_stream stream, _tide_arena **out);
/* Arenas of an allocator: a stable copy of the table for iteration. */
size_t _tide_arenas_snapshot(struct tide_allocator *a, _tide_arena ***out);

/* Wait for pending frees and give every cached page back, in every arena
 * but those of capture pools with users: what PyTorch does before it gives
 * up. Returns the first failure. */
int _tide_arenas_release_cached(struct tide_allocator *a);
/* A free tide_free's fast path did not finish: look in every arena. */
tide_status _tide_free_slow(struct tide_allocator *a, uintptr_t addr, size_t size, bool sized,
                            tide_stream stream);
/* The allocated block whose range holds addr, in any arena: its start, size
 * and stream (each may be NULL); TIDE_ERR_BAD_POINTER, or another status,
 * with the reason when there is none. */
tide_status _tide_block_info(struct tide_allocator *a, uintptr_t addr, void **base, size_t *size,
                             tide_stream *stream);

#endif /* TIDE_ARENA_TABLE_H */
