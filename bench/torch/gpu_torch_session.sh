#!/usr/bin/env bash
# gpu_torch_session.sh: the PyTorch work of a GPU session in one go, from the
# repository root: the library, the shim built for the machine's torch, the
# native-allocator tests (tests/torch/native_shim.py under PyTorch's allocator
# and under tidalloc, then compared), the cost of one cached allocation
# (tests/torch/alloc_pair.py), PyTorch's own graph tests under both
# allocators when their sources are in UPSTREAM_DIR (default .upstream:
# test/inductor/test_cudagraph_trees.py and test/test_cuda.py of the
# installed torch's version; tests/torch/upstream/fetch_tests.sh fetches
# them), and the streaming model (bench/torch) when
# STREAM_FRAMES is set. Logs and results go to $OUT (default out/torch);
# the summary is printed last.
#   OUT=/some/dir STEPS="build shim native alloc upstream" bench/torch/gpu_torch_session.sh
# WHEELS=dir installs wheels from dir first (packages the machine lacks;
# default: UPSTREAM_DIR/wheels where tests/torch/upstream/fetch_tests.sh put
# the wheels PyTorch's tests import, such as expecttest).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
out=${OUT:-out/torch}
mkdir -p "$out"
out=$(cd "$out" && pwd)
steps=${STEPS:-build shim native alloc upstream}
upstream=${UPSTREAM_DIR:-.upstream}
py=${TIDE_PYTHON:-python3}
summary=$out/summary.txt
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }
want() { [[ " $steps " == *" $1 "* ]]; }

export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
export TIDALLOC_CACHE=${TIDALLOC_CACHE:-$PWD/build-torch/shim-cache}
wheels=${WHEELS:-}
[[ -z $wheels && -d $upstream/wheels ]] && wheels=$upstream/wheels
if [[ -n $wheels ]]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$wheels"/*.whl &&
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi

bench/torch/machine.sh "$py" | tee "$out/machine.txt"

if want build; then
  t0=$SECONDS
  if cmake -S . -B build-torch -DCMAKE_BUILD_TYPE=Release -DTIDE_BUILD_TESTS=OFF \
       -DTIDE_BUILD_TOOLS=OFF -DTIDE_BUILD_EXAMPLES=OFF >"$out/build.log" 2>&1 &&
     cmake --build build-torch -j"$(nproc)" --target tidalloc >>"$out/build.log" 2>&1; then
    note "build: ok ($((SECONDS - t0)) s)"
  else
    note "build: FAILED (build.log)"
  fi
fi
# The library built here, unless the caller names one (built elsewhere).
if want build || [[ -z ${TIDALLOC_LIB:-} ]]; then
  export TIDALLOC_LIB=$PWD/build-torch/libtidalloc.so
fi

if want shim; then
  t0=$SECONDS
  if "$py" -m tidalloc build-shim --verbose >"$out/shim_build.log" 2>&1; then
    note "shim: built ($((SECONDS - t0)) s): $(tail -1 "$out/shim_build.log")"
  else
    note "shim: FAILED: $(tail -3 "$out/shim_build.log" | tr '\n' ' ')"
  fi
  note "info: $("$py" -m tidalloc info 2>&1 | grep -E '^(torch|bridge):' | tr '\n' ' ')"
fi

if want native; then
  for alloc in native tidalloc; do
    t0=$SECONDS
    timeout 420 "$py" tests/torch/native_shim.py --allocator $alloc --out "$out/native_shim_$alloc.pt" \
      --kv-steps "${KV_STEPS:-128}" >"$out/native_shim_$alloc.log" 2>&1
    note "native_shim $alloc: exit $? ($((SECONDS - t0)) s): $(grep -E 'passed|FAIL|checkpoints|bridge' "$out/native_shim_$alloc.log" | tr '\n' ' ')"
  done
  "$py" tests/torch/native_shim.py --compare "$out/native_shim_native.pt" "$out/native_shim_tidalloc.pt" \
    >"$out/native_shim_compare.txt" 2>&1
  note "native_shim compare: exit $?"
  tee -a "$summary" <"$out/native_shim_compare.txt"
fi

# The growing-KV model at a size where fixed costs do not decide the ratio.
if want kv; then
  for alloc in native tidalloc; do
    timeout 300 "$py" tests/torch/native_shim.py --allocator $alloc --cases compile_kv \
      --kv-steps "${KV_BIG_STEPS:-512}" --kv-batch 8 --kv-width 1024 --kv-layers 16 \
      --out "$out/kv_$alloc.pt" >"$out/kv_$alloc.log" 2>&1
    note "kv $alloc: exit $?: $(grep -E 'compile_kv:|checkpoints' "$out/kv_$alloc.log" | tr '\n' ' ')"
  done
fi

if want alloc; then
  timeout 300 "$py" tests/torch/alloc_pair.py --rounds "${ALLOC_ROUNDS:-3}" --csv "$out/alloc_pair.csv" \
    >"$out/alloc_pair.log" 2>&1
  note "alloc_pair: exit $?"
  tail -7 "$out/alloc_pair.log" | tee -a "$summary"
fi

