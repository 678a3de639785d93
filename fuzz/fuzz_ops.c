/* fuzz_ops.c: random sequences of API calls on one allocator of the host
 * backend, with tide_check (the consistency check) after every fourth step,
 * after every step in which an injected fault fired, and at the end.
 *
 * The input is read as choices (fuzz.h): two bytes pick the configuration
 * (segment kind, device size, rounding, splitting, garbage collection, page
 * and mapping sizes, trace, capture_detection), then each step takes one byte that picks an
 * operation from the table `ops` by weight, and the operation reads its own
 * arguments from the bytes after it. Sizes come from classes that matter to
 * the allocator (0, huge, sizes used before, small, large, page multiples,
 * the size of a live block), so that short inputs reach reuse, splitting,
 * growth and out-of-memory.
 *
 * Every call's outcome is checked against what the API documents: a failure
 * has a status the call may return in that state and a message; a backend
 * failure happens only in a call an injected fault (tide_host_fail_call)
 * hit; a free that fails leaves the block allocated and intact; bad
 * pointers (double, interior, unknown, another device's) get their errors.
 * After every step: the figures equal the sums over the
 * live blocks, and every live block still holds its data at both ends (the
 * whole pattern is checked before a block is freed). At the end everything
 * is freed and the cache emptied: nothing may stay reserved, and the
 * allocator must be destroyed without complaint (ASan sees host leaks).
 *
 * Growable buffers (buf_*) are created without a worker thread, so that
 * every backend call happens inside the step that makes it and an injected
 * fault is seen by the call that hit it.
 *
 * Capture pools: the host backend's emulated captures (begin, join, end)
 * run beside the allocator's begins and ends, pools are created, retained
 * and released, and checkpoints are taken and restored. The model knows
 * which capture each stream is in, and from that where every allocation
 * must go (a begin's pool, a detected capture's pool, or the usual memory):
 * after every step each pool's figures equal the sums over the blocks
 * routed to it. A free that a capture must defer is remembered until its
 * streams leave their captures: no block handed out meanwhile may overlap
 * it. A restore must give exactly the delta the model expects (blocks of
 * the pool not in the checkpoint released, the checkpoint's freed blocks
 * restored, the others kept with their data); released blocks leave the
 * model, restored ones join it with a new pattern. Refusals are checked
 * against the pool's state (captures in progress, deferred frees, users
 * left). Pinned memory and growable buffers order their frees with events,
 * which a capture would take into its graph, so their calls stay off
 * captured streams; so do frees in captures the allocator does not watch
 * (no begin, no capture_detection), which only a caller's mistake makes.
 *
 * Adding an operation:
 * write `static void op_name(world *w)`, which reads its arguments with
 * fz_byte/fz_pick/pick_size, calls the API between begin() and the checks
 * of its outcome (expect_failure, or FZ_CHECK), and keeps the model (slots,
 * streams) in step; then add a row {"name", weight, op_name} to `ops`.
 * Weights are relative; the table's total must stay below 256. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"
#include "tidalloc_testing.h"

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)
#define MAX_ALLOC ((size_t)1 << 52) /* larger sizes are refused as invalid */
#define SLOTS 32
#define STREAMS 4 /* [0] is the default stream */
#define RING 8
#define MAX_STEPS 192
#define HISTORY 16
#define BUFS 4 /* growable buffers alive at once */
/* tide_check walks every block, bin and page table: after every step it was
 * half of an execution's time in the target. A corruption stays until the
 * next check, and the steps where the backend fails are checked at once. */
#define CHECK_EVERY 4

typedef enum stream_kind { LIVE, DEAD, BOGUS } stream_kind;

#define RECORDED 6  /* streams recorded on one block that the model follows */
#define POOLS 4     /* capture pools known at once */
#define BEGINS 4    /* tide_capture_begin in progress */
#define CKPTS 3     /* checkpoints kept */
#define DEFERRED 32 /* frees deferred by captures */
#define NEW_POOL (-2)

typedef struct slot {
  bool used, pinned;
  void *ptr;
  size_t requested, size;
  uint64_t seq;
  tide_stream stream;        /* allocated on */
  uint64_t pool;             /* tide_pool_id of its capture pool; 0: the usual memory */
  tide_stream rec[RECORDED]; /* recorded with tide_record_stream (not `stream`) */
  unsigned nrec;
} slot;

/* A capture pool: its users as the model counts them. A pool made by
 * capture_detection serves one capture (`group`) and has one user, the graph. */
typedef struct pool_slot {
  tide_pool *p; /* NULL: none, or gone (its last user released it) */
  uint64_t id;
  int uses;
  uint64_t group;     /* detected: the capture it was made for; 0: tide_pool_create */
  tide_stream origin; /* detected: the stream whose allocation made it */
} pool_slot;

/* A tide_capture_begin in progress: on `stream`, in capture `group` (0: the
 * stream was not being captured, so the stream itself is routed). */
typedef struct begin_rec {
  bool used;
  tide_stream stream;
  uint64_t group;
  int pool; /* index in pools (a begin holds a user, so the pool lives) */
} begin_rec;

/* The allocated blocks of a pool at a checkpoint. */
typedef struct ckpt_rec {
  tide_checkpoint *k; /* NULL: free */
  uint64_t pool;      /* the pool's id */
  struct ck_block {
    uintptr_t addr;
    size_t size, requested;
    tide_stream stream;
  } blocks[SLOTS];
  unsigned n;
} ckpt_rec;

/* A free that a capture defers: nobody may be given the block while one of
 * the streams it waits for is captured. */
typedef struct deferred_rec {
  bool used;
  uintptr_t addr;
  size_t size;
  uint64_t pool;
  tide_stream on[RECORDED + 1];
  unsigned n;
} deferred_rec;

typedef struct world {
  fz_reader in;
  tide_allocator *a;
  tide_allocator *other; /* device 1, for pointers of another device */
  void *other_block;
  char conf[384];
  size_t capacity;
  size_t granularity; /* host_granularity, the page of growable buffers */
  slot slots[SLOTS];
  tide_stream streams[STREAMS];
  bool exists[STREAMS];
  tide_stream held[RING]; /* held streams, destroyed ones too */
  size_t nheld;
  tide_stream dead[RING]; /* destroyed streams, the last RING of ndead */
  size_t ndead;
  uintptr_t freed[RING]; /* device pointers freed lately */
  size_t nfreed;
  struct buf_slot {
    tide_buf *b; /* NULL: free */
    size_t length, capacity;
    bool ring;
    uint8_t seed;
    size_t mark; /* a byte written with seed + 1 (SIZE_MAX: none) */
    bool first;  /* byte 0 holds seed */
    tide_stream stream;
  } bufs[BUFS];
  bool detection;          /* capture_detection is on */
  uint64_t group[STREAMS]; /* the emulated capture each stream is in (0: none) */
  uint64_t next_group;
  pool_slot pools[POOLS];
  begin_rec begins[BEGINS];
  ckpt_rec ckpts[CKPTS];
  deferred_rec deferred[DEFERRED];
  /* Deferred frees whose streams all left their captures: the allocator
   * completes them at its next look (a capture's end, a free, a restore),
   * and keeps them deferred if a stream is captured again by then. */
  deferred_rec ended[DEFERRED];
  unsigned nended;                  /* written so far (a ring) */
  bool deferred_lost;               /* a deferred free the model could not keep */
  uint64_t fault_at[TIDE_OP_COUNT]; /* the call of each op armed to fail; 0: none */
  uint64_t calls_before[TIDE_OP_COUNT];
  uint64_t next_seq;
  unsigned step;
  const char *history[HISTORY];
  char what[160]; /* the current call, for messages */
  bool failed;    /* an injected fault fired in this step */
  bool ending;    /* finish(): the last check */
} world;

static world *current; /* for fail() */

