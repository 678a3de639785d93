#!/usr/bin/env bash
# scripts/fuzz.sh BUILD_DIR: run every libFuzzer program of BUILD_DIR (built
# by `make fuzz` with -DTIDE_FUZZ=ON) for a bounded time, one after the
# other, and print the executions each reached.
#
#   FUZZ_SECONDS   seconds per target (default 60)
#   FUZZ_TARGETS   the targets to run ("conf ops"; default: every fuzz_* program)
#   FUZZ_JOBS      workers per target, run in parallel for the whole time
#                  (default 1): libFuzzer's -jobs=N -workers=N, N processes
#                  that share the corpus directory (each reloads what the
#                  others add) and each print their final figures in
#                  BUILD_DIR/jobs/<target>/fuzz-<i>.log; the executions
#                  reported are their sum. (Fork mode, -fork=N, is not used:
#                  when the time is up it stops without counting the jobs
#                  still running, which may have run for minutes.)
#   FUZZ_CSV       append one line per target to this CSV file (results with the
#                  machine, commit, date and jobs; created with its header if
#                  missing, and given the jobs column if it predates it)
#   (fuzz/<target>.options, when present, adds libFuzzer flags for that
#   target: one per line, lines starting with # are comments)
#   FUZZ_SOURCES, FUZZ_COMMIT  the sources hash and commit to record, for
#                  programs built on another machine from a tree this one's
#                  history may not hold (default: computed here)
#   NO_ASLR        a command prefix that turns address randomization off (the
#                  Makefile passes setarch -R where the sanitizer runtime needs
#                  it); when it is not set at all, this script finds out itself
#
# The programs need only the C library at run time (the library, the
# sanitizer runtimes and libFuzzer's C++ runtime are linked in): BUILD_DIR
# may be copied to another x86-64 Linux machine with a C library as recent
# as the build machine's and run there with this script and the repository's
# fuzz/ directory, no compiler installed (stack traces of crashes then show
# addresses: llvm-symbolizer is what names them).
#
# New inputs go to BUILD_DIR/corpus/<target>/ (the committed seeds in
# fuzz/corpus/<target>/ are read, never written), crashes to
# BUILD_DIR/artifacts/<target>/. Exit status 1 if any target found a crash:
# copy the crash file into fuzz/corpus/<target>/ with the fix, so that the
# replay test (ctest fuzz_<target>_replay) keeps it fixed.
set -euo pipefail
build=$(cd "${1:-build-fuzz}" && pwd) # the workers run in a directory of their own
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
seconds=${FUZZ_SECONDS:-60}
jobs=${FUZZ_JOBS:-1}
[[ "$jobs" =~ ^[1-9][0-9]*$ ]] || { echo "fuzz: FUZZ_JOBS must be a positive number, not '$jobs'" >&2; exit 1; }
# Sanitizer runtimes before LLVM 18 cannot start under the high address-space
# randomization of recent kernels: without it where the system allows that.
if [ -z "${NO_ASLR+set}" ] && setarch "$(uname -m)" -R true >/dev/null 2>&1; then
  NO_ASLR="setarch $(uname -m) -R"
fi
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
# What was fuzzed, whatever the commit: one hash over the library, its header
# and the fuzz programs (src/, include/, fuzz/, and tools/trace_read.c, which
# fuzz_trace compiles, where the commit has it) as committed, "+dirty" when
# the working tree differs there. Runs with the same sources fuzzed the same code,
# so their executions add up (experiments/fuzz_totals.sh sums them).
sources_of() { # COMMIT: the hash, or nothing where the commit is unknown here
  local trees
  local reader
  trees=$(git -C "$root" rev-parse "$1:src" "$1:include" "$1:fuzz" 2>/dev/null) || return 0
  reader=$(git -C "$root" rev-parse "$1:tools/trace_read.c" 2>/dev/null) && trees+=$'\n'"$reader"
  echo "$trees" | sha1sum | cut -c1-12
}
sources=$(sources_of HEAD)
[ -n "$(git -C "$root" status --porcelain -- src include fuzz tools/trace_read.c 2>/dev/null)" ] &&
  sources+="+dirty"
# Programs built elsewhere and run here (a copy of the working tree whose
# history may lag behind it) say what they were built from: FUZZ_SOURCES and
# FUZZ_COMMIT, as the build machine computed them.
sources=${FUZZ_SOURCES:-$sources}
commit=${FUZZ_COMMIT:-$commit}
date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
failed=""
summary=""

