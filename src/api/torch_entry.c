/* torch_entry.c: the entry points PyTorch's CUDAPluggableAllocator loads by
 * name from libtidalloc.so (torch.cuda.memory.CUDAPluggableAllocator(path,
 * "tide_torch_alloc", "tide_torch_free")), and the calls the Python layer
 * makes for empty_cache, record_stream and the memory fraction. They take
 * the process-wide allocator of the device (tide_device), so that C code and
 * PyTorch in one process share one allocator per GPU. PyTorch cannot take an
 * error code from these calls: a failed allocation returns NULL (PyTorch
 * then raises its out-of-memory error) and the reason stays in
 * tide_last_error() for the Python layer to show. */

#include "memory/core.h"
#include "tidalloc_torch.h"

void *tide_torch_alloc(tide_ssize size, int device, void *stream) {
  if (size <= 0) {
    _tide_error_set(TIDE_ERR_INVALID, "tide_torch_alloc(%lld): %s", (long long)size,
                    size == 0 ? "size 0 asks for nothing" : "a negative size");
    return NULL;
  }
  tide_allocator *a = tide_device(device);
  return a ? tide_malloc(a, (size_t)size, (tide_stream)stream) : NULL;
}

void tide_torch_free(void *ptr, tide_ssize size, int device, void *stream) {
  (void)size; /* PyTorch passes the size it asked for; the block knows its own */
  tide_allocator *a = tide_device(device);
  if (a && ptr) tide_free(a, ptr, (tide_stream)stream);
}

int tide_torch_record_stream(void *ptr, int device, void *stream) {
  tide_allocator *a = tide_device(device);
  return a ? (int)tide_record_stream(a, ptr, (tide_stream)stream) : (int)tide_last_status();
}

int tide_torch_empty_cache(int device) {
  tide_allocator *a = tide_device(device);
  return a ? (int)tide_empty_cache(a) : (int)tide_last_status();
}

int tide_torch_set_memory_fraction(double fraction, int device) {
  tide_allocator *a = tide_device(device);
  return a ? (int)tide_set_memory_fraction(a, fraction) : (int)tide_last_status();
}
