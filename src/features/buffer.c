/* buffer.c: growable buffers (tide_buf_*): one reserved virtual range of
 * fixed address whose pages are mapped as the length grows and unmapped as
 * it shrinks, and ring buffers, whose pages are mapped twice back to back.
 *
 * Pages are the device's granularity, each its own physical handle, mapped
 * in order from the start of the range: `mapped` pages are mapped, the
 * first `keep` of them are wanted, and the rest wait for the event of the
 * shrink that let them go before they are unmapped (stream order: queued
 * work may still read them). A worker thread, when asked for, maps ahead of
 * the length after each growth; `busy` marks pages it is mapping with the
 * lock dropped, so the caller only waits for it when it needs those very
 * pages. Stats go to the arena of the buffer's stream, under its lock.
 *
 * Handles: a buffer's memory outlives it (handles.c), so a call on a
 * destroyed buffer finds its magic word cleared and is refused. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "features/features.h"

#define BUF_MAGIC 0x7469646542l /* "tideB" */

static _tide_handle_kind buf_objects = {0};

struct tide_buf {
  long magic;
  tide_allocator *alloc;
  _tide_arena *arena; /* whose stats it joins */
  tide_stream stream;
  uintptr_t base;
  size_t page, capacity, reserved_bytes; /* reserved_bytes: the virtual range (2x for a ring) */
  size_t length;
  bool ring;
  _tide_handle *handles; /* per page of the capacity */
  pthread_mutex_t mutex; /* guards what follows, and the backend calls on pages */
  pthread_cond_t changed;
  size_t mapped, keep, busy; /* pages; busy: being mapped by the worker, after `mapped` */
  size_t ahead;              /* map_ahead: bytes kept mapped beyond the length */
  double ahead_fraction;     /* map_ahead_fraction: at most this much of the length, if nonzero */
  _tide_event release_event; /* pages [keep, mapped) go once it completes */
  bool release_pending;
  /* The worker. */
  bool async, stop;
  size_t want;                     /* pages the worker should bring `mapped` up to */
  _tide_saved_error worker_failed; /* status TIDE_OK: none since the last call */
  pthread_t worker;
  struct tide_buf *next; /* the allocator's list */
  /* What the arena's stats hold of the buffer, under the arena lock:
   * tide_check reads these, not the fields above, so it never waits for
   * the buffer's mutex or its worker (whose pages are counted one by one
   * before `mapped` takes them in). */
  size_t counted_pages;
  int64_t counted_length, counted_count;
};

static bool live(const tide_buf *b) { return b && b->magic == BUF_MAGIC; }

/* The refusal of a call on a buffer that is NULL or gone. */
static int not_live(const char *op) {
  return _tide_error_set(TIDE_ERR_INVALID,
                         "%s: not a live growable buffer (NULL, destroyed, or corrupted handle)",
                         op);
}

static size_t pages_for(size_t bytes, size_t page) { return (bytes + page - 1) / page; }

/* ------------------------------------------------------------------------ */
/* Accounting (under the arena lock)                                         */
/* ------------------------------------------------------------------------ */

/* A page created and mapped (its budget is taken already). */
static void count_page(tide_buf *b) {
  _tide_arena *arena = b->arena;
  _tide_lock_acquire(&arena->lock);
  _tide_stat_add(&arena->stats, _TIDE_ST_RESERVED, _TIDE_LARGE, (int64_t)b->page);
  arena->stats.counters[_TIDE_CT_PAGES_MAPPED]++;
  arena->stats.counters[_TIDE_CT_MAPPINGS] += b->ring ? 2 : 1; /* a ring maps it twice */
  arena->stats.counters[_TIDE_CT_DEVICE_ALLOC]++;
  b->counted_pages++;
  _tide_lock_release(&arena->lock);
}

