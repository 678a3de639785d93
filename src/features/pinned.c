/* pinned.c: the pinned host memory pool, page-locked host memory for
 * asynchronous copies between the device and the CPU (outputs offloaded
 * every frame, inputs staged for upload).
 *
 * The policy is PyTorch's CachingHostAllocator's: every request is rounded
 * up to a power of two and served by a block of exactly that size class,
 * each block being one pinned allocation of the backend (cuMemHostAlloc);
 * freed blocks wait in their class's free list until a request of the same
 * class takes them back. Blocks are never split or merged: pinning is slow
 * (the pages are locked and mapped for the device), so the point is to pin
 * rarely, and a workload's few output shapes soon each have a block.
 * The smallest class is 4 KiB, a page: pinning locks whole pages, so a
 * smaller class would hold the same memory and only report less of it.
 *
 * Reuse is ordered by streams as it is for device memory. A block freed on
 * the stream it was allocated on is reused at once by that stream: work
 * queued on one stream runs in order. Every free also records an event on
 * that stream, so that requests on other streams may take the block once
 * the work queued before the free is done. A block recorded on other
 * streams (tide_pinned_record_stream), or freed on another stream, waits in
 * the pending list for events on those streams first. When an event cannot
 * be had, the stream is waited for instead.
 *
 * Everything is guarded by one mutex: allocating pinned memory is not a hot
 * path. The backend's pinned allocation runs outside it, as it is slow. */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "features/pinned.h"
#include "memory/arena_table.h"

#define MIN_CLASS 12u /* 4 KiB */
#define CLASSES 64u

typedef enum block_state {
  BLOCK_FREE = 0,      /* in its class's free list */
  BLOCK_ALLOCATED = 1, /* handed to the user */
  BLOCK_PENDING = 2,   /* freed, waiting for events of other streams */
} block_state;

typedef struct pinned_block {
  uintptr_t addr;
  size_t size;          /* its class: a power of two */
  size_t requested;     /* allocated blocks: what the user asked for */
  tide_stream stream;   /* allocated on; free blocks: the stream that may reuse it at once */
  _tide_event ready;    /* free blocks: recorded on `stream` at the free; NULL once done */
  tide_stream *streams; /* recorded with tide_pinned_record_stream */
  uint32_t nstreams, streams_cap;
  uint32_t events;                  /* pending blocks: events still outstanding */
  uint8_t state;                    /* block_state */
  uint8_t cls;                      /* log2 of size */
  uint8_t stream_gone;              /* `stream` was destroyed: no request reuses it at once (a new
                                       stream may get its handle), no event goes to it; the block
                                       may still be freed on it */
  struct pinned_block *prev, *next; /* its class's free list */
} pinned_block;

typedef struct pending_event {
  _tide_event event;
  pinned_block *block;
} pending_event;

struct _tide_pinned {
  pthread_mutex_t lock;
  tide_allocator *alloc;
  pinned_block *free_lists[CLASSES]; /* newest first */
  pinned_block **blocks;             /* every block, by address */
  size_t nblocks, blocks_cap;
  pending_event *pending; /* in record order */
  size_t npending, pending_cap;
  _tide_event *spare; /* created events ready for reuse */
  size_t nspare, spare_cap;
  _tide_arena_stats stats;
  uint64_t retries, ooms, syncs;
};

static const _tide_backend *backend(const _tide_pinned *pool) { return &pool->alloc->backend; }

static int pool_of(const pinned_block *b) {
  return b->size <= TIDE_SMALL_SIZE ? _TIDE_SMALL : _TIDE_LARGE;
}

static unsigned class_of(size_t size) {
  if (size <= ((size_t)1 << MIN_CLASS)) return MIN_CLASS;
  return 64u - (unsigned)__builtin_clzll((unsigned long long)(size - 1));
}

/* ------------------------------------------------------------------------ */
/* Blocks by address                                                         */
/* ------------------------------------------------------------------------ */

/* Index of the last block starting at or below addr, or SIZE_MAX. */
static size_t table_find_le(const _tide_pinned *pool, uintptr_t addr) {
  size_t lo = 0, hi = pool->nblocks;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (pool->blocks[mid]->addr <= addr)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo == 0 ? SIZE_MAX : lo - 1;
}

static pinned_block *table_find(const _tide_pinned *pool, uintptr_t addr) {
  size_t i = table_find_le(pool, addr);
  return i != SIZE_MAX && pool->blocks[i]->addr == addr ? pool->blocks[i] : NULL;
}

/* Room must have been made. */
static void table_insert(_tide_pinned *pool, pinned_block *b) {
  size_t i = table_find_le(pool, b->addr);
  size_t at = i == SIZE_MAX ? 0 : i + 1;
  memmove(&pool->blocks[at + 1], &pool->blocks[at], (pool->nblocks - at) * sizeof *pool->blocks);
  pool->blocks[at] = b;
  pool->nblocks++;
}

