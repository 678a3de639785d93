/* gpu_check.h: what the GPU tests share: checks that print one PASS or FAIL
 * line each, with the numbers behind them, and count failures; an allocator
 * on the CUDA backend; kernels that write a pattern into a block and count,
 * on the device, the words that differ from it; and a kernel that waits on
 * the GPU's clock before it checks its block (a long-running kernel).
 *
 * A CUDA or tidalloc call that must not fail ends the program at once with a
 * FAIL line (after a CUDA error the context may be unusable). Every program
 * ends with finish(), whose exit code is 0 only if every check passed. */
#ifndef TIDE_GPU_CHECK_H
#define TIDE_GPU_CHECK_H

#include <cuda_runtime.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "tidalloc.h"

#define GPU_MiB ((size_t)1 << 20)
#define GPU_GiB ((size_t)1 << 30)

static int gpu_checks, gpu_failures;

static inline void gpu_fatal(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4), noreturn));
static inline void gpu_fatal(const char *file, int line, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  printf("FAIL %s:%d: ", file, line);
  vprintf(fmt, ap);
  va_end(ap);
  printf("\nFAIL: stopped after %d check(s), %d failed before this\n", gpu_checks, gpu_failures);
  fflush(stdout);
  exit(1);
}

#define CUDA_OK(call)                                                                              \
  do {                                                                                             \
    cudaError_t e_ = (call);                                                                       \
    if (e_ != cudaSuccess)                                                                         \
      gpu_fatal(__FILE__, __LINE__, "%s: %s (%s)", #call, cudaGetErrorName(e_),                    \
                cudaGetErrorString(e_));                                                           \
  } while (0)

#define TIDE_OK_OR_DIE(call)                                                                       \
  do {                                                                                             \
    tide_status s_ = (call);                                                                       \
    if (s_ != TIDE_OK)                                                                             \
      gpu_fatal(__FILE__, __LINE__, "%s: %s: %s", #call, tide_status_name(s_), tide_last_error()); \
  } while (0)

/* One check: a PASS or FAIL line with what was checked and its numbers. */
static inline bool check(bool ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static inline bool check(bool ok, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  printf("%s: ", ok ? "PASS" : "FAIL");
  vprintf(fmt, ap);
  printf("\n");
  va_end(ap);
  fflush(stdout);
  gpu_checks++;
  if (!ok) gpu_failures++;
  return ok;
}

/* The summary line and the exit code. */
static inline int finish(const char *name) {
  printf("%s: %s: %d check(s), %d failed\n", gpu_failures ? "FAIL" : "PASS", name, gpu_checks,
         gpu_failures);
  fflush(stdout);
  return gpu_failures ? 1 : 0;
}

static inline bool has_word(const char *text, const char *word) {
  return text && strcasestr(text, word) != NULL;
}

static inline const char *mib(size_t bytes, char *buf, size_t len) {
  snprintf(buf, len, "%.1f MiB", (double)bytes / (double)GPU_MiB);
  return buf;
}

/* An allocator of device 0 on the CUDA backend with `conf` added. */
static inline tide_allocator *gpu_allocator(const char *conf) {
  char text[256];
  snprintf(text, sizeof text, "backend:cuda%s%s", conf && *conf ? "," : "", conf ? conf : "");
  tide_config *config = NULL;
  TIDE_OK_OR_DIE(tide_config_new(&config));
  TIDE_OK_OR_DIE(tide_config_parse(config, text));
  tide_allocator *a = NULL;
  tide_status rc = tide_create(0, config, &a);
  tide_config_free(config);
  if (rc != TIDE_OK)
    gpu_fatal(__FILE__, __LINE__, "tide_create(\"%s\"): %s: %s", text, tide_status_name(rc),
              tide_last_error());
  return a;
}

static inline tide_stats gpu_stats(tide_allocator *a) {
  tide_stats st;
  TIDE_OK_OR_DIE(tide_get_stats(a, &st));
  return st;
}

/* Print the device once, so that every log says where it ran. */
static inline void print_device(void) {
  cudaDeviceProp prop;
  int driver = 0, runtime = 0;
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  CUDA_OK(cudaDriverGetVersion(&driver));
  CUDA_OK(cudaRuntimeGetVersion(&runtime));
  printf("device: %s, sm_%d%d, %.1f GiB, driver CUDA %d.%d, runtime %d.%d, tidalloc %s\n",
         prop.name, prop.major, prop.minor, (double)prop.totalGlobalMem / (double)GPU_GiB,
         driver / 1000, driver % 1000 / 10, runtime / 1000, runtime % 1000 / 10, tide_version());
}

/* ------------------------------------------------------------------------ */
/* Patterns                                                                  */
/* ------------------------------------------------------------------------ */

/* The word at index i of the pattern `seed`. */
__device__ __forceinline__ uint32_t pattern_word(uint64_t seed, uint64_t i) {
  uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return (uint32_t)(z ^ (z >> 31));
}

/* This thread's share of writing the pattern into n bytes: whole words,
 * then the tail bytes. */
__device__ void fill_pattern(uint8_t *p, size_t n, uint64_t seed) {
  size_t words = n / 4;
  uint32_t *w = (uint32_t *)p;
  size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += stride)
    w[i] = pattern_word(seed, i);
  if (blockIdx.x == 0 && threadIdx.x < n % 4)
    p[words * 4 + threadIdx.x] = (uint8_t)pattern_word(seed, words + threadIdx.x);
}

/* Write the pattern into n bytes. */
__global__ void fill_kernel(uint8_t *p, size_t n, uint64_t seed) { fill_pattern(p, n, seed); }

/* Add to *bad the number of words (and tail bytes) that differ. */
__device__ void count_mismatches(const uint8_t *p, size_t n, uint64_t seed,
                                 unsigned long long *bad) {
  size_t words = n / 4;
  const uint32_t *w = (const uint32_t *)p;
  size_t stride = (size_t)gridDim.x * blockDim.x;
  unsigned long long mine = 0;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += stride)
    mine += w[i] != pattern_word(seed, i);
  if (blockIdx.x == 0 && threadIdx.x < n % 4)
    mine += p[words * 4 + threadIdx.x] != (uint8_t)pattern_word(seed, words + threadIdx.x);
  if (mine) atomicAdd(bad, mine);
}