/* The length as allocated and requested bytes: what the program holds. */
static void count_length(tide_buf *b, int64_t delta, int64_t allocations) {
  _tide_arena *arena = b->arena;
  _tide_lock_acquire(&arena->lock);
  /* The raw stats rise only with no quick block (quick.h). */
  if (delta > 0 || allocations > 0) _tide_arena_flush_quick(arena);
  _tide_stat_add(&arena->stats, _TIDE_ST_ALLOCATED, _TIDE_LARGE, delta);
  _tide_stat_add(&arena->stats, _TIDE_ST_REQUESTED, _TIDE_LARGE, delta);
  _tide_stat_add(&arena->stats, _TIDE_ST_ALLOCATIONS, _TIDE_LARGE, allocations);
  if (allocations > 0) arena->stats.counters[_TIDE_CT_ALLOCS]++;
  b->counted_length += delta;
  b->counted_count += allocations;
  if (atomic_load_explicit(&b->alloc->shared_peak, memory_order_relaxed))
    _tide_arena_publish(arena, delta);
  _tide_lock_release(&arena->lock);
}

/* ------------------------------------------------------------------------ */
/* Pages                                                                     */
/* ------------------------------------------------------------------------ */

static const _tide_backend *backend(const tide_buf *b) { return &b->alloc->backend; }

/* A page's budget, handle, mapping and stats change in one step, which
 * tide_check never sees half done: it holds the allocator's page lock alone,
 * a step holds it shared. Steps never nest. */
static void step_begin(const tide_buf *b) { pthread_rwlock_rdlock(&b->alloc->bufs_pages); }
static void step_end(const tide_buf *b) { pthread_rwlock_unlock(&b->alloc->bufs_pages); }

/* Unmap (at every address it is mapped at) and release page i's handle.
 * What the backend refuses becomes an orphan of the arena, retried with
 * its own: the handle's bytes stay reserved until it is released. */
static void drop_page(tide_buf *b, size_t i) {
  step_begin(b);
  uintptr_t at = b->base + i * b->page;
  bool first = _tide_mem_unmap(b->alloc, at, b->page) == TIDE_OK;
  bool second = !b->ring || _tide_mem_unmap(b->alloc, at + b->capacity, b->page) == TIDE_OK;
  bool released = first && second && _tide_mem_release(b->alloc, b->handles[i]) == TIDE_OK;
  _tide_arena *arena = b->arena;
  _tide_lock_acquire(&arena->lock);
  arena->stats.counters[_TIDE_CT_PAGES_UNMAPPED]++;
  arena->stats.counters[_TIDE_CT_UNMAPPINGS] += (unsigned)first + (unsigned)(b->ring && second);
  if (released) {
    _tide_budget_give(b->alloc, b->page);
    _tide_stat_add(&arena->stats, _TIDE_ST_RESERVED, _TIDE_LARGE, -(int64_t)b->page);
    arena->stats.counters[_TIDE_CT_DEVICE_FREE]++;
  } else {
    _tide_orphan(arena, _TIDE_LARGE, first ? 0 : at, first ? 0 : b->page, b->handles[i], b->page, 0,
                 0);
    if (!second) _tide_orphan(arena, _TIDE_LARGE, at + b->capacity, b->page, 0, 0, 0, 0);
  }
  b->counted_pages--; /* an orphan's bytes are the orphan's */
  _tide_lock_release(&arena->lock);
  b->handles[i] = 0;
  step_end(b);
}

/* Undo a page half made (created, maybe mapped at `mapped_at`) whose
 * mapping failed: what the backend refuses to undo becomes an orphan of the
 * arena, its bytes still reserved, retried later. The caller's error stays. */
static void undo_page(tide_buf *b, uintptr_t mapped_at, _tide_handle h) {
  _tide_saved_error failure;
  _tide_error_save(&failure);
  bool unmapped = !mapped_at || _tide_mem_unmap(b->alloc, mapped_at, b->page) == TIDE_OK;
  if (unmapped && _tide_mem_release(b->alloc, h) == TIDE_OK) {
    _tide_budget_give(b->alloc, b->page);
  } else {
    _tide_arena *arena = b->arena;
    _tide_lock_acquire(&arena->lock);
    _tide_stat_add(&arena->stats, _TIDE_ST_RESERVED, _TIDE_LARGE, (int64_t)b->page);
    arena->stats.counters[_TIDE_CT_DEVICE_ALLOC]++;
    _tide_orphan(arena, _TIDE_LARGE, unmapped ? 0 : mapped_at, unmapped ? 0 : b->page, h, b->page,
                 0, 0);
    _tide_lock_release(&arena->lock);
  }
  _tide_error_restore(&failure);
}

