#!/usr/bin/env bash
# stream_1024_replay.sh [OUT.csv]: the streaming model in PyTorch on the host,
# at 1024 frames (and at 128 and 512 under the default and 0.017):
# bench/traces/stream_gct_96.csv.gz carried on (bench/extend_stream_trace.py)
# and replayed (`tidalloc replay`, host backend, an emulated H200, work
# completing eight events behind as on a GPU) under the default and other
# release settings (keys joined by '+'), one row each: reserved over the
# trace's live peak, mappings, unmappings, stream waits. Counts, not times:
# what the GPU pays for. The H100's own counts for the same settings are in
# bench/results/h100/stream_gct_1024_paired.csv.
# Default OUT: bench/results/host/stream_1024_replay.csv. Needs build/tidalloc.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:-bench/results/host/stream_1024_replay.csv}
bin=${TIDALLOC_BIN:-build/tidalloc}
py=${PYTHON:-python3}
[ -x "$bin" ] || { echo "stream_1024_replay: no $bin (make build)" >&2; exit 1; }
settings=(defaults release_slack:0.017 release_slack:0.018 release_slack:0.019 release_slack:0.02
          release_slack:0.021 release_slack:0.022 release_slack:0.023 release_slack:0.024
          release_slack:0.027 release_slack:0.03 release_slack:0.035 release_slack:0.1
          release_slack:0.017+wait_limit:1 wait_limit:1)
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
echo "frames,setting,reserved_over_live,mappings,unmappings,stream_waits" >"$out"
replay() { # frames setting
  local conf=backend:host,host_capacity:141GiB,host_queue_depth:8
  [[ $2 == defaults ]] || conf+=",${2//+/,}"
  env -u TIDALLOC_CONF "$bin" replay "$dir/t$1.csv.gz" --conf "$conf" >"$dir/r.txt"
  awk -v f="$1" -v s="$2" '{ v[$1] = $2 } END { OFS = ","; print f, s, v["reserved_over_live"], v["mappings"], v["unmappings"], v["stream_waits"] }' "$dir/r.txt" >>"$out"
}
# Shorter runs at the default and at 0.017, for the 128- and 512-frame pairings.
for frames in 128 512; do
  "$py" bench/extend_stream_trace.py bench/traces/stream_gct_96.csv.gz "$dir/t$frames.csv.gz" "$frames" >&2
  for s in defaults release_slack:0.017; do replay "$frames" "$s"; done
done
"$py" bench/extend_stream_trace.py bench/traces/stream_gct_96.csv.gz "$dir/t1024.csv.gz" 1024 >&2
for s in "${settings[@]}"; do replay 1024 "$s"; done
column -s, -t "$out"
