// tidalloc_torch.cpp: tidalloc as PyTorch's own CUDA allocator. One final
// subclass of c10::cuda::CUDACachingAllocator::CUDAAllocator over tidalloc's
// C API, installed with PyTorch's changeCurrentAllocator before CUDA
// initialises (tidalloc.torch.install builds this file against the torch
// in use and calls tidalloc_torch_install through ctypes).
//
// What it adds over the pluggable path (two C functions): graph pools
// (beginAllocateToPool with PyTorch's filter evaluated here, each MempoolId_t
// a tide_pool), the checkpoints of cudagraph trees (tide_pool_checkpoint and
// tide_pool_restore), torch.cuda.MemPool, and the statistics and snapshots
// PyTorch's Python side reads, with no patching there.
//
// The DataPtr's context is the block's address with the device in its low
// bits (blocks are 512-byte aligned), so that the deleter finds the device's
// allocator without a lookup; tide_free_home frees the block on the stream it
// was allocated on, with the current stream as the hint.
//
// Errors: PyTorch calls these methods from C++ and expects exceptions
// (TORCH_CHECK) for failures, c10::OutOfMemoryError for out of memory. The
// deleter and the pool calls PyTorch makes from destructors never throw: a
// failure there is a warning with tidalloc's message.

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/version.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "tidalloc.h"

#if TORCH_VERSION_MAJOR != 2 || TORCH_VERSION_MINOR < 8
#error "the tidalloc shim is written for torch 2.8 to 2.11"
#endif
// 2.9 made CUDAAllocator a DeviceAllocator; 2.10 added setNoSplit and
// getExpandableSegmentSizes; 2.11 changed the signatures of snapshot,
// recordHistory, createOrIncrefPool and setUseOnOOM.
#define TIDE_TORCH_AT_LEAST(minor) (TORCH_VERSION_MINOR >= (minor))
#define TIDE_STR2(x) #x
#define TIDE_STR(x) TIDE_STR2(x)
#define TIDE_TORCH_BUILT_FOR TIDE_STR(TORCH_VERSION_MAJOR) "." TIDE_STR(TORCH_VERSION_MINOR)

