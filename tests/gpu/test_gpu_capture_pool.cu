/* test_gpu_capture_pool.cu: CUDA graphs whose memory comes from a capture
 * pool that keeps growing, replayed many times, checked bit for bit against
 * eager runs; then a checkpoint and restore of the pool.
 *
 * - A step (five kernels on two streams) allocates its intermediate buffers
 *   and its output, frees the intermediates as soon as their readers are
 *   queued (so later allocations of the step take their memory again), and
 *   forks a second stream that allocates and frees too. Run eagerly, its memory comes from the
 *   allocator's usual memory.
 * - The step is captured (global mode) into a graph with tide_capture_begin:
 *   every allocation of the capture, the forked stream's included, must come
 *   from the pool, whose pages are mapped during the capture. A block of the
 *   usual memory freed in the capture is not reused before the capture
 *   ends, and is after.
 * - The graph is replayed on fresh inputs many times. Between replays the
 *   pool grows: a block is allocated in it on a third stream (outside any
 *   capture; pages are mapped) and filled with a pattern. After every replay
 *   the graph's output must equal an eager run's bit for bit, and every so
 *   often every grown block must still hold its pattern: addresses never
 *   move, and the pool never hands the graph's memory to anyone else.
 * - Checkpoint and restore: with the graph's output allocated, the pool is
 *   checkpointed; the output is freed and a large block allocated in the
 *   graph's own segment (new pages, merged free blocks) and freed; the
 *   restore must give the output back at the same address, figures as at
 *   the checkpoint, and a replay must still be exact.
 * - Releasing the pool's users returns its memory to the device.
 * The grown blocks are allocated on their own stream: a block allocated in
 * the pool after the capture on the capture's stream could take memory the
 * capture freed, which every replay writes (as with PyTorch's pools). */
#include "gpu_check.h"

#define N_FLOATS ((size_t)3 * 1024 * 1024 + 123) /* about 12 MiB per buffer: pages mapped */
#define MAX_REPLAYS 120 /* TIDE_GPU_SCALE=N (the memcheck run) divides it by N */

