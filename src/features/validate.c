/* validate.c: the consistency check of an allocator (tide_check). It walks
 * every arena, pool, segment and block and checks the invariants the rest
 * of the code keeps, so that a test (or a user chasing a corruption) learns
 * of a broken structure at the step that broke it, not later when a block
 * is handed out twice.
 *
 * Checked, for every arena (docs/design.md has the structures):
 * - segments: linked both ways, of this arena and pool, not overlapping any
 *   other segment of the allocator; a fixed one is mapped whole, an
 *   expandable one has a page table whose mapped pages add up to `mapped`;
 * - blocks: they tile their segment in address order from its base, with
 *   prev/next links that agree, 512-byte aligned sizes and addresses, a
 *   valid state, no two free or two unmapped neighbours (merging is eager);
 *   an unmapped block covers whole pages that have no handle, every other
 *   block lies on mapped pages; streams and events only where the state
 *   allows them;
 * - bins: every free block is in the bin of its size, every bin entry is a
 *   free block of this pool, lists link both ways, the bitmaps agree with
 *   the heads, and the count is right; the unmapped list holds exactly the
 *   unmapped blocks, in address order;
 * - the live map holds exactly the allocated and quick blocks, each under
 *   its address and reachable by a lookup; the quick list holds the quick
 *   blocks, oldest first; the pending list holds exactly one entry per
 *   outstanding event of each pending block;
 * - stats: allocated, requested, pending, inactive-split, reserved,
 *   allocation, segment and block counts equal the sums over the blocks
 *   (reserved: mapped pages, fixed segments and handles the backend refused
 *   to release; allocated and requested bytes, allocations and oversize
 *   blocks: the raw stats of quick.h, which count quick blocks too),
 *   peaks are at least the current values, and the counters of pages,
 *   segments, device handles and oversize blocks agree;
 * - allocator-wide: reserved bytes equal the arenas' sum (and, on the host
 *   backend, the bytes the emulated device holds); the shared allocated
 *   counter plus what arenas have not published equals their sum; streams
 *   have one arena each; and the pinned pool checks itself (pinned.c).
 *
 * The check holds the arena table's mutex and every arena's lock at once
 * (in table order, which no other path inverts), so it sees one consistent
 * state even while other threads allocate; it changes nothing. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "features/features.h"
#include "features/pinned.h"

/* A free deferred by a capture (pool.c), as the capture state lists it. */
typedef struct deferred_ref {
  const _tide_arena *arena;
  const _tide_block *block;
} deferred_ref;

typedef struct checker {
  char *why;
  size_t len;
  const struct tide_allocator *a;
  const deferred_ref *deferred; /* the capture state's deferred frees */
  size_t ndeferred;
  size_t arena_index;
  const _tide_arena *arena;
  const _tide_block **blocks; /* every block record of the arena, sorted */
  size_t nblocks, blocks_cap;
  const _tide_block *local_blocks[64]; /* `blocks` until more are needed */
  bool out_of_memory;                  /* the check itself ran out of host memory */
  const _tide_buf_stats *bufs;         /* per arena: what its growable buffers add */
} checker;

/* What the blocks of one arena add up to, [stat][all, small, large]. */
typedef struct sums {
  int64_t cur[_TIDE_ST_COUNT][TIDE_POOL_KINDS];
  size_t free_blocks[2], unmapped_blocks[2];
  size_t live, quick, pending, deferred; /* deferred: pending blocks on no event yet */
  int64_t quick_bytes;
  uint64_t mapped_pages, handles, oversize;
} sums;

static bool fail(checker *c, const char *fmt, ...) TIDE_PRINTF(2, 3);

static bool fail(checker *c, const char *fmt, ...) {
  size_t used = 0;
  if (c->arena)
    used = (size_t)snprintf(c->why, c->len, "arena %zu (stream %p): ", c->arena_index,
                            (void *)c->arena->stream);
  if (used >= c->len) return false;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->why + used, c->len - used, fmt, ap);
  va_end(ap);
  return false;
}

static bool no_memory(checker *c) {
  c->out_of_memory = true;
  return fail(c, "out of host memory for the check");
}

#define CHECK(c, cond, ...)                                                                        \
  do {                                                                                             \
    if (TIDE_UNLIKELY(!(cond))) return fail((c), __VA_ARGS__);                                     \
  } while (0)

static const char *state_name(uint8_t state) {
  static const char *const names[] = {"free", "allocated", "pending", "unmapped", "quick"};
  return state < sizeof names / sizeof names[0] ? names[state] : "invalid";
}

static void add(sums *s, int stat, int pool, int64_t value) {
  s->cur[stat][0] += value;
  s->cur[stat][pool + 1] += value;
}

/* ------------------------------------------------------------------------ */
/* Block records                                                             */
/* ------------------------------------------------------------------------ */

/* Room for `need` items in *items, which starts out as the caller's array
 * `local` (of *cap items) and moves to the heap once that is too short. The
 * check runs after every step of a fuzz input and its arrays are short:
 * allocating each of them, with the address sanitizer recording the stack
 * of every allocation and free, cost more than filling them. */
static bool grow_local(void **items, size_t *cap, size_t need, size_t item_size,
                       const void *local) {
  if (need <= *cap) return true;
  if (*items != local) return _tide_grow_array(items, cap, need, item_size);
  size_t new_cap = *cap * 2;
  while (new_cap < need) new_cap *= 2;
  void *p = malloc(new_cap * item_size);
  if (!p) return false;
  memcpy(p, local, *cap * item_size);
  *items = p;
  *cap = new_cap;
  return true;
}

static bool remember(checker *c, const _tide_block *b) {
  if (c->nblocks == c->blocks_cap &&
      !grow_local((void **)&c->blocks, &c->blocks_cap, c->nblocks + 1, sizeof *c->blocks,
                  c->local_blocks))
    return no_memory(c);
  c->blocks[c->nblocks++] = b;
  return true;
}

