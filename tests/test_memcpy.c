/* test_memcpy.c: copies (tide_memcpy), and what the CUDA backend asks of the
 * driver for copies, pinned host memory and peer access.
 *
 * - On the host backend: copies between device blocks, pinned blocks and
 *   ordinary host memory keep their bytes; a copy on a held stream is done
 *   at once; arguments are checked (NULL, overlap, wrap, 0 bytes, unknown
 *   streams), copies into unmapped device memory or past the end of a
 *   pinned allocation are refused, and an injected failure says so.
 * - Through a fake driver handed to the CUDA backend in place of
 *   libcuda.so.1: cuMemcpyAsync gets the pointers, size and stream, and its
 *   failure comes back with the driver's words; cuMemHostAlloc is asked for
 *   portable, device-mapped memory, and its out-of-memory is the pool's; and
 *   cuMemSetAccess gets one descriptor for the device and one per peer that
 *   cuDeviceCanAccessPeer allows (and that has virtual memory management),
 *   none with peer_access:False or without the query, in both segment
 *   kinds; a refused peer mapping names the peers. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "backend/backend.h"
#include "testutil.h"

/* ------------------------------------------------------------------------ */
/* On the host backend                                                       */
/* ------------------------------------------------------------------------ */

static void fill_bytes(void *p, size_t n, unsigned seed) {
  unsigned char *c = p;
  for (size_t i = 0; i < n; i++) c[i] = (unsigned char)(i * 31u + seed);
}

static size_t first_wrong(const void *p, size_t n, unsigned seed) {
  const unsigned char *c = p;
  for (size_t i = 0; i < n; i++)
    if (c[i] != (unsigned char)(i * 31u + seed)) return i;
  return SIZE_MAX;
}

static void memcpy_round_trip(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  const size_t n = 3 * TU_MiB + 123;
  char *d1 = tide_malloc(a, n, NULL), *d2 = tide_malloc(a, n, NULL);
  char *h1 = tide_pinned_malloc(a, n, NULL), *h2 = tide_pinned_malloc(a, n, NULL);
  char *plain = malloc(n);
  assert_non_null(d1);
  assert_non_null(d2);
  assert_non_null(h1);
  assert_non_null(h2);
  assert_non_null(plain);
  fill_bytes(h1, n, 7);
  tu_assert_ok(tide_memcpy(a, d1, h1, n, NULL));    /* pinned -> device */
  tu_assert_ok(tide_memcpy(a, d2, d1, n, NULL));    /* device -> device */
  tu_assert_ok(tide_memcpy(a, h2, d2, n, NULL));    /* device -> pinned */
  tu_assert_ok(tide_memcpy(a, plain, h2, n, NULL)); /* pinned -> pageable */
  assert_int_equal(first_wrong(plain, n, 7), SIZE_MAX);
  /* Part of a block, at an odd offset. */
  fill_bytes(plain, 1001, 9);
  tu_assert_ok(tide_memcpy(a, d1 + 17, plain, 1001, NULL));
  tu_assert_ok(tide_memcpy(a, h1, d1 + 17, 1001, NULL));
  assert_int_equal(first_wrong(h1, 1001, 9), SIZE_MAX);
  assert_int_equal(first_wrong(h1 + 1001, 16, (unsigned)(7 + 1001 * 31u)), SIZE_MAX);
  assert_int_equal(tide_host_call_count(a, TIDE_OP_COPY), 6);

  /* On a held stream the copy is done at once. */
  tide_stream s = NULL;
  tu_assert_ok(tide_stream_create(a, &s));
  tu_assert_ok(tide_host_stream_hold(a, s));
  fill_bytes(h1, 4096, 3);
  tu_assert_ok(tide_memcpy(a, d2, h1, 4096, s));
  tu_assert_ok(tide_memcpy(a, plain, d2, 4096, s));
  assert_int_equal(first_wrong(plain, 4096, 3), SIZE_MAX);
  tu_assert_ok(tide_host_stream_release(a, s));
  tu_assert_ok(tide_stream_destroy(a, s));

  free(plain);
  tu_assert_ok(tide_pinned_free(a, h1, NULL));
  tu_assert_ok(tide_pinned_free(a, h2, NULL));
  tu_assert_ok(tide_free(a, d1, NULL));
  tu_assert_ok(tide_free(a, d2, NULL));
  tu_assert_ok(tide_destroy(a));
}

