"""frame_flatness.py: whether bench/torch/stream_gct.py's time per frame stays
flat once its KV window is full, from the rows of --per-frame-csv.

    python bench/torch/frame_flatness.py FRAMES.csv [MORE.csv ...]

For each run (the `frames` column) it takes the steps made after the cache
first held its largest number of frames (the window full: from then on each
frame adds and evicts as much as it keeps) and prints their count, the
median step time of their first and last thirds, the ratio of the two, and
the least-squares slope of step time against frame, as percent of the median
per 100 frames. Flat: a ratio near 1 and a slope near 0; a cache copied
whole every frame (torch.cat) shows as a rising ratio only while its length
grows, so after the window is full both variants should be flat and the
growable one lower."""
import csv
import statistics
import sys


def steady_steps(rows):
    """(frame, seconds) of the steps after the cache first reached its
    largest length, in order."""
    full = max(int(r["cache_frames"]) for r in rows)
    out, reached = [], False
    for r in sorted(rows, key=lambda r: int(r["frame"])):
        reached = reached or int(r["cache_frames"]) == full
        if reached and r["seconds"]:
            out.append((int(r["frame"]), float(r["seconds"])))
    return out


def flatness(steps):
    """(steps, first third's median, last third's median, ratio, slope in %
    of the median per 100 frames), or None with fewer than 6 steps."""
    if len(steps) < 6:
        return None
    third = len(steps) // 3
    first = statistics.median(s for _, s in steps[:third])
    last = statistics.median(s for _, s in steps[-third:])
    xs = [f for f, _ in steps]
    ys = [s for _, s in steps]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    median = statistics.median(ys)
    return len(steps), first, last, last / first, 100.0 * slope * 100.0 / median


def main(paths):
    if not paths:
        sys.exit("usage: frame_flatness.py FRAMES.csv [MORE.csv ...]")
    print("file,frames,steady_steps,first_third_ms,last_third_ms,last_over_first,"
          "slope_pct_per_100_frames")
    for path in paths:
        with open(path) as f:
            rows = list(csv.DictReader(f))
        for frames in sorted({r["frames"] for r in rows}, key=int):
            steps = steady_steps([r for r in rows if r["frames"] == frames])
            got = flatness(steps)
            if got is None:
                print("%s,%s,%d,,,," % (path, frames, len(steps)))
                continue
            n, first, last, ratio, slope = got
            print("%s,%s,%d,%.3f,%.3f,%.4f,%.2f" % (path, frames, n, first * 1e3, last * 1e3,
                                                    ratio, slope))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
