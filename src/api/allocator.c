/* allocator.c: the device allocator behind the public API — creation,
 * the memory limit, malloc and free with the out-of-memory path, streams,
 * copies and the entry points of the pinned pool (pinned.c); the host
 * backend's controls are testing.c's. The arenas of streams and capture
 * pools are arena_table.c's; this file calls down into them and into the
 * features, and nothing below calls back into it.
 *
 * The fast path of tide_malloc/tide_free is: find the stream's arena in the
 * allocator's table of streams (arena_table.h, inline), take its lock, take
 * back (or keep) a quick block and update its stats (quick.h, inline: no
 * call). The rest of the full path, best fit or merging in the bins, is a
 * call into arena.c under the same lock; growth (segment.c) is below it.
 * What runs out of memory comes back here once, to the retries and the
 * error (malloc_failed); frees on the wrong stream and graph captures
 * (pool.c, one predictable branch on a flag) leave the fast path too. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "features/features.h"
#include "features/pinned.h"
#include "memory/quick.h"

static _Atomic uint64_t next_allocator_id = 1;

/* Allocators' memory outlives them (handles.c): a handle used after
 * tide_destroy reads a cleared magic word. */
static _tide_handle_kind allocators = {0};

/* ------------------------------------------------------------------------ */
/* Validation                                                                */
/* ------------------------------------------------------------------------ */

static bool valid(const tide_allocator *a) { return _tide_allocator_valid(a); }

/* ------------------------------------------------------------------------ */
/* Creation                                                                  */
/* ------------------------------------------------------------------------ */

/* backend:cuda insists on a GPU; backend:auto takes one when the driver and a
 * device are there, and the emulated device otherwise. */
static int open_backend(tide_allocator *a) {
  int kind = a->conf.backend;
  if (kind == TIDE_BACKEND_CUDA) return _tide_cuda_open(&a->conf, a->device, &a->backend);
  if (kind == TIDE_BACKEND_AUTO) {
    if (_tide_cuda_usable()) return _tide_cuda_open(&a->conf, a->device, &a->backend);
    tide_clear_error(); /* no GPU here is not a failure of auto */
  }
  return _tide_host_open(&a->conf, a->device, &a->backend);
}

static int read_device(tide_allocator *a) {
  const _tide_backend *be = &a->backend;
  size_t free_bytes = 0;
  int rc = be->ops->granularity(be->ctx, &a->granularity);
  if (!rc) rc = be->ops->mem_info(be->ctx, &free_bytes, &a->total_memory);
  if (rc) return rc;
  size_t page = a->conf.page_size;
  /* Pages must be whole mapping units of the device. */
  a->page_size = (page + a->granularity - 1) / a->granularity * a->granularity;
  a->handle_pages = a->conf.handle_size > a->page_size ? a->conf.handle_size / a->page_size : 1;
  if (a->handle_pages > TIDE_MAX_HANDLE_PAGES) a->handle_pages = TIDE_MAX_HANDLE_PAGES;
  a->handle_threshold = a->conf.handle_threshold == SIZE_MAX
                            ? TIDE_HANDLES_BEFORE_LARGE * a->handle_pages * a->page_size
                            : a->conf.handle_threshold;
  a->plain_rounding = true;
  for (int i = 0; i < TIDE_ROUNDUP_INTERVALS; i++)
    if (a->conf.roundup_divisions[i] > 1) a->plain_rounding = false;
  return TIDE_OK;
}

static size_t limit_of(const tide_allocator *a, double fraction, size_t bytes) {
  size_t limit = a->total_memory;
  if (fraction > 0.0 && fraction < 1.0) limit = (size_t)(fraction * (double)a->total_memory);
  if (bytes && bytes < limit) limit = bytes;
  return limit;
}