static void table_remove(_tide_pinned *pool, const pinned_block *b) {
  size_t i = table_find_le(pool, b->addr);
  memmove(&pool->blocks[i], &pool->blocks[i + 1], (pool->nblocks - i - 1) * sizeof *pool->blocks);
  pool->nblocks--;
}

/* ------------------------------------------------------------------------ */
/* Free lists                                                                */
/* ------------------------------------------------------------------------ */

static void list_push(_tide_pinned *pool, pinned_block *b) {
  pinned_block **head = &pool->free_lists[b->cls];
  b->state = BLOCK_FREE;
  b->prev = NULL;
  b->next = *head;
  if (*head) (*head)->prev = b;
  *head = b;
}

static void list_remove(_tide_pinned *pool, pinned_block *b) {
  if (b->prev)
    b->prev->next = b->next;
  else
    pool->free_lists[b->cls] = b->next;
  if (b->next) b->next->prev = b->prev;
  b->prev = b->next = NULL;
}

/* ------------------------------------------------------------------------ */
/* Stats                                                                     */
/* ------------------------------------------------------------------------ */

static void count_alloc(_tide_pinned *pool, const pinned_block *b, int sign) {
  _tide_arena_stats *s = &pool->stats;
  int kind = pool_of(b);
  _tide_stat_add(s, _TIDE_ST_ALLOCATED, kind, sign * (int64_t)b->size);
  _tide_stat_add(s, _TIDE_ST_REQUESTED, kind, sign * (int64_t)b->requested);
  _tide_stat_add(s, _TIDE_ST_ALLOCATIONS, kind, sign);
  s->counters[sign > 0 ? _TIDE_CT_ALLOCS : _TIDE_CT_FREES]++;
  _tide_track_active(s);
}

static void count_pending(_tide_pinned *pool, const pinned_block *b, int sign) {
  _tide_arena_stats *s = &pool->stats;
  _tide_stat_add(s, _TIDE_ST_PENDING, pool_of(b), sign * (int64_t)b->size);
  _tide_stat_add(s, _TIDE_ST_PENDING_BLOCKS, pool_of(b), sign);
  _tide_track_active(s);
}

static void count_reserved(_tide_pinned *pool, const pinned_block *b, int sign) {
  _tide_arena_stats *s = &pool->stats;
  _tide_stat_add(s, _TIDE_ST_RESERVED, pool_of(b), sign * (int64_t)b->size);
  _tide_stat_add(s, _TIDE_ST_SEGMENTS, pool_of(b), sign);
  s->counters[sign > 0 ? _TIDE_CT_SEGMENTS_CREATED : _TIDE_CT_SEGMENTS_RELEASED]++;
  s->counters[sign > 0 ? _TIDE_CT_DEVICE_ALLOC : _TIDE_CT_DEVICE_FREE]++;
}

static tide_stat stat_of(const _tide_arena_stats *s, int st, int p) {
  return (tide_stat){.current = s->cur[st][p], .peak = s->peak[st][p]};
}

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

void _tide_pinned_stats(_tide_pinned *pool, tide_stats *out) {
  memset(out, 0, sizeof *out);
  pthread_mutex_lock(&pool->lock);
  const _tide_arena_stats *s = &pool->stats;
  for (int p = 0; p < TIDE_POOL_KINDS; p++) {
    out->allocated_bytes[p] = stat_of(s, _TIDE_ST_ALLOCATED, p);
    out->requested_bytes[p] = stat_of(s, _TIDE_ST_REQUESTED, p);
    out->reserved_bytes[p] = stat_of(s, _TIDE_ST_RESERVED, p);
    out->allocations[p] = stat_of(s, _TIDE_ST_ALLOCATIONS, p);
    out->segments[p] = stat_of(s, _TIDE_ST_SEGMENTS, p);
    /* Active is allocated plus pending; its peak is kept while blocks pend. */
    out->active_bytes[p].current = s->cur[_TIDE_ST_ALLOCATED][p] + s->cur[_TIDE_ST_PENDING][p];
    out->active_bytes[p].peak = max64(s->peak[_TIDE_ST_ALLOCATED][p], s->active_peak[0][p]);
    out->active_blocks[p].current =
        s->cur[_TIDE_ST_ALLOCATIONS][p] + s->cur[_TIDE_ST_PENDING_BLOCKS][p];
    out->active_blocks[p].peak = max64(s->peak[_TIDE_ST_ALLOCATIONS][p], s->active_peak[1][p]);
  }
  out->num_allocs = s->counters[_TIDE_CT_ALLOCS];
  out->num_frees = s->counters[_TIDE_CT_FREES];
  out->segments_created = s->counters[_TIDE_CT_SEGMENTS_CREATED];
  out->segments_released = s->counters[_TIDE_CT_SEGMENTS_RELEASED];
  out->num_device_alloc = s->counters[_TIDE_CT_DEVICE_ALLOC];
  out->num_device_free = s->counters[_TIDE_CT_DEVICE_FREE];
  out->num_alloc_retries = pool->retries;
  out->num_ooms = pool->ooms;
  out->num_sync_all_streams = pool->syncs;
  out->memory_limit = TIDE_NO_LIMIT; /* pinned memory is bounded by the system only */
  pthread_mutex_unlock(&pool->lock);
}

