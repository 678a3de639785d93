/* micro.c: `tidalloc micro`, the latency of allocating and freeing, for
 * tidalloc's cached path next to other allocators (the anchors).
 *
 * Workloads: `pair` allocates and frees one size in a loop (one op = one
 * alloc+free pair); `mixed` keeps 64 live slots and, per op, frees a random
 * slot and allocates a random size (log-uniform in 512 B .. 16 MiB) into it.
 * Random choices come from a fixed seed, precomputed outside the timed loop,
 * so every allocator sees the same sequence.
 *
 * Each (workload, size, threads, allocator) runs `repeat` timed batches per
 * thread after a warm-up batch; every batch starts behind a barrier so that
 * with several threads all of them run at once. The figure is the median over
 * threads of each thread's median ns per op. Without --ops, a batch is sized
 * on one thread to last at least 20 ms. Worker i runs on the i-th CPU the
 * process may use (modulo their count): a thread the scheduler moves between
 * cores mid-batch measures the move, not the allocator.
 *
 * run_pair is never inlined, so that `valgrind --tool=callgrind
 * --toggle-collect=run_pair` counts the instructions of the pairs alone
 * (bench/pair_instructions.sh). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* pthread barriers, thread affinity */
#endif
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"

/* mimalloc is an anchor when the build found it, except under
 * ThreadSanitizer, which cannot see the synchronization inside an
 * uninstrumented mimalloc and reports races that are not there. */
#if defined(TIDE_HAVE_MIMALLOC) && TIDE_HAVE_MIMALLOC && !defined(__SANITIZE_THREAD__)
#define MICRO_WITH_MIMALLOC 1
#include <mimalloc.h>
#else
#define MICRO_WITH_MIMALLOC 0
#endif

enum {
  MIXED_SLOTS = 64,
  SCRIPT_LENGTH = 4096, /* random steps of `mixed`, replayed in a ring */
  DEFAULT_REPEAT = 21,
  MAX_THREADS = 256,
  MAX_THREAD_COUNTS = 16, /* entries of --threads */
  MAX_SIZES = 16,         /* entries of --sizes */
};
#define MIN_BATCH_NS 20000000.0 /* calibrated batches last at least this */
#define MIXED_MIN_SIZE 512.0
#define MIXED_SIZE_OCTAVES 15.0 /* 512 B * 2^15 = 16 MiB */
#define SCRIPT_SEED 0x7469646555ull

static const size_t pair_sizes[] = {512, 4096, (size_t)1 << 20, (size_t)8 << 20, (size_t)64 << 20};
static const int default_thread_counts[] = {1, 8};

/* ------------------------------------------------------------------------ */
/* Anchors: allocators measured side by side. To add one (a GPU allocator,   */
/* say), write its five functions and add a row to `anchors`.                */
/* ------------------------------------------------------------------------ */

typedef struct anchor {
  const char *name;
  /* Get ready for `threads` threads: ctx[i] is what thread i passes to alloc
   * and free. False after printing why on stderr. */
  bool (*open)(const char *conf, int threads, void **ctx);
  void *(*alloc)(void *ctx, size_t size);
  /* Returns false if the allocator refused the free. */
  bool (*free)(void *ctx, void *ptr, size_t size);
  void (*close)(int threads, void **ctx);
  /* Why the last failure of the calling thread happened; NULL if unknown. */
  const char *(*last_error)(void);
} anchor;

/* tidalloc: the host backend unless the configuration says otherwise; one
 * stream per thread when several run, to show whether streams contend. */
typedef struct tidalloc_thread {
  tide_allocator *alloc;
  tide_stream stream;
  char pad[64 - sizeof(void *) - sizeof(tide_stream)]; /* one cache line each */
} tidalloc_thread;

static bool tidalloc_open(const char *conf, int threads, void **ctx) {
  tide_allocator *alloc = cli_allocator_create("micro", "backend:host", conf, 0);
  if (alloc == NULL) return false;
  tidalloc_thread *per = aligned_alloc(64, sizeof(tidalloc_thread) * (size_t)threads);
  if (per == NULL) {
    cli_error("micro: out of host memory");
    tide_destroy(alloc);
    return false;
  }
  for (int i = 0; i < threads; i++) {
    per[i].alloc = alloc;
    per[i].stream = NULL;
    if (threads > 1 && tide_stream_create(alloc, &per[i].stream) != TIDE_OK) {
      cli_report_tide_error("micro: creating a stream");
      for (int j = 0; j < i; j++) tide_stream_destroy(alloc, per[j].stream);
      free(per);
      tide_destroy(alloc);
      return false;
    }
    ctx[i] = &per[i];
  }
  return true;
}

