#!/usr/bin/env bash
# experiments/replay_bounds.sh [TIDALLOC]: the inputs of issue 31 that used to run
# without bound, each timed with its peak memory (GNU time): `tidalloc replay`
# of /dev/zero, of a trace with a NUL byte inside a line, of a 1 MB gzip of a
# header and 1 GB of newlines, and of 80 million lines `0,free,1,0,0`. Each
# must end within 5 s and 200 MB, with a clear error or a correct result.
# Prints one line per input: name, exit status, seconds, peak KB, and the
# last line of stderr. The inputs are made once in a temporary directory.
set -euo pipefail
bin=${1:-build/tidalloc}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
header=t_us,action,addr,size,stream
printf '%s\n1,alloc,1,100,0\0x\n2,alloc,2,100,0\n3,free,2,0,0\n' "$header" | gzip >"$tmp/nul.csv.gz"
{ echo "$header"; head -c 1000000000 /dev/zero | tr '\0' '\n'; } | gzip -9 >"$tmp/newlines.csv.gz"
{ echo "$header"; (yes 0,free,1,0,0 || true) | head -n 80000000; } | gzip -9 >"$tmp/frees.csv.gz"
for input in /dev/zero "$tmp/nul.csv.gz" "$tmp/newlines.csv.gz" "$tmp/frees.csv.gz"; do
  status=0
  /usr/bin/time -f '%e %M' -o "$tmp/time" "$bin" replay "$input" >"$tmp/out" 2>"$tmp/err" || status=$?
  read -r seconds kb < <(tail -1 "$tmp/time")
  size=$([ -f "$input" ] && stat -c %s "$input" || echo -)
  printf '%s (%s bytes): exit %s, %s s, %s KB peak; %s\n' "$(basename "$input")" "$size" "$status" \
    "$seconds" "$kb" "$(grep '^events ' "$tmp/out" || true) $(tail -1 "$tmp/err" | sed "s|$tmp/||")"
done
