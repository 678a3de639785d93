/* backend.h: the contract between the allocator and a device.
 *
 * A backend is a table of operations over one device plus a context pointer.
 * Every operation returns TIDE_OK (0) on success, or a tide_status and a
 * message set with _tide_error_set (so the caller can pass it on). Failing
 * calls change nothing: a failed map leaves the range unmapped, a failed
 * create holds no memory. Operations may be called from several threads at
 * once; the backend serializes what it must.
 *
 * Preconditions the allocator keeps (the host backend checks them and fails
 * with TIDE_ERR_BACKEND where the CUDA driver would fail too):
 * - reserve: size and align are multiples of the granularity. The range is
 *   inaccessible until pages are mapped into it and made accessible.
 * - unreserve: a whole range from reserve, with nothing mapped in it.
 * - create: size is a multiple of the granularity. TIDE_ERR_OOM when the
 *   device has not that much memory left. Handles are never 0.
 * - release: a handle from create. Memory a handle holds stays alive until
 *   it is released and unmapped everywhere.
 * - map: addr is inside a reserved range, aligned to the granularity, and
 *   [addr, addr+size) is unmapped; size is the handle's whole size. The same
 *   handle may be mapped at several addresses (ring buffers use this).
 * - set_access: [addr, addr+size) is fully mapped; after it the device (and on
 *   the host backend, the CPU) may read and write the range. On CUDA, with
 *   peer_access, every peer device that can access this one's memory may
 *   too (the backend finds them when it opens).
 * - unmap: exactly one earlier mapping (its address and size).
 * - unmap_run: `count` earlier mappings of `page` bytes each, one after the
 *   other from addr; *done gets how many of them, from the first, are
 *   unmapped (all on success; on failure the others are still mapped).
 * - export_fd: a new POSIX file descriptor (the caller's to close) through
 *   which another process can import the handle's memory, and where in what
 *   the descriptor refers to that memory starts (0 on CUDA; the host backend
 *   hands out its memory file). TIDE_ERR_UNAVAILABLE when the handle cannot
 *   be shared (CUDA: created without a shareable handle type).
 * - import_fd: a handle for `size` bytes at `offset` of an exported
 *   descriptor's memory, mapped and released like any handle; the
 *   descriptor stays the caller's. Imported memory is the exporter's: it
 *   counts against no capacity of the importing device.
 * - host_alloc: pinned host memory of at least `size` bytes (size > 0),
 *   page-aligned, readable and writable by the CPU and usable in copies;
 *   TIDE_ERR_OOM when there is no more. host_free: a pointer host_alloc
 *   returned, once.
 * - copy: `bytes` > 0, the ranges do not overlap; ordered on `stream` (the
 *   host backend copies at once).
 * - streams: NULL is the default stream. Events recorded on a stream complete
 *   once the work queued on it before the record is done; event_query answers
 *   TIDE_OK (done) or TIDE_ERR_NOT_READY.
 * - device_synchronize: waits until the work queued on every stream of the
 *   device is done, also on streams the allocator never saw (cuCtxSynchronize).
 *   Never while a stream of the device may be being captured: on CUDA the
 *   wait invalidates the capture; the host backend refuses it then, and while
 *   a stream is held (TIDE_ERR_NOT_READY).
 * - stream_capture_status: whether `stream` is being captured into a graph
 *   now, and the id of its capture (never 0 while capturing; streams forked
 *   into a capture share its id). Legal during a capture. The default stream
 *   is never being captured.
 * - capture_deps (optional, NULL where the device cannot tell): the capture
 *   id of `stream` (0: not being captured) and the graph nodes the next work
 *   captured on it will depend on (its capture's terminal nodes on that
 *   stream; none while nothing was captured on it since it joined).
 *   node_deps: the nodes a node of a capture under way depends on. Both put
 *   up to `cap` nodes into `out` (may be NULL with cap 0) and their number
 *   into *n, which may be more than cap (ask again with room). Queries,
 *   legal during a capture. */
#ifndef TIDE_BACKEND_H
#define TIDE_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tidalloc_testing.h"

typedef uint64_t _tide_handle; /* physical memory: never 0 */
typedef void *_tide_event;
typedef uint64_t _tide_node; /* a node of a graph being captured: never 0 */

