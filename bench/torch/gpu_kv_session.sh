#!/usr/bin/env bash
# gpu_kv_session.sh: the KV-cache measurements on one GPU, from the repository
# root, within SESSION_SECONDS (default 450): a stage or run is not begun with
# less than its minimum left, and each is cut at what is left. Stages
# (STAGES, in order; default "kernels decode stream hf stream_compile hf_long"):
#   kernels         tests/torch/kv_cache_gpu.py: which SDPA kernels take
#                   tidalloc.kv.KVCache's views, and a CUDA graph replayed over
#                   a bucket of lengths (kv_kernels.csv, kv_cache_gpu.txt)
#   attention       bench/torch/attention_cost.py: one attention call's time by
#                   kernel, over contiguous keys and over KVCache's layout, at
#                   one key length and at a new length every call (cuDNN's
#                   plans), for a streaming frame and a decoding step
#                   (attention_cost.csv; not in the default stages)
#   decode          bench/torch/kv_decode.py: a decode step's appends and
#                   attention alone (GPT-2's 12 layers of 12 heads), host and
#                   wall time per step as the cache grows, torch.cat against
#                   KVCache, for each BATCH:SOURCE of DECODE_RUNS (default
#                   "1:projection 1:strided 8:projection"; kv_decode.py
#                   --source), DECODE_TOKENS steps (default 8192), kernel
#                   DECODE_SDPA (default flash) (kv_decode.csv)
#   stream          bench/torch/stream_gct.py's model, STREAM_FRAMES frames
#                   (default 128), paired with tests/torch/paired_time.py, one
#                   process per configuration, STREAM_ROUNDS rounds (default 2):
#                   torch.cat under expandable segments (the reference) and the
#                   native allocator, and the caches in KVCache under both
#                   (STREAM_CONFIGS) (stream_eager.csv, stream_eager.txt);
#                   STREAM_WARMUP_FRAMES=N makes each worker's untimed first
#                   run N frames long
#   stream_profile  bench/torch/stream_gct.py with torch.cat and with KVCache
#                   (--growable), under expandable segments, one process each
#                   per attention kernel of STREAM_PROFILE_SDPA (default
#                   "default", PyTorch's choice; stream_gct.py --sdpa):
#                   a run of each frame count of STREAM_PROFILE_FRAMES
#                   (default "160 160": a first run, then one over lengths
#                   seen), the device's kernels over steps STREAM_PROFILE_STEPS
#                   (default 100:110, the window full) by kind, and those
#                   steps' wall time: where a step's time goes for each cache
#                   (stream_profile.txt)
#   stream_compile  the same with the hot modules compiled
#                   (mode="reduce-overhead"), STREAM_COMPILE_ROUNDS rounds
#                   (default 1) of STREAM_COMPILE_CONFIGS (default: torch.cat and
#                   KVCache, both under expandable segments)
#   hf              bench/torch/hf_generate.py, one process per run, for each
#                   MODEL:BATCH:NEW_TOKENS of HF_RUNS (default: gpt2 and llama1b,
#                   batch 8 and 1, 2048 new tokens) and each cache of HF_CACHES
#                   (default dynamic growable static, run next to each other),
#                   PyTorch's allocator set by HF_ALLOC_CONF (default
#                   expandable_segments:True, the anchor the peaks compare to),
#                   for each kernel of HF_SDPA (default: "default", PyTorch's
#                   choice; hf_generate.py --sdpa), the ids kept to name the
#                   first token where two caches' outputs part; HF_PROFILE_STEPS=N
#                   profiles the host's work over N steps early and late in
#                   each run (hf_generate.log; those runs' times are perturbed)
#   hf_long         the same for HF_LONG_RUNS (default: 8192 new tokens, batch
#                   8 then 1), with what time is left
# Rows go to $OUT/hf_generate.csv; summary.txt has every stage's table,
# including whether each cache's greedy outputs equal DynamicCache's; the
# logs, the kernel table and the saved ids travel in logs.tar.gz.
#
#   OUT=dir bench/torch/gpu_kv_session.sh
#   OUT=dir STAGES="kernels hf" HF_RUNS="llama1b:8:2048" SESSION_SECONDS=240 bench/torch/gpu_kv_session.sh
#
# Needs torch and transformers (5.x) in TIDE_PYTHON (default python3); builds
# the library (Release) into build-kv/.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
out=${OUT:-out/gpu_kv}
mkdir -p "$out"
out=$(cd "$out" && pwd)
py=${TIDE_PYTHON:-python3}
budget=${SESSION_SECONDS:-450}
stages=${STAGES:-kernels decode stream hf stream_compile hf_long}
summary=$out/summary.txt
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }
left() { echo $((budget - SECONDS)); }
want() { [[ " $stages " == *" $1 "* ]]; }
# enough N WHAT: whether N seconds are left for WHAT (noted when not).
enough() {
  if (($(left) < $1)); then
    note "$2: not begun, $(left) s left of $budget"
    return 1
  fi
}

