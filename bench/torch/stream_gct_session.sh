#!/usr/bin/env bash
# stream_gct_session.sh: bench/torch/stream_gct.py's full model on one GPU,
# in one call from the repository root: a Release build of the library, then
# one process per allocator (native, expandable_segments:True,
# backend:cudaMallocAsync, tidalloc; then tidalloc with --growable), each
# streaming FRAMES (default "64 128") with a fresh cache per count, and one
# more tidalloc process that records TRACE_FRAMES (default 96: past the window
# of 72, so eviction is in it) frames as a trace for `tidalloc replay`,
# replayed at once on the GPU with tidalloc's default settings. Prints a
# table at the end (also in $OUT/summary.txt). Estimated at 4-5 minutes on an
# H200 (not yet measured; each run is cut at RUN_SECONDS, default 150).
#
#   OUT=/some/dir TIDE_PYTHON=/path/to/python bench/torch/stream_gct_session.sh
#
# Files in $OUT: machine.txt; stream_gct_<run>.csv (the benchmark's columns)
# and stream_gct_<run>_frames.csv (per step) for native, expandable,
# cudaMallocAsync, tidalloc, tidalloc_growable; stream_gct_<run>.log;
# stream_gct_trace.csv.gz (every allocation and free of the trace process),
# stream_gct_trace_replay.txt; summary.txt. RUNS picks the runs, in order
# (default "native expandable cudaMallocAsync tidalloc tidalloc_growable
# trace"; also native_compile and tidalloc_compile: --compile under each,
# whose compilation takes minutes, so give them a larger RUN_SECONDS).
# Exit status: 0 if every run completed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
out=${OUT:-out/stream_gct}
py=${TIDE_PYTHON:-python3}
frames=${FRAMES:-64 128}
trace_frames=${TRACE_FRAMES:-96}
run_limit=${RUN_SECONDS:-150}
mkdir -p "$out"
summary=$out/summary.txt
: >"$summary"
failed=0
start=$(date +%s)

note() { echo "$*" | tee -a "$summary"; }

# The machine and the software.
bench/torch/machine.sh "$py" >"$out/machine.txt"
cat "$out/machine.txt"
if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  note "stream_gct_session: $py has no torch that sees a GPU; set TIDE_PYTHON"
  exit 2
fi

# The library (and the tidalloc command, for the replay), unless built.
if [[ ! -e build/libtidalloc.so || ! -x build/tidalloc ]]; then
  if ! { cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DTIDE_BUILD_TESTS=OFF \
           -DTIDE_BUILD_EXAMPLES=OFF >"$out/build.log" 2>&1 &&
         cmake --build build -j"$(nproc)" >>"$out/build.log" 2>&1; }; then
    note "stream_gct_session: the build failed (build.log)"
    exit 1
  fi
fi
export TIDALLOC_LIB=$PWD/build/libtidalloc.so
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}

# run NAME PYTORCH_CUDA_ALLOC_CONF [tidalloc] -- ARGS...: one process.
run() {
  local name=$1 conf=$2 launcher=()
  shift 2
  if [[ $1 == tidalloc ]]; then
    launcher=(-m tidalloc run)
    shift
  fi
  shift # --
  local t0
  t0=$(date +%s)
  # shellcheck disable=SC2086 # STREAM_ARGS: words
  PYTORCH_CUDA_ALLOC_CONF=$conf timeout --kill-after=10 "$run_limit" \
    "$py" "${launcher[@]}" bench/torch/stream_gct.py "$@" ${STREAM_ARGS:-} \
    >"$out/stream_gct_$name.log" 2>&1
  local rc=$?
  local what=ok
  ((rc == 124 || rc == 137)) && what="TIMEOUT after $run_limit s"
  ((rc != 0 && rc != 124 && rc != 137)) && what="FAILED (exit $rc)"
  [[ $what == ok ]] || failed=1
  note "$(printf '%-22s %-22s %4d s' "$name" "$what" $(($(date +%s) - t0)))"
}

sweep() { # NAME CONF [tidalloc] [-- extra args]
  local name=$1
  # shellcheck disable=SC2086 # $frames: one word per frame count
  run "$@" --frame-counts $frames --csv "$out/stream_gct_$name.csv" \
    --per-frame-csv "$out/stream_gct_${name}_frames.csv"
}

