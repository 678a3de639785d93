/* stream_kv.cu: a streaming attention step over a KV cache that grows every
 * frame, the way a streaming transformer runs: each frame appends its keys
 * and values to the cache and its queries attend to the most recent keys.
 *
 * The cache lives in tidalloc growable buffers: their address never changes
 * while they grow, so the step is captured once as a CUDA graph and replayed
 * every frame (the kernels read the frame number and the cache length from
 * device memory). `--mode cat` grows the cache the way torch.cat does
 * (allocate the longer cache, copy, free the old one) for comparison; its
 * addresses change every frame, so it runs eagerly. `--window W` keeps only
 * the last W tokens in a ring buffer whose pages are mapped twice, so the
 * window is contiguous wherever it starts.
 *
 *   stream_kv [--frames N] [--tokens T] [--dim D] [--span S] [--window W]
 *             [--mode buf|cat] [--exec graph|eager] [--offload] [--no-check]
 *             [--ahead-frames A] [--ahead-fraction F] [--csv FILE]
 *
 * A growable buffer maps A frames' growth ahead (default 8) on its worker
 * thread; with F, at most that fraction of its length (map_ahead_fraction;
 * default 0: no bound), so that a short cache holds no pages it does not use
 * yet. The bound suits caches that grow by pages a frame (--tokens 1024 --dim
 * 512: 2 MiB); at the small default (32 KiB a frame) it leaves every page to
 * be mapped on the calling thread, in the frame that needs it.
 *
 * With --exec graph (the default on a GPU) or a ring, the run is repeated
 * eagerly over a plain growable buffer and the outputs of every frame are
 * compared bit for bit (a ring attends to the same keys: the span is capped
 * at its window). Without a GPU the
 * program runs on tidalloc's host backend (emulated device memory), eagerly,
 * with the same arithmetic done by the CPU. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <tidalloc.h>

/* ------------------------------------------------------------------------ */
/* Options                                                                   */
/* ------------------------------------------------------------------------ */

typedef struct options {
  int frames;
  int tokens;            /* appended per frame; also the queries per frame */
  int dim;               /* floats per key, value, query */
  int span;              /* keys each query attends to (the most recent); 0: all */
  int window;            /* ring mode: tokens kept; 0: keep all (linear buffer) */
  int ahead_frames;      /* frames' growth mapped ahead */
  double ahead_fraction; /* ... at most this fraction of the length */
  int cat;               /* grow by allocate-copy-free instead of a growable buffer */
  int graph;             /* capture once and replay */
  int offload;
  int check;
  const char *csv;
} options;

static void usage(void) {
  fprintf(stderr,
          "usage: stream_kv [--frames N] [--tokens T] [--dim D] [--span S] [--window W]\n"
          "                 [--mode buf|cat] [--exec graph|eager] [--offload] [--no-check]\n"
          "                 [--ahead-frames A] [--ahead-fraction F] [--csv FILE]\n");
}

static int parse_int(const char *s, int *out) {
  char *end;
  long v = strtol(s, &end, 10);
  if (*s == '\0' || *end != '\0' || v < 0 || v > 1 << 24) return 0;
  *out = (int)v;
  return 1;
}

