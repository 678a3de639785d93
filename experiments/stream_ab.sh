#!/usr/bin/env bash
# stream_ab.sh: an A/B of `tidalloc stream` between this tree and an earlier
# one, interleaved so that drift of the machine (clocks, other load) falls on
# both alike: ROUNDS times, this tree's command then the old one's, each on a
# fresh process, plus fixed segments as the anchor. Writes the benchmark's
# CSV rows with the label naming the tree and the round.
#   OLD_TREE=old.tar experiments/stream_ab.sh > ab.csv
# Environment:
#   OLD_TREE   a source tarball of the earlier commit (git archive), required
#   FRAMES     frame counts (default 64 128)
#   ROUNDS     rounds (default 3)
#   CONF       options for every run (default backend:cuda)
#   TIDALLOC   this tree's command (default build/tidalloc, built if missing)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
frames=${FRAMES:-64 128}
rounds=${ROUNDS:-3}
conf=${CONF:-backend:cuda}
new=${TIDALLOC:-build/tidalloc}
die() { printf 'stream_ab: %s\n' "$*" >&2; exit 1; }
[[ -n ${OLD_TREE:-} && -f $OLD_TREE ]] || die "OLD_TREE must name a source tarball"

if [[ ! -x $new ]]; then
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DTIDE_BUILD_TESTS=OFF >/dev/null
  cmake --build build -j"$(nproc)" --target tidalloc_cli >/dev/null
fi
rm -rf build-old-src && mkdir -p build-old-src && tar -xf "$OLD_TREE" -C build-old-src
cmake -S build-old-src -B build-old -DCMAKE_BUILD_TYPE=Release -DTIDE_BUILD_TESTS=OFF >/dev/null
cmake --build build-old -j"$(nproc)" --target tidalloc_cli >/dev/null

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# run LABEL COMMAND CONF: one sweep, its rows (no header) on stdout.
run() {
  "$2" stream --frames $frames --conf "$3" --label "$1" --csv "$tmp/run.csv" >/dev/null
  tail -n +2 "$tmp/run.csv"
}
# A first run warms the GPU and gives the header.
"$new" stream --frames 64 --conf "$conf" --csv "$tmp/h.csv" >/dev/null
head -1 "$tmp/h.csv"
for ((r = 1; r <= rounds; r++)); do
  run "new-r$r" "$new" "$conf,expandable_segments:True"
  run "old-r$r" build-old/tidalloc "$conf,expandable_segments:True"
  run "fixed-r$r" "$new" "$conf,expandable_segments:False"
done
