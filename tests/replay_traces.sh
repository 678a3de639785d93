#!/bin/sh
# replay_traces.sh: replays the traces committed under bench/traces (recorded
# from real PyTorch programs under tidalloc) on the host backend and checks
# that each replays cleanly (every free matches a live allocation, every
# allocation succeeds) and that peak reserved stays within 1.02 x the
# trace's peak live bytes, the goal for programs of this kind.
# usage: replay_traces.sh path/to/tidalloc
set -u

bin=${1:?usage: replay_traces.sh path/to/tidalloc}
traces=$(cd "$(dirname "$0")/../bench/traces" && pwd) || exit 1
out=$(mktemp)
trap 'rm -f "$out"' EXIT INT TERM
failures=0
count=0
for trace in "$traces"/*.csv.gz; do
  [ -e "$trace" ] || continue
  count=$((count + 1))
  name=$(basename "$trace")
  if ! "$bin" replay "$trace" --conf backend:host >"$out" 2>&1; then
    echo "FAIL: $name: replay failed: $(tail -3 "$out")" >&2
    failures=$((failures + 1))
    continue
  fi
  ratio=$(awk '$1 == "reserved_over_live" { print $2 }' "$out")
  maps=$(awk '$1 == "mappings" { print $2 }' "$out")
  if awk -v r="$ratio" 'BEGIN { exit !(r != "" && r + 0 <= 1.02) }'; then
    echo "PASS: $name: reserved $ratio x peak live, $maps mappings"
  else
    echo "FAIL: $name: reserved is '$ratio' x peak live, more than 1.02" >&2
    failures=$((failures + 1))
  fi
done
[ "$count" -gt 0 ] || { echo "FAIL: no traces in $traces" >&2; exit 1; }
exit "$failures"
