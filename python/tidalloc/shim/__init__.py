"""tidalloc.shim: builds the C++ shim that makes tidalloc PyTorch's own CUDA
allocator (tidalloc_torch.cpp, a subclass of PyTorch's CUDAAllocator) against
the torch in use, once, and loads it.

The build goes through torch.utils.cpp_extension (a C++ compiler, ninja and
CUDA's headers are needed) into a cache folder keyed by the torch version,
the sources and the library: $TIDALLOC_CACHE, else $XDG_CACHE_HOME/tidalloc,
else ~/.cache/tidalloc. A later process with the same key loads the built
library at once. unavailable() says in one line what is missing when it
cannot be built.

Supported are torch 2.8 to 2.15 (SUPPORTED; docs/torch_versions.md): another
version is refused without a build unless asked for (any_version). A build
that fails is remembered in its cache folder (failed.txt, with the compiler's
output in build.log), so that later processes with the same key go straight
to the fallback instead of compiling again; build(retry=True),
TIDALLOC_SHIM_RETRY=1 or `python -m tidalloc build-shim --retry` tries again.
TIDALLOC_VERBOSE=1 shows the compiler's output as it builds."""
import ctypes
import hashlib
import os
import re
import shutil
import sys
import warnings

from .. import _lib

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "tidalloc_torch.cpp")

# The counts tidalloc_torch_counts fills, in its order.
COUNT_NAMES = ("begin_allocate_to_pool", "end_allocate_to_pool", "release_pool",
               "get_checkpoint_state", "set_checkpoint_pool_state",
               "check_pool_live_allocations", "create_or_incref_pool", "pool_allocations")


# The oldest and newest torch (major, minor) the shim is written for and
# compiled against (tests/torch/shim_compile.sh --versions).
SUPPORTED = ((2, 8), (2, 15))

# What a program loses on the pluggable path, said when it is taken.
LOST = ('torch.compile(mode="reduce-overhead")', "torch.cuda.MemPool",
        "CUDA graph pools (a graph's memory is kept until exit)")


class ShimUnavailable(RuntimeError):
    """The shim cannot be built or loaded here; the message says why."""


def supported_range():
    """The supported torch versions, as "2.8 to 2.15"."""
    return "%d.%d to %d.%d" % (SUPPORTED[0] + SUPPORTED[1])


def torch_minor(version):
    """(major, minor) of a torch version string ("2.15.0+cu130"), or None."""
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def version_supported(version):
    v = torch_minor(version)
    return v is not None and SUPPORTED[0] <= v <= SUPPORTED[1]


def _env_on(name):
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


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


def _import_cpp_extension():
    """torch.utils.cpp_extension, imported without its log line on a machine
    without a GPU ("No CUDA runtime is found") unless TIDALLOC_VERBOSE."""
    import logging
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    if not _env_on("TIDALLOC_VERBOSE"):
        log.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        log.setLevel(level)
    return cpp_extension


def unavailable(any_version=False):
    """Why the shim cannot be built here, or None when it can be tried.
    A torch outside SUPPORTED is a reason unless any_version."""
    try:
        import torch
        cpp_extension = _import_cpp_extension()
    except ImportError as e:
        return "PyTorch is not installed (%s)" % e
    if torch.version.cuda is None:
        return "this torch (%s) is built without CUDA" % torch.__version__
    if not any_version and not version_supported(torch.__version__):
        return ("torch %s is outside the versions the shim supports (%s)"
                % (torch.__version__, supported_range()))
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


def _paths(torch):
    """The cache folder for the torch in use, and in it the built library,
    the failure note and the compiler's log."""
    name = "tidalloc_torch_" + _key(torch, _lib.library_path())
    folder = os.path.join(cache_root(), name)
    return (folder, os.path.join(folder, name + ".so"), os.path.join(folder, "failed.txt"),
            os.path.join(folder, "build.log"))


