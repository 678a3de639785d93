/* checkpoint.c: checkpoints of a capture pool and their restore — what
 * graph-tree runtimes do between replays of graphs that share a pool
 * (PyTorch's getCheckpointState and setCheckpointPoolState).
 *
 * A checkpoint copies the pool's layout: for each segment of each of its
 * arenas, every block's address, size and state (allocated, free or
 * unmapped) and, for allocated blocks, the size that was asked for.
 *
 * A restore does not replay allocations over the current blocks. PyTorch
 * walks the current blocks and splits them where the checkpoint had
 * boundaries, expecting the checkpoint's unmapped tail where the walk ends;
 * once an expandable segment has grown and its free blocks have merged, the
 * walk finds mapped memory there and fails ("Expected curr_block->next ==
 * nullptr"). Here each segment's block list is rebuilt from what defines
 * it: the blocks the checkpoint had allocated, at their addresses; the
 * unmapped ranges the segment has now (a pool with users never unmaps, so
 * every page mapped at the checkpoint still is, and those mapped since stay
 * mapped: a graph captured since may still use them); and the segment's
 * bounds. Between allocated blocks, each run of mapped space becomes one
 * free block and each unmapped range one unmapped block. A block allocated
 * now at the same address and size keeps its record (its requested size and
 * recorded streams); other allocated blocks are released, and the
 * checkpoint's are made anew. Any layout restores this way, whatever
 * growth and merging happened since.
 *
 * Steps: frees that captures deferred and that may go now are retried
 * (their captures may have ended with no call since to retry them); then,
 * under the capture mutex and every arena lock of the pool: check
 * (nothing changes); wait for the frees of the pool's blocks that wait on
 * other streams (a failure changes nothing but the frees that completed);
 * plan and prepare (block records, room in the live maps, the delta: a
 * failure changes nothing); apply (cannot fail). */
#include <stdlib.h>
#include <string.h>

#include "features/features.h"

enum { CK_ALLOCATED = 1, CK_FREE = 2, CK_UNMAPPED = 3 };

typedef struct ckpt_block {
  uintptr_t addr;
  size_t size;
  size_t requested; /* allocated blocks */
  uint8_t state;    /* CK_* */
} ckpt_block;

typedef struct ckpt_segment {
  uintptr_t base;
  size_t size;
  size_t first, count; /* its blocks in tide_checkpoint.blocks, address order */
} ckpt_segment;

struct tide_checkpoint {
  uint64_t pool_id;
  ckpt_segment *segments;
  size_t nsegments;
  ckpt_block *blocks;
  size_t nblocks;
};

static void lock_all(_tide_arena **arenas, size_t n) {
  for (size_t i = 0; i < n; i++) _tide_lock_acquire(&arenas[i]->lock);
}

static void unlock_all(_tide_arena **arenas, size_t n) {
  for (size_t i = n; i-- > 0;) _tide_lock_release(&arenas[i]->lock);
}

#define EACH_SEGMENT(arena, seg)                                                                   \
  for (int kind_ = 0; kind_ < 2; kind_++)                                                          \
    for (_tide_segment *seg = (arena)->pools[kind_].segments; seg; seg = seg->next)

/* The pool's arenas, with the capture mutex held and the pool checked:
 * TIDE_OK, or an error with nothing held. Captures that capture_detection
 * found and that have ended are pruned by the caller first (they would
 * count as the pool's captures). */
static int enter_pool(tide_pool *pool, const char *op, _tide_arena ***arenas, size_t *n) {
  tide_allocator *a = pool->alloc;
  pthread_mutex_lock(&a->captures.mutex);
  int rc = _tide_capture_pool_live(pool, op);
  if (!rc) {
    *n = _tide_capture_pool_arenas(a, pool->id, arenas);
    if (!*arenas) rc = _tide_error_set(TIDE_ERR_OOM, "%s: out of host memory", op);
  }
  if (rc) {
    pthread_mutex_unlock(&a->captures.mutex);
    return rc;
  }
  lock_all(*arenas, *n);
  return TIDE_OK;
}

