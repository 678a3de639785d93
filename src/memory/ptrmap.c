/* ptrmap.c: the live map of an arena, from a block's address to its record.
 *
 * Device memory cannot hold our headers, so every free must find its block
 * by address. Open addressing with linear probing keeps a lookup to one or
 * two cache lines; deletion shifts later entries back instead of leaving
 * tombstones, so probes stay short however long the program runs. */
#include <stdlib.h>

#include "memory/core.h"

#define INITIAL_CAPACITY 64u

static int alloc_table(_tide_ptrmap *m, size_t capacity) {
  m->slots = calloc(capacity, sizeof *m->slots);
  if (!m->slots) return _tide_error_set(TIDE_ERR_OOM, "out of host memory for the live-block map");
  m->mask = capacity - 1;
  m->shift = 64;
  for (size_t c = capacity; c > 1; c >>= 1) m->shift--;
  return TIDE_OK;
}

int _tide_ptrmap_init(_tide_ptrmap *m) {
  m->count = 0;
  return alloc_table(m, INITIAL_CAPACITY);
}

void _tide_ptrmap_destroy(_tide_ptrmap *m) {
  free(m->slots);
  m->slots = NULL;
  m->count = 0;
}

int _tide_ptrmap_grow(_tide_ptrmap *m) {
  _tide_ptrmap old = *m;
  int rc = alloc_table(m, (old.mask + 1) * 2);
  if (rc) {
    *m = old;
    return rc;
  }
  m->count = 0;
  for (size_t i = 0; i <= old.mask; i++)
    if (old.slots[i].key) _tide_ptrmap_put(m, old.slots[i].value);
  free(old.slots);
  return TIDE_OK;
}

/* Backward-shift deletion: move later members of the probe run into the
 * hole when their home slot does not lie between the hole and them. */
void _tide_ptrmap_close_hole(_tide_ptrmap *m, size_t i) {
  for (size_t j = (i + 1) & m->mask; m->slots[j].key; j = (j + 1) & m->mask) {
    size_t home = _tide_ptrmap_slot(m, m->slots[j].key);
    bool stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
    if (stays) continue;
    m->slots[i] = m->slots[j];
    i = j;
  }
  m->slots[i].key = 0;
  m->slots[i].value = NULL;
}