static void memcpy_bad_arguments(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  char *d = tide_malloc(a, 8192, NULL);
  char buf[64] = {0};
  assert_non_null(d);
  uint64_t copies = tide_host_call_count(a, TIDE_OP_COPY);
  /* 0 bytes: nothing to do, whatever the pointers. */
  tu_assert_ok(tide_memcpy(a, NULL, NULL, 0, NULL));
  tu_assert_status(tide_memcpy(NULL, buf, d, 8, NULL), TIDE_ERR_INVALID);
  tu_assert_last_error(TIDE_ERR_INVALID, "not a live tidalloc allocator");
  tu_assert_status(tide_memcpy(a, NULL, d, 8, NULL), TIDE_ERR_INVALID);
  tu_assert_last_error(TIDE_ERR_INVALID, "destination is NULL");
  tu_assert_status(tide_memcpy(a, buf, NULL, 8, NULL), TIDE_ERR_INVALID);
  tu_assert_last_error(TIDE_ERR_INVALID, "source is NULL");
  tu_assert_status(tide_memcpy(a, d + 100, d, 200, NULL), TIDE_ERR_INVALID);
  tu_assert_last_error(TIDE_ERR_INVALID, "overlap");
  tu_assert_status(tide_memcpy(a, d, d + 100, 101, NULL), TIDE_ERR_INVALID);
  tu_assert_status(tide_memcpy(a, d, d, 1, NULL), TIDE_ERR_INVALID);
  tu_assert_status(tide_memcpy(a, (void *)(UINTPTR_MAX - 10), d, 100, NULL), TIDE_ERR_INVALID);
  tu_assert_last_error(TIDE_ERR_INVALID, "run past the end of the address space");
  tu_assert_status(tide_memcpy(a, buf, d, SIZE_MAX, NULL), TIDE_ERR_INVALID);
  assert_int_equal(tide_host_call_count(a, TIDE_OP_COPY), copies); /* refused before */
  /* Adjacent ranges do not overlap. */
  tu_assert_ok(tide_memcpy(a, d + 100, d, 100, NULL));

  tide_stream bogus = (tide_stream)(uintptr_t)0x4242;
  tu_assert_status(tide_memcpy(a, buf, d, 8, bogus), TIDE_ERR_INVALID);
  tu_assert_last_error(TIDE_ERR_INVALID, "unknown or destroyed stream");
  tu_assert_last_error(TIDE_ERR_INVALID, "tide_memcpy(");

  tu_assert_ok(tide_host_fail_call(a, TIDE_OP_COPY, 1));
  tu_assert_status(tide_memcpy(a, buf, d, 8, NULL), TIDE_ERR_BACKEND);
  tu_assert_last_error(TIDE_ERR_BACKEND, "injected failure: copy");
  tu_assert_ok(tide_memcpy(a, buf, d, 8, NULL));
  tu_assert_ok(tide_free(a, d, NULL));
  tu_assert_ok(tide_destroy(a));
}

/* What a GPU would fault on is refused instead. */
static void memcpy_refuses_unmapped_and_overruns(void **state) {
  (void)state;
  tide_allocator *a = tu_create(NULL);
  tide_info info;
  tu_assert_ok(tide_get_info(a, &info));
  /* A block of one whole page: the page after it is reserved, not mapped. */
  char *d = tide_malloc(a, info.page_size, NULL);
  assert_non_null(d);
  char *buf = malloc(8192);
  assert_non_null(buf);
  tu_assert_ok(tide_memcpy(a, buf, d + info.page_size - 4096, 4096, NULL));
  tu_assert_status(tide_memcpy(a, buf, d + info.page_size - 4096, 8192, NULL), TIDE_ERR_BACKEND);
  tu_assert_last_error(TIDE_ERR_BACKEND, "not mapped");
  tu_assert_status(tide_memcpy(a, d + info.page_size, buf, 16, NULL), TIDE_ERR_BACKEND);
  tu_assert_last_error(TIDE_ERR_BACKEND, "destination");

  char *h = tide_pinned_malloc(a, 4096, NULL);
  assert_non_null(h);
  tu_assert_ok(tide_memcpy(a, buf, h, 4096, NULL));
  tu_assert_status(tide_memcpy(a, buf, h + 1, 4096, NULL), TIDE_ERR_BACKEND);
  tu_assert_last_error(TIDE_ERR_BACKEND, "past the end of its pinned allocation");
  free(buf);
  tu_assert_ok(tide_pinned_free(a, h, NULL));
  tu_assert_ok(tide_free(a, d, NULL));
  tu_assert_ok(tide_destroy(a));
}