/* Create and map pages [first, first + count) (twice for a ring) and make
 * them accessible. All or nothing: on failure every page taken is given back
 * and the message says why. Called without the buffer's mutex by the worker
 * (the pages are marked busy) and with it by the caller. */
/* Whether a mapping the backend refused to undo still sits where pages
 * [first, first+count) go. */
static bool orphan_in_the_way(const tide_buf *b, size_t first, size_t count) {
  uintptr_t at = b->base + first * b->page, bytes = count * b->page;
  return _tide_orphan_mapped_in(b->arena, at, at + bytes) ||
         (b->ring && _tide_orphan_mapped_in(b->arena, at + b->capacity, at + b->capacity + bytes));
}

/* Create page i and map it (twice for a ring), as one step; on failure
 * nothing is left of it but what the backend refused to undo (an orphan). */
static int map_page(tide_buf *b, size_t i, size_t request) {
  uintptr_t at = b->base + i * b->page;
  int rc;
  step_begin(b);
  if ((rc = _tide_budget_take(b->alloc, b->page, request))) goto done;
  if ((rc = _tide_mem_create(b->alloc, b->page, &b->handles[i]))) {
    _tide_budget_give(b->alloc, b->page);
    goto done;
  }
  if ((rc = _tide_mem_map(b->alloc, at, b->page, b->handles[i]))) {
    undo_page(b, 0, b->handles[i]);
    goto done;
  }
  if (b->ring && (rc = _tide_mem_map(b->alloc, at + b->capacity, b->page, b->handles[i]))) {
    undo_page(b, at, b->handles[i]);
    goto done;
  }
  count_page(b);
done:
  step_end(b);
  return rc;
}

static int map_pages(tide_buf *b, size_t first, size_t count) {
  size_t done = 0;
  int rc = TIDE_OK;
  _tide_lock_acquire(&b->arena->lock);
  /* A mapping the backend refused to undo may sit where the pages go: tried
   * again, and if it stays, the pages cannot go there (the retry's failure
   * says why). */
  if (b->arena->norphans && _tide_arena_retry_orphans(b->arena) &&
      orphan_in_the_way(b, first, count))
    rc = TIDE_ERR_BACKEND;
  else
    _tide_arena_make_room(b->arena, count * b->page);
  _tide_lock_release(&b->arena->lock);
  if (rc) {
    _tide_error_prefix("growable buffer: mapping %zu page(s) of %zu bytes failed", count, b->page);
    return rc;
  }
  tide_clear_error();
  for (; done < count; done++)
    if ((rc = map_page(b, first + done, count * b->page))) break;
  if (!rc) {
    uintptr_t at = b->base + first * b->page;
    rc = _tide_mem_set_access(b->alloc, at, count * b->page);
    if (!rc && b->ring) rc = _tide_mem_set_access(b->alloc, at + b->capacity, count * b->page);
  }
  if (rc) {
    _tide_saved_error why;
    _tide_error_save(&why);
    while (done-- > 0) drop_page(b, first + done);
    _tide_error_restore(&why);
    _tide_error_prefix("growable buffer: mapping %zu page(s) of %zu bytes failed", count, b->page);
  }
  return rc;
}

/* No shrink waits any more: the worker, which never maps while one does,
 * may have been asked for pages meanwhile. Under the mutex. */
static void release_done(tide_buf *b) {
  const _tide_backend *be = backend(b);
  be->ops->event_destroy(be->ctx, b->release_event);
  b->release_pending = false;
  pthread_cond_broadcast(&b->changed);
}

/* Unmap the pages let go by a shrink once its stream is past it; `wait`
 * blocks until then. Under the mutex. */
static int settle_release(tide_buf *b, bool wait) {
  if (!b->release_pending) return TIDE_OK;
  /* Pages the worker is mapping land after `mapped`: let it finish first. */
  while (b->busy) pthread_cond_wait(&b->changed, &b->mutex);
  const _tide_backend *be = backend(b);
  if (wait) _tide_note_stream_wait(b->alloc);
  int rc = wait ? be->ops->event_synchronize(be->ctx, b->release_event)
                : be->ops->event_query(be->ctx, b->release_event);
  if (rc == TIDE_ERR_NOT_READY && !wait) return TIDE_OK;
  if (rc) return rc;
  while (b->mapped > b->keep) drop_page(b, --b->mapped);
  release_done(b);
  return TIDE_OK;
}