static void *tidalloc_alloc(void *ctx, size_t size) {
  tidalloc_thread *t = ctx;
  return tide_malloc(t->alloc, size, t->stream);
}

static bool tidalloc_free(void *ctx, void *ptr, size_t size) {
  (void)size;
  tidalloc_thread *t = ctx;
  return tide_free(t->alloc, ptr, t->stream) == TIDE_OK;
}

static void tidalloc_close(int threads, void **ctx) {
  tidalloc_thread *per = ctx[0];
  tide_allocator *alloc = per[0].alloc;
  for (int i = 0; i < threads; i++) {
    if (per[i].stream != NULL && tide_stream_destroy(alloc, per[i].stream) != TIDE_OK) {
      cli_report_tide_error("micro: destroying a stream");
    }
  }
  if (tide_destroy(alloc) != TIDE_OK) cli_report_tide_error("micro: destroying the allocator");
  free(per);
}

/* glibc: malloc and free, which mmap and munmap the large sizes. */
static bool plain_open(const char *conf, int threads, void **ctx) {
  (void)conf;
  for (int i = 0; i < threads; i++) ctx[i] = NULL;
  return true;
}
static void plain_close(int threads, void **ctx) {
  (void)threads;
  (void)ctx;
}
static void *glibc_alloc(void *ctx, size_t size) {
  (void)ctx;
  return malloc(size);
}
static bool glibc_free(void *ctx, void *ptr, size_t size) {
  (void)ctx;
  (void)size;
  free(ptr);
  return true;
}

#if MICRO_WITH_MIMALLOC
static void *mimalloc_alloc(void *ctx, size_t size) {
  (void)ctx;
  return mi_malloc(size);
}
static bool mimalloc_free(void *ctx, void *ptr, size_t size) {
  (void)ctx;
  (void)size;
  mi_free(ptr);
  return true;
}
#endif

static const anchor anchors[] = {
    {"tidalloc", tidalloc_open, tidalloc_alloc, tidalloc_free, tidalloc_close, tide_last_error},
    {"glibc", plain_open, glibc_alloc, glibc_free, plain_close, NULL},
#if MICRO_WITH_MIMALLOC
    {"mimalloc", plain_open, mimalloc_alloc, mimalloc_free, plain_close, NULL},
#endif
};
static const size_t anchor_count = sizeof(anchors) / sizeof(anchors[0]);

/* ------------------------------------------------------------------------ */
/* Workloads                                                                 */
/* ------------------------------------------------------------------------ */

typedef struct mixed_step {
  uint32_t slot;
  size_t size;
} mixed_step;

/* What every thread of one measurement shares. */
typedef struct plan {
  const anchor *anchor;
  size_t size; /* 0: mixed */
  int threads;
  uint64_t ops; /* per batch; 0: calibrate (one thread only) */
  int repeat;
  pthread_barrier_t barrier;
} plan;

typedef struct worker {
  plan *plan;
  void *ctx;
  int index;
  pthread_t thread;
  uint64_t ops;    /* the batch length used */
  double median;   /* this thread's median ns per op */
  double *samples; /* repeat of them */
  bool failed;
  char error[256];
  /* mixed */
  mixed_step script[SCRIPT_LENGTH];
  size_t step;
  void *slots[MIXED_SLOTS];
  size_t slot_size[MIXED_SLOTS];
} worker;

/* Keep the compiler from proving a pointer unused and eliding the
 * allocation it came from. */
static inline void keep(void *p) { __asm__ volatile("" : : "r"(p) : "memory"); }