/* ------------------------------------------------------------------------ */
/* A fake CUDA driver                                                        */
/* ------------------------------------------------------------------------ */

/* The backend's test seam (backend_cuda.c). */
typedef void (*_tide_cuda_fn)(void);
void _tide_cuda_set_driver_lookup(_tide_cuda_fn (*lookup)(const char *name));

/* The driver's ABI, written out so that the test needs no cuda.h. */
typedef int fres;
enum {
  F_SUCCESS = 0,
  F_INVALID_VALUE = 1,
  F_OUT_OF_MEMORY = 2,
  F_INVALID_DEVICE = 101,
  F_VMM_ATTRIBUTE = 102,
  F_LOCATION_DEVICE = 1,
  F_READ_WRITE = 3,
  F_HOSTALLOC_PORTABLE = 1,
  F_HOSTALLOC_DEVICEMAP = 2,
};
typedef struct f_access {
  struct {
    int type;
    int id;
  } location;
  int flags;
} f_access;

#define MAX_DEVICES 4
#define DEVICE_BASE ((uint64_t)0x600000000000)
#define GRAN ((size_t)2 << 20)

typedef struct fake_config {
  int devices;
  bool can[MAX_DEVICES][MAX_DEVICES]; /* [peer][device]: peer can access device */
  bool vmm[MAX_DEVICES];
  const char *missing;               /* an entry point cuGetProcAddress does not find */
  fres set_access_result_with_peers; /* what cuMemSetAccess answers to several descriptors */
  fres copy_result;
  fres host_alloc_result;
} fake_config;

static struct {
  fake_config cfg;
  int ctx_depth;
  void *ctx_stack[8];
  uint64_t next_va;
  uint64_t next_handle;
  int handles, maps, reservations; /* outstanding */
  /* The last cuMemSetAccess. */
  int set_access_calls;
  size_t naccess;
  f_access access[MAX_DEVICES + 1];
  /* The last cuMemcpyAsync. */
  int copies;
  uint64_t copy_dst, copy_src;
  size_t copy_bytes;
  void *copy_stream;
  /* cuMemHostAlloc. */
  int host_allocs, host_live;
  size_t host_size;
  unsigned host_flags;
  int streams, events;
} fake;

static int primary_ctx;

static fres f_init(unsigned flags) { return flags == 0 ? F_SUCCESS : F_INVALID_VALUE; }
static fres f_driver_get_version(int *v) {
  *v = 12080;
  return F_SUCCESS;
}
static fres f_get_error_name(fres r, const char **s) {
  *s = r == F_INVALID_VALUE    ? "CUDA_ERROR_INVALID_VALUE"
       : r == F_OUT_OF_MEMORY  ? "CUDA_ERROR_OUT_OF_MEMORY"
       : r == F_INVALID_DEVICE ? "CUDA_ERROR_INVALID_DEVICE"
                               : "CUDA_ERROR_UNKNOWN";
  return F_SUCCESS;
}
static fres f_get_error_string(fres r, const char **s) {
  *s = r == F_OUT_OF_MEMORY ? "out of memory" : "invalid argument";
  return F_SUCCESS;
}

static bool device_ok(int dev) { return dev >= 0 && dev < fake.cfg.devices; }

