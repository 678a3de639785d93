/* test_chaos_threads.c: every public call at once, from several threads, on
 * one allocator of the host backend, with a watchdog that turns a hang into
 * a failure.
 *
 * Workers mix allocations and frees (on their own stream, on another, after
 * tide_record_stream, sized, home), byte patterns written into every block
 * and buffer and verified before each free and resize, growable buffers
 * (mapped ahead on a worker thread, rings) created, resized and destroyed,
 * capture pools begun, ended and released (on an emulated capture too),
 * streams created and destroyed, limits changed, the cache emptied,
 * statistics, snapshots and layouts taken; a checker thread runs tide_check
 * all the while. At the end every block, buffer, pool and stream goes and
 * tide_destroy must say nothing leaked.
 *
 * Each thread names the call it is in; the watchdog fails the run when one
 * stays in a call longer than TIDE_CHAOS_HANG seconds (default 60), printing every
 * thread's call and the stacks of those stuck, and exits non-zero instead
 * of leaving the test to its timeout.
 *
 * Seeded: the seed is printed; TIDE_CHAOS_SEED (or the first argument) sets
 * it, so each thread makes the same choices again (which thread wins a race
 * stays the scheduler's). TIDE_CHAOS_SECONDS sets the length (default 3, a
 * soak: 600), TIDE_CHAOS_THREADS the workers (default 4), TIDE_CHAOS_ONLY
 * =test_chaos leaves out the other test. */
#include <execinfo.h>
#include <inttypes.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "testutil.h"

#define MAX_WORKERS 16
#define MAX_BLOCKS 48
#define MAX_BUFS 3
#define SHARED_STREAMS 3
#define CONFIG "host_capacity:4GiB,host_queue_depth:2,trace:4096"

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ------------------------------------------------------------------------ */
/* Threads the watchdog watches                                              */
/* ------------------------------------------------------------------------ */

typedef struct watched {
  char name[24];
  pthread_t thread;
  atomic_bool running;
  _Atomic(const char *) op; /* the call it is in, or NULL between calls */
  _Atomic uint64_t since;   /* when it entered it */
  _Atomic uint64_t ops;     /* calls made */
} watched;

static _Atomic(watched *) watch_list[MAX_WORKERS + 4]; /* NULL until filled */
static atomic_int nwatched;
static atomic_bool watch_stop;
static double hang_seconds;

static void watch_add(watched *w, const char *name) {
  snprintf(w->name, sizeof w->name, "%s", name);
  w->thread = pthread_self();
  atomic_store(&w->op, NULL);
  atomic_store(&w->ops, 0);
  atomic_store(&w->running, true);
  atomic_store(&watch_list[atomic_fetch_add(&nwatched, 1)], w);
}

static inline void op_begin(watched *w, const char *op) {
  atomic_store_explicit(&w->since, now_ns(), memory_order_relaxed);
  atomic_store_explicit(&w->op, op, memory_order_release);
}

static inline void op_end(watched *w) {
  atomic_store_explicit(&w->op, NULL, memory_order_release);
  atomic_fetch_add_explicit(&w->ops, 1, memory_order_relaxed);
}

/* A stuck thread's stack, printed by the thread itself. */
static void print_stack(int sig) {
  (void)sig;
  void *frames[48];
  int n = backtrace(frames, 48);
  static const char head[] = "---- stack of a stuck thread:\n";
  ssize_t ignored = write(2, head, sizeof head - 1);
  (void)ignored;
  backtrace_symbols_fd(frames, n, 2);
}

