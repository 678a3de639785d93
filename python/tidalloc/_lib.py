"""_lib.py: libtidalloc through ctypes: finding the library and the few
calls the Python layer makes. The library is found through TIDALLOC_LIB
(a path, which must exist), then the one pip installed inside this package,
then the build tree next to this source tree (build/), then the system's
library path."""
import ctypes
import ctypes.util
import operator
import os

POOLS = ("all", "small_pool", "large_pool")


class Stat(ctypes.Structure):
    _fields_ = [("current", ctypes.c_int64), ("peak", ctypes.c_int64)]


_KINDS = 3
_STAT_FIELDS = ("allocated_bytes", "requested_bytes", "active_bytes", "inactive_split_bytes",
                "reserved_bytes", "allocations", "active_blocks", "inactive_split", "segments")
_COUNTERS = ("num_allocs", "num_frees", "pages_mapped", "pages_unmapped", "segments_created",
             "segments_released", "num_alloc_retries", "num_ooms", "num_sync_all_streams",
             "num_device_alloc", "num_device_free", "oversize_allocations", "memory_limit",
             "mappings", "unmappings", "stream_waits", "mapping_ns", "device_queries",
             "device_query_ns", "others_wait_ns")


class Stats(ctypes.Structure):
    _fields_ = ([(name, Stat * _KINDS) for name in _STAT_FIELDS] +
                [(name, ctypes.c_uint64) for name in _COUNTERS] +
                [("reserved_u64", ctypes.c_uint64 * 1)])


class BufOptions(ctypes.Structure):
    _fields_ = [("capacity", ctypes.c_size_t), ("ring", ctypes.c_int),
                ("map_ahead", ctypes.c_size_t), ("async_map_ahead", ctypes.c_int),
                ("stream", ctypes.c_void_p), ("map_ahead_fraction", ctypes.c_double)]


class Info(ctypes.Structure):
    _fields_ = [("version", ctypes.c_char_p), ("backend", ctypes.c_char_p),
                ("device_name", ctypes.c_char_p), ("device", ctypes.c_int),
                ("device_count", ctypes.c_int), ("total_memory", ctypes.c_uint64),
                ("free_memory", ctypes.c_uint64), ("granularity", ctypes.c_uint64),
                ("page_size", ctypes.c_uint64)]


class OptionInfo(ctypes.Structure):
    _fields_ = [("key", ctypes.c_char_p), ("value", ctypes.c_char_p),
                ("default_value", ctypes.c_char_p), ("meaning", ctypes.c_char_p),
                ("source", ctypes.c_int)]


_SIZE_BITS = 8 * ctypes.sizeof(ctypes.c_size_t)


def _whole(value, what):
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError("%s must be a whole number, not %r (%s)"
                        % (what, value, type(value).__name__)) from None


def unsigned_arg(value, what, bits=_SIZE_BITS):
    """`value` checked for an unsigned C field or argument of `bits` bits.
    ctypes would take it modulo 2**bits without a word (2**64 + 2**30 bytes
    would be 1 GiB, -1 the largest size), so anything outside is refused
    here, naming `what`; a value that fits but is too large for the device is
    left to the library, whose out-of-memory error says so."""
    value = _whole(value, what)
    if value < 0:
        raise ValueError("%s is %d: it cannot be negative" % (what, value))
    if value >> bits:
        raise OverflowError("%s is %d: more than a %d-bit unsigned number holds (at most 2**%d - 1)"
                            % (what, value, bits, bits))
    return value


def size_arg(value, what):
    """`value` checked as a size_t (bytes or a count): see unsigned_arg."""
    return unsigned_arg(value, what)


def int_arg(value, what, bits=32):
    """`value` checked for a signed C int of `bits` bits (a device number, a
    file descriptor): ctypes would wrap 2**32 to 0."""
    value = _whole(value, what)
    if not -(1 << (bits - 1)) <= value < (1 << (bits - 1)):
        raise OverflowError("%s is %d: outside what a %d-bit C int holds" % (what, value, bits))
    return value


# tide_config_source: where an option's value came from.
CONF_SOURCES = ("default", "environment", "code")


def _candidates():
    env = os.environ.get("TIDALLOC_LIB")
    if env:
        if not os.path.exists(env):
            raise OSError("TIDALLOC_LIB names %s, which does not exist; point it at a "
                          "libtidalloc.so or unset it" % env)
        yield env
        return
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, "libtidalloc.so")
    yield os.path.join(here, "..", "..", "build", "libtidalloc.so")
    found = ctypes.util.find_library("tidalloc")
    if found:
        yield found