/* ------------------------------------------------------------------------ */
/* Events                                                                    */
/* ------------------------------------------------------------------------ */

static int take_event(_tide_pinned *pool, _tide_event *out) {
  if (pool->nspare) {
    *out = pool->spare[--pool->nspare];
    return TIDE_OK;
  }
  const _tide_backend *be = backend(pool);
  return be->ops->event_create(be->ctx, out);
}

static void give_event(_tide_pinned *pool, _tide_event e) {
  if (!_tide_grow_array((void **)&pool->spare, &pool->spare_cap, pool->nspare + 1,
                        sizeof *pool->spare)) {
    const _tide_backend *be = backend(pool);
    be->ops->event_destroy(be->ctx, e);
    return;
  }
  pool->spare[pool->nspare++] = e;
}

/* An event recorded on `s` now, or NULL after waiting for `s` instead (or,
 * when it no longer exists, for the default stream, whose queued work came
 * before). */
static int mark_stream(_tide_pinned *pool, tide_stream s, _tide_event *out) {
  const _tide_backend *be = backend(pool);
  _tide_event e;
  *out = NULL;
  if (take_event(pool, &e) == TIDE_OK) {
    if (be->ops->event_record(be->ctx, e, s) == TIDE_OK) {
      *out = e;
      return TIDE_OK;
    }
    give_event(pool, e);
  }
  if (be->ops->stream_synchronize(be->ctx, s) == TIDE_OK) return TIDE_OK;
  if (tide_last_status() != TIDE_ERR_INVALID) return tide_last_status();
  return be->ops->stream_synchronize(be->ctx, NULL);
}

/* A freed block whose last event completed goes to its free list. */
static void event_done(_tide_pinned *pool, size_t i) {
  pinned_block *b = pool->pending[i].block;
  give_event(pool, pool->pending[i].event);
  if (--b->events == 0) {
    count_pending(pool, b, -1);
    list_push(pool, b);
  }
}

/* Complete what events allow; with `wait`, wait for all of them. Returns
 * the first failure (not-ready answers of queries are no failure). */
static int process_events(_tide_pinned *pool, bool wait) {
  const _tide_backend *be = backend(pool);
  size_t kept = 0;
  _tide_first_error first = {0};
  for (size_t i = 0; i < pool->npending; i++) {
    _tide_event e = pool->pending[i].event;
    int rc = wait ? be->ops->event_synchronize(be->ctx, e) : be->ops->event_query(be->ctx, e);
    if (rc == TIDE_OK) {
      event_done(pool, i);
      continue;
    }
    if (wait || rc != TIDE_ERR_NOT_READY) _tide_first_error_note(&first, rc);
    pool->pending[kept++] = pool->pending[i];
  }
  pool->npending = kept;
  return _tide_first_error_end(&first);
}

/* Whether the work queued on a free block's stream before its free is done:
 * its ready event completed (asked with `wait` or not). */
static bool settled(_tide_pinned *pool, pinned_block *b, bool wait) {
  if (!b->ready) return true;
  const _tide_backend *be = backend(pool);
  int rc = wait ? be->ops->event_synchronize(be->ctx, b->ready)
                : be->ops->event_query(be->ctx, b->ready);
  if (rc != TIDE_OK) return false;
  give_event(pool, b->ready);
  b->ready = NULL;
  return true;
}

/* ------------------------------------------------------------------------ */
/* Creation and destruction                                                  */
/* ------------------------------------------------------------------------ */

int _tide_pinned_create(tide_allocator *a, _tide_pinned **out) {
  _tide_pinned *pool = calloc(1, sizeof *pool);
  if (!pool) return _tide_error_set(TIDE_ERR_OOM, "out of host memory for the pinned pool");
  pthread_mutex_init(&pool->lock, NULL);
  pool->alloc = a;
  *out = pool;
  return TIDE_OK;
}