static void leave_pool(tide_pool *pool, _tide_arena **arenas, size_t n) {
  unlock_all(arenas, n);
  free(arenas);
  pthread_mutex_unlock(&pool->alloc->captures.mutex);
}

/* ------------------------------------------------------------------------ */
/* Checkpoints                                                               */
/* ------------------------------------------------------------------------ */

static uint8_t checkpoint_state(const _tide_block *b) {
  if (b->state == _TIDE_ALLOCATED) return CK_ALLOCATED;
  return b->state == _TIDE_UNMAPPED ? CK_UNMAPPED : CK_FREE; /* quick, pending: freed */
}

static void copy_layout(tide_checkpoint *k, _tide_arena **arenas, size_t n) {
  for (size_t i = 0; i < n; i++) {
    EACH_SEGMENT(arenas[i], seg) {
      ckpt_segment *cs = &k->segments[k->nsegments++];
      *cs = (ckpt_segment){.base = seg->base, .size = seg->size, .first = k->nblocks};
      for (const _tide_block *b = seg->first; b; b = b->next) {
        uint8_t state = checkpoint_state(b);
        k->blocks[k->nblocks++] = (ckpt_block){
            .addr = b->addr,
            .size = b->size,
            .requested = state == CK_ALLOCATED ? b->requested : 0,
            .state = state,
        };
      }
      cs->count = k->nblocks - cs->first;
    }
  }
}

tide_status tide_pool_checkpoint(tide_pool *pool, tide_checkpoint **out) {
  if (!_tide_capture_pool_valid(pool) || !out)
    return (tide_status)_tide_error_set(
        TIDE_ERR_INVALID, "tide_pool_checkpoint: %s is NULL or invalid", out ? "the pool" : "out");
  *out = NULL;
  _tide_capture_prune(pool->alloc);
  _tide_arena **arenas;
  size_t n;
  int rc = enter_pool(pool, __func__, &arenas, &n);
  if (rc) return (tide_status)rc;
  size_t nsegments = 0, nblocks = 0;
  for (size_t i = 0; i < n; i++) {
    EACH_SEGMENT(arenas[i], seg) {
      nsegments++;
      for (const _tide_block *b = seg->first; b; b = b->next) nblocks++;
    }
  }
  tide_checkpoint *k = calloc(1, sizeof *k);
  if (k) {
    k->segments = malloc((nsegments ? nsegments : 1) * sizeof *k->segments);
    k->blocks = malloc((nblocks ? nblocks : 1) * sizeof *k->blocks);
  }
  if (!k || !k->segments || !k->blocks) {
    leave_pool(pool, arenas, n);
    tide_checkpoint_free(k);
    return (tide_status)_tide_error_set(TIDE_ERR_OOM,
                                        "tide_pool_checkpoint: out of host memory for %zu "
                                        "block records",
                                        nblocks);
  }
  k->pool_id = pool->id;
  copy_layout(k, arenas, n);
  leave_pool(pool, arenas, n);
  *out = k;
  return TIDE_OK;
}

size_t tide_checkpoint_allocated(const tide_checkpoint *k, void **out, size_t cap) {
  size_t count = 0;
  for (size_t i = 0; k && i < k->nblocks; i++) {
    if (k->blocks[i].state != CK_ALLOCATED) continue;
    if (out && count < cap) out[count] = (void *)k->blocks[i].addr;
    count++;
  }
  return count;
}

/* ------------------------------------------------------------------------ */
/* Live allocations                                                          */
/* ------------------------------------------------------------------------ */

