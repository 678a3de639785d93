#!/usr/bin/env bash
# deps.sh: makes sure what building and testing tidalloc needs is installed,
# installing what is missing with apt-get (through sudo when not root). When
# everything is present it only asks dpkg and returns at once.
#   scripts/deps.sh          build, test and benchmark needs
#   scripts/deps.sh format   clang-format as well
#   scripts/deps.sh gpu      only what building the GPU tests needs besides CUDA
set -euo pipefail

# cmake, compilers, cmocka, zlib and mimalloc build the project (g++ the C++
# consumer of the install test); clang and its
# runtimes build the sanitizer and fuzzing builds; python3 merges benchmark tables
# and, with pytest, tests the Python layer (python/); python3-venv lets the
# package test (tests/package/run.sh) install it into a fresh environment.
packages=(cmake make gcc g++ libc6-dev binutils pkg-config libcmocka-dev zlib1g-dev
          libmimalloc-dev clang valgrind python3 python3-pytest python3-venv)
case "${1:-}" in
  format) packages+=(clang-format) ;;
  gpu) packages=(cmake make gcc g++ libc6-dev) ;;
  "") ;;
  *) echo "usage: scripts/deps.sh [format|gpu]" >&2; exit 2 ;;
esac

log() { printf 'deps: %s\n' "$*" >&2; }

# The command a package is installed for: found on PATH (a pip cmake, a
# compiler built from source), it is as good as the package.
declare -A command_of=([cmake]=cmake [make]=make [gcc]=gcc [g++]=g++ [binutils]=objdump
                       [pkg-config]=pkg-config [clang]=clang [valgrind]=valgrind
                       [python3]=python3 [clang-format]=clang-format)

# Packages of the list that are neither installed (dpkg) nor on PATH.
missing_packages() {
  local pkg
  for pkg in "$@"; do
    if [[ -n "${command_of[$pkg]:-}" ]] && command -v "${command_of[$pkg]}" >/dev/null; then
      continue
    fi
    missing_packages_dpkg_only "$pkg"
  done
}

# Packages of the list dpkg does not know as installed.
missing_packages_dpkg_only() {
  local pkg
  for pkg in "$@"; do
    [[ $(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null) == *" installed" ]] || echo "$pkg"
  done
}

apt_updated=no
install_packages() {
  local sudo=()
  if [[ $(id -u) -ne 0 ]]; then
    if ! command -v sudo >/dev/null; then
      log "missing: $*; run as root or install sudo, or install them yourself:"
      log "  apt-get install $*"
      exit 1
    fi
    sudo=(sudo)
  fi
  log "installing: $*"
  if [[ $apt_updated == no ]]; then
    # A failed update leaves the old lists, which may still do.
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq ||
      log "apt-get update failed; trying with the package lists there are"
    apt_updated=yes
  fi
  if ! "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends "$@" >/dev/null; then
    log "could not install: $* (is the package archive reachable?)"
    exit 1
  fi
}

if ! command -v dpkg-query >/dev/null || ! command -v apt-get >/dev/null; then
  # Not Debian: check the commands and leave the rest to the build's own errors.
  for cmd in cmake make cc pkg-config clang python3; do
    command -v "$cmd" >/dev/null || { log "missing $cmd (not a Debian system: install it yourself)"; exit 1; }
  done
  exit 0
fi

mapfile -t missing < <(missing_packages "${packages[@]}")
if ((${#missing[@]})); then
  install_packages "${missing[@]}"
fi

[[ "${1:-}" == gpu ]] && exit 0

# Only now is clang sure to be there to say which runtimes (libclang_rt.*: the
# sanitizers and libFuzzer) it needs. Debian ships them in libclang-rt-N-dev
# since clang 14, in libclang-common-N-dev (a dependency of clang) before.
# A clang not from a package brings its own runtimes.
clang_major=$(clang -dumpversion | cut -d. -f1)
if ((clang_major >= 14)) && [[ -z $(missing_packages_dpkg_only clang) ]]; then
  mapfile -t missing < <(missing_packages "libclang-rt-$clang_major-dev")
  if ((${#missing[@]})); then
    install_packages "${missing[@]}"
  fi
fi
