/* bins.c: block records, and free mapped blocks sorted into size bins with
 * the best-fit search: the bottom of the memory layer, which segments and
 * arenas build on.
 *
 * A request is served by the smallest free block that holds it (PyTorch's
 * policy, which keeps large blocks whole for large requests). Exact bins
 * below 1 MiB make that a list head; graded bins above are short lists that
 * are scanned. Equal sizes in exact bins are served last-freed first, which
 * keeps recently used memory hot. */
#include <stdlib.h>
#include <string.h>

#include "memory/core.h"

#define SUB_COUNT (1u << _TIDE_SUB_BITS)

static inline unsigned log2_floor(uint64_t v) { return 63u - (unsigned)__builtin_clzll(v); }

uint32_t _tide_bin_of(size_t size) {
  uint64_t units = size / TIDE_MIN_BLOCK;
  if (units < _TIDE_EXACT_BINS) return (uint32_t)units;
  unsigned msb = log2_floor(units);
  unsigned sub = (unsigned)(units >> (msb - _TIDE_SUB_BITS)) & (SUB_COUNT - 1);
  uint32_t bin = _TIDE_EXACT_BINS + (msb - 11u) * SUB_COUNT + sub;
  return bin < _TIDE_BIN_COUNT ? bin : _TIDE_BIN_COUNT - 1;
}

static inline void mark(_tide_bins *bins, uint32_t bin) {
  bins->map[bin / 64] |= (uint64_t)1 << (bin % 64);
  bins->summary[bin / 4096] |= (uint64_t)1 << ((bin / 64) % 64);
}

static inline void unmark(_tide_bins *bins, uint32_t bin) {
  uint64_t *word = &bins->map[bin / 64];
  *word &= ~((uint64_t)1 << (bin % 64));
  if (*word == 0) bins->summary[bin / 4096] &= ~((uint64_t)1 << ((bin / 64) % 64));
}

void _tide_bins_insert(_tide_bins *bins, _tide_block *b) {
  uint32_t bin = _tide_bin_of(b->size);
  _tide_block *head = bins->head[bin];
  b->bin = bin;
  b->link_prev = NULL;
  b->link_next = head;
  if (head)
    head->link_prev = b;
  else
    mark(bins, bin);
  bins->head[bin] = b;
  bins->count++;
}

void _tide_bins_remove(_tide_bins *bins, _tide_block *b) {
  uint32_t bin = b->bin;
  if (b->link_prev)
    b->link_prev->link_next = b->link_next;
  else
    bins->head[bin] = b->link_next;
  if (b->link_next) b->link_next->link_prev = b->link_prev;
  if (!bins->head[bin]) unmark(bins, bin);
  b->link_prev = b->link_next = NULL;
  bins->count--;
}

/* The first non-empty bin at or after `bin`, or _TIDE_BIN_COUNT. */
static uint32_t next_nonempty(const _tide_bins *bins, uint32_t bin) {
  if (bin >= _TIDE_BIN_COUNT) return _TIDE_BIN_COUNT;
  uint32_t word = bin / 64;
  uint64_t bits = bins->map[word] & (~(uint64_t)0 << (bin % 64));
  if (bits) return word * 64 + (uint32_t)__builtin_ctzll(bits);
  for (uint32_t w = word + 1; w < _TIDE_BIN_WORDS;) {
    uint32_t s = w / 64;
    uint64_t summary = bins->summary[s] & (~(uint64_t)0 << (w % 64));
    if (summary) {
      uint32_t found = s * 64 + (uint32_t)__builtin_ctzll(summary);
      return found * 64 + (uint32_t)__builtin_ctzll(bins->map[found]);
    }
    w = (s + 1) * 64;
  }
  return _TIDE_BIN_COUNT;
}

/* The best block of a graded bin for `size`: the smallest that fits, then
 * the lowest address. */
static _tide_block *scan_bin(_tide_block *b, size_t size) {
  _tide_block *best = NULL;
  for (; b; b = b->link_next) {
    if (b->size < size) continue;
    if (!best || b->size < best->size || (b->size == best->size && b->addr < best->addr)) best = b;
  }
  return best;
}

