#!/usr/bin/env python3
"""plot_stream_kv.py: summarise the per-frame CSVs of bench_stream_kv.sh
(DIR/raw/frames_*.csv) into DIR/stream_kv_summary.csv (one row per run),
DIR/stream_kv_frames.csv (every frame of every run, with its run's frame
count) and DIR/stream_kv.png (time per frame and bytes copied per frame as
the cache grows, for each way of growing it)."""
import csv
import glob
import os
import statistics
import sys


def load(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def summarise(rows):
    ms = [float(r["ms"]) for r in rows]
    med = statistics.median(ms)
    # Frames slower than 5% above the median: what mapping must not cause.
    slow = sum(1 for x in ms if x > 1.05 * med)
    alloc = max(int(r["allocated"]) for r in rows)
    res = max(int(r["reserved"]) for r in rows)
    copied = sum(int(r["bytes_copied"]) for r in rows) / len(rows)
    # Reserved over allocated after each frame, the most of it: the ratio
    # throughout the run, not only at its peaks.
    frame_ratio = max(int(r["reserved"]) / int(r["allocated"]) for r in rows
                      if int(r["allocated"]) > 0)
    ms_sorted = sorted(ms)
    return {
        "mode": rows[0]["mode"], "exec": rows[0]["exec"], "frames": len(rows),
        "median_ms": f"{med:.4f}", "p99_ms": f"{ms_sorted[int(0.99 * (len(ms) - 1))]:.4f}",
        "max_ms": f"{max(ms):.4f}", "frames_over_5pct": slow,
        "first_quarter_ms": f"{statistics.median(ms[:max(1, len(ms) // 4)]):.4f}",
        "last_quarter_ms": f"{statistics.median(ms[-max(1, len(ms) // 4):]):.4f}",
        "copied_mib_per_frame": f"{copied / 2**20:.2f}",
        "peak_allocated_mib": f"{alloc / 2**20:.1f}", "peak_reserved_mib": f"{res / 2**20:.1f}",
        "reserved_over_allocated": f"{res / alloc:.4f}" if alloc else "",
        "max_frame_ratio": f"{frame_ratio:.4f}",
    }


def main():
    out = sys.argv[1]
    runs = {}
    for path in sorted(glob.glob(os.path.join(out, "raw", "frames_*.csv"))):
        rows = load(path)
        if rows:
            runs[os.path.basename(path)[7:-4]] = rows
    if not runs:
        sys.exit("plot_stream_kv: no per-frame CSV in " + out)
    summary = [summarise(rows) for rows in runs.values()]
    summary.sort(key=lambda s: (s["frames"], s["mode"], s["exec"]))
    with open(os.path.join(out, "stream_kv_summary.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(summary[0].keys()))
        w.writeheader()
        w.writerows(summary)
    with open(os.path.join(out, "stream_kv_frames.csv"), "w", newline="") as f:
        fields = ["run_frames"] + list(next(iter(runs.values()))[0].keys())
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for rows in runs.values():
            for r in rows:
                w.writerow(dict(r, run_frames=len(rows)))
    for s in summary:
        print(",".join(str(v) for v in s.values()))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    longest = max(len(r) for r in runs.values())
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for tag, rows in runs.items():
        if len(rows) != longest:
            continue
        label = f"{rows[0]['mode']} {rows[0]['exec']}"
        frames = [int(r["frame"]) for r in rows]
        ax1.plot(frames, [float(r["ms"]) for r in rows], label=label, linewidth=0.8)
        ax2.plot(frames, [int(r["bytes_copied"]) / 2**20 for r in rows], label=label)
    ax1.set_xlabel("frame")
    ax1.set_ylabel("ms per frame")
    ax1.set_yscale("log")
    ax1.set_title(f"time per frame, {longest} frames")
    ax1.legend()
    ax2.set_xlabel("frame")
    ax2.set_ylabel("MiB copied to grow the cache")
    ax2.set_title("bytes copied per frame")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "stream_kv.png"), dpi=120)


if __name__ == "__main__":
    main()
