"""test_share.py: tidalloc.share on the host backend, without torch: a block
exported and mapped again (here in the same process, as another process
would), writes seen both ways, descriptors closed, the mapping gone on
close(); and a clear error for a pointer tidalloc does not know."""
import ctypes
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
from tidalloc import _lib, share  # noqa: E402

MiB = 1 << 20


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def test_export_import_roundtrip():
    lib = _lib.lib()
    size = 5 * MiB
    p = lib.tide_torch_alloc(size, 0, None)
    assert p, _lib.last_error()
    ctypes.memset(p, 0x21, size)
    before = open_fds()
    desc, pieces = share.export(p, 0)
    # three 2 MiB pages, or one load handle of three while the stream has freed nothing
    assert desc[0] == size and desc[2] == len(pieces) in (1, 3)
    assert share.block_of(p + 100, 0) == (p, size)
    mem = share.import_(desc, pieces, 0)
    for fd, _, _ in pieces:
        os.close(fd)
    assert mem.ptr and mem.ptr != p
    assert ctypes.string_at(mem.ptr + size - 4, 4) == b"\x21" * 4
    ctypes.memset(mem.ptr, 0x42, 16)
    assert ctypes.string_at(p, 16) == b"\x42" * 16
    mem.close()
    mem.close()  # once only
    assert open_fds() == before  # the mapping's own descriptors went with it
    lib.tide_torch_free(p, size, 0, None)
    lib.tide_torch_empty_cache(0)


def test_unknown_pointer_is_a_clear_error():
    x = ctypes.create_string_buffer(64)
    with pytest.raises(_lib.TidallocError, match="not allocated by this allocator"):
        share.export(ctypes.addressof(x), 0)