size_t _tide_pinned_destroy(_tide_pinned *pool) {
  if (!pool) return 0;
  const _tide_backend *be = backend(pool);
  _tide_saved_error saved;
  _tide_error_save(&saved);
  /* The copies still queued must not land in memory given back. */
  process_events(pool, true);
  size_t in_use = 0;
  for (size_t i = 0; i < pool->nblocks; i++) {
    pinned_block *b = pool->blocks[i];
    in_use += b->state != BLOCK_FREE;
    if (b->ready) {
      be->ops->event_synchronize(be->ctx, b->ready);
      be->ops->event_destroy(be->ctx, b->ready);
    }
    be->ops->host_free(be->ctx, (void *)b->addr);
    free(b->streams);
    free(b);
  }
  for (size_t i = 0; i < pool->npending; i++)
    be->ops->event_destroy(be->ctx, pool->pending[i].event);
  for (size_t i = 0; i < pool->nspare; i++) be->ops->event_destroy(be->ctx, pool->spare[i]);
  free(pool->blocks);
  free(pool->pending);
  free(pool->spare);
  pthread_mutex_destroy(&pool->lock);
  free(pool);
  _tide_error_restore(&saved);
  return in_use;
}

/* ------------------------------------------------------------------------ */
/* Pointers and streams from the user                                        */
/* ------------------------------------------------------------------------ */

/* A pointer that is no allocated block: why, with the status. Under the lock. */
static int explain(_tide_pinned *pool, const char *op, uintptr_t addr) {
  size_t i = table_find_le(pool, addr);
  const pinned_block *b = i == SIZE_MAX ? NULL : pool->blocks[i];
  if (!b || addr >= b->addr + b->size) return -1; /* not ours at all */
  void *p = (void *)addr;
  if (b->state != BLOCK_ALLOCATED)
    return _tide_error_set(TIDE_ERR_DOUBLE_FREE,
                           "%s(%p): %s pinned memory that was already freed (double free, or a "
                           "pointer kept after its free)",
                           op, p, addr == b->addr ? "the block is" : "the pointer lies in");
  return _tide_error_set(TIDE_ERR_BAD_POINTER,
                         "%s(%p): not the start of a pinned block: it lies %zu bytes into the "
                         "block at %p of %zu bytes (pass the pointer tide_pinned_malloc returned)",
                         op, p, (size_t)(addr - b->addr), (void *)b->addr, b->size);
}

/* The allocated block at ptr, or NULL with the reason set. Takes the lock
 * when it finds the block, and leaves it released otherwise. */
static pinned_block *lock_block(_tide_pinned *pool, const char *op, const void *ptr) {
  uintptr_t addr = (uintptr_t)ptr;
  pthread_mutex_lock(&pool->lock);
  pinned_block *b = table_find(pool, addr);
  if (b && b->state == BLOCK_ALLOCATED) return b;
  int rc = explain(pool, op, addr);
  pthread_mutex_unlock(&pool->lock);
  if (rc >= 0) return NULL;
  void *base = NULL;
  bool device = _tide_block_info(pool->alloc, (uintptr_t)ptr, &base, NULL, NULL) == TIDE_OK;
  _tide_error_set(TIDE_ERR_BAD_POINTER, "%s(%p): not pinned memory of this allocator (device %d)%s",
                  op, ptr, pool->alloc->device,
                  device ? ": it is device memory from tide_malloc, freed with tide_free" : "");
  return NULL;
}

static int check_stream(_tide_pinned *pool, const char *op, tide_stream stream) {
  const _tide_backend *be = backend(pool);
  if (!be->ops->stream_check || be->ops->stream_check(be->ctx, stream) == TIDE_OK) return TIDE_OK;
  return _tide_error_set(TIDE_ERR_INVALID,
                         "%s: stream %p is not a stream of this device (unknown or destroyed)", op,
                         (void *)stream);
}

static bool has_stream(const pinned_block *b, tide_stream s) {
  for (uint32_t i = 0; i < b->nstreams; i++)
    if (b->streams[i] == s) return true;
  return false;
}

static int add_stream(pinned_block *b, tide_stream s) {
  if (s == b->stream || has_stream(b, s)) return TIDE_OK;
  if (b->nstreams == UINT32_MAX)
    return _tide_error_set(TIDE_ERR_INVALID, "pinned block %p is recorded on too many streams",
                           (void *)b->addr);
  size_t cap = b->streams_cap;
  if (!_tide_grow_array((void **)&b->streams, &cap, (size_t)b->nstreams + 1, sizeof *b->streams))
    return _tide_error_set(TIDE_ERR_OOM, "out of host memory recording a stream");
  b->streams_cap = (uint32_t)(cap > UINT32_MAX ? UINT32_MAX : cap);
  b->streams[b->nstreams++] = s;
  return TIDE_OK;
}

/* ------------------------------------------------------------------------ */
/* Allocation                                                                */
/* ------------------------------------------------------------------------ */