static int parse_options(int argc, char **argv, options *o, int have_gpu) {
  *o = (options){256, 64, 128, 4096, 0, 8, 0.0, 0, have_gpu, 0, 1, NULL};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    int ok = 1;
    if (!strcmp(a, "--frames") && v)
      ok = parse_int(argv[++i], &o->frames);
    else if (!strcmp(a, "--tokens") && v)
      ok = parse_int(argv[++i], &o->tokens);
    else if (!strcmp(a, "--dim") && v)
      ok = parse_int(argv[++i], &o->dim);
    else if (!strcmp(a, "--span") && v)
      ok = parse_int(argv[++i], &o->span);
    else if (!strcmp(a, "--window") && v)
      ok = parse_int(argv[++i], &o->window);
    else if (!strcmp(a, "--ahead-frames") && v)
      ok = parse_int(argv[++i], &o->ahead_frames);
    else if (!strcmp(a, "--ahead-fraction") && v) {
      char *end;
      o->ahead_fraction = strtod(argv[++i], &end);
      ok = *end == '\0' && o->ahead_fraction >= 0 && o->ahead_fraction <= 1;
    } else if (!strcmp(a, "--mode") && v) {
      o->cat = !strcmp(v, "cat");
      ok = o->cat || !strcmp(v, "buf");
      i++;
    } else if (!strcmp(a, "--exec") && v) {
      o->graph = !strcmp(v, "graph");
      ok = o->graph || !strcmp(v, "eager");
      i++;
    } else if (!strcmp(a, "--offload"))
      o->offload = 1;
    else if (!strcmp(a, "--no-check"))
      o->check = 0;
    else if (!strcmp(a, "--csv") && v)
      o->csv = argv[++i];
    else
      ok = 0;
    if (!ok) return usage(), 0;
  }
  if (o->frames < 1 || o->tokens < 1 || o->dim < 1 || o->dim > 1024) return usage(), 0;
  if (o->cat && (o->graph || o->window)) {
    fprintf(stderr, "stream_kv: --mode cat moves the cache every frame: eager and linear only\n");
    return 0;
  }
  if (o->graph && !have_gpu) {
    fprintf(stderr, "stream_kv: no GPU: running eagerly on the host backend\n");
    o->graph = 0;
  }
  return 1;
}

/* ------------------------------------------------------------------------ */
/* The arithmetic, shared by the GPU kernels and the CPU path                */
/* ------------------------------------------------------------------------ */

/* Deterministic inputs: a hash of (frame, token, element, which). */
__host__ __device__ static float input_value(uint32_t frame, uint32_t token, uint32_t d,
                                             uint32_t which) {
  uint32_t h = frame * 0x9E3779B1u ^ token * 0x85EBCA77u ^ d * 0xC2B2AE3Du ^ which * 0x27D4EB2Fu;
  h ^= h >> 15;
  h *= 0x2C1B3C6Du;
  h ^= h >> 12;
  h *= 0x297A2D39u;
  h ^= h >> 15;
  return (float)(h & 0xFFFFFF) / 8388608.0f - 1.0f; /* [-1, 1) */
}

/* Where the step is: device memory, so that a captured graph replays with
 * the current values. */
typedef struct step_state {
  int frame;
  int length; /* tokens appended so far (all time) */
} step_state;

typedef struct step_args {
  float *queries; /* tokens x dim */
  float *keys, *values;
  float *outputs; /* frames x tokens x dim: every frame's output */
  step_state *state;
  int tokens, dim, span, window;
} step_args;

/* Slot of the token with absolute index `t` in the cache. */
__host__ __device__ static long slot_of(long t, int window) { return window ? t % window : t; }

/* First token a query of this frame attends to, and how many. */
__host__ __device__ static void attended(const step_state *s, const step_args *a, long *first,
                                         long *count) {
  long end = (long)s->length + a->tokens; /* after this frame's append */
  long n = end;
  if (a->span && n > a->span) n = a->span;
  if (a->window && n > a->window) n = a->window;
  *first = end - n;
  *count = n;
}

/* ------------------------------------------------------------------------ */
/* GPU kernels                                                               */
/* ------------------------------------------------------------------------ */

__global__ void append_kernel(step_args a) {
  int t = blockIdx.x, d = threadIdx.x;
  if (d >= a.dim) return;
  step_state s = *a.state;
  long slot = slot_of((long)s.length + t, a.window);
  a.queries[(long)t * a.dim + d] = input_value(s.frame, t, d, 0);
  a.keys[slot * a.dim + d] = input_value(s.frame, t, d, 1);
  a.values[slot * a.dim + d] = input_value(s.frame, t, d, 2);
}

