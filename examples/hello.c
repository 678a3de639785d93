/* hello.c: the smallest tidalloc program. It takes the process-wide allocator
 * of device 0, allocates 1 MiB on the default stream, frees it and prints the
 * allocator's statistics.
 *
 *   cc hello.c $(pkg-config --cflags --libs tidalloc) -o hello && ./hello
 *
 * Without a GPU, run it on the emulated device: TIDALLOC_CONF=backend:host ./hello */
#include <stdio.h>

#include <tidalloc.h>

/* Every tidalloc failure leaves a message for the calling thread. */
static int report_failure(const char *what) {
  fprintf(stderr, "hello: %s failed: %s\n", what, tide_last_error());
  return 1;
}

static double mib(int64_t bytes) { return (double)bytes / (1024.0 * 1024.0); }

int main(void) {
  tide_allocator *alloc = tide_device(0);
  if (alloc == NULL) return report_failure("tide_device(0)");

  /* NULL is the default stream. */
  void *buffer = tide_malloc(alloc, 1 << 20, NULL);
  if (buffer == NULL) return report_failure("tide_malloc(1 MiB)");
  printf("allocated 1 MiB at %p\n", buffer);

  /* The block goes back to the allocator's cache, not to the device. */
  if (tide_free(alloc, buffer, NULL) != TIDE_OK) return report_failure("tide_free");

  tide_stats stats;
  if (tide_get_stats(alloc, &stats) != TIDE_OK) return report_failure("tide_get_stats");
  const tide_stat *allocated = &stats.allocated_bytes[TIDE_POOL_ALL];
  const tide_stat *reserved = &stats.reserved_bytes[TIDE_POOL_ALL];
  printf("allocated: %8.2f MiB now, %8.2f MiB peak\n", mib(allocated->current),
         mib(allocated->peak));
  printf("reserved:  %8.2f MiB now, %8.2f MiB peak\n", mib(reserved->current), mib(reserved->peak));

  /* Optional at exit; it returns all memory to the device. */
  if (tide_shutdown() != TIDE_OK) return report_failure("tide_shutdown");
  return 0;
}
