#!/bin/sh
# stream_trace.sh: `tidalloc stream --trace-csv` writes a trace that `tidalloc
# replay` reads cleanly (every free matches a live allocation, all of them
# freed by the end) and that makes the same requests: replayed on the same
# configuration it reaches the peak allocated memory the run reported.
# usage: stream_trace.sh path/to/tidalloc
set -u

bin=${1:?usage: stream_trace.sh path/to/tidalloc}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT INT TERM
conf=backend:host,host_capacity:141GiB
fail() { echo "FAIL: $*" >&2; exit 1; }

"$bin" stream --frames 4 12 --conf "$conf" --trace-csv "$dir/trace.csv" --csv "$dir/rows.csv" \
  >"$dir/stream.out" 2>&1 || fail "stream failed: $(tail -3 "$dir/stream.out")"
[ "$(head -1 "$dir/trace.csv")" = "t_us,action,addr,size,stream" ] || fail "trace header"
"$bin" replay "$dir/trace.csv" --conf "$conf" >"$dir/replay.out" 2>&1 ||
  fail "replay failed: $(tail -3 "$dir/replay.out")"
field() { awk -v k="$1" '$1 == k { print $2 }' "$dir/replay.out"; }
for k in malformed_lines unknown_frees duplicate_allocs size_mismatches; do
  [ "$(field "$k")" = 0 ] || fail "replay: $k is '$(field "$k")'"
done
allocs=$(field allocs)
[ "$allocs" -gt 1000 ] && [ "$allocs" = "$(field frees)" ] ||
  fail "replay: $allocs allocations, $(field frees) frees"
# The file holds the last run's (12 frames): its peak, as the CSV row shows it.
want=$(awk -F, '$1 == 12 { print $10 }' "$dir/rows.csv")
got=$(awk -v b="$(field peak_allocated_bytes)" 'BEGIN { printf "%.4f", b / 1073741824 }')
[ -n "$want" ] && [ "$got" = "$want" ] || fail "peak allocated: replay $got GiB, run $want GiB"
"$bin" stream --frames 4 --conf "$conf" --trace-csv "$dir/missing/trace.csv" >/dev/null 2>&1 &&
  fail "an unwritable trace file was not an error"
echo "PASS: stream --trace-csv: $allocs allocations replayed, peak allocated $got GiB"