/* Wanted pages [keep, pages) that are still mapped come back at no cost. */
static void want_mapped(tide_buf *b, size_t pages) {
  if (pages <= b->keep) return;
  b->keep = pages < b->mapped ? pages : b->mapped;
  if (b->release_pending && b->keep == b->mapped) release_done(b);
}

/* Make the first `pages` pages mapped, waiting for the worker if it is
 * mapping some of them. Under the mutex. */
static int ensure_mapped(tide_buf *b, size_t pages) {
  settle_release(b, false);
  want_mapped(b, pages);
  while (b->busy && b->mapped < pages) pthread_cond_wait(&b->changed, &b->mutex);
  if (b->mapped >= pages) {
    want_mapped(b, pages);
    return TIDE_OK;
  }
  /* Pages waiting for release sit below the ones to map: keep them all. */
  want_mapped(b, b->mapped);
  int rc = map_pages(b, b->mapped, pages - b->mapped);
  if (!rc) b->keep = b->mapped = pages;
  return rc;
}

/* ensure_mapped, and when memory runs out, again after the allocator gave
 * its cached memory back, and while others hold the device, after waiting
 * for them (others.c), as tide_malloc does before it fails: free blocks of
 * the segments, or another process's cache, must not make a buffer's
 * growth fail. The mutex is let go meanwhile: giving the cache back takes
 * the arena table's mutex, which comes before the buffers' (tide_check
 * holds it while it waits for them). Under the mutex. */
static int ensure_mapped_or_reclaim(tide_buf *b, size_t pages) {
  int rc = ensure_mapped(b, pages);
  if (rc != TIDE_ERR_OOM) return rc;
  pthread_mutex_unlock(&b->mutex);
  _tide_reclaim_for_retry(b->alloc);
  pthread_mutex_lock(&b->mutex);
  _tide_others_wait wait = {0};
  while ((rc = ensure_mapped(b, pages)) == TIDE_ERR_OOM &&
         _tide_others_wait_more(b->alloc, &wait, (pages - b->mapped) * b->page)) {
    pthread_mutex_unlock(&b->mutex);
    _tide_others_nap(b->alloc, b->arena, &wait);
    pthread_mutex_lock(&b->mutex);
  }
  _tide_others_wait_end(b->alloc, &wait);
  return rc;
}

/* ------------------------------------------------------------------------ */
/* The worker                                                                */
/* ------------------------------------------------------------------------ */

static void *worker_main(void *arg) {
  tide_buf *b = arg;
  pthread_mutex_lock(&b->mutex);
  for (;;) {
    while (!b->stop && (b->want <= b->mapped || b->release_pending || b->worker_failed.status))
      pthread_cond_wait(&b->changed, &b->mutex);
    if (b->stop) break;
    size_t first = b->mapped, count = b->want - b->mapped;
    b->busy = count;
    pthread_mutex_unlock(&b->mutex);
    int rc = map_pages(b, first, count);
    pthread_mutex_lock(&b->mutex);
    b->busy = 0;
    if (rc == TIDE_ERR_OOM) {
      /* Mapping ahead is a bet, not a request: out of memory, it stops, and
       * the growth that needs those pages maps them itself, giving the cache
       * back first if it must (which the worker cannot: tide_check waits for
       * it holding the arena table). */
      if (b->want > b->mapped) b->want = b->mapped;
      tide_clear_error();
    } else if (rc) {
      _tide_error_save(&b->worker_failed);
    } else {
      /* A shrink meanwhile lowered keep: the new pages then wait with the rest. */
      if (b->keep == b->mapped) b->keep = first + count;
      b->mapped = first + count;
    }
    pthread_cond_broadcast(&b->changed);
  }
  pthread_mutex_unlock(&b->mutex);
  return NULL;
}

/* The pages that keep `ahead` bytes mapped beyond `length`, and no more: a
 * page ahead is mapped only once the length comes within `ahead` bytes of the
 * end of the mapped ones, so a small map_ahead costs little memory. With a
 * fraction, `ahead` is at most that much of the length and only pages wholly
 * inside it are mapped ahead: beyond the last page the length touches, the
 * buffer holds at most that fraction of its length, so a short buffer holds
 * no pages it does not use yet. */
