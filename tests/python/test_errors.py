"""test_errors.py: failures of the Python layer that used to be dropped or
told twice: a library without tidalloc's symbols, configuration text with a
NUL, a device that does not exist, and a Buffer or Imported whose close
fails when it is collected (host backend, as test_tidalloc.py)."""
import ctypes.util
import gc
import os
import subprocess
import sys

import pytest

PYTHON = os.path.join(os.path.dirname(__file__), "..", "..", "python")
sys.path.insert(0, PYTHON)
import tidalloc  # noqa: E402
from tidalloc import _lib, buffer, share  # noqa: E402


def test_a_library_without_tidalloc_symbols_is_a_tidalloc_error():
    name = ctypes.util.find_library("c")
    assert name
    # TIDALLOC_LIB must name a file: the loaded libc's own path.
    with open("/proc/self/maps") as maps:
        paths = [line.split()[-1] for line in maps if line.rstrip().endswith(name)]
    libc = paths[0] if paths else name
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from tidalloc import _lib\n"
            "try:\n"
            "    _lib.lib()\n"
            "except _lib.TidallocError as e:\n"
            "    print('TidallocError:', e)\n" % PYTHON)
    env = dict(os.environ, TIDALLOC_LIB=libc)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "TidallocError:" in out.stdout
    assert "is not tidalloc's library" in out.stdout and "tide_device" in out.stdout


def test_configuration_with_a_nul_is_refused():
    # Before: C saw only "backend:host" (the value already in force) and took it.
    with pytest.raises(_lib.TidallocError, match="NUL character at index 12"):
        tidalloc._lib.configure("backend:host\0page_size_mb:999")


def test_device_error_names_the_call_once():
    for index in (99, -1):
        with pytest.raises(_lib.TidallocError) as info:
            _lib.device(index)
        message = str(info.value)
        assert message.count("tide_device(%d)" % index) == 1, message
        assert "does not exist" in message


def _failing_close():
    raise _lib.TidallocError("injected failure")


def test_buffer_collected_with_a_failing_close_warns():
    b = buffer.Buffer(8 << 20)
    b.resize(4 << 20)
    b.close()  # the real one; the next close, when collected, fails
    b.close = _failing_close
    with pytest.warns(RuntimeWarning, match="tidalloc.Buffer.*injected failure"):
        del b
        gc.collect()


def test_imported_collected_with_a_failing_close_warns():
    im = share.Imported.__new__(share.Imported)
    im.close = _failing_close
    with pytest.warns(RuntimeWarning, match="tidalloc.Imported.*injected failure"):
        del im
        gc.collect()
