#!/usr/bin/env bash
# gpu_session.sh: everything to run on a GPU machine, in one go, from the
# repository root: the machine's description, a Release build, the CPU tests,
# the GPU tests, the GPU tests under compute-sanitizer's memcheck, and the
# benchmark runs added in the marked section below. Logs and a summary go to
# $OUT (default out/gpu); the machine may be offline, so nothing is
# installed: what is missing (cmocka, zlib) turns the parts that need it off,
# and the summary says so.
#   OUT=/some/dir scripts/gpu_session.sh
# Files written (8 at most): summary.txt, system.txt, build.log (with the CPU
# tests), gpu_tests.log, gpu_memcheck.log, bench.log, bench.csv, stream.csv.
# GPU_TESTS=0 or GPU_BENCH=0 leave a part out, MICRO=0 the micro benchmarks
# and the PyTorch anchor (about 200 s); TRACE_DIR holds the traces.
# STREAM_CONFIGS="LABEL=OPTIONS ..." adds an interleaved run of those
# configurations (bench/stream_configs.sh; CONFIG_FRAMES, default 64 128
# 256) to stream.csv and bench.log.
# SOAK_SECONDS=N (default 0: none) runs `tidalloc soak` on the GPU for N
# seconds at the end; its output and its CSV row go to bench.log, its result
# to the summary (the budget below grows by N).
# TORCH_ROUNDS=N times the PyTorch validation programs, N fresh processes per
# configuration (TORCH_PROGRAMS, TORCH_CONFIGS, TORCH_REPEATS, TORCH_SECONDS);
# FUZZ_BUILD=DIR FUZZ_SECONDS=N fuzzes with DIR's programs on every CPU for N
# seconds per target (FUZZ_TARGETS), last. Both go to bench.log and the summary.
# Exit status: 0 if every step passed.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
out=${OUT:-out/gpu}
mkdir -p "$out"
jobs=$(nproc 2>/dev/null || echo 8)
start=$(date +%s)
# The steps take about 5 minutes; a step that hangs is cut so that the whole
# run stays under GPU_RUN_SECONDS (later steps get what is left).
soak_seconds=${SOAK_SECONDS:-0}
if [[ ! $soak_seconds =~ ^[0-9]+$ ]]; then
  echo "gpu_session.sh: SOAK_SECONDS must be a number of seconds, not '$soak_seconds'" >&2
  exit 2
fi
budget=${GPU_RUN_SECONDS:-$((540 + soak_seconds + ${FUZZ_SECONDS:-0} + (${TORCH_ROUNDS:-0} > 0 ? ${TORCH_SECONDS:-300} : 0)))}
summary=$out/summary.txt
: >"$summary"
failed=0

elapsed() { echo $(($(date +%s) - start)); }
note() { echo "$*" | tee -a "$summary"; }

# step NAME LOG LIMIT command...: run it with output appended to LOG, at most
# LIMIT seconds (cut to what the budget has left, at least 30 s), and record
# the outcome in the summary.
step() {
  local name=$1 log=$2 limit=$3
  shift 3
  local left=$((budget - $(elapsed)))
  ((left < 30)) && left=30
  ((limit > left)) && limit=$left
  local t0=$(date +%s)
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit} s): $*" >>"$log"
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  local secs=$(($(date +%s) - t0))
  local what=ok
  if ((rc == 124 || rc == 137)); then
    what="TIMEOUT after ${limit} s"
  elif ((rc != 0)); then
    what="FAILED (exit $rc)"
  fi
  [[ $what == ok ]] || failed=1
  note "$(printf '%-28s %-22s %4d s   log: %s' "$name" "$what" "$secs" "$(basename "$log")")"
  return $rc
}

