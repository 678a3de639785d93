// torch_anchor.cpp: the GPU anchors of `tidalloc micro`: PyTorch's native
// caching allocator through its C++ API (c10::cuda::CUDACachingAllocator:
// raw_alloc / raw_alloc_with_stream / raw_delete) and the CUDA runtime's
// stream-ordered allocator (cudaMallocAsync / cudaFreeAsync), measured with
// exactly the workloads of tools/micro.c so that the rows sit next to
// tidalloc's (`tidalloc micro --csv --conf backend:cuda`):
//   pair   allocate and free one size in a loop (one op = one alloc+free
//          pair): 512 B, 4 KiB, 1 MiB, 8 MiB, 64 MiB;
//   mixed  64 live slots; per op, free a random slot and allocate a random
//          size, log-uniform in 512 B .. 16 MiB, from micro's fixed seed;
// on 1 thread (the default stream, as micro) and 8 threads (one
// non-blocking stream each). Each (workload, threads, allocator) runs
// `repeat` timed batches per thread after a warm-up batch, every batch behind
// a barrier; a batch is sized on one thread to last at least 20 ms, and that
// size is kept for 8 threads. The figure is the median over threads of each
// thread's median ns per op. Output: CSV rows
//   workload,size,threads,allocator,ns_per_op
// with allocator torch-native or cudaMallocAsync; progress and settings go to
// stderr.
//
// cudaMallocAsync uses the device's default pool with its release threshold
// raised to the maximum, so that freed memory stays cached as in the other
// allocators (with the default threshold of 0 it may go back to the device at
// every synchronization). PyTorch's allocator runs with whatever
// PYTORCH_CUDA_ALLOC_CONF says (its name is printed); it must be the native
// one for the rows to mean "torch-native".
//
// usage: torch_anchor [--repeat N] [--ops N] [--only torch|async]
#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>
#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace alloc = c10::cuda::CUDACachingAllocator;

constexpr int kMixedSlots = 64;
constexpr int kScriptLength = 4096;
constexpr int kDefaultRepeat = 21;
constexpr double kMinBatchNs = 20e6;
constexpr double kMixedMinSize = 512.0;
constexpr double kMixedSizeOctaves = 15.0; // 512 B * 2^15 = 16 MiB
constexpr uint64_t kScriptSeed = 0x7469646555ull;
const size_t kPairSizes[] = {512, 4096, size_t(1) << 20, size_t(8) << 20, size_t(64) << 20};
const int kThreadCounts[] = {1, 8};

void die(const char *what, cudaError_t e) {
  std::fprintf(stderr, "torch_anchor: %s: %s (%s)\n", what, cudaGetErrorName(e),
               cudaGetErrorString(e));
  std::exit(1);
}

#define CUDA_OK(call)                                                                              \
  do {                                                                                             \
    cudaError_t e_ = (call);                                                                       \
    if (e_ != cudaSuccess) die(#call, e_);                                                         \
  } while (0)

uint64_t now_ns() {
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now().time_since_epoch())
                      .count());
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2.0;
}

// ---------------------------------------------------------------------------
// The allocators
// ---------------------------------------------------------------------------

struct Anchor {
  const char *name;
  void *(*alloc)(cudaStream_t stream, size_t size);
  void (*free)(cudaStream_t stream, void *ptr);
  void (*settle)(); // after a measurement: wait for the device, drop caches
};

// One thread uses the current stream (the default stream), as micro does;
// several threads pass their own stream.
void *torch_alloc(cudaStream_t stream, size_t size) {
  return stream ? alloc::raw_alloc_with_stream(size, stream) : alloc::raw_alloc(size);
}
void torch_free(cudaStream_t, void *ptr) { alloc::raw_delete(ptr); }
void torch_settle() {
  CUDA_OK(cudaDeviceSynchronize());
  alloc::emptyCache();
}

void *async_alloc(cudaStream_t stream, size_t size) {
  void *p = nullptr;
  cudaError_t e = cudaMallocAsync(&p, size, stream);
  return e == cudaSuccess ? p : nullptr;
}
void async_free(cudaStream_t stream, void *ptr) { CUDA_OK(cudaFreeAsync(ptr, stream)); }
void async_settle() {
  cudaMemPool_t pool;
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaDeviceGetDefaultMemPool(&pool, 0));
  CUDA_OK(cudaMemPoolTrimTo(pool, 0));
}

const Anchor kAnchors[] = {
    {"torch-native", torch_alloc, torch_free, torch_settle},
    {"cudaMallocAsync", async_alloc, async_free, async_settle},
};

