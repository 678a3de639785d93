#!/usr/bin/env bash
# run_stream.sh: the main benchmark. Runs the streaming-inference workload of
# `tidalloc stream` three times, with fixed and with expandable segments (the
# KV caches grown by concatenation, as the model does), and with expandable
# segments and the caches in growable buffers (--mode grow), on an
# emulated device the size of an H200 unless told otherwise, merges both CSV
# files into out/stream.csv and prints how much memory each mode reserved for
# what it allocated.
#   scripts/run_stream.sh
# Environment:
#   TIDALLOC   the command (default build/tidalloc)
#   FRAMES     frame counts of the sweep (default 64 .. 1024; the benchmark sweeps up to 10000)
#   STREAM_CONF  extra options for both runs (default host_capacity:141GiB)
#   OUT        where the CSV files go (default out)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
tidalloc=${TIDALLOC:-build/tidalloc}
frames=${FRAMES:-64 128 256 512 1024}
conf=${STREAM_CONF:-host_capacity:141GiB}
out=${OUT:-out}

die() { printf 'run_stream: %s\n' "$*" >&2; exit 1; }

[[ -x $tidalloc ]] || die "$tidalloc is not built (run \`make build\`)"
"$tidalloc" stream --help >/dev/null 2>&1 ||
  die "$tidalloc has no working \`stream\` command (\`$tidalloc stream --help\` failed)"
mkdir -p "$out"

# One sweep per mode; the mode's name goes into the CSV's backend column.
run_mode() {
  local mode=$1 expandable=$2 caches=${3:-cat}
  local csv=$out/stream_$mode.csv
  rm -f "$csv"
  printf '\n== tidalloc-%s: expandable_segments:%s, caches by %s, frames %s\n' "$mode" \
    "$expandable" "$caches" "$frames"
  # shellcheck disable=SC2086 # one argument per frame count
  "$tidalloc" stream --frames $frames --mode "$caches" \
    --conf "expandable_segments:$expandable,$conf" --label "tidalloc-$mode" --csv "$csv" ||
    die "tidalloc stream failed for $mode segments (exit $?)"
  [[ -s $csv ]] || die "tidalloc stream wrote no $csv"
}

run_mode fixed False
run_mode expandable True
run_mode expandable-grow True grow

python3 - "$out/stream_fixed.csv" "$out/stream_expandable.csv" "$out/stream_expandable-grow.csv" \
  "$out/stream.csv" <<'PY'
"""Merge the sweeps (same columns) into one CSV and print the comparison."""
import csv
import sys

*inputs, merged_path = sys.argv[1:]
needed = ["frames", "status", "backend", "peak_allocated_gib", "peak_reserved_gib"]
header, rows = None, []
for path in inputs:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if header is None:
            header = reader.fieldnames
        elif reader.fieldnames != header:
            sys.exit(f"run_stream: {path} has columns {reader.fieldnames}, expected {header}")
        missing = [c for c in needed if c not in (reader.fieldnames or [])]
        if missing:
            sys.exit(f"run_stream: {path} lacks the columns {missing}")
        file_rows = list(reader)
        if not file_rows:
            sys.exit(f"run_stream: {path} has no rows")
        rows.extend(file_rows)

with open(merged_path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=header, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)

def number(text):
    try:
        return float(text)
    except ValueError:
        return None

rows.sort(key=lambda r: int(r["frames"]))  # stable: the modes in the order run
print(f"\n{'frames':>7}  {'mode':<24} {'status':<6} {'peak alloc GiB':>14} "
      f"{'peak reserved GiB':>17} {'reserved/allocated':>18}")
for r in rows:
    alloc, reserved = number(r["peak_allocated_gib"]), number(r["peak_reserved_gib"])
    ratio = f"{reserved / alloc:.3f}" if alloc and reserved is not None else "-"
    show = lambda v: f"{v:.2f}" if v is not None else "-"
    print(f"{r['frames']:>7}  {r['backend']:<24} {r['status']:<6} {show(alloc):>14} "
          f"{show(reserved):>17} {ratio:>18}")
print(f"\nwrote {merged_path} ({len(rows)} rows)")
PY
