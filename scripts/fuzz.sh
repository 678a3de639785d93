#!/usr/bin/env bash
# scripts/fuzz.sh BUILD_DIR: run every libFuzzer program of BUILD_DIR (built
# by `make fuzz` with -DTIDE_FUZZ=ON) for a bounded time, one after the
# other, and print the executions each reached.
#
#   FUZZ_SECONDS   seconds per target (default 60)
#   FUZZ_TARGETS   the targets to run ("conf ops"; default: every fuzz_* program)
#   FUZZ_CSV       append one line per target to this CSV file (results with the
#                  machine, commit and date; created with its header if missing)
#   NO_ASLR        a command prefix that turns address randomization off (the
#                  Makefile passes setarch -R where the sanitizer runtime needs it)
#
# New inputs go to BUILD_DIR/corpus/<target>/ (the committed seeds in
# fuzz/corpus/<target>/ are read, never written), crashes to
# BUILD_DIR/artifacts/<target>/. Exit status 1 if any target found a crash:
# copy the crash file into fuzz/corpus/<target>/ with the fix, so that the
# replay test (ctest fuzz_<target>_replay) keeps it fixed.
set -euo pipefail
build=${1:-build-fuzz}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
seconds=${FUZZ_SECONDS:-60}
read -r -a prefix <<< "${NO_ASLR:-}"

if [ -n "${FUZZ_TARGETS:-}" ]; then
  targets=$FUZZ_TARGETS
else
  targets=$(cd "$build" && ls fuzz_* 2>/dev/null | grep -v '\.' | sed 's/^fuzz_//' | sort | tr '\n' ' ')
fi
[ -n "$targets" ] || { echo "fuzz: no fuzz_* program in $build (run make fuzz)" >&2; exit 1; }

machine=$(lscpu 2>/dev/null | sed -n 's/^Model name:[[:space:]]*//p' | head -1)
cores=$(nproc)
commit=$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)
date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
failed=""
summary=""
for t in $targets; do
  program=$build/fuzz_$t
  work=$build/corpus/$t
  artifacts=$build/artifacts/$t
  log=$build/fuzz_$t.log
  mkdir -p "$work" "$artifacts"
  args=(-max_total_time="$seconds" -print_final_stats=1 -timeout=60 -rss_limit_mb=4096
        -artifact_prefix="$artifacts/")
  [ -f "$root/fuzz/$t.dict" ] && args+=(-dict="$root/fuzz/$t.dict")
  echo "fuzz: $t for $seconds s ..."
  start=$(date +%s.%N)
  status=0
  "${prefix[@]}" "$program" "${args[@]}" "$work" "$root/fuzz/corpus/$t" > "$log" 2>&1 || status=$?
  elapsed=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  execs=${execs:-0}
  rate=$(awk -v n="$execs" -v s="$elapsed" 'BEGIN { printf "%.0f", (s > 0 ? n / s : 0) }')
  files=$(ls "$work" | wc -l)
  ten_million=$(awk -v r="$rate" 'BEGIN { printf "%.0f", (r > 0 ? 10000000 / r : 0) }')
  line=$(printf '%-6s %10s executions in %6.1f s: %8s exec/s, %5s corpus files; 10M would take %s s' \
         "$t" "$execs" "$elapsed" "$rate" "$files" "$ten_million")
  summary+="$line"$'\n'
  if [ "$status" -ne 0 ]; then
    failed+=" $t"
    echo "fuzz: $t FAILED (exit $status); the end of $log:" >&2
    tail -40 "$log" >&2
  fi
  if [ -n "${FUZZ_CSV:-}" ]; then
    [ -s "$FUZZ_CSV" ] ||
      echo "date,commit,machine,cores,target,seconds,executions,exec_per_s,seconds_for_10M,corpus_files,result" > "$FUZZ_CSV"
    echo "$date,$commit,\"$machine\",$cores,$t,$elapsed,$execs,$rate,$ten_million,$files,$([ "$status" -eq 0 ] && echo ok || echo crash)" >> "$FUZZ_CSV"
  fi
done
echo "fuzz results ($machine, $cores cores, commit $commit):"
printf '%s' "$summary"
if [ -n "$failed" ]; then
  echo "fuzz: FAILED:$failed (inputs in $build/artifacts/)" >&2
  exit 1
fi
