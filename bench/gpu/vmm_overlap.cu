/* vmm_overlap.cu: whether the CUDA driver's virtual memory calls wait for the
 * GPU, slow the work it is running, or make mapped memory slower to copy than
 * cudaMalloc's.
 *
 * Expandable segments map and unmap pages while the stream is busy. If those
 * calls cost only CPU time, a frame whose GPU work outlasts them pays nothing
 * for them; if they wait for queued work, or disturb it (page-table updates,
 * TLB invalidations), they cost GPU time; and if memory made of many 2 or
 * 4 MiB handles copies slower than one cudaMalloc block, every frame pays,
 * mapped or not. Three measurements, each against its control in one run:
 *
 *   calls_busy   the time of create / map / set access / unmap / release of
 *                a run of pages while a spinning kernel occupies another
 *                stream, against the same calls on an idle GPU (a call that
 *                waits for the kernel takes about the kernel's time)
 *   copy_under   the time of a queue of device-to-device copies while the
 *                CPU maps and unmaps unrelated pages, against the same queue
 *                with the CPU idle
 *   copy_kind    the bandwidth of device-to-device copies between two
 *                blocks of 256 MiB from cudaMalloc and from handles of 2 MiB
 *                to 256 MiB (one handle each)
 *   threads      a run of 64 pages created, mapped, made accessible and
 *                unmapped by 1, 2, 4 or 8 threads, each taking its share of
 *                the run: whether the driver's per-mapping work can be spread
 *   launch_beside  the CPU time of enqueuing kernels and small copies on
 *                one thread while another thread maps and unmaps pages in
 *                a loop, against the same with that thread idle: whether
 *                growth done ahead on a helper thread would hide behind a
 *                frame's launches or hold them up inside the driver
 *
 * Output: CSV rows  test,variant,value,unit  on stdout.
 * usage: vmm_overlap [--repeat R]    (default 20)
 * Build: nvcc -O2 vmm_overlap.cu -lcuda -lpthread -o vmm_overlap */
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <vector>

#define BENCH_NAME "vmm_overlap"
#include "driver_check.h" /* now_us; its own checks exit with the line */

#define MIB ((size_t)1 << 20)
#define BLOCK (256 * MIB)