namespace tidalloc_torch {

namespace cca = c10::cuda::CUDACachingAllocator;
using c10::CachingDeviceAllocator::DeviceStats;
using c10::cuda::MempoolId_t; // c10::MempoolId_t from 2.9, an alias kept here

constexpr int kMaxDevices = 64; // the device fits the low bits of a block address
constexpr uintptr_t kDeviceBits = 63;

// ---------------------------------------------------------------------------
// Calls counted for tests (tidalloc_torch_counts)
// ---------------------------------------------------------------------------

enum Count {
  kBeginAllocateToPool,
  kEndAllocateToPool,
  kReleasePool,
  kGetCheckpointState,
  kSetCheckpointPoolState,
  kCheckPoolLiveAllocations,
  kCreateOrIncrefPool,
  kPoolAllocations,
  kNumCounts
};
std::array<std::atomic<uint64_t>, kNumCounts> counts{};

void count(Count c) { counts[c].fetch_add(1, std::memory_order_relaxed); }

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

// Messages are made here as one string, never by c10::str from several
// pieces: c10::str formats numbers through std::ostream in this library's
// code, and where the compiler links a copy of libstdc++ into the shim (a
// toolchain whose library directory holds only the static libstdc++) that
// copy's locale does not match the process's, so formatting a number crashed
// the process (the 4 TiB out-of-memory error). One std::string argument is
// passed through c10::str untouched.
std::string piece(const char *s) { return s; }
std::string piece(const std::string &s) { return s; }
std::string piece(const void *p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}
std::string piece(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0> std::string piece(T v) {
  return std::to_string(v);
}
template <typename... Pieces> std::string msg(const Pieces &...pieces) {
  std::string out;
  (out += ... += piece(pieces));
  return out;
}

std::string last_error() {
  return std::string(tide_status_name(tide_last_status())) + ": " + tide_last_error();
}

void *encode(void *ptr, c10::DeviceIndex device) {
  return reinterpret_cast<void *>(reinterpret_cast<uintptr_t>(ptr) |
                                  static_cast<uintptr_t>(device));
}

void *decode_ptr(void *ctx) {
  return reinterpret_cast<void *>(reinterpret_cast<uintptr_t>(ctx) & ~kDeviceBits);
}

c10::DeviceIndex decode_device(void *ctx) {
  return static_cast<c10::DeviceIndex>(reinterpret_cast<uintptr_t>(ctx) & kDeviceBits);
}

struct MempoolHash {
  size_t operator()(const MempoolId_t &id) const {
    return std::hash<uint64_t>()(id.first) * 31 + std::hash<uint64_t>()(id.second);
  }
};

// A MempoolId_t's tidalloc pool, with the users PyTorch counts.
struct Pool {
  tide_pool *pool = nullptr;
  int uses = 0;
  std::shared_ptr<cca::CUDAAllocator> own_allocator; // a MemPool with its own allocator
  bool use_on_oom = false;
};

// A beginAllocateToPool not yet ended: allocations for which filter says
// yes go to the pool.
struct Route {
  MempoolId_t id;
  std::function<bool(cudaStream_t)> filter;
};

struct Device {
  std::atomic<tide_allocator *> alloc{nullptr};
  std::mutex mutex; // pools, routes, foreign blocks
  std::unordered_map<MempoolId_t, Pool, MempoolHash> pools;
  std::unordered_map<uint64_t, MempoolId_t> ids; // tide_pool_id -> MempoolId_t
  std::vector<Route> routes;
  std::atomic<int> nroutes{0};
  std::unordered_map<void *, std::shared_ptr<cca::CUDAAllocator>>
      foreign; // blocks of own allocators
  std::atomic<int> nforeign{0};
  double fraction = 1.0;
};

std::array<Device, kMaxDevices> devices;

// Each tidalloc checkpoint, as PyTorch keeps it between getCheckpointState
// and setCheckpointPoolState.
struct Checkpoint final : cca::AllocatorState {
  Checkpoint(tide_checkpoint *k, MempoolId_t id, c10::DeviceIndex device)
      : k(k), id(id), device(device) {}
  ~Checkpoint() override { tide_checkpoint_free(k); }
  tide_checkpoint *k;
  MempoolId_t id;
  c10::DeviceIndex device;
};

void delete_block(void *ctx);

class TidallocAllocator final : public cca::CUDAAllocator {
public:
  // ------------------------------------------------------------- allocation

  c10::DataPtr allocate(size_t n) override {
    c10::DeviceIndex device = c10::cuda::current_device();
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
    void *ptr = n ? malloc_on(device, n, stream) : nullptr;
    return {ptr, ptr ? encode(ptr, device) : nullptr, &delete_block,
            c10::Device(c10::DeviceType::CUDA, device)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &delete_block; }

  bool is_simple_data_ptr(const c10::DataPtr &data_ptr) const override {
    return data_ptr.get() == decode_ptr(data_ptr.get_context());
  }

  void copy_data(void *dest, const void *src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  void *raw_alloc(size_t nbytes) override {
    c10::DeviceIndex device = c10::cuda::current_device();
    return raw_alloc_with_stream(nbytes, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  void *raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    if (nbytes == 0) return nullptr;
    return malloc_on(c10::cuda::current_device(), nbytes, stream);
  }

  void raw_delete(void *ptr) override {
    if (!ptr) return;
    c10::DeviceIndex first = c10::cuda::current_device();
    if (free_on(first, ptr, /*quiet_if_foreign=*/true)) return;
    for (int d = 0; d < kMaxDevices; d++)
      if (d != first && devices[d].alloc.load() && free_on(d, ptr, true)) return;
    TORCH_CHECK(false,
                msg("tidalloc: raw_delete(", ptr, "): no device's allocator holds this block"));
  }

  // Returns whether `ptr` was this device's (freed, or refused with a warning).
  bool free_on(c10::DeviceIndex device, void *ptr, bool quiet_if_foreign) {
    Device &d = devices[device];
    if (d.nforeign.load(std::memory_order_relaxed) && free_foreign(d, ptr)) return true;
    tide_allocator *a = d.alloc.load(std::memory_order_acquire);
    if (!a) return false;
    cudaStream_t hint = c10::cuda::getCurrentCUDAStream(device).stream();
    tide_status st = tide_free_home(a, ptr, reinterpret_cast<tide_stream>(hint));
    if (st == TIDE_OK) return true;
    if (st == TIDE_ERR_BAD_POINTER && quiet_if_foreign) return false;
    TORCH_WARN(msg("tidalloc: freeing ", ptr, " on device ", static_cast<int>(device),
                   " failed: ", last_error()));
    return true;
  }

  // -------------------------------------------------------- initialisation

  void init(int device_count) override { initialized_ = true; }

  bool initialized() override { return initialized_; }

  void enable(bool value) override { enabled_ = value; }
  bool isEnabled() const override { return enabled_; }

  void emptyCache(MempoolId_t mempool_id = {0, 0}) override {
    // tidalloc's empty_cache returns the free memory of every pool without
    // users and of the usual memory: a superset of one pool's.
    for (int d = 0; d < kMaxDevices; d++) {
      tide_allocator *a = devices[d].alloc.load();
      if (a && tide_empty_cache(a) != TIDE_OK)
        TORCH_WARN(msg("tidalloc: empty_cache on device ", d, ": ", last_error()));
    }
  }

  double getMemoryFraction(c10::DeviceIndex device) override { return devices[device].fraction; }

  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    TORCH_CHECK(fraction > 0 && fraction <= 1,
                msg("tidalloc: invalid fraction ", fraction, ": it must be in (0, 1]"));
    tide_allocator *a = allocator_of(device);
    TORCH_CHECK(tide_set_memory_fraction(a, fraction) == TIDE_OK, msg("tidalloc: ", last_error()));
    devices[device].fraction = fraction;
  }

  void cacheInfo(c10::DeviceIndex device, size_t *largest) override {
    if (*largest == 0) { // as PyTorch's: free device memory is the first guess
      size_t total = 0;
      c10::cuda::CUDAGuard guard(device);
      C10_CUDA_CHECK(cudaMemGetInfo(largest, &total));
    }
    tide_layout l;
    if (tide_layout_get(allocator_of(device), &l) != TIDE_OK) return;
    for (size_t i = 0; i < l.num_segments; i++) {
      const tide_segment_view &s = l.segments[i];
      if (s.capture_pool) continue;
      for (size_t b = s.first_block; b < s.first_block + s.num_blocks; b++)
        if (l.blocks[b].state == TIDE_BLOCK_FREE)
          *largest = std::max<size_t>(*largest, l.blocks[b].size);
    }
    tide_layout_free(&l);
  }

  void *getBaseAllocation(void *ptr, size_t *size) override {
    c10::DeviceIndex device = c10::cuda::current_device();
    void *base = nullptr;
    size_t bytes = 0;
    TORCH_CHECK(tide_block_info(allocator_of(device), ptr, &base, &bytes, nullptr) == TIDE_OK,
                msg("tidalloc: getBaseAllocation: ", last_error()));
    if (size) *size = bytes;
    return base;
  }

  void recordStream(const c10::DataPtr &data_ptr, c10::cuda::CUDAStream stream) override {
    if (!data_ptr.get() || data_ptr.get_deleter() != &delete_block) return;
    c10::DeviceIndex device = decode_device(data_ptr.get_context());
    Device &d = devices[device];
    if (d.nforeign.load() && is_foreign(d, data_ptr.get())) return;
    tide_status st = tide_record_stream(allocator_of(device), data_ptr.get(),
                                        reinterpret_cast<tide_stream>(stream.stream()));
    TORCH_CHECK(st == TIDE_OK, msg("tidalloc: record_stream: ", last_error()));
  }

  // ------------------------------------------------------------ statistics

  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    tide_stats st;
    TORCH_CHECK(tide_get_stats(allocator_of(device), &st) == TIDE_OK,
                msg("tidalloc: ", last_error()));
    DeviceStats out;
    for (int p = 0; p < TIDE_POOL_KINDS; p++) {
      put(out.allocation[p], st.allocations[p]);
      put(out.segment[p], st.segments[p]);
      put(out.active[p], st.active_blocks[p]);
      put(out.inactive_split[p], st.inactive_split[p]);
      put(out.allocated_bytes[p], st.allocated_bytes[p]);
      put(out.reserved_bytes[p], st.reserved_bytes[p]);
      put(out.active_bytes[p], st.active_bytes[p]);
      put(out.inactive_split_bytes[p], st.inactive_split_bytes[p]);
      put(out.requested_bytes[p], st.requested_bytes[p]);
    }
    // Counts of allocations and frees are kept; totals of bytes are not.
    out.allocation[0].allocated = static_cast<int64_t>(st.num_allocs);
    out.allocation[0].freed = static_cast<int64_t>(st.num_frees);
    out.num_alloc_retries = static_cast<int64_t>(st.num_alloc_retries);
    out.num_ooms = static_cast<int64_t>(st.num_ooms);
    out.oversize_allocations.current = static_cast<int64_t>(st.oversize_allocations);
    out.num_sync_all_streams = static_cast<int64_t>(st.num_sync_all_streams);
    out.num_device_alloc = static_cast<int64_t>(st.num_device_alloc);
    out.num_device_free = static_cast<int64_t>(st.num_device_free);
    return out;
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    // Nothing to reset: the totals PyTorch would reset are not kept.
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    TORCH_CHECK(tide_reset_peak_stats(allocator_of(device)) == TIDE_OK,
                msg("tidalloc: ", last_error()));
  }

#if TIDE_TORCH_AT_LEAST(10)
  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex) override {
    return {};
  }
#endif

#if TIDE_TORCH_AT_LEAST(11)
  cca::SnapshotInfo snapshot(MempoolId_t mempool_id = {0, 0}, bool include_traces = true) override {
#else
  cca::SnapshotInfo snapshot(MempoolId_t mempool_id = {0, 0}) override {
#endif
    cca::SnapshotInfo info{};
    int count = std::min<int>(c10::cuda::device_count(), kMaxDevices);
    for (int d = 0; d < count; d++) {
      if (devices[d].alloc.load()) add_segments(info, static_cast<c10::DeviceIndex>(d), mempool_id);
      info.device_traces.emplace_back(); // no history is recorded
    }
    info.config_metadata.expandable_segments = true;
    info.config_metadata.last_allocator_settings = "tidalloc";
    return info;
  }

  // ------------------------------------------------------------ graph pools

  void beginAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override {
    count(kBeginAllocateToPool);
    tide_allocator *a = allocator_of(device);
    Device &d = devices[device];
    std::lock_guard<std::mutex> lock(d.mutex);
    for (const Route &r : d.routes)
      TORCH_CHECK(r.id != mempool_id,
                  msg("tidalloc: beginAllocateToPool: already allocating to pool (",
                      mempool_id.first, ", ", mempool_id.second, ")"));
    incref_locked(d, a, mempool_id, nullptr);
    d.routes.push_back({mempool_id, std::move(filter)});
    d.nroutes.store(static_cast<int>(d.routes.size()), std::memory_order_release);
    TORCH_CHECK(tide_capture_watch_begin(a) == TIDE_OK, msg("tidalloc: ", last_error()));
  }

  void endAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    count(kEndAllocateToPool);
    Device &d = devices[device];
    tide_allocator *a = allocator_of(device);
    std::lock_guard<std::mutex> lock(d.mutex);
    auto it = std::find_if(d.routes.begin(), d.routes.end(),
                           [&](const Route &r) { return r.id == mempool_id; });
    TORCH_CHECK(it != d.routes.end(), msg("tidalloc: endAllocateToPool: pool (", mempool_id.first,
                                          ", ", mempool_id.second, ") is not being allocated to"));
    d.routes.erase(it);
    d.nroutes.store(static_cast<int>(d.routes.size()), std::memory_order_release);
    if (tide_capture_watch_end(a) != TIDE_OK)
      TORCH_WARN(msg("tidalloc: endAllocateToPool: ", last_error()));
  }

  void releasePool(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    count(kReleasePool);
    Device &d = devices[device];
    std::lock_guard<std::mutex> lock(d.mutex);
    auto it = d.pools.find(mempool_id);
    if (it == d.pools.end()) {
      TORCH_WARN(msg("tidalloc: releasePool: no pool (", mempool_id.first, ", ", mempool_id.second,
                     ") on device ", static_cast<int>(device)));
      return;
    }
    Pool &p = it->second;
    uint64_t tide_id = tide_pool_id(p.pool);
    if (tide_pool_release(p.pool) != TIDE_OK && tide_last_status() != TIDE_ERR_NOT_READY)
      TORCH_WARN(msg("tidalloc: releasePool: ", last_error()));
    if (--p.uses == 0) {
      d.ids.erase(tide_id);
      d.pools.erase(it);
    }
  }

  // Each pool of `device`: its PyTorch id and tidalloc's figures (up to n).
  // Returns how many pools there are.
  int pool_figures(int device, uint64_t *ids, tide_stats *figures, int n) {
    if (device < 0 || device >= kMaxDevices || !devices[device].alloc.load()) return 0;
    Device &d = devices[device];
    std::lock_guard<std::mutex> lock(d.mutex);
    int i = 0;
    for (auto &[id, pool] : d.pools) {
      if (i < n) {
        ids[2 * i] = id.first;
        ids[2 * i + 1] = id.second;
        if (tide_pool_get_stats(pool.pool, &figures[i]) != TIDE_OK)
          std::memset(&figures[i], 0, sizeof figures[i]);
      }
      i++;
    }
    return i;
  }

  int getPoolUseCount(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    Device &d = devices[device];
    std::lock_guard<std::mutex> lock(d.mutex);
    auto it = d.pools.find(mempool_id);
    return it == d.pools.end() ? 0 : it->second.uses;
  }

#if TIDE_TORCH_AT_LEAST(11)
  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                          std::shared_ptr<cca::CUDAAllocator> allocator = nullptr) override {
#else
  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                          cca::CUDAAllocator *raw_allocator = nullptr) override {
    // Before 2.11 a pointer, which its MemPool keeps alive.
    std::shared_ptr<cca::CUDAAllocator> allocator(raw_allocator, [](cca::CUDAAllocator *) {});
#endif
    count(kCreateOrIncrefPool);
    tide_allocator *a = allocator_of(device);
    Device &d = devices[device];
    std::lock_guard<std::mutex> lock(d.mutex);
    if (allocator.get() == this) allocator = nullptr;
    incref_locked(d, a, mempool_id, std::move(allocator));
  }

#if TIDE_TORCH_AT_LEAST(11)
  void setUseOnOOM(c10::DeviceIndex device, MempoolId_t mempool_id, bool use_on_oom) override {
#else
  void setUseOnOOM(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    bool use_on_oom = true;
#endif
    Device &d = devices[device];
    std::lock_guard<std::mutex> lock(d.mutex);
    auto it = d.pools.find(mempool_id);
    if (it != d.pools.end()) it->second.use_on_oom = use_on_oom;
  }

#if TIDE_TORCH_AT_LEAST(10)
  void setNoSplit(c10::DeviceIndex, MempoolId_t) override {
    // A pool's blocks are split as anywhere in tidalloc; nothing to change.
  }
#endif

  bool checkPoolLiveAllocations(c10::DeviceIndex device, MempoolId_t mempool_id,
                                const std::unordered_set<void *> &expected) override {
    count(kCheckPoolLiveAllocations);
    Device &d = devices[device];
    std::lock_guard<std::mutex> lock(d.mutex);
    auto it = d.pools.find(mempool_id);
    if (it == d.pools.end()) return expected.empty();
    std::vector<void *> live = pool_allocated(it->second.pool);
    if (live.size() != expected.size()) return false;
    for (void *p : live)
      if (!expected.count(p)) return false;
    return true;
  }

  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                          MempoolId_t id) override {
    count(kGetCheckpointState);
    Device &d = devices[device];
    std::lock_guard<std::mutex> lock(d.mutex);
    auto it = d.pools.find(id);
    TORCH_CHECK(it != d.pools.end(), msg("tidalloc: getCheckpointState: no pool (", id.first, ", ",
                                         id.second, ") on device ", static_cast<int>(device)));
    tide_checkpoint *k = nullptr;
    TORCH_CHECK(tide_pool_checkpoint(it->second.pool, &k) == TIDE_OK,
                msg("tidalloc: ", last_error()));
    return std::make_shared<Checkpoint>(k, id, device);
  }

  cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                              std::shared_ptr<cca::AllocatorState> state) override {
    count(kSetCheckpointPoolState);
    auto *ck = dynamic_cast<Checkpoint *>(state.get());
    TORCH_CHECK(ck, "tidalloc: setCheckpointPoolState: not a checkpoint of tidalloc's");
    Device &d = devices[ck->device];
    std::lock_guard<std::mutex> lock(d.mutex);
    auto it = d.pools.find(ck->id);
    TORCH_CHECK(it != d.pools.end(), msg("tidalloc: setCheckpointPoolState: pool (", ck->id.first,
                                         ", ", ck->id.second, ") is gone"));
    tide_restore_delta delta;
    TORCH_CHECK(tide_pool_restore(it->second.pool, ck->k, &delta) == TIDE_OK,
                msg("tidalloc: ", last_error()));
    return to_torch_delta(*ck, delta);
  }

