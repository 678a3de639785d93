#!/usr/bin/env bash
# run_gpu_tests.sh: the PyTorch tests of tests/torch under tidalloc, for
# `make gpu-test` (which builds the library and sets TIDALLOC_LIB):
#   build_shim, info_says_shim, quiet_shim_launch   the shim built for this
#                    torch and chosen; `run` then silent on stderr (bridge_check.py)
#   smoke.py         under python -m tidalloc run: tensors, a model, the
#                    figures, empty_cache, a torch.cuda.graph capture
#   graph_safety.py  graphs replayed while other tensors are allocated and written
#   graph_release.py a graph's memory let go while a replay of it, or a read of
#                    its output, still runs on another stream: under PyTorch's
#                    allocator, then under tidalloc
#   growable_kv.py   a short KV loop (128 steps, float32 and bfloat16)
#   share_mp.py      CUDA tensors sent to a spawned process through
#                    torch.multiprocessing (tidalloc's sharing)
#   distributed.py   NCCL collectives and DDP training on 2 GPUs (skips itself
#                    with fewer)
#   native_shim.py   CUDA graphs, MemPool and torch.compile(mode="reduce-overhead")
#                    with tidalloc as PyTorch's own allocator, and the same under
#                    PyTorch's allocator: every case passes and the outputs agree
# A test passes with exit status 0, is skipped with 77 (it says why), and fails
# otherwise or after TORCH_TEST_TIMEOUT seconds (default 900). The last line
# counts them; the exit status is 1 if one failed.
#
# TIDE_PYTHON names the python with torch (default python3). Without torch, or
# when torch sees no CUDA device, nothing runs: a line says why and the exit
# status is 0. `--check` only makes that check: 0 when the tests can run, 1
# (after saying why) when they cannot.
#
#   TIDE_PYTHON=/path/to/venv/bin/python tests/torch/run_gpu_tests.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
py=${TIDE_PYTHON:-python3}
timeout_s=${TORCH_TEST_TIMEOUT:-900}

# Can the tests run? Exit 3 from the probe: torch is there but sees no GPU.
probe=$("$py" -c 'import sys, torch
print(torch.__version__, torch.cuda.device_count())
sys.exit(0 if torch.cuda.is_available() else 3)' 2>&1)
case $? in
  0) why="" ;;
  3) why="torch in $py sees no CUDA device ($probe)" ;;
  127) why="$py not found; set TIDE_PYTHON to a python with torch" ;;
  *) why="no torch in $py ($(tail -1 <<<"$probe")); set TIDE_PYTHON to a python with torch" ;;
esac
if [[ ${1:-} == --check ]]; then
  [[ -z $why ]] && exit 0
  echo "gpu-test: torch tests skipped: $why"
  exit 1
fi
if [[ -n $why ]]; then
  echo "gpu-test: torch tests skipped: $why"
  exit 0
fi
read -r torch_version gpus <<<"$(head -1 <<<"$probe")"
echo "gpu-test: torch tests with $py (torch $torch_version, $gpus GPUs), library ${TIDALLOC_LIB:-found by the package}"

export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
passed=0 failed=0 skipped=0 failures=""

run_test() {
  local name=$1
  shift
  echo "== $name: $*"
  local start=$SECONDS
  timeout --kill-after=30 "$timeout_s" "$@"
  local rc=$?
  local took=$((SECONDS - start))
  case $rc in
    0) passed=$((passed + 1)); echo "-- $name: PASS (${took} s)" ;;
    77) skipped=$((skipped + 1)); echo "-- $name: SKIP (${took} s)" ;;
    124 | 137) failed=$((failed + 1)); failures+=" $name"
      echo "-- $name: FAIL: still running after ${timeout_s} s (TORCH_TEST_TIMEOUT)" ;;
    *) failed=$((failed + 1)); failures+=" $name"; echo "-- $name: FAIL (exit $rc, ${took} s)" ;;
  esac
}

# The shim builds for this torch (python -m tidalloc build-shim), and a
# process started now would get it (python -m tidalloc info).
run_test build_shim "$py" -m tidalloc build-shim
# (Printed, then matched: `tee /dev/stderr` would reopen a log file that
# stderr points to, truncating what was written before.)
run_test info_says_shim bash -c 'info=$("$1" -m tidalloc info) || exit 1
  echo "$info"; grep -q "^bridge: shim" <<<"$info"' _ "$py"
# With the shim built, `run` says nothing on stderr and runs on the shim.
run_test quiet_shim_launch bash -c 'err=$("$1" -m tidalloc run tests/torch/bridge_check.py 2>&1 >/dev/null) &&
  { [[ -z $err ]] || { echo "stderr: $err"; false; }; }' _ "$py"
run_test smoke "$py" -m tidalloc run tests/torch/smoke.py
run_test graph_safety "$py" tests/torch/graph_safety.py
run_test graph_release_native "$py" tests/torch/graph_release.py --native
run_test graph_release "$py" tests/torch/graph_release.py
run_test growable_kv "$py" -m tidalloc run tests/torch/growable_kv.py 128 --repeats 1
run_test share_mp "$py" tests/torch/share_mp.py
run_test distributed "$py" tests/torch/distributed.py
# tidalloc as PyTorch's own allocator (the shim), against PyTorch's, then
# the same with the pluggable bridge for the cases it can run.
shim_out=${TMPDIR:-/tmp}/tidalloc_native_shim.$$
run_test native_shim_native "$py" tests/torch/native_shim.py --allocator native --out "$shim_out.native.pt"
run_test native_shim_tidalloc "$py" tests/torch/native_shim.py --allocator tidalloc --out "$shim_out.tidalloc.pt"
run_test native_shim_same_outputs "$py" tests/torch/native_shim.py --compare "$shim_out.native.pt" "$shim_out.tidalloc.pt"
rm -f "$shim_out".*.pt

[[ -n $failures ]] && echo "gpu-test: torch tests failed:$failures"
echo "torch: $passed passed, $failed failed, $skipped skipped"
[[ $failed == 0 ]]
