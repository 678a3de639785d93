/* pool.c: capture pools, the private memory of CUDA graphs — pools and their
 * users, which allocations go to which pool, and the frees a capture defers.
 * Checkpoints of a pool and their restore are in checkpoint.c.
 *
 * The semantics are those of PyTorch's graph private pools
 * (beginAllocateToPool, endAllocateToPool, releasePool, use_count):
 * - A pool's memory is held by arenas of its own, one per stream that
 *   allocated in it (arena.pool_id), so stream-ordered reuse, growth of
 *   expandable segments and the stats work there as in any arena. While
 *   the pool has users those arenas never give memory back (keep_cache):
 *   a graph's replays write the blocks its capture freed. Once it has none,
 *   they give it back after waiting for the whole device, not their own
 *   streams: replays run on the streams they are launched on.
 * - The fast paths of tide_malloc and tide_free test one flag,
 *   capture_watch, which is nonzero only while a capture is routed to a
 *   pool or a free is deferred; then they come here, where locks and
 *   driver queries are affordable. With capture_detection on and nothing
 *   watched, an allocation or free first asks whether its stream is being
 *   captured (_tide_capture_detected) and comes here only if it is: one
 *   driver query, not the capture path's locks and searches, is what the
 *   option costs an ordinary call.
 * - Routing: a begin on a stream being captured routes that capture (all of
 *   its streams share its id: cuStreamGetCaptureInfo); a begin on a stream
 *   not being captured routes that stream. With capture_detection, a
 *   capture nobody began gets a pool of its own.
 * - Deferral: reusing memory inside a graph is safe only where the graph
 *   orders the reuse. A block of a stream's own memory freed by a stream
 *   being captured is not free for the rest of the program until the
 *   capture ends, and a free that would record an event on a stream being
 *   captured (the event would be a node of the graph, never completing) must
 *   wait too; both are deferred until no stream they involve is captured.
 *   A pool's block freed on its own stream is free at once: the same
 *   capture may take it again.
 *
 * Locks: the capture mutex comes before arenas_mutex and the arena locks;
 * no code takes it while holding one of those. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "features/features.h"

static _Atomic uint64_t next_pool_id = 1; /* ids are never reused in the process */

/* Pools' memory outlives them (handles.c): a handle used after the pool went
 * (its last release, or its allocator's destroy) reads a cleared magic word. */
static _tide_handle_kind pool_objects = {0};

/* ------------------------------------------------------------------------ */
/* State                                                                     */
/* ------------------------------------------------------------------------ */

/* Under the mutex: what makes the fast paths come here. */
static void update_watch(tide_allocator *a) {
  int watch = 0;
  for (const _tide_capture *c = a->captures.active; c; c = c->next) watch++;
  if (a->captures.deferred) watch++;
  watch += a->captures.watchers;
  atomic_store_explicit(&a->capture_watch, watch, memory_order_release);
  _tide_fast_paths_update(a, watch != 0 || a->conf.capture_detection);
  if (watch == 0) _tide_reuse_forget(a); /* no capture left to walk */
}

void _tide_captures_init(tide_allocator *a) {
  pthread_mutex_init(&a->captures.mutex, NULL);
  a->captures.active = NULL;
  a->captures.pools = NULL;
  a->captures.deferred = NULL;
  a->captures.watchers = 0;
  a->captures.reach = NULL;
  atomic_init(&a->capture_watch, 0);
  atomic_init(&a->capture_reuse, a->conf.graph_reuse);
  atomic_init(&a->reuse_marked, 0);
}

void _tide_captures_destroy(tide_allocator *a) {
  while (a->captures.active) {
    _tide_capture *c = a->captures.active;
    a->captures.active = c->next;
    free(c);
  }
  while (a->captures.deferred) {
    _tide_deferred *d = a->captures.deferred;
    a->captures.deferred = d->next;
    _tide_reuse_unmark(a, d);
    free(d);
  }
  _tide_reuse_forget(a);
  while (a->captures.pools) {
    tide_pool *p = a->captures.pools;
    a->captures.pools = p->next;
    p->magic = 0;
    _tide_handle_retire(&pool_objects, p);
  }
  pthread_mutex_destroy(&a->captures.mutex);
}