__global__ void check_kernel(const uint8_t *p, size_t n, uint64_t seed, unsigned long long *bad) {
  count_mismatches(p, n, seed, bad);
}

__device__ __forceinline__ uint64_t global_ns(void) {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

/* A long-running kernel: every block waits `ns` nanoseconds on the GPU's
 * clock, then counts the mismatches of its part of the block. */
__global__ void wait_then_check_kernel(const uint8_t *p, size_t n, uint64_t seed, uint64_t ns,
                                       unsigned long long *bad) {
  if (threadIdx.x == 0) {
    uint64_t start = global_ns();
    while (global_ns() - start < ns) __nanosleep(10000);
  }
  __syncthreads();
  count_mismatches(p, n, seed, bad);
}

static inline unsigned grid_for(size_t n) {
  size_t words = n / 4 + 1;
  size_t blocks = (words + 255) / 256;
  return (unsigned)(blocks < 2048 ? blocks : 2048);
}

static inline void fill(void *p, size_t n, uint64_t seed, cudaStream_t stream) {
  fill_kernel<<<grid_for(n), 256, 0, stream>>>((uint8_t *)p, n, seed);
  CUDA_OK(cudaGetLastError());
}

/* Queue a count of the mismatches of [p, p+n) into *bad (device memory). */
static inline void queue_check(const void *p, size_t n, uint64_t seed, unsigned long long *bad,
                               cudaStream_t stream) {
  check_kernel<<<grid_for(n), 256, 0, stream>>>((const uint8_t *)p, n, seed, bad);
  CUDA_OK(cudaGetLastError());
}

/* A counter in device memory of its own (cudaMalloc, not tidalloc). */
typedef struct counter {
  unsigned long long *dev;
} counter;

static inline counter counter_new(void) {
  counter c;
  CUDA_OK(cudaMalloc((void **)&c.dev, sizeof *c.dev));
  CUDA_OK(cudaMemset(c.dev, 0, sizeof *c.dev));
  return c;
}

/* Wait for the device, read the counter and zero it. */
static inline unsigned long long counter_take(counter c) {
  unsigned long long v = 0;
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaMemcpy(&v, c.dev, sizeof v, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemset(c.dev, 0, sizeof *c.dev));
  return v;
}

static inline void counter_free(counter c) { CUDA_OK(cudaFree(c.dev)); }

/* ------------------------------------------------------------------------ */
/* Random sizes                                                              */
/* ------------------------------------------------------------------------ */

static inline uint64_t rng_next(uint64_t *state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* Log-uniform in [lo, hi], not rounded: odd sizes exercise the tails. */
static inline size_t rng_size(uint64_t *state, size_t lo, size_t hi) {
  double u = (double)(rng_next(state) >> 11) / 9007199254740992.0;
  double v = (double)lo * exp2(u * log2((double)hi / (double)lo));
  size_t s = (size_t)v;
  return s < lo ? lo : s > hi ? hi : s;
}

#endif /* TIDE_GPU_CHECK_H */
