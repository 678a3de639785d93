#!/usr/bin/env python3
"""extend_stream_trace.py: a recorded streaming trace carried on to more frames.

Once bench/torch/stream_gct.py's window is full, every frame makes the same
allocations and frees in the same order; only some sizes move, each by its own
constant step a frame (the caches of evicted frames' special tokens grow
without bound, and with them the transients that join them to the window).
So the last recorded frame, with each size moved on by its step, is every
later frame: this writes the recorded trace and then that frame repeated until
the run has FRAMES frames, in `tidalloc replay`'s format. A free in the
template frame is of an allocation made in that frame or the one before (the
script checks), and so is each repeated free.

Frames are told apart by an allocation that each frame makes once (--marker,
the size of stream_gct.py's first per-frame allocation by default). The last
three recorded frames must agree in their events and in each size's step,
or the script stops and says where they do not.

  bench/extend_stream_trace.py bench/traces/stream_gct_96.csv.gz out.csv.gz 1024

On the H100, the 96-frame trace carried on to 1024 frames replays (host
backend, host_queue_depth:8) to within a few percent of the PyTorch program's
own mappings, stream waits and reserved / allocated at 1024 frames
(bench/results/host/stream_1024_replay.md).
"""
import argparse
import gzip
import sys

MARKER = 1175040  # stream_gct.py's first allocation of each frame, bytes


def read_trace(path):
    with gzip.open(path, "rt") as f:
        header = f.readline()
        if not header.startswith("t_us,action,addr,size,stream"):
            sys.exit(f"extend_stream_trace: {path}: not a trace (header {header.strip()!r})")
        return [line.rstrip("\n").split(",") for line in f if line.strip()]


def frame_starts(rows, marker):
    return [i for i, r in enumerate(rows) if r[1] == "alloc" and int(r[3]) == marker]


def check_steady(frames):
    """The last three frames: the same actions, each size's step the same."""
    a, b, c = frames[-3:]
    if not len(a) == len(b) == len(c):
        sys.exit(f"extend_stream_trace: the last frames differ in length ({len(a)}, {len(b)}, {len(c)})")
    for i, (x, y, z) in enumerate(zip(a, b, c)):
        if not x[1] == y[1] == z[1] or int(z[3]) - int(y[3]) != int(y[3]) - int(x[3]):
            sys.exit(f"extend_stream_trace: event {i} of the last frames is not steady: {x}, {y}, {z}")


def free_sources(frames):
    """For each free of the last frame: (frames back, index of its allocation)."""
    last = len(frames) - 1
    live, sources = {}, {}
    for k in range(max(0, last - 3), last + 1):
        for i, r in enumerate(frames[k]):
            if r[1] == "alloc":
                live[r[2]] = (k, i)
                continue
            src = live.pop(r[2], None)
            if k == last:
                if src is None or last - src[0] > 1:
                    sys.exit(f"extend_stream_trace: free {i} of the last frame is of an older allocation")
                sources[i] = (last - src[0], src[1])
    return sources


def extend(rows, total_frames, recorded_frames, marker, out):
    starts = frame_starts(rows, marker)
    if len(starts) < 4:
        sys.exit(f"extend_stream_trace: {len(starts)} frames found by the marker; need 4")
    frames = [rows[x:y] for x, y in zip(starts, starts[1:])]
    check_steady(frames)
    template, before = frames[-1], frames[-2]
    steps = [int(t[3]) - int(b[3]) for t, b in zip(template, before)]
    sources = free_sources(frames)
    prefix = rows[: starts[-1]]
    out.write("t_us,action,addr,size,stream\n")
    for r in prefix:
        out.write(",".join(r) + "\n")
    t = int(prefix[-1][0])
    span = int(template[-1][0]) - int(template[0][0])
    tick = max(1, span // len(template))
    previous = {i: r[2] for i, r in enumerate(template) if r[1] == "alloc"}
    next_addr = 1 << 52  # above any device address, 2 MiB apart
    extra = total_frames - recorded_frames + 1  # the partial last frame is made again
    for f in range(1, extra + 1):
        current = {}
        for i, r in enumerate(template):
            t += tick
            size = int(r[3]) + f * steps[i]
            if r[1] == "alloc":
                current[i] = next_addr
                next_addr += 1 << 21
                out.write(f"{t},alloc,{current[i]},{size},{r[4]}\n")
            else:
                back, j = sources[i]
                addr = current[j] if back == 0 else previous[j]
                out.write(f"{t},free,{addr},{size},{r[4]}\n")
        previous = current
    return len(frames), extra


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace", help="a recorded stream_gct trace (.csv.gz)")
    p.add_argument("out", help="the trace carried on (.csv.gz)")
    p.add_argument("frames", type=int, help="frames the carried-on run has in all")
    p.add_argument("--recorded-frames", type=int, default=96,
                   help="frames the recorded run had (default 96)")
    p.add_argument("--marker", type=int, default=MARKER,
                   help=f"size of the allocation each frame makes once (default {MARKER})")
    a = p.parse_args()
    if a.frames <= a.recorded_frames:
        sys.exit("extend_stream_trace: FRAMES must be more than the recorded frames")
    rows = read_trace(a.trace)
    with gzip.open(a.out, "wt", compresslevel=3) as out:
        found, extra = extend(rows, a.frames, a.recorded_frames, a.marker, out)
    print(f"extend_stream_trace: {found} whole frames found, {extra} added: {a.out}")


if __name__ == "__main__":
    main()
