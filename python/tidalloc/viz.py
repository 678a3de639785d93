"""viz.py: tidalloc's state for PyTorch's memory tools and as a picture.

export_memory_viz(path) writes a pickle in the format of
torch.cuda.memory._snapshot(), which PyTorch's memory_viz page
(pytorch.org/memory_viz) and torch.cuda._memory_viz open: the segments
(each mapped run of an expandable segment is one segment, as PyTorch shows
expandable segments) with their blocks, each growable buffer as a segment of
its mapped pages, and, when tidalloc's trace ring is
on (the `trace` option), the events as the device trace. timeline_png(path)
draws allocated and reserved bytes over the traced events, and
write_replay_trace(path) writes them as a trace for `tidalloc replay`."""
import ctypes
import json
import pickle

from . import _lib

_STATES = {"allocated": "active_allocated", "pending": "active_pending_free", "free": "inactive",
           "quick": "inactive"}
_ACTIONS = {0: ["alloc"], 1: ["free_requested", "free_completed"], 2: ["segment_map"],
            3: ["segment_unmap"], 4: ["oom"]}


class TraceEvent(ctypes.Structure):
    _fields_ = [("seq", ctypes.c_uint64), ("time_ns", ctypes.c_uint64), ("kind", ctypes.c_uint32),
                ("pool", ctypes.c_uint32), ("addr", ctypes.c_uint64), ("size", ctypes.c_uint64),
                ("stream", ctypes.c_void_p)]


def snapshot_json(device=0):
    """tide_snapshot_json as a dict."""
    lib = _lib.lib()
    text, length = ctypes.c_void_p(), ctypes.c_size_t()
    lib.tide_snapshot_json.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                       ctypes.POINTER(ctypes.c_size_t)]
    lib.tide_string_free.argtypes = [ctypes.c_void_p]
    _lib.check(lib.tide_snapshot_json(_lib.device(device), ctypes.byref(text), ctypes.byref(length)),
               "tide_snapshot_json")
    try:
        return json.loads(ctypes.string_at(text, length.value).decode())
    finally:
        lib.tide_string_free(text)


def trace_events(device=0, cap=1 << 20):
    """The trace ring's newest `cap` events, oldest first, and how many older
    events the ring overwrote."""
    cap = _lib.size_arg(cap, "trace_events: cap")
    lib = _lib.lib()
    lib.tide_trace_read.argtypes = [ctypes.c_void_p, ctypes.POINTER(TraceEvent), ctypes.c_size_t,
                                    ctypes.POINTER(ctypes.c_size_t),
                                    ctypes.POINTER(ctypes.c_uint64)]
    out = (TraceEvent * cap)()
    n, dropped = ctypes.c_size_t(), ctypes.c_uint64()
    _lib.check(lib.tide_trace_read(_lib.device(device), out, cap, ctypes.byref(n),
                                   ctypes.byref(dropped)), "tide_trace_read")
    return list(out[:n.value]), dropped.value


def trace(device=0, cap=1 << 20):
    """The trace ring's events, oldest first (empty when tracing is off)."""
    return trace_events(device, cap)[0]


def write_replay_trace(path, device=0, cap=1 << 22):
    """Write every allocation and free the trace ring holds as a trace that
    `tidalloc replay` reads: gzip'd CSV, t_us,action,addr,size,stream, the
    streams numbered in order of appearance. Refuses (TidallocError) when the
    ring is empty or lost events, since a trace missing its beginning frees
    blocks it never allocated. Returns the number of events written."""
    import gzip
    events, dropped = trace_events(device, cap)
    if not events:
        raise _lib.TidallocError("write_replay_trace: the trace ring is empty (set the trace "
                                 "option, such as TIDALLOC_CONF=trace:1000000)")
    if dropped or len(events) == cap:
        raise _lib.TidallocError(
            "write_replay_trace: the trace ring lost the oldest events (%d overwritten); set the "
            "trace option above the program's count of events (each allocation, free, map and "
            "unmap is one), such as trace:%d" % (dropped, 4 * (len(events) + dropped)))
    streams, written = {}, 0
    with gzip.open(path, "wt") as out:
        out.write("t_us,action,addr,size,stream\n")
        for e in events:
            if e.kind not in (0, 1):  # allocations and frees; the rest is the allocator's own
                continue
            stream = streams.setdefault(e.stream or 0, len(streams))
            out.write("%d,%s,%d,%d,%d\n" % (e.time_ns // 1000, ("alloc", "free")[e.kind], e.addr,
                                           e.size, stream))
            written += 1
    return written


def _segments(snap, device):
    out = []
    for seg in snap["segments"]:
        run = []

        def close():
            if not run:
                return
            blocks = [{"address": b["address"], "size": b["size"],
                       "requested_size": b.get("requested", b["size"]),
                       "state": _STATES.get(b["state"], "inactive"), "frames": []} for b in run]
            out.append({
                "device": device, "address": run[0]["address"],
                "total_size": sum(b["size"] for b in run), "stream": seg.get("stream", 0),
                "segment_type": seg["pool"], "segment_pool_id": (seg.get("capture_pool", 0), 0),
                "is_expandable": seg["kind"] == "expandable",
                "allocated_size": sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
                "active_size": sum(b["size"] for b in blocks if b["state"] != "inactive"),
                "requested_size": sum(b["requested_size"] for b in blocks
                                      if b["state"] == "active_allocated"),
                "frames": [], "blocks": blocks})
            run.clear()

        for b in seg["blocks"]:
            if b["state"] == "unmapped":
                close()
            else:
                run.append(b)
        close()
    return out


