#!/usr/bin/env bash
# machine.sh [PYTHON]: the machine and the software a GPU session ran on, as
# the sessions write it to machine.txt: date, commit (and whether the tree
# had local changes), the GPU, torch (and transformers where importable),
# CPUs and the host.
py=${1:-python3}
echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
"$py" - <<'PY' 2>&1 | tail -1
import torch
line = "torch %s cuda %s" % (torch.__version__, torch.version.cuda)
try:
    import transformers
    line += " transformers %s" % transformers.__version__
except ImportError:
    pass
print(line)
PY
echo "cpus: $(nproc)"
echo "host: $(uname -srm)"
