/* test_gpu_empty_cache.cu: tide_empty_cache gives memory back to the device.
 * Blocks in both pools are allocated, touched by a kernel and freed (all of
 * them, or every other one); the device's free memory (cudaMemGetInfo) must
 * then rise by at least the reserved bytes tide_empty_cache released, less a
 * small tolerance for what the driver itself allocates. Run for expandable
 * and fixed segments. */
#include "gpu_check.h"

#define BLOCKS 96

/* What the driver may take or give back on its own between two readings
 * (page tables, its own pools). */
#define TOLERANCE (64 * GPU_MiB)

static size_t device_free(void) {
  size_t free_bytes = 0, total = 0;
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaMemGetInfo(&free_bytes, &total));
  return free_bytes;
}

static void one_case(const char *conf, const char *mode, bool free_all) {
  tide_allocator *a = gpu_allocator(conf);
  const char *which = free_all ? "all freed" : "every other block freed";
  size_t start = device_free();
  void *p[BLOCKS];
  size_t size[BLOCKS];
  for (int i = 0; i < BLOCKS; i++) {
    /* A third in the small pool, the rest large, up to 512 MiB. */
    size[i] = i % 3 == 0 ? (size_t)(i + 1) * 10 * 1024 : (size_t)(i % 16 + 1) * 32 * GPU_MiB + 512;
    p[i] = tide_malloc(a, size[i], NULL);
    if (!p[i]) gpu_fatal(__FILE__, __LINE__, "tide_malloc(%zu): %s", size[i], tide_last_error());
    fill(p[i], size[i], (uint64_t)i, NULL);
  }
  for (int i = 0; i < BLOCKS; i++)
    if (free_all || i % 2 == 0) TIDE_OK_OR_DIE(tide_free(a, p[i], NULL));
  tide_stats before = gpu_stats(a);
  size_t free_before = device_free();
  TIDE_OK_OR_DIE(tide_empty_cache(a));
  tide_stats after = gpu_stats(a);
  size_t free_after = device_free();

  int64_t released = before.reserved_bytes[0].current - after.reserved_bytes[0].current;
  int64_t risen = (int64_t)free_after - (int64_t)free_before;
  char x[32], y[32], z[32], w[32];
  check(released > 0, "%s, %s: empty_cache released %s (reserved %s -> %s)", mode, which,
        mib((size_t)(released > 0 ? released : 0), x, sizeof x),
        mib((size_t)before.reserved_bytes[0].current, y, sizeof y),
        mib((size_t)after.reserved_bytes[0].current, z, sizeof z));
  check(risen + (int64_t)TOLERANCE >= released,
        "%s, %s: device free memory rose by %s, at least the %s released (tolerance %s)", mode,
        which, mib((size_t)(risen > 0 ? risen : 0), x, sizeof x),
        mib((size_t)(released > 0 ? released : 0), y, sizeof y), mib(TOLERANCE, w, sizeof w));
  if (free_all) {
    check(after.reserved_bytes[0].current == 0,
          "%s, %s: nothing reserved after empty_cache (%lld bytes)", mode, which,
          (long long)after.reserved_bytes[0].current);
    check(free_after + TOLERANCE >= start,
          "%s, %s: the device is back to its free memory before the test (%s now, %s before)", mode,
          which, mib(free_after, x, sizeof x), mib(start, y, sizeof y));
  } else {
    check(after.reserved_bytes[0].current >= after.allocated_bytes[0].current &&
              after.allocated_bytes[0].current > 0,
          "%s, %s: live blocks stay reserved (allocated %s, reserved %s)", mode, which,
          mib((size_t)after.allocated_bytes[0].current, x, sizeof x),
          mib((size_t)after.reserved_bytes[0].current, y, sizeof y));
    /* The blocks that stayed are intact after their neighbours' pages went. */
    counter bad = counter_new();
    for (int i = 1; i < BLOCKS; i += 2) queue_check(p[i], size[i], (uint64_t)i, bad.dev, NULL);
    unsigned long long wrong = counter_take(bad);
    check(wrong == 0, "%s, %s: live blocks intact after empty_cache (%llu word(s) changed)", mode,
          which, wrong);
    counter_free(bad);
    for (int i = 1; i < BLOCKS; i += 2) TIDE_OK_OR_DIE(tide_free(a, p[i], NULL));
    TIDE_OK_OR_DIE(tide_empty_cache(a));
  }
  tide_status rc = tide_destroy(a);
  check(rc == TIDE_OK, "%s, %s: tide_destroy: %s", mode, which, tide_status_name(rc));
}

int main(void) {
  print_device();
  one_case("expandable_segments:true", "expandable", true);
  one_case("expandable_segments:true", "expandable", false);
  one_case("expandable_segments:false", "fixed", true);
  one_case("expandable_segments:false", "fixed", false);
  return finish("test_gpu_empty_cache");
}
