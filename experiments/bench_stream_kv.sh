#!/usr/bin/env bash
# bench_stream_kv.sh: the growable-buffer benchmark. Runs examples/stream_kv
# for each frame count: cache grown by allocate-copy-free (cat, eager), in a
# growable buffer eagerly, and in a growable buffer with the step replayed as
# a CUDA graph (checked against an eager run bit for bit). Writes one CSV per
# run (one row per frame) into OUTDIR/raw, then OUTDIR/stream_kv_summary.csv,
# OUTDIR/stream_kv_frames.csv and OUTDIR/stream_kv.png; the runs' output goes
# to stdout.
#
#   experiments/bench_stream_kv.sh BUILD_DIR OUTDIR [FRAMES...]
#
# STREAM_KV_ARGS goes to every run; by default "--tokens 1024 --dim 512
# --ahead-fraction 0.01": a cache that grows 2 MiB a frame, as one layer of a
# streaming reconstruction model's does, mapped ahead by at most 1% of its
# length. Set it empty for the example's own small default (64 tokens of 128
# floats, 32 KiB a frame, mapped ahead without a bound), where a 2 MiB page
# is most of the memory at first and no allocator can hold reserved near
# allocated.
set -euo pipefail
build=${1:?build directory}
out=${2:?output directory}
shift 2
frames=("$@")
[ ${#frames[@]} -gt 0 ] || frames=(64 256 1024 4096)
bin="$build/examples/stream_kv"
mkdir -p "$out/raw"
status=0
for n in "${frames[@]}"; do
  for config in "cat eager" "buf eager" "buf graph"; do
    set -- $config
    tag="$1_$2_$n"
    echo "== stream_kv --frames $n --mode $1 --exec $2"
    # shellcheck disable=SC2086
    if ! "$bin" --frames "$n" --mode "$1" --exec "$2" ${STREAM_KV_ARGS---tokens 1024 --dim 512 --ahead-fraction 0.01} \
      --csv "$out/raw/frames_$tag.csv"; then
      echo "stream_kv failed: $tag"
      status=1
    fi
  done
done
python3 "$(dirname "$0")/plot_stream_kv.py" "$out" || status=1
exit $status