static int by_record(const void *x, const void *y) {
  uintptr_t a = (uintptr_t) * (const _tide_block *const *)x;
  uintptr_t b = (uintptr_t) * (const _tide_block *const *)y;
  return (a > b) - (a < b);
}

/* Whether b is a block of the arena's segments (not a stray record). */
static bool known(const checker *c, const _tide_block *b) {
  return b && c->nblocks &&
         bsearch(&b, c->blocks, c->nblocks, sizeof *c->blocks, by_record) != NULL;
}

/* ------------------------------------------------------------------------ */
/* Segments and their blocks                                                 */
/* ------------------------------------------------------------------------ */

/* Sweeps over page tables and bin heads, the bulk of what the check reads
 * (a segment's page table spans the whole device), run without the
 * sanitizers' checks of each load and index: those made them most of a fuzz
 * run's time. What the address sanitizer checked load by load, that every
 * entry lies in live memory, readable() asks it once for the whole range. */
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 8)
#define UNCHECKED_LOADS __attribute__((no_sanitize("address", "undefined")))
#else
#define UNCHECKED_LOADS
#endif

#if defined(__SANITIZE_ADDRESS__)
#define TIDE_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TIDE_ASAN 1
#endif
#endif
#ifdef TIDE_ASAN
#include <sanitizer/asan_interface.h>
#endif

static bool readable(const void *p, size_t bytes) {
#ifdef TIDE_ASAN
  return __asan_region_is_poisoned((void *)(uintptr_t)p, bytes) == NULL;
#else
  (void)p;
  (void)bytes;
  return true;
#endif
}

/* The first of entries [first, last] that is (`nonzero`) or is not a
 * handle, or SIZE_MAX. */
UNCHECKED_LOADS static size_t find_page(const _tide_handle *pages, size_t first, size_t last,
                                        bool nonzero) {
  for (size_t i = first; i <= last; i++)
    if ((pages[i] != 0) == nonzero) return i;
  return SIZE_MAX;
}

UNCHECKED_LOADS static size_t count_mapped(const _tide_handle *pages, size_t n) {
  size_t mapped = 0;
  for (size_t i = 0; i < n; i++) mapped += pages[i] != 0;
  return mapped;
}

/* The handles of an expandable segment's page table: its pages go in
 * groups of handle_pages from the base, each group unmapped (no handle) or
 * mapped by one handle that every page of the group names; a load handle
 * spans several groups next to each other, and as many as the segment
 * counts. */
UNCHECKED_LOADS static bool check_handles(checker *c, const _tide_segment *seg, size_t *handles) {
  size_t n = seg->handle_pages;
  CHECK(c, n == 1 || n == c->a->handle_pages,
        "segment %#lx has handles of %zu pages (1 or %zu expected)", (unsigned long)seg->base, n,
        c->a->handle_pages);
  CHECK(c, seg->npages % n == 0, "segment %#lx of %zu pages is not whole handles of %zu",
        (unsigned long)seg->base, seg->npages, n);
  *handles = 0;
  /* Counted without a branch per page, from locals (the compiler cannot
   * tell that the counts do not alias the table): the loop runs over the
   * whole device after every step of a fuzz input. */
  const _tide_handle *pages = seg->pages;
  size_t npages = seg->npages, count = 0, load = 0;
  _tide_handle prev = 0; /* the group before; 0 before the first */
  for (size_t i = 0; i < npages; i += n) {
    for (size_t j = i + 1; j < i + n; j++)
      CHECK(c, pages[j] == pages[i],
            "page %zu of segment %#lx lies in the handle of %zu pages at page %zu (%#llx) but "
            "names handle %#llx",
            j, (unsigned long)seg->base, n, i, (unsigned long long)pages[i],
            (unsigned long long)pages[j]);
    _tide_handle cur = pages[i], next = i + n < npages ? pages[i + n] : 0;
    bool continues = (cur != 0) & (prev == cur);
    bool goes_on = (cur != 0) & (next == cur);
    count += (cur != 0) & !continues;
    load += goes_on & !continues;
    prev = cur;
  }
  *handles = count;
  CHECK(c, load == seg->load_handles, "segment %#lx counts %u load handles, its page table has %zu",
        (unsigned long)seg->base, seg->load_handles, load);
  return true;
}

/* The page indices [first, last] of the segment that block b touches. */
static void pages_of(const _tide_block *b, size_t page, size_t *first, size_t *last) {
  *first = (b->addr - b->segment->base) / page;
  *last = (b->addr + b->size - 1 - b->segment->base) / page;
}

static bool check_pages(checker *c, const _tide_block *b, size_t page) {
  const _tide_segment *seg = b->segment;
  size_t first, last;
  pages_of(b, page, &first, &last);
  CHECK(c, last < seg->npages, "block %#lx runs past the page table of its segment",
        (unsigned long)b->addr);
  CHECK(c, readable(&seg->pages[first], (last - first + 1) * sizeof *seg->pages),
        "the page table of segment %#lx is not readable for block %#lx", (unsigned long)seg->base,
        (unsigned long)b->addr);
  if (b->state == _TIDE_UNMAPPED) {
    size_t unit = page * seg->handle_pages;
    CHECK(c, (b->addr - seg->base) % unit == 0 && b->size % unit == 0,
          "unmapped block %#lx of %zu bytes is not whole handles of %zu bytes",
          (unsigned long)b->addr, b->size, unit);
    size_t i = find_page(seg->pages, first, last, true);
    CHECK(c, i == SIZE_MAX, "page %zu of segment %#lx has a handle inside unmapped block %#lx", i,
          (unsigned long)seg->base, (unsigned long)b->addr);
    return true;
  }
  size_t i = find_page(seg->pages, first, last, false);
  CHECK(c, i == SIZE_MAX, "%s block %#lx of %zu bytes lies on page %zu, which is not mapped",
        state_name(b->state), (unsigned long)b->addr, b->size, i);
  return true;
}