# The CSV's columns; files written before a column existed are brought up to
# date (the jobs column: one job; the sources column: computed from each
# line's commit, empty where the commit is unknown here).
header="date,commit,machine,cores,jobs,target,seconds,executions,exec_per_s,seconds_for_10M,corpus_files,result,sources"
jobs_header="date,commit,machine,cores,jobs,target,seconds,executions,exec_per_s,seconds_for_10M,corpus_files,result"
old_header="date,commit,machine,cores,target,seconds,executions,exec_per_s,seconds_for_10M,corpus_files,result"
write_csv_row() {
  if [ ! -s "$FUZZ_CSV" ]; then
    echo "$header" > "$FUZZ_CSV"
  fi
  if [ "$(head -1 "$FUZZ_CSV")" = "$old_header" ]; then
    # Lines from before the jobs column: one job each (after the quoted machine).
    sed -i -e "1s/.*/$jobs_header/" -e '2,$s/^\([^,]*,[^,]*,"[^"]*",[^,]*\),/\1,1,/' "$FUZZ_CSV"
  fi
  if [ "$(head -1 "$FUZZ_CSV")" = "$jobs_header" ]; then
    local tmp line c
    tmp=$(mktemp)
    echo "$header" > "$tmp"
    tail -n +2 "$FUZZ_CSV" | while IFS= read -r line; do
      c=${line#*,}
      c=${c%%,*}
      echo "$line,$(sources_of "$c")"
    done >> "$tmp"
    mv "$tmp" "$FUZZ_CSV"
  fi
  echo "$date,$commit,\"$machine\",$cores,$jobs,$t,$elapsed,$execs,$rate,$ten_million,$files,$result,$sources" >> "$FUZZ_CSV"
}
for t in $targets; do
  program=$build/fuzz_$t
  work=$build/corpus/$t
  artifacts=$build/artifacts/$t
  log=$build/fuzz_$t.log
  mkdir -p "$work" "$artifacts"
  args=(-max_total_time="$seconds" -print_final_stats=1 -timeout=60 -rss_limit_mb=4096
        -artifact_prefix="$artifacts/")
  args+=(-jobs="$jobs" -workers="$jobs")
  [ -f "$root/fuzz/$t.dict" ] && args+=(-dict="$root/fuzz/$t.dict")
  if [ -f "$root/fuzz/$t.options" ]; then
    while IFS= read -r opt; do
      [[ "$opt" == -* ]] && args+=("$opt")
    done < "$root/fuzz/$t.options"
  fi
  jobdir=$build/jobs/$t # the workers write fuzz-<i>.log where they run
  rm -rf "$jobdir"
  mkdir -p "$jobdir"
  echo "fuzz: $t for $seconds s, $jobs job(s) ..."
  start=$(date +%s.%N)
  status=0
  (cd "$jobdir" && "${prefix[@]}" "$program" "${args[@]}" "$work" "$root/fuzz/corpus/$t") > "$log" 2>&1 ||
    status=$?
  elapsed=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
  # Each worker's last figure (printed at its end, also after a crash).
  execs=0
  for wlog in "$jobdir"/fuzz-*.log; do
    [ -f "$wlog" ] || continue
    n=$(sed -n 's/^stat::number_of_executed_units: *//p' "$wlog" | tail -1)
    execs=$((execs + ${n:-0}))
    { echo "== $(basename "$wlog")"; cat "$wlog"; } >> "$log"
  done
  rate=$(awk -v n="$execs" -v s="$elapsed" 'BEGIN { printf "%.0f", (s > 0 ? n / s : 0) }')
  files=$(ls "$work" | wc -l)
  ten_million=$(awk -v r="$rate" 'BEGIN { printf "%.0f", (r > 0 ? 10000000 / r : 0) }')
  line=$(printf '%-6s %10s executions in %6.1f s, %2s job(s): %8s exec/s, %5s corpus files; 10M would take %s s' \
         "$t" "$execs" "$elapsed" "$jobs" "$rate" "$files" "$ten_million")
  summary+="$line"$'\n'
  # ok, crash, or stopped (interrupted by a signal before its time: no crash
  # found, and its executions count).
  result=ok
  if [ "$status" -ne 0 ]; then
    result=crash
    if grep -q 'libFuzzer: run interrupted' "$log" && ! grep -qE '^SUMMARY: |deadly signal|ERROR: libFuzzer: (out-of-memory|timeout)' "$log"; then
      result=stopped
    fi
  fi
  if [ "$result" = stopped ]; then
    echo "fuzz: $t was stopped by a signal before its time (no crash found)" >&2
  elif [ "$result" = crash ]; then
    failed+=" $t"
    echo "fuzz: $t FAILED (exit $status); the end of $log:" >&2
    tail -40 "$log" >&2
    for wlog in "$jobdir"/fuzz-*.log; do # the workers that failed, if not the last
      if [ "$wlog" != "$(ls "$jobdir"/fuzz-*.log | tail -1)" ] &&
        grep -qE '^SUMMARY: |ERROR: libFuzzer' "$wlog"; then
        echo "fuzz: the end of $wlog:" >&2
        tail -40 "$wlog" >&2
      fi
    done
  fi
  [ -n "${FUZZ_CSV:-}" ] && write_csv_row

done
echo "fuzz results ($machine, $cores cores, commit $commit):"
printf '%s' "$summary"
if [ -n "$failed" ]; then
  echo "fuzz: FAILED:$failed (inputs in $build/artifacts/)" >&2
  exit 1
fi