__attribute__((noreturn, format(printf, 1, 2))) static void fail(const char *fmt, ...) {
  char text[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(text, sizeof text, fmt, ap);
  va_end(ap);
  world *w = current;
  fprintf(stderr, "config \"%s\", step %u, %s\nlast steps:", w->conf, w->step, w->what);
  for (unsigned i = w->step > HISTORY ? w->step - HISTORY : 0; i < w->step; i++)
    fprintf(stderr, " %s", w->history[i % HISTORY]);
  fprintf(stderr, "\n");
  fz_die("%s", text);
}

#define CHECK(cond, ...)                                                                           \
  do {                                                                                             \
    if (!(cond)) fail(__VA_ARGS__);                                                                \
  } while (0)

/* ------------------------------------------------------------------------ */
/* Data patterns                                                             */
/* ------------------------------------------------------------------------ */

FZ_CHECK_ONLY static uint8_t pattern_byte(uintptr_t base, uint64_t seq, size_t off) {
  uint64_t x = (uint64_t)base ^ (seq * UINT64_C(0xD1B54A32D192ED03)) ^ ((uint64_t)(off / 8) << 17);
  x += UINT64_C(0x9E3779B97F4A7C15);
  x = (x ^ (x >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
  x = (x ^ (x >> 27)) * UINT64_C(0x94D049BB133111EB);
  x ^= x >> 31;
  return (uint8_t)(x >> ((off % 8) * 8));
}

/* The bytes a pattern covers: all of a small block; of a larger one its
 * first and last 64 bytes and a few in between. Returns false at a byte that
 * lost its value (with `write`, writes them). */
FZ_CHECK_ONLY static bool pattern(const slot *s, bool write, bool edges_only, size_t *bad) {
  uint8_t *p = s->ptr;
  size_t n = s->requested, edge = n < 64 ? n : 64;
  size_t offsets[4] = {n / 3, n / 2, (2 * n) / 3, n - n / 7 - 1};
  for (size_t k = 0; k < edge; k++) {
    size_t offs[2] = {k, n - 1 - k};
    for (int j = 0; j < 2; j++) {
      uint8_t want = pattern_byte((uintptr_t)p, s->seq, offs[j]);
      if (write)
        p[offs[j]] = want;
      else if (p[offs[j]] != want)
        return *bad = offs[j], false;
    }
    if (edges_only && k >= 7) break;
  }
  for (int j = 0; j < 4 && !edges_only && n > 128; j++) {
    uint8_t want = pattern_byte((uintptr_t)p, s->seq, offsets[j]);
    if (write)
      p[offsets[j]] = want;
    else if (p[offsets[j]] != want)
      return *bad = offsets[j], false;
  }
  return true;
}

FZ_CHECK_ONLY static void fill(slot *s) {
  size_t bad;
  pattern(s, true, false, &bad);
}

FZ_CHECK_ONLY static void expect_intact(const slot *s, bool edges_only) {
  size_t bad = 0;
  CHECK(pattern(s, false, edges_only, &bad),
        "%s block %p (%zu bytes, seq %llu) lost its data at "
        "offset %zu",
        s->pinned ? "pinned" : "device", s->ptr, s->requested, (unsigned long long)s->seq, bad);
}

/* ------------------------------------------------------------------------ */
/* Steps and their outcomes                                                  */
/* ------------------------------------------------------------------------ */

FZ_CHECK_ONLY static void begin(world *w, const char *what) {
  snprintf(w->what, sizeof w->what, "%s", what);
  for (int op = 0; op < TIDE_OP_COUNT; op++) /* fault_fired looks at armed ones only */
    if (w->fault_at[op]) w->calls_before[op] = tide_host_call_count(w->a, (tide_backend_op)op);
  tide_clear_error();
}

/* Whether an armed fault fired during the current call. */
FZ_CHECK_ONLY static bool fault_fired(const world *w) {
  for (int op = 0; op < TIDE_OP_COUNT; op++) {
    uint64_t at = w->fault_at[op];
    if (at && w->calls_before[op] < at && tide_host_call_count(w->a, (tide_backend_op)op) >= at)
      return true;
  }
  return false;
}

#define ST(s) (1u << (s))

/* A call failed with `st`: it must be one of `allowed` (a mask of ST()),
 * or a backend failure, a wait on a held stream or a lack of memory caused
 * by an injected fault that fired in this call; and it has a message. */
FZ_CHECK_ONLY static void expect_failure(world *w, tide_status st, unsigned allowed) {
  const char *msg = tide_last_error();
  CHECK(st != TIDE_OK, "%s succeeded, expected a failure", w->what);
  CHECK(msg && *msg, "%s failed with %s and no message", w->what, tide_status_name(st));
  CHECK(tide_last_status() == st, "%s returned %s, the thread's last status is %s", w->what,
        tide_status_name(st), tide_status_name(tide_last_status()));
  bool fired = fault_fired(w);
  unsigned by_fault = ST(TIDE_ERR_BACKEND) | ST(TIDE_ERR_NOT_READY) | ST(TIDE_ERR_OOM);
  CHECK((allowed & ST(st)) || (fired && (by_fault & ST(st))), "%s failed with %s%s: %s", w->what,
        tide_status_name(st), fired ? " (a fault fired)" : "", msg);
  if (st == TIDE_ERR_BACKEND && !(allowed & ST(st)))
    CHECK(strstr(msg, "injected failure"), "%s: a backend failure that is not the injected one: %s",
          w->what, msg);
}

FZ_CHECK_ONLY static void expect_ok(world *w, tide_status st, unsigned allowed) {
  if (st != TIDE_OK) expect_failure(w, st, allowed);
}

/* ------------------------------------------------------------------------ */
/* The model: slots and streams                                              */
/* ------------------------------------------------------------------------ */

static slot *free_slot(world *w) {
  for (int i = 0; i < SLOTS; i++)
    if (!w->slots[i].used) return &w->slots[i];
  return NULL;
}

/* A used slot of the kind asked for, or NULL. */
static slot *pick_used(world *w, bool pinned) {
  unsigned n = 0;
  for (int i = 0; i < SLOTS; i++) n += w->slots[i].used && w->slots[i].pinned == pinned;
  if (n == 0) return NULL;
  unsigned k = fz_pick(&w->in, n);
  for (int i = 0; i < SLOTS; i++)
    if (w->slots[i].used && w->slots[i].pinned == pinned && k-- == 0) return &w->slots[i];
  return NULL;
}

/* The live device block holding addr, or NULL. */
static slot *device_slot_at(world *w, uintptr_t addr) {
  for (int i = 0; i < SLOTS; i++) {
    slot *s = &w->slots[i];
    if (s->used && !s->pinned && addr >= (uintptr_t)s->ptr && addr < (uintptr_t)s->ptr + s->size)
      return s;
  }
  return NULL;
}

static bool is_dead(const world *w, tide_stream s) {
  for (size_t i = 0; i < w->ndead && i < RING; i++)
    if (w->dead[i] == s) return true;
  return false;
}

static bool is_held(const world *w, tide_stream s) {
  for (size_t i = 0; i < w->nheld; i++)
    if (w->held[i] == s) return true;
  return false;
}

/* Captures, as the model sees them (the emulated ones of the host backend,
 * and the begins of the allocator). */

static int stream_index(const world *w, tide_stream s) {
  for (int i = 0; i < STREAMS; i++)
    if (w->exists[i] && w->streams[i] == s) return i;
  return -1;
}

/* The capture a stream is in; 0: none (also for destroyed or made-up ones). */
static uint64_t group_of(const world *w, tide_stream s) {
  int i = stream_index(w, s);
  return i > 0 ? w->group[i] : 0;
}

static bool captured(const world *w, tide_stream s) { return group_of(w, s) != 0; }

static bool any_captured(const world *w) {
  for (int i = 1; i < STREAMS; i++)
    if (w->exists[i] && w->group[i]) return true;
  return false;
}

/* Whether a tide_capture_begin is in force: the allocator then takes a
 * capture to be under way, and gives a released pool's memory back only
 * after it (waiting for the whole device would invalidate the capture). */
static bool any_begun(const world *w) {
  for (int b = 0; b < BEGINS; b++)
    if (w->begins[b].used) return true;
  return false;
}

/* Whether the capture a detected pool was made for still allocates to it:
 * the allocator follows it through the stream that made the pool, until
 * that stream leaves the capture (the capture ends) or is destroyed. */
static bool detected_live(const world *w, int i) {
  return w->pools[i].p && w->pools[i].group && group_of(w, w->pools[i].origin) == w->pools[i].group;
}

/* The captures that allocate to pool i: its begins in progress, and the
 * capture a detected pool was made for while it lasts. */
static int pool_captures(const world *w, int i) {
  int n = detected_live(w, i);
  for (int b = 0; b < BEGINS; b++) n += w->begins[b].used && w->begins[b].pool == i;
  return n;
}

static int free_pool(const world *w) {
  for (int i = 0; i < POOLS; i++)
    if (!w->pools[i].p) return i;
  return -1;
}

static int pick_pool(world *w) {
  unsigned k = fz_pick(&w->in, POOLS);
  for (unsigned j = 0; j < POOLS; j++)
    if (w->pools[(k + j) % POOLS].p) return (int)((k + j) % POOLS);
  return -1;
}

/* Where an allocation on live stream s goes (pool.c documents it): the
 * pool of a begin on s made outside a capture; else, when captures are
 * routed, the pool of s's capture, or a new one made by capture_detection
 * (NEW_POOL); else the usual memory (-1). */
static int route(const world *w, tide_stream s) {
  bool routes = w->detection;
  for (int b = 0; b < BEGINS; b++) {
    const begin_rec *r = &w->begins[b];
    if (r->used && r->stream == s && !r->group) return r->pool;
    routes |= r->used && r->group;
  }
  uint64_t g = group_of(w, s);
  if (!routes || !g) return -1;
  for (int b = 0; b < BEGINS; b++)
    if (w->begins[b].used && w->begins[b].group == g) return w->begins[b].pool;
  for (int i = 0; i < POOLS; i++)
    if (detected_live(w, i) && w->pools[i].group == g) return i;
  return w->detection ? NEW_POOL : -1;
}

/* Whether freeing s on `stream` is deferred by a capture: a stream it
 * involves is captured (the freeing one, for the usual memory or when it
 * is not the pool block's own stream; every recorded one). */
static bool defers(const world *w, const slot *s, tide_stream stream) {
  if ((!s->pool || stream != s->stream) && captured(w, stream)) return true;
  for (unsigned i = 0; i < s->nrec; i++)
    if (captured(w, s->rec[i])) return true;
  return false;
}

/* Whether the allocator looks at captures in frees: only while a begin is
 * in progress, capture_detection is on, or a free is deferred (the fast
 * paths test one flag). A capture nobody declared is not seen otherwise:
 * a free would record an event into its graph, which is the caller's
 * mistake, so the fuzzer makes no such free. */
static bool watched(const world *w) {
  if (w->detection || w->deferred_lost) return true;
  for (int i = 0; i < BEGINS; i++)
    if (w->begins[i].used) return true;
  for (int i = 0; i < DEFERRED; i++)
    if (w->deferred[i].used) return true;
  return false;
}

static void remember_deferred(world *w, const slot *s, tide_stream stream) {
  deferred_rec *d = NULL;
  for (int i = 0; i < DEFERRED && !d; i++)
    if (!w->deferred[i].used) d = &w->deferred[i];
  if (!d) {
    w->deferred_lost = true;
    return;
  }
  *d = (deferred_rec){.used = true, .addr = (uintptr_t)s->ptr, .size = s->size, .pool = s->pool};
  d->on[d->n++] = stream;
  for (unsigned i = 0; i < s->nrec; i++) d->on[d->n++] = s->rec[i];
}

/* Deferred frees whose streams are all out of captures are no longer
 * deferred (they may still wait on events). */
FZ_CHECK_ONLY static void settle_deferred(world *w) {
  for (int i = 0; i < DEFERRED; i++) {
    deferred_rec *d = &w->deferred[i];
    bool still = false;
    for (unsigned j = 0; d->used && j < d->n; j++) still |= captured(w, d->on[j]);
    if (d->used && !still) {
      w->ended[w->nended++ % DEFERRED] = *d;
      d->used = false;
    }
  }
  if (w->deferred_lost && !any_captured(w)) w->deferred_lost = false;
}

FZ_CHECK_ONLY static bool pool_deferred(const world *w, uint64_t pool) {
  for (int i = 0; i < DEFERRED; i++)
    if (w->deferred[i].used && w->deferred[i].pool == pool) return true;
  for (int i = 0; i < DEFERRED; i++) {
    const deferred_rec *d = &w->ended[i];
    for (unsigned j = 0; d->used && d->pool == pool && j < d->n; j++)
      if (captured(w, d->on[j])) return true;
  }
  return w->deferred_lost;
}

/* A stream to use: mostly a live one, sometimes a destroyed or made-up one. */
static tide_stream pick_stream(world *w, stream_kind *kind) {
  unsigned c = fz_pick(&w->in, 16);
  *kind = LIVE;
  if (c == 14 && w->ndead) {
    *kind = DEAD;
    return w->dead[fz_pick(&w->in, (unsigned)(w->ndead < RING ? w->ndead : RING))];
  }
  if (c == 15) {
    *kind = BOGUS;
    return (tide_stream)(uintptr_t)(0x5eed0000u + fz_byte(&w->in));
  }
  unsigned i = c % STREAMS;
  return w->exists[i] ? w->streams[i] : NULL;
}

static size_t pick_size(world *w) {
  static const size_t favorites[] = {512,     4096,    1000,     1 * MiB,
                                     2 * MiB, 3 * MiB, 20 * MiB, 300 * KiB};
  switch (fz_pick(&w->in, 16)) {
  case 0: return 0;
  case 1: {
    const size_t huge[] = {w->capacity + 1, w->capacity * 4, (size_t)1 << 40, MAX_ALLOC,
                           MAX_ALLOC + 1,   SIZE_MAX,        SIZE_MAX - 511};
    return huge[fz_pick(&w->in, sizeof huge / sizeof huge[0])];
  }
  case 2:
  case 3:
  case 4:
  case 5: return favorites[fz_pick(&w->in, sizeof favorites / sizeof favorites[0])];
  case 6:
  case 7:
  case 8:
  case 9: return 1 + (size_t)fz_u16(&w->in) * 16; /* up to 1 MiB */
  case 10:
  case 11:
  case 12: return MiB + (size_t)fz_u16(&w->in) * 512; /* up to 33 MiB */
  case 13: return 2 * MiB * (1 + fz_pick(&w->in, 8)) + 512 * (fz_pick(&w->in, 5) - 2u);
  default: {
    slot *s = pick_used(w, false); /* a size a live block has: exact reuse */
    return s ? (fz_byte(&w->in) & 1 ? s->requested : s->size) : 4096;
  }
  }
}

static void remember_freed(world *w, void *p) { w->freed[w->nfreed++ % RING] = (uintptr_t)p; }

/* ------------------------------------------------------------------------ */
/* Device memory                                                             */
/* ------------------------------------------------------------------------ */

/* A block handed out overlaps no live block and no block whose free a
 * capture defers. */
FZ_CHECK_ONLY static void expect_apart(const world *w, void *p, size_t bsize) {
  for (int i = 0; i < SLOTS; i++) {
    const slot *o = &w->slots[i];
    if (o->used && !o->pinned)
      CHECK(
          (uintptr_t)p + bsize <= (uintptr_t)o->ptr || (uintptr_t)o->ptr + o->size <= (uintptr_t)p,
          "%s: block %p (+%zu) overlaps live block %p (+%zu)", w->what, p, bsize, o->ptr, o->size);
  }
  for (int i = 0; i < DEFERRED; i++) {
    const deferred_rec *d = &w->deferred[i];
    if (d->used)
      CHECK((uintptr_t)p + bsize <= d->addr || d->addr + d->size <= (uintptr_t)p,
            "%s: block %p (+%zu) overlaps block %p (+%zu), whose free waits for a capture to end",
            w->what, p, bsize, (void *)d->addr, d->size);
  }
}

/* A block handed out (by tide_malloc, or again by a restore): where it is,
 * that it overlaps no live block and no block whose free a capture defers,
 * and its pattern. */
static void take_block(world *w, slot *s, void *p, size_t size, tide_stream stream, uint64_t pool) {
  CHECK((uintptr_t)p % 512 == 0, "%s returned %p, not 512-byte aligned", w->what, p);
  void *base = NULL;
  size_t bsize = 0;
  tide_stream bstream = (tide_stream)(uintptr_t)1;
  tide_status rc = tide_block_info(w->a, p, &base, &bsize, &bstream);
  CHECK(rc == TIDE_OK && base == p && bsize >= size && bsize % 512 == 0 && bstream == stream,
        "%s: block %p: tide_block_info says %s, base %p, size %zu, stream %p: %s", w->what, p,
        tide_status_name(rc), base, bsize, (void *)bstream, tide_last_error());
  expect_apart(w, p, bsize);
  *s = (slot){.used = true,
              .ptr = p,
              .requested = size,
              .size = bsize,
              .seq = ++w->next_seq,
              .stream = stream,
              .pool = pool};
  fill(s);
}

static void learn_detected(world *w, tide_stream stream);

static void op_malloc(world *w) {
  stream_kind kind;
  tide_stream stream = pick_stream(w, &kind);
  size_t size = pick_size(w);
  slot *s = free_slot(w);
  if (!s) return;
  int to = kind == LIVE ? route(w, stream) : -1;
  if (to == NEW_POOL && free_pool(w) < 0) return; /* no room for the pool it would make */
  char what[96];
  snprintf(what, sizeof what, "tide_malloc(%zu) on %s stream %p", size,
           kind == LIVE   ? "live"
           : kind == DEAD ? "destroyed"
                          : "unknown",
           (void *)stream);
  begin(w, what);
  void *p = tide_malloc(w->a, size, stream);
  if (!p) {
    tide_status st = tide_last_status();
    if (size == 0 || size > MAX_ALLOC || kind != LIVE) {
      expect_failure(w, st, ST(TIDE_ERR_INVALID));
    } else {
      expect_failure(w, st, ST(TIDE_ERR_OOM));
      if (st == TIDE_ERR_OOM)
        CHECK(strstr(tide_last_error(), "out of memory") ||
                  strstr(tide_last_error(), "injected failure"),
              "%s: TIDE_ERR_OOM without \"out of memory\": %s", w->what, tide_last_error());
    }
  } else {
    CHECK(size > 0 && size <= MAX_ALLOC && kind == LIVE, "%s returned %p", w->what, p);
  }
  if (to == NEW_POOL) { /* the capture's new pool, made by this call or made now */
    learn_detected(w, stream);
    to = route(w, stream);
    CHECK(to >= 0, "%s: capture_detection made no pool", w->what);
  }
  if (p) take_block(w, s, p, size, stream, to >= 0 ? w->pools[to].id : 0);
}

/* Free the block of slot s on `stream`, checking its data first. */
static void free_block(world *w, slot *s, tide_stream stream, stream_kind kind, bool sized,
                       size_t size) {
  if (defers(w, s, stream) && !watched(w)) return; /* in a capture the allocator does not see */
  expect_intact(s, false);
  char what[128];
  snprintf(what, sizeof what, "tide_free%s(%p, %zu of %zu bytes) on %s stream %p (allocated on %p)",
           sized ? "_sized" : "", s->ptr, size, s->requested,
           kind == LIVE   ? "live"
           : kind == DEAD ? "destroyed"
                          : "unknown",
           (void *)stream, (void *)s->stream);
  begin(w, what);
  tide_status rc =
      sized ? tide_free_sized(w->a, s->ptr, size, stream) : tide_free(w->a, s->ptr, stream);
  bool wrong_size = sized && size != s->requested;
  bool bad_stream = kind != LIVE && stream != s->stream;
  if (rc == TIDE_OK) {
    CHECK(!wrong_size && !bad_stream, "%s succeeded", w->what);
    if (defers(w, s, stream)) remember_deferred(w, s, stream);
    remember_freed(w, s->ptr);
    s->used = false;
    return;
  }
  /* A stream that cannot take an event (destroyed, or made up and recorded)
   * is waited for instead, or the default stream in its place: held, that
   * wait cannot end. */
  unsigned allowed = (wrong_size || bad_stream) ? ST(TIDE_ERR_INVALID) : 0;
  if (w->nheld) allowed |= ST(TIDE_ERR_NOT_READY);
  expect_failure(w, rc, allowed);
  if (wrong_size || bad_stream)
    CHECK(strstr(tide_last_error(), wrong_size ? "nothing was freed" : "still allocated"), "%s: %s",
          w->what, tide_last_error());
  /* Refused: still allocated, where it was, with its data. */
  void *base = NULL;
  size_t bsize = 0;
  CHECK(tide_block_info(w->a, s->ptr, &base, &bsize, NULL) == TIDE_OK && base == s->ptr &&
            bsize == s->size,
        "%s failed, and the block is no longer allocated as it was: %s", w->what,
        tide_last_error());
  expect_intact(s, false);
}

static void op_free(world *w) {
  slot *s = pick_used(w, false);
  if (!s) return;
  stream_kind kind = LIVE;
  tide_stream stream = s->stream;
  unsigned mode = fz_pick(&w->in, 8);
  if (mode == 5) stream = NULL;
  if (mode == 6 || mode == 7) stream = pick_stream(w, &kind);
  if (stream == s->stream) kind = is_dead(w, stream) ? DEAD : LIVE;
  free_block(w, s, stream, kind, false, 0);
}

static void op_free_sized(world *w) {
  slot *s = pick_used(w, false);
  if (!s) return;
  const size_t sizes[] = {s->requested,     s->requested, s->requested + 1,
                          s->requested - 1, s->size,      0};
  size_t size = sizes[fz_pick(&w->in, sizeof sizes / sizeof sizes[0])];
  free_block(w, s, s->stream, is_dead(w, s->stream) ? DEAD : LIVE, true, size);
}

/* A pointer that is no live block's start: the error depends on where it
 * points. `pinned_ok`: pinned memory is "not allocated" too. */
static void expect_not_a_block(world *w, uintptr_t addr, tide_status rc, const char *needle) {
  slot *inside = device_slot_at(w, addr);
  if (inside) {
    expect_failure(w, rc, ST(TIDE_ERR_BAD_POINTER));
    CHECK(strstr(tide_last_error(), "not the start of a block"), "%s: %s", w->what,
          tide_last_error());
  } else {
    expect_failure(w, rc, ST(TIDE_ERR_BAD_POINTER) | ST(TIDE_ERR_DOUBLE_FREE));
    if (needle) CHECK(strstr(tide_last_error(), needle), "%s: %s", w->what, tide_last_error());
  }
}

/* Free, sized free, record and block info of a pointer that is not a live
 * block's start; nothing may change. */
static void bad_pointer_calls(world *w, uintptr_t addr, const char *kind, const char *needle) {
  tide_stream side = w->exists[1] ? w->streams[1] : NULL;
  char what[96];
  snprintf(what, sizeof what, "tide_free(%s %#lx)", kind, (unsigned long)addr);
  begin(w, what);
  expect_not_a_block(w, addr, tide_free(w->a, (void *)addr, NULL), needle);
  begin(w, what);
  expect_not_a_block(w, addr, tide_free(w->a, (void *)addr, side), needle);
  snprintf(what, sizeof what, "tide_free_sized(%s %#lx)", kind, (unsigned long)addr);
  begin(w, what);
  expect_not_a_block(w, addr, tide_free_sized(w->a, (void *)addr, 4096, NULL), needle);
  snprintf(what, sizeof what, "tide_record_stream(%s %#lx)", kind, (unsigned long)addr);
  begin(w, what);
  expect_not_a_block(w, addr, tide_record_stream(w->a, (void *)addr, side), NULL);
  snprintf(what, sizeof what, "tide_block_info(%s %#lx)", kind, (unsigned long)addr);
  begin(w, what);
  void *base = NULL;
  tide_status rc = tide_block_info(w->a, (void *)addr, &base, NULL, NULL);
  slot *inside = device_slot_at(w, addr);
  if (inside)
    CHECK(rc == TIDE_OK && base == inside->ptr, "%s: %s, base %p, the block is %p", w->what,
          tide_status_name(rc), base, inside->ptr);
  else
    expect_failure(w, rc, ST(TIDE_ERR_BAD_POINTER) | ST(TIDE_ERR_DOUBLE_FREE));
}

static void op_double_free(world *w) {
  if (!w->nfreed) return;
  uintptr_t addr = w->freed[fz_pick(&w->in, (unsigned)(w->nfreed < RING ? w->nfreed : RING))];
  slot *s = device_slot_at(w, addr);
  if (s && (uintptr_t)s->ptr == addr) return; /* handed out again: a valid free */
  bad_pointer_calls(w, addr, "freed", NULL);
}

static void op_interior(world *w) {
  slot *s = pick_used(w, false);
  if (!s || s->size < 2) return;
  size_t off = 1 + (size_t)fz_u32(&w->in) % (s->size - 1);
  bad_pointer_calls(w, (uintptr_t)s->ptr + off, "interior", NULL);
}

static void op_unknown(world *w) {
  int on_stack = 0;
  uintptr_t addr = 0;
  const char *needle = "not allocated";
  void *heap = NULL;
  switch (fz_pick(&w->in, 6)) {
  case 0: addr = (uintptr_t)&on_stack; break;
  case 1:
    heap = malloc(64);
    addr = (uintptr_t)heap;
    break;
  case 2: addr = (uintptr_t)1 + 511u * fz_byte(&w->in); break;
  case 3: { /* a block of another device's allocator */
    if (!w->other) {
      tide_config *c = NULL;
      CHECK(tide_config_new(&c) == TIDE_OK && tide_config_parse(c, w->conf) == TIDE_OK,
            "config: %s", tide_last_error());
      CHECK(tide_create(1, c, &w->other) == TIDE_OK, "tide_create(1): %s", tide_last_error());
      tide_config_free(c);
      w->other_block = tide_malloc(w->other, 4096, NULL);
      CHECK(w->other_block, "tide_malloc on device 1: %s", tide_last_error());
    }
    addr = (uintptr_t)w->other_block;
    needle = "not allocated by this";
    break;
  }
  case 4: { /* pinned memory is no device block */
    slot *s = pick_used(w, true);
    if (!s) return;
    addr = (uintptr_t)s->ptr;
    break;
  }
  default: { /* past a live block: free memory, another block, or nothing */
    slot *s = pick_used(w, false);
    if (!s) return;
    addr = (uintptr_t)s->ptr + s->size + 512u * fz_byte(&w->in);
    slot *t = device_slot_at(w, addr);
    if (t && (uintptr_t)t->ptr == addr) return; /* a live block's start */
    needle = NULL;
    break;
  }
  }
  bad_pointer_calls(w, addr, "unknown", needle);
  free(heap);
}

static void op_record(world *w) {
  slot *s = pick_used(w, false);
  if (!s) return;
  stream_kind kind;
  tide_stream stream = pick_stream(w, &kind);
  bool known = stream == s->stream;
  for (unsigned i = 0; i < s->nrec; i++) known |= s->rec[i] == stream;
  if (!known && s->nrec == RECORDED) return; /* more than the model follows */
  begin(w, "tide_record_stream");
  /* Any stream may be recorded: one gone by the free is waited for instead. */
  tide_status rc = tide_record_stream(w->a, s->ptr, stream);
  expect_ok(w, rc, 0);
  if (rc == TIDE_OK && !known) s->rec[s->nrec++] = stream;
}

static void op_block_info(world *w) {
  slot *s = pick_used(w, false);
  if (!s) return;
  size_t off = (size_t)fz_u32(&w->in) % s->size;
  begin(w, "tide_block_info(inside a block)");
  void *base = NULL;
  size_t size = 0;
  tide_stream stream = (tide_stream)(uintptr_t)1;
  tide_status rc = tide_block_info(w->a, (char *)s->ptr + off, &base, &size, &stream);
  CHECK(rc == TIDE_OK && base == s->ptr && size == s->size && stream == s->stream,
        "%s +%zu: %s, base %p size %zu stream %p; the block is %p, %zu bytes, stream %p", w->what,
        off, tide_status_name(rc), base, size, (void *)stream, s->ptr, s->size, (void *)s->stream);
}

/* ------------------------------------------------------------------------ */
/* Streams                                                                   */
/* ------------------------------------------------------------------------ */

static void op_stream_create(world *w) {
  unsigned i = 1 + fz_pick(&w->in, STREAMS - 1);
  if (w->exists[i]) return;
  begin(w, "tide_stream_create");
  tide_stream s = NULL;
  tide_status rc = tide_stream_create(w->a, &s);
  expect_ok(w, rc, 0);
  if (rc == TIDE_OK) {
    CHECK(s != NULL, "tide_stream_create gave the default stream");
    w->streams[i] = s;
    w->exists[i] = true;
  }
}

static void op_stream_destroy(world *w) {
  unsigned i = fz_pick(&w->in, STREAMS);
  if (i == 0) {
    begin(w, "tide_stream_destroy(default stream)");
    expect_failure(w, tide_stream_destroy(w->a, NULL), ST(TIDE_ERR_INVALID));
    return;
  }
  if (!w->exists[i]) {
    if (!w->ndead) return;
    begin(w, "tide_stream_destroy(destroyed stream)");
    tide_stream dead = w->dead[fz_pick(&w->in, (unsigned)(w->ndead < RING ? w->ndead : RING))];
    expect_failure(w, tide_stream_destroy(w->a, dead), ST(TIDE_ERR_INVALID));
    return;
  }
  begin(w, "tide_stream_destroy");
  tide_status rc = tide_stream_destroy(w->a, w->streams[i]);
  expect_ok(w, rc, 0);
  if (rc == TIDE_OK) {
    w->exists[i] = false;
    w->group[i] = 0;
    w->dead[w->ndead++ % RING] = w->streams[i];
  }
}

static void op_hold(world *w) {
  stream_kind kind;
  tide_stream s = pick_stream(w, &kind);
  if (kind != LIVE || is_held(w, s) || w->nheld == RING) return;
  begin(w, "tide_host_stream_hold");
  expect_ok(w, tide_host_stream_hold(w->a, s), 0);
  w->held[w->nheld++] = s;
}

static void op_release(world *w) {
  if (!w->nheld) return;
  size_t i = fz_pick(&w->in, (unsigned)w->nheld);
  begin(w, "tide_host_stream_release");
  expect_ok(w, tide_host_stream_release(w->a, w->held[i]), 0);
  w->held[i] = w->held[--w->nheld];
}

static void op_synchronize(world *w) {
  stream_kind kind;
  tide_stream s = pick_stream(w, &kind);
  begin(w, "tide_stream_synchronize");
  tide_status rc = tide_stream_synchronize(w->a, s);
  if (kind != LIVE)
    expect_failure(w, rc, ST(TIDE_ERR_INVALID) | (is_held(w, s) ? ST(TIDE_ERR_NOT_READY) : 0));
  else if (captured(w, s))
    expect_failure(w, rc, ST(TIDE_ERR_NOT_READY));
  else
    expect_ok(w, rc, is_held(w, s) ? ST(TIDE_ERR_NOT_READY) : 0);
}

/* ------------------------------------------------------------------------ */
/* The cache, limits and faults                                              */
/* ------------------------------------------------------------------------ */

static void op_empty_cache(world *w) {
  begin(w, "tide_empty_cache");
  tide_status rc = tide_empty_cache(w->a);
  /* Returning a stream's cached pages waits for it: not while it is held or
   * captured. A released pool's waits for the whole device: not while a
   * capture is begun either. */
  expect_ok(w, rc, w->nheld || any_captured(w) || any_begun(w) ? ST(TIDE_ERR_NOT_READY) : 0);
  if (rc == TIDE_ERR_NOT_READY && !fault_fired(w))
    CHECK(strstr(tide_last_error(), "held") || strstr(tide_last_error(), "captured"), "%s: %s",
          w->what, tide_last_error());
}

static void op_limit(world *w) {
  switch (fz_pick(&w->in, 4)) {
  case 0: {
    const size_t limits[] = {0, w->capacity / 4, w->capacity / 2, 8 * MiB, 4096, SIZE_MAX};
    begin(w, "tide_set_memory_limit");
    expect_ok(w, tide_set_memory_limit(w->a, limits[fz_pick(&w->in, 6)]), 0);
    break;
  }
  case 1: {
    const double fractions[] = {1.0, 0.5, 0.125, 0.999};
    begin(w, "tide_set_memory_fraction");
    expect_ok(w, tide_set_memory_fraction(w->a, fractions[fz_pick(&w->in, 4)]), 0);
    break;
  }
  case 2: {
    const double bad[] = {0.0, -1.0, 1.5, NAN, INFINITY};
    begin(w, "tide_set_memory_fraction(bad)");
    expect_failure(w, tide_set_memory_fraction(w->a, bad[fz_pick(&w->in, 5)]),
                   ST(TIDE_ERR_INVALID));
    break;
  }
  default:
    begin(w, "tide_set_memory_limit(0)");
    expect_ok(w, tide_set_memory_limit(w->a, 0), 0);
    expect_ok(w, tide_set_memory_fraction(w->a, 1.0), 0);
  }
}

static void op_fault(world *w) {
  static const tide_backend_op faultable[] = {
      TIDE_OP_ANY,
      TIDE_OP_RESERVE,
      TIDE_OP_UNRESERVE,
      TIDE_OP_CREATE,
      TIDE_OP_RELEASE,
      TIDE_OP_MAP,
      TIDE_OP_SET_ACCESS,
      TIDE_OP_UNMAP,
      TIDE_OP_STREAM_CREATE,
      TIDE_OP_STREAM_DESTROY,
      TIDE_OP_STREAM_SYNCHRONIZE,
      TIDE_OP_EVENT_CREATE,
      TIDE_OP_EVENT_RECORD,
      TIDE_OP_EVENT_QUERY,
      TIDE_OP_EVENT_SYNCHRONIZE,
      TIDE_OP_MEM_INFO,
      TIDE_OP_HOST_ALLOC,
      TIDE_OP_HOST_FREE,
      TIDE_OP_COPY,
      TIDE_OP_CAPTURE_STATUS,
      TIDE_OP_EVENT_DESTROY,
  };
  tide_backend_op op = faultable[fz_pick(&w->in, sizeof faultable / sizeof faultable[0])];
  uint64_t n = fz_pick(&w->in, 17); /* 0 disarms */
  begin(w, "tide_host_fail_call");
  expect_ok(w, tide_host_fail_call(w->a, op, n), 0);
  w->fault_at[op] = n ? tide_host_call_count(w->a, op) + n : 0;
}

/* ------------------------------------------------------------------------ */
/* Pinned memory, copies, figures                                            */
/* ------------------------------------------------------------------------ */

static void op_pinned_malloc(world *w) {
  stream_kind kind;
  tide_stream stream = pick_stream(w, &kind);
  size_t size = fz_pick(&w->in, 8) == 0 ? 0 : 1 + (size_t)fz_u16(&w->in) * 4;
  slot *s = free_slot(w);
  if (!s) return;
  begin(w, "tide_pinned_malloc");
  void *p = tide_pinned_malloc(w->a, size, stream);
  if (!p) {
    expect_failure(w, tide_last_status(),
                   size == 0 || kind != LIVE ? ST(TIDE_ERR_INVALID) : ST(TIDE_ERR_OOM));
    return;
  }
  CHECK(size > 0 && kind == LIVE && (uintptr_t)p % 4096 == 0, "%s(%zu) returned %p", w->what, size,
        p);
  size_t cls = 4096;
  while (cls < size) cls *= 2;
  *s = (slot){.used = true,
              .pinned = true,
              .ptr = p,
              .requested = size,
              .size = cls,
              .seq = ++w->next_seq,
              .stream = stream};
  fill(s);
}

static void op_pinned_free(world *w) {
  slot *s = pick_used(w, true);
  if (!s) return;
  stream_kind kind = LIVE;
  tide_stream stream = fz_pick(&w->in, 4) ? s->stream : pick_stream(w, &kind);
  if (stream == s->stream) kind = LIVE;
  /* The pinned pool orders frees with events, which a capture would take
   * into its graph: its calls stay off captured streams. */
  bool in_capture = captured(w, stream) || captured(w, s->stream);
  for (unsigned i = 0; i < s->nrec; i++) in_capture |= captured(w, s->rec[i]);
  if (in_capture) return;
  expect_intact(s, false);
  begin(w, "tide_pinned_free");
  tide_status rc = tide_pinned_free(w->a, s->ptr, stream);
  if (rc == TIDE_OK) {
    CHECK(kind == LIVE, "%s on a %s stream succeeded", w->what,
          kind == DEAD ? "destroyed" : "made-up");
    begin(w, "tide_pinned_free, twice");
    expect_failure(w, tide_pinned_free(w->a, s->ptr, s->stream), ST(TIDE_ERR_DOUBLE_FREE));
    begin(w, "tide_free of pinned memory");
    expect_failure(w, tide_free(w->a, s->ptr, NULL), ST(TIDE_ERR_BAD_POINTER));
    s->used = false;
    return;
  }
  /* As for device memory: a stream that cannot take an event is waited for
   * instead, which cannot end while it (or the default stream) is held. */
  expect_failure(
      w, rc, (kind != LIVE ? ST(TIDE_ERR_INVALID) : 0) | (w->nheld ? ST(TIDE_ERR_NOT_READY) : 0));
  expect_intact(s, false);
}

static void op_pinned_record(world *w) {
  slot *s = pick_used(w, true);
  if (!s) return;
  stream_kind kind;
  tide_stream stream = pick_stream(w, &kind);
  bool known = stream == s->stream;
  for (unsigned i = 0; i < s->nrec; i++) known |= s->rec[i] == stream;
  if (!known && s->nrec == RECORDED) return; /* more than the model follows */
  begin(w, "tide_pinned_record_stream");
  tide_status rc = tide_pinned_record_stream(w->a, s->ptr, stream);
  expect_ok(w, rc, kind != LIVE ? ST(TIDE_ERR_INVALID) : 0);
  if (rc == TIDE_OK && !known) s->rec[s->nrec++] = stream;
}

static void op_pinned_empty(world *w) {
  begin(w, "tide_pinned_empty_cache");
  expect_ok(w, tide_pinned_empty_cache(w->a), w->nheld ? ST(TIDE_ERR_NOT_READY) : 0);
}

/* Copies out of a block, and from one block into another (whose pattern is
 * then written again). */
static void op_memcpy(world *w) {
  slot *from = pick_used(w, fz_byte(&w->in) & 1);
  slot *to = pick_used(w, fz_byte(&w->in) & 1);
  if (!from) return;
  size_t n = from->requested < 4096 ? from->requested : 4096;
  if (!to || to == from) {
    unsigned char host[4096];
    begin(w, "tide_memcpy(host <- block)");
    tide_status rc = tide_memcpy(w->a, host, from->ptr, n, NULL);
    expect_ok(w, rc, 0);
    if (rc == TIDE_OK) CHECK(memcmp(host, from->ptr, n) == 0, "%s copied other bytes", w->what);
    if (n > 1) {
      begin(w, "tide_memcpy(overlapping)");
      expect_failure(w, tide_memcpy(w->a, (char *)from->ptr + 1, from->ptr, n - 1, NULL),
                     ST(TIDE_ERR_INVALID));
    }
    return;
  }
  if (to->requested < n) n = to->requested;
  begin(w, "tide_memcpy(block <- block)");
  tide_status rc = tide_memcpy(w->a, to->ptr, from->ptr, n, NULL);
  expect_ok(w, rc, 0);
  if (rc == TIDE_OK) CHECK(memcmp(to->ptr, from->ptr, n) == 0, "%s copied other bytes", w->what);
  fill(to);
}

static void op_figures(world *w) {
  begin(w, "figures");
  tide_stats st;
  CHECK(tide_reset_peak_stats(w->a) == TIDE_OK, "tide_reset_peak_stats: %s", tide_last_error());
  CHECK(tide_get_stats(w->a, &st) == TIDE_OK, "tide_get_stats: %s", tide_last_error());
  CHECK(st.reserved_bytes[0].peak == st.reserved_bytes[0].current,
        "after a reset the reserved peak is %lld, current %lld",
        (long long)st.reserved_bytes[0].peak, (long long)st.reserved_bytes[0].current);
  char *json = NULL;
  size_t len = 0;
  CHECK(tide_snapshot_json(w->a, &json, &len) == TIDE_OK && json && len == strlen(json) &&
            json[0] == '{',
        "tide_snapshot_json: %s", tide_last_error());
  tide_string_free(json);
  tide_trace_event events[8];
  size_t n = 0;
  uint64_t dropped = 0;
  CHECK(tide_trace_read(w->a, events, 8, &n, &dropped) == TIDE_OK && n <= 8, "tide_trace_read: %s",
        tide_last_error());
  for (size_t i = 1; i < n; i++)
    CHECK(events[i].seq == events[i - 1].seq + 1, "trace events out of order");
}

/* ------------------------------------------------------------------------ */
/* Growable buffers                                                          */
/* ------------------------------------------------------------------------ */

typedef struct buf_slot buf_slot;

static void buf_mark(buf_slot *s) {
  unsigned char *p = tide_buf_data(s->b);
  s->mark = SIZE_MAX;
  s->first = s->length > 0;
  if (!s->length) return;
  p[0] = s->seed;
  s->mark = s->length - 1;
  if (s->mark) p[s->mark] = (unsigned char)(s->seed + 1);
}

FZ_CHECK_ONLY static void buf_expect(const world *w, const buf_slot *s) {
  const unsigned char *p = tide_buf_data(s->b);
  CHECK(tide_buf_length(s->b) == s->length && tide_buf_capacity(s->b) == s->capacity,
        "buffer %p: length %zu capacity %zu, the model says %zu and %zu", (void *)s->b,
        tide_buf_length(s->b), tide_buf_capacity(s->b), s->length, s->capacity);
  CHECK(tide_buf_mapped(s->b) >= s->length, "buffer %p maps %zu bytes for a length of %zu",
        (void *)s->b, tide_buf_mapped(s->b), s->length);
  if (!s->length || !s->first) return;
  CHECK(p[0] == s->seed, "buffer %p lost its first byte", (void *)s->b);
  if (s->mark != SIZE_MAX && s->mark)
    CHECK(p[s->mark] == (unsigned char)(s->seed + 1), "buffer %p lost byte %zu", (void *)s->b,
          s->mark);
  if (s->ring) /* the second mapping shows the same pages */
    CHECK(p[s->capacity] == s->seed, "ring %p: its second mapping differs", (void *)s->b);
  (void)w;
}

static void op_buf_create(world *w) {
  buf_slot *s = NULL;
  for (int i = 0; i < BUFS && !s; i++)
    if (!w->bufs[i].b) s = &w->bufs[i];
  if (!s) return;
  /* The device's size, to fill it, but at most 1024 pages: a ring maps every
   * page twice at creation, and 16384 pages of 64 KiB would make one step
   * take a second (filling the device stays reachable with every device at
   * 2 MiB pages, and with the smallest at 64 KiB). */
  size_t whole = w->capacity < 1024 * w->granularity ? w->capacity : 1024 * w->granularity;
  const size_t capacities[] = {2 * MiB, 6 * MiB, 64 * MiB, whole, 0, MAX_ALLOC + 1, 1000};
  tide_buf_options o;
  tide_buf_options_init(&o);
  o.capacity = capacities[fz_pick(&w->in, sizeof capacities / sizeof capacities[0])];
  o.ring = fz_pick(&w->in, 4) == 0;
  /* map_ahead in bytes: none, below a page (the next page mapped only near
   * it), one and two pages of the largest granularity. */
  const size_t aheads[] = {0, 2 * MiB, 4 * MiB, 300 * KiB};
  o.map_ahead = aheads[fz_pick(&w->in, sizeof aheads / sizeof aheads[0])];
  /* Bounded by the length (a little, or below a page until the buffer is
   * long), or not. */
  const double fractions[] = {0, 0.01, 0.5};
  if (o.map_ahead) o.map_ahead_fraction = fractions[fz_pick(&w->in, 3)];
  stream_kind kind;
  o.stream = pick_stream(w, &kind);
  if (captured(w, o.stream)) return; /* buffers are grown and shrunk outside captures */
  char what[96];
  snprintf(what, sizeof what, "tide_buf_create(%zu%s) on a %s stream", o.capacity,
           o.ring ? ", ring" : "", kind == LIVE ? "live" : "bad");
  begin(w, what);
  tide_buf *b = NULL;
  tide_status rc = tide_buf_create(w->a, &o, &b);
  unsigned allowed = ST(TIDE_ERR_OOM);
  if (o.capacity == 0 || o.capacity > MAX_ALLOC || kind != LIVE) allowed |= ST(TIDE_ERR_INVALID);
  if (o.capacity == 0 || o.capacity > MAX_ALLOC || kind == BOGUS)
    CHECK(rc != TIDE_OK, "%s succeeded", w->what);
  expect_ok(w, rc, allowed);
  if (rc != TIDE_OK) {
    CHECK(b == NULL, "%s failed but gave a buffer", w->what);
    return;
  }
  *s = (struct buf_slot){.b = b,
                         .capacity = tide_buf_capacity(b),
                         .length = o.ring ? tide_buf_capacity(b) : 0,
                         .ring = o.ring,
                         .seed = (uint8_t)(w->next_seq++ * 37 + 1),
                         .stream = o.stream};
  CHECK(s->capacity >= o.capacity, "capacity %zu below the %zu asked", s->capacity, o.capacity);
  buf_mark(s);
}

static buf_slot *pick_buf(world *w) {
  unsigned i = fz_pick(&w->in, BUFS);
  for (unsigned k = 0; k < BUFS; k++)
    if (w->bufs[(i + k) % BUFS].b) return &w->bufs[(i + k) % BUFS];
  return NULL;
}

static void op_buf_resize(world *w) {
  buf_slot *s = pick_buf(w);
  if (!s) return;
  size_t length;
  switch (fz_pick(&w->in, 6)) {
  case 0: length = 0; break;
  case 1: length = s->capacity; break;
  case 2: length = s->capacity + 1 + fz_byte(&w->in); break;
  case 3: length = s->length + (size_t)fz_u16(&w->in) * 64; break;
  case 4: length = s->length > MiB ? s->length - MiB : s->length / 2; break;
  default: length = (size_t)fz_u16(&w->in) * 1024; break;
  }
  stream_kind kind;
  tide_stream stream = pick_stream(w, &kind);
  if (kind != LIVE) stream = NULL;
  if (captured(w, stream) || captured(w, s->stream)) return; /* outside captures */
  char what[96];
  snprintf(what, sizeof what, "tide_buf_resize(%zu -> %zu of %zu%s)", s->length, length,
           s->capacity, s->ring ? ", ring" : "");
  begin(w, what);
  tide_status rc = tide_buf_resize(s->b, length, stream);
  bool invalid = s->ring || length > s->capacity;
  if (invalid) CHECK(rc == TIDE_ERR_INVALID, "%s returned %s", w->what, tide_status_name(rc));
  expect_ok(w, rc, invalid ? ST(TIDE_ERR_INVALID) : ST(TIDE_ERR_OOM));
  if (rc == TIDE_OK) { /* the bytes below both lengths are kept */
    if (s->mark != SIZE_MAX && s->mark >= length) s->mark = SIZE_MAX;
    if (length == 0) s->first = false;
    s->length = length;
  }
  buf_expect(w, s);
  if (rc == TIDE_OK) buf_mark(s);
}

static void buf_gone(buf_slot *s) { *s = (struct buf_slot){0}; }

static void op_buf_destroy(world *w) {
  buf_slot *s = pick_buf(w);
  if (!s || captured(w, s->stream)) return;
  begin(w, "tide_buf_destroy");
  tide_status rc = tide_buf_destroy(s->b);
  /* Refused while a shrink waits on a held stream: the buffer stays. */
  expect_ok(w, rc, ST(TIDE_ERR_NOT_READY));
  if (rc == TIDE_OK) buf_gone(s);
}

/* ------------------------------------------------------------------------ */
/* Capture pools, captures, checkpoints                                     */
/* ------------------------------------------------------------------------ */

/* The pool capture_detection made (or makes now) for the capture `stream`
 * is in: tide_capture_pool gives it, with its one user, the graph. */
static void learn_detected(world *w, tide_stream stream) {
  char what[sizeof w->what];
  memcpy(what, w->what, sizeof what);
  int i = free_pool(w);
  CHECK(i >= 0, "%s: no room for the capture's pool", w->what);
  tide_pool *p = NULL;
  tide_status rc = TIDE_ERR_STATE;
  for (int tries = 0; tries < 3 && rc != TIDE_OK; tries++) { /* an armed fault fires once */
    begin(w, "tide_capture_pool(a capture without a begin)");
    rc = tide_capture_pool(w->a, stream, &p);
    expect_ok(w, rc, 0);
  }
  CHECK(rc == TIDE_OK && p, "%s: %s", w->what, tide_last_error());
  for (int j = 0; j < POOLS; j++)
    CHECK(w->pools[j].p != p, "%s: gave pool %d's handle for a capture without a pool", w->what, j);
  w->pools[i] = (pool_slot){
      .p = p, .id = tide_pool_id(p), .uses = 1, .group = group_of(w, stream), .origin = stream};
  CHECK(w->pools[i].id != 0, "%s: pool id 0", w->what);
  memcpy(w->what, what, sizeof what);
}

/* The model's user count reached 0: the handle is no longer the fuzzer's. */
static void pool_gone(world *w, int i) { w->pools[i] = (pool_slot){0}; }

static void op_pool(world *w) {
  unsigned what = fz_pick(&w->in, 4);
  if (what == 0) {
    int i = free_pool(w);
    if (i < 0) return;
    begin(w, "tide_pool_create");
    tide_pool *p = NULL;
    tide_status rc = tide_pool_create(w->a, &p);
    expect_ok(w, rc, 0);
    if (rc != TIDE_OK) return;
    CHECK(p && tide_pool_id(p), "%s gave pool %p, id %llu", w->what, (void *)p,
          (unsigned long long)tide_pool_id(p));
    w->pools[i] = (pool_slot){.p = p, .id = tide_pool_id(p), .uses = 1};
    return;
  }
  int i = pick_pool(w);
  if (i < 0) return;
  pool_slot *ps = &w->pools[i];
  if (what == 1) {
    begin(w, "tide_pool_retain");
    tide_status rc = tide_pool_retain(ps->p);
    expect_ok(w, rc, 0);
    if (rc == TIDE_OK) ps->uses++;
    return;
  }
  int captures = pool_captures(w, i);
  bool last = ps->uses == 1 && captures == 0;
  char text[96];
  snprintf(text, sizeof text, "tide_pool_release(%d users, %d captures)", ps->uses, captures);
  begin(w, text);
  tide_status rc = tide_pool_release(ps->p);
  if (ps->uses <= captures) { /* only the captures' users are left: not the caller's */
    expect_failure(w, rc, ST(TIDE_ERR_STATE));
    return;
  }
  /* A detected capture that ended is forgotten by asking the backend; a
   * fault in that question keeps it. */
  unsigned allowed = ps->group && fault_fired(w) ? ST(TIDE_ERR_STATE) : 0;
  /* The last user returns the pool's free memory: that waits for the whole
   * device (graphs replay on any stream), which a hold keeps busy and a
   * capture, begun or emulated, forbids (then the rest goes back at a later
   * tide_empty_cache). */
  if (last && (w->nheld || any_captured(w) || any_begun(w))) allowed |= ST(TIDE_ERR_NOT_READY);
  expect_ok(w, rc, allowed);
  if (rc == TIDE_ERR_STATE) return;
  if (--ps->uses == 0) pool_gone(w, i);
}

/* The emulated capture of the host backend: begin, join (a fork into
 * another stream), end (of every stream in the capture). */
static void op_host_capture(world *w) {
  unsigned what = fz_pick(&w->in, 4);
  unsigned i = fz_pick(&w->in, STREAMS);
  tide_stream s = w->exists[i] ? w->streams[i] : NULL;
  if (i && !w->exists[i]) return;
  if (what <= 1) {
    begin(w, "tide_host_capture_begin");
    tide_status rc = tide_host_capture_begin(w->a, s);
    if (i == 0 || w->group[i]) { /* the default stream; one already captured */
      expect_failure(w, rc, ST(TIDE_ERR_INVALID));
      return;
    }
    CHECK(rc == TIDE_OK, "%s: %s", w->what, tide_last_error());
    w->group[i] = ++w->next_group;
  } else if (what == 2) {
    unsigned j = fz_pick(&w->in, STREAMS);
    tide_stream from = w->exists[j] ? w->streams[j] : NULL;
    if (j && !w->exists[j]) return;
    begin(w, "tide_host_capture_join");
    tide_status rc = tide_host_capture_join(w->a, s, from);
    if (i == 0 || j == 0 || w->group[i] || !w->group[j]) {
      expect_failure(w, rc, ST(TIDE_ERR_INVALID));
      return;
    }
    CHECK(rc == TIDE_OK, "%s: %s", w->what, tide_last_error());
    w->group[i] = w->group[j];
  } else {
    begin(w, "tide_host_capture_end");
    tide_status rc = tide_host_capture_end(w->a, s);
    if (i == 0 || !w->group[i]) {
      expect_failure(w, rc, ST(TIDE_ERR_INVALID));
      return;
    }
    CHECK(rc == TIDE_OK, "%s: %s", w->what, tide_last_error());
    uint64_t g = w->group[i];
    for (int k = 1; k < STREAMS; k++)
      if (w->group[k] == g) w->group[k] = 0;
  }
}

static void op_capture_begin(world *w) {
  int pi = pick_pool(w);
  begin_rec *b = NULL;
  for (int k = 0; k < BEGINS && !b; k++)
    if (!w->begins[k].used) b = &w->begins[k];
  if (pi < 0 || !b) return;
  stream_kind kind;
  tide_stream s = pick_stream(w, &kind);
  uint64_t g = kind == LIVE ? group_of(w, s) : 0;
  bool begun = false, taken = false; /* a begin on s; one for its capture */
  for (int k = 0; k < BEGINS; k++) {
    begun |= w->begins[k].used && w->begins[k].stream == s;
    taken |= g && w->begins[k].used && w->begins[k].group == g;
  }
  for (int k = 0; k < POOLS; k++) taken |= g && detected_live(w, k) && w->pools[k].group == g;
  char text[96];
  snprintf(text, sizeof text, "tide_capture_begin(%s stream %p%s)", kind == LIVE ? "live" : "bad",
           (void *)s, g ? ", captured" : "");
  begin(w, text);
  tide_status rc = tide_capture_begin(w->a, s, w->pools[pi].p);
  if (kind != LIVE) {
    expect_failure(w, rc, ST(TIDE_ERR_INVALID));
  } else if (begun || taken) {
    expect_failure(w, rc, ST(TIDE_ERR_STATE));
  } else {
    expect_ok(w, rc, fault_fired(w) ? ST(TIDE_ERR_STATE) : 0); /* an ended capture kept */
    if (rc == TIDE_OK) {
      *b = (begin_rec){.used = true, .stream = s, .group = g, .pool = pi};
      w->pools[pi].uses++; /* the graph's */
    }
  }
}

static void op_capture_end(world *w) {
  unsigned k = fz_pick(&w->in, BEGINS + 1);
  tide_stream s;
  if (k < BEGINS && w->begins[k].used) {
    s = w->begins[k].stream;
  } else { /* a stream with no begin */
    stream_kind kind;
    s = pick_stream(w, &kind);
    for (int j = 0; j < BEGINS; j++)
      if (w->begins[j].used && w->begins[j].stream == s) return;
    begin(w, "tide_capture_end(no begin)");
    expect_failure(w, tide_capture_end(w->a, s), ST(TIDE_ERR_STATE));
    return;
  }
  begin(w, "tide_capture_end");
  tide_status rc = tide_capture_end(w->a, s);
  CHECK(rc == TIDE_OK, "%s: %s", w->what, tide_last_error());
  w->begins[k].used = false; /* the graph keeps its user of the pool */
}

static void op_capture_pool(world *w) {
  stream_kind kind;
  tide_stream s = pick_stream(w, &kind);
  if (kind != LIVE) return; /* a begin outlives its stream; the answer then is no matter */
  int to = route(w, s);
  if (to == NEW_POOL) {
    if (free_pool(w) >= 0) learn_detected(w, s);
    return;
  }
  begin(w, "tide_capture_pool");
  tide_pool *p = (tide_pool *)(uintptr_t)1;
  tide_status rc = tide_capture_pool(w->a, s, &p);
  if (to < 0) {
    expect_failure(w, rc, ST(TIDE_ERR_INVALID));
    CHECK(p == NULL, "%s failed and gave %p", w->what, (void *)p);
    return;
  }
  expect_ok(w, rc, 0);
  if (rc == TIDE_OK)
    CHECK(p == w->pools[to].p, "%s gave %p, allocations go to pool %d (%p)", w->what, (void *)p, to,
          (void *)w->pools[to].p);
}

static void ckpt_drop(ckpt_rec *c) {
  tide_checkpoint_free(c->k);
  c->k = NULL;
  c->n = 0;
}

static void op_checkpoint(world *w) {
  int pi = pick_pool(w);
  if (pi < 0) return;
  ckpt_rec *c = &w->ckpts[fz_pick(&w->in, CKPTS)];
  ckpt_drop(c);
  begin(w, "tide_pool_checkpoint");
  tide_status rc = tide_pool_checkpoint(w->pools[pi].p, &c->k);
  expect_ok(w, rc, 0);
  if (rc != TIDE_OK) {
    CHECK(c->k == NULL, "%s failed and gave a checkpoint", w->what);
    return;
  }
  c->pool = w->pools[pi].id;
  for (int i = 0; i < SLOTS; i++) {
    const slot *s = &w->slots[i];
    if (s->used && !s->pinned && s->pool == c->pool)
      c->blocks[c->n++] = (struct ck_block){(uintptr_t)s->ptr, s->size, s->requested, s->stream};
  }
}

static void op_checkpoint_free(world *w) {
  ckpt_rec *c = &w->ckpts[fz_pick(&w->in, CKPTS)];
  begin(w, "tide_checkpoint_free");
  ckpt_drop(c);
}

FZ_CHECK_ONLY static bool in_list(void *const *list, size_t n, uintptr_t addr) {
  for (size_t i = 0; i < n; i++)
    if ((uintptr_t)list[i] == addr) return true;
  return false;
}

FZ_CHECK_ONLY static bool ck_has(const ckpt_rec *c, const slot *s) {
  for (unsigned i = 0; i < c->n; i++)
    if (c->blocks[i].addr == (uintptr_t)s->ptr && c->blocks[i].size == s->size) return true;
  return false;
}

/* Restore a checkpoint: the pool's blocks that are not the checkpoint's go
 * (released, no longer the fuzzer's), the checkpoint's that were freed come
 * back (restored, the fuzzer's to free), those of both stay as they are,
 * data included. The delta must say exactly that. */
static void op_restore(world *w) {
  ckpt_rec *c = &w->ckpts[fz_pick(&w->in, CKPTS)];
  if (!c->k) return;
  int pi = -1;
  if (fz_pick(&w->in, 4) == 0) {
    pi = pick_pool(w); /* perhaps another pool's */
  } else {
    for (int i = 0; i < POOLS; i++)
      if (w->pools[i].p && w->pools[i].id == c->pool) pi = i;
  }
  if (pi < 0) return; /* its pool is gone */
  bool with_delta = fz_pick(&w->in, 4) != 0;
  pool_slot *ps = &w->pools[pi];
  int captures = pool_captures(w, pi);
  char text[96];
  snprintf(text, sizeof text, "tide_pool_restore(%u blocks%s)", c->n,
           ps->id != c->pool ? ", another pool's checkpoint" : "");
  begin(w, text);
  tide_restore_delta delta;
  tide_status rc = tide_pool_restore(ps->p, c->k, with_delta ? &delta : NULL);
  if (ps->id != c->pool) {
    expect_failure(w, rc, ST(TIDE_ERR_INVALID));
    return;
  }
  if (captures) {
    expect_failure(w, rc, ST(TIDE_ERR_STATE));
    return;
  }
  /* Refused while a free of its blocks waits for a capture; waiting for
   * frees on held streams cannot end. */
  unsigned allowed = pool_deferred(w, ps->id) ? ST(TIDE_ERR_STATE) : 0;
  if (w->nheld) allowed |= ST(TIDE_ERR_NOT_READY);
  /* A fault in asking about captures keeps an ended capture, or a free it
   * deferred, for now. */
  if (fault_fired(w)) allowed |= ST(TIDE_ERR_STATE);
  expect_ok(w, rc, allowed);
  if (rc != TIDE_OK) return;
  for (int i = 0; i < DEFERRED; i++) /* none of them was still deferred */
    if (w->ended[i].pool == ps->id) w->ended[i].used = false;
  /* What the model expects to change hands. */
  size_t nreleased = 0, nrestored = 0;
  for (int i = 0; i < SLOTS; i++) {
    slot *s = &w->slots[i];
    if (!s->used || s->pinned || s->pool != ps->id || ck_has(c, s)) continue;
    nreleased++;
    if (with_delta)
      CHECK(in_list(delta.released, delta.nreleased, (uintptr_t)s->ptr),
            "%s: block %p, allocated and not in the checkpoint, is not in the delta's released",
            w->what, s->ptr);
    remember_freed(w, s->ptr);
    s->used = false;
  }
  for (unsigned k = 0; k < c->n; k++) {
    const struct ck_block *b = &c->blocks[k];
    bool live = false;
    for (int i = 0; i < SLOTS; i++) {
      const slot *s = &w->slots[i];
      live |= s->used && !s->pinned && (uintptr_t)s->ptr == b->addr && s->size == b->size;
    }
    if (live) continue;
    nrestored++;
    if (with_delta)
      CHECK(in_list(delta.restored, delta.nrestored, b->addr),
            "%s: block %p of the checkpoint, freed since, is not in the delta's restored", w->what,
            (void *)b->addr);
    slot *s = free_slot(w);
    if (s) {
      take_block(w, s, (void *)b->addr, b->requested, b->stream, ps->id);
      CHECK(s->size == b->size, "%s: block %p restored with %zu bytes, the checkpoint had %zu",
            w->what, s->ptr, s->size, b->size);
      continue;
    }
    /* No room in the model: the block is freed at once, as a caller may. */
    slot tmp = {.used = true,
                .ptr = (void *)b->addr,
                .requested = b->requested,
                .size = b->size,
                .stream = b->stream,
                .pool = ps->id};
    begin(w, "tide_free(a restored block)");
    CHECK(tide_free(w->a, tmp.ptr, tmp.stream) == TIDE_OK, "%s: %s", w->what, tide_last_error());
    if (defers(w, &tmp, tmp.stream)) remember_deferred(w, &tmp, tmp.stream);
  }
  if (with_delta) {
    CHECK(delta.nreleased == nreleased && delta.nrestored == nrestored,
          "%s: the delta has %zu released and %zu restored blocks, the model %zu and %zu", w->what,
          delta.nreleased, delta.nrestored, nreleased, nrestored);
    tide_restore_delta_free(&delta);
    CHECK(!delta.restored && !delta.released && !delta.nrestored && !delta.nreleased,
          "tide_restore_delta_free left the delta filled");
  }
}

/* The operations, by weight (the total stays below 256). */
typedef struct op_row {
  const char *name;
  unsigned weight;
  void (*run)(world *w);
} op_row;

static const op_row ops[] = {
    {"malloc", 24, op_malloc},
    {"free", 16, op_free},
    {"free_sized", 4, op_free_sized},
    {"double_free", 3, op_double_free},
    {"interior", 2, op_interior},
    {"unknown", 2, op_unknown},
    {"record", 4, op_record},
    {"block_info", 2, op_block_info},
    {"stream_create", 3, op_stream_create},
    {"stream_destroy", 2, op_stream_destroy},
    {"hold", 3, op_hold},
    {"release", 3, op_release},
    {"synchronize", 1, op_synchronize},
    {"empty_cache", 3, op_empty_cache},
    {"limit", 2, op_limit},
    {"fault", 3, op_fault},
    {"pinned_malloc", 3, op_pinned_malloc},
    {"pinned_free", 3, op_pinned_free},
    {"pinned_record", 1, op_pinned_record},
    {"pinned_empty", 1, op_pinned_empty},
    {"memcpy", 2, op_memcpy},
    {"figures", 1, op_figures},
    {"buf_create", 3, op_buf_create},
    {"buf_resize", 6, op_buf_resize},
    {"buf_destroy", 2, op_buf_destroy},
    {"pool", 4, op_pool},
    {"host_capture", 5, op_host_capture},
    {"capture_begin", 4, op_capture_begin},
    {"capture_end", 3, op_capture_end},
    {"capture_pool", 2, op_capture_pool},
    {"checkpoint", 3, op_checkpoint},
    {"checkpoint_free", 1, op_checkpoint_free},
    {"restore", 4, op_restore},
};

#define NOPS (sizeof ops / sizeof ops[0])

static const op_row *pick_op(world *w) {
  static unsigned total;
  if (!total)
    for (size_t i = 0; i < NOPS; i++) total += ops[i].weight;
  unsigned k = fz_byte(&w->in) % total;
  for (size_t i = 0;; i++) {
    if (k < ops[i].weight) return &ops[i];
    k -= ops[i].weight;
  }
}

/* ------------------------------------------------------------------------ */
/* After every step, and at the end                                          */
/* ------------------------------------------------------------------------ */

/* TIDE_FUZZ_TRACE=1 prints each step's call and the outcome (to read what
 * an input does). */
FZ_CHECK_ONLY static void trace_step(const world *w) {
  static int on = -1;
  if (on < 0) on = getenv("TIDE_FUZZ_TRACE") != NULL;
  if (on)
    fprintf(stderr, "step %u: %s: %s\n", w->step, w->what,
            tide_last_status() ? tide_last_error() : "ok");
}

FZ_CHECK_ONLY static void after_step(world *w) {
  trace_step(w);
  for (int op = 0; op < TIDE_OP_COUNT; op++) /* a fault fires once */
    if (w->fault_at[op] && tide_host_call_count(w->a, (tide_backend_op)op) >= w->fault_at[op]) {
      w->fault_at[op] = 0;
      w->failed = true;
    }
  if (w->failed || w->ending || w->step % CHECK_EVERY == 0)
    CHECK(tide_check(w->a) == TIDE_OK, "after %s: %s", w->what, tide_last_error());
  w->failed = false;
  int64_t bytes = 0, requested = 0, count = 0, pbytes = 0, prequested = 0, pcount = 0;
  for (int i = 0; i < SLOTS; i++) {
    const slot *s = &w->slots[i];
    if (!s->used) continue;
    expect_intact(s, true);
    if (s->pinned) {
      pbytes += (int64_t)s->size;
      prequested += (int64_t)s->requested;
      pcount++;
    } else {
      bytes += (int64_t)s->size;
      requested += (int64_t)s->requested;
      count++;
    }
  }
  for (int i = 0; i < BUFS; i++) {
    const buf_slot *b = &w->bufs[i];
    if (!b->b) continue;
    buf_expect(w, b);
    bytes += (int64_t)b->length; /* a buffer's length is allocated and requested */
    requested += (int64_t)b->length;
    count++;
  }
  settle_deferred(w);
  for (int i = 0; i < POOLS; i++) { /* each pool holds the blocks routed to it */
    const pool_slot *ps = &w->pools[i];
    if (!ps->p) continue;
    int64_t pbytes_ = 0, preq = 0, pn = 0;
    for (int k = 0; k < SLOTS; k++) {
      const slot *s = &w->slots[k];
      if (!s->used || s->pinned || s->pool != ps->id) continue;
      pbytes_ += (int64_t)s->size;
      preq += (int64_t)s->requested;
      pn++;
    }
    tide_stats ps_st;
    CHECK(tide_pool_get_stats(ps->p, &ps_st) == TIDE_OK && tide_pool_id(ps->p) == ps->id,
          "tide_pool_get_stats: %s", tide_last_error());
    CHECK(ps_st.allocated_bytes[0].current == pbytes_ && ps_st.requested_bytes[0].current == preq &&
              ps_st.allocations[0].current == pn,
          "after %s: pool %llu has %lld bytes (%lld asked) in %lld blocks allocated; the live "
          "blocks routed to it hold %lld (%lld) in %lld",
          w->what, (unsigned long long)ps->id, (long long)ps_st.allocated_bytes[0].current,
          (long long)ps_st.requested_bytes[0].current, (long long)ps_st.allocations[0].current,
          (long long)pbytes_, (long long)preq, (long long)pn);
  }
  tide_stats st, pst;
  CHECK(tide_get_stats(w->a, &st) == TIDE_OK && tide_pinned_get_stats(w->a, &pst) == TIDE_OK,
        "stats: %s", tide_last_error());
  CHECK(st.allocated_bytes[0].current == bytes && st.requested_bytes[0].current == requested &&
            st.allocations[0].current == count,
        "after %s: %lld bytes (%lld asked) in %lld blocks allocated; the live blocks hold %lld "
        "(%lld) in %lld",
        w->what, (long long)st.allocated_bytes[0].current, (long long)st.requested_bytes[0].current,
        (long long)st.allocations[0].current, (long long)bytes, (long long)requested,
        (long long)count);
  CHECK(pst.allocated_bytes[0].current == pbytes && pst.requested_bytes[0].current == prequested &&
            pst.allocations[0].current == pcount,
        "after %s: pinned figures %lld bytes (%lld asked) in %lld blocks; the live blocks hold "
        "%lld (%lld) in %lld",
        w->what, (long long)pst.allocated_bytes[0].current,
        (long long)pst.requested_bytes[0].current, (long long)pst.allocations[0].current,
        (long long)pbytes, (long long)prequested, (long long)pcount);
}

static void finish(world *w) {
  snprintf(w->what, sizeof w->what, "the end");
  w->ending = true;
  for (int op = 0; op < TIDE_OP_COUNT; op++)
    CHECK(tide_host_fail_call(w->a, (tide_backend_op)op, 0) == TIDE_OK, "disarm: %s",
          tide_last_error());
  memset(w->fault_at, 0, sizeof w->fault_at);
  for (size_t i = 0; i < w->nheld; i++)
    CHECK(tide_host_stream_release(w->a, w->held[i]) == TIDE_OK, "release: %s", tide_last_error());
  w->nheld = 0;
  /* Captures end (begins first or the emulated ones first, as the input's
   * last byte says), the graphs' and our users of the pools go, then the
   * blocks: pool memory comes back once they are freed. */
  bool host_first = w->in.size && (w->in.data[w->in.size - 1] & 1);
  for (int pass = 0; pass < 2; pass++) {
    if ((pass == 0) == host_first) {
      for (int i = 1; i < STREAMS; i++) {
        if (!w->exists[i] || !w->group[i]) continue;
        CHECK(tide_host_capture_end(w->a, w->streams[i]) == TIDE_OK, "tide_host_capture_end: %s",
              tide_last_error());
        for (int k = 1; k < STREAMS; k++)
          if (k != i && w->group[k] == w->group[i]) w->group[k] = 0;
        w->group[i] = 0;
      }
    } else {
      for (int k = 0; k < BEGINS; k++) {
        if (!w->begins[k].used) continue;
        CHECK(tide_capture_end(w->a, w->begins[k].stream) == TIDE_OK, "tide_capture_end: %s",
              tide_last_error());
        w->begins[k].used = false;
      }
    }
  }
  settle_deferred(w);
  for (int i = 0; i < CKPTS; i++) ckpt_drop(&w->ckpts[i]);
  for (int i = 0; i < POOLS; i++) {
    while (w->pools[i].p) {
      tide_status rc = tide_pool_release(w->pools[i].p);
      CHECK(rc == TIDE_OK, "tide_pool_release at the end (%d users): %s", w->pools[i].uses,
            tide_last_error());
      if (--w->pools[i].uses == 0) pool_gone(w, i);
    }
  }
  for (int i = 0; i < BUFS; i++) {
    if (!w->bufs[i].b) continue;
    buf_expect(w, &w->bufs[i]);
    CHECK(tide_buf_destroy(w->bufs[i].b) == TIDE_OK, "tide_buf_destroy at the end: %s",
          tide_last_error());
    buf_gone(&w->bufs[i]);
  }
  for (int i = 0; i < SLOTS; i++) {
    slot *s = &w->slots[i];
    if (!s->used) continue;
    expect_intact(s, false);
    tide_status rc =
        s->pinned ? tide_pinned_free(w->a, s->ptr, s->stream) : tide_free(w->a, s->ptr, s->stream);
    CHECK(rc == TIDE_OK, "freeing %p at the end: %s: %s", s->ptr, tide_status_name(rc),
          tide_last_error());
    s->used = false;
  }
  CHECK(tide_empty_cache(w->a) == TIDE_OK, "tide_empty_cache at the end: %s", tide_last_error());
  CHECK(tide_pinned_empty_cache(w->a) == TIDE_OK, "tide_pinned_empty_cache at the end: %s",
        tide_last_error());
  after_step(w);
  tide_stats st, pst;
  CHECK(tide_get_stats(w->a, &st) == TIDE_OK && tide_pinned_get_stats(w->a, &pst) == TIDE_OK,
        "stats");
  CHECK(st.reserved_bytes[0].current == 0 && st.segments[0].current == 0 &&
            st.active_bytes[0].current == 0 && tide_host_bytes_in_use(w->a) == 0 &&
            pst.reserved_bytes[0].current == 0,
        "everything freed and the caches emptied: %lld bytes reserved in %lld segments, %lld "
        "active, the device holds %llu, pinned %lld",
        (long long)st.reserved_bytes[0].current, (long long)st.segments[0].current,
        (long long)st.active_bytes[0].current, (unsigned long long)tide_host_bytes_in_use(w->a),
        (long long)pst.reserved_bytes[0].current);
  for (int i = 1; i < STREAMS; i++)
    if (w->exists[i])
      CHECK(tide_stream_destroy(w->a, w->streams[i]) == TIDE_OK, "tide_stream_destroy: %s",
            tide_last_error());
  CHECK(tide_destroy(w->a) == TIDE_OK, "tide_destroy: %s", tide_last_error());
  if (w->other) {
    CHECK(tide_free(w->other, w->other_block, NULL) == TIDE_OK, "free on device 1");
    CHECK(tide_destroy(w->other) == TIDE_OK, "tide_destroy of device 1: %s", tide_last_error());
  }
}

/* Two bytes choose the allocator's configuration. */
static void configure(world *w) {
  static const size_t capacities[] = {64 * MiB, 256 * MiB, 1024 * MiB, 128 * MiB};
  static const char *const roundings[] = {"0", "4", "[1:2,4:4,>:8]", "1"};
  unsigned a = fz_byte(&w->in), b = fz_byte(&w->in);
  w->capacity = capacities[(a >> 2) & 3];
  w->detection = b & 16;
  w->granularity = b & 1 ? 64 * KiB : 2 * MiB;
  snprintf(w->conf, sizeof w->conf,
           "backend:host,host_devices:2,expandable_segments:%s,release_holes:%s,"
           "host_capacity:%zuMiB,roundup_power2_divisions:%s,max_split_size_mb:%s,"
           "garbage_collection_threshold:%s,host_granularity:%s,page_size_mb:%s,trace:%s,"
           "capture_detection:%s,handle_size_mb:%s,handle_threshold_mb:%s",
           a & 1 ? "False" : "True", a & 2 ? "False" : "True", w->capacity / MiB,
           roundings[(a >> 4) & 3], a & 64 ? "20" : "unlimited", a & 128 ? "0.6" : "0",
           w->granularity == 64 * KiB ? "64KiB" : "2MiB",
           b & 2   ? "1"
           : b & 4 ? "4"
                   : "2",
           b & 8 ? "32" : "0", w->detection ? "True" : "False", b & 64 ? "4" : "0",
           b & 64 ? "0" : "auto");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  world *w = calloc(1, sizeof *w);
  if (!w) return 0;
  current = w;
  w->in = (fz_reader){data, size, 0};
  configure(w);
  tide_config *c = NULL;
  CHECK(tide_config_new(&c) == TIDE_OK && tide_config_parse(c, w->conf) == TIDE_OK,
        "config \"%s\": %s", w->conf, tide_last_error());
  tide_status rc = tide_create(0, c, &w->a);
  tide_config_free(c);
  CHECK(rc == TIDE_OK, "tide_create: %s", tide_last_error());
  w->exists[0] = true; /* the default stream */
  while (fz_more(&w->in) && w->step < MAX_STEPS) {
    const op_row *op = pick_op(w);
    w->history[w->step % HISTORY] = op->name;
    w->step++;
    snprintf(w->what, sizeof w->what, "%s", op->name);
    op->run(w);
    after_step(w);
  }
  finish(w);
  current = NULL;
  free(w);
  return 0;
}