tide_status tide_create(int device, const tide_config *config, tide_allocator **out) {
  if (!out) return _tide_error_set(TIDE_ERR_INVALID, "tide_create: out is NULL");
  *out = NULL;
  if (device < 0)
    return _tide_error_set(TIDE_ERR_INVALID,
                           "tide_create: device %d does not exist (devices are "
                           "numbered from 0)",
                           device);
  tide_allocator *a =
      _tide_handle_new(&allocators, sizeof(tide_allocator)); /* 64-byte aligned: see its counters */
  if (!a) return _tide_error_set(TIDE_ERR_OOM, "out of host memory for an allocator");
  int rc = TIDE_OK;
  if (config) {
    a->config = _tide_config_clone(config);
    if (!a->config) rc = tide_last_status();
  } else if (!(rc = tide_config_new(&a->config))) {
    rc = tide_config_load_env(a->config);
  }
  if (rc) goto fail;
  a->conf = *_tide_config_values(a->config);
  a->device = device;
  if ((rc = open_backend(a))) goto fail;
  if ((rc = read_device(a))) goto fail_backend;
  if ((rc = _tide_trace_init(&a->trace, a->conf.trace_capacity))) goto fail_backend;
  if ((rc = _tide_pinned_create(a, &a->pinned))) goto fail_trace;
  atomic_init(&a->limit, limit_of(a, a->conf.memory_fraction, a->conf.memory_limit));
  atomic_init(&a->hit_extras, a->trace.cap != 0);
  _tide_captures_init(a);
  _tide_fast_paths_update(a, atomic_load(&a->capture_watch) != 0 || a->conf.capture_detection);
  pthread_mutex_init(&a->arenas_mutex, NULL);
  pthread_mutex_init(&a->reclaim_mutex, NULL);
  pthread_mutex_init(&a->bufs_mutex, NULL);
  /* tide_check waits for the buffers' page steps under way, and must not be
   * kept waiting by new ones. */
  pthread_rwlockattr_t writer_first;
  pthread_rwlockattr_init(&writer_first);
  pthread_rwlockattr_setkind_np(&writer_first, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
  pthread_rwlock_init(&a->bufs_pages, &writer_first);
  pthread_rwlockattr_destroy(&writer_first);
  pthread_mutex_init(&a->imports_mutex, NULL);
  a->id = atomic_fetch_add(&next_allocator_id, 1);
  a->magic = _TIDE_MAGIC;
  *out = a;
  return TIDE_OK;
fail_trace:
  _tide_trace_destroy(&a->trace);
fail_backend:
  a->backend.ops->destroy(a->backend.ctx);
fail:
  tide_config_free(a->config);
  _tide_handle_retire(&allocators, a);
  return (tide_status)rc;
}

tide_status tide_destroy(tide_allocator *a) {
  _TIDE_CHECK_ALLOCATOR(a, TIDE_ERR_INVALID);
  size_t unfreed = _tide_bufs_destroy_all(a); /* their stats live in the arenas */
  _tide_first_error refused = {0};            /* what the backend would not take back */
  _tide_first_error_note(&refused, _tide_imports_close_all(a));
  size_t n = atomic_load(&a->narenas);
  /* Frees ordered on streams that are past them (waited for, or never
   * held) are done: only those still waiting count as in use. */
  _tide_saved_error saved;
  _tide_error_save(&saved);
  for (size_t i = 0; i < n; i++) _tide_arena_process_events(a->arenas[i], false);
  _tide_error_restore(&saved);
  for (size_t i = 0; i < n; i++) unfreed += _tide_arena_destroy(a->arenas[i], &refused);
  free(a->arenas);
  _tide_captures_destroy(a);
  unfreed += _tide_pinned_destroy(a->pinned);
  a->backend.ops->destroy(a->backend.ctx);
  _tide_trace_destroy(&a->trace);
  tide_config_free(a->config);
  pthread_mutex_destroy(&a->arenas_mutex);
  pthread_mutex_destroy(&a->reclaim_mutex);
  pthread_mutex_destroy(&a->bufs_mutex);
  pthread_rwlock_destroy(&a->bufs_pages);
  pthread_mutex_destroy(&a->imports_mutex);
  a->magic = 0;
  _tide_handle_retire(&allocators, a);
  if (refused.status) {
    _tide_first_error_end(&refused);
    if (unfreed)
      _tide_error_prefix("allocator destroyed with %zu block(s) or buffer(s) still allocated or in "
                         "use by streams, and memory the device backend refused to give back",
                         unfreed);
    else
      _tide_error_prefix("allocator destroyed; memory the device backend refused to give back "
                         "stays held");
    return (tide_status)refused.status;
  }
  if (unfreed)
    return (tide_status)_tide_error_set(
        TIDE_ERR_STATE,
        "allocator destroyed with %zu block(s) or buffer(s) still allocated "
        "or in use by streams; their memory was released",
        unfreed);
  return TIDE_OK;
}

/* ------------------------------------------------------------------------ */
/* The memory limit (device_memory.c takes physical memory under it)         */
/* ------------------------------------------------------------------------ */

tide_status tide_set_memory_fraction(tide_allocator *a, double fraction) {
  _TIDE_CHECK_ALLOCATOR(a, TIDE_ERR_INVALID);
  if (!(fraction > 0.0 && fraction <= 1.0))
    return _tide_error_set(TIDE_ERR_INVALID,
                           "memory fraction %g is outside (0, 1]: give the share of the "
                           "device's memory reserved memory may reach",
                           fraction);
  /* The fraction and the byte limit change together with the limit they
   * make: two threads setting them at once leave the one of the last. */
  _tide_lock_acquire(&a->limits_lock);
  a->conf.memory_fraction = fraction;
  atomic_store(&a->limit, limit_of(a, fraction, a->conf.memory_limit));
  _tide_lock_release(&a->limits_lock);
  return TIDE_OK;
}

tide_status tide_set_memory_limit(tide_allocator *a, size_t bytes) {
  _TIDE_CHECK_ALLOCATOR(a, TIDE_ERR_INVALID);
  _tide_lock_acquire(&a->limits_lock);
  a->conf.memory_limit = bytes;
  atomic_store(&a->limit, limit_of(a, a->conf.memory_fraction, bytes));
  _tide_lock_release(&a->limits_lock);
  return TIDE_OK;
}

/* ------------------------------------------------------------------------ */
/* Allocation, top to bottom                                                 */
/* ------------------------------------------------------------------------ */

/* The size a request takes: 512-byte steps, or roundup_power2_divisions. */
static inline size_t rounded_size(const tide_allocator *a, size_t size) {
  return TIDE_LIKELY(a->plain_rounding) ? (size + TIDE_MIN_BLOCK - 1) & ~(TIDE_MIN_BLOCK - 1)
                                        : _tide_round_size(&a->conf, size);
}

/* Whether a call on `stream` goes through the capture path (pool.c): while
 * captures are watched, and with capture_detection when the stream is being
 * captured. */
static inline bool captures_involved(tide_allocator *a, tide_stream stream) {
  if (atomic_load_explicit(&a->capture_watch, memory_order_relaxed)) return true;
  return a->conf.capture_detection && _tide_capture_detected(&a->backend, stream);
}

/* While captures are watched: the arena of the capture pool the stream's
 * allocations go to, or the stream's own. */
static TIDE_NOINLINE _tide_arena *capture_arena(tide_allocator *a, tide_stream stream) {
  _tide_arena *arena = NULL;
  if (_tide_capture_route(a, stream, &arena) != TIDE_OK) {
    _tide_error_prefix("tide_malloc on stream %p: finding its capture pool failed", (void *)stream);
    return NULL;
  }
  return arena ? arena : _tide_arena_of(a, stream, true);
}

/* tide_malloc reads downward: after the small helpers it asks, each step
 * is defined below the one that calls it, and goes down into the arena
 * (arena.c: quick blocks, best fit; segment.c: growth) and, once memory
 * ran out, into the features (what every arena caches, the stats of the
 * error).
 *
 *   tide_malloc      the fast path: the stream's arena from its home slot,
 *                    its lock, a quick hit (quick.h), all inline
 *   malloc_slow      what the fast path leaves before the lock: a bad call,
 *                    rounding by roundup_power2_divisions, captures, a stream
 *                    outside its home slot, a lock held by another thread
 *   malloc_in_arena  under the lock: the quick hit, inline; a hit with
 *                    extras to do (several streams, tracing) goes to
 *                    malloc_hit_extras
 *   malloc_locked    under the lock: the arena's full path
 *   malloc_failed    every failure: a backend's message, or the retries and
 *                    the out-of-memory error
 *
 * tide_malloc and malloc_in_arena make calls only in tail position: every
 * case they do not finish goes to a function that does, so a quick hit
 * makes no call. */
static TIDE_NOINLINE void *malloc_slow(tide_allocator *a, size_t size, tide_stream stream);
static TIDE_ALWAYS_INLINE void *malloc_in_arena(tide_allocator *a, _tide_arena *arena, size_t size,
                                                size_t rounded, tide_stream stream);
static TIDE_NOINLINE void *malloc_hit_extras(_tide_arena *arena, _tide_block *b);
static TIDE_NOINLINE void *malloc_locked(tide_allocator *a, _tide_arena *arena, size_t size,
                                         size_t rounded, tide_stream stream);
static TIDE_NOINLINE void *malloc_failed(tide_allocator *a, _tide_arena *arena, size_t size,
                                         size_t rounded, tide_stream stream, int rc);

void *tide_malloc(tide_allocator *a, size_t size, tide_stream stream) {
  /* size - 1 wraps for 0: one comparison refuses both impossible sizes. */
  if (TIDE_UNLIKELY(!valid(a) || size - 1 >= TIDE_MAX_ALLOC)) return malloc_slow(a, size, stream);
  _tide_arena *arena = _tide_stream_arena_home(
      atomic_load_explicit(&a->malloc_streams, memory_order_relaxed), stream);
  if (TIDE_UNLIKELY(!arena || !_tide_lock_try(&arena->lock))) return malloc_slow(a, size, stream);
  size_t rounded = (size + TIDE_MIN_BLOCK - 1) & ~(TIDE_MIN_BLOCK - 1);
  return malloc_in_arena(a, arena, size, rounded, stream);
}

static void *malloc_slow(tide_allocator *a, size_t size, tide_stream stream) {
  _TIDE_CHECK_ALLOCATOR(a, NULL);
  if (TIDE_UNLIKELY(size == 0 || size > TIDE_MAX_ALLOC)) {
    _tide_error_set(TIDE_ERR_INVALID,
                    size == 0 ? "tide_malloc: size 0 asks for nothing; no block was allocated"
                              : "tide_malloc: size %zu is larger than any device (limit 4 PiB)",
                    size);
    return NULL;
  }
  size_t rounded = rounded_size(a, size);
  _tide_arena *arena = TIDE_LIKELY(!captures_involved(a, stream)) ? _tide_arena_of(a, stream, true)
                                                                  : capture_arena(a, stream);
  if (TIDE_UNLIKELY(!arena)) return NULL;
  _tide_lock_acquire(&arena->lock);
  return malloc_in_arena(a, arena, size, rounded, stream);
}

/* Under the arena lock, which the functions it goes to release: the newest
 * quick block when it has the size, or the rest (malloc_locked). */
static void *malloc_in_arena(tide_allocator *a, _tide_arena *arena, size_t size, size_t rounded,
                             tide_stream stream) {
  _tide_block *b = _tide_arena_malloc_quick(arena, size, rounded);
  if (TIDE_UNLIKELY(!b)) return malloc_locked(a, arena, size, rounded, stream);
  if (TIDE_UNLIKELY(_tide_hit_has_extras(a))) return malloc_hit_extras(arena, b);
  _tide_lock_release(&arena->lock);
  return (void *)b->addr;
}

/* A quick hit with extras to do (quick.h: the shared counter, the trace),
 * under the arena lock, which it releases. Apart from malloc_locked, whose
 * full path saves registers that a hit need not pay for. */
static void *malloc_hit_extras(_tide_arena *arena, _tide_block *b) {
  _tide_hit_extras(arena, b, true, arena->stream);
  _tide_lock_release(&arena->lock);
  return (void *)b->addr;
}

/* Under the arena lock, which it releases: the arena's full path
 * (_tide_arena_malloc: the other quick blocks, pending frees, best fit,
 * growth). */
static void *malloc_locked(tide_allocator *a, _tide_arena *arena, size_t size, size_t rounded,
                           tide_stream stream) {
  void *ptr = NULL;
  int rc = _tide_arena_malloc(arena, size, rounded, &ptr);
  _tide_lock_release(&arena->lock);
  if (TIDE_LIKELY(rc == TIDE_OK)) return ptr;
  return malloc_failed(a, arena, size, rounded, stream, rc);
}

/* The one place a failed allocation goes, holding no lock; `rc` is the
 * arena's status. A failure other than a lack of memory gets its message
 * prefixed. A lack of memory climbs a ladder before it is an error:
 *   1. what PyTorch does before it gives up: wait for pending frees and
 *      for the streams of pages growable buffers let go, give every arena's
 *      cached pages back, and try again;
 *   2. while the device, not the limit, is in the way and others (another
 *      process, another allocator of the device) hold more than the
 *      low-water mark, wait for them: an allocator holding memory it
 *      caches gives it back when it sees the device low, within a few of
 *      its allocations (arena.c, yield_to_device), and between tries
 *      the allocation holds a claim that lets them see it (others.c).
 *      The device's free memory alone does not say: a growth maps whole
 *      pages, and what others gave back since the failure is what the
 *      next try takes;
 *   3. the out-of-memory error: what was asked, what is held and cached,
 *      the device and the limit, the largest free block, the cause (the
 *      last try's message) and what to try. */
static void *malloc_failed(tide_allocator *a, _tide_arena *arena, size_t size, size_t rounded,
                           tide_stream stream, int rc) {
  if (rc != TIDE_ERR_OOM) {
    if (rc == TIDE_ERR_BACKEND)
      _tide_error_prefix("tide_malloc(%zu bytes) failed in the device backend", size);
    else
      _tide_error_prefix("tide_malloc(%zu bytes)", size);
    return NULL;
  }
  _tide_reclaim_for_retry(a);
  void *ptr = NULL;
  _tide_others_wait wait = {0};
  for (;;) {
    _tide_lock_acquire(&arena->lock);
    rc = _tide_arena_malloc(arena, size, rounded, &ptr);
    _tide_lock_release(&arena->lock);
    if (rc != TIDE_ERR_OOM || !_tide_others_wait_more(a, &wait, rounded)) break;
    _tide_others_nap(a, arena, &wait);
  }
  _tide_others_wait_end(a, &wait);
  if (rc == TIDE_OK) return ptr;
  if (rc != TIDE_ERR_OOM) return NULL;
  char cause[512], b[7][32], on_stream[48];
  snprintf(cause, sizeof cause, "%s", tide_last_error());
  tide_stats st;
  _tide_stats_collect(a, &st);
  if (stream == NULL)
    snprintf(on_stream, sizeof on_stream, "the default stream");
  else
    snprintf(on_stream, sizeof on_stream, "stream %p", (void *)stream);
  size_t limit = atomic_load(&a->limit), dev_free = 0, dev_total = 0;
  bool limited = limit < a->total_memory;
  /* The emulated device's size is an option: name it, not PyTorch's remedies. */
  bool host = strcmp(a->backend.ops->name, "host") == 0;
  if (a->backend.ops->mem_info(a->backend.ctx, &dev_free, &dev_total)) dev_free = dev_total = 0;
  size_t largest = _tide_largest_free_block(a);
  int64_t reserved = st.reserved_bytes[0].current, allocated = st.allocated_bytes[0].current;
  atomic_fetch_add(&a->num_ooms, 1);
  _tide_trace(a, TIDE_TRACE_OOM, rounded <= TIDE_SMALL_SIZE ? 1 : 2, 0, rounded, stream);
  _tide_error_set(
      TIDE_ERR_OOM,
      "out of memory on device %d: tried to allocate %s (%zu bytes) on %s. "
      "Allocated %s, reserved %s (%s cached in free blocks), device free %s of %s, "
      "memory limit %s; largest free block %s. Cause: %s. "
      "Try: free %s no longer needed%s%s%s",
      a->device, _tide_format_bytes(rounded, b[0], 32), size, on_stream,
      _tide_format_bytes((uint64_t)allocated, b[1], 32),
      _tide_format_bytes((uint64_t)reserved, b[2], 32),
      _tide_format_bytes((uint64_t)(reserved - allocated), b[3], 32),
      _tide_format_bytes(dev_free, b[4], 32), _tide_format_bytes(dev_total, b[5], 32),
      limited ? _tide_format_bytes(limit, b[6], 32) : "none (the device's memory)",
      _tide_format_bytes(largest, (char[32]){0}, 32), cause, host ? "blocks" : "tensors",
      a->conf.expandable_segments ? "" : "; set expandable_segments:True to stop fragmentation",
      limited ? "; raise memory_fraction or memory_limit" : "",
      !host ? "; reduce the batch or sequence length"
            : (limited ? "" : "; raise host_capacity (the emulated device's memory)"));
  return NULL;
}

/* An allocation in a pool chosen by the caller (PyTorch's
 * beginAllocateToPool filters are evaluated by the caller, which then knows
 * the pool): the pool's arena of the stream, then the usual path there. */
void *tide_pool_malloc(tide_pool *pool, size_t size, tide_stream stream) {
  if (!_tide_capture_pool_valid(pool)) {
    _tide_error_set(TIDE_ERR_INVALID, "tide_pool_malloc: not a live tidalloc capture pool (NULL, "
                                      "gone after its last release, or corrupted handle)");
    return NULL;
  }
  tide_allocator *a = pool->alloc;
  if (TIDE_UNLIKELY(size == 0 || size > TIDE_MAX_ALLOC)) {
    _tide_error_set(TIDE_ERR_INVALID,
                    size == 0
                        ? "tide_pool_malloc: size 0 asks for nothing; no block was allocated"
                        : "tide_pool_malloc: size %zu is larger than any device (limit 4 PiB)",
                    size);
    return NULL;
  }
  pthread_mutex_lock(&a->captures.mutex);
  int rc = _tide_capture_pool_live(pool, __func__);
  pthread_mutex_unlock(&a->captures.mutex);
  _tide_arena *arena = NULL;
  if (!rc) rc = _tide_arena_of_pool(a, pool, pool->id, stream, &arena);
  if (rc) {
    _tide_error_prefix("tide_pool_malloc(%zu bytes) on stream %p", size, (void *)stream);
    return NULL;
  }
  /* A free the capture's graph now orders before this allocation. */
  if (TIDE_UNLIKELY(atomic_load_explicit(&a->reuse_marked, memory_order_relaxed)))
    _tide_capture_reuse(a, stream);
  size_t rounded = rounded_size(a, size);
  _tide_lock_acquire(&arena->lock);
  return malloc_in_arena(a, arena, size, rounded, stream);
}

/* ------------------------------------------------------------------------ */
/* Freeing                                                                   */
/* ------------------------------------------------------------------------ */

static tide_status free_anywhere(tide_allocator *a, void *ptr, size_t size, bool sized,
                                 tide_stream stream);

/* A free can succeed after one of its steps failed and was worked around
 * (no event on a stream destroyed since the block was recorded on it: the
 * free waits instead). A success leaves the caller's last error as it was,
 * as every other call does. */
static TIDE_NOINLINE tide_status free_any(tide_allocator *a, void *ptr, size_t size, bool sized,
                                          tide_stream stream) {
  _tide_saved_error saved;
  _tide_error_save(&saved);
  tide_status rc = free_anywhere(a, ptr, size, sized, stream);
  if (rc == TIDE_OK) _tide_error_restore(&saved);
  return rc;
}

static tide_status free_anywhere(tide_allocator *a, void *ptr, size_t size, bool sized,
                                 tide_stream stream) {
  _TIDE_CHECK_ALLOCATOR(a, TIDE_ERR_INVALID);
  if (!ptr) return TIDE_OK;
  uintptr_t addr = (uintptr_t)ptr;
  if (TIDE_UNLIKELY(captures_involved(a, stream)))
    return (tide_status)_tide_capture_free(a, addr, size, sized, stream);
  _tide_arena *arena = _tide_arena_of(a, stream, false);
  if (TIDE_UNLIKELY(!arena && a->conf.capture_detection))
    return (tide_status)_tide_capture_free(a, addr, size, sized, stream);
  if (TIDE_LIKELY(arena != NULL)) {
    _tide_lock_acquire(&arena->lock);
    _tide_block *b = _tide_arena_live(arena, addr);
    /* With capture_detection, a block recorded on other streams, or of
     * another arena, goes the capture path: a stream it involves may be
     * captured (pool.c, must_defer). */
    if (TIDE_UNLIKELY(a->conf.capture_detection && (!b || b->nstreams))) {
      _tide_lock_release(&arena->lock);
      return (tide_status)_tide_capture_free(a, addr, size, sized, stream);
    }
    if (TIDE_LIKELY(b && (!sized || b->requested == size))) {
      int rc = TIDE_OK;
      if (_tide_arena_free_quick(arena, b)) { /* the stream's own arena: as tide_free's hit */
        if (TIDE_UNLIKELY(_tide_hit_has_extras(a))) _tide_hit_extras(arena, b, false, stream);
      } else {
        rc = _tide_arena_free(arena, b, stream);
      }
      _tide_lock_release(&arena->lock);
      return (tide_status)rc;
    }
    _tide_lock_release(&arena->lock);
  }
  return _tide_free_slow(a, addr, size, sized, stream);
}

/* tide_free after its quick hit missed, under the arena lock, which it
 * releases: b is the live block at addr, or NULL. */
static TIDE_NOINLINE tide_status free_locked(tide_allocator *a, _tide_arena *arena, _tide_block *b,
                                             uintptr_t addr, tide_stream stream) {
  _tide_saved_error saved; /* as in free_any */
  _tide_error_save(&saved);
  int rc;
  if (b) {
    rc = _tide_arena_free(arena, b, stream);
    _tide_lock_release(&arena->lock);
  } else {
    _tide_lock_release(&arena->lock);
    rc = _tide_free_slow(a, addr, 0, false, stream);
  }
  if (rc == TIDE_OK) _tide_error_restore(&saved);
  return (tide_status)rc;
}

/* A quick hit with extras to do (quick.h), under the arena lock, which it
 * releases. */
static TIDE_NOINLINE tide_status free_hit_extras(_tide_arena *arena, _tide_block *b,
                                                 tide_stream stream) {
  _tide_hit_extras(arena, b, false, stream);
  _tide_lock_release(&arena->lock);
  return TIDE_OK;
}

/* The free of b, the live block of `arena` (the arena of `stream`), under
 * its lock, which it releases: the quick hit, or the full path. */
static TIDE_ALWAYS_INLINE tide_status free_found(tide_allocator *a, _tide_arena *arena,
                                                 _tide_block *b, tide_stream stream) {
  if (TIDE_UNLIKELY(!_tide_arena_free_quick(arena, b)))
    return free_locked(a, arena, b, b->addr, stream);
  if (TIDE_UNLIKELY(_tide_hit_has_extras(a))) return free_hit_extras(arena, b, stream);
  _tide_lock_release(&arena->lock);
  return TIDE_OK;
}

/* tide_free under the arena lock, which it releases: the quick hit, or the
 * full path. */
static TIDE_ALWAYS_INLINE tide_status free_in_arena(tide_allocator *a, _tide_arena *arena,
                                                    uintptr_t addr, tide_stream stream) {
  _tide_block *b = _tide_arena_live(arena, addr);
  if (TIDE_UNLIKELY(!b)) return free_locked(a, arena, NULL, addr, stream);
  return free_found(a, arena, b, stream);
}

/* tide_free when the arena's lock was held by another thread. */
static TIDE_NOINLINE tide_status free_contended(tide_allocator *a, _tide_arena *arena,
                                                uintptr_t addr, tide_stream stream) {
  _tide_lock_acquire(&arena->lock);
  return free_in_arena(a, arena, addr, stream);
}

/* As tide_malloc, calls only in tail position. */
tide_status tide_free(tide_allocator *a, void *ptr, tide_stream stream) {
  if (TIDE_UNLIKELY(!valid(a) || !ptr)) return free_any(a, ptr, 0, false, stream);
  _tide_arena *arena =
      _tide_stream_arena_home(atomic_load_explicit(&a->free_streams, memory_order_relaxed), stream);
  if (TIDE_UNLIKELY(!arena)) return free_any(a, ptr, 0, false, stream);
  if (TIDE_UNLIKELY(!_tide_lock_try(&arena->lock)))
    return free_contended(a, arena, (uintptr_t)ptr, stream);
  return free_in_arena(a, arena, (uintptr_t)ptr, stream);
}

/* The stream of the arena whose live block starts at addr, found by a
 * walk over every arena; TIDE_ERR_BAD_POINTER (with the reason) if none. */
static int home_stream(tide_allocator *a, uintptr_t addr, tide_stream *out) {
  _tide_arena **arenas;
  size_t n = _tide_arenas_snapshot(a, &arenas);
  bool found = false;
  for (size_t i = 0; i < n && !found; i++) {
    _tide_lock_acquire(&arenas[i]->lock);
    if (_tide_arena_live(arenas[i], addr)) {
      *out = arenas[i]->stream;
      found = true;
    }
    _tide_lock_release(&arenas[i]->lock);
  }
  free(arenas);
  if (found) return TIDE_OK;
  return _tide_free_slow(a, addr, 0, false, NULL); /* says why: freed, interior or foreign */
}

static TIDE_NOINLINE tide_status free_home_slow(tide_allocator *a, void *ptr) {
  _TIDE_CHECK_ALLOCATOR(a, TIDE_ERR_INVALID);
  if (!ptr) return TIDE_OK;
  tide_stream stream = NULL;
  int rc = home_stream(a, (uintptr_t)ptr, &stream);
  return rc ? (tide_status)rc : free_any(a, ptr, 0, false, stream);
}

/* tide_free on the block's own stream, looked for first in the arena of
 * `hint`: a free that does not know the stream (PyTorch's deleters get only
 * the pointer) costs what tide_free costs when the hint is right. */
tide_status tide_free_home(tide_allocator *a, void *ptr, tide_stream hint) {
  if (TIDE_UNLIKELY(!valid(a) || !ptr)) return free_home_slow(a, ptr);
  _tide_arena *arena =
      _tide_stream_arena_home(atomic_load_explicit(&a->free_streams, memory_order_relaxed), hint);
  if (TIDE_UNLIKELY(!arena)) return free_home_slow(a, ptr);
  _tide_lock_acquire(&arena->lock);
  _tide_block *b = _tide_arena_live(arena, (uintptr_t)ptr);
  if (TIDE_UNLIKELY(!b)) {
    _tide_lock_release(&arena->lock);
    return free_home_slow(a, ptr);
  }
  return free_found(a, arena, b, hint);
}

tide_status tide_free_sized(tide_allocator *a, void *ptr, size_t size, tide_stream stream) {
  return free_any(a, ptr, size, true, stream);
}

/* Run `fn` on the live block at `ptr` under its arena's lock. */
static tide_status with_block(tide_allocator *a, const void *ptr,
                              int (*fn)(_tide_arena *, _tide_block *, void *), void *arg) {
  _tide_arena **arenas;
  size_t n = _tide_arenas_snapshot(a, &arenas);
  uintptr_t addr = (uintptr_t)ptr;
  int rc = -1;
  for (size_t i = 0; i < n && rc < 0; i++) {
    _tide_lock_acquire(&arenas[i]->lock);
    _tide_block *b = _tide_arena_live(arenas[i], addr);
    if (b) rc = fn(arenas[i], b, arg);
    _tide_lock_release(&arenas[i]->lock);
  }
  for (size_t i = 0; i < n && rc < 0; i++) {
    _tide_lock_acquire(&arenas[i]->lock);
    int why = _tide_arena_explain_pointer(arenas[i], addr);
    _tide_lock_release(&arenas[i]->lock);
    if (why) rc = why;
  }
  free(arenas);
  if (rc < 0)
    rc = _tide_error_set(TIDE_ERR_BAD_POINTER, "%p was not allocated by this tidalloc allocator",
                         ptr);
  return (tide_status)rc;
}

static int add_stream(_tide_arena *arena, _tide_block *b, void *arg) {
  tide_stream s = *(tide_stream *)arg;
  if (s == arena->stream) return TIDE_OK;
  for (unsigned i = 0; i < b->nstreams; i++) {
    tide_stream have =
        i < _TIDE_INLINE_STREAMS ? b->streams[i] : b->more_streams[i - _TIDE_INLINE_STREAMS];
    if (have == s) return TIDE_OK;
  }
  if (b->nstreams < _TIDE_INLINE_STREAMS) {
    b->streams[b->nstreams++] = s;
    return TIDE_OK;
  }
  if (b->nstreams == UINT8_MAX)
    return _tide_error_set(TIDE_ERR_INVALID, "block %p is already recorded on %u streams",
                           (void *)b->addr, b->nstreams);
  unsigned extra = b->nstreams - _TIDE_INLINE_STREAMS;
  if (extra == b->more_cap) {
    uint32_t cap = b->more_cap ? b->more_cap * 2 : 4;
    tide_stream *grown = realloc(b->more_streams, cap * sizeof *grown);
    if (!grown) return _tide_error_set(TIDE_ERR_OOM, "out of host memory recording a stream");
    b->more_streams = grown;
    b->more_cap = cap;
  }
  b->more_streams[extra] = s;
  b->nstreams++;
  return TIDE_OK;
}

tide_status tide_record_stream(tide_allocator *a, void *ptr, tide_stream stream) {
  _TIDE_CHECK_ALLOCATOR(a, TIDE_ERR_INVALID);
  if (!ptr) return (tide_status)_tide_error_set(TIDE_ERR_INVALID, "tide_record_stream: NULL");
  return with_block(a, ptr, add_stream, &stream);
}

tide_status tide_block_info(tide_allocator *a, const void *ptr, void **base, size_t *size,
                            tide_stream *stream) {
  _TIDE_CHECK_ALLOCATOR(a, TIDE_ERR_INVALID);
  return _tide_block_info(a, (uintptr_t)ptr, base, size, stream);
}

tide_status tide_empty_cache(tide_allocator *a) {
  _TIDE_CHECK_ALLOCATOR(a, TIDE_ERR_INVALID);
  _tide_capture_settle(a); /* frees no capture defers now can be given back */
  _tide_bufs_release_pending(a);
  pthread_mutex_lock(&a->reclaim_mutex);
  int rc = _tide_arenas_release_cached(a);
  pthread_mutex_unlock(&a->reclaim_mutex);
  _tide_saved_error saved; /* the status returned keeps its own message */
  _tide_error_save(&saved);
  _tide_capture_settle(a); /* pools whose memory is all back go */
  if (rc) _tide_error_restore(&saved);
  _tide_trace(a, TIDE_TRACE_EMPTY_CACHE, 0, 0, 0, NULL);
  return (tide_status)rc;
}

/* ------------------------------------------------------------------------ */
/* Streams and the backend                                                   */
/* ------------------------------------------------------------------------ */

tide_status tide_stream_create(tide_allocator *a, tide_stream *out) {
  _TIDE_CHECK_ALLOCATOR(a, TIDE_ERR_INVALID);
  if (!out)
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID, "tide_stream_create: out is NULL");
  return (tide_status)a->backend.ops->stream_create(a->backend.ctx, out);
}

