/* ptrmap.c: the live map of an arena, from a block's address to its record.
 *
 * Device memory cannot hold our headers, so every free must find its block
 * by address. Open addressing with linear probing keeps a lookup to one or
 * two cache lines; deletion shifts later entries back instead of leaving
 * tombstones, so probes stay short however long the program runs. */
#include <stdlib.h>

#include "core.h"

#define INITIAL_CAPACITY 64u

static int alloc_table(_tide_ptrmap *m, size_t capacity) {
  m->keys = calloc(capacity, sizeof *m->keys);
  m->values = calloc(capacity, sizeof *m->values);
  if (!m->keys || !m->values) {
    free(m->keys);
    free(m->values);
    m->keys = NULL;
    m->values = NULL;
    return _tide_error_set(TIDE_ERR_OOM, "out of host memory for the live-block map");
  }
  m->mask = capacity - 1;
  return TIDE_OK;
}

int _tide_ptrmap_init(_tide_ptrmap *m) {
  m->count = 0;
  return alloc_table(m, INITIAL_CAPACITY);
}

void _tide_ptrmap_destroy(_tide_ptrmap *m) {
  free(m->keys);
  free(m->values);
  m->keys = NULL;
  m->values = NULL;
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
    if (old.keys[i]) _tide_ptrmap_put(m, old.values[i]);
  free(old.keys);
  free(old.values);
  return TIDE_OK;
}

/* Backward-shift deletion: move later members of the probe run into the
 * hole when their home slot does not lie between the hole and them. */
void _tide_ptrmap_close_hole(_tide_ptrmap *m, size_t i) {
  for (size_t j = (i + 1) & m->mask; m->keys[j]; j = (j + 1) & m->mask) {
    size_t home = _tide_ptrmap_slot(m, m->keys[j]);
    bool stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
    if (stays) continue;
    m->keys[i] = m->keys[j];
    m->values[i] = m->values[j];
    i = j;
  }
  m->keys[i] = 0;
  m->values[i] = NULL;
}