bool _tide_capture_pool_valid(const tide_pool *pool) {
  return pool && (uintptr_t)pool % _Alignof(tide_pool) == 0 && pool->magic == _TIDE_POOL_MAGIC &&
         _tide_allocator_valid(pool->alloc);
}

#define CHECK_POOL(pool)                                                                           \
  do {                                                                                             \
    if (!_tide_capture_pool_valid(pool))                                                           \
      return (tide_status)_tide_error_set(TIDE_ERR_INVALID,                                        \
                                          "%s: not a live tidalloc capture pool (NULL, gone "      \
                                          "after its last release, or corrupted handle)",          \
                                          __func__);                                               \
  } while (0)

int _tide_capture_pool_live(const tide_pool *pool, const char *op) {
  if (pool->uses > 0) return TIDE_OK;
  return _tide_error_set(TIDE_ERR_STATE,
                         "%s: capture pool %llu was released by its last user; it can no "
                         "longer be used",
                         op, (unsigned long long)pool->id);
}

size_t _tide_capture_pool_arenas(tide_allocator *a, uint64_t id, _tide_arena ***out) {
  pthread_mutex_lock(&a->arenas_mutex);
  size_t n = atomic_load(&a->narenas), kept = 0;
  *out = malloc((n ? n : 1) * sizeof **out);
  for (size_t i = 0; i < n && *out; i++)
    if (a->arenas[i]->pool_id == id) (*out)[kept++] = a->arenas[i];
  pthread_mutex_unlock(&a->arenas_mutex);
  return kept;
}

/* Whether `stream` is being captured, and into which capture. */
static int capture_status(tide_allocator *a, tide_stream stream, bool *capturing, uint64_t *id) {
  return _tide_capture_status(&a->backend, stream, capturing, id);
}

/* ------------------------------------------------------------------------ */
/* Pools and their users                                                     */
/* ------------------------------------------------------------------------ */

static tide_pool *new_pool(tide_allocator *a) {
  tide_pool *p = _tide_handle_new(&pool_objects, sizeof(tide_pool));
  if (!p) {
    _tide_error_set(TIDE_ERR_OOM, "out of host memory for a capture pool");
    return NULL;
  }
  p->magic = _TIDE_POOL_MAGIC;
  p->alloc = a;
  p->id = atomic_fetch_add(&next_pool_id, 1);
  p->uses = 1;
  return p;
}

tide_status tide_pool_create(tide_allocator *a, tide_pool **out) {
  if (!_tide_allocator_valid(a) || !out)
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID, "tide_pool_create: %s is NULL or invalid",
                                        out ? "the allocator" : "out");
  *out = NULL;
  tide_pool *p = new_pool(a);
  if (!p) return tide_last_status();
  pthread_mutex_lock(&a->captures.mutex);
  p->next = a->captures.pools;
  a->captures.pools = p;
  pthread_mutex_unlock(&a->captures.mutex);
  *out = p;
  return TIDE_OK;
}

tide_status tide_pool_retain(tide_pool *pool) {
  CHECK_POOL(pool);
  tide_allocator *a = pool->alloc;
  pthread_mutex_lock(&a->captures.mutex);
  int rc = _tide_capture_pool_live(pool, __func__);
  if (!rc) pool->uses++;
  pthread_mutex_unlock(&a->captures.mutex);
  return (tide_status)rc;
}

uint64_t tide_pool_id(const tide_pool *pool) {
  return _tide_capture_pool_valid(pool) ? pool->id : 0;
}

tide_status tide_pool_get_stats(tide_pool *pool, tide_stats *out) {
  CHECK_POOL(pool);
  if (!out)
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID, "tide_pool_get_stats: out is NULL");
  _tide_stats_collect_pool(pool->alloc, pool->id, out);
  return TIDE_OK;
}

static bool arena_empty(const _tide_arena *arena) {
  return !arena->pools[_TIDE_SMALL].segments && !arena->pools[_TIDE_LARGE].segments &&
         arena->live.count == 0 && arena->npending == 0 && arena->norphans == 0 &&
         arena->nspare_pages == 0;
}

/* Under the capture mutex: a released pool whose arenas hold nothing goes;
 * its arenas wait for the next pool. */
