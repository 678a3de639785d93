#!/usr/bin/env bash
# pair_instructions.sh: instructions per cached alloc+free pair of tidalloc,
# counted by callgrind over `tidalloc micro`'s pair loop (run_pair) on one
# thread, divided by the pairs it ran. Unlike a time, the count does not
# depend on the machine's load.
#   bench/pair_instructions.sh [SIZE...]     (default: 512 4096)
# Environment: TIDALLOC (default build/tidalloc), OPS (pairs per batch,
# default 200000), CONF (default backend:host).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
tidalloc=${TIDALLOC:-build/tidalloc}
ops=${OPS:-200000}
conf=${CONF:-backend:host}
repeat=3
[[ -x $tidalloc ]] || { echo "pair_instructions: $tidalloc is not built (make build)" >&2; exit 1; }
command -v valgrind >/dev/null || { echo "pair_instructions: valgrind is not installed" >&2; exit 1; }
[[ $# -gt 0 ]] || set -- 512 4096

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "size,pairs,instructions,instructions_per_pair"
for size in "$@"; do
  valgrind --tool=callgrind --callgrind-out-file="$out/cg" --toggle-collect=run_pair \
    "$tidalloc" micro --only tidalloc --threads 1 --sizes "$size" --ops "$ops" \
    --repeat "$repeat" --conf "$conf" >/dev/null 2>"$out/log"
  ir=$(sed -n 's/^summary: *//p' "$out/cg")
  pairs=$((ops * (repeat + 1))) # the warm-up batch and the timed ones
  awk -v s="$size" -v p="$pairs" -v ir="$ir" 'BEGIN { printf "%s,%d,%d,%.1f\n", s, p, ir, ir / p }'
done