static fres f_device_get(int *dev, int ordinal) {
  if (!device_ok(ordinal)) return F_INVALID_DEVICE;
  *dev = ordinal;
  return F_SUCCESS;
}
static fres f_device_get_count(int *n) {
  *n = fake.cfg.devices;
  return F_SUCCESS;
}
static fres f_device_get_name(char *buf, int len, int dev) {
  snprintf(buf, (size_t)len, "Fake GPU %d", dev);
  return F_SUCCESS;
}
static fres f_device_get_attribute(int *value, int attribute, int dev) {
  if (!device_ok(dev)) return F_INVALID_DEVICE;
  *value = attribute == F_VMM_ATTRIBUTE ? fake.cfg.vmm[dev] : 0;
  return F_SUCCESS;
}
static fres f_device_can_access_peer(int *can, int dev, int peer) {
  if (!device_ok(dev) || !device_ok(peer)) return F_INVALID_DEVICE;
  *can = dev != peer && fake.cfg.can[dev][peer];
  return F_SUCCESS;
}
static fres f_primary_ctx_retain(void **ctx, int dev) {
  if (!device_ok(dev)) return F_INVALID_DEVICE;
  *ctx = &primary_ctx;
  return F_SUCCESS;
}
static fres f_primary_ctx_release(int dev) { return device_ok(dev) ? F_SUCCESS : F_INVALID_DEVICE; }
static fres f_ctx_get_current(void **ctx) {
  *ctx = fake.ctx_depth ? fake.ctx_stack[fake.ctx_depth - 1] : NULL;
  return F_SUCCESS;
}
static fres f_ctx_push_current(void *ctx) {
  if (fake.ctx_depth == 8) return F_INVALID_VALUE;
  fake.ctx_stack[fake.ctx_depth++] = ctx;
  return F_SUCCESS;
}
static fres f_ctx_pop_current(void **ctx) {
  if (fake.ctx_depth == 0) return F_INVALID_VALUE;
  *ctx = fake.ctx_stack[--fake.ctx_depth];
  return F_SUCCESS;
}
static fres f_exchange_capture_mode(int *mode) {
  (void)mode;
  return F_SUCCESS;
}
static fres f_mem_get_info(size_t *free_bytes, size_t *total) {
  *free_bytes = *total = (size_t)8 << 30;
  return F_SUCCESS;
}
static fres f_mem_get_granularity(size_t *g, const void *prop, int option) {
  (void)prop;
  (void)option;
  *g = GRAN;
  return F_SUCCESS;
}
static fres f_mem_address_reserve(uint64_t *ptr, size_t size, size_t align, uint64_t addr,
                                  unsigned long long flags) {
  (void)addr;
  (void)flags;
  if (align < GRAN) align = GRAN;
  fake.next_va = (fake.next_va + align - 1) / align * align;
  *ptr = fake.next_va;
  fake.next_va += size;
  fake.reservations++;
  return F_SUCCESS;
}
static fres f_mem_address_free(uint64_t ptr, size_t size) {
  (void)ptr;
  (void)size;
  fake.reservations--;
  return F_SUCCESS;
}
static fres f_mem_create(uint64_t *h, size_t size, const void *prop, unsigned long long flags) {
  (void)size;
  (void)prop;
  (void)flags;
  *h = ++fake.next_handle;
  fake.handles++;
  return F_SUCCESS;
}
static fres f_mem_release(uint64_t h) {
  (void)h;
  fake.handles--;
  return F_SUCCESS;
}
static fres f_mem_map(uint64_t ptr, size_t size, size_t offset, uint64_t h,
                      unsigned long long flags) {
  (void)ptr;
  (void)size;
  (void)offset;
  (void)h;
  (void)flags;
  fake.maps++;
  return F_SUCCESS;
}
static fres f_mem_unmap(uint64_t ptr, size_t size) {
  (void)ptr;
  (void)size;
  fake.maps--;
  return F_SUCCESS;
}
static fres f_mem_set_access(uint64_t ptr, size_t size, const f_access *desc, size_t count) {
  (void)ptr;
  (void)size;
  fake.set_access_calls++;
  fake.naccess = count;
  for (size_t i = 0; i < count && i <= MAX_DEVICES; i++) fake.access[i] = desc[i];
  return count > 1 ? fake.cfg.set_access_result_with_peers : F_SUCCESS;
}
static fres f_memcpy_async(uint64_t dst, uint64_t src, size_t bytes, void *stream) {
  fake.copies++;
  fake.copy_dst = dst;
  fake.copy_src = src;
  fake.copy_bytes = bytes;
  fake.copy_stream = stream;
  if (fake.cfg.copy_result) return fake.cfg.copy_result;
  /* Host memory on both sides: copy for real, so the bytes can be checked. */
  bool device =
      (dst >= DEVICE_BASE && dst < fake.next_va) || (src >= DEVICE_BASE && src < fake.next_va);
  if (!device) memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, bytes);
  return F_SUCCESS;
}
static fres f_mem_host_alloc(void **p, size_t size, unsigned flags) {
  fake.host_allocs++;
  fake.host_size = size;
  fake.host_flags = flags;
  if (fake.cfg.host_alloc_result) return fake.cfg.host_alloc_result;
  *p = aligned_alloc(4096, (size + 4095) / 4096 * 4096);
  if (!*p) return F_OUT_OF_MEMORY;
  fake.host_live++;
  return F_SUCCESS;
}
static fres f_mem_free_host(void *p) {
  free(p);
  fake.host_live--;
  return F_SUCCESS;
}
static fres f_stream_create(void **s, unsigned flags) {
  (void)flags;
  *s = (void *)(uintptr_t)(0x5000 + 16 * ++fake.streams);
  return F_SUCCESS;
}
static fres f_stream_destroy(void *s) {
  (void)s;
  return F_SUCCESS;
}
static fres f_stream_synchronize(void *s) {
  (void)s;
  return F_SUCCESS;
}
static fres f_stream_is_capturing(void *s, int *status) {
  (void)s;
  *status = 0;
  return F_SUCCESS;
}
static fres f_stream_get_ctx(void *s, void **ctx) {
  (void)s;
  *ctx = &primary_ctx;
  return F_SUCCESS;
}
static fres f_event_create(void **e, unsigned flags) {
  (void)flags;
  *e = (void *)(uintptr_t)(0x9000 + 16 * ++fake.events);
  return F_SUCCESS;
}
static fres f_event_any(void *e) {
  (void)e;
  return F_SUCCESS;
}
static fres f_event_record(void *e, void *s) {
  (void)e;
  (void)s;
  return F_SUCCESS;
}

