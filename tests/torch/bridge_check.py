"""bridge_check.py: run under `python -m tidalloc run` on a GPU with a
supported torch: the shim is the bridge (not the pluggable fallback), and a
tensor and a torch.cuda.MemPool allocate through it. Exit status 0, or 1
saying what was found."""
import sys

import torch

import tidalloc.torch as tide_torch

bridge = tide_torch.bridge()
if bridge != "shim":
    sys.exit("bridge_check: the bridge is %r, not the shim (torch %s)"
             % (bridge, torch.__version__))
x = torch.ones(1 << 20, device="cuda")
pool = torch.cuda.MemPool()
with torch.cuda.use_mem_pool(pool):
    y = torch.ones(1 << 20, device="cuda")
torch.cuda.synchronize()
assert float((x + y).sum()) == 2 * (1 << 20)
print("bridge_check: torch %s, bridge %s, %s" % (torch.__version__, bridge,
                                                 torch.cuda.get_allocator_backend()))
