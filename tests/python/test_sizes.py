"""test_sizes.py: sizes, counts and device numbers crossing into the library
through ctypes, which would wrap them modulo 2**64 (or 2**32) without a word:
a negative one or one too large for its C type is a ValueError or
OverflowError naming the argument, one that fits the type but not the device
is the library's own out-of-memory error, and nothing changes either way.
Also configure() with bytes. Host backend, as test_tidalloc.py; GrowableTensor
is checked with a stand-in for torch where torch is not installed (its sizes
are checked before any tensor is made)."""
import os
import subprocess
import sys
import types

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
import tidalloc  # noqa: E402
from tidalloc import _lib, buffer, share  # noqa: E402

MiB = 1 << 20
TOO_LARGE = (1 << 64, (1 << 64) + (1 << 30), 1 << 70)


def _named(info, name):
    assert name in str(info.value), str(info.value)


@pytest.mark.parametrize("capacity", TOO_LARGE)
def test_buffer_capacity_past_a_size_is_refused(capacity):
    # Before: 2**64 + 2**30 made a 1 GiB buffer.
    with pytest.raises(OverflowError) as info:
        buffer.Buffer(capacity)
    _named(info, "capacity")


def test_buffer_negative_sizes_are_refused():
    with pytest.raises(ValueError) as info:
        buffer.Buffer(-1)
    _named(info, "capacity")
    with pytest.raises(ValueError) as info:
        buffer.Buffer(8 * MiB, map_ahead=-4096)
    _named(info, "map_ahead")
    with pytest.raises(OverflowError) as info:
        buffer.Buffer(8 * MiB, map_ahead=1 << 64)
    _named(info, "map_ahead")


def test_buffer_sizes_must_be_whole_numbers():
    with pytest.raises(TypeError) as info:
        buffer.Buffer(8.5 * MiB)
    _named(info, "capacity")


@pytest.mark.parametrize("length", TOO_LARGE + (-1, -(1 << 64)))
def test_buffer_resize_past_a_size_changes_nothing(length):
    b = buffer.Buffer(8 * MiB)
    try:
        b.resize(4 * MiB)
        mapped = b.mapped
        # Before: resize(2**64) was resize(0) and emptied the buffer.
        with pytest.raises(ValueError if length < 0 else OverflowError) as info:
            b.resize(length)
        _named(info, "length")
        assert len(b) == 4 * MiB and b.mapped == mapped
        with pytest.raises(ValueError if length < 0 else OverflowError) as info:
            b.reserve_ahead(length)
        _named(info, "length")
        assert len(b) == 4 * MiB and b.mapped == mapped
    finally:
        b.close()


def test_sizes_that_fit_but_not_the_device_are_the_librarys_out_of_memory():
    b = buffer.Buffer(1 << 44)  # address space only: the range is reserved, not mapped
    try:
        with pytest.raises(_lib.TidallocError) as info:
            b.resize(1 << 44)
        assert _lib.lib().tide_last_status() == 1, str(info.value)  # TIDE_ERR_OOM
        assert "would be passed" in str(info.value), str(info.value)
        assert len(b) == 0
    finally:
        b.close()
    with pytest.raises(_lib.TidallocError) as info:
        buffer.Buffer((1 << 64) - 1)
    assert "capacity" in str(info.value), str(info.value)


@pytest.mark.parametrize("index", [1 << 32, -(1 << 31) - 1, 1 << 64])
def test_device_numbers_past_a_c_int_are_refused(index):
    # Before: 2**32 wrapped to device 0.
    with pytest.raises((ValueError, OverflowError)) as info:
        _lib.device(index)
    _named(info, "device")
    with pytest.raises((ValueError, OverflowError)):
        tidalloc.memory_stats(index)


def test_trace_capacity_past_a_size_is_refused():
    from tidalloc import viz
    with pytest.raises(ValueError) as info:
        viz.trace_events(0, cap=-1)
    _named(info, "cap")
    with pytest.raises(OverflowError) as info:
        viz.trace_events(0, cap=1 << 64)
    _named(info, "cap")


def test_share_import_sizes_past_their_fields_are_refused():
    desc = (1 << 64, 0, 1, 0, 0)  # size, offset, pieces, device, backend
    with pytest.raises(OverflowError) as info:
        share.Imported(desc, [(0, 0, 2 * MiB)])
    _named(info, "size")
    with pytest.raises(ValueError) as info:
        share.Imported((2 * MiB, 0, 1, 0, 0), [(0, -1, 2 * MiB)])
    _named(info, "offset")


class _FakeTorch(types.ModuleType):
    """Just enough of torch for GrowableTensor to size its buffer."""

    float32 = "torch.float32"

    def __init__(self):
        super().__init__("torch")

    @staticmethod
    def empty(shape, dtype=None):
        return types.SimpleNamespace(element_size=lambda: 4)


@pytest.fixture
def torch_module(monkeypatch):
    try:
        import torch
        return torch
    except ImportError:
        fake = _FakeTorch()
        monkeypatch.setitem(sys.modules, "torch", fake)
        return fake


def test_growable_tensor_past_a_size_names_its_rows(torch_module):
    # Before: 2**62 rows of 2 KiB wrapped to a capacity of 0, and the
    # library's message said so while the call asked for 2**73 bytes.
    with pytest.raises(OverflowError) as info:
        tidalloc.GrowableTensor((8, 64), torch_module.float32, 1 << 62)
    _named(info, "capacity_rows")
    assert str(1 << 62) in str(info.value)
    with pytest.raises(OverflowError) as info:
        tidalloc.GrowableTensor((8, 64), torch_module.float32, 16, map_ahead_rows=1 << 62)
    _named(info, "map_ahead_rows")
    with pytest.raises(ValueError) as info:
        tidalloc.GrowableTensor((8, 64), torch_module.float32, 16, map_ahead_rows=-1)
    _named(info, "map_ahead_rows")


def test_configure_takes_bytes_or_says_it_wants_text():
    # A process of its own: the configuration is taken before first use.
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from tidalloc import _lib\n"
            "_lib.configure(b'trace:7')\n"
            "print(_lib.conf_option('trace'))\n"
            % os.path.join(os.path.dirname(__file__), "..", "..", "python"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "('7', 'code')", out.stdout
    # Before: bytes failed inside the NUL check with "a bytes-like object is
    # required, not 'str'".
    with pytest.raises(_lib.TidallocError, match="NUL character at index 12"):
        _lib.configure(b"backend:host\0page_size_mb:999")
    with pytest.raises(TypeError) as info:
        _lib.configure(12)
    _named(info, "str")
    with pytest.raises(ValueError) as info:
        _lib.configure(b"backend:\xff")
    _named(info, "UTF-8")
