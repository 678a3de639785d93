#!/usr/bin/env bash
# fuzz_totals.sh [FUZZ_CSV]: executions per fuzz target and per version of
# the fuzzed sources (the CSV's `sources` column, written by scripts/fuzz.sh:
# one hash over src/, include/ and fuzz/), summed over every run of those
# sources whatever the commit or machine, with how many runs found a crash.
# Runs with the same sources fuzzed the same code, so their executions add
# up; the goal is 10 million per target without a crash ("of 10M": met, the
# share reached, or crashed). The newest sources first. Default file:
# bench/results/host/fuzz.csv.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
csv=${1:-bench/results/host/fuzz.csv}
[ -s "$csv" ] || { echo "fuzz_totals: no $csv" >&2; exit 1; }
head -1 "$csv" | grep -q ',sources$' ||
  { echo "fuzz_totals: $csv has no sources column (scripts/fuzz.sh adds it at its next run)" >&2; exit 1; }
printf '%-6s %-18s %12s %5s %7s %9s  %s\n' target sources executions runs crashes "of 10M" commits
# Fields: 1 date, 2 commit, 3 machine (quoted, no commas), 4 cores, 5 jobs,
# 6 target, 7 seconds, 8 executions, ..., 12 result, 13 sources.
tail -n +2 "$csv" | awk -F, '
  $13 == "" { next } # a commit unknown to this clone
  {
    key = $6 " " $13
    if (!(key in runs)) { order[++n] = key; last[key] = $1 }
    if ($1 > last[key]) last[key] = $1
    runs[key]++; execs[key] += $8; crashes[key] += ($12 == "crash")
    if (index(" " commits[key] " ", " " $2 " ") == 0) commits[key] = commits[key] (commits[key] == "" ? "" : " ") $2
  }
  END {
    for (i = 1; i <= n; i++) {
      split(order[i], k, " ")
      key = order[i]
      goal = crashes[key] ? "crashed" : (execs[key] >= 10000000 ? "met" : sprintf("%.0f%%", execs[key] / 100000))
      printf "%s\t%-6s %-18s %12d %5d %7d %9s  %s\n", last[key], k[1], k[2], execs[key], runs[key], crashes[key], goal, commits[key]
    }
  }' | sort -r | cut -f2-
