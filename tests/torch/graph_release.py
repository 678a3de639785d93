"""graph_release.py: a CUDA graph's private memory is not given back while
work may still use it: a replay of the graph, or work on its output, queued
on a stream other than the capture's.

PyTorch captures on a side stream and replays on the current one; a graph's
output is used wherever the program uses it. When the graph goes (its pool's
last release) or its output is freed and the cache emptied, the pool's pages
must stay mapped until that work is done, as PyTorch's allocator keeps them
(it frees a pool's memory only at empty_cache, with cudaFree, which waits
for the device). Each case queues a long kernel (torch.cuda._sleep) ahead of
the work that touches the pool, then lets the memory go at once:
  replay_then_delete   the graph (capture on a side stream, its intermediate
                       freed during the capture) replayed on the default
                       stream and deleted while the replay still runs
  output_then_empty    a graph's output read on the default stream, freed,
                       and the cache emptied while that read still runs
  replay_then_empty    as the first, then torch.cuda.empty_cache() at once
An unmapped page hit by a kernel is CUDA's illegal address error (sticky:
the process cannot go on), so the first failure ends the run. Prints one
line per case; exit status 1 if one failed, 77 without a CUDA device.

    python tests/torch/graph_release.py              (under tidalloc)
    python tests/torch/graph_release.py --native     (PyTorch's allocator)"""
import argparse
import gc
import os
import sys

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--native", action="store_true",
                    help="run under PyTorch's own allocator, for comparison")
parser.add_argument("--conf", help="tidalloc options for install(), key:value,...")
parser.add_argument("--cycles", type=int, default=400_000_000,
                    help="length of the queued sleep in GPU cycles (default 4e8, ~0.2 s)")
args = parser.parse_args()

if not args.native:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "python"))
    import tidalloc.torch
    tidalloc.torch.install(args.conf, bridge=os.environ.get("TIDALLOC_TORCH_BRIDGE", "shim"))

import torch  # noqa: E402

if not torch.cuda.is_available():
    print("graph_release: SKIP: no CUDA device (torch.cuda.is_available() is False)")
    sys.exit(77)

N = 16 << 20  # 64 MiB of floats: whole pages of their own in the pool


def capture(x, out):
    """A graph that sleeps, then writes an intermediate it frees during the
    capture (pool memory no tensor holds) and copies it into `out`."""
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g.capture_begin()
        torch.cuda._sleep(args.cycles)
        t = x * 2
        out.copy_(t)
        del t
        g.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    return g


def replay_then_delete(empty):
    x = torch.randn(N, device="cuda")
    out = torch.zeros(N, device="cuda")
    g = capture(x, out)
    torch.cuda.synchronize()
    out.zero_()
    g.replay()  # on the default stream, not the capture's
    del g  # the pool's last release while the replay sleeps
    if empty:
        gc.collect()
        torch.cuda.empty_cache()
    torch.cuda.synchronize()
    return torch.equal(out, x * 2)


def output_then_empty():
    x = torch.randn(N, device="cuda")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g.capture_begin()
        y = x * 3  # the graph's output, in its pool
        g.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    del g  # the pool is released; y outlives it
    expect = (x * 3).sum().item()  # before the sleep: .item() waits for the stream
    total = torch.zeros(1, device="cuda")
    torch.cuda._sleep(args.cycles)
    torch.sum(y, dim=0, keepdim=True, out=total)  # reads y after the sleep
    del y  # freed while the read is queued
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    return abs(total.item() - expect) <= 1e-3 * max(1.0, abs(expect))


CASES = [("replay_then_delete", lambda: replay_then_delete(False)),
         ("output_then_empty", output_then_empty),
         ("replay_then_empty", lambda: replay_then_delete(True))]

failed = 0
for name, fn in CASES:
    try:
        ok = fn()
        print("%s: %s" % ("PASS" if ok else "FAIL", name), flush=True)
        failed += not ok
    except Exception as e:  # an illegal address is sticky: nothing more can run
        print("FAIL: %s: %s: %s" % (name, type(e).__name__, str(e).splitlines()[0]), flush=True)
        sys.exit(1)
sys.exit(1 if failed else 0)
