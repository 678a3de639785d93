/* ptrmap.c: the live map of an arena, from a block's address to its record.
 *
 * Device memory cannot hold our headers, so every free must find its block
 * by address. Open addressing with linear probing keeps a lookup to one or
 * two cache lines; deletion shifts later entries back instead of leaving
 * tombstones, so probes stay short however long the program runs. */
#include <stdlib.h>

#include "core.h"

#define INITIAL_CAPACITY 64u

static inline size_t slot_of(const _tide_ptrmap *m, uintptr_t addr) {
  /* Addresses are 512-byte aligned: drop those bits, then mix. */
  uint64_t h = (uint64_t)(addr >> 9) * UINT64_C(0x9E3779B97F4A7C15);
  return (size_t)(h >> 32) & m->mask;
}

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

static void put(_tide_ptrmap *m, uintptr_t key, _tide_block *value) {
  size_t i = slot_of(m, key);
  while (m->keys[i]) i = (i + 1) & m->mask;
  m->keys[i] = key;
  m->values[i] = value;
}

static int grow(_tide_ptrmap *m) {
  _tide_ptrmap old = *m;
  int rc = alloc_table(m, (old.mask + 1) * 2);
  if (rc) {
    *m = old;
    return rc;
  }
  for (size_t i = 0; i <= old.mask; i++)
    if (old.keys[i]) put(m, old.keys[i], old.values[i]);
  free(old.keys);
  free(old.values);
  return TIDE_OK;
}

int _tide_ptrmap_reserve_one(_tide_ptrmap *m) {
  /* Keep the load at most one half: probes stay short. */
  if ((m->count + 1) * 2 > m->mask + 1) return grow(m);
  return TIDE_OK;
}

int _tide_ptrmap_insert(_tide_ptrmap *m, _tide_block *b) {
  int rc = _tide_ptrmap_reserve_one(m);
  if (rc) return rc;
  put(m, b->addr, b);
  m->count++;
  return TIDE_OK;
}

_tide_block *_tide_ptrmap_find(const _tide_ptrmap *m, uintptr_t addr) {
  if (!addr) return NULL;
  for (size_t i = slot_of(m, addr);; i = (i + 1) & m->mask) {
    if (m->keys[i] == addr) return m->values[i];
    if (!m->keys[i]) return NULL;
  }
}

_tide_block *_tide_ptrmap_remove(_tide_ptrmap *m, uintptr_t addr) {
  if (!addr) return NULL;
  size_t i = slot_of(m, addr);
  while (m->keys[i] != addr) {
    if (!m->keys[i]) return NULL;
    i = (i + 1) & m->mask;
  }
  _tide_block *found = m->values[i];
  /* Backward-shift deletion: move later members of the probe run into the
   * hole when their home slot does not lie between the hole and them. */
  for (size_t j = (i + 1) & m->mask; m->keys[j]; j = (j + 1) & m->mask) {
    size_t home = slot_of(m, m->keys[j]);
    bool stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
    if (stays) continue;
    m->keys[i] = m->keys[j];
    m->values[i] = m->values[j];
    i = j;
  }
  m->keys[i] = 0;
  m->values[i] = NULL;
  m->count--;
  return found;
}
