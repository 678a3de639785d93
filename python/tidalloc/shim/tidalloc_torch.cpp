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
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "tidalloc.h"

// Written for torch 2.8 to 2.15 (python/tidalloc/shim/__init__.py's
// SUPPORTED, docs/torch_versions.md); each release compiled against by
// tests/torch/shim_compile.sh --versions. What changed for this class:
//   2.9  CUDAAllocator became a DeviceAllocator
//   2.10 setNoSplit and getExpandableSegmentSizes
//   2.11 new signatures of snapshot, recordHistory, createOrIncrefPool and
//        setUseOnOOM
//   2.12 attachOomRejectionObserver, pure virtual
//   2.13 markCaptureBegin/End and allocateWithAddress, with defaults;
//        DeviceStats::reserved_bytes_by_private_pools
//   2.14 supportsUserMetadata and annotateMemory, with defaults; torch's
//        headers need C++20 (cpp_extension passes -std=c++20)
//   2.15 nothing for the class
// A later 2.x is compiled as the newest known; only a build the user asks
// for reaches it (tidalloc.shim refuses versions outside SUPPORTED).
#if TORCH_VERSION_MAJOR != 2 || TORCH_VERSION_MINOR < 8
#error "the tidalloc shim needs torch 2.8 or later"
#endif
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
  std::map<uintptr_t, size_t> free_pieces; // own memory cached: address -> bytes
};

// Memory of a pool's own allocator is cached as PyTorch's allocator caches
// it: each block the allocator gives is a segment, cut into pieces for the
// pool's requests (and, for a use_on_oom pool, for those of the usual
// memory that found none); a freed piece goes back to its pool's free
// pieces, and a segment goes back to its allocator once wholly free, when
// the pool is released or emptied. Its bytes count in the figures the shim
// reports and, under a memory fraction, against it (tidalloc's limit is the
// fraction less them).
struct OwnSegment {
  std::shared_ptr<cca::CUDAAllocator> owner; // alive while its memory is held
  MempoolId_t pool;
  size_t size;
  cudaStream_t stream; // pieces are reused on this stream only
  bool large;
  int pieces = 0; // handed out, or freed and waiting on other streams
};

struct OwnPiece { // handed out
  size_t size;
  size_t requested;
  std::vector<cudaStream_t> streams; // others it was used on (record_stream)
};