// ---------------------------------------------------------------------------
// Workloads (as tools/micro.c)
// ---------------------------------------------------------------------------

struct Step {
  uint32_t slot;
  size_t size;
};

uint64_t splitmix64(uint64_t *state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

struct Plan {
  const Anchor *anchor;
  size_t size; // 0: mixed
  int threads;
  uint64_t ops; // per batch; 0: calibrate (one thread only)
  int repeat;
  pthread_barrier_t barrier;
};

struct Worker {
  Plan *plan = nullptr;
  int index = 0;
  cudaStream_t stream = nullptr;
  uint64_t ops = 0;
  double result = 0; // this thread's median ns per op
  std::vector<double> samples;
  bool failed = false;
  std::string error;
  std::vector<Step> script;
  size_t step = 0;
  void *slots[kMixedSlots] = {};

  void make_script() {
    uint64_t state = kScriptSeed + uint64_t(index);
    script.resize(kScriptLength);
    for (auto &s : script) {
      double u = double(splitmix64(&state) >> 11) / 9007199254740992.0;
      s.size = size_t(kMixedMinSize * std::exp2(u * kMixedSizeOctaves));
      s.slot = uint32_t(splitmix64(&state) % kMixedSlots);
    }
  }

  bool fail(const char *what, size_t size) {
    char buf[256];
    std::snprintf(buf, sizeof buf, "%s: %s of %zu bytes failed", plan->anchor->name, what, size);
    error = buf;
    failed = true;
    return false;
  }

  bool run_pair(uint64_t n) {
    const Anchor *a = plan->anchor;
    for (uint64_t k = 0; k < n; k++) {
      void *p = a->alloc(stream, plan->size);
      if (!p) return fail("allocation", plan->size);
      a->free(stream, p);
    }
    return true;
  }

  bool run_mixed(uint64_t n) {
    const Anchor *a = plan->anchor;
    for (uint64_t k = 0; k < n; k++) {
      const Step &s = script[step];
      step = (step + 1) % kScriptLength;
      a->free(stream, slots[s.slot]);
      slots[s.slot] = a->alloc(stream, s.size);
      if (!slots[s.slot]) return fail("allocation", s.size);
    }
    return true;
  }

  bool run_batch(uint64_t n) { return plan->size ? run_pair(n) : run_mixed(n); }

  bool mixed_fill() {
    make_script();
    step = 0;
    for (int i = 0; i < kMixedSlots; i++) {
      const Step &s = script[(kScriptLength - 1 - i) % kScriptLength];
      slots[i] = plan->anchor->alloc(stream, s.size);
      if (!slots[i]) return fail("allocation", s.size);
    }
    return true;
  }

  void mixed_drain() {
    for (auto &p : slots) {
      if (p) plan->anchor->free(stream, p);
      p = nullptr;
    }
  }

  bool calibrate() {
    uint64_t n = 256;
    for (;;) {
      uint64_t t0 = now_ns();
      if (!run_batch(n)) return false;
      double ns = double(now_ns() - t0);
      if (ns >= kMinBatchNs) {
        ops = uint64_t(double(n) * (kMinBatchNs * 1.1) / ns) + 1;
        return true;
      }
      n *= 2;
    }
  }

  // Every thread passes every barrier, even after a failure.
  void run() {
    CUDA_OK(cudaSetDevice(0));
    bool ok = plan->size != 0 || mixed_fill();
    if (ok && plan->ops == 0)
      ok = calibrate();
    else
      ops = plan->ops;
    if (ok) ok = run_batch(ops); // warm-up: later batches hit cached blocks
    samples.assign(size_t(plan->repeat), 0.0);
    for (int r = 0; r < plan->repeat; r++) {
      pthread_barrier_wait(&plan->barrier);
      if (!ok) continue;
      uint64_t t0 = now_ns();
      ok = run_batch(ops);
      samples[size_t(r)] = double(now_ns() - t0) / double(ops);
    }
    if (plan->size == 0) mixed_drain();
    if (ok) result = median(samples);
  }
};

struct Result {
  const char *workload;
  size_t size;
  int threads;
  const char *allocator;
  double ns_per_op;
  uint64_t ops;
};

bool measure(const Anchor *a, size_t size, int threads, uint64_t ops, int repeat, Result *out) {
  Plan plan{a, size, threads, ops, repeat, {}};
  pthread_barrier_init(&plan.barrier, nullptr, unsigned(threads));
  std::vector<Worker> workers(static_cast<size_t>(threads));
  for (int i = 0; i < threads; i++) {
    workers[size_t(i)].plan = &plan;
    workers[size_t(i)].index = i;
    if (threads > 1)
      CUDA_OK(cudaStreamCreateWithFlags(&workers[size_t(i)].stream, cudaStreamNonBlocking));
  }
  std::vector<std::thread> pool;
  for (auto &w : workers) pool.emplace_back([&w] { w.run(); });
  for (auto &t : pool) t.join();
  pthread_barrier_destroy(&plan.barrier);
  bool ok = true;
  std::vector<double> medians;
  for (auto &w : workers) {
    if (w.failed) {
      if (ok) std::fprintf(stderr, "torch_anchor: %s\n", w.error.c_str());
      ok = false;
    }
    medians.push_back(w.result);
    if (w.stream) {
      CUDA_OK(cudaStreamSynchronize(w.stream));
      CUDA_OK(cudaStreamDestroy(w.stream));
    }
  }
  a->settle();
  *out = Result{size ? "pair" : "mixed",    size,          threads, a->name,
                ok ? median(medians) : 0.0, workers[0].ops};
  return ok;
}

void print_row(const Result &r) {
  if (r.size == 0)
    std::printf("%s,mixed,%d,%s,%.1f\n", r.workload, r.threads, r.allocator, r.ns_per_op);
  else
    std::printf("%s,%zu,%d,%s,%.1f\n", r.workload, r.size, r.threads, r.allocator, r.ns_per_op);
  std::fflush(stdout);
}

void usage() {
  std::fprintf(stderr, "usage: torch_anchor [--repeat N] [--ops N] [--only torch|async]\n");
  std::exit(2);
}

} // namespace