# ---------------------------------------------------------------------------
# The machine
# ---------------------------------------------------------------------------
{
  echo "date: $(date -u)"
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
  echo "host: $(uname -a)"
  echo "cpus: $jobs"
  echo
  nvidia-smi 2>&1 || echo "nvidia-smi failed"
  echo
  nvidia-smi -q -d MEMORY,COMPUTE,CLOCK 2>&1 | head -60
  echo
  for tool in nvcc cmake gcc compute-sanitizer python3 make readelf; do
    printf '%-18s %s\n' "$tool" "$(command -v "$tool" || echo 'not found')"
  done
  nvcc --version 2>&1 | tail -2
  cmake --version 2>&1 | head -1
  gcc --version 2>&1 | head -1
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -1
  ls -l /usr/lib/x86_64-linux-gnu/libcuda.so* 2>/dev/null
} >"$out/system.txt" 2>&1
cat "$out/system.txt"
note "tidalloc GPU run, $(date -u), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
note "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
note ""

# nvcc for CMake's CUDA language, wherever the toolkit is.
if ! command -v nvcc >/dev/null; then
  for dir in "${CUDA_HOME:-}" /usr/local/cuda; do
    [[ -n $dir && -x $dir/bin/nvcc ]] && export PATH=$dir/bin:$PATH && break
  done
fi
command -v nvcc >/dev/null && export CUDACXX=${CUDACXX:-$(command -v nvcc)}

# ---------------------------------------------------------------------------
# The Release build (build/) and its CPU tests
# ---------------------------------------------------------------------------
cmake_args=(-DCMAKE_BUILD_TYPE=Release)
# A header is there when the compiler finds it (C_INCLUDE_PATH counts).
have_header() { echo "#include <$1>" | ${CC:-cc} -E -x c - >/dev/null 2>&1; }
if ! have_header cmocka.h; then
  cmake_args+=(-DTIDE_BUILD_TESTS=OFF)
  note "note: cmocka is not installed: CPU tests are not built"
fi
if ! have_header zlib.h; then
  cmake_args+=(-DTIDE_BUILD_TOOLS=OFF)
  note "note: zlib.h is not installed: the tidalloc command is not built (no benchmarks)"
fi
build_log=$out/build.log
step "configure build/" "$build_log" 120 cmake -S . -B build "${cmake_args[@]}" &&
  step "build build/" "$build_log" 240 cmake --build build -j"$jobs"
built=$?
grep -E "CUDA backend|mimalloc" "$build_log" | sed 's/^-- /  /' | tee -a "$summary"

cpu_log=$build_log # one log for the build and the CPU tests: $OUT holds 8 files
if ((built == 0)) && [[ -x build/test_backend_cuda ]]; then
  # The CUDA backend's own test first, in full: on this machine it runs the
  # real driver (backend:cuda must work) as well as the fake one.
  step "test_backend_cuda" "$cpu_log" 60 build/test_backend_cuda
  grep -E "^GPU:|no usable GPU" "$cpu_log" | head -2 | sed 's/^/  /' | tee -a "$summary"
  # The rest of the CPU tests, without the long stress test.
  step "ctest build/ (not stress)" "$cpu_log" 150 \
    bash -c 'cd build && ctest --output-on-failure -j"$1" -LE stress --timeout 120' _ "$jobs"
  grep -E "tests passed|tests failed" "$cpu_log" | tail -1 | sed 's/^/  /' | tee -a "$summary"
else
  note "CPU tests: skipped (not built)"
fi

# ---------------------------------------------------------------------------
# The GPU tests (build-gpu/), then the same under compute-sanitizer
# ---------------------------------------------------------------------------
gpu_test() { # SANITIZE=0|1
  if command -v make >/dev/null; then
    make --no-print-directory gpu-test JOBS="$jobs" SANITIZE="$1"
  else
    local label='^gpu$'
    [[ $1 == 1 ]] && label='^gpu-memcheck$'
    cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTIDE_GPU_TESTS=ON \
      -DTIDE_BUILD_TESTS=OFF -DTIDE_BUILD_TOOLS=OFF -DTIDE_BUILD_EXAMPLES=OFF &&
      cmake --build build-gpu -j"$jobs" &&
      (cd build-gpu && ctest --output-on-failure --no-tests=error -L "$label")
  fi
}
export -f gpu_test
export jobs

# PASS/FAIL lines of a GPU log, counted, and its FAIL lines.
gpu_counts() {
  local log=$1
  note "  $(grep -c '^PASS' "$log") PASS line(s), $(grep -c '^FAIL' "$log") FAIL line(s)"
  grep -E '^FAIL|^INFO' "$log" | head -20 | sed 's/^/  /' | tee -a "$summary"
}

