#!/usr/bin/env bash
# fuzz_stage.sh BUILD_DIR STAGE_DIR [TARGETS]: copies the libFuzzer programs
# of BUILD_DIR (built by `make fuzz`) into STAGE_DIR with a file `built_from`
# that records the sources hash and the commit they were built from, so that
# they can run on another machine (scripts/fuzz.sh there, FUZZ_SOURCES and
# FUZZ_COMMIT read from that file: gpu_stream_session.sh's fuzz lane does)
# and their executions still count for these sources. Refuses a build whose
# sources differ from the committed ones.
set -euo pipefail
build=${1:?usage: fuzz_stage.sh BUILD_DIR STAGE_DIR [TARGETS]}
stage=${2:?usage: fuzz_stage.sh BUILD_DIR STAGE_DIR [TARGETS]}
targets=${3:-ops}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ -n "$(git -C "$root" status --porcelain -- src include fuzz tools/trace_read.c)" ]; then
  echo "fuzz_stage: src/, include/, fuzz/ or tools/trace_read.c differ from the commit:" \
    "commit them and rebuild first" >&2
  exit 1
fi
first=${targets%% *}
newest=$(find "$root/src" "$root/include" "$root/fuzz" "$root/tools/trace_read.c" -newer \
  "$build/fuzz_$first" -type f -print -quit)
if [ -n "$newest" ]; then
  echo "fuzz_stage: $newest is newer than the build: run make fuzz first" >&2
  exit 1
fi
trees=$(git -C "$root" rev-parse HEAD:src HEAD:include HEAD:fuzz)
trees+=$'\n'$(git -C "$root" rev-parse HEAD:tools/trace_read.c)
mkdir -p "$stage"
for t in $targets; do cp "$build/fuzz_$t" "$stage/"; done
echo "$(echo "$trees" | sha1sum | cut -c1-12) $(git -C "$root" rev-parse --short HEAD)" >"$stage/built_from"
echo "fuzz_stage: $targets in $stage, built from $(cat "$stage/built_from")"
