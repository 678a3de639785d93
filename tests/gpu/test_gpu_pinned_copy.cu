/* test_gpu_pinned_copy.cu: pinned host memory from tidalloc's pool and
 * tide_memcpy on a GPU, as a streaming program offloads its per-frame
 * outputs (about 1.6 MB each).
 *
 * - Device -> pinned and pinned -> device copies keep every byte, and a
 *   kernel reads pinned memory directly (it is mapped for the device).
 * - tide_memcpy is asynchronous and ordered: queued after a kernel that
 *   waits (TIDE_GPU_WAIT_MS, default 300 ms) and then writes the source, it
 *   returns while the kernel runs and copies what the kernel wrote.
 * - A pinned block still the target of a copy on another stream is not
 *   handed out again before that copy is done; afterwards it is.
 * - Offloading frame after frame reuses the same pinned blocks: the backend
 *   pins memory only in the first frames. */
#include "gpu_check.h"

static uint64_t wait_ns(void) {
  const char *env = getenv("TIDE_GPU_WAIT_MS");
  long ms = env ? strtol(env, NULL, 10) : 300;
  return (uint64_t)(ms > 0 ? ms : 300) * 1000000ull;
}

/* pattern_word of gpu_check.h, for the CPU. */
static uint32_t host_word(uint64_t seed, uint64_t i) {
  uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return (uint32_t)(z ^ (z >> 31));
}

static void host_fill(void *p, size_t n, uint64_t seed) {
  uint32_t *w = (uint32_t *)p;
  for (size_t i = 0; i < n / 4; i++) w[i] = host_word(seed, i);
  for (size_t i = 0; i < n % 4; i++)
    ((uint8_t *)p)[n / 4 * 4 + i] = (uint8_t)host_word(seed, n / 4 + i);
}

static size_t host_wrong(const void *p, size_t n, uint64_t seed) {
  const uint32_t *w = (const uint32_t *)p;
  size_t bad = 0;
  for (size_t i = 0; i < n / 4; i++) bad += w[i] != host_word(seed, i);
  for (size_t i = 0; i < n % 4; i++)
    bad += ((const uint8_t *)p)[n / 4 * 4 + i] != (uint8_t)host_word(seed, n / 4 + i);
  return bad;
}

/* Wait `ns` on the GPU's clock, then write the pattern. */
__global__ void wait_then_fill_kernel(uint8_t *p, size_t n, uint64_t seed, uint64_t ns) {
  if (threadIdx.x == 0) {
    uint64_t start = global_ns();
    while (global_ns() - start < ns) __nanosleep(10000);
  }
  __syncthreads();
  fill_pattern(p, n, seed);
}

static void round_trip(tide_allocator *a, cudaStream_t s, size_t n) {
  char text[32];
  tide_stream ts = (tide_stream)s;
  void *d = tide_malloc(a, n, ts), *d2 = tide_malloc(a, n, ts);
  void *h = tide_pinned_malloc(a, n, ts);
  if (!check(d && d2 && h, "%zu bytes: a device block, another, and a pinned block", n)) return;
  check((uintptr_t)h % 4096 == 0, "%zu bytes: the pinned block %p is page-aligned", n, h);
  fill(d, n, 5, s);
  TIDE_OK_OR_DIE(tide_memcpy(a, h, d, n, ts));
  CUDA_OK(cudaStreamSynchronize(s));
  size_t wrong = host_wrong(h, n, 5);
  check(wrong == 0, "%s: device -> pinned keeps every byte (%zu word(s) wrong)",
        mib(n, text, sizeof text), wrong);

  host_fill(h, n, 6);
  TIDE_OK_OR_DIE(tide_memcpy(a, d2, h, n, ts));
  counter c = counter_new();
  queue_check(d2, n, 6, c.dev, s);
  unsigned long long bad = counter_take(c);
  check(bad == 0, "%s: pinned -> device keeps every byte (%llu word(s) wrong)",
        mib(n, text, sizeof text), bad);
  /* Mapped for the device: a kernel reads the pinned block itself. */
  queue_check(h, n, 6, c.dev, s);
  bad = counter_take(c);
  check(bad == 0, "%s: a kernel reads the pinned block directly (%llu word(s) wrong)",
        mib(n, text, sizeof text), bad);
  counter_free(c);

  /* Asynchronous and ordered after the kernel before it. */
  wait_then_fill_kernel<<<grid_for(n) < 128 ? grid_for(n) : 128, 256, 0, s>>>((uint8_t *)d, n, 7,
                                                                              wait_ns());
  CUDA_OK(cudaGetLastError());
  TIDE_OK_OR_DIE(tide_memcpy(a, h, d, n, ts));
  bool queued = cudaStreamQuery(s) == cudaErrorNotReady;
  check(queued, "%s: tide_memcpy returned while the kernel before it still ran",
        mib(n, text, sizeof text));
  CUDA_OK(cudaStreamSynchronize(s));
  wrong = host_wrong(h, n, 7);
  check(wrong == 0, "%s: the copy saw what the kernel before it wrote (%zu word(s) wrong)",
        mib(n, text, sizeof text), wrong);

  TIDE_OK_OR_DIE(tide_pinned_free(a, h, ts));
  TIDE_OK_OR_DIE(tide_free(a, d, ts));
  TIDE_OK_OR_DIE(tide_free(a, d2, ts));
}

