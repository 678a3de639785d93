#!/usr/bin/env bash
# run_validation.sh: the validation programs (tests/torch/validate.py) each
# under PyTorch's default allocator, with expandable_segments:True, and under
# tidalloc. Each configuration is one fresh process that runs the workload
# once (the warm-up: the columns measured before repeats existed) and then
# REPEATS times more (default 3), timed; validate.py checks every repeat's
# output against its first run. Writes the CSV to stdout and, to stderr, a
# table per configuration of the median time over its processes (each
# process's own median of its repeats) and their spread (highest - lowest,
# as a percentage of the median). Exits non-zero if a configuration fails or its
# outputs differ from the native ones.
#
# ROUNDS (default 1) runs the whole set that many times, configurations
# interleaved, each a fresh process (a process's own speed varies more than
# its repeats show); the `round` column says which, and the table gives the
# median over the rounds of each process's median.
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
rounds=${ROUNDS:-1}
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
echo "program,allocator,output_sha256,peak_allocated_mib,peak_reserved_mib,reserved_over_allocated,seconds,repeats,median_seconds,min_seconds,max_seconds,peak_reserved_all_mib,round"
status=0
rows=$(mktemp)
trap 'rm -f "$rows"' EXIT
for ((round = 1; round <= rounds; round++)); do
  for program in ${PROGRAMS:-gpt2 vit}; do
    native=""
    # Even rounds run the configurations in reverse order, so that a drift
    # of the machine within a round does not always favour the same one.
    read -ra configs <<<"${CONFIGS:-native expandable tidalloc}"
    if ((round % 2 == 0)); then
      for ((i = 0, j = ${#configs[@]} - 1; i < j; i++, j--)); do
        t=${configs[i]}; configs[i]=${configs[j]}; configs[j]=$t
      done
    fi
    for config in "${configs[@]}"; do
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
      row=${row/,$allocator,/,$config,},$round
      echo "$row"
      echo "$row" >>"$rows"
      IFS=, read -r _ _ sha _ <<<"$row"
      [[ $config == native || -z $native ]] && native=$sha
      if [[ $sha != "$native" ]]; then
        echo "run_validation: $program under $config gives other outputs ($sha vs $native)" >&2
        status=1
      fi
    done
  done
done
# Per program and configuration: the median over rounds of each process's
# median, and the lowest and highest of those (each round a fresh process);
# then, against the first configuration named in CONFIGS, the median over
# rounds of the ratio of the two processes' medians in the same round.
first=$(set -- ${CONFIGS:-native expandable tidalloc}; echo "$1")
awk -F, -v repeats="$repeats" -v rounds="$rounds" -v first="$first" '
  function median(arr, m,    i, j, t) {
    for (i = 2; i <= m; i++) for (j = i; j > 1 && arr[j-1] > arr[j]; j--) { t = arr[j]; arr[j] = arr[j-1]; arr[j-1] = t }
    return (m % 2) ? arr[(m + 1) / 2] : (arr[m / 2] + arr[m / 2 + 1]) / 2
  }
  { key = $1 " " $2; if (!(key in n)) order[++keys] = key; v[key, ++n[key]] = $9; by_round[$1, $2, $13] = $9 }
  END {
    for (k = 1; k <= keys; k++) {
      split(order[k], pc, " ")
      if (pc[2] == first) continue
      m = 0
      for (r = 1; r <= rounds; r++)
        if (((pc[1], pc[2], r) in by_round) && ((pc[1], first, r) in by_round) && by_round[pc[1], first, r] > 0)
          ratio[++m] = by_round[pc[1], pc[2], r] / by_round[pc[1], first, r]
      if (m) line[k] = sprintf("%-5s %-18s / %s, paired by round: median %.3f over %d round(s)", pc[1], pc[2], first, median(ratio, m), m)
    }
    printf "\nmedian of %d repeats per process, %d process(es) per configuration (spread: highest - lowest process median over their median):\n", repeats, rounds
    for (k = 1; k <= keys; k++) {
      key = order[k]; m = n[key]
      for (i = 1; i <= m; i++) a[i] = v[key, i]
      for (i = 2; i <= m; i++) for (j = i; j > 1 && a[j-1] > a[j]; j--) { t = a[j]; a[j] = a[j-1]; a[j-1] = t }
      md = (m % 2) ? a[(m + 1) / 2] : (a[m / 2] + a[m / 2 + 1]) / 2
      split(key, pc, " ")
      spread = (md > 0) ? 100 * (a[m] - a[1]) / md : 0
      printf "%-5s %-18s %8.3f s  (processes: lowest %.3f, highest %.3f, spread %.1f%%)\n", pc[1], pc[2], md, a[1], a[m], spread
    }
    for (k = 1; k <= keys; k++) if (k in line) print line[k]
  }' "$rows" >&2
exit $status