static void reap_pool(tide_allocator *a, tide_pool *pool) {
  bool empty = true;
  pthread_mutex_lock(&a->arenas_mutex);
  size_t n = atomic_load(&a->narenas);
  for (size_t i = 0; i < n; i++) {
    _tide_arena *arena = a->arenas[i];
    if (arena->pool_id != pool->id) continue;
    _tide_lock_acquire(&arena->lock);
    if (arena_empty(arena)) {
      arena->pool_id = _TIDE_UNUSED_ARENA;
      arena->pool = NULL;
      arena->stream = NULL;
      arena->keep_cache = false;
    } else {
      empty = false;
    }
    _tide_lock_release(&arena->lock);
  }
  pthread_mutex_unlock(&a->arenas_mutex);
  if (!empty) return;
  for (tide_pool **at = &a->captures.pools; *at; at = &(*at)->next) {
    if (*at != pool) continue;
    *at = pool->next;
    pool->magic = 0;
    _tide_handle_retire(&pool_objects, pool);
    return;
  }
}

static void reap_pools(tide_allocator *a) {
  pthread_mutex_lock(&a->captures.mutex);
  tide_pool *next;
  for (tide_pool *p = a->captures.pools; p; p = next) {
    next = p->next;
    if (p->uses == 0 && p->captures == 0) reap_pool(a, p);
  }
  pthread_mutex_unlock(&a->captures.mutex);
}

/* The last user went: the pool's free memory goes back to the device, once
 * the whole device is done with it (_tide_stream_settle of a pool's arena:
 * its graphs replay on any stream); what is still allocated or waits on
 * streams, and everything while a capture is under way, goes with a later
 * tide_empty_cache. */
static int give_back(tide_allocator *a, tide_pool *pool) {
  _tide_arena **arenas;
  size_t n = _tide_capture_pool_arenas(a, pool->id, &arenas);
  int first = TIDE_OK;
  _tide_saved_error saved = {0};
  pthread_mutex_lock(&a->reclaim_mutex);
  for (size_t i = 0; i < n; i++) {
    _tide_lock_acquire(&arenas[i]->lock);
    arenas[i]->keep_cache = false;
    _tide_arena_process_events(arenas[i], false);
    int rc = _tide_arena_release_cached(arenas[i]);
    _tide_lock_release(&arenas[i]->lock);
    if (rc && !first) {
      first = rc;
      _tide_error_save(&saved);
    }
  }
  pthread_mutex_unlock(&a->reclaim_mutex);
  free(arenas);
  reap_pools(a);
  return first ? _tide_error_restore(&saved) : TIDE_OK;
}

static void retry_deferred(tide_allocator *a);

tide_status tide_pool_release(tide_pool *pool) {
  CHECK_POOL(pool);
  tide_allocator *a = pool->alloc;
  /* Frees deferred by captures that ended, and the records of detected
   * captures that ended, no longer keep the watch on: the memory goes back
   * now unless a capture is still under way (see give_back). */
  retry_deferred(a);
  _tide_capture_prune(a);
  pthread_mutex_lock(&a->captures.mutex);
  int rc = _tide_capture_pool_live(pool, __func__);
  /* Each capture in progress holds a use: those are not the caller's to drop. */
  if (!rc && pool->uses <= pool->captures)
    rc = _tide_error_set(TIDE_ERR_STATE,
                         "tide_pool_release: pool %llu has no user to release but the %d "
                         "capture(s) allocating to it; end them (tide_capture_end) first",
                         (unsigned long long)pool->id, pool->captures);
  bool last = !rc && --pool->uses == 0;
  pthread_mutex_unlock(&a->captures.mutex);
  if (rc || !last) return (tide_status)rc;
  rc = give_back(a, pool);
  if (rc)
    _tide_error_prefix("tide_pool_release: the pool is released, but part of its memory goes "
                       "back only at the next tide_empty_cache");
  return (tide_status)rc;
}

/* A caller that routes a capture's allocations itself (tide_pool_malloc)
 * still needs frees to be deferred while a stream they wait for is being
 * captured: while watched, frees take the capture path, which asks. */
tide_status tide_capture_watch_begin(tide_allocator *a) {
  if (!_tide_allocator_valid(a))
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID,
                                        "tide_capture_watch_begin: not a live tidalloc allocator");
  pthread_mutex_lock(&a->captures.mutex);
  a->captures.watchers++;
  update_watch(a);
  pthread_mutex_unlock(&a->captures.mutex);
  return TIDE_OK;
}

