#!/usr/bin/env bash
# replay_configs.sh TRACE.csv.gz [LABEL=OPTIONS ...]: replay one allocation
# trace (`tidalloc replay`'s format; `python -m tidalloc run --trace-csv`
# records one from a PyTorch program) under several configurations on the
# host backend, and print one line each: peak reserved over the trace's peak
# live bytes, and the driver's work (handles mapped and unmapped, which the
# time of growth follows on a GPU). With no configurations, a few that trade
# memory against mappings are compared with the defaults.
#   experiments/replay_configs.sh prog.csv.gz defaults= slack2=release_slack:0.02
# TIDALLOC names the command (default build/tidalloc, built if missing).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
trace=${1:?usage: experiments/replay_configs.sh TRACE.csv.gz [LABEL=OPTIONS ...]}
shift
[[ -f $trace ]] || { echo "replay_configs: no file $trace" >&2; exit 1; }
configs=("$@")
if ((${#configs[@]} == 0)); then
  configs=(defaults= "slack1.8%=release_slack:0.018" "handles8=handle_size_mb:8"
           "handles4-from-0=handle_threshold_mb:0" "no-release=release_holes:False"
           "fixed=expandable_segments:False")
fi
cmd=${TIDALLOC:-build/tidalloc}
if [[ ! -x $cmd ]]; then
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DTIDE_BUILD_TESTS=OFF >/dev/null
  cmake --build build -j"$(nproc)" --target tidalloc_cli >/dev/null
fi
printf '%-20s %12s %14s %10s %10s  %s\n' label "reserved/live" "reserved MiB" mappings unmappings options
for c in "${configs[@]}"; do
  [[ $c == *=* ]] || { echo "replay_configs: '$c' is not LABEL=OPTIONS" >&2; exit 1; }
  label=${c%%=*} options=${c#*=}
  row=$("$cmd" replay "$trace" --csv --conf "backend:host${options:+,$options}" | tail -1)
  # trace,events,peak_live,peak_allocated,peak_reserved,ratio,seconds,mappings,unmappings
  IFS=, read -r _ _ _ _ reserved ratio _ maps unmaps <<<"$row"
  printf '%-20s %12s %14.1f %10s %10s  %s\n' "$label" "$ratio" \
    "$(awk -v b="$reserved" 'BEGIN { print b / 1048576 }')" "$maps" "$unmaps" "${options:-(defaults)}"
done
