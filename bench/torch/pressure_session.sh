#!/usr/bin/env bash
# pressure_session.sh: the memory frontier and the two-process run on a GPU
# machine, from the repository root: the library (Release) and the PyTorch
# shim built once, then bench/torch/frontier.py for each of PROGRAMS under
# CAPS, and, where TWO_PROCESS names a program, bench/torch/two_process.py at
# each margin of MARGIN (default 1.06), the second process STAGGER seconds
# after the first (default 0), TWO_PROCESS_ROUNDS rounds (default 1; the
# allocators' order reversed every other round), summarized in
# two_process_summary.txt.
# Everything lands in $OUT (default out/pressure): frontier.csv and .png,
# two_process.csv, machine.txt, logs. SESSION_SECONDS (default 540) bounds
# the frontier: no run starts after it.
#   OUT=out PROGRAMS="gpt2:256 vit:20" CAPS="none 1.00 1.02 1.05" \
#     bench/torch/pressure_session.sh
# PAIRED_FRAMES=N first pairs PAIRED_PROGRAM (default stream_gct, the
# streaming model; lingbot: LingBot-Map's own loop, LINGBOT_MAP naming its
# checkout) at N frames with
# tests/torch/paired_time.py (one worker per configuration, the runs of a
# round taking turns every PAIRED_SEGMENT frames, default 64), uncapped with
# PAIRED_CONFIGS (default: expandable tidalloc tidalloc@stream_gct_growable),
# then capped at PAIRED_CAP (default 1.02; none skips it) x expandable
# segments' peak allocated in that pairing with PAIRED_CAP_CONFIGS (default:
# expandable tidalloc): paired_N.csv/.txt and paired_N_cap.csv/.txt, each
# PAIRED_ROUNDS rounds (default 1), no round begun with less than PAIRED_ROUND_S
# seconds left (default 0: one round's length, so that none is cut). PAIRED_COMPILED=R
# pairs the compiled model (128 frames) for R rounds of PAIRED_COMPILED_CONFIGS
# (default: native tidalloc; PyTorch's own allocator grows until the device is
# full, so a third worker beside it on an 80 GB card runs out of memory):
# paired_compiled.csv/.txt.
# FRONTIER_ARGS adds arguments to frontier.py (--peak-gib G, --allocators ...,
# --refine N: N caps more inside the grid step where expandable segments' and
# tidalloc's tightest completing caps lie).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
out=${OUT:-out/pressure}
mkdir -p "$out"
out=$(cd "$out" && pwd)
py=${TIDE_PYTHON:-python3}
start=$SECONDS
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
export TIDALLOC_CACHE=$PWD/build-gpu-release/shim-cache TIDALLOC_LIB=$PWD/build-gpu-release/libtidalloc.so
bench/torch/machine.sh "$py" | tee "$out/machine.txt"
if [[ ! -f $TIDALLOC_LIB ]]; then
  cmake -S . -B build-gpu-release -DCMAKE_BUILD_TYPE=Release -DTIDE_BUILD_TESTS=OFF \
    -DTIDE_BUILD_EXAMPLES=OFF >"$out/build.log" 2>&1 &&
    cmake --build build-gpu-release -j"$(nproc)" >>"$out/build.log" 2>&1 || {
    echo "build: FAILED"; tail -20 "$out/build.log"; exit 1; }
fi
"$py" -c 'import tidalloc.shim as s; print(s.build(verbose=True))' >"$out/shim_build.log" 2>&1 ||
  { echo "shim: FAILED"; tail -5 "$out/shim_build.log"; }
echo "built in $((SECONDS - start)) s"
left() { echo $((${SESSION_SECONDS:-540} - (SECONDS - start))); }
# paired NAME ROUNDS PROGRAM ARGS...: one paired_time.py pairing, cut at what is left.
paired() {
  local name=$1 rounds=$2
  shift 2
  timeout -k 20 "$(left)" "$py" tests/torch/paired_time.py "$@" --pairs "$rounds" \
    --budget-s "$(($(left) - ${PAIRED_ROUND_S:-0}))" \
    >"$out/$name.csv" 2>"$out/$name.txt"
  echo "$name: rc $?, $(grep -vc '^#\|^program' "$out/$name.csv") runs, $(left) s left"
  grep -v '^validate.py\|^\s*$' "$out/$name.txt" | tail -12
}
if [[ -n ${PAIRED_FRAMES:-} ]]; then
  n=$PAIRED_FRAMES
  # shellcheck disable=SC2086
  paired "paired_$n" "${PAIRED_ROUNDS:-1}" "${PAIRED_PROGRAM:-stream_gct}" --frames "$n" --warmup-frames 16 \
    --segment-frames "${PAIRED_SEGMENT:-64}" \
    --configs ${PAIRED_CONFIGS:-expandable tidalloc tidalloc@stream_gct_growable}
  peak=$(sed -n 's/^expandable: peak allocated \([0-9.]*\) MiB.*/\1/p' "$out/paired_$n.txt")
  if [[ -n $peak && ${PAIRED_CAP:-1.02} != none ]]; then
    limit=$("$py" -c "print(round($peak / 1024 * ${PAIRED_CAP:-1.02}, 4))")
    echo "cap ${PAIRED_CAP:-1.02} x $peak MiB: $limit GiB"
    # shellcheck disable=SC2086
    paired "paired_${n}_cap" "${PAIRED_ROUNDS:-1}" "${PAIRED_PROGRAM:-stream_gct}" --frames "$n" --warmup-frames 16 \
      --segment-frames "${PAIRED_SEGMENT:-64}" --limit-gib "$limit" \
      --configs ${PAIRED_CAP_CONFIGS:-expandable tidalloc}
  fi
fi
if [[ -n ${PAIRED_COMPILED:-} ]]; then
  # shellcheck disable=SC2086
  paired paired_compiled "$PAIRED_COMPILED" stream_gct_compile --frames 128 \
    --configs ${PAIRED_COMPILED_CONFIGS:-native tidalloc}
fi
budget=$(left)
if [[ -n ${PROGRAMS:-} ]] && ((budget > 60)); then
  # shellcheck disable=SC2086
  "$py" bench/torch/frontier.py --programs $PROGRAMS --caps ${CAPS:-none 1.00 1.01 1.02 1.03 1.05 1.10} \
    ${GROWABLE:+--growable} ${FRONTIER_ARGS:-} --csv "$out/frontier.csv" --budget-seconds "$budget" \
    --timeout "${RUN_TIMEOUT:-300}" 2>&1 | tee "$out/frontier.log"
  "$py" bench/torch/frontier.py --summarize "$out/frontier.csv" | tee "$out/frontier_summary.txt"
fi
if [[ -n ${TWO_PROCESS:-} ]]; then
  # shellcheck disable=SC2086
  "$py" bench/torch/two_process.py --program "$TWO_PROCESS" --margins ${MARGIN:-1.06} \
    --stagger "${STAGGER:-0}" --rounds "${TWO_PROCESS_ROUNDS:-1}" \
    --csv "$out/two_process.csv" 2>&1 | tee "$out/two_process.log"
  "$py" bench/torch/two_process.py --summarize "$out/two_process.csv" |
    tee "$out/two_process_summary.txt"
fi
echo "session: $((SECONDS - start)) s"