tide_status tide_capture_watch_end(tide_allocator *a) {
  if (!_tide_allocator_valid(a))
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID,
                                        "tide_capture_watch_end: not a live tidalloc allocator");
  pthread_mutex_lock(&a->captures.mutex);
  int rc = TIDE_OK;
  if (a->captures.watchers == 0)
    rc = _tide_error_set(TIDE_ERR_STATE,
                         "tide_capture_watch_end: no tide_capture_watch_begin to end");
  else
    a->captures.watchers--;
  update_watch(a);
  pthread_mutex_unlock(&a->captures.mutex);
  if (!rc) retry_deferred(a); /* frees deferred by the capture may go now */
  return (tide_status)rc;
}

/* ------------------------------------------------------------------------ */
/* Which pool an allocation goes to                                          */
/* ------------------------------------------------------------------------ */

/* The begin made on `stream` itself (by capture id or not). Under the mutex. */
static _tide_capture *begun_on(tide_allocator *a, tide_stream stream) {
  for (_tide_capture *c = a->captures.active; c; c = c->next)
    if (!c->detected && c->stream == stream) return c;
  return NULL;
}

static _tide_capture *of_capture(tide_allocator *a, uint64_t id) {
  for (_tide_capture *c = a->captures.active; c; c = c->next)
    if (c->capture_id == id) return c;
  return NULL;
}

static bool routes_captures(tide_allocator *a) {
  if (a->conf.capture_detection) return true;
  for (const _tide_capture *c = a->captures.active; c; c = c->next)
    if (c->capture_id) return true;
  return false;
}

/* Under the mutex: a pool for capture `id`, found by capture_detection. */
static int detect(tide_allocator *a, tide_stream stream, uint64_t id, tide_pool **out) {
  _tide_capture *c = calloc(1, sizeof *c);
  tide_pool *p = c ? new_pool(a) : NULL;
  if (!p) {
    free(c);
    return _tide_error_set(TIDE_ERR_OOM, "out of host memory for the pool of a capture");
  }
  p->captures = 1; /* its one user (uses = 1) is the graph */
  p->next = a->captures.pools;
  a->captures.pools = p;
  *c = (_tide_capture){
      .next = a->captures.active, .stream = stream, .capture_id = id, .pool = p, .detected = true};
  a->captures.active = c;
  update_watch(a);
  *out = p;
  return TIDE_OK;
}

/* The pool allocations on `stream` go to now, or NULL. */
static int pool_of_stream(tide_allocator *a, tide_stream stream, tide_pool **out) {
  pthread_mutex_lock(&a->captures.mutex);
  _tide_capture *c = begun_on(a, stream);
  *out = c && !c->capture_id ? c->pool : NULL;
  bool ask = !*out && routes_captures(a);
  pthread_mutex_unlock(&a->captures.mutex);
  if (!ask) return TIDE_OK;
  bool capturing;
  uint64_t id;
  int rc = capture_status(a, stream, &capturing, &id);
  if (rc || !capturing) return rc;
  pthread_mutex_lock(&a->captures.mutex);
  c = of_capture(a, id);
  if (c)
    *out = c->pool;
  else if (a->conf.capture_detection)
    rc = detect(a, stream, id, out);
  pthread_mutex_unlock(&a->captures.mutex);
  return rc;
}

/* Only frees marked by graph_reuse.c wait here; a marked free means the
 * backend answers graph queries. */
void _tide_capture_reuse(tide_allocator *a, tide_stream stream) {
  if (!atomic_load_explicit(&a->reuse_marked, memory_order_relaxed)) return;
  _tide_saved_error saved;
  _tide_error_save(&saved); /* the allocation's message is not about this */
  pthread_mutex_lock(&a->captures.mutex);
  if (_tide_reuse_complete(a, stream)) update_watch(a);
  pthread_mutex_unlock(&a->captures.mutex);
  _tide_error_restore(&saved);
}

int _tide_capture_route(tide_allocator *a, tide_stream stream, _tide_arena **out) {
  *out = NULL;
  retry_deferred(a);
  _tide_capture_reuse(a, stream);
  /* Routing on a capture whose end could not be learned would guess. */
  int ended = a->conf.capture_detection ? _tide_capture_prune(a) : TIDE_OK;
  if (ended) return ended;
  tide_pool *pool = NULL;
  int rc = pool_of_stream(a, stream, &pool);
  if (rc || !pool) return rc;
  return _tide_arena_of_pool(a, pool, pool->id, stream, out);
}

