#!/usr/bin/env bash
# run_validation.sh: the validation programs (tests/torch/validate.py) each
# under PyTorch's default allocator, with expandable_segments:True, and under
# tidalloc, RUNS times each (default 2: the first warms the disk cache and
# the kernels' caches; the last is reported). Writes the CSV to stdout; exits non-zero if tidalloc's outputs
# differ from the native ones.
#   PYTHON=python3 tests/torch/run_validation.sh > validation.csv
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
py=${PYTHON:-python3}
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
echo "program,allocator,output_sha256,peak_allocated_mib,peak_reserved_mib,reserved_over_allocated,seconds"
status=0
for program in ${PROGRAMS:-gpt2 vit}; do
  native=""
  for allocator in native expandable tidalloc; do
    conf=""; name=$allocator
    [[ $allocator == expandable ]] && { conf="expandable_segments:True"; name=native; }
    row=""
    for run in $(seq 1 "${RUNS:-2}"); do
      row=$(PYTORCH_CUDA_ALLOC_CONF=$conf "$py" tests/torch/validate.py "$program" "$name" | tail -1)
    done
    row=${row/,native,/,$allocator,}
    echo "$row"
    sha=$(cut -d, -f3 <<<"$row")
    [[ $allocator == native ]] && native=$sha
    if [[ $sha != "$native" ]]; then
      echo "run_validation: $program under $allocator gives other outputs ($sha vs $native)" >&2
      status=1
    fi
  done
done
exit $status
