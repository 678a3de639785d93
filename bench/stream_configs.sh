#!/usr/bin/env bash
# stream_configs.sh: `tidalloc stream` under several configurations of this
# tree, interleaved round by round (drift of the machine falls on all alike),
# each run a fresh process, fixed segments as the anchor. Writes the
# benchmark's CSV rows, the backend column naming the configuration and the
# round (LABEL-rN); the terminal tables (with mappings and unmappings) go to
# stderr.
#   CONFIGS="page2=page_size_mb:2 handle16=handle_size_mb:16" bench/stream_configs.sh > out.csv
# Environment:
#   CONFIGS    space-separated LABEL=OPTIONS pairs (OPTIONS joined to CONF);
#              default: handle sizes 2, 8 and 16 MiB
#   FRAMES     frame counts (default 64 128)
#   ROUNDS     rounds (default 2)
#   CONF       options for every run (default backend:cuda)
#   TIDALLOC   the command (default build/tidalloc, built if missing)
#   DRIVER_CSV also write every run's driver work (`tidalloc stream
#              --driver-csv`: pages and handles mapped and unmapped, stream
#              waits, frame times) to this file
#   STREAM_ARGS more arguments for every run, e.g. --sync-frames (frame times
#              that end when the device is done with each frame)
#   FRAMES_CSV also write every one-frame step of every run (`tidalloc stream
#              --frames-csv`, the backend column naming the run) to this file
# Even rounds run the configurations in reverse order (fixed segments first),
# so that a drift within a round favours none of them.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
frames=${FRAMES:-64 128}
rounds=${ROUNDS:-2}
conf=${CONF:-backend:cuda}
configs=${CONFIGS:-handle2=handle_size_mb:2 handle8=handle_size_mb:8 handle16=handle_size_mb:16}
cmd=${TIDALLOC:-build/tidalloc}
die() { printf 'stream_configs: %s\n' "$*" >&2; exit 1; }
for c in $configs; do [[ $c == *=* ]] || die "'$c' is not LABEL=OPTIONS"; done

if [[ ! -x $cmd ]]; then
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DTIDE_BUILD_TESTS=OFF >/dev/null
  cmake --build build -j"$(nproc)" --target tidalloc_cli >/dev/null
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# run LABEL CONF: one sweep, its rows (no header) on stdout, its table on stderr.
frames_arg=()
[[ -z ${FRAMES_CSV:-} ]] || frames_arg=(--frames-csv "$tmp/frames.csv")
run() {
  # shellcheck disable=SC2086
  "$cmd" stream --frames $frames --conf "$2" --label "$1" --csv "$tmp/run.csv" \
    --driver-csv "$tmp/driver.csv" "${frames_arg[@]}" ${STREAM_ARGS:-} >&2
  tail -n +2 "$tmp/run.csv"
  if [[ -n ${FRAMES_CSV:-} ]]; then
    [[ -s $FRAMES_CSV ]] || head -1 "$tmp/frames.csv" >"$FRAMES_CSV"
    tail -n +2 "$tmp/frames.csv" >>"$FRAMES_CSV"
  fi
  if [[ -n ${DRIVER_CSV:-} ]]; then
    [[ -s $DRIVER_CSV ]] || head -1 "$tmp/driver.csv" >"$DRIVER_CSV"
    tail -n +2 "$tmp/driver.csv" >>"$DRIVER_CSV"
  fi
}
# A first run warms the device and gives the header.
"$cmd" stream --frames 64 --conf "$conf" --csv "$tmp/h.csv" >/dev/null
head -1 "$tmp/h.csv"
for ((r = 1; r <= rounds; r++)); do
  if ((r % 2)); then
    for c in $configs; do run "${c%%=*}-r$r" "$conf,${c#*=}"; done
    run "fixed-r$r" "$conf,expandable_segments:False"
  else
    run "fixed-r$r" "$conf,expandable_segments:False"
    read -ra list <<<"$configs"
    for ((i = ${#list[@]} - 1; i >= 0; i--)); do
      c=${list[i]}
      run "${c%%=*}-r$r" "$conf,${c#*=}"
    done
  fi
done
