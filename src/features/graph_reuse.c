/* graph_reuse.c: graph_capture_record_stream_reuse. A capture pool's block
 * freed during a capture after other streams used it (tide_record_stream,
 * or a free on another stream) is deferred until the capture ends, since
 * no event can order its reuse while those streams are captured. With this
 * option, the capture's own graph orders it instead, as PyTorch's
 * allocator does under the same option:
 *
 * - Free markers: at the free, the graph nodes that the next work captured
 *   on each stream involved (the block's own, the freeing one, each
 *   recorded one) would depend on, the capture's terminal nodes on that
 *   stream. Every use of the block on that stream is one of them or comes
 *   before them. Every such stream must be in one capture and there must
 *   be a marker; else the free waits for the capture's end, as before.
 * - Reuse: an allocation on the block's stream in that capture walks the
 *   graph backwards from the stream's own terminal nodes. Once every marker
 *   has been reached, all later work on the stream comes after every use
 *   of the block, and the free completes with no event (an event recorded
 *   on a capturing stream would join the graph and never complete).
 * - Cost: the nodes reached are kept per capture and stream, and a walk
 *   stops at nodes reached before, so each node is asked about once per
 *   stream: one capture query per allocation on a stream with a marked free
 *   waiting, plus one dependency query (two past 16 dependencies) per node
 *   newly reached. Nothing is asked while no marked free waits.
 * - Failures prove nothing: the free then waits for the capture's end. A
 *   node counts as reached only once its dependencies are known, so a walk
 *   cut short resumes where it stopped.
 *
 * Locks: the capture mutex around a walk and the frees it completes, each
 * under its arena's lock (the capture mutex comes first, as in pool.c).
 * pool.c takes the mutex and, when frees completed, recounts its capture
 * watch: this file calls nothing of pool.c. */
#include <stdlib.h>
#include <string.h>

#include "features/features.h"

/* A growable list of nodes. */
typedef struct node_list {
  _tide_node *items;
  size_t n, cap;
} node_list;

/* The nodes reached backwards from one stream's terminal nodes in one
 * capture: a set by open addressing (0: an empty slot; nodes are never 0),
 * and the nodes still to visit when a walk was cut short. */
typedef struct _tide_reach {
  struct _tide_reach *next;
  uint64_t capture_id;
  tide_stream stream;
  _tide_node *slots;
  size_t cap; /* a power of two, or 0 */
  size_t count;
  node_list todo;
} _tide_reach;

/* ------------------------------------------------------------------------ */
/* Sets of nodes reached                                                     */
/* ------------------------------------------------------------------------ */

static size_t slot_of(const _tide_reach *r, _tide_node node) {
  return (size_t)((node * UINT64_C(0x9E3779B97F4A7C15)) >> 20) & (r->cap - 1);
}

static bool reached(const _tide_reach *r, _tide_node node) {
  if (!r->cap) return false;
  for (size_t i = slot_of(r, node);; i = (i + 1) & (r->cap - 1)) {
    if (r->slots[i] == node) return true;
    if (r->slots[i] == 0) return false;
  }
}

static void put(_tide_reach *r, _tide_node node) {
  size_t i = slot_of(r, node);
  while (r->slots[i] && r->slots[i] != node) i = (i + 1) & (r->cap - 1);
  r->count += r->slots[i] == 0;
  r->slots[i] = node;
}

/* Kept at most half full; false (nothing changed) without host memory. */
static bool reach_add(_tide_reach *r, _tide_node node) {
  if (2 * (r->count + 1) > r->cap) {
    size_t cap = r->cap ? 2 * r->cap : 64;
    _tide_node *old = r->slots, *slots = calloc(cap, sizeof *slots);
    if (!slots) return false;
    size_t old_cap = r->cap;
    r->slots = slots;
    r->cap = cap;
    r->count = 0;
    for (size_t i = 0; i < old_cap; i++)
      if (old[i]) put(r, old[i]);
    free(old);
  }
  put(r, node);
  return true;
}

/* The walk of `stream` in capture `id`, made if there is none; a walk of
 * an earlier capture of the stream starts again. NULL without memory.
 * Under the capture mutex. */
