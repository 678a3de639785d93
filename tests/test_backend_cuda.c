/* test_backend_cuda.c: the CUDA backend, on any machine.
 *
 * - The real driver: the process does not load libcuda before the backend
 *   asks for it. Without a usable GPU, backend:cuda fails with
 *   TIDE_ERR_UNAVAILABLE and says why, and backend:auto falls back to the host
 *   backend; with one, backend:cuda allocates, frees and empties its cache.
 * - A fake driver, written below in host code and handed to the backend in
 *   place of libcuda.so.1: every reason the driver cannot be used and its
 *   message; what the backend asks of the driver (ABI version, legacy-stream
 *   entry points, pinned device memory, whole-handle mappings, read-write
 *   access, non-blocking streams, events without timing); that it leaves the
 *   calling thread's context and capture mode as it found them and maps
 *   memory in relaxed capture mode; that it never waits for a capturing
 *   stream; how it asks whether a stream is being captured; capture pools
 *   on the driver (pages mapped during a capture, forked streams, deferred
 *   frees, no event recorded in a capture); out of memory; and the
 *   allocator on top of it, from several threads. The fake checks the preconditions the driver
 * checks and keeps its own books, so a leak or a bad argument shows. */
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "backend/backend.h"
#include "base/internal.h"

#define MiB ((size_t)1 << 20)
#define GiB ((size_t)1 << 30)

/* The backend's test seam (backend_cuda.c). */
typedef void (*_tide_cuda_fn)(void);
void _tide_cuda_set_driver_lookup(_tide_cuda_fn (*lookup)(const char *name));

static bool contains(const char *text, const char *needle) {
  return text && strstr(text, needle) != NULL;
}

static bool contains_word(const char *text, const char *word) {
  return text && strcasestr(text, word) != NULL;
}

#define assert_message_has(needle)                                                                 \
  do {                                                                                             \
    if (!contains(tide_last_error(), (needle)))                                                    \
      fail_msg("message lacks \"%s\": \"%s\"", (needle), tide_last_error());                       \
  } while (0)

static tide_config *config_of(const char *text) {
  tide_config *c = NULL;
  assert_int_equal(tide_config_new(&c), TIDE_OK);
  if (tide_config_parse(c, text) != TIDE_OK)
    fail_msg("config \"%s\" refused: %s", text, tide_last_error());
  return c;
}

/* tide_create with `text`; returns the status, *out the allocator or NULL. */
static tide_status create_with(const char *text, tide_allocator **out) {
  tide_config *c = config_of(text);
  *out = NULL;
  tide_status rc = tide_create(0, c, out);
  tide_config_free(c);
  return rc;
}

static tide_allocator *create_ok(const char *text) {
  tide_allocator *a = NULL;
  tide_status rc = create_with(text, &a);
  if (rc != TIDE_OK)
    fail_msg("tide_create(\"%s\"): %s: %s", text, tide_status_name(rc), tide_last_error());
  return a;
}

static tide_stats stats_of(tide_allocator *a) {
  tide_stats st;
  assert_int_equal(tide_get_stats(a, &st), TIDE_OK);
  return st;
}

/* ======================================================================== */
/* The real driver                                                           */
/* ======================================================================== */

static int find_libcuda(struct dl_phdr_info *info, size_t size, void *found) {
  (void)size;
  if (contains(info->dlpi_name, "libcuda.so")) *(bool *)found = true;
  return 0;
}

/* Nothing links libcuda: it is not in the process until the backend loads
 * it. (Runs first, before any test touches the backend.) */
static void test_libcuda_not_linked(void **state) {
  (void)state;
  bool found = false;
  dl_iterate_phdr(find_libcuda, &found);
  assert_false(found);
}

static const char *const unavailable_reasons[] = {
    "libcuda.so.1", "driver", "cuInit", "device", "virtual memory", "built without CUDA",
};

static void test_real_backend_cuda(void **state) {
  (void)state;
  if (!_tide_cuda_usable()) {
    /* No GPU here: asking for one says so, with the reason. */
    assert_int_equal(tide_last_status(), TIDE_ERR_UNAVAILABLE);
    tide_allocator *a = NULL;
    assert_int_equal(create_with("backend:cuda", &a), TIDE_ERR_UNAVAILABLE);
    assert_null(a);
    assert_int_equal(tide_last_status(), TIDE_ERR_UNAVAILABLE);
    assert_message_has("CUDA");
    bool named = false;
    for (size_t i = 0; i < sizeof unavailable_reasons / sizeof *unavailable_reasons; i++)
      named |= contains(tide_last_error(), unavailable_reasons[i]);
    if (!named) fail_msg("the message names no reason: \"%s\"", tide_last_error());
    print_message("no usable GPU: %s\n", tide_last_error());
    return;
  }
  /* A GPU: the backend works. */
  tide_allocator *a = create_ok("backend:cuda");
  tide_info info;
  assert_int_equal(tide_get_info(a, &info), TIDE_OK);
  assert_string_equal(info.backend, "cuda");
  assert_true(info.device_count >= 1);
  assert_true(info.total_memory > 0 && info.free_memory <= info.total_memory);
  assert_true(info.granularity > 0 && (info.granularity & (info.granularity - 1)) == 0);
  print_message("GPU: %s, %llu MiB, granularity %llu KiB\n", info.device_name,
                (unsigned long long)(info.total_memory >> 20),
                (unsigned long long)(info.granularity >> 10));
  static const size_t sizes[] = {512, 4096, 1 * MiB, 3 * MiB + 512, 64 * MiB};
  void *p[5];
  for (int i = 0; i < 5; i++) {
    p[i] = tide_malloc(a, sizes[i], NULL);
    if (!p[i]) fail_msg("tide_malloc(%zu): %s", sizes[i], tide_last_error());
    assert_int_equal((uintptr_t)p[i] % 512, 0);
  }
  for (int i = 0; i < 5; i++) assert_int_equal(tide_free(a, p[i], NULL), TIDE_OK);
  assert_true(stats_of(a).reserved_bytes[0].current > 0);
  assert_int_equal(tide_empty_cache(a), TIDE_OK);
  assert_int_equal(stats_of(a).reserved_bytes[0].current, 0);
  tide_stream s;
  assert_int_equal(tide_stream_create(a, &s), TIDE_OK);
  void *q = tide_malloc(a, 2 * MiB, s);
  assert_non_null(q);
  assert_int_equal(tide_free(a, q, s), TIDE_OK);
  assert_int_equal(tide_stream_synchronize(a, s), TIDE_OK);
  assert_int_equal(tide_empty_cache(a), TIDE_OK);
  assert_int_equal(tide_stream_destroy(a, s), TIDE_OK);
  assert_int_equal(tide_destroy(a), TIDE_OK);
}

static void test_real_backend_auto(void **state) {
  (void)state;
  bool gpu = _tide_cuda_usable();
  tide_allocator *a = create_ok("backend:auto");
  tide_info info;
  assert_int_equal(tide_get_info(a, &info), TIDE_OK);
  assert_string_equal(info.backend, gpu ? "cuda" : "host");
  void *p = tide_malloc(a, MiB, NULL);
  assert_non_null(p);
  assert_int_equal(tide_free(a, p, NULL), TIDE_OK);
  assert_int_equal(tide_destroy(a), TIDE_OK);
  /* backend:host never touches the GPU. */
  a = create_ok("backend:host");
  assert_int_equal(tide_get_info(a, &info), TIDE_OK);
  assert_string_equal(info.backend, "host");
  assert_int_equal(tide_destroy(a), TIDE_OK);
}

/* ======================================================================== */
/* A fake driver                                                             */
/* ======================================================================== */

/* The driver's ABI, written out again from the documentation rather than
 * taken from cuda.h, so that this test builds anywhere and a mistake in
 * the backend's use of cuda.h does not cancel out. */
typedef int fres;
enum {
  F_SUCCESS = 0,
  F_INVALID_VALUE = 1,
  F_OUT_OF_MEMORY = 2,
  F_NO_DEVICE = 100,
  F_INVALID_DEVICE = 101,
  F_INVALID_CONTEXT = 201,
  F_INVALID_HANDLE = 400,
  F_NOT_READY = 600,
  F_CAPTURE_UNSUPPORTED = 900,
  F_CAPTURE_IMPLICIT = 906,
  F_CAPTURED_EVENT = 907,
  F_NOT_SUPPORTED = 801,
};
enum { F_LEGACY_STREAM_FLAG = 1, F_NON_BLOCKING = 1, F_DISABLE_TIMING = 2 };
enum { F_MODE_GLOBAL = 0, F_MODE_THREAD_LOCAL = 1, F_MODE_RELAXED = 2 };
enum { F_VMM_ATTRIBUTE = 102, F_PINNED = 1, F_LOCATION_DEVICE = 1, F_READ_WRITE = 3 };
enum { F_FD_ATTRIBUTE = 103, F_HANDLE_FD = 1 };

typedef struct f_location {
  int type;
  int id;
} f_location;
typedef struct f_prop { /* CUmemAllocationProp */
  int type;
  int requested_handle_types;
  f_location location;
  void *win32_metadata;
  unsigned char compression, rdma;
  unsigned short usage;
  unsigned char reserved[4];
} f_prop;
typedef struct f_access { /* CUmemAccessDesc */
  f_location location;
  int flags;
} f_access;
_Static_assert(sizeof(f_prop) == 32, "CUmemAllocationProp is 32 bytes");
_Static_assert(sizeof(f_access) == 12, "CUmemAccessDesc is 12 bytes");

