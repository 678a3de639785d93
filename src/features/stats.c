/* stats.c: the allocator's stats, summed over the arenas of its streams
 * (and of its capture pools, whose stats are also given alone).
 *
 * Each arena keeps exact current and peak stats under its own lock, so
 * counting costs no shared writes. With one stream the arena's stats are
 * the allocator's. With several, the allocator-wide peak of reserved bytes
 * stays exact (a shared counter, written only when pages are mapped or
 * unmapped) and that of allocated bytes is within 2 MiB per stream of exact
 * (arenas add to a shared counter in steps of 2 MiB); the other peaks are
 * the sum of each stream's peak (an upper bound). */
#include <stdlib.h>
#include <string.h>

#include "features/features.h"

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

static void add_arena(tide_stats *out, const _tide_arena_stats *s) {
  tide_stat *dest[_TIDE_ST_COUNT] = {
      [_TIDE_ST_ALLOCATED] = out->allocated_bytes,
      [_TIDE_ST_REQUESTED] = out->requested_bytes,
      [_TIDE_ST_INACTIVE_SPLIT] = out->inactive_split_bytes,
      [_TIDE_ST_RESERVED] = out->reserved_bytes,
      [_TIDE_ST_ALLOCATIONS] = out->allocations,
      [_TIDE_ST_INACTIVE_SPLIT_BLOCKS] = out->inactive_split,
      [_TIDE_ST_SEGMENTS] = out->segments,
  };
  for (int st = 0; st < _TIDE_ST_COUNT; st++)
    for (int p = 0; p < TIDE_POOL_KINDS && dest[st]; p++) {
      dest[st][p].current += s->cur[st][p];
      dest[st][p].peak += s->peak[st][p];
    }
  for (int p = 0; p < TIDE_POOL_KINDS; p++) {
    out->active_bytes[p].current += s->cur[_TIDE_ST_ALLOCATED][p] + s->cur[_TIDE_ST_PENDING][p];
    out->active_bytes[p].peak += max64(s->peak[_TIDE_ST_ALLOCATED][p], s->active_peak[0][p]);
    out->active_blocks[p].current +=
        s->cur[_TIDE_ST_ALLOCATIONS][p] + s->cur[_TIDE_ST_PENDING_BLOCKS][p];
    out->active_blocks[p].peak += max64(s->peak[_TIDE_ST_ALLOCATIONS][p], s->active_peak[1][p]);
  }
  out->num_allocs += s->counters[_TIDE_CT_ALLOCS];
  /* Every allocation not live any more was freed once: no counter needed. */
  out->num_frees += s->counters[_TIDE_CT_ALLOCS] - (uint64_t)s->cur[_TIDE_ST_ALLOCATIONS][0];
  out->pages_mapped += s->counters[_TIDE_CT_PAGES_MAPPED];
  out->pages_unmapped += s->counters[_TIDE_CT_PAGES_UNMAPPED];
  out->segments_created += s->counters[_TIDE_CT_SEGMENTS_CREATED];
  out->segments_released += s->counters[_TIDE_CT_SEGMENTS_RELEASED];
  out->num_device_alloc += s->counters[_TIDE_CT_DEVICE_ALLOC];
  out->num_device_free += s->counters[_TIDE_CT_DEVICE_FREE];
  out->oversize_allocations += s->counters[_TIDE_CT_OVERSIZE];
  out->mappings += s->counters[_TIDE_CT_MAPPINGS];
  out->unmappings += s->counters[_TIDE_CT_UNMAPPINGS];
}

/* Add what an arena has not yet added to the shared allocated counter. */
static void flush_unpublished(_tide_arena *arena) {
  if (!atomic_load(&arena->alloc->shared_peak)) return;
  _tide_arena_publish_now(arena);
}

