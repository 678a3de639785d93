#!/usr/bin/env python3
"""replay_frontier.py: how much memory each recorded trace needs under
tidalloc, replayed on the host backend: uncapped, then under memory_limit at
multiples of the trace's peak live bytes. This is the table of
docs/tuning.md (tests/tuning_figure.sh checks that the two agree).

    scripts/replay_frontier.py [--tidalloc PATH] [TRACE.csv.gz ...]

Defaults: the `tidalloc` command on PATH (else build/tidalloc) and every
trace of bench/traces/. Each cell is reserved bytes at the peak over the
trace's peak live bytes, and the pages unmapped to stay under the limit;
"out of memory" where an allocation failed under that limit. Every replay
runs on a 24 GiB emulated device with nothing but --conf set, so the table
is the same on every machine."""
import argparse
import glob
import math
import os
import shutil
import subprocess
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
MULTIPLES = ("1.005", "1.01", "1.015", "1.02", "1.05")
BASE_CONF = "backend:host,host_capacity:24GiB"


def find_tidalloc(given):
    if given:
        return given
    found = shutil.which("tidalloc")
    if found:
        return found
    built = os.path.join(ROOT, "build", "tidalloc")
    if os.access(built, os.X_OK):
        return built
    sys.exit("replay_frontier: no tidalloc command (on PATH or in build/); pass --tidalloc")


def replay(tidalloc, trace, extra=""):
    """The replay's figures as a dict, or None when an allocation failed."""
    env = {k: v for k, v in os.environ.items() if k != "TIDALLOC_CONF"}
    conf = BASE_CONF + ("," + extra if extra else "")
    r = subprocess.run([tidalloc, "replay", trace, "--csv", "--conf", conf], env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        if "out of memory" in r.stderr:
            return None
        sys.exit("replay_frontier: %s failed: %s" % (trace, r.stderr.strip()))
    header, row = r.stdout.strip().splitlines()[-2:]
    return dict(zip(header.split(","), row.split(",")))


def cell(figures, live):
    if figures is None:
        return "out of memory"
    ratio = int(figures["peak_reserved_bytes"]) / live
    return "%.3f, %s unmappings" % (ratio, figures["unmappings"])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tidalloc", help="the tidalloc command (default: on PATH, else build/)")
    p.add_argument("traces", nargs="*",
                   default=sorted(glob.glob(os.path.join(ROOT, "bench", "traces", "*.csv.gz"))))
    args = p.parse_args()
    tidalloc = find_tidalloc(args.tidalloc)
    print("| trace | peak live | uncapped | %s |" %
          " | ".join("limit %s x" % m for m in MULTIPLES))
    print("|---|---|---|%s" % ("---|" * len(MULTIPLES)))
    for trace in args.traces:
        uncapped = replay(tidalloc, trace)
        if uncapped is None:
            sys.exit("replay_frontier: %s runs out of memory uncapped" % trace)
        live = int(uncapped["peak_live_bytes"])
        cells = [cell(uncapped, live)]
        for m in MULTIPLES:
            limit = math.ceil(live * float(m))
            cells.append(cell(replay(tidalloc, trace, "memory_limit:%d" % limit), live))
        name = os.path.basename(trace)
        print("| `%s` | %.2f GiB | %s |" % (name, live / float(1 << 30), " | ".join(cells)))


if __name__ == "__main__":
    main()
