#!/usr/bin/env bash
# stream_release_sweep.sh [OUT.csv]: the C model of the streaming workload
# (`tidalloc stream`, host backend, an emulated 40 GiB device) at 512 and 1024
# frames under the defaults and under other release settings (release_slack,
# wait_limit; keys joined by '+' in a setting), one row per setting and frame
# count: the reserved / allocated
# ratio at the end and at its highest through the run, the driver's mappings
# and unmappings, and the stream waits. Counts, not times: they are what a
# GPU pays for (docs/design.md, "The remapping that keeps 1.02").
# Default OUT: bench/results/host/stream_release_sweep.csv. Needs build/tidalloc.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:-bench/results/host/stream_release_sweep.csv}
bin=${TIDALLOC_BIN:-build/tidalloc}
[ -x "$bin" ] || { echo "stream_release_sweep: no $bin (make build)" >&2; exit 1; }
settings=(defaults release_slack:0.017 release_slack:0.017+wait_limit:0.025
          release_slack:0.017+wait_limit:0.03 release_slack:0.017+wait_limit:1 wait_limit:1
          release_slack:0.02 release_slack:0.03 release_slack:0.05 release_slack:0.1)
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
echo "setting,frames,reserved_over_allocated,max_running_ratio,max_running_ratio_frame,mappings,unmappings,stream_waits" >"$out"
for s in "${settings[@]}"; do
  conf=host_capacity:40GiB
  [[ $s == defaults ]] || conf+=",${s//+/,}"
  "$bin" stream --frames 512 1024 --conf "$conf" --driver-csv "$tmp" >/dev/null
  # driver csv: 1 frames, 5 reserved_over_allocated, 8 mappings, 9 unmappings,
  # 10 max_running_ratio, 11 its frame, 15 stream_waits
  tail -n +2 "$tmp" | awk -F, -v s="$s" 'BEGIN { OFS = "," } { print s, $1, $5, $10, $11, $8, $9, $15 }' >>"$out"
done
column -s, -t "$out"
