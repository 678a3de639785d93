"""buffer.py: growable buffers (tide_buf) from Python: a device range of fixed
address that grows and shrinks in place, and GrowableTensor, a torch tensor
over one that appends along its first dimension without copying what it
holds (its data pointer never changes), for KV caches."""
import ctypes
import sys
import warnings

from . import _lib


class Buffer:
    """A tidalloc growable buffer of `capacity` bytes on `device`.

    `release_stream` (a CUstream as an int, or None for the default stream):
    on close, the length goes to 0 on that stream first, so that destroying
    the buffer waits for the work queued there that may still read it."""

    def __init__(self, capacity, device=0, map_ahead=0, ring=False, stream=None,
                 release_stream=None, map_ahead_fraction=0.0):
        lib = _lib.lib()
        capacity = _lib.size_arg(capacity, "Buffer: capacity")
        map_ahead = _lib.size_arg(map_ahead, "Buffer: map_ahead")
        o = _lib.BufOptions(capacity=capacity, ring=int(ring), map_ahead=map_ahead,
                            async_map_ahead=int(map_ahead > 0 and not ring), stream=stream,
                            map_ahead_fraction=map_ahead_fraction)
        handle = ctypes.c_void_p()
        _lib.check(lib.tide_buf_create(_lib.device(device), ctypes.byref(o), ctypes.byref(handle)),
                   "tide_buf_create(%d bytes)" % capacity)
        self._handle = handle
        self._ring = bool(ring)
        self.release_stream = release_stream

    def resize(self, length, stream=None):
        length = _lib.size_arg(length, "Buffer.resize: length")
        _lib.check(_lib.lib().tide_buf_resize(self._handle, length, stream),
                   "tide_buf_resize(%d)" % length)

    def reserve_ahead(self, length):
        """Map pages for `length` bytes now, leaving the length as it is."""
        length = _lib.size_arg(length, "Buffer.reserve_ahead: length")
        _lib.check(_lib.lib().tide_buf_reserve_ahead(self._handle, length),
                   "tide_buf_reserve_ahead(%d)" % length)

    @property
    def data(self):
        return _lib.lib().tide_buf_data(self._handle)

    def __len__(self):
        return _lib.lib().tide_buf_length(self._handle)

    @property
    def capacity(self):
        return _lib.lib().tide_buf_capacity(self._handle)

    @property
    def mapped(self):
        return _lib.lib().tide_buf_mapped(self._handle)

    def close(self):
        if getattr(self, "_handle", None):  # absent when __init__ failed
            lib = _lib.lib()
            # Pages are not unmapped under kernels still queued to read them:
            # destroy_after waits for the release stream first. (A shrink would
            # not do: it keeps the pages it maps ahead, and rings never shrink.)
            if hasattr(lib, "tide_buf_destroy_after"):
                _lib.check(lib.tide_buf_destroy_after(self._handle, self.release_stream),
                           "tide_buf_destroy_after")
            else:
                if not self._ring and lib.tide_buf_length(self._handle):
                    self.resize(0, self.release_stream)
                _lib.check(lib.tide_buf_destroy(self._handle), "tide_buf_destroy")
            self._handle = None

    def __del__(self):
        try:
            self.close()
        except Exception as e:
            # At interpreter exit the library (or warnings) may be gone: the
            # allocator gives back the rest. Otherwise the failure is reported.
            if not sys.is_finalizing():
                warnings.warn("tidalloc.Buffer: closing it when it was collected failed: %s" % e,
                              RuntimeWarning, stacklevel=2)


# __cuda_array_interface__ type strings of the dtypes it can describe; bfloat16
# has none, so it is described as int16 and viewed back.
_TYPESTR = {"float32": "<f4", "float16": "<f2", "float64": "<f8", "int32": "<i4",
            "int64": "<i8", "int16": "<i2", "int8": "|i1", "uint8": "|u1", "bool": "|b1"}


class _View:
    """The buffer's whole range as __cuda_array_interface__. The tensor built
    from it keeps it, and it keeps the Buffer: the buffer lives as long as any
    tensor over it."""

    def __init__(self, owner, ptr, shape, typestr):
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False),
                                         "version": 3, "strides": None, "stream": None}


def _itemsize(torch, dtype):
    """Bytes per element of `dtype`."""
    return torch.empty((), dtype=dtype).element_size()


def _typestr(torch, dtype):
    name = str(dtype).replace("torch.", "")
    if name not in _TYPESTR:
        raise TypeError("GrowableTensor: dtype %s is not supported (supported: %s, bfloat16)"
                        % (dtype, ", ".join(sorted(_TYPESTR))))
    return _TYPESTR[name]