typedef struct f_stream {
  unsigned flags;
  void *ctx; /* the context it belongs to */
  bool capturing;
  uint64_t capture_id; /* while capturing */
  bool held;
  bool destroyed; /* a handle the driver no longer knows */
  uint64_t submitted, completed;
} f_stream;

typedef struct f_event {
  unsigned flags;
  f_stream *stream;
  uint64_t ticket;
  bool captured;
} f_event;

/* What the fake driver is and does; tests set it before loading. */
typedef struct fake_config {
  int version;
  bool has_v2, has_v1;
  fres init_result;
  int devices;
  int vmm;
  const char *missing; /* a symbol cuGetProcAddress does not know */
  size_t capacity;     /* device memory */
  size_t taken;        /* of it, held by someone else */
  size_t granularity;
  int fd_sharing;          /* CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED */
  bool refuse_sharable;    /* cuMemCreate refuses exportable memory (a container, say) */
  bool refuse_unmap_spans; /* cuMemUnmap takes one mapping a call */
} fake_config;

#define FAKE_RANGES 4096

typedef struct f_range {
  uint64_t addr, size, handle;
  bool access;
} f_range;

typedef struct f_handle {
  uint64_t size;
  bool live, released;
  bool shareable; /* created with the file-descriptor handle type */
  int maps;
} f_handle;

static struct fake {
  pthread_mutex_t lock;
  fake_config cfg;
  size_t used;
  uint64_t next_va;
  f_range reserved[FAKE_RANGES];
  int nreserved;
  f_range maps[FAKE_RANGES];
  int nmaps;
  f_handle handles[FAKE_RANGES];
  int nhandles;
  int retained;
  int asked_abi;
  uint64_t asked_flags;
  bool legacy_implicit; /* a blocking stream captures: the legacy stream must not be used */
  int capture_queries;  /* cuStreamGetCaptureInfo calls */
  int captured_events;  /* events recorded on a capturing stream */
  /* What the backend must never do. */
  int no_context;        /* a call without the primary context current */
  int not_relaxed;       /* memory calls outside relaxed capture mode */
  int broken_captures;   /* waits that would have invalidated a capture */
  int bad_arguments;     /* anything else the real driver would refuse */
  int unmap_spans;       /* cuMemUnmap calls that ended several mappings */
  int spans_refused;     /* ... that refuse_unmap_spans turned down */
  int ctx_syncs;         /* cuCtxSynchronize calls */
  f_stream *streams[64]; /* created and not destroyed, for cuCtxSynchronize */
  int nstreams;
  char first_problem[256];
} fake = {.lock = PTHREAD_MUTEX_INITIALIZER};

static f_stream legacy_stream;
static char primary_ctx, user_ctx;
static _Thread_local void *ctx_stack[8];
static _Thread_local int ctx_depth;
static _Thread_local int capture_mode; /* F_MODE_GLOBAL */

static void fake_lock(void) { pthread_mutex_lock(&fake.lock); }
static void fake_unlock(void) { pthread_mutex_unlock(&fake.lock); }

static void problem(int *counter, const char *fmt, ...) {
  (*counter)++;
  if (fake.first_problem[0]) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(fake.first_problem, sizeof fake.first_problem, fmt, ap);
  va_end(ap);
}

static fres bad(const char *fmt, const char *what) {
  problem(&fake.bad_arguments, fmt, what);
  return F_INVALID_VALUE;
}

/* Every device call: the primary context must be current; memory calls must
 * run in relaxed capture mode. Under the fake's lock. */
static bool device_call(const char *fn, bool memory) {
  if (ctx_depth == 0 || ctx_stack[ctx_depth - 1] != &primary_ctx) {
    problem(&fake.no_context, "%s without the primary context current", fn);
    return false;
  }
  if (memory && capture_mode != F_MODE_RELAXED)
    problem(&fake.not_relaxed, "%s in capture mode %d", fn, capture_mode);
  return true;
}

static f_stream *stream_of(void *s) { return s ? (f_stream *)s : &legacy_stream; }

/* --- library symbols ----------------------------------------------------- */

static fres f_init(unsigned flags) { return flags ? F_INVALID_VALUE : fake.cfg.init_result; }

static fres f_driver_get_version(int *v) {
  *v = fake.cfg.version;
  return F_SUCCESS;
}

static const char *code_name(fres r, bool text) {
  switch (r) {
  case F_SUCCESS: return text ? "no error" : "CUDA_SUCCESS";
  case F_INVALID_VALUE: return text ? "invalid argument" : "CUDA_ERROR_INVALID_VALUE";
  case F_OUT_OF_MEMORY: return text ? "out of memory" : "CUDA_ERROR_OUT_OF_MEMORY";
  case F_NO_DEVICE: return text ? "no CUDA-capable device is detected" : "CUDA_ERROR_NO_DEVICE";
  case F_INVALID_CONTEXT: return text ? "invalid device context" : "CUDA_ERROR_INVALID_CONTEXT";
  case F_INVALID_HANDLE: return text ? "invalid resource handle" : "CUDA_ERROR_INVALID_HANDLE";
  case F_NOT_READY: return text ? "device not ready" : "CUDA_ERROR_NOT_READY";
  case F_CAPTURE_UNSUPPORTED:
    return text ? "operation not permitted when stream is capturing"
                : "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED";
  default: return NULL;
  }
}

static fres f_get_error_name(fres r, const char **s) {
  *s = code_name(r, false);
  return *s ? F_SUCCESS : F_INVALID_VALUE;
}

static fres f_get_error_string(fres r, const char **s) {
  *s = code_name(r, true);
  return *s ? F_SUCCESS : F_INVALID_VALUE;
}

/* --- devices and contexts ------------------------------------------------ */

static fres f_device_get(int *dev, int ordinal) {
  if (ordinal < 0 || ordinal >= fake.cfg.devices) return F_INVALID_DEVICE;
  *dev = ordinal;
  return F_SUCCESS;
}

static fres f_device_get_count(int *n) {
  *n = fake.cfg.devices;
  return F_SUCCESS;
}

static fres f_device_get_name(char *buf, int len, int dev) {
  if (len <= 0 || dev < 0 || dev >= fake.cfg.devices) return F_INVALID_VALUE;
  snprintf(buf, (size_t)len, "Fake GPU %d", dev);
  return F_SUCCESS;
}

static fres f_device_get_attribute(int *value, int attribute, int dev) {
  if (dev < 0 || dev >= fake.cfg.devices) return F_INVALID_DEVICE;
  *value = attribute == F_VMM_ATTRIBUTE  ? fake.cfg.vmm
           : attribute == F_FD_ATTRIBUTE ? fake.cfg.fd_sharing
                                         : 0;
  return F_SUCCESS;
}

static fres f_primary_ctx_retain(void **ctx, int dev) {
  if (dev < 0 || dev >= fake.cfg.devices) return F_INVALID_DEVICE;
  fake_lock();
  fake.retained++;
  fake_unlock();
  *ctx = &primary_ctx;
  return F_SUCCESS;
}

static fres f_primary_ctx_release(int dev) {
  if (dev < 0 || dev >= fake.cfg.devices) return F_INVALID_DEVICE;
  fake_lock();
  fres r = fake.retained > 0 ? (fake.retained--, F_SUCCESS) : F_INVALID_CONTEXT;
  fake_unlock();
  return r;
}

static fres f_ctx_get_current(void **ctx) {
  *ctx = ctx_depth ? ctx_stack[ctx_depth - 1] : NULL;
  return F_SUCCESS;
}

static fres f_ctx_push_current(void *ctx) {
  if (!ctx || ctx_depth == 8) return F_INVALID_VALUE;
  ctx_stack[ctx_depth++] = ctx;
  return F_SUCCESS;
}

static fres f_ctx_pop_current(void **ctx) {
  if (ctx_depth == 0) return F_INVALID_CONTEXT;
  *ctx = ctx_stack[--ctx_depth];
  return F_SUCCESS;
}

static fres f_exchange_capture_mode(int *mode) {
  int old = capture_mode;
  capture_mode = *mode;
  *mode = old;
  return F_SUCCESS;
}

/* --- memory --------------------------------------------------------------- */

static fres f_mem_get_info(size_t *free_bytes, size_t *total) {
  fake_lock();
  fres r = F_INVALID_CONTEXT;
  if (device_call("cuMemGetInfo", false)) {
    *total = fake.cfg.capacity;
    *free_bytes = fake.cfg.capacity - fake.cfg.taken - fake.used;
    r = F_SUCCESS;
  }
  fake_unlock();
  return r;
}

static bool good_prop(const f_prop *p) {
  return p->type == F_PINNED && p->location.type == F_LOCATION_DEVICE && p->location.id == 0 &&
         (p->requested_handle_types == 0 ||
          (p->requested_handle_types == F_HANDLE_FD && fake.cfg.fd_sharing)) &&
         p->win32_metadata == NULL;
}

static fres f_mem_get_granularity(size_t *g, const f_prop *prop, int option) {
  fake_lock();
  fres r = F_INVALID_CONTEXT;
  if (device_call("cuMemGetAllocationGranularity", false)) {
    r = good_prop(prop) && option == 0 ? F_SUCCESS : bad("%s: bad properties", "granularity");
    *g = fake.cfg.granularity;
  }
  fake_unlock();
  return r;
}

