/* test_stress.c: many threads on one allocator, checked as they go.
 *
 * Eight threads share five streams (four created, plus the default stream),
 * or sixteen share four, and run a seeded random mix of operations:
 * allocations of log-uniform sizes from 512 B to 8 MiB (a few up to 64 MiB),
 * frees on the allocation's stream and on others, tide_record_stream,
 * tide_free_sized, occasional tide_empty_cache, holds of a stream with frees
 * pending on it, and tide_check (the consistency check) while the other
 * threads run. Checked:
 * - no two live blocks overlap (a sorted interval set under a test mutex);
 * - every block keeps the data written into it until it is freed;
 * - at quiescent points (all threads joined) the statistics equal the sums
 *   over the live blocks, tide_check passes, and once everything is freed
 *   and the cache emptied, nothing stays allocated, reserved or held by the
 *   device;
 * - with a small device, a NULL from tide_malloc is TIDE_ERR_OOM with an
 *   "out of memory" message, and the allocator keeps working after it.
 *
 * Each of four configurations (expandable segments, fixed segments, and
 * both on a 1 GiB device) runs TIDE_STRESS_OPS operations over all threads:
 * 1,000,000 by default, 250,000 under AddressSanitizer or ThreadSanitizer,
 * which run it several times slower; the sixteen-thread one runs half as
 * many. TIDE_STRESS_SEED changes the seed. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "testutil.h"

/* Sanitized builds run many times slower: they do fewer operations. */
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
#define UNDER_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
#define UNDER_SANITIZER 1
#endif
#endif
#ifndef UNDER_SANITIZER
#define UNDER_SANITIZER 0
#endif

#define MAX_THREADS 16
#define MAX_STREAMS 5 /* [0] is the default stream */
#define PHASES 4
#define DEFAULT_OPS (UNDER_SANITIZER ? 250000u : 1000000u)

/* ------------------------------------------------------------------------ */
/* The run and its workers                                                   */
/* ------------------------------------------------------------------------ */

typedef struct live_block {
  void *ptr;
  size_t requested;
  size_t size; /* the block's size, from tide_block_info */
  uint64_t seq;
  tide_stream stream;
} live_block;

typedef struct interval {
  uintptr_t lo, hi;
  int owner;
} interval;

struct stress_run;

typedef struct worker {
  struct stress_run *run;
  int index;
  tu_rng rng;
  tide_stream home;
  live_block *live;
  size_t nlive;
  uint64_t next_seq;
  uint64_t ops, mallocs, frees, cross_frees, sized_frees, records, empties, holds, ooms;
} worker;

typedef struct stress_setup {
  const char *name;
  const char *conf;
  size_t max_live;    /* live blocks per thread */
  bool small_device;  /* OOMs are expected (and required) */
  int threads;        /* at most MAX_THREADS */
  int streams;        /* with the default stream; at most MAX_STREAMS */
  unsigned ops_share; /* percent of TIDE_STRESS_OPS this run does (0: all) */
} stress_setup;

typedef struct stress_run {
  const stress_setup *setup;
  tide_allocator *a;
  tide_stream streams[MAX_STREAMS];
  int nthreads, nstreams;
  uint64_t ops_per_phase; /* per thread */
  worker workers[MAX_THREADS];

  pthread_mutex_t set_mutex; /* the live intervals of all threads */
  interval *set;
  size_t nset, set_cap;

  /* Holds in progress are started - ended; read in this order to know that
   * no stream was held during a call. */
  _Atomic uint64_t holds_started, holds_ended;

  atomic_bool failed;
  pthread_mutex_t fail_mutex;
  char failure[2048];
} stress_run;

/* cmocka's assertions jump to the main thread's context, so the workers
 * record the first failure and stop; the main thread reports it. */
__attribute__((format(printf, 2, 3))) static void worker_fail(stress_run *run, const char *fmt,
                                                              ...) {
  pthread_mutex_lock(&run->fail_mutex);
  if (!atomic_load(&run->failed)) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(run->failure, sizeof run->failure, fmt, args);
    va_end(args);
    atomic_store(&run->failed, true);
  }
  pthread_mutex_unlock(&run->fail_mutex);
}

/* ------------------------------------------------------------------------ */
/* The interval set                                                          */
/* ------------------------------------------------------------------------ */

