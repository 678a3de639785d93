/* vmm_scale.c: what the CUDA driver's mapping calls cost in the conditions
 * of a real workload rather than an empty process: memory created with an
 * exportable handle type (as the allocator creates it, so that blocks can
 * be shared between processes) or without one, handles of 2 or 4 MiB, with
 * thousands of other mappings alive in the process, and with the GPU busy
 * copying.
 *
 * Why: vmm_costs measures an empty process, about 43-51 us a page moved; in
 * the streaming workload the allocator's time over its mappings comes to
 * 75-95 us each. This program tells which condition makes the difference.
 *
 * For every combination of --shareable (0, 1), --handle-mb (2, 4),
 * --background (0, 2000, 8000 live mappings) and --busy (0, 1): map the
 * background (its own reserved range, one handle per mapping), then repeat
 * `--repeat` times, over `--ops` handles: create each, map each at its place
 * of a second range, make each accessible (one call a mapping, as growth
 * does for a run of one), move each (unmap, map at a third range, make
 * accessible: what recycling a page costs), unmap each, release each.
 * With --busy, copies of 256 MiB between two buffers are queued before each
 * repetition so that the GPU copies while the calls run.
 * Output: CSV rows
 *   shareable,handle_mb,background,busy,op,calls,us_per_call
 * with op create, map, set_access, move, unmap, release.
 *
 * usage: vmm_scale [--device D] [--repeat R] [--ops K]   (default 0, 10, 64)
 * Build: cc -O2 vmm_scale.c -I$CUDA/include -L$CUDA/lib64/stubs -lcuda */
#define BENCH_NAME "vmm_scale"
#include "driver_check.h"

#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { OP_CREATE, OP_MAP, OP_ACCESS, OP_MOVE, OP_UNMAP, OP_RELEASE, OPS };
static const char *const op_names[OPS] = {"create", "map",   "set_access",
                                          "move",   "unmap", "release"};

typedef struct setup {
  int device;
  size_t handle;
  CUmemAllocationProp prop;
  CUmemAccessDesc access;
} setup;

typedef struct totals {
  double us[OPS];
  long calls[OPS];
} totals;

/* `count` handles mapped one after the other from `base`, accessible. */
static int map_many(const setup *s, CUdeviceptr base, CUmemGenericAllocationHandle *h, int count) {
  for (int i = 0; i < count; i++) {
    CUdeviceptr at = base + (size_t)i * s->handle;
    if (check(cuMemCreate(&h[i], s->handle, &s->prop, 0), "cuMemCreate") ||
        check(cuMemMap(at, s->handle, 0, h[i], 0), "cuMemMap") ||
        check(cuMemSetAccess(at, s->handle, &s->access, 1), "cuMemSetAccess"))
      return 1;
  }
  return 0;
}

static int unmap_many(const setup *s, CUdeviceptr base, CUmemGenericAllocationHandle *h,
                      int count) {
  for (int i = 0; i < count; i++)
    if (check(cuMemUnmap(base + (size_t)i * s->handle, s->handle), "cuMemUnmap") ||
        check(cuMemRelease(h[i]), "cuMemRelease"))
      return 1;
  return 0;
}

#define TIMED(t, op, call, name)                                                                   \
  do {                                                                                             \
    double start_ = now_us();                                                                      \
    if (check((call), (name))) return 1;                                                           \
    (t)->us[(op)] += now_us() - start_;                                                            \
    (t)->calls[(op)]++;                                                                            \
  } while (0)

/* One repetition over `ops` handles: create, map, access, move, unmap,
 * release, each timed call by call. */
static int cycle(const setup *s, CUdeviceptr first, CUdeviceptr second,
                 CUmemGenericAllocationHandle *h, int ops, totals *t) {
  for (int i = 0; i < ops; i++)
    TIMED(t, OP_CREATE, cuMemCreate(&h[i], s->handle, &s->prop, 0), "cuMemCreate");
  for (int i = 0; i < ops; i++)
    TIMED(t, OP_MAP, cuMemMap(first + (size_t)i * s->handle, s->handle, 0, h[i], 0), "cuMemMap");
  for (int i = 0; i < ops; i++)
    TIMED(t, OP_ACCESS, cuMemSetAccess(first + (size_t)i * s->handle, s->handle, &s->access, 1),
          "cuMemSetAccess");
  for (int i = 0; i < ops; i++) {
    double start = now_us();
    if (check(cuMemUnmap(first + (size_t)i * s->handle, s->handle), "cuMemUnmap (move)") ||
        check(cuMemMap(second + (size_t)i * s->handle, s->handle, 0, h[i], 0), "cuMemMap (move)") ||
        check(cuMemSetAccess(second + (size_t)i * s->handle, s->handle, &s->access, 1),
              "cuMemSetAccess (move)"))
      return 1;
    t->us[OP_MOVE] += now_us() - start;
    t->calls[OP_MOVE]++;
  }
  for (int i = 0; i < ops; i++)
    TIMED(t, OP_UNMAP, cuMemUnmap(second + (size_t)i * s->handle, s->handle), "cuMemUnmap");
  for (int i = 0; i < ops; i++) TIMED(t, OP_RELEASE, cuMemRelease(h[i]), "cuMemRelease");
  return 0;
}