static uint64_t splitmix64(uint64_t *state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static void make_script(worker *w) {
  uint64_t state = SCRIPT_SEED + (uint64_t)w->index;
  for (size_t i = 0; i < SCRIPT_LENGTH; i++) {
    double u = (double)(splitmix64(&state) >> 11) / 9007199254740992.0; /* [0, 1) */
    w->script[i].size = (size_t)(MIXED_MIN_SIZE * exp2(u * MIXED_SIZE_OCTAVES));
    w->script[i].slot = (uint32_t)(splitmix64(&state) % MIXED_SLOTS);
  }
}

static bool fail(worker *w, const char *what, size_t size) {
  const char *why = w->plan->anchor->last_error ? w->plan->anchor->last_error() : NULL;
  snprintf(w->error, sizeof(w->error), "%s: %s of %zu bytes failed%s%s", w->plan->anchor->name,
           what, size, why ? ": " : "", why ? why : "");
  w->failed = true;
  return false;
}

static __attribute__((noinline)) bool run_pair(worker *w, uint64_t ops) {
  const anchor *a = w->plan->anchor;
  size_t size = w->plan->size;
  for (uint64_t k = 0; k < ops; k++) {
    void *p = a->alloc(w->ctx, size);
    if (p == NULL) return fail(w, "allocation", size);
    keep(p);
    if (!a->free(w->ctx, p, size)) return fail(w, "free", size);
  }
  return true;
}

static bool run_mixed(worker *w, uint64_t ops) {
  const anchor *a = w->plan->anchor;
  for (uint64_t k = 0; k < ops; k++) {
    const mixed_step *s = &w->script[w->step];
    w->step = (w->step + 1) % SCRIPT_LENGTH;
    if (!a->free(w->ctx, w->slots[s->slot], w->slot_size[s->slot])) {
      return fail(w, "free", w->slot_size[s->slot]);
    }
    w->slots[s->slot] = NULL;
    void *p = a->alloc(w->ctx, s->size);
    if (p == NULL) return fail(w, "allocation", s->size);
    keep(p);
    w->slots[s->slot] = p;
    w->slot_size[s->slot] = s->size;
  }
  return true;
}

static bool run_batch(worker *w, uint64_t ops) {
  return w->plan->size == 0 ? run_mixed(w, ops) : run_pair(w, ops);
}

static bool mixed_fill(worker *w) {
  make_script(w);
  w->step = 0;
  for (size_t i = 0; i < MIXED_SLOTS; i++) {
    const mixed_step *s = &w->script[(SCRIPT_LENGTH - 1 - i) % SCRIPT_LENGTH];
    void *p = w->plan->anchor->alloc(w->ctx, s->size);
    if (p == NULL) return fail(w, "allocation", s->size);
    w->slots[i] = p;
    w->slot_size[i] = s->size;
  }
  return true;
}

static void mixed_drain(worker *w) {
  for (size_t i = 0; i < MIXED_SLOTS; i++) {
    if (w->slots[i] != NULL) w->plan->anchor->free(w->ctx, w->slots[i], w->slot_size[i]);
    w->slots[i] = NULL;
  }
}

/* Double the batch until it lasts MIN_BATCH_NS, then size it to just over. */
static bool calibrate(worker *w) {
  uint64_t ops = 256;
  for (;;) {
    uint64_t t0 = cli_now_ns();
    if (!run_batch(w, ops)) return false;
    double ns = (double)(cli_now_ns() - t0);
    if (ns >= MIN_BATCH_NS) {
      w->ops = (uint64_t)((double)ops * (MIN_BATCH_NS * 1.1) / ns) + 1;
      return true;
    }
    ops *= 2;
  }
}

/* Every thread takes part in every barrier, even after a failure, so that
 * none waits forever; a failed thread only stops doing work. */
static void pin_to_cpu(int index) {
  cpu_set_t allowed, one;
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return;
  int count = CPU_COUNT(&allowed);
  if (count <= 0) return;
  int want = index % count;
  for (int cpu = 0; cpu < CPU_SETSIZE; cpu++) {
    if (!CPU_ISSET(cpu, &allowed) || want-- > 0) continue;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    pthread_setaffinity_np(pthread_self(), sizeof one, &one); /* best effort */
    return;
  }
}

static void *worker_main(void *arg) {
  worker *w = arg;
  plan *p = w->plan;
  pin_to_cpu(w->index);
  bool ok = p->size != 0 || mixed_fill(w);
  if (ok && p->ops == 0) {
    ok = calibrate(w);
  } else {
    w->ops = p->ops;
  }
  if (ok) ok = run_batch(w, w->ops); /* warm-up: later batches hit cached blocks */
  for (int r = 0; r < p->repeat; r++) {
    pthread_barrier_wait(&p->barrier);
    if (!ok) continue;
    uint64_t t0 = cli_now_ns();
    ok = run_batch(w, w->ops);
    w->samples[r] = (double)(cli_now_ns() - t0) / (double)w->ops;
  }
  if (p->size == 0) mixed_drain(w);
  if (ok) w->median = cli_median(w->samples, (size_t)p->repeat);
  return NULL;
}

/* ------------------------------------------------------------------------ */
/* One measurement                                                           */
/* ------------------------------------------------------------------------ */

typedef struct result {
  const char *workload;
  size_t size; /* 0: mixed */
  int threads;
  const char *allocator;
  double ns_per_op;
  uint64_t ops;
} result;

/* Measure one (workload, size, threads, anchor). `ops` 0 calibrates (one
 * thread only); the batch length used comes back in out->ops. */
static bool measure(const anchor *a, const char *conf, size_t size, int threads, uint64_t ops,
                    int repeat, result *out) {
  plan p = {.anchor = a, .size = size, .threads = threads, .ops = ops, .repeat = repeat};
  void *ctx[MAX_THREADS];
  worker *workers = calloc((size_t)threads, sizeof(worker));
  double *samples = calloc((size_t)threads * (size_t)repeat, sizeof(double));
  if (workers == NULL || samples == NULL) {
    free(workers);
    free(samples);
    cli_error("micro: out of host memory");
    return false;
  }
  if (!a->open(conf, threads, ctx)) {
    free(workers);
    free(samples);
    return false;
  }
  pthread_barrier_init(&p.barrier, NULL, (unsigned)threads);
  int started = 0;
  for (; started < threads; started++) {
    worker *w = &workers[started];
    w->plan = &p;
    w->ctx = ctx[started];
    w->index = started;
    w->samples = samples + (size_t)started * (size_t)repeat;
    if (pthread_create(&w->thread, NULL, worker_main, w) != 0) break;
  }
  bool ok = started == threads;
  if (!ok) {
    /* The barrier cannot be passed by fewer threads: that is fatal. */
    cli_error("micro: could not start %d threads", threads);
    exit(CLI_EXIT_FAILURE);
  }
  double medians[MAX_THREADS];
  for (int i = 0; i < threads; i++) {
    pthread_join(workers[i].thread, NULL);
    if (workers[i].failed) {
      if (ok) cli_error("micro: %s", workers[i].error);
      ok = false;
    }
    medians[i] = workers[i].median;
  }
  pthread_barrier_destroy(&p.barrier);
  a->close(threads, ctx);
  out->workload = size == 0 ? "mixed" : "pair";
  out->size = size;
  out->threads = threads;
  out->allocator = a->name;
  out->ns_per_op = ok ? cli_median(medians, (size_t)threads) : 0.0;
  out->ops = workers[0].ops;
  free(workers);
  free(samples);
  return ok;
}

/* ------------------------------------------------------------------------ */
/* Output                                                                    */
/* ------------------------------------------------------------------------ */

static void print_csv(const result *results, size_t n) {
  printf("workload,size,threads,allocator,ns_per_op\n");
  for (size_t i = 0; i < n; i++) {
    const result *r = &results[i];
    if (r->size == 0) {
      printf("%s,mixed,%d,%s,%.1f\n", r->workload, r->threads, r->allocator, r->ns_per_op);
    } else {
      printf("%s,%zu,%d,%s,%.1f\n", r->workload, r->size, r->threads, r->allocator, r->ns_per_op);
    }
  }
}

static double glibc_figure(const result *results, size_t n, const result *like) {
  for (size_t i = 0; i < n; i++) {
    const result *r = &results[i];
    if (r->size == like->size && r->threads == like->threads &&
        strcmp(r->allocator, "glibc") == 0) {
      return r->ns_per_op;
    }
  }
  return 0.0;
}

/* Two decimals, more for the small ratios of cached large blocks. */
static void format_ratio(double ratio, char *buf, size_t len) {
  if (ratio >= 0.1) {
    snprintf(buf, len, "%.2f", ratio);
  } else if (ratio >= 0.0001) {
    snprintf(buf, len, "%.4f", ratio);
  } else {
    snprintf(buf, len, "<0.0001");
  }
}

static void print_table(const result *results, size_t n) {
  printf("%-8s %-10s %7s  %-9s %10s %9s %10s\n", "workload", "size", "threads", "allocator",
         "ns/op", "x glibc", "batch ops");
  for (size_t i = 0; i < n; i++) {
    const result *r = &results[i];
    char size[32];
    if (r->size == 0) {
      snprintf(size, sizeof(size), "512B-16M");
    } else {
      cli_format_bytes(r->size, size, sizeof(size));
    }
    double base = glibc_figure(results, n, r);
    char ratio[32] = "-";
    if (base > 0.0) format_ratio(r->ns_per_op / base, ratio, sizeof(ratio));
    printf("%-8s %-10s %7d  %-9s %10.1f %9s %10llu\n", r->workload, size, r->threads, r->allocator,
           r->ns_per_op, ratio, (unsigned long long)r->ops);
  }
  printf("\nns/op: the median over threads of each thread's median over its batches;\n"
         "x glibc: ns/op divided by glibc's (below 1 is faster). One op of `pair` is an\n"
         "alloc+free pair; one op of `mixed` frees a random live slot (of 64) and\n"
         "allocates a random size, log-uniform in 512 B .. 16 MiB.\n");
}

/* ------------------------------------------------------------------------ */
/* The command                                                               */
/* ------------------------------------------------------------------------ */

/* The anchors besides tidalloc, as the help says them: only those built in. */
#if MICRO_WITH_MIMALLOC
#define MICRO_OTHERS "glibc and mimalloc"
#else
#define MICRO_OTHERS "glibc (this build has no mimalloc)"
#endif

static void print_help(void) {
  printf("usage: tidalloc micro [--csv] [--conf STR] [--repeat N] [--ops N] [--threads L]\n"
         "                      [--only L] [--sizes L]\n"
         "\n"
         "Alloc+free latency of tidalloc (host backend unless --conf or TIDALLOC_CONF\n"
         "choose another) next to " MICRO_OTHERS ",\n"
         "on 1 and 8 threads unless --threads says otherwise (tidalloc: one stream per\n"
         "thread when several run). Workloads: `pair` (allocate and free one size:\n"
         "512 B, 4 KiB, 1 MiB, 8 MiB, 64 MiB) and `mixed` (64 live slots, random\n"
         "sizes). Its first line says how long the run will take: 75-120 s on 2 CPUs\n"
         "with the defaults.\n"
         "\n"
         "  --csv        print workload,size,threads,allocator,ns_per_op\n"
         "  --conf STR   tidalloc options, \"key:value,...\"\n"
         "  --repeat N   timed batches per thread (default %d); the median is reported\n"
         "  --ops N      ops per batch (default: enough for a batch to last 20 ms)\n"
         "  --threads L  thread counts to run, such as 1,2,4,8 (default 1,8)\n"
         "  --only L     allocators to run, such as tidalloc,glibc (default all)\n"
         "  --sizes L    workloads to run: pair sizes in bytes and `mixed`, such as\n"
         "               512,mixed (default all)\n",
         DEFAULT_REPEAT);
}

typedef struct micro_args {
  bool csv;
  const char *conf;
  uint64_t repeat;
  uint64_t ops;
  int threads[MAX_THREAD_COUNTS];
  size_t thread_count;
  const char *only;        /* comma-separated allocator names, NULL: all */
  size_t sizes[MAX_SIZES]; /* pair sizes, 0: mixed */
  size_t size_count;
} micro_args;

/* Whether `name` is in the comma-separated list (NULL: every name is). */
static bool selected(const char *list, const char *name) {
  if (list == NULL) return true;
  size_t len = strlen(name);
  for (const char *at = list; *at != '\0';) {
    size_t item = strcspn(at, ",");
    if (item == len && strncmp(at, name, len) == 0) return true;
    at += item + (at[item] == ',');
  }
  return false;
}

/* "1,2,8" into args->threads; false if it is not such a list. */
static bool parse_thread_list(const char *text, void *target) {
  micro_args *args = target;
  args->thread_count = 0;
  char item[32];
  while (*text != '\0') {
    size_t len = strcspn(text, ",");
    uint64_t n = 0;
    if (len == 0 || len >= sizeof(item) || args->thread_count == MAX_THREAD_COUNTS) return false;
    memcpy(item, text, len);
    item[len] = '\0';
    if (!cli_parse_u64(item, &n) || n == 0 || n > MAX_THREADS) return false;
    args->threads[args->thread_count++] = (int)n;
    text += len;
    if (*text == ',' && *++text == '\0') return false; /* a trailing comma */
  }
  return args->thread_count > 0;
}

/* "512,mixed" into args->sizes (0 stands for mixed); false if it is not
 * such a list. */
static bool parse_size_list(const char *text, void *target) {
  micro_args *args = target;
  args->size_count = 0;
  char item[32];
  while (*text != '\0') {
    size_t len = strcspn(text, ",");
    uint64_t n = 0;
    if (len == 0 || len >= sizeof(item) || args->size_count == MAX_SIZES) return false;
    memcpy(item, text, len);
    item[len] = '\0';
    if (strcmp(item, "mixed") != 0 && (!cli_parse_u64(item, &n) || n == 0 || n > SIZE_MAX / 2))
      return false;
    args->sizes[args->size_count++] = (size_t)n;
    text += len;
    if (*text == ',' && *++text == '\0') return false; /* a trailing comma */
  }
  return args->size_count > 0;
}

/* Allocators of this build named in the list: at least one. */
static bool parse_only(const char *text, void *target) {
  bool known = false;
  for (size_t a = 0; a < anchor_count; a++) known |= selected(text, anchors[a].name);
  if (known) *(const char **)target = text;
  return known;
}

/* The limits the messages of --threads and --sizes name. */
_Static_assert(MAX_THREADS == 256 && MAX_THREAD_COUNTS == 16 && MAX_SIZES == 16,
               "update the option table's messages");

/* Returns -1 to go on, or the exit code. */
static int parse_args(int argc, char **argv, micro_args *args) {
  *args = (micro_args){.repeat = DEFAULT_REPEAT};
  args->thread_count = sizeof(default_thread_counts) / sizeof(default_thread_counts[0]);
  memcpy(args->threads, default_thread_counts, sizeof(default_thread_counts));
  args->size_count = sizeof(pair_sizes) / sizeof(pair_sizes[0]) + 1; /* + mixed, last */
  memcpy(args->sizes, pair_sizes, sizeof(pair_sizes));
  args->sizes[args->size_count - 1] = 0;
  const cli_option options[] = {
      {.name = "--csv", .kind = CLI_FLAG, .target = &args->csv},
      {.name = "--conf", .kind = CLI_TEXT, .target = &args->conf},
      {.name = "--repeat",
       .kind = CLI_COUNT,
       .target = &args->repeat,
       .min = 1,
       .max = 100000,
       .wants = "a count from 1 to 100000"},
      {.name = "--threads",
       .kind = CLI_CUSTOM,
       .target = args,
       .parse = parse_thread_list,
       .wants = "a list such as 1,8 (each 1 to 256, at most 16)"},
      {.name = "--sizes",
       .kind = CLI_CUSTOM,
       .target = args,
       .parse = parse_size_list,
       .wants = "a list of byte counts and `mixed`, such as 512,mixed (at most 16)"},
      {.name = "--only",
       .kind = CLI_CUSTOM,
       .target = &args->only,
       .parse = parse_only,
       .wants = "allocators this build has"},
      {.name = "--ops",
       .kind = CLI_COUNT,
       .target = &args->ops,
       .min = 1,
       .max = UINT64_MAX,
       .wants = "a positive count"},
  };
  return cli_parse(argc, argv, "micro", print_help, options, sizeof options / sizeof options[0],
                   NULL, 0);
}

/* CPUs the process may run on (at least 1). */
static int usable_cpus(void) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) return 1;
  int count = CPU_COUNT(&allowed);
  return count > 0 ? count : 1;
}