static int range_index(const f_range *ranges, int n, uint64_t addr) {
  for (int i = 0; i < n; i++)
    if (ranges[i].addr == addr) return i;
  return -1;
}

static bool inside_reserved(uint64_t addr, uint64_t size) {
  for (int i = 0; i < fake.nreserved; i++)
    if (addr >= fake.reserved[i].addr &&
        addr + size <= fake.reserved[i].addr + fake.reserved[i].size)
      return true;
  return false;
}

static fres f_mem_address_reserve(uint64_t *ptr, size_t size, size_t align, uint64_t hint,
                                  unsigned long long flags) {
  fres r = F_INVALID_CONTEXT;
  fake_lock();
  if (!device_call("cuMemAddressReserve", true)) goto out;
  if (size == 0 || size % fake.cfg.granularity || hint || flags || (align & (align - 1)) ||
      fake.nreserved == FAKE_RANGES) {
    r = bad("%s: bad arguments", "cuMemAddressReserve");
    goto out;
  }
  if (align < fake.cfg.granularity) align = fake.cfg.granularity;
  uint64_t at = (fake.next_va + align - 1) / align * align;
  fake.next_va = at + size + fake.cfg.granularity; /* a gap between reservations */
  fake.reserved[fake.nreserved++] = (f_range){.addr = at, .size = size};
  *ptr = at;
  r = F_SUCCESS;
out:
  fake_unlock();
  return r;
}

static fres f_mem_address_free(uint64_t ptr, size_t size) {
  fres r = F_INVALID_CONTEXT;
  fake_lock();
  if (!device_call("cuMemAddressFree", true)) goto out;
  int i = range_index(fake.reserved, fake.nreserved, ptr);
  if (i < 0 || fake.reserved[i].size != size) {
    r = bad("%s: not a whole reservation", "cuMemAddressFree");
    goto out;
  }
  for (int m = 0; m < fake.nmaps; m++)
    if (fake.maps[m].addr >= ptr && fake.maps[m].addr < ptr + size) {
      r = bad("%s: the range still has mappings", "cuMemAddressFree");
      goto out;
    }
  fake.reserved[i] = fake.reserved[--fake.nreserved];
  r = F_SUCCESS;
out:
  fake_unlock();
  return r;
}

static fres f_mem_create(uint64_t *handle, size_t size, const f_prop *prop,
                         unsigned long long flags) {
  fres r = F_INVALID_CONTEXT;
  fake_lock();
  if (!device_call("cuMemCreate", true)) goto out;
  if (size == 0 || size % fake.cfg.granularity || flags || !good_prop(prop)) {
    r = bad("%s: bad arguments", "cuMemCreate");
    goto out;
  }
  if (prop->requested_handle_types && fake.cfg.refuse_sharable) {
    r = F_NOT_SUPPORTED;
    goto out;
  }
  if (fake.cfg.taken + fake.used + size > fake.cfg.capacity) {
    r = F_OUT_OF_MEMORY;
    goto out;
  }
  int slot = -1;
  for (int i = 0; i < fake.nhandles && slot < 0; i++)
    if (!fake.handles[i].live) slot = i;
  if (slot < 0 && fake.nhandles < FAKE_RANGES) slot = fake.nhandles++;
  if (slot < 0) {
    r = F_OUT_OF_MEMORY;
    goto out;
  }
  fake.handles[slot] =
      (f_handle){.size = size, .live = true, .shareable = prop->requested_handle_types != 0};
  fake.used += size;
  *handle = (uint64_t)slot + 0x1000; /* never 0 */
  r = F_SUCCESS;
out:
  fake_unlock();
  return r;
}

static f_handle *handle_of(uint64_t h) {
  if (h < 0x1000 || h - 0x1000 >= (uint64_t)fake.nhandles) return NULL;
  f_handle *p = &fake.handles[h - 0x1000];
  return p->live && !p->released ? p : NULL;
}

static void handle_maybe_free(f_handle *p) {
  if (p->released && p->maps == 0) {
    fake.used -= p->size;
    p->live = false;
  }
}

/* An exported handle is a memory file of the handle's size, so that an
 * import can tell the size and a leaked descriptor shows up. */
static fres f_mem_export(void *out, uint64_t handle, int type, unsigned long long flags) {
  fres r = F_INVALID_CONTEXT;
  fake_lock();
  if (!device_call("cuMemExportToShareableHandle", true)) goto out;
  f_handle *p = handle_of(handle);
  if (!p || type != F_HANDLE_FD || flags) {
    r = bad("%s: bad arguments", "cuMemExportToShareableHandle");
    goto out;
  }
  if (!p->shareable) {
    r = F_NOT_SUPPORTED;
    goto out;
  }
  int fd = memfd_create("fake-cuda-export", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, (off_t)p->size) != 0) {
    if (fd >= 0) close(fd);
    r = F_OUT_OF_MEMORY;
    goto out;
  }
  *(int *)out = fd;
  r = F_SUCCESS;
out:
  fake_unlock();
  return r;
}

static fres f_mem_import(uint64_t *handle, void *os_handle, int type) {
  fres r = F_INVALID_CONTEXT;
  fake_lock();
  if (!device_call("cuMemImportFromShareableHandle", true)) goto out;
  struct stat st;
  int fd = (int)(intptr_t)os_handle;
  if (type != F_HANDLE_FD || fstat(fd, &st) != 0 || st.st_size <= 0) {
    r = bad("%s: bad arguments", "cuMemImportFromShareableHandle");
    goto out;
  }
  int slot = -1;
  for (int i = 0; i < fake.nhandles && slot < 0; i++)
    if (!fake.handles[i].live) slot = i;
  if (slot < 0 && fake.nhandles < FAKE_RANGES) slot = fake.nhandles++;
  if (slot < 0) {
    r = F_OUT_OF_MEMORY;
    goto out;
  }
  /* Counted as used, as the driver counts the imported memory's handle. */
  fake.handles[slot] = (f_handle){.size = (uint64_t)st.st_size, .live = true};
  fake.used += (size_t)st.st_size;
  *handle = (uint64_t)slot + 0x1000;
  r = F_SUCCESS;
out:
  fake_unlock();
  return r;
}

static fres f_mem_release(uint64_t handle) {
  fres r = F_INVALID_CONTEXT;
  fake_lock();
  if (!device_call("cuMemRelease", true)) goto out;
  f_handle *p = handle_of(handle);
  if (!p) {
    r = bad("%s: unknown or released handle", "cuMemRelease");
    goto out;
  }
  p->released = true;
  handle_maybe_free(p);
  r = F_SUCCESS;
out:
  fake_unlock();
  return r;
}

static bool overlaps_mapping(uint64_t addr, uint64_t size) {
  for (int m = 0; m < fake.nmaps; m++)
    if (addr < fake.maps[m].addr + fake.maps[m].size && fake.maps[m].addr < addr + size)
      return true;
  return false;
}

static fres f_mem_map(uint64_t ptr, size_t size, size_t offset, uint64_t handle,
                      unsigned long long flags) {
  fres r = F_INVALID_CONTEXT;
  fake_lock();
  if (!device_call("cuMemMap", true)) goto out;
  f_handle *p = handle_of(handle);
  if (!p) {
    r = F_INVALID_HANDLE;
    goto out;
  }
  if (offset || flags || size != p->size || ptr % fake.cfg.granularity ||
      !inside_reserved(ptr, size) || overlaps_mapping(ptr, size) || fake.nmaps == FAKE_RANGES) {
    r = bad("%s: bad arguments", "cuMemMap");
    goto out;
  }
  fake.maps[fake.nmaps++] = (f_range){.addr = ptr, .size = size, .handle = handle};
  p->maps++;
  r = F_SUCCESS;
out:
  fake_unlock();
  return r;
}

static fres f_mem_set_access(uint64_t ptr, size_t size, const f_access *desc, size_t count) {
  fres r = F_INVALID_CONTEXT;
  fake_lock();
  if (!device_call("cuMemSetAccess", true)) goto out;
  if (count != 1 || desc->location.type != F_LOCATION_DEVICE || desc->location.id != 0 ||
      desc->flags != F_READ_WRITE) {
    r = bad("%s: bad access descriptor", "cuMemSetAccess");
    goto out;
  }
  /* The range must be covered by mappings without a gap. */
  for (uint64_t at = ptr; at < ptr + size;) {
    int found = -1;
    for (int m = 0; m < fake.nmaps && found < 0; m++)
      if (fake.maps[m].addr <= at && at < fake.maps[m].addr + fake.maps[m].size) found = m;
    if (found < 0) {
      r = bad("%s: range not fully mapped", "cuMemSetAccess");
      goto out;
    }
    fake.maps[found].access = true;
    at = fake.maps[found].addr + fake.maps[found].size;
  }
  r = F_SUCCESS;
out:
  fake_unlock();
  return r;
}

/* A range made of whole mappings, one or several (never part of one). */
static fres f_mem_unmap(uint64_t ptr, size_t size) {
  fres r = F_INVALID_CONTEXT;
  fake_lock();
  if (!device_call("cuMemUnmap", true)) goto out;
  int count = 0;
  uint64_t at = ptr;
  for (int m; at < ptr + size && (m = range_index(fake.maps, fake.nmaps, at)) >= 0; count++)
    at += fake.maps[m].size;
  if (count == 0 || at != ptr + size) {
    r = bad("%s: not a run of whole mappings", "cuMemUnmap");
    goto out;
  }
  if (count > 1 && fake.cfg.refuse_unmap_spans) {
    fake.spans_refused++;
    r = F_INVALID_VALUE;
    goto out;
  }
  fake.unmap_spans += count > 1;
  for (at = ptr; at < ptr + size;) {
    int m = range_index(fake.maps, fake.nmaps, at);
    at += fake.maps[m].size;
    f_handle *p = &fake.handles[fake.maps[m].handle - 0x1000];
    p->maps--;
    handle_maybe_free(p);
    fake.maps[m] = fake.maps[--fake.nmaps];
  }
  r = F_SUCCESS;
out:
  fake_unlock();
  return r;
}

