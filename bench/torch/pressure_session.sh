#!/usr/bin/env bash
# pressure_session.sh: the memory frontier and the two-process run on a GPU
# machine, from the repository root: the library (Release) and the PyTorch
# shim built once, then bench/torch/frontier.py for each of PROGRAMS under
# CAPS, and, where TWO_PROCESS names a program, bench/torch/two_process.py.
# Everything lands in $OUT (default out/pressure): frontier.csv and .png,
# two_process.csv, machine.txt, logs. SESSION_SECONDS (default 540) bounds
# the frontier: no run starts after it.
#   OUT=out PROGRAMS="gpt2:256 vit:20" CAPS="none 1.00 1.02 1.05" \
#     bench/torch/pressure_session.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
out=${OUT:-out/pressure}
mkdir -p "$out"
out=$(cd "$out" && pwd)
py=${TIDE_PYTHON:-python3}
start=$SECONDS
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
export TIDALLOC_CACHE=$PWD/build-gpu-release/shim-cache TIDALLOC_LIB=$PWD/build-gpu-release/libtidalloc.so
{
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1
  echo "cpus: $(nproc)"
} | tee "$out/machine.txt"
if [[ ! -f $TIDALLOC_LIB ]]; then
  cmake -S . -B build-gpu-release -DCMAKE_BUILD_TYPE=Release -DTIDE_BUILD_TESTS=OFF \
    -DTIDE_BUILD_EXAMPLES=OFF >"$out/build.log" 2>&1 &&
    cmake --build build-gpu-release -j"$(nproc)" >>"$out/build.log" 2>&1 || {
    echo "build: FAILED"; tail -20 "$out/build.log"; exit 1; }
fi
"$py" -c 'import tidalloc.shim as s; print(s.build(verbose=True))' >"$out/shim_build.log" 2>&1 ||
  { echo "shim: FAILED"; tail -5 "$out/shim_build.log"; }
echo "built in $((SECONDS - start)) s"
budget=$((${SESSION_SECONDS:-540} - (SECONDS - start)))
if [[ -n ${PROGRAMS:-} ]]; then
  # shellcheck disable=SC2086
  "$py" bench/torch/frontier.py --programs $PROGRAMS --caps ${CAPS:-none 1.00 1.01 1.02 1.03 1.05 1.10} \
    ${GROWABLE:+--growable} --csv "$out/frontier.csv" --budget-seconds "$budget" \
    --timeout "${RUN_TIMEOUT:-300}" 2>&1 | tee "$out/frontier.log"
  "$py" bench/torch/frontier.py --summarize "$out/frontier.csv" | tee "$out/frontier_summary.txt"
fi
if [[ -n ${TWO_PROCESS:-} ]]; then
  "$py" bench/torch/two_process.py --program "$TWO_PROCESS" --margin "${MARGIN:-1.06}" \
    --csv "$out/two_process.csv" 2>&1 | tee "$out/two_process.log"
fi
echo "session: $((SECONDS - start)) s"