/* A cached block of class `cls` that `stream` may use now: one of its own
 * stream first (no driver call), then one whose stream is done with it. */
static pinned_block *take_cached(_tide_pinned *pool, unsigned cls, tide_stream stream) {
  pinned_block *found = NULL;
  for (pinned_block *b = pool->free_lists[cls]; b && !found; b = b->next)
    if (b->stream == stream && !b->stream_gone) found = b;
  for (pinned_block *b = pool->free_lists[cls]; b && !found; b = b->next)
    if (settled(pool, b, false)) found = b;
  if (!found) return NULL;
  list_remove(pool, found);
  /* Its stream's work before the free is behind us, or ahead in our stream. */
  if (found->ready) give_event(pool, found->ready);
  found->ready = NULL;
  return found;
}

static void hand_out(_tide_pinned *pool, pinned_block *b, size_t size, tide_stream stream) {
  b->state = BLOCK_ALLOCATED;
  b->stream = stream;
  b->stream_gone = 0;
  b->requested = size;
  count_alloc(pool, b, +1);
}

/* New pinned memory for a block of `bytes`, handed out at once. The
 * backend's call runs outside the lock. */
static int new_block(_tide_pinned *pool, size_t bytes, size_t size, tide_stream stream,
                     pinned_block **out) {
  const _tide_backend *be = backend(pool);
  pinned_block *b = calloc(1, sizeof *b);
  if (!b) return _tide_error_set(TIDE_ERR_OOM, "out of host memory for a pinned block's record");
  void *p = NULL;
  int rc = be->ops->host_alloc(be->ctx, bytes, &p);
  if (rc) {
    free(b);
    return rc;
  }
  b->addr = (uintptr_t)p;
  b->size = bytes;
  b->cls = (uint8_t)class_of(bytes);
  pthread_mutex_lock(&pool->lock);
  if (!_tide_grow_array((void **)&pool->blocks, &pool->blocks_cap, pool->nblocks + 1,
                        sizeof *pool->blocks)) {
    pthread_mutex_unlock(&pool->lock);
    be->ops->host_free(be->ctx, p);
    free(b);
    return _tide_error_set(TIDE_ERR_OOM, "out of host memory for the pinned pool's table");
  }
  table_insert(pool, b);
  count_reserved(pool, b, +1);
  hand_out(pool, b, size, stream);
  pthread_mutex_unlock(&pool->lock);
  *out = b;
  return TIDE_OK;
}

static void out_of_memory(_tide_pinned *pool, size_t size, size_t bytes, tide_stream stream,
                          const char *cause) {
  char b[3][32];
  pthread_mutex_lock(&pool->lock);
  pool->ooms++;
  int64_t in_use = pool->stats.cur[_TIDE_ST_ALLOCATED][0];
  int64_t held = pool->stats.cur[_TIDE_ST_RESERVED][0];
  pthread_mutex_unlock(&pool->lock);
  _tide_error_set(TIDE_ERR_OOM,
                  "out of pinned host memory: tried to allocate %s (%zu bytes asked) on stream %p; "
                  "the pinned pool of device %d holds %s, %s of it in use, after returning its "
                  "cache and trying again. Cause: %s. Try: free pinned blocks no longer needed "
                  "(tide_pinned_free), or use fewer or smaller pinned buffers (pinned memory is "
                  "host RAM the system can neither swap nor give to others)",
                  _tide_format_bytes(bytes, b[0], 32), size, (void *)stream, pool->alloc->device,
                  _tide_format_bytes((uint64_t)held, b[1], 32),
                  _tide_format_bytes((uint64_t)in_use, b[2], 32), cause);
}

/* The backend could not pin more: return the cache and try once more. Any
 * failure is retried: returning the cache only costs time on a path that
 * already failed, and a failure that is not a lack of memory comes back. */
static pinned_block *malloc_retry(_tide_pinned *pool, size_t size, size_t bytes,
                                  tide_stream stream) {
  pthread_mutex_lock(&pool->lock);
  pool->retries++;
  pool->syncs++;
  pthread_mutex_unlock(&pool->lock);
  _tide_saved_error cause;
  _tide_error_save(&cause);
  _tide_pinned_empty_cache(pool);
  pinned_block *b = NULL;
  int rc = new_block(pool, bytes, size, stream, &b);
  if (rc == TIDE_OK) return b;
  char text[512];
  snprintf(text, sizeof text, "%s", tide_last_error());
  if (rc == TIDE_ERR_OOM) {
    out_of_memory(pool, size, bytes, stream, text);
  } else {
    _tide_error_set((tide_status)rc,
                    "tide_pinned_malloc(%zu bytes): the backend failed (%s), and again after the "
                    "pinned cache was returned: %s",
                    size, cause.text, text);
  }
  return NULL;
}