static size_t pages_with_ahead(const tide_buf *b, size_t length) {
  if (b->ahead_fraction <= 0) return pages_for(length + b->ahead, b->page);
  double bound = b->ahead_fraction * (double)length;
  size_t ahead = bound < (double)b->ahead ? (size_t)bound : b->ahead;
  size_t whole = (length + ahead) / b->page, needed = pages_for(length, b->page);
  return whole > needed ? whole : needed;
}

/* After a growth to `length` bytes, the pages ahead: on the worker, or now.
 * A failure to map ahead is no failure of the growth; an asynchronous one is
 * reported by the next call. Under the mutex. */
static void map_ahead(tide_buf *b, size_t length) {
  size_t total = b->capacity / b->page, target = pages_with_ahead(b, length);
  if (target > total) target = total;
  if (target <= b->mapped + b->busy) return;
  if (b->async) {
    b->want = target;
    pthread_cond_broadcast(&b->changed);
    return;
  }
  if (!b->release_pending && map_pages(b, b->mapped, target - b->mapped) == TIDE_OK)
    b->mapped = b->keep = target;
  tide_clear_error();
}

/* ------------------------------------------------------------------------ */
/* The allocator's list                                                      */
/* ------------------------------------------------------------------------ */

/* A buffer's stats change in the arenas together with its place on the
 * list, under the list's mutex: tide_check, which holds it, sees a buffer
 * with its stats or neither. */
static void list_add(tide_buf *b) {
  tide_allocator *a = b->alloc;
  b->next = a->bufs;
  a->bufs = b;
}

static void list_remove(tide_buf *b) {
  tide_allocator *a = b->alloc;
  for (tide_buf **p = &a->bufs; *p; p = &(*p)->next)
    if (*p == b) {
      *p = b->next;
      break;
    }
}

/* ------------------------------------------------------------------------ */
/* Public API                                                                */
/* ------------------------------------------------------------------------ */

void tide_buf_options_init(tide_buf_options *options) {
  if (options) memset(options, 0, sizeof *options);
}

static int check_options(tide_allocator *a, const tide_buf_options *o) {
  if (!_tide_allocator_valid(a) || !o)
    return _tide_error_set(TIDE_ERR_INVALID, "tide_buf_create: %s is NULL or invalid",
                           o ? "the allocator" : "options");
  if (o->capacity == 0 || o->capacity > TIDE_MAX_ALLOC)
    return _tide_error_set(TIDE_ERR_INVALID,
                           "tide_buf_create: capacity %zu bytes (it must be above 0 and at most "
                           "4 PiB)",
                           o->capacity);
  if (o->map_ahead > TIDE_MAX_ALLOC)
    return _tide_error_set(TIDE_ERR_INVALID, "tide_buf_create: map_ahead %zu bytes is too large",
                           o->map_ahead);
  if (!(o->map_ahead_fraction >= 0 && o->map_ahead_fraction <= 1))
    return _tide_error_set(TIDE_ERR_INVALID,
                           "tide_buf_create: map_ahead_fraction %g (it must be from 0 to 1)",
                           o->map_ahead_fraction);
  return TIDE_OK;
}

/* Whether a mapping the backend refused to undo still sits in the range:
 * the range may be unreserved only after it. */
static bool orphan_in_range(const tide_buf *b) {
  _tide_lock_acquire(&b->arena->lock);
  bool inside = _tide_orphan_mapped_in(b->arena, b->base, b->base + b->reserved_bytes);
  _tide_lock_release(&b->arena->lock);
  return inside;
}

static void destroy_parts(tide_buf *b) {
  const _tide_backend *be = backend(b);
  if (b->release_pending) be->ops->event_destroy(be->ctx, b->release_event);
  _tide_saved_error caller;
  _tide_error_save(&caller);
  if (b->base &&
      (orphan_in_range(b) || be->ops->unreserve(be->ctx, b->base, b->reserved_bytes) != TIDE_OK)) {
    /* Retried later, after the orphaned mappings inside it. The caller's
     * error, if any, is the one to report. */
    _tide_lock_acquire(&b->arena->lock);
    _tide_orphan(b->arena, _TIDE_LARGE, 0, 0, 0, 0, b->base, b->reserved_bytes);
    _tide_lock_release(&b->arena->lock);
    _tide_error_restore(&caller);
  }
  pthread_cond_destroy(&b->changed);
  pthread_mutex_destroy(&b->mutex);
  free(b->handles);
  b->magic = 0;
  _tide_handle_retire(&buf_objects, b);
}

