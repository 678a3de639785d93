"""test_tidalloc.py: the Python layer without torch and without a GPU:
libtidalloc through ctypes on the host backend (TIDALLOC_CONF=backend:host,trace:N,
TIDALLOC_LIB naming the library; ctest sets both)."""
import ctypes
import os
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
import tidalloc  # noqa: E402
from tidalloc import _lib  # noqa: E402

MiB = 1 << 20


def test_library_found():
    assert os.path.exists(tidalloc.library_path())


def test_torch_entry_points_allocate_and_count():
    lib = _lib.lib()
    before = tidalloc.memory_stats(0)
    p = lib.tide_torch_alloc(3 * MiB, 0, None)
    assert p, _lib.last_error()
    st = tidalloc.memory_stats(0)
    assert st["allocated_bytes.all.current"] == before["allocated_bytes.all.current"] + 3 * MiB
    assert st["allocation.all.current"] == before["allocation.all.current"] + 1
    assert st["reserved_bytes.all.current"] >= st["allocated_bytes.all.current"]
    ctypes.memset(p, 0x5A, 3 * MiB)  # host backend: the CPU may write it
    assert _lib.owns(p, 0) and _lib.owns(p + 12345, 0)
    local = ctypes.create_string_buffer(64)
    assert not _lib.owns(ctypes.addressof(local), 0)
    lib.tide_torch_free(p, 3 * MiB, 0, None)
    st = tidalloc.memory_stats(0)
    assert st["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    assert st["allocated_bytes.all.peak"] >= 3 * MiB
    tidalloc.reset_peak(0)
    assert tidalloc.memory_stats(0)["allocated_bytes.all.peak"] == st["allocated_bytes.all.current"]


def test_zero_and_failed_allocations_are_null():
    lib = _lib.lib()
    assert not lib.tide_torch_alloc(0, 0, None)
    assert not lib.tide_torch_alloc(1 << 62, 0, None)
    assert "larger than any device" in _lib.last_error()


def test_empty_cache_and_fraction():
    lib = _lib.lib()
    p = lib.tide_torch_alloc(8 * MiB, 0, None)
    lib.tide_torch_free(p, 8 * MiB, 0, None)
    assert tidalloc.memory_stats(0)["reserved_bytes.all.current"] > 0
    maps = tidalloc.memory_stats(0)["num_device_map"]
    waits = tidalloc.memory_stats(0)["num_stream_waits"]
    mapping_ns = tidalloc.memory_stats(0)["device_mapping_ns"]
    assert maps >= 1  # 2 MiB pages, one mapping each, or one load handle before any free
    assert mapping_ns > 0
    assert lib.tide_torch_empty_cache(0) == 0
    st = tidalloc.memory_stats(0)
    assert st["reserved_bytes.all.current"] == 0
    assert st["num_device_unmap"] >= 1 and st["num_device_map"] == maps
    assert st["device_mapping_ns"] > mapping_ns  # the unmapping took time too
    # The growth asked the device for its free memory, and the fields after
    # device_mapping_ns in the C structure are read where they are.
    assert st["num_device_queries"] >= 1 and st["device_query_ns"] > 0
    # Giving the cache back waits for the stream first (and the count is read
    # from the right field of the C structure, not its neighbours).
    assert waits + 1 <= st["num_stream_waits"] <= waits + 4
    assert lib.tide_torch_set_memory_fraction(0.5, 0) == 0
    assert lib.tide_torch_set_memory_fraction(2.0, 0) != 0


def test_configure_after_first_use_is_refused():
    tidalloc.stats(0)
    with pytest.raises(tidalloc.TidallocError, match="tide_config_process_set"):
        tidalloc.configure("memory_limit:1GiB")


def test_run_without_torch_says_why(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("print('ran')\n")
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "..", "python"))
    r = subprocess.run([sys.executable, "-m", "tidalloc", "run", str(script)], env=env,
                       capture_output=True, text=True)
    try:
        import torch  # noqa: F401
        has_torch = True
    except ImportError:
        has_torch = False
    if has_torch:
        pytest.skip("torch is installed: the GPU tests run scripts under it")
    assert r.returncode != 0
    assert "torch" in r.stderr