/* A block whose free a capture defers is pending on no event yet and keeps
 * its recorded streams: the free records its events once the capture ends. */
static bool check_streams_of(checker *c, const _tide_block *b) {
  bool deferred = b->state == _TIDE_PENDING && b->events == 0;
  if (b->state == _TIDE_ALLOCATED || deferred) {
    CHECK(c,
          b->nstreams <= _TIDE_INLINE_STREAMS ||
              (b->more_streams && b->more_cap + _TIDE_INLINE_STREAMS >= (uint32_t)b->nstreams),
          "%s block %#lx is recorded on %u streams without room for them", state_name(b->state),
          (unsigned long)b->addr, b->nstreams);
  } else {
    CHECK(c, b->nstreams == 0, "%s block %#lx still has %u recorded streams", state_name(b->state),
          (unsigned long)b->addr, b->nstreams);
  }
  if (b->state != _TIDE_PENDING)
    CHECK(c, b->events == 0, "%s block %#lx waits for %u events", state_name(b->state),
          (unsigned long)b->addr, b->events);
  return true;
}

/* One block: its state, what it adds to the stats, and its places in the
 * arena's other structures that can be found from it. */
static bool check_block(checker *c, sums *s, const _tide_block *b) {
  const _tide_segment *seg = b->segment;
  const _tide_arena *arena = c->arena;
  int pool = seg->pool;
  if (seg->expandable && !check_pages(c, b, c->a->page_size)) return false;
  if (!check_streams_of(c, b)) return false;
  switch (b->state) {
  case _TIDE_FREE:
  case _TIDE_QUICK:
    if (b->state == _TIDE_FREE) {
      s->free_blocks[pool]++;
    } else {
      s->quick++;
      CHECK(c, _tide_ptrmap_find(&arena->live, b->addr) == b,
            "quick block %#lx is not in the live map", (unsigned long)b->addr);
      /* The raw stats count a quick block as allocated (quick.h). */
      s->quick_bytes += (int64_t)b->size;
      add(s, _TIDE_ST_ALLOCATED, pool, (int64_t)b->size);
      add(s, _TIDE_ST_REQUESTED, pool, (int64_t)b->requested);
      add(s, _TIDE_ST_ALLOCATIONS, pool, 1);
      s->oversize += b->size >= c->a->conf.max_split_size;
    }
    if (_tide_block_is_split(b)) {
      add(s, _TIDE_ST_INACTIVE_SPLIT, pool, (int64_t)b->size);
      add(s, _TIDE_ST_INACTIVE_SPLIT_BLOCKS, pool, 1);
    }
    break;
  case _TIDE_ALLOCATED:
    CHECK(c, b->requested > 0 && b->requested <= b->size,
          "allocated block %#lx of %zu bytes was asked for %zu bytes", (unsigned long)b->addr,
          b->size, b->requested);
    CHECK(c, _tide_ptrmap_find(&arena->live, b->addr) == b,
          "allocated block %#lx is not in the live map", (unsigned long)b->addr);
    s->live++;
    add(s, _TIDE_ST_ALLOCATED, pool, (int64_t)b->size);
    add(s, _TIDE_ST_REQUESTED, pool, (int64_t)b->requested);
    add(s, _TIDE_ST_ALLOCATIONS, pool, 1);
    s->oversize += b->size >= c->a->conf.max_split_size;
    break;
  case _TIDE_PENDING:
    CHECK(c, _tide_ptrmap_find(&arena->live, b->addr) == NULL,
          "pending block %#lx is still in the live map", (unsigned long)b->addr);
    s->pending++;
    s->deferred += b->events == 0;
    add(s, _TIDE_ST_PENDING, pool, (int64_t)b->size);
    add(s, _TIDE_ST_PENDING_BLOCKS, pool, 1);
    break;
  case _TIDE_UNMAPPED:
    CHECK(c, seg->expandable, "block %#lx of a fixed segment is unmapped", (unsigned long)b->addr);
    s->unmapped_blocks[pool]++;
    break;
  default: return fail(c, "block %#lx has state %u", (unsigned long)b->addr, b->state);
  }
  return true;
}

/* The blocks of a segment tile [base, base+size) in address order. */
static bool check_tiling(checker *c, sums *s, const _tide_segment *seg) {
  uintptr_t at = seg->base, end = seg->base + seg->size;
  const _tide_block *prev = NULL;
  for (const _tide_block *b = seg->first; b; prev = b, b = b->next) {
    CHECK(c, at < end, "segment %#lx has blocks past its end (%#lx)", (unsigned long)seg->base,
          (unsigned long)end);
    CHECK(c, b->segment == seg, "block %#lx in the chain of segment %#lx names segment %p",
          (unsigned long)b->addr, (unsigned long)seg->base, (void *)b->segment);
    CHECK(c, b->prev == prev, "block %#lx: its prev link is %p, the block before it is %p",
          (unsigned long)b->addr, (void *)b->prev, (void *)prev);
    CHECK(c, b->addr == at,
          "segment %#lx: a block starts at %#lx where %#lx was expected (gap or "
          "overlap)",
          (unsigned long)seg->base, (unsigned long)b->addr, (unsigned long)at);
    CHECK(c,
          b->size >= TIDE_MIN_BLOCK && b->size % TIDE_MIN_BLOCK == 0 &&
              b->addr % TIDE_MIN_BLOCK == 0 && b->size <= end - at,
          "block %#lx has size %zu (not whole 512-byte units inside its segment)",
          (unsigned long)b->addr, b->size);
    if (prev) {
      CHECK(c, !(prev->state == _TIDE_FREE && b->state == _TIDE_FREE),
            "free blocks %#lx and %#lx are neighbours, not merged", (unsigned long)prev->addr,
            (unsigned long)b->addr);
      CHECK(c, !(prev->state == _TIDE_UNMAPPED && b->state == _TIDE_UNMAPPED),
            "unmapped blocks %#lx and %#lx are neighbours, not merged", (unsigned long)prev->addr,
            (unsigned long)b->addr);
    }
    if (!remember(c, b) || !check_block(c, s, b)) return false;
    at += b->size;
  }
  CHECK(c, at == end, "the blocks of segment %#lx end at %#lx, the segment at %#lx",
        (unsigned long)seg->base, (unsigned long)at, (unsigned long)end);
  return true;
}

