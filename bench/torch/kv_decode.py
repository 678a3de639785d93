"""kv_decode.py: what a decode step's cache and attention cost on the host and
on the device as the cache grows, with no model around them.

Each step runs, for each of --layers layers, what an attention layer of a
decoder does with its cache: append one token's keys and values ([B, H, 1,
D]) and attend to the whole cache with one query (scaled_dot_product_attention,
the kernel chosen by --sdpa). Two caches, one after the other in the same
process: torch.cat of the whole cache (DynamicCache's way) and
tidalloc.kv.KVCache. For each window of --window steps it records the host's
time to issue a step (the clock around the layers, no synchronization) and the
wall time of a step (the window from a synchronized device to a synchronized
device, divided by its steps). A host time that grows with the cache's length
is work the host does per token of cache; a wall time above the host time is
the device's.

    PYTHONPATH=python python bench/torch/kv_decode.py --tokens 8192 --csv kv_decode.csv
    TIDALLOC_CONF=backend:host PYTHONPATH=python python bench/torch/kv_decode.py \\
        --device cpu --tokens 256 --layers 2 --heads 2 --window 64

Columns: cache, batch, heads, head_dim, layers, tokens (the length at the
window's end), host_us_per_step, wall_us_per_step, sdpa, source, device."""
import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
# sdpa.py and results_csv.py beside this file, also when this file is loaded by its path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_csv import append_rows  # noqa: E402
from sdpa import SDPA_KERNELS, sdpa_context  # noqa: E402

COLUMNS = ("cache", "batch", "heads", "head_dim", "layers", "tokens", "host_us_per_step",
           "wall_us_per_step", "sdpa", "source", "device")


class CatCache:
    """DynamicLayer's way: the whole cache copied by torch.cat every step."""

    def __init__(self):
        self.k = self.v = None

    def append(self, k, v):
        if self.k is None:
            self.k, self.v = k, v
        else:
            self.k = torch.cat((self.k, k), dim=2)
            self.v = torch.cat((self.v, v), dim=2)
        return self.k, self.v

    def close(self):
        self.k = self.v = None


def make_cache(kind, max_len):
    if kind == "cat":
        return CatCache()
    from tidalloc.kv import KVCache
    return KVCache(max_len=max_len)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(kind, args, device, dtype):
    """Rows of one cache kind: one per window of steps."""
    b, h, d, layers = args.batch, args.heads, args.head_dim, args.layers
    g = torch.Generator(device=device).manual_seed(0)
    # The step's inputs, made once: the loop measures the cache and the
    # attention, not the making of random numbers.
    prompt = torch.randn(b, h, args.prompt, d, device=device, dtype=dtype, generator=g)
    if args.source == "projection":
        # As a model makes them: one projection's output [B, 1, 3 * H * D]
        # split into q, k, v and viewed as [B, H, 1, D] (GPT-2's c_attn).
        # With B > 1 these are not contiguous, so copying them takes a
        # kernel; with B = 1 they are, and copy_ takes a memcpy.
        qkv = torch.randn(b, 1, 3 * h * d, device=device, dtype=dtype, generator=g)
        q, k, v = (t.view(b, 1, h, d).transpose(1, 2) for t in qkv.split(h * d, dim=2))
    elif args.source == "strided":
        # Views that are never contiguous (every other D-sized chunk): a copy
        # kernel at any batch.
        wide = torch.randn(3, b, 1, h, 2 * d, device=device, dtype=dtype, generator=g)
        q, k, v = (t[..., :d].transpose(1, 2) for t in wide)
    else:
        k = torch.randn(b, h, 1, d, device=device, dtype=dtype, generator=g)
        v = torch.randn(b, h, 1, d, device=device, dtype=dtype, generator=g)
        q = torch.randn(b, h, 1, d, device=device, dtype=dtype, generator=g)
    caches = [make_cache(kind, args.prompt + args.tokens) for _ in range(layers)]
    for c in caches:
        c.append(prompt, prompt)
    rows = []
    with torch.no_grad(), sdpa_context(args.sdpa):
        done = 0
        while done < args.tokens:
            n = min(args.window, args.tokens - done)
            synchronize(device)
            start = time.perf_counter()
            host = 0.0
            for _ in range(n):
                t0 = time.perf_counter()
                for c in caches:
                    keys, values = c.append(k, v)
                    F.scaled_dot_product_attention(q, keys, values)
                host += time.perf_counter() - t0
            synchronize(device)
            wall = time.perf_counter() - start
            done += n
            rows.append(dict(cache=kind, batch=b, heads=h, head_dim=d, layers=layers,
                             tokens=args.prompt + done, host_us_per_step="%.1f" % (1e6 * host / n),
                             wall_us_per_step="%.1f" % (1e6 * wall / n), sdpa=args.sdpa,
                             source=args.source, device=device.type))
    for c in caches:
        c.close()
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--tokens", type=int, default=8192, help="decode steps (default 8192)")
    p.add_argument("--window", type=int, default=1024, help="steps per row (default 1024)")
    p.add_argument("--sdpa", choices=SDPA_KERNELS,
                   default="default")
    p.add_argument("--caches", default="cat,kvcache", help="kinds, in order (cat, kvcache)")
    p.add_argument("--source", choices=("projection", "contiguous", "strided"),
                   default="projection",
                   help="the step's keys and values: views of one projection's output, as a "
                        "model makes them (default), tensors of their own (copied by a "
                        "memcpy), or views never contiguous (copied by a kernel)")
    p.add_argument("--csv", help="append the rows to this CSV")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("kv_decode: no CUDA device; use --device cpu (with TIDALLOC_CONF=backend:host)")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for kind in args.caches.split(","):
        if kind not in ("cat", "kvcache"):
            sys.exit("kv_decode: unknown cache %r (cat, kvcache)" % kind)
        rows += run(kind, args, device, dtype)
    print("%-8s %7s %10s %10s" % ("cache", "tokens", "host us", "wall us"))
    for r in rows:
        print("%-8s %7s %10s %10s" % (r["cache"], r["tokens"], r["host_us_per_step"],
                                      r["wall_us_per_step"]))
    if args.csv:
        append_rows(args.csv, COLUMNS, rows)


if __name__ == "__main__":
    main()
