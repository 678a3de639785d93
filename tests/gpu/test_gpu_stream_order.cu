/* test_gpu_stream_order.cu: a block still used by a kernel on another stream
 * is not handed out again before that kernel is done.
 *
 * A block p is allocated on stream A and filled there; stream B waits for
 * the fill, then runs a kernel that waits (TIDE_GPU_WAIT_MS, default 300 ms,
 * on the GPU's clock) before it checks p's pattern. While it waits, p is
 * freed on A after tide_record_stream(p, B) (or freed naming B as its
 * stream), and a block of the same size is allocated on A at once and
 * filled with another pattern. That block must not overlap p while B's
 * kernel runs, and B's kernel must find p intact. Once B is done, the same
 * request must be served from p's memory without reserving more. A control
 * checks that a block freed on its own stream is reused at once. Run for
 * expandable and fixed segments, for a small-pool and a large-pool size. */
#include "gpu_check.h"

static uint64_t wait_ns(void) {
  const char *env = getenv("TIDE_GPU_WAIT_MS");
  long ms = env ? strtol(env, NULL, 10) : 300;
  return (uint64_t)(ms > 0 ? ms : 300) * 1000000ull;
}

static bool overlap(const void *p, const void *q, size_t n) {
  uintptr_t a = (uintptr_t)p, b = (uintptr_t)q;
  return a < b + n && b < a + n;
}

typedef enum how { RECORD_STREAM, FREE_ON_B } how;

static void one_case(tide_allocator *a, tide_stream ta, tide_stream tb, size_t size, how how,
                     const char *mode) {
  cudaStream_t sa = (cudaStream_t)ta, sb = (cudaStream_t)tb;
  const char *what = how == RECORD_STREAM ? "record_stream(B) + free on A" : "free naming B";
  counter bad = counter_new();
  cudaEvent_t filled;
  CUDA_OK(cudaEventCreateWithFlags(&filled, cudaEventDisableTiming));

  void *p = tide_malloc(a, size, ta);
  if (!check(p != NULL, "%s, %zu bytes, %s: allocate p on A", mode, size, what)) return;
  fill(p, size, 11, sa);
  CUDA_OK(cudaEventRecord(filled, sa));
  CUDA_OK(cudaStreamWaitEvent(sb, filled, 0));
  /* One wave of blocks, so that every block waits at the same time. */
  unsigned grid = grid_for(size) < 128 ? grid_for(size) : 128;
  wait_then_check_kernel<<<grid, 256, 0, sb>>>((const uint8_t *)p, size, 11, wait_ns(), bad.dev);
  CUDA_OK(cudaGetLastError());

  if (how == RECORD_STREAM) {
    TIDE_OK_OR_DIE(tide_record_stream(a, p, tb));
    TIDE_OK_OR_DIE(tide_free(a, p, ta));
  } else {
    TIDE_OK_OR_DIE(tide_free(a, p, tb));
  }
  void *q = tide_malloc(a, size, ta);
  bool running = cudaStreamQuery(sb) == cudaErrorNotReady;
  check(q != NULL, "%s, %zu bytes, %s: allocate q on A at once", mode, size, what);
  check(running,
        "%s, %zu bytes, %s: B's kernel was still running when q was allocated (else "
        "raise TIDE_GPU_WAIT_MS)",
        mode, size, what);
  check(!q || !overlap(p, q, size), "%s, %zu bytes, %s: q %p does not overlap p %p while B runs",
        mode, size, what, q, p);
  if (q) fill(q, size, 22, sa); /* would clobber p if they overlapped */
  CUDA_OK(cudaStreamSynchronize(sa));
  CUDA_OK(cudaStreamSynchronize(sb));
  unsigned long long wrong = counter_take(bad);
  check(wrong == 0,
        "%s, %zu bytes, %s: B's kernel found p intact after its wait (%llu word(s) "
        "changed)",
        mode, size, what, wrong);

  /* B is done: p's memory serves the same request without growing. */
  tide_stats before = gpu_stats(a);
  void *r = tide_malloc(a, size, ta);
  tide_stats after = gpu_stats(a);
  check(r != NULL && after.reserved_bytes[0].current == before.reserved_bytes[0].current,
        "%s, %zu bytes, %s: after B is done the request is served from cached memory (reserved "
        "%lld -> %lld bytes, r %s p)",
        mode, size, what, (long long)before.reserved_bytes[0].current,
        (long long)after.reserved_bytes[0].current, r == p ? "==" : "!=");
  if (r) TIDE_OK_OR_DIE(tide_free(a, r, ta));
  if (q) TIDE_OK_OR_DIE(tide_free(a, q, ta));
  CUDA_OK(cudaEventDestroy(filled));
  counter_free(bad);
}

/* Control: freed on its own stream, a block is reused by the next request. */
static void same_stream_control(tide_allocator *a, tide_stream ta, size_t size, const char *mode) {
  void *p = tide_malloc(a, size, ta);
  fill(p, size, 33, (cudaStream_t)ta);
  TIDE_OK_OR_DIE(tide_free(a, p, ta));
  void *q = tide_malloc(a, size, ta);
  check(q == p, "%s, %zu bytes: a block freed on its own stream is reused at once (%p, %p)", mode,
        size, p, q);
  TIDE_OK_OR_DIE(tide_free(a, q, ta));
}

static void run_mode(const char *conf, const char *mode) {
  tide_allocator *a = gpu_allocator(conf);
  tide_stream ta, tb;
  TIDE_OK_OR_DIE(tide_stream_create(a, &ta));
  TIDE_OK_OR_DIE(tide_stream_create(a, &tb));
  static const size_t sizes[] = {256 * 1024, 64 * GPU_MiB + 512};
  /* Warm-up: load the kernels so that the timed part is only the test. */
  {
    counter c = counter_new();
    void *w = tide_malloc(a, GPU_MiB, ta);
    fill(w, GPU_MiB, 1, (cudaStream_t)ta);
    wait_then_check_kernel<<<1, 32, 0, (cudaStream_t)ta>>>((const uint8_t *)w, 4, 1, 1000, c.dev);
    CUDA_OK(cudaGetLastError());
    (void)counter_take(c);
    TIDE_OK_OR_DIE(tide_free(a, w, ta));
    counter_free(c);
  }
  for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
    same_stream_control(a, ta, sizes[i], mode);
    one_case(a, ta, tb, sizes[i], RECORD_STREAM, mode);
    one_case(a, ta, tb, sizes[i], FREE_ON_B, mode);
  }
  TIDE_OK_OR_DIE(tide_stream_synchronize(a, ta));
  TIDE_OK_OR_DIE(tide_stream_synchronize(a, tb));
  TIDE_OK_OR_DIE(tide_empty_cache(a));
  tide_stats st = gpu_stats(a);
  check(st.active_blocks[0].current == 0 && st.reserved_bytes[0].current == 0,
        "%s: nothing left active (%lld) or reserved (%lld bytes) after empty_cache", mode,
        (long long)st.active_blocks[0].current, (long long)st.reserved_bytes[0].current);
  TIDE_OK_OR_DIE(tide_stream_destroy(a, ta));
  TIDE_OK_OR_DIE(tide_stream_destroy(a, tb));
  tide_status rc = tide_destroy(a);
  check(rc == TIDE_OK, "%s: tide_destroy: %s", mode, tide_status_name(rc));
}

int main(void) {
  print_device();
  run_mode("expandable_segments:true", "expandable");
  run_mode("expandable_segments:false", "fixed");
  return finish("test_gpu_stream_order");
}
