/* mapcalls.c: the backend calls that create, map, make accessible, unmap
 * and release device memory, timed. tide_stats.mapping_ns sums the time the
 * calling threads spent in them: on a GPU, tens of microseconds a mapping,
 * most of what growing and shrinking expandable memory costs a program
 * (bench/results/history/README.md, "What mapping costs the GPU"). The
 * clock's own cost, tens of nanoseconds, is noise beside any of these calls. */
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
