/* others.c: an allocation the device cannot hold, waiting for others
 * (another process, another allocator of the device) to give memory back.
 *
 * An allocator that caches memory gives it back when its periodic check
 * sees the device below its low-water mark and others grown since its last
 * look (memory/arena.c, yield_to_device), two marks' worth at a time. A
 * failed growth is rolled back and shows it neither, so between tries the
 * waiting allocation holds a claim: one handle taking the device's free
 * memory to a page below the mark, no further (a third process keeps the
 * mark's worth), reserved like any memory and within the limit. The others
 * see the device low and this allocator grown, give back, and the next
 * claim is larger, until the request fits. The claim goes back before each
 * try, which can then use its memory. tide_malloc (api/allocator.c) and a
 * growable buffer's growth (buffer.c) wait so. */
#include <time.h>

#include "features/features.h"

/* How long a wait lasts: many of the others' device checks (each after 256
 * of their allocations), so that a second process whose growth meets the
 * first one's cache gets the pages instead of an error; a real
 * out-of-memory error still comes within half a second. */
#define OTHERS_TRIES 100
#define OTHERS_WAIT_NS 5000000L

bool _tide_others_wait_more(tide_allocator *a, _tide_others_wait *w, size_t bytes) {
  if (w->tries++ == OTHERS_TRIES) return false;
  int64_t reserved = atomic_load_explicit(&a->reserved.cur, memory_order_relaxed);
  if ((size_t)reserved + bytes > atomic_load(&a->limit)) return false; /* the limit's, not theirs */
  if (!_tide_device_free(a, &w->free_bytes)) return false;
  if (_tide_others_hold(a, w->free_bytes) <= (int64_t)_tide_low_water(a)) return false;
  if (!w->since_ns) w->since_ns = _tide_now_ns();
  return true;
}

/* A claim on the device's free memory, held for one nap. */
typedef struct claim {
  _tide_handle handle;
  size_t bytes; /* 0: none held */
} claim;

/* The bytes to claim with `free_bytes` free on the device: none below the
 * mark (others see the device low already), else down to a page under it,
 * within the limit. */
static size_t claim_bytes(tide_allocator *a, size_t free_bytes) {
  size_t low = _tide_low_water(a), page = a->page_size;
  if (free_bytes < low) return 0;
  size_t want = (free_bytes - low) / page * page + page;
  if (want > free_bytes) want = free_bytes / page * page;
  int64_t room = (int64_t)atomic_load(&a->limit) -
                 atomic_load_explicit(&a->reserved.cur, memory_order_relaxed);
  if (room < (int64_t)want) want = room > 0 ? (size_t)room / page * page : 0;
  return want;
}

/* Take a claim (none where the device or the limit refuses it), under the
 * arena's lock, so that tide_check sees the reserved bytes and the claims
 * move together. The caller's error stays. */
static void claim_take(tide_allocator *a, _tide_arena *arena, size_t free_bytes, claim *c) {
  c->bytes = claim_bytes(a, free_bytes);
  if (!c->bytes) return;
  _tide_saved_error saved;
  _tide_error_save(&saved);
  _tide_lock_acquire(&arena->lock);
  if (_tide_budget_take(a, c->bytes, c->bytes) != TIDE_OK) {
    c->bytes = 0;
  } else if (_tide_mem_create(a, c->bytes, &c->handle) != TIDE_OK) {
    _tide_budget_give(a, c->bytes);
    c->bytes = 0;
  } else {
    atomic_fetch_add(&a->claimed, (int64_t)c->bytes);
  }
  _tide_lock_release(&arena->lock);
  _tide_error_restore(&saved);
}

/* Give a claim back. A handle the backend refuses to release becomes an
 * orphan of the arena (its bytes stay reserved there), released with the
 * arena's other orphans. The caller's error stays. */
static void claim_drop(tide_allocator *a, _tide_arena *arena, claim *c) {
  if (!c->bytes) return;
  _tide_saved_error saved;
  _tide_error_save(&saved);
  _tide_lock_acquire(&arena->lock);
  if (_tide_mem_release(a, c->handle) == TIDE_OK) {
    _tide_budget_give(a, c->bytes);
  } else {
    _tide_stat_add(&arena->stats, _TIDE_ST_RESERVED, _TIDE_LARGE, (int64_t)c->bytes);
    arena->stats.counters[_TIDE_CT_DEVICE_ALLOC]++;
    _tide_orphan(arena, _TIDE_LARGE, 0, 0, c->handle, c->bytes, 0, 0);
  }
  atomic_fetch_sub(&a->claimed, (int64_t)c->bytes);
  _tide_lock_release(&arena->lock);
  _tide_error_restore(&saved);
  c->bytes = 0;
}

void _tide_others_nap(tide_allocator *a, _tide_arena *arena, const _tide_others_wait *w) {
  claim held;
  claim_take(a, arena, w->free_bytes, &held);
  nanosleep(&(struct timespec){.tv_nsec = OTHERS_WAIT_NS}, NULL);
  claim_drop(a, arena, &held);
}

void _tide_others_wait_end(tide_allocator *a, const _tide_others_wait *w) {
  if (w->since_ns)
    atomic_fetch_add_explicit(&a->others_wait_ns, _tide_now_ns() - w->since_ns,
                              memory_order_relaxed);
}
