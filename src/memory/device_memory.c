/* device_memory.c: the memory limit physical memory is taken under, and the
 * backend calls that create, map, make accessible, unmap and release device
 * memory, timed. tide_stats.mapping_ns sums the time the calling threads
 * spent in them: on a GPU, most of what growing and shrinking expandable
 * memory costs a program (bench/results/history/README.md, "What mapping
 * costs the GPU"). Reading the monotonic clock costs far less than any of
 * these calls, so timing every one of them adds nothing that shows. */
#include "memory/core.h"

static int timed(tide_allocator *a, uint64_t start, int rc) {
  atomic_fetch_add_explicit(&a->mapping_ns, _tide_now_ns() - start, memory_order_relaxed);
  return rc;
}

int _tide_mem_create(tide_allocator *a, size_t size, _tide_handle *h) {
  uint64_t start = _tide_now_ns();
  return timed(a, start, a->backend.ops->create(a->backend.ctx, size, h));
}

int _tide_mem_release(tide_allocator *a, _tide_handle h) {
  uint64_t start = _tide_now_ns();
  return timed(a, start, a->backend.ops->release(a->backend.ctx, h));
}

int _tide_mem_map(tide_allocator *a, uintptr_t addr, size_t size, _tide_handle h) {
  uint64_t start = _tide_now_ns();
  return timed(a, start, a->backend.ops->map(a->backend.ctx, addr, size, h));
}

int _tide_mem_set_access(tide_allocator *a, uintptr_t addr, size_t size) {
  uint64_t start = _tide_now_ns();
  return timed(a, start, a->backend.ops->set_access(a->backend.ctx, addr, size));
}

int _tide_mem_unmap(tide_allocator *a, uintptr_t addr, size_t size) {
  uint64_t start = _tide_now_ns();
  return timed(a, start, a->backend.ops->unmap(a->backend.ctx, addr, size));
}

int _tide_mem_unmap_run(tide_allocator *a, uintptr_t addr, size_t page, size_t count,
                        size_t *done) {
  uint64_t start = _tide_now_ns();
  return timed(a, start, a->backend.ops->unmap_run(a->backend.ctx, addr, page, count, done));
}

/* ------------------------------------------------------------------------ */
/* The memory limit and the device's free memory                             */
/* ------------------------------------------------------------------------ */

int _tide_budget_take(tide_allocator *a, size_t bytes, size_t request) {
  size_t limit = atomic_load_explicit(&a->limit, memory_order_relaxed);
  int64_t cur = atomic_load_explicit(&a->reserved.cur, memory_order_relaxed);
  do {
    if ((size_t)cur + bytes > limit) {
      char want[32], held[32], lim[32];
      /* With no limit set, the device's memory is the limit. */
      return _tide_error_set(TIDE_ERR_OOM,
                             "%s %s would be passed: %s reserved, %s more "
                             "needed for a request of %zu bytes",
                             limit < a->total_memory ? "the memory limit of" : "the device's",
                             _tide_format_bytes(limit, lim, sizeof lim),
                             _tide_format_bytes((uint64_t)cur, held, sizeof held),
                             _tide_format_bytes(bytes, want, sizeof want), request);
    }
  } while (!atomic_compare_exchange_weak_explicit(&a->reserved.cur, &cur, cur + (int64_t)bytes,
                                                  memory_order_relaxed, memory_order_relaxed));
  int64_t now = cur + (int64_t)bytes;
  int64_t peak = atomic_load_explicit(&a->reserved.peak, memory_order_relaxed);
  while (now > peak &&
         !atomic_compare_exchange_weak_explicit(&a->reserved.peak, &peak, now, memory_order_relaxed,
                                                memory_order_relaxed)) {
  }
  return TIDE_OK;
}

void _tide_budget_give(tide_allocator *a, size_t bytes) {
  atomic_fetch_sub_explicit(&a->reserved.cur, (int64_t)bytes, memory_order_relaxed);
}

/* Counted and timed like the mapping calls: a driver call on the paths of
 * growth and of the periodic check for others, whose cost a program must be
 * able to see. */
bool _tide_device_free(tide_allocator *a, size_t *free_bytes) {
  const _tide_backend *be = &a->backend;
  size_t total;
  _tide_saved_error saved;
  _tide_error_save(&saved);
  uint64_t start = _tide_now_ns();
  bool ok = be->ops->mem_info(be->ctx, free_bytes, &total) == TIDE_OK;
  uint64_t end = _tide_now_ns();
  atomic_fetch_add_explicit(&a->device_query_ns, end - start, memory_order_relaxed);
  atomic_fetch_add_explicit(&a->device_queries, 1, memory_order_relaxed);
  _tide_error_restore(&saved);
  if (ok) {
    atomic_store_explicit(&a->others_seen, _tide_others_hold(a, *free_bytes), memory_order_relaxed);
    atomic_store_explicit(&a->others_seen_ns, end, memory_order_relaxed);
  }
  return ok;
}

/* How long a reading of what others hold stands in for a query at growth,
 * and how far from the low-water mark (in marks) its estimate must leave the
 * device. The estimate misses only what others took since the reading: the
 * periodic check (_TIDE_DEVICE_CHECK_EVERY) renews it while the program
 * allocates, and a program has to be that far from the mark before others'
 * growth in that time could take it below. Near the mark, every growth asks:
 * that is where pressure is decided. */
#define READING_FRESH_NS 1000000000ull
#define READING_MARGIN_MARKS 2

/* A query of the device's free memory is a driver call that costs as much
 * as a mapping (docs/design.md, "Memory by pressure"); growth far from
 * pressure makes it with nothing to learn. */
bool _tide_device_room(tide_allocator *a, int64_t *room) {
  int64_t low = (int64_t)_tide_low_water(a);
  uint64_t seen_ns = atomic_load_explicit(&a->others_seen_ns, memory_order_relaxed);
  if (seen_ns != 0 && _tide_now_ns() - seen_ns < READING_FRESH_NS) {
    int64_t estimate = (int64_t)a->total_memory -
                       atomic_load_explicit(&a->others_seen, memory_order_relaxed) -
                       atomic_load_explicit(&a->reserved.cur, memory_order_relaxed) - low;
    if (estimate > READING_MARGIN_MARKS * low) {
      *room = estimate;
      return true;
    }
  }
  size_t free_bytes;
  if (!_tide_device_free(a, &free_bytes)) return false;
  *room = (int64_t)free_bytes - low;
  return true;
}