/* The length of the run, said before it starts. Each measurement runs a
 * warm-up and `repeat` batches per thread, each batch sized on one thread to
 * last MIN_BATCH_NS (1.1 times it, as calibrated), plus the calibration.
 * Threads beyond the CPUs take turns, and threads that share CPUs slow each
 * other beyond their turns (caches, locks, the barrier before each batch):
 * on 2 CPUs the defaults' 8-thread batches took 1.8 times their turns on
 * average, and the run 81 s where turns alone give 45 s. The range is that
 * model to 1.6 times it, the longer for a machine busy with other work. Negative when
 * --ops fixes the batches (their length is then unknown). */
#define MICRO_SHARED_CPU_SLOWDOWN 1.8
static double estimated_seconds(const micro_args *args, size_t anchors_run) {
  if (args->ops != 0) return -1.0;
  int cpus = usable_cpus();
  double seconds = 0.0;
  for (size_t t = 0; t < args->thread_count; t++) {
    int threads = args->threads[t];
    int rounds = (threads + cpus - 1) / cpus;
    double batches = (double)(args->repeat + 1) * MIN_BATCH_NS * 1.1 / 1e9 * rounds;
    if (threads > cpus) batches *= MICRO_SHARED_CPU_SLOWDOWN;
    seconds += batches + 0.1; /* calibration: doubling batches up to MIN_BATCH_NS */
  }
  return seconds * (double)args->size_count * (double)anchors_run;
}