static void die_cu(CUresult r, const char *call, int line) {
  const char *name = NULL;
  cuGetErrorName(r, &name);
  fprintf(stderr, "vmm_overlap:%d: %s failed: %s\n", line, call, name ? name : "?");
  exit(1);
}
#define CU(call)                                                                                   \
  do {                                                                                             \
    CUresult r_ = (call);                                                                          \
    if (r_ != CUDA_SUCCESS) die_cu(r_, #call, __LINE__);                                           \
  } while (0)
#define RT(call)                                                                                   \
  do {                                                                                             \
    cudaError_t e_ = (call);                                                                       \
    if (e_ != cudaSuccess) {                                                                       \
      fprintf(stderr, "vmm_overlap:%d: %s failed: %s\n", __LINE__, #call, cudaGetErrorString(e_)); \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)

__global__ void spin(long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

static CUmemAllocationProp prop_for(int device) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

/* A block of `bytes` in a reserved range, mapped in handles of `handle`
 * bytes, readable and writable by the device. */
typedef struct vmm_block {
  CUdeviceptr base;
  size_t bytes, handle;
  std::vector<CUmemGenericAllocationHandle> handles;
} vmm_block;

static void vmm_map(vmm_block *b, int device, size_t bytes, size_t handle) {
  CUmemAllocationProp prop = prop_for(device);
  b->bytes = bytes;
  b->handle = handle;
  CU(cuMemAddressReserve(&b->base, bytes, 0, 0, 0));
  for (size_t off = 0; off < bytes; off += handle) {
    CUmemGenericAllocationHandle h;
    CU(cuMemCreate(&h, handle, &prop, 0));
    CU(cuMemMap(b->base + off, handle, 0, h, 0));
    b->handles.push_back(h);
  }
  CUmemAccessDesc access;
  memset(&access, 0, sizeof access);
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CU(cuMemSetAccess(b->base, bytes, &access, 1));
}

static void vmm_unmap(vmm_block *b) {
  CU(cuMemUnmap(b->base, b->bytes));
  for (CUmemGenericAllocationHandle h : b->handles) CU(cuMemRelease(h));
  CU(cuMemAddressFree(b->base, b->bytes));
  b->handles.clear();
}

/* One cycle of what growth and release do to `pages` pages: create, map,
 * set access, unmap, release; the time of each step is added to t[5]. */
static void map_cycle(int device, CUdeviceptr base, size_t page, int pages, double t[5]) {
  CUmemAllocationProp prop = prop_for(device);
  CUmemAccessDesc access;
  memset(&access, 0, sizeof access);
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUmemGenericAllocationHandle h[64];
  double t0 = now_us();
  for (int i = 0; i < pages; i++) CU(cuMemCreate(&h[i], page, &prop, 0));
  double t1 = now_us();
  for (int i = 0; i < pages; i++) CU(cuMemMap(base + (size_t)i * page, page, 0, h[i], 0));
  double t2 = now_us();
  CU(cuMemSetAccess(base, (size_t)pages * page, &access, 1));
  double t3 = now_us();
  CU(cuMemUnmap(base, (size_t)pages * page));
  double t4 = now_us();
  for (int i = 0; i < pages; i++) CU(cuMemRelease(h[i]));
  double t5 = now_us();
  t[0] += t1 - t0;
  t[1] += t2 - t1;
  t[2] += t3 - t2;
  t[3] += t4 - t3;
  t[4] += t5 - t4;
}

static const char *step_names[5] = {"create", "map", "set_access", "unmap", "release"};

/* calls_busy: the calls on an idle GPU, then while a kernel spins. */
static void calls_busy(int device, size_t page, int repeat, long long spin_cycles) {
  enum { PAGES = 4 };
  CUdeviceptr base;
  CU(cuMemAddressReserve(&base, PAGES * page, 0, 0, 0));
  cudaStream_t busy;
  RT(cudaStreamCreateWithFlags(&busy, cudaStreamNonBlocking));
  for (int loaded = 0; loaded < 2; loaded++) {
    double t[5] = {0, 0, 0, 0, 0};
    int still_running = 0;
    for (int r = 0; r < repeat; r++) {
      if (loaded) {
        spin<<<1, 1, 0, busy>>>(spin_cycles);
        RT(cudaGetLastError());
      }
      map_cycle(device, base, page, PAGES, t);
      if (loaded && cudaStreamQuery(busy) == cudaErrorNotReady) still_running++;
      RT(cudaStreamSynchronize(busy));
    }
    for (int s = 0; s < 5; s++)
      printf("calls_busy,%s_%s,%.2f,us_per_page\n", loaded ? "busy" : "idle", step_names[s],
             t[s] / repeat / PAGES);
    if (loaded) printf("calls_busy,kernel_outlived_calls,%d,of_%d\n", still_running, repeat);
  }
  RT(cudaStreamDestroy(busy));
  CU(cuMemAddressFree(base, PAGES * page));
}

/* copy_under: a queue of copies timed by events, the CPU idle or mapping. */
static void copy_under(int device, size_t page, int repeat) {
  enum { COPIES = 40, PAGES = 4 };
  void *src, *dst;
  RT(cudaMalloc(&src, BLOCK));
  RT(cudaMalloc(&dst, BLOCK));
  RT(cudaMemset(src, 1, BLOCK));
  CUdeviceptr base;
  CU(cuMemAddressReserve(&base, PAGES * page, 0, 0, 0));
  cudaStream_t stream;
  RT(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t start, stop;
  RT(cudaEventCreate(&start));
  RT(cudaEventCreate(&stop));
  for (int mapping = 0; mapping < 2; mapping++) {
    std::vector<double> ms;
    int cycles_total = 0;
    for (int r = 0; r < repeat; r++) {
      RT(cudaEventRecord(start, stream));
      for (int c = 0; c < COPIES; c++)
        RT(cudaMemcpyAsync(dst, src, BLOCK, cudaMemcpyDeviceToDevice, stream));
      RT(cudaEventRecord(stop, stream));
      double t[5] = {0, 0, 0, 0, 0};
      if (mapping) {
        while (cudaEventQuery(stop) == cudaErrorNotReady) {
          map_cycle(device, base, page, PAGES, t);
          cycles_total++;
        }
      }
      RT(cudaEventSynchronize(stop));
      float elapsed;
      RT(cudaEventElapsedTime(&elapsed, start, stop));
      ms.push_back(elapsed);
    }
    printf("copy_under,%s,%.3f,ms_for_%d_copies_of_256_MiB\n", mapping ? "cpu_mapping" : "cpu_idle",
           median(ms), COPIES);
    if (mapping)
      printf("copy_under,map_cycles_per_queue,%.1f,cycles_of_%d_pages\n",
             (double)cycles_total / repeat, PAGES);
  }
  RT(cudaEventDestroy(start));
  RT(cudaEventDestroy(stop));
  RT(cudaStreamDestroy(stream));
  CU(cuMemAddressFree(base, PAGES * page));
  RT(cudaFree(src));
  RT(cudaFree(dst));
}

static double copy_gbps(void *dst, const void *src, cudaStream_t stream, int repeat) {
  enum { COPIES = 10 };
  cudaEvent_t start, stop;
  RT(cudaEventCreate(&start));
  RT(cudaEventCreate(&stop));
  RT(cudaMemcpyAsync(dst, src, BLOCK, cudaMemcpyDeviceToDevice, stream)); /* warm-up */
  std::vector<double> gbps;
  for (int r = 0; r < repeat; r++) {
    RT(cudaEventRecord(start, stream));
    for (int c = 0; c < COPIES; c++)
      RT(cudaMemcpyAsync(dst, src, BLOCK, cudaMemcpyDeviceToDevice, stream));
    RT(cudaEventRecord(stop, stream));
    RT(cudaEventSynchronize(stop));
    float ms;
    RT(cudaEventElapsedTime(&ms, start, stop));
    gbps.push_back((double)BLOCK * COPIES / (ms * 1e-3) / 1e9);
  }
  RT(cudaEventDestroy(start));
  RT(cudaEventDestroy(stop));
  return median(gbps);
}

/* copy_kind: the same copy between blocks of each kind, interleaved rounds. */
static void copy_kind(int device, size_t page, int repeat) {
  enum { KINDS = 8 };
  cudaStream_t stream;
  RT(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  void *malloc_src, *malloc_dst;
  RT(cudaMalloc(&malloc_src, BLOCK));
  RT(cudaMalloc(&malloc_dst, BLOCK));
  size_t handles[KINDS];
  for (int k = 0; k < KINDS; k++) handles[k] = page << k; /* 2 MiB .. 256 MiB */
  vmm_block src[KINDS], dst[KINDS];
  for (int k = 0; k < KINDS; k++) {
    vmm_map(&src[k], device, BLOCK, handles[k]);
    vmm_map(&dst[k], device, BLOCK, handles[k]);
  }
  std::vector<double> results[KINDS + 1];
  for (int round = 0; round < 3; round++) {
    results[0].push_back(copy_gbps(malloc_dst, malloc_src, stream, repeat));
    for (int k = 0; k < KINDS; k++)
      results[k + 1].push_back(
          copy_gbps((void *)dst[k].base, (const void *)src[k].base, stream, repeat));
  }
  printf("copy_kind,cudaMalloc,%.1f,GB_per_s\n", median(results[0]));
  for (int k = 0; k < KINDS; k++)
    printf("copy_kind,vmm_%zuMiB_handles,%.1f,GB_per_s\n", handles[k] / MIB,
           median(results[k + 1]));
  for (int k = 0; k < KINDS; k++) {
    vmm_unmap(&src[k]);
    vmm_unmap(&dst[k]);
  }
  RT(cudaFree(malloc_src));
  RT(cudaFree(malloc_dst));
  RT(cudaStreamDestroy(stream));
}

/* threads: one share of a run, for one thread. */
typedef struct share {
  CUcontext ctx;
  int device;
  CUdeviceptr base;
  size_t page;
  int pages;
  int step; /* 0 create + map, 1 set access, 2 unmap, 3 release */
  CUmemGenericAllocationHandle *handles;
} share;

static void *run_share(void *arg) {
  share *sh = (share *)arg;
  CU(cuCtxSetCurrent(sh->ctx));
  CUmemAllocationProp prop = prop_for(sh->device);
  CUmemAccessDesc access;
  memset(&access, 0, sizeof access);
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  size_t bytes = (size_t)sh->pages * sh->page;
  switch (sh->step) {
  case 0:
    for (int i = 0; i < sh->pages; i++) {
      CU(cuMemCreate(&sh->handles[i], sh->page, &prop, 0));
      CU(cuMemMap(sh->base + (size_t)i * sh->page, sh->page, 0, sh->handles[i], 0));
    }
    break;
  case 1: CU(cuMemSetAccess(sh->base, bytes, &access, 1)); break;
  case 2: CU(cuMemUnmap(sh->base, bytes)); break;
  default:
    for (int i = 0; i < sh->pages; i++) CU(cuMemRelease(sh->handles[i]));
  }
  return NULL;
}

static void threads_cost(int device, size_t page, int repeat) {
  enum { PAGES = 64, MAX_THREADS = 8 };
  static const char *steps[4] = {"create_map", "set_access", "unmap", "release"};
  CUcontext ctx;
  CU(cuCtxGetCurrent(&ctx));
  CUdeviceptr base;
  CU(cuMemAddressReserve(&base, PAGES * page, 0, 0, 0));
  CUmemGenericAllocationHandle handles[PAGES];
  for (int threads = 1; threads <= MAX_THREADS; threads *= 2) {
    double t[4] = {0, 0, 0, 0};
    for (int r = 0; r < repeat; r++) {
      for (int step = 0; step < 4; step++) {
        share shares[MAX_THREADS];
        pthread_t ids[MAX_THREADS];
        int per = PAGES / threads;
        for (int k = 0; k < threads; k++)
          shares[k] = (share){ctx,  device,           base + (size_t)k * per * page, page, per,
                              step, handles + k * per};
        double t0 = now_us();
        if (threads == 1) {
          run_share(&shares[0]);
        } else {
          for (int k = 0; k < threads; k++) pthread_create(&ids[k], NULL, run_share, &shares[k]);
          for (int k = 0; k < threads; k++) pthread_join(ids[k], NULL);
        }
        t[step] += now_us() - t0;
      }
    }
    for (int step = 0; step < 4; step++)
      printf("threads,%s_%d_threads,%.2f,us_per_page\n", steps[step], threads,
             t[step] / repeat / PAGES);
  }
  CU(cuMemAddressFree(base, PAGES * page));
}

/* launch_beside: a thread that maps and unmaps until told to stop. */
typedef struct mapper {
  CUcontext ctx;
  int device;
  CUdeviceptr base;
  size_t page;
  int pages;
  int stop;
  long cycles;
  double t[5];
} mapper;

static void *run_mapper(void *arg) {
  mapper *m = (mapper *)arg;
  CU(cuCtxSetCurrent(m->ctx));
  while (!__atomic_load_n(&m->stop, __ATOMIC_ACQUIRE)) {
    map_cycle(m->device, m->base, m->page, m->pages, m->t);
    m->cycles++;
  }
  return NULL;
}

static void launch_beside(int device, size_t page, int repeat) {
  enum { BATCH = 200, PAGES = 4, SMALL = 4096 };
  CUcontext ctx;
  CU(cuCtxGetCurrent(&ctx));
  CUdeviceptr base;
  CU(cuMemAddressReserve(&base, PAGES * page, 0, 0, 0));
  cudaStream_t stream;
  RT(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  void *src, *dst;
  RT(cudaMalloc(&src, SMALL));
  RT(cudaMalloc(&dst, SMALL));
  for (int mapping = 0; mapping < 2; mapping++) {
    mapper m = {ctx, device, base, page, PAGES, 0, 0, {0, 0, 0, 0, 0}};
    pthread_t id;
    if (mapping && pthread_create(&id, NULL, run_mapper, &m) != 0) {
      fprintf(stderr, "vmm_overlap: pthread_create failed\n");
      exit(1);
    }
    std::vector<double> launch_us, copy_us;
    double started = now_us();
    for (int r = 0; r < repeat * 5; r++) {
      double t0 = now_us();
      for (int i = 0; i < BATCH; i++) spin<<<1, 1, 0, stream>>>(0);
      double t1 = now_us();
      for (int i = 0; i < BATCH; i++)
        RT(cudaMemcpyAsync(dst, src, SMALL, cudaMemcpyDeviceToDevice, stream));
      double t2 = now_us();
      RT(cudaStreamSynchronize(stream));
      launch_us.push_back((t1 - t0) / BATCH);
      copy_us.push_back((t2 - t1) / BATCH);
    }
    double elapsed = now_us() - started;
    if (mapping) {
      __atomic_store_n(&m.stop, 1, __ATOMIC_RELEASE);
      pthread_join(id, NULL);
    }
    const char *v = mapping ? "helper_mapping" : "helper_idle";
    printf("launch_beside,%s_kernel_launch,%.2f,us_each\n", v, median(launch_us));
    printf("launch_beside,%s_memcpy_async,%.2f,us_each\n", v, median(copy_us));
    if (mapping && m.cycles) {
      printf("launch_beside,helper_pages_cycled,%.0f,pages_per_s\n",
             m.cycles * PAGES / (elapsed * 1e-6));
      for (int s = 0; s < 5; s++)
        printf("launch_beside,helper_%s,%.2f,us_per_page\n", step_names[s],
               m.t[s] / m.cycles / PAGES);
    }
  }
  RT(cudaFree(src));
  RT(cudaFree(dst));
  RT(cudaStreamDestroy(stream));
  CU(cuMemAddressFree(base, PAGES * page));
}

int main(int argc, char **argv) {
  int repeat = 20;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--repeat") && i + 1 < argc) {
      repeat = atoi(argv[++i]);
    } else {
      fprintf(stderr, "usage: vmm_overlap [--repeat R]\n");
      return 2;
    }
  }
  int device = 0;
  RT(cudaSetDevice(device));
  RT(cudaFree(0)); /* the primary context, which the driver calls then use */
  CUmemAllocationProp prop = prop_for(device);
  size_t page;
  CU(cuMemGetAllocationGranularity(&page, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  int clock_khz;
  RT(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device));
  long long spin_cycles = (long long)clock_khz * 20; /* about 20 ms */
  printf("test,variant,value,unit\n");
  calls_busy(device, page, repeat, spin_cycles);
  copy_under(device, page, repeat);
  copy_kind(device, page, repeat);
  threads_cost(device, page, repeat);
  launch_beside(device, page, repeat);
  return 0;
}
