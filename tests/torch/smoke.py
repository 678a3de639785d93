"""smoke.py: tidalloc installed as PyTorch's CUDA allocator in an
unmodified-style script: tensors, a small model, the memory figures PyTorch
reports, a KV cache grown by torch.cat, empty_cache, and a CUDA graph
capture (which must work or fail with a clear error). Prints one line per
check and exits non-zero if a check fails.

    python tests/torch/smoke.py            (native allocator, for comparison)
    python -m tidalloc run tests/torch/smoke.py"""
import sys

import torch

failures = 0


def check(name, ok, detail=""):
    global failures
    print("%s: %s %s" % ("PASS" if ok else "FAIL", name, detail))
    failures += 0 if ok else 1


MiB = 1 << 20
torch.manual_seed(0)
dev = torch.device("cuda")
x = torch.randn(1024, 1024, device=dev)
check("allocated counts a 4 MiB tensor", torch.cuda.memory_allocated() >= 4 * MiB,
      "(%d)" % torch.cuda.memory_allocated())
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                            torch.nn.Linear(4096, 1024)).to(dev)
with torch.no_grad():
    y = model(x)
ref = y.double().sum().item()
check("a model runs", torch.isfinite(y).all().item(), "(sum %.6f)" % ref)
torch.cuda.reset_peak_memory_stats()
cache = torch.empty(0, 1024, device=dev)
with torch.no_grad():
    for step in range(256):
        cache = torch.cat([cache, model(x[step:step + 1])])
torch.cuda.synchronize()
alloc, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
res, peak_res = torch.cuda.memory_reserved(), torch.cuda.max_memory_reserved()
check("figures are consistent", 0 < alloc <= peak <= peak_res and alloc <= res,
      "(allocated %.1f MiB, peak %.1f, reserved %.1f, peak reserved %.1f, ratio %.3f)" %
      (alloc / MiB, peak / MiB, res / MiB, peak_res / MiB, peak_res / max(peak, 1)))
stats = torch.cuda.memory_stats()
check("memory_stats has the usual keys", "allocated_bytes.all.current" in stats and
      stats["allocated_bytes.all.current"] == alloc)
del cache
torch.cuda.empty_cache()
check("empty_cache returns memory", torch.cuda.memory_reserved() < res,
      "(%.1f -> %.1f MiB)" % (res / MiB, torch.cuda.memory_reserved() / MiB))
try:
    g = torch.cuda.CUDAGraph()
    static_in = torch.randn(8, 1024, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        for _ in range(3):
            model(static_in)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g), torch.no_grad():
        static_out = model(static_in)
    static_in.copy_(torch.randn(8, 1024, device=dev))
    g.replay()
    with torch.no_grad():
        eager = model(static_in)
    check("torch.cuda.graph capture and replay", torch.equal(static_out, eager))
except Exception as e:  # the outcome is what we record
    check("torch.cuda.graph capture and replay", False, "(%s: %s)" % (type(e).__name__, e))
print("allocator:", torch.cuda.get_allocator_backend())
sys.exit(1 if failures else 0)