# PyTorch's own tests: one pytest run per allocator, both at once (each
# with UPSTREAM_JOBS workers), tidalloc installed in every process through
# tests/torch/upstream/sitecustomize.py; upstream_compat.py lets test files
# of a neighbouring torch version import.
# Each allocator's run builds the tests' extensions in a folder of its own:
# the two runs built different sources under one name at once, and one
# loaded the other's.
if want upstream; then
  [[ -f $upstream/VERSION ]] && note "upstream: test files of $(cat "$upstream/VERSION")"
  # PyTorch's test helpers import expecttest, which a torch install lacks.
  "$py" -c "import expecttest" 2>/dev/null ||
    note "upstream: expecttest is not importable, so PyTorch's test files will not import" \
      "(tests/torch/upstream/fetch_tests.sh puts its wheel in $upstream/wheels)"
  for f in ${UPSTREAM_FILES:-test/inductor/test_cudagraph_trees.py test/test_cuda.py}; do
    [[ -f $upstream/$f ]] || { note "upstream: $f not in $upstream, skipped"; continue; }
    base=$(basename "$f" .py)
    sel=()
    [[ $base == test_cuda ]] && sel=(-k "graph or Graph or mem_pool or MemPool")
    t0=$SECONDS
    extensions=$(mktemp -d) # built fresh each run, and kept out of $out's archive
    for alloc in native tidalloc; do
      (cd "$upstream/$(dirname "$f")" &&
        TIDALLOC_INSTALL=$([[ $alloc == tidalloc ]] && echo 1 || echo 0) \
        TORCH_EXTENSIONS_DIR=$extensions/$alloc \
        PYTHONPATH=$OLDPWD/tests/torch/upstream:$PYTHONPATH \
        timeout -s INT -k 30 "${UPSTREAM_SECONDS:-400}" "$py" -m pytest -v -p no:cacheprovider -p upstream_compat \
          -n "${UPSTREAM_JOBS:-7}" "$(basename "$f")" "${sel[@]}" --junitxml="$out/${base}_$alloc.xml" \
          >"$out/${base}_$alloc.log" 2>&1; echo $? >"$out/${base}_$alloc.rc") &
    done
    wait
    rm -rf "$extensions"
    for alloc in native tidalloc; do
      note "upstream $base $alloc: exit $(cat "$out/${base}_$alloc.rc") ($((SECONDS - t0)) s): $(grep -m1 '^allocator:' "$out/${base}_$alloc.log"); $(tail -1 "$out/${base}_$alloc.log")"
    done
    # A fault of the device (an illegal address) fails every later test of its
    # worker process: each worker's first failure, in the order it ran (-v), is
    # the test to look at.
    for alloc in native tidalloc; do
      grep -E '^\[gw[0-9]+\] .*(FAILED|ERROR)' "$out/${base}_$alloc.log" |
        awk '!seen[$1]++ {print "upstream " a " first failure of " $1 ": " $NF}' a="$alloc" |
        tee -a "$summary"
    done
    "$py" tests/torch/upstream/compare_junit.py --common --known tests/torch/upstream/known.txt \
      --unexplained "$out/${base}_unexplained.txt" "$out/${base}_native.xml" \
      "$out/${base}_tidalloc.xml" >"$out/${base}_compare.txt" 2>&1
    tail -5 "$out/${base}_compare.txt" | tee -a "$summary"
    # Each test that failed under tidalloc alone, run again alone (its own
    # process, under each allocator): whether it fails by itself or only
    # after the tests its worker ran before it.
    while read -r t; do
      [[ -n $t ]] || continue
      for alloc in native tidalloc; do
        (cd "$upstream/$(dirname "$f")" &&
          TIDALLOC_INSTALL=$([[ $alloc == tidalloc ]] && echo 1 || echo 0) \
          PYTHONPATH=$OLDPWD/tests/torch/upstream:$PYTHONPATH \
          timeout -s INT -k 10 "${UPSTREAM_ALONE_SECONDS:-90}" "$py" -m pytest -q -p no:cacheprovider \
            -p upstream_compat "$(basename "$f")::$t" >"$out/${base}_alone_$alloc.log" 2>&1)
        note "upstream $base alone $alloc: $t: exit $?: $(tail -1 "$out/${base}_alone_$alloc.log")"
        cat "$out/${base}_alone_$alloc.log" >>"$out/${base}_alone.log"
      done
    done <"$out/${base}_unexplained.txt" 2>/dev/null
    rm -f "$out/${base}"_alone_native.log "$out/${base}"_alone_tidalloc.log
  done
fi

if [[ -n ${STREAM_FRAMES:-} && -f bench/torch/stream_gct.py ]]; then
  for alloc in native expandable tidalloc; do
    env=()
    [[ $alloc == expandable ]] && env=(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)
    runner=("$py")
    [[ $alloc == tidalloc ]] && runner=("$py" -m tidalloc run)
    env "${env[@]}" timeout 300 "${runner[@]}" bench/torch/stream_gct.py --frame-counts $STREAM_FRAMES \
      ${STREAM_ARGS:-} --csv "$out/stream_gct_$alloc.csv" >"$out/stream_gct_$alloc.log" 2>&1
    note "stream_gct $alloc: exit $?: $(tail -2 "$out/stream_gct_$alloc.csv" 2>/dev/null | tr '\n' ' ')"
  done
fi
# Fewer files come back than are written: the logs travel as one archive.
bench/torch/pack_logs.sh "$out" summary.txt
echo "== summary"
cat "$summary"