def _buffers(snap, device):
    """A growable buffer as a segment of its mapped bytes: the length one
    allocated block, the pages mapped beyond it free."""
    out = []
    for b in snap.get("buffers", []):
        if not b["mapped"]:
            continue
        blocks = [{"address": b["address"], "size": b["length"], "requested_size": b["length"],
                   "state": "active_allocated", "frames": []}] if b["length"] else []
        if b["mapped"] > b["length"]:
            blocks.append({"address": b["address"] + b["length"], "size": b["mapped"] - b["length"],
                           "requested_size": 0, "state": "inactive", "frames": []})
        out.append({"device": device, "address": b["address"], "total_size": b["mapped"],
                    "stream": b["stream"], "segment_type": "large", "segment_pool_id": (0, 0),
                    "is_expandable": True, "allocated_size": b["length"],
                    "active_size": b["length"], "requested_size": b["length"], "frames": [],
                    "blocks": blocks})
    return out


def memory_viz_snapshot(device=0):
    """A dict in the format of torch.cuda.memory._snapshot()."""
    events = []
    for e in trace(device):
        for action in _ACTIONS.get(e.kind, []):
            events.append({"action": action, "addr": e.addr, "size": e.size,
                           "stream": e.stream or 0, "time_us": e.time_ns // 1000, "frames": []})
    snap = snapshot_json(device)
    return {"segments": _segments(snap, device) + _buffers(snap, device),
            "device_traces": [events if d == device else [] for d in range(device + 1)]}


def export_memory_viz(path, device=0):
    with open(path, "wb") as f:
        pickle.dump(memory_viz_snapshot(device), f)


def timeline_png(path, device=0):
    """Allocated and reserved bytes over the traced events (needs `trace`)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    events = trace(device)
    if not events:
        raise _lib.TidallocError("timeline_png: the trace ring is empty (set the trace option, "
                                 "such as TIDALLOC_CONF=trace:1000000)")
    t0 = events[0].time_ns
    allocated = reserved = 0
    xs, ya, yr = [], [], []
    for e in events:
        if e.kind == 0:
            allocated += e.size
        elif e.kind == 1:
            allocated -= e.size
        elif e.kind == 2:
            reserved += e.size
        elif e.kind == 3:
            reserved -= e.size
        xs.append((e.time_ns - t0) / 1e6)
        ya.append(allocated / 2**20)
        yr.append(reserved / 2**20)
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(xs, ya, label="allocated (since the first traced event)", linewidth=0.8)
    ax.plot(xs, yr, label="reserved (pages mapped since it)", linewidth=0.8)
    ax.set_xlabel("ms")
    ax.set_ylabel("MiB")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pool_breakdown(torch, pool_peaks=None):
    """Reserved and allocated bytes of each pool (the usual memory and each
    private pool of CUDA graphs) from torch.cuda.memory_snapshot(), under any
    allocator, as one line: where memory held beyond what is allocated sits.
    Where the snapshot lists blocks, each pool also gets its segments and its
    free blocks (count, bytes, the largest): many small free blocks are
    fragmentation, one large one is memory kept for later. Under tidalloc's
    shim each graph pool also gets its allocated peak (`pool_peaks`, {pool
    id: bytes}, by default from tidalloc.shim.pools()): the most its graphs
    held at once, which the pool's reserved bytes can be compared with."""
    if pool_peaks is None:
        pool_peaks = _shim_pool_peaks(torch)
    pools = {}
    for seg in torch.cuda.memory_snapshot():
        pool = tuple(seg.get("segment_pool_id", (0, 0)))
        p = pools.setdefault(pool, dict(reserved=0, allocated=0, segments=0, blocks=False,
                                        free=0, free_blocks=0, largest=0))
        p["reserved"] += seg["total_size"]
        p["allocated"] += seg["allocated_size"]
        p["segments"] += 1
        for block in seg.get("blocks", ()):
            p["blocks"] = True
            if block["state"] == "inactive":
                p["free"] += block["size"]
                p["free_blocks"] += 1
                p["largest"] = max(p["largest"], block["size"])

    def line(pool, p):
        text = "%s reserved %.1f MiB allocated %.1f MiB" % (
            "usual memory" if pool == (0, 0) else "pool %s" % (pool,), p["reserved"] / 2**20,
            p["allocated"] / 2**20)
        if p["blocks"]:
            text += " (%d segment(s); free %.1f MiB in %d block(s), the largest %.1f MiB)" % (
                p["segments"], p["free"] / 2**20, p["free_blocks"], p["largest"] / 2**20)
        if pool in pool_peaks:
            text += ", allocated peak %.1f MiB" % (pool_peaks[pool] / 2**20)
        return text

    return "; ".join(line(pool, p) for pool, p in sorted(pools.items())) or "no memory"


def _shim_pool_peaks(torch):
    """{pool id: allocated peak} of the graph pools under tidalloc's shim on
    the current device; {} under any other allocator."""
    import sys
    shim = sys.modules.get("tidalloc.shim")
    if shim is None:
        return {}
    try:
        device = torch.cuda.current_device()
    except Exception:  # no CUDA here: nothing to ask
        return {}
    return {pool: figures[1] for pool, figures in shim.pools(device).items()}