/* A pinned block that a copy on stream B still writes is not reused. */
static void stream_ordered_reuse(tide_allocator *a, cudaStream_t sa, cudaStream_t sb, size_t n) {
  char text[32];
  tide_stream ta = (tide_stream)sa, tb = (tide_stream)sb;
  void *d = tide_malloc(a, n, tb);
  void *h = tide_pinned_malloc(a, n, ta);
  if (!check(d && h, "%s: blocks for the reuse case", mib(n, text, sizeof text))) return;
  wait_then_fill_kernel<<<grid_for(n) < 128 ? grid_for(n) : 128, 256, 0, sb>>>((uint8_t *)d, n, 8,
                                                                               wait_ns());
  CUDA_OK(cudaGetLastError());
  TIDE_OK_OR_DIE(tide_memcpy(a, h, d, n, tb)); /* B writes h once its kernel is done */
  TIDE_OK_OR_DIE(tide_pinned_record_stream(a, h, tb));
  TIDE_OK_OR_DIE(tide_pinned_free(a, h, ta));
  void *other = tide_pinned_malloc(a, n, ta);
  bool running = cudaStreamQuery(sb) == cudaErrorNotReady;
  check(running,
        "%s: B's copy was still queued when the block was asked for again (else raise "
        "TIDE_GPU_WAIT_MS)",
        mib(n, text, sizeof text));
  check(other != NULL && other != h, "%s: a block B still writes is not handed out (%p, %p)",
        mib(n, text, sizeof text), h, other);
  CUDA_OK(cudaStreamSynchronize(sb));
  size_t wrong = host_wrong(h, n, 8);
  check(wrong == 0, "%s: B's copy landed in the freed block undisturbed (%zu word(s) wrong)",
        mib(n, text, sizeof text), wrong);
  void *again = tide_pinned_malloc(a, n, ta);
  check(again == h, "%s: once B is done the block is reused (%p, %p)", mib(n, text, sizeof text), h,
        again);
  /* Freed on its own stream, a block is its stream's at once. */
  TIDE_OK_OR_DIE(tide_pinned_free(a, again, ta));
  void *same = tide_pinned_malloc(a, n, ta);
  check(same == again, "%s: freed on its own stream, reused by it at once",
        mib(n, text, sizeof text));
  TIDE_OK_OR_DIE(tide_pinned_free(a, same, ta));
  TIDE_OK_OR_DIE(tide_pinned_free(a, other, ta));
  TIDE_OK_OR_DIE(tide_free(a, d, tb));
}

/* Frame after frame: compute, offload the output, free it on the copy
 * stream. After the first frames no new memory is pinned. */