static bool check_segment(checker *c, sums *s, const _tide_pool *pool, const _tide_segment *seg) {
  size_t page = c->a->page_size;
  CHECK(c, seg->arena == c->arena && seg->pool == pool->kind,
        "segment %#lx is listed in pool %d of this arena but says pool %d of arena %p",
        (unsigned long)seg->base, pool->kind, seg->pool, (void *)seg->arena);
  CHECK(c, seg->size > 0 && seg->first && !seg->first->prev,
        "segment %#lx has size %zu and first block %p", (unsigned long)seg->base, seg->size,
        (void *)seg->first);
  if (seg->expandable) {
    CHECK(c, seg->pages && seg->npages * page == seg->size && seg->base % page == 0,
          "expandable segment %#lx of %zu bytes has %zu pages of %zu bytes",
          (unsigned long)seg->base, seg->size, seg->npages, page);
    CHECK(c, readable(seg->pages, seg->npages * sizeof *seg->pages),
          "the page table of expandable segment %#lx is not readable", (unsigned long)seg->base);
    size_t mapped = count_mapped(seg->pages, seg->npages), handles = 0;
    CHECK(c, mapped * page == seg->mapped,
          "expandable segment %#lx says %zu bytes are mapped, its page table %zu pages of %zu",
          (unsigned long)seg->base, seg->mapped, mapped, page);
    if (!check_handles(c, seg, &handles)) return false;
    s->mapped_pages += mapped;
    s->handles += handles;
  } else {
    CHECK(c, seg->mapped == seg->size && seg->handle != 0 && !seg->pages,
          "fixed segment %#lx of %zu bytes has %zu mapped, handle %llu", (unsigned long)seg->base,
          seg->size, seg->mapped, (unsigned long long)seg->handle);
    s->handles++;
  }
  add(s, _TIDE_ST_RESERVED, pool->kind, (int64_t)seg->mapped);
  add(s, _TIDE_ST_SEGMENTS, pool->kind, 1);
  return check_tiling(c, s, seg);
}

static bool check_segments(checker *c, sums *s, const _tide_pool *pool) {
  const _tide_segment *prev = NULL;
  for (const _tide_segment *seg = pool->segments; seg; prev = seg, seg = seg->next) {
    CHECK(c, seg->prev == prev, "segment %#lx: its prev link is %p, the one before it %p",
          (unsigned long)seg->base, (void *)seg->prev, (void *)prev);
    if (!check_segment(c, s, pool, seg)) return false;
  }
  return true;
}

/* ------------------------------------------------------------------------ */
/* Bins, the unmapped list, the live map, quick and pending blocks           */
/* ------------------------------------------------------------------------ */

static bool bit_of(const uint64_t *words, size_t i) { return (words[i / 64] >> (i % 64)) & 1; }

static bool check_bin(checker *c, const _tide_pool *pool, uint32_t bin, size_t *n, size_t limit) {
  const _tide_block *prev = NULL;
  for (const _tide_block *b = pool->bins.head[bin]; b; prev = b, b = b->link_next) {
    CHECK(c, ++*n <= limit, "the bins of pool %d hold more entries than its %zu free blocks",
          pool->kind, limit);
    CHECK(c, known(c, b), "bin %u of pool %d holds %p, which is no block of the arena", bin,
          pool->kind, (void *)b);
    CHECK(c, b->state == _TIDE_FREE && b->segment->pool == pool->kind,
          "bin %u of pool %d holds %s block %#lx of pool %d", bin, pool->kind, state_name(b->state),
          (unsigned long)b->addr, b->segment->pool);
    CHECK(c, b->bin == bin && _tide_bin_of(b->size) == bin,
          "free block %#lx of %zu bytes lies in bin %u, says bin %u, belongs in bin %u",
          (unsigned long)b->addr, b->size, bin, b->bin, _tide_bin_of(b->size));
    CHECK(c, b->link_prev == prev, "free block %#lx in bin %u: its prev link is %p, not %p",
          (unsigned long)b->addr, bin, (void *)b->link_prev, (void *)prev);
  }
  return true;
}

/* Whether bins [first, first + count) have no list: the common case (the
 * heads lie in the arena, a fixed array: no range to ask about). One OR
 * over them, which the compiler does several heads at a time: a memcmp
 * against zeros, checked whole by the address sanitizer at each call, made
 * this sweep a tenth of a fuzz run's time. */
UNCHECKED_LOADS static bool heads_empty(const _tide_bins *bins, uint32_t first, uint32_t count) {
  _tide_block *const *h = &bins->head[first];
  uintptr_t any = 0;
  for (uint32_t i = 0; i < count; i++) any |= (uintptr_t)h[i];
  return any == 0;
}

/* Bit i set: bin first + i has a list. Compared whole with the bitmap word,
 * instead of bit by bit with a branch for each (which, with the sanitizers'
 * checks of every load, was a tenth of a fuzz run's time). */
UNCHECKED_LOADS static uint64_t heads_full(const _tide_bins *bins, uint32_t first, uint32_t count) {
  _tide_block *const *h = &bins->head[first];
  uint64_t full = 0;
  for (uint32_t i = 0; i < count; i++) full |= (uint64_t)(h[i] != NULL) << i;
  return full;
}

/* Every bitmap word covers 64 bins, none past the last. */
_Static_assert(_TIDE_BIN_COUNT % 64 == 0, "the bins fill their bitmap words");