static int open_range(tide_buf *b, const tide_buf_options *o) {
  tide_allocator *a = b->alloc;
  b->page = a->granularity;
  b->capacity = pages_for(o->capacity, b->page) * b->page;
  b->reserved_bytes = b->ring ? 2 * b->capacity : b->capacity;
  b->ahead = o->map_ahead;
  b->ahead_fraction = o->map_ahead_fraction;
  b->handles = calloc(b->capacity / b->page, sizeof *b->handles);
  if (!b->handles) return _tide_error_set(TIDE_ERR_OOM, "out of host memory for a buffer");
  const _tide_backend *be = &a->backend;
  return be->ops->reserve(be->ctx, b->reserved_bytes, b->page, &b->base);
}

tide_status tide_buf_create(tide_allocator *a, const tide_buf_options *o, tide_buf **out) {
  if (!out) return (tide_status)_tide_error_set(TIDE_ERR_INVALID, "tide_buf_create: out is NULL");
  *out = NULL;
  int rc = check_options(a, o);
  if (rc) return (tide_status)rc;
  _tide_arena *arena = _tide_arena_get(a, o->stream);
  if (!arena) return tide_last_status();
  tide_buf *b = _tide_handle_new(&buf_objects, sizeof(struct tide_buf));
  if (!b) return (tide_status)_tide_error_set(TIDE_ERR_OOM, "out of host memory for a buffer");
  b->magic = BUF_MAGIC;
  b->alloc = a;
  b->arena = arena;
  b->stream = o->stream;
  b->ring = o->ring != 0;
  b->async = o->async_map_ahead && !b->ring && o->map_ahead;
  pthread_mutex_init(&b->mutex, NULL);
  pthread_cond_init(&b->changed, NULL);
  if ((rc = open_range(b, o))) {
    b->base = 0;
    destroy_parts(b);
    return (tide_status)rc;
  }
  if (b->async && pthread_create(&b->worker, NULL, worker_main, b) != 0) {
    b->async = false; /* maps ahead on the caller's thread instead */
  }
  pthread_mutex_lock(&a->bufs_mutex);
  if (b->ring) {
    size_t pages = b->capacity / b->page;
    if ((rc = map_pages(b, 0, pages)) == TIDE_ERR_OOM) {
      /* All undone: again once the cache is given back, which waits for
       * streams (not holding the list's mutex meanwhile). */
      pthread_mutex_unlock(&a->bufs_mutex);
      _tide_reclaim_for_retry(a);
      pthread_mutex_lock(&a->bufs_mutex);
      rc = map_pages(b, 0, pages);
    }
    if (rc) {
      pthread_mutex_unlock(&a->bufs_mutex);
      destroy_parts(b);
      return (tide_status)rc;
    }
    b->mapped = b->keep = pages;
    b->length = b->capacity;
  }
  count_length(b, (int64_t)b->length, 1);
  list_add(b);
  pthread_mutex_unlock(&a->bufs_mutex);
  *out = b;
  return TIDE_OK;
}

static void stop_worker(tide_buf *b) {
  if (!b->async) return;
  pthread_mutex_lock(&b->mutex);
  b->stop = true;
  pthread_cond_broadcast(&b->changed);
  pthread_mutex_unlock(&b->mutex);
  pthread_join(b->worker, NULL);
  pthread_mutex_lock(&b->mutex);
  b->async = false;
  /* Whoever waits for the worker to map what it was asked for must look
   * again: no worker will. */
  pthread_cond_broadcast(&b->changed);
  pthread_mutex_unlock(&b->mutex);
}

/* Everything back, and off the allocator's list if `listed`. */
static int teardown(tide_buf *b, bool listed) {
  tide_allocator *a = b->alloc;
  stop_worker(b);
  if (listed) pthread_mutex_lock(&a->bufs_mutex);
  pthread_mutex_lock(&b->mutex);
  int rc = settle_release(b, true);
  b->keep = 0;
  while (b->mapped) drop_page(b, --b->mapped);
  count_length(b, -(int64_t)b->length, -1);
  pthread_mutex_unlock(&b->mutex);
  if (listed) {
    list_remove(b);
    pthread_mutex_unlock(&a->bufs_mutex);
  }
  destroy_parts(b);
  return rc;
}