void *_tide_pinned_malloc(_tide_pinned *pool, size_t size, tide_stream stream) {
  if (size == 0 || size > TIDE_MAX_ALLOC) {
    _tide_error_set(TIDE_ERR_INVALID,
                    size == 0
                        ? "tide_pinned_malloc: size 0 asks for nothing; no block was "
                          "allocated"
                        : "tide_pinned_malloc: size %zu is larger than any host (limit 4 PiB)",
                    size);
    return NULL;
  }
  if (check_stream(pool, "tide_pinned_malloc", stream)) return NULL;
  unsigned cls = class_of(size);
  pthread_mutex_lock(&pool->lock);
  _tide_saved_error saved;
  _tide_error_save(&saved);
  process_events(pool, false);
  _tide_error_restore(&saved);
  pinned_block *b = take_cached(pool, cls, stream);
  if (b) hand_out(pool, b, size, stream);
  pthread_mutex_unlock(&pool->lock);
  if (b) return (void *)b->addr;
  size_t bytes = (size_t)1 << cls;
  if (new_block(pool, bytes, size, stream, &b) == TIDE_OK) return (void *)b->addr;
  b = malloc_retry(pool, size, bytes, stream);
  return b ? (void *)b->addr : NULL;
}

/* ------------------------------------------------------------------------ */
/* Freeing                                                                   */
/* ------------------------------------------------------------------------ */

/* Order the free after the work that uses b: an event on its own stream
 * (b->ready), and pending events on every other stream that used it. All or
 * nothing: on failure b is as it was. Under the lock. */
static int order_free(_tide_pinned *pool, pinned_block *b, tide_stream freed_on) {
  if (!_tide_grow_array((void **)&pool->pending, &pool->pending_cap,
                        pool->npending + b->nstreams + 1, sizeof *pool->pending))
    return _tide_error_set(TIDE_ERR_OOM, "out of host memory for stream events");
  size_t start = pool->npending;
  int rc = TIDE_OK;
  for (uint32_t i = 0; i <= b->nstreams && !rc; i++) {
    tide_stream s = i < b->nstreams ? b->streams[i] : freed_on;
    if (s == b->stream || (i == b->nstreams && has_stream(b, s))) continue;
    _tide_event e;
    rc = mark_stream(pool, s, &e);
    if (!rc && e) pool->pending[pool->npending++] = (pending_event){.event = e, .block = b};
  }
  _tide_event ready = NULL;
  if (!rc && !b->stream_gone) rc = mark_stream(pool, b->stream, &ready);
  if (rc) {
    for (size_t j = start; j < pool->npending; j++) give_event(pool, pool->pending[j].event);
    pool->npending = start;
    return rc;
  }
  b->ready = ready;
  b->events = (uint32_t)(pool->npending - start);
  return TIDE_OK;
}

int _tide_pinned_free(_tide_pinned *pool, void *ptr, tide_stream stream) {
  if (!ptr) return TIDE_OK;
  pinned_block *b = lock_block(pool, "tide_pinned_free", ptr);
  if (!b) return tide_last_status();
  int rc = stream == b->stream ? TIDE_OK : check_stream(pool, "tide_pinned_free", stream);
  if (!rc) rc = order_free(pool, b, stream);
  if (rc) {
    pthread_mutex_unlock(&pool->lock);
    return _tide_error_set((tide_status)rc,
                           "cannot free pinned block %p: ordering the free after the streams that "
                           "use it failed (%s); the block is still allocated",
                           ptr, tide_last_error());
  }
  b->nstreams = 0;
  count_alloc(pool, b, -1);
  if (b->events) {
    b->state = BLOCK_PENDING;
    count_pending(pool, b, +1);
  } else {
    list_push(pool, b);
  }
  pthread_mutex_unlock(&pool->lock);
  return TIDE_OK;
}

int _tide_pinned_record_stream(_tide_pinned *pool, void *ptr, tide_stream stream) {
  if (!ptr)
    return _tide_error_set(TIDE_ERR_INVALID, "tide_pinned_record_stream: the pointer is NULL");
  if (check_stream(pool, "tide_pinned_record_stream", stream)) return TIDE_ERR_INVALID;
  pinned_block *b = lock_block(pool, "tide_pinned_record_stream", ptr);
  if (!b) return tide_last_status();
  int rc = add_stream(b, stream);
  pthread_mutex_unlock(&pool->lock);
  return rc;
}

/* ------------------------------------------------------------------------ */
/* Returning memory                                                          */
/* ------------------------------------------------------------------------ */