/* A stream about to go: give back its arenas' cache while the stream can
 * still be waited for (not that of capture pools with users); blocks still
 * allocated on it stay valid. */
static void retire_arena(tide_allocator *a, tide_stream stream) {
  _tide_arena **arenas;
  size_t n = _tide_arenas_snapshot(a, &arenas);
  _tide_saved_error saved;
  _tide_error_save(&saved);
  for (size_t i = 0; i < n; i++) {
    _tide_arena *arena = arenas[i];
    _tide_lock_acquire(&arena->lock);
    if (arena->stream == stream && arena->pool_id != _TIDE_UNUSED_ARENA) {
      _tide_arena_process_events(arena, true);
      if (!arena->keep_cache) _tide_arena_release_cached(arena);
      arena->stream_gone = true;
    }
    _tide_lock_release(&arena->lock);
  }
  free(arenas);
  _tide_error_restore(&saved);
}

tide_status tide_stream_destroy(tide_allocator *a, tide_stream stream) {
  _TIDE_CHECK_ALLOCATOR(a, TIDE_ERR_INVALID);
  if (!stream)
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID, "the default stream cannot be destroyed");
  retire_arena(a, stream);
  _tide_pinned_stream_gone(a->pinned, stream);
  return (tide_status)a->backend.ops->stream_destroy(a->backend.ctx, stream);
}

