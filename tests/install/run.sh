#!/usr/bin/env bash
# run.sh: installs a built tidalloc into a temporary prefix, then builds and
# runs tests/install/consumer.c against it, once through find_package(tidalloc)
# (shared and static) and once through pkg-config (shared and static), and
# tests/install/consumer_cxx.cpp through find_package where a C++ compiler of
# the C compiler's family is installed; then README.md's hello program
# (examples/hello.c) with README.md's command line, which must run without
# LD_LIBRARY_PATH (tidalloc.pc sets an rpath).
#   run.sh <build dir> <C compiler> [C flags of that build]
# The C flags carry sanitizer options over, so the consumer links the runtime
# a sanitized library needs.
set -euo pipefail

build=$(cd "$1" && pwd)
cc=$2
cflags=${3:-}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

work=$(mktemp -d "${TMPDIR:-/tmp}/tidalloc-install.XXXXXX")
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix

step() { printf '\n== %s\n' "$*"; }

step "install into $prefix"
cmake --install "$build" --prefix "$prefix"
for f in include/tidalloc.h include/tidalloc_torch.h include/tidalloc_testing.h; do
  test -f "$prefix/$f" || { echo "missing $prefix/$f" >&2; exit 1; }
done
pcdir=$(dirname "$(find "$prefix" -name tidalloc.pc -print -quit)")
libdir=$(dirname "$pcdir")
for f in libtidalloc.a libtidalloc.so cmake/tidalloc/tidallocConfig.cmake \
         cmake/tidalloc/tidallocConfigVersion.cmake; do
  test -e "$libdir/$f" || { echo "missing $libdir/$f" >&2; exit 1; }
done
soname=$(objdump -p "$libdir/libtidalloc.so" | awk '$1 == "SONAME" {print $2}')
test -n "$soname" || { echo "libtidalloc.so has no SONAME" >&2; exit 1; }
echo "SONAME $soname"

export TIDALLOC_CONF=backend:host

# The C++ compiler of the same family as the C one (the sanitizer flags of
# the build must suit both), if there is one: the C++ consumer is built too.
case $(basename "$cc") in
  clang*) cxx=$(dirname "$cc")/clang++ ;;
  gcc*) cxx=$(dirname "$cc")/g++ ;;
  cc) cxx=$(dirname "$cc")/c++ ;;
  *) cxx="" ;;
esac
[[ -n $cxx && ! -x $cxx ]] && cxx=$(command -v "$(basename "$cxx")" || true)
cxx_args=(-DTIDE_CXX=OFF)
[[ -n $cxx ]] && cxx_args=(-DTIDE_CXX=ON -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_CXX_FLAGS="$cflags")

step "find_package(tidalloc)"
cmake -S "$here" -B "$work/cmake-build" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_C_COMPILER="$cc" -DCMAKE_C_FLAGS="$cflags" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  "${cxx_args[@]}"
cmake --build "$work/cmake-build"
"$work/cmake-build/consumer_shared"
"$work/cmake-build/consumer_static"
if [[ -n $cxx ]]; then
  "$work/cmake-build/consumer_cxx"
else
  echo "no C++ compiler to match $cc: the C++ consumer is not built"
fi
# The shared consumer must load the installed library, not the build tree's.
# (ldd's output is kept whole: grep -q quitting early would break the pipe.)
deps=$(ldd "$work/cmake-build/consumer_shared")
grep -q "libtidalloc.so.* => $prefix/" <<<"$deps" || {
  echo "consumer_shared does not load libtidalloc from $prefix:" >&2
  echo "$deps" >&2
  exit 1
}

step "pkg-config tidalloc"
export PKG_CONFIG_PATH=$pcdir
echo "version $(pkg-config --modversion tidalloc)"
# No rpath of our own: tidalloc.pc's Libs carry one to the installed library.
# shellcheck disable=SC2046,SC2086 # the flags are meant to split into words
"$cc" $cflags "$here/consumer.c" -o "$work/pc_shared" $(pkg-config --cflags --libs tidalloc)
env -u LD_LIBRARY_PATH "$work/pc_shared"

# README.md's commands for its hello program (examples/hello.c), as a user
# types them after `make install PREFIX=...` and PKG_CONFIG_PATH.
step "README: cc hello.c \$(pkg-config --cflags --libs tidalloc)"
cp "$here/../../examples/hello.c" "$work/hello.c"
# shellcheck disable=SC2046,SC2086
(cd "$work" && "$cc" $cflags hello.c $(pkg-config --cflags --libs tidalloc) -o hello)
hello_out=$(env -u LD_LIBRARY_PATH "$work/hello")
echo "$hello_out"
grep -q 'allocated: *0.00 MiB now, *1.00 MiB peak' <<<"$hello_out" || {
  echo "hello printed no allocation" >&2
  exit 1
}
# The same flags with --static, asking the linker for the archive by name.
# shellcheck disable=SC2046,SC2086
"$cc" $cflags "$here/consumer.c" -o "$work/pc_static" \
  $(pkg-config --static --cflags --libs tidalloc | sed 's/-ltidalloc\b/-l:libtidalloc.a/')
if grep -q libtidalloc <<<"$(ldd "$work/pc_static")"; then
  echo "pc_static is linked to the shared libtidalloc" >&2
  exit 1
fi
"$work/pc_static"

step "the installed tidalloc works with find_package and with pkg-config"