record_trace() {
  # shellcheck disable=SC2086 # $trace_frames: one word per frame count
  TIDALLOC_CONF=${TRACE_CONF:-trace:4000000} run trace "" tidalloc -- \
    --frame-counts $trace_frames --csv "$out/stream_gct_trace.csv" \
    --trace-csv "$out/stream_gct_trace.csv.gz"
  if [[ -s $out/stream_gct_trace.csv.gz && -x build/tidalloc ]]; then
    build/tidalloc replay "$out/stream_gct_trace.csv.gz" \
      >"$out/stream_gct_trace_replay.txt" 2>&1 || failed=1
    note "replay of the trace (CUDA backend, default settings):"
    sed 's/^/  /' "$out/stream_gct_trace_replay.txt" | tee -a "$summary"
  fi
}

for name in ${RUNS:-native expandable cudaMallocAsync tidalloc tidalloc_growable trace}; do
  case $name in
    native) sweep native "" -- ;;
    expandable) sweep expandable "expandable_segments:True" -- ;;
    cudaMallocAsync) sweep cudaMallocAsync "backend:cudaMallocAsync" -- ;;
    tidalloc) sweep tidalloc "" tidalloc -- ;;
    tidalloc_growable) sweep tidalloc_growable "" tidalloc -- --growable ;;
    native_compile) sweep native_compile "" -- --compile ;;
    tidalloc_compile) sweep tidalloc_compile "" tidalloc -- --compile ;;
    trace) record_trace ;;
    *) note "stream_gct_session: unknown run '$name'"; failed=1 ;;
  esac
done

# The table: every row of every run; from the per-step CSVs, the median
# one-frame step while the window fills and once it is full (evicting).
"$py" - "$out" <<'EOF' | tee -a "$summary"
import csv, glob, os, statistics, sys
out = sys.argv[1]


def step_medians(path, frames):
    """(filling, full) median ms of the one-frame steps of that row."""
    if not os.path.exists(path):
        return "-", "-"
    rows = [r for r in csv.DictReader(open(path)) if r["frames"] == frames and r["batch"] == "1"]
    parts = ([r for r in rows if r["special_tokens"] == "0"],
             [r for r in rows if r["special_tokens"] != "0"])
    return tuple("%.1f" % (1e3 * statistics.median(float(r["seconds"]) for r in p)) if p else "-"
                 for p in parts)


print("%-18s %6s %-6s %8s %9s %9s %10s %8s %8s %8s" % (
    "run", "frames", "status", "seconds", "alloc GiB", "resv GiB", "resv/alloc", "ms/frame",
    "ms fill", "ms full"))
for path in sorted(glob.glob(os.path.join(out, "stream_gct_*.csv"))):
    name = os.path.basename(path)[len("stream_gct_"):-len(".csv")]
    if name.endswith("_frames"):
        continue
    for r in csv.DictReader(open(path)):
        a, res = r["peak_allocated_gib"], r["peak_reserved_gib"]
        ratio = "%.4f" % (float(res) / float(a)) if a and res and float(a) else "-"
        per = "%.1f" % (1e3 * float(r["seconds"]) / int(r["frames"])) if r["seconds"] else "-"
        fill, full = step_medians(path[:-len(".csv")] + "_frames.csv", r["frames"])
        print("%-18s %6s %-6s %8s %9s %9s %10s %8s %8s %8s  %s" % (
            name, r["frames"], r["status"], r["seconds"] or "-", a or "-", res or "-", ratio,
            per, fill, full, r["error"][:60]))
EOF
# Whether the time per frame stays flat once the window is full.
frames_csvs=("$out"/stream_gct_*_frames.csv)
if [[ -e ${frames_csvs[0]} ]]; then
  "$py" bench/torch/frame_flatness.py "${frames_csvs[@]}" 2>&1 | sed "s|$out/||" | tee -a "$summary"
fi
note "stream_gct_session: $(($(date +%s) - start)) s in all, $([[ $failed == 0 ]] && echo 'every run completed' || echo 'a run failed: see its log')"
exit $failed
