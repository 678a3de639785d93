#!/usr/bin/env bash
# shim_compile.sh: compile the PyTorch shim (python/tidalloc/shim) against the
# headers of one or more torch releases, without linking and without a GPU:
# the check that it builds for each supported version.
#   tests/torch/shim_compile.sh TORCH_INCLUDE_DIR...
#   tests/torch/shim_compile.sh --auto
#   tests/torch/shim_compile.sh --versions [VERSION...]
# Each TORCH_INCLUDE_DIR is a torch/include folder (of an installed torch, or
# of a wheel unpacked). --auto takes the folders of TIDE_TORCH_INCLUDE
# (separated by colons), else that of the torch in TIDE_PYTHON (default
# python3). --versions takes the releases of tests/torch/torch_versions.txt
# (or those named) from the cache scripts/torch_headers.py fills
# ($TIDE_TORCH_HEADERS, default ${XDG_CACHE_HOME:-~/.cache}/tidalloc/torch-headers);
# a release not in the cache is skipped, saying how to fetch it. `make test`
# runs both (ctest's shim_compile and shim_compile_versions).
# Each compiles with the C++ standard that torch's cpp_extension uses
# (c++20 from 2.14): the one noted beside the headers, or read from
# torch/utils/cpp_extension.py, else c++17 before 2.14 and c++20 after.
# CUDA's headers come from CUDA_HOME (default /usr/local/cuda).
# One line per release: "ok", "FAILED" (the compiler's output follows) or
# "absent". Exit status 0 when every one present compiled; 1 when one
# failed; 77 (skip) when none could be tried: no torch or headers, no
# compiler or no CUDA headers, saying why.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
cxx=${CXX:-g++}
cuda=${CUDA_HOME:-/usr/local/cuda}
cache=${TIDE_TORCH_HEADERS:-${XDG_CACHE_HOME:-$HOME/.cache}/tidalloc/torch-headers}
if ! command -v "$cxx" >/dev/null; then
  echo "shim_compile: skipped: no C++ compiler ($cxx)"
  exit 77
fi
if [[ ! -f $cuda/include/cuda_runtime_api.h ]]; then
  echo "shim_compile: skipped: no CUDA headers in $cuda/include (set CUDA_HOME)"
  exit 77
fi

# The version in a torch/include folder's torch/version.h, as "2.15.0".
torch_version() {
  local h
  # torch/version.h moved under csrc/api, then its numbers to headeronly/
  for h in "$1/torch/version.h" "$1/torch/csrc/api/include/torch/version.h" \
    "$1/torch/headeronly/version.h"; do
    if grep -qs '^#define TORCH_VERSION_MINOR' "$h"; then
      local part v=""
      for part in MAJOR MINOR PATCH; do
        v+=${v:+.}$(sed -n "s/^#define TORCH_VERSION_$part \([0-9]*\).*/\1/p" "$h" | head -1)
      done
      echo "$v"
      return
    fi
  done
}

# The C++ standard cpp_extension compiles with for the torch of folder $1.
cxx_std() {
  local inc=$1 ext=$1/../utils/cpp_extension.py std=""
  if [[ -f $ext ]]; then
    # the flag it passes most often (its docstrings show others)
    std=$(grep -oE -- "'-std=c\+\+[0-9]{2}'" "$ext" | sort | uniq -c | sort -rn | head -1 |
      grep -oE 'c\+\+[0-9]{2}')
  elif [[ -f $inc/../cxx_std ]]; then
    std=$(head -1 "$inc/../cxx_std")
  fi
  if [[ -z $std ]]; then
    local minor
    minor=$(torch_version "$inc" | cut -d. -f2)
    std=c++17
    [[ ${minor:-0} -ge 14 ]] && std=c++20
  fi
  echo "$std"
}

dirs=()
absent=0
case ${1:-} in
  --auto)
    if [[ -n ${TIDE_TORCH_INCLUDE:-} ]]; then
      IFS=: read -r -a dirs <<<"$TIDE_TORCH_INCLUDE"
    else
      py=${TIDE_PYTHON:-python3}
      inc=$("$py" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))' 2>/dev/null)
      if [[ -z $inc ]]; then
        echo "shim_compile: skipped: no torch in $py (set TIDE_PYTHON to a python with torch, or" \
             "TIDE_TORCH_INCLUDE to torch/include folders; shim_compile.sh --versions uses the" \
             "headers of scripts/torch_headers.py)"
        exit 77
      fi
      dirs=("$inc")
    fi
    ;;
  --versions)
    shift
    versions=("$@")
    if [[ ${#versions[@]} == 0 ]]; then
      mapfile -t versions < <(grep -vE '^\s*(#|$)' tests/torch/torch_versions.txt)
    fi
    for v in "${versions[@]}"; do
      if [[ -f $cache/$v/.complete ]]; then
        dirs+=("$cache/$v/include")
      else
        echo "shim_compile: torch $v: absent (no headers in $cache/$v; scripts/torch_headers.py $v fetches them)"
        absent=$((absent + 1))
      fi
    done
    if [[ ${#dirs[@]} == 0 ]]; then
      echo "shim_compile: skipped: no torch headers in $cache (scripts/torch_headers.py fetches" \
           "those of tests/torch/torch_versions.txt, ~65 MB each)"
      exit 77
    fi
    ;;
  "" | -h | --help)
    sed -n '2,23s/^# \{0,1\}//p' "$0"
    exit 2
    ;;
  *) dirs=("$@") ;;
esac

# One compiler per release, SHIM_COMPILE_JOBS (default: the cores) at once;
# the lines come in the releases' order.
jobs=${SHIM_COMPILE_JOBS:-$(nproc 2>/dev/null || echo 2)}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
compile() { # folder, index: writes $work/index.{rc,out,line}
  local inc=$1 i=$2 version std start=$SECONDS
  version=$(torch_version "$inc")
  std=$(cxx_std "$inc")
  "$cxx" -std="$std" -fsyntax-only -Wall -Wextra -Werror -Wno-unused-parameter \
    -isystem "$inc" -isystem "$inc/torch/csrc/api/include" -isystem "$cuda/include" \
    -Iinclude python/tidalloc/shim/tidalloc_torch.cpp >"$work/$i.out" 2>&1
  local rc=$?
  echo "torch ${version:-?} ($std, $inc)" >"$work/$i.label"
  echo "$((SECONDS - start))" >"$work/$i.seconds"
  echo "$rc" >"$work/$i.rc"
}
i=0
for inc in "${dirs[@]}"; do
  while [[ $(jobs -rp | wc -l) -ge $jobs ]]; do wait -n; done
  compile "$inc" "$i" &
  i=$((i + 1))
done
wait
failed=0
ok=0
for ((i = 0; i < ${#dirs[@]}; i++)); do
  label=$(cat "$work/$i.label")
  if [[ $(cat "$work/$i.rc") == 0 ]]; then
    echo "shim_compile: $label: ok ($(cat "$work/$i.seconds") s)"
    ok=$((ok + 1))
  else
    out=$(cat "$work/$i.out")
    # an abstract class (a new pure virtual) says more than the first error
    first=$(grep -m1 'abstract class type' <<<"$out" || grep -m1 'error' <<<"$out")
    echo "shim_compile: $label: FAILED: $first"
    echo "$out"
    failed=$((failed + 1))
  fi
done
echo "shim_compile: $ok compiled, $failed failed, $absent absent"
[[ $failed == 0 ]] || exit 1
exit 0