/* One block per query, one thread per element. Keys go by in chunks of
 * blockDim.x: each thread scores one key of the chunk, thread 0 takes the
 * chunk's maximum in a fixed order (so every run sums alike), then each
 * thread folds the chunk into its element with a running softmax. In ring
 * mode the window is read from one contiguous address because the ring's
 * pages are mapped twice. */
__global__ void attend_kernel(step_args a) {
  extern __shared__ float shared[];
  float *scores = shared, *query = shared + blockDim.x;
  __shared__ float chunk_max;
  int q = blockIdx.x, d = threadIdx.x;
  step_state s = *a.state;
  long first, count;
  attended(&s, &a, &first, &count);
  long base = slot_of(first, a.window);
  if (d < a.dim) query[d] = a.queries[(long)q * a.dim + d];
  __syncthreads();
  float scale = rsqrtf((float)a.dim), m = -INFINITY, sum = 0.0f, acc = 0.0f;
  for (long c = 0; c < count; c += blockDim.x) {
    long k = c + d;
    float score = -INFINITY;
    if (k < count) {
      const float *key = a.keys + (base + k) * a.dim;
      score = 0.0f;
      for (int e = 0; e < a.dim; e++) score += query[e] * key[e];
      score *= scale;
    }
    scores[d] = score;
    __syncthreads();
    if (d == 0) {
      float cm = m;
      for (int j = 0; j < (int)blockDim.x; j++) cm = fmaxf(cm, scores[j]);
      chunk_max = cm;
    }
    __syncthreads();
    float nm = chunk_max, rescale = expf(m - nm);
    sum *= rescale;
    acc *= rescale;
    long n = count - c < (long)blockDim.x ? count - c : (long)blockDim.x;
    for (long j = 0; j < n; j++) {
      float p = expf(scores[j] - nm);
      sum += p;
      if (d < a.dim) acc += p * a.values[(base + c + j) * a.dim + d];
    }
    m = nm;
    __syncthreads();
  }
  if (d < a.dim) a.outputs[((long)s.frame * a.tokens + q) * a.dim + d] = acc / sum;
}

__global__ void advance_kernel(step_args a) {
  a.state->frame += 1;
  a.state->length += a.tokens;
}

static int threads_for(int dim) { return dim < 32 ? 32 : (dim + 31) / 32 * 32; }

static void launch_step(const step_args *a, cudaStream_t stream) {
  int threads = threads_for(a->dim);
  append_kernel<<<a->tokens, threads, 0, stream>>>(*a);
  attend_kernel<<<a->tokens, threads, 2 * threads * sizeof(float), stream>>>(*a);
  advance_kernel<<<1, 1, 0, stream>>>(*a);
}

/* ------------------------------------------------------------------------ */
/* The CPU path (host backend): the same arithmetic, one query at a time     */
/* ------------------------------------------------------------------------ */