export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
export TIDALLOC_LIB=$PWD/build-kv/libtidalloc.so
bench/torch/machine.sh "$py" | tee -a "$summary" >"$out/machine.txt"

if ! { cmake -S . -B build-kv -DCMAKE_BUILD_TYPE=Release -DTIDE_BUILD_TESTS=OFF \
  -DTIDE_BUILD_EXAMPLES=OFF -DTIDE_BUILD_TOOLS=OFF && cmake --build build-kv -j"$(nproc)" --target tidalloc; } >"$out/build.log" 2>&1; then
  note "build: FAILED (build.log)"
  exit 1
fi
note "build: done after $SECONDS s"

if want kernels && enough 30 kernels; then
  timeout -k 10 "$(left)" "$py" tests/torch/kv_cache_gpu.py --csv "$out/kv_kernels.csv" \
    >"$out/kv_cache_gpu.txt" 2>&1
  note "kernels (rc $?): $(tail -1 "$out/kv_cache_gpu.txt")"
  grep '^FAIL' "$out/kv_cache_gpu.txt" | tee -a "$summary"
fi

if want attention && enough 30 attention; then
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 10 "$(left)" "$py" \
    bench/torch/attention_cost.py --csv "$out/attention_cost.csv" >"$out/attention_cost.txt" 2>&1
  note "attention (rc $?):"
  tee -a "$summary" <"$out/attention_cost.txt"
fi

if want decode; then
  for spec in ${DECODE_RUNS:-1:projection 1:strided 8:projection}; do
    IFS=: read -r batch source <<<"$spec"
    enough 40 "decode $spec" || continue
    PYTORCH_CUDA_ALLOC_CONF=${HF_ALLOC_CONF-expandable_segments:True} \
      timeout -k 10 "$(left)" "$py" bench/torch/kv_decode.py --batch "$batch" \
      --source "$source" --tokens "${DECODE_TOKENS:-8192}" --sdpa "${DECODE_SDPA:-flash}" \
      --csv "$out/kv_decode.csv" >>"$out/kv_decode.txt" 2>&1
    note "decode $spec (rc $?):"
    tail -17 "$out/kv_decode.txt" | tee -a "$summary"
  done
fi

# paired NAME PROGRAM ROUNDS CONFIGS...: paired_time.py over the configurations.
paired() {
  local name=$1 program=$2 rounds=$3 limit
  shift 3
  limit=$(left)
  timeout -k 20 "$limit" "$py" tests/torch/paired_time.py "$program" \
    --frames "${STREAM_FRAMES:-128}" ${STREAM_WARMUP_FRAMES:+--warmup-frames "$STREAM_WARMUP_FRAMES"} \
    --pairs "$rounds" --budget-s "$((limit * 2 / 3))" --configs "$@" >"$out/$name.csv" 2>"$out/$name.txt"
  note "$name (rc $?, $(grep -vc '^#\|^program' "$out/$name.csv") runs):"
  grep -v '^validate.py\|^\s*$' "$out/$name.txt" | tail -20 | tee -a "$summary"
}