_tide_block *_tide_bins_best_fit(const _tide_bins *bins, size_t size) {
  uint32_t bin = _tide_bin_of(size);
  if (bin >= _TIDE_EXACT_BINS) {
    _tide_block *b = scan_bin(bins->head[bin], size);
    if (b) return b;
    bin++;
  }
  bin = next_nonempty(bins, bin);
  if (bin >= _TIDE_BIN_COUNT) return NULL;
  if (bin < _TIDE_EXACT_BINS) return bins->head[bin];
  return scan_bin(bins->head[bin], 0);
}

_tide_block *_tide_bins_largest(const _tide_bins *bins) {
  for (int w = (int)_TIDE_BIN_WORDS - 1; w >= 0; w--) {
    if (!bins->map[w]) continue;
    uint32_t bin = (uint32_t)w * 64 + log2_floor(bins->map[w]);
    _tide_block *best = NULL;
    for (_tide_block *b = bins->head[bin]; b; b = b->link_next)
      if (!best || b->size > best->size) best = b;
    return best;
  }
  return NULL;
}

size_t _tide_bins_collect(const _tide_bins *bins, _tide_block **out, size_t cap) {
  size_t n = 0;
  for (uint32_t w = 0; w < _TIDE_BIN_WORDS; w++)
    for (uint64_t bits = bins->map[w]; bits; bits &= bits - 1) {
      uint32_t bin = w * 64 + (uint32_t)__builtin_ctzll(bits);
      for (_tide_block *b = bins->head[bin]; b && n < cap; b = b->link_next) out[n++] = b;
    }
  return n;
}

/* ------------------------------------------------------------------------ */
/* Block records                                                             */
/* ------------------------------------------------------------------------ */

#define BLOCKS_PER_CHUNK 128

_tide_block *_tide_block_new(_tide_arena *arena) {
  if (TIDE_UNLIKELY(!arena->spare)) {
    _tide_block_chunk *chunk = calloc(1, sizeof *chunk + BLOCKS_PER_CHUNK * sizeof(_tide_block));
    if (!chunk) return NULL;
    chunk->next = arena->chunks;
    arena->chunks = chunk;
    for (int i = BLOCKS_PER_CHUNK - 1; i >= 0; i--) {
      chunk->blocks[i].link_next = arena->spare;
      arena->spare = &chunk->blocks[i];
    }
  }
  _tide_block *b = arena->spare;
  arena->spare = b->link_next;
  memset(b, 0, sizeof *b);
  return b;
}

void _tide_block_delete(_tide_arena *arena, _tide_block *b) {
  free(b->more_streams);
  b->more_streams = NULL;
  b->link_next = arena->spare;
  arena->spare = b;
}

/* ------------------------------------------------------------------------ */
/* Bins with the inactive-split stats                                        */
/* ------------------------------------------------------------------------ */

void _tide_pool_insert(_tide_arena *arena, _tide_block *b) {
  int kind = b->segment->pool;
  _tide_bins_insert(&arena->pools[kind].bins, b);
  if (_tide_block_is_split(b)) {
    _tide_stat_add(&arena->stats, _TIDE_ST_INACTIVE_SPLIT, kind, (int64_t)b->size);
    _tide_stat_add(&arena->stats, _TIDE_ST_INACTIVE_SPLIT_BLOCKS, kind, 1);
  }
}

void _tide_pool_remove(_tide_arena *arena, _tide_block *b) {
  int kind = b->segment->pool;
  _tide_bins_remove(&arena->pools[kind].bins, b);
  if (_tide_block_is_split(b)) {
    _tide_stat_add(&arena->stats, _TIDE_ST_INACTIVE_SPLIT, kind, -(int64_t)b->size);
    _tide_stat_add(&arena->stats, _TIDE_ST_INACTIVE_SPLIT_BLOCKS, kind, -1);
  }
}

void _tide_blocks_free_all(_tide_arena *arena) {
  while (arena->chunks) {
    _tide_block_chunk *next = arena->chunks->next;
    for (int i = 0; i < BLOCKS_PER_CHUNK; i++) free(arena->chunks->blocks[i].more_streams);
    free(arena->chunks);
    arena->chunks = next;
  }
  arena->spare = NULL;
}
