/* backend_cuda.c: the CUDA backend, one GPU through the CUDA driver API.
 *
 * The driver is loaded at run time, never linked: dlopen("libcuda.so.1"),
 * then every entry point through cuGetProcAddress (its _v2 form where the
 * driver has it) at the ABI of CUDA 12.0, or of the driver if it is older, so
 * the signatures below stay right whatever driver runs them. cuda.h is read
 * for its types only. The library therefore loads on machines with no
 * driver; there, and wherever else CUDA cannot be used, opening the backend
 * fails with TIDE_ERR_UNAVAILABLE and a message that says why.
 *
 * How it meets the driver:
 * - Memory: cuMemAddressReserve / cuMemCreate (pinned, on the device) /
 *   cuMemMap / cuMemSetAccess / cuMemUnmap / cuMemRelease / cuMemAddressFree,
 *   at the minimum granularity.
 * - Access: read-write for this device and, with peer_access (the default),
 *   for every other device that cuDeviceCanAccessPeer says can reach this
 *   one's memory, in one cuMemSetAccess call. The runtime's peer switches
 *   (cudaDeviceEnablePeerAccess) do not cover memory mapped this way, so
 *   without it a kernel on another GPU could not touch our blocks. The
 *   peers are found once, when the backend opens.
 * - Pinned host memory: cuMemHostAlloc (portable and device-mapped, as
 *   PyTorch's host allocator asks) / cuMemFreeHost. Copies: cuMemcpyAsync,
 *   which with unified addressing finds the direction from the pointers.
 *   Waiting for the whole device (a capture pool's memory given back):
 *   cuCtxSynchronize. These entry points, cuDeviceCanAccessPeer,
 *   cuStreamGetCaptureInfo and cuGraphNodeGetDependencies are optional: a
 *   driver without them still serves device memory, and the call that needs
 *   one says that the driver lacks it (without cuStreamGetCaptureInfo no
 *   stream is seen being captured; the two graph queries serve
 *   graph_capture_record_stream_reuse, at the ABI of 12.0, without edge
 *   data).
 * - Context: the device's primary context, retained while the backend is
 *   open, so that memory and streams are shared with the CUDA runtime (and
 *   PyTorch). A call makes it current only if the calling thread has another
 *   (or none), and restores what it found.
 * - Graph capture: every call runs with the thread in relaxed capture mode
 *   (cuThreadExchangeStreamCaptureMode, as PyTorch does around cudaMalloc), so
 *   mapping pages while a stream is being captured does not invalidate the
 *   capture. Waiting for a stream that is capturing, or for an event recorded
 *   in a capture, cannot work; those calls answer TIDE_ERR_NOT_READY with a
 *   message instead of breaking the capture. Whether a stream is being
 *   captured, and into which capture, is cuStreamGetCaptureInfo's answer
 *   (never asked of the legacy stream, which cannot be captured).
 * - Streams it creates are non-blocking, like PyTorch's: they never wait for
 *   the legacy default stream, which the allocator does not rely on (it orders
 *   reuse with events), and a capture on them is not broken by work another
 *   thread queues on the legacy stream. NULL is the legacy default stream.
 *
 * After opening, the backend's state does not change, so calls from several
 * threads need no lock; only reservations with an alignment that is not a
 * power of two (which the driver cannot honour) keep a small table. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "base/internal.h"

/* -DTIDE_WITHOUT_CUDA builds the stub even where cuda.h is around. */
#if defined(__has_include) && !defined(TIDE_WITHOUT_CUDA)
#if __has_include(<cuda.h>)
#define TIDE_HAVE_CUDA_H 1
#endif
#endif

/* The headers must know cuGetProcAddress (CUDA 11.3). */
#ifdef TIDE_HAVE_CUDA_H
#include <cuda.h>
#if !defined(CUDA_VERSION) || CUDA_VERSION < 11030
#undef TIDE_HAVE_CUDA_H
#define TIDE_CUDA_H_TOO_OLD 1
#endif
#endif

/* Tests: resolve the driver's symbols with `lookup` (what dlsym on
 * libcuda.so.1 would give for a name) instead of loading libcuda.so.1; NULL
 * goes back to the real driver. What was loaded before is forgotten, so no
 * CUDA backend may be open across this call. */
typedef void (*_tide_cuda_fn)(void);
void _tide_cuda_set_driver_lookup(_tide_cuda_fn (*lookup)(const char *name));

#ifndef TIDE_HAVE_CUDA_H

/* ------------------------------------------------------------------------ */
/* Built without cuda.h: the backend exists, and says why it cannot be used  */
/* ------------------------------------------------------------------------ */

static int built_without_cuda(void) {
#ifdef TIDE_CUDA_H_TOO_OLD
  const char *why = "the cuda.h found at build time is older than CUDA 11.3";
#else
  const char *why = "cuda.h was not found at build time";
#endif
  return _tide_error_set(TIDE_ERR_UNAVAILABLE,
                         "CUDA is unavailable: this tidalloc was built without CUDA headers "
                         "(%s; set CUDA_HOME to a CUDA toolkit and rebuild), so it has no CUDA "
                         "backend; use backend:host",
                         why);
}

int _tide_cuda_open(const _tide_conf_values *conf, int device, _tide_backend *out) {
  (void)conf;
  (void)device;
  (void)out;
  return built_without_cuda();
}

bool _tide_cuda_usable(void) {
  built_without_cuda();
  return false;
}

void _tide_cuda_set_driver_lookup(_tide_cuda_fn (*lookup)(const char *name)) { (void)lookup; }

#else /* TIDE_HAVE_CUDA_H */

_Static_assert(sizeof(void *) == sizeof(_tide_cuda_fn),
               "driver entry points are passed around as data pointers");
_Static_assert(sizeof(CUdeviceptr) <= sizeof(uintptr_t), "device pointers fit uintptr_t");
_Static_assert(sizeof(CUmemGenericAllocationHandle) <= sizeof(_tide_handle),
               "allocation handles fit _tide_handle");

/* The oldest driver with cuGetProcAddress, and the ABI we ask entry points
 * for: every function below has kept its signature since (at least) 12.0. */
#define MIN_DRIVER_VERSION 11030
#define ABI_VERSION 12000

/* ------------------------------------------------------------------------ */
/* The driver's entry points                                                 */
/* ------------------------------------------------------------------------ */

/* The status is a CUdriverProcAddressQueryResult (an int; 0: found), a type
 * that headers before 12.0 lack. */
typedef CUresult (*get_proc_v2_fn)(const char *, void **, int, cuuint64_t, int *);
typedef CUresult (*get_proc_v1_fn)(const char *, void **, int, cuuint64_t);