def library_path():
    """The path of the libtidalloc.so this package uses."""
    tried = []
    for path in _candidates():
        tried.append(path)
        if os.path.exists(path) or not os.path.dirname(path):
            return os.path.abspath(path) if os.path.exists(path) else path
    raise OSError("libtidalloc.so not found (tried %s); install the package with "
                  "`pip install .` from the repository, build it (make build), or set TIDALLOC_LIB"
                  % ", ".join(tried))


_lib = None


def lib():
    global _lib
    if _lib is None:
        path = library_path()
        l = ctypes.CDLL(path)
        _require_symbols(l, path)
        l.tide_device.restype = ctypes.c_void_p
        l.tide_device.argtypes = [ctypes.c_int]
        l.tide_last_error.restype = ctypes.c_char_p
        l.tide_get_stats.argtypes = [ctypes.c_void_p, ctypes.POINTER(Stats)]
        l.tide_reset_peak_stats.argtypes = [ctypes.c_void_p]
        l.tide_config_process_set.argtypes = [ctypes.c_char_p]
        l.tide_config_process_get.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        l.tide_config_free.argtypes = [ctypes.c_void_p]
        l.tide_config_free.restype = None
        l.tide_config_notice.argtypes = [ctypes.c_void_p]
        l.tide_config_notice.restype = ctypes.c_char_p
        l.tide_config_option_count.restype = ctypes.c_size_t
        l.tide_config_option_count.argtypes = []
        l.tide_config_option.argtypes = [ctypes.c_void_p, ctypes.c_size_t,
                                         ctypes.POINTER(OptionInfo)]
        l.tide_get_info.argtypes = [ctypes.c_void_p, ctypes.POINTER(Info)]
        # As share.py binds it: the stream output may be NULL.
        l.tide_block_info.argtypes = [ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.POINTER(ctypes.c_void_p),
                                      ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p]
        l.tide_torch_alloc.restype = ctypes.c_void_p
        l.tide_torch_alloc.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p]
        l.tide_torch_free.restype = None
        l.tide_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_void_p]
        l.tide_torch_empty_cache.argtypes = [ctypes.c_int]
        l.tide_torch_set_memory_fraction.argtypes = [ctypes.c_double, ctypes.c_int]
        l.tide_torch_record_stream.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        l.tide_buf_create.argtypes = [ctypes.c_void_p, ctypes.POINTER(BufOptions),
                                      ctypes.POINTER(ctypes.c_void_p)]
        l.tide_buf_destroy.argtypes = [ctypes.c_void_p]
        if hasattr(l, "tide_buf_destroy_after"):  # a library older than it has only destroy
            l.tide_buf_destroy_after.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        l.tide_buf_resize.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        l.tide_buf_reserve_ahead.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        l.tide_buf_data.restype = ctypes.c_void_p
        l.tide_buf_data.argtypes = [ctypes.c_void_p]
        for name in ("tide_buf_length", "tide_buf_capacity", "tide_buf_mapped"):
            getattr(l, name).restype = ctypes.c_size_t
            getattr(l, name).argtypes = [ctypes.c_void_p]
        _lib = l
    return _lib


class TidallocError(RuntimeError):
    pass


# The functions lib() declares: a library without one of them is not
# tidalloc's (ctypes would raise AttributeError at the first).
_SYMBOLS = ("tide_device", "tide_last_error", "tide_get_stats", "tide_reset_peak_stats",
            "tide_config_process_set", "tide_config_process_get", "tide_config_free", "tide_config_option_count",
            "tide_config_option", "tide_get_info", "tide_block_info", "tide_torch_alloc",
            "tide_torch_free", "tide_torch_empty_cache", "tide_torch_set_memory_fraction",
            "tide_torch_record_stream", "tide_buf_create", "tide_buf_destroy", "tide_buf_resize",
            "tide_buf_reserve_ahead", "tide_buf_data", "tide_buf_length", "tide_buf_capacity",
            "tide_buf_mapped")


def _require_symbols(l, path):
    missing = [name for name in _SYMBOLS if not hasattr(l, name)]
    if missing:
        raise TidallocError("%s is not tidalloc's library: it lacks %s"
                            % (path, ", ".join(missing)))


def last_error():
    return (lib().tide_last_error() or b"").decode("utf-8", "replace")


def check(status, what):
    if status != 0:
        raise TidallocError("%s failed: %s" % (what, last_error()))


def device(index=0):
    index = int_arg(index, "device")
    handle = lib().tide_device(index)
    if not handle:
        message = last_error()
        prefix = "tide_device(%d)" % index
        # The library's message names the call already; said once.
        raise TidallocError(message if message.startswith(prefix) else
                            "%s: %s" % (prefix, message))
    return handle