def test_growable_buffer_keeps_address_and_data():
    b = tidalloc.Buffer(64 * MiB)
    b.resize(3 * MiB)
    base = b.data
    ctypes.memset(base, 0x11, 3 * MiB)
    before = tidalloc.memory_stats(0)["allocated_bytes.all.current"]
    b.resize(40 * MiB)
    assert b.data == base and len(b) == 40 * MiB and b.mapped >= 40 * MiB
    assert ctypes.string_at(base, 16) == b"\x11" * 16
    assert ctypes.string_at(base + 3 * MiB - 16, 16) == b"\x11" * 16
    assert tidalloc.memory_stats(0)["allocated_bytes.all.current"] == before + 37 * MiB
    with pytest.raises(tidalloc.TidallocError, match="capacity"):
        b.resize(65 * MiB)
    b.resize(1 * MiB)
    assert b.mapped == 2 * MiB
    b.close()
    assert tidalloc.memory_stats(0)["allocated_bytes.all.current"] == before - 3 * MiB


@pytest.mark.parametrize("ring", [False, True])
def test_growable_buffer_close_waits_for_its_stream(ring):
    # Closing must not unmap under work still queued on the release stream:
    # a shrink to nothing keeps the pages mapped ahead (no event to wait
    # for) and a ring never shrinks. A held stream of the host backend is
    # work that does not end: close refuses and keeps the buffer whole.
    lib = _lib.lib()
    lib.tide_host_stream_hold.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.tide_host_stream_release.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    alloc = lib.tide_device(0)
    stream = ctypes.c_void_p()
    lib.tide_stream_create.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.tide_stream_destroy.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    assert lib.tide_stream_create(alloc, ctypes.byref(stream)) == 0, _lib.last_error()
    b = tidalloc.Buffer(8 * MiB, ring=ring, map_ahead=0 if ring else 4 * MiB,
                        release_stream=stream.value)
    if not ring:
        b.resize(2 * MiB, stream.value)
        # The worker maps ahead on its own time; mapping the whole capacity
        # now leaves it nothing to change under the comparison below.
        b.reserve_ahead(8 * MiB)
    ctypes.memset(b.data, 0x5C, 2 * MiB)
    mapped = b.mapped
    assert lib.tide_host_stream_hold(alloc, stream) == 0
    with pytest.raises(tidalloc.TidallocError, match="kept"):
        b.close()
    assert b.mapped == mapped and ctypes.string_at(b.data, 8) == b"\x5c" * 8
    assert lib.tide_host_stream_release(alloc, stream) == 0
    b.close()
    assert lib.tide_stream_destroy(alloc, stream) == 0


def test_growable_buffer_maps_ahead_by_bytes():
    """map_ahead is bytes: the next page is mapped once the length comes within
    that much of it, by the buffer's worker thread."""
    b = tidalloc.Buffer(64 * MiB, map_ahead=256 * 1024)
    b.resize(1 * MiB)
    b.resize(MiB + MiB // 2)  # + 256 KiB still fits the first page
    assert b.mapped == 2 * MiB
    b.resize(2 * MiB - 128 * 1024)  # + 256 KiB passes it: the worker maps the next
    deadline = time.monotonic() + 5
    while b.mapped < 4 * MiB and time.monotonic() < deadline:
        time.sleep(0.001)
    assert b.mapped == 4 * MiB
    b.close()


def test_growable_buffer_map_ahead_fraction_bounds_it():
    """map_ahead_fraction reaches the C options: a short buffer maps only its
    length, a long one at most that fraction of it ahead."""
    b = tidalloc.Buffer(1024 * MiB, map_ahead=64 * MiB, map_ahead_fraction=0.01)
    b.resize(3 * MiB)
    time.sleep(0.01)
    assert b.mapped == 4 * MiB  # 31 KiB ahead fits the last page's rest: nothing more
    b.resize(400 * MiB)  # 4 MiB ahead, not 64
    deadline = time.monotonic() + 5
    while b.mapped < 404 * MiB and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.01)
    assert b.mapped == 404 * MiB
    b.close()
    with pytest.raises(_lib.TidallocError):
        tidalloc.Buffer(64 * MiB, map_ahead=MiB, map_ahead_fraction=2.0)