tide_status tide_capture_pool(tide_allocator *a, tide_stream stream, tide_pool **out) {
  if (!_tide_allocator_valid(a) || !out)
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID,
                                        "tide_capture_pool: %s is NULL or invalid",
                                        out ? "the allocator" : "out");
  *out = NULL;
  int rc = a->conf.capture_detection ? _tide_capture_prune(a) : TIDE_OK;
  if (!rc) rc = pool_of_stream(a, stream, out);
  if (!rc && !*out)
    rc = _tide_error_set(TIDE_ERR_INVALID,
                         "tide_capture_pool: allocations on stream %p go to the allocator's usual "
                         "memory, not to a capture pool",
                         (void *)stream);
  return (tide_status)rc;
}

int _tide_capture_prune(tide_allocator *a) {
  pthread_mutex_lock(&a->captures.mutex);
  size_t n = 0;
  for (const _tide_capture *c = a->captures.active; c; c = c->next) n += c->detected;
  _tide_capture *seen = n ? malloc(n * sizeof *seen) : NULL;
  n = 0;
  for (const _tide_capture *c = a->captures.active; c && seen; c = c->next)
    if (c->detected) seen[n++] = *c;
  pthread_mutex_unlock(&a->captures.mutex);
  /* Asked without the mutex: the driver may be slow. */
  int failed = TIDE_OK;
  _tide_saved_error first;
  for (size_t i = 0; i < n; i++) {
    bool capturing;
    uint64_t id;
    int rc = capture_status(a, seen[i].stream, &capturing, &id);
    /* Ended (stored in `detected` from here on): the stream is no longer in
     * that capture, or no longer exists (destroyed while captured: nothing
     * could end the capture record otherwise, and its pool would keep its
     * memory for good). Any other failure leaves the record as it is, and
     * is the first failure returned. */
    seen[i].detected =
        rc == TIDE_ERR_INVALID || (rc == TIDE_OK && (!capturing || id != seen[i].capture_id));
    if (rc && rc != TIDE_ERR_INVALID && !failed) {
      _tide_error_prefix("learning whether the capture of stream %p ended", (void *)seen[i].stream);
      failed = rc;
      _tide_error_save(&first);
    }
  }
  pthread_mutex_lock(&a->captures.mutex);
  for (size_t i = 0; i < n; i++) {
    if (!seen[i].detected) continue;
    for (_tide_capture **at = &a->captures.active; *at; at = &(*at)->next) {
      _tide_capture *c = *at;
      if (!c->detected || c->capture_id != seen[i].capture_id) continue;
      *at = c->next;
      c->pool->captures--;
      free(c);
      break;
    }
  }
  if (n) update_watch(a);
  pthread_mutex_unlock(&a->captures.mutex);
  free(seen);
  return failed ? _tide_error_restore(&first) : TIDE_OK;
}

tide_status tide_capture_begin(tide_allocator *a, tide_stream stream, tide_pool *pool) {
  if (!_tide_allocator_valid(a))
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID, "tide_capture_begin: bad allocator");
  CHECK_POOL(pool);
  if (pool->alloc != a)
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID,
                                        "tide_capture_begin: pool %llu belongs to another "
                                        "allocator",
                                        (unsigned long long)pool->id);
  /* A detected capture that ended does not hold its capture id any more. */
  if (a->conf.capture_detection) _tide_capture_prune(a);
  bool capturing;
  uint64_t id;
  int rc = capture_status(a, stream, &capturing, &id);
  if (rc) {
    _tide_error_prefix("tide_capture_begin on stream %p", (void *)stream);
    return (tide_status)rc;
  }
  _tide_capture *c = calloc(1, sizeof *c);
  if (!c) return (tide_status)_tide_error_set(TIDE_ERR_OOM, "out of host memory for a capture");
  pthread_mutex_lock(&a->captures.mutex);
  rc = _tide_capture_pool_live(pool, __func__);
  if (!rc && begun_on(a, stream))
    rc = _tide_error_set(TIDE_ERR_STATE,
                         "tide_capture_begin: stream %p already has a capture begun (end it "
                         "with tide_capture_end first)",
                         (void *)stream);
  if (!rc && capturing && of_capture(a, id))
    rc = _tide_error_set(TIDE_ERR_STATE,
                         "tide_capture_begin: the capture stream %p is part of already "
                         "allocates to pool %llu",
                         (void *)stream, (unsigned long long)of_capture(a, id)->pool->id);
  if (!rc) {
    *c = (_tide_capture){.next = a->captures.active,
                         .stream = stream,
                         .capture_id = capturing ? id : 0,
                         .pool = pool};
    a->captures.active = c;
    pool->uses++; /* the graph's */
    pool->captures++;
    update_watch(a);
  }
  pthread_mutex_unlock(&a->captures.mutex);
  if (rc) free(c);
  return (tide_status)rc;
}