static void cpu_step(const step_args *a) {
  step_state *s = a->state;
  int dim = a->dim, chunk = threads_for(dim);
  for (int t = 0; t < a->tokens; t++) {
    long slot = slot_of((long)s->length + t, a->window);
    for (int d = 0; d < dim; d++) {
      a->queries[(long)t * dim + d] = input_value(s->frame, t, d, 0);
      a->keys[slot * dim + d] = input_value(s->frame, t, d, 1);
      a->values[slot * dim + d] = input_value(s->frame, t, d, 2);
    }
  }
  long first, count;
  attended(s, a, &first, &count);
  long base = slot_of(first, a->window);
  float *scores = (float *)malloc(sizeof(float) * chunk),
        *acc = (float *)malloc(sizeof(float) * dim);
  for (int q = 0; q < a->tokens; q++) {
    const float *query = a->queries + (long)q * dim;
    float scale = 1.0f / sqrtf((float)dim), m = -INFINITY, sum = 0.0f;
    for (int d = 0; d < dim; d++) acc[d] = 0.0f;
    for (long c = 0; c < count; c += chunk) {
      long n = count - c < chunk ? count - c : chunk;
      float nm = m;
      for (long j = 0; j < n; j++) {
        const float *key = a->keys + (base + c + j) * dim;
        float score = 0.0f;
        for (int e = 0; e < dim; e++) score += query[e] * key[e];
        scores[j] = score * scale;
        nm = fmaxf(nm, scores[j]);
      }
      float rescale = expf(m - nm);
      sum *= rescale;
      for (int d = 0; d < dim; d++) acc[d] *= rescale;
      for (long j = 0; j < n; j++) {
        float p = expf(scores[j] - nm);
        sum += p;
        const float *value = a->values + (base + c + j) * dim;
        for (int d = 0; d < dim; d++) acc[d] += p * value[d];
      }
      m = nm;
    }
    for (int d = 0; d < dim; d++)
      a->outputs[((long)s->frame * a->tokens + q) * dim + d] = acc[d] / sum;
  }
  free(scores);
  free(acc);
  s->frame += 1;
  s->length += a->tokens;
}

/* ------------------------------------------------------------------------ */
/* The KV cache: growable buffers, or allocate-copy-free                     */
/* ------------------------------------------------------------------------ */

typedef struct cache {
  tide_buf *buf[2]; /* keys, values (buffer mode) */
  void *block[2];   /* keys, values (cat mode) */
  size_t length;    /* bytes in use per cache */
  size_t copied;    /* bytes copied by the last growth (cat mode) */
} cache;

static int fail(const char *what) {
  fprintf(stderr, "stream_kv: %s failed: %s\n", what, tide_last_error());
  return 0;
}

static int cuda_ok(cudaError_t e, const char *what) {
  if (e == cudaSuccess) return 1;
  fprintf(stderr, "stream_kv: %s: %s\n", what, cudaGetErrorString(e));
  return 0;
}

static size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

static int cache_open(cache *c, tide_allocator *alloc, const options *o, size_t granularity) {
  memset(c, 0, sizeof *c);
  if (o->cat) return 1;
  size_t row = (size_t)o->dim * sizeof(float);
  for (int i = 0; i < 2; i++) {
    tide_buf_options bo;
    tide_buf_options_init(&bo);
    if (o->window) {
      bo.ring = 1;
      bo.capacity = round_up((size_t)o->window * row, granularity);
    } else {
      bo.capacity = round_up((size_t)o->frames * o->tokens * row, granularity);
      /* A few frames' growth ahead, mapped off the critical path: the next
       * page is mapped that many frames before the cache reaches it, and held
       * only from then on; never more than a fraction of the cache, so that
       * the memory held beyond the length stays a small part of it. */
      bo.map_ahead = (size_t)o->ahead_frames * o->tokens * row;
      bo.map_ahead_fraction = o->ahead_fraction;
      bo.async_map_ahead = 1;
    }
    if (tide_buf_create(alloc, &bo, &c->buf[i]) != TIDE_OK) return fail("tide_buf_create");
  }
  return 1;
}

/* Make room for `length` bytes per cache before the frame that needs it. */
static int cache_grow(cache *c, tide_allocator *alloc, const options *o, size_t length,
                      tide_stream stream) {
  c->copied = 0;
  if (o->window) return 1; /* a ring is mapped whole at creation */
  if (!o->cat) {
    for (int i = 0; i < 2; i++)
      if (tide_buf_resize(c->buf[i], length, stream) != TIDE_OK) return fail("tide_buf_resize");
    c->length = length;
    return 1;
  }
  for (int i = 0; i < 2; i++) {
    void *grown = tide_malloc(alloc, length, stream);
    if (!grown) return fail("tide_malloc");
    if (c->block[i]) {
      if (tide_memcpy(alloc, grown, c->block[i], c->length, stream) != TIDE_OK)
        return fail("tide_memcpy");
      if (tide_free(alloc, c->block[i], stream) != TIDE_OK) return fail("tide_free");
      c->copied += c->length;
    }
    c->block[i] = grown;
  }
  c->length = length;
  return 1;
}