static _tide_reach *reach_of(tide_allocator *a, uint64_t id, tide_stream stream) {
  _tide_reach *r = a->captures.reach;
  while (r && r->stream != stream) r = r->next;
  if (r && r->capture_id != id) {
    free(r->slots);
    free(r->todo.items);
    *r = (_tide_reach){.next = r->next, .capture_id = id, .stream = stream};
  }
  if (r) return r;
  r = calloc(1, sizeof *r);
  if (!r) return NULL;
  *r = (_tide_reach){.next = a->captures.reach, .capture_id = id, .stream = stream};
  a->captures.reach = r;
  return r;
}

void _tide_reuse_forget(tide_allocator *a) {
  while (a->captures.reach) {
    _tide_reach *r = a->captures.reach;
    a->captures.reach = r->next;
    free(r->slots);
    free(r->todo.items);
    free(r);
  }
}

/* ------------------------------------------------------------------------ */
/* Queries                                                                   */
/* ------------------------------------------------------------------------ */

/* Room for `more` nodes past the list's end; false without memory. */
static bool list_room(node_list *l, size_t more) {
  return _tide_grow_array((void **)&l->items, &l->cap, l->n + more, sizeof *l->items);
}

static _tide_node *list_end(const node_list *l) { return l->items ? l->items + l->n : NULL; }

/* Append what the backend answers (the capture_deps / node_deps cap
 * convention: asked again with room when there are more). */
static int stream_deps(const _tide_backend *be, tide_stream stream, uint64_t *id, node_list *l) {
  for (;;) {
    size_t n = 0, room = l->cap - l->n;
    int rc = be->ops->capture_deps(be->ctx, stream, id, list_end(l), room, &n);
    if (rc) return rc;
    if (n <= room) {
      l->n += n;
      return TIDE_OK;
    }
    if (!list_room(l, n)) return TIDE_ERR_OOM;
  }
}

static int node_deps(const _tide_backend *be, _tide_node node, node_list *l) {
  for (;;) {
    size_t n = 0, room = l->cap - l->n;
    int rc = be->ops->node_deps(be->ctx, node, list_end(l), room, &n);
    if (rc) return rc;
    if (n <= room) {
      l->n += n;
      return TIDE_OK;
    }
    if (!list_room(l, n)) return TIDE_ERR_OOM;
  }
}

static bool graph_queries(const _tide_backend *be) {
  return be->ops->capture_deps && be->ops->node_deps;
}

/* ------------------------------------------------------------------------ */
/* Free markers                                                              */
/* ------------------------------------------------------------------------ */

static tide_stream recorded_on(const _tide_block *b, unsigned i) {
  return i < _TIDE_INLINE_STREAMS ? b->streams[i] : b->more_streams[i - _TIDE_INLINE_STREAMS];
}

/* Add the terminal nodes of `stream` to the markers, each once; false when
 * the stream is not in capture *id (set by the first stream) or a query
 * failed. */
static bool add_terminals(const _tide_backend *be, tide_stream stream, uint64_t *id,
                          node_list *markers) {
  node_list found = {0};
  uint64_t its = 0;
  bool ok = stream_deps(be, stream, &its, &found) == TIDE_OK && its != 0 &&
            (*id == 0 || its == *id) && list_room(markers, found.n);
  for (size_t i = 0; ok && i < found.n; i++) {
    bool seen = false;
    for (size_t j = 0; j < markers->n && !seen; j++) seen = markers->items[j] == found.items[i];
    if (!seen) markers->items[markers->n++] = found.items[i];
  }
  if (ok) *id = its;
  free(found.items);
  return ok;
}

