"""kv_cache_gpu.py: tidalloc.kv.KVCache on a GPU.

1. Which scaled_dot_product_attention kernels (flash, memory-efficient,
   cuDNN, math) take the cache's [B, H, T, D] views as they are: for each,
   one decode step (1 query) and one prefill-like step (T queries, causal)
   over a growing and a sliding-window cache, bf16: accepted or refused,
   the largest difference from the same kernel over contiguous copies, and
   the memory the call allocated beyond its output, over the views and over
   the contiguous copies (a kernel that copied the views would allocate about
   the cache's size more than over the copies: the math kernel's scores and a
   flash prefill's row statistics are the kernel's own, alike for both); and which kernel PyTorch chooses by
   itself over the views and over contiguous copies, and whether their
   outputs are equal.
2. A CUDA graph captured once over static_view(bucket) and a mask from a
   length tensor, replayed after each eager append for every length of the
   bucket, against eager attention over the exact cache.

Prints one line per check and "kv_cache_gpu: N checks, M failed"; --csv
writes the kernel table. Exits 1 if a check failed, 77 without a GPU.

    PYTHONPATH=python python tests/torch/kv_cache_gpu.py [--csv kernels.csv]"""
import argparse
import csv
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

failures = []
checks = [0]


def check(ok, what):
    checks[0] += 1
    print("%s: %s" % ("ok" if ok else "FAIL", what), flush=True)
    if not ok:
        failures.append(what)


def filled_cache(window, b, h, d, steps, dtype):
    from tidalloc.kv import KVCache
    cache = KVCache(max_len=4096) if window is None else KVCache(window=window)
    g = torch.Generator(device="cuda").manual_seed(0)
    cache.append(torch.randn(b, h, 64, d, device="cuda", dtype=dtype, generator=g),
                 torch.randn(b, h, 64, d, device="cuda", dtype=dtype, generator=g))
    for _ in range(steps):
        k = torch.randn(b, h, 1, d, device="cuda", dtype=dtype, generator=g)
        cache.append(k, k * 0.5)
    return cache