typedef struct copier {
  CUstream stream;
  CUdeviceptr a, b;
  size_t bytes;
} copier;

/* Enough copies to outlast one repetition's calls (a copy of 256 MiB takes
 * about a quarter of a millisecond on an H200). */
static int queue_copies(copier *c, int count) {
  for (int i = 0; i < count; i++)
    if (check(cuMemcpyDtoDAsync(i % 2 ? c->a : c->b, i % 2 ? c->b : c->a, c->bytes, c->stream),
              "cuMemcpyDtoDAsync"))
      return 1;
  return 0;
}

static int measure(setup *s, int background, int busy, int ops, int repeat, copier *c) {
  CUmemGenericAllocationHandle *bg = calloc((size_t)background + 1, sizeof *bg);
  CUmemGenericAllocationHandle *h = calloc((size_t)ops, sizeof *h);
  CUdeviceptr bg_base = 0, first = 0, second = 0;
  size_t bg_bytes = ((size_t)background + 1) * s->handle, ops_bytes = (size_t)ops * s->handle;
  if (!bg || !h || check(cuMemAddressReserve(&bg_base, bg_bytes, 0, 0, 0), "reserve") ||
      check(cuMemAddressReserve(&first, ops_bytes, 0, 0, 0), "reserve") ||
      check(cuMemAddressReserve(&second, ops_bytes, 0, 0, 0), "reserve") ||
      map_many(s, bg_base, bg, background))
    return 1;
  totals t = {0};
  int busy_held = 0;
  for (int rep = 0; rep < repeat; rep++) {
    if (busy && queue_copies(c, 120)) return 1;
    if (cycle(s, first, second, h, ops, &t)) return 1;
    if (busy) {
      busy_held += cuStreamQuery(c->stream) == CUDA_ERROR_NOT_READY;
      if (check(cuStreamSynchronize(c->stream), "cuStreamSynchronize")) return 1;
    }
  }
  if (busy && busy_held < repeat)
    fprintf(stderr, "vmm_scale: the copies ended before the calls in %d of %d repetitions\n",
            repeat - busy_held, repeat);
  int shareable = s->prop.requestedHandleTypes != CU_MEM_HANDLE_TYPE_NONE;
  for (int op = 0; op < OPS; op++)
    printf("%d,%zu,%d,%d,%s,%ld,%.2f\n", shareable, s->handle >> 20, background, busy, op_names[op],
           t.calls[op], t.calls[op] ? t.us[op] / (double)t.calls[op] : 0.0);
  fflush(stdout);
  if (unmap_many(s, bg_base, bg, background)) return 1;
  cuMemAddressFree(bg_base, bg_bytes);
  cuMemAddressFree(first, ops_bytes);
  cuMemAddressFree(second, ops_bytes);
  free(bg);
  free(h);
  return 0;
}

int main(int argc, char **argv) {
  int device = 0, repeat = 10, ops = 64;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--device") && i + 1 < argc)
      device = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--repeat") && i + 1 < argc)
      repeat = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--ops") && i + 1 < argc)
      ops = atoi(argv[++i]);
    else {
      fprintf(stderr, "usage: vmm_scale [--device D] [--repeat R] [--ops K]\n");
      return 2;
    }
  }
  CUdevice dev;
  if (open_primary_context(device, &dev)) return 1;
  copier c = {.bytes = (size_t)256 << 20};
  if (check(cuStreamCreate(&c.stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate") ||
      check(cuMemAlloc(&c.a, c.bytes), "cuMemAlloc") ||
      check(cuMemAlloc(&c.b, c.bytes), "cuMemAlloc"))
    return 1;
  char name[128] = "?";
  cuDeviceGetName(name, sizeof name, dev);
  fprintf(stderr, "vmm_scale: %s, %d repeats of %d handles\n", name, repeat, ops);
  printf("shareable,handle_mb,background,busy,op,calls,us_per_call\n");
  const int backgrounds[] = {0, 2000, 8000};
  for (int shareable = 0; shareable <= 1; shareable++)
    for (size_t mb = 2; mb <= 4; mb += 2)
      for (size_t b = 0; b < sizeof backgrounds / sizeof *backgrounds; b++)
        for (int busy = 0; busy <= 1; busy++) {
          setup s = {.device = device, .handle = mb << 20};
          s.prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
          s.prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
          s.prop.location.id = device;
          s.prop.requestedHandleTypes =
              shareable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
          s.access.location = s.prop.location;
          s.access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
          if (measure(&s, backgrounds[b], busy, ops, repeat, &c)) return 1;
        }
  cuMemFree(c.a);
  cuMemFree(c.b);
  cuStreamDestroy(c.stream);
  cuDevicePrimaryCtxRelease(dev);
  return 0;
}
