#!/bin/sh
# replay_traces.sh: replays the traces committed under bench/traces (recorded
# from real PyTorch programs under tidalloc) on the host backend and checks
# that each replays cleanly (every free matches a live allocation, every
# allocation succeeds): uncapped, where nothing is given back (no pressure:
# no unmapping, no stream wait), then under a memory limit of BUDGETS times
# the trace's peak live bytes and under the peak reserved the uncapped run
# reached, each of which must complete within its limit. A limit must get
# at least what no limit gets.
# usage: replay_traces.sh path/to/tidalloc
set -u

bin=${1:?usage: replay_traces.sh path/to/tidalloc}
traces=$(cd "$(dirname "$0")/../bench/traces" && pwd) || exit 1
out=$(mktemp)
trap 'rm -f "$out"' EXIT INT TERM
. "$(dirname "$0")/lib/budget.sh"
BUDGETS=${BUDGETS:-1.02 1.015}
failures=0
count=0
value() { awk -v k="$1" '$1 == k { print $2 }' "$out"; }
replay() { env -u TIDALLOC_CONF "$bin" replay "$1" --conf "backend:host$2" >"$out" 2>&1; }
for trace in "$traces"/*.csv.gz; do
  [ -e "$trace" ] || continue
  count=$((count + 1))
  name=$(basename "$trace")
  if ! replay "$trace" ""; then
    echo "FAIL: $name, uncapped: replay failed: $(tail -3 "$out")" >&2
    failures=$((failures + 1))
    continue
  fi
  live=$(value peak_live_bytes)
  uncapped=$(value peak_reserved_bytes)
  if [ "$(value unmappings)" != 0 ] || [ "$(value stream_waits)" != 0 ]; then
    echo "FAIL: $name, uncapped: $(value unmappings) unmappings, $(value stream_waits) stream waits without pressure" >&2
    failures=$((failures + 1))
  else
    echo "PASS: $name, uncapped: reserved $(value reserved_over_live) x peak live, nothing unmapped"
  fi
  for budget in $BUDGETS uncapped; do
    if [ "$budget" = uncapped ]; then limit=$uncapped; else limit=$(budget_bytes "$live" "$budget"); fi
    if ! replay "$trace" ",memory_limit:$limit"; then
      echo "FAIL: $name, limit $budget ($limit bytes): replay failed: $(tail -3 "$out")" >&2
      failures=$((failures + 1))
    elif within "$(value peak_reserved_bytes)" "$limit"; then
      echo "PASS: $name, limit $budget: reserved $(value reserved_over_live) x peak live, $(value unmappings) unmappings, $(value stream_waits) stream waits"
    else
      echo "FAIL: $name, limit $budget: peak reserved $(value peak_reserved_bytes) above $limit" >&2
      failures=$((failures + 1))
    fi
  done
done
[ "$count" -gt 0 ] || { echo "FAIL: no traces in $traces" >&2; exit 1; }
exit "$failures"