if [[ ${GPU_TESTS:-1} == 1 ]]; then
gpu_log=$out/gpu_tests.log
# 480 s: the C GPU tests, then the PyTorch tests of tests/torch (their library
# build, five scripts, the distributed one training 1000 iterations on 2 GPUs).
step "make gpu-test" "$gpu_log" 480 bash -c 'gpu_test 0'
gpu_counts "$gpu_log"

memcheck_log=$out/gpu_memcheck.log
if command -v compute-sanitizer >/dev/null || [[ -x /usr/local/cuda/bin/compute-sanitizer ]]; then
  step "make gpu-test SANITIZE=1" "$memcheck_log" 300 bash -c 'gpu_test 1'
  gpu_counts "$memcheck_log"
  grep -E "ERROR SUMMARY" "$memcheck_log" | sort | uniq -c | sed 's/^/  /' | tee -a "$summary"
else
  note "memcheck: skipped (compute-sanitizer not found)"
fi
fi

# ===========================================================================
# BENCHMARKS: each writes its log to $bench_log and CSV rows
# (workload,size,threads,allocator,ns_per_op) to $bench_csv, through `step`
# so that each run is timed, bounded and summarized. The anchors take 7
# batches, not 21: on 8 threads behind their global locks a batch lasts
# seconds (21 did not fit in 150 s).
# ===========================================================================
bench_log=$out/bench.log
bench_csv=$out/bench.csv
if [[ ${GPU_BENCH:-1} == 1 && -x build/tidalloc ]]; then
  # The host-side anchors and tidalloc's cached path on this machine's CPUs,
  # then tidalloc on the GPU, then PyTorch's allocator and cudaMallocAsync.
  if [[ ${MICRO:-1} == 1 ]]; then
  step "micro (host backend)" "$bench_log" 150 \
    sh -c 'build/tidalloc micro --csv --conf backend:host >"$0"' "$bench_csv"
  step "micro (cuda backend)" "$bench_log" 120 \
    sh -c 'build/tidalloc micro --csv --only tidalloc --conf backend:cuda | grep ",tidalloc," | sed "s/,tidalloc,/,tidalloc-cuda,/" >>"$0"' "$bench_csv"
  # What capture_detection (on under PyTorch) costs the cached path: one thread.
  step "micro (cuda, capture_detection)" "$bench_log" 60 \
    sh -c 'build/tidalloc micro --csv --only tidalloc --threads 1 --conf backend:cuda,capture_detection:True | grep ",tidalloc," | sed "s/,tidalloc,/,tidalloc-cuda-detect,/" >>"$0"' "$bench_csv"
  step "torch anchor build" "$bench_log" 150 bench/gpu/build.sh build/bench-gpu &&
    step "torch anchor" "$bench_log" 150 \
      sh -c 'build/bench-gpu/torch_anchor --repeat 7 | tail -n +2 >>"$0"' "$bench_csv"
  fi
  # What the driver's map and unmap calls cost here, and whether one unmap may
  # cover several mappings (bench/gpu/vmm_costs.c).
  cuda_home=$(dirname "$(dirname "$(command -v nvcc)")")
  step "vmm costs" "$bench_log" 60 bash -c "cc -std=c11 -D_POSIX_C_SOURCE=200809L -O2 \
    bench/gpu/vmm_costs.c -I$cuda_home/include -L$cuda_home/lib64/stubs -lcuda \
    -o build/vmm_costs && build/vmm_costs | tee build/vmm_costs.csv"
  # Whether those calls wait for the GPU or slow its copies, how fast memory
  # in handles of each size copies, and whether threads spread the calls
  # (bench/gpu/vmm_overlap.cu).
  step "vmm overlap" "$bench_log" 120 bash -c "nvcc -O2 bench/gpu/vmm_overlap.cu -lcuda -lpthread \
    -o build/vmm_overlap && build/vmm_overlap | tee build/vmm_overlap.csv"
  # Those calls with exportable memory, thousands of live mappings and a busy
  # GPU (bench/gpu/vmm_scale.c), and what a copy costs the issuing thread
  # against the mappings it spans (bench/gpu/copy_launch.c).
  for prog in vmm_scale copy_launch; do
    step "$prog" "$bench_log" 120 bash -c "cc -std=c11 -D_POSIX_C_SOURCE=200809L -O2 \
      bench/gpu/$prog.c -I$cuda_home/include -L$cuda_home/lib64/stubs -lcuda \
      -o build/$prog && build/$prog | tee build/$prog.csv"
  done
  for mode in True False; do
    step "stream expandable=$mode" "$bench_log" 150 \
      build/tidalloc stream --frames ${STREAM_FRAMES:-64 128 256 512 1024} \
      --conf backend:cuda,expandable_segments:$mode --csv "build/stream_$mode.csv" \
      --driver-csv "build/stream_driver_$mode.csv"
  done
  step "stream grow" "$bench_log" 150 \
    build/tidalloc stream --frames ${STREAM_FRAMES:-64 128 256 512 1024} --mode grow \
    --conf backend:cuda --csv "build/stream_grow.csv" --driver-csv "build/stream_driver_grow.csv"
  # The sweeps' driver work and ratio throughout the run (max_running_ratio)
  # go to bench.log: stream.csv keeps the benchmark's columns.
  { echo "stream driver csv:"; head -1 build/stream_driver_True.csv 2>/dev/null
    tail -q -n +2 build/stream_driver_True.csv build/stream_driver_False.csv \
      build/stream_driver_grow.csv 2>/dev/null; echo "end of stream driver csv"; } >>"$bench_log"
  # A/B in the same session: OLD_TREE, a source tarball of an earlier
  # commit (git archive), built and run through the same expandable sweep.
  if [[ -n ${OLD_TREE:-} && -f ${OLD_TREE:-} ]]; then
    rm -rf build-old-src && mkdir -p build-old-src && tar -xf "$OLD_TREE" -C build-old-src &&
      step "old tree build" "$bench_log" 180 bash -c "cmake -S build-old-src -B build-old \
        -DCMAKE_BUILD_TYPE=Release ${cmake_args[*]} -DTIDE_BUILD_TESTS=OFF >/dev/null && \
        cmake --build build-old -j$jobs --target tidalloc_cli" &&
      step "stream expandable (old tree)" "$bench_log" 150 \
        build-old/tidalloc stream --frames ${STREAM_FRAMES:-64 128 256 512 1024} \
        --conf backend:cuda --label tidalloc-expandable-old --csv build/stream_old.csv
  fi
  # STREAM_CONFIGS="LABEL=OPTIONS ...": those configurations of this tree and
  # fixed segments, interleaved by rounds (bench/stream_configs.sh), at
  # CONFIG_FRAMES (default 64 128 256); their rows join stream.csv.
  rm -f build/stream_configs.csv
  if [[ -n ${STREAM_CONFIGS:-} ]]; then
    rm -f build/stream_driver.csv
    step "stream configurations" "$bench_log" 300 env CONFIGS="$STREAM_CONFIGS" \
      FRAMES="${CONFIG_FRAMES:-64 128 256}" TIDALLOC=build/tidalloc \
      DRIVER_CSV=build/stream_driver.csv \
      sh -c 'bench/stream_configs.sh | tail -n +2 >build/stream_configs.csv'
    # Their driver work (maps, unmaps) goes to bench.log: stream.csv keeps
    # the benchmark's columns.
    { echo "stream configurations driver csv:"; cat build/stream_driver.csv 2>/dev/null
      echo "end of stream configurations driver csv"; } >>"$bench_log"
  fi
  { head -1 build/stream_True.csv; tail -q -n +2 build/stream_True.csv build/stream_False.csv \
    build/stream_grow.csv build/stream_old.csv; cat build/stream_configs.csv; } \
    >"$out/stream.csv" 2>/dev/null
  for trace in "${TRACE_DIR:-bench/traces}"/*.csv.gz; do
    [[ -f $trace ]] || continue
    step "replay $(basename "$trace" .csv.gz) (cuda)" "$bench_log" 120 build/tidalloc replay "$trace" --conf backend:cuda
  done
fi

# ---------------------------------------------------------------------------
# The soak (SOAK_SECONDS > 0): the mixed workload with data verification on
# the CUDA backend. bench.log gets its output, then its CSV (a header and one
# row); the summary its result. A 2-minute margin covers the end's checks.
# ---------------------------------------------------------------------------
# The result lines of the last soak in bench.log.
soak_result() {
  awk '/^=== soak /{text=""} {text=text $0 "\n"} END{printf "%s", text}' "$bench_log" |
    grep -E '^  operations|^  written|^  (verification failures|unexpected errors|tide_check failures|leaks) |^soak: (PASS|FAIL)$' |
    sed 's/^ */  /' | tee -a "$summary"
}

