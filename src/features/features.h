/* features.h: what is built on the memory layer (memory/core.h) and
 * called by the API (api/) and by the features' own files: capture pools
 * and checkpoints (pool.c, checkpoint.c), waiting for others' memory
 * (others.c), growable buffers (buffer.c),
 * sharing between processes (share.c), statistics (stats.c), the snapshot
 * (snapshot.c) and the consistency check (validate.c); the pinned host pool
 * has its own header (pinned.h). Nothing below includes this. */
#ifndef TIDE_FEATURES_H
#define TIDE_FEATURES_H

#include "memory/arena_table.h"

/* ------------------------------------------------------------------------ */
/* Capture pools (pool.c, checkpoint.c)                                      */
/* ------------------------------------------------------------------------ */

#define _TIDE_POOL_MAGIC 0x74696465506ful /* "tideP" */

/* A capture pool: the arenas whose pool_id is its id hold its memory. Under
 * the allocator's capture mutex, except `id` and `alloc` (fixed). */
struct tide_pool {
  long magic;
  struct tide_allocator *alloc;
  struct tide_pool *next; /* the allocator's pools */
  uint64_t id;
  int uses;     /* users: the creator, each graph; 0: its memory is going back */
  int captures; /* begins (or detected captures) that allocate to it now */
};

/* Where the allocations of a capture go: those of `stream`, or, when
 * capture_id is not 0, those of every stream of that capture. */
typedef struct _tide_capture {
  struct _tide_capture *next;
  tide_stream stream;
  uint64_t capture_id;
  struct tide_pool *pool;
  bool detected; /* made by capture_detection, not by tide_capture_begin */
} _tide_capture;

/* A free deferred until no stream it waits for is being captured. */
typedef struct _tide_deferred {
  struct _tide_deferred *next;
  _tide_arena *arena;
  _tide_block *block;
  tide_stream stream; /* the free's */
  uintptr_t addr;     /* the block's, and its arena's pool, read without the arena's lock */
  uint64_t pool_id;
  /* graph_capture_record_stream_reuse: the capture all its streams were in
   * at the free and the graph nodes that ended their use of the block (free
   * markers; NULL: it waits for the capture's end). */
  uint64_t capture_id;
  _tide_node *markers;
  size_t nmarkers;
  /* Its captures ended, but the free could not be ordered after its
   * streams (an event refused and the stream not waitable now): the status
   * of that last try, else 0. */
  int stuck;
  char why[192]; /* that try's message */
} _tide_deferred;

void _tide_captures_init(struct tide_allocator *a);
/* Frees what the capture state holds (the arenas are the caller's). */
void _tide_captures_destroy(struct tide_allocator *a);
/* The arena of `stream` in the pool its allocations go to now; *out NULL
 * when they go to the stream's own arena. */
int _tide_capture_route(struct tide_allocator *a, tide_stream stream, _tide_arena **out);
/* tide_free while captures are watched: defers what a capture must defer. */
int _tide_capture_free(struct tide_allocator *a, uintptr_t addr, size_t size, bool sized,
                       tide_stream stream);
/* Retry deferred frees; let go of pools whose memory is all back. */
void _tide_capture_settle(struct tide_allocator *a);
/* Retry deferred frees: those whose captures ended become real frees. */
void _tide_capture_retry_deferred(struct tide_allocator *a);
/* After a retry: a free deferred in `pool` whose captures ended but that
 * still cannot be completed, with why (TIDE_ERR_NOT_READY when its streams
 * cannot be waited for now); TIDE_OK if none, or if a capture allocates to
 * the pool (the restore's first refusal). */
int _tide_capture_deferred_stuck(struct tide_allocator *a, const struct tide_pool *pool);

/* graph_capture_record_stream_reuse (graph_reuse.c). Under the arena lock,
 * for a free `d` of b just deferred: its free markers, when it may be
 * reused in its capture (a capture pool's block, every stream it involves
 * in one capture); else none. Never fails: without markers it waits for
 * the capture's end, as any deferred free. */
void _tide_reuse_mark(struct tide_allocator *a, const _tide_arena *arena, const _tide_block *b,
                      _tide_deferred *d);
/* The markers of a deferred free that goes (any way): freed, uncounted. */
void _tide_reuse_unmark(struct tide_allocator *a, _tide_deferred *d);
/* Under the capture mutex, before an allocation on `stream`: complete the
 * marked frees of its arenas whose markers the capture's graph orders before
 * the stream's next work; true if any completed, and the capture watch is
 * then the caller's to recount (pool.c). Never fails (a failed query proves
 * nothing). */
bool _tide_reuse_complete(struct tide_allocator *a, tide_stream stream);
/* Under the capture mutex: forget every walk (no capture is watched). */
void _tide_reuse_forget(struct tide_allocator *a);

/* A handle that looks like a pool (for its allocator to be reached). */
bool _tide_capture_pool_valid(const struct tide_pool *pool);
/* TIDE_OK if the pool has users, else TIDE_ERR_STATE naming `op`. Under
 * the capture mutex. */
