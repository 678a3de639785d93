#!/usr/bin/env bash
# run_one.sh ALLOCATOR TEST_ID...: PyTorch's own tests one at a time, each in
# a pytest process of its own (no xdist), from the repository root, with the
# test files in UPSTREAM_DIR (default .upstream) and ALLOCATOR native or
# tidalloc. Where gdb is installed each process runs under it, so that a
# crash leaves a native backtrace in the log; otherwise crash_trace.c,
# compiled here and preloaded, writes the native frames at the signal
# (after Python's faulthandler has written the Python ones; pytest runs
# with -s, so that stderr is not captured away), and the frames
# inside libraries without exported names are named with addr2line.
#   tests/torch/upstream/run_one.sh tidalloc test/test_cuda.py::TestMemPool::test_nested_mempool
# OUT (default out/upstream_one) gets one log per test; stdout says how
# each ended, with the last lines of a crash's backtrace.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.." || exit 1
root=$PWD
alloc=${1:?usage: run_one.sh native|tidalloc TEST_ID...}
shift
upstream=${UPSTREAM_DIR:-.upstream}
out=${OUT:-out/upstream_one}
mkdir -p "$out"
out=$(cd "$out" && pwd)
py=${TIDE_PYTHON:-python3}
gdb_cmd=()
preload=()
if ! command -v gdb >/dev/null &&
  ${CC:-cc} -shared -fPIC -O1 -o "$out/crash_trace.so" tests/torch/upstream/crash_trace.c; then
  preload=(env "LD_PRELOAD=$out/crash_trace.so")
fi
command -v gdb >/dev/null && gdb_cmd=(gdb -q -batch -ex "set pagination off" \
  -ex "handle SIGPIPE nostop noprint" -ex run -ex "bt 40" --args)
for id in "$@"; do
  file=${id%%::*}
  name=$(echo "${id##*::}" | tr -c 'A-Za-z0-9_\n' _)
  log=$out/${alloc}_$name.log
  (cd "$upstream/$(dirname "$file")" &&
    TIDALLOC_INSTALL=$([[ $alloc == tidalloc ]] && echo 1 || echo 0) \
    PYTHONPATH=$root/tests/torch/upstream:$root/python${PYTHONPATH:+:$PYTHONPATH} \
    timeout -k 10 "${ONE_SECONDS:-180}" "${preload[@]}" "${gdb_cmd[@]}" "$py" -X faulthandler -m pytest -q -s \
      -p no:cacheprovider -p no:xdist -p upstream_compat "$(basename "$file")::${id#*::}" \
      >"$log" 2>&1)
  rc=$?
  echo "== $alloc $id: exit $rc, $(grep -E '[0-9]+ (passed|failed)' "$log" | tail -1)"
  grep -E 'SIGSEGV|SIGABRT|SIGBUS|^#[0-9]+ ' "$log" |
    grep -vE '^#[0-9]+ .* in (_Py|Py|method_vectorcall|cfunction|slot_tp|call_|object_|vectorcall)' | head -24
  grep -E '^E  ' "$log" | head -6
  # crash_trace's frames: "LIB(+0xOFFSET) [ADDR]" named with addr2line.
  sed -n '/^crash_trace:/,$p' "$log" | head -40 | while IFS= read -r frame; do
    if [[ $frame =~ ^([^\(]+)\(\+(0x[0-9a-f]+)\) ]]; then
      echo "  $frame = $(addr2line -f -C -e "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}" 2>/dev/null | head -1)"
    else
      echo "  $frame"
    fi
  done
done