/* Progress where stderr is not a terminal (cli_progress draws nothing
 * there): a line at every tenth of the measurements. */
static void progress_line(size_t done, size_t total, uint64_t start_ns) {
  static size_t last_tenth = 0;
  if (total == 0 || isatty(STDERR_FILENO)) return;
  size_t tenth = done * 10 / total;
  if (tenth == last_tenth || done == 0) return;
  last_tenth = tenth;
  fprintf(stderr, "tidalloc micro: %zu%% (%zu of %zu measurements, %.0f s)\n", done * 100 / total,
          done, total, (double)(cli_now_ns() - start_ns) / 1e9);
}

int tide_cli_micro(int argc, char **argv) {
  micro_args args;
  int code = parse_args(argc, argv, &args);
  if (code >= 0) return code;
#if !MICRO_WITH_MIMALLOC
  fprintf(stderr, "tidalloc micro: this build has no mimalloc (not found when it was built, or "
                  "under ThreadSanitizer): tidalloc and glibc only\n");
#endif
  const size_t size_count = args.size_count;
  const size_t thread_count = args.thread_count;
  const size_t total = size_count * thread_count * anchor_count;
  result *results = calloc(total, sizeof(result));
  if (results == NULL) {
    cli_error("micro: out of host memory");
    return CLI_EXIT_FAILURE;
  }
  size_t anchors_run = 0;
  for (size_t a = 0; a < anchor_count; a++) anchors_run += selected(args.only, anchors[a].name);
  const size_t measurements = size_count * thread_count * anchors_run;
  double estimate = estimated_seconds(&args, anchors_run);
  if (estimate >= 0.0) {
    fprintf(stderr,
            "tidalloc micro: %zu measurements, roughly %.0f-%.0f s on %d CPUs (the longer "
            "on a busy machine; --sizes, --threads, --only and --repeat make it shorter)\n",
            measurements, estimate, 1.6 * estimate, usable_cpus());
  } else {
    fprintf(stderr, "tidalloc micro: %zu measurements of %llu-op batches\n", measurements,
            (unsigned long long)args.ops);
  }
  const uint64_t start_ns = cli_now_ns();
  size_t n = 0;
  for (size_t s = 0; s < size_count; s++) {
    size_t size = args.sizes[s];
    for (size_t a = 0; a < anchor_count; a++) {
      if (!selected(args.only, anchors[a].name)) continue;
      /* The batch one thread needs for 20 ms serves the other thread counts
       * too, so that contention shows as longer batches. */
      uint64_t ops = args.ops;
      for (size_t t = 0; t < thread_count; t++) {
        cli_progress("micro", (double)n / (double)measurements);
        int threads = args.threads[t];
        bool calibrate_here = ops == 0 && threads != 1;
        if (calibrate_here) {
          result probe;
          if (!measure(&anchors[a], args.conf, size, 1, 0, 1, &probe)) goto failed;
          ops = probe.ops;
        }
        result *slot = &results[(s * anchor_count + a) * thread_count + t];
        if (!measure(&anchors[a], args.conf, size, threads, ops, (int)args.repeat, slot)) {
          goto failed;
        }
        ops = slot->ops;
        n++;
        progress_line(n, measurements, start_ns);
      }
    }
  }
  cli_progress("micro", 1.0);
  /* Group rows by (workload, size, threads), allocators in table order. */
  result *ordered = calloc(total, sizeof(result));
  if (ordered == NULL) {
    cli_error("micro: out of host memory");
    free(results);
    return CLI_EXIT_FAILURE;
  }
  size_t m = 0;
  for (size_t s = 0; s < size_count; s++) {
    for (size_t t = 0; t < thread_count; t++) {
      for (size_t a = 0; a < anchor_count; a++) {
        const result *r = &results[(s * anchor_count + a) * thread_count + t];
        if (r->allocator != NULL) ordered[m++] = *r; /* left out by --only otherwise */
      }
    }
  }
  if (args.csv) {
    print_csv(ordered, m);
  } else {
    print_table(ordered, m);
  }
  free(ordered);
  free(results);
  return CLI_EXIT_OK;

failed:
  cli_progress("micro", 1.0);
  free(results);
  return CLI_EXIT_FAILURE;
}