tide_status tide_buf_destroy(tide_buf *b) {
  if (!live(b)) return (tide_status)not_live(__func__);
  /* Pages a shrink let go may still be read by queued work: wait for it
   * first, and if waiting fails keep the buffer as it is. */
  pthread_mutex_lock(&b->mutex);
  int rc = settle_release(b, true);
  pthread_mutex_unlock(&b->mutex);
  if (rc) {
    _tide_error_prefix("tide_buf_destroy: the buffer is kept, its pages may still be in use");
    return (tide_status)rc;
  }
  return (tide_status)teardown(b, true);
}

/* A shrink records an event only when it lets pages go; pages it keeps
 * mapped ahead, and every page of a ring, may still be read by work queued
 * before the last use, so the stream of that use is waited for here. */
tide_status tide_buf_destroy_after(tide_buf *b, tide_stream stream) {
  if (!live(b)) return (tide_status)not_live(__func__);
  const _tide_backend *be = backend(b);
  _tide_note_stream_wait(b->alloc);
  int rc = be->ops->stream_synchronize(be->ctx, stream);
  if (rc) {
    _tide_error_prefix("tide_buf_destroy_after: the buffer is kept, the work queued on its "
                       "stream may still use it");
    return (tide_status)rc;
  }
  return tide_buf_destroy(b);
}

size_t _tide_bufs_destroy_all(tide_allocator *a) {
  size_t n = 0;
  while (a->bufs) {
    tide_buf *b = a->bufs;
    a->bufs = b->next;
    teardown(b, false);
    n++;
  }
  return n;
}

void _tide_bufs_hold(tide_allocator *a) {
  pthread_mutex_lock(&a->bufs_mutex);
  pthread_rwlock_wrlock(&a->bufs_pages);
}

void _tide_bufs_let_go(tide_allocator *a) {
  pthread_rwlock_unlock(&a->bufs_pages);
  pthread_mutex_unlock(&a->bufs_mutex);
}

void _tide_bufs_stats(tide_allocator *a, _tide_arena *const *arenas, size_t n,
                      _tide_buf_stats *out) {
  memset(out, 0, n * sizeof *out);
  for (tide_buf *b = a->bufs; b; b = b->next)
    for (size_t i = 0; i < n; i++) {
      if (arenas[i] != b->arena) continue;
      out[i].length += b->counted_length;
      out[i].pages += b->counted_pages;
      out[i].page = b->page;
      out[i].count += b->counted_count;
    }
}

size_t _tide_bufs_list(tide_allocator *a, _tide_buf_info *out, size_t cap) {
  size_t n = 0;
  pthread_mutex_lock(&a->bufs_mutex);
  for (tide_buf *b = a->bufs; b; b = b->next, n++) {
    if (n >= cap) continue;
    pthread_mutex_lock(&b->mutex);
    out[n] =
        (_tide_buf_info){b->base, b->capacity, b->length, b->mapped * b->page, b->ring, b->stream};
    pthread_mutex_unlock(&b->mutex);
  }
  pthread_mutex_unlock(&a->bufs_mutex);
  return n;
}

void _tide_bufs_release_pending(tide_allocator *a) {
  _tide_saved_error saved;
  _tide_error_save(&saved);
  pthread_mutex_lock(&a->bufs_mutex);
  for (tide_buf *b = a->bufs; b; b = b->next) {
    pthread_mutex_lock(&b->mutex);
    settle_release(b, true); /* a stream that cannot be waited for keeps its pages */
    pthread_mutex_unlock(&b->mutex);
  }
  pthread_mutex_unlock(&a->bufs_mutex);
  _tide_error_restore(&saved);
}

void _tide_reclaim_for_retry(tide_allocator *a) {
  /* Pages growable buffers' shrinks let go come back once their streams
   * are waited for: for tide_malloc's retry and for a buffer's own growth
   * alike. */
  _tide_bufs_release_pending(a);
  atomic_fetch_add(&a->num_alloc_retries, 1);
  atomic_fetch_add(&a->num_sync_all_streams, 1);
  pthread_mutex_lock(&a->reclaim_mutex);
  _tide_arenas_release_cached(a);
  pthread_mutex_unlock(&a->reclaim_mutex);
}

