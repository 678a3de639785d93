/* tidalloc_testing.h: the hooks of tidalloc's tests, apart from the API that
 * programs call (tidalloc.h). They drive the host backend, an emulated
 * device for machines without a GPU: hold a stream so that its work stays
 * pending, emulate graph capture, count the backend's calls and make the
 * n-th one fail. The library's tests and fuzz targets, the tidalloc command
 * (replay, soak) and the Python package's tests use them.
 *
 * The header is installed beside tidalloc.h, for projects that test their
 * own code against the emulated device. The library exports its functions
 * as it exports the API's, but they are outside the API's promises and may
 * change with any release. On an allocator of another backend the calls
 * that return a tide_status fail with TIDE_ERR_UNAVAILABLE, the counters
 * return 0. */
#ifndef TIDALLOC_TESTING_H
#define TIDALLOC_TESTING_H

#include "tidalloc.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The backend operations, for counting calls and injecting failures. */
typedef enum tide_backend_op {
  TIDE_OP_ANY = 0,
  TIDE_OP_RESERVE,
  TIDE_OP_UNRESERVE,
  TIDE_OP_CREATE,
  TIDE_OP_RELEASE,
  TIDE_OP_MAP,
  TIDE_OP_SET_ACCESS,
  TIDE_OP_UNMAP,
  TIDE_OP_STREAM_CREATE,
  TIDE_OP_STREAM_DESTROY,
  TIDE_OP_STREAM_SYNCHRONIZE,
  TIDE_OP_EVENT_CREATE,
  TIDE_OP_EVENT_DESTROY,
  TIDE_OP_EVENT_RECORD,
  TIDE_OP_EVENT_QUERY,
  TIDE_OP_EVENT_SYNCHRONIZE,
  TIDE_OP_MEM_INFO,
  TIDE_OP_HOST_ALLOC,
  TIDE_OP_HOST_FREE,
  TIDE_OP_COPY,
  TIDE_OP_CAPTURE_STATUS,
  TIDE_OP_EXPORT,             /* a memory handle to a file descriptor (sharing) */
  TIDE_OP_IMPORT,             /* a file descriptor to a memory handle */
  TIDE_OP_CAPTURE_GRAPH,      /* the dependencies of a stream or node in a capture's graph */
  TIDE_OP_DEVICE_SYNCHRONIZE, /* waiting for every stream of the device */
  TIDE_OP_COUNT
} tide_backend_op;

/* The name of an operation ("map"). */
TIDE_API const char *tide_backend_op_name(tide_backend_op op);

/* Hold a stream of the host backend: events recorded on it stay pending (as
 * if a long kernel ran) until tide_host_stream_release completes them. */
TIDE_API tide_status tide_host_stream_hold(tide_allocator *alloc, tide_stream stream);
TIDE_API tide_status tide_host_stream_release(tide_allocator *alloc, tide_stream stream);
/* Emulated graph capture (as cuStreamBeginCapture, a fork into another
 * stream, and cuStreamEndCapture): while a stream is captured, the backend
 * says so with its capture id, waiting for it answers TIDE_ERR_NOT_READY, and
 * an event recorded on it never completes (it belongs to the graph) until it
 * is recorded again outside a capture. Work is not recorded: the emulated
 * device does nothing anyway. The default stream cannot be captured. _join
 * makes `stream` part of the capture of `capturing`; _end ends the capture
 * of `stream` for every stream in it. */
TIDE_API tide_status tide_host_capture_begin(tide_allocator *alloc, tide_stream stream);
TIDE_API tide_status tide_host_capture_join(tide_allocator *alloc, tide_stream stream,
                                            tide_stream capturing);
TIDE_API tide_status tide_host_capture_end(tide_allocator *alloc, tide_stream stream);
/* The emulated capture's graph, for graph_capture_record_stream_reuse: _work
 * captures a node of work on `stream` (being captured), after the nodes its
 * work had reached; _wait makes `stream` wait for what `other` (being
 * captured) reached, as an event recorded on `other` and waited for on
 * `stream` (joining `stream` to the capture if it is in none). _begin
 * starts a stream with no dependencies and _join copies those of
 * `capturing`. */
TIDE_API tide_status tide_host_capture_work(tide_allocator *alloc, tide_stream stream);
TIDE_API tide_status tide_host_capture_wait(tide_allocator *alloc, tide_stream stream,
                                            tide_stream other);
/* Make the n-th call (n >= 1, counted from now) of `op` fail; TIDE_OP_ANY
 * counts calls of every operation. n = 0 disarms. One arming per op. */
TIDE_API tide_status tide_host_fail_call(tide_allocator *alloc, tide_backend_op op, uint64_t n);
/* How many times `op` was called on this allocator's host backend. */
TIDE_API uint64_t tide_host_call_count(tide_allocator *alloc, tide_backend_op op);
/* Bytes of emulated device memory created and not yet released. */
TIDE_API uint64_t tide_host_bytes_in_use(tide_allocator *alloc);
/* Mappings the emulated device holds now (one unmap call may end several). */
TIDE_API uint64_t tide_host_mappings(tide_allocator *alloc);

#ifdef __cplusplus
}
#endif

#endif /* TIDALLOC_TESTING_H */