/* --- streams and events ---------------------------------------------------- */

static fres f_stream_create(void **s, unsigned flags) {
  fake_lock();
  bool ok = device_call("cuStreamCreate", false);
  fake_unlock();
  if (!ok) return F_INVALID_CONTEXT;
  f_stream *st = calloc(1, sizeof *st);
  st->flags = flags;
  st->ctx = ctx_stack[ctx_depth - 1];
  fake_lock();
  if (fake.nstreams < (int)(sizeof fake.streams / sizeof *fake.streams))
    fake.streams[fake.nstreams++] = st;
  fake_unlock();
  *s = st;
  return F_SUCCESS;
}

static fres f_stream_get_ctx(void *s, void **ctx) {
  if (!s) { /* the legacy stream: the current context's */
    if (ctx_depth == 0) return F_INVALID_CONTEXT;
    *ctx = ctx_stack[ctx_depth - 1];
    return F_SUCCESS;
  }
  f_stream *st = s;
  if (st->destroyed) return F_INVALID_HANDLE;
  *ctx = st->ctx;
  return F_SUCCESS;
}

static fres f_stream_destroy(void *s) {
  fake_lock();
  bool ok = device_call("cuStreamDestroy", false);
  fake_unlock();
  if (!ok) return F_INVALID_CONTEXT;
  if (!s) return F_INVALID_HANDLE;
  fake_lock();
  for (int i = 0; i < fake.nstreams; i++)
    if (fake.streams[i] == s) fake.streams[i--] = fake.streams[--fake.nstreams];
  fake_unlock();
  free(s);
  return F_SUCCESS;
}

static fres f_stream_is_capturing(void *s, int *status) {
  fake_lock();
  bool ok = device_call("cuStreamIsCapturing", false);
  bool implicit = !s && fake.legacy_implicit;
  fake_unlock();
  if (!ok) return F_INVALID_CONTEXT;
  if (implicit) return F_CAPTURE_IMPLICIT;
  *status = stream_of(s)->capturing ? 1 : 0;
  return F_SUCCESS;
}

static fres f_stream_get_capture_info(void *s, int *status, uint64_t *id, void **graph,
                                      const void **deps, size_t *ndeps) {
  fake_lock();
  bool ok = device_call("cuStreamGetCaptureInfo", false);
  fake.capture_queries++;
  if (ok && !s) problem(&fake.bad_arguments, "cuStreamGetCaptureInfo of the legacy stream");
  if (ok && (graph || deps || ndeps))
    problem(&fake.bad_arguments, "cuStreamGetCaptureInfo asked for the graph");
  fake_unlock();
  if (!ok) return F_INVALID_CONTEXT;
  f_stream *st = stream_of(s);
  if (st->destroyed) return F_INVALID_HANDLE;
  *status = st->capturing ? 1 : 0;
  *id = st->capturing ? st->capture_id : 0;
  return F_SUCCESS;
}

static fres f_stream_synchronize(void *s) {
  fres r = F_INVALID_CONTEXT;
  fake_lock();
  if (!device_call("cuStreamSynchronize", true)) goto out;
  f_stream *st = stream_of(s);
  if (st->destroyed) {
    r = F_INVALID_HANDLE;
    goto out;
  }
  if (st->capturing || (!s && fake.legacy_implicit)) {
    problem(&fake.broken_captures, "cuStreamSynchronize of a capturing stream");
    r = F_CAPTURE_UNSUPPORTED;
    goto out;
  }
  st->completed = st->submitted; /* as if the host waited */
  r = F_SUCCESS;
out:
  fake_unlock();
  return r;
}

/* Every stream's work done; a stream being captured would have its capture
 * invalidated, as the driver does. */
static fres f_ctx_synchronize(void) {
  fres r = F_INVALID_CONTEXT;
  fake_lock();
  if (!device_call("cuCtxSynchronize", false)) goto out;
  fake.ctx_syncs++;
  bool capturing = legacy_stream.capturing || fake.legacy_implicit;
  for (int i = 0; i < fake.nstreams; i++) capturing |= fake.streams[i]->capturing;
  if (capturing) {
    problem(&fake.broken_captures, "cuCtxSynchronize while a stream is being captured");
    r = F_CAPTURE_UNSUPPORTED;
    goto out;
  }
  legacy_stream.completed = legacy_stream.submitted;
  for (int i = 0; i < fake.nstreams; i++) fake.streams[i]->completed = fake.streams[i]->submitted;
  r = F_SUCCESS;
out:
  fake_unlock();
  return r;
}

static fres f_event_create(void **e, unsigned flags) {
  fake_lock();
  bool ok = device_call("cuEventCreate", false);
  fake_unlock();
  if (!ok) return F_INVALID_CONTEXT;
  f_event *ev = calloc(1, sizeof *ev);
  ev->flags = flags;
  *e = ev;
  return F_SUCCESS;
}

static fres f_event_destroy(void *e) {
  fake_lock();
  bool ok = device_call("cuEventDestroy", false);
  fake_unlock();
  if (!ok) return F_INVALID_CONTEXT;
  free(e);
  return F_SUCCESS;
}

static fres f_event_record(void *e, void *s) {
  fres r = F_INVALID_CONTEXT;
  fake_lock();
  if (!device_call("cuEventRecord", false)) goto out;
  if (!s && fake.legacy_implicit) {
    problem(&fake.broken_captures, "cuEventRecord on the legacy stream during a capture");
    r = F_CAPTURE_IMPLICIT;
    goto out;
  }
  f_event *ev = e;
  f_stream *st = stream_of(s);
  ev->stream = st;
  ev->captured = st->capturing;
  fake.captured_events += st->capturing;
  ev->ticket = ++st->submitted;
  if (!st->held) st->completed = st->submitted;
  r = F_SUCCESS;
out:
  fake_unlock();
  return r;
}

static fres f_event_query(void *e) {
  fres r = F_INVALID_CONTEXT;
  fake_lock();
  if (!device_call("cuEventQuery", true)) goto out;
  f_event *ev = e;
  if (ev->captured)
    r = F_CAPTURED_EVENT;
  else
    r = !ev->stream || ev->stream->completed >= ev->ticket ? F_SUCCESS : F_NOT_READY;
out:
  fake_unlock();
  return r;
}

static fres f_event_synchronize(void *e) {
  fres r = F_INVALID_CONTEXT;
  fake_lock();
  if (!device_call("cuEventSynchronize", true)) goto out;
  f_event *ev = e;
  if (ev->captured) {
    problem(&fake.broken_captures, "cuEventSynchronize of an event of a capture");
    r = F_CAPTURED_EVENT;
    goto out;
  }
  if (ev->stream && ev->stream->completed < ev->ticket) ev->stream->completed = ev->ticket;
  r = F_SUCCESS;
out:
  fake_unlock();
  return r;
}

/* --- cuGetProcAddress ------------------------------------------------------ */

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
    FN("cuDevicePrimaryCtxRetain", f_primary_ctx_retain),
    FN("cuDevicePrimaryCtxRelease", f_primary_ctx_release),
    FN("cuCtxGetCurrent", f_ctx_get_current),
    FN("cuCtxPushCurrent", f_ctx_push_current),
    FN("cuCtxPopCurrent", f_ctx_pop_current),
    FN("cuCtxSynchronize", f_ctx_synchronize),
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
    FN("cuStreamCreate", f_stream_create),
    FN("cuStreamDestroy", f_stream_destroy),
    FN("cuStreamSynchronize", f_stream_synchronize),
    FN("cuStreamIsCapturing", f_stream_is_capturing),
    FN("cuStreamGetCaptureInfo", f_stream_get_capture_info),
    FN("cuStreamGetCtx", f_stream_get_ctx),
    FN("cuMemExportToShareableHandle", f_mem_export),
    FN("cuMemImportFromShareableHandle", f_mem_import),
    FN("cuEventCreate", f_event_create),
    FN("cuEventDestroy", f_event_destroy),
    FN("cuEventRecord", f_event_record),
    FN("cuEventQuery", f_event_query),
    FN("cuEventSynchronize", f_event_synchronize),
};

static fres proc_address(const char *symbol, void **pfn, int version, uint64_t flags, int *status) {
  fake.asked_abi = version;
  fake.asked_flags = flags;
  *pfn = NULL;
  if (version > fake.cfg.version) return F_INVALID_VALUE; /* as the driver does */
  if (status) *status = 1;                                /* symbol not found */
  if (fake.cfg.missing && strcmp(symbol, fake.cfg.missing) == 0) return F_SUCCESS;
  for (size_t i = 0; i < sizeof fake_procs / sizeof *fake_procs; i++) {
    if (strcmp(fake_procs[i].name, symbol) == 0) {
      memcpy(pfn, &fake_procs[i].fn, sizeof *pfn);
      if (status) *status = 0;
      return F_SUCCESS;
    }
  }
  return F_SUCCESS;
}