static void offload_frames(tide_allocator *a, cudaStream_t compute, cudaStream_t copy) {
  const size_t out = 1638400; /* depth + confidence of one frame, fp32 */
  const int frames = 200;
  cudaEvent_t done;
  CUDA_OK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  /* Start from nothing pinned, so that what is pinned at the end is the
   * loop's. */
  TIDE_OK_OR_DIE(tide_pinned_empty_cache(a));
  tide_stats st0;
  TIDE_OK_OR_DIE(tide_pinned_get_stats(a, &st0));
  uint64_t after_warmup = 0;
  size_t wrong = 0;
  void *keep[4] = {NULL, NULL, NULL, NULL}; /* a few frames' outputs stay alive */
  for (int f = 0; f < frames; f++) {
    void *d = tide_malloc(a, out, (tide_stream)compute);
    fill(d, out, 1000 + (uint64_t)f, compute);
    CUDA_OK(cudaEventRecord(done, compute));
    CUDA_OK(cudaStreamWaitEvent(copy, done, 0));
    void *h = tide_pinned_malloc(a, out, (tide_stream)copy);
    if (!h) gpu_fatal(__FILE__, __LINE__, "frame %d: %s", f, tide_last_error());
    TIDE_OK_OR_DIE(tide_memcpy(a, h, d, out, (tide_stream)copy));
    TIDE_OK_OR_DIE(tide_free(a, d, (tide_stream)copy));
    int slot = f % 4;
    if (keep[slot]) {
      CUDA_OK(cudaStreamSynchronize(copy));
      wrong += host_wrong(keep[slot], out, 1000 + (uint64_t)(f - 4));
      TIDE_OK_OR_DIE(tide_pinned_free(a, keep[slot], (tide_stream)copy));
    }
    keep[slot] = h;
    if (f == 10) {
      tide_stats st;
      TIDE_OK_OR_DIE(tide_pinned_get_stats(a, &st));
      after_warmup = st.num_device_alloc;
    }
  }
  CUDA_OK(cudaStreamSynchronize(copy));
  for (int i = 0; i < 4; i++) TIDE_OK_OR_DIE(tide_pinned_free(a, keep[i], (tide_stream)copy));
  tide_stats st;
  TIDE_OK_OR_DIE(tide_pinned_get_stats(a, &st));
  check(wrong == 0, "offload: %d frames of outputs arrived intact (%zu word(s) wrong)", frames,
        wrong);
  check(st.num_device_alloc == after_warmup,
        "offload: no memory pinned after frame 10 (%llu pinned allocations at frame 10, %llu "
        "at the end; %llu in all before the frames)",
        (unsigned long long)after_warmup, (unsigned long long)st.num_device_alloc,
        (unsigned long long)st0.num_device_alloc);
  check(st.reserved_bytes[0].current <= (int64_t)(8 * 2 * GPU_MiB),
        "offload: at most 8 blocks of 2 MiB pinned for 5 outputs in flight (%lld bytes)",
        (long long)st.reserved_bytes[0].current);
  CUDA_OK(cudaEventDestroy(done));
}

int main(void) {
  print_device();
  tide_allocator *a = gpu_allocator("");
  tide_stream ta, tb;
  TIDE_OK_OR_DIE(tide_stream_create(a, &ta));
  TIDE_OK_OR_DIE(tide_stream_create(a, &tb));
  cudaStream_t sa = (cudaStream_t)ta, sb = (cudaStream_t)tb;
  /* Warm-up: load the kernels. */
  {
    void *w = tide_malloc(a, GPU_MiB, ta);
    wait_then_fill_kernel<<<1, 32, 0, sa>>>((uint8_t *)w, 4, 1, 1000);
    fill(w, GPU_MiB, 1, sa);
    CUDA_OK(cudaStreamSynchronize(sa));
    TIDE_OK_OR_DIE(tide_free(a, w, ta));
  }
  static const size_t sizes[] = {4097, 1638400, 64 * GPU_MiB + 3};
  for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) round_trip(a, sa, sizes[i]);
  stream_ordered_reuse(a, sa, sb, 1638400);
  offload_frames(a, sa, sb);

  CUDA_OK(cudaStreamSynchronize(sa));
  CUDA_OK(cudaStreamSynchronize(sb));
  TIDE_OK_OR_DIE(tide_pinned_empty_cache(a));
  tide_stats st;
  TIDE_OK_OR_DIE(tide_pinned_get_stats(a, &st));
  check(st.reserved_bytes[0].current == 0 && st.allocations[0].current == 0,
        "after tide_pinned_empty_cache nothing is pinned (%lld bytes, %lld block(s) in use)",
        (long long)st.reserved_bytes[0].current, (long long)st.allocations[0].current);
  TIDE_OK_OR_DIE(tide_stream_destroy(a, ta));
  TIDE_OK_OR_DIE(tide_stream_destroy(a, tb));
  tide_status rc = tide_destroy(a);
  check(rc == TIDE_OK, "tide_destroy: %s", tide_status_name(rc));
  return finish("test_gpu_pinned_copy");
}