def _first_error(output):
    """The compiler's error in one line: an abstract class (a pure virtual
    of a newer torch not implemented) with the functions' names, else the
    first error, else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = []
    for line in lines:
        m = re.search(r"\berror:\s*(.*)", line)
        if m and m.group(1):
            errors.append("error: " + m.group(1))
    abstract = [e for e in errors if "abstract class type" in e]
    if abstract:
        pure = re.findall(r"note:\s+\S?virtual\s.*?(\w+)\(", output)
        if pure:
            return "%s; pure virtual: %s" % (abstract[0][:200], ", ".join(sorted(set(pure))))
        return abstract[0][:300]
    if errors:
        return errors[0][:300]
    return lines[-1][:300] if lines else "no output"


def remembered_failure():
    """The note of an earlier failed build for the torch and sources in use
    (one line), or None."""
    import torch
    try:
        with open(_paths(torch)[2]) as f:
            return f.readline().strip() or "failed"
    except OSError:
        return None


def built_path():
    """The built shim for the torch in use when the cache holds it, else None."""
    import torch
    built = _paths(torch)[1]
    return built if os.path.exists(built) else None


def build(verbose=None, retry=None, any_version=False):
    """The path of the shim built for the torch in use, building it if the
    cache does not hold it. Raises ShimUnavailable with the reason in one
    line: also, without a new build, when an earlier build with the same
    torch and sources failed, unless retry (default: TIDALLOC_SHIM_RETRY).
    verbose (default: TIDALLOC_VERBOSE) shows the compiler's output."""
    verbose = _env_on("TIDALLOC_VERBOSE") if verbose is None else verbose
    retry = _env_on("TIDALLOC_SHIM_RETRY") if retry is None else retry
    why = unavailable(any_version)
    if why:
        raise ShimUnavailable(why)
    import torch
    from torch.utils import cpp_extension
    library = _lib.library_path()
    folder, built, failed, log = _paths(torch)
    name = os.path.splitext(os.path.basename(built))[0]
    if os.path.exists(built):
        return built
    again = ("`python -m tidalloc build-shim --retry` (or TIDALLOC_SHIM_RETRY=1) tries again")
    if os.path.exists(failed) and not retry:
        raise ShimUnavailable("building the shim for torch %s failed earlier and is not tried "
                              "again (%s; compiler output: %s); %s"
                              % (torch.__version__, remembered_failure(), log, again))
    os.makedirs(folder, exist_ok=True)
    for stale in (failed, log):
        if os.path.exists(stale):
            os.remove(stale)
    libdir = os.path.dirname(os.path.realpath(library))
    print("tidalloc: building the PyTorch shim for torch %s (once, about 15 s)"
          % torch.__version__, file=sys.stderr, flush=True)
    # No CUDA code is compiled, but cpp_extension asks for architectures
    # (and finds none without a GPU): any list will do.
    arch_was = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    try:
        with warnings.catch_warnings(record=not verbose) as said:
            if said is not None:  # cpp_extension's warnings go to the log
                warnings.simplefilter("always")
            try:
                cpp_extension.load(name=name, sources=[SOURCE],
                                   extra_include_paths=[header_dir()],
                                   extra_cflags=["-O2", "-fvisibility=hidden"],
                                   extra_ldflags=[os.path.realpath(library),
                                                  "-Wl,-rpath," + libdir],
                                   build_directory=folder, with_cuda=True,
                                   is_python_module=False, verbose=verbose)
            except Exception as e:  # the compiler's own words are in e
                output = "\n".join([str(w.message) for w in said or []] + [str(e)])
                with open(log, "w") as f:
                    f.write(output + "\n")
                first = _first_error(output)
                with open(failed, "w") as f:
                    f.write(first + "\n")
                raise ShimUnavailable("building the shim for torch %s failed (%s; compiler output: "
                                      "%s); %s after a fix" % (torch.__version__, first, log,
                                                               again)) from e
    finally:
        if arch_was is None:
            del os.environ["TORCH_CUDA_ARCH_LIST"]
    if not os.path.exists(built):
        raise ShimUnavailable("building the shim left no %s" % built)
    return built


def plan(bridge=None):
    """(bridge, why) for a torch process started now: which bridge
    tidalloc.torch.install(bridge) would take ("shim", "pluggable", or
    "error" when install would raise) and why, without building anything."""
    choice = bridge or os.environ.get("TIDALLOC_TORCH_BRIDGE") or "auto"
    if choice == "pluggable":
        return "pluggable", "asked for (TIDALLOC_TORCH_BRIDGE or install(bridge=...))"
    fallback = "error" if choice == "shim" else "pluggable"
    why = unavailable(any_version=choice == "shim")
    if why:
        return fallback, why
    try:
        built = built_path()
        failed = remembered_failure()
    except (OSError, ShimUnavailable) as e:
        return fallback, str(e)
    if built:
        return "shim", "built for this torch: %s" % built
    if failed and not _env_on("TIDALLOC_SHIM_RETRY"):
        return fallback, ("an earlier build for this torch and shim failed (%s); "
                          "`python -m tidalloc build-shim --retry` tries again" % failed)
    return "shim", ("not built yet: the first install() builds it (about 15 s), or "
                    "`python -m tidalloc build-shim` now")


_shim = None


def load(verbose=None, any_version=False):
    """The loaded shim (ctypes.CDLL), built first if needed."""
    global _shim
    if _shim is None:
        _lib.lib()  # the library the shim links, loaded first from the same path
        shim = ctypes.CDLL(build(verbose, any_version=any_version))
        shim.tidalloc_torch_install.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        shim.tidalloc_torch_counts.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_int]
        shim.tidalloc_torch_built_for.restype = ctypes.c_char_p
        shim.tidalloc_torch_pools.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint64),
                                              ctypes.POINTER(ctypes.c_int64),
                                              ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
        _shim = shim
    return _shim


def install(any_version=False):
    """Make the shim PyTorch's CUDA allocator (before CUDA initialises)."""
    shim = load(any_version=any_version)
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
