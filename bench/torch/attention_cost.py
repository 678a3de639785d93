"""attention_cost.py: what one scaled_dot_product_attention call costs over
a cache, by kernel and by the cache's layout, at a fixed key length and at a
new key length every call.

Two layouts of the same keys and values: contiguous [B, H, T, D] (what
torch.cat makes) and tidalloc.kv.KVCache's views ([T, B, H, D] storage seen
as [B, H, T, D], strides (H*D, D, B*H*D, 1); made here with a permute, which
gives the same strides without the package). Two ways to call: "same", every
call at one key length (whatever a kernel prepares per length is prepared
once), and "new", each call one key longer than the last, as a cache that
grows by a step every call meets them (cuDNN's attention builds an execution
plan for each new length; flash and memory-efficient attention prepare
nothing). The time of a call is the device's wall time over --calls calls
(a synchronized device to a synchronized device), so that work the host does
before a kernel can start counts.

Shapes: "stream", a frame of the streaming model attending to its full
window (query [1, 16, 1005, 64], 75,000 keys, bf16), and "decode", a decoding
step of GPT-2 at batch 8 (query [8, 12, 1, 64], 4,096 keys); --tiny shrinks
both for a CPU.

    python bench/torch/attention_cost.py --csv attention_cost.csv
    python bench/torch/attention_cost.py --device cpu --tiny --kernels math

Columns: shape, kernel, layout, lengths, calls, batch, heads, query_len,
key_len, head_dim, ms_per_call, status, error."""
import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

# sdpa.py and results_csv.py beside this file, also when this file is loaded by its path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_csv import append_rows  # noqa: E402
from sdpa import SDPA_KERNELS, sdpa_context  # noqa: E402

COLUMNS = ("shape", "kernel", "layout", "lengths", "calls", "batch", "heads", "query_len",
           "key_len", "head_dim", "ms_per_call", "status", "error")
# (batch, heads, query length, key length, head dim)
SHAPES = {"stream": (1, 16, 1005, 75000, 64), "decode": (8, 12, 1, 4096, 64)}
TINY_SHAPES = {"stream": (1, 2, 9, 64, 8), "decode": (2, 2, 1, 32, 8)}
LAYOUTS = ("contiguous", "kvcache")


def cache_tensor(layout, batch, heads, length, dim, dtype, device, generator):
    """Keys (or values) of `length` steps in `layout`, random."""
    if layout == "contiguous":
        return torch.randn(batch, heads, length, dim, dtype=dtype, device=device,
                           generator=generator)
    rows = torch.randn(length, batch, heads, dim, dtype=dtype, device=device, generator=generator)
    return rows.permute(1, 2, 0, 3)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(q, keys, values, kernel, device):
    """Seconds per call over the (keys, values) pairs, one call each, after
    one untimed call on a length none of them has."""
    with sdpa_context(kernel):
        synchronize(device)
        start = time.perf_counter()
        for k, v in zip(keys, values):
            F.scaled_dot_product_attention(q, k, v)
        synchronize(device)
    return (time.perf_counter() - start) / len(keys)


def measure(shape_name, dims, kernel, layout, lengths, calls, dtype, device):
    """One row: `calls` calls at one key length ("same") or at a new one
    each ("new")."""
    batch, heads, q_len, k_len, dim = dims
    row = dict(shape=shape_name, kernel=kernel, layout=layout, lengths=lengths, calls=calls,
               batch=batch, heads=heads, query_len=q_len, key_len=k_len, head_dim=dim,
               ms_per_call="", status="ok", error="")
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, heads, q_len, dim, dtype=dtype, device=device, generator=gen)
    try:
        if lengths == "same":
            k = cache_tensor(layout, batch, heads, k_len, dim, dtype, device, gen)
            v = cache_tensor(layout, batch, heads, k_len, dim, dtype, device, gen)
            time_calls(q, [k], [v], kernel, device)  # whatever this length needs, made once
            keys, values = [k] * calls, [v] * calls
        else:
            # The longest, sliced: every call a length not seen before (the
            # first call's length is used by no other).
            k = cache_tensor(layout, batch, heads, k_len + calls, dim, dtype, device, gen)
            v = cache_tensor(layout, batch, heads, k_len + calls, dim, dtype, device, gen)
            time_calls(q, [k[:, :, :k_len - 1]], [v[:, :, :k_len - 1]], kernel, device)
            if layout == "contiguous":
                # torch.cat's caches are contiguous at every length: a tensor each.
                keys = [k[:, :, :n].contiguous() for n in range(k_len, k_len + calls)]
                values = [v[:, :, :n].contiguous() for n in range(k_len, k_len + calls)]
            else:
                keys = [k[:, :, :n] for n in range(k_len, k_len + calls)]
                values = [v[:, :, :n] for n in range(k_len, k_len + calls)]
        row["ms_per_call"] = "%.4f" % (time_calls(q, keys, values, kernel, device) * 1e3)
    except RuntimeError as e:  # a kernel that refuses these inputs, or memory
        row.update(status="refused", error=str(e).splitlines()[0][:200])
    return row


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small shapes, for a CPU")
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    p.add_argument("--kernels", nargs="+", choices=SDPA_KERNELS,
                   default=["default", "flash", "efficient", "cudnn"])
    p.add_argument("--calls", type=int, default=20, help="timed calls per row (default 20)")
    p.add_argument("--csv", help="append the rows to this CSV")
    args = p.parse_args(argv)
    if args.calls < 1:
        p.error("--calls must be positive")
    return args


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("attention_cost: no CUDA device; use --device cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = TINY_SHAPES if args.tiny else SHAPES
    rows = []
    for name in args.shapes:
        for kernel in args.kernels:
            for lengths in ("same", "new"):
                for layout in LAYOUTS:
                    row = measure(name, shapes[name], kernel, layout, lengths, args.calls, dtype,
                                  device)
                    rows.append(row)
                    print("%-7s %-9s %-10s %-4s %10s ms  %s" % (
                        name, kernel, layout, lengths, row["ms_per_call"] or "-",
                        row["error"]), flush=True)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    if args.csv:
        append_rows(args.csv, COLUMNS, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