/* Give one free block back to the backend; on failure it stays cached. */
static int release(_tide_pinned *pool, pinned_block *b) {
  const _tide_backend *be = backend(pool);
  int rc = be->ops->host_free(be->ctx, (void *)b->addr);
  if (rc) return rc;
  list_remove(pool, b);
  table_remove(pool, b);
  count_reserved(pool, b, -1);
  free(b->streams);
  free(b);
  return TIDE_OK;
}

int _tide_pinned_empty_cache(_tide_pinned *pool) {
  pthread_mutex_lock(&pool->lock);
  _tide_first_error first = {0};
  _tide_first_error_note(&first, process_events(pool, true));
  for (unsigned cls = 0; cls < CLASSES; cls++) {
    pinned_block *next;
    for (pinned_block *b = pool->free_lists[cls]; b; b = next) {
      next = b->next;
      _tide_first_error_note(&first,
                             settled(pool, b, true) ? release(pool, b) : (int)tide_last_status());
    }
  }
  pthread_mutex_unlock(&pool->lock);
  int rc = _tide_first_error_end(&first);
  if (rc) _tide_error_prefix("tide_pinned_empty_cache: a cached pinned block was kept");
  return rc;
}

void _tide_pinned_stream_gone(_tide_pinned *pool, tide_stream stream) {
  const _tide_backend *be = backend(pool);
  _tide_saved_error saved;
  _tide_error_save(&saved);
  pthread_mutex_lock(&pool->lock);
  /* Blocks of the stream are waited for now; later, their ready events (if
   * any) say when their work is done. */
  be->ops->stream_synchronize(be->ctx, stream);
  for (size_t i = 0; i < pool->nblocks; i++)
    if (pool->blocks[i]->stream == stream) pool->blocks[i]->stream_gone = 1;
  pthread_mutex_unlock(&pool->lock);
  _tide_error_restore(&saved);
}

/* ------------------------------------------------------------------------ */
/* Consistency (tide_check)                                                  */
/* ------------------------------------------------------------------------ */

typedef struct pinned_sums {
  int64_t cur[_TIDE_ST_COUNT][TIDE_POOL_KINDS];
  size_t free_blocks, pending_blocks;
} pinned_sums;

static void sum_add(pinned_sums *s, int stat, const pinned_block *b, int64_t value) {
  s->cur[stat][0] += value;
  s->cur[stat][pool_of(b) + 1] += value;
}

static bool pinned_fail(char *why, size_t len, const char *fmt, ...) TIDE_PRINTF(3, 4);

static bool pinned_fail(char *why, size_t len, const char *fmt, ...) {
  int used = snprintf(why, len, "pinned pool: ");
  va_list ap;
  va_start(ap, fmt);
  if (used >= 0 && (size_t)used < len) vsnprintf(why + used, len - (size_t)used, fmt, ap);
  va_end(ap);
  return false;
}

#define PCHECK(cond, ...)                                                                          \
  do {                                                                                             \
    if (!(cond)) return pinned_fail(why, len, __VA_ARGS__);                                        \
  } while (0)

/* The table: sorted, disjoint, every block a whole class of its state. */
static bool check_table(const _tide_pinned *pool, pinned_sums *s, char *why, size_t len) {
  for (size_t i = 0; i < pool->nblocks; i++) {
    const pinned_block *b = pool->blocks[i];
    PCHECK(b && b->size >= ((size_t)1 << MIN_CLASS) && b->size == (size_t)1 << b->cls &&
               b->addr % ((size_t)1 << MIN_CLASS) == 0,
           "block %zu (%p) has size %zu, class %u", i, b ? (void *)b->addr : NULL, b ? b->size : 0,
           b ? b->cls : 0);
    PCHECK(i == 0 || pool->blocks[i - 1]->addr + pool->blocks[i - 1]->size <= b->addr,
           "blocks %p and %p overlap or are out of order", (void *)pool->blocks[i - 1]->addr,
           (void *)b->addr);
    PCHECK(b->nstreams <= b->streams_cap, "block %p records %u streams in room for %u",
           (void *)b->addr, b->nstreams, b->streams_cap);
    PCHECK(b->state == BLOCK_ALLOCATED || b->nstreams == 0,
           "freed block %p still has %u recorded streams", (void *)b->addr, b->nstreams);
    PCHECK((b->state == BLOCK_PENDING) == (b->events > 0),
           "block %p in state %u waits for %u events", (void *)b->addr, b->state, b->events);
    sum_add(s, _TIDE_ST_RESERVED, b, (int64_t)b->size);
    sum_add(s, _TIDE_ST_SEGMENTS, b, 1);
    switch (b->state) {
    case BLOCK_FREE: s->free_blocks++; break;
    case BLOCK_ALLOCATED:
      PCHECK(b->requested > 0 && b->requested <= b->size && !b->ready,
             "allocated block %p of %zu bytes: %zu asked for, ready event %p", (void *)b->addr,
             b->size, b->requested, b->ready);
      sum_add(s, _TIDE_ST_ALLOCATED, b, (int64_t)b->size);
      sum_add(s, _TIDE_ST_REQUESTED, b, (int64_t)b->requested);
      sum_add(s, _TIDE_ST_ALLOCATIONS, b, 1);
      break;
    case BLOCK_PENDING:
      s->pending_blocks++;
      sum_add(s, _TIDE_ST_PENDING, b, (int64_t)b->size);
      sum_add(s, _TIDE_ST_PENDING_BLOCKS, b, 1);
      break;
    default: return pinned_fail(why, len, "block %p has state %u", (void *)b->addr, b->state);
    }
  }
  return true;
}