tide_status tide_capture_end(tide_allocator *a, tide_stream stream) {
  if (!_tide_allocator_valid(a))
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID, "tide_capture_end: bad allocator");
  pthread_mutex_lock(&a->captures.mutex);
  _tide_capture *found = NULL;
  for (_tide_capture **at = &a->captures.active; *at; at = &(*at)->next) {
    if ((*at)->detected || (*at)->stream != stream) continue;
    found = *at;
    *at = found->next;
    found->pool->captures--;
    update_watch(a);
    break;
  }
  pthread_mutex_unlock(&a->captures.mutex);
  if (!found)
    return (tide_status)_tide_error_set(TIDE_ERR_STATE,
                                        "tide_capture_end: no capture was begun on stream %p "
                                        "(tide_capture_begin)",
                                        (void *)stream);
  free(found);
  retry_deferred(a);
  return TIDE_OK;
}

/* ------------------------------------------------------------------------ */
/* Frees during captures                                                     */
/* ------------------------------------------------------------------------ */

static tide_stream recorded(const _tide_block *b, unsigned i) {
  return i < _TIDE_INLINE_STREAMS ? b->streams[i] : b->more_streams[i - _TIDE_INLINE_STREAMS];
}

/* Whether `stream` is being captured; a stream that no longer exists is not
 * (the free's own checks report it). */
static int captured(tide_allocator *a, tide_stream stream, bool *yes) {
  uint64_t id;
  int rc = capture_status(a, stream, yes, &id);
  if (rc == TIDE_ERR_INVALID) {
    *yes = false;
    return TIDE_OK;
  }
  return rc;
}

/* Whether freeing b (of `arena`) on `stream` must wait until no stream it
 * involves is being captured. Under the arena lock. `again`: the free was
 * deferred already; then the freeing stream counts too, since a recorded
 * stream destroyed during the capture leaves its work in the capture that
 * the freeing stream is still in (the block may be reused only once that
 * capture ends). */
static int must_defer(tide_allocator *a, const _tide_arena *arena, const _tide_block *b,
                      tide_stream stream, bool again, bool *defer) {
  *defer = false;
  /* The freeing stream matters for a stream's own memory (freed in a
   * capture), and for a pool's when the free needs an event on it; every
   * recorded stream gets an event. */
  int rc = TIDE_OK;
  if (again || arena->pool_id == 0 || stream != arena->stream) rc = captured(a, stream, defer);
  for (unsigned i = 0; i < b->nstreams && !rc && !*defer; i++)
    rc = captured(a, recorded(b, i), defer);
  return rc;
}

/* Frees deferred by captures that have ended become real frees. */
static void retry_deferred(tide_allocator *a) {
  pthread_mutex_lock(&a->captures.mutex);
  _tide_deferred *list = a->captures.deferred;
  a->captures.deferred = NULL;
  a->captures.unlisted += list != NULL; /* for tide_check: these are off the list */
  pthread_mutex_unlock(&a->captures.mutex);
  if (!list) return;
  _tide_saved_error saved;
  _tide_error_save(&saved);
  _tide_deferred *kept = NULL, *last = NULL, *next;
  for (_tide_deferred *d = list; d; d = next) {
    next = d->next;
    bool defer = true;
    _tide_lock_acquire(&d->arena->lock);
    bool asked = must_defer(a, d->arena, d->block, d->stream, true, &defer) == TIDE_OK;
    int finished = asked && !defer ? _tide_arena_finish_deferred(d->arena, d->block, d->stream)
                                   : TIDE_ERR_STATE;
    bool done = finished == TIDE_OK;
    d->stuck = asked && !defer ? finished : 0;
    if (d->stuck) snprintf(d->why, sizeof d->why, "%s", tide_last_error());
    _tide_lock_release(&d->arena->lock);
    if (done) {
      _tide_reuse_unmark(a, d);
      free(d);
      continue;
    }
    d->next = kept;
    kept = d;
    if (!last) last = d;
  }
  _tide_error_restore(&saved);
  pthread_mutex_lock(&a->captures.mutex);
  if (last) {
    last->next = a->captures.deferred;
    a->captures.deferred = kept;
  }
  a->captures.unlisted--;
  update_watch(a);
  pthread_mutex_unlock(&a->captures.mutex);
}

