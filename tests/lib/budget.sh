# budget.sh: sourced by the memory tests (tests/stream_ratio.sh,
# tests/replay_traces.sh), which run a workload uncapped, then under a memory
# limit a little above its peak: memory is given back under pressure, so a
# limit must get at least what no limit gets.
#   budget_bytes BYTES MULTIPLE   BYTES x MULTIPLE, rounded up to a byte
#   within A B                    status 0 when A <= B (decimals)

budget_bytes() {
  awk -v b="$1" -v m="$2" 'BEGIN { x = b * m; y = int(x); if (y < x) y++; printf "%.0f\n", y }'
}

within() {
  awk -v a="$1" -v b="$2" 'BEGIN { exit !(a != "" && b != "" && a + 0 <= b + 0) }'
}