int _tide_stats_collect(tide_allocator *a, tide_stats *out) {
  memset(out, 0, sizeof *out);
  _tide_arena **arenas;
  size_t n = _tide_arenas_snapshot(a, &arenas);
  for (size_t i = 0; i < n; i++) {
    _tide_lock_acquire(&arenas[i]->lock);
    if (arenas[i]->unpublished) flush_unpublished(arenas[i]);
    _tide_arena_stats reported;
    _tide_arena_stats_read(arenas[i], &reported);
    add_arena(out, &reported);
    _tide_lock_release(&arenas[i]->lock);
  }
  free(arenas);
  pthread_mutex_lock(&a->arenas_mutex);
  add_arena(out, &a->retired_stats);
  pthread_mutex_unlock(&a->arenas_mutex);
  if (atomic_load(&a->shared_peak)) out->allocated_bytes[0].peak = atomic_load(&a->allocated.peak);
  out->reserved_bytes[0].current = atomic_load(&a->reserved.cur);
  out->reserved_bytes[0].peak = atomic_load(&a->reserved.peak);
  out->num_alloc_retries = atomic_load(&a->num_alloc_retries);
  out->num_ooms = atomic_load(&a->num_ooms);
  out->num_sync_all_streams = atomic_load(&a->num_sync_all_streams);
  out->stream_waits = atomic_load(&a->stream_waits);
  out->mapping_ns = atomic_load(&a->mapping_ns);
  out->device_queries = atomic_load(&a->device_queries);
  out->device_query_ns = atomic_load(&a->device_query_ns);
  out->others_wait_ns = atomic_load(&a->others_wait_ns);
  out->memory_limit = atomic_load(&a->limit);
  return TIDE_OK;
}

void _tide_stats_collect_pool(tide_allocator *a, uint64_t pool_id, tide_stats *out) {
  memset(out, 0, sizeof *out);
  _tide_arena **arenas;
  size_t n = _tide_arenas_snapshot(a, &arenas);
  for (size_t i = 0; i < n; i++) {
    _tide_lock_acquire(&arenas[i]->lock);
    if (arenas[i]->pool_id == pool_id) {
      _tide_arena_stats reported;
      _tide_arena_stats_read(arenas[i], &reported);
      add_arena(out, &reported);
    }
    _tide_lock_release(&arenas[i]->lock);
  }
  free(arenas);
  out->memory_limit = atomic_load(&a->limit);
}

tide_status tide_get_stats(tide_allocator *a, tide_stats *out) {
  if (!_tide_allocator_valid(a) || !out)
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID, "tide_get_stats: %s is NULL or invalid",
                                        out ? "the allocator" : "out");
  return (tide_status)_tide_stats_collect(a, out);
}

tide_status tide_reset_peak_stats(tide_allocator *a) {
  if (!_tide_allocator_valid(a))
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID, "tide_reset_peak_stats: bad allocator");
  _tide_arena **arenas;
  size_t n = _tide_arenas_snapshot(a, &arenas);
  for (size_t i = 0; i < n; i++) {
    _tide_lock_acquire(&arenas[i]->lock);
    /* With no quick block the raw stats are the true ones: the peaks
     * start from them (quick.h). */
    _tide_arena_flush_quick(arenas[i]);
    _tide_arena_stats *s = &arenas[i]->stats;
    memcpy(s->peak, s->cur, sizeof s->peak);
    memset(s->active_peak, 0, sizeof s->active_peak);
    _tide_arena_track_active(arenas[i]);
    _tide_lock_release(&arenas[i]->lock);
  }
  free(arenas);
  pthread_mutex_lock(&a->arenas_mutex);
  memset(a->retired_stats.peak, 0, sizeof a->retired_stats.peak); /* its current stats are 0 */
  memset(a->retired_stats.active_peak, 0, sizeof a->retired_stats.active_peak);
  pthread_mutex_unlock(&a->arenas_mutex);
  atomic_store(&a->allocated.peak, atomic_load(&a->allocated.cur));
  atomic_store(&a->reserved.peak, atomic_load(&a->reserved.cur));
  return TIDE_OK;
}

size_t _tide_largest_free_block(tide_allocator *a) {
  _tide_arena **arenas;
  size_t n = _tide_arenas_snapshot(a, &arenas), largest = 0;
  for (size_t i = 0; i < n; i++) {
    _tide_lock_acquire(&arenas[i]->lock);
    /* A capture pool's free blocks serve only its captures. */
    for (int kind = 0; kind < 2 && arenas[i]->pool_id == 0; kind++) {
      const _tide_block *b = _tide_bins_largest(&arenas[i]->pools[kind].bins);
      if (b && b->size > largest) largest = b->size;
    }
    _tide_lock_release(&arenas[i]->lock);
  }
  free(arenas);
  return largest;
}