class GrowableTensor:
    """Rows of shape `row_shape` and `dtype` appended in place, up to
    `capacity_rows`. `tensor()` is a torch tensor over the rows so far (a view:
    no copy; the same data pointer as the cache grows), usable in any torch op.

    One tensor over the whole capacity is built at creation (the buffer's
    address never changes) and each append returns a narrowed view of it, so
    an append costs one library call (the resize) and a copy of the new rows.
    On the host backend (an emulated device, no GPU) the rows are host memory
    and the tensors are CPU tensors.

    `map_ahead_rows`: rows kept mapped beyond the length, mapped by the
    buffer's worker thread; the next page is mapped once fewer rows than that
    are left in the mapped ones, so a few appends' worth holds little memory.
    `map_ahead_fraction` (e.g. 0.01): map ahead at most that fraction of the
    rows in use, so a short tensor holds no pages it does not use yet."""

    def __init__(self, row_shape, dtype, capacity_rows, device=0, map_ahead_rows=0,
                 map_ahead_fraction=0.0):
        import torch
        self._torch = torch
        self.row_shape = tuple(row_shape)
        self.dtype = dtype
        self.device = device
        self.capacity_rows = capacity_rows
        self.row_bytes = _itemsize(torch, dtype)
        for d in self.row_shape:
            self.row_bytes *= d
        if capacity_rows <= 0 or self.row_bytes <= 0:
            raise ValueError("GrowableTensor: capacity_rows and the row size must be positive "
                             "(capacity_rows=%d, row_shape=%s)" % (capacity_rows, self.row_shape))
        # The byte counts, checked here so that a message names the rows.
        for name, rows in (("capacity_rows", capacity_rows), ("map_ahead_rows", map_ahead_rows)):
            _lib.size_arg(rows * self.row_bytes, "GrowableTensor: %s=%d rows of %d bytes (%d bytes)"
                          % (name, rows, self.row_bytes, rows * self.row_bytes))
        self.rows = 0
        self._host = _lib.backend(device) == "host"
        # On close, pages go once the stream that was current at creation is past
        # the work queued on it, as PyTorch frees a block on its stream.
        self._buf = Buffer(capacity_rows * self.row_bytes, device,
                           map_ahead=map_ahead_rows * self.row_bytes,
                           map_ahead_fraction=map_ahead_fraction,
                           release_stream=self._current_stream())
        self._full = self._over_buffer(self._host)
        # The hot path: the bound C function and the raw handle, no wrappers.
        self._resize = _lib.lib().tide_buf_resize
        self._handle = self._buf._handle

    def _current_stream(self):
        if self._host:
            return None
        return self._torch.cuda.current_stream(self.device).cuda_stream or None

    def _over_buffer(self, host):
        """One tensor of capacity_rows rows over the whole buffer."""
        torch = self._torch
        shape = (self.capacity_rows,) + self.row_shape
        nbytes = self.capacity_rows * self.row_bytes
        if host:
            raw = (ctypes.c_uint8 * nbytes).from_address(self._buf.data)
            raw.owner = self._buf  # the tensor keeps `raw`, `raw` keeps the buffer
            return torch.frombuffer(raw, dtype=torch.uint8).view(self.dtype).view(shape)
        # PyTorch asks the driver which device the pointer belongs to, which
        # needs its first page mapped; length stays 0 (nothing counted allocated).
        self._buf.reserve_ahead(self.row_bytes)
        store = torch.int16 if self.dtype == torch.bfloat16 else self.dtype
        view = _View(self._buf, self._buf.data, shape, _typestr(torch, store))
        t = torch.as_tensor(view, device="cuda:%d" % self.device)
        return t.view(self.dtype) if store != self.dtype else t

    def tensor(self):
        """The rows so far: a view, valid while the rows are kept."""
        return self._full[:self.rows]

    def append(self, rows):
        """Copy `rows` (n x row_shape) to the end; returns the tensor of all rows."""
        if tuple(rows.shape[1:]) != self.row_shape:
            raise ValueError("GrowableTensor.append: rows of shape %s, expected (n,) + %s"
                             % (tuple(rows.shape), self.row_shape))
        start = self.extend(rows.shape[0])
        self._full[start:self.rows].copy_(rows)
        return self._full[:self.rows]

    def extend(self, n):
        """Add n rows, their contents unset, and return where they start:
        the rows [start, start + n) are the caller's to fill."""
        end = self.rows + n
        if end > self.capacity_rows:
            raise ValueError("GrowableTensor: %d + %d rows is beyond the capacity of %d "
                             "rows; create it with a larger capacity_rows"
                             % (self.rows, n, self.capacity_rows))
        # Growing maps pages now and uses no stream (nothing queued reads past
        # the old length), so no stream is looked up here.
        if self._resize(self._handle, end * self.row_bytes, None) != 0:
            raise _lib.TidallocError("GrowableTensor: tide_buf_resize(%d) failed: %s"
                                     % (end * self.row_bytes, _lib.last_error()))
        start, self.rows = self.rows, end
        return start

    def truncate(self, rows):
        """Keep the first `rows` rows; pages past them go once the current
        stream is past the work queued so far."""
        self.rows = max(0, min(rows, self.rows))
        self._buf.resize(self.rows * self.row_bytes, self._current_stream())

    def close(self):
        """Give the buffer back now (once the stream of its creation is past
        the work queued on it), rather than when the last tensor over it goes.
        Tensors over it must not be used afterwards."""
        self._full = None
        self._handle = None  # the C handle dies with the buffer; append then fails cleanly
        self._buf.close()

    @property
    def data_ptr(self):
        return self._buf.data