static fres f_get_proc_v2(const char *symbol, void **pfn, int version, uint64_t flags,
                          int *status) {
  return proc_address(symbol, pfn, version, flags, status);
}

static fres f_get_proc_v1(const char *symbol, void **pfn, int version, uint64_t flags) {
  return proc_address(symbol, pfn, version, flags, NULL);
}

static _tide_cuda_fn fake_lookup(const char *name) {
  if (strcmp(name, "cuInit") == 0) return (_tide_cuda_fn)f_init;
  if (strcmp(name, "cuDriverGetVersion") == 0) return (_tide_cuda_fn)f_driver_get_version;
  if (strcmp(name, "cuGetErrorName") == 0) return (_tide_cuda_fn)f_get_error_name;
  if (strcmp(name, "cuGetErrorString") == 0) return (_tide_cuda_fn)f_get_error_string;
  if (strcmp(name, "cuGetProcAddress_v2") == 0 && fake.cfg.has_v2)
    return (_tide_cuda_fn)f_get_proc_v2;
  if (strcmp(name, "cuGetProcAddress") == 0 && fake.cfg.has_v1) return (_tide_cuda_fn)f_get_proc_v1;
  return NULL;
}

/* A healthy driver: CUDA 13.0, one device of 4 GiB, 2 MiB granularity. */
static fake_config healthy(void) {
  return (fake_config){.version = 13000,
                       .has_v2 = true,
                       .has_v1 = true,
                       .init_result = F_SUCCESS,
                       .devices = 1,
                       .vmm = 1,
                       .capacity = 4 * GiB,
                       .granularity = 2 * MiB};
}

static void install_fake(fake_config cfg);

/* A library built without cuda.h has only the stub backend: nothing to fake. */
static void skip_if_stub(void) {
  install_fake(healthy());
  if (!_tide_cuda_usable() && contains(tide_last_error(), "built without CUDA headers")) {
    print_message("skipped: %s\n", tide_last_error());
    skip();
  }
}

/* Install the fake with `cfg` and forget any earlier driver. */
static void use_fake(fake_config cfg) {
  skip_if_stub();
  install_fake(cfg);
}

static void install_fake(fake_config cfg) {
  fake_lock();
  fake.cfg = cfg;
  fake.used = 0;
  fake.next_va = (uint64_t)1 << 44;
  fake.nreserved = fake.nmaps = fake.nhandles = 0;
  fake.retained = 0;
  fake.asked_abi = 0;
  fake.asked_flags = 0;
  fake.legacy_implicit = false;
  fake.capture_queries = fake.captured_events = 0;
  fake.no_context = fake.not_relaxed = fake.broken_captures = fake.bad_arguments = 0;
  fake.unmap_spans = fake.spans_refused = 0;
  fake.ctx_syncs = fake.nstreams = 0;
  fake.first_problem[0] = '\0';
  fake_unlock();
  legacy_stream = (f_stream){0};
  _tide_cuda_set_driver_lookup(fake_lookup);
}

static int teardown_fake(void **state) {
  (void)state;
  _tide_cuda_set_driver_lookup(NULL);
  return 0;
}

/* Nothing the real driver would refuse or that breaks a user's state. */
static void assert_fake_clean(void) {
  if (fake.no_context || fake.not_relaxed || fake.broken_captures || fake.bad_arguments)
    fail_msg("the fake driver saw %d call(s) without context, %d outside relaxed mode, %d "
             "broken capture(s), %d bad argument(s); first: %s",
             fake.no_context, fake.not_relaxed, fake.broken_captures, fake.bad_arguments,
             fake.first_problem);
  assert_int_equal(ctx_depth, 0);
  assert_int_equal(capture_mode, F_MODE_GLOBAL);
}

/* Everything given back: no memory, mapping or reservation, no context. */
static void assert_fake_empty(void) {
  assert_int_equal(fake.used, 0);
  assert_int_equal(fake.nmaps, 0);
  assert_int_equal(fake.nreserved, 0);
  assert_int_equal(fake.retained, 0);
}

/* ------------------------------------------------------------------------ */
/* Why the driver cannot be used                                             */
/* ------------------------------------------------------------------------ */

/* Loading fails with a message that has `needle` and `also` (if not NULL);
 * auto falls back to host. */
static void expect_unusable(fake_config cfg, const char *needle, const char *also) {
  use_fake(cfg);
  assert_false(_tide_cuda_usable());
  assert_int_equal(tide_last_status(), TIDE_ERR_UNAVAILABLE);
  assert_message_has(needle);
  tide_allocator *a = NULL;
  assert_int_equal(create_with("backend:cuda", &a), TIDE_ERR_UNAVAILABLE);
  assert_null(a);
  assert_message_has(needle);
  if (also) assert_message_has(also);
  a = create_ok("backend:auto");
  tide_info info;
  assert_int_equal(tide_get_info(a, &info), TIDE_OK);
  assert_string_equal(info.backend, "host");
  assert_int_equal(tide_destroy(a), TIDE_OK);
}

static void test_fake_driver_too_old(void **state) {
  (void)state;
  fake_config cfg = healthy();
  cfg.version = 11020;
  expect_unusable(cfg, "too old", "supports CUDA 11.2");
  cfg = healthy();
  cfg.has_v1 = cfg.has_v2 = false;
  expect_unusable(cfg, "too old", "cuGetProcAddress");
}

static void test_fake_init_fails(void **state) {
  (void)state;
  fake_config cfg = healthy();
  cfg.init_result = F_NO_DEVICE;
  expect_unusable(cfg, "cuInit failed with CUDA_ERROR_NO_DEVICE",
                  "no CUDA-capable device is detected");
}

static void test_fake_missing_entry_point(void **state) {
  (void)state;
  fake_config cfg = healthy();
  cfg.missing = "cuMemCreate";
  expect_unusable(cfg, "does not provide cuMemCreate", NULL);
}

static void test_fake_no_device(void **state) {
  (void)state;
  fake_config cfg = healthy();
  cfg.devices = 0;
  expect_unusable(cfg, "no CUDA device", NULL);
}

/* The driver works but this device cannot be used: no fallback then. */
static void test_fake_device_unusable(void **state) {
  (void)state;
  fake_config cfg = healthy();
  cfg.vmm = 0;
  use_fake(cfg);
  assert_true(_tide_cuda_usable());
  tide_allocator *a = NULL;
  assert_int_equal(create_with("backend:cuda", &a), TIDE_ERR_UNAVAILABLE);
  assert_message_has("virtual memory management");
  assert_int_equal(fake.retained, 0);

  use_fake(healthy());
  tide_config *c = config_of("backend:cuda");
  assert_int_equal(tide_create(1, c, &a), TIDE_ERR_UNAVAILABLE);
  tide_config_free(c);
  assert_message_has("device 1 does not exist");
  assert_fake_clean();
}

/* Entry points come at the ABI of 12.0 (or the driver's, if older), the
 * legacy-stream versions, through cuGetProcAddress_v2 or the older form. */
static void test_fake_abi_and_flags(void **state) {
  (void)state;
  use_fake(healthy());
  assert_true(_tide_cuda_usable());
  assert_int_equal(fake.asked_abi, 12000);
  assert_int_equal(fake.asked_flags, F_LEGACY_STREAM_FLAG);

  fake_config cfg = healthy();
  cfg.version = 11080;
  cfg.has_v2 = false;
  use_fake(cfg);
  assert_true(_tide_cuda_usable());
  assert_int_equal(fake.asked_abi, 11080);
  tide_allocator *a = create_ok("backend:cuda");
  void *p = tide_malloc(a, MiB, NULL);
  assert_non_null(p);
  assert_int_equal(tide_free(a, p, NULL), TIDE_OK);
  assert_int_equal(tide_destroy(a), TIDE_OK);
  assert_fake_clean();
  assert_fake_empty();
}

/* ------------------------------------------------------------------------ */
/* The backend's calls                                                       */
/* ------------------------------------------------------------------------ */

static void open_fake(_tide_backend *b) {
  _tide_conf_values conf;
  memset(&conf, 0, sizeof conf);
  if (_tide_cuda_open(&conf, 0, b) != TIDE_OK) fail_msg("open: %s", tide_last_error());
  assert_string_equal(b->ops->name, "cuda");
  assert_int_equal(b->is_host, 0);
}

static void test_fake_queries(void **state) {
  (void)state;
  use_fake(healthy());
  _tide_backend b;
  open_fake(&b);
  assert_int_equal(fake.retained, 1);
  int n = 0;
  size_t g = 0, free_bytes = 0, total = 0;
  char name[64];
  assert_int_equal(b.ops->device_count(b.ctx, &n), TIDE_OK);
  assert_int_equal(n, 1);
  assert_int_equal(b.ops->granularity(b.ctx, &g), TIDE_OK);
  assert_int_equal(g, 2 * MiB);
  assert_int_equal(b.ops->mem_info(b.ctx, &free_bytes, &total), TIDE_OK);
  assert_int_equal(total, 4 * GiB);
  assert_int_equal(free_bytes, 4 * GiB);
  assert_int_equal(b.ops->device_name(b.ctx, name, sizeof name), TIDE_OK);
  assert_string_equal(name, "Fake GPU 0");
  b.ops->destroy(b.ctx);
  assert_int_equal(fake.retained, 0);
  assert_fake_clean();
}

