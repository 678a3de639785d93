#!/usr/bin/env bash
# bench_host.sh: the benchmarks that run without a GPU, with their results
# written under bench/results/<name>/ next to a description of the machine:
#   replay.csv  the recorded traces (TRACE_DIR's, default bench/traces: GPT-2
#               generation, ViT, bench/torch/stream_gct.py's 96 frames),
#               expandable segments (defaults, and without release_holes)
#               and fixed segments
#   stream.csv  the streaming workload, fixed vs expandable segments
#   micro.csv   alloc+free latency: tidalloc's cached path, glibc, mimalloc
#   machine.txt CPU, system, compiler, commit and date
#   bench/bench_host.sh [NAME]     (default: host)
# Environment: TRACE_DIR (default bench/traces), FRAMES (default 64..1024),
# TIDALLOC (default build/tidalloc).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
name=${1:-host}
out=bench/results/$name
tidalloc=${TIDALLOC:-build/tidalloc}
traces=${TRACE_DIR:-bench/traces}
frames=${FRAMES:-64 128 256 512 1024}

[[ -x $tidalloc ]] || { echo "bench_host: $tidalloc is not built (make build)" >&2; exit 1; }
mkdir -p "$out"

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git rev-parse HEAD)$(git diff --quiet HEAD -- src include tools || echo ' (with local changes)')"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //') x $(nproc)"
  echo "system: $(uname -srm)"
  echo "compiler: $(cc --version | head -1)"
  echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
} >"$out/machine.txt"

# Replays: each configuration's row, with the configuration in front.
echo "conf,trace,events,peak_live_bytes,peak_allocated_bytes,peak_reserved_bytes,reserved_over_live,seconds,mappings,unmappings" \
  >"$out/replay.csv"
for conf in "expandable_segments:True" "expandable_segments:True,release_holes:False" \
  "expandable_segments:False"; do
  for trace in "$traces"/*.csv.gz; do
    # The streaming model's trace holds 17 GiB: replayed on an emulated H200.
    c=$conf
    [[ $trace == *stream_gct* ]] && c=$conf,host_capacity:141GiB
    row=$("$tidalloc" replay "$trace" --conf "$c" --csv | tail -1)
    echo "\"$c\",$row" >>"$out/replay.csv"
  done
done

# The streaming workload: fixed segments on an emulated H200, expandable on
# the same device.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# shellcheck disable=SC2086
"$tidalloc" stream --frames $frames --conf host_capacity:141GiB,expandable_segments:False \
  --label tidalloc-fixed --csv "$tmp/fixed.csv" >/dev/null
# shellcheck disable=SC2086
"$tidalloc" stream --frames $frames --conf host_capacity:141GiB,expandable_segments:True \
  --label tidalloc-expandable --csv "$tmp/expandable.csv" >/dev/null
{ head -1 "$tmp/fixed.csv"; tail -q -n +2 "$tmp/fixed.csv" "$tmp/expandable.csv"; } >"$out/stream.csv"

"$tidalloc" micro --csv >"$out/micro.csv"
echo "load average at end: $(cut -d' ' -f1-3 /proc/loadavg)" >>"$out/machine.txt"
echo "bench_host: results in $out/"