int main(int argc, char **argv) {
  int repeat = kDefaultRepeat;
  uint64_t fixed_ops = 0;
  std::string only;
  for (int i = 1; i < argc; i++) {
    std::string arg = argv[i];
    if (arg == "--repeat" && i + 1 < argc)
      repeat = std::atoi(argv[++i]);
    else if (arg == "--ops" && i + 1 < argc)
      fixed_ops = std::strtoull(argv[++i], nullptr, 10);
    else if (arg == "--only" && i + 1 < argc)
      only = argv[++i];
    else if (arg == "--csv")
      continue; // always CSV; accepted for symmetry with `tidalloc micro`
    else
      usage();
  }
  if (repeat < 1 || (!only.empty() && only != "torch" && only != "async")) usage();

  int devices = 0;
  CUDA_OK(cudaGetDeviceCount(&devices));
  CUDA_OK(cudaSetDevice(0));
  alloc::init(devices); // what torch's CUDA initialization does
  cudaMemPool_t pool;
  CUDA_OK(cudaDeviceGetDefaultMemPool(&pool, 0));
  uint64_t threshold = UINT64_MAX;
  CUDA_OK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  const char *conf = std::getenv("PYTORCH_CUDA_ALLOC_CONF");
  std::fprintf(stderr,
               "torch_anchor: PyTorch allocator \"%s\" (PYTORCH_CUDA_ALLOC_CONF=%s); "
               "cudaMallocAsync: default pool, release threshold UINT64_MAX\n",
               alloc::get()->name().c_str(), conf ? conf : "");

  std::printf("workload,size,threads,allocator,ns_per_op\n");
  const size_t nsizes = sizeof kPairSizes / sizeof kPairSizes[0] + 1; // + mixed
  for (size_t s = 0; s < nsizes; s++) {
    size_t size = s + 1 < nsizes ? kPairSizes[s] : 0;
    for (const Anchor &a : kAnchors) {
      if (!only.empty() && (only == "torch") != (std::strcmp(a.name, "torch-native") == 0))
        continue;
      uint64_t ops = fixed_ops; // calibrated on one thread, kept for eight
      for (int threads : kThreadCounts) {
        if (ops == 0 && threads != 1) {
          Result probe;
          if (!measure(&a, size, 1, 0, 1, &probe)) return 1;
          ops = probe.ops;
        }
        Result r;
        if (!measure(&a, size, threads, ops, repeat, &r)) return 1;
        ops = r.ops;
        print_row(r);
        std::fprintf(stderr, "  %s %s x%d: %.1f ns/op (batch %llu ops)\n", r.allocator,
                     size ? std::to_string(size).c_str() : "mixed", threads, r.ns_per_op,
                     (unsigned long long)r.ops);
      }
    }
  }
  return 0;
}