hf_runs() {
  local spec model batch tokens cache kernel rc
  for spec in $1; do
    IFS=: read -r model batch tokens <<<"$spec"
    for kernel in ${HF_SDPA:-default}; do
      for cache in ${HF_CACHES:-dynamic growable static}; do
        if [[ $cache == static && $kernel == flash ]]; then
          note "hf $spec static flash: skipped (StaticCache masks its unwritten positions; flash takes no mask)"
          continue
        fi
        enough "${HF_MIN_SECONDS:-60}" "hf $spec $cache $kernel" || continue
        PYTORCH_CUDA_ALLOC_CONF=${HF_ALLOC_CONF-expandable_segments:True} \
          timeout -k 10 "$(left)" "$py" bench/torch/hf_generate.py --model "$model" \
          --batch "$batch" --new-tokens "$tokens" --cache "$cache" --sdpa "$kernel" \
          --profile-steps "${HF_PROFILE_STEPS:-0}" \
          --csv "$out/hf_generate.csv" --ids-out "$out/ids_${model}_${batch}_${tokens}_${kernel}_$cache.pt" \
          >>"$out/hf_generate.log" 2>&1
        rc=$?
        ((rc == 0)) || note "hf $spec $cache $kernel: rc $rc (hf_generate.log)"
      done
    done
  done
}

if want stream && enough 120 stream; then
  # shellcheck disable=SC2086
  paired stream_eager stream_gct "${STREAM_ROUNDS:-2}" \
    ${STREAM_CONFIGS:-expandable native expandable@stream_gct_growable native@stream_gct_growable}
fi
if want stream_profile && enough 90 stream_profile; then
  for sdpa in ${STREAM_PROFILE_SDPA:-default}; do
    for cache in cat growable; do
      enough 30 "stream_profile $cache $sdpa" || break 2
      echo "== $cache, --sdpa $sdpa" >>"$out/stream_profile.txt"
      growable=()
      [[ $cache == growable ]] && growable=(--growable)
      # shellcheck disable=SC2086
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -k 10 "$(left)" "$py" \
        bench/torch/stream_gct.py --frame-counts ${STREAM_PROFILE_FRAMES:-160 160} \
        --profile-frames "${STREAM_PROFILE_STEPS:-100:110}" --sdpa "$sdpa" \
        "${growable[@]}" >>"$out/stream_profile.txt" 2>&1
      note "stream_profile $cache, --sdpa $sdpa (rc $?):"
      sed -n '/^== '"$cache, --sdpa $sdpa"'$/,$p' "$out/stream_profile.txt" |
        grep '^stream_gct: \|frames  ok\|frames  oom' | tee -a "$summary"
    done
  done
fi
if want hf; then
  hf_runs "${HF_RUNS:-gpt2:8:2048 llama1b:8:2048 gpt2:1:2048 llama1b:1:2048}"
fi
if want stream_compile && enough 180 stream_compile; then
  # shellcheck disable=SC2086
  paired stream_compile stream_gct_compile "${STREAM_COMPILE_ROUNDS:-1}" \
    ${STREAM_COMPILE_CONFIGS:-expandable expandable@stream_gct_growable_compile}
fi
if want hf_long; then
  hf_runs "${HF_LONG_RUNS:-llama1b:8:8192 gpt2:8:8192 llama1b:1:8192 gpt2:1:8192}"
fi
if [[ -s $out/hf_generate.csv ]]; then
  note "hf_generate (time per token and peak against DynamicCache's):"
  "$py" bench/torch/hf_generate.py --summarize "$out/hf_generate.csv" 2>&1 | tee -a "$summary"
fi
note "done after $SECONDS s"
# Fewer files come back from a GPU machine than are written: all but the
# summary and the table travel as one archive.
bench/torch/pack_logs.sh "$out" summary.txt hf_generate.csv