tide_status tide_pool_allocated(tide_pool *pool, void **out, size_t cap, size_t *count) {
  if (!_tide_capture_pool_valid(pool) || !count)
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID,
                                        "tide_pool_allocated: %s is NULL or invalid",
                                        count ? "the pool" : "count");
  *count = 0;
  _tide_arena **arenas;
  size_t n;
  int rc = enter_pool(pool, __func__, &arenas, &n);
  if (rc) return (tide_status)rc;
  for (size_t i = 0; i < n; i++) {
    EACH_SEGMENT(arenas[i], seg) {
      for (const _tide_block *b = seg->first; b; b = b->next) {
        if (b->state != _TIDE_ALLOCATED) continue;
        if (out && *count < cap) out[*count] = (void *)b->addr;
        ++*count;
      }
    }
  }
  leave_pool(pool, arenas, n);
  return TIDE_OK;
}

void tide_checkpoint_free(tide_checkpoint *k) {
  if (!k) return;
  free(k->segments);
  free(k->blocks);
  free(k);
}

void tide_restore_delta_free(tide_restore_delta *delta) {
  if (!delta) return;
  free(delta->restored);
  free(delta->released);
  memset(delta, 0, sizeof *delta);
}

/* ------------------------------------------------------------------------ */
/* Restore: the plan                                                         */
/* ------------------------------------------------------------------------ */

/* One block of a segment's new layout. */
typedef struct entry {
  uintptr_t addr;
  size_t size;
  size_t requested;
  uint8_t state;     /* CK_* */
  _tide_block *keep; /* the allocated block that stays as it is, or NULL */
} entry;

/* A segment's new layout: entries [first, first+count). */
typedef struct seg_plan {
  _tide_arena *arena;
  _tide_segment *seg;
  size_t first, count;
} seg_plan;

typedef struct restore {
  const tide_checkpoint *k;
  seg_plan *segs;
  size_t nsegs, segs_cap;
  entry *entries;
  size_t nentries, entries_cap;
  size_t *records;  /* per arena: new block records */
  size_t *restored; /* per arena: blocks allocated again */
  size_t nreleased; /* allocated blocks that go */
  tide_restore_delta delta;
} restore;

static int out_of_memory(void) {
  return _tide_error_set(TIDE_ERR_OOM,
                         "tide_pool_restore: out of host memory for the new layout; the pool is "
                         "as it was");
}

static int add_entry(restore *r, entry e) {
  if (!_tide_grow_array((void **)&r->entries, &r->entries_cap, r->nentries + 1, sizeof e))
    return out_of_memory();
  r->entries[r->nentries++] = e;
  return TIDE_OK;
}

static int conflict(const _tide_segment *seg, const ckpt_block *want) {
  return _tide_error_set(TIDE_ERR_STATE,
                         "tide_pool_restore: the checkpoint's block at %p (%zu bytes) does not "
                         "lie in mapped memory of the segment at %p now; the pool is as it was",
                         (void *)want->addr, want->size, (void *)seg->base);
}

static const ckpt_block *next_allocated(const tide_checkpoint *k, size_t *i, size_t end) {
  while (*i < end && k->blocks[*i].state != CK_ALLOCATED) (*i)++;
  return *i < end ? &k->blocks[*i] : NULL;
}

static _tide_block *next_in_state(_tide_block *b, uint8_t state) {
  while (b && b->state != state) b = b->next;
  return b;
}

/* The new layout of `seg`: the checkpoint's allocated blocks (none if the
 * segment is newer than the checkpoint), the unmapped ranges of now, free
 * blocks between. */
