/* driver_check.h: what the driver benchmarks (vmm_costs, vmm_scale,
 * copy_launch, vmm_overlap) share: a microsecond clock, a check of a
 * driver call's result that says which call failed and how, and the set-up
 * of a device's primary context. Define
 * BENCH_NAME, the program's name for its messages, before including. */
#ifndef BENCH_GPU_DRIVER_CHECK_H
#define BENCH_GPU_DRIVER_CHECK_H

#include <cuda.h>
#include <stdio.h>
#include <time.h>

static inline double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

/* 0 when the call succeeded; else 1, with "NAME: CALL failed: ERROR". */
static inline int check(CUresult r, const char *call) {
  if (r == CUDA_SUCCESS) return 0;
  const char *name = NULL;
  cuGetErrorName(r, &name);
  fprintf(stderr, "%s: %s failed: %s\n", BENCH_NAME, call, name ? name : "?");
  return 1;
}

/* Initialize the driver and make device `device`'s primary context current
 * (release it with cuDevicePrimaryCtxRelease(*dev)). 0 on success; else 1,
 * with the failed call named. */
static inline int open_primary_context(int device, CUdevice *dev) {
  CUcontext ctx;
  return check(cuInit(0), "cuInit") || check(cuDeviceGet(dev, device), "cuDeviceGet") ||
         check(cuDevicePrimaryCtxRetain(&ctx, *dev), "cuDevicePrimaryCtxRetain") ||
         check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
}

#endif
