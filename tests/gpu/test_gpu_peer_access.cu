/* test_gpu_peer_access.cu: a block tidalloc allocates on device 0 is read and
 * written by kernels on device 1 (peer_access:True, the default, grants it
 * through cuMemSetAccess: the runtime's peer switches do not cover memory
 * mapped this way).
 *
 * For a small-pool and a large-pool size, with expandable and with fixed
 * segments: device 0 fills the block; a kernel on device 1 checks every word
 * of it, then writes another pattern into it; device 0 checks that pattern.
 * A second block, allocated after the first (new pages mapped later), is
 * checked the same way, and tide_memcpy copies a block of device 0 into
 * memory of device 1. With fewer than two GPUs, or when device 1 cannot
 * reach device 0's memory at all, the test prints SKIP and passes. */
#include "gpu_check.h"

static void peer_case(tide_allocator *a, cudaStream_t s0, cudaStream_t s1, size_t size,
                      const char *mode, uint64_t seed) {
  char text[32];
  CUDA_OK(cudaSetDevice(0));
  void *p = tide_malloc(a, size, (tide_stream)s0);
  if (!check(p != NULL, "%s, %s: allocate on device 0", mode, mib(size, text, sizeof text))) return;
  fill(p, size, seed, s0);
  CUDA_OK(cudaStreamSynchronize(s0));

  /* Device 1 reads it, then writes it. */
  CUDA_OK(cudaSetDevice(1));
  counter c1 = counter_new();
  queue_check(p, size, seed, c1.dev, s1);
  unsigned long long wrong = counter_take(c1);
  check(wrong == 0, "%s, %s: a kernel on device 1 reads device 0's block (%llu word(s) wrong)",
        mode, mib(size, text, sizeof text), wrong);
  fill(p, size, seed + 1, s1);
  CUDA_OK(cudaStreamSynchronize(s1));
  counter_free(c1);

  /* Device 0 sees what device 1 wrote. */
  CUDA_OK(cudaSetDevice(0));
  counter c0 = counter_new();
  queue_check(p, size, seed + 1, c0.dev, s0);
  wrong = counter_take(c0);
  check(wrong == 0, "%s, %s: device 0 reads what device 1 wrote (%llu word(s) wrong)", mode,
        mib(size, text, sizeof text), wrong);

  /* A copy from device 0's block into device 1's memory. */
  CUDA_OK(cudaSetDevice(1));
  void *q = NULL;
  CUDA_OK(cudaMalloc(&q, size));
  CUDA_OK(cudaSetDevice(0));
  tide_status rc = tide_memcpy(a, q, p, size, (tide_stream)s0);
  check(rc == TIDE_OK, "%s, %s: tide_memcpy from device 0 to device 1: %s %s", mode,
        mib(size, text, sizeof text), tide_status_name(rc), rc ? tide_last_error() : "");
  CUDA_OK(cudaStreamSynchronize(s0));
  CUDA_OK(cudaSetDevice(1));
  c1 = counter_new();
  queue_check(q, size, seed + 1, c1.dev, s1);
  wrong = counter_take(c1);
  check(wrong == 0, "%s, %s: device 1 finds the copy intact (%llu word(s) wrong)", mode,
        mib(size, text, sizeof text), wrong);
  counter_free(c1);
  CUDA_OK(cudaFree(q));

  CUDA_OK(cudaSetDevice(0));
  counter_free(c0);
  TIDE_OK_OR_DIE(tide_free(a, p, (tide_stream)s0));
}

static void run_mode(const char *conf, const char *mode) {
  CUDA_OK(cudaSetDevice(0));
  tide_allocator *a = gpu_allocator(conf);
  cudaStream_t s0, s1;
  CUDA_OK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  CUDA_OK(cudaSetDevice(1));
  CUDA_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  static const size_t sizes[] = {256 * 1024, 64 * GPU_MiB + 512};
  /* Hold a block across the cases, so later ones map new pages. */
  CUDA_OK(cudaSetDevice(0));
  void *hold = tide_malloc(a, 3 * GPU_MiB, (tide_stream)s0);
  check(hold != NULL, "%s: a block held across the cases", mode);
  for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++)
    peer_case(a, s0, s1, sizes[i], mode, 100 + 10 * i);
  CUDA_OK(cudaSetDevice(0));
  TIDE_OK_OR_DIE(tide_free(a, hold, (tide_stream)s0));
  CUDA_OK(cudaStreamSynchronize(s0));
  CUDA_OK(cudaSetDevice(1));
  CUDA_OK(cudaStreamSynchronize(s1));
  CUDA_OK(cudaStreamDestroy(s1));
  CUDA_OK(cudaSetDevice(0));
  CUDA_OK(cudaStreamDestroy(s0));
  tide_status rc = tide_destroy(a);
  check(rc == TIDE_OK, "%s: tide_destroy: %s", mode, tide_status_name(rc));
}

int main(void) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n < 2) {
    printf("SKIP: test_gpu_peer_access needs 2 GPUs, and %d %s visible%s%s\n",
           e == cudaSuccess ? n : 0, n == 1 ? "is" : "are",
           e == cudaSuccess ? "" : ": cudaGetDeviceCount failed with ",
           e == cudaSuccess ? "" : cudaGetErrorName(e));
    return 0;
  }
  int can = 0;
  CUDA_OK(cudaDeviceCanAccessPeer(&can, 1, 0));
  if (!can) {
    printf("SKIP: test_gpu_peer_access: device 1 cannot access device 0's memory "
           "(cudaDeviceCanAccessPeer(1, 0) is 0: no peer path between them)\n");
    return 0;
  }
  print_device();
  printf("devices: %d; device 1 can access device 0\n", n);
  run_mode("", "expandable");
  run_mode("expandable_segments:false", "fixed");
  return finish("test_gpu_peer_access");
}