  // -------------------------------------------------------- history, IPC...

  bool isHistoryEnabled() override { return false; }

#if TIDE_TORCH_AT_LEAST(11)
  void recordHistory(bool enabled, cca::CreateContextFn, size_t, cca::RecordContext, bool,
                     const std::vector<std::string> &) override {
#else
  void recordHistory(bool enabled, cca::CreateContextFn, size_t, cca::RecordContext,
                     bool) override {
#endif
    if (enabled) {
      TORCH_WARN_ONCE("tidalloc does not record PyTorch's allocation history; its own trace "
                      "(TIDALLOC_CONF=trace:N, python -m tidalloc run --trace-csv/--memory-viz) "
                      "records every allocation and free");
    }
  }

  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> lock(observers_mutex_);
    oom_observers_.push_back(std::move(observer));
  }

  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker) override {}

  cca::ShareableHandle shareIpcHandle(void *) override {
    TORCH_CHECK(false, "tidalloc: CUDA IPC handles do not cover tidalloc's memory; "
                       "tidalloc.torch.install() sends CUDA tensors between processes through "
                       "tidalloc's sharing (tidalloc.share)");
  }

  std::shared_ptr<void> getIpcDevPtr(std::string) override {
    TORCH_CHECK(false, "tidalloc: CUDA IPC handles do not cover tidalloc's memory; use "
                       "tidalloc.share");
  }

  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    c10::cuda::CUDAGuard guard(dev);
    cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
    } else {
      C10_CUDA_CHECK(err);
    }
  }

  cudaError_t memcpyAsync(void *dst, int dstDevice, const void *src, int srcDevice, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override {
    if (p2p_enabled || dstDevice == srcDevice)
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }

  std::string name() override { return "tidalloc"; }

private:
  bool initialized_ = false;
  bool enabled_ = true;
  std::mutex observers_mutex_;
  std::vector<cca::OutOfMemoryObserver> oom_observers_;

  static void put(c10::CachingAllocator::Stat &to, const tide_stat &from) {
    to.current = from.current;
    to.peak = from.peak;
  }

  tide_allocator *allocator_of(c10::DeviceIndex device) {
    TORCH_CHECK(device >= 0 && device < kMaxDevices,
                msg("tidalloc: device ", static_cast<int>(device), " is out of range"));
    tide_allocator *a = devices[device].alloc.load(std::memory_order_acquire);
    if (a) return a;
    a = tide_device(device);
    TORCH_CHECK(a, msg("tidalloc: device ", static_cast<int>(device), ": ", last_error()));
    devices[device].alloc.store(a, std::memory_order_release);
    return a;
  }

  // Under d.mutex: one more user of the pool, made if new.
  void incref_locked(Device &d, tide_allocator *a, MempoolId_t id,
                     std::shared_ptr<cca::CUDAAllocator> own) {
    auto it = d.pools.find(id);
    if (it != d.pools.end()) {
      TORCH_CHECK(tide_pool_retain(it->second.pool) == TIDE_OK, msg("tidalloc: ", last_error()));
      it->second.uses++;
      return;
    }
    Pool p;
    TORCH_CHECK(tide_pool_create(a, &p.pool) == TIDE_OK, msg("tidalloc: ", last_error()));
    p.uses = 1;
    p.own_allocator = std::move(own);
    d.ids[tide_pool_id(p.pool)] = id;
    d.pools.emplace(id, std::move(p));
  }

  void *malloc_on(c10::DeviceIndex device, size_t n, cudaStream_t stream) {
    tide_allocator *a = allocator_of(device);
    Device &d = devices[device];
    if (d.nroutes.load(std::memory_order_acquire)) {
      void *p = nullptr;
      if (routed_malloc(d, n, stream, &p)) return p;
    }
    void *p = tide_malloc(a, n, reinterpret_cast<tide_stream>(stream));
    return p ? p : out_of_memory(device, n, stream);
  }

  // Whether a route took the allocation: *out is the block (or an exception).
  // The latest route first, as PyTorch's allocator does (LIFO): nested
  // use_mem_pool blocks allocate to the innermost pool.
  bool routed_malloc(Device &d, size_t n, cudaStream_t stream, void **out) {
    std::unique_lock<std::mutex> lock(d.mutex);
    for (auto it = d.routes.rbegin(); it != d.routes.rend(); ++it) {
      const Route &r = *it;
      if (!r.filter(stream)) continue;
      Pool &pool = d.pools.at(r.id);
      count(kPoolAllocations);
      if (pool.own_allocator) {
        *out = pool.own_allocator->raw_alloc_with_stream(n, stream);
        d.foreign[*out] = pool.own_allocator;
        d.nforeign.store(static_cast<int>(d.foreign.size()));
        return true;
      }
      *out = tide_pool_malloc(pool.pool, n, reinterpret_cast<tide_stream>(stream));
      if (!*out) {
        std::string why = last_error();
        lock.unlock();
        throw_oom(n, why);
      }
      return true;
    }
    return false;
  }

  // The usual memory failed: pools marked use_on_oom, then the observers and
  // PyTorch's out-of-memory error with tidalloc's message.
  void *out_of_memory(c10::DeviceIndex device, size_t n, cudaStream_t stream) {
    std::string why = last_error();
    TORCH_CHECK(tide_last_status() == TIDE_ERR_OOM,
                msg("tidalloc: allocating ", n,
                    " bytes failed: ", why)); // not for lack of memory: a plain error
    Device &d = devices[device];
    {
      std::lock_guard<std::mutex> lock(d.mutex);
      for (auto &[id, pool] : d.pools) {
        if (!pool.use_on_oom || pool.own_allocator) continue;
        void *p = tide_pool_malloc(pool.pool, n, reinterpret_cast<tide_stream>(stream));
        if (p) return p;
      }
    }
    std::vector<cca::OutOfMemoryObserver> observers;
    {
      std::lock_guard<std::mutex> lock(observers_mutex_);
      observers = oom_observers_;
    }
    if (!observers.empty()) {
      size_t free_bytes = 0, total = 0;
      (void)cudaMemGetInfo(&free_bytes, &total);
      tide_stats st;
      tide_get_stats(allocator_of(device), &st);
      for (auto &o : observers)
        o(device, static_cast<size_t>(st.allocated_bytes[0].current), total, free_bytes);
    }
    throw_oom(n, why);
    return nullptr;
  }

  [[noreturn]] static void throw_oom(size_t n, const std::string &why) {
    TORCH_CHECK_WITH(OutOfMemoryError, false,
                     msg("CUDA out of memory (tidalloc). Tried to allocate ", n, " bytes. ", why));
    abort(); // not reached: TORCH_CHECK_WITH throws
  }

  static bool is_foreign(Device &d, void *ptr) {
    std::lock_guard<std::mutex> lock(d.mutex);
    return d.foreign.count(ptr) != 0;
  }

  static bool free_foreign(Device &d, void *ptr) {
    std::shared_ptr<cca::CUDAAllocator> owner;
    {
      std::lock_guard<std::mutex> lock(d.mutex);
      auto it = d.foreign.find(ptr);
      if (it == d.foreign.end()) return false;
      owner = std::move(it->second);
      d.foreign.erase(it);
      d.nforeign.store(static_cast<int>(d.foreign.size()));
    }
    owner->raw_delete(ptr);
    return true;
  }

  static std::vector<void *> pool_allocated(tide_pool *pool) {
    size_t n = 0;
    TORCH_CHECK(tide_pool_allocated(pool, nullptr, 0, &n) == TIDE_OK,
                msg("tidalloc: ", last_error()));
    std::vector<void *> out(n + 16);
    for (;;) {
      TORCH_CHECK(tide_pool_allocated(pool, out.data(), out.size(), &n) == TIDE_OK,
                  msg("tidalloc: ", last_error()));
      if (n <= out.size()) break;
      out.resize(n + 16);
    }
    out.resize(n);
    return out;
  }

  // PyTorch's delta: freed are all blocks allocated before the restore (the
  // released ones and those that stayed), allocated all of the checkpoint's.
  static cca::CheckpointDelta to_torch_delta(const Checkpoint &ck, tide_restore_delta &delta) {
    std::vector<void *> allocd(tide_checkpoint_allocated(ck.k, nullptr, 0));
    tide_checkpoint_allocated(ck.k, allocd.data(), allocd.size());
    std::unordered_set<void *> restored(delta.restored, delta.restored + delta.nrestored);
    cca::CheckpointDelta out;
    out.ptrs_freed.assign(delta.released, delta.released + delta.nreleased);
    for (void *p : allocd)
      if (!restored.count(p)) out.ptrs_freed.push_back(p);
    c10::Device dev(c10::DeviceType::CUDA, ck.device);
    for (void *p : allocd)
      out.dataptrs_allocd.emplace_back(p, encode(p, ck.device), &delete_block, dev);
    tide_restore_delta_free(&delta);
    return out;
  }

  // The device's segments as PyTorch's: each run of mapped blocks of a
  // segment is one SegmentInfo (PyTorch's tools place blocks one after the
  // other from the segment's address).
  void add_segments(cca::SnapshotInfo &info, c10::DeviceIndex device, MempoolId_t only) {
    tide_layout l;
    if (tide_layout_get(devices[device].alloc.load(), &l) != TIDE_OK) return;
    std::unordered_map<uint64_t, MempoolId_t> ids;
    {
      std::lock_guard<std::mutex> lock(devices[device].mutex);
      ids = devices[device].ids;
    }
    for (size_t i = 0; i < l.num_segments; i++) {
      const tide_segment_view &s = l.segments[i];
      MempoolId_t owner{0, 0};
      if (s.capture_pool) {
        auto it = ids.find(s.capture_pool);
        owner = it != ids.end() ? it->second : MempoolId_t{0, s.capture_pool};
      }
      if (only != MempoolId_t{0, 0} && owner != only) continue;
      add_runs(info, device, s, l.blocks, owner);
    }
    tide_layout_free(&l);
  }

  static void add_runs(cca::SnapshotInfo &info, c10::DeviceIndex device, const tide_segment_view &s,
                       const tide_block_view *blocks, MempoolId_t owner) {
    cca::SegmentInfo *seg = nullptr;
    for (size_t b = s.first_block; b < s.first_block + s.num_blocks; b++) {
      const tide_block_view &v = blocks[b];
      if (v.state == TIDE_BLOCK_UNMAPPED) {
        seg = nullptr;
        continue;
      }
      if (!seg) {
        info.segments.emplace_back();
        seg = &info.segments.back();
        seg->device = device;
        seg->address = v.address;
        seg->stream = reinterpret_cast<decltype(seg->stream)>(s.stream);
        seg->is_large = s.large != 0;
        seg->is_expandable = s.expandable != 0;
        seg->owner_private_pool_id = owner;
      }
      cca::BlockInfo bi;
      bi.size = v.size;
      bi.requested_size = v.requested;
      bi.allocated = v.state == TIDE_BLOCK_ALLOCATED;
      bi.active = v.state == TIDE_BLOCK_ALLOCATED || v.state == TIDE_BLOCK_PENDING;
      seg->total_size += v.size;
      seg->requested_size += v.requested;
      if (bi.allocated) seg->allocated_size += v.size;
      if (bi.active) seg->active_size += v.size;
      seg->blocks.push_back(std::move(bi));
    }
  }
};

