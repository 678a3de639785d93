/* soak.c: `tidalloc soak`, a bounded mixed workload with data verification
 * that runs for a given time on either backend.
 *
 * Worker threads share one allocator and a few streams. Each draws its
 * operations at random (from --seed): allocations of mixed sizes (mostly
 * small, some medium, a few large) and their frees, plain and sized; blocks
 * read on another stream (tide_record_stream) and freed while that read may
 * still be queued, their memory asked for again at once; reads and rewrites
 * through pinned memory; a growable buffer that grows and shrinks and a ring
 * buffer written across its wrap; and, on a timer, tide_empty_cache and an
 * out-of-memory check under a lowered memory limit. Every live block holds a
 * pattern derived from (id, offset), written with tide_memcpy from a host
 * buffer and compared when it is read back: at random times and in full
 * before every free.
 *
 * The main thread calls tide_check every few seconds and prints a progress
 * line. At the end every thread frees what it holds, and the command checks
 * that allocated memory is back to 0, that tide_empty_cache brings reserved
 * memory to 0 (device and pinned), that tide_check passes and that the
 * allocator is destroyed with nothing left. It exits 0 only if all of that
 * held and no verification failed and no call failed unexpectedly. */
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "tidalloc_testing.h"

#define KIB ((size_t)1 << 10)
#define MIB ((size_t)1 << 20)
#define GIB ((uint64_t)1 << 30)

enum {
  MAX_THREADS = 256,
  MAX_STREAMS = 256,
  MAX_REPORTS = 20,            /* failure messages printed; the rest are counted */
  ERROR_LEN = 1024,            /* a message kept for the summary */
  CHUNK = 4 << 20,             /* bytes of a thread's host buffer, copied at once */
  WINDOW = 1 << 20,            /* bytes of a random read of a larger region */
  EDGE = 64 << 10,             /* bytes read at each end of a sampled region */
  PINNED_WRITE_MAX = 16 << 20, /* blocks rewritten through pinned memory */
};

#define CSV_HEADER                                                                                 \
  "backend,device,seed,threads,streams,max_gib,seconds,ops,alloc,free,free_sized,"                 \
  "cross_stream_free,verify,pinned_read,pinned_write,buf_resize,buf_recreate,ring_window,"         \
  "ring_recreate,empty_cache,oom_check,expected_ooms,bytes_written,bytes_verified,"                \
  "peak_allocated_bytes,peak_reserved_bytes,peak_ratio,checks,check_failures,"                     \
  "verify_failures,errors,leaks,status"

/* The workload's operations, counted per kind. */
typedef enum soak_op {
  OP_ALLOC,
  OP_FREE,
  OP_FREE_SIZED,
  OP_CROSS_FREE,
  OP_VERIFY,
  OP_PINNED_READ,
  OP_PINNED_WRITE,
  OP_BUF_RESIZE,
  OP_BUF_RECREATE,
  OP_RING,
  OP_RING_RECREATE,
  OP_EMPTY_CACHE,
  OP_OOM,
  OP_COUNT
} soak_op;

/* A thread's figures: the operations, then these. */
enum {
  FIG_WRITTEN = OP_COUNT, /* bytes of patterns written */
  FIG_VERIFIED,           /* bytes read back and compared */
  FIG_EXPECTED_OOM,       /* out of memory where it had to be */
  FIG_OOM_SKIPPED,        /* out-of-memory checks left out: too little room */
  FIG_AHEAD_FAILURES,     /* map-ahead failures under a lowered limit, retried */
  FIG_COUNT
};

static const char *const op_names[OP_COUNT] = {
    "alloc",         "free",         "free_sized", "cross_stream_free", "verify",
    "pinned_read",   "pinned_write", "buf_resize", "buf_recreate",      "ring_window",
    "ring_recreate", "empty_cache",  "oom_check"};

/* What makes a run fail, counted. */
typedef enum soak_failure {
  FAIL_VERIFY, /* data read back differs from what was written */
  FAIL_ERROR,  /* a call failed that should not have */
  FAIL_CHECK,  /* tide_check found a broken invariant */
  FAIL_LEAK,   /* memory left allocated or reserved at the end */
  FAIL_KINDS
} soak_failure;

static const char *const failure_names[FAIL_KINDS] = {"verification failures", "unexpected errors",
                                                      "tide_check failures", "leaks"};

typedef struct soak_args {
  uint64_t seconds;
  uint64_t seed;
  bool seed_given;
  int threads;
  int streams;
  double max_gib; /* 0: the backend's default */
  const char *csv_path;
  const char *conf;
  bool quiet;
} soak_args;

/* Threads in shared mode run operations side by side; one in exclusive mode
 * (the out-of-memory check) runs alone. A thread waiting for exclusive mode
 * keeps new shared entries out, so it is not starved. */
typedef struct soak_gate {
  pthread_mutex_t mutex;
  pthread_cond_t changed;
  int shared;  /* threads inside in shared mode */
  int waiting; /* threads waiting for exclusive mode */
  bool exclusive;
} soak_gate;

/* What every thread shares. */
typedef struct soak_shared {
  tide_allocator *alloc;
  tide_stream streams[MAX_STREAMS];
  int nstreams;
  int nthreads;
  tide_stream oom_stream; /* only the out-of-memory check allocates on it */
  bool host;              /* the host backend */
  size_t page;            /* what expandable segments and buffers map at once */
  uint64_t thread_budget; /* bytes of blocks and buffers a thread may hold */
  uint64_t initial_limit; /* the memory limit to come back to */
  soak_gate gate;
  atomic_bool stop;
  atomic_uint_fast64_t next_id;   /* of patterns */
  atomic_uint_fast64_t oom_epoch; /* out-of-memory checks begun */
  atomic_uint_fast64_t failures[FAIL_KINDS];
  atomic_uint_fast64_t checks;
  pthread_mutex_t report_mutex;
  int reports;
} soak_shared;

/* A live block and the pattern it holds. */
typedef struct soak_block {
  char *ptr;
  size_t size;
  uint64_t id;
  int stream;
} soak_block;

typedef struct soak_thread {
  soak_shared *sh;
  int index;
  pthread_t thread;
  uint64_t rng;
  unsigned char *host; /* CHUNK bytes */
  soak_block *blocks;
  size_t nblocks, cap;
  uint64_t live; /* bytes of blocks, the buffer's length and the ring */
  /* The growable buffer: pattern (buf_id, offset) over its length. */
  tide_buf *buf;
  uint64_t buf_id;
  int buf_stream;
  uint64_t buf_epoch; /* oom_epoch at its last resize */
  /* The ring buffer. */
  tide_buf *ring;
  size_t ring_size;
  int ring_stream;
  /* Timers. */
  uint64_t next_empty_ns, next_oom_ns;
  /* Read by the main thread while the worker runs. */
  atomic_uint_fast64_t figures[FIG_COUNT];
} soak_thread;

/* ------------------------------------------------------------------------ */
/* Random numbers (splitmix64)                                               */
/* ------------------------------------------------------------------------ */

static uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static uint64_t rand_next(soak_thread *th) {
  th->rng += 0x9E3779B97F4A7C15ull;
  return mix64(th->rng);
}

/* Uniform in [0, n); n > 0. */
static uint64_t rand_below(soak_thread *th, uint64_t n) { return rand_next(th) % n; }

/* In [lo, hi], spread evenly over the powers of two between them. */
static uint64_t rand_log(soak_thread *th, uint64_t lo, uint64_t hi) {
  int lb = 63 - __builtin_clzll(lo), hb = 63 - __builtin_clzll(hi);
  int b = lb + (int)rand_below(th, (uint64_t)(hb - lb + 1));
  uint64_t v = ((uint64_t)1 << b) + rand_below(th, (uint64_t)1 << b);
  return v < lo ? lo : v > hi ? hi : v;
}

static void bump(atomic_uint_fast64_t *counter, uint64_t n) {
  atomic_fetch_add_explicit(counter, n, memory_order_relaxed);
}

