"""share.py: memory tidalloc allocated, mapped by other processes.

export() and import_() wrap tide_share_export / tide_share_import: a block
becomes a description and a list of POSIX file descriptors (one per page,
or one for a fixed segment), and another process maps them at an address of
its own. enable_torch_sharing() teaches torch.multiprocessing to send CUDA
tensors that way while tidalloc is PyTorch's allocator: PyTorch's own path
(cudaIpcGetMemHandle through the caching allocator) does not exist for a
pluggable allocator and fails inside PyTorch. The descriptors travel with
multiprocessing's own descriptor passing (multiprocessing.reduction.DupFd),
so queues, pipes and pools of any start method work.

As with PyTorch's own sharing, the sending process must keep a tensor alive
while receivers use it: once freed there, its memory may be handed out
again. A receiver's mapping lives as long as its tensor does.
"""
import ctypes
import os
import sys
import warnings

from . import _lib


class ShareDesc(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint64), ("offset", ctypes.c_uint64),
                ("num_pieces", ctypes.c_uint32), ("device", ctypes.c_int32),
                ("backend", ctypes.c_uint32), ("reserved", ctypes.c_uint32)]


class SharePiece(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("pad", ctypes.c_uint32), ("offset", ctypes.c_uint64),
                ("size", ctypes.c_uint64)]


_bound = False


def _l():
    global _bound
    l = _lib.lib()
    if not _bound:
        l.tide_share_export.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ShareDesc),
                                        ctypes.POINTER(ctypes.POINTER(SharePiece))]
        l.tide_share_import.argtypes = [ctypes.c_void_p, ctypes.POINTER(ShareDesc),
                                        ctypes.POINTER(SharePiece), ctypes.POINTER(ctypes.c_void_p)]
        l.tide_share_close.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        l.tide_share_pieces_close.restype = None
        l.tide_share_pieces_close.argtypes = [ctypes.POINTER(SharePiece), ctypes.c_uint32]
        l.tide_block_info.argtypes = [ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.POINTER(ctypes.c_void_p),
                                      ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p]
        _bound = True
    return l


def block_of(ptr, device=0):
    """(start, size) of the tidalloc block that holds address `ptr`."""
    base, size = ctypes.c_void_p(), ctypes.c_size_t()
    _lib.check(_l().tide_block_info(_lib.device(device), ptr, ctypes.byref(base),
                                    ctypes.byref(size), None), "tide_block_info")
    return base.value or 0, size.value


def export(ptr, device=0):
    """Export the block holding `ptr`: (description, pieces), the description
    a tuple of plain numbers, pieces a list of (fd, offset, size) whose
    descriptors the caller owns and must close."""
    l = _l()
    desc = ShareDesc()
    pieces = ctypes.POINTER(SharePiece)()
    _lib.check(l.tide_share_export(_lib.device(device), ptr, ctypes.byref(desc),
                                   ctypes.byref(pieces)), "tide_share_export")
    out = [(pieces[i].fd, pieces[i].offset, pieces[i].size) for i in range(desc.num_pieces)]
    ctypes.CDLL(None).free(ctypes.cast(pieces, ctypes.c_void_p))  # the array; fds are ours now
    return (desc.size, desc.offset, desc.num_pieces, desc.device, desc.backend), out


class Imported:
    """Memory another process exported, mapped here; unmapped when this
    object goes (or on close())."""

    def __init__(self, desc, pieces, device=0):
        l = _l()
        # Fields ctypes would take modulo their width: refused here instead.
        u64, u32 = _lib.unsigned_arg, lambda v, what: _lib.unsigned_arg(v, what, 32)
        d = ShareDesc(u64(desc[0], "Imported: the description's size"),
                      u64(desc[1], "Imported: the description's offset"),
                      u32(desc[2], "Imported: the description's num_pieces"),
                      _lib.int_arg(desc[3], "Imported: the description's device"),
                      u32(desc[4], "Imported: the description's backend"), 0)
        if len(pieces) != d.num_pieces:
            raise ValueError("%d pieces for a description of %d" % (len(pieces), d.num_pieces))
        arr = (SharePiece * len(pieces))()
        for i, (fd, offset, size) in enumerate(pieces):
            arr[i].fd = _lib.int_arg(fd, "Imported: piece %d's fd" % i)
            arr[i].offset = u64(offset, "Imported: piece %d's offset" % i)
            arr[i].size = u64(size, "Imported: piece %d's size" % i)
        out = ctypes.c_void_p()
        self.device = device
        self.ptr = 0
        _lib.check(l.tide_share_import(_lib.device(device), ctypes.byref(d), arr, ctypes.byref(out)),
                   "tide_share_import")
        self.ptr = out.value
        self.size = d.size

    def close(self):
        if getattr(self, "ptr", 0):  # absent when __init__ failed early
            ptr, self.ptr = self.ptr, 0
            _lib.check(_l().tide_share_close(_lib.device(self.device), ptr), "tide_share_close")

    def __del__(self):
        try:
            self.close()
        except Exception as e:
            # At interpreter exit the library (or warnings) may be gone: the
            # allocator gives back the rest. Otherwise the failure is reported.
            if not sys.is_finalizing():
                warnings.warn("tidalloc.Imported: closing it when it was collected failed: %s" % e,
                              RuntimeWarning, stacklevel=2)