static void *watchdog_main(void *arg) {
  (void)arg;
  uint64_t limit = (uint64_t)(hang_seconds * 1e9);
  while (!atomic_load(&watch_stop)) {
    usleep(50 * 1000);
    uint64_t now = now_ns();
    int n = atomic_load(&nwatched), stuck = 0;
    for (int i = 0; i < n; i++) {
      watched *w = atomic_load(&watch_list[i]);
      if (!w) continue;
      const char *op = atomic_load(&w->op);
      uint64_t since = atomic_load(&w->since); /* may be after `now` */
      if (atomic_load(&w->running) && op && since < now && now - since > limit) stuck++;
    }
    if (!stuck) continue;
    fprintf(stderr, "chaos: HANG: %d thread(s) in one call for more than %.0f s\n", stuck,
            hang_seconds);
    for (int i = 0; i < n; i++) {
      watched *w = atomic_load(&watch_list[i]);
      if (!w) continue;
      const char *op = atomic_load(&w->op);
      uint64_t since = atomic_load(&w->since);
      fprintf(stderr, "  %-10s %s%s (%.1f s), %" PRIu64 " calls made\n", w->name,
              op ? "in " : "between calls, last done: ", op ? op : "-",
              op && since < now ? (double)(now - since) / 1e9 : 0.0, atomic_load(&w->ops));
    }
    fflush(stderr);
    for (int i = 0; i < n; i++) {
      watched *w = atomic_load(&watch_list[i]);
      if (w && atomic_load(&w->running) && atomic_load(&w->op)) {
        pthread_kill(w->thread, SIGUSR2);
        usleep(200 * 1000);
      }
    }
    _exit(3);
  }
  return NULL;
}

static pthread_t watchdog;

static void watchdog_start(void) {
  hang_seconds = (double)tu_env_u64("TIDE_CHAOS_HANG", 60);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = print_stack;
  sigaction(SIGUSR2, &sa, NULL);
  void *warm[1];
  backtrace(warm, 1); /* loads what backtrace needs before a signal asks for it */
  for (size_t i = 0; i < sizeof watch_list / sizeof *watch_list; i++)
    atomic_store(&watch_list[i], NULL);
  atomic_store(&nwatched, 0);
  atomic_store(&watch_stop, false);
  assert_int_equal(pthread_create(&watchdog, NULL, watchdog_main, NULL), 0);
}

static void watchdog_stop(void) {
  atomic_store(&watch_stop, true);
  pthread_join(watchdog, NULL);
}

/* ------------------------------------------------------------------------ */
/* The run                                                                   */
/* ------------------------------------------------------------------------ */

typedef struct block {
  void *p;
  size_t size;
  uint64_t seq;
  tide_stream home; /* where it is freed: its stream, or NULL once that went */
} block;

typedef struct buffer {
  tide_buf *b;
  tide_stream stream;
  size_t capacity, valid; /* valid: bytes from the start that hold the pattern */
  uint64_t seq;
  bool ring;
} buffer;

typedef struct run run;

typedef struct worker {
  watched w;
  pthread_t tid;
  run *r;
  int index;
  tu_rng rng;
  uint64_t seq;
  block blocks[MAX_BLOCKS];
  size_t nblocks;
  buffer bufs[MAX_BUFS];
  size_t nbufs;
  tide_stream own;     /* created and destroyed as it goes */
  tide_stream capture; /* its captures' stream, used by no other thread */
  uint64_t ooms;
} worker;

struct run {
  tide_allocator *a;
  tide_stream shared[SHARED_STREAMS];
  atomic_bool stop;
  atomic_int failures;
  pthread_mutex_t failure_lock;
  char failure[1024];
  worker workers[MAX_WORKERS];
  int nworkers;
  watched checker;
  _Atomic uint64_t checks;
};