static int plan_segment(restore *r, size_t arena_index, _tide_arena *arena, _tide_segment *seg,
                        const ckpt_segment *cs) {
  const tide_checkpoint *k = r->k;
  size_t ci = cs ? cs->first : 0, cend = cs ? cs->first + cs->count : 0;
  const ckpt_block *want = next_allocated(k, &ci, cend);
  _tide_block *hole = next_in_state(seg->first, _TIDE_UNMAPPED);
  _tide_block *live = next_in_state(seg->first, _TIDE_ALLOCATED);
  uintptr_t pos = seg->base, end = seg->base + seg->size;
  size_t first = r->nentries;
  int rc = TIDE_OK;
  while (pos < end && !rc) {
    if (want && want->addr < pos) return conflict(seg, want);
    if (want && want->addr == pos) {
      if (want->size > end - pos || (hole && hole->addr < pos + want->size))
        return conflict(seg, want);
      while (live && live->addr < pos) live = next_in_state(live->next, _TIDE_ALLOCATED);
      entry e = {
          .addr = pos, .size = want->size, .requested = want->requested, .state = CK_ALLOCATED};
      if (live && live->addr == pos && live->size == want->size) e.keep = live;
      r->records[arena_index] += !e.keep;
      r->restored[arena_index] += !e.keep;
      rc = add_entry(r, e);
      pos += want->size;
      ci++;
      want = next_allocated(k, &ci, cend);
      continue;
    }
    if (hole && hole->addr == pos) {
      rc = add_entry(r, (entry){.addr = pos, .size = hole->size, .state = CK_UNMAPPED});
      r->records[arena_index]++;
      pos += hole->size;
      hole = next_in_state(hole->next, _TIDE_UNMAPPED);
      continue;
    }
    uintptr_t stop = end;
    if (want && want->addr < stop) stop = want->addr;
    if (hole && hole->addr < stop) stop = hole->addr;
    rc = add_entry(r, (entry){.addr = pos, .size = stop - pos, .state = CK_FREE});
    r->records[arena_index]++;
    pos = stop;
  }
  if (!rc && want) return conflict(seg, want);
  if (rc) return rc;
  if (!_tide_grow_array((void **)&r->segs, &r->segs_cap, r->nsegs + 1, sizeof *r->segs))
    return out_of_memory();
  r->segs[r->nsegs++] =
      (seg_plan){.arena = arena, .seg = seg, .first = first, .count = r->nentries - first};
  for (_tide_block *b = seg->first; b; b = b->next) r->nreleased += b->state == _TIDE_ALLOCATED;
  for (size_t i = first; i < r->nentries; i++) r->nreleased -= r->entries[i].keep != NULL;
  return TIDE_OK;
}

static const ckpt_segment *checkpoint_segment(const tide_checkpoint *k, const _tide_segment *seg) {
  for (size_t i = 0; i < k->nsegments; i++)
    if (k->segments[i].base == seg->base && k->segments[i].size == seg->size)
      return &k->segments[i];
  return NULL;
}

static int plan(restore *r, _tide_arena **arenas, size_t n) {
  size_t matched = 0;
  for (size_t i = 0; i < n; i++) {
    EACH_SEGMENT(arenas[i], seg) {
      const ckpt_segment *cs = checkpoint_segment(r->k, seg);
      matched += cs != NULL;
      int rc = plan_segment(r, i, arenas[i], seg, cs);
      if (rc) return rc;
    }
  }
  if (matched != r->k->nsegments)
    return _tide_error_set(TIDE_ERR_STATE,
                           "tide_pool_restore: %zu segment(s) of the checkpoint are no longer in "
                           "the pool; the pool is as it was",
                           r->k->nsegments - matched);
  return TIDE_OK;
}

/* ------------------------------------------------------------------------ */
/* Restore: preparing and applying                                           */
/* ------------------------------------------------------------------------ */

/* At least n block records on the arena's spare list, so that taking them
 * cannot fail. */
static int reserve_records(_tide_arena *arena, size_t n) {
  _tide_block *taken = NULL;
  size_t got = 0;
  for (; got < n; got++) {
    _tide_block *b = _tide_block_new(arena);
    if (!b) break;
    b->link_next = taken;
    taken = b;
  }
  while (taken) {
    _tide_block *next = taken->link_next;
    _tide_block_delete(arena, taken);
    taken = next;
  }
  return got == n ? TIDE_OK : out_of_memory();
}

