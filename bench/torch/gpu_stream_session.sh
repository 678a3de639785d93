#!/usr/bin/env bash
# gpu_stream_session.sh: a GPU session's streaming-model work in one call,
# from the repository root. First the library (Release, with the tidalloc
# command) and the PyTorch shim, built once. Then LANES, run side by side
# (their timings are not results: they share the machine):
#   eager     bench/torch/stream_gct_session.sh: FRAMES under native,
#             expandable_segments:True, cudaMallocAsync, tidalloc, tidalloc
#             --growable, and a trace of TRACE_FRAMES replayed
#   compile   the same script's native_compile and tidalloc_compile runs
#             (COMPILE_FRAMES), side by side
#   upstream  PyTorch's own graph tests under both allocators
#             (bench/torch/gpu_torch_session.sh's upstream step)
#   gputest   make gpu-test (TIDE_GPU_OOM_LIMIT_GIB, default 40, keeps its
#             out-of-memory test from taking the memory of the other lanes)
#   extra     the shell command EXTRA (bash -c), with the library and the shim
#             built and EXTRA_OUT set to a folder of its own: diagnostics
#             that need no quiet machine (memory breakdowns, snapshots)
#   fuzz      the libFuzzer programs scripts/fuzz_stage.sh put in FUZZ_DIR
#             (default fuzz-stage, carried), FUZZ_JOBS workers (default 8)
#             for FUZZ_SECONDS (default 420); rows in fuzz.csv, counted for
#             the sources they were built from
# Then PAIRED, alone on the machine: tests/torch/paired_time.py once per
# spec PROGRAM:FRAMES:PAIRS:CONFIG_A+CONFIG_B[+...] (space-separated specs;
# the first configuration is the reference, PAIRS counts rounds), each
# cut at PAIR_SECONDS (default 580), or at S seconds where PAIRS is N@S, or
# at what is left of SESSION_SECONDS since the start, and not begun with
# less than a minute left. PAIR_FRESH_EVERY=N starts new workers every N
# rounds (paired_time.py --fresh-every), so that what sets one process
# apart from another is resampled too. PAIR_WARMUP_FRAMES=N makes each
# worker's untimed first run N frames (--warmup-frames; eager stream_gct
# pairings only). PAIR_SEGMENT_FRAMES=N makes a round's runs take turns
# every N frames (--segment-frames; stream_gct pairings). ALT_BUILDS="DIR ..."
# builds other versions of the library (source folders, carried) into
# DIR/build for tidalloc/DIR/build configs.
#
#   OUT=dir LANES="eager compile upstream gputest" FRAMES=128 \
#     PAIRED="stream_gct:128:10:expandable+tidalloc" bench/torch/gpu_stream_session.sh
#
# $OUT gets summary.txt (every lane's summary and every pairing's figures)
# and logs.tar.gz (everything else: the lanes' files, paired_<i>.csv and
# paired_<i>.txt, gpu_tests.txt).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
out=${OUT:-out/gpu_stream}
mkdir -p "$out"
out=$(cd "$out" && pwd)
py=${TIDE_PYTHON:-python3}
lanes=${LANES:-eager compile upstream gputest}
summary=$out/summary.txt
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }
want() { [[ " $lanes " == *" $1 "* ]]; }
start=$SECONDS

export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
export TIDALLOC_CACHE=$PWD/build/shim-cache TIDALLOC_LIB=$PWD/build/libtidalloc.so
bench/torch/machine.sh "$py" | tee -a "$summary" >"$out/machine.txt"

