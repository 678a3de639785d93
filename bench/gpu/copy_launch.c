/* copy_launch.c: what a device-to-device copy costs the issuing thread and
 * the GPU when its memory is made of many mappings (expandable segments'
 * handles) rather than one allocation.
 *
 * Why: in the streaming workload the same 256 cache copies a frame took
 * 14.9 us each to issue with expandable segments (4 MiB handles) and 6.8 us
 * with fixed segments (one handle per segment), about 2 ms of a growing
 * frame, whose time is the issuing thread's. This program tells whether the
 * driver's cost follows the number of mappings a copy spans, and whether
 * cuMemcpyDtoDAsync, which states that both sides are device memory, costs
 * less than cuMemcpyAsync, which must find out.
 *
 * For copy sizes of 64 and 256 MiB, between two ranges made of handles of
 * 2, 4 and 16 MiB, or of one handle each ("whole"), or from cuMemAlloc
 * ("cumemalloc"): issue `--launches` copies with each call, timing each
 * call on the CPU, and the whole batch on the GPU with events.
 * Output: CSV rows
 *   memory,handle_mb,copy_mb,call,launches,us_per_launch,gpu_ms_per_copy
 *
 * usage: copy_launch [--device D] [--launches N]      (default 0 and 50)
 * Build: cc -O2 copy_launch.c -I$CUDA/include -L$CUDA/lib64/stubs -lcuda */
#define BENCH_NAME "copy_launch"
#include "driver_check.h"

#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* A range of `bytes` made of handles of `handle` bytes (0: cuMemAlloc). */
typedef struct range {
  CUdeviceptr base;
  size_t bytes, handle;
  int count;
  CUmemGenericAllocationHandle *h;
} range;

static int range_make(range *r, int device, size_t bytes, size_t handle) {
  *r = (range){.bytes = bytes, .handle = handle};
  if (!handle) return check(cuMemAlloc(&r->base, bytes), "cuMemAlloc");
  CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
                              .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = device}};
  CUmemAccessDesc access = {.location = prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  r->count = (int)(bytes / handle);
  r->h = calloc((size_t)r->count, sizeof *r->h);
  if (!r->h || check(cuMemAddressReserve(&r->base, bytes, 0, 0, 0), "cuMemAddressReserve"))
    return 1;
  for (int i = 0; i < r->count; i++)
    if (check(cuMemCreate(&r->h[i], handle, &prop, 0), "cuMemCreate") ||
        check(cuMemMap(r->base + (size_t)i * handle, handle, 0, r->h[i], 0), "cuMemMap"))
      return 1;
  return check(cuMemSetAccess(r->base, bytes, &access, 1), "cuMemSetAccess");
}

static void range_free(range *r) {
  if (!r->handle) {
    cuMemFree(r->base);
    return;
  }
  cuMemUnmap(r->base, r->bytes);
  for (int i = 0; i < r->count; i++) cuMemRelease(r->h[i]);
  cuMemAddressFree(r->base, r->bytes);
  free(r->h);
}

static CUresult issue(int dtod, CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream s) {
  return dtod ? cuMemcpyDtoDAsync(dst, src, bytes, s) : cuMemcpyAsync(dst, src, bytes, s);
}

static int measure(const char *memory, size_t handle, const range *a, const range *b, int dtod,
                   int launches, CUstream s, CUevent start, CUevent end) {
  /* One untimed copy first: the driver's first look at a range is not the
   * steady cost. */
  if (check(issue(dtod, b->base, a->base, a->bytes, s), "copy") ||
      check(cuStreamSynchronize(s), "cuStreamSynchronize"))
    return 1;
  double cpu = 0;
  if (check(cuEventRecord(start, s), "cuEventRecord")) return 1;
  for (int i = 0; i < launches; i++) {
    const range *from = i % 2 ? b : a, *to = i % 2 ? a : b;
    double t = now_us();
    if (check(issue(dtod, to->base, from->base, a->bytes, s), "copy")) return 1;
    cpu += now_us() - t;
  }
  float ms = 0;
  if (check(cuEventRecord(end, s), "cuEventRecord") ||
      check(cuEventSynchronize(end), "cuEventSynchronize") ||
      check(cuEventElapsedTime(&ms, start, end), "cuEventElapsedTime"))
    return 1;
  printf("%s,%zu,%zu,%s,%d,%.2f,%.4f\n", memory, handle >> 20, a->bytes >> 20,
         dtod ? "cuMemcpyDtoDAsync" : "cuMemcpyAsync", launches, cpu / launches, ms / launches);
  fflush(stdout);
  return 0;
}

int main(int argc, char **argv) {
  int device = 0, launches = 50;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--device") && i + 1 < argc)
      device = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--launches") && i + 1 < argc)
      launches = atoi(argv[++i]);
    else {
      fprintf(stderr, "usage: copy_launch [--device D] [--launches N]\n");
      return 2;
    }
  }
  CUdevice dev;
  CUstream s;
  CUevent start, end;
  if (open_primary_context(device, &dev) ||
      check(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate") ||
      check(cuEventCreate(&start, 0), "cuEventCreate") ||
      check(cuEventCreate(&end, 0), "cuEventCreate"))
    return 1;
  printf("memory,handle_mb,copy_mb,call,launches,us_per_launch,gpu_ms_per_copy\n");
  const size_t copies[] = {64, 256};
  const size_t handles[] = {0, 2, 4, 16, 1}; /* 0: cuMemAlloc; 1: one handle, the whole */
  for (size_t c = 0; c < sizeof copies / sizeof *copies; c++)
    for (size_t k = 0; k < sizeof handles / sizeof *handles; k++) {
      size_t bytes = copies[c] << 20;
      size_t handle = handles[k] == 1 ? bytes : handles[k] << 20;
      const char *memory = handles[k] == 0 ? "cumemalloc" : handles[k] == 1 ? "whole" : "handles";
      range a, b;
      if (range_make(&a, device, bytes, handle) || range_make(&b, device, bytes, handle)) return 1;
      for (int dtod = 0; dtod <= 1; dtod++)
        if (measure(memory, handle, &a, &b, dtod, launches, s, start, end)) return 1;
      range_free(&a);
      range_free(&b);
    }
  cuEventDestroy(start);
  cuEventDestroy(end);
  cuStreamDestroy(s);
  cuDevicePrimaryCtxRelease(dev);
  return 0;
}