/* Add n to one of the thread's figures (an operation or FIG_*). */
static void note(soak_thread *th, int figure, uint64_t n) { bump(&th->figures[figure], n); }

static uint64_t get(const atomic_uint_fast64_t *counter) {
  return atomic_load_explicit(counter, memory_order_relaxed);
}

/* ------------------------------------------------------------------------ */
/* The pattern: byte `offset` of pattern `id`                                */
/* ------------------------------------------------------------------------ */

/* The 8-byte word of the pattern that holds byte 8 * index. */
static uint64_t pattern_word(uint64_t seed, uint64_t index) {
  return mix64(seed + index * 0x9E3779B97F4A7C15ull);
}

static unsigned char pattern_byte(uint64_t seed, uint64_t offset) {
  uint64_t w = pattern_word(seed, offset / 8);
  unsigned char bytes[8];
  memcpy(bytes, &w, 8);
  return bytes[offset % 8];
}

/* `len` bytes of pattern `id` from `offset` into dst. */
static void pattern_fill(unsigned char *dst, size_t len, uint64_t id, uint64_t offset) {
  uint64_t seed = mix64(id);
  size_t i = 0;
  for (; i < len && (offset + i) % 8; i++) dst[i] = pattern_byte(seed, offset + i);
  for (; i + 8 <= len; i += 8) {
    uint64_t w = pattern_word(seed, (offset + i) / 8);
    memcpy(dst + i, &w, 8);
  }
  for (; i < len; i++) dst[i] = pattern_byte(seed, offset + i);
}

/* The index of the first byte of src that differs from the pattern, or len. */
static size_t pattern_mismatch(const unsigned char *src, size_t len, uint64_t id, uint64_t offset) {
  uint64_t seed = mix64(id);
  size_t i = 0;
  for (; i < len && (offset + i) % 8; i++)
    if (src[i] != pattern_byte(seed, offset + i)) return i;
  for (; i + 8 <= len; i += 8) {
    uint64_t w = pattern_word(seed, (offset + i) / 8), got;
    memcpy(&got, src + i, 8);
    if (got != w) break; /* the byte loop below finds which one */
  }
  for (; i < len; i++)
    if (src[i] != pattern_byte(seed, offset + i)) return i;
  return len;
}

/* ------------------------------------------------------------------------ */
/* The gate                                                                  */
/* ------------------------------------------------------------------------ */

static void gate_init(soak_gate *g) {
  memset(g, 0, sizeof *g);
  pthread_mutex_init(&g->mutex, NULL);
  pthread_cond_init(&g->changed, NULL);
}

static void gate_destroy(soak_gate *g) {
  pthread_cond_destroy(&g->changed);
  pthread_mutex_destroy(&g->mutex);
}

static void gate_enter(soak_gate *g) {
  pthread_mutex_lock(&g->mutex);
  while (g->exclusive || g->waiting > 0) pthread_cond_wait(&g->changed, &g->mutex);
  g->shared++;
  pthread_mutex_unlock(&g->mutex);
}

static void gate_leave(soak_gate *g) {
  pthread_mutex_lock(&g->mutex);
  if (--g->shared == 0) pthread_cond_broadcast(&g->changed);
  pthread_mutex_unlock(&g->mutex);
}

static void gate_enter_alone(soak_gate *g) {
  pthread_mutex_lock(&g->mutex);
  g->waiting++;
  while (g->exclusive || g->shared > 0) pthread_cond_wait(&g->changed, &g->mutex);
  g->waiting--;
  g->exclusive = true;
  pthread_mutex_unlock(&g->mutex);
}

static void gate_leave_alone(soak_gate *g) {
  pthread_mutex_lock(&g->mutex);
  g->exclusive = false;
  pthread_cond_broadcast(&g->changed);
  pthread_mutex_unlock(&g->mutex);
}

/* ------------------------------------------------------------------------ */
/* Failures                                                                  */
/* ------------------------------------------------------------------------ */

/* Count a failure, print the first few and stop the workload: later ones
 * would mostly follow from it. Always false, for `return failed(...)`. */