static float *cache_data(const cache *c, const options *o, int i) {
  return (float *)(o->cat ? c->block[i] : tide_buf_data(c->buf[i]));
}

static void cache_close(cache *c, tide_allocator *alloc, tide_stream stream) {
  for (int i = 0; i < 2; i++) {
    if (c->buf[i]) tide_buf_destroy(c->buf[i]);
    if (c->block[i]) tide_free(alloc, c->block[i], stream);
  }
}

/* ------------------------------------------------------------------------ */
/* One run                                                                   */
/* ------------------------------------------------------------------------ */

typedef struct frame_record {
  double ms;
  size_t cache_bytes, copied;
  int64_t allocated, reserved;
} frame_record;

typedef struct run_result {
  float *outputs; /* host copy of every frame's output */
  frame_record *frames;
  int64_t load_allocated, load_reserved, peak_allocated, peak_reserved;
} run_result;

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static double mib(int64_t bytes) { return (double)bytes / 1048576.0; }

static void read_stats(tide_allocator *alloc, int64_t *allocated, int64_t *reserved, int peak) {
  tide_stats st;
  if (tide_get_stats(alloc, &st) != TIDE_OK) return;
  *allocated =
      peak ? st.allocated_bytes[TIDE_POOL_ALL].peak : st.allocated_bytes[TIDE_POOL_ALL].current;
  *reserved =
      peak ? st.reserved_bytes[TIDE_POOL_ALL].peak : st.reserved_bytes[TIDE_POOL_ALL].current;
}

typedef struct device {
  tide_allocator *alloc;
  int gpu;
  size_t granularity;
} device;

static int sync_stream(const device *dev, tide_stream stream) {
  if (!dev->gpu) return 1;
  return cuda_ok(cudaStreamSynchronize((cudaStream_t)stream), "cudaStreamSynchronize");
}