std::shared_ptr<TidallocAllocator> &the_allocator() {
  static auto *a = new std::shared_ptr<TidallocAllocator>(std::make_shared<TidallocAllocator>());
  return *a; // never destroyed: tensors may die after static destructors ran
}

void delete_block(void *ctx) {
  the_allocator()->free_on(decode_device(ctx), decode_ptr(ctx), /*quiet_if_foreign=*/false);
}

} // namespace tidalloc_torch

// ---------------------------------------------------------------------------
// The entry points tidalloc.torch calls through ctypes
// ---------------------------------------------------------------------------

extern "C" {

// Make tidalloc PyTorch's CUDA allocator. 0, or -1 with the reason in `err`.
__attribute__((visibility("default"))) int tidalloc_torch_install(char *err, size_t len) {
  try {
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(tidalloc_torch::the_allocator());
    return 0;
  } catch (const std::exception &e) {
    if (err && len) std::snprintf(err, len, "%s", e.what());
    return -1;
  }
}

// How often PyTorch called the graph-pool methods, in the order of
// tidalloc_torch::Count; returns how many counts there are.
__attribute__((visibility("default"))) int tidalloc_torch_counts(uint64_t *out, int n) {
  for (int i = 0; i < n && i < tidalloc_torch::kNumCounts; i++)
    out[i] = tidalloc_torch::counts[i].load();
  return tidalloc_torch::kNumCounts;
}

// The graph pools of `device` (up to n): ids gets each one's MempoolId_t as
// two numbers, allocated and reserved its tidalloc figures (current, peak)
// of all sizes. Returns how many pools there are.
__attribute__((visibility("default"))) int
tidalloc_torch_pools(int device, uint64_t *ids, int64_t *allocated, int64_t *reserved, int n) {
  std::vector<tide_stats> figures(n > 0 ? n : 0);
  int total = tidalloc_torch::the_allocator()->pool_figures(device, ids, figures.data(), n);
  for (int i = 0; i < n && i < total; i++) {
    allocated[2 * i] = figures[i].allocated_bytes[0].current;
    allocated[2 * i + 1] = figures[i].allocated_bytes[0].peak;
    reserved[2 * i] = figures[i].reserved_bytes[0].current;
    reserved[2 * i + 1] = figures[i].reserved_bytes[0].peak;
  }
  return total;
}

// The torch version the shim was built for, as "2.11".
__attribute__((visibility("default"))) const char *tidalloc_torch_built_for(void) {
  return TIDE_TORCH_BUILT_FOR;
}

} // extern "C"