/* Room in the live map for `more` entries, so that putting them cannot fail. */
static int reserve_live(_tide_arena *arena, size_t more) {
  while ((arena->live.count + more) * 2 > arena->live.mask + 1)
    if (_tide_ptrmap_grow(&arena->live) != TIDE_OK) return out_of_memory();
  return TIDE_OK;
}

static int prepare(restore *r, _tide_arena **arenas, size_t n) {
  size_t restored = 0;
  for (size_t i = 0; i < n; i++) {
    int rc = reserve_records(arenas[i], r->records[i]);
    if (!rc) rc = reserve_live(arenas[i], r->restored[i]);
    if (rc) return rc;
    restored += r->restored[i];
  }
  r->delta.restored = malloc((restored ? restored : 1) * sizeof(void *));
  r->delta.released = malloc((r->nreleased ? r->nreleased : 1) * sizeof(void *));
  return r->delta.restored && r->delta.released ? TIDE_OK : out_of_memory();
}

/* Take the segment's blocks out of the bins, the unmapped list and the live
 * map (all but those kept), and give their records back. */
static void take_apart(restore *r, const seg_plan *sp) {
  _tide_arena *arena = sp->arena;
  _tide_pool *pool = &arena->pools[sp->seg->pool];
  const entry *e = &r->entries[sp->first], *e_end = e + sp->count;
  /* Links stay intact until every block is out: the bins' stats ask
   * whether a block is split. */
  for (_tide_block *b = sp->seg->first; b; b = b->next) {
    while (e < e_end && (!e->keep || e->keep->addr < b->addr)) e++;
    if (e < e_end && e->keep == b) continue;
    if (b->state == _TIDE_FREE) {
      _tide_pool_remove(arena, b);
    } else if (b->state == _TIDE_UNMAPPED) {
      _tide_unmapped_remove(pool, b);
    } else { /* allocated: checked before, nothing else is left */
      _tide_ptrmap_remove(&arena->live, b->addr);
      _tide_arena_count_released(arena, b);
      r->delta.released[r->delta.nreleased++] = (void *)b->addr;
    }
  }
  e = &r->entries[sp->first];
  _tide_block *next;
  for (_tide_block *b = sp->seg->first; b; b = next) {
    next = b->next;
    while (e < e_end && (!e->keep || e->keep->addr < b->addr)) e++;
    if (e < e_end && e->keep == b) continue;
    _tide_block_delete(arena, b);
  }
}

static void put_together(restore *r, const seg_plan *sp) {
  _tide_arena *arena = sp->arena;
  _tide_segment *seg = sp->seg;
  const entry *entries = &r->entries[sp->first];
  _tide_block *prev = NULL;
  for (size_t i = 0; i < sp->count; i++) {
    const entry *e = &entries[i];
    _tide_block *b = e->keep ? e->keep : _tide_block_new(arena); /* reserved: cannot fail */
    if (!e->keep) {
      b->addr = e->addr;
      b->size = e->size;
      b->segment = seg;
      b->stamp = arena->clock;
      b->state = e->state == CK_UNMAPPED ? _TIDE_UNMAPPED : _TIDE_FREE;
    }
    b->prev = prev;
    b->next = NULL;
    if (prev)
      prev->next = b;
    else
      seg->first = b;
    prev = b;
  }
  /* Into the bins, the unmapped list and the live map once linked. */
  size_t i = 0;
  for (_tide_block *b = seg->first; b; b = b->next, i++) {
    const entry *e = &entries[i];
    if (e->keep) continue;
    if (e->state == CK_FREE) {
      _tide_pool_insert(arena, b);
    } else if (e->state == CK_UNMAPPED) {
      _tide_unmapped_insert(&arena->pools[seg->pool], b);
    } else {
      _tide_ptrmap_put(&arena->live, b);
      _tide_arena_count_restored(arena, b, e->requested);
      r->delta.restored[r->delta.nrestored++] = (void *)b->addr;
    }
  }
}

