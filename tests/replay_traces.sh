#!/bin/sh
# replay_traces.sh: replays the traces committed under bench/traces (recorded
# from real PyTorch programs under tidalloc) on the host backend and checks
# that each replays cleanly (every free matches a live allocation, every
# allocation succeeds) and that peak reserved stays within the release slack
# (+ 0.003, growth past the ceiling that wait_limit lets through, and a page)
# above the trace's peak live bytes: at the defaults, and at a slack of
# 0.017, which must hold 1.02, the goal for programs of this kind.
# usage: replay_traces.sh path/to/tidalloc
set -u

bin=${1:?usage: replay_traces.sh path/to/tidalloc}
traces=$(cd "$(dirname "$0")/../bench/traces" && pwd) || exit 1
out=$(mktemp)
trap 'rm -f "$out"' EXIT INT TERM
. "$(dirname "$0")/lib/slack.sh"
default_slack=$(default_slack "$bin") || exit 1
failures=0
count=0
for trace in "$traces"/*.csv.gz; do
  [ -e "$trace" ] || continue
  count=$((count + 1))
  name=$(basename "$trace")
  for slack in "$default_slack" 0.017; do
    limit=$(slack_limit "$slack")
    if ! env -u TIDALLOC_CONF "$bin" replay "$trace" --conf "backend:host,release_slack:$slack" \
      >"$out" 2>&1; then
      echo "FAIL: $name, slack $slack: replay failed: $(tail -3 "$out")" >&2
      failures=$((failures + 1))
      continue
    fi
    ratio=$(awk '$1 == "reserved_over_live" { print $2 }' "$out")
    maps=$(awk '$1 == "mappings" { print $2 }' "$out")
    if awk -v r="$ratio" -v l="$limit" 'BEGIN { exit !(r != "" && r + 0 <= l + 0) }'; then
      echo "PASS: $name, slack $slack: reserved $ratio x peak live (limit $limit), $maps mappings"
    else
      echo "FAIL: $name, slack $slack: reserved is '$ratio' x peak live, more than $limit" >&2
      failures=$((failures + 1))
    fi
  done
done
[ "$count" -gt 0 ] || { echo "FAIL: no traces in $traces" >&2; exit 1; }
exit "$failures"