static void run_fail(worker *k, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void run_fail(worker *k, const char *fmt, ...) {
  run *r = k->r;
  pthread_mutex_lock(&r->failure_lock);
  if (atomic_fetch_add(&r->failures, 1) == 0) {
    va_list ap;
    va_start(ap, fmt);
    int len = snprintf(r->failure, sizeof r->failure, "%s: ", k->w.name);
    vsnprintf(r->failure + len, sizeof r->failure - (size_t)len, fmt, ap);
    va_end(ap);
  }
  pthread_mutex_unlock(&r->failure_lock);
  atomic_store(&r->stop, true);
}

/* A call's status must be OK (or `also`, when not OK). */
static bool expect(worker *k, tide_status rc, tide_status also, const char *what) {
  if (rc == TIDE_OK || (also != TIDE_OK && rc == also)) return true;
  run_fail(k, "%s returned %s: %s", what, tide_status_name(rc), tide_last_error());
  return false;
}

static tide_stream any_stream(worker *k) {
  uint64_t c = tu_below(&k->rng, SHARED_STREAMS + 2);
  if (c < SHARED_STREAMS) return k->r->shared[c];
  return c == SHARED_STREAMS ? NULL : k->own;
}

static size_t block_size(worker *k) {
  uint64_t c = tu_below(&k->rng, 100);
  if (c < 80) return tu_log_uniform(&k->rng, 1, 64 * TU_KiB);
  if (c < 96) return tu_log_uniform(&k->rng, 64 * TU_KiB, 4 * TU_MiB);
  return tu_log_uniform(&k->rng, 4 * TU_MiB, 24 * TU_MiB);
}

static bool verify_block(worker *k, const block *b, const char *when) {
  size_t bad = tu_check(b->p, b->size, b->seq, TU_PATTERN_DEFAULT);
  if (bad == SIZE_MAX) return true;
  run_fail(k, "block %p (%zu bytes) lost its data at offset %zu %s", b->p, b->size, bad, when);
  return false;
}

/* ---- blocks -------------------------------------------------------------- */

static void free_one(worker *k, size_t i, bool plain) {
  tide_allocator *a = k->r->a;
  block b = k->blocks[i];
  if (!verify_block(k, &b, "before its free")) return;
  k->blocks[i] = k->blocks[--k->nblocks];
  uint64_t c = plain ? 0 : tu_below(&k->rng, 10);
  tide_status rc;
  if (c <= 4) {
    op_begin(&k->w, "tide_free");
    rc = tide_free(a, b.p, b.home);
  } else if (c == 5) {
    tide_stream other = k->r->shared[tu_below(&k->rng, SHARED_STREAMS)];
    op_begin(&k->w, "tide_free (another stream)");
    rc = tide_free(a, b.p, other);
  } else if (c == 6) {
    tide_stream other = any_stream(k);
    op_begin(&k->w, "tide_record_stream");
    rc = tide_record_stream(a, b.p, other);
    if (rc == TIDE_OK) {
      op_begin(&k->w, "tide_free (after record_stream)");
      rc = tide_free(a, b.p, b.home);
    }
  } else if (c == 7) {
    op_begin(&k->w, "tide_free_sized");
    rc = tide_free_sized(a, b.p, b.size, b.home);
  } else if (c == 8) {
    op_begin(&k->w, "tide_free_home");
    rc = tide_free_home(a, b.p, k->r->shared[0]);
  } else {
    op_begin(&k->w, "tide_block_info + tide_free");
    void *base = NULL;
    size_t size = 0;
    rc = tide_block_info(a, (char *)b.p + b.size / 2, &base, &size, NULL);
    if (rc == TIDE_OK && (base != b.p || size < b.size)) {
      op_end(&k->w);
      run_fail(k, "tide_block_info(%p + %zu) says %p, %zu bytes", b.p, b.size / 2, base, size);
      return;
    }
    if (rc == TIDE_OK) rc = tide_free(a, b.p, b.home);
  }
  op_end(&k->w);
  expect(k, rc, TIDE_OK, "a free");
}

static void do_malloc(worker *k) {
  if (k->nblocks == MAX_BLOCKS) free_one(k, tu_below(&k->rng, k->nblocks), false);
  if (k->nblocks == MAX_BLOCKS) return;
  size_t size = block_size(k);
  tide_stream s = any_stream(k);
  op_begin(&k->w, "tide_malloc");
  void *p = tide_malloc(k->r->a, size, s);
  op_end(&k->w);
  if (!p) {
    if (tide_last_status() != TIDE_ERR_OOM) {
      run_fail(k, "tide_malloc(%zu) returned NULL with %s: %s", size,
               tide_status_name(tide_last_status()), tide_last_error());
      return;
    }
    k->ooms++;
    while (k->nblocks > MAX_BLOCKS / 2 && !atomic_load(&k->r->stop))
      free_one(k, tu_below(&k->rng, k->nblocks), true);
    return;
  }
  block *b = &k->blocks[k->nblocks++];
  *b = (block){p, size, ++k->seq * MAX_WORKERS + (uint64_t)k->index, s};
  tu_fill(p, size, b->seq, TU_PATTERN_DEFAULT);
}

static void do_free(worker *k) {
  if (k->nblocks) free_one(k, tu_below(&k->rng, k->nblocks), false);
}

static void do_verify(worker *k) {
  for (size_t i = 0; i < k->nblocks; i++)
    if (!verify_block(k, &k->blocks[i], "while it was allocated")) return;
}

/* ---- growable buffers ---------------------------------------------------- */

#define BUF_STEP (64 * TU_KiB) /* the pattern's words are this far apart */

static uint64_t buf_word(const buffer *f, size_t off) {
  return tu_pattern_word((uintptr_t)f->capacity, f->seq, off);
}

/* The pattern over [from, to) of the buffer's data. */
static void buf_fill(buffer *f, size_t from, size_t to) {
  char *base = tide_buf_data(f->b);
  for (size_t off = (from + BUF_STEP - 1) / BUF_STEP * BUF_STEP; off + 8 <= to; off += BUF_STEP)
    *(uint64_t *)(base + off) = buf_word(f, off);
}

static bool buf_verify(worker *k, buffer *f) {
  char *base = tide_buf_data(f->b);
  for (size_t off = 0; off + 8 <= f->valid; off += BUF_STEP) {
    uint64_t want = buf_word(f, off);
    uint64_t got = *(uint64_t *)(base + off);
    /* A ring's pages are mapped twice: the second view reads the same. */
    uint64_t twin = f->ring ? *(uint64_t *)(base + f->capacity + off) : want;
    if (got != want || twin != want) {
      run_fail(k, "buffer %p lost its data at offset %zu: 0x%016llx (view 2: 0x%016llx)",
               (void *)base, off, (unsigned long long)got, (unsigned long long)twin);
      return false;
    }
  }
  return true;
}

static void buf_destroy(worker *k, size_t i) {
  buffer f = k->bufs[i];
  if (!buf_verify(k, &f)) return;
  k->bufs[i] = k->bufs[--k->nbufs];
  tide_status rc;
  if (tu_below(&k->rng, 2)) {
    op_begin(&k->w, "tide_buf_destroy");
    rc = tide_buf_destroy(f.b);
  } else {
    op_begin(&k->w, "tide_buf_destroy_after");
    rc = tide_buf_destroy_after(f.b, f.stream);
  }
  op_end(&k->w);
  expect(k, rc, TIDE_OK, "destroying a growable buffer");
}

static void buf_create(worker *k) {
  tide_buf_options o;
  tide_buf_options_init(&o);
  buffer f = {0};
  f.ring = tu_below(&k->rng, 6) == 0;
  f.stream = tu_below(&k->rng, 2) ? NULL : k->r->shared[tu_below(&k->rng, SHARED_STREAMS)];
  o.stream = f.stream;
  if (f.ring) {
    o.capacity = tu_log_uniform(&k->rng, 2 * TU_MiB, 16 * TU_MiB);
    o.ring = 1;
  } else {
    o.capacity = tu_log_uniform(&k->rng, 64 * TU_MiB, TU_GiB);
    uint64_t ahead = tu_below(&k->rng, 4);
    o.map_ahead = ahead == 0 ? 0 : ahead == 1 ? 2 * TU_MiB : ahead == 2 ? 8 * TU_MiB : 64 * TU_MiB;
    o.async_map_ahead = tu_below(&k->rng, 3) != 0;
    o.map_ahead_fraction = tu_below(&k->rng, 3) == 0 ? 0.25 : 0;
  }
  op_begin(&k->w, f.ring              ? "tide_buf_create (ring)"
                  : o.async_map_ahead ? "tide_buf_create (async map-ahead)"
                                      : "tide_buf_create");
  tide_status rc = tide_buf_create(k->r->a, &o, &f.b);
  op_end(&k->w);
  if (!expect(k, rc, TIDE_ERR_OOM, "tide_buf_create") || rc) return;
  f.capacity = tide_buf_capacity(f.b);
  f.seq = ++k->seq * MAX_WORKERS + (uint64_t)k->index;
  if (f.ring) {
    f.valid = f.capacity;
    buf_fill(&f, 0, f.valid);
  }
  k->bufs[k->nbufs++] = f;
}

static void buf_resize(worker *k, buffer *f) {
  if (!buf_verify(k, f)) return;
  if (f->ring) {
    f->seq++; /* a new pattern through the first view, read through both */
    buf_fill(f, 0, f->valid);
    return;
  }
  size_t most = f->capacity < 40 * TU_MiB ? f->capacity : 40 * TU_MiB;
  size_t length = tu_below(&k->rng, 8) == 0 ? 0 : tu_below(&k->rng, most + 1);
  tide_stream s = tu_below(&k->rng, 4) ? f->stream : any_stream(k);
  tide_status rc;
  if (tu_below(&k->rng, 8) == 0) {
    op_begin(&k->w, "tide_buf_reserve_ahead");
    rc = tide_buf_reserve_ahead(f->b, length);
    op_end(&k->w);
    expect(k, rc, TIDE_ERR_OOM, "tide_buf_reserve_ahead");
    return;
  }
  op_begin(&k->w, "tide_buf_resize");
  rc = tide_buf_resize(f->b, length, s);
  op_end(&k->w);
  if (!expect(k, rc, TIDE_ERR_OOM, "tide_buf_resize") || rc) return;
  if (tide_buf_length(f->b) != length) {
    run_fail(k, "tide_buf_resize(%zu) left the length at %zu", length, tide_buf_length(f->b));
    return;
  }
  if (length < f->valid) f->valid = length;
  buf_fill(f, f->valid, length);
  f->valid = length;
}

static void do_buffers(worker *k) {
  uint64_t c = tu_below(&k->rng, 10);
  if (k->nbufs < MAX_BUFS && (k->nbufs == 0 || c == 0))
    buf_create(k);
  else if (k->nbufs && c == 1)
    buf_destroy(k, tu_below(&k->rng, k->nbufs));
  else if (k->nbufs)
    buf_resize(k, &k->bufs[tu_below(&k->rng, k->nbufs)]);
}

/* ---- capture pools ------------------------------------------------------- */

static void do_capture(worker *k) {
  tide_allocator *a = k->r->a;
  tide_pool *pool = NULL;
  op_begin(&k->w, "tide_pool_create");
  tide_status rc = tide_pool_create(a, &pool);
  op_end(&k->w);
  if (!expect(k, rc, TIDE_OK, "tide_pool_create")) return;
  bool emulated = tu_below(&k->rng, 2) == 0;
  if (emulated) {
    op_begin(&k->w, "tide_host_capture_begin");
    rc = tide_host_capture_begin(a, k->capture);
    op_end(&k->w);
    if (!expect(k, rc, TIDE_OK, "tide_host_capture_begin")) return;
  }
  op_begin(&k->w, "tide_capture_begin");
  rc = tide_capture_begin(a, k->capture, pool);
  op_end(&k->w);
  if (!expect(k, rc, TIDE_OK, "tide_capture_begin")) return;
  block got[8];
  size_t n = 0, want = 1 + tu_below(&k->rng, 8);
  for (size_t i = 0; i < want; i++) {
    size_t size = tu_log_uniform(&k->rng, 512, 3 * TU_MiB);
    bool direct = tu_below(&k->rng, 3) == 0;
    op_begin(&k->w, direct ? "tide_pool_malloc" : "tide_malloc (captured)");
    void *p = direct ? tide_pool_malloc(pool, size, k->capture) : tide_malloc(a, size, k->capture);
    op_end(&k->w);
    if (!p) {
      if (!expect(k, tide_last_status(), TIDE_ERR_OOM, "an allocation in a capture pool")) return;
      continue;
    }
    got[n] = (block){p, size, ++k->seq * MAX_WORKERS + (uint64_t)k->index, k->capture};
    tu_fill(p, size, got[n].seq, TU_PATTERN_DEFAULT);
    n++;
    if (tu_below(&k->rng, 3) == 0) { /* freed inside the capture: the capture may take it again */
      if (!verify_block(k, &got[n - 1], "in its capture")) return;
      op_begin(&k->w, "tide_free (captured)");
      rc = tide_free(a, p, k->capture);
      op_end(&k->w);
      if (!expect(k, rc, TIDE_OK, "a free in a capture")) return;
      n--;
    }
  }
  op_begin(&k->w, "tide_capture_end");
  rc = tide_capture_end(a, k->capture);
  op_end(&k->w);
  if (!expect(k, rc, TIDE_OK, "tide_capture_end")) return;
  if (emulated) {
    op_begin(&k->w, "tide_host_capture_end");
    rc = tide_host_capture_end(a, k->capture);
    op_end(&k->w);
    if (!expect(k, rc, TIDE_OK, "tide_host_capture_end")) return;
  }
  for (size_t i = 0; i < n; i++) {
    if (!verify_block(k, &got[i], "after its capture")) return;
    op_begin(&k->w, "tide_free (a pool's block)");
    rc = tide_free(a, got[i].p, k->capture);
    op_end(&k->w);
    if (!expect(k, rc, TIDE_OK, "freeing a pool's block")) return;
  }
  op_begin(&k->w, "tide_pool_release");
  rc = tide_pool_release(pool);
  op_end(&k->w);
  expect(k, rc, TIDE_OK, "tide_pool_release");
}

/* ---- streams, limits, the cache, stats ----------------------------------- */

static void do_stream_churn(worker *k) {
  tide_allocator *a = k->r->a;
  /* Blocks of the stream stay allocated; they are freed on the default
   * stream from now on. */
  for (size_t i = 0; i < k->nblocks; i++)
    if (k->blocks[i].home == k->own) k->blocks[i].home = NULL;
  op_begin(&k->w, "tide_stream_destroy");
  tide_status rc = tide_stream_destroy(a, k->own);
  op_end(&k->w);
  if (!expect(k, rc, TIDE_OK, "tide_stream_destroy")) return;
  k->own = NULL;
  op_begin(&k->w, "tide_stream_create");
  rc = tide_stream_create(a, &k->own);
  op_end(&k->w);
  expect(k, rc, TIDE_OK, "tide_stream_create");
}

static void do_synchronize(worker *k) {
  tide_stream s = any_stream(k);
  op_begin(&k->w, "tide_stream_synchronize");
  tide_status rc = tide_stream_synchronize(k->r->a, s);
  op_end(&k->w);
  expect(k, rc, TIDE_OK, "tide_stream_synchronize");
}

static void do_limits(worker *k) {
  tide_allocator *a = k->r->a;
  static const size_t limits[] = {0, 0, 3 * TU_GiB / 2, 768 * TU_MiB};
  static const double fractions[] = {1.0, 1.0, 0.75, 0.5};
  tide_status rc;
  if (tu_below(&k->rng, 2)) {
    op_begin(&k->w, "tide_set_memory_limit");
    rc = tide_set_memory_limit(a, limits[tu_below(&k->rng, 4)]);
  } else {
    op_begin(&k->w, "tide_set_memory_fraction");
    rc = tide_set_memory_fraction(a, fractions[tu_below(&k->rng, 4)]);
  }
  op_end(&k->w);
  expect(k, rc, TIDE_OK, "changing the memory limit");
}

static void do_stats(worker *k) {
  tide_allocator *a = k->r->a;
  tide_status rc;
  uint64_t c = tu_below(&k->rng, 4);
  if (c == 0) {
    tide_stats st;
    op_begin(&k->w, "tide_get_stats");
    rc = tide_get_stats(a, &st);
  } else if (c == 1) {
    char *text = NULL;
    size_t len = 0;
    op_begin(&k->w, "tide_snapshot_json");
    rc = tide_snapshot_json(a, &text, &len);
    if (rc == TIDE_OK) tide_string_free(text);
  } else if (c == 2) {
    tide_layout layout;
    op_begin(&k->w, "tide_layout_get");
    rc = tide_layout_get(a, &layout);
    if (rc == TIDE_OK) tide_layout_free(&layout);
  } else {
    op_begin(&k->w, "tide_check");
    rc = tide_check(a);
  }
  op_end(&k->w);
  expect(k, rc, TIDE_OK, "reading the stats");
}

static void do_empty_cache(worker *k) {
  op_begin(&k->w, "tide_empty_cache");
  tide_status rc = tide_empty_cache(k->r->a);
  op_end(&k->w);
  expect(k, rc, TIDE_OK, "tide_empty_cache");
}

/* ---- the threads --------------------------------------------------------- */

static void *worker_main(void *arg) {
  worker *k = arg;
  char name[16];
  snprintf(name, sizeof name, "worker %d", k->index);
  watch_add(&k->w, name);
  tide_allocator *a = k->r->a;
  expect(k, tide_stream_create(a, &k->own), TIDE_OK, "tide_stream_create");
  expect(k, tide_stream_create(a, &k->capture), TIDE_OK, "tide_stream_create");
  while (!atomic_load(&k->r->stop)) {
    uint64_t c = tu_below(&k->rng, 100);
    if (c < 34)
      do_malloc(k);
    else if (c < 60)
      do_free(k);
    else if (c < 64)
      do_verify(k);
    else if (c < 78)
      do_buffers(k);
    else if (c < 83)
      do_capture(k);
    else if (c < 86) {
      /* A destroyed stream's arena stays in the allocator's table, and
       * every walk over the table (tide_check, empty_cache, the out-of-
       * memory path) pays for it: few streams go, so a long run stays
       * about as fast as a short one. */
      if (tu_below(&k->rng, 8) == 0)
        do_stream_churn(k);
      else
        do_synchronize(k);
    } else if (c < 89)
      do_synchronize(k);
    else if (c < 91)
      do_limits(k);
    else if (c < 97)
      do_stats(k);
    else
      do_empty_cache(k);
  }
  /* Everything goes back; what the run left is checked by tide_destroy. */
  while (k->nblocks) free_one(k, k->nblocks - 1, true);
  while (k->nbufs) buf_destroy(k, k->nbufs - 1);
  op_begin(&k->w, "tide_stream_destroy (at the end)");
  expect(k, tide_stream_destroy(a, k->own), TIDE_OK, "tide_stream_destroy");
  expect(k, tide_stream_destroy(a, k->capture), TIDE_OK, "tide_stream_destroy");
  op_end(&k->w);
  atomic_store(&k->w.running, false);
  return NULL;
}

static void *checker_main(void *arg) {
  run *r = arg;
  watch_add(&r->checker, "checker");
  worker as = {.r = r};
  snprintf(as.w.name, sizeof as.w.name, "checker");
  while (!atomic_load(&r->stop)) {
    op_begin(&r->checker, "tide_check");
    tide_status rc = tide_check(r->a);
    op_end(&r->checker);
    atomic_fetch_add(&r->checks, 1);
    if (!expect(&as, rc, TIDE_OK, "tide_check while the others run")) break;
  }
  atomic_store(&r->checker.running, false);
  return NULL;
}

static uint64_t chaos_seed;

static void test_chaos(void **state) {
  (void)state;
  double seconds = (double)tu_env_u64("TIDE_CHAOS_SECONDS", 3);
  int nworkers = (int)tu_env_u64("TIDE_CHAOS_THREADS", 4);
  if (nworkers < 1) nworkers = 1;
  if (nworkers > MAX_WORKERS) nworkers = MAX_WORKERS;
  printf("chaos: seed %" PRIu64 " (TIDE_CHAOS_SEED=%" PRIu64 " repeats it), %.0f s, %d workers "
         "and a checker\n",
         chaos_seed, chaos_seed, seconds, nworkers);
  fflush(stdout);
  static run r; /* large: off the stack */
  memset(&r, 0, sizeof r);
  pthread_mutex_init(&r.failure_lock, NULL);
  r.a = tu_create(CONFIG);
  r.nworkers = nworkers;
  for (int i = 0; i < SHARED_STREAMS; i++) tu_assert_ok(tide_stream_create(r.a, &r.shared[i]));
  watchdog_start();
  pthread_t checker;
  assert_int_equal(pthread_create(&checker, NULL, checker_main, &r), 0);
  for (int i = 0; i < nworkers; i++) {
    worker *k = &r.workers[i];
    k->r = &r;
    k->index = i;
    tu_rng_seed(&k->rng, chaos_seed * 1000003u + (uint64_t)i);
    assert_int_equal(pthread_create(&k->tid, NULL, worker_main, k), 0);
  }
  uint64_t end = now_ns() + (uint64_t)(seconds * 1e9), next_report = now_ns() + 60000000000u;
  while (now_ns() < end && !atomic_load(&r.stop)) {
    usleep(20 * 1000);
    if (now_ns() >= next_report) {
      uint64_t ops = 0;
      for (int i = 0; i < nworkers; i++) ops += atomic_load(&r.workers[i].w.ops);
      printf("chaos: %" PRIu64 " calls, %" PRIu64 " checks so far\n", ops, atomic_load(&r.checks));
      fflush(stdout);
      next_report += 60000000000u;
    }
  }
  atomic_store(&r.stop, true);
  for (int i = 0; i < nworkers; i++) pthread_join(r.workers[i].tid, NULL);
  pthread_join(checker, NULL);
  watchdog_stop();
  uint64_t ops = 0, ooms = 0;
  for (int i = 0; i < nworkers; i++) {
    ops += atomic_load(&r.workers[i].w.ops);
    ooms += r.workers[i].ooms;
  }
  printf("chaos: %" PRIu64 " calls, %" PRIu64 " checks, %" PRIu64 " allocations out of memory\n",
         ops, atomic_load(&r.checks), ooms);
  if (atomic_load(&r.failures)) fail_msg("chaos (seed %" PRIu64 "): %s", chaos_seed, r.failure);
  tu_assert_ok(tide_set_memory_limit(r.a, 0));
  tu_assert_ok(tide_set_memory_fraction(r.a, 1.0));
  /* Frees ordered on streams are done once those are waited for. */
  tu_assert_ok(tide_stream_synchronize(r.a, NULL));
  for (int i = 0; i < SHARED_STREAMS; i++) tu_assert_ok(tide_stream_synchronize(r.a, r.shared[i]));
  tu_assert_ok(tide_check(r.a));
  for (int i = 0; i < SHARED_STREAMS; i++) tu_assert_ok(tide_stream_destroy(r.a, r.shared[i]));
  tu_assert_ok(tide_destroy(r.a)); /* nothing left: no leak reported */
  pthread_mutex_destroy(&r.failure_lock);
}

/* ------------------------------------------------------------------------ */
/* The deadlock the chaos run found, by itself                               */
/* ------------------------------------------------------------------------ */

typedef struct check_loop {
  watched w;
  tide_allocator *a;
  atomic_bool stop;
  tide_status failed;
} check_loop;

static void *check_loop_main(void *arg) {
  check_loop *c = arg;
  watch_add(&c->w, "checker");
  while (!atomic_load(&c->stop)) {
    op_begin(&c->w, "tide_check");
    tide_status rc = tide_check(c->a);
    op_end(&c->w);
    if (rc != TIDE_OK) {
      c->failed = rc;
      break;
    }
  }
  atomic_store(&c->w.running, false);
  return NULL;
}

/* tide_check while a buffer that maps ahead on its worker is destroyed:
 * the check once waited for that worker holding the capture, arena-table
 * and buffer-list locks, and the destroy (which stops the worker) waited
 * for the list. */
static void test_check_while_async_buffer_destroyed(void **state) {
  (void)state;
  tide_allocator *a = tu_create(CONFIG);
  static check_loop c;
  memset(&c, 0, sizeof c);
  c.a = a;
  watchdog_start();
  static watched self;
  watch_add(&self, "main");
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, check_loop_main, &c), 0);
  for (int i = 0; i < 200 && !c.failed; i++) {
    tide_buf_options o;
    tide_buf_options_init(&o);
    o.capacity = TU_GiB;
    o.map_ahead = 64 * TU_MiB;
    o.async_map_ahead = 1;
    tide_buf *b = NULL;
    op_begin(&self, "tide_buf_create");
    tu_assert_ok(tide_buf_create(a, &o, &b));
    op_begin(&self, "tide_buf_resize");
    tu_assert_ok(tide_buf_resize(b, 4096, NULL));
    op_begin(&self, "tide_buf_destroy");
    tu_assert_ok(tide_buf_destroy(b));
    op_end(&self);
    /* A slow path the stuck check would block too. */
    void *p = tide_malloc(a, 4096, NULL);
    assert_non_null(p);
    op_begin(&self, "tide_record_stream");
    tu_assert_ok(tide_record_stream(a, p, NULL));
    op_end(&self);
    tu_assert_ok(tide_free(a, p, NULL));
  }
  atomic_store(&c.stop, true);
  pthread_join(t, NULL);
  atomic_store(&self.running, false);
  watchdog_stop();
  if (c.failed) fail_msg("tide_check failed: %s", tide_status_name(c.failed));
  tu_assert_ok(tide_destroy(a));
}

int main(int argc, char **argv) {
  chaos_seed = argc > 1 ? strtoull(argv[1], NULL, 0)
                        : tu_env_u64("TIDE_CHAOS_SEED", (uint64_t)time(NULL) ^ (uint64_t)getpid());
  /* TIDE_CHAOS_ONLY=test_chaos runs that test alone (a soak). */
  if (getenv("TIDE_CHAOS_ONLY")) cmocka_set_test_filter(getenv("TIDE_CHAOS_ONLY"));
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_check_while_async_buffer_destroyed),
      cmocka_unit_test(test_chaos),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
