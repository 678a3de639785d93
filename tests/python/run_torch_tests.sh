#!/usr/bin/env bash
# run_torch_tests.sh: the Python tests that need torch and transformers
# (tidalloc.kv, tidalloc.hf, the torch parts of the package's own tests, the streaming
# benchmark's caches, the attention cost benchmark), with the python of scripts/torch_venv.sh's
# environment, on the host backend. `make test` makes the environment
# first; without it (TIDE_TORCH_VENV=off, no PyPI) this exits 77: skipped.
#   TIDE_TORCH_PYTHON   a python that has torch and transformers, instead
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
py=${TIDE_TORCH_PYTHON:-${TIDE_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/tidalloc/torch-venv}/bin/python}
if ! [[ -x $py ]] || ! "$py" -c 'import torch, transformers, pytest' >/dev/null 2>&1; then
  echo "run_torch_tests: SKIP: no python with torch, transformers and pytest at $py" \
    "(make test makes it with scripts/torch_venv.sh; or set TIDE_TORCH_PYTHON)"
  exit 77
fi
export TIDALLOC_CONF=${TIDALLOC_CONF:-backend:host,trace:100000} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
cd "$here" || exit 1
exec "$py" -m pytest -q -p no:cacheprovider test_kv.py test_hf.py test_tidalloc.py \
  test_stream_gct.py test_lingbot_stream.py test_attention_cost.py "$@"
