/* clock.c: the monotonic clock trace events are stamped with. */
#include <time.h>

#include "base/internal.h"

uint64_t _tide_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}
