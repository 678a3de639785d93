/* tidalloc_torch.h: the entry points of libtidalloc.so for PyTorch, which
 * looks them up by name: its CUDAPluggableAllocator takes an allocation and
 * a free function of fixed signatures, and the Python package
 * (tidalloc.torch) calls the others through ctypes. Programs use tidalloc.h;
 * this header declares what those callers bind, and is installed beside it. */
#ifndef TIDALLOC_TORCH_H
#define TIDALLOC_TORCH_H

#include "tidalloc.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The functions PyTorch's CUDAPluggableAllocator loads from libtidalloc.so:
 *   torch.cuda.memory.CUDAPluggableAllocator(path, "tide_torch_alloc", "tide_torch_free")
 * They use the process-wide allocator of `device` (tide_device); `stream` is
 * a cudaStream_t. A failed allocation returns NULL, with the reason in
 * tide_last_error(). The python/ package (tidalloc.torch.install) uses them
 * and the ones after, which return a tide_status as an int. */
#if defined(_WIN32)
typedef long long tide_ssize;
#else
typedef long tide_ssize; /* ssize_t on the platforms PyTorch supports */
#endif
TIDE_NODISCARD TIDE_API void *tide_torch_alloc(tide_ssize size, int device,
                                               void *stream) TIDE_MALLOC;
TIDE_API void tide_torch_free(void *ptr, tide_ssize size, int device, void *stream);
TIDE_API int tide_torch_record_stream(void *ptr, int device, void *stream);
TIDE_API int tide_torch_empty_cache(int device);
TIDE_API int tide_torch_set_memory_fraction(double fraction, int device);

#ifdef __cplusplus
}
#endif

#endif /* TIDALLOC_TORCH_H */