// A freed piece kept until the other streams it was used on are done with
// it, as PyTorch's allocator does with events; streams still to record an
// event on wait for the pool routes (captures) to end.
struct OwnPending {
  uintptr_t addr;
  size_t size;
  std::vector<cudaStream_t> streams;
  std::vector<cudaEvent_t> events;
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
  std::map<uintptr_t, OwnSegment> own_segments; // by address
  std::unordered_map<void *, OwnPiece> foreign; // pieces of own memory handed out
  std::atomic<int> nforeign{0};
  std::vector<OwnPending> own_pending;
  tide_stats own{}; // own memory's figures, added to tidalloc's
  double fraction = 1.0;
  bool fraction_set = false; // by set_per_process_memory_fraction
  size_t total = 0;          // the device's memory, which the fraction is of
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
    // users and of the usual memory: a superset of one pool's. Own memory
    // goes back for the pool named (a pool without users gave it back when
    // released); for all pools, as under PyTorch's allocator, a live pool
    // keeps it, and only freed pieces waiting on streams are waited for.
    for (int d = 0; d < kMaxDevices; d++) {
      tide_allocator *a = devices[d].alloc.load();
      if (a && tide_empty_cache(a) != TIDE_OK)
        TORCH_WARN(msg("tidalloc: empty_cache on device ", d, ": ", last_error()));
      if (!a) continue;
      Device &dev = devices[d];
      std::lock_guard<std::mutex> lock(dev.mutex);
      own_poll_locked(dev, /*wait=*/true);
      auto it = dev.pools.find(mempool_id);
      if (mempool_id != MempoolId_t{0, 0} && it != dev.pools.end())
        own_release_locked(dev, it->second);
    }
  }

  double getMemoryFraction(c10::DeviceIndex device) override { return devices[device].fraction; }

  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    TORCH_CHECK(fraction > 0 && fraction <= 1,
                msg("tidalloc: invalid fraction ", fraction, ": it must be in (0, 1]"));
    tide_allocator *a = allocator_of(device);
    tide_info info;
    TORCH_CHECK(tide_get_info(a, &info) == TIDE_OK, msg("tidalloc: ", last_error()));
    Device &d = devices[device];
    std::lock_guard<std::mutex> lock(d.mutex);
    double was = d.fraction;
    d.fraction = fraction;
    d.fraction_set = true;
    d.total = info.total_memory;
    if (apply_fraction_locked(d) != TIDE_OK) {
      std::string why = last_error();
      d.fraction = was;
      apply_fraction_locked(d);
      TORCH_CHECK(false, msg("tidalloc: ", why));
    }
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
    if (d.nforeign.load() && record_foreign(d, data_ptr.get(), stream.stream())) return;
    tide_status st = tide_record_stream(allocator_of(device), data_ptr.get(),
                                        reinterpret_cast<tide_stream>(stream.stream()));
    TORCH_CHECK(st == TIDE_OK, msg("tidalloc: record_stream: ", last_error()));
  }

  // ------------------------------------------------------------ statistics

  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    tide_stats st;
    TORCH_CHECK(tide_get_stats(allocator_of(device), &st) == TIDE_OK,
                msg("tidalloc: ", last_error()));
    tide_stats own;
    {
      std::lock_guard<std::mutex> lock(devices[device].mutex);
      own = devices[device].own;
    }
    DeviceStats out;
    for (int p = 0; p < TIDE_POOL_KINDS; p++) {
      put(out.allocation[p], st.allocations[p], own.allocations[p]);
      put(out.segment[p], st.segments[p], own.segments[p]);
      put(out.active[p], st.active_blocks[p], own.active_blocks[p]);
      put(out.inactive_split[p], st.inactive_split[p]);
      put(out.allocated_bytes[p], st.allocated_bytes[p], own.allocated_bytes[p]);
      put(out.reserved_bytes[p], st.reserved_bytes[p], own.reserved_bytes[p]);
      put(out.active_bytes[p], st.active_bytes[p], own.active_bytes[p]);
      put(out.inactive_split_bytes[p], st.inactive_split_bytes[p]);
      put(out.requested_bytes[p], st.requested_bytes[p], own.requested_bytes[p]);
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
#if TIDE_TORCH_AT_LEAST(13)
    // Each live graph pool's reserved bytes, as tidalloc counts them (a
    // released pool's entry goes with it; a MemPool's own allocator's memory
    // is not in it).
    Device &d = devices[device];
    std::lock_guard<std::mutex> lock(d.mutex);
    for (auto &[id, pool] : d.pools) {
      tide_stats figures;
      if (tide_pool_get_stats(pool.pool, &figures) != TIDE_OK) continue;
      auto &stats = out.reserved_bytes_by_private_pools[id];
      for (int p = 0; p < TIDE_POOL_KINDS; p++) put(stats[p], figures.reserved_bytes[p]);
    }
#endif
    return out;
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    // Nothing to reset: the totals PyTorch would reset are not kept.
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    TORCH_CHECK(tide_reset_peak_stats(allocator_of(device)) == TIDE_OK,
                msg("tidalloc: ", last_error()));
    Device &d = devices[device];
    std::lock_guard<std::mutex> lock(d.mutex);
    for (tide_stat *s :
         {d.own.allocations, d.own.segments, d.own.active_blocks, d.own.allocated_bytes,
          d.own.reserved_bytes, d.own.active_bytes, d.own.requested_bytes})
      for (int p = 0; p < TIDE_POOL_KINDS; p++) s[p].peak = s[p].current;
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
      if (devices[d].alloc.load()) {
        add_segments(info, static_cast<c10::DeviceIndex>(d), mempool_id);
        add_own_segments(info, static_cast<c10::DeviceIndex>(d), mempool_id);
      }
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
#if TIDE_TORCH_AT_LEAST(10)
    // PyTorch's setting may change between captures (_set_allocator_settings).
    tide_capture_reuse_set(a, cca::CUDAAllocatorConfig::graph_capture_record_stream_reuse());
#endif
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
      // Its own memory goes back; a segment with pieces still alive goes
      // back when the last of them is freed.
      own_poll_locked(d, /*wait=*/true);
      own_release_locked(d, p);
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

#if TIDE_TORCH_AT_LEAST(12)
  // PyTorch's allocator calls these when its throw_on_cudamalloc_oom option
  // refuses a request before cudaMalloc; tidalloc has no such refusal (it
  // raises OutOfMemoryError, which the out-of-memory observers hear), so
  // they are kept and never called.
  void attachOomRejectionObserver(cca::OomRejectionObserver observer) override {
    std::lock_guard<std::mutex> lock(observers_mutex_);
    oom_rejection_observers_.push_back(std::move(observer));
  }
#endif

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
#if TIDE_TORCH_AT_LEAST(12)
  std::vector<cca::OomRejectionObserver> oom_rejection_observers_;
#endif

  // Own memory's figures added: the peak of the sum is at most the sum of
  // the peaks, which is what is reported.
  static void put(c10::CachingAllocator::Stat &to, const tide_stat &from,
                  const tide_stat &own = tide_stat{}) {
    to.current = from.current + own.current;
    to.peak = from.peak + own.peak;
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
        *out = own_malloc(d, r.id, n, stream, lock);
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
      own_poll_locked(d, /*wait=*/false);
      for (auto &[id, pool] : d.pools) {
        if (!pool.use_on_oom) continue;
        void *p = pool.own_allocator
                      ? own_take_locked(d, pool, n, stream)
                      : tide_pool_malloc(pool.pool, n, reinterpret_cast<tide_stream>(stream));
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
      tide_stats st{};
      const size_t allocated = tide_get_stats(allocator_of(device), &st) == TIDE_OK
                                   ? static_cast<size_t>(st.allocated_bytes[0].current)
                                   : 0;
      for (auto &o : observers) o(device, allocated, total, free_bytes);
    }
    throw_oom(n, why);
    return nullptr;
  }

  [[noreturn]] static void throw_oom(size_t n, const std::string &why) {
    TORCH_CHECK_WITH(OutOfMemoryError, false,
                     msg("CUDA out of memory (tidalloc). Tried to allocate ", n, " bytes. ", why));
    abort(); // not reached: TORCH_CHECK_WITH throws
  }

  // ------------------------------------------------- pools' own memory

  static constexpr size_t kOwnAlign = 512;     // pieces keep the device bits free
  static constexpr size_t kOwnSmall = 1 << 20; // PyTorch's small requests
  static constexpr size_t kOwnRoundLarge = 2 << 20;

  static size_t own_round(size_t n) {
    return std::max<size_t>(1, (n + kOwnAlign - 1) / kOwnAlign) * kOwnAlign;
  }

  // The segment a request gets, sized as PyTorch's allocator sizes them.
  static size_t own_segment_size(size_t rounded) {
    if (rounded <= kOwnSmall) return 2 << 20;
    if (rounded < (10 << 20)) return 20 << 20;
    return (rounded + kOwnRoundLarge - 1) / kOwnRoundLarge * kOwnRoundLarge;
  }

  static c10::DeviceIndex index_of(const Device &d) {
    return static_cast<c10::DeviceIndex>(&d - devices.data());
  }

  // A figure of all sizes and of the segment's kind moved by delta.
  static void bump(tide_stat (&s)[TIDE_POOL_KINDS], bool large, int64_t delta) {
    for (int k : {int{TIDE_POOL_ALL}, int{large ? TIDE_POOL_LARGE : TIDE_POOL_SMALL}}) {
      s[k].current += delta;
      s[k].peak = std::max(s[k].peak, s[k].current);
    }
  }

  // Under d.mutex: tidalloc's limit is the fraction's bytes less the own
  // memory held, so that both together stay within the fraction. Untouched
  // until PyTorch sets a fraction (TIDALLOC_CONF's then applies alone).
  static tide_status apply_fraction_locked(Device &d) {
    tide_allocator *a = d.alloc.load();
    if (!a || !d.fraction_set) return TIDE_OK;
    int64_t held = d.own.reserved_bytes[TIDE_POOL_ALL].current;
    if (d.fraction >= 1.0 || held <= 0 || !d.total) return tide_set_memory_fraction(a, d.fraction);
    double total = static_cast<double>(d.total);
    size_t allowed = static_cast<size_t>(d.fraction * total); // as tidalloc computes it
    size_t limit =
        allowed > static_cast<size_t>(held) + 1 ? allowed - static_cast<size_t>(held) : 1;
    double f = static_cast<double>(limit) / total;
    while (static_cast<size_t>(f * total) < limit) f = std::nextafter(f, 1.0);
    return tide_set_memory_fraction(a, f);
  }

  // Under d.mutex: whether `bytes` more of own memory stay within the
  // fraction, as PyTorch's allocator checks a pool allocator's segments.
  static bool own_fits_locked(Device &d, size_t bytes, std::string *why) {
    if (!d.fraction_set || d.fraction >= 1.0 || !d.total) return true;
    tide_stats st;
    if (tide_get_stats(d.alloc.load(), &st) != TIDE_OK) return true;
    size_t allowed = static_cast<size_t>(d.fraction * static_cast<double>(d.total));
    size_t used = static_cast<size_t>(st.reserved_bytes[TIDE_POOL_ALL].current) +
                  static_cast<size_t>(d.own.reserved_bytes[TIDE_POOL_ALL].current);
    if (used + bytes <= allowed) return true;
    *why = msg("The pool's allocator would pass the memory fraction (", d.fraction, " of ", d.total,
               " bytes: ", allowed, "): tidalloc reserves ",
               st.reserved_bytes[TIDE_POOL_ALL].current, " bytes, pools' own allocators hold ",
               d.own.reserved_bytes[TIDE_POOL_ALL].current, ", a new segment needs ", bytes, ".");
    return false;
  }

  static std::map<uintptr_t, OwnSegment>::iterator own_segment_of(Device &d, uintptr_t addr) {
    auto it = d.own_segments.upper_bound(addr);
    return std::prev(it); // a piece lies in a segment
  }

  // Under d.mutex: the best fitting free piece of the pool on `stream`,
  // split when the rest is worth keeping (PyTorch's rule), handed out; null
  // if none fits.
  static void *own_take_locked(Device &d, Pool &pool, size_t n, cudaStream_t stream) {
    size_t want = own_round(n);
    auto best = pool.free_pieces.end();
    for (auto it = pool.free_pieces.begin(); it != pool.free_pieces.end(); ++it)
      if (it->second >= want && (best == pool.free_pieces.end() || it->second < best->second) &&
          own_segment_of(d, it->first)->second.stream == stream)
        best = it;
    if (best == pool.free_pieces.end()) return nullptr;
    uintptr_t addr = best->first;
    size_t size = best->second, rest = size - want;
    pool.free_pieces.erase(best);
    if (want <= kOwnSmall ? rest >= kOwnAlign : rest > kOwnSmall) {
      pool.free_pieces.emplace(addr + want, rest);
      size = want;
    }
    OwnSegment &seg = own_segment_of(d, addr)->second;
    seg.pieces++;
    d.foreign.emplace(reinterpret_cast<void *>(addr), OwnPiece{size, n, {}});
    d.nforeign.store(static_cast<int>(d.foreign.size()));
    bump(d.own.allocations, seg.large, 1);
    bump(d.own.active_blocks, seg.large, 1);
    bump(d.own.allocated_bytes, seg.large, static_cast<int64_t>(size));
    bump(d.own.active_bytes, seg.large, static_cast<int64_t>(size));
    bump(d.own.requested_bytes, seg.large, static_cast<int64_t>(n));
    return reinterpret_cast<void *>(addr);
  }

  // An allocation of a pool with its own allocator (d.mutex held by `lock`):
  // a cached piece, else a new segment of the allocator within the
  // fraction, after giving back the pool's free segments if it must.
  static void *own_malloc(Device &d, MempoolId_t id, size_t n, cudaStream_t stream,
                          std::unique_lock<std::mutex> &lock) {
    Pool &pool = d.pools.at(id);
    if (void *p = own_take_locked(d, pool, n, stream)) return p;
    size_t want = own_round(n), bytes = own_segment_size(want);
    std::string why;
    if (!own_fits_locked(d, bytes, &why)) {
      own_release_locked(d, pool);
      if (!own_fits_locked(d, bytes, &why)) {
        lock.unlock();
        throw_oom(n, why);
      }
    }
    void *base = pool.own_allocator->raw_alloc_with_stream(bytes, stream);
    if (!base) {
      lock.unlock();
      throw_oom(n, "The pool's allocator returned no memory.");
    }
    uintptr_t addr = reinterpret_cast<uintptr_t>(base);
    if (addr & kDeviceBits) {
      give_back(pool.own_allocator, base);
      lock.unlock();
      TORCH_CHECK(false, msg("tidalloc: the pool's allocator returned ", base,
                             ", not aligned to 64 bytes"));
    }
    d.own_segments.emplace(addr,
                           OwnSegment{pool.own_allocator, id, bytes, stream, want > kOwnSmall});
    bump(d.own.segments, want > kOwnSmall, 1);
    bump(d.own.reserved_bytes, want > kOwnSmall, static_cast<int64_t>(bytes));
    if (apply_fraction_locked(d) != TIDE_OK)
      TORCH_WARN(msg("tidalloc: memory fraction: ", last_error()));
    pool.free_pieces.emplace(addr, bytes);
    return own_take_locked(d, pool, n, stream);
  }

  static void give_back(const std::shared_ptr<cca::CUDAAllocator> &owner, void *ptr) {
    try {
      owner->raw_delete(ptr);
    } catch (const std::exception &e) {
      TORCH_WARN(msg("tidalloc: giving ", ptr, " back to its pool's allocator failed: ", e.what()));
    }
  }

  // Under d.mutex: a wholly free segment back to its allocator.
  static void own_give_back_locked(Device &d, std::map<uintptr_t, OwnSegment>::iterator seg) {
    void *base = reinterpret_cast<void *>(seg->first);
    OwnSegment s = std::move(seg->second);
    d.own_segments.erase(seg);
    bump(d.own.segments, s.large, -1);
    bump(d.own.reserved_bytes, s.large, -static_cast<int64_t>(s.size));
    if (apply_fraction_locked(d) != TIDE_OK)
      TORCH_WARN(msg("tidalloc: memory fraction: ", last_error()));
    give_back(s.owner, base);
  }

  // Under d.mutex: the pool's wholly free segments back to its allocator.
  static void own_release_locked(Device &d, Pool &pool) {
    for (auto it = pool.free_pieces.begin(); it != pool.free_pieces.end();) {
      auto seg = d.own_segments.find(it->first);
      if (seg == d.own_segments.end() || seg->second.size != it->second) {
        ++it;
        continue;
      }
      it = pool.free_pieces.erase(it);
      own_give_back_locked(d, seg);
    }
  }

  // Under d.mutex: a freed piece no stream uses any more back among its
  // pool's free pieces, merged with its free neighbours in the segment; its
  // segment back to the allocator when the pool is gone and no piece is left.
  static void own_complete_locked(Device &d, uintptr_t addr, size_t size) {
    auto seg = own_segment_of(d, addr);
    OwnSegment &s = seg->second;
    bump(d.own.active_blocks, s.large, -1);
    bump(d.own.active_bytes, s.large, -static_cast<int64_t>(size));
    s.pieces--;
    auto pool = d.pools.find(s.pool);
    if (pool == d.pools.end() || pool->second.own_allocator != s.owner) { // released
      if (s.pieces == 0) own_give_back_locked(d, seg);
      return;
    }
    auto &free = pool->second.free_pieces;
    uintptr_t end = seg->first + s.size;
    auto next = free.lower_bound(addr);
    if (next != free.end() && next->first == addr + size && next->first < end) {
      size += next->second;
      next = free.erase(next);
    }
    if (next != free.begin()) {
      auto prev = std::prev(next);
      if (prev->first >= seg->first && prev->first + prev->second == addr) {
        prev->second += size;
        return;
      }
    }
    free.emplace(addr, size);
  }

  // Under d.mutex: freed pieces whose other streams are done complete; with
  // wait, they are waited for. While a route is open (a capture, or
  // use_mem_pool) no event is recorded or queried, as in PyTorch's allocator.
  static void own_poll_locked(Device &d, bool wait) {
    if (d.own_pending.empty() || !d.routes.empty()) return;
    c10::cuda::CUDAGuard guard(index_of(d));
    for (size_t i = 0; i < d.own_pending.size();) {
      OwnPending &w = d.own_pending[i];
      for (cudaStream_t s : w.streams) {
        cudaEvent_t e = nullptr;
        if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess &&
            cudaEventRecord(e, s) == cudaSuccess) {
          w.events.push_back(e);
        } else {
          if (e) (void)cudaEventDestroy(e);
          (void)cudaGetLastError();
          TORCH_WARN(msg("tidalloc: recording an event for a freed piece of a pool's own memory "
                         "failed; it waits for the device instead"));
          (void)cudaDeviceSynchronize();
        }
      }
      w.streams.clear();
      bool done = true;
      for (cudaEvent_t e : w.events) {
        if ((wait ? cudaEventSynchronize(e) : cudaEventQuery(e)) != cudaSuccess) {
          (void)cudaGetLastError(); // not ready
          done = false;
          break;
        }
      }
      if (!done) {
        i++;
        continue;
      }
      for (cudaEvent_t e : w.events) (void)cudaEventDestroy(e);
      uintptr_t addr = w.addr;
      size_t size = w.size;
      d.own_pending.erase(d.own_pending.begin() + static_cast<std::ptrdiff_t>(i));
      own_complete_locked(d, addr, size);
    }
  }

  // Whether ptr is a piece of own memory; if so it is freed: back to its
  // pool at once, or once the other streams it was used on are done.
  static bool free_foreign(Device &d, void *ptr) {
    std::lock_guard<std::mutex> lock(d.mutex);
    auto it = d.foreign.find(ptr);
    if (it == d.foreign.end()) return false;
    OwnPiece piece = std::move(it->second);
    d.foreign.erase(it);
    d.nforeign.store(static_cast<int>(d.foreign.size()));
    uintptr_t addr = reinterpret_cast<uintptr_t>(ptr);
    bool large = own_segment_of(d, addr)->second.large;
    bump(d.own.allocations, large, -1);
    bump(d.own.allocated_bytes, large, -static_cast<int64_t>(piece.size));
    bump(d.own.requested_bytes, large, -static_cast<int64_t>(piece.requested));
    if (piece.streams.empty()) {
      own_complete_locked(d, addr, piece.size);
    } else {
      d.own_pending.push_back({addr, piece.size, std::move(piece.streams), {}});
      own_poll_locked(d, /*wait=*/false);
    }
    return true;
  }

  // Whether ptr is a piece of own memory; if so `stream` is noted for its free.
  static bool record_foreign(Device &d, void *ptr, cudaStream_t stream) {
    std::lock_guard<std::mutex> lock(d.mutex);
    auto it = d.foreign.find(ptr);
    if (it == d.foreign.end()) return false;
    auto &streams = it->second.streams;
    if (stream != own_segment_of(d, reinterpret_cast<uintptr_t>(ptr))->second.stream &&
        std::find(streams.begin(), streams.end(), stream) == streams.end())
      streams.push_back(stream);
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

  // The own memory of `device`'s pools: each segment one SegmentInfo, its
  // pieces in address order and free blocks between them.
  static void add_own_segments(cca::SnapshotInfo &info, c10::DeviceIndex device, MempoolId_t only) {
    Device &d = devices[device];
    std::lock_guard<std::mutex> lock(d.mutex);
    for (auto &[base, seg] : d.own_segments) {
      if (only != MempoolId_t{0, 0} && seg.pool != only) continue;
      uintptr_t end = base + seg.size;
      std::map<uintptr_t, cca::BlockInfo> used;
      for (auto &[ptr, piece] : d.foreign) {
        uintptr_t at = reinterpret_cast<uintptr_t>(ptr);
        if (at < base || at >= end) continue;
        cca::BlockInfo &b = used[at];
        b.size = piece.size;
        b.requested_size = piece.requested;
        b.allocated = b.active = true;
      }
      for (const OwnPending &w : d.own_pending) {
        if (w.addr < base || w.addr >= end) continue;
        cca::BlockInfo &b = used[w.addr];
        b.size = w.size;
        b.active = true;
      }
      info.segments.emplace_back();
      cca::SegmentInfo &out = info.segments.back();
      out.device = device;
      out.address = base;
      out.total_size = seg.size;
      out.stream = reinterpret_cast<decltype(out.stream)>(seg.stream);
      out.is_large = seg.large;
      out.owner_private_pool_id = seg.pool;
      uintptr_t at = base;
      auto add_free = [&](uintptr_t to) {
        if (to <= at) return;
        cca::BlockInfo b;
        b.size = to - at;
        out.blocks.push_back(std::move(b));
      };
      for (auto &[addr, b] : used) {
        add_free(addr);
        out.requested_size += b.requested_size;
        if (b.allocated) out.allocated_size += b.size;
        out.active_size += b.size;
        at = addr + b.size;
        out.blocks.push_back(std::move(b));
      }
      add_free(end);
    }
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
