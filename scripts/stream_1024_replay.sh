#!/usr/bin/env bash
# stream_1024_replay.sh [OUT.csv]: the streaming model in PyTorch at 1024
# frames, on the host: bench/traces/stream_gct_96.csv.gz carried on to 1024
# frames (scripts/extend_stream_trace.py) and replayed (`tidalloc replay`,
# host backend, an emulated H200, work completing eight events behind as on
# a GPU) under the default and other release settings (keys joined by '+'),
# one row each:
# reserved over the trace's live peak, mappings, unmappings, stream waits.
# Counts, not times: what the GPU pays for. The H100's own counts for the
# same settings are in bench/results/h100/stream_gct_1024_paired.csv.
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
"$py" scripts/extend_stream_trace.py bench/traces/stream_gct_96.csv.gz "$dir/t.csv.gz" 1024 >&2
echo "setting,reserved_over_live,mappings,unmappings,stream_waits" >"$out"
for s in "${settings[@]}"; do
  conf=backend:host,host_capacity:141GiB,host_queue_depth:8
  [[ $s == defaults ]] || conf+=",${s//+/,}"
  env -u TIDALLOC_CONF "$bin" replay "$dir/t.csv.gz" --conf "$conf" >"$dir/r.txt"
  awk -v s="$s" '{ v[$1] = $2 } END { OFS = ","; print s, v["reserved_over_live"], v["mappings"], v["unmappings"], v["stream_waits"] }' "$dir/r.txt" >>"$out"
done
column -s, -t "$out"