#define FN(name, fn)                                                                               \
  { name, (_tide_cuda_fn)fn }
static const struct {
  const char *name;
  _tide_cuda_fn fn;
} fake_procs[] = {
    FN("cuDeviceGet", f_device_get),
    FN("cuDeviceGetCount", f_device_get_count),
    FN("cuDeviceGetName", f_device_get_name),
    FN("cuDeviceGetAttribute", f_device_get_attribute),
    FN("cuDeviceCanAccessPeer", f_device_can_access_peer),
    FN("cuDevicePrimaryCtxRetain", f_primary_ctx_retain),
    FN("cuDevicePrimaryCtxRelease", f_primary_ctx_release),
    FN("cuCtxGetCurrent", f_ctx_get_current),
    FN("cuCtxPushCurrent", f_ctx_push_current),
    FN("cuCtxPopCurrent", f_ctx_pop_current),
    FN("cuThreadExchangeStreamCaptureMode", f_exchange_capture_mode),
    FN("cuMemGetInfo", f_mem_get_info),
    FN("cuMemGetAllocationGranularity", f_mem_get_granularity),
    FN("cuMemAddressReserve", f_mem_address_reserve),
    FN("cuMemAddressFree", f_mem_address_free),
    FN("cuMemCreate", f_mem_create),
    FN("cuMemRelease", f_mem_release),
    FN("cuMemMap", f_mem_map),
    FN("cuMemSetAccess", f_mem_set_access),
    FN("cuMemUnmap", f_mem_unmap),
    FN("cuMemcpyAsync", f_memcpy_async),
    FN("cuMemHostAlloc", f_mem_host_alloc),
    FN("cuMemFreeHost", f_mem_free_host),
    FN("cuStreamCreate", f_stream_create),
    FN("cuStreamDestroy", f_stream_destroy),
    FN("cuStreamSynchronize", f_stream_synchronize),
    FN("cuStreamIsCapturing", f_stream_is_capturing),
    FN("cuStreamGetCtx", f_stream_get_ctx),
    FN("cuEventCreate", f_event_create),
    FN("cuEventDestroy", f_event_any),
    FN("cuEventRecord", f_event_record),
    FN("cuEventQuery", f_event_any),
    FN("cuEventSynchronize", f_event_any),
};
#undef FN