static bool check_bins(checker *c, const sums *s, const _tide_pool *pool) {
  const _tide_bins *bins = &pool->bins;
  size_t n = 0, limit = s->free_blocks[pool->kind];
  for (uint32_t w = 0; w < _TIDE_BIN_WORDS; w++) {
    uint32_t first = w * 64, count = 64;
    uint64_t word = bins->map[w];
    CHECK(c, bit_of(bins->summary, w) == (word != 0),
          "pool %d: the summary bit of bitmap word %u disagrees with it", pool->kind, w);
    if (word == 0) { /* the common case, checked in one sweep */
      CHECK(c, heads_empty(bins, first, count),
            "pool %d: bins %u..%u are marked empty, one of them is not", pool->kind, first,
            first + count - 1);
      continue;
    }
    uint64_t differ = word ^ heads_full(bins, first, count);
    if (differ) {
      uint32_t bin = first + (uint32_t)__builtin_ctzll(differ);
      bool marked = (word >> (bin - first)) & 1;
      return fail(c, "bin %u of pool %d: its bitmap bit says %s, its list is %s", bin, pool->kind,
                  marked ? "full" : "empty", bins->head[bin] ? "full" : "empty");
    }
    for (uint64_t left = word; left; left &= left - 1) {
      uint32_t bin = first + (uint32_t)__builtin_ctzll(left);
      if (!check_bin(c, pool, bin, &n, limit)) return false;
    }
  }
  CHECK(c, n == limit && bins->count == n,
        "pool %d has %zu free blocks, %zu in its bins, and counts %zu", pool->kind, limit, n,
        bins->count);
  return true;
}

static bool check_unmapped(checker *c, const sums *s, const _tide_pool *pool) {
  size_t n = 0, limit = s->unmapped_blocks[pool->kind];
  const _tide_block *prev = NULL;
  for (const _tide_block *b = pool->unmapped; b; prev = b, b = b->link_next) {
    CHECK(c, ++n <= limit, "the unmapped list of pool %d is longer than its %zu unmapped blocks",
          pool->kind, limit);
    CHECK(c, known(c, b) && b->state == _TIDE_UNMAPPED && b->segment->pool == pool->kind,
          "the unmapped list of pool %d holds %p, no unmapped block of it", pool->kind, (void *)b);
    CHECK(c, b->link_prev == prev && (!prev || prev->addr < b->addr),
          "unmapped block %#lx: out of address order or badly linked in its list",
          (unsigned long)b->addr);
  }
  CHECK(c, n == limit, "pool %d has %zu unmapped blocks, %zu in its list", pool->kind, limit, n);
  return true;
}

static bool check_live_map(checker *c, const sums *s) {
  const _tide_ptrmap *m = &c->arena->live;
  size_t cap = m->mask + 1, n = 0;
  CHECK(c, m->slots && (cap & m->mask) == 0, "the live map has capacity %zu", cap);
  for (size_t i = 0; i < cap; i++) {
    if (!m->slots[i].key) {
      CHECK(c, m->slots[i].value == NULL, "slot %zu of the live map has a value but no key", i);
      continue;
    }
    n++;
    const _tide_block *b = m->slots[i].value;
    CHECK(c, b && b->addr == m->slots[i].key, "slot %zu of the live map: key %#lx, block %p", i,
          (unsigned long)m->slots[i].key, (void *)b);
    CHECK(c, known(c, b) && (b->state == _TIDE_ALLOCATED || b->state == _TIDE_QUICK),
          "the live map holds %#lx, not an allocated or quick block of the arena (%s)",
          (unsigned long)m->slots[i].key, known(c, b) ? state_name(b->state) : "no block");
    CHECK(c, _tide_ptrmap_find(m, m->slots[i].key) == b,
          "the live map's entry for %#lx cannot be found by a lookup",
          (unsigned long)m->slots[i].key);
  }
  CHECK(c, n == m->count && n == s->live + s->quick && n * 2 <= cap,
        "the live map holds %zu entries, counts %zu, capacity %zu; the arena has %zu allocated "
        "and %zu quick blocks",
        n, m->count, cap, s->live, s->quick);
  return true;
}

static bool check_quick(checker *c, const sums *s) {
  const _tide_arena *arena = c->arena;
  CHECK(c, arena->nquick <= _TIDE_QUICK_SLOTS && arena->nquick == s->quick,
        "the quick list holds %u blocks, the segments %zu quick blocks", arena->nquick, s->quick);
  for (unsigned i = 0; i < arena->nquick; i++) {
    const _tide_block *b = arena->quick[i];
    CHECK(c, known(c, b) && b->state == _TIDE_QUICK, "quick slot %u holds %p, no quick block", i,
          (void *)b);
    for (unsigned j = 0; j < i; j++)
      CHECK(c, arena->quick[j] != b, "block %#lx is in the quick list twice",
            (unsigned long)b->addr);
    CHECK(c, i == 0 || arena->quick[i - 1]->stamp <= b->stamp,
          "the quick list is not oldest first at slot %u", i);
  }
  return true;
}

static int by_pending_block(const void *x, const void *y) {
  uintptr_t a = (uintptr_t)((const _tide_pending *)x)->block;
  uintptr_t b = (uintptr_t)((const _tide_pending *)y)->block;
  return (a > b) - (a < b);
}

