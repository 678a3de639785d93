"""tidalloc.torch: tidalloc as PyTorch's CUDA allocator, for unmodified
programs. install() must run before CUDA is initialised; afterwards
torch.cuda.memory_allocated, max_memory_allocated, memory_reserved,
max_memory_reserved, reset_peak_memory_stats, memory_stats and empty_cache
report and act on tidalloc (with a pluggable allocator PyTorch raises on
them otherwise).

install() turns on tidalloc's capture_detection unless the user set it
(TIDALLOC_CONF, install(conf=...) or tidalloc.configure): PyTorch's
pluggable-allocator path never tells an allocator that a CUDA graph capture
begins or ends, so without it a block freed during torch.cuda.graph capture
goes back to the ordinary cache and can be handed out again while replays
still write it (docs/torch_compile.md)."""
import functools
import warnings

from . import _lib

_installed = False


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


def install(conf=None):
    """Make tidalloc PyTorch's CUDA allocator. `conf` ("key:value,...")
    adds to TIDALLOC_CONF. capture_detection is turned on unless TIDALLOC_CONF
    or `conf` sets it (capture_detection:False turns it off). Raises if CUDA
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
    _configure(conf)
    allocator = torch.cuda.memory.CUDAPluggableAllocator(_lib.library_path(), "tide_torch_alloc",
                                                         "tide_torch_free")
    torch.cuda.memory.change_current_allocator(allocator)
    _patch(torch)
    from . import share
    share.enable_torch_sharing()  # torch.multiprocessing sends CUDA tensors through tidalloc
    _installed = True