int _tide_capture_pool_live(const struct tide_pool *pool, const char *op);
/* A stable copy of the arenas of pool `id`, as _tide_arenas_snapshot. */
size_t _tide_capture_pool_arenas(struct tide_allocator *a, uint64_t id, _tide_arena ***out);
/* Before an allocation on `stream`: the marked frees the capture's graph
 * now orders before it are completed (_tide_reuse_complete), and the watch
 * recounted. Holding no lock; never fails. */
void _tide_capture_reuse(struct tide_allocator *a, tide_stream stream);
/* Drop captures found by capture_detection whose capture has ended. A
 * failure to learn whether one ended (other than its stream being gone)
 * keeps that record and is returned, with its message: callers that route
 * allocations by the records must not guess. */
int _tide_capture_prune(struct tide_allocator *a);

/* ------------------------------------------------------------------------ */
/* Growable buffers (buffer.c)                                               */
/* ------------------------------------------------------------------------ */

/* What the growable buffers of each of n arenas add to its stats, for
 * tide_check: their lengths (allocated and requested bytes), mapped pages
 * (reserved bytes, pages and handles) and count (allocations), as the arenas
 * hold them. Call it between _tide_bufs_hold and _tide_bufs_let_go (the
 * list's mutex: no buffer comes or goes; the page lock alone: no page is
 * half made or half given back) with every arena lock held (no stat
 * changes). It waits for no buffer's mutex or condition, so a buffer (or
 * its worker) never holds up the caller's locks: a page step takes only an
 * arena lock and the backend's. */
typedef struct _tide_buf_stats {
  int64_t length, count;
  uint64_t pages;
  size_t page;
} _tide_buf_stats;
void _tide_bufs_stats(struct tide_allocator *a, _tide_arena *const *arenas, size_t n,
                      _tide_buf_stats *out);
void _tide_bufs_hold(struct tide_allocator *a);
void _tide_bufs_let_go(struct tide_allocator *a);
/* Give back every buffer's pages let go by shrinks, waiting for their
 * streams to be past them (tide_empty_cache, and before an allocation
 * fails); best effort. Call it holding no lock: it takes the list's mutex,
 * then each buffer's. */
void _tide_bufs_release_pending(struct tide_allocator *a);
/* The growable buffers now, for the snapshot: up to `cap` into `out`;
 * returns how many there are. */
typedef struct _tide_buf_info {
  uintptr_t address;
  size_t capacity, length, mapped;
  bool ring;
  tide_stream stream;
} _tide_buf_info;
size_t _tide_bufs_list(struct tide_allocator *a, _tide_buf_info *out, size_t cap);
/* Destroy the growable buffers left (tide_destroy); returns how many. */
size_t _tide_bufs_destroy_all(struct tide_allocator *a);
/* Before a request fails for lack of memory: wait for pending frees, for
 * the streams of pages growable buffers' shrinks let go (and give those
 * back), and give every arena's cached pages back (what PyTorch does before
 * it gives up), counted as a retry. Takes the arena locks and the buffers':
 * call it holding none. */
void _tide_reclaim_for_retry(struct tide_allocator *a);

/* ------------------------------------------------------------------------ */
/* Waiting for others to give memory back (others.c)                        */
/* ------------------------------------------------------------------------ */

/* One allocation's wait: its tries, when it began, the last reading of the
 * device's free memory. Zeroed before the first try. */
typedef struct _tide_others_wait {
  unsigned tries;
  uint64_t since_ns; /* 0: not waiting yet */
  size_t free_bytes;
} _tide_others_wait;
/* After a try that failed for lack of memory: whether to nap and try again,
 * which holds while the device, not the limit, stands in the way of `bytes`
 * more and others hold more than the low-water mark, for up to half a
 * second. Holding no lock. */
bool _tide_others_wait_more(struct tide_allocator *a, _tide_others_wait *w, size_t bytes);
/* Nap before the next try, holding a claim on the device's free memory
 * meanwhile (under `arena`'s lock when taken and given back) so that the
 * others see the need. Holding no lock. */
void _tide_others_nap(struct tide_allocator *a, _tide_arena *arena, const _tide_others_wait *w);
/* The wait is over: its time goes to tide_stats.others_wait_ns. */
void _tide_others_wait_end(struct tide_allocator *a, const _tide_others_wait *w);

/* ------------------------------------------------------------------------ */
/* Sharing (share.c)                                                         */
/* ------------------------------------------------------------------------ */

/* Unmap every import left (allocator teardown, share.c); the first failure. */
int _tide_imports_close_all(struct tide_allocator *a);

/* ------------------------------------------------------------------------ */
/* Statistics (stats.c) and the check (validate.c)                           */
/* ------------------------------------------------------------------------ */

/* Stats (stats.c): the sum over arenas. */
int _tide_stats_collect(struct tide_allocator *a, tide_stats *out);
/* Largest free block over every arena. */
size_t _tide_largest_free_block(struct tide_allocator *a);
/* The stats of the arenas of capture pool `pool_id`. */
void _tide_stats_collect_pool(struct tide_allocator *a, uint64_t pool_id, tide_stats *out);

/* The consistency check behind tide_check (validate.c): TIDE_OK, or
 * TIDE_ERR_STATE with the first broken invariant written into `why` (or
 * TIDE_ERR_OOM when the check had no memory). Takes every lock it needs. */
int _tide_validate(struct tide_allocator *a, char *why, size_t len);

#endif /* TIDE_FEATURES_H */