# The library (Release, with the tidalloc command) from source folder $1
# into $1/build, its log in $out/$2.
build_library() {
  cmake -S "$1" -B "$1/build" -DCMAKE_BUILD_TYPE=Release -DTIDE_BUILD_TESTS=OFF \
    -DTIDE_BUILD_EXAMPLES=OFF >"$out/$2" 2>&1 &&
    cmake --build "$1/build" -j"$(nproc)" >>"$out/$2" 2>&1
}
build_library . build.log || note "build: FAILED (build.log)"
# Other versions of the library to pair (ALT_BUILDS: source folders from the
# repository root, such as a worktree of another branch, carried): each is
# built into FOLDER/build, for paired_time's tidalloc/FOLDER/build configs.
for alt in ${ALT_BUILDS:-}; do
  log=build_${alt//\//_}.log
  if build_library "$alt" "$log"; then
    note "build of $alt: done ($(git -C "$alt" rev-parse --short HEAD 2>/dev/null || echo unknown))"
  else
    note "build of $alt: FAILED ($log)"
  fi
done
if "$py" -c 'import tidalloc.shim as s; print(s.build(verbose=True))' >"$out/shim_build.log" 2>&1; then
  note "shim: built ($((SECONDS - start)) s with the library)"
else
  note "shim: FAILED: $(tail -3 "$out/shim_build.log" | tr '\n' ' ')"
fi

pids=()
if want eager; then
  OUT=$out/eager FRAMES=${FRAMES:-128} RUN_SECONDS=${RUN_SECONDS:-200} \
    RUNS=${EAGER_RUNS:-native expandable cudaMallocAsync tidalloc tidalloc_growable trace} \
    bench/torch/stream_gct_session.sh >"$out/eager.txt" 2>&1 &
  pids+=($!)
fi
if want compile; then # the two compilations side by side: each takes minutes
  for run in native_compile tidalloc_compile; do
    OUT=$out/$run FRAMES=${COMPILE_FRAMES:-128} RUN_SECONDS=${COMPILE_SECONDS:-360} RUNS=$run \
      bench/torch/stream_gct_session.sh >"$out/$run.txt" 2>&1 &
    pids+=($!)
  done
fi
if want upstream; then
  OUT=$out/upstream STEPS=upstream UPSTREAM_JOBS=${UPSTREAM_JOBS:-3} \
    UPSTREAM_SECONDS=${UPSTREAM_SECONDS:-420} TIDALLOC_CACHE=$TIDALLOC_CACHE \
    bench/torch/gpu_torch_session.sh >"$out/upstream.txt" 2>&1 &
  pids+=($!)
fi
if want gputest; then
  {
    echo "# make gpu-test on $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1)," \
      "commit $(git rev-parse --short HEAD), $(date -u '+%Y-%m-%d %H:%M UTC'), beside other GPU work," \
      "TIDE_GPU_OOM_LIMIT_GIB=${TIDE_GPU_OOM_LIMIT_GIB:-40}"
    TIDE_GPU_OOM_LIMIT_GIB=${TIDE_GPU_OOM_LIMIT_GIB:-40} TIDE_PYTHON=$py timeout 540 make gpu-test 2>&1
    echo "make gpu-test: exit $?"
  } >"$out/gpu_tests.txt" 2>&1 &
  pids+=($!)
fi
if want extra; then
  mkdir -p "$out/extra"
  EXTRA_OUT=$out/extra bash -c "${EXTRA:-echo 'extra: no EXTRA command'}" >"$out/extra.txt" 2>&1 &
  pids+=($!)
fi
if want fuzz; then # programs staged by scripts/fuzz_stage.sh, run on this machine's cores
  if [[ -r ${FUZZ_DIR:-fuzz-stage}/built_from ]]; then
    read -r fuzz_sources fuzz_commit <"${FUZZ_DIR:-fuzz-stage}/built_from"
    FUZZ_SOURCES=$fuzz_sources FUZZ_COMMIT=$fuzz_commit FUZZ_JOBS=${FUZZ_JOBS:-8} \
      FUZZ_SECONDS=${FUZZ_SECONDS:-420} FUZZ_TARGETS=${FUZZ_TARGETS:-ops} FUZZ_CSV=$out/fuzz.csv \
      scripts/fuzz.sh "${FUZZ_DIR:-fuzz-stage}" >"$out/fuzz.txt" 2>&1 &
    pids+=($!)
  else
    note "fuzz: no staged programs in ${FUZZ_DIR:-fuzz-stage} (scripts/fuzz_stage.sh)"
  fi
fi
for pid in "${pids[@]}"; do wait "$pid"; done
[[ -f $out/fuzz.csv ]] && { note "== fuzz"; tail -n +2 "$out/fuzz.csv" | tee -a "$summary" >/dev/null; }
for lane in eager native_compile tidalloc_compile upstream extra; do
  [[ -f $out/$lane.txt ]] && { note "== $lane"; grep -v '^date:\|^commit:\|^host:\|^cpus:' "$out/$lane.txt" | tail -40 | tee -a "$summary" >/dev/null; }
done
if [[ -f $out/gpu_tests.txt ]]; then
  note "== gputest"
  grep -E 'tests passed|torch: |make gpu-test|FAIL' "$out/gpu_tests.txt" | tail -8 | tee -a "$summary" >/dev/null
fi
note "lanes done at $((SECONDS - start)) s"

i=0
for spec in ${PAIRED:-}; do
  IFS=: read -r program frames pairs configs <<<"$spec" # a configuration may hold : and , (tidalloc:KEY:VALUE,...)
  IFS=+ read -r -a config_list <<<"$configs"
  i=$((i + 1))
  t0=$SECONDS
  limit=${PAIR_SECONDS:-580}
  if [[ $pairs == *@* ]]; then # N@S: this pairing's own time limit
    limit=${pairs#*@}
    pairs=${pairs%@*}
  fi
  left=$((${SESSION_SECONDS:-100000} - (SECONDS - start)))
  ((left < limit)) && limit=$left
  if ((limit < 60)); then
    note "paired $i ($spec): not begun (SESSION_SECONDS)"
    continue
  fi
  # Pairs begin until 3/4 of the limit, so that the last one can end in it.
  timeout -k 10 "$limit" "$py" tests/torch/paired_time.py "$program" --frames "$frames" \
    --configs "${config_list[@]}" --pairs "$pairs" --budget-s $((limit * 3 / 4)) \
    --fresh-every "${PAIR_FRESH_EVERY:-0}" ${PAIR_WARMUP_FRAMES:+--warmup-frames "$PAIR_WARMUP_FRAMES"} \
    ${PAIR_SEGMENT_FRAMES:+--segment-frames "$PAIR_SEGMENT_FRAMES"} >"$out/paired_$i.csv" 2>"$out/paired_$i.txt"
  rc=$?
  note "== paired $i: $program, $frames frames, ${config_list[*]}: exit $rc ($((SECONDS - t0)) s)"
  grep -v '^W\|^  warnings\|^$' "$out/paired_$i.txt" | tail -12 | tee -a "$summary" >/dev/null
done
note "session: $((SECONDS - start)) s"
# (Only this folder's archive and summary are left out: a lane's own archive goes in.)
# (Traces, *trace*.csv.gz, stay out too: a lane that wants one back copies it
# to $out, beside the archive, where the size limit on each file allows it.)
bench/torch/pack_logs.sh "$out" summary.txt '*trace*.csv.gz'
cat "$summary"
