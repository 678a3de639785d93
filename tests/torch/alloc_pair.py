"""alloc_pair.py: what one cached allocation and free costs through PyTorch:
`torch.empty(1 MiB, device="cuda")` then `del`, under PyTorch's allocator
(native), expandable_segments:True, cudaMallocAsync, tidalloc through the
pluggable path and tidalloc as PyTorch's own allocator (the shim).

Each configuration runs in a fresh process (the allocator is fixed when CUDA
starts); the configurations are interleaved over --rounds rounds, and each
process reports the least of --reps timings of --iters pairs (the one
least disturbed by the machine).  Prints a table
of ns per pair (median over rounds, and the range) and each configuration's
ratio to native; --csv appends the rows.
  python tests/torch/alloc_pair.py --rounds 3 --csv out.csv"""
import argparse
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = {
    "native": {},
    "expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "cudaMallocAsync": {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
    "tidalloc-pluggable": {"TIDALLOC_TORCH_BRIDGE": "pluggable"},
    "tidalloc-shim": {"TIDALLOC_TORCH_BRIDGE": "shim"},
}


def worker(iters, reps, size):
    if os.environ.get("TIDALLOC_TORCH_BRIDGE"):
        sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
        import tidalloc.torch
        tidalloc.torch.install(bridge=os.environ["TIDALLOC_TORCH_BRIDGE"])
    import torch
    torch.empty(size, dtype=torch.uint8, device="cuda")  # CUDA up, the block cached
    times = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            x = torch.empty(size, dtype=torch.uint8, device="cuda")
            del x
        times.append((time.perf_counter_ns() - t0) / iters)
    torch.cuda.synchronize()
    print("ns_per_pair %.1f" % min(times))  # the least disturbed repetition


def measure(name, iters, reps, size):
    env = dict(os.environ)
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "TIDALLOC_TORCH_BRIDGE"):
        env.pop(k, None)
    env.update(CONFIGS[name])
    r = subprocess.run([sys.executable, __file__, "--worker", "--iters", str(iters), "--reps",
                        str(reps), "--size", str(size)], env=env, capture_output=True, text=True)
    for line in r.stdout.splitlines():
        if line.startswith("ns_per_pair "):
            return float(line.split()[1])
    sys.stderr.write("%s failed:\n%s\n" % (name, r.stderr[-2000:]))
    return None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--iters", type=int, default=20_000)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--size", type=int, default=1 << 20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--configs", nargs="*", default=list(CONFIGS))
    p.add_argument("--csv")
    a = p.parse_args()
    if a.worker:
        worker(a.iters, a.reps, a.size)
        return 0
    results = {n: [] for n in a.configs}
    for rnd in range(a.rounds):
        for name in a.configs:
            v = measure(name, a.iters, a.reps, a.size)
            if v is not None:
                results[name].append(v)
            print("round %d %-20s %s ns" % (rnd, name, "failed" if v is None else "%.1f" % v),
                  flush=True)
    native = statistics.median(results["native"]) if results.get("native") else None
    print("%-20s %10s %18s %10s" % ("allocator", "ns/pair", "range", "vs native"))
    rows = []
    for name in a.configs:
        vals = results[name]
        if not vals:
            print("%-20s %10s" % (name, "failed"))
            continue
        med = statistics.median(vals)
        ratio = med / native if native else float("nan")
        print("%-20s %10.1f %8.1f-%-8.1f %10.3f" % (name, med, min(vals), max(vals), ratio))
        rows.append("%s,%d,%d,%.1f,%.1f,%.1f,%.4f" % (name, a.size, len(vals), med, min(vals),
                                                      max(vals), ratio))
    if a.csv:
        new = not os.path.exists(a.csv)
        with open(a.csv, "a") as f:
            if new:
                f.write("allocator,bytes,rounds,ns_per_pair,min,max,vs_native\n")
            f.write("\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
