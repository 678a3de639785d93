"""tidalloc from Python: the library's figures through ctypes, and
tidalloc.torch.install() to make it PyTorch's CUDA allocator."""
from .buffer import Buffer, GrowableTensor  # noqa: F401
from ._lib import (TidallocError, configure, library_path, memory_stats, reset_peak,  # noqa: F401
                   stats)

__version__ = "0.1.0"