void _tide_reuse_mark(tide_allocator *a, const _tide_arena *arena, const _tide_block *b,
                      _tide_deferred *d) {
  const _tide_backend *be = &a->backend;
  d->markers = NULL;
  d->nmarkers = 0;
  d->capture_id = 0;
  if (!atomic_load_explicit(&a->capture_reuse, memory_order_relaxed) || arena->pool_id == 0 ||
      !graph_queries(be))
    return;
  _tide_saved_error saved;
  _tide_error_save(&saved); /* a failed query only means no reuse */
  node_list markers = {0};
  uint64_t id = 0;
  bool ok = add_terminals(be, arena->stream, &id, &markers);
  if (ok && d->stream != arena->stream) ok = add_terminals(be, d->stream, &id, &markers);
  for (unsigned i = 0; ok && i < b->nstreams; i++)
    ok = add_terminals(be, recorded_on(b, i), &id, &markers);
  _tide_error_restore(&saved);
  if (!ok || markers.n == 0) {
    free(markers.items);
    return;
  }
  d->markers = markers.items;
  d->nmarkers = markers.n;
  d->capture_id = id;
  atomic_fetch_add_explicit(&a->reuse_marked, 1, memory_order_relaxed);
}

void _tide_reuse_unmark(tide_allocator *a, _tide_deferred *d) {
  if (!d->markers) return;
  free(d->markers);
  d->markers = NULL;
  d->nmarkers = 0;
  atomic_fetch_sub_explicit(&a->reuse_marked, 1, memory_order_relaxed);
}

/* ------------------------------------------------------------------------ */
/* Reuse                                                                     */
/* ------------------------------------------------------------------------ */

/* Whether a marked free waits for `stream` (its block's arena's stream).
 * Under the capture mutex. */
static bool waits_for(const tide_allocator *a, tide_stream stream) {
  for (const _tide_deferred *d = a->captures.deferred; d; d = d->next)
    if (d->markers && d->arena->stream == stream) return true;
  return false;
}

/* Reach every node before those to visit; false when a query or host
 * memory failed. Each node reached has its dependencies reached or still
 * to visit, so a walk cut short resumes where it stopped. */
static bool walk(const _tide_backend *be, _tide_reach *r) {
  node_list *todo = &r->todo;
  while (todo->n) {
    _tide_node v = todo->items[--todo->n];
    if (reached(r, v)) continue;
    size_t mark = todo->n;
    if (node_deps(be, v, todo) != TIDE_OK || !reach_add(r, v)) {
      todo->n = mark;
      todo->items[todo->n++] = v; /* where it was */
      return false;
    }
  }
  return true;
}

static bool all_reached(const _tide_reach *r, const _tide_deferred *d) {
  for (size_t i = 0; i < d->nmarkers; i++)
    if (!reached(r, d->markers[i])) return false;
  return true;
}

/* Complete the marked frees of r's stream and capture that r has reached
 * every marker of; true if it completed any. Under the capture mutex. */
static bool complete_reached(tide_allocator *a, const _tide_reach *r) {
  bool any = false;
  for (_tide_deferred **at = &a->captures.deferred; *at;) {
    _tide_deferred *d = *at;
    if (!d->markers || d->arena->stream != r->stream || d->capture_id != r->capture_id ||
        !all_reached(r, d)) {
      at = &d->next;
      continue;
    }
    *at = d->next;
    _tide_lock_acquire(&d->arena->lock);
    _tide_arena_finish_ordered(d->arena, d->block);
    _tide_lock_release(&d->arena->lock);
    _tide_reuse_unmark(a, d);
    free(d);
    any = true;
  }
  return any;
}

bool _tide_reuse_complete(tide_allocator *a, tide_stream stream) {
  if (!waits_for(a, stream)) return false;
  const _tide_backend *be = &a->backend;
  node_list terminals = {0};
  uint64_t id = 0;
  bool any = false;
  if (stream_deps(be, stream, &id, &terminals) == TIDE_OK && id != 0 && terminals.n) {
    _tide_reach *r = reach_of(a, id, stream);
    if (r && list_room(&r->todo, terminals.n)) {
      memcpy(r->todo.items + r->todo.n, terminals.items, terminals.n * sizeof *terminals.items);
      r->todo.n += terminals.n;
      if (walk(be, r)) any = complete_reached(a, r);
    }
  }
  free(terminals.items);
  return any;
}

tide_status tide_capture_reuse_set(tide_allocator *a, int on) {
  if (!_tide_allocator_valid(a))
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID,
                                        "tide_capture_reuse_set: not a live tidalloc allocator");
  atomic_store_explicit(&a->capture_reuse, on != 0, memory_order_relaxed);
  return TIDE_OK;
}