static void test_fake_memory_calls(void **state) {
  (void)state;
  use_fake(healthy());
  _tide_backend b;
  open_fake(&b);
  const _tide_backend_ops *ops = b.ops;
  uintptr_t va = 0;
  assert_int_equal(ops->reserve(b.ctx, 64 * MiB, 4 * MiB, &va), TIDE_OK);
  assert_int_equal(va % (4 * MiB), 0);
  _tide_handle h[2];
  for (int i = 0; i < 2; i++) {
    assert_int_equal(ops->create(b.ctx, 4 * MiB, &h[i]), TIDE_OK);
    assert_true(h[i] != 0);
    assert_int_equal(ops->map(b.ctx, va + (size_t)i * 4 * MiB, 4 * MiB, h[i]), TIDE_OK);
  }
  /* One access call over two mappings, as the allocator makes it. */
  assert_int_equal(ops->set_access(b.ctx, va, 8 * MiB), TIDE_OK);
  assert_int_equal(fake.used, 8 * MiB);
  /* A bad call comes back as a backend error naming the call and the error. */
  assert_int_equal(ops->map(b.ctx, va, 4 * MiB, h[0]), TIDE_ERR_BACKEND);
  assert_message_has("cuMemMap failed with CUDA_ERROR_INVALID_VALUE");
  fake.bad_arguments = 0; /* that one was on purpose */
  fake.first_problem[0] = '\0';
  for (int i = 0; i < 2; i++) {
    assert_int_equal(ops->unmap(b.ctx, va + (size_t)i * 4 * MiB, 4 * MiB), TIDE_OK);
    assert_int_equal(ops->release(b.ctx, h[i]), TIDE_OK);
  }
  assert_int_equal(ops->unreserve(b.ctx, va, 64 * MiB), TIDE_OK);
  /* An alignment that is not a power of two (20 MiB pages) is honoured too. */
  assert_int_equal(ops->reserve(b.ctx, 200 * MiB, 20 * MiB, &va), TIDE_OK);
  assert_int_equal(va % (20 * MiB), 0);
  assert_int_equal(ops->create(b.ctx, 20 * MiB, &h[0]), TIDE_OK);
  assert_int_equal(ops->map(b.ctx, va + 180 * MiB, 20 * MiB, h[0]), TIDE_OK);
  assert_int_equal(ops->set_access(b.ctx, va + 180 * MiB, 20 * MiB), TIDE_OK);
  assert_int_equal(ops->unmap(b.ctx, va + 180 * MiB, 20 * MiB), TIDE_OK);
  assert_int_equal(ops->release(b.ctx, h[0]), TIDE_OK);
  assert_int_equal(ops->unreserve(b.ctx, va, 200 * MiB), TIDE_OK);
  /* Out of device memory is TIDE_ERR_OOM, with the driver's words. */
  assert_int_equal(ops->create(b.ctx, 8 * GiB, &h[0]), TIDE_ERR_OOM);
  assert_message_has("CUDA_ERROR_OUT_OF_MEMORY (out of memory)");
  b.ops->destroy(b.ctx);
  assert_fake_clean();
  assert_fake_empty();
}

/* Whatever context and capture mode the thread has, it has them after. */
static void test_fake_context_and_mode_restored(void **state) {
  (void)state;
  use_fake(healthy());
  _tide_backend b;
  open_fake(&b);
  const _tide_backend_ops *ops = b.ops;
  void *stack_before[2] = {&user_ctx, &primary_ctx};
  for (int depth = 0; depth <= 2; depth++) {
    for (int mode = F_MODE_GLOBAL; mode <= F_MODE_RELAXED; mode++) {
      for (int i = 0; i < depth; i++) f_ctx_push_current(stack_before[i]);
      capture_mode = mode;
      uintptr_t va = 0;
      _tide_handle h = 0;
      size_t f = 0, t = 0;
      assert_int_equal(ops->reserve(b.ctx, 2 * MiB, 0, &va), TIDE_OK);
      assert_int_equal(ops->create(b.ctx, 2 * MiB, &h), TIDE_OK);
      assert_int_equal(ops->map(b.ctx, va, 2 * MiB, h), TIDE_OK);
      assert_int_equal(ops->set_access(b.ctx, va, 2 * MiB), TIDE_OK);
      assert_int_equal(ops->mem_info(b.ctx, &f, &t), TIDE_OK);
      assert_int_equal(ops->unmap(b.ctx, va, 2 * MiB), TIDE_OK);
      assert_int_equal(ops->release(b.ctx, h), TIDE_OK);
      assert_int_equal(ops->unreserve(b.ctx, va, 2 * MiB), TIDE_OK);
      assert_int_equal(ctx_depth, depth);
      for (int i = 0; i < depth; i++) assert_ptr_equal(ctx_stack[i], stack_before[i]);
      assert_int_equal(capture_mode, mode);
      ctx_depth = 0;
      capture_mode = F_MODE_GLOBAL;
    }
  }
  b.ops->destroy(b.ctx);
  assert_fake_clean();
  assert_fake_empty();
}

/* With a device that can export memory, pages are made exportable, export
 * gives a descriptor and import a handle that maps like any other. Where
 * exportable memory is refused, memory is still made, and export says why
 * it cannot share. */
static void test_fake_sharing(void **state) {
  (void)state;
  fake_config cfg = healthy();
  cfg.fd_sharing = 1;
  use_fake(cfg);
  _tide_backend b;
  open_fake(&b);
  const _tide_backend_ops *ops = b.ops;
  _tide_handle h = 0, imported = 0;
  uintptr_t va = 0;
  int fd = -1;
  uint64_t offset = 99;
  assert_int_equal(ops->create(b.ctx, 2 * MiB, &h), TIDE_OK);
  assert_int_equal(ops->export_fd(b.ctx, h, &fd, &offset), TIDE_OK);
  assert_true(fd >= 0);
  assert_int_equal(offset, 0);
  assert_int_equal(ops->import_fd(b.ctx, fd, 0, 2 * MiB, &imported), TIDE_OK);
  close(fd);
  assert_int_equal(ops->reserve(b.ctx, 2 * MiB, 0, &va), TIDE_OK);
  assert_int_equal(ops->map(b.ctx, va, 2 * MiB, imported), TIDE_OK);
  assert_int_equal(ops->set_access(b.ctx, va, 2 * MiB), TIDE_OK);
  assert_int_equal(ops->unmap(b.ctx, va, 2 * MiB), TIDE_OK);
  assert_int_equal(ops->unreserve(b.ctx, va, 2 * MiB), TIDE_OK);
  assert_int_equal(ops->release(b.ctx, imported), TIDE_OK);
  assert_int_equal(ops->release(b.ctx, h), TIDE_OK);
  b.ops->destroy(b.ctx);
  assert_fake_clean();
  assert_fake_empty();

  cfg.refuse_sharable = true;
  use_fake(cfg);
  open_fake(&b);
  ops = b.ops;
  assert_int_equal(ops->create(b.ctx, 2 * MiB, &h), TIDE_OK);
  assert_int_equal(ops->export_fd(b.ctx, h, &fd, &offset), TIDE_ERR_UNAVAILABLE);
  assert_non_null(strstr(tide_last_error(), "cannot be shared"));
  assert_int_equal(ops->release(b.ctx, h), TIDE_OK);
  b.ops->destroy(b.ctx);
  assert_fake_clean();
  assert_fake_empty();
}

static void test_fake_streams_and_events(void **state) {
  (void)state;
  use_fake(healthy());
  _tide_backend b;
  open_fake(&b);
  const _tide_backend_ops *ops = b.ops;
  tide_stream s = NULL;
  _tide_event e = NULL;
  assert_int_equal(ops->stream_create(b.ctx, &s), TIDE_OK);
  f_stream *fs = (f_stream *)(void *)s;
  assert_int_equal(fs->flags, F_NON_BLOCKING);
  assert_int_equal(ops->event_create(b.ctx, &e), TIDE_OK);
  assert_int_equal(((f_event *)e)->flags, F_DISABLE_TIMING);

  /* Work still running: the event is not ready until it ends. */
  fs->held = true;
  assert_int_equal(ops->event_record(b.ctx, e, s), TIDE_OK);
  assert_int_equal(ops->event_query(b.ctx, e), TIDE_ERR_NOT_READY);
  fs->completed = fs->submitted;
  fs->held = false;
  assert_int_equal(ops->event_query(b.ctx, e), TIDE_OK);
  assert_int_equal(ops->event_synchronize(b.ctx, e), TIDE_OK);
  assert_int_equal(ops->stream_synchronize(b.ctx, s), TIDE_OK);
  assert_int_equal(ops->stream_synchronize(b.ctx, NULL), TIDE_OK);

  /* A capturing stream is never waited for. */
  fs->capturing = true;
  assert_int_equal(ops->stream_synchronize(b.ctx, s), TIDE_ERR_NOT_READY);
  assert_message_has("captured into a CUDA graph");
  assert_int_equal(ops->event_record(b.ctx, e, s), TIDE_OK); /* legal: a graph node */
  assert_int_equal(ops->event_query(b.ctx, e), TIDE_ERR_NOT_READY);
  assert_message_has("completes only when the graph runs");
  assert_int_equal(ops->event_synchronize(b.ctx, e), TIDE_ERR_NOT_READY);
  fs->capturing = false;

  /* Nor is the legacy stream while a blocking stream captures. */
  fake.legacy_implicit = true;
  assert_int_equal(ops->stream_synchronize(b.ctx, NULL), TIDE_ERR_NOT_READY);
  assert_message_has("default stream");
  assert_int_equal(ops->event_record(b.ctx, e, NULL), TIDE_ERR_NOT_READY);
  fake.legacy_implicit = false;

  /* A handle the driver does not know is a bad argument, as on the host. */
  assert_int_equal(ops->stream_check(b.ctx, s), TIDE_OK);
  assert_int_equal(ops->stream_check(b.ctx, NULL), TIDE_OK);
  fs->capturing = true; /* a property query: fine during capture */
  assert_int_equal(ops->stream_check(b.ctx, s), TIDE_OK);
  fs->capturing = false;
  fs->destroyed = true;
  assert_int_equal(ops->stream_synchronize(b.ctx, s), TIDE_ERR_INVALID);
  assert_message_has("CUDA_ERROR_INVALID_HANDLE");
  assert_int_equal(ops->stream_check(b.ctx, s), TIDE_ERR_INVALID);
  fs->destroyed = false;
  /* A stream of another context is not this device's. */
  fs->ctx = &user_ctx;
  assert_int_equal(ops->stream_check(b.ctx, s), TIDE_ERR_INVALID);
  assert_message_has("another CUDA context");
  fs->ctx = &primary_ctx;

  assert_int_equal(ops->stream_destroy(b.ctx, NULL), TIDE_ERR_INVALID);
  assert_int_equal(ops->event_destroy(b.ctx, e), TIDE_OK);
  assert_int_equal(ops->stream_destroy(b.ctx, s), TIDE_OK);
  b.ops->destroy(b.ctx);
  assert_fake_clean();
}

