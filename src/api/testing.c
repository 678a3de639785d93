/* testing.c: the host backend's controls that tidalloc_testing.h declares
 * (held streams, emulated captures, injected failures, call counts), each a
 * check of the allocator and of its backend's kind around a call into
 * backend_host.c. */
#include "memory/core.h"

static int need_host(tide_allocator *a, const char *what) {
  if (a->backend.is_host) return TIDE_OK;
  return _tide_error_set(TIDE_ERR_UNAVAILABLE,
                         "%s works only on the host backend (this "
                         "allocator uses %s)",
                         what, a->backend.ops->name);
}

tide_status tide_host_stream_hold(tide_allocator *a, tide_stream stream) {
  _TIDE_CHECK_ALLOCATOR(a, TIDE_ERR_INVALID);
  int rc = need_host(a, __func__);
  return (tide_status)(rc ? rc : _tide_host_stream_hold(&a->backend, stream));
}

tide_status tide_host_stream_release(tide_allocator *a, tide_stream stream) {
  _TIDE_CHECK_ALLOCATOR(a, TIDE_ERR_INVALID);
  int rc = need_host(a, __func__);
  return (tide_status)(rc ? rc : _tide_host_stream_release(&a->backend, stream));
}

tide_status tide_host_capture_begin(tide_allocator *a, tide_stream stream) {
  _TIDE_CHECK_ALLOCATOR(a, TIDE_ERR_INVALID);
  int rc = need_host(a, __func__);
  return (tide_status)(rc ? rc : _tide_host_capture_begin(&a->backend, stream));
}

tide_status tide_host_capture_join(tide_allocator *a, tide_stream stream, tide_stream capturing) {
  _TIDE_CHECK_ALLOCATOR(a, TIDE_ERR_INVALID);
  int rc = need_host(a, __func__);
  return (tide_status)(rc ? rc : _tide_host_capture_join(&a->backend, stream, capturing));
}

tide_status tide_host_capture_end(tide_allocator *a, tide_stream stream) {
  _TIDE_CHECK_ALLOCATOR(a, TIDE_ERR_INVALID);
  int rc = need_host(a, __func__);
  return (tide_status)(rc ? rc : _tide_host_capture_end(&a->backend, stream));
}

tide_status tide_host_capture_work(tide_allocator *a, tide_stream stream) {
  _TIDE_CHECK_ALLOCATOR(a, TIDE_ERR_INVALID);
  int rc = need_host(a, __func__);
  return (tide_status)(rc ? rc : _tide_host_capture_work(&a->backend, stream));
}

tide_status tide_host_capture_wait(tide_allocator *a, tide_stream stream, tide_stream other) {
  _TIDE_CHECK_ALLOCATOR(a, TIDE_ERR_INVALID);
  int rc = need_host(a, __func__);
  return (tide_status)(rc ? rc : _tide_host_capture_wait(&a->backend, stream, other));
}

tide_status tide_host_fail_call(tide_allocator *a, tide_backend_op op, uint64_t n) {
  _TIDE_CHECK_ALLOCATOR(a, TIDE_ERR_INVALID);
  int rc = need_host(a, __func__);
  return (tide_status)(rc ? rc : _tide_host_fail_call(&a->backend, op, n));
}

uint64_t tide_host_call_count(tide_allocator *a, tide_backend_op op) {
  _TIDE_CHECK_ALLOCATOR(a, 0);
  return a->backend.is_host ? _tide_host_call_count(&a->backend, op) : 0;
}

uint64_t tide_host_mappings(tide_allocator *a) {
  _TIDE_CHECK_ALLOCATOR(a, 0);
  return a->backend.is_host ? _tide_host_mappings(&a->backend) : 0;
}

uint64_t tide_host_bytes_in_use(tide_allocator *a) {
  _TIDE_CHECK_ALLOCATOR(a, 0);
  return a->backend.is_host ? _tide_host_bytes_in_use(&a->backend) : 0;
}