static fres f_get_proc(const char *symbol, void **pfn, int version, uint64_t flags, int *status) {
  (void)version;
  (void)flags;
  *pfn = NULL;
  *status = 1; /* not found */
  if (fake.cfg.missing && strcmp(symbol, fake.cfg.missing) == 0) return F_SUCCESS;
  for (size_t i = 0; i < sizeof fake_procs / sizeof *fake_procs; i++) {
    if (strcmp(fake_procs[i].name, symbol) == 0) {
      memcpy(pfn, &fake_procs[i].fn, sizeof *pfn);
      *status = 0;
    }
  }
  return F_SUCCESS;
}

static _tide_cuda_fn fake_lookup(const char *name) {
  if (strcmp(name, "cuInit") == 0) return (_tide_cuda_fn)f_init;
  if (strcmp(name, "cuDriverGetVersion") == 0) return (_tide_cuda_fn)f_driver_get_version;
  if (strcmp(name, "cuGetErrorName") == 0) return (_tide_cuda_fn)f_get_error_name;
  if (strcmp(name, "cuGetErrorString") == 0) return (_tide_cuda_fn)f_get_error_string;
  if (strcmp(name, "cuGetProcAddress_v2") == 0) return (_tide_cuda_fn)f_get_proc;
  return NULL;
}

/* Four devices with virtual memory management and no peer access, unless
 * `setup` says otherwise; the driver is loaded anew. */
static void fake_reset(void (*setup)(fake_config *)) {
  memset(&fake, 0, sizeof fake);
  fake.cfg.devices = MAX_DEVICES;
  for (int i = 0; i < MAX_DEVICES; i++) fake.cfg.vmm[i] = true;
  fake.next_va = DEVICE_BASE;
  if (setup) setup(&fake.cfg);
  _tide_cuda_set_driver_lookup(fake_lookup);
}

static int fake_teardown(void **state) {
  (void)state;
  _tide_cuda_set_driver_lookup(NULL);
  return 0;
}

/* An allocator of `device` on the fake driver; NULL (and the test skipped)
 * when the library was built without cuda.h. */
static tide_allocator *fake_allocator(int device, const char *conf) {
  char text[128];
  snprintf(text, sizeof text, "backend:cuda%s%s", conf ? "," : "", conf ? conf : "");
  tide_config *config = NULL;
  tu_assert_ok(tide_config_new(&config));
  tu_assert_ok(tide_config_parse(config, text));
  tide_allocator *a = NULL;
  tide_status rc = tide_create(device, config, &a);
  tide_config_free(config);
  if (rc != TIDE_OK && strstr(tide_last_error(), "built without CUDA headers")) {
    print_message("skipped: %s\n", tide_last_error());
    skip();
  }
  if (rc != TIDE_OK)
    fail_msg("tide_create(%d, \"%s\") on the fake driver: %s: %s", device, text,
             tide_status_name(rc), tide_last_error());
  return a;
}

static void fake_destroy(tide_allocator *a) {
  tu_assert_ok(tide_destroy(a));
  assert_int_equal(fake.handles, 0);
  assert_int_equal(fake.maps, 0);
  assert_int_equal(fake.reservations, 0);
  assert_int_equal(fake.host_live, 0);
}

/* The devices the last cuMemSetAccess made memory read-write for, in order. */
static void assert_access(const int *ids, size_t n) {
  assert_true(fake.set_access_calls > 0);
  if (fake.naccess != n)
    fail_msg("cuMemSetAccess got %zu descriptor(s), expected %zu", fake.naccess, n);
  for (size_t i = 0; i < n; i++) {
    assert_int_equal(fake.access[i].location.type, F_LOCATION_DEVICE);
    assert_int_equal(fake.access[i].location.id, ids[i]);
    assert_int_equal(fake.access[i].flags, F_READ_WRITE);
  }
}

/* ------------------------------------------------------------------------ */

/* Device 1 reaches device 0; device 2 reaches device 1 and 0 but lacks
 * virtual memory management; device 3 reaches nobody. Device 1 is reached
 * by 0 and 3. */
static void peers_setup(fake_config *c) {
  c->can[1][0] = true;
  c->can[2][0] = true;
  c->can[2][1] = true;
  c->vmm[2] = false;
  c->can[0][1] = true;
  c->can[3][1] = true;
}

