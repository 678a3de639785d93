#!/usr/bin/env bash
# run_validation.sh: the validation programs (tests/torch/validate.py) each
# under PyTorch's default allocator, with expandable_segments:True, and under
# tidalloc. Each configuration is one fresh process that runs the workload
# once (the warm-up: the columns measured before repeats existed) and then
# REPEATS times more (default 3), timed; validate.py checks every repeat's
# output against its first run. Writes the CSV to stdout and, to stderr, a
# table of the median time and the spread (max - min, as a percentage of the
# median) per configuration. Exits non-zero if a configuration fails or its
# outputs differ from the native ones.
#
#   PYTHON=python3 REPEATS=3 tests/torch/run_validation.sh > validation.csv
#   PROGRAMS="gpt2" CONFIGS="native tidalloc tidalloc-nodetect" tests/torch/run_validation.sh
#
# CONFIGS (default "native expandable tidalloc") may also name
# tidalloc-nodetect: tidalloc with capture_detection:False, to measure what
# the option that install() turns on costs.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
py=${PYTHON:-python3}
repeats=${REPEATS:-3}
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
echo "program,allocator,output_sha256,peak_allocated_mib,peak_reserved_mib,reserved_over_allocated,seconds,repeats,median_seconds,min_seconds,max_seconds,peak_reserved_all_mib"
status=0
summary=""
for program in ${PROGRAMS:-gpt2 vit}; do
  native=""
  for config in ${CONFIGS:-native expandable tidalloc}; do
    torch_conf=""; tide_conf=${TIDALLOC_CONF:-}; allocator=native
    case $config in
      native) ;;
      expandable) torch_conf="expandable_segments:True" ;;
      tidalloc) allocator=tidalloc ;;
      tidalloc-nodetect) allocator=tidalloc; tide_conf="${tide_conf:+$tide_conf,}capture_detection:False" ;;
      *) echo "run_validation: unknown configuration $config" >&2; status=1; continue ;;
    esac
    row=$(PYTORCH_CUDA_ALLOC_CONF=$torch_conf TIDALLOC_CONF=$tide_conf \
          "$py" tests/torch/validate.py "$program" "$allocator" --repeats "$repeats" | tail -1)
    rc=$?
    if [[ $rc != 0 || -z $row ]]; then
      echo "run_validation: $program under $config failed (exit $rc)" >&2
      status=1
      [[ -z $row ]] && continue
    fi
    row=${row/,$allocator,/,$config,}
    echo "$row"
    IFS=, read -r _ _ sha _ _ _ _ _ median min max _ <<<"$row"
    summary+=$(awk -v p="$program" -v c="$config" -v md="$median" -v mn="$min" -v mx="$max" \
      'BEGIN { spread = (md > 0) ? 100 * (mx - mn) / md : 0
               printf "%-5s %-18s %8.3f s  (min %.3f, max %.3f, spread %.1f%%)\n", p, c, md, mn, mx, spread }')$'\n'
    [[ $config == native || -z $native ]] && native=$sha
    if [[ $sha != "$native" ]]; then
      echo "run_validation: $program under $config gives other outputs ($sha vs $native)" >&2
      status=1
    fi
  done
done
printf '\nmedian of %s repeats per configuration (spread: max - min over the median):\n%s' \
  "$repeats" "$summary" >&2
exit $status