/* Whether a stream is being captured: cuStreamGetCaptureInfo's answer, with
 * the capture's id; never asked of the legacy stream. */
static void test_fake_capture_status(void **state) {
  (void)state;
  use_fake(healthy());
  _tide_backend b;
  open_fake(&b);
  const _tide_backend_ops *ops = b.ops;
  tide_stream s = NULL;
  assert_int_equal(ops->stream_create(b.ctx, &s), TIDE_OK);
  f_stream *fs = (f_stream *)(void *)s;
  bool capturing = true;
  uint64_t id = 9;
  assert_int_equal(ops->stream_capture_status(b.ctx, s, &capturing, &id), TIDE_OK);
  assert_false(capturing);
  assert_int_equal(id, 0);
  fs->capturing = true;
  fs->capture_id = 42;
  assert_int_equal(ops->stream_capture_status(b.ctx, s, &capturing, &id), TIDE_OK);
  assert_true(capturing);
  assert_int_equal(id, 42);
  int asked = fake.capture_queries;
  fake.legacy_implicit = true; /* asking about the legacy stream would be an error */
  assert_int_equal(ops->stream_capture_status(b.ctx, NULL, &capturing, &id), TIDE_OK);
  assert_false(capturing);
  assert_int_equal(fake.capture_queries, asked);
  fake.legacy_implicit = false;
  fs->capturing = false;
  fs->destroyed = true;
  assert_int_equal(ops->stream_capture_status(b.ctx, s, &capturing, &id), TIDE_ERR_INVALID);
  assert_message_has("cuStreamGetCaptureInfo");
  fs->destroyed = false;
  assert_int_equal(ops->stream_destroy(b.ctx, s), TIDE_OK);
  b.ops->destroy(b.ctx);
  assert_fake_clean();
}

/* ------------------------------------------------------------------------ */
/* The allocator on the fake driver                                          */
/* ------------------------------------------------------------------------ */

/* A capture pool on the driver: pages are mapped during the capture (in
 * relaxed mode, never waiting for the capturing stream), a stream forked
 * into the capture allocates to the pool too, a block of the usual memory
 * freed in the capture is deferred without an event recorded in it, and
 * the last release gives the pool's memory back. */
static void test_fake_capture_pool(void **state) {
  (void)state;
  use_fake(healthy());
  tide_allocator *a = create_ok("backend:cuda");
  tide_stream s, fork, other;
  assert_int_equal(tide_stream_create(a, &s), TIDE_OK);
  assert_int_equal(tide_stream_create(a, &fork), TIDE_OK);
  assert_int_equal(tide_stream_create(a, &other), TIDE_OK);
  f_stream *fs = (f_stream *)(void *)s, *ff = (f_stream *)(void *)fork;
  void *before = tide_malloc(a, 4 * MiB, s);
  assert_non_null(before);
  size_t used_before = fake.used;
  tide_pool *pool = NULL;
  assert_int_equal(tide_pool_create(a, &pool), TIDE_OK);

  fs->capturing = true; /* cudaStreamBeginCapture */
  fs->capture_id = 5;
  assert_int_equal(tide_capture_begin(a, s, pool), TIDE_OK);
  void *p = tide_malloc(a, 24 * MiB, s);
  assert_non_null(p);
  assert_true(fake.used > used_before); /* new pages, mapped in the capture */
  ff->capturing = true;                 /* forked into the capture */
  ff->capture_id = 5;
  void *q = tide_malloc(a, 3 * MiB, fork);
  void *r = tide_malloc(a, 3 * MiB, other);
  assert_non_null(q);
  assert_non_null(r);
  tide_stats ps;
  assert_int_equal(tide_pool_get_stats(pool, &ps), TIDE_OK);
  assert_int_equal(ps.allocated_bytes[0].current, 27 * MiB);
  assert_int_equal(tide_free(a, before, s), TIDE_OK); /* deferred */
  assert_int_equal(tide_free(a, q, s), TIDE_OK);      /* needs s: deferred */
  assert_int_equal(tide_free(a, p, s), TIDE_OK);      /* the pool's, on its stream */
  assert_int_equal(fake.captured_events, 0);
  /* s cannot be waited for, so its own cache stays; the pool keeps its pages. */
  assert_int_equal(tide_empty_cache(a), TIDE_ERR_NOT_READY);
  assert_int_equal(tide_pool_get_stats(pool, &ps), TIDE_OK);
  assert_true(ps.reserved_bytes[0].current >= (int64_t)(27 * MiB));

  fs->capturing = ff->capturing = false; /* cudaStreamEndCapture */
  assert_int_equal(tide_capture_end(a, s), TIDE_OK);
  tide_stats st = stats_of(a);
  /* before is free again; q waits for an event on s, recorded now: r and q. */
  assert_int_equal(st.active_bytes[0].current, 6 * MiB);
  assert_int_equal(fake.captured_events, 0);
  assert_int_equal(tide_free(a, r, other), TIDE_OK);
  assert_int_equal(tide_pool_release(pool), TIDE_OK);
  assert_int_equal(tide_pool_release(pool), TIDE_OK);
  assert_int_equal(tide_empty_cache(a), TIDE_OK);
  assert_int_equal(fake.used, 0);
  assert_true(fake.capture_queries > 0);
  for (tide_stream *x = (tide_stream[]){s, fork, other, NULL}; *x; x++)
    assert_int_equal(tide_stream_destroy(a, *x), TIDE_OK);
  assert_int_equal(tide_destroy(a), TIDE_OK);
  assert_fake_clean();
  assert_fake_empty();
}

static void churn(tide_allocator *a, tide_stream stream, uint64_t seed, int rounds) {
  enum { SLOTS = 24 };
  void *live[SLOTS] = {0};
  uint64_t x = seed;
  for (int i = 0; i < rounds; i++) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    unsigned slot = (unsigned)(x >> 33) % SLOTS;
    size_t size = (size_t)512 << ((x >> 40) % 16); /* 512 B .. 16 MiB */
    size += (size_t)((x >> 20) % 4096);
    if (live[slot]) assert_int_equal(tide_free(a, live[slot], stream), TIDE_OK);
    live[slot] = tide_malloc(a, size, stream);
    if (!live[slot]) fail_msg("tide_malloc(%zu): %s", size, tide_last_error());
  }
  for (int s = 0; s < SLOTS; s++)
    if (live[s]) assert_int_equal(tide_free(a, live[s], stream), TIDE_OK);
}

static void test_fake_allocator(void **state) {
  (void)state;
  static const char *const confs[] = {
      "backend:cuda",
      "backend:cuda,expandable_segments:false",
      "backend:cuda,page_size_mb:20",
  };
  for (size_t i = 0; i < sizeof confs / sizeof *confs; i++) {
    use_fake(healthy());
    tide_allocator *a = create_ok(confs[i]);
    tide_info info;
    assert_int_equal(tide_get_info(a, &info), TIDE_OK);
    assert_string_equal(info.backend, "cuda");
    assert_string_equal(info.device_name, "Fake GPU 0");
    assert_int_equal(info.granularity, 2 * MiB);
    assert_int_equal(info.total_memory, 4 * GiB);
    churn(a, NULL, 7 + i, 2000);
    assert_true(fake.used > 0);
    assert_int_equal(tide_empty_cache(a), TIDE_OK);
    assert_int_equal(fake.used, 0);
    assert_int_equal(fake.nmaps, 0);
    assert_int_equal(stats_of(a).reserved_bytes[0].current, 0);
    churn(a, NULL, 99, 200); /* and it grows again after emptying */
    assert_int_equal(tide_destroy(a), TIDE_OK);
    assert_fake_clean();
    assert_fake_empty();
  }
}

/* Pages released together are unmapped with one cuMemUnmap; a driver that
 * refuses such a span gets them one at a time from then on, with nothing
 * left mapped either way. */
