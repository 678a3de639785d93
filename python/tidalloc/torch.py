"""tidalloc.torch: tidalloc as PyTorch's CUDA allocator, for unmodified
programs. install() must run before CUDA is initialised.

Two bridges. The shim (tidalloc/shim, the default): a C++ subclass of
PyTorch's CUDAAllocator, built once against the torch in use, so that CUDA
graph pools, torch.compile(mode="reduce-overhead") (cudagraph trees and
their checkpoints), torch.cuda.MemPool, memory_stats, memory_summary and
memory._snapshot work as with PyTorch's own allocator. The pluggable
allocator (two C functions, CUDAPluggableAllocator), where the shim cannot
be built: there PyTorch never says when a graph capture begins or ends, so
install() turns on tidalloc's capture_detection unless the user set it, a
graph's memory stays until the process ends, cudagraph trees fail, and
torch.cuda's figures are patched in Python to report tidalloc's.

TIDALLOC_TORCH_BRIDGE=shim or pluggable (or install(bridge=...)) chooses;
with shim, a shim that cannot be built is an error instead of a warning, and
a torch outside the supported versions (tidalloc.shim.SUPPORTED) is tried
all the same. `python -m tidalloc info` says which bridge a process would
get and why."""
import functools
import os
import warnings

from . import _lib

_installed = None  # the bridge in use: "shim" or "pluggable"


def _index(device):
    import torch
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    return torch.device(device).index or 0


def _patch(torch):
    cuda = torch.cuda

    def stat(field, peak):
        def get(device=None):
            s = getattr(_lib.stats(_index(device)), field)[0]
            return s.peak if peak else s.current
        return get

    def memory_stats(device=None):
        return _lib.memory_stats(_index(device))

    def reset_peak_memory_stats(device=None):
        _lib.reset_peak(_index(device))

    def empty_cache():
        _lib.check(_lib.lib().tide_torch_empty_cache(cuda.current_device()), "empty_cache")

    replacements = {
        "memory_allocated": stat("allocated_bytes", False),
        "max_memory_allocated": stat("allocated_bytes", True),
        "memory_reserved": stat("reserved_bytes", False),
        "max_memory_reserved": stat("reserved_bytes", True),
        "memory_stats": memory_stats,
        "reset_peak_memory_stats": reset_peak_memory_stats,
        "empty_cache": empty_cache,
    }
    for name, fn in replacements.items():
        functools.update_wrapper(fn, getattr(cuda, name))
        setattr(cuda, name, fn)
        if hasattr(cuda.memory, name):
            setattr(cuda.memory, name, fn)


# What install() adds to the configuration when the user did not set the key.
DEFAULTS = {"capture_detection": "True"}


def _configure(conf=None):
    """Apply `conf`, then install()'s defaults for the keys nobody set: an
    option whose source is still "default" was set neither in TIDALLOC_CONF
    nor by code, so the user's explicit setting always wins."""
    if conf:
        _lib.configure(conf)
    for key, value in DEFAULTS.items():
        if _lib.conf_option(key)[1] != "default":
            continue
        try:
            _lib.configure("%s:%s" % (key, value))
        except _lib.TidallocError as e:
            # Only possible when tidalloc was used before install() (its
            # configuration is then fixed); run on, but say what is missing.
            warnings.warn("tidalloc.torch.install(): %s:%s not applied (%s); set "
                          "TIDALLOC_CONF=%s:%s before the program starts" %
                          (key, value, e, key, value), RuntimeWarning, stacklevel=3)


BRIDGES = ("shim", "pluggable")


def bridge():
    """The bridge tidalloc is installed with ("shim" or "pluggable"), or None."""
    return _installed


def _choose(requested):
    choice = requested or os.environ.get("TIDALLOC_TORCH_BRIDGE") or "auto"
    if choice not in BRIDGES + ("auto",):
        raise ValueError("tidalloc.torch.install(): bridge %r is not one of shim, pluggable"
                         % choice)
    return choice


def _install_shim(conf, any_version=False):
    from . import shim
    if conf:
        _lib.configure(conf)
    shim.install(any_version=any_version)


def fallback_notice(reason):
    """The one line said when the pluggable path is taken for `reason`."""
    from . import shim
    return ("tidalloc: %s; running as a pluggable allocator, without %s"
            % (reason, ", ".join(shim.LOST)))


def _install_pluggable(torch, conf):
    _configure(conf)
    allocator = torch.cuda.memory.CUDAPluggableAllocator(_lib.library_path(), "tide_torch_alloc",
                                                         "tide_torch_free")
    torch.cuda.memory.change_current_allocator(allocator)
    _patch(torch)


def install(conf=None, bridge=None):
    """Make tidalloc PyTorch's CUDA allocator. `conf` ("key:value,...")
    adds to TIDALLOC_CONF. `bridge`: "shim" or "pluggable" (default: the
    shim where it can be built for a supported torch, else the pluggable
    allocator with one warning saying why and what is lost). Raises if CUDA
    is already initialised."""
    global _installed
    import torch
    if _installed:
        return
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "tidalloc.torch.install() must run before CUDA is initialised (before the first "
            "tensor on a GPU or torch.cuda call that creates a context); call it at the top of "
            "the program, or run the program with `python -m tidalloc run SCRIPT`")
    choice = _choose(bridge)
    if choice in ("auto", "shim"):
        from . import shim
        try:
            _install_shim(conf, any_version=choice == "shim")
            _installed = "shim"
        except shim.ShimUnavailable as e:
            if choice == "shim":
                raise
            warnings.warn(fallback_notice(e), RuntimeWarning, stacklevel=2)
    if not _installed:
        _install_pluggable(torch, conf)
        _installed = "pluggable"
    from . import share
    share.enable_torch_sharing()  # torch.multiprocessing sends CUDA tensors through tidalloc