/* Pending frees of the pool's blocks complete first; a block still pending
 * after that waits for a capture to end. */
static int settle(_tide_arena **arenas, size_t n) {
  for (size_t i = 0; i < n; i++) {
    int rc = _tide_arena_process_events(arenas[i], true);
    if (rc) {
      _tide_error_prefix("tide_pool_restore: waiting for frees of the pool's blocks on other "
                         "streams failed; the pool is as it was");
      return rc;
    }
    _tide_arena_flush_quick(arenas[i]);
    EACH_SEGMENT(arenas[i], seg) {
      for (const _tide_block *b = seg->first; b; b = b->next)
        if (b->state == _TIDE_PENDING)
          return _tide_error_set(TIDE_ERR_STATE,
                                 "tide_pool_restore: the free of %p waits for a graph capture "
                                 "to end; restore after it",
                                 (void *)b->addr);
    }
  }
  return TIDE_OK;
}

static int restore_locked(restore *r, tide_pool *pool, _tide_arena **arenas, size_t n) {
  if (r->k->pool_id != pool->id)
    return _tide_error_set(TIDE_ERR_INVALID,
                           "tide_pool_restore: the checkpoint is of pool %llu, not of pool %llu",
                           (unsigned long long)r->k->pool_id, (unsigned long long)pool->id);
  if (pool->captures)
    return _tide_error_set(TIDE_ERR_STATE,
                           "tide_pool_restore: a capture allocates to pool %llu now; restore "
                           "after tide_capture_end",
                           (unsigned long long)pool->id);
  r->records = calloc(n ? n : 1, sizeof *r->records);
  r->restored = calloc(n ? n : 1, sizeof *r->restored);
  if (!r->records || !r->restored) return out_of_memory();
  int rc = settle(arenas, n);
  if (!rc) rc = plan(r, arenas, n);
  if (!rc) rc = prepare(r, arenas, n);
  if (rc) return rc;
  for (size_t i = 0; i < r->nsegs; i++) take_apart(r, &r->segs[i]);
  for (size_t i = 0; i < r->nsegs; i++) put_together(r, &r->segs[i]);
  return TIDE_OK;
}

tide_status tide_pool_restore(tide_pool *pool, const tide_checkpoint *checkpoint,
                              tide_restore_delta *delta) {
  if (delta) memset(delta, 0, sizeof *delta);
  if (!_tide_capture_pool_valid(pool) || !checkpoint)
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID,
                                        "tide_pool_restore: %s is NULL or invalid",
                                        checkpoint ? "the pool" : "the checkpoint");
  /* Captures found by capture_detection that have ended (their stream left
   * them, or is gone) let go of the pool first: the checks below look at
   * the pool's captures. Then frees deferred by captures that have ended
   * are frees now, not deferred ones that would refuse the restore. */
  _tide_capture_prune(pool->alloc);
  _tide_capture_retry_deferred(pool->alloc);
  /* (After the refusals that come first: another pool's checkpoint, a
   * capture allocating to the pool.) */
  int rc =
      checkpoint->pool_id == pool->id ? _tide_capture_deferred_stuck(pool->alloc, pool) : TIDE_OK;
  if (rc) {
    _tide_error_prefix("tide_pool_restore");
    return (tide_status)rc;
  }
  _tide_arena **arenas;
  size_t n;
  rc = enter_pool(pool, __func__, &arenas, &n);
  if (rc) return (tide_status)rc;
  restore r = {.k = checkpoint};
  rc = restore_locked(&r, pool, arenas, n);
  leave_pool(pool, arenas, n);
  free(r.segs);
  free(r.entries);
  free(r.records);
  free(r.restored);
  if (rc || !delta)
    tide_restore_delta_free(&r.delta);
  else
    *delta = r.delta;
  return (tide_status)rc;
}
