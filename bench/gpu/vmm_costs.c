/* vmm_costs.c: what the CUDA driver's virtual memory calls cost on this GPU,
 * and whether one cuMemUnmap (or cuMemSetAccess) may cover several adjacent
 * mappings, each of its own handle, in one call.
 *
 * Expandable segments map one handle per page and, when they give memory
 * back, unmap page by page. If the driver accepts a range made of several
 * whole mappings and charges per call rather than per mapping, unmapping a
 * run of pages with one call would cost a fraction: this program measures
 * both ways on the same pages so that the choice rests on figures.
 *
 * For each run length N (1, 4, 16, 64 pages of the allocation granularity):
 * create N handles, map each at its page of one reserved range, then
 *   - set access with one call over the run, and
 *   - unmap with one call over the run ("span"), checking that the range can
 *     then be mapped again (it was really unmapped), or
 *   - unmap page by page ("each"),
 * repeated `--repeat` times; the creates and releases are timed as well.
 * Output: CSV rows
 *   op,pages,calls,us_per_call,us_per_page,ok
 * with op create, map, set_access_run, unmap_each, unmap_span, release; ok
 * is 0 where the driver refused (unmap_span's row then says so, and the
 * pages are unmapped one by one to go on).
 *
 * usage: vmm_costs [--device D] [--repeat R]      (default 0 and 20)
 * Build: cc -O2 vmm_costs.c -I$CUDA/include -L$CUDA/lib64/stubs -lcuda */
#define BENCH_NAME "vmm_costs"
#include "driver_check.h"

#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_PAGES 64

typedef struct totals {
  double create, map, access, unmap, release;
  long creates, maps, accesses, unmaps, releases;
} totals;

typedef struct run {
  CUdeviceptr base;
  size_t page;
  int pages;
  CUmemAllocationProp prop;
  CUmemAccessDesc access;
  CUmemGenericAllocationHandle handles[MAX_PAGES];
} run;

static int create_and_map(run *r, totals *t) {
  for (int i = 0; i < r->pages; i++) {
    double s = now_us();
    if (check(cuMemCreate(&r->handles[i], r->page, &r->prop, 0), "cuMemCreate")) return 1;
    t->create += now_us() - s;
    t->creates++;
  }
  for (int i = 0; i < r->pages; i++) {
    double s = now_us();
    if (check(cuMemMap(r->base + (size_t)i * r->page, r->page, 0, r->handles[i], 0), "cuMemMap"))
      return 1;
    t->map += now_us() - s;
    t->maps++;
  }
  double s = now_us();
  if (check(cuMemSetAccess(r->base, (size_t)r->pages * r->page, &r->access, 1), "cuMemSetAccess"))
    return 1;
  t->access += now_us() - s;
  t->accesses++;
  return 0;
}

static int unmap_each(run *r, totals *t) {
  for (int i = 0; i < r->pages; i++) {
    double s = now_us();
    if (check(cuMemUnmap(r->base + (size_t)i * r->page, r->page), "cuMemUnmap")) return 1;
    t->unmap += now_us() - s;
    t->unmaps++;
  }
  return 0;
}

/* One call over the run. 1: refused (the pages are then unmapped one by
 * one); -1: something else failed. */
static int unmap_span(run *r, totals *t) {
  double s = now_us();
  CUresult res = cuMemUnmap(r->base, (size_t)r->pages * r->page);
  double took = now_us() - s;
  if (res != CUDA_SUCCESS) {
    const char *name = NULL;
    cuGetErrorName(res, &name);
    fprintf(stderr, "vmm_costs: cuMemUnmap over %d mappings refused: %s\n", r->pages,
            name ? name : "?");
    return unmap_each(r, &(totals){0}) ? -1 : 1;
  }
  t->unmap += took;
  t->unmaps++;
  /* Really unmapped: every page can be mapped (and unmapped) again. */
  for (int i = 0; i < r->pages; i++)
    if (check(cuMemMap(r->base + (size_t)i * r->page, r->page, 0, r->handles[i], 0),
              "cuMemMap after a span unmap") ||
        check(cuMemUnmap(r->base + (size_t)i * r->page, r->page), "cuMemUnmap after it"))
      return -1;
  return 0;
}

static int release_all(run *r, totals *t) {
  for (int i = 0; i < r->pages; i++) {
    double s = now_us();
    if (check(cuMemRelease(r->handles[i]), "cuMemRelease")) return 1;
    t->release += now_us() - s;
    t->releases++;
  }
  return 0;
}

static void row(const char *op, int pages, long calls, double us, int ok) {
  if (!calls) {
    printf("%s,%d,0,,,%d\n", op, pages, ok);
    return;
  }
  double per_call = us / (double)calls;
  double per_page = strcmp(op, "set_access_run") == 0 || strcmp(op, "unmap_span") == 0
                        ? per_call / pages
                        : per_call;
  printf("%s,%d,%ld,%.2f,%.2f,%d\n", op, pages, calls, per_call, per_page, ok);
}

int main(int argc, char **argv) {
  int device = 0, repeat = 20;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--device") && i + 1 < argc)
      device = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--repeat") && i + 1 < argc)
      repeat = atoi(argv[++i]);
    else {
      fprintf(stderr, "usage: vmm_costs [--device D] [--repeat R]\n");
      return 2;
    }
  }
  CUdevice dev;
  if (open_primary_context(device, &dev)) return 1;
  run r = {0};
  r.prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  r.prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  r.prop.location.id = device;
  r.access.location = r.prop.location;
  r.access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (check(cuMemGetAllocationGranularity(&r.page, &r.prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
            "cuMemGetAllocationGranularity") ||
      check(cuMemAddressReserve(&r.base, MAX_PAGES * r.page, 0, 0, 0), "cuMemAddressReserve"))
    return 1;
  char name[128] = "?";
  cuDeviceGetName(name, sizeof name, dev);
  fprintf(stderr, "vmm_costs: %s, page %zu bytes, %d repeats\n", name, r.page, repeat);
  printf("op,pages,calls,us_per_call,us_per_page,ok\n");
  const int lengths[] = {1, 4, 16, 64};
  for (size_t k = 0; k < sizeof lengths / sizeof *lengths; k++) {
    r.pages = lengths[k];
    totals each = {0}, span = {0};
    int span_ok = 1;
    for (int rep = 0; rep < repeat; rep++) {
      if (create_and_map(&r, &each) || unmap_each(&r, &each) || release_all(&r, &each)) return 1;
      if (create_and_map(&r, &span)) return 1;
      int rc = span_ok ? unmap_span(&r, &span) : (unmap_each(&r, &(totals){0}) ? -1 : 1);
      if (rc < 0) return 1;
      if (rc > 0) span_ok = 0;
      if (release_all(&r, &span)) return 1;
    }
    row("create", r.pages, each.creates + span.creates, each.create + span.create, 1);
    row("map", r.pages, each.maps + span.maps, each.map + span.map, 1);
    row("set_access_run", r.pages, each.accesses + span.accesses, each.access + span.access, 1);
    row("unmap_each", r.pages, each.unmaps, each.unmap, 1);
    row("unmap_span", r.pages, span.unmaps, span.unmap, span_ok);
    row("release", r.pages, each.releases + span.releases, each.release + span.release, 1);
  }
  cuMemAddressFree(r.base, MAX_PAGES * r.page);
  cuDevicePrimaryCtxRelease(dev);
  return 0;
}
