#!/usr/bin/env bash
# torch_venv.sh: a virtual environment with torch and transformers for the
# Python tests that need them (tests/python/torch-requirements.txt), made
# once and kept outside the repository; prints its python on stdout.
#
#   TIDE_TORCH_VENV   where (default ${XDG_CACHE_HOME:-~/.cache}/tidalloc/torch-venv);
#                     "off": make nothing and exit 1
#   TIDE_PYTHON       the python it is made from (default /usr/bin/python3, the one
#                     CMake's Python tests use; its pytest is seen through
#                     --system-site-packages)
#
# Made again when the requirements file changed or torch no longer imports.
# The first install downloads about 3 GB (PyPI's Linux torch wheel is the CUDA
# build, whose import needs the nvidia-* libraries) and takes about two
# minutes where PyPI is fast; later calls answer at once.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
req=$root/tests/python/torch-requirements.txt
venv=${TIDE_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/tidalloc/torch-venv}
base=${TIDE_PYTHON:-/usr/bin/python3}
log() { printf 'torch_venv: %s\n' "$*" >&2; }

if [[ $venv == off ]]; then
  log "TIDE_TORCH_VENV=off: no environment made"
  exit 1
fi
stamp=$venv/.tide-requirements
if [[ -x $venv/bin/python ]] && cmp -s "$req" "$stamp" &&
  "$venv/bin/python" -c 'import torch, transformers' >/dev/null 2>&1; then
  echo "$venv/bin/python"
  exit 0
fi
command -v "$base" >/dev/null || { log "no $base to make the environment from"; exit 1; }
log "installing $(grep -v '^#' "$req" | xargs) into $venv (once; about 5.6 GB)"
start=$SECONDS
rm -rf "$venv"
mkdir -p "$(dirname "$venv")"
if ! "$base" -m venv --system-site-packages "$venv" >&2; then
  log "could not make a virtual environment with $base (python3-venv missing?)"
  exit 1
fi
if ! "$venv/bin/pip" install --quiet --disable-pip-version-check --no-input -r "$req" >&2; then
  log "pip install failed (is PyPI reachable?); the tests that need torch will skip"
  rm -rf "$venv"
  exit 1
fi
cp "$req" "$stamp"
log "installed in $((SECONDS - start)) s"
echo "$venv/bin/python"