static void test_fake_unmap_runs(void **state) {
  (void)state;
  for (int refuse = 0; refuse < 2; refuse++) {
    fake_config cfg = healthy();
    cfg.refuse_unmap_spans = refuse;
    use_fake(cfg);
    tide_allocator *a = create_ok("backend:cuda,load_handles:False");
    void *p = tide_malloc(a, 64 * MiB, NULL);
    assert_non_null(p);
    assert_int_equal(tide_free(a, p, NULL), TIDE_OK);
    assert_int_equal(tide_empty_cache(a), TIDE_OK);
    assert_int_equal(fake.nmaps, 0);
    assert_int_equal(fake.unmap_spans, refuse ? 0 : 1);
    assert_int_equal(fake.spans_refused, refuse ? 1 : 0);
    churn(a, NULL, 5, 500);
    assert_int_equal(tide_empty_cache(a), TIDE_OK);
    assert_int_equal(fake.nmaps, 0);
    assert_int_equal(fake.spans_refused, refuse ? 1 : 0); /* asked once */
    assert_int_equal(tide_destroy(a), TIDE_OK);
    assert_fake_clean();
    assert_fake_empty();
  }
}

/* A device whose memory runs out before the allocator's limit: the driver's
 * out-of-memory becomes the allocator's, with its full message. */
static void test_fake_out_of_memory(void **state) {
  (void)state;
  fake_config cfg = healthy();
  cfg.capacity = GiB;
  cfg.taken = 512 * MiB; /* another process holds half */
  use_fake(cfg);
  tide_allocator *a = create_ok("backend:cuda");
  void *p[8] = {0};
  int got = 0;
  while (got < 8 && (p[got] = tide_malloc(a, 128 * MiB, NULL)) != NULL) got++;
  assert_true(got >= 3 && got <= 4); /* 512 MiB were free */
  assert_int_equal(tide_last_status(), TIDE_ERR_OOM);
  static const char *const words[] = {"out of memory", "allocated", "reserved", "free"};
  for (size_t i = 0; i < sizeof words / sizeof *words; i++)
    if (!contains_word(tide_last_error(), words[i]))
      fail_msg("the message lacks \"%s\": \"%s\"", words[i], tide_last_error());
  assert_message_has("CUDA_ERROR_OUT_OF_MEMORY");
  for (int i = 0; i < got; i++) assert_int_equal(tide_free(a, p[i], NULL), TIDE_OK);
  void *again = tide_malloc(a, 128 * MiB, NULL);
  assert_non_null(again);
  assert_int_equal(tide_free(a, again, NULL), TIDE_OK);
  assert_int_equal(tide_destroy(a), TIDE_OK);
  assert_fake_clean();
  assert_fake_empty();
}

/* A block used by another stream is not reused until that stream's work is
 * done; the events come from the fake driver. */
static void test_fake_stream_ordered_free(void **state) {
  (void)state;
  use_fake(healthy());
  tide_allocator *a = create_ok("backend:cuda");
  tide_stream other;
  assert_int_equal(tide_stream_create(a, &other), TIDE_OK);
  f_stream *fs = (f_stream *)(void *)other;
  void *p = tide_malloc(a, 4 * MiB, NULL);
  assert_non_null(p);
  fs->held = true; /* a long kernel on `other` */
  assert_int_equal(tide_record_stream(a, p, other), TIDE_OK);
  assert_int_equal(tide_free(a, p, NULL), TIDE_OK);
  void *q = tide_malloc(a, 4 * MiB, NULL);
  assert_non_null(q);
  assert_true((uintptr_t)q + 4 * MiB <= (uintptr_t)p || (uintptr_t)p + 4 * MiB <= (uintptr_t)q);
  assert_int_equal(stats_of(a).active_blocks[0].current, 2);
  fs->completed = fs->submitted; /* the kernel ends */
  fs->held = false;
  assert_int_equal(tide_free(a, q, NULL), TIDE_OK);
  assert_int_equal(tide_empty_cache(a), TIDE_OK);
  tide_stats st = stats_of(a);
  assert_int_equal(st.active_blocks[0].current, 0);
  assert_int_equal(st.reserved_bytes[0].current, 0);
  assert_int_equal(tide_stream_destroy(a, other), TIDE_OK);
  assert_int_equal(tide_destroy(a), TIDE_OK);
  assert_fake_clean();
  assert_fake_empty();
}

/* A stream of another context gets no arena: nothing is allocated on it. */
static void test_fake_foreign_stream(void **state) {
  (void)state;
  use_fake(healthy());
  tide_allocator *a = create_ok("backend:cuda");
  f_stream foreign = {.flags = F_NON_BLOCKING, .ctx = &user_ctx};
  assert_null(tide_malloc(a, MiB, (tide_stream)(void *)&foreign));
  assert_int_equal(tide_last_status(), TIDE_ERR_INVALID);
  assert_message_has("not a stream of this device");
  void *p = tide_malloc(a, MiB, NULL);
  assert_non_null(p);
  assert_int_equal(tide_free(a, p, NULL), TIDE_OK);
  assert_int_equal(tide_destroy(a), TIDE_OK);
  assert_fake_clean();
  assert_fake_empty();
}

typedef struct churner {
  tide_allocator *a;
  uint64_t seed;
  int failed;
  char why[256];
} churner;

static void *churn_thread(void *arg) {
  churner *c = arg;
  tide_stream s = NULL;
  if (tide_stream_create(c->a, &s) != TIDE_OK) {
    c->failed = 1;
    return NULL;
  }
  void *live[16] = {0};
  uint64_t x = c->seed;
  for (int i = 0; i < 3000 && !c->failed; i++) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    unsigned slot = (unsigned)(x >> 33) % 16;
    size_t size = (size_t)512 << ((x >> 40) % 13); /* 512 B .. 2 MiB */
    if (live[slot] && tide_free(c->a, live[slot], s) != TIDE_OK) c->failed = 2;
    live[slot] = tide_malloc(c->a, size, s);
    if (!live[slot]) c->failed = 3;
    if (ctx_depth != 0 || capture_mode != F_MODE_GLOBAL) c->failed = 4;
  }
  for (int i = 0; i < 16; i++)
    if (live[i] && tide_free(c->a, live[i], s) != TIDE_OK) c->failed = 5;
  if (tide_stream_synchronize(c->a, s) != TIDE_OK) c->failed = 6;
  if (tide_empty_cache(c->a) != TIDE_OK) c->failed = 7;
  if (tide_stream_destroy(c->a, s) != TIDE_OK) c->failed = 8;
  if (c->failed) snprintf(c->why, sizeof c->why, "%s", tide_last_error());
  return NULL;
}

static void test_fake_allocator_from_threads(void **state) {
  (void)state;
  use_fake(healthy());
  tide_allocator *a = create_ok("backend:cuda");
  enum { THREADS = 6 };
  churner c[THREADS];
  pthread_t t[THREADS];
  for (int i = 0; i < THREADS; i++) {
    c[i] = (churner){.a = a, .seed = 1000u + (uint64_t)i};
    assert_int_equal(pthread_create(&t[i], NULL, churn_thread, &c[i]), 0);
  }
  for (int i = 0; i < THREADS; i++) {
    pthread_join(t[i], NULL);
    if (c[i].failed) fail_msg("thread %d failed at step %d: %s", i, c[i].failed, c[i].why);
  }
  assert_int_equal(tide_empty_cache(a), TIDE_OK);
  assert_int_equal(fake.used, 0);
  assert_int_equal(tide_destroy(a), TIDE_OK);
  assert_fake_clean();
  assert_fake_empty();
}

int main(void) {
  const struct CMUnitTest tests[] = {
      /* First: nothing may have loaded libcuda yet. */
      cmocka_unit_test(test_libcuda_not_linked),
      cmocka_unit_test(test_real_backend_cuda),
      cmocka_unit_test(test_real_backend_auto),
      cmocka_unit_test_teardown(test_fake_driver_too_old, teardown_fake),
      cmocka_unit_test_teardown(test_fake_init_fails, teardown_fake),
      cmocka_unit_test_teardown(test_fake_missing_entry_point, teardown_fake),
      cmocka_unit_test_teardown(test_fake_no_device, teardown_fake),
      cmocka_unit_test_teardown(test_fake_device_unusable, teardown_fake),
      cmocka_unit_test_teardown(test_fake_abi_and_flags, teardown_fake),
      cmocka_unit_test_teardown(test_fake_queries, teardown_fake),
      cmocka_unit_test_teardown(test_fake_memory_calls, teardown_fake),
      cmocka_unit_test_teardown(test_fake_context_and_mode_restored, teardown_fake),
      cmocka_unit_test_teardown(test_fake_streams_and_events, teardown_fake),
      cmocka_unit_test_teardown(test_fake_capture_status, teardown_fake),
      cmocka_unit_test_teardown(test_fake_capture_pool, teardown_fake),
      cmocka_unit_test_teardown(test_fake_allocator, teardown_fake),
      cmocka_unit_test_teardown(test_fake_out_of_memory, teardown_fake),
      cmocka_unit_test_teardown(test_fake_unmap_runs, teardown_fake),
      cmocka_unit_test_teardown(test_fake_stream_ordered_free, teardown_fake),
      cmocka_unit_test_teardown(test_fake_foreign_stream, teardown_fake),
      cmocka_unit_test_teardown(test_fake_sharing, teardown_fake),
      cmocka_unit_test_teardown(test_fake_allocator_from_threads, teardown_fake),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