static bool check_pending(checker *c, const sums *s) {
  const _tide_arena *arena = c->arena;
  size_t n = arena->npending;
  CHECK(c, n <= arena->pending_cap, "%zu pending entries in room for %zu", n, arena->pending_cap);
  /* Pending blocks on no event are frees a capture defers, each on the
   * capture state's list (but while another thread retries the list, its
   * frees are off it for a moment). */
  size_t listed = 0;
  for (size_t i = 0; i < c->ndeferred; i++) {
    const _tide_block *b = c->deferred[i].block;
    if (c->deferred[i].arena != arena) continue;
    CHECK(c, known(c, b), "a deferred free names %p, no block of the arena", (void *)b);
    CHECK(c, b->state == _TIDE_PENDING && b->events == 0,
          "the free of block %#lx is deferred, but the block is %s waiting for %u events",
          (unsigned long)b->addr, state_name(b->state), b->events);
    listed++;
  }
  if (!c->a->captures.unlisted)
    CHECK(c, listed == s->deferred,
          "%zu pending blocks wait for no event, %zu of them are deferred frees", s->deferred,
          listed);
  if (n == 0) {
    CHECK(c, s->pending == s->deferred, "%zu pending blocks and no event to wait for",
          s->pending - s->deferred);
    return true;
  }
  _tide_pending *sorted = malloc(n * sizeof *sorted);
  if (!sorted) return no_memory(c);
  memcpy(sorted, arena->pending, n * sizeof *sorted);
  qsort(sorted, n, sizeof *sorted, by_pending_block);
  size_t blocks = 0;
  bool ok = true;
  for (size_t i = 0, j; i < n && ok; i = j) {
    const _tide_block *b = sorted[i].block;
    for (j = i; j < n && sorted[j].block == b; j++) {
      if (!sorted[j].event || sorted[j].stream == arena->stream)
        ok = fail(c, "a pending entry of block %p has event %p on stream %p (the arena's own?)",
                  (void *)b, sorted[j].event, (void *)sorted[j].stream);
    }
    blocks++;
    if (ok && !known(c, b))
      ok = fail(c, "%zu pending entries for %p, no block of the arena", j - i, (void *)b);
    if (ok && !(b->state == _TIDE_PENDING && b->events == j - i))
      ok = fail(c, "%zu pending entries for block %#lx, which is %s waiting for %u events", j - i,
                (unsigned long)b->addr, state_name(b->state), b->events);
  }
  free(sorted);
  if (!ok) return false;
  CHECK(c, blocks == s->pending - s->deferred,
        "pending entries name %zu blocks, the segments have %zu pending on events", blocks,
        s->pending - s->deferred);
  return true;
}

/* ------------------------------------------------------------------------ */
/* Stats                                                                     */
/* ------------------------------------------------------------------------ */

static bool check_orphans(checker *c, sums *s) {
  const _tide_arena *arena = c->arena;
  CHECK(c, arena->orphans_lost == 0,
        "%zu piece(s) of memory the device backend refused to give back could not be recorded "
        "(out of host memory): they stay held, uncounted, until the process ends",
        arena->orphans_lost);
  CHECK(c, arena->norphans <= arena->orphans_cap, "%zu orphans in room for %zu", arena->norphans,
        arena->orphans_cap);
  CHECK(c, arena->nspare_pages == 0 && !arena->keep_spare_pages,
        "%zu spare pages are kept between operations (growth gives them back)",
        arena->nspare_pages);
  for (size_t i = 0; i < arena->norphans; i++) {
    const _tide_orphan_rec *o = &arena->orphans[i];
    CHECK(c, o->pool == _TIDE_SMALL || o->pool == _TIDE_LARGE, "orphan %zu has pool %d", i,
          o->pool);
    CHECK(c, o->map_addr || o->handle || o->range, "orphan %zu holds nothing", i);
    if (o->handle) {
      add(s, _TIDE_ST_RESERVED, o->pool, (int64_t)o->handle_size);
      s->handles++;
    }
  }
  /* Stale pages: mapped at an address their segment no longer maps. The
   * owned ones hold their handle's bytes. */
  size_t page = arena->alloc->page_size;
  for (size_t i = 0; i < arena->nstale; i++) {
    const struct _tide_stale_page *sp = &arena->stale[i];
    CHECK(c, sp->addr % page == 0 && sp->handle && sp->size && sp->size % page == 0,
          "stale page %zu at %#lx of %zu bytes with handle %#llx", i, (unsigned long)sp->addr,
          sp->size, (unsigned long long)sp->handle);
    if (sp->owned) {
      add(s, _TIDE_ST_RESERVED, sp->pool, (int64_t)sp->size);
      s->handles++;
    }
  }
  return true;
}

static const char *const stat_names[_TIDE_ST_COUNT] = {
    [_TIDE_ST_ALLOCATED] = "allocated bytes",
    [_TIDE_ST_REQUESTED] = "requested bytes",
    [_TIDE_ST_PENDING] = "pending bytes",
    [_TIDE_ST_INACTIVE_SPLIT] = "inactive split bytes",
    [_TIDE_ST_RESERVED] = "reserved bytes",
    [_TIDE_ST_ALLOCATIONS] = "allocations",
    [_TIDE_ST_PENDING_BLOCKS] = "pending blocks",
    [_TIDE_ST_INACTIVE_SPLIT_BLOCKS] = "inactive split blocks",
    [_TIDE_ST_SEGMENTS] = "segments",
};