static bool failed(soak_shared *sh, soak_failure kind, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static bool failed(soak_shared *sh, soak_failure kind, const char *fmt, ...) {
  bump(&sh->failures[kind], 1);
  atomic_store(&sh->stop, true);
  pthread_mutex_lock(&sh->report_mutex);
  if (sh->reports++ < MAX_REPORTS) {
    va_list ap;
    va_start(ap, fmt);
    fflush(stdout);
    fputs("tidalloc soak: FAIL: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
  }
  pthread_mutex_unlock(&sh->report_mutex);
  return false;
}

/* A call that failed when it should not have, with the library's message. */
static bool call_failed(soak_shared *sh, const char *what) {
  return failed(sh, FAIL_ERROR, "%s: %s (%s)", what, tide_last_error(),
                tide_status_name(tide_last_status()));
}

static bool call_ok(soak_shared *sh, tide_status st, const char *what) {
  return st == TIDE_OK || call_failed(sh, what);
}

/* ------------------------------------------------------------------------ */
/* Copies: patterns written and read back                                    */
/* ------------------------------------------------------------------------ */

/* Write `len` bytes of pattern `id`, from `offset`, to device memory at dst
 * through the thread's host buffer, on `stream`, and wait for them. */
static bool put_pattern(soak_thread *th, char *dst, size_t len, uint64_t id, uint64_t offset,
                        tide_stream stream) {
  tide_allocator *alloc = th->sh->alloc;
  for (size_t done = 0; done < len;) {
    size_t n = len - done < CHUNK ? len - done : CHUNK;
    pattern_fill(th->host, n, id, offset + done);
    if (tide_memcpy(alloc, dst + done, th->host, n, stream) != TIDE_OK)
      return call_failed(th->sh, "tide_memcpy to the device");
    done += n;
  }
  note(th, FIG_WRITTEN, len);
  return call_ok(th->sh, tide_stream_synchronize(alloc, stream), "tide_stream_synchronize");
}

/* A region read back did not hold its pattern: say where and what. */
static bool mismatch(soak_thread *th, const char *what, const char *src, size_t at,
                     const unsigned char *got, uint64_t id, uint64_t offset) {
  unsigned char want = pattern_byte(mix64(id), offset);
  return failed(th->sh, FAIL_VERIFY,
                "%s: byte %llu (address %p) holds 0x%02x, its pattern %llu says 0x%02x", what,
                (unsigned long long)offset, (const void *)(src + at), *got, (unsigned long long)id,
                want);
}

/* Read `len` bytes at src (device memory, or a second mapping of it) on
 * `stream` and compare them with pattern `id` from `offset`. */
static bool check_pattern(soak_thread *th, const char *src, size_t len, uint64_t id,
                          uint64_t offset, tide_stream stream, const char *what) {
  tide_allocator *alloc = th->sh->alloc;
  for (size_t done = 0; done < len;) {
    size_t n = len - done < CHUNK ? len - done : CHUNK;
    if (tide_memcpy(alloc, th->host, src + done, n, stream) != TIDE_OK)
      return call_failed(th->sh, "tide_memcpy from the device");
    if (tide_stream_synchronize(alloc, stream) != TIDE_OK)
      return call_failed(th->sh, "tide_stream_synchronize");
    size_t bad = pattern_mismatch(th->host, n, id, offset + done);
    if (bad < n)
      return mismatch(th, what, src, done + bad, th->host + bad, id, offset + done + bad);
    done += n;
  }
  note(th, FIG_VERIFIED, len);
  return true;
}

/* Compare region [0, len) of a pattern: all of it, or when `sample` and it
 * is large, both ends and a random window. */
static bool check_region(soak_thread *th, const char *src, size_t len, uint64_t id,
                         tide_stream stream, bool sample, const char *what) {
  if (!sample || len <= 2 * EDGE + WINDOW) return check_pattern(th, src, len, id, 0, stream, what);
  size_t at = EDGE + (size_t)rand_below(th, len - 2 * EDGE - WINDOW + 1);
  return check_pattern(th, src, EDGE, id, 0, stream, what) &&
         check_pattern(th, src + at, WINDOW, id, at, stream, what) &&
         check_pattern(th, src + len - EDGE, EDGE, id, len - EDGE, stream, what);
}

static uint64_t new_id(soak_shared *sh) { return atomic_fetch_add(&sh->next_id, 1); }

static int random_stream(soak_thread *th) {
  return (int)rand_below(th, (uint64_t)th->sh->nstreams);
}

/* Another stream than `avoid` (the same one if there is only one). */
static int other_stream(soak_thread *th, int avoid) {
  int n = th->sh->nstreams;
  if (n == 1) return avoid;
  return (avoid + 1 + (int)rand_below(th, (uint64_t)(n - 1))) % n;
}

/* ------------------------------------------------------------------------ */
/* Blocks                                                                    */
/* ------------------------------------------------------------------------ */

static void describe(const soak_block *b, char *buf, size_t len) {
  snprintf(buf, len, "block %llu (%zu bytes at %p, stream %d)", (unsigned long long)b->id, b->size,
           (void *)b->ptr, b->stream);
}

static bool verify_block(soak_thread *th, const soak_block *b, bool sample) {
  char what[128];
  describe(b, what, sizeof what);
  return check_region(th, b->ptr, b->size, b->id, th->sh->streams[b->stream], sample, what);
}

static bool add_block(soak_thread *th, const soak_block *b) {
  if (th->nblocks == th->cap) {
    size_t cap = th->cap ? 2 * th->cap : 256;
    soak_block *grown = realloc(th->blocks, cap * sizeof *grown);
    if (grown == NULL) return failed(th->sh, FAIL_ERROR, "out of host memory for block records");
    th->blocks = grown;
    th->cap = cap;
  }
  th->blocks[th->nblocks++] = *b;
  th->live += b->size;
  return true;
}

/* Take block i out of the list (the last one takes its place). */
static soak_block take_block(soak_thread *th, size_t i) {
  soak_block b = th->blocks[i];
  th->blocks[i] = th->blocks[--th->nblocks];
  th->live -= b.size;
  return b;
}

/* A new block of `size` bytes on stream `si`, its pattern written. */
static bool new_block(soak_thread *th, size_t size, int si) {
  soak_shared *sh = th->sh;
  soak_block b = {NULL, size, new_id(sh), si};
  b.ptr = tide_malloc(sh->alloc, size, sh->streams[si]);
  if (b.ptr == NULL) {
    char what[64];
    snprintf(what, sizeof what, "tide_malloc(%zu bytes)", size);
    return call_failed(sh, what);
  }
  return add_block(th, &b) && put_pattern(th, b.ptr, size, b.id, 0, sh->streams[si]);
}

/* Sizes: 80% small (below 1 MiB), 17% medium (to 32 MiB), 3% large (to 256
 * MiB), each spread evenly over its powers of two, within the budget. */
static size_t pick_size(soak_thread *th) {
  uint64_t budget = th->sh->thread_budget;
  uint64_t medium = budget / 4 < 32 * MIB ? budget / 4 : 32 * MIB;
  uint64_t large = budget / 2 < 256 * MIB ? budget / 2 : 256 * MIB;
  uint64_t r = rand_below(th, 100);
  if (r < 80 || medium <= MIB) return (size_t)rand_log(th, 1, MIB - 1);
  if (r < 97 || large <= medium) return (size_t)rand_log(th, MIB, medium);
  return (size_t)rand_log(th, medium, large);
}

/* Free block i after reading all of it back; sized or not. A sized free
 * with a wrong size must be refused first, now and then. */
static bool free_block(soak_thread *th, size_t i, bool sized) {
  soak_shared *sh = th->sh;
  bool ok = verify_block(th, &th->blocks[i], false); /* freed anyway: nothing is left behind */
  soak_block b = take_block(th, i);
  tide_stream s = sh->streams[b.stream];
  if (sized && rand_below(th, 16) == 0) {
    tide_status st = tide_free_sized(sh->alloc, b.ptr, b.size + 1, s);
    if (st != TIDE_ERR_INVALID)
      return failed(sh, FAIL_ERROR,
                    "tide_free_sized with a wrong size gave %s, not TIDE_ERR_INVALID",
                    tide_status_name(st));
  }
  tide_status st =
      sized ? tide_free_sized(sh->alloc, b.ptr, b.size, s) : tide_free(sh->alloc, b.ptr, s);
  note(th, sized ? OP_FREE_SIZED : OP_FREE, 1);
  return call_ok(sh, st, sized ? "tide_free_sized" : "tide_free") && ok;
}

static bool free_random(soak_thread *th) {
  return free_block(th, (size_t)rand_below(th, th->nblocks), rand_below(th, 2) == 0);
}

static bool op_alloc(soak_thread *th) {
  size_t size = pick_size(th);
  while (th->nblocks > 0 && th->live + size > th->sh->thread_budget)
    if (!free_random(th)) return false;
  if (th->live + size > th->sh->thread_budget) return true; /* the buffers hold it all */
  note(th, OP_ALLOC, 1);
  return new_block(th, size, random_stream(th));
}

static bool op_verify(soak_thread *th) {
  note(th, OP_VERIFY, 1);
  return verify_block(th, &th->blocks[rand_below(th, th->nblocks)], true);
}

/* ------------------------------------------------------------------------ */
/* Other streams and pinned memory                                           */
/* ------------------------------------------------------------------------ */

/* A random window of a block: at most `most` bytes. */
static void pick_window(soak_thread *th, const soak_block *b, size_t most, size_t *at,
                        size_t *len) {
  *len = b->size < most ? b->size : (size_t)rand_log(th, 1, most);
  *at = (size_t)rand_below(th, b->size - *len + 1);
}

/* Read a window of a block into pinned memory on another stream (marked
 * with tide_record_stream), then free the block at once, on its own stream
 * or on a third one, while the read may still be queued; ask for the same
 * size again on the block's stream and write it. The window read must hold
 * the old pattern: the allocator may not hand the memory out before the
 * read is done. */
static bool op_cross_free(soak_thread *th) {
  soak_shared *sh = th->sh;
  size_t i = (size_t)rand_below(th, th->nblocks);
  if (!verify_block(th, &th->blocks[i], false)) return false;
  int reader = other_stream(th, th->blocks[i].stream);
  int freer = rand_below(th, 2) ? th->blocks[i].stream : other_stream(th, th->blocks[i].stream);
  size_t at, len;
  pick_window(th, &th->blocks[i], 8 * MIB, &at, &len);
  unsigned char *pin = tide_pinned_malloc(sh->alloc, len, sh->streams[reader]);
  if (pin == NULL) return call_failed(sh, "tide_pinned_malloc");
  soak_block b = take_block(th, i);
  bool ok =
      call_ok(sh, tide_memcpy(sh->alloc, pin, b.ptr + at, len, sh->streams[reader]),
              "tide_memcpy to pinned memory") &&
      call_ok(sh, tide_record_stream(sh->alloc, b.ptr, sh->streams[reader]),
              "tide_record_stream") &&
      call_ok(sh, tide_free(sh->alloc, b.ptr, sh->streams[freer]), "tide_free on another stream");
  note(th, OP_CROSS_FREE, 1);
  if (ok) ok = new_block(th, b.size, b.stream);
  if (ok)
    ok = call_ok(sh, tide_stream_synchronize(sh->alloc, sh->streams[reader]),
                 "tide_stream_synchronize");
  size_t bad = ok ? pattern_mismatch(pin, len, b.id, at) : len;
  if (ok && bad < len) {
    char what[160];
    describe(&b, what, sizeof what);
    strncat(what, ", read on another stream before its free", sizeof what - strlen(what) - 1);
    ok = mismatch(th, what, b.ptr + at, bad, pin + bad, b.id, at + bad);
  }
  if (ok) note(th, FIG_VERIFIED, len);
  return call_ok(sh, tide_pinned_free(sh->alloc, pin, sh->streams[reader]), "tide_pinned_free") &&
         ok;
}

/* Read a window of a block into pinned memory on another stream. */
static bool op_pinned_read(soak_thread *th) {
  soak_shared *sh = th->sh;
  const soak_block *b = &th->blocks[rand_below(th, th->nblocks)];
  int si = other_stream(th, b->stream);
  tide_stream s = sh->streams[si];
  size_t at, len;
  pick_window(th, b, 4 * MIB, &at, &len);
  note(th, OP_PINNED_READ, 1);
  unsigned char *pin = tide_pinned_malloc(sh->alloc, len, s);
  if (pin == NULL) return call_failed(sh, "tide_pinned_malloc");
  bool ok = call_ok(sh, tide_record_stream(sh->alloc, b->ptr, s), "tide_record_stream") &&
            call_ok(sh, tide_memcpy(sh->alloc, pin, b->ptr + at, len, s),
                    "tide_memcpy to pinned memory") &&
            call_ok(sh, tide_stream_synchronize(sh->alloc, s), "tide_stream_synchronize");
  size_t bad = ok ? pattern_mismatch(pin, len, b->id, at) : len;
  if (ok && bad < len) {
    char what[160];
    describe(b, what, sizeof what);
    strncat(what, ", read into pinned memory", sizeof what - strlen(what) - 1);
    ok = mismatch(th, what, b->ptr + at, bad, pin + bad, b->id, at + bad);
  }
  if (ok) note(th, FIG_VERIFIED, len);
  return call_ok(sh, tide_pinned_free(sh->alloc, pin, s), "tide_pinned_free") && ok;
}

/* Give a block a new pattern, written from pinned memory by an asynchronous
 * copy; the pinned block is freed while the copy may still be queued. */
static bool op_pinned_write(soak_thread *th) {
  soak_shared *sh = th->sh;
  soak_block *b = &th->blocks[rand_below(th, th->nblocks)];
  if (b->size > PINNED_WRITE_MAX) return op_pinned_read(th);
  tide_stream s = sh->streams[b->stream];
  note(th, OP_PINNED_WRITE, 1);
  unsigned char *pin = tide_pinned_malloc(sh->alloc, b->size, s);
  if (pin == NULL) return call_failed(sh, "tide_pinned_malloc");
  /* A block reused on its stream may still be the source of a queued copy. */
  bool ok = call_ok(sh, tide_stream_synchronize(sh->alloc, s), "tide_stream_synchronize");
  if (ok) {
    b->id = new_id(sh);
    pattern_fill(pin, b->size, b->id, 0);
    ok = call_ok(sh, tide_memcpy(sh->alloc, b->ptr, pin, b->size, s),
                 "tide_memcpy from pinned memory");
  }
  ok = call_ok(sh, tide_pinned_free(sh->alloc, pin, s), "tide_pinned_free") && ok;
  if (ok) note(th, FIG_WRITTEN, b->size);
  return ok && call_ok(sh, tide_stream_synchronize(sh->alloc, s), "tide_stream_synchronize");
}

/* ------------------------------------------------------------------------ */
/* Growable buffers                                                          */
/* ------------------------------------------------------------------------ */

/* A new growable buffer: a random amount mapped ahead, by the worker thread
 * or not, on a random stream. */
static bool buf_create(soak_thread *th) {
  soak_shared *sh = th->sh;
  uint64_t cap = sh->thread_budget / 4 < 256 * MIB ? sh->thread_budget / 4 : 256 * MIB;
  static const size_t ahead_pages[] = {0, 1, 4};
  tide_buf_options o;
  tide_buf_options_init(&o);
  o.capacity = cap < sh->page ? sh->page : (size_t)cap;
  o.map_ahead = ahead_pages[rand_below(th, 3)] * sh->page;
  o.async_map_ahead = (int)rand_below(th, 2);
  th->buf_stream = random_stream(th);
  o.stream = sh->streams[th->buf_stream];
  th->buf_id = new_id(sh);
  th->buf_epoch = atomic_load(&sh->oom_epoch);
  return call_ok(sh, tide_buf_create(sh->alloc, &o, &th->buf), "tide_buf_create");
}

static bool buf_destroy(soak_thread *th) {
  size_t len = tide_buf_length(th->buf);
  char what[96];
  snprintf(what, sizeof what, "growable buffer %llu (%zu bytes)", (unsigned long long)th->buf_id,
           len);
  bool ok = check_region(th, tide_buf_data(th->buf), len, th->buf_id,
                         th->sh->streams[th->buf_stream], false, what);
  tide_status st = tide_buf_destroy(th->buf);
  th->buf = NULL;
  th->live -= len;
  return call_ok(th->sh, st, "tide_buf_destroy") && ok;
}

/* The next length: mostly a step of up to 4 MiB either way, as a cache that
 * grows and is trimmed; sometimes anywhere, empty or full. */
static size_t pick_length(soak_thread *th, size_t now, size_t cap) {
  uint64_t r = rand_below(th, 100);
  if (r < 70) {
    size_t step = (size_t)rand_log(th, 1, 4 * MIB);
    if (rand_below(th, 3) == 0) return now > step ? now - step : 0;
    return cap - now > step ? now + step : cap;
  }
  if (r < 90) return (size_t)rand_below(th, cap + 1);
  return r < 95 ? 0 : cap;
}

/* Resize; a failure of mapping ahead reported now may come from an
 * out-of-memory check's lowered limit since the last resize: then the
 * resize is tried again. */
static tide_status buf_resize(soak_thread *th, size_t length) {
  soak_shared *sh = th->sh;
  uint64_t epoch = atomic_load(&sh->oom_epoch);
  tide_stream s = sh->streams[th->buf_stream];
  tide_status st = tide_buf_resize(th->buf, length, s);
  if (st == TIDE_ERR_OOM && epoch != th->buf_epoch &&
      strstr(tide_last_error(), "mapping ahead failed") != NULL) {
    note(th, FIG_AHEAD_FAILURES, 1);
    st = tide_buf_resize(th->buf, length, s);
  }
  th->buf_epoch = epoch;
  return st;
}

/* Read back what a resize kept: a random window and the end. */
static bool check_kept(soak_thread *th, size_t kept) {
  if (kept == 0) return true;
  char what[96];
  snprintf(what, sizeof what, "growable buffer %llu", (unsigned long long)th->buf_id);
  const char *data = tide_buf_data(th->buf);
  tide_stream s = th->sh->streams[th->buf_stream];
  size_t len = kept < WINDOW ? kept : WINDOW;
  size_t at = (size_t)rand_below(th, kept - len + 1);
  size_t end = kept < EDGE ? kept : EDGE;
  return check_pattern(th, data + at, len, th->buf_id, at, s, what) &&
         check_pattern(th, data + kept - end, end, th->buf_id, kept - end, s, what);
}

static bool op_buf_resize(soak_thread *th) {
  if (th->buf == NULL && !buf_create(th)) return false;
  size_t old = tide_buf_length(th->buf);
  size_t length = pick_length(th, old, tide_buf_capacity(th->buf));
  uint64_t others = th->live - old, budget = th->sh->thread_budget;
  uint64_t room = budget > others ? budget - others : 0; /* what the buffer may take */
  if (length > room) length = (size_t)room;
  note(th, OP_BUF_RESIZE, 1);
  if (!call_ok(th->sh, buf_resize(th, length), "tide_buf_resize")) return false;
  th->live = th->live - old + length;
  char *data = tide_buf_data(th->buf);
  if (length > old &&
      !put_pattern(th, data + old, length - old, th->buf_id, old, th->sh->streams[th->buf_stream]))
    return false;
  return check_kept(th, old < length ? old : length);
}

static bool op_buf_recreate(soak_thread *th) {
  note(th, OP_BUF_RECREATE, 1);
  if (th->buf != NULL && !buf_destroy(th)) return false;
  return buf_create(th);
}

/* ------------------------------------------------------------------------ */
/* The ring buffer                                                           */
/* ------------------------------------------------------------------------ */

/* A ring of 1, 2, 4 or 8 pages (fewer on a small budget). */
static bool ring_create(soak_thread *th) {
  soak_shared *sh = th->sh;
  size_t size = sh->page << rand_below(th, 4);
  while (size > sh->page && size > sh->thread_budget / 8) size /= 2;
  tide_buf_options o;
  tide_buf_options_init(&o);
  o.capacity = size;
  o.ring = 1;
  th->ring_stream = random_stream(th);
  o.stream = sh->streams[th->ring_stream];
  note(th, OP_RING_RECREATE, 1);
  if (!call_ok(sh, tide_buf_create(sh->alloc, &o, &th->ring), "tide_buf_create (ring)"))
    return false;
  th->ring_size = tide_buf_capacity(th->ring);
  th->live += th->ring_size;
  return true;
}

static bool ring_destroy(soak_thread *th) {
  tide_status st = tide_buf_destroy(th->ring);
  th->ring = NULL;
  th->live -= th->ring_size;
  return call_ok(th->sh, st, "tide_buf_destroy (ring)");
}

/* Write a window that starts anywhere in the ring, through the first
 * mapping (past its end, into the second), and read it back through the
 * other mapping of the same pages. */
static bool op_ring(soak_thread *th) {
  if (th->ring != NULL && rand_below(th, 32) == 0 && !ring_destroy(th)) return false;
  if (th->ring == NULL && !ring_create(th)) return false;
  size_t w = th->ring_size;
  char *data = tide_buf_data(th->ring);
  tide_stream s = th->sh->streams[th->ring_stream];
  size_t at = (size_t)rand_below(th, w);
  size_t len = rand_below(th, 2) ? (size_t)rand_log(th, 1, 64 * KIB) : (size_t)rand_log(th, 1, w);
  uint64_t id = new_id(th->sh);
  note(th, OP_RING, 1);
  if (!put_pattern(th, data + at, len, id, 0, s)) return false;
  size_t first = len < w - at ? len : w - at; /* the part before the wrap */
  char what[96];
  snprintf(what, sizeof what, "ring buffer of %zu bytes, window at %zu, read at its alias", w, at);
  return check_pattern(th, data + at + w, first, id, 0, s, what) &&
         check_pattern(th, data, len - first, id, first, s, what);
}

/* ------------------------------------------------------------------------ */
/* Emptying the cache and running out of memory                              */
/* ------------------------------------------------------------------------ */

static bool op_empty_cache(soak_thread *th) {
  note(th, OP_EMPTY_CACHE, 1);
  return call_ok(th->sh, tide_empty_cache(th->sh->alloc), "tide_empty_cache") &&
         call_ok(th->sh, tide_pinned_empty_cache(th->sh->alloc), "tide_pinned_empty_cache");
}

static bool read_stats(soak_shared *sh, int64_t *allocated, int64_t *reserved) {
  tide_stats st;
  if (tide_get_stats(sh->alloc, &st) != TIDE_OK) return call_failed(sh, "tide_get_stats");
  *allocated = st.allocated_bytes[TIDE_POOL_ALL].current;
  *reserved = st.reserved_bytes[TIDE_POOL_ALL].current;
  return true;
}

/* One block on the out-of-memory stream, its pattern written at both ends
 * (it may be large, and everyone waits meanwhile). */
static void *oom_block(soak_thread *th, size_t size, uint64_t id) {
  soak_shared *sh = th->sh;
  char *p = tide_malloc(sh->alloc, size, sh->oom_stream);
  if (p == NULL) return NULL;
  size_t end = size < EDGE ? size : EDGE;
  if (!put_pattern(th, p, end, id, 0, sh->oom_stream) ||
      !put_pattern(th, p + size - end, end, id, size - end, sh->oom_stream)) {
    tide_free(sh->alloc, p, sh->oom_stream);
    return NULL;
  }
  return p;
}

static bool oom_block_free(soak_thread *th, char *p, size_t size, uint64_t id) {
  soak_shared *sh = th->sh;
  size_t end = size < EDGE ? size : EDGE;
  bool ok = check_pattern(th, p, end, id, 0, sh->oom_stream, "out-of-memory check's block") &&
            check_pattern(th, p + size - end, end, id, size - end, sh->oom_stream,
                          "out-of-memory check's block");
  return call_ok(sh, tide_free(sh->alloc, p, sh->oom_stream), "tide_free") && ok;
}

/* Ask for `size` bytes past the limit: it must fail with TIDE_ERR_OOM and
 * a message saying so. */
static bool expect_oom(soak_thread *th, size_t size, int64_t allocated, uint64_t limit) {
  soak_shared *sh = th->sh;
  void *p = tide_malloc(sh->alloc, size, sh->oom_stream);
  if (p != NULL) {
    tide_free(sh->alloc, p, sh->oom_stream);
    return failed(sh, FAIL_ERROR,
                  "out-of-memory check: %zu bytes were allocated with %lld allocated and a "
                  "memory limit of %llu bytes",
                  size, (long long)allocated, (unsigned long long)limit);
  }
  if (tide_last_status() != TIDE_ERR_OOM || strstr(tide_last_error(), "out of memory") == NULL)
    return failed(sh, FAIL_ERROR,
                  "out-of-memory check: %zu bytes past the limit gave %s, \"%s\", not "
                  "TIDE_ERR_OOM and a message",
                  size, tide_status_name(tide_last_status()), tide_last_error());
  note(th, FIG_EXPECTED_OOM, 1);
  return true;
}

/* Alone: empty the cache and hold a block of X bytes, X more than the
 * memory reserved but not allocated; then set the memory limit to what is
 * reserved. X more bytes cannot fit under it (allocated + X > limit): asking
 * for them must fail. Once the block is freed, on its own stream (reusable
 * at once), the same request must succeed from its memory, whatever the
 * rounding and splitting options. */
static bool oom_check_alone(soak_thread *th) {
  soak_shared *sh = th->sh;
  int64_t allocated, reserved;
  if (!op_empty_cache(th) || !read_stats(sh, &allocated, &reserved)) return false;
  uint64_t gap = reserved > allocated ? (uint64_t)(reserved - allocated) : 0;
  size_t x = (size_t)((gap + 16 * MIB + sh->page - 1) / sh->page * sh->page);
  uint64_t most = sh->thread_budget * 2 > 256 * MIB ? sh->thread_budget * 2 : 256 * MIB;
  if (x > most) {
    note(th, FIG_OOM_SKIPPED, 1);
    return true;
  }
  uint64_t id = new_id(sh);
  char *p = oom_block(th, x, id);
  if (p == NULL) return call_failed(sh, "out-of-memory check: tide_malloc before the limit");
  bool ok = read_stats(sh, &allocated, &reserved);
  uint64_t limit = (uint64_t)reserved;
  if (ok && limit - (uint64_t)allocated >= x) { /* a buffer's worker mapped ahead meanwhile */
    note(th, FIG_OOM_SKIPPED, 1);
    return oom_block_free(th, p, x, id);
  }
  ok = ok && call_ok(sh, tide_set_memory_limit(sh->alloc, (size_t)limit), "tide_set_memory_limit");
  ok = ok && expect_oom(th, x, allocated, limit);
  ok = oom_block_free(th, p, x, id) && ok;
  id = new_id(sh);
  p = ok ? oom_block(th, x, id) : NULL;
  if (ok && p == NULL)
    ok = call_failed(sh, "out-of-memory check: the same request once as much was freed");
  if (p != NULL) ok = oom_block_free(th, p, x, id) && ok;
  return call_ok(sh, tide_set_memory_limit(sh->alloc, (size_t)sh->initial_limit),
                 "tide_set_memory_limit (back)") &&
         ok;
}

static bool run_check(soak_shared *sh, const char *when) {
  bump(&sh->checks, 1);
  if (tide_check(sh->alloc) == TIDE_OK) return true;
  return failed(sh, FAIL_CHECK, "tide_check %s: %s", when, tide_last_error());
}

static bool op_oom_check(soak_thread *th) {
  soak_shared *sh = th->sh;
  gate_enter_alone(&sh->gate);
  atomic_fetch_add(&sh->oom_epoch, 1);
  note(th, OP_OOM, 1);
  bool ok = oom_check_alone(th) && run_check(sh, "after an out-of-memory check");
  gate_leave_alone(&sh->gate);
  return ok;
}

/* ------------------------------------------------------------------------ */
/* A worker thread                                                           */
/* ------------------------------------------------------------------------ */

/* Percent weights of the random operations. */
static const struct {
  soak_op op;
  int weight;
} op_weights[] = {
    {OP_ALLOC, 32},      {OP_FREE, 20},        {OP_VERIFY, 10},
    {OP_CROSS_FREE, 6},  {OP_PINNED_READ, 4},  {OP_PINNED_WRITE, 4},
    {OP_BUF_RESIZE, 14}, {OP_BUF_RECREATE, 1}, {OP_RING, 9},
};

static soak_op pick_op(soak_thread *th) {
  int total = 0;
  for (size_t i = 0; i < sizeof op_weights / sizeof op_weights[0]; i++)
    total += op_weights[i].weight;
  int r = (int)rand_below(th, (uint64_t)total);
  for (size_t i = 0; i < sizeof op_weights / sizeof op_weights[0]; i++) {
    if (r < op_weights[i].weight) return op_weights[i].op;
    r -= op_weights[i].weight;
  }
  return OP_ALLOC;
}

static bool run_op(soak_thread *th, soak_op op) {
  if (th->nblocks == 0 && op != OP_BUF_RESIZE && op != OP_BUF_RECREATE && op != OP_RING)
    op = OP_ALLOC;
  switch (op) {
  case OP_FREE: return free_random(th);
  case OP_VERIFY: return op_verify(th);
  case OP_CROSS_FREE: return op_cross_free(th);
  case OP_PINNED_READ: return op_pinned_read(th);
  case OP_PINNED_WRITE: return op_pinned_write(th);
  case OP_BUF_RESIZE: return op_buf_resize(th);
  case OP_BUF_RECREATE: return op_buf_recreate(th);
  case OP_RING: return op_ring(th);
  default: return op_alloc(th);
  }
}

/* Seconds from now, at random in [lo, hi), as a time. */
static uint64_t timer_in(soak_thread *th, uint64_t now, double lo, double hi) {
  double s = lo + (hi - lo) * (double)rand_below(th, 1000) / 1000.0;
  return now + (uint64_t)(s * 1e9);
}

/* One step: a timer's operation when it is due, else a random one. */
static bool step(soak_thread *th) {
  soak_shared *sh = th->sh;
  uint64_t now = cli_now_ns();
  if (now >= th->next_oom_ns) {
    /* About one check a second over all threads. */
    th->next_oom_ns = timer_in(th, now, 0.5 * sh->nthreads, 1.5 * sh->nthreads);
    return op_oom_check(th);
  }
  gate_enter(&sh->gate);
  bool ok;
  if (now >= th->next_empty_ns) {
    th->next_empty_ns = timer_in(th, now, 1.0, 4.0);
    ok = op_empty_cache(th);
  } else {
    ok = run_op(th, pick_op(th));
  }
  gate_leave(&sh->gate);
  return ok;
}

/* Everything the thread holds back, read back first. */
static void give_back(soak_thread *th) {
  soak_shared *sh = th->sh;
  while (th->nblocks > 0) {
    gate_enter(&sh->gate);
    free_block(th, th->nblocks - 1, rand_below(th, 2) == 0);
    gate_leave(&sh->gate);
  }
  gate_enter(&sh->gate);
  if (th->buf != NULL) buf_destroy(th);
  if (th->ring != NULL) ring_destroy(th);
  gate_leave(&sh->gate);
}

static void *worker_main(void *arg) {
  soak_thread *th = arg;
  uint64_t now = cli_now_ns();
  th->next_empty_ns = timer_in(th, now, 0.5, 3.0);
  /* The first thread checks out of memory early, so short runs do it too. */
  th->next_oom_ns = th->index == 0 ? timer_in(th, now, 0.3, 1.0) : timer_in(th, now, 2.0, 6.0);
  while (!atomic_load(&th->sh->stop))
    if (!step(th)) break;
  give_back(th);
  return NULL;
}

/* ------------------------------------------------------------------------ */
/* The run                                                                   */
/* ------------------------------------------------------------------------ */

typedef struct soak_run {
  soak_args args;
  soak_shared sh;
  soak_thread *threads;
  char backend[16];
  char device[128];
  uint64_t max_bytes;
  double seconds; /* measured */
  int64_t peak_allocated, peak_reserved;
} soak_run;

/* One figure over every thread. */
static uint64_t total(const soak_run *run, int figure) {
  uint64_t sum = 0;
  for (int i = 0; i < run->args.threads; i++) sum += get(&run->threads[i].figures[figure]);
  return sum;
}

static uint64_t total_ops(const soak_run *run) {
  uint64_t sum = 0;
  for (int op = 0; op < OP_COUNT; op++) sum += total(run, op);
  return sum;
}

static uint64_t total_failures(const soak_run *run) {
  uint64_t sum = 0;
  for (int k = 0; k < FAIL_KINDS; k++) sum += get(&run->sh.failures[k]);
  return sum;
}

static double peak_ratio(const soak_run *run) {
  return run->peak_allocated > 0 ? (double)run->peak_reserved / (double)run->peak_allocated : 0.0;
}

static void read_peaks(soak_run *run, tide_stats *st) {
  if (tide_get_stats(run->sh.alloc, st) != TIDE_OK) {
    call_failed(&run->sh, "tide_get_stats");
    memset(st, 0, sizeof *st);
  }
  run->peak_allocated = st->allocated_bytes[TIDE_POOL_ALL].peak;
  run->peak_reserved = st->reserved_bytes[TIDE_POOL_ALL].peak;
}

static void progress_line(soak_run *run, double elapsed, bool check_ok) {
  tide_stats st;
  read_peaks(run, &st);
  char verified[32], allocated[32], reserved[32];
  printf("soak %7.1f s  ops %llu  verified %s  allocated %s  reserved %s  peak reserved/allocated "
         "%.3f  check %s\n",
         elapsed, (unsigned long long)total_ops(run),
         cli_format_bytes(total(run, FIG_VERIFIED), verified, sizeof verified),
         cli_format_bytes((uint64_t)st.allocated_bytes[TIDE_POOL_ALL].current, allocated,
                          sizeof allocated),
         cli_format_bytes((uint64_t)st.reserved_bytes[TIDE_POOL_ALL].current, reserved,
                          sizeof reserved),
         peak_ratio(run), check_ok ? "ok" : "FAILED");
  fflush(stdout);
}

static void sleep_ms(long ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Until the time is up or something failed: tide_check and a progress line
 * every few seconds (a tenth of the run, from 1 to 10 s). */
static void watch(soak_run *run, uint64_t start) {
  double every = (double)run->args.seconds / 10.0;
  every = every < 1.0 ? 1.0 : every > 10.0 ? 10.0 : every;
  uint64_t end = start + run->args.seconds * 1000000000ull;
  uint64_t next = start + (uint64_t)(every * 1e9);
  while (!atomic_load(&run->sh.stop)) {
    uint64_t now = cli_now_ns();
    if (now >= end) break;
    if (now >= next) {
      bool ok = run_check(&run->sh, "while the workload runs");
      if (!run->args.quiet) progress_line(run, (double)(now - start) / 1e9, ok);
      next += (uint64_t)(every * 1e9);
    }
    sleep_ms(20);
  }
  atomic_store(&run->sh.stop, true);
}

static bool start_threads(soak_run *run) {
  for (int i = 0; i < run->args.threads; i++) {
    soak_thread *th = &run->threads[i];
    th->sh = &run->sh;
    th->index = i;
    th->rng = mix64(run->args.seed) + (uint64_t)i * 0xD1B54A32D192ED03ull;
    th->host = malloc(CHUNK);
    if (th->host == NULL || pthread_create(&th->thread, NULL, worker_main, th) != 0) {
      free(th->host);
      th->host = NULL;
      atomic_store(&run->sh.stop, true);
      for (int j = 0; j < i; j++) pthread_join(run->threads[j].thread, NULL);
      cli_error("soak: cannot start %d threads", run->args.threads);
      return false;
    }
  }
  return true;
}

static void join_threads(soak_run *run) {
  for (int i = 0; i < run->args.threads; i++) {
    pthread_join(run->threads[i].thread, NULL);
    free(run->threads[i].host);
    free(run->threads[i].blocks);
  }
}

/* ------------------------------------------------------------------------ */
/* Set-up and the end: nothing may be left                                   */
/* ------------------------------------------------------------------------ */

static bool create_streams(soak_run *run) {
  soak_shared *sh = &run->sh;
  for (int i = 0; i < run->args.streams; i++) {
    if (tide_stream_create(sh->alloc, &sh->streams[i]) != TIDE_OK) {
      cli_report_tide_error("soak: creating a stream");
      return false;
    }
    sh->nstreams = i + 1;
  }
  if (tide_stream_create(sh->alloc, &sh->oom_stream) != TIDE_OK) {
    cli_report_tide_error("soak: creating a stream");
    return false;
  }
  return true;
}

static void destroy_streams(soak_run *run) {
  soak_shared *sh = &run->sh;
  for (int i = 0; i < sh->nstreams; i++)
    call_ok(sh, tide_stream_destroy(sh->alloc, sh->streams[i]), "tide_stream_destroy");
  if (sh->oom_stream != NULL)
    call_ok(sh, tide_stream_destroy(sh->alloc, sh->oom_stream), "tide_stream_destroy");
  sh->nstreams = 0;
  sh->oom_stream = NULL;
}

static bool sync_streams(soak_shared *sh) {
  bool ok = true;
  for (int i = 0; i < sh->nstreams; i++)
    ok = call_ok(sh, tide_stream_synchronize(sh->alloc, sh->streams[i]),
                 "tide_stream_synchronize") &&
         ok;
  return ok;
}

/* What a figure should be once everything is freed: `what` names it. */
static void expect_zero(soak_shared *sh, int64_t value, const char *what) {
  if (value != 0) failed(sh, FAIL_LEAK, "%s: %lld bytes, expected 0", what, (long long)value);
}

static void check_device_empty(soak_run *run) {
  soak_shared *sh = &run->sh;
  tide_stats st;
  read_peaks(run, &st);
  expect_zero(sh, st.allocated_bytes[TIDE_POOL_ALL].current, "allocated after every free");
  run_check(sh, "after every free");
  sync_streams(sh);
  if (call_ok(sh, tide_empty_cache(sh->alloc), "tide_empty_cache at the end") &&
      call_ok(sh, tide_get_stats(sh->alloc, &st), "tide_get_stats"))
    expect_zero(sh, st.reserved_bytes[TIDE_POOL_ALL].current, "reserved after tide_empty_cache");
  if (sh->host)
    expect_zero(sh, (int64_t)tide_host_bytes_in_use(sh->alloc), "emulated device memory in use");
}

static void check_pinned_empty(soak_shared *sh) {
  tide_stats st;
  if (!call_ok(sh, tide_pinned_get_stats(sh->alloc, &st), "tide_pinned_get_stats")) return;
  expect_zero(sh, st.allocated_bytes[TIDE_POOL_ALL].current, "pinned allocated after every free");
  if (call_ok(sh, tide_pinned_empty_cache(sh->alloc), "tide_pinned_empty_cache at the end") &&
      call_ok(sh, tide_pinned_get_stats(sh->alloc, &st), "tide_pinned_get_stats"))
    expect_zero(sh, st.reserved_bytes[TIDE_POOL_ALL].current,
                "pinned reserved after tide_pinned_empty_cache");
}

static void finish(soak_run *run) {
  soak_shared *sh = &run->sh;
  check_device_empty(run);
  check_pinned_empty(sh);
  run_check(sh, "at the end");
  destroy_streams(run);
  tide_status st = tide_destroy(sh->alloc);
  sh->alloc = NULL;
  if (st != TIDE_OK)
    failed(sh, st == TIDE_ERR_STATE ? FAIL_LEAK : FAIL_ERROR, "tide_destroy: %s (%s)",
           tide_last_error(), tide_status_name(st));
}

/* The allocator, and what follows from its backend: the default bound on
 * live memory, the page, the limit to restore. */
static bool open_allocator(soak_run *run) {
  soak_shared *sh = &run->sh;
  sh->alloc = cli_allocator_create("soak", NULL, run->args.conf, 0);
  if (sh->alloc == NULL) return false;
  tide_info info;
  tide_stats st;
  if (tide_get_info(sh->alloc, &info) != TIDE_OK || tide_get_stats(sh->alloc, &st) != TIDE_OK) {
    cli_report_tide_error("soak");
    return false;
  }
  snprintf(run->backend, sizeof run->backend, "%s", info.backend);
  snprintf(run->device, sizeof run->device, "%s", info.device_name);
  sh->host = strcmp(info.backend, "host") == 0;
  sh->page = info.page_size ? (size_t)info.page_size : 2 * MIB;
  sh->initial_limit = st.memory_limit;
  double gib = run->args.max_gib > 0 ? run->args.max_gib : sh->host ? 2.0 : 8.0;
  run->max_bytes = (uint64_t)(gib * (double)GIB);
  /* Half of what reserved memory may reach (the device's, or less under
   * memory_limit or memory_fraction): the rest is room for caching,
   * rounding and the out-of-memory check's block. */
  uint64_t room = st.memory_limit < info.total_memory ? st.memory_limit : info.total_memory;
  if (run->max_bytes > room / 2) run->max_bytes = room / 2;
  sh->thread_budget = run->max_bytes / (uint64_t)run->args.threads;
  if (sh->thread_budget < 16 * MIB) {
    char live[32], limit[32];
    cli_error("soak: %s of live memory for %d threads leaves less than 16 MiB each (reserved "
              "memory may reach %s, and at most half of that is live)",
              cli_format_bytes(run->max_bytes, live, sizeof live), run->args.threads,
              cli_format_bytes(room, limit, sizeof limit));
    return false;
  }
  return true;
}

static bool setup(soak_run *run) {
  soak_shared *sh = &run->sh;
  gate_init(&sh->gate);
  pthread_mutex_init(&sh->report_mutex, NULL);
  atomic_init(&sh->next_id, 1);
  sh->nthreads = run->args.threads;
  run->threads = calloc((size_t)run->args.threads, sizeof *run->threads);
  if (run->threads == NULL) {
    cli_error("soak: out of host memory");
    return false;
  }
  return open_allocator(run) && create_streams(run);
}

static void teardown(soak_run *run) {
  if (run->sh.alloc != NULL) {
    destroy_streams(run);
    tide_destroy(run->sh.alloc);
  }
  free(run->threads);
  pthread_mutex_destroy(&run->sh.report_mutex);
  gate_destroy(&run->sh.gate);
}

/* ------------------------------------------------------------------------ */
/* Output                                                                    */
/* ------------------------------------------------------------------------ */

static void print_summary(const soak_run *run) {
  char a[32], b[32];
  uint64_t ops = total_ops(run);
  printf("soak: %.1f s on %s (%s), seed %llu, %d threads, %d streams, at most %s live\n",
         run->seconds, run->backend, run->device, (unsigned long long)run->args.seed,
         run->args.threads, run->args.streams, cli_format_bytes(run->max_bytes, a, sizeof a));
  printf("  operations %llu (%.0f/s):\n", (unsigned long long)ops,
         run->seconds > 0 ? (double)ops / run->seconds : 0.0);
  for (int op = 0; op < OP_COUNT; op++)
    printf("    %-18s %llu\n", op_names[op], (unsigned long long)total(run, op));
  printf("  written %s, verified %s\n", cli_format_bytes(total(run, FIG_WRITTEN), a, sizeof a),
         cli_format_bytes(total(run, FIG_VERIFIED), b, sizeof b));
  printf("  out of memory as expected %llu times (%llu checks skipped: too little room; %llu "
         "buffer map-ahead failures under a lowered limit)\n",
         (unsigned long long)total(run, FIG_EXPECTED_OOM),
         (unsigned long long)total(run, FIG_OOM_SKIPPED),
         (unsigned long long)total(run, FIG_AHEAD_FAILURES));
  printf("  peak allocated %s, peak reserved %s, ratio %.3f\n",
         cli_format_bytes((uint64_t)run->peak_allocated, a, sizeof a),
         cli_format_bytes((uint64_t)run->peak_reserved, b, sizeof b), peak_ratio(run));
  printf("  tide_check runs %llu\n", (unsigned long long)get(&run->sh.checks));
  for (int k = 0; k < FAIL_KINDS; k++)
    printf("  %-22s %llu\n", failure_names[k], (unsigned long long)get(&run->sh.failures[k]));
  printf("soak: %s\n", total_failures(run) == 0 ? "PASS" : "FAIL");
}

static bool write_csv(const soak_run *run) {
  FILE *f = fopen(run->args.csv_path, "w");
  if (f == NULL) {
    cli_error("cannot write %s: %s", run->args.csv_path, strerror(errno));
    return false;
  }
  fprintf(f, "%s\n%s,\"%s\",%llu,%d,%d,%.3f,%.1f,%llu", CSV_HEADER, run->backend, run->device,
          (unsigned long long)run->args.seed, run->args.threads, run->args.streams,
          (double)run->max_bytes / (double)GIB, run->seconds, (unsigned long long)total_ops(run));
  for (int op = 0; op < OP_COUNT; op++) fprintf(f, ",%llu", (unsigned long long)total(run, op));
  fprintf(f, ",%llu,%llu,%llu,%lld,%lld,%.4f,%llu",
          (unsigned long long)total(run, FIG_EXPECTED_OOM),
          (unsigned long long)total(run, FIG_WRITTEN), (unsigned long long)total(run, FIG_VERIFIED),
          (long long)run->peak_allocated, (long long)run->peak_reserved, peak_ratio(run),
          (unsigned long long)get(&run->sh.checks));
  fprintf(f, ",%llu,%llu,%llu,%llu,%s\n", (unsigned long long)get(&run->sh.failures[FAIL_CHECK]),
          (unsigned long long)get(&run->sh.failures[FAIL_VERIFY]),
          (unsigned long long)get(&run->sh.failures[FAIL_ERROR]),
          (unsigned long long)get(&run->sh.failures[FAIL_LEAK]),
          total_failures(run) == 0 ? "pass" : "fail");
  return cli_close_output(f, run->args.csv_path);
}

/* ------------------------------------------------------------------------ */
/* The command                                                               */
/* ------------------------------------------------------------------------ */

static void print_help(void) {
  printf("usage: tidalloc soak [--seconds N] [--seed S] [--threads T] [--streams K]\n"
         "                     [--max-gib G] [--csv FILE] [--quiet] [--conf STR]\n"
         "\n"
         "Run a mixed allocation workload for N seconds, checking every byte it writes:\n"
         "allocations of mixed sizes freed plain and sized, blocks read on another\n"
         "stream and freed while the read is queued, copies through pinned memory, a\n"
         "growable buffer that grows and shrinks, a ring buffer written across its\n"
         "wrap, tide_empty_cache, and out of memory under a lowered memory limit. The\n"
         "allocator is configured as by the other commands (TIDALLOC_CONF=backend:host\n"
         "forces the emulated device). tide_check runs every few seconds. It exits 0\n"
         "only if every read matched, tide_check passed, no call failed unexpectedly,\n"
         "and once everything is freed nothing stays allocated, nor reserved after\n"
         "tide_empty_cache.\n"
         "\n"
         "  --seconds N   how long the workload runs (default 600)\n"
         "  --seed S      of the random choices (default: from the clock, printed)\n"
         "  --threads T   worker threads (default 4)\n"
         "  --streams K   streams they share (default 4)\n"
         "  --max-gib G   live memory of all threads together (default 8 on CUDA, 2 on\n"
         "                the host backend; at most half of what reserved memory may\n"
         "                reach: the device, or less under memory_limit or\n"
         "                memory_fraction)\n"
         "  --csv FILE    write a header and one summary row to FILE:\n"
         "                %s\n"
         "  --quiet       no progress lines, only the summary\n"
         "  --conf STR    tidalloc options, \"key:value,...\"\n",
         CSV_HEADER);
}

static bool parse_gib(const char *text, void *target) {
  double *gib = target;
  char *end = NULL;
  *gib = strtod(text, &end);
  return end != text && *end == '\0' && *gib > 0 && *gib <= 1 << 20;
}

/* Returns -1 to go on, or the exit code. */
static int parse_args(int argc, char **argv, soak_args *args) {
  memset(args, 0, sizeof *args);
  args->seconds = 600;
  uint64_t threads = 4, streams = 4;
  const cli_option options[] = {
      {.name = "--quiet", .kind = CLI_FLAG, .target = &args->quiet},
      {.name = "--seconds",
       .kind = CLI_COUNT,
       .target = &args->seconds,
       .min = 1,
       .max = 100000000},
      {.name = "--seed",
       .kind = CLI_COUNT,
       .target = &args->seed,
       .max = UINT64_MAX,
       .given = &args->seed_given},
      {.name = "--threads", .kind = CLI_COUNT, .target = &threads, .min = 1, .max = MAX_THREADS},
      {.name = "--streams", .kind = CLI_COUNT, .target = &streams, .min = 1, .max = MAX_STREAMS},
      {.name = "--max-gib",
       .kind = CLI_CUSTOM,
       .target = &args->max_gib,
       .parse = parse_gib,
       .wants = "a positive number of GiB"},
      {.name = "--csv", .kind = CLI_TEXT, .target = &args->csv_path},
      {.name = "--conf", .kind = CLI_TEXT, .target = &args->conf},
  };
  int code = cli_parse(argc, argv, "soak", print_help, options, sizeof options / sizeof options[0],
                       NULL, 0);
  if (code >= 0) return code;
  args->threads = (int)threads;
  args->streams = (int)streams;
  if (!args->seed_given) args->seed = mix64(cli_now_ns()) % 1000000000ull;
  return -1;
}

int tide_cli_soak(int argc, char **argv) {
  soak_run run;
  memset(&run, 0, sizeof run);
  int code = parse_args(argc, argv, &run.args);
  if (code >= 0) return code;
  if (!setup(&run)) {
    teardown(&run);
    return CLI_EXIT_FAILURE;
  }
  if (!run.args.quiet)
    printf("soak: %llu s on %s (%s), seed %llu, %d threads, %d streams\n",
           (unsigned long long)run.args.seconds, run.backend, run.device,
           (unsigned long long)run.args.seed, run.args.threads, run.args.streams);
  uint64_t start = cli_now_ns();
  if (!start_threads(&run)) {
    teardown(&run);
    return CLI_EXIT_FAILURE;
  }
  watch(&run, start);
  join_threads(&run);
  run.seconds = (double)(cli_now_ns() - start) / 1e9;
  finish(&run);
  print_summary(&run);
  bool ok = total_failures(&run) == 0;
  if (run.args.csv_path != NULL && !write_csv(&run)) ok = false;
  teardown(&run);
  return ok ? CLI_EXIT_OK : CLI_EXIT_FAILURE;
}
