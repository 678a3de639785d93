/* test_gpu_capture.cu: allocating while a stream is captured into a CUDA
 * graph does not break the capture.
 *
 * A stream begins capturing (global mode, the strictest and PyTorch's
 * default; then thread-local and relaxed). Inside the capture:
 * - tide_malloc on the capturing stream, whose arena is new, so the call
 *   reserves address space and creates, maps and opens pages;
 * - a kernel writes the block (captured, not run);
 * - tide_malloc on the default stream and on another stream (more mapping);
 * - tide_stream_synchronize of the capturing stream: waiting for a capture is
 *   illegal, so it must answer TIDE_ERR_NOT_READY and leave the capture
 *   alone; the default stream may be waited for, unless the capturing stream
 *   is a blocking one (then the legacy stream is part of the capture);
 * - the stream must still be capturing after each of these.
 * cudaStreamEndCapture must succeed; the graph, launched, must write the
 * block. Last, what tide_empty_cache does inside a capture (it gives pages
 * back, which the driver may treat as synchronizing) is printed, as INFO
 * lines, not checked: that is the allocator's policy to decide. */
#include "gpu_check.h"

static const char *mode_name(cudaStreamCaptureMode m) {
  return m == cudaStreamCaptureModeGlobal        ? "global"
         : m == cudaStreamCaptureModeThreadLocal ? "thread-local"
                                                 : "relaxed";
}

static bool still_capturing(cudaStream_t s) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaError_t e = cudaStreamIsCapturing(s, &status);
  return e == cudaSuccess && status == cudaStreamCaptureStatusActive;
}

