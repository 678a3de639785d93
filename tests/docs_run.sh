#!/bin/sh
# docs_run.sh: every sh, c and python block of README.md and docs/*.md runs as
# written (tests/docs_blocks.py says how), with the build of the tidalloc
# command given (ctest passes build/'s). The blocks that need torch run with
# the python of scripts/torch_venv.sh's environment (make test makes it), or
# TIDE_TORCH_PYTHON, and are skipped, saying so, without one. Not in sanitizer
# builds: python and the shell's tools are not instrumented.
# usage: docs_run.sh path/to/tidalloc
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${1:?usage: docs_run.sh path/to/tidalloc}
build=$(cd "$(dirname "$bin")" && pwd)
if grep -q -- '-fsanitize' "$build/CMakeCache.txt" 2>/dev/null; then
  echo "docs_run: skipped in a sanitizer build ($build); the plain build runs it"
  exit 0
fi
venv=${TIDE_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/tidalloc/torch-venv}
py=${TIDE_TORCH_PYTHON:-$venv/bin/python}
if [ -x "$py" ] && "$py" -c 'import torch, transformers' >/dev/null 2>&1; then
  set -- --torch-python "$py"
else
  echo "docs_run: no python with torch and transformers at $py: the blocks that need them skip"
  set --
fi
exec python3 "$root/tests/docs_blocks.py" --build "$build" "$@"