int _tide_capture_free(tide_allocator *a, uintptr_t addr, size_t size, bool sized,
                       tide_stream stream) {
  retry_deferred(a);
  _tide_deferred *node = malloc(sizeof *node); /* before any lock; unused if not deferred */
  pthread_mutex_lock(&a->captures.mutex);
  a->captures.unlisted++; /* for tide_check: a deferral is on the list only at the end */
  pthread_mutex_unlock(&a->captures.mutex);
  _tide_arena **arenas;
  size_t n = _tide_arenas_snapshot(a, &arenas);
  int rc = -1; /* not found (or the wrong size): the slow path explains */
  bool deferred = false, wrong_size = false;
  for (size_t i = 0; i < n && rc < 0 && !wrong_size; i++) {
    _tide_arena *arena = arenas[i];
    _tide_lock_acquire(&arena->lock);
    _tide_block *b = _tide_arena_live(arena, addr);
    wrong_size = b && sized && b->requested != size;
    if (b && !wrong_size) {
      bool defer = false;
      rc = must_defer(a, arena, b, stream, false, &defer);
      if (rc) {
        rc = _tide_error_set(tide_last_status(),
                             "cannot free %p: asking whether the streams it involves are being "
                             "captured failed (%s); the block is still allocated",
                             (void *)addr, tide_last_error());
      } else if (defer && !node) {
        rc = _tide_error_set(TIDE_ERR_OOM,
                             "cannot free %p during a capture: out of host memory to defer it; "
                             "the block is still allocated",
                             (void *)addr);
      } else if (defer) {
        rc = _tide_arena_defer_free(arena, b, stream);
        if (!rc)
          *node = (_tide_deferred){.arena = arena,
                                   .block = b,
                                   .stream = stream,
                                   .addr = b->addr,
                                   .pool_id = arena->pool_id};
        deferred = rc == TIDE_OK;
        if (deferred) _tide_reuse_mark(a, arena, b, node);
      } else {
        rc = _tide_arena_free(arena, b, stream);
      }
    }
    _tide_lock_release(&arena->lock);
  }
  free(arenas);
  pthread_mutex_lock(&a->captures.mutex);
  if (deferred) {
    node->next = a->captures.deferred;
    a->captures.deferred = node;
    update_watch(a);
  }
  a->captures.unlisted--;
  pthread_mutex_unlock(&a->captures.mutex);
  if (!deferred) free(node);
  if (rc < 0) return _tide_free_slow(a, addr, size, sized, stream);
  return rc;
}

void _tide_capture_retry_deferred(tide_allocator *a) { retry_deferred(a); }

int _tide_capture_deferred_stuck(tide_allocator *a, const tide_pool *pool) {
  int rc = TIDE_OK;
  pthread_mutex_lock(&a->captures.mutex);
  /* A capture allocating to the pool is the first reason to refuse. */
  for (const _tide_deferred *d = pool->captures ? NULL : a->captures.deferred; d && !rc;
       d = d->next)
    if (d->pool_id == pool->id && d->stuck)
      rc = _tide_error_set(d->stuck == TIDE_ERR_NOT_READY ? TIDE_ERR_NOT_READY : d->stuck,
                           "the free of %p no longer waits for a capture but for work on the "
                           "streams that used it, which cannot be waited for now (%s); try "
                           "again once it can",
                           (void *)d->addr, d->why);
  pthread_mutex_unlock(&a->captures.mutex);
  return rc;
}

void _tide_capture_settle(tide_allocator *a) {
  retry_deferred(a);
  _tide_capture_prune(a);
  reap_pools(a);
}
