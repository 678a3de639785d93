#!/bin/sh
# stream_ratio.sh: the streaming workload (`tidalloc stream`) on the host
# backend, its caches grown by concatenation (cat) and in growable buffers
# (grow), at 64 and 256 frames: first uncapped, where no stream may be
# waited for and, in cat mode, nothing unmapped (no pressure; a growable
# buffer gives its own pages back when it shrinks or goes), then under a memory limit
# of BUDGET times the uncapped run's peak allocated bytes and under the peak
# reserved it reached, each of which must complete within its limit: memory
# is given back under pressure, and a limit gets at least what no limit
# gets. Each mode runs with streams that complete at once and with
# host_queue_depth:8, where work completes eight events behind, as on a GPU
# (pages stay mapped until the stream is past them), and with the default
# 8 MiB handles and with 4 MiB ones.
# usage: stream_ratio.sh path/to/tidalloc
set -u

bin=${1:?usage: stream_ratio.sh path/to/tidalloc}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT INT TERM
. "$(dirname "$0")/lib/budget.sh"
BUDGET=${BUDGET:-1.02}
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }

# run LABEL FRAMES CONF: one run; sets status, allocated and reserved (bytes),
# unmappings and waits, or fails the test.
run() {
  if ! env TIDALLOC_CONF="$3" "$bin" stream --frames "$2" --mode "$mode" --csv "$dir/s.csv" \
    --driver-csv "$dir/d.csv" >"$dir/out" 2>&1; then
    fail "$1, $2 frames: stream failed: $(tail -3 "$dir/out")"
    return 1
  fi
  # Columns: frames,status,...,peak_allocated_gib (10),peak_reserved_gib (11)
  IFS=, read -r _ status _ _ _ _ _ _ _ allocated reserved _ <<ROW
$(sed -n 2p "$dir/s.csv")
ROW
  allocated=$(awk -v g="$allocated" 'BEGIN { printf "%.0f", g * 1073741824 }')
  reserved=$(awk -v g="$reserved" 'BEGIN { printf "%.0f", g * 1073741824 }')
  # Columns: frames,status,backend,seconds,ratio,mapped,unmapped,mappings,unmappings,...,stream_waits (15)
  IFS=, read -r _ _ _ _ _ _ _ _ unmappings _ _ _ _ _ waits _ <<ROW
$(sed -n 2p "$dir/d.csv")
ROW
}

for mode in cat grow; do
  for depth in 0 8; do
    for handles in 8 4; do
      conf=backend:host,host_queue_depth:$depth,handle_size_mb:$handles
      label="$mode, queue depth $depth, $handles MiB handles"
      for frames in 64 256; do
        run "$label, uncapped" "$frames" "$conf" || continue
        kept=$unmappings
        [ "$mode" = grow ] && kept=0
        if [ "$status" != ok ] || [ "$kept" != 0 ] || [ "$waits" != 0 ]; then
          fail "$label, $frames frames, uncapped: status '$status', $unmappings unmappings, $waits waits"
          continue
        fi
        echo "PASS: $label, $frames frames, uncapped: $unmappings unmappings, no wait"
        peak=$allocated
        uncapped=$reserved
        for budget in "$BUDGET" uncapped; do
          if [ "$budget" = uncapped ]; then limit=$uncapped; else limit=$(budget_bytes "$peak" "$budget"); fi
          run "$label, limit $budget" "$frames" "$conf,memory_limit:$limit" || continue
          # The peaks read back in GiB to 4 places: within 2^-14 GiB.
          if [ "$status" = ok ] && within "$reserved" "$((limit + 65536))"; then
            echo "PASS: $label, $frames frames, limit $budget: $unmappings unmappings, $waits waits"
          else
            fail "$label, $frames frames, limit $budget ($limit bytes): status '$status', reserved $reserved"
          fi
        done
      done
    done
  done
done
[ "$failures" -eq 0 ] || exit 1
