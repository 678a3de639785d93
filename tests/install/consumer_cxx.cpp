// consumer_cxx.cpp: a C++ program built against an installed tidalloc, with
// warnings fatal and pedantic C++17: the public header must compile as C++
// (its extern "C" block, no C-only syntax) and the library must link into a
// C++ program. It holds its blocks in std::unique_ptr with a deleter that
// frees through tidalloc, grows a buffer in place, and exits 0 when all of
// it works.
#include <tidalloc.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

namespace {

// Frees a block of one allocator on the stream it was used on.
struct tide_deleter {
  tide_allocator *alloc;
  void operator()(void *p) const {
    if (tide_free(alloc, p, nullptr) != TIDE_OK)
      std::fprintf(stderr, "consumer_cxx: tide_free: %s\n", tide_last_error());
  }
};
using tide_ptr = std::unique_ptr<void, tide_deleter>;

int fail(const char *what) {
  std::fprintf(stderr, "consumer_cxx: %s failed: %s (%s)\n", what, tide_last_error(),
               tide_status_name(tide_last_status()));
  return 1;
}

} // namespace

int main() {
  if (std::strcmp(tide_version(), TIDE_VERSION_STRING) != 0) return fail("version check");
  tide_allocator *alloc = tide_device(0);
  if (alloc == nullptr) return fail("tide_device(0)");
  {
    std::vector<tide_ptr> blocks;
    for (size_t size : {size_t{512}, size_t{4096}, size_t{1} << 20, size_t{8} << 20}) {
      tide_ptr p(tide_malloc(alloc, size, nullptr), tide_deleter{alloc});
      if (!p) return fail("tide_malloc");
      blocks.push_back(std::move(p));
    }
    tide_stats stats;
    if (tide_get_stats(alloc, &stats) != TIDE_OK) return fail("tide_get_stats");
    if (stats.allocated_bytes[TIDE_POOL_ALL].current < (9 << 20)) return fail("allocated bytes");
  } // the blocks go back here, through the deleter
  {
    // A buffer that grows in place: its address does not change.
    tide_buf_options options;
    tide_buf_options_init(&options);
    options.capacity = size_t{64} << 20;
    tide_buf *buf = nullptr;
    if (tide_buf_create(alloc, &options, &buf) != TIDE_OK) return fail("tide_buf_create");
    void *data = tide_buf_data(buf);
    for (size_t length = size_t{1} << 20; length <= (size_t{16} << 20); length *= 2) {
      if (tide_buf_resize(buf, length, nullptr) != TIDE_OK) return fail("tide_buf_resize");
      if (tide_buf_data(buf) != data || tide_buf_length(buf) != length)
        return fail("growth in place");
    }
    if (tide_buf_destroy(buf) != TIDE_OK) return fail("tide_buf_destroy");
  }
  tide_stats after;
  if (tide_get_stats(alloc, &after) != TIDE_OK) return fail("tide_get_stats");
  if (after.allocated_bytes[TIDE_POOL_ALL].current != 0) return fail("all freed");
  if (tide_shutdown() != TIDE_OK) return fail("tide_shutdown");
  std::printf("consumer_cxx: tidalloc %s works from C++\n", tide_version());
  return 0;
}