tide_status tide_stream_synchronize(tide_allocator *a, tide_stream stream) {
  _TIDE_CHECK_ALLOCATOR(a, TIDE_ERR_INVALID);
  return (tide_status)a->backend.ops->stream_synchronize(a->backend.ctx, stream);
}

tide_status tide_memcpy(tide_allocator *a, void *dst, const void *src, size_t bytes,
                        tide_stream stream) {
  _TIDE_CHECK_ALLOCATOR(a, TIDE_ERR_INVALID);
  if (bytes == 0) return TIDE_OK;
  uintptr_t to = (uintptr_t)dst, from = (uintptr_t)src;
  if (!dst || !src)
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID, "tide_memcpy(%zu bytes): the %s is NULL",
                                        bytes, dst ? "source" : "destination");
  if (bytes > TIDE_MAX_ALLOC || to + bytes < to || from + bytes < from)
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID,
                                        "tide_memcpy(%p <- %p): %zu bytes are more than any "
                                        "device holds, or run past the end of the address space",
                                        dst, src, bytes);
  if (to < from + bytes && from < to + bytes)
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID,
                                        "tide_memcpy(%p <- %p, %zu bytes): the ranges overlap, "
                                        "and a copy between overlapping ranges is undefined; "
                                        "copy through a block of its own",
                                        dst, src, bytes);
  const _tide_backend *be = &a->backend;
  int rc = be->ops->copy(be->ctx, dst, src, bytes, stream);
  if (rc) _tide_error_prefix("tide_memcpy(%p <- %p, %zu bytes) failed", dst, src, bytes);
  return (tide_status)rc;
}

