"""growable_kv.py: a KV-cache loop grown by torch.cat and the same loop with a
tidalloc GrowableTensor (appended in place: no copy of what it holds, data
pointer fixed). Checks that every step's attention output is bit-identical,
that the pointer never moves, and prints the bytes each variant copied to
grow its cache and its time.

    PYTHONPATH=python python tests/torch/growable_kv.py [STEPS]"""
import sys
import time

import torch

import tidalloc

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
D = 1024
torch.manual_seed(0)
dev = torch.device("cuda")
proj = torch.nn.Linear(D, D).to(dev)
x = torch.randn(steps, D, device=dev)


def attend(q, cache):
    return torch.softmax(q @ cache.T / 32.0, dim=-1) @ cache


def run_cat():
    cache = torch.empty(0, D, device=dev)
    outs, copied = [], 0
    for i in range(steps):
        k = proj(x[i:i + 1])
        copied += cache.numel() * 4
        cache = torch.cat([cache, k])
        outs.append(attend(x[i:i + 1], cache))
    return torch.cat(outs), copied


def run_growable():
    g = tidalloc.GrowableTensor((D,), torch.float32, capacity_rows=steps, map_ahead_rows=512)
    ptr = g.data_ptr
    outs = []
    for i in range(steps):
        cache = g.append(proj(x[i:i + 1]))
        assert cache.data_ptr() == ptr, "the growable cache moved"
        outs.append(attend(x[i:i + 1], cache))
    return torch.cat(outs), 0


results = {}
with torch.no_grad():
    for name, fn in (("cat", run_cat), ("growable", run_growable)):
        fn()  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out, copied = fn()
        torch.cuda.synchronize()
        results[name] = (out, copied, time.perf_counter() - t0)
same = torch.equal(results["cat"][0], results["growable"][0])
for name, (_, copied, secs) in results.items():
    print("%s: %d steps, %.1f MiB copied to grow the cache, %.3f s" % (name, steps, copied / 2**20,
                                                                      secs))
print("growable vs cat outputs: %s" % ("identical" if same else "DIFFERENT"))
sys.exit(0 if same else 1)