/* Index of the first interval with lo >= addr. */
static size_t set_lower_bound(const stress_run *run, uintptr_t addr) {
  size_t lo = 0, hi = run->nset;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (run->set[mid].lo < addr)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

static bool set_insert(stress_run *run, uintptr_t lo, size_t size, int owner) {
  bool ok = true;
  pthread_mutex_lock(&run->set_mutex);
  size_t i = set_lower_bound(run, lo);
  const interval *prev = i > 0 ? &run->set[i - 1] : NULL;
  const interval *next = i < run->nset ? &run->set[i] : NULL;
  const interval *hit = (prev && prev->hi > lo)          ? prev
                        : (next && next->lo < lo + size) ? next
                                                         : NULL;
  if (hit) {
    worker_fail(run,
                "overlap: block [%#lx, %#lx) of thread %d overlaps live block [%#lx, %#lx) "
                "of thread %d",
                (unsigned long)lo, (unsigned long)(lo + size), owner, (unsigned long)hit->lo,
                (unsigned long)hit->hi, hit->owner);
    ok = false;
  } else {
    if (run->nset == run->set_cap) {
      size_t cap = run->set_cap ? run->set_cap * 2 : 1024;
      interval *grown = realloc(run->set, cap * sizeof *grown);
      if (!grown) {
        pthread_mutex_unlock(&run->set_mutex);
        worker_fail(run, "out of host memory for the interval set");
        return false;
      }
      run->set = grown;
      run->set_cap = cap;
    }
    memmove(&run->set[i + 1], &run->set[i], (run->nset - i) * sizeof *run->set);
    run->set[i] = (interval){.lo = lo, .hi = lo + size, .owner = owner};
    run->nset++;
  }
  pthread_mutex_unlock(&run->set_mutex);
  return ok;
}

static void set_remove(stress_run *run, uintptr_t lo) {
  pthread_mutex_lock(&run->set_mutex);
  size_t i = set_lower_bound(run, lo);
  if (i < run->nset && run->set[i].lo == lo) {
    memmove(&run->set[i], &run->set[i + 1], (run->nset - i - 1) * sizeof *run->set);
    run->nset--;
  } else {
    worker_fail(run, "block %#lx is missing from the interval set", (unsigned long)lo);
  }
  pthread_mutex_unlock(&run->set_mutex);
}

/* ------------------------------------------------------------------------ */
/* Operations                                                                */
/* ------------------------------------------------------------------------ */

static tide_stream pick_stream(worker *w) {
  if (tu_below(&w->rng, 4) != 0) return w->home;
  return w->run->streams[tu_below(&w->rng, (uint64_t)w->run->nstreams)];
}

static tide_stream other_stream(worker *w, tide_stream not_this) {
  for (;;) {
    tide_stream s = w->run->streams[tu_below(&w->rng, (uint64_t)w->run->nstreams)];
    if (s != not_this) return s;
  }
}

static size_t pick_size(worker *w) {
  if (tu_below(&w->rng, 100) == 0) return tu_log_uniform(&w->rng, 16 * TU_MiB, 64 * TU_MiB);
  return tu_log_uniform(&w->rng, 512, 8 * TU_MiB);
}

/* Free live block k on `stream` after checking its data. */
static bool free_block(worker *w, size_t k, tide_stream stream) {
  stress_run *run = w->run;
  live_block b = w->live[k];
  size_t bad = tu_check(b.ptr, b.requested, b.seq, TU_PATTERN_DEFAULT);
  if (bad != SIZE_MAX) {
    worker_fail(run, "thread %d: block %p (%zu bytes, seq %llu) lost its data at offset %zu",
                w->index, b.ptr, b.requested, (unsigned long long)b.seq, bad);
    return false;
  }
  /* Out of the set first: once freed, another thread may get the memory. */
  set_remove(run, (uintptr_t)b.ptr);
  bool sized = tu_below(&w->rng, 4) == 0;
  tide_status rc = sized ? tide_free_sized(run->a, b.ptr, b.requested, stream)
                         : tide_free(run->a, b.ptr, stream);
  if (rc != TIDE_OK) {
    worker_fail(run, "thread %d: freeing %p (%zu bytes) on stream %p: %s: %s", w->index, b.ptr,
                b.requested, (void *)stream, tide_status_name(rc), tide_last_error());
    return false;
  }
  w->live[k] = w->live[--w->nlive];
  w->frees++;
  w->sized_frees += sized;
  w->cross_frees += stream != b.stream;
  return true;
}

static bool free_random(worker *w) {
  if (w->nlive == 0) return true;
  size_t k = tu_below(&w->rng, w->nlive);
  tide_stream s = w->live[k].stream;
  if (tu_below(&w->rng, 5) == 0) s = other_stream(w, s);
  return free_block(w, k, s);
}

static bool check_oom(worker *w, size_t size) {
  stress_run *run = w->run;
  tide_status st = tide_last_status();
  const char *msg = tide_last_error();
  if (!run->setup->small_device) {
    worker_fail(run, "thread %d: tide_malloc(%zu) failed on a large device: %s: %s", w->index, size,
                tide_status_name(st), msg);
    return false;
  }
  if (st != TIDE_ERR_OOM || !strstr(msg, "out of memory")) {
    worker_fail(run,
                "thread %d: tide_malloc(%zu) returned NULL with %s, expected "
                "TIDE_ERR_OOM and \"out of memory\": \"%s\"",
                w->index, size, tide_status_name(st), msg);
    return false;
  }
  w->ooms++;
  return free_random(w); /* make room and go on */
}

static bool malloc_block(worker *w, tide_stream stream, size_t size) {
  stress_run *run = w->run;
  void *p = tide_malloc(run->a, size, stream);
  if (!p) return check_oom(w, size);
  void *base = NULL;
  size_t bsize = 0;
  tide_stream bstream = (tide_stream)(uintptr_t)1;
  tide_status rc = tide_block_info(run->a, p, &base, &bsize, &bstream);
  if (rc != TIDE_OK || base != p || bsize < size || bstream != stream || (uintptr_t)p % 512) {
    worker_fail(run,
                "thread %d: block %p of %zu bytes on stream %p: tide_block_info says %s, "
                "base %p, size %zu, stream %p (%s)",
                w->index, p, size, (void *)stream, tide_status_name(rc), base, bsize,
                (void *)bstream, tide_last_error());
    return false;
  }
  if (!set_insert(run, (uintptr_t)p, bsize, w->index)) return false;
  uint64_t seq = ((uint64_t)w->index << 48) | w->next_seq++;
  tu_fill(p, size, seq, TU_PATTERN_DEFAULT);
  w->live[w->nlive++] = (live_block){p, size, bsize, seq, stream};
  w->mallocs++;
  return true;
}

static bool record_random(worker *w) {
  stress_run *run = w->run;
  if (w->nlive == 0) return true;
  live_block *b = &w->live[tu_below(&w->rng, w->nlive)];
  tide_stream s = run->streams[tu_below(&w->rng, (uint64_t)run->nstreams)];
  tide_status rc = tide_record_stream(run->a, b->ptr, s);
  if (rc != TIDE_OK) {
    worker_fail(run, "thread %d: tide_record_stream(%p, %p): %s: %s", w->index, b->ptr, (void *)s,
                tide_status_name(rc), tide_last_error());
    return false;
  }
  w->records++;
  return true;
}

/* tide_empty_cache may only fail while some stream is held. */
static bool empty_cache(worker *w) {
  stress_run *run = w->run;
  uint64_t ended = atomic_load(&run->holds_ended);
  uint64_t started = atomic_load(&run->holds_started);
  tide_status rc = tide_empty_cache(run->a);
  bool none_held = started == ended && atomic_load(&run->holds_started) == started;
  w->empties++;
  if (rc == TIDE_OK) return true;
  if (none_held || rc != TIDE_ERR_NOT_READY || !strstr(tide_last_error(), "held")) {
    worker_fail(run, "thread %d: tide_empty_cache: %s (%s a stream was held): %s", w->index,
                tide_status_name(rc), none_held ? "no" : "while", tide_last_error());
    return false;
  }
  return true;
}

/* Hold a created stream, free a few blocks on it (frees on another stream
 * than the allocation's stay pending while it is held), allocate on it,
 * maybe empty the cache meanwhile, then release it. */
static bool hold_stream(worker *w) {
  stress_run *run = w->run;
  tide_stream s = run->streams[1 + tu_below(&w->rng, (uint64_t)run->nstreams - 1)];
  atomic_fetch_add(&run->holds_started, 1);
  tide_status rc = tide_host_stream_hold(run->a, s);
  bool ok = rc == TIDE_OK;
  if (!ok)
    worker_fail(run, "thread %d: tide_host_stream_hold(%p): %s: %s", w->index, (void *)s,
                tide_status_name(rc), tide_last_error());
  for (int i = 0; ok && i < 3 && w->nlive; i++) ok = free_block(w, tu_below(&w->rng, w->nlive), s);
  if (ok && w->nlive < run->setup->max_live) ok = malloc_block(w, s, pick_size(w));
  if (ok && tu_below(&w->rng, 4) == 0) ok = empty_cache(w);
  rc = tide_host_stream_release(run->a, s);
  atomic_fetch_add(&run->holds_ended, 1);
  if (ok && rc != TIDE_OK) {
    worker_fail(run, "thread %d: tide_host_stream_release(%p): %s: %s", w->index, (void *)s,
                tide_status_name(rc), tide_last_error());
    ok = false;
  }
  w->holds++;
  return ok;
}

/* The consistency check while the other threads keep working: it takes
 * every lock of the allocator, so it must see a consistent state. */
static bool check_now(worker *w) {
  stress_run *run = w->run;
  if (tide_check(run->a) == TIDE_OK) return true;
  worker_fail(run, "thread %d: tide_check while the others run: %s", w->index, tide_last_error());
  return false;
}

static bool one_op(worker *w) {
  const stress_setup *setup = w->run->setup;
  uint64_t dice = tu_below(&w->rng, 100000);
  if (dice < 25) return hold_stream(w);
  if (dice < 35) return empty_cache(w);
  if (dice < 40) return check_now(w);
  if (dice < 5000) return record_random(w);
  bool room = w->nlive < setup->max_live;
  if (room && (w->nlive == 0 || dice < 55000)) return malloc_block(w, pick_stream(w), pick_size(w));
  return free_random(w);
}

static void *work(void *arg) {
  worker *w = arg;
  for (uint64_t i = 0; i < w->run->ops_per_phase && !atomic_load(&w->run->failed); i++) {
    if (!one_op(w)) break;
    w->ops++;
  }
  return NULL;
}

/* Free everything, on the allocation's stream or another. */
static void *drain(void *arg) {
  worker *w = arg;
  while (w->nlive && !atomic_load(&w->run->failed)) {
    size_t k = w->nlive - 1;
    tide_stream s = w->live[k].stream;
    if (tu_below(&w->rng, 3) == 0) s = other_stream(w, s);
    if (!free_block(w, k, s)) break;
  }
  return NULL;
}

static void run_threads(stress_run *run, void *(*fn)(void *)) {
  pthread_t threads[MAX_THREADS];
  for (int i = 0; i < run->nthreads; i++)
    assert_int_equal(pthread_create(&threads[i], NULL, fn, &run->workers[i]), 0);
  for (int i = 0; i < run->nthreads; i++) assert_int_equal(pthread_join(threads[i], NULL), 0);
  if (atomic_load(&run->failed)) fail_msg("%s: %s", run->setup->name, run->failure);
}

/* ------------------------------------------------------------------------ */
/* Quiescent checks                                                          */
/* ------------------------------------------------------------------------ */

static int by_ptr(const void *x, const void *y) {
  uintptr_t a = (uintptr_t)((const live_block *)x)->ptr,
            b = (uintptr_t)((const live_block *)y)->ptr;
  return (a > b) - (a < b);
}

/* With all threads joined: every live block is intact, where it was and as
 * large; none overlaps another; the statistics are the sums over them. */
static void check_quiescent(stress_run *run) {
  size_t count = 0;
  for (int i = 0; i < run->nthreads; i++) count += run->workers[i].nlive;
  live_block *all = malloc((count ? count : 1) * sizeof *all);
  assert_non_null(all);
  size_t n = 0;
  int64_t bytes = 0, requested = 0;
  for (int i = 0; i < run->nthreads; i++)
    for (size_t k = 0; k < run->workers[i].nlive; k++) {
      live_block b = run->workers[i].live[k];
      void *base = NULL;
      size_t size = 0;
      tide_stream stream = NULL;
      tu_assert_ok(tide_block_info(run->a, b.ptr, &base, &size, &stream));
      assert_ptr_equal(base, b.ptr);
      assert_int_equal(size, b.size);
      assert_ptr_equal(stream, b.stream);
      tu_assert_pattern(b.ptr, b.requested, b.seq, TU_PATTERN_DEFAULT);
      bytes += (int64_t)b.size;
      requested += (int64_t)b.requested;
      all[n++] = b;
    }
  qsort(all, n, sizeof *all, by_ptr);
  for (size_t k = 1; k < n; k++)
    if ((uintptr_t)all[k - 1].ptr + all[k - 1].size > (uintptr_t)all[k].ptr)
      fail_msg("%s: blocks %p (+%zu) and %p overlap", run->setup->name, all[k - 1].ptr,
               all[k - 1].size, all[k].ptr);
  free(all);
  assert_int_equal(run->nset, n);

  tide_stats st = tu_stats(run->a);
  assert_int_equal(st.allocated_bytes[TIDE_POOL_ALL].current, bytes);
  assert_int_equal(st.requested_bytes[TIDE_POOL_ALL].current, requested);
  assert_int_equal(st.allocations[TIDE_POOL_ALL].current, (int64_t)n);
  assert_int_equal(st.allocated_bytes[TIDE_POOL_SMALL].current +
                       st.allocated_bytes[TIDE_POOL_LARGE].current,
                   bytes);
  assert_int_equal(st.num_allocs - st.num_frees, n);
  assert_true(st.reserved_bytes[TIDE_POOL_ALL].current >= bytes);
  assert_true(st.active_bytes[TIDE_POOL_ALL].current >= bytes);
  assert_true(st.allocated_bytes[TIDE_POOL_ALL].peak >= bytes);
  /* No backend call failed, so what the allocator counts as reserved is
   * exactly what the device holds. */
  assert_int_equal((uint64_t)st.reserved_bytes[TIDE_POOL_ALL].current,
                   tide_host_bytes_in_use(run->a));
  if (tide_check(run->a) != TIDE_OK) fail_msg("%s: %s", run->setup->name, tide_last_error());
}

/* ------------------------------------------------------------------------ */
/* Runs                                                                      */
/* ------------------------------------------------------------------------ */

static double seconds_since(const struct timespec *t0) {
  struct timespec t1;
  clock_gettime(CLOCK_MONOTONIC, &t1);
  return (double)(t1.tv_sec - t0->tv_sec) + (double)(t1.tv_nsec - t0->tv_nsec) * 1e-9;
}

static void stress(const stress_setup *setup) {
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  uint64_t total_ops = tu_env_u64("TIDE_STRESS_OPS", DEFAULT_OPS);
  uint64_t seed = tu_env_u64("TIDE_STRESS_SEED", 20240611);
  stress_run *run = calloc(1, sizeof *run);
  assert_non_null(run);
  run->setup = setup;
  run->a = tu_create(setup->conf);
  run->nthreads = setup->threads;
  run->nstreams = setup->streams;
  assert_true(run->nthreads >= 1 && run->nthreads <= MAX_THREADS);
  assert_true(run->nstreams >= 2 && run->nstreams <= MAX_STREAMS);
  if (setup->ops_share) total_ops = total_ops * setup->ops_share / 100;
  run->ops_per_phase = total_ops / (uint64_t)run->nthreads / PHASES;
  if (run->ops_per_phase == 0) run->ops_per_phase = 1;
  pthread_mutex_init(&run->set_mutex, NULL);
  pthread_mutex_init(&run->fail_mutex, NULL);
  run->streams[0] = NULL;
  for (int s = 1; s < run->nstreams; s++)
    tu_assert_ok(tide_stream_create(run->a, &run->streams[s]));
  for (int i = 0; i < run->nthreads; i++) {
    worker *w = &run->workers[i];
    w->run = run;
    w->index = i;
    tu_rng_seed(&w->rng, seed * 1000003u + (uint64_t)i);
    w->home = run->streams[i % run->nstreams]; /* threads i, i+streams, ... share one */
    w->live = calloc(setup->max_live, sizeof *w->live);
    assert_non_null(w->live);
  }

  for (int phase = 0; phase < PHASES; phase++) {
    run_threads(run, work);
    check_quiescent(run);
  }
  run_threads(run, drain);
  check_quiescent(run);

  tu_assert_ok(tide_empty_cache(run->a));
  tide_stats st = tu_stats(run->a);
  assert_int_equal(st.allocated_bytes[TIDE_POOL_ALL].current, 0);
  assert_int_equal(st.requested_bytes[TIDE_POOL_ALL].current, 0);
  assert_int_equal(st.allocations[TIDE_POOL_ALL].current, 0);
  assert_int_equal(st.active_bytes[TIDE_POOL_ALL].current, 0);
  assert_int_equal(st.reserved_bytes[TIDE_POOL_ALL].current, 0);
  assert_int_equal(st.segments[TIDE_POOL_ALL].current, 0);
  assert_int_equal(tide_host_bytes_in_use(run->a), 0);
  assert_int_equal(st.num_allocs, st.num_frees);

  uint64_t sum[9] = {0};
  for (int i = 0; i < run->nthreads; i++) {
    worker *w = &run->workers[i];
    uint64_t v[9] = {w->ops,     w->mallocs, w->frees, w->cross_frees, w->sized_frees,
                     w->records, w->empties, w->holds, w->ooms};
    for (int k = 0; k < 9; k++) sum[k] += v[k];
  }
  assert_int_equal(st.num_allocs, sum[1]);
  assert_int_equal(st.num_frees, sum[2]);
  /* The mix must have done what it is for: every kind of operation and,
   * on the small device, running out of memory happen hundreds of times in
   * a full run (a short one, TIDE_STRESS_OPS below 100000, may miss some). */
  bool full_run = total_ops >= 100000;
  if (full_run) assert_true(sum[3] > 0 && sum[5] > 0 && sum[6] > 0 && sum[7] > 0);
  if (setup->small_device) {
    if (full_run) assert_true(sum[8] > 0);
    assert_true(st.num_ooms >= sum[8]);
    assert_true(st.num_alloc_retries >= st.num_ooms);
  } else {
    assert_int_equal(st.num_ooms, 0);
  }
  print_message("%s: %llu ops (%llu mallocs, %llu frees of which %llu on another stream and "
                "%llu sized, %llu records, %llu empty_cache, %llu holds, %llu OOMs; %llu "
                "retries, peak reserved %.1f MiB) in %.1f s, seed %llu\n",
                setup->name, (unsigned long long)sum[0], (unsigned long long)sum[1],
                (unsigned long long)sum[2], (unsigned long long)sum[3], (unsigned long long)sum[4],
                (unsigned long long)sum[5], (unsigned long long)sum[6], (unsigned long long)sum[7],
                (unsigned long long)sum[8], (unsigned long long)st.num_alloc_retries,
                (double)st.reserved_bytes[TIDE_POOL_ALL].peak / (double)TU_MiB, seconds_since(&t0),
                (unsigned long long)seed);

  for (int s = 1; s < run->nstreams; s++)
    tu_assert_ok(tide_stream_destroy(run->a, run->streams[s]));
  tu_assert_ok(tide_destroy(run->a));
  for (int i = 0; i < run->nthreads; i++) free(run->workers[i].live);
  free(run->set);
  pthread_mutex_destroy(&run->set_mutex);
  pthread_mutex_destroy(&run->fail_mutex);
  free(run);
}

static void stress_expandable(void **state) {
  (void)state;
  static const stress_setup setup = {.name = "expandable segments",
                                     .conf = "expandable_segments:True",
                                     .max_live = 48,
                                     .threads = 8,
                                     .streams = 5};
  stress(&setup);
}

static void stress_fixed(void **state) {
  (void)state;
  static const stress_setup setup = {.name = "fixed segments",
                                     .conf = "expandable_segments:False,roundup_power2_divisions:4",
                                     .max_live = 48,
                                     .threads = 8,
                                     .streams = 5};
  stress(&setup);
}

static void stress_small_device_expandable(void **state) {
  (void)state;
  static const stress_setup setup = {.name = "1 GiB device, expandable segments",
                                     .conf = "host_capacity:1GiB,expandable_segments:True,"
                                             "release_holes:True",
                                     .max_live = 160,
                                     .small_device = true,
                                     .threads = 8,
                                     .streams = 5};
  stress(&setup);
}

static void stress_small_device_fixed(void **state) {
  (void)state;
  static const stress_setup setup = {.name = "1 GiB device, fixed segments",
                                     .conf = "host_capacity:1GiB,expandable_segments:False,"
                                             "garbage_collection_threshold:0.8",
                                     .max_live = 160,
                                     .small_device = true,
                                     .threads = 8,
                                     .streams = 5};
  stress(&setup);
}

/* Sixteen threads on four streams (the default and three created), four
 * to a stream, on a device small enough that they run out of memory: the
 * out-of-memory path of one thread empties the caches of every stream while
 * the others allocate. Half the operations of the others, so that it stays
 * short under ThreadSanitizer on a small machine. */
static void stress_16_threads_4_streams(void **state) {
  (void)state;
  static const stress_setup setup = {.name = "16 threads, 4 streams, 1 GiB device",
                                     .conf = "host_capacity:1GiB,expandable_segments:True",
                                     .max_live = 64,
                                     .small_device = true,
                                     .threads = 16,
                                     .streams = 4,
                                     .ops_share = 50};
  stress(&setup);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(stress_expandable),
      cmocka_unit_test(stress_fixed),
      cmocka_unit_test(stress_small_device_expandable),
      cmocka_unit_test(stress_small_device_fixed),
      cmocka_unit_test(stress_16_threads_4_streams),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
