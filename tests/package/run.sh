#!/usr/bin/env bash
# run.sh: the Python package as a user installs it. In a fresh virtual
# environment: a wheel of the repository (`pip wheel .`, which builds
# libtidalloc and the tidalloc command with CMake through scikit-build-core),
# what the wheel holds, its install, then from another directory with no
# TIDALLOC_LIB or PYTHONPATH: `import tidalloc` (the packaged library),
# `python -m tidalloc --help`, `run` without PyTorch, an allocation on the
# host backend, the `tidalloc` command; then the uninstall.
#   run.sh <source dir> <python>
# scikit-build-core comes from PyPI into the environment (the build runs
# without isolation, so nothing else is fetched). Without PyPI, or without a
# Python that makes virtual environments, it says why and exits 77 (skipped).
set -euo pipefail

src=$(cd "$1" && pwd)
python=${2:-python3}
skip() { echo "SKIP: $*"; exit 77; }
step() { printf '\n== %s\n' "$*"; }

work=$(mktemp -d "${TMPDIR:-/tmp}/tidalloc-package.XXXXXX")
trap 'rm -rf "$work"' EXIT
unset TIDALLOC_LIB PYTHONPATH PYTHONHOME
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc 2>/dev/null || echo 2)}

step "a fresh virtual environment ($python)"
"$python" -m venv "$work/venv" >"$work/venv.log" 2>&1 ||
  skip "$python cannot make a virtual environment (Debian: apt-get install python3-venv): $(tail -1 "$work/venv.log")"
py=$work/venv/bin/python
pip=("$py" -m pip)

step "scikit-build-core from PyPI"
"${pip[@]}" install --quiet --timeout 30 --retries 1 'scikit-build-core>=0.10' >"$work/sbc.log" 2>&1 ||
  skip "scikit-build-core could not be installed (is PyPI reachable?): $(tail -1 "$work/sbc.log")"

step "pip wheel $src"
"${pip[@]}" wheel --no-build-isolation --no-deps --wheel-dir "$work/wheels" "$src"
wheel=$(ls "$work/wheels"/tidalloc-*.whl)
echo "$(basename "$wheel"): $(du -k "$wheel" | cut -f1) KiB"
"$py" - "$wheel" "$src" <<'PY'
import os, sys, zipfile
wheel, src = sys.argv[1], sys.argv[2]
names = set(zipfile.ZipFile(wheel).namelist())
want = ["tidalloc/__init__.py", "tidalloc/__main__.py", "tidalloc/_lib.py", "tidalloc/libtidalloc.so"]
# Files of the PyTorch shim are compiled at run time: each must ship.
shim = os.path.join(src, "python", "tidalloc", "shim")
if os.path.isdir(shim):
    for root, _, files in os.walk(shim):
        for f in files:
            if f.endswith((".cpp", ".h")):
                want.append(os.path.relpath(os.path.join(root, f), os.path.join(src, "python")))
missing = [w for w in want if w not in names]
if not any(n.endswith(".data/scripts/tidalloc") for n in names):
    missing.append("the tidalloc command (*.data/scripts/tidalloc)")
if missing:
    sys.exit("the wheel lacks: %s" % ", ".join(missing))
print("the wheel holds the package, libtidalloc.so and the tidalloc command (%d files)" % len(names))
PY

step "pip install the wheel"
"${pip[@]}" install --no-deps "$wheel"

mkdir "$work/elsewhere"
cd "$work/elsewhere"
step "import tidalloc from $PWD"
lib=$("$py" -c 'import tidalloc; print(tidalloc.library_path())')
echo "library: $lib"
case $lib in
  "$work/venv/"*/site-packages/tidalloc/libtidalloc.so) ;;
  *) echo "tidalloc loads $lib, not the library it installed" >&2; exit 1 ;;
esac

step "python -m tidalloc --help"
help=$("$py" -m tidalloc --help)
grep -q 'run' <<<"$help" && grep -q 'PyTorch' <<<"$help" ||
  { echo "--help does not say that run needs PyTorch: $help" >&2; exit 1; }

if ! "$py" -c 'import torch' 2>/dev/null; then
  step "python -m tidalloc run without PyTorch: one line, a failure"
  echo 'print("ran")' >script.py
  if "$py" -m tidalloc run script.py >out.txt 2>err.txt; then
    echo "run without PyTorch exited 0" >&2; exit 1
  fi
  cat err.txt
  [[ $(wc -l <err.txt) -eq 1 ]] && grep -q 'PyTorch' err.txt ||
    { echo "run without PyTorch did not say so in one line" >&2; exit 1; }
fi

step "an allocation on the host backend"
TIDALLOC_CONF=backend:host "$py" - <<'PY'
import tidalloc
from tidalloc import _lib
assert _lib.backend() == "host", _lib.backend()
buf = tidalloc.Buffer(64 << 20)
buf.resize(8 << 20)
allocated = tidalloc.memory_stats()["allocated_bytes.all.current"]
assert allocated >= 8 << 20, allocated
buf.close()
print("host backend: 8 MiB allocated through the packaged library, then freed")
PY

step "a TIDALLOC_LIB that names a missing file is an error naming it"
if TIDALLOC_LIB=$work/missing.so "$py" -c 'import tidalloc; tidalloc.library_path()' 2>err.txt; then
  echo "a missing TIDALLOC_LIB was ignored" >&2; exit 1
fi
grep -q "$work/missing.so" err.txt || { echo "the error does not name it: $(cat err.txt)" >&2; exit 1; }

step "the tidalloc command"
"$work/venv/bin/tidalloc" --version
# Read whole, then searched: grep -q stops reading at its match, and under
# pipefail the command's broken pipe would fail the step now and then.
info=$(TIDALLOC_CONF=backend:host "$work/venv/bin/tidalloc" info)
grep -q '^backend: host' <<<"$info" || { echo "tidalloc info: $info" >&2; exit 1; }

step "pip uninstall"
"${pip[@]}" uninstall --yes tidalloc
if "$py" -c 'import tidalloc' 2>/dev/null; then
  echo "tidalloc still imports after the uninstall" >&2; exit 1
fi
[[ ! -e $work/venv/bin/tidalloc ]] || { echo "the tidalloc command is still there" >&2; exit 1; }

step "the package installs, imports and allocates from a fresh environment"