def test_memory_viz_snapshot_has_pytorchs_shape(tmp_path):
    import pickle
    from tidalloc import viz
    lib = _lib.lib()
    ps = [lib.tide_torch_alloc(size, 0, None) for size in (3 * MiB, 512, 100000, 7 * MiB)]
    lib.tide_torch_free(ps[1], 0, 0, None)
    buf = tidalloc.Buffer(32 * MiB)
    buf.resize(5 * MiB)
    path = tmp_path / "snapshot.pickle"
    viz.export_memory_viz(str(path))
    snap = pickle.loads(path.read_bytes())
    assert set(snap) == {"segments", "device_traces"}
    blocks = [b for s in snap["segments"] for b in s["blocks"]]
    live = {b["address"] for b in blocks if b["state"] == "active_allocated"}
    assert {p for i, p in enumerate(ps) if i != 1} <= live and ps[1] not in live
    for s in snap["segments"]:
        assert s["total_size"] == sum(b["size"] for b in s["blocks"])
        assert s["segment_type"] in ("small", "large")
        assert s["allocated_size"] <= s["active_size"] <= s["total_size"]
    seg = [s for s in snap["segments"] if s["address"] == buf.data]
    assert len(seg) == 1 and seg[0]["allocated_size"] == 5 * MiB and seg[0]["total_size"] == 6 * MiB
    buf.close()
    actions = [e["action"] for e in snap["device_traces"][0]]
    if _lib.conf_option("trace")[0] != "0":  # ctest turns the trace on; a plain run may not
        assert "alloc" in actions and "free_requested" in actions
    else:
        assert actions == []
    for p in ps[:1] + ps[2:]:
        lib.tide_torch_free(p, 0, 0, None)


def test_growable_tensor_appends_in_place_on_the_host_backend():
    # On the host backend a GrowableTensor is a CPU tensor over the buffer's
    # host pages: the narrowing, dtypes and figures are checked without a GPU.
    torch = pytest.importorskip("torch")
    import gc
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        before = tidalloc.memory_stats(0)["allocated_bytes.all.current"]
        g = tidalloc.GrowableTensor((8, 64), dtype, capacity_rows=4096, map_ahead_rows=64)
        ptr = g.data_ptr
        assert g.tensor().shape == (0, 8, 64) and g.tensor().dtype == dtype
        ref = torch.empty(0, 8, 64, dtype=dtype)
        for step in range(1, 40):  # 780 rows: past the first 2 MiB page for 4- and 8-byte types
            rows = (torch.arange(step * 512).reshape(step, 8, 64) % 251 - 125).to(dtype)
            out = g.append(rows)
            ref = torch.cat([ref, rows])
            assert out.data_ptr() == ptr and out.dtype == dtype and out.shape == ref.shape
            assert torch.equal(out, ref)
        assert (tidalloc.memory_stats(0)["allocated_bytes.all.current"] ==
                before + ref.shape[0] * g.row_bytes)
        assert torch.equal(g.tensor(), ref) and g.tensor().data_ptr() == ptr
        with pytest.raises(ValueError, match="capacity"):
            g.append(torch.zeros(4000, 8, 64, dtype=dtype))
        with pytest.raises(ValueError, match="shape"):
            g.append(torch.zeros(1, 64, 8, dtype=dtype))
        assert g.rows == ref.shape[0]  # a refused append changes nothing
        g.truncate(10)
        assert torch.equal(g.tensor(), ref[:10])
        assert torch.equal(g.append(ref[10:20]), ref[:20])
        # A view outlives the GrowableTensor: the buffer goes with the last tensor over it.
        view = g.tensor()
        del g, out
        gc.collect()
        assert torch.equal(view, ref[:20])
        del view
        gc.collect()
        assert tidalloc.memory_stats(0)["allocated_bytes.all.current"] == before
    g = tidalloc.GrowableTensor((4,), torch.float32, capacity_rows=16)
    g.append(torch.ones(3, 4))
    g.close()
    with pytest.raises(tidalloc.TidallocError, match="not a live growable buffer"):
        g.append(torch.ones(1, 4))


@pytest.mark.parametrize("env_conf, conf, expected", [
    ("", None, "True code"),
    ("", "memory_limit:1GiB", "True code"),
    ("capture_detection:False", None, "False environment"),
    ("capture_detection:True", None, "True environment"),
    ("", "capture_detection:False", "False code"),
])
def test_install_turns_capture_detection_on_unless_the_user_set_it(env_conf, conf, expected):
    # install()'s configuration step alone (the rest needs CUDA), in a fresh
    # process: the process-wide configuration is fixed after first use.
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "..", "python"),
               TIDALLOC_CONF=",".join(c for c in ("backend:host", env_conf) if c))
    code = ("from tidalloc import torch as t, _lib; t._configure(%r); "
            "print(*_lib.conf_option('capture_detection'))" % (conf,))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == expected


def test_install_default_after_first_use_warns(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "..", "python"),
               TIDALLOC_CONF="backend:host")
    code = ("import tidalloc; from tidalloc import torch as t, _lib; tidalloc.stats(0); "
            "t._configure(); print(*_lib.conf_option('capture_detection'))")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False default"
    assert "capture_detection:True not applied" in r.stderr


