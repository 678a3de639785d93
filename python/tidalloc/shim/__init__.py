"""tidalloc.shim: builds the C++ shim that makes tidalloc PyTorch's own CUDA
allocator (tidalloc_torch.cpp, a subclass of PyTorch's CUDAAllocator) against
the torch in use, once, and loads it.

The build goes through torch.utils.cpp_extension (a C++ compiler, ninja and
CUDA's headers are needed) into a cache folder keyed by the torch version,
the sources and the library: $TIDALLOC_CACHE, else $XDG_CACHE_HOME/tidalloc,
else ~/.cache/tidalloc. A later process with the same key loads the built
library at once. unavailable() says in one line what is missing when it
cannot be built."""
import ctypes
import hashlib
import os
import shutil

from .. import _lib

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "tidalloc_torch.cpp")

# The counts tidalloc_torch_counts fills, in its order.
COUNT_NAMES = ("begin_allocate_to_pool", "end_allocate_to_pool", "release_pool",
               "get_checkpoint_state", "set_checkpoint_pool_state",
               "check_pool_live_allocations", "create_or_incref_pool", "pool_allocations")


class ShimUnavailable(RuntimeError):
    """The shim cannot be built or loaded here; the message says why."""


def header_dir():
    """The folder holding tidalloc.h: packaged beside the module, or the
    repository's include/."""
    for d in (os.path.join(HERE, "..", "include"), os.path.join(HERE, "..", "..", "..", "include")):
        if os.path.exists(os.path.join(d, "tidalloc.h")):
            return os.path.abspath(d)
    raise ShimUnavailable("tidalloc.h not found beside the package or in the repository")


def cache_root():
    if os.environ.get("TIDALLOC_CACHE"):
        return os.environ["TIDALLOC_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tidalloc")


def _key(torch, library):
    h = hashlib.sha256()
    for path in (SOURCE, os.path.join(header_dir(), "tidalloc.h")):
        with open(path, "rb") as f:
            h.update(f.read())
    h.update(("%s|%s|%s" % (torch.__version__, torch.version.cuda, os.path.realpath(library)))
             .encode())
    return h.hexdigest()[:16]


def unavailable():
    """Why the shim cannot be built here, or None when it can be tried."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as e:
        return "PyTorch is not installed (%s)" % e
    if torch.version.cuda is None:
        return "this torch (%s) is built without CUDA" % torch.__version__
    cxx = os.environ.get("CXX", "c++")
    if not shutil.which(cxx):
        return "no C++ compiler (%s) on PATH" % cxx
    if not shutil.which("ninja"):
        try:
            cpp_extension.verify_ninja_availability()
        except RuntimeError:
            return "ninja is not installed (pip install ninja)"
    home = cpp_extension.CUDA_HOME
    if not home or not os.path.exists(os.path.join(home, "include", "cuda_runtime_api.h")):
        return "CUDA's headers are not found (install the CUDA toolkit or set CUDA_HOME)"
    try:
        header_dir()
    except ShimUnavailable as e:
        return str(e)
    return None


def build(verbose=False):
    """The path of the shim built for the torch in use, building it if the
    cache does not hold it. Raises ShimUnavailable with the reason."""
    why = unavailable()
    if why:
        raise ShimUnavailable(why)
    import torch
    from torch.utils import cpp_extension
    library = _lib.library_path()
    key = _key(torch, library)
    name = "tidalloc_torch_" + key
    folder = os.path.join(cache_root(), name)
    built = os.path.join(folder, name + ".so")
    if os.path.exists(built):
        return built
    os.makedirs(folder, exist_ok=True)
    libdir = os.path.dirname(os.path.realpath(library))
    # No CUDA code is compiled, but cpp_extension asks for architectures
    # (and finds none without a GPU): any list will do.
    arch_was = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    try:
        cpp_extension.load(name=name, sources=[SOURCE], extra_include_paths=[header_dir()],
                           extra_cflags=["-O2", "-fvisibility=hidden"],
                           extra_ldflags=[os.path.realpath(library), "-Wl,-rpath," + libdir],
                           build_directory=folder, with_cuda=True, is_python_module=False,
                           verbose=verbose)
    except Exception as e:  # the compiler's own words are in e
        raise ShimUnavailable("building the shim failed: %s" % str(e).strip().splitlines()[-1]) \
            from e
    finally:
        if arch_was is None:
            del os.environ["TORCH_CUDA_ARCH_LIST"]
    if not os.path.exists(built):
        raise ShimUnavailable("building the shim left no %s" % built)
    return built


_shim = None


def load(verbose=False):
    """The loaded shim (ctypes.CDLL), built first if needed."""
    global _shim
    if _shim is None:
        _lib.lib()  # the library the shim links, loaded first from the same path
        shim = ctypes.CDLL(build(verbose))
        shim.tidalloc_torch_install.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        shim.tidalloc_torch_counts.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_int]
        shim.tidalloc_torch_built_for.restype = ctypes.c_char_p
        shim.tidalloc_torch_pools.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint64),
                                              ctypes.POINTER(ctypes.c_int64),
                                              ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
        _shim = shim
    return _shim


def install():
    """Make the shim PyTorch's CUDA allocator (before CUDA initialises)."""
    shim = load()
    err = ctypes.create_string_buffer(1024)
    if shim.tidalloc_torch_install(err, len(err)) != 0:
        raise RuntimeError("tidalloc: installing the allocator failed: %s" % err.value.decode())


def counts():
    """How often PyTorch called the shim's graph-pool methods, by name."""
    if _shim is None:
        return {}
    values = (ctypes.c_uint64 * len(COUNT_NAMES))()
    _shim.tidalloc_torch_counts(values, len(COUNT_NAMES))
    return dict(zip(COUNT_NAMES, (int(v) for v in values)))


def pools(device=0):
    """The graph pools tidalloc holds for PyTorch on `device`: {MempoolId:
    (allocated, allocated peak, reserved, reserved peak)} in bytes, as
    tide_pool_get_stats gives them; {} before the shim is loaded."""
    if _shim is None:
        return {}
    n = 16
    while True:
        ids = (ctypes.c_uint64 * (2 * n))()
        allocated = (ctypes.c_int64 * (2 * n))()
        reserved = (ctypes.c_int64 * (2 * n))()
        total = _shim.tidalloc_torch_pools(device, ids, allocated, reserved, n)
        if total <= n:
            return {(ids[2 * i], ids[2 * i + 1]): (allocated[2 * i], allocated[2 * i + 1],
                                                   reserved[2 * i], reserved[2 * i + 1])
                    for i in range(total)}
        n = total
