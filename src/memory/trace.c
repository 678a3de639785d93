/* trace.c: the optional ring of allocator events (alloc, free, map, unmap,
 * oom, empty_cache), for seeing what the allocator did without a debugger.
 * Off by default; when on, each event takes the ring's own short lock. */
#include <stdlib.h>
#include <string.h>

#include "memory/core.h"

int _tide_trace_init(_tide_trace_ring *ring, size_t cap) {
  memset(ring, 0, sizeof *ring);
  _tide_lock_init(&ring->lock);
  if (cap == 0) return TIDE_OK;
  ring->events = calloc(cap, sizeof *ring->events);
  if (!ring->events)
    return _tide_error_set(TIDE_ERR_OOM, "out of host memory for a trace ring of %zu events", cap);
  ring->cap = cap;
  return TIDE_OK;
}

void _tide_trace_destroy(_tide_trace_ring *ring) {
  free(ring->events);
  ring->events = NULL;
  ring->cap = 0;
}

void _tide_trace_push_slow(tide_allocator *a, tide_trace_kind kind, int pool, uintptr_t addr,
                           size_t size, tide_stream stream) {
  _tide_trace_ring *ring = &a->trace;
  _tide_lock_acquire(&ring->lock);
  /* Read under the lock, so that times never decrease in the ring's order
   * (a trace written from it is refused by `tidalloc replay` otherwise). */
  uint64_t now = _tide_now_ns();
  uint64_t seq = ring->next++;
  ring->events[seq % ring->cap] = (tide_trace_event){
      .seq = seq,
      .time_ns = now,
      .kind = (uint32_t)kind,
      .pool = (uint32_t)pool,
      .addr = addr,
      .size = size,
      .stream = stream,
  };
  _tide_lock_release(&ring->lock);
}

tide_status tide_trace_read(tide_allocator *a, tide_trace_event *out, size_t cap, size_t *n,
                            uint64_t *dropped) {
  if (!_tide_allocator_valid(a) || !n || (cap && !out))
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID, "tide_trace_read: bad argument");
  _tide_trace_ring *ring = &a->trace;
  *n = 0;
  if (dropped) *dropped = 0;
  if (ring->cap == 0) return TIDE_OK;
  _tide_lock_acquire(&ring->lock);
  uint64_t held = ring->next < ring->cap ? ring->next : ring->cap;
  uint64_t take = held < cap ? held : cap;
  uint64_t first = ring->next - take;
  for (uint64_t i = 0; i < take; i++) out[i] = ring->events[(first + i) % ring->cap];
  if (dropped) *dropped = ring->next - held;
  _tide_lock_release(&ring->lock);
  *n = (size_t)take;
  return TIDE_OK;
}
