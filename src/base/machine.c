/* machine.c: what the machine the library runs on can hold, for the
 * defaults that follow it: the emulated device of the host backend must not
 * be larger than the memory behind it, or a program that fills it is killed
 * by the kernel instead of getting TIDE_ERR_OOM.
 *
 * The machine's memory is the physical memory, or the memory limit of the
 * process's control group when that is lower (a container's share of a
 * larger machine). */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "base/internal.h"

/* The emulated devices together take at most this share of the machine's
 * memory: the rest is the program's own (the host side of its data, its
 * libraries) and the other processes'. */
#define HOST_SHARE_NUM 1
#define HOST_SHARE_DEN 2
/* ... and each at most this much, a device as large as common GPUs, so
 * that figures measured on large machines stay comparable. */
#define HOST_CAPACITY_MAX ((uint64_t)24 << 30)

/* A whole number of bytes read from `path`; false for "max", a missing
 * file or anything else. */
static bool read_bytes(const char *path, uint64_t *out) {
  FILE *f = fopen(path, "re");
  if (!f) return false;
  unsigned long long v = 0;
  bool ok = fscanf(f, "%llu", &v) == 1;
  fclose(f);
  if (ok) *out = (uint64_t)v;
  return ok;
}

/* The memory limit of the process's control group (version 2, then
 * version 1), or UINT64_MAX without one. */
static uint64_t cgroup_limit(void) {
  uint64_t limit = UINT64_MAX, v;
  char line[512], path[600];
  FILE *f = fopen("/proc/self/cgroup", "re");
  if (f) {
    while (fgets(line, sizeof line, f)) {
      if (strncmp(line, "0::", 3) != 0) continue; /* the unified (version 2) hierarchy */
      line[strcspn(line, "\n")] = '\0';
      snprintf(path, sizeof path, "/sys/fs/cgroup%s/memory.max", line + 3);
      if (read_bytes(path, &v) && v < limit) limit = v;
    }
    fclose(f);
  }
  if (read_bytes("/sys/fs/cgroup/memory.max", &v) && v < limit) limit = v;
  if (read_bytes("/sys/fs/cgroup/memory/memory.limit_in_bytes", &v) && v < limit) limit = v;
  return limit;
}

uint64_t _tide_machine_memory(void) {
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  uint64_t physical = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 0;
  uint64_t limit = cgroup_limit();
  if (physical == 0) return limit == UINT64_MAX ? 0 : limit;
  return limit < physical ? limit : physical;
}

size_t _tide_host_capacity(const _tide_conf_values *conf) {
  if (conf->host_capacity) return conf->host_capacity;
  uint64_t machine = _tide_machine_memory();
  uint64_t each = HOST_CAPACITY_MAX;
  int devices = conf->host_devices > 0 ? conf->host_devices : 1;
  if (machine) {
    uint64_t share = machine / HOST_SHARE_DEN * HOST_SHARE_NUM / (uint64_t)devices;
    if (share < each) each = share;
  }
  uint64_t gran = conf->host_granularity ? conf->host_granularity : 1;
  each = each / gran * gran;
  return (size_t)(each ? each : gran); /* a machine too small for one unit still gets one */
}