static int run(const device *dev, const options *o, run_result *r) {
  tide_allocator *alloc = dev->alloc;
  tide_stream stream = NULL;
  size_t row = (size_t)o->dim * sizeof(float);
  size_t out_bytes = (size_t)o->frames * o->tokens * row;
  memset(r, 0, sizeof *r);
  r->outputs = (float *)malloc(out_bytes);
  r->frames = (frame_record *)calloc((size_t)o->frames, sizeof *r->frames);
  if (!r->outputs || !r->frames) return fprintf(stderr, "stream_kv: out of host memory\n"), 0;
  if (tide_stream_create(alloc, &stream) != TIDE_OK) return fail("tide_stream_create");
  cudaStream_t cs = (cudaStream_t)stream;

  /* "Load": the step's fixed buffers. */
  step_args a;
  memset(&a, 0, sizeof a);
  a.tokens = o->tokens;
  a.dim = o->dim;
  a.span = o->span;
  a.window = o->window;
  a.queries = (float *)tide_malloc(alloc, (size_t)o->tokens * row, stream);
  a.outputs = (float *)tide_malloc(alloc, out_bytes, stream);
  a.state = (step_state *)tide_malloc(alloc, sizeof(step_state), stream);
  if (!a.queries || !a.outputs || !a.state) return fail("tide_malloc");
  step_state zero = {0, 0};
  if (tide_memcpy(alloc, a.state, &zero, sizeof zero, stream) != TIDE_OK)
    return fail("tide_memcpy");
  cache c;
  if (!cache_open(&c, alloc, o, dev->granularity)) return 0;
  float *pinned = NULL;
  if (o->offload) {
    pinned = (float *)tide_pinned_malloc(alloc, out_bytes, stream);
    if (!pinned) return fail("tide_pinned_malloc");
  }
  if (!sync_stream(dev, stream)) return 0;
  read_stats(alloc, &r->load_allocated, &r->load_reserved, 0);
  tide_reset_peak_stats(alloc);

  cudaGraphExec_t exec = NULL;
  for (int f = 0; f < o->frames; f++) {
    double t0 = now_ms();
    size_t needed = (size_t)(f + 1) * o->tokens * row;
    if (!cache_grow(&c, alloc, o, needed, stream)) return 0;
    a.keys = cache_data(&c, o, 0);
    a.values = cache_data(&c, o, 1);
    if (!dev->gpu) {
      cpu_step(&a);
    } else if (!o->graph) {
      launch_step(&a, cs);
    } else {
      if (!exec) { /* the buffers never move: one capture serves every frame */
        cudaGraph_t graph;
        if (!cuda_ok(cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal), "capture"))
          return 0;
        launch_step(&a, cs);
        if (!cuda_ok(cudaStreamEndCapture(cs, &graph), "end capture")) return 0;
        if (!cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate")) return 0;
        cudaGraphDestroy(graph);
      }
      if (!cuda_ok(cudaGraphLaunch(exec, cs), "graph launch")) return 0;
    }
    if (pinned) {
      size_t frame_bytes = (size_t)o->tokens * row, at = (size_t)f * o->tokens * o->dim;
      if (tide_memcpy(alloc, pinned + at, a.outputs + at, frame_bytes, stream) != TIDE_OK)
        return fail("tide_memcpy (offload)");
    }
    if (!sync_stream(dev, stream)) return 0;
    frame_record *fr = &r->frames[f];
    fr->ms = now_ms() - t0;
    fr->cache_bytes = 2 * needed;
    fr->copied = c.copied;
    read_stats(alloc, &fr->allocated, &fr->reserved, 0);
  }
  if (exec) cudaGraphExecDestroy(exec);
  read_stats(alloc, &r->peak_allocated, &r->peak_reserved, 1);
  if (tide_memcpy(alloc, r->outputs, a.outputs, out_bytes, stream) != TIDE_OK)
    return fail("tide_memcpy (outputs)");
  if (!sync_stream(dev, stream)) return 0;
  if (pinned && memcmp(pinned, r->outputs, out_bytes) != 0) {
    fprintf(stderr, "stream_kv: the offloaded outputs differ from the device's\n");
    return 0;
  }
  if (pinned) tide_pinned_free(alloc, pinned, stream);
  cache_close(&c, alloc, stream);
  tide_free(alloc, a.queries, stream);
  tide_free(alloc, a.outputs, stream);
  tide_free(alloc, a.state, stream);
  tide_stream_destroy(alloc, stream);
  return 1;
}

static void run_free(run_result *r) {
  free(r->outputs);
  free(r->frames);
}

/* ------------------------------------------------------------------------ */
/* Reporting                                                                 */
/* ------------------------------------------------------------------------ */

static int by_double(const void *x, const void *y) {
  double a = *(const double *)x, b = *(const double *)y;
  return (a > b) - (a < b);
}

static void report(const options *o, const run_result *r) {
  double *ms = (double *)malloc(sizeof(double) * o->frames);
  size_t copied = 0;
  for (int f = 0; f < o->frames; f++) {
    ms[f] = r->frames[f].ms;
    copied += r->frames[f].copied;
  }
  qsort(ms, (size_t)o->frames, sizeof *ms, by_double);
  printf("after load:       allocated %9.1f MiB  reserved %9.1f MiB\n", mib(r->load_allocated),
         mib(r->load_reserved));
  printf("during inference: peak allocated %6.1f MiB  peak reserved %6.1f MiB  (x%.4f)\n",
         mib(r->peak_allocated), mib(r->peak_reserved),
         r->peak_allocated ? (double)r->peak_reserved / (double)r->peak_allocated : 0.0);
  printf("time per frame:   median %.3f ms  p99 %.3f ms  max %.3f ms  copied %.1f MiB/frame\n",
         ms[o->frames / 2], ms[(int)((o->frames - 1) * 0.99)], ms[o->frames - 1],
         mib((int64_t)copied) / o->frames);
  free(ms);
}