static bool check_stats(checker *c, const sums *s) {
  static const char *const pools[TIDE_POOL_KINDS] = {"all pools", "the small pool",
                                                     "the large pool"};
  const _tide_arena_stats *st = &c->arena->stats;
  for (int stat = 0; stat < _TIDE_ST_COUNT; stat++)
    for (int k = 1; k <= TIDE_POOL_KINDS; k++) { /* each pool, then their sum */
      int p = k % TIDE_POOL_KINDS;
      CHECK(c, st->cur[stat][p] == s->cur[stat][p], "%s of %s: %lld counted, the blocks %lld",
            stat_names[stat], pools[p], (long long)st->cur[stat][p], (long long)s->cur[stat][p]);
      CHECK(c, st->peak[stat][p] >= st->cur[stat][p], "%s of %s: peak %lld below current %lld",
            stat_names[stat], pools[p], (long long)st->peak[stat][p], (long long)st->cur[stat][p]);
    }
  const uint64_t *k = st->counters;
  CHECK(c, k[_TIDE_CT_ALLOCS] >= (uint64_t)s->cur[_TIDE_ST_ALLOCATIONS][0],
        "%llu allocations made, %lld live", (unsigned long long)k[_TIDE_CT_ALLOCS],
        (long long)s->cur[_TIDE_ST_ALLOCATIONS][0]);
  CHECK(c, k[_TIDE_CT_OVERSIZE] == s->oversize, "%llu oversize allocations counted, %llu live",
        (unsigned long long)k[_TIDE_CT_OVERSIZE], (unsigned long long)s->oversize);
  CHECK(c, k[_TIDE_CT_PAGES_MAPPED] - k[_TIDE_CT_PAGES_UNMAPPED] == s->mapped_pages,
        "%llu pages mapped and %llu unmapped, but %llu are mapped now",
        (unsigned long long)k[_TIDE_CT_PAGES_MAPPED],
        (unsigned long long)k[_TIDE_CT_PAGES_UNMAPPED], (unsigned long long)s->mapped_pages);
  CHECK(c,
        k[_TIDE_CT_SEGMENTS_CREATED] - k[_TIDE_CT_SEGMENTS_RELEASED] ==
            (uint64_t)s->cur[_TIDE_ST_SEGMENTS][0],
        "%llu segments created and %llu released, but %lld exist",
        (unsigned long long)k[_TIDE_CT_SEGMENTS_CREATED],
        (unsigned long long)k[_TIDE_CT_SEGMENTS_RELEASED], (long long)s->cur[_TIDE_ST_SEGMENTS][0]);
  CHECK(c, k[_TIDE_CT_DEVICE_ALLOC] - k[_TIDE_CT_DEVICE_FREE] == s->handles,
        "%llu device allocations and %llu frees, but %llu handles are held",
        (unsigned long long)k[_TIDE_CT_DEVICE_ALLOC], (unsigned long long)k[_TIDE_CT_DEVICE_FREE],
        (unsigned long long)s->handles);
  return true;
}

/* ------------------------------------------------------------------------ */
/* An arena, and the allocator                                               */
/* ------------------------------------------------------------------------ */

static bool check_arena(checker *c, sums *s) {
  const _tide_arena *arena = c->arena;
  CHECK(c, arena->alloc == c->a, "the arena belongs to allocator %p", (void *)arena->alloc);
  c->nblocks = 0;
  for (int kind = 0; kind < 2; kind++) {
    CHECK(c, arena->pools[kind].kind == kind, "pool %d says it is pool %d", kind,
          arena->pools[kind].kind);
    if (!check_segments(c, s, &arena->pools[kind])) return false;
  }
  if (c->nblocks) qsort(c->blocks, c->nblocks, sizeof *c->blocks, by_record);
  for (size_t i = 1; i < c->nblocks; i++)
    CHECK(c, c->blocks[i] != c->blocks[i - 1], "block record %p lies in two places",
          (void *)c->blocks[i]);
  for (int kind = 0; kind < 2; kind++)
    if (!check_bins(c, s, &arena->pools[kind]) || !check_unmapped(c, s, &arena->pools[kind]))
      return false;
  if (c->bufs) {
    const _tide_buf_stats *f = &c->bufs[c->arena_index];
    add(s, _TIDE_ST_ALLOCATED, _TIDE_LARGE, f->length);
    add(s, _TIDE_ST_REQUESTED, _TIDE_LARGE, f->length);
    add(s, _TIDE_ST_ALLOCATIONS, _TIDE_LARGE, f->count);
    add(s, _TIDE_ST_RESERVED, _TIDE_LARGE, (int64_t)(f->pages * f->page));
    s->mapped_pages += f->pages;
    s->handles += f->pages;
  }
  return check_live_map(c, s) && check_quick(c, s) && check_pending(c, s) && check_orphans(c, s) &&
         check_stats(c, s);
}

/* An arena of a capture pool belongs to a pool of the allocator that,
 * while it has users, keeps its cache; one left by a pool that went holds
 * nothing. Under the capture mutex. */
static bool check_pool_arena(checker *c) {
  const _tide_arena *arena = c->arena;
  if (arena->pool_id == 0) return true;
  if (arena->pool_id == _TIDE_UNUSED_ARENA) {
    CHECK(c,
          !arena->pool && !arena->pools[_TIDE_SMALL].segments &&
              !arena->pools[_TIDE_LARGE].segments && arena->live.count == 0 &&
              arena->npending == 0 && arena->norphans == 0 && arena->nspare_pages == 0,
          "an arena left by a capture pool still holds memory or names pool %p",
          (void *)arena->pool);
    return true;
  }
  const struct tide_pool *p = c->a->captures.pools;
  while (p && p != arena->pool) p = p->next;
  CHECK(c, p && p->id == arena->pool_id,
        "the arena of capture pool %llu names pool %p, not a pool of the allocator with that id",
        (unsigned long long)arena->pool_id, (void *)arena->pool);
  CHECK(c, p->uses <= 0 || arena->keep_cache,
        "capture pool %llu has %d users, but its arena does not keep its cache",
        (unsigned long long)p->id, p->uses);
  return true;
}

typedef struct range {
  uintptr_t base;
  size_t size;
} range;

static int by_base(const void *x, const void *y) {
  uintptr_t a = ((const range *)x)->base, b = ((const range *)y)->base;
  return (a > b) - (a < b);
}

/* No two segments of the allocator share an address. */
static bool check_disjoint(checker *c, _tide_arena *const *arenas, size_t n) {
  range local[64];
  size_t count = 0, cap = sizeof local / sizeof *local;
  range *ranges = local;
  for (size_t i = 0; i < n; i++)
    for (int kind = 0; kind < 2; kind++)
      for (const _tide_segment *seg = arenas[i]->pools[kind].segments; seg; seg = seg->next) {
        if (!grow_local((void **)&ranges, &cap, count + 1, sizeof *ranges, local)) {
          if (ranges != local) free(ranges);
          return no_memory(c);
        }
        ranges[count++] = (range){seg->base, seg->size};
      }
  if (count) qsort(ranges, count, sizeof *ranges, by_base);
  bool ok = true;
  for (size_t i = 1; i < count && ok; i++)
    if (ranges[i - 1].base + ranges[i - 1].size > ranges[i].base)
      ok = fail(c, "segments %#lx (%zu bytes) and %#lx overlap", (unsigned long)ranges[i - 1].base,
                ranges[i - 1].size, (unsigned long)ranges[i].base);
  if (ranges != local) free(ranges);
  return ok;
}

