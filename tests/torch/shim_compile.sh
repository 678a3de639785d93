#!/usr/bin/env bash
# shim_compile.sh: compile the PyTorch shim (python/tidalloc/shim) against the
# headers of one or more torch installations, without linking and without a
# GPU: the check that it builds for each supported version.
#   tests/torch/shim_compile.sh TORCH_INCLUDE_DIR...
#   tests/torch/shim_compile.sh --auto
# Each argument is a torch/include folder (of an installed torch, or of a
# wheel unpacked). --auto takes the folders of TIDE_TORCH_INCLUDE (separated
# by colons), else that of the torch in TIDE_PYTHON (default python3): what
# `make test` runs. CUDA's headers come from CUDA_HOME (default /usr/local/cuda).
# Exit status 0 when every one compiled; 77 (skip) when there is no torch, no
# compiler or no CUDA headers, saying why.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
cxx=${CXX:-g++}
cuda=${CUDA_HOME:-/usr/local/cuda}
if ! command -v "$cxx" >/dev/null; then
  echo "shim_compile: skipped: no C++ compiler ($cxx)"
  exit 77
fi
if [[ ! -f $cuda/include/cuda_runtime_api.h ]]; then
  echo "shim_compile: skipped: no CUDA headers in $cuda/include (set CUDA_HOME)"
  exit 77
fi
if [[ ${1:-} == --auto ]]; then
  if [[ -n ${TIDE_TORCH_INCLUDE:-} ]]; then
    IFS=: read -r -a dirs <<<"$TIDE_TORCH_INCLUDE"
  else
    py=${TIDE_PYTHON:-python3}
    inc=$("$py" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))' 2>/dev/null)
    if [[ -z $inc ]]; then
      echo "shim_compile: skipped: no torch in $py (set TIDE_PYTHON to a python with torch, or" \
           "TIDE_TORCH_INCLUDE to torch/include folders, e.g. of wheels unpacked)"
      exit 77
    fi
    dirs=("$inc")
  fi
  set -- "${dirs[@]}"
fi
failed=0
for inc in "$@"; do
  if "$cxx" -std=c++17 -fsyntax-only -Wall -Wextra -Werror -Wno-unused-parameter \
      -isystem "$inc" -isystem "$inc/torch/csrc/api/include" -isystem "$cuda/include" \
      -Iinclude python/tidalloc/shim/tidalloc_torch.cpp; then
    echo "shim_compile: ok with $inc"
  else
    echo "shim_compile: FAILED with $inc"
    failed=1
  fi
done
exit $failed