static int write_csv(const options *o, const run_result *r) {
  FILE *f = fopen(o->csv, "w");
  if (!f) return fprintf(stderr, "stream_kv: cannot write %s\n", o->csv), 0;
  fprintf(f, "mode,exec,window,frame,cache_bytes,ms,bytes_copied,allocated,reserved\n");
  for (int i = 0; i < o->frames; i++) {
    const frame_record *fr = &r->frames[i];
    fprintf(f, "%s,%s,%d,%d,%zu,%.4f,%zu,%lld,%lld\n", o->cat ? "cat" : "buf",
            o->graph ? "graph" : "eager", o->window, i, fr->cache_bytes, fr->ms, fr->copied,
            (long long)fr->allocated, (long long)fr->reserved);
  }
  return fclose(f) == 0;
}

/* ------------------------------------------------------------------------ */
/* Main                                                                      */
/* ------------------------------------------------------------------------ */

static int open_device(device *dev) {
  int count = 0;
  dev->gpu = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  if (dev->gpu) cudaFree(0); /* the runtime's context is the one tidalloc uses */
  if (!dev->gpu) cudaGetLastError();
  tide_config *config = NULL;
  if (tide_config_new(&config) != TIDE_OK) return fail("tide_config_new");
  if (tide_config_load_env(config) != TIDE_OK ||
      tide_config_set(config, "backend", dev->gpu ? "cuda" : "host") != TIDE_OK)
    return tide_config_free(config), fail("configuration");
  tide_status rc = tide_create(0, config, &dev->alloc);
  tide_config_free(config);
  if (rc != TIDE_OK) return fail("tide_create");
  tide_info info;
  if (tide_get_info(dev->alloc, &info) != TIDE_OK) return fail("tide_get_info");
  dev->granularity = (size_t)info.granularity;
  printf("stream_kv on %s (%s backend)\n", info.device_name, info.backend);
  return 1;
}

int main(int argc, char **argv) {
  device dev;
  memset(&dev, 0, sizeof dev);
  if (!open_device(&dev)) return 1;
  options o;
  if (!parse_options(argc, argv, &o, dev.gpu)) return 2;
  printf("%d frames x %d tokens, dim %d, span %d, %s, %s%s\n", o.frames, o.tokens, o.dim, o.span,
         o.cat      ? "cat growth"
         : o.window ? "ring buffer"
                    : "growable buffer",
         o.graph ? "graph replay" : "eager", o.offload ? ", offload to pinned memory" : "");
  run_result r;
  if (!run(&dev, &o, &r)) return 1;
  report(&o, &r);
  if (o.csv && !write_csv(&o, &r)) return 1;
  int status = 0;
  if (o.check && (o.graph || o.window)) {
    /* The reference: an eager run over a plain growable buffer. A ring
     * attends to the same keys when the span is within its window. */
    options ref = o;
    ref.graph = 0;
    ref.offload = 0;
    ref.window = 0;
    ref.csv = NULL;
    if (o.window && (o.span == 0 || o.span > o.window)) ref.span = o.window;
    run_result e;
    if (!run(&dev, &ref, &e)) return 1;
    size_t bytes = (size_t)o.frames * o.tokens * o.dim * sizeof(float);
    int same = memcmp(r.outputs, e.outputs, bytes) == 0;
    printf("%s vs eager over a growable buffer: %s over %d frames\n",
           o.window ? (o.graph ? "ring, graph replay," : "ring") : "graph replay",
           same ? "identical" : "DIFFERENT", o.frames);
    status = same ? 0 : 1;
    run_free(&e);
  }
  run_free(&r);
  tide_destroy(dev.alloc);
  return status;
}