if ((soak_seconds > 0)); then
  if [[ -x build/tidalloc ]]; then
    soak_csv=build/soak.csv
    rm -f "$soak_csv"
    step "soak ${soak_seconds} s (cuda)" "$bench_log" $((soak_seconds + 120)) \
      env TIDALLOC_CONF=backend:cuda build/tidalloc soak --seconds "$soak_seconds" \
      --csv "$soak_csv"
    soak_result
    { echo "soak.csv:"; cat "$soak_csv" 2>/dev/null || echo "(not written)"; } >>"$bench_log"
  else
    note "soak: skipped (the tidalloc command was not built)"
  fi
fi

# ---------------------------------------------------------------------------
# PyTorch programs, timed (TORCH_ROUNDS > 0): tests/torch/run_validation.sh
# with ROUNDS=TORCH_ROUNDS fresh processes per configuration (order reversed
# in even rounds), REPEATS=TORCH_REPEATS (default 10), PROGRAMS=TORCH_PROGRAMS
# (default "vit gpt2"), CONFIGS=TORCH_CONFIGS (default "expandable
# tidalloc"), within TORCH_SECONDS (default 300). Its CSV goes to bench.log
# between "torch rounds csv:" and "end of torch rounds csv", its table and
# per-run lines to bench.log and the table to the summary.
# ---------------------------------------------------------------------------
torch_rounds=${TORCH_ROUNDS:-0}
if ((torch_rounds > 0)); then
  torch_csv=build/torch_rounds.csv
  step "torch rounds (${torch_rounds})" "$bench_log" "${TORCH_SECONDS:-300}" \
    env ROUNDS="$torch_rounds" REPEATS="${TORCH_REPEATS:-10}" \
    PROGRAMS="${TORCH_PROGRAMS:-vit gpt2}" CONFIGS="${TORCH_CONFIGS:-expandable tidalloc}" \
    sh -c 'tests/torch/run_validation.sh >"$0"' "$torch_csv"
  { echo "torch rounds csv:"; cat "$torch_csv" 2>/dev/null; echo "end of torch rounds csv"; } >>"$bench_log"
  awk '/^=== torch rounds/{text=""} {text=text $0 "\n"} END{printf "%s", text}' "$bench_log" |
    grep -E '^(vit|gpt2) ' | sed 's/^/  /' | tee -a "$summary"
fi

# ---------------------------------------------------------------------------
# Fuzzing on this machine's CPUs (FUZZ_BUILD=DIR holding fuzz_* programs
# built by `make fuzz`, and FUZZ_SECONDS > 0): scripts/fuzz.sh with one
# worker per CPU, after everything timed above (it would disturb timings).
# Its CSV line goes to the summary, to be added to bench/results/host/fuzz.csv.
# ---------------------------------------------------------------------------
if [[ -n ${FUZZ_BUILD:-} && ${FUZZ_SECONDS:-0} -gt 0 ]]; then
  rm -f build/fuzz.csv
  step "fuzz ${FUZZ_TARGETS:-all} ${FUZZ_SECONDS} s" "$bench_log" $((FUZZ_SECONDS + 120)) \
    env FUZZ_JOBS="$jobs" FUZZ_CSV=build/fuzz.csv scripts/fuzz.sh "$FUZZ_BUILD"
  note "  fuzz.csv lines:"
  tail -n +2 build/fuzz.csv 2>/dev/null | sed 's/^/  /' | tee -a "$summary"
fi

note ""
note "total: $(elapsed) s; $( ((failed)) && echo 'some steps FAILED' || echo 'every step passed')"
exit "$failed"