def import_(desc, pieces, device=0):
    """Map exported memory: an Imported whose .ptr is the block's address."""
    return Imported(desc, pieces, device)


class _Region:
    """Bytes of an Imported mapping as a CUDA array, for torch.as_tensor;
    the tensor keeps this object, and so the mapping, alive."""

    def __init__(self, mem, delta, nbytes):
        self.mem = mem
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (mem.ptr + delta, False),
            "version": 3, "strides": None}


def _rebuild_tensor(desc, dupfds, delta, nbytes, dtype, size, stride, storage_offset,
                    requires_grad, device, is_param):
    import torch
    fds = [d.detach() for d in dupfds]
    try:
        mem = import_(desc, [(fd, off, sz) for fd, (off, sz) in zip(fds, desc[5])], device)
    finally:
        for fd in fds:
            os.close(fd)
    flat = torch.as_tensor(_Region(mem, delta, nbytes), device="cuda:%d" % device)
    t = torch.empty((0,), dtype=dtype, device=flat.device)
    t.set_(flat.untyped_storage(), storage_offset, size, stride)
    if is_param:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    t.requires_grad_(requires_grad)
    return t


def _reduce_tensor(tensor):
    from multiprocessing import reduction
    import torch
    if tensor.requires_grad and not tensor.is_leaf:
        raise RuntimeError("Cowardly refusing to serialize non-leaf tensor which requires_grad, "
                           "since autograd does not support crossing process boundaries. If you "
                           "just want to transfer the data, call detach() on the tensor before "
                           "serializing (e.g., putting it on the queue).")
    device = tensor.device.index or 0
    storage = tensor.untyped_storage()
    # The receiver reads what the sender's queued kernels wrote.
    torch.cuda.current_stream(device).synchronize()
    start, _ = block_of(storage.data_ptr(), device)
    desc, pieces = export(storage.data_ptr(), device)
    from multiprocessing import context
    try:
        if context.get_spawning_popen() is not None:
            # Arguments of a process being started: its Popen passes these
            # very descriptors to the child later, so they must stay open.
            _kept.extend(os.dup(fd) for fd, _, _ in pieces)
            dupfds = [reduction.DupFd(fd) for fd in _kept[-len(pieces):]]
        else:
            dupfds = [reduction.DupFd(fd) for fd, _, _ in pieces]  # duplicates them
    finally:
        for fd, _, _ in pieces:
            os.close(fd)
    meta = desc + ([(off, size) for _, off, size in pieces],)
    return (_rebuild_tensor,
            (meta, dupfds, storage.data_ptr() - start, storage.nbytes(), tensor.dtype,
             tuple(tensor.size()), tuple(tensor.stride()), tensor.storage_offset(),
             tensor.requires_grad, device, isinstance(tensor, torch.nn.Parameter)))


_enabled = False
_kept = []  # descriptors handed to processes being started


def enable_torch_sharing():
    """Send CUDA tensors through torch.multiprocessing with tidalloc's
    sharing (tidalloc.torch.install() calls this). Other tensors keep
    PyTorch's own path."""
    global _enabled
    if _enabled:
        return
    import torch
    from multiprocessing.reduction import ForkingPickler
    from torch.multiprocessing import reductions
    original = reductions.reduce_tensor

    def reduce(tensor):
        if tensor.is_cuda and not tensor.is_sparse and not tensor.is_nested:
            return _reduce_tensor(tensor)
        return original(tensor)

    reductions.init_reductions()  # PyTorch's first, so that ours replace them
    for cls in (torch.Tensor, torch.nn.parameter.Parameter):
        ForkingPickler.register(cls, reduce)
    _enabled = True