static void capture_case(cudaStreamCaptureMode mode, bool blocking) {
  const char *m = mode_name(mode);
  const char *kind = blocking ? "blocking stream" : "non-blocking stream";
  tide_allocator *a = gpu_allocator("expandable_segments:true");
  cudaStream_t s, other;
  CUDA_OK(cudaStreamCreateWithFlags(&s, blocking ? cudaStreamDefault : cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  const size_t size = 8 * GPU_MiB + 512;
  counter bad = counter_new();
  CUDA_OK(cudaDeviceSynchronize());

  CUDA_OK(cudaStreamBeginCapture(s, mode));
  void *p = tide_malloc(a, size, (tide_stream)s);
  check(p != NULL, "%s capture, %s: tide_malloc on the capturing stream%s%s", m, kind,
        p ? "" : ": ", p ? "" : tide_last_error());
  check(still_capturing(s), "%s capture, %s: still capturing after mapping its pages", m, kind);
  if (p) fill(p, size, 77, s);

  void *q = tide_malloc(a, 3 * GPU_MiB, NULL);
  check(q != NULL && still_capturing(s),
        "%s capture, %s: tide_malloc on the default stream meanwhile, capture intact", m, kind);
  void *r = tide_malloc(a, 40 * GPU_MiB, (tide_stream)other);
  check(r != NULL && still_capturing(s),
        "%s capture, %s: tide_malloc on another stream meanwhile, capture intact", m, kind);
  if (r) TIDE_OK_OR_DIE(tide_free(a, r, (tide_stream)other));

  tide_status st = tide_stream_synchronize(a, (tide_stream)s);
  printf("  tide_stream_synchronize(capturing stream) -> %s: %s\n", tide_status_name(st),
         tide_last_error());
  check(st == TIDE_ERR_NOT_READY && still_capturing(s),
        "%s capture, %s: synchronizing the capturing stream answers TIDE_ERR_NOT_READY (%s) "
        "and leaves the capture alone",
        m, kind, tide_status_name(st));
  st = tide_stream_synchronize(a, NULL);
  printf("  tide_stream_synchronize(default stream) -> %s: %s\n", tide_status_name(st),
         st == TIDE_OK ? "" : tide_last_error());
  /* A blocking stream's capture would take the legacy stream in; a
   * non-blocking one leaves it free to be waited for. */
  check(st == (blocking ? TIDE_ERR_NOT_READY : TIDE_OK) && still_capturing(s),
        "%s capture, %s: synchronizing the default stream answers %s, capture intact", m, kind,
        tide_status_name(st));

  cudaGraph_t graph = NULL;
  cudaError_t e = cudaStreamEndCapture(s, &graph);
  check(e == cudaSuccess && graph != NULL, "%s capture, %s: cudaStreamEndCapture: %s", m, kind,
        cudaGetErrorName(e));
  if (e != cudaSuccess) (void)cudaGetLastError();
  if (e == cudaSuccess && graph && p) {
    cudaGraphExec_t exec;
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_OK(cudaGraphLaunch(exec, s));
    CUDA_OK(cudaStreamSynchronize(s));
    queue_check(p, size, 77, bad.dev, s);
    unsigned long long wrong = counter_take(bad);
    check(wrong == 0, "%s capture, %s: the graph wrote the block (%llu word(s) wrong)", m, kind,
          wrong);
    CUDA_OK(cudaGraphExecDestroy(exec));
  }
  if (graph) CUDA_OK(cudaGraphDestroy(graph));
  /* After the capture the stream can be waited for again. */
  st = tide_stream_synchronize(a, (tide_stream)s);
  check(st == TIDE_OK, "%s capture, %s: after the capture, synchronize works (%s)", m, kind,
        tide_status_name(st));
  if (p) TIDE_OK_OR_DIE(tide_free(a, p, (tide_stream)s));
  if (q) TIDE_OK_OR_DIE(tide_free(a, q, NULL));
  TIDE_OK_OR_DIE(tide_empty_cache(a));
  CUDA_OK(cudaStreamDestroy(s));
  CUDA_OK(cudaStreamDestroy(other));
  counter_free(bad);
  tide_status rc = tide_destroy(a);
  check(rc == TIDE_OK, "%s capture, %s: tide_destroy: %s", m, kind, tide_status_name(rc));
}

/* Not a check: what happens to tide_empty_cache inside a global capture. */
static void empty_cache_during_capture(void) {
  tide_allocator *a = gpu_allocator("expandable_segments:true");
  cudaStream_t s, other;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  void *warm = tide_malloc(a, 16 * GPU_MiB, (tide_stream)s);
  if (warm) TIDE_OK_OR_DIE(tide_free(a, warm, (tide_stream)s));
  CUDA_OK(cudaStreamSynchronize(s));
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  void *r = tide_malloc(a, 40 * GPU_MiB, (tide_stream)other);
  if (r) TIDE_OK_OR_DIE(tide_free(a, r, (tide_stream)other));
  tide_status st = tide_empty_cache(a);
  printf("INFO: tide_empty_cache inside a global capture -> %s%s%s\n", tide_status_name(st),
         st == TIDE_OK ? "" : ": ", st == TIDE_OK ? "" : tide_last_error());
  printf("INFO: the stream is %s capturing afterwards\n", still_capturing(s) ? "still" : "NOT");
  cudaGraph_t graph = NULL;
  cudaError_t e = cudaStreamEndCapture(s, &graph);
  printf("INFO: cudaStreamEndCapture after it -> %s\n", cudaGetErrorName(e));
  if (e != cudaSuccess) (void)cudaGetLastError();
  if (graph) CUDA_OK(cudaGraphDestroy(graph));
  st = tide_empty_cache(a);
  printf("INFO: tide_empty_cache after the capture -> %s\n", tide_status_name(st));
  CUDA_OK(cudaStreamDestroy(s));
  CUDA_OK(cudaStreamDestroy(other));
  (void)tide_destroy(a);
}

int main(void) {
  print_device();
  CUDA_OK(cudaFree(0));
  capture_case(cudaStreamCaptureModeGlobal, false);
  capture_case(cudaStreamCaptureModeThreadLocal, false);
  capture_case(cudaStreamCaptureModeRelaxed, false);
  capture_case(cudaStreamCaptureModeGlobal, true);
  empty_cache_during_capture();
  return finish("test_gpu_capture");
}