def attend_measured(q, k, v, causal):
    """The attention's output and the bytes the call allocated beyond it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size()


def kernels(rows):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backends = [("flash", SDPBackend.FLASH_ATTENTION),
                ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                ("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)]
    dtype = torch.bfloat16
    # Heads of 128, and GPT-2's decode at batch 8 (12 heads of 64): PyTorch's
    # choice of kernel depends on the shapes as well as the strides.
    for kind, window, (b, h, d) in (("growing", None, (2, 8, 128)), ("window", 512, (2, 8, 128)),
                                    ("growing b8 h12 d64", None, (8, 12, 64))):
        cache = filled_cache(window, b, h, d, 700, dtype)
        keys, values = cache.keys, cache.values
        ck, cv = keys.contiguous(), values.contiguous()
        cache_bytes = keys.numel() * keys.element_size()
        for step, q_len, causal in (("decode", 1, False), ("prefill", keys.shape[2], True)):
            q = torch.randn(b, h, q_len, d, device="cuda", dtype=dtype)
            outputs = {}  # kernel: (output over the views, over contiguous copies)
            for name, backend in backends:
                row = dict(cache=kind, step=step, kernel=name, strides=str(keys.stride()),
                           tokens=keys.shape[2])
                try:
                    with sdpa_kernel([backend]):
                        ref, own = attend_measured(q, ck, cv, causal)
                        out, extra = attend_measured(q, keys, values, causal)
                    outputs[name] = (out, ref)
                    diff = (out.float() - ref.float()).abs().max().item()
                    row.update(accepted="yes", max_diff="%.3g" % diff, extra_bytes=extra,
                               contiguous_extra_bytes=own, cache_bytes=cache_bytes)
                    check(diff == 0.0 or name == "math" and diff < 1e-2,
                          "%s %s %s: views accepted, output %s the contiguous one's"
                          % (kind, step, name, "equals" if diff == 0 else "differs by %g from"
                             % diff))
                    check(extra - own < cache_bytes // 2,
                          "%s %s %s: allocated %d bytes beyond its output, %d over contiguous "
                          "copies (cache: %d)" % (kind, step, name, extra, own, cache_bytes))
                except RuntimeError as e:
                    # A kernel that refuses the views refuses contiguous ones too?
                    msg = " ".join(str(e).split())[:160]
                    try:
                        with sdpa_kernel([backend]):
                            F.scaled_dot_product_attention(q, ck, cv, is_causal=causal)
                        contiguous_ok = True
                    except RuntimeError:
                        contiguous_ok = False
                    row.update(accepted="no (contiguous: %s)" % ("yes" if contiguous_ok else "no"),
                               error=msg)
                    check(not contiguous_ok, "%s %s %s: refused the views%s (%s)" % (
                        kind, step, name, " but took contiguous copies" if contiguous_ok
                        else ", as it refuses contiguous ones", msg))
                rows.append(row)
            rows.append(default_dispatch(kind, step, q, (keys, values), (ck, cv), causal, outputs))
        cache.close()


def default_dispatch(kind, step, q, views, contiguous, causal, outputs):
    """The kernel scaled_dot_product_attention chooses by itself over the
    views and over contiguous copies, each named by the forced kernel whose
    output it equals bit for bit: where they differ (PyTorch's choice can
    depend on strides), a model's outputs over the cache may differ from
    DynamicCache's in the last bits, which greedy decoding with random
    weights turns into other tokens."""
    out = F.scaled_dot_product_attention(q, *views, is_causal=causal)
    ref = F.scaled_dot_product_attention(q, *contiguous, is_causal=causal)

    def chosen(result, which):
        names = [n for n, pair in outputs.items() if torch.equal(pair[which], result)]
        return "/".join(names) or "none of the forced kernels"

    on_views, on_contiguous = chosen(out, 0), chosen(ref, 1)
    diff = (out.float() - ref.float()).abs().max().item()
    check(diff == 0.0, "%s %s default dispatch: views run %s, contiguous copies %s; outputs %s"
          % (kind, step, on_views, on_contiguous,
             "equal" if diff == 0 else "differ by up to %g" % diff))
    return dict(cache=kind, step=step, kernel="default (views: %s; contiguous: %s)"
                % (on_views, on_contiguous), strides=str(views[0].stride()),
                tokens=views[0].shape[2], accepted="yes", max_diff="%.3g" % diff)


def graph_replay():
    from tidalloc.kv import KVCache
    b, h, d, dtype, bucket = 2, 8, 64, torch.bfloat16, 256
    cache = KVCache(max_len=4096)
    g = torch.Generator(device="cuda").manual_seed(1)
    cache.append(torch.randn(b, h, 10, d, device="cuda", dtype=dtype, generator=g),
                 torch.randn(b, h, 10, d, device="cuda", dtype=dtype, generator=g))
    keys, values = cache.static_view(bucket)
    ptr = keys.data_ptr()
    length = torch.tensor(len(cache), device="cuda")
    positions = torch.arange(bucket, device="cuda")
    q = torch.zeros(b, h, 1, d, device="cuda", dtype=dtype)

    def step():
        mask = (positions < length).view(1, 1, 1, bucket)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    worst, replays = 0.0, 0
    while len(cache) < bucket:
        k = torch.randn(b, h, 1, d, device="cuda", dtype=dtype, generator=g)
        exact_k, exact_v = cache.append(k, k * 0.5)
        length.fill_(len(cache))
        q.copy_(torch.randn(b, h, 1, d, device="cuda", dtype=dtype, generator=g))
        graph.replay()
        ref = F.scaled_dot_product_attention(q, exact_k, exact_v)
        worst = max(worst, (out.float() - ref.float()).abs().max().item())
        replays += 1
    check(worst < 2e-2, "one CUDA graph, %d replays over lengths 11 to %d: largest difference "
          "from eager attention %g" % (replays, bucket, worst))
    check(cache.keys.data_ptr() == ptr, "the cache kept its address through the appends")
    cache.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--csv", help="the kernel table")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("kv_cache_gpu: SKIP: no CUDA device")
        return 77
    rows = []
    kernels(rows)
    graph_replay()
    if args.csv:
        cols = ("cache", "step", "kernel", "tokens", "strides", "accepted", "max_diff",
                "extra_bytes", "contiguous_extra_bytes", "cache_bytes", "error")
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            w.writerows({c: r.get(c, "") for c in cols} for r in rows)
    print("kv_cache_gpu: %d checks, %d failed" % (checks[0], len(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
