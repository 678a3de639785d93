/* test_gpu_integrity.cu: data survives growing, shrinking and emptying the
 * cache. Blocks of random sizes (512 B .. 256 MiB, odd sizes included) are
 * allocated until the live total reaches a target, each filled by a kernel
 * with its own pattern; then the target drops and random blocks are freed,
 * sometimes followed by tide_empty_cache (which unmaps free pages next to
 * live blocks); after every round a kernel checks every live block and
 * counts the words that changed. Live blocks must never overlap. Run for
 * expandable segments (2 MiB and 20 MiB pages) and for fixed segments.
 * TIDE_GPU_SCALE=N divides the live targets by N (the memcheck run's kernels
 * are slow). */
#include "gpu_check.h"

#define MAX_LIVE 4096

typedef struct live_block {
  void *ptr;
  size_t size;
  uint64_t seed;
} live_block;

typedef struct pool {
  live_block blocks[MAX_LIVE];
  int n;
  size_t bytes;
} pool;

static int by_address(const void *a, const void *b) {
  uintptr_t x = (uintptr_t)((const live_block *)a)->ptr;
  uintptr_t y = (uintptr_t)((const live_block *)b)->ptr;
  return x < y ? -1 : x > y;
}

/* Live blocks are 512-byte aligned and do not overlap. */
static void check_layout(pool *p, const char *mode, int round) {
  live_block sorted[MAX_LIVE];
  memcpy(sorted, p->blocks, (size_t)p->n * sizeof *sorted);
  qsort(sorted, (size_t)p->n, sizeof *sorted, by_address);
  int misaligned = 0, overlaps = 0;
  for (int i = 0; i < p->n; i++) {
    misaligned += (uintptr_t)sorted[i].ptr % 512 != 0;
    if (i > 0)
      overlaps += (uintptr_t)sorted[i - 1].ptr + sorted[i - 1].size > (uintptr_t)sorted[i].ptr;
  }
  check(misaligned == 0 && overlaps == 0,
        "%s round %d: %d live blocks, %d misaligned, %d overlapping", mode, round, p->n, misaligned,
        overlaps);
}

static void grow_to(tide_allocator *a, pool *p, size_t target, uint64_t *rng, const char *mode,
                    int round) {
  int failed = 0;
  while (p->bytes < target && p->n < MAX_LIVE) {
    size_t size = rng_size(rng, 512, 256 * GPU_MiB);
    void *ptr = tide_malloc(a, size, NULL);
    if (!ptr) {
      failed++;
      printf("  tide_malloc(%zu) failed: %s: %s\n", size, tide_status_name(tide_last_status()),
             tide_last_error());
      break;
    }
    live_block *b = &p->blocks[p->n++];
    b->ptr = ptr;
    b->size = size;
    b->seed = rng_next(rng);
    p->bytes += size;
    fill(ptr, size, b->seed, NULL);
  }
  char m[32];
  check(failed == 0, "%s round %d: grew to %d blocks, %s", mode, round, p->n,
        mib(p->bytes, m, sizeof m));
}

static void shrink_to(tide_allocator *a, pool *p, size_t target, uint64_t *rng) {
  while (p->bytes > target && p->n > 0) {
    int i = (int)(rng_next(rng) % (uint64_t)p->n);
    TIDE_OK_OR_DIE(tide_free(a, p->blocks[i].ptr, NULL));
    p->bytes -= p->blocks[i].size;
    p->blocks[i] = p->blocks[--p->n];
  }
}

static void verify(pool *p, counter bad, const char *mode, int round, const char *when) {
  for (int i = 0; i < p->n; i++)
    queue_check(p->blocks[i].ptr, p->blocks[i].size, p->blocks[i].seed, bad.dev, NULL);
  unsigned long long wrong = counter_take(bad);
  char m[32];
  check(wrong == 0, "%s round %d %s: %d blocks (%s) checked, %llu word(s) changed", mode, round,
        when, p->n, mib(p->bytes, m, sizeof m), wrong);
}

static void run_mode(const char *conf, const char *mode, uint64_t seed) {
  static pool p; /* large: keep it off the stack */
  memset(&p, 0, sizeof p);
  tide_allocator *a = gpu_allocator(conf);
  counter bad = counter_new();
  uint64_t rng = seed;
  /* Targets rise and fall: growth maps pages, frees and empty_cache unmap
   * them around the blocks that stay. */
  static const size_t targets[] = {4 * GPU_GiB, 1 * GPU_GiB,  8 * GPU_GiB, 512 * GPU_MiB,
                                   6 * GPU_GiB, 64 * GPU_MiB, 3 * GPU_GiB, 0};
  const int rounds = (int)(sizeof targets / sizeof *targets);
  const char *env = getenv("TIDE_GPU_SCALE");
  size_t scale = env && atoi(env) > 0 ? (size_t)atoi(env) : 1;
  for (int r = 0; r < rounds; r++) {
    size_t target = targets[r] / scale;
    if (target > p.bytes)
      grow_to(a, &p, target, &rng, mode, r);
    else
      shrink_to(a, &p, target, &rng);
    verify(&p, bad, mode, r, "after resizing");
    if (r % 2 == 1) {
      tide_stats before = gpu_stats(a);
      TIDE_OK_OR_DIE(tide_empty_cache(a));
      tide_stats after = gpu_stats(a);
      char x[32], y[32], z[32];
      check(after.reserved_bytes[0].current <= before.reserved_bytes[0].current &&
                after.reserved_bytes[0].current >= after.allocated_bytes[0].current,
            "%s round %d: empty_cache: reserved %s -> %s, allocated %s", mode, r,
            mib((size_t)before.reserved_bytes[0].current, x, sizeof x),
            mib((size_t)after.reserved_bytes[0].current, y, sizeof y),
            mib((size_t)after.allocated_bytes[0].current, z, sizeof z));
      verify(&p, bad, mode, r, "after empty_cache");
    }
    check_layout(&p, mode, r);
  }
  shrink_to(a, &p, 0, &rng);
  TIDE_OK_OR_DIE(tide_empty_cache(a));
  tide_stats st = gpu_stats(a);
  check(st.reserved_bytes[0].current == 0 && st.allocated_bytes[0].current == 0,
        "%s: all freed and emptied: reserved %lld bytes, allocated %lld bytes, %llu pages "
        "mapped and %llu unmapped in all",
        mode, (long long)st.reserved_bytes[0].current, (long long)st.allocated_bytes[0].current,
        (unsigned long long)st.pages_mapped, (unsigned long long)st.pages_unmapped);
  counter_free(bad);
  tide_status rc = tide_destroy(a);
  check(rc == TIDE_OK, "%s: tide_destroy: %s", mode, tide_status_name(rc));
}

int main(void) {
  print_device();
  run_mode("expandable_segments:true", "expandable 2 MiB pages", 1);
  run_mode("expandable_segments:true,page_size_mb:20", "expandable 20 MiB pages", 2);
  /* Handles of 4 pages for requests of 32 MiB or more once 1 GiB is held. */
  run_mode("expandable_segments:true,handle_size_mb:8,handle_threshold_mb:1024",
           "expandable 8 MiB handles", 4);
  run_mode("expandable_segments:false", "fixed segments", 3);
  return finish("test_gpu_integrity");
}
