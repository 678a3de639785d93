/* handles.c: the memory of the objects a caller holds by pointer (allocators,
 * growable buffers, capture pools). It never goes back to the C library: an
 * object that goes has its magic word cleared and waits in a queue of its
 * kind, and a new object of that kind takes the oldest one only once more
 * than TIDE_HANDLE_QUARANTINE wait. So a handle used after its object went
 * reads a cleared magic word, never freed memory, and it is refused; only a
 * handle kept across that many later objects of its kind may find a new one
 * there. The memory held is bounded by the most objects alive at once plus
 * the quarantine; creating and destroying objects is a slow path, so the
 * kind's lock costs nothing that matters. */
#include <stdlib.h>
#include <string.h>

#include "base/lock.h"

/* Each object follows a header that links it into its kind's queue, so the
 * object's own words (its magic first) stay as they were left. */
#define HEADER 64

typedef struct _tide_retired {
  struct _tide_retired *next;
} retired;

static retired *header_of(void *object) { return (retired *)((char *)object - HEADER); }

void *_tide_handle_new(_tide_handle_kind *kind, size_t size) {
  void *raw = NULL;
  _tide_lock_acquire(&kind->lock);
  if (kind->count > TIDE_HANDLE_QUARANTINE) {
    retired *oldest = kind->head;
    kind->head = oldest->next;
    if (!kind->head) kind->tail = NULL;
    kind->count--;
    raw = oldest;
  }
  _tide_lock_release(&kind->lock);
  size_t bytes = (HEADER + size + 63) / 64 * 64;
  if (!raw && !(raw = aligned_alloc(64, bytes))) return NULL;
  memset(raw, 0, bytes);
  return (char *)raw + HEADER;
}

void _tide_handle_retire(_tide_handle_kind *kind, void *object) {
  if (!object) return;
  retired *r = header_of(object);
  r->next = NULL;
  _tide_lock_acquire(&kind->lock);
  if (kind->tail)
    kind->tail->next = r;
  else
    kind->head = r;
  kind->tail = r;
  kind->count++;
  _tide_lock_release(&kind->lock);
}