static void set_access_grants_peers(void **state) {
  (void)state;
  static const char *const modes[] = {NULL, "expandable_segments:False"};
  for (size_t m = 0; m < 2; m++) {
    fake_reset(peers_setup);
    tide_allocator *a = fake_allocator(0, modes[m]);
    void *small = tide_malloc(a, 4096, NULL);
    assert_non_null(small);
    assert_access((const int[]){0, 1}, 2);
    fake.set_access_calls = 0;
    void *large = tide_malloc(a, 50 * TU_MiB, NULL);
    assert_non_null(large);
    assert_access((const int[]){0, 1}, 2);
    tu_assert_ok(tide_free(a, small, NULL));
    tu_assert_ok(tide_free(a, large, NULL));
    fake_destroy(a);

    tide_allocator *b = fake_allocator(1, modes[m]);
    void *p = tide_malloc(b, 4096, NULL);
    assert_non_null(p);
    assert_access((const int[]){1, 0, 3}, 3);
    tu_assert_ok(tide_free(b, p, NULL));
    fake_destroy(b);
  }
}

static void set_access_without_peers(void **state) {
  (void)state;
  fake_reset(peers_setup);
  tide_allocator *a = fake_allocator(0, "peer_access:False");
  void *p = tide_malloc(a, 4096, NULL);
  assert_non_null(p);
  assert_access((const int[]){0}, 1);
  tu_assert_ok(tide_free(a, p, NULL));
  fake_destroy(a);
}

static void missing_peer_query(fake_config *c) {
  peers_setup(c);
  c->missing = "cuDeviceCanAccessPeer";
}

static void set_access_without_peer_query(void **state) {
  (void)state;
  fake_reset(missing_peer_query);
  tide_allocator *a = fake_allocator(0, NULL);
  void *p = tide_malloc(a, 4096, NULL);
  assert_non_null(p);
  assert_access((const int[]){0}, 1);
  tu_assert_ok(tide_free(a, p, NULL));
  fake_destroy(a);
}

static void peers_refused(fake_config *c) {
  peers_setup(c);
  c->set_access_result_with_peers = F_INVALID_DEVICE;
}

static void set_access_failure_names_peers(void **state) {
  (void)state;
  fake_reset(peers_refused);
  tide_allocator *a = fake_allocator(1, NULL);
  assert_null(tide_malloc(a, 4096, NULL));
  tu_assert_last_error(TIDE_ERR_BACKEND, "cuMemSetAccess failed with CUDA_ERROR_INVALID_DEVICE");
  tu_assert_last_error(TIDE_ERR_BACKEND, "by device 1 and its peers 0, 3");
  tu_assert_last_error(TIDE_ERR_BACKEND, "peer_access:False");
  fake_destroy(a);
}

static void copy_through_driver(void **state) {
  (void)state;
  fake_reset(NULL);
  tide_allocator *a = fake_allocator(0, NULL);
  tide_stream s = NULL;
  tu_assert_ok(tide_stream_create(a, &s));
  char *d = tide_malloc(a, 10000, s);
  char *h = tide_pinned_malloc(a, 10000, s);
  assert_non_null(d);
  assert_non_null(h);
  tu_assert_ok(tide_memcpy(a, d + 8, h, 9000, s));
  assert_int_equal(fake.copies, 1);
  assert_int_equal(fake.copy_dst, (uint64_t)(uintptr_t)(d + 8));
  assert_int_equal(fake.copy_src, (uint64_t)(uintptr_t)h);
  assert_int_equal(fake.copy_bytes, 9000);
  assert_ptr_equal(fake.copy_stream, s);

  /* Between pinned blocks the fake really copies. */
  char *h2 = tide_pinned_malloc(a, 10000, NULL);
  assert_non_null(h2);
  fill_bytes(h, 10000, 5);
  tu_assert_ok(tide_memcpy(a, h2, h, 10000, NULL));
  assert_ptr_equal(fake.copy_stream, NULL);
  assert_int_equal(first_wrong(h2, 10000, 5), SIZE_MAX);

  fake.cfg.copy_result = F_INVALID_VALUE;
  tu_assert_status(tide_memcpy(a, d, h, 16, s), TIDE_ERR_BACKEND);
  tu_assert_last_error(TIDE_ERR_BACKEND, "cuMemcpyAsync failed with CUDA_ERROR_INVALID_VALUE");
  tu_assert_last_error(TIDE_ERR_BACKEND, "tide_memcpy(");
  fake.cfg.copy_result = F_SUCCESS;
  /* Overlap is refused before the driver sees it. */
  int copies = fake.copies;
  tu_assert_status(tide_memcpy(a, d, d + 8, 16, s), TIDE_ERR_INVALID);
  assert_int_equal(fake.copies, copies);

  tu_assert_ok(tide_pinned_free(a, h, s));
  tu_assert_ok(tide_pinned_free(a, h2, NULL));
  tu_assert_ok(tide_free(a, d, s));
  tu_assert_ok(tide_stream_destroy(a, s));
  fake_destroy(a);
}

