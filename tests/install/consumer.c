/* consumer.c: a program built against an installed tidalloc. It checks that
 * the header and the library it was linked to agree and that one allocation
 * round-trips; exit status 0 means the install is usable. */
#include <stdio.h>
#include <string.h>

#include <tidalloc.h>

static int fail(const char *what) {
  fprintf(stderr, "consumer: %s failed: %s (%s)\n", what, tide_last_error(),
          tide_status_name(tide_last_status()));
  return 1;
}

int main(void) {
  if (strcmp(tide_version(), TIDE_VERSION_STRING) != 0) {
    fprintf(stderr, "consumer: header %s but library %s\n", TIDE_VERSION_STRING, tide_version());
    return 1;
  }
  tide_allocator *alloc = tide_device(0);
  if (alloc == NULL) return fail("tide_device(0)");
  void *p = tide_malloc(alloc, 4096, NULL);
  if (p == NULL) return fail("tide_malloc");
  if (tide_free(alloc, p, NULL) != TIDE_OK) return fail("tide_free");
  if (tide_shutdown() != TIDE_OK) return fail("tide_shutdown");
  printf("consumer: tidalloc %s works\n", tide_version());
  return 0;
}