def stats(index=0):
    out = Stats()
    check(lib().tide_get_stats(device(index), ctypes.byref(out)), "tide_get_stats")
    return out


def memory_stats(index=0):
    """tidalloc's figures as the keys of torch.cuda.memory_stats()."""
    st = stats(index)
    result = {}
    for field, name in (("allocated_bytes", "allocated_bytes"), ("reserved_bytes", "reserved_bytes"),
                        ("active_bytes", "active_bytes"), ("requested_bytes", "requested_bytes"),
                        ("inactive_split_bytes", "inactive_split_bytes"),
                        ("allocations", "allocation"), ("active_blocks", "active"),
                        ("inactive_split", "inactive_split"), ("segments", "segment")):
        for k, pool in enumerate(POOLS):
            s = getattr(st, field)[k]
            result["%s.%s.current" % (name, pool)] = s.current
            result["%s.%s.peak" % (name, pool)] = s.peak
    result["num_alloc_retries"] = st.num_alloc_retries
    result["num_ooms"] = st.num_ooms
    result["num_sync_all_streams"] = st.num_sync_all_streams
    result["num_device_alloc"] = st.num_device_alloc
    result["num_device_free"] = st.num_device_free
    # Not PyTorch's: the driver's work is per mapping (see handle_size_mb).
    result["num_device_map"] = st.mappings
    result["num_device_unmap"] = st.unmappings
    # Not PyTorch's: how often the allocator waited for a stream's queue.
    result["num_stream_waits"] = st.stream_waits
    # Not PyTorch's: the time spent in the driver's calls that map and unmap.
    result["device_mapping_ns"] = st.mapping_ns
    # Not PyTorch's: the queries of the device's free memory, and their time.
    result["num_device_queries"] = st.device_queries
    result["device_query_ns"] = st.device_query_ns
    # Not PyTorch's: time failed allocations waited for other processes.
    result["others_wait_ns"] = st.others_wait_ns
    return result


def reset_peak(index=0):
    check(lib().tide_reset_peak_stats(device(index)), "tide_reset_peak_stats")


def configure(conf):
    """Set the process-wide configuration before first use ("key:value,...",
    a str, or bytes in UTF-8)."""
    if isinstance(conf, (bytes, bytearray)):
        try:
            conf = bytes(conf).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError("configure: the configuration bytes are not UTF-8 text (%s)" % e) \
                from None
    if not isinstance(conf, str):
        raise TypeError("configure: the configuration is a str such as \"key:value,...\" (or "
                        "bytes in UTF-8), not %s" % type(conf).__name__)
    if "\0" in conf:
        # C text ends at its first NUL: what follows would be dropped unseen.
        raise TidallocError("tide_config_process_set(%r) refused: a NUL character at index %d (the "
                            "configuration is text without NULs)" % (conf, conf.index("\0")))
    check(lib().tide_config_process_set(conf.encode()), "tide_config_process_set(%r)" % conf)


def conf_option(key):
    """(value, source) of one option of the process-wide configuration as it
    stands now: defaults, TIDALLOC_CONF, then configure() calls. `source` is
    "default", "environment" or "code"."""
    l = lib()
    config = ctypes.c_void_p()
    check(l.tide_config_process_get(ctypes.byref(config)), "tide_config_process_get")
    try:
        info = OptionInfo()
        for i in range(l.tide_config_option_count()):
            check(l.tide_config_option(config, i, ctypes.byref(info)), "tide_config_option")
            if info.key.decode() == key:
                return info.value.decode(), CONF_SOURCES[info.source]
    finally:
        l.tide_config_free(config)
    raise KeyError("tidalloc has no option %r" % key)


def conf_notice():
    """A sentence for the user about the process-wide configuration, or
    None: a key of an earlier version that is accepted but does nothing
    (release_slack, release_limit, wait_limit), and what to do."""
    l = lib()
    config = ctypes.c_void_p()
    check(l.tide_config_process_get(ctypes.byref(config)), "tide_config_process_get")
    try:
        text = l.tide_config_notice(config)
        return text.decode() if text else None
    finally:
        l.tide_config_free(config)


def backend(index=0):
    """"host" (an emulated device in host memory) or "cuda"."""
    out = Info()
    check(lib().tide_get_info(device(index), ctypes.byref(out)), "tide_get_info")
    return out.backend.decode()


def owns(ptr, index=0):
    """Whether `ptr` lies in a block tidalloc allocated on device `index`
    (such as a torch tensor's data_ptr() under tidalloc.torch.install())."""
    base, size = ctypes.c_void_p(), ctypes.c_size_t()
    return lib().tide_block_info(device(index), ptr, ctypes.byref(base), ctypes.byref(size),
                                 None) == 0