typedef struct cuda_driver {
  int version; /* 12080 for CUDA 12.8 */
  int device_count;
  /* Found by name in libcuda.so.1. */
  CUresult (*init)(unsigned int);
  CUresult (*driver_get_version)(int *);
  CUresult (*get_error_name)(CUresult, const char **);
  CUresult (*get_error_string)(CUresult, const char **);
  get_proc_v2_fn get_proc_v2;
  get_proc_v1_fn get_proc_v1;
  /* Found through cuGetProcAddress. */
  CUresult (*device_get)(CUdevice *, int);
  CUresult (*device_get_count)(int *);
  CUresult (*device_get_name)(char *, int, CUdevice);
  CUresult (*device_get_attribute)(int *, CUdevice_attribute, CUdevice);
  CUresult (*primary_ctx_retain)(CUcontext *, CUdevice);
  CUresult (*primary_ctx_release)(CUdevice);
  CUresult (*ctx_get_current)(CUcontext *);
  CUresult (*ctx_push_current)(CUcontext);
  CUresult (*ctx_pop_current)(CUcontext *);
  CUresult (*exchange_capture_mode)(CUstreamCaptureMode *);
  CUresult (*mem_get_info)(size_t *, size_t *);
  CUresult (*mem_get_granularity)(size_t *, const CUmemAllocationProp *,
                                  CUmemAllocationGranularity_flags);
  CUresult (*mem_address_reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*mem_address_free)(CUdeviceptr, size_t);
  CUresult (*mem_create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                         unsigned long long);
  CUresult (*mem_release)(CUmemGenericAllocationHandle);
  CUresult (*mem_map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                      unsigned long long);
  CUresult (*mem_set_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
  CUresult (*mem_unmap)(CUdeviceptr, size_t);
  CUresult (*stream_create)(CUstream *, unsigned int);
  CUresult (*stream_destroy)(CUstream);
  CUresult (*stream_synchronize)(CUstream);
  CUresult (*stream_is_capturing)(CUstream, CUstreamCaptureStatus *);
  CUresult (*stream_get_ctx)(CUstream, CUcontext *);
  CUresult (*event_create)(CUevent *, unsigned int);
  CUresult (*event_destroy)(CUevent);
  CUresult (*event_record)(CUevent, CUstream);
  CUresult (*event_query)(CUevent);
  CUresult (*event_synchronize)(CUevent);
  /* Optional: NULL when the driver lacks them. */
  CUresult (*ctx_synchronize)(void);
  CUresult (*device_can_access_peer)(int *, CUdevice, CUdevice);
  CUresult (*memcpy_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*mem_host_alloc)(void **, size_t, unsigned int);
  CUresult (*mem_free_host)(void *);
  /* The signature since 11.3 (cuStreamGetCaptureInfo_v2), which the ABI
   * asked for (12.0, or the driver's, at least 11.3) gets. */
  CUresult (*stream_get_capture_info)(CUstream, CUstreamCaptureStatus *, cuuint64_t *, CUgraph *,
                                      const CUgraphNode **, size_t *);
  /* The signature of 12.0, without edge data (a graph with edges that carry
   * data answers CUDA_ERROR_LOSSY_QUERY, and no reuse is proven there). */
  CUresult (*graph_node_get_dependencies)(CUgraphNode, CUgraphNode *, size_t *);
  CUresult (*mem_export)(void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                         unsigned long long);
  CUresult (*mem_import)(CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType);
} cuda_driver;

typedef struct driver_symbol {
  const char *name; /* the base name cuGetProcAddress wants */
  size_t offset;    /* of the field in cuda_driver */
} driver_symbol;

#define SYMBOL(name, field)                                                                        \
  { name, offsetof(cuda_driver, field) }
static const driver_symbol proc_symbols[] = {
    SYMBOL("cuDeviceGet", device_get),
    SYMBOL("cuDeviceGetCount", device_get_count),
    SYMBOL("cuDeviceGetName", device_get_name),
    SYMBOL("cuDeviceGetAttribute", device_get_attribute),
    SYMBOL("cuDevicePrimaryCtxRetain", primary_ctx_retain),
    SYMBOL("cuDevicePrimaryCtxRelease", primary_ctx_release),
    SYMBOL("cuCtxGetCurrent", ctx_get_current),
    SYMBOL("cuCtxPushCurrent", ctx_push_current),
    SYMBOL("cuCtxPopCurrent", ctx_pop_current),
    SYMBOL("cuThreadExchangeStreamCaptureMode", exchange_capture_mode),
    SYMBOL("cuMemGetInfo", mem_get_info),
    SYMBOL("cuMemGetAllocationGranularity", mem_get_granularity),
    SYMBOL("cuMemAddressReserve", mem_address_reserve),
    SYMBOL("cuMemAddressFree", mem_address_free),
    SYMBOL("cuMemCreate", mem_create),
    SYMBOL("cuMemRelease", mem_release),
    SYMBOL("cuMemMap", mem_map),
    SYMBOL("cuMemSetAccess", mem_set_access),
    SYMBOL("cuMemUnmap", mem_unmap),
    SYMBOL("cuStreamCreate", stream_create),
    SYMBOL("cuStreamDestroy", stream_destroy),
    SYMBOL("cuStreamSynchronize", stream_synchronize),
    SYMBOL("cuStreamIsCapturing", stream_is_capturing),
    SYMBOL("cuStreamGetCtx", stream_get_ctx),
    SYMBOL("cuEventCreate", event_create),
    SYMBOL("cuEventDestroy", event_destroy),
    SYMBOL("cuEventRecord", event_record),
    SYMBOL("cuEventQuery", event_query),
    SYMBOL("cuEventSynchronize", event_synchronize),
};
static const driver_symbol optional_symbols[] = {
    SYMBOL("cuCtxSynchronize", ctx_synchronize),
    SYMBOL("cuDeviceCanAccessPeer", device_can_access_peer),
    SYMBOL("cuMemcpyAsync", memcpy_async),
    SYMBOL("cuMemHostAlloc", mem_host_alloc),
    SYMBOL("cuMemFreeHost", mem_free_host),
    SYMBOL("cuStreamGetCaptureInfo", stream_get_capture_info),
    SYMBOL("cuGraphNodeGetDependencies", graph_node_get_dependencies),
    SYMBOL("cuMemExportToShareableHandle", mem_export),
    SYMBOL("cuMemImportFromShareableHandle", mem_import),
};
#undef SYMBOL

/* ------------------------------------------------------------------------ */
/* Loading the driver, once per process                                      */
/* ------------------------------------------------------------------------ */

enum { DRIVER_UNTRIED = 0, DRIVER_LOADED = 1, DRIVER_FAILED = 2 };

static pthread_mutex_t driver_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic int driver_state = DRIVER_UNTRIED;
static cuda_driver driver;       /* written once, under driver_lock, before LOADED */
static char driver_failure[512]; /* why, when FAILED */
static _tide_cuda_fn (*driver_lookup)(const char *name); /* tests only */
static void *libcuda; /* never closed: the runtime may share it */

/* The text of a driver error: "CUDA_ERROR_OUT_OF_MEMORY (out of memory)". */
static const char *error_text(const cuda_driver *drv, CUresult r, char *buf, size_t len) {
  const char *name = NULL, *text = NULL;
  if (drv->get_error_name && drv->get_error_name(r, &name) != CUDA_SUCCESS) name = NULL;
  if (drv->get_error_string && drv->get_error_string(r, &text) != CUDA_SUCCESS) text = NULL;
  if (name && text)
    snprintf(buf, len, "%s (%s)", name, text);
  else
    snprintf(buf, len, "CUresult %d", (int)r);
  return buf;
}

static void set_entry(cuda_driver *drv, size_t offset, void *fn) {
  memcpy((char *)drv + offset, &fn, sizeof fn);
}

/* What libcuda.so.1 exports under `name` (or the test's stand-in). */
static void *library_symbol(const char *name) {
  if (driver_lookup) {
    _tide_cuda_fn fn = driver_lookup(name);
    void *p;
    memcpy(&p, &fn, sizeof p);
    return p;
  }
  return dlsym(libcuda, name);
}

static bool open_library(char *why, size_t len) {
  if (driver_lookup || libcuda) return true;
  dlerror();
  libcuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (libcuda) return true;
  const char *err = dlerror();
  snprintf(why, len,
           "CUDA is unavailable: the NVIDIA driver library libcuda.so.1 could not be loaded "
           "(%s); install the NVIDIA driver, or use backend:host",
           err ? err : "no reason given");
  return false;
}

static bool find_library_symbols(cuda_driver *drv, char *why, size_t len) {
  static const struct {
    const char *name;
    size_t offset;
  } names[] = {
      {"cuInit", offsetof(cuda_driver, init)},
      {"cuDriverGetVersion", offsetof(cuda_driver, driver_get_version)},
      {"cuGetErrorName", offsetof(cuda_driver, get_error_name)},
      {"cuGetErrorString", offsetof(cuda_driver, get_error_string)},
      {"cuGetProcAddress_v2", offsetof(cuda_driver, get_proc_v2)},
      {"cuGetProcAddress", offsetof(cuda_driver, get_proc_v1)},
  };
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    set_entry(drv, names[i].offset, library_symbol(names[i].name));
  if (!drv->init || !drv->driver_get_version) {
    snprintf(why, len,
             "CUDA is unavailable: libcuda.so.1 has no %s, so it is not a usable NVIDIA driver",
             drv->init ? "cuDriverGetVersion" : "cuInit");
    return false;
  }
  return true;
}

static bool check_version(cuda_driver *drv, char *why, size_t len) {
  char err[160];
  CUresult r = drv->driver_get_version(&drv->version);
  if (r != CUDA_SUCCESS) {
    snprintf(why, len, "CUDA is unavailable: cuDriverGetVersion failed with %s",
             error_text(drv, r, err, sizeof err));
    return false;
  }
  if (drv->version < MIN_DRIVER_VERSION || (!drv->get_proc_v2 && !drv->get_proc_v1)) {
    snprintf(why, len,
             "CUDA is unavailable: the NVIDIA driver is too old: it supports CUDA %d.%d, and "
             "tidalloc needs a driver for CUDA %d.%d or newer (with cuGetProcAddress); "
             "update the driver, or use backend:host",
             drv->version / 1000, drv->version % 1000 / 10, MIN_DRIVER_VERSION / 1000,
             MIN_DRIVER_VERSION % 1000 / 10);
    return false;
  }
  return true;
}

static CUresult get_proc(const cuda_driver *drv, const char *name, void **fn) {
  int abi = drv->version < ABI_VERSION ? drv->version : ABI_VERSION;
  *fn = NULL;
  if (drv->get_proc_v2) {
    int found = 0;
    CUresult r = drv->get_proc_v2(name, fn, abi, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &found);
    if (r == CUDA_SUCCESS && found != 0) *fn = NULL;
    return r;
  }
  return drv->get_proc_v1(name, fn, abi, CU_GET_PROC_ADDRESS_LEGACY_STREAM);
}

static bool find_proc_symbols(cuda_driver *drv, char *why, size_t len) {
  char err[160];
  for (size_t i = 0; i < sizeof proc_symbols / sizeof proc_symbols[0]; i++) {
    void *fn = NULL;
    CUresult r = get_proc(drv, proc_symbols[i].name, &fn);
    if (r != CUDA_SUCCESS || !fn) {
      snprintf(why, len,
               "CUDA is unavailable: the NVIDIA driver (CUDA %d.%d) does not provide %s%s%s; "
               "update the driver, or use backend:host",
               drv->version / 1000, drv->version % 1000 / 10, proc_symbols[i].name,
               r != CUDA_SUCCESS ? ": cuGetProcAddress failed with " : "",
               r != CUDA_SUCCESS ? error_text(drv, r, err, sizeof err) : "");
      return false;
    }
    set_entry(drv, proc_symbols[i].offset, fn);
  }
  return true;
}

/* What the driver lacks stays NULL; the calls that need it say so. */
static void find_optional_symbols(cuda_driver *drv) {
  for (size_t i = 0; i < sizeof optional_symbols / sizeof optional_symbols[0]; i++) {
    void *fn = NULL;
    if (get_proc(drv, optional_symbols[i].name, &fn) != CUDA_SUCCESS) fn = NULL;
    set_entry(drv, optional_symbols[i].offset, fn);
  }
}

static bool count_devices(cuda_driver *drv, char *why, size_t len) {
  char err[160];
  CUresult r = drv->device_get_count(&drv->device_count);
  if (r != CUDA_SUCCESS) {
    snprintf(why, len, "CUDA is unavailable: cuDeviceGetCount failed with %s",
             error_text(drv, r, err, sizeof err));
    return false;
  }
  if (drv->device_count < 1) {
    const char *visible = getenv("CUDA_VISIBLE_DEVICES");
    snprintf(why, len,
             "CUDA is unavailable: the driver sees no CUDA device%s%s%s; use backend:host",
             visible ? " (CUDA_VISIBLE_DEVICES=" : "", visible ? visible : "", visible ? ")" : "");
    return false;
  }
  return true;
}

static bool load(cuda_driver *drv, char *why, size_t len) {
  char err[160];
  memset(drv, 0, sizeof *drv);
  if (!open_library(why, len) || !find_library_symbols(drv, why, len) ||
      !check_version(drv, why, len))
    return false;
  CUresult r = drv->init(0);
  if (r != CUDA_SUCCESS) {
    snprintf(why, len, "CUDA is unavailable: cuInit failed with %s%s; use backend:host",
             error_text(drv, r, err, sizeof err),
             r == CUDA_ERROR_NO_DEVICE ? ": no GPU is visible to this process" : "");
    return false;
  }
  if (!find_proc_symbols(drv, why, len)) return false;
  find_optional_symbols(drv);
  return count_devices(drv, why, len);
}

/* The driver, loaded on first use; NULL with the reason set if it cannot be. */
static const cuda_driver *driver_get(void) {
  int state = atomic_load_explicit(&driver_state, memory_order_acquire);
  if (TIDE_UNLIKELY(state == DRIVER_UNTRIED)) {
    pthread_mutex_lock(&driver_lock);
    state = atomic_load_explicit(&driver_state, memory_order_relaxed);
    if (state == DRIVER_UNTRIED) {
      state = load(&driver, driver_failure, sizeof driver_failure) ? DRIVER_LOADED : DRIVER_FAILED;
      atomic_store_explicit(&driver_state, state, memory_order_release);
    }
    pthread_mutex_unlock(&driver_lock);
  }
  if (state == DRIVER_LOADED) return &driver;
  _tide_error_set(TIDE_ERR_UNAVAILABLE, "%s", driver_failure);
  return NULL;
}

void _tide_cuda_set_driver_lookup(_tide_cuda_fn (*lookup)(const char *name)) {
  pthread_mutex_lock(&driver_lock);
  driver_lookup = lookup;
  atomic_store_explicit(&driver_state, DRIVER_UNTRIED, memory_order_release);
  pthread_mutex_unlock(&driver_lock);
}

bool _tide_cuda_usable(void) { return driver_get() != NULL; }

/* ------------------------------------------------------------------------ */
/* A device                                                                  */
/* ------------------------------------------------------------------------ */

/* A reservation moved up to honour an alignment the driver cannot (not a
 * power of two): unreserve must free what was really reserved. */
typedef struct shifted_range {
  uintptr_t addr;   /* what reserve returned */
  CUdeviceptr base; /* what the driver reserved */
  size_t size;
} shifted_range;

typedef struct cuda_device {
  cuda_driver drv; /* a copy: the device never depends on later loads */
  CUdevice dev;
  int ordinal;
  CUcontext ctx; /* the primary context, retained */
  size_t granularity;
  /* Physical memory is created exportable as a POSIX file descriptor: the
   * device supports it, and no creation has been refused for asking. */
  _Atomic bool shareable;
  /* The driver refused one cuMemUnmap over several mappings: runs are
   * unmapped a mapping at a time from then on. */
  _Atomic bool unmap_spans_refused;
  /* Who may read and write our memory: this device, then its peers. */
  CUmemAccessDesc *access;
  size_t naccess;
  pthread_mutex_t shifted_lock;
  shifted_range *shifted;
  size_t nshifted, shifted_cap;
} cuda_device;

/* Report a failed driver call: "CUDA device 0: <what>: cuMemCreate failed
 * with CUDA_ERROR_OUT_OF_MEMORY (out of memory)". Out of memory becomes
 * TIDE_ERR_OOM, a handle the driver does not know (a destroyed stream, say)
 * TIDE_ERR_INVALID, as on the host backend, and every other failure
 * TIDE_ERR_BACKEND. */
static int fail(const cuda_device *d, CUresult r, const char *call, const char *fmt, ...)
    TIDE_PRINTF(4, 5);
static int fail(const cuda_device *d, CUresult r, const char *call, const char *fmt, ...) {
  char what[256], err[160];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  tide_status status = r == CUDA_ERROR_OUT_OF_MEMORY ? TIDE_ERR_OOM
                       : r == CUDA_ERROR_INVALID_HANDLE || r == CUDA_ERROR_CONTEXT_IS_DESTROYED
                           ? TIDE_ERR_INVALID
                           : TIDE_ERR_BACKEND;
  const char *hint = "";
  if (r == CUDA_ERROR_DEINITIALIZED)
    hint = "; the CUDA driver is shutting down (is the allocator used from an exit handler?)";
  else if (r == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED || r == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
    hint = "; a stream is being captured into a CUDA graph";
  return _tide_error_set(status, "CUDA device %d: %s: %s failed with %s%s", d->ordinal, what, call,
                         error_text(&d->drv, r, err, sizeof err), hint);
}

/* The sequence of every driver operation: enter a scope (the primary
 * context current, pushed only if the thread had another or none, and the
 * thread in relaxed capture mode), make the call, leave (restoring both),
 * and report a failure with fail(). SCOPED gives the call's result, or the
 * result of whichever call refused the scope; `call` of the scope names the
 * driver function that gave it, for the message. */
typedef struct scope {
  bool pushed;
  bool exchanged;
  CUstreamCaptureMode mode; /* the thread's, to restore */
  CUresult result;          /* why the scope could not be entered */
  const char *call;         /* the driver function whose result counts */
} scope;

/* Enter the scope for the driver function `call`: false, or true when the
 * context could not be made current (s->result and s->call say why). */
static bool cannot_enter(const cuda_device *d, scope *s, const char *call) {
  CUcontext current = NULL;
  s->pushed = s->exchanged = false;
  s->call = "cuCtxGetCurrent";
  s->result = d->drv.ctx_get_current(&current);
  if (s->result != CUDA_SUCCESS) return true;
  if (current != d->ctx) {
    s->call = "cuCtxPushCurrent";
    s->result = d->drv.ctx_push_current(d->ctx);
    if (s->result != CUDA_SUCCESS) return true;
    s->pushed = true;
  }
  s->mode = CU_STREAM_CAPTURE_MODE_RELAXED;
  /* Without the exchange the call still runs, as the thread's mode allows. */
  s->exchanged = d->drv.exchange_capture_mode(&s->mode) == CUDA_SUCCESS;
  s->call = call;
  return false;
}

/* Leave the scope; gives back `r`, the result of the call made in it. */
static CUresult leave(const cuda_device *d, scope *s, CUresult r) {
  if (s->exchanged) d->drv.exchange_capture_mode(&s->mode);
  if (s->pushed) {
    CUcontext popped;
    d->drv.ctx_pop_current(&popped);
  }
  return r;
}

/* `expr` (a CUresult) made inside a scope for the driver function `call`;
 * not evaluated when the scope cannot be entered. */
#define SCOPED(d, s, call, expr)                                                                   \
  (cannot_enter((d), (s), (call)) ? (s)->result : leave((d), (s), (expr)))

static const char *bytes_text(uint64_t bytes, char *buf) {
  return _tide_format_bytes(bytes, buf, 32);
}

static CUmemAllocationProp allocation_prop(const cuda_device *d, bool shareable) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes =
      shareable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = d->ordinal;
  return prop;
}

/* ------------------------------------------------------------------------ */
/* Device queries                                                            */
/* ------------------------------------------------------------------------ */

static int cuda_device_count(void *ctx, int *count) {
  cuda_device *d = ctx;
  if (!count) return _tide_error_set(TIDE_ERR_INVALID, "device_count: NULL output");
  *count = d->drv.device_count;
  return TIDE_OK;
}

static int cuda_device_name(void *ctx, char *buf, size_t len) {
  cuda_device *d = ctx;
  if (!buf || len == 0) return _tide_error_set(TIDE_ERR_INVALID, "device_name: no buffer");
  CUresult r = d->drv.device_get_name(buf, len > INT32_MAX ? INT32_MAX : (int)len, d->dev);
  if (r != CUDA_SUCCESS) {
    buf[0] = '\0';
    return fail(d, r, "cuDeviceGetName", "reading the device's name");
  }
  buf[len - 1] = '\0';
  return TIDE_OK;
}

static int cuda_granularity(void *ctx, size_t *bytes) {
  cuda_device *d = ctx;
  if (!bytes) return _tide_error_set(TIDE_ERR_INVALID, "granularity: NULL output");
  *bytes = d->granularity;
  return TIDE_OK;
}

static int cuda_mem_info(void *ctx, size_t *free_bytes, size_t *total_bytes) {
  cuda_device *d = ctx;
  if (!free_bytes || !total_bytes)
    return _tide_error_set(TIDE_ERR_INVALID, "mem_info: NULL output");
  scope s;
  CUresult r = SCOPED(d, &s, "cuMemGetInfo", d->drv.mem_get_info(free_bytes, total_bytes));
  return r == CUDA_SUCCESS ? TIDE_OK : fail(d, r, s.call, "reading free memory");
}

/* ------------------------------------------------------------------------ */
/* Address space                                                             */
/* ------------------------------------------------------------------------ */

static bool power_of_two(size_t x) { return x && (x & (x - 1)) == 0; }

static int remember_shifted(cuda_device *d, shifted_range range) {
  pthread_mutex_lock(&d->shifted_lock);
  if (d->nshifted == d->shifted_cap) {
    size_t cap = d->shifted_cap ? d->shifted_cap * 2 : 8;
    shifted_range *grown = realloc(d->shifted, cap * sizeof *grown);
    if (!grown) {
      pthread_mutex_unlock(&d->shifted_lock);
      return _tide_error_set(TIDE_ERR_OOM, "reserve: out of host memory for its records");
    }
    d->shifted = grown;
    d->shifted_cap = cap;
  }
  d->shifted[d->nshifted++] = range;
  pthread_mutex_unlock(&d->shifted_lock);
  return TIDE_OK;
}

/* The range the driver really reserved for [addr, addr+size). */
static void really_reserved(cuda_device *d, uintptr_t addr, size_t size, CUdeviceptr *base,
                            size_t *total) {
  *base = (CUdeviceptr)addr;
  *total = size;
  pthread_mutex_lock(&d->shifted_lock);
  for (size_t i = 0; i < d->nshifted; i++) {
    if (d->shifted[i].addr == addr) {
      *base = d->shifted[i].base;
      *total = d->shifted[i].size;
      break;
    }
  }
  pthread_mutex_unlock(&d->shifted_lock);
}

static void forget_shifted(cuda_device *d, uintptr_t addr) {
  pthread_mutex_lock(&d->shifted_lock);
  for (size_t i = 0; i < d->nshifted; i++) {
    if (d->shifted[i].addr == addr) {
      d->shifted[i] = d->shifted[--d->nshifted];
      break;
    }
  }
  pthread_mutex_unlock(&d->shifted_lock);
}

static int cuda_reserve(void *ctx, size_t size, size_t align, uintptr_t *addr) {
  cuda_device *d = ctx;
  char a[32], b[32], g[32];
  if (!addr) return _tide_error_set(TIDE_ERR_INVALID, "reserve: NULL output");
  if (align == 0) align = d->granularity;
  if (size == 0 || size % d->granularity || align % d->granularity)
    return _tide_error_set(TIDE_ERR_BACKEND,
                           "reserve: size %zu and alignment %zu must be multiples of the "
                           "granularity (%s), and the size not 0",
                           size, align, bytes_text(d->granularity, g));
  /* The driver aligns to powers of two only: reserve more and move up. */
  bool shift = !power_of_two(align);
  size_t total = size;
  if (shift && __builtin_add_overflow(size, align, &total))
    return _tide_error_set(TIDE_ERR_OOM,
                           "reserve: %zu bytes aligned to %zu exceed the address "
                           "space",
                           size, align);
  scope s;
  CUdeviceptr base = 0;
  CUresult r = SCOPED(d, &s, "cuMemAddressReserve",
                      d->drv.mem_address_reserve(&base, total, shift ? 0 : align, 0, 0));
  if (r != CUDA_SUCCESS)
    return fail(d, r, s.call, "reserving %s of address space aligned to %s", bytes_text(total, a),
                bytes_text(align, b));
  uintptr_t at = (uintptr_t)base;
  if (shift) {
    at = ((uintptr_t)base + align - 1) / align * align;
    int rc = remember_shifted(d, (shifted_range){.addr = at, .base = base, .size = total});
    if (rc) {
      (void)SCOPED(d, &s, "cuMemAddressFree", d->drv.mem_address_free(base, total));
      return rc;
    }
  }
  *addr = at;
  return TIDE_OK;
}

static int cuda_unreserve(void *ctx, uintptr_t addr, size_t size) {
  cuda_device *d = ctx;
  char a[32];
  CUdeviceptr base;
  size_t total;
  really_reserved(d, addr, size, &base, &total);
  scope s;
  CUresult r = SCOPED(d, &s, "cuMemAddressFree", d->drv.mem_address_free(base, total));
  if (r != CUDA_SUCCESS)
    return fail(d, r, s.call, "freeing %s of address space at %p", bytes_text(total, a),
                (void *)addr);
  if (base != (CUdeviceptr)addr) forget_shifted(d, addr);
  return TIDE_OK;
}

/* ------------------------------------------------------------------------ */
/* Physical memory and mappings                                              */
/* ------------------------------------------------------------------------ */

static int cuda_create(void *ctx, size_t size, _tide_handle *out) {
  cuda_device *d = ctx;
  char a[32];
  if (!out) return _tide_error_set(TIDE_ERR_INVALID, "create: NULL output");
  bool shareable = atomic_load_explicit(&d->shareable, memory_order_relaxed);
  CUmemAllocationProp prop = allocation_prop(d, shareable);
  CUmemGenericAllocationHandle h = 0;
  scope s;
  if (cannot_enter(d, &s, "cuMemCreate"))
    return fail(d, s.result, s.call, "creating %s of device memory", bytes_text(size, a));
  CUresult r = d->drv.mem_create(&h, size, &prop, 0);
  if (shareable && (r == CUDA_ERROR_NOT_SUPPORTED || r == CUDA_ERROR_NOT_PERMITTED ||
                    r == CUDA_ERROR_INVALID_VALUE)) {
    /* Some systems (containers, say) refuse exportable memory: memory that
     * cannot be shared beats no memory. Sharing then reports why. */
    atomic_store_explicit(&d->shareable, false, memory_order_relaxed);
    prop = allocation_prop(d, false);
    r = d->drv.mem_create(&h, size, &prop, 0);
  }
  leave(d, &s, r);
  if (r != CUDA_SUCCESS)
    return fail(d, r, s.call, "creating %s of device memory", bytes_text(size, a));
  /* The contract promises handles are never 0; no driver hands one out. */
  if (h == 0)
    return _tide_error_set(TIDE_ERR_BACKEND, "CUDA device %d: cuMemCreate returned handle 0",
                           d->ordinal);
  *out = (_tide_handle)h;
  return TIDE_OK;
}

static int cuda_release(void *ctx, _tide_handle handle) {
  cuda_device *d = ctx;
  scope s;
  CUresult r =
      SCOPED(d, &s, "cuMemRelease", d->drv.mem_release((CUmemGenericAllocationHandle)handle));
  if (r != CUDA_SUCCESS)
    return fail(d, r, s.call, "releasing memory handle 0x%llx", (unsigned long long)handle);
  return TIDE_OK;
}

static int cuda_map(void *ctx, uintptr_t addr, size_t size, _tide_handle handle) {
  cuda_device *d = ctx;
  char a[32];
  scope s;
  CUresult r =
      SCOPED(d, &s, "cuMemMap",
             d->drv.mem_map((CUdeviceptr)addr, size, 0, (CUmemGenericAllocationHandle)handle, 0));
  if (r != CUDA_SUCCESS)
    return fail(d, r, s.call, "mapping %s at %p", bytes_text(size, a), (void *)addr);
  return TIDE_OK;
}

/* ------------------------------------------------------------------------ */
/* Sharing between processes                                                 */
/* ------------------------------------------------------------------------ */

static int cuda_export_fd(void *ctx, _tide_handle handle, int *fd, uint64_t *offset) {
  cuda_device *d = ctx;
  if (!fd || !offset) return _tide_error_set(TIDE_ERR_INVALID, "export: NULL output");
  if (!d->drv.mem_export)
    return _tide_error_set(TIDE_ERR_UNAVAILABLE,
                           "CUDA device %d: the driver lacks cuMemExportToShareableHandle",
                           d->ordinal);
  int out = -1;
  scope s;
  CUresult r = SCOPED(d, &s, "cuMemExportToShareableHandle",
                      d->drv.mem_export(&out, (CUmemGenericAllocationHandle)handle,
                                        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  if (r != CUDA_SUCCESS) {
    fail(d, r, s.call, "exporting memory handle 0x%llx", (unsigned long long)handle);
    if (atomic_load(&d->shareable)) return TIDE_ERR_BACKEND;
    /* Not an accident: the memory was made without a shareable handle. */
    return _tide_error_set(TIDE_ERR_UNAVAILABLE,
                           "the memory cannot be shared: this device's memory is made without a "
                           "file-descriptor handle type (the device or system refused exportable "
                           "memory): %s",
                           tide_last_error());
  }
  *fd = out;
  *offset = 0;
  return TIDE_OK;
}

static int cuda_import_fd(void *ctx, int fd, uint64_t offset, size_t size, _tide_handle *out) {
  cuda_device *d = ctx;
  char a[32];
  if (!out) return _tide_error_set(TIDE_ERR_INVALID, "import: NULL output");
  if (!d->drv.mem_import)
    return _tide_error_set(TIDE_ERR_UNAVAILABLE,
                           "CUDA device %d: the driver lacks cuMemImportFromShareableHandle",
                           d->ordinal);
  if (offset != 0)
    return _tide_error_set(TIDE_ERR_BACKEND,
                           "import: CUDA memory handles start at offset 0, not %llu "
                           "(was it exported by another backend?)",
                           (unsigned long long)offset);
  CUmemGenericAllocationHandle h = 0;
  scope s;
  CUresult r =
      SCOPED(d, &s, "cuMemImportFromShareableHandle",
             d->drv.mem_import(&h, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  if (r != CUDA_SUCCESS)
    return fail(d, r, s.call, "importing %s from descriptor %d", bytes_text(size, a), fd);
  *out = (_tide_handle)h;
  return TIDE_OK;
}

/* "device 0", or "device 0 and its peers 1, 3 (peer_access:True; ...)". */
static const char *access_text(const cuda_device *d, char *buf, size_t len) {
  size_t used = (size_t)snprintf(buf, len, "device %d", d->ordinal);
  for (size_t i = 1; i < d->naccess && used < len; i++)
    used += (size_t)snprintf(buf + used, len - used, "%s%d", i == 1 ? " and its peers " : ", ",
                             d->access[i].location.id);
  if (d->naccess > 1 && used < len)
    snprintf(buf + used, len - used,
             " (peer_access:True; set peer_access:False if the peers need not reach it)");
  return buf;
}

static int cuda_set_access(void *ctx, uintptr_t addr, size_t size) {
  cuda_device *d = ctx;
  char a[32], who[256];
  scope s;
  CUresult r = SCOPED(d, &s, "cuMemSetAccess",
                      d->drv.mem_set_access((CUdeviceptr)addr, size, d->access, d->naccess));
  if (r != CUDA_SUCCESS)
    return fail(d, r, s.call, "making %s at %p readable and writable by %s", bytes_text(size, a),
                (void *)addr, access_text(d, who, sizeof who));
  return TIDE_OK;
}

static int cuda_unmap(void *ctx, uintptr_t addr, size_t size) {
  cuda_device *d = ctx;
  char a[32];
  scope s;
  CUresult r = SCOPED(d, &s, "cuMemUnmap", d->drv.mem_unmap((CUdeviceptr)addr, size));
  if (r != CUDA_SUCCESS)
    return fail(d, r, s.call, "unmapping %s at %p", bytes_text(size, a), (void *)addr);
  return TIDE_OK;
}

/* One cuMemUnmap over the whole run where the driver takes it (each call
 * costs about the same whatever it covers), else one per mapping. A refused
 * span changes nothing, so the mappings are then unmapped one by one. */
static CUresult unmap_pages(cuda_device *d, uintptr_t addr, size_t page, size_t count,
                            size_t *done) {
  CUresult r = CUDA_SUCCESS;
  if (count > 1 && !atomic_load_explicit(&d->unmap_spans_refused, memory_order_relaxed)) {
    r = d->drv.mem_unmap((CUdeviceptr)addr, count * page);
    if (r == CUDA_SUCCESS) {
      *done = count;
      return r;
    }
    atomic_store_explicit(&d->unmap_spans_refused, true, memory_order_relaxed);
  }
  for (; *done < count; ++*done)
    if ((r = d->drv.mem_unmap((CUdeviceptr)(addr + *done * page), page)) != CUDA_SUCCESS) break;
  return r;
}

static int cuda_unmap_run(void *ctx, uintptr_t addr, size_t page, size_t count, size_t *done) {
  cuda_device *d = ctx;
  char a[32];
  *done = 0;
  if (count == 0) return TIDE_OK;
  scope s;
  CUresult r = SCOPED(d, &s, "cuMemUnmap", unmap_pages(d, addr, page, count, done));
  if (r != CUDA_SUCCESS)
    return fail(d, r, s.call, "unmapping %s at %p", bytes_text(page, a),
                (void *)(addr + *done * page));
  return TIDE_OK;
}

static CUstream cu_stream(tide_stream stream) { return (CUstream)(void *)stream; }

static const char *stream_text(tide_stream stream, char *buf, size_t len) {
  if (!stream) return "the default stream";
  snprintf(buf, len, "stream %p", (void *)stream);
  return buf;
}

/* ------------------------------------------------------------------------ */
/* Pinned host memory and copies                                             */
/* ------------------------------------------------------------------------ */

static int driver_lacks(const cuda_device *d, const char *call, const char *what) {
  return _tide_error_set(TIDE_ERR_UNAVAILABLE,
                         "CUDA device %d: %s needs %s, which the NVIDIA driver (CUDA %d.%d) does "
                         "not provide; update the driver",
                         d->ordinal, what, call, d->drv.version / 1000, d->drv.version % 1000 / 10);
}

static int cuda_host_alloc(void *ctx, size_t size, void **out) {
  cuda_device *d = ctx;
  char a[32];
  if (!out) return _tide_error_set(TIDE_ERR_INVALID, "host_alloc: NULL output");
  if (!d->drv.mem_host_alloc) return driver_lacks(d, "cuMemHostAlloc", "pinned host memory");
  void *p = NULL;
  scope s;
  CUresult r =
      SCOPED(d, &s, "cuMemHostAlloc",
             d->drv.mem_host_alloc(&p, size, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP));
  if (r != CUDA_SUCCESS)
    return fail(d, r, s.call, "allocating %s of pinned host memory", bytes_text(size, a));
  *out = p;
  return TIDE_OK;
}

static int cuda_host_free(void *ctx, void *ptr) {
  cuda_device *d = ctx;
  if (!d->drv.mem_free_host) return driver_lacks(d, "cuMemFreeHost", "freeing pinned memory");
  scope s;
  CUresult r = SCOPED(d, &s, "cuMemFreeHost", d->drv.mem_free_host(ptr));
  if (r != CUDA_SUCCESS) return fail(d, r, s.call, "freeing pinned host memory at %p", ptr);
  return TIDE_OK;
}

static int cuda_copy(void *ctx, void *dst, const void *src, size_t bytes, tide_stream stream) {
  cuda_device *d = ctx;
  char a[32], text[48];
  if (!d->drv.memcpy_async) return driver_lacks(d, "cuMemcpyAsync", "copying");
  scope s;
  CUresult r = SCOPED(d, &s, "cuMemcpyAsync",
                      d->drv.memcpy_async((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)src,
                                          bytes, cu_stream(stream)));
  if (r != CUDA_SUCCESS)
    return fail(d, r, s.call, "copying %s from %p to %p on %s", bytes_text(bytes, a), src, dst,
                stream_text(stream, text, sizeof text));
  return TIDE_OK;
}

/* ------------------------------------------------------------------------ */
/* Streams and events                                                        */
/* ------------------------------------------------------------------------ */

/* TIDE_OK if waiting for `stream` cannot disturb a graph capture; otherwise
 * TIDE_ERR_NOT_READY with the reason. Inside a scope. */
static int check_not_capturing(const cuda_device *d, tide_stream stream, const char *op) {
  char text[48];
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  CUresult r = d->drv.stream_is_capturing(cu_stream(stream), &status);
  if (r == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
    return _tide_error_set(TIDE_ERR_NOT_READY,
                           "%s: the default stream cannot be used while a blocking stream is "
                           "being captured into a CUDA graph (it would join the capture and "
                           "invalidate it); try again after cudaStreamEndCapture",
                           op);
  if (r != CUDA_SUCCESS)
    return fail(d, r, "cuStreamIsCapturing", "%s: checking whether %s is capturing", op,
                stream_text(stream, text, sizeof text));
  if (status != CU_STREAM_CAPTURE_STATUS_NONE)
    return _tide_error_set(TIDE_ERR_NOT_READY,
                           "%s: %s is being captured into a CUDA graph%s, so its work does not "
                           "run now and waiting for it is illegal (it would invalidate the "
                           "capture); try again after cudaStreamEndCapture",
                           op, stream_text(stream, text, sizeof text),
                           status == CU_STREAM_CAPTURE_STATUS_INVALIDATED
                               ? " (the capture was already invalidated)"
                               : "");
  return TIDE_OK;
}

static int cuda_stream_create(void *ctx, tide_stream *out) {
  cuda_device *d = ctx;
  if (!out) return _tide_error_set(TIDE_ERR_INVALID, "stream_create: NULL output");
  CUstream stream = NULL;
  scope s;
  CUresult r =
      SCOPED(d, &s, "cuStreamCreate", d->drv.stream_create(&stream, CU_STREAM_NON_BLOCKING));
  if (r != CUDA_SUCCESS) return fail(d, r, s.call, "creating a stream");
  *out = (tide_stream)(void *)stream;
  return TIDE_OK;
}

static int cuda_stream_destroy(void *ctx, tide_stream stream) {
  cuda_device *d = ctx;
  char text[48];
  if (!stream)
    return _tide_error_set(TIDE_ERR_INVALID,
                           "stream_destroy: the default stream cannot be destroyed");
  scope s;
  CUresult r = SCOPED(d, &s, "cuStreamDestroy", d->drv.stream_destroy(cu_stream(stream)));
  if (r != CUDA_SUCCESS)
    return fail(d, r, s.call, "destroying %s", stream_text(stream, text, sizeof text));
  return TIDE_OK;
}

static int cuda_stream_synchronize(void *ctx, tide_stream stream) {
  cuda_device *d = ctx;
  char text[48];
  scope s;
  if (cannot_enter(d, &s, "cuStreamSynchronize"))
    return fail(d, s.result, s.call, "waiting for %s", stream_text(stream, text, sizeof text));
  int rc = check_not_capturing(d, stream, "stream_synchronize");
  CUresult r = leave(d, &s, rc ? CUDA_SUCCESS : d->drv.stream_synchronize(cu_stream(stream)));
  if (rc) return rc;
  if (r != CUDA_SUCCESS)
    return fail(d, r, s.call, "waiting for %s", stream_text(stream, text, sizeof text));
  return TIDE_OK;
}

/* Every stream of the device (the primary context's), also those the
 * allocator never saw. The allocator asks only while no capture is known to
 * be under way: the driver invalidates a capture this wait meets. */
static int cuda_device_synchronize(void *ctx) {
  cuda_device *d = ctx;
  if (!d->drv.ctx_synchronize)
    return driver_lacks(d, "cuCtxSynchronize", "waiting for every stream of the device");
  scope s;
  CUresult r = SCOPED(d, &s, "cuCtxSynchronize", d->drv.ctx_synchronize());
  if (r != CUDA_SUCCESS) return fail(d, r, s.call, "waiting for every stream of the device");
  return TIDE_OK;
}

/* Whether `stream` is a stream of this device: its context must be ours
 * (NULL and the special handles name the current context, ours inside the
 * scope). Only a clear answer refuses it: a handle the driver does not know,
 * or another context's stream; any other failure gives it the benefit of the
 * doubt. A property query, legal during capture. */
static int cuda_stream_check(void *ctx, tide_stream stream) {
  cuda_device *d = ctx;
  /* The default stream always exists; asking the driver about the legacy
   * stream counts as using it, which would break a capture on a blocking
   * stream. */
  if (!stream) return TIDE_OK;
  char text[48];
  scope s;
  if (cannot_enter(d, &s, "cuStreamGetCtx"))
    return fail(d, s.result, s.call, "checking %s", stream_text(stream, text, sizeof text));
  CUcontext owner = NULL;
  CUresult r = leave(d, &s, d->drv.stream_get_ctx(cu_stream(stream), &owner));
  if (r == CUDA_ERROR_INVALID_HANDLE || r == CUDA_ERROR_CONTEXT_IS_DESTROYED)
    return fail(d, r, s.call, "checking %s", stream_text(stream, text, sizeof text));
  if (r == CUDA_SUCCESS && owner != d->ctx)
    return _tide_error_set(TIDE_ERR_INVALID,
                           "CUDA device %d: %s belongs to another CUDA context (another device, "
                           "or a context other than the device's primary one)",
                           d->ordinal, stream_text(stream, text, sizeof text));
  return TIDE_OK;
}

/* Whether `stream` is being captured, and its capture's id (streams forked
 * into a capture share it). A query, legal during capture. */
static int cuda_stream_capture_status(void *ctx, tide_stream stream, bool *capturing,
                                      uint64_t *capture_id) {
  cuda_device *d = ctx;
  if (!capturing || !capture_id)
    return _tide_error_set(TIDE_ERR_INVALID, "stream_capture_status: NULL output");
  *capturing = false;
  *capture_id = 0;
  /* The legacy stream cannot be captured; asking about it while a blocking
   * stream is being captured is an error the driver reports (and counts).
   * Without the entry point no capture can be seen: tide_capture_begin then
   * routes the one stream it names. */
  if (!stream || !d->drv.stream_get_capture_info) return TIDE_OK;
  char text[48];
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  cuuint64_t id = 0;
  CUresult r;
  const char *call = "cuStreamGetCaptureInfo";
  CUcontext current = NULL;
  /* capture_detection asks this on every allocation and free: with the
   * device's context already current (as under PyTorch) the query goes
   * straight to the driver, without the capture-mode switch of enter(),
   * which a query legal during any capture does not need. */
  if (d->drv.ctx_get_current(&current) == CUDA_SUCCESS && current == d->ctx) {
    r = d->drv.stream_get_capture_info(cu_stream(stream), &status, &id, NULL, NULL, NULL);
  } else {
    scope s;
    r = SCOPED(d, &s, "cuStreamGetCaptureInfo",
               d->drv.stream_get_capture_info(cu_stream(stream), &status, &id, NULL, NULL, NULL));
    call = s.call;
  }
  if (r != CUDA_SUCCESS)
    return fail(d, r, call, "asking whether %s is being captured",
                stream_text(stream, text, sizeof text));
  /* An invalidated capture still owns the stream until it ends: its
   * allocations belong to it as well. */
  *capturing = status != CU_STREAM_CAPTURE_STATUS_NONE;
  *capture_id = *capturing ? (uint64_t)id : 0;
  if (*capturing && *capture_id == 0) *capture_id = UINT64_MAX; /* ids are never 0 */
  return TIDE_OK;
}

/* Up to cap of the n nodes into out; *count gets n. */
static void give_nodes(const CUgraphNode *nodes, size_t n, _tide_node *out, size_t cap,
                       size_t *count) {
  for (size_t i = 0; i < n && i < cap && out; i++) out[i] = (_tide_node)(uintptr_t)nodes[i];
  *count = n;
}

/* The graph nodes the next work captured on `stream` will depend on: the
 * dependencies cuStreamGetCaptureInfo gives (valid until the next call on
 * the stream, so copied at once). */
static int cuda_capture_deps(void *ctx, tide_stream stream, uint64_t *capture_id, _tide_node *out,
                             size_t cap, size_t *n) {
  cuda_device *d = ctx;
  if (!capture_id || !n || (cap && !out))
    return _tide_error_set(TIDE_ERR_INVALID, "capture_deps: NULL output");
  *capture_id = 0;
  *n = 0;
  if (!stream || !d->drv.stream_get_capture_info) return TIDE_OK;
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  cuuint64_t id = 0;
  const CUgraphNode *deps = NULL;
  size_t ndeps = 0;
  char text[48];
  scope s;
  if (cannot_enter(d, &s, "cuStreamGetCaptureInfo"))
    return fail(d, s.result, s.call, "asking what %s's captured work depends on",
                stream_text(stream, text, sizeof text));
  CUresult r = d->drv.stream_get_capture_info(cu_stream(stream), &status, &id, NULL, &deps, &ndeps);
  if (r == CUDA_SUCCESS && status == CU_STREAM_CAPTURE_STATUS_ACTIVE) {
    *capture_id = id ? (uint64_t)id : UINT64_MAX; /* ids are never 0 */
    give_nodes(deps, ndeps, out, cap, n);
  }
  leave(d, &s, r);
  if (r != CUDA_SUCCESS)
    return fail(d, r, s.call, "asking what %s's captured work depends on",
                stream_text(stream, text, sizeof text));
  return TIDE_OK;
}

/* The driver fills at most the room it is given and says no more, so a
 * full first answer asks for the count (NULL array) before the rest. */
static CUresult node_deps_query(const cuda_device *d, CUgraphNode node, _tide_node *out, size_t cap,
                                size_t *n) {
  CUgraphNode found[16];
  size_t count = sizeof found / sizeof found[0], total = 0;
  CUresult r = d->drv.graph_node_get_dependencies(node, found, &count);
  if (r == CUDA_SUCCESS && count == sizeof found / sizeof found[0])
    r = d->drv.graph_node_get_dependencies(node, NULL, &total);
  if (r != CUDA_SUCCESS || total <= count) {
    if (r == CUDA_SUCCESS) give_nodes(found, count, out, cap, n);
    return r;
  }
  *n = total;
  if (cap < total) return CUDA_SUCCESS; /* the caller asks again with room */
  CUgraphNode *all = malloc(total * sizeof *all);
  if (!all) return CUDA_ERROR_OUT_OF_MEMORY;
  r = d->drv.graph_node_get_dependencies(node, all, &total);
  if (r == CUDA_SUCCESS) give_nodes(all, total, out, cap, n);
  free(all);
  return r;
}

static int cuda_node_deps(void *ctx, _tide_node node, _tide_node *out, size_t cap, size_t *n) {
  cuda_device *d = ctx;
  if (!n || (cap && !out)) return _tide_error_set(TIDE_ERR_INVALID, "node_deps: NULL output");
  if (!d->drv.graph_node_get_dependencies)
    return _tide_error_set(TIDE_ERR_UNAVAILABLE,
                           "CUDA device %d: the driver has no cuGraphNodeGetDependencies",
                           d->ordinal);
  scope s;
  CUresult r = SCOPED(d, &s, "cuGraphNodeGetDependencies",
                      node_deps_query(d, (CUgraphNode)(uintptr_t)node, out, cap, n));
  if (r != CUDA_SUCCESS) return fail(d, r, s.call, "asking what a captured graph node depends on");
  return TIDE_OK;
}

static int cuda_event_create(void *ctx, _tide_event *out) {
  cuda_device *d = ctx;
  if (!out) return _tide_error_set(TIDE_ERR_INVALID, "event_create: NULL output");
  CUevent event = NULL;
  scope s;
  CUresult r = SCOPED(d, &s, "cuEventCreate", d->drv.event_create(&event, CU_EVENT_DISABLE_TIMING));
  if (r != CUDA_SUCCESS) return fail(d, r, s.call, "creating an event");
  *out = (_tide_event)event;
  return TIDE_OK;
}

static int cuda_event_destroy(void *ctx, _tide_event event) {
  cuda_device *d = ctx;
  scope s;
  CUresult r = SCOPED(d, &s, "cuEventDestroy", d->drv.event_destroy((CUevent)event));
  if (r != CUDA_SUCCESS) return fail(d, r, s.call, "destroying event %p", event);
  return TIDE_OK;
}

static int cuda_event_record(void *ctx, _tide_event event, tide_stream stream) {
  cuda_device *d = ctx;
  char text[48];
  scope s;
  if (cannot_enter(d, &s, "cuEventRecord"))
    return fail(d, s.result, s.call, "recording an event on %s",
                stream_text(stream, text, sizeof text));
  /* Only the legacy stream can be dragged into someone else's capture. */
  int rc = stream ? TIDE_OK : check_not_capturing(d, stream, "event_record");
  CUresult r =
      leave(d, &s, rc ? CUDA_SUCCESS : d->drv.event_record((CUevent)event, cu_stream(stream)));
  if (rc) return rc;
  if (r != CUDA_SUCCESS)
    return fail(d, r, s.call, "recording an event on %s", stream_text(stream, text, sizeof text));
  return TIDE_OK;
}

static int captured_event(_tide_event event, const char *op) {
  return _tide_error_set(TIDE_ERR_NOT_READY,
                         "%s: event %p was recorded in a stream being captured into a CUDA "
                         "graph; it completes only when the graph runs",
                         op, event);
}

static int cuda_event_query(void *ctx, _tide_event event) {
  cuda_device *d = ctx;
  scope s;
  CUresult r = SCOPED(d, &s, "cuEventQuery", d->drv.event_query((CUevent)event));
  if (r == CUDA_SUCCESS) return TIDE_OK;
  if (r == CUDA_ERROR_NOT_READY)
    return _tide_error_set(TIDE_ERR_NOT_READY, "event not complete yet");
  if (r == CUDA_ERROR_CAPTURED_EVENT) return captured_event(event, "event_query");
  return fail(d, r, s.call, "querying event %p", event);
}

/* A query first: an event of a capture must not be waited for. */
static CUresult query_then_wait(const cuda_device *d, CUevent event) {
  CUresult r = d->drv.event_query(event);
  return r == CUDA_ERROR_NOT_READY ? d->drv.event_synchronize(event) : r;
}

static int cuda_event_synchronize(void *ctx, _tide_event event) {
  cuda_device *d = ctx;
  scope s;
  CUresult r = SCOPED(d, &s, "cuEventSynchronize", query_then_wait(d, (CUevent)event));
  if (r == CUDA_SUCCESS) return TIDE_OK;
  if (r == CUDA_ERROR_CAPTURED_EVENT) return captured_event(event, "event_synchronize");
  return fail(d, r, s.call, "waiting for event %p", event);
}

/* ------------------------------------------------------------------------ */
/* Opening and destroying                                                    */
/* ------------------------------------------------------------------------ */

static void cuda_destroy(void *ctx) {
  cuda_device *d = ctx;
  if (!d) return;
  /* Errors are ignored: at process exit the driver may already be gone. */
  if (d->ctx) d->drv.primary_ctx_release(d->dev);
  free(d->access);
  free(d->shifted);
  pthread_mutex_destroy(&d->shifted_lock);
  free(d);
}

static const _tide_backend_ops cuda_ops = {
    .name = "cuda",
    .destroy = cuda_destroy,
    .device_count = cuda_device_count,
    .device_name = cuda_device_name,
    .mem_info = cuda_mem_info,
    .granularity = cuda_granularity,
    .reserve = cuda_reserve,
    .unreserve = cuda_unreserve,
    .create = cuda_create,
    .release = cuda_release,
    .map = cuda_map,
    .set_access = cuda_set_access,
    .unmap = cuda_unmap,
    .unmap_run = cuda_unmap_run,
    .export_fd = cuda_export_fd,
    .import_fd = cuda_import_fd,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .copy = cuda_copy,
    .stream_create = cuda_stream_create,
    .stream_destroy = cuda_stream_destroy,
    .stream_synchronize = cuda_stream_synchronize,
    .device_synchronize = cuda_device_synchronize,
    .stream_check = cuda_stream_check,
    .stream_capture_status = cuda_stream_capture_status,
    .capture_deps = cuda_capture_deps,
    .node_deps = cuda_node_deps,
    .event_create = cuda_event_create,
    .event_destroy = cuda_event_destroy,
    .event_record = cuda_event_record,
    .event_query = cuda_event_query,
    .event_synchronize = cuda_event_synchronize,
};

static int unavailable(const cuda_device *d, CUresult r, const char *call) {
  char err[160];
  return _tide_error_set(TIDE_ERR_UNAVAILABLE, "CUDA device %d cannot be used: %s failed with %s",
                         d->ordinal, call, error_text(&d->drv, r, err, sizeof err));
}

/* The device's handle, its support for virtual memory management, its
 * primary context and its granularity. */
static int open_device(cuda_device *d) {
  char err[160];
  int vmm = 0;
  CUresult r = d->drv.device_get(&d->dev, d->ordinal);
  if (r != CUDA_SUCCESS) return unavailable(d, r, "cuDeviceGet");
  r = d->drv.device_get_attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                  d->dev);
  if (r != CUDA_SUCCESS) return unavailable(d, r, "cuDeviceGetAttribute");
  if (!vmm)
    return _tide_error_set(TIDE_ERR_UNAVAILABLE,
                           "CUDA device %d cannot be used: it lacks virtual memory management "
                           "support (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is "
                           "0), which tidalloc's segments are built on",
                           d->ordinal);
  r = d->drv.primary_ctx_retain(&d->ctx, d->dev);
  if (r != CUDA_SUCCESS) {
    d->ctx = NULL;
    return _tide_error_set(TIDE_ERR_UNAVAILABLE,
                           "CUDA device %d cannot be used: cuDevicePrimaryCtxRetain failed with "
                           "%s (is the device in exclusive-process mode and used elsewhere?)",
                           d->ordinal, error_text(&d->drv, r, err, sizeof err));
  }
  CUmemAllocationProp prop = allocation_prop(d, false);
  scope s;
  r = SCOPED(d, &s, "cuMemGetAllocationGranularity",
             d->drv.mem_get_granularity(&d->granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  if (r != CUDA_SUCCESS) return unavailable(d, r, s.call);
  if (!power_of_two(d->granularity))
    return _tide_error_set(TIDE_ERR_UNAVAILABLE,
                           "CUDA device %d cannot be used: its mapping granularity of %zu bytes "
                           "is not a power of two",
                           d->ordinal, d->granularity);
  int fd_handles = 0;
  if (d->drv.mem_export && d->drv.mem_import &&
      d->drv.device_get_attribute(&fd_handles,
                                  CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                                  d->dev) == CUDA_SUCCESS)
    atomic_store(&d->shareable, fd_handles != 0);
  return TIDE_OK;
}

static CUmemAccessDesc read_write(int ordinal) {
  CUmemAccessDesc desc;
  memset(&desc, 0, sizeof desc);
  desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  desc.location.id = ordinal;
  desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return desc;
}

/* Whether device `ordinal` can map our memory: peer access to us, and the
 * virtual memory management our mappings are made with. A failed query
 * only means "no": the device keeps its own access either way. */
static bool peer_can_access(const cuda_device *d, int ordinal) {
  CUdevice peer;
  int can = 0, vmm = 0;
  if (d->drv.device_get(&peer, ordinal) != CUDA_SUCCESS) return false;
  if (d->drv.device_can_access_peer(&can, peer, d->dev) != CUDA_SUCCESS || !can) return false;
  if (d->drv.device_get_attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                  peer) != CUDA_SUCCESS)
    return false;
  return vmm != 0;
}

/* The access descriptors set_access hands the driver: ours first. */
static int find_peers(cuda_device *d, bool peer_access) {
  int count = d->drv.device_count > 0 ? d->drv.device_count : 1;
  d->access = calloc((size_t)count, sizeof *d->access);
  if (!d->access) return _tide_error_set(TIDE_ERR_OOM, "CUDA backend: out of host memory");
  d->access[d->naccess++] = read_write(d->ordinal);
  if (!peer_access || !d->drv.device_can_access_peer) return TIDE_OK;
  for (int i = 0; i < count; i++)
    if (i != d->ordinal && peer_can_access(d, i)) d->access[d->naccess++] = read_write(i);
  return TIDE_OK;
}

int _tide_cuda_open(const _tide_conf_values *conf, int device, _tide_backend *out) {
  if (!out) return _tide_error_set(TIDE_ERR_INVALID, "CUDA backend: NULL output");
  const cuda_driver *drv = driver_get();
  if (!drv) return TIDE_ERR_UNAVAILABLE;
  if (device < 0 || device >= drv->device_count)
    return _tide_error_set(TIDE_ERR_UNAVAILABLE,
                           "CUDA device %d does not exist: the driver sees %d device%s "
                           "(numbered from 0%s)",
                           device, drv->device_count, drv->device_count == 1 ? "" : "s",
                           getenv("CUDA_VISIBLE_DEVICES") ? ", after CUDA_VISIBLE_DEVICES" : "");
  cuda_device *d = calloc(1, sizeof *d);
  if (!d) return _tide_error_set(TIDE_ERR_OOM, "CUDA backend: out of host memory");
  d->drv = *drv;
  d->ordinal = device;
  pthread_mutex_init(&d->shifted_lock, NULL);
  int rc = open_device(d);
  if (!rc) rc = find_peers(d, conf ? conf->peer_access : true);
  if (rc) {
    cuda_destroy(d);
    return rc;
  }
  out->ops = &cuda_ops;
  out->ctx = d;
  out->is_host = 0;
  return TIDE_OK;
}

#endif /* TIDE_HAVE_CUDA_H */
