#!/usr/bin/env bash
# memory_probes.sh: where reserved memory sits above the allocated peak in
# the cases that miss their memory goal, on a GPU, one process each, from the
# repository root with the library and the shim built (gpu_stream_session.sh
# runs it as its "extra" lane: EXTRA=experiments/memory_probes.sh). Timings here
# are not results (other work shares the machine); the memory figures are.
#   1. the growing-KV model compiled with reduce-overhead (16 layers, width
#      1024, batch 8, 256 steps after 128) under native and tidalloc, with
#      each pool's segments and free blocks at the end
#   2. bench/torch/stream_gct.py --compile, 128 frames, under tidalloc, the
#      same breakdown
#   3. experiments/stream_gct_peaks.py under tidalloc: torch.cat runs then
#      growable runs in one process, each reserved peak broken down
# PROBES picks some of them (default "compile_kv stream_gct_compile
# stream_gct_peaks").
# Output: EXTRA_OUT (default out/memory_probes) gets one log per probe; the
# lines that carry the figures go to stdout.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
out=${EXTRA_OUT:-out/memory_probes}
mkdir -p "$out"
py=${TIDE_PYTHON:-python3}
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
probe() { # NAME SECONDS PATTERN COMMAND...: run, keep the log, print the matching lines
  local name=$1 limit=$2 pattern=$3 t0=$SECONDS
  shift 3
  timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
  echo "== $name: exit $? ($((SECONDS - t0)) s)"
  grep -E "$pattern" "$out/$name.log" | cut -c1-900
}
probes=" ${PROBES:-compile_kv stream_gct_compile stream_gct_peaks} "
kv=(--cases compile_kv --kv-layers 16 --kv-width 1024 --kv-batch 8 --kv-steps 256)
[[ $probes == *" compile_kv "* ]] && for alloc in native tidalloc; do
  probe "compile_kv_$alloc" 240 'compile_kv:|checkpoints' \
    "$py" tests/torch/native_shim.py --allocator "$alloc" "${kv[@]}" --out "$out/kv_$alloc.pt"
done
[[ $probes == *" stream_gct_compile "* ]] && probe stream_gct_compile 360 'frames|by pool|tidalloc|^ *[0-9]+,' \
  "$py" -m tidalloc run bench/torch/stream_gct.py --compile --frame-counts 128
[[ $probes == *" stream_gct_peaks "* ]] && probe stream_gct_peaks 300 'run [0-9]|reserved peak' \
  "$py" -m tidalloc run experiments/stream_gct_peaks.py --frames 128 --runs 2
