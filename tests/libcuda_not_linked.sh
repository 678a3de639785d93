#!/bin/sh
# libcuda_not_linked.sh: the shared library and the tidalloc command do not
# depend on the CUDA driver or runtime (no DT_NEEDED entry for libcuda or
# libcudart), so they load on machines without a GPU; the CUDA backend opens
# libcuda.so.1 itself at run time. The library is looked for next to the command.
# usage: libcuda_not_linked.sh path/to/tidalloc
set -u

bin=${1:?usage: libcuda_not_linked.sh path/to/tidalloc}
lib=$(dirname "$bin")/libtidalloc.so
failures=0

needed() {
  if command -v readelf >/dev/null 2>&1; then
    readelf -d "$1" | sed -n 's/.*(NEEDED).*\[\(.*\)\].*/\1/p'
  elif command -v objdump >/dev/null 2>&1; then
    objdump -p "$1" | awk '$1 == "NEEDED" { print $2 }'
  else
    echo "libcuda_not_linked: neither readelf nor objdump is installed (binutils)" >&2
    exit 1
  fi
}

check() {
  if [ ! -f "$1" ]; then
    echo "FAIL: $1 does not exist" >&2
    failures=$((failures + 1))
    return
  fi
  deps=$(needed "$1")
  if [ -z "$deps" ]; then
    echo "FAIL: found no DT_NEEDED entry at all in $1 (is it a dynamic ELF file?)" >&2
    failures=$((failures + 1))
    return
  fi
  if echo "$deps" | grep -Eq '^libcuda(rt)?\.so'; then
    echo "FAIL: $1 links the CUDA driver or runtime: $(echo "$deps" | tr '\n' ' ')" >&2
    failures=$((failures + 1))
  else
    echo "ok: $1 needs $(echo "$deps" | tr '\n' ' ')"
  fi
}

check "$lib"
check "$bin"
[ "$failures" -eq 0 ]