/* A failure of the worker since the last call, as this call's error. */
static int worker_failure(tide_buf *b) {
  if (b->worker_failed.status == TIDE_OK) return TIDE_OK;
  int rc = _tide_error_restore(&b->worker_failed);
  b->worker_failed.status = TIDE_OK;
  pthread_cond_broadcast(&b->changed); /* it waits while a failure is unreported */
  _tide_error_prefix("growable buffer: mapping ahead failed");
  return rc;
}

tide_status tide_buf_resize(tide_buf *b, size_t length, tide_stream stream) {
  if (!live(b)) return (tide_status)not_live(__func__);
  if (b->ring)
    return (tide_status)_tide_error_set(
        TIDE_ERR_INVALID, "tide_buf_resize: a ring buffer keeps its length (%zu)", b->capacity);
  if (length > b->capacity)
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID,
                                        "tide_buf_resize: %zu bytes is beyond the capacity of "
                                        "%zu bytes; create the buffer with a larger capacity",
                                        length, b->capacity);
  /* Checked first: a shrink would otherwise fail in the backend's
   * event_record, whose name says nothing to the caller. */
  const _tide_backend *bs = backend(b);
  if (bs->ops->stream_check && bs->ops->stream_check(bs->ctx, stream))
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID,
                                        "tide_buf_resize(%zu): stream %p is not a stream of this "
                                        "device (unknown or destroyed); the length is unchanged",
                                        length, (void *)stream);
  pthread_mutex_lock(&b->mutex);
  int rc = worker_failure(b);
  size_t pages = pages_for(length, b->page);
  if (!rc && length > b->length) {
    rc = ensure_mapped_or_reclaim(b, pages);
    if (!rc) map_ahead(b, length);
  } else if (!rc && length < b->length) {
    rc = settle_release(b, false);
    size_t keep = pages_with_ahead(b, length);
    if (b->want > keep) b->want = keep; /* the worker maps ahead of this length, no more */
    if (!rc && keep < b->keep) {
      const _tide_backend *be = backend(b);
      bool created = false;
      if (!b->release_pending) {
        rc = be->ops->event_create(be->ctx, &b->release_event);
        b->release_pending = created = rc == TIDE_OK;
      }
      if (!rc) rc = be->ops->event_record(be->ctx, b->release_event, stream);
      if (rc && created) release_done(b); /* nothing waits on an event never recorded */
      if (!rc) {
        /* The shrink is done once its event is recorded: unmapping now, for
         * a stream already past it, is a bonus whose failure waits for the
         * next try (it must not fail the shrink, whose pages are let go). */
        b->keep = keep;
        _tide_saved_error saved;
        _tide_error_save(&saved);
        settle_release(b, false);
        _tide_error_restore(&saved);
      }
    }
  }
  if (!rc) {
    count_length(b, (int64_t)length - (int64_t)b->length, 0);
    b->length = length;
  }
  pthread_mutex_unlock(&b->mutex);
  return (tide_status)rc;
}

tide_status tide_buf_reserve_ahead(tide_buf *b, size_t length) {
  if (!live(b)) return (tide_status)not_live(__func__);
  if (length > b->capacity)
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID,
                                        "tide_buf_reserve_ahead: %zu bytes is beyond the "
                                        "capacity of %zu bytes",
                                        length, b->capacity);
  pthread_mutex_lock(&b->mutex);
  int rc = worker_failure(b);
  if (!rc) rc = ensure_mapped_or_reclaim(b, pages_for(length, b->page));
  pthread_mutex_unlock(&b->mutex);
  return (tide_status)rc;
}

void *tide_buf_data(const tide_buf *b) { return live(b) ? (void *)b->base : NULL; }
size_t tide_buf_length(const tide_buf *b) { return live(b) ? b->length : 0; }
size_t tide_buf_capacity(const tide_buf *b) { return live(b) ? b->capacity : 0; }

size_t tide_buf_mapped(const tide_buf *b) {
  if (!live(b)) return 0;
  pthread_mutex_t *m = (pthread_mutex_t *)&b->mutex;
  pthread_mutex_lock(m);
  size_t bytes = b->mapped * b->page;
  pthread_mutex_unlock(m);
  return bytes;
}