static void missing_copy(fake_config *c) { c->missing = "cuMemcpyAsync"; }

static void copy_without_entry_point(void **state) {
  (void)state;
  fake_reset(missing_copy);
  tide_allocator *a = fake_allocator(0, NULL);
  char *d = tide_malloc(a, 4096, NULL); /* device memory needs no copies */
  assert_non_null(d);
  tu_assert_status(tide_memcpy(a, d, d + 1024, 16, NULL), TIDE_ERR_UNAVAILABLE);
  tu_assert_last_error(TIDE_ERR_UNAVAILABLE, "cuMemcpyAsync");
  tu_assert_last_error(TIDE_ERR_UNAVAILABLE, "does not provide");
  tu_assert_ok(tide_free(a, d, NULL));
  fake_destroy(a);
}

static void pinned_through_driver(void **state) {
  (void)state;
  fake_reset(NULL);
  tide_allocator *a = fake_allocator(0, NULL);
  char *p = tide_pinned_malloc(a, 1000, NULL);
  assert_non_null(p);
  assert_int_equal(fake.host_allocs, 1);
  assert_int_equal(fake.host_size, 4096);
  assert_int_equal(fake.host_flags, F_HOSTALLOC_PORTABLE | F_HOSTALLOC_DEVICEMAP);
  memset(p, 1, 4096);
  tu_assert_ok(tide_pinned_free(a, p, NULL));
  assert_ptr_equal(tide_pinned_malloc(a, 4000, NULL), p);
  assert_int_equal(fake.host_allocs, 1);
  tu_assert_ok(tide_pinned_free(a, p, NULL));
  tu_assert_ok(tide_pinned_empty_cache(a));
  assert_int_equal(fake.host_live, 0);

  /* The driver's out of memory: the cache goes back, one more try, NULL. */
  void *q = tide_pinned_malloc(a, 100, NULL);
  tu_assert_ok(tide_pinned_free(a, q, NULL));
  fake.cfg.host_alloc_result = F_OUT_OF_MEMORY;
  int before = fake.host_allocs;
  assert_null(tide_pinned_malloc(a, 3 * TU_MiB, NULL));
  tu_assert_last_error(TIDE_ERR_OOM, "out of pinned host memory");
  tu_assert_last_error(TIDE_ERR_OOM, "cuMemHostAlloc failed with CUDA_ERROR_OUT_OF_MEMORY");
  assert_int_equal(fake.host_allocs - before, 2);
  assert_int_equal(fake.host_live, 0);
  tide_stats st;
  tu_assert_ok(tide_pinned_get_stats(a, &st));
  assert_int_equal(st.num_ooms, 1);
  assert_int_equal(st.reserved_bytes[TIDE_POOL_ALL].current, 0);
  fake.cfg.host_alloc_result = F_SUCCESS;
  fake_destroy(a);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(memcpy_round_trip),
      cmocka_unit_test(memcpy_bad_arguments),
      cmocka_unit_test(memcpy_refuses_unmapped_and_overruns),
      cmocka_unit_test_teardown(set_access_grants_peers, fake_teardown),
      cmocka_unit_test_teardown(set_access_without_peers, fake_teardown),
      cmocka_unit_test_teardown(set_access_without_peer_query, fake_teardown),
      cmocka_unit_test_teardown(set_access_failure_names_peers, fake_teardown),
      cmocka_unit_test_teardown(copy_through_driver, fake_teardown),
      cmocka_unit_test_teardown(copy_without_entry_point, fake_teardown),
      cmocka_unit_test_teardown(pinned_through_driver, fake_teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