/* ------------------------------------------------------------------------ */
/* Pinned host memory (pinned.c)                                             */
/* ------------------------------------------------------------------------ */

void *tide_pinned_malloc(tide_allocator *a, size_t size, tide_stream stream) {
  _TIDE_CHECK_ALLOCATOR(a, NULL);
  return _tide_pinned_malloc(a->pinned, size, stream);
}

tide_status tide_pinned_free(tide_allocator *a, void *ptr, tide_stream stream) {
  _TIDE_CHECK_ALLOCATOR(a, TIDE_ERR_INVALID);
  return (tide_status)_tide_pinned_free(a->pinned, ptr, stream);
}

tide_status tide_pinned_record_stream(tide_allocator *a, void *ptr, tide_stream stream) {
  _TIDE_CHECK_ALLOCATOR(a, TIDE_ERR_INVALID);
  return (tide_status)_tide_pinned_record_stream(a->pinned, ptr, stream);
}

tide_status tide_pinned_empty_cache(tide_allocator *a) {
  _TIDE_CHECK_ALLOCATOR(a, TIDE_ERR_INVALID);
  return (tide_status)_tide_pinned_empty_cache(a->pinned);
}

tide_status tide_pinned_get_stats(tide_allocator *a, tide_stats *out) {
  _TIDE_CHECK_ALLOCATOR(a, TIDE_ERR_INVALID);
  if (!out)
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID, "tide_pinned_get_stats: out is NULL");
  _tide_pinned_stats(a->pinned, out);
  return TIDE_OK;
}

/* ------------------------------------------------------------------------ */
/* The device                                                                */
/* ------------------------------------------------------------------------ */

tide_status tide_get_info(tide_allocator *a, tide_info *out) {
  _TIDE_CHECK_ALLOCATOR(a, TIDE_ERR_INVALID);
  if (!out) return (tide_status)_tide_error_set(TIDE_ERR_INVALID, "tide_get_info: out is NULL");
  static _Thread_local char name[128];
  const _tide_backend *be = &a->backend;
  memset(out, 0, sizeof *out);
  out->version = TIDE_VERSION_STRING;
  out->backend = be->ops->name;
  out->device = a->device;
  size_t free_bytes = 0, total = 0;
  int rc = be->ops->device_count(be->ctx, &out->device_count);
  if (!rc) rc = be->ops->device_name(be->ctx, name, sizeof name);
  if (!rc) rc = be->ops->mem_info(be->ctx, &free_bytes, &total);
  out->device_name = name;
  out->total_memory = total;
  out->free_memory = free_bytes;
  out->granularity = a->granularity;
  out->page_size = a->page_size;
  return (tide_status)rc;
}