/* Free lists hold exactly the free blocks, each in its class's list; every
 * pending entry names a pending block, as often as it waits for events. */
static bool check_lists(const _tide_pinned *pool, const pinned_sums *s, char *why, size_t len) {
  size_t listed = 0;
  for (unsigned cls = 0; cls < CLASSES; cls++) {
    const pinned_block *prev = NULL;
    for (const pinned_block *b = pool->free_lists[cls]; b; prev = b, b = b->next) {
      PCHECK(++listed <= s->free_blocks, "the free lists are longer than the %zu free blocks",
             s->free_blocks);
      PCHECK(table_find(pool, b->addr) == b && b->state == BLOCK_FREE && b->cls == cls &&
                 b->prev == prev,
             "free list %u holds %p, not a free block of that class linked there", cls,
             (void *)b->addr);
    }
  }
  PCHECK(listed == s->free_blocks, "%zu free blocks, %zu in the free lists", s->free_blocks,
         listed);
  size_t events = 0, expected = 0;
  for (size_t i = 0; i < pool->npending; i++) {
    const pinned_block *b = pool->pending[i].block;
    PCHECK(b && table_find(pool, b->addr) == b && b->state == BLOCK_PENDING &&
               pool->pending[i].event,
           "pending entry %zu names %p, no pending block", i, b ? (void *)b->addr : NULL);
    events++;
  }
  for (size_t i = 0; i < pool->nblocks; i++) expected += pool->blocks[i]->events;
  PCHECK(events == expected, "%zu pending entries, the blocks wait for %zu events", events,
         expected);
  return true;
}

static bool check_pinned_stats(const _tide_pinned *pool, const pinned_sums *s, char *why,
                               size_t len) {
  static const int stats[] = {_TIDE_ST_ALLOCATED, _TIDE_ST_REQUESTED,   _TIDE_ST_PENDING,
                              _TIDE_ST_RESERVED,  _TIDE_ST_ALLOCATIONS, _TIDE_ST_PENDING_BLOCKS,
                              _TIDE_ST_SEGMENTS};
  const _tide_arena_stats *st = &pool->stats;
  for (size_t i = 0; i < sizeof stats / sizeof stats[0]; i++)
    for (int p = 0; p < TIDE_POOL_KINDS; p++) {
      int k = stats[i];
      PCHECK(st->cur[k][p] == s->cur[k][p] && st->peak[k][p] >= st->cur[k][p],
             "stat %d of pool %d is %lld (peak %lld), the blocks add up to %lld", k, p,
             (long long)st->cur[k][p], (long long)st->peak[k][p], (long long)s->cur[k][p]);
    }
  const uint64_t *c = st->counters;
  PCHECK(c[_TIDE_CT_ALLOCS] - c[_TIDE_CT_FREES] == (uint64_t)s->cur[_TIDE_ST_ALLOCATIONS][0] &&
             c[_TIDE_CT_DEVICE_ALLOC] - c[_TIDE_CT_DEVICE_FREE] == pool->nblocks &&
             c[_TIDE_CT_SEGMENTS_CREATED] - c[_TIDE_CT_SEGMENTS_RELEASED] == pool->nblocks,
         "counters disagree with %zu blocks and %lld allocations", pool->nblocks,
         (long long)s->cur[_TIDE_ST_ALLOCATIONS][0]);
  return true;
}

TIDE_CHECK_ONLY int _tide_pinned_validate(_tide_pinned *pool, char *why, size_t len) {
  pinned_sums s;
  memset(&s, 0, sizeof s);
  pthread_mutex_lock(&pool->lock);
  bool ok = pool->nblocks <= pool->blocks_cap && pool->npending <= pool->pending_cap &&
            pool->nspare <= pool->spare_cap;
  if (!ok) pinned_fail(why, len, "a table holds more entries than its room");
  ok = ok && check_table(pool, &s, why, len) && check_lists(pool, &s, why, len) &&
       check_pinned_stats(pool, &s, why, len);
  pthread_mutex_unlock(&pool->lock);
  return ok ? TIDE_OK : TIDE_ERR_STATE;
}
