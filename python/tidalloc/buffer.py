"""buffer.py: growable buffers (tide_buf) from Python: a device range of fixed
address that grows and shrinks in place, and GrowableTensor, a torch tensor
over one that appends along its first dimension without copying what it
holds (its data pointer never changes), for KV caches."""
import ctypes

from . import _lib


class Buffer:
    """A tidalloc growable buffer of `capacity` bytes on `device`."""

    def __init__(self, capacity, device=0, map_ahead=0, ring=False, stream=None):
        lib = _lib.lib()
        o = _lib.BufOptions(capacity=capacity, ring=int(ring), map_ahead=map_ahead,
                            async_map_ahead=int(map_ahead > 0 and not ring), stream=stream)
        handle = ctypes.c_void_p()
        _lib.check(lib.tide_buf_create(_lib.device(device), ctypes.byref(o), ctypes.byref(handle)),
                   "tide_buf_create(%d bytes)" % capacity)
        self._handle = handle

    def resize(self, length, stream=None):
        _lib.check(_lib.lib().tide_buf_resize(self._handle, length, stream),
                   "tide_buf_resize(%d)" % length)

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
        if self._handle:
            _lib.check(_lib.lib().tide_buf_destroy(self._handle), "tide_buf_destroy")
            self._handle = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # at interpreter exit the library may be gone
            pass


_TYPESTR = {"float32": "<f4", "float16": "<f2", "float64": "<f8", "int32": "<i4",
            "int64": "<i8", "int8": "|i1", "uint8": "|u1"}


class _View:
    def __init__(self, ptr, shape, typestr):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, False),
                                         "version": 3, "strides": None, "stream": None}


class GrowableTensor:
    """Rows of shape `row_shape` and `dtype` appended in place on the GPU, up to
    `capacity_rows`. `tensor()` is a torch tensor over the rows so far (a view:
    no copy; the same data pointer as the cache grows), usable in any torch op.
    bfloat16 is stored as int16 bits and viewed back."""

    def __init__(self, row_shape, dtype, capacity_rows, device=0, map_ahead_rows=0):
        import torch
        self._torch = torch
        self.row_shape = tuple(row_shape)
        self.dtype = dtype
        self.device = device
        store = torch.int16 if dtype == torch.bfloat16 else dtype
        self._store = store
        self._typestr = _TYPESTR[str(store).replace("torch.", "")]
        self.row_bytes = torch.empty((), dtype=dtype).element_size()
        for d in self.row_shape:
            self.row_bytes *= d
        self.rows = 0
        self._buf = Buffer(capacity_rows * self.row_bytes, device,
                           map_ahead=map_ahead_rows * self.row_bytes)

    def _stream(self):
        return self._torch.cuda.current_stream(self.device).cuda_stream or None

    def tensor(self):
        view = _View(self._buf.data, (self.rows,) + self.row_shape, self._typestr)
        t = self._torch.as_tensor(view, device="cuda:%d" % self.device)
        return t.view(self.dtype) if self._store is not self.dtype else t

    def append(self, rows):
        """Copy `rows` (n x row_shape) to the end; returns the tensor of all rows."""
        n = rows.shape[0]
        self._buf.resize((self.rows + n) * self.row_bytes, self._stream())
        self.rows += n
        out = self.tensor()
        out[self.rows - n:].copy_(rows)
        return out

    def truncate(self, rows):
        """Keep the first `rows` rows; pages past them go once the stream is done."""
        self.rows = min(rows, self.rows)
        self._buf.resize(self.rows * self.row_bytes, self._stream())

    @property
    def data_ptr(self):
        return self._buf.data