__device__ __forceinline__ size_t first_index(void) {
  return (size_t)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ size_t stride(void) { return (size_t)gridDim.x * blockDim.x; }

__global__ void k_input(float *in, size_t n, uint64_t seed) {
  for (size_t i = first_index(); i < n; i += stride())
    in[i] = (float)(pattern_word(seed, i) >> 8) * 0x1p-22f - 2.0f;
}

__global__ void k_first(const float *in, float *t1, size_t n) {
  for (size_t i = first_index(); i < n; i += stride()) t1[i] = sinf(in[i]) * 1.5f + 0.25f;
}

__global__ void k_mix(const float *t1, const float *in, float *t2, size_t n) {
  for (size_t i = first_index(); i < n; i += stride())
    t2[i] = t1[i] * in[(i * 7) % n] - 0.5f * t1[n - 1 - i];
}

__global__ void k_third(const float *t2, float *t3, size_t n) {
  for (size_t i = first_index(); i < n; i += stride()) t3[i] = t2[i] * t2[i] + 1.0f;
}

__global__ void k_side(const float *t2, float *t4, size_t n) {
  for (size_t i = first_index(); i < n; i += stride()) t4[i] = 2.0f * t2[i] - 3.0f;
}

__global__ void k_out(const float *t3, const float *t4, float *out, size_t n) {
  for (size_t i = first_index(); i < n; i += stride()) out[i] = t3[i] / (1.0f + fabsf(t4[i]));
}

/* Words of x and y that differ, bit for bit, added to *bad. */
__global__ void k_compare(const uint32_t *x, const uint32_t *y, size_t n, unsigned long long *bad) {
  unsigned long long mine = 0;
  for (size_t i = first_index(); i < n; i += stride()) mine += x[i] != y[i];
  if (mine) atomicAdd(bad, mine);
}

static const unsigned GRID = 1024, THREADS = 256;

typedef struct streams {
  cudaStream_t main, side;
  cudaEvent_t fork, join, fork2, join2;
} streams;

static float *alloc_floats(tide_allocator *a, cudaStream_t s, const char *what) {
  void *p = tide_malloc(a, N_FLOATS * sizeof(float), (tide_stream)s);
  if (!p) gpu_fatal(__FILE__, __LINE__, "tide_malloc(%s): %s", what, tide_last_error());
  return (float *)p;
}

/* One step: out = f(in), through four intermediate buffers, two streams.
 * Each intermediate is freed once its last reader is queued; the buffer
 * allocated after a free takes its memory again. */
static float *step(tide_allocator *a, const streams *st, const float *in, float *mine[4]) {
  size_t n = N_FLOATS;
  float *t1 = alloc_floats(a, st->main, "t1");
  k_first<<<GRID, THREADS, 0, st->main>>>(in, t1, n);
  float *t2 = alloc_floats(a, st->main, "t2");
  k_mix<<<GRID, THREADS, 0, st->main>>>(t1, in, t2, n);
  TIDE_OK_OR_DIE(tide_free(a, t1, (tide_stream)st->main));
  float *t3 = alloc_floats(a, st->main, "t3"); /* t1's memory */
  k_third<<<GRID, THREADS, 0, st->main>>>(t2, t3, n);
  CUDA_OK(cudaEventRecord(st->fork, st->main));
  CUDA_OK(cudaStreamWaitEvent(st->side, st->fork, 0));
  float *t4 = alloc_floats(a, st->side, "t4");
  k_side<<<GRID, THREADS, 0, st->side>>>(t2, t4, n);
  CUDA_OK(cudaEventRecord(st->join, st->side));
  CUDA_OK(cudaStreamWaitEvent(st->main, st->join, 0));
  TIDE_OK_OR_DIE(tide_free(a, t2, (tide_stream)st->main)); /* after the join: side is done */
  float *out = alloc_floats(a, st->main, "out");           /* t2's memory */
  k_out<<<GRID, THREADS, 0, st->main>>>(t3, t4, out, n);
  CUDA_OK(cudaGetLastError());
  TIDE_OK_OR_DIE(tide_free(a, t3, (tide_stream)st->main));
  /* t4 goes on its own stream, once that is ordered after k_out; then the
   * fork joins again. */
  CUDA_OK(cudaEventRecord(st->fork2, st->main));
  CUDA_OK(cudaStreamWaitEvent(st->side, st->fork2, 0));
  TIDE_OK_OR_DIE(tide_free(a, t4, (tide_stream)st->side));
  CUDA_OK(cudaEventRecord(st->join2, st->side));
  CUDA_OK(cudaStreamWaitEvent(st->main, st->join2, 0));
  if (mine) {
    mine[0] = t1;
    mine[1] = t2;
    mine[2] = t3;
    mine[3] = t4;
  }
  return out;
}

/* Mismatching words between the graph's output and an eager step on the
 * same input, in general memory. */
static unsigned long long compare_with_eager(tide_allocator *a, const streams *st, const float *in,
                                             const float *graph_out, counter bad) {
  float *eager = step(a, st, in, NULL);
  k_compare<<<GRID, THREADS, 0, st->main>>>((const uint32_t *)graph_out, (const uint32_t *)eager,
                                            N_FLOATS, bad.dev);
  CUDA_OK(cudaGetLastError());
  unsigned long long wrong = counter_take(bad);
  TIDE_OK_OR_DIE(tide_free(a, eager, (tide_stream)st->main));
  return wrong;
}

typedef struct grown {
  void *ptr;
  size_t size;
  uint64_t seed;
} grown;

/* A block allocated in the pool outside any capture, on stream g, filled. */
static grown grow_pool(tide_allocator *a, tide_pool *pool, cudaStream_t g, size_t size,
                       uint64_t seed) {
  TIDE_OK_OR_DIE(tide_capture_begin(a, (tide_stream)g, pool));
  void *p = tide_malloc(a, size, (tide_stream)g);
  TIDE_OK_OR_DIE(tide_capture_end(a, (tide_stream)g));
  TIDE_OK_OR_DIE(tide_pool_release(pool)); /* the begin's use: nothing was captured */
  if (!p)
    gpu_fatal(__FILE__, __LINE__, "growing the pool by %zu bytes: %s", size, tide_last_error());
  fill(p, size, seed, g);
  return (grown){p, size, seed};
}

static unsigned long long check_grown(const grown *g, int n, cudaStream_t s, counter bad) {
  for (int i = 0; i < n; i++) queue_check(g[i].ptr, g[i].size, g[i].seed, bad.dev, s);
  return counter_take(bad);
}

int main(void) {
  print_device();
  CUDA_OK(cudaFree(0));
  tide_allocator *a = gpu_allocator("expandable_segments:true");
  streams st;
  cudaStream_t g;
  CUDA_OK(cudaStreamCreateWithFlags(&st.main, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&st.side, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&g, cudaStreamNonBlocking));
  CUDA_OK(cudaEventCreateWithFlags(&st.fork, cudaEventDisableTiming));
  CUDA_OK(cudaEventCreateWithFlags(&st.join, cudaEventDisableTiming));
  CUDA_OK(cudaEventCreateWithFlags(&st.fork2, cudaEventDisableTiming));
  CUDA_OK(cudaEventCreateWithFlags(&st.join2, cudaEventDisableTiming));
  counter bad = counter_new();
  size_t dev_free0 = 0, dev_total = 0;
  CUDA_OK(cudaMemGetInfo(&dev_free0, &dev_total));

  /* The input lives in the usual memory; the graph reads it where it is. */
  float *in = alloc_floats(a, st.main, "in");
  /* Eager once, so that the usual memory has the step's blocks cached. */
  k_input<<<GRID, THREADS, 0, st.main>>>(in, N_FLOATS, 1);
  float *warm = step(a, &st, in, NULL);
  TIDE_OK_OR_DIE(tide_free(a, warm, (tide_stream)st.main));
  void *before = tide_malloc(a, 6 * GPU_MiB, (tide_stream)st.main); /* freed in the capture */
  CUDA_OK(cudaStreamSynchronize(st.main));

  tide_pool *pool = NULL;
  TIDE_OK_OR_DIE(tide_pool_create(a, &pool));
  tide_stats s0 = gpu_stats(a);

  /* ---- Capture. */
  CUDA_OK(cudaStreamBeginCapture(st.main, cudaStreamCaptureModeGlobal));
  TIDE_OK_OR_DIE(tide_capture_begin(a, (tide_stream)st.main, pool));
  TIDE_OK_OR_DIE(tide_free(a, before, (tide_stream)st.main));
  tide_stats deferring = gpu_stats(a);
  check(deferring.active_bytes[0].current - deferring.allocated_bytes[0].current ==
            (int64_t)(6 * GPU_MiB),
        "a block of the usual memory freed in the capture waits for its end (%lld bytes wait)",
        (long long)(deferring.active_bytes[0].current - deferring.allocated_bytes[0].current));
  void *not_before = tide_malloc(a, 6 * GPU_MiB, (tide_stream)st.main);
  check(not_before != NULL && not_before != before,
        "an allocation of the capture comes from the pool, not from that block");
  float *inner[4];
  float *out = step(a, &st, in, inner);
  tide_stats in_pool;
  TIDE_OK_OR_DIE(tide_pool_get_stats(pool, &in_pool));
  check(in_pool.num_allocs == 6,
        "every allocation of the capture, the forked stream's included, came from the pool (%llu "
        "of 6)",
        (unsigned long long)in_pool.num_allocs);
  tide_stats s1 = gpu_stats(a);
  TIDE_OK_OR_DIE(tide_free(a, not_before, (tide_stream)st.main));
  cudaGraph_t graph = NULL;
  cudaError_t e = cudaStreamEndCapture(st.main, &graph);
  check(e == cudaSuccess && graph, "cudaStreamEndCapture after allocating from the pool: %s",
        cudaGetErrorName(e));
  if (e != cudaSuccess) gpu_fatal(__FILE__, __LINE__, "the capture broke: nothing more to test");
  TIDE_OK_OR_DIE(tide_capture_end(a, (tide_stream)st.main));
  tide_stats ps;
  TIDE_OK_OR_DIE(tide_pool_get_stats(pool, &ps));
  check(s1.pages_mapped > s0.pages_mapped && ps.reserved_bytes[0].current > 0,
        "pages were mapped into the pool during the capture (%llu pages, pool %lld bytes)",
        (unsigned long long)(s1.pages_mapped - s0.pages_mapped),
        (long long)ps.reserved_bytes[0].current);
  check(ps.allocated_bytes[0].current == (int64_t)(N_FLOATS * sizeof(float) + 511) / 512 * 512,
        "after the capture the pool holds the output only (%lld bytes allocated)",
        (long long)ps.allocated_bytes[0].current);
  check(inner[2] == inner[0] && out == inner[1],
        "inside the capture freed blocks were taken again (t3 at t1, out at t2)");
  tide_stats ended = gpu_stats(a);
  check(ended.active_bytes[0].current == ended.allocated_bytes[0].current,
        "after the capture the deferred block is free (%lld bytes still wait)",
        (long long)(ended.active_bytes[0].current - ended.allocated_bytes[0].current));

  cudaGraphExec_t exec;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

  /* ---- Replays, the pool growing between them. */
  const char *scale_env = getenv("TIDE_GPU_SCALE");
  int scale = scale_env && atoi(scale_env) > 0 ? atoi(scale_env) : 1;
  const int replays = MAX_REPLAYS / scale;
  grown kept[MAX_REPLAYS];
  int nkept = 0, wrong_replays = 0;
  unsigned long long worst = 0;
  int64_t pool_reserved0 = ps.reserved_bytes[0].current;
  for (int r = 0; r < replays; r++) {
    k_input<<<GRID, THREADS, 0, st.main>>>(in, N_FLOATS, 1000 + (uint64_t)r);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaGraphLaunch(exec, st.main));
    unsigned long long wrong = compare_with_eager(a, &st, in, out, bad);
    if (wrong) wrong_replays++;
    if (wrong > worst) worst = wrong;
    kept[nkept] = grow_pool(a, pool, g, 2 * GPU_MiB + (size_t)r * 40 * 1024 + 100, 50 + r);
    nkept++;
    if (r % 20 == 19) {
      unsigned long long lost = check_grown(kept, nkept, g, bad);
      check(lost == 0, "replay %d: the %d blocks the pool grew by keep their data (%llu wrong)",
            r + 1, nkept, lost);
    }
  }
  check(wrong_replays == 0,
        "%d replays on fresh inputs equal eager runs bit for bit (%d "
        "differed, at most %llu words)",
        replays, wrong_replays, worst);
  TIDE_OK_OR_DIE(tide_pool_get_stats(pool, &ps));
  check(ps.reserved_bytes[0].current > pool_reserved0,
        "the pool grew between replays: %lld -> %lld bytes", (long long)pool_reserved0,
        (long long)ps.reserved_bytes[0].current);

  /* ---- Checkpoint and restore. */
  tide_checkpoint *ck = NULL;
  TIDE_OK_OR_DIE(tide_pool_checkpoint(pool, &ck));
  tide_stats at_ck;
  TIDE_OK_OR_DIE(tide_pool_get_stats(pool, &at_ck));
  CUDA_OK(cudaStreamSynchronize(st.main));
  TIDE_OK_OR_DIE(tide_free(a, out, (tide_stream)st.main)); /* the output goes... */
  TIDE_OK_OR_DIE(tide_capture_begin(a, (tide_stream)st.main, pool));
  void *big = tide_malloc(a, 200 * GPU_MiB, (tide_stream)st.main); /* ...new pages, merged */
  TIDE_OK_OR_DIE(tide_capture_end(a, (tide_stream)st.main));
  TIDE_OK_OR_DIE(tide_pool_release(pool));
  if (!big) gpu_fatal(__FILE__, __LINE__, "200 MiB in the pool: %s", tide_last_error());
  fill(big, 200 * GPU_MiB, 7, st.main); /* overwrites the free memory the graph uses */
  TIDE_OK_OR_DIE(tide_free(a, big, (tide_stream)st.main));
  tide_stats grown_st;
  TIDE_OK_OR_DIE(tide_pool_get_stats(pool, &grown_st));
  tide_restore_delta d;
  tide_status rc = tide_pool_restore(pool, ck, &d);
  check(rc == TIDE_OK, "tide_pool_restore after growth and merging: %s %s", tide_status_name(rc),
        rc == TIDE_OK ? "" : tide_last_error());
  bool back = rc == TIDE_OK && d.nrestored == 1 && d.restored[0] == (void *)out && d.nreleased == 0;
  check(back, "the restore gives the output back at %p (%zu restored, %zu released)", (void *)out,
        d.nrestored, d.nreleased);
  tide_restore_delta_free(&d);
  TIDE_OK_OR_DIE(tide_pool_get_stats(pool, &ps));
  check(ps.allocated_bytes[0].current == at_ck.allocated_bytes[0].current &&
            ps.allocations[0].current == at_ck.allocations[0].current &&
            ps.reserved_bytes[0].current == grown_st.reserved_bytes[0].current,
        "figures after the restore: allocated %lld (checkpoint %lld), reserved %lld (kept)",
        (long long)ps.allocated_bytes[0].current, (long long)at_ck.allocated_bytes[0].current,
        (long long)ps.reserved_bytes[0].current);
  k_input<<<GRID, THREADS, 0, st.main>>>(in, N_FLOATS, 99);
  CUDA_OK(cudaGraphLaunch(exec, st.main));
  unsigned long long wrong = compare_with_eager(a, &st, in, out, bad);
  check(wrong == 0, "a replay after the restore equals an eager run (%llu words differ)", wrong);
  check(check_grown(kept, nkept, g, bad) == 0, "the grown blocks kept their data through it");
  tide_checkpoint_free(ck);

  /* ---- Release: the pool's memory goes back to the device. */
  CUDA_OK(cudaGraphExecDestroy(exec));
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaDeviceSynchronize());
  TIDE_OK_OR_DIE(tide_free(a, out, (tide_stream)st.main));
  for (int i = 0; i < nkept; i++) TIDE_OK_OR_DIE(tide_free(a, kept[i].ptr, (tide_stream)g));
  TIDE_OK_OR_DIE(tide_pool_get_stats(pool, &ps));
  int64_t pool_bytes = ps.reserved_bytes[0].current;
  tide_stats before_release = gpu_stats(a);
  TIDE_OK_OR_DIE(tide_pool_release(pool)); /* the graph's */
  TIDE_OK_OR_DIE(tide_pool_release(pool)); /* ours: the last */
  tide_stats after_release = gpu_stats(a);
  check(before_release.reserved_bytes[0].current - after_release.reserved_bytes[0].current ==
            pool_bytes,
        "the last release returns the pool's %lld bytes", (long long)pool_bytes);
  TIDE_OK_OR_DIE(tide_free(a, in, (tide_stream)st.main));
  TIDE_OK_OR_DIE(tide_empty_cache(a));
  size_t dev_free1 = 0;
  CUDA_OK(cudaMemGetInfo(&dev_free1, &dev_total));
  check(dev_free1 + 64 * GPU_MiB >= dev_free0, "the device's free memory is back (%zu of %zu MiB)",
        dev_free1 >> 20, dev_free0 >> 20);
  counter_free(bad);
  CUDA_OK(cudaEventDestroy(st.fork));
  CUDA_OK(cudaEventDestroy(st.join));
  CUDA_OK(cudaEventDestroy(st.fork2));
  CUDA_OK(cudaEventDestroy(st.join2));
  CUDA_OK(cudaStreamDestroy(st.main));
  CUDA_OK(cudaStreamDestroy(st.side));
  CUDA_OK(cudaStreamDestroy(g));
  tide_status done = tide_destroy(a);
  check(done == TIDE_OK, "tide_destroy: %s", tide_status_name(done));
  return finish("test_gpu_capture_pool");
}