def test_replay_trace_round_trips(tmp_path):
    """write_replay_trace writes what the allocator saw in `tidalloc replay`'s
    format; where the tidalloc command was built beside the library, it
    replays that file cleanly (every free matches an allocation)."""
    import gzip
    from tidalloc import viz
    lib = _lib.lib()
    before = tidalloc.memory_stats(0)["allocated_bytes.all.current"]
    sizes = (512, 3 * MiB, 40 * MiB, 4096)
    blocks = [lib.tide_torch_alloc(n, 0, None) for n in sizes]
    assert all(blocks), _lib.last_error()
    for p, n in zip(blocks[:3], sizes[:3]):
        lib.tide_torch_free(p, n, 0, None)
    path = tmp_path / "trace.csv.gz"
    written = viz.write_replay_trace(str(path))
    lines = gzip.open(path, "rt").read().splitlines()
    assert lines[0] == "t_us,action,addr,size,stream"
    assert len(lines) == written + 1
    rows = [line.split(",") for line in lines[1:]]
    assert all(r[1] in ("alloc", "free") and r[4] == "0" for r in rows)
    # Each of our blocks ends with its allocation (of at least its size), then
    # for the three freed ones their free.
    for i, (p, n) in enumerate(zip(blocks, sizes)):
        mine = [r for r in rows if int(r[2]) == p]
        tail = ["alloc"] if i == 3 else ["alloc", "free"]
        assert [r[1] for r in mine[-len(tail):]] == tail
        assert int(mine[-len(tail)][3]) >= n
    cli = os.path.join(os.path.dirname(os.environ.get("TIDALLOC_LIB", "")), "tidalloc")
    if os.path.exists(cli):
        out = subprocess.run([cli, "replay", str(path), "--conf", "backend:host"],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        keys = dict(line.split(None, 1) for line in out.stdout.splitlines() if " " in line)
        assert int(keys["unknown_frees"]) == 0 and int(keys["malformed_lines"]) == 0
    lib.tide_torch_free(blocks[3], sizes[3], 0, None)
    assert tidalloc.memory_stats(0)["allocated_bytes.all.current"] == before


def test_replay_trace_refuses_a_ring_that_lost_events(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "..", "python"),
               TIDALLOC_CONF="backend:host,trace:16")
    code = ("import tidalloc; from tidalloc import _lib, viz; lib = _lib.lib()\n"
            "for _ in range(20):\n"
            "    lib.tide_torch_free(lib.tide_torch_alloc(4096, 0, None), 4096, 0, None)\n"
            "try: viz.write_replay_trace(%r)\n"
            "except _lib.TidallocError as e: print(e)\n" % str(tmp_path / "t.csv.gz"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "lost the oldest events" in r.stdout and "trace:" in r.stdout
    assert not (tmp_path / "t.csv.gz").exists()


def test_pool_breakdown_sums_each_pool_apart():
    from tidalloc.viz import pool_breakdown

    class FakeCuda:
        @staticmethod
        def memory_snapshot():
            return [dict(segment_pool_id=(0, 0), total_size=4 << 20, allocated_size=1 << 20),
                    dict(segment_pool_id=(1, 3), total_size=2 << 20, allocated_size=0),
                    dict(segment_pool_id=(0, 0), total_size=2 << 20, allocated_size=2 << 20)]

    class FakeTorch:
        cuda = FakeCuda

    assert pool_breakdown(FakeTorch) == ("usual memory reserved 6.0 MiB allocated 3.0 MiB; "
                                         "pool (1, 3) reserved 2.0 MiB allocated 0.0 MiB")

    class WithBlocks:
        @staticmethod
        def memory_snapshot():
            blocks = [dict(size=1 << 20, state="active_allocated"),
                      dict(size=512 << 10, state="inactive"),
                      dict(size=256 << 10, state="active_pending_free"),
                      dict(size=256 << 10, state="inactive")]
            return [dict(segment_pool_id=(1, 2), total_size=2 << 20, allocated_size=1 << 20,
                         blocks=blocks)]

    class FakeTorch2:
        cuda = WithBlocks

    assert pool_breakdown(FakeTorch2) == (
        "pool (1, 2) reserved 2.0 MiB allocated 1.0 MiB (1 segment(s); free 0.8 MiB in 2 "
        "block(s), the largest 0.5 MiB)")
    assert pool_breakdown(FakeTorch2, {(1, 2): 3 << 19}) == (
        "pool (1, 2) reserved 2.0 MiB allocated 1.0 MiB (1 segment(s); free 0.8 MiB in 2 "
        "block(s), the largest 0.5 MiB), allocated peak 1.5 MiB")
