#!/usr/bin/env bash
# fetch_tests.sh VERSION [PYTORCH_GIT_DIR]: PyTorch's own test files that
# bench/torch/gpu_torch_session.sh's upstream step runs under tidalloc
# (test/test_cuda.py and test/inductor/test_cudagraph_trees.py), as of the
# release tag vVERSION, into UPSTREAM_DIR (default .upstream, which git
# ignores: they are PyTorch's, never committed here). From a clone of
# PyTorch's repository when one is named (git show vVERSION:FILE), else
# downloaded from GitHub. Fetch them where there is a network, then carry
# the folder to the GPU machine. .upstream/VERSION says where they came from;
# .upstream/wheels holds the wheel of expecttest, which the test files import.
#   tests/torch/upstream/fetch_tests.sh 2.11.0
#   tests/torch/upstream/fetch_tests.sh 2.11.0 ~/src/pytorch
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.." || exit 1
version=${1:?usage: fetch_tests.sh VERSION [PYTORCH_GIT_DIR]}
git_dir=${2:-}
dest=${UPSTREAM_DIR:-.upstream}
files=${UPSTREAM_FILES:-test/test_cuda.py test/inductor/test_cudagraph_trees.py}
tag=v$version
for f in $files; do
  mkdir -p "$dest/$(dirname "$f")"
  if [[ -n $git_dir ]]; then
    git -C "$git_dir" show "$tag:$f" >"$dest/$f.part" ||
      { echo "fetch_tests: $f is not at $tag in $git_dir" >&2; exit 1; }
  else
    url=https://raw.githubusercontent.com/pytorch/pytorch/$tag/$f
    curl -fsSL --retry 2 -o "$dest/$f.part" "$url" ||
      { echo "fetch_tests: could not download $url (no network? name a PyTorch clone)" >&2; exit 1; }
  fi
  mv "$dest/$f.part" "$dest/$f"
done
# Their helpers import expecttest, which torch does not install: its wheel
# travels with the files (gpu_torch_session.sh installs it from there).
python3 -m pip download -q --no-deps -d "$dest/wheels" expecttest ||
  echo "fetch_tests: expecttest's wheel not downloaded (no network?): put it in $dest/wheels" >&2
echo "PyTorch $tag: $files (from ${git_dir:-GitHub}, $(date -u +%F))" >"$dest/VERSION"
echo "fetch_tests: $(cat "$dest/VERSION") -> $dest"