static bool check_allocator(checker *c, _tide_arena *const *arenas, size_t n) {
  struct tide_allocator *a = (struct tide_allocator *)c->a;
  int64_t reserved = 0, allocated = 0, unpublished = 0;
  for (size_t i = 0; i < n; i++) {
    sums s;
    memset(&s, 0, sizeof s);
    c->arena = arenas[i];
    c->arena_index = i;
    if (!check_arena(c, &s) || !check_pool_arena(c)) return false;
    for (size_t j = 0; j < i; j++)
      CHECK(c,
            arenas[i]->pool_id == _TIDE_UNUSED_ARENA || arenas[j]->stream != arenas[i]->stream ||
                arenas[j]->pool_id != arenas[i]->pool_id,
            "arena %zu serves the same stream%s", j,
            arenas[i]->pool_id ? " in the same capture pool" : "");
    reserved += s.cur[_TIDE_ST_RESERVED][0];
    allocated += s.cur[_TIDE_ST_ALLOCATED][0] - s.quick_bytes;
    unpublished += arenas[i]->unpublished;
  }
  c->arena = NULL;
  if (!check_disjoint(c, arenas, n)) return false;
  int64_t held = atomic_load(&a->reserved.cur), claimed = atomic_load(&a->claimed);
  CHECK(c, held == reserved + claimed,
        "the allocator counts %lld reserved bytes, its arenas %lld and waiting claims %lld",
        (long long)held, (long long)reserved, (long long)claimed);
  CHECK(c, atomic_load(&a->reserved.peak) >= held, "the reserved peak is below current");
  if (atomic_load(&a->shared_peak)) {
    int64_t shared = atomic_load(&a->allocated.cur);
    CHECK(c, shared + unpublished == allocated,
          "the shared allocated counter is %lld with %lld unpublished, the arenas hold %lld",
          (long long)shared, (long long)unpublished, (long long)allocated);
  } else {
    CHECK(c, n <= 1 && unpublished == 0,
          "%zu arenas but no shared allocated counter (%lld bytes unpublished)", n,
          (long long)unpublished);
  }
  if (a->backend.is_host) {
    uint64_t device = _tide_host_bytes_in_use(&a->backend);
    CHECK(c, device == (uint64_t)held, "the emulated device holds %llu bytes, %lld are reserved",
          (unsigned long long)device, (long long)held);
  }
  return true;
}

/* The frees the capture state defers, under its mutex. */
static bool collect_deferred(checker *c, struct tide_allocator *a, deferred_ref **out) {
  size_t n = 0, cap = 0;
  *out = NULL;
  for (const _tide_deferred *d = a->captures.deferred; d; d = d->next) {
    if (!_tide_grow_array((void **)out, &cap, n + 1, sizeof **out)) return false;
    (*out)[n++] = (deferred_ref){d->arena, d->block};
  }
  c->deferred = *out;
  c->ndeferred = n;
  return true;
}

int _tide_validate(struct tide_allocator *a, char *why, size_t len) {
  checker c = {.why = why, .len = len, .a = a};
  c.blocks = c.local_blocks;
  c.blocks_cap = sizeof c.local_blocks / sizeof *c.local_blocks;
  if (len) why[0] = '\0';
  /* The capture state first: its mutex comes before the arenas'. */
  pthread_mutex_lock(&a->captures.mutex);
  deferred_ref *deferred;
  if (!collect_deferred(&c, a, &deferred)) {
    pthread_mutex_unlock(&a->captures.mutex);
    free(deferred);
    snprintf(why, len, "out of host memory for the check");
    return TIDE_ERR_OOM;
  }
  pthread_mutex_lock(&a->arenas_mutex);
  size_t n = atomic_load(&a->narenas);
  /* The list of growable buffers comes before the arenas' locks; their
   * stats are read under those locks (buffer.c counts them there). */
  _tide_buf_stats local_bufs[16];
  _tide_buf_stats *bufs = n <= 16 ? local_bufs : calloc(n, sizeof *bufs);
  if (!bufs) {
    pthread_mutex_unlock(&a->arenas_mutex);
    pthread_mutex_unlock(&a->captures.mutex);
    free(deferred);
    snprintf(why, len, "out of host memory for the check");
    return TIDE_ERR_OOM;
  }
  _tide_bufs_hold(a);
  for (size_t i = 0; i < n; i++) _tide_lock_acquire(&a->arenas[i]->lock);
  _tide_bufs_stats(a, a->arenas, n, bufs);
  c.bufs = bufs;
  bool ok = check_allocator(&c, a->arenas, n);
  for (size_t i = n; i-- > 0;) _tide_lock_release(&a->arenas[i]->lock);
  _tide_bufs_let_go(a);
  pthread_mutex_unlock(&a->arenas_mutex);
  pthread_mutex_unlock(&a->captures.mutex);
  free(deferred);
  if (bufs != local_bufs) free(bufs);
  if (c.blocks != c.local_blocks) free(c.blocks);
  if (!ok) return c.out_of_memory ? TIDE_ERR_OOM : TIDE_ERR_STATE;
  return a->pinned ? _tide_pinned_validate(a->pinned, why, len) : TIDE_OK;
}

tide_status tide_check(tide_allocator *a) {
  if (!_tide_allocator_valid(a))
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID,
                                        "tide_check: not a live tidalloc allocator (NULL, "
                                        "destroyed or corrupted handle)");
  char why[400];
  int rc = _tide_validate(a, why, sizeof why);
  if (rc == TIDE_OK) return TIDE_OK;
  return (tide_status)_tide_error_set((tide_status)rc,
                                      "tide_check: the allocator of device %d is inconsistent: %s",
                                      a->device, why);
}
