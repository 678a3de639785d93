"""test_extend_stream_trace.py: bench/extend_stream_trace.py, which carries a
recorded streaming trace on to more frames, on a made-up trace (no torch, no
GPU): the added frames repeat the last one with each size moved by its step,
every free is of a live allocation, and a trace that is not steady is
refused."""
import gzip

import pytest
from repo_module import load

MARKER = 1175040


def load_script():
    return load("bench/extend_stream_trace.py")


def made_up_trace(frames, bad_frame=None):
    """Each frame: the marker (freed in the frame), a cache that grows by 100
    bytes a frame and replaces the previous frame's, and a transient."""
    rows, t, addr = [], 0, 4096
    cache = None
    for f in range(frames):
        t += 10
        rows.append([t, "alloc", addr, MARKER, 0])
        marker, addr = addr, addr + 4096
        size = 1000 + 100 * f + (7 if f == bad_frame else 0)
        t += 10
        rows.append([t, "alloc", addr, size, 0])
        new_cache, addr = (addr, size), addr + 4096
        if cache:
            t += 10
            rows.append([t, "free", cache[0], cache[1], 0])
        cache = new_cache
        t += 10
        rows.append([t, "alloc", addr, 5000, 0])
        t += 10
        rows.append([t, "free", addr, 5000, 0])
        addr += 4096
        t += 10
        rows.append([t, "free", marker, MARKER, 0])
    return [[str(x) for x in r] for r in rows]


def replay_check(rows):
    """Every free is of a live allocation; the live sizes at the end."""
    live = {}
    for _, action, addr, size, _ in rows:
        if action == "alloc":
            assert addr not in live
            live[addr] = int(size)
        else:
            assert live.pop(addr) == int(size)
    return sorted(live.values())


def test_added_frames_repeat_the_last_with_each_step(tmp_path):
    ext = load_script()
    rows = made_up_trace(6)
    out = tmp_path / "out.csv.gz"
    with gzip.open(out, "wt") as f:
        found, extra = ext.extend(rows, total_frames=10, recorded_frames=6, marker=MARKER, out=f)
    assert (found, extra) == (5, 5)  # the sixth frame, with no marker after it, made again
    with gzip.open(out, "rt") as f:
        assert f.readline().startswith("t_us,action,addr,size,stream")
        written = [line.rstrip("\n").split(",") for line in f]
    # The recorded frames up to the last whole one, then five more: ten in all.
    markers = [r for r in written if r[1] == "alloc" and int(r[3]) == MARKER]
    assert len(markers) == 10
    caches = [int(r[3]) for r in written if r[1] == "alloc" and int(r[3]) not in (MARKER, 5000)]
    assert caches == [1000 + 100 * f for f in range(10)]
    times = [int(r[0]) for r in written]
    assert times == sorted(times)
    # Only the last cache is live at the end: every repeated free found its
    # allocation, of the same frame or the one before.
    assert replay_check(written) == [1900]


def test_a_trace_that_is_not_steady_is_refused(tmp_path):
    ext = load_script()
    rows = made_up_trace(6, bad_frame=3)  # one size off its step in the last frames
    with gzip.open(tmp_path / "out.csv.gz", "wt") as f:
        with pytest.raises(SystemExit, match="not steady"):
            ext.extend(rows, total_frames=10, recorded_frames=6, marker=MARKER, out=f)
