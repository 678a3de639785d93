/* test_gpu_oom.cu: out of memory at the device's real limit. Blocks of 1 GiB
 * are allocated until tide_malloc returns NULL (at most 150): the status
 * must be TIDE_ERR_OOM and the message must speak of out of memory, what is
 * allocated and reserved and what is free; most of the device must have
 * been handed out first, and the last block must work. After freeing them
 * all, allocating succeeds again, and after tide_empty_cache the device has
 * its memory back. Run for expandable and fixed segments.
 *
 * Then, with the device full of cached blocks, a growable buffer grows over
 * them (each growth at the limit gets the cache back) and keeps its data.
 *
 * TIDE_GPU_OOM_LIMIT_GIB=N puts the limit at N GiB with tide_set_memory_limit
 * instead (the memcheck run does, so that the sanitizer keeps device memory
 * for itself): then exactly N blocks must fit. */
#include "gpu_check.h"

#define MAX_BLOCKS 150

/* The memory limit asked for in GiB, or 0 for the device's own. */
static int limit_gib(void) {
  const char *env = getenv("TIDE_GPU_OOM_LIMIT_GIB");
  int n = env ? atoi(env) : 0;
  return n > 0 && n < MAX_BLOCKS ? n : 0;
}

/* With the device full of cached free blocks, a growable buffer grows a
 * GiB at a time to `gib` GiB: each growth that finds no memory left must
 * get the cache back and succeed, and the buffer keeps its data. */
static void buffer_takes_the_cache(tide_allocator *a, int gib, counter bad, const char *mode) {
  if (gib < 1) return;
  tide_buf_options o;
  tide_buf_options_init(&o);
  o.capacity = (size_t)gib * GPU_GiB;
  tide_buf *b = NULL;
  tide_status st = tide_buf_create(a, &o, &b);
  check(st == TIDE_OK, "%s: a buffer of %d GiB is created: %s", mode, gib, tide_last_error());
  if (st != TIDE_OK) return;
  int grown = 0;
  while (grown < gib && tide_buf_resize(b, (size_t)(grown + 1) * GPU_GiB, NULL) == TIDE_OK) grown++;
  check(grown == gib, "%s: the buffer grows to %d GiB over the cached blocks (%d GiB: %s)", mode,
        gib, grown, grown == gib ? "" : tide_last_error());
  if (grown) {
    fill(tide_buf_data(b), (size_t)grown * GPU_GiB, 11, NULL);
    queue_check(tide_buf_data(b), (size_t)grown * GPU_GiB, 11, bad.dev, NULL);
    unsigned long long wrong = counter_take(bad);
    check(wrong == 0, "%s: the buffer holds its data (%llu word(s) wrong)", mode, wrong);
  }
  printf("  %s: a buffer grew to %d GiB over the cached blocks\n", mode, grown);
  TIDE_OK_OR_DIE(tide_buf_destroy(b));
}

static void one_mode(const char *conf, const char *mode) {
  size_t free0 = 0, total = 0;
  CUDA_OK(cudaMemGetInfo(&free0, &total));
  tide_allocator *a = gpu_allocator(conf);
  int limit = limit_gib();
  if (limit) TIDE_OK_OR_DIE(tide_set_memory_limit(a, (size_t)limit * GPU_GiB));
  counter bad = counter_new(); /* before the device is full */
  void *p[MAX_BLOCKS];
  int n = 0;
  while (n < MAX_BLOCKS && (p[n] = tide_malloc(a, GPU_GiB, NULL)) != NULL) n++;
  tide_status st = tide_last_status();
  char message[1024];
  snprintf(message, sizeof message, "%s", tide_last_error());
  printf("  %s: %d blocks of 1 GiB, then: %s: %s\n", mode, n, tide_status_name(st), message);
  check(n < MAX_BLOCKS, "%s: allocation failed before %d GiB (after %d GiB)", mode, MAX_BLOCKS, n);
  check(st == TIDE_ERR_OOM, "%s: the failure is TIDE_ERR_OOM (%s)", mode, tide_status_name(st));
  static const char *const words[] = {"out of memory", "allocated", "reserved", "free"};
  for (size_t i = 0; i < sizeof words / sizeof *words; i++)
    check(has_word(message, words[i]), "%s: the message mentions \"%s\"", mode, words[i]);
  if (limit) {
    check(n == limit, "%s: %d GiB allocated under a limit of %d GiB", mode, n, limit);
  } else {
    /* Most of what was free is handed out before the failure. */
    double got = (double)n * (double)GPU_GiB;
    check(got >= 0.85 * (double)free0 - 2.0 * (double)GPU_GiB,
          "%s: %d GiB allocated of %.1f GiB free at the start", mode, n,
          (double)free0 / (double)GPU_GiB);
  }
  tide_stats s = gpu_stats(a);
  check(s.num_ooms >= 1, "%s: num_ooms counts it (%llu)", mode, (unsigned long long)s.num_ooms);
  if (n >= 2) {
    /* Give one block back to the device, for the kernels (and a sanitizer)
     * to have room, then check that the memory at the limit works. */
    TIDE_OK_OR_DIE(tide_free(a, p[n - 2], NULL));
    p[n - 2] = NULL;
    TIDE_OK_OR_DIE(tide_empty_cache(a));
    fill(p[n - 1], GPU_GiB, 5, NULL);
    queue_check(p[n - 1], GPU_GiB, 5, bad.dev, NULL);
    unsigned long long wrong = counter_take(bad);
    check(wrong == 0, "%s: the last block holds its data (%llu word(s) wrong)", mode, wrong);
  }
  for (int i = 0; i < n; i++)
    if (p[i]) TIDE_OK_OR_DIE(tide_free(a, p[i], NULL));
  void *again = tide_malloc(a, GPU_GiB, NULL);
  check(again != NULL, "%s: after freeing everything, 1 GiB is allocated again%s%s", mode,
        again ? "" : ": ", again ? "" : tide_last_error());
  if (again) TIDE_OK_OR_DIE(tide_free(a, again, NULL));
  /* And a second time to the limit: the allocator is still consistent. */
  int m = 0;
  while (m < MAX_BLOCKS && (p[m] = tide_malloc(a, GPU_GiB, NULL)) != NULL) m++;
  check(m >= n - 1 && tide_last_status() == TIDE_ERR_OOM,
        "%s: a second run to the limit gets %d GiB (first: %d) and ends in TIDE_ERR_OOM", mode, m,
        n);
  for (int i = 0; i < m; i++) TIDE_OK_OR_DIE(tide_free(a, p[i], NULL));
  buffer_takes_the_cache(a, m - 1, bad, mode);
  TIDE_OK_OR_DIE(tide_empty_cache(a));
  size_t free1 = 0;
  CUDA_OK(cudaMemGetInfo(&free1, &total));
  check(free1 + 256 * GPU_MiB >= free0,
        "%s: after empty_cache the device has %.2f GiB free "
        "(%.2f GiB before)",
        mode, (double)free1 / (double)GPU_GiB, (double)free0 / (double)GPU_GiB);
  counter_free(bad);
  tide_status rc = tide_destroy(a);
  check(rc == TIDE_OK, "%s: tide_destroy: %s", mode, tide_status_name(rc));
}

int main(void) {
  print_device();
  CUDA_OK(cudaFree(0)); /* the runtime's context first, so its memory is counted in free0 */
  one_mode("expandable_segments:true", "expandable");
  one_mode("expandable_segments:false", "fixed");
  return finish("test_gpu_oom");
}