typedef struct _tide_backend_ops {
  const char *name;
  void (*destroy)(void *ctx);

  int (*device_count)(void *ctx, int *count);
  int (*device_name)(void *ctx, char *buf, size_t len);
  int (*mem_info)(void *ctx, size_t *free_bytes, size_t *total_bytes);
  int (*granularity)(void *ctx, size_t *bytes);

  int (*reserve)(void *ctx, size_t size, size_t align, uintptr_t *addr);
  int (*unreserve)(void *ctx, uintptr_t addr, size_t size);
  int (*create)(void *ctx, size_t size, _tide_handle *out);
  int (*release)(void *ctx, _tide_handle handle);
  int (*map)(void *ctx, uintptr_t addr, size_t size, _tide_handle handle);
  int (*set_access)(void *ctx, uintptr_t addr, size_t size);
  int (*unmap)(void *ctx, uintptr_t addr, size_t size);
  int (*unmap_run)(void *ctx, uintptr_t addr, size_t page, size_t count, size_t *done);
  int (*export_fd)(void *ctx, _tide_handle handle, int *fd, uint64_t *offset);
  int (*import_fd)(void *ctx, int fd, uint64_t offset, size_t size, _tide_handle *out);

  int (*host_alloc)(void *ctx, size_t size, void **out);
  int (*host_free)(void *ctx, void *ptr);
  int (*copy)(void *ctx, void *dst, const void *src, size_t bytes, tide_stream stream);

  int (*stream_create)(void *ctx, tide_stream *out);
  int (*stream_destroy)(void *ctx, tide_stream stream);
  int (*stream_synchronize)(void *ctx, tide_stream stream);
  int (*device_synchronize)(void *ctx);
  /* TIDE_OK if the stream exists (cheap; legal while it is being captured). */
  int (*stream_check)(void *ctx, tide_stream stream);
  int (*stream_capture_status)(void *ctx, tide_stream stream, bool *capturing,
                               uint64_t *capture_id);
  int (*capture_deps)(void *ctx, tide_stream stream, uint64_t *capture_id, _tide_node *out,
                      size_t cap, size_t *n);
  int (*node_deps)(void *ctx, _tide_node node, _tide_node *out, size_t cap, size_t *n);
  int (*event_create)(void *ctx, _tide_event *out);
  int (*event_destroy)(void *ctx, _tide_event event);
  int (*event_record)(void *ctx, _tide_event event, tide_stream stream);
  int (*event_query)(void *ctx, _tide_event event);
  int (*event_synchronize)(void *ctx, _tide_event event);
} _tide_backend_ops;

typedef struct _tide_backend {
  const _tide_backend_ops *ops;
  void *ctx;
  int is_host; /* the host backend's controls (hold, faults) apply */
} _tide_backend;

struct _tide_conf_values;

/* Open the host backend for one emulated device. Each instance is its own
 * device: its own capacity (conf->host_capacity), mappings and streams. */
int _tide_host_open(const struct _tide_conf_values *conf, int device, _tide_backend *out);

/* Open the CUDA backend for one GPU: the driver API loaded at run time
 * (dlopen of libcuda.so.1), so the library loads where there is no driver.
 * TIDE_ERR_UNAVAILABLE, with the reason in words, when it cannot be used. */
int _tide_cuda_open(const struct _tide_conf_values *conf, int device, _tide_backend *out);
/* Whether the CUDA backend can be used here (a driver and a device); the
 * reason it cannot goes into the thread's error message. */
bool _tide_cuda_usable(void);

/* Host backend controls behind the tide_host_* functions. */
int _tide_host_stream_hold(_tide_backend *b, tide_stream stream);
int _tide_host_stream_release(_tide_backend *b, tide_stream stream);
int _tide_host_capture_begin(_tide_backend *b, tide_stream stream);
int _tide_host_capture_join(_tide_backend *b, tide_stream stream, tide_stream capturing);
int _tide_host_capture_end(_tide_backend *b, tide_stream stream);
int _tide_host_capture_work(_tide_backend *b, tide_stream stream);
int _tide_host_capture_wait(_tide_backend *b, tide_stream stream, tide_stream other);
int _tide_host_fail_call(_tide_backend *b, tide_backend_op op, uint64_t n);
uint64_t _tide_host_call_count(_tide_backend *b, tide_backend_op op);
uint64_t _tide_host_bytes_in_use(_tide_backend *b);
uint64_t _tide_host_mappings(_tide_backend *b);

/* How many calls of `op` had been made when the last injected failure
 * fired (that call included): a test can then aim a second failure at the
 * next call of another operation after the first failure. */
uint64_t _tide_host_calls_at_failure(_tide_backend *b, tide_backend_op op);

/* Calls of one operation from one call site of the allocator (the return
 * address of the operation), and how many of them were made to fail. */
typedef struct _tide_host_site {
  tide_backend_op op;
  uintptr_t site;
  uint64_t calls, failures;
} _tide_host_site;

/* Up to `cap` call sites seen so far into `out`; returns how many there are
 * (more than `cap` when `out` is too small). For tests of fault coverage. */
size_t _tide_host_sites(_tide_backend *b, _tide_host_site *out, size_t cap);

#endif /* TIDE_BACKEND_H */
