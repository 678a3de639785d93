#!/bin/sh
# stream_ratio.sh: the streaming workload (`tidalloc stream`) on the host
# backend, its caches grown by concatenation (cat) and in growable buffers
# (grow), at 64 and 256 frames: each run must hold at most 1.02 x its peak
# allocated bytes, the goal for expandable segments, at its end and after
# every frame (the peaks so far: --driver-csv's max_running_ratio; the
# tool's buffers once mapped a page ahead each and held 1.026 there).
# Catches a default that costs one mode memory while the other looks fine
# (4 MiB handles once left grow mode at 1.19). Each mode runs twice: with
# streams that complete at once, and with host_queue_depth:8, where work
# completes eight events behind, as on a GPU (pages left mapped until the
# stream is past them once held cat mode at 1.0295 there).
# Two settings: handle_size_mb:4, held to 1.02 after every frame; and the
# defaults (8 MiB handles, which a release gives back only whole), held to
# 1.02 at the end and to RUNNING_LIMIT after every frame: on this model they
# pass 1.02 by up to 0.001 around frames 29-33 (cat mode), while on the
# streaming model in PyTorch they made 40% fewer mappings at the same
# 1.015-1.017 (docs/design.md, "Segments of large handles").
# usage: stream_ratio.sh path/to/tidalloc
set -u

bin=${1:?usage: stream_ratio.sh path/to/tidalloc}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT INT TERM
failures=0
RUNNING_LIMIT=${RUNNING_LIMIT:-1.0215}
for run in cat:0:4 grow:0:4 cat:8:4 grow:8:4 cat:0: grow:0: cat:8: grow:8:; do
  mode=${run%%:*} rest=${run#*:}
  depth=${rest%%:*} handles=${rest#*:}
  conf=backend:host,host_queue_depth:$depth${handles:+,handle_size_mb:$handles}
  running_limit=1.02
  [ -z "$handles" ] && running_limit=$RUNNING_LIMIT
  size="default"
  [ -n "$handles" ] && size="$handles MiB"
  label="$mode, queue depth $depth, $size handles"
  if ! env TIDALLOC_CONF="$conf" "$bin" stream --frames 64 256 \
    --mode "$mode" --csv "$dir/$mode.csv" --driver-csv "$dir/$mode.driver.csv" \
    >"$dir/$mode.out" 2>&1; then
    echo "FAIL: stream --mode $mode failed: $(tail -3 "$dir/$mode.out")" >&2
    failures=$((failures + 1))
    continue
  fi
  # Columns: frames,status,backend,seconds,reserved_over_allocated,...
  rows=$(tail -n +2 "$dir/$mode.driver.csv" | wc -l)
  if [ "$rows" -ne 2 ]; then
    echo "FAIL: stream --mode $mode wrote $rows rows, not 2" >&2
    failures=$((failures + 1))
    continue
  fi
  # Columns: frames,status,backend,seconds,reserved_over_allocated, four
  # counts, max_running_ratio (the peaks so far, at the worst frame), its frame,
  # then the frame times.
  while IFS=, read -r frames status _ _ ratio _ _ _ _ running at _; do
    if [ "$status" = ok ] && awk -v r="$ratio" -v s="$running" -v l="$running_limit" \
      'BEGIN { exit !(r != "" && s != "" && r + 0 <= 1.02 && s + 0 <= l + 0) }'; then
      echo "PASS: $label, $frames frames: reserved $ratio x allocated, at most $running on the way (frame $at)"
    else
      echo "FAIL: $label, $frames frames: status '$status', reserved '$ratio' x allocated, '$running' at frame '$at' (limit $running_limit)" >&2
      failures=$((failures + 1))
    fi
  done <<ROWS
$(tail -n +2 "$dir/$mode.driver.csv")
ROWS
done
[ "$failures" -eq 0 ] || exit 1
