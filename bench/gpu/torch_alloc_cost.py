"""torch_alloc_cost.py: what one tensor's allocation and free cost a PyTorch
program under an allocator: `torch.empty(n, device="cuda")` then dropping
it, in a loop, at a few sizes (the cached path: every size is freed before
the next request). Prints one CSV row per size, nanoseconds per pair (the
median of several batches); the difference between allocators is their
part, the rest is PyTorch's own (Python binding, dispatcher, tensor).

    python bench/gpu/torch_alloc_cost.py native|expandable|tidalloc [--pairs N]

`expandable` is the native allocator with expandable_segments:True;
`tidalloc` installs tidalloc through tidalloc.torch.install() (so through
PyTorch's CUDAPluggableAllocator)."""
import argparse
import os
import statistics
import sys
import time

SIZES = (512, 4096, 1 << 20, 8 << 20, 64 << 20)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("allocator", choices=("native", "expandable", "tidalloc"))
    parser.add_argument("--pairs", type=int, default=20000, help="pairs per batch")
    parser.add_argument("--batches", type=int, default=9)
    args = parser.parse_args()
    if args.allocator == "expandable":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if args.allocator == "tidalloc":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                        "python"))
        import tidalloc.torch
        tidalloc.torch.install()
    import torch
    dev = torch.device("cuda")
    torch.empty(1, device=dev)  # the context and the first segment, outside the timing
    for size in SIZES:
        empty, u8 = torch.empty, torch.uint8
        for _ in range(1000):  # warm: the block is cached
            empty(size, dtype=u8, device=dev)
        batches = []
        for _ in range(args.batches):
            start = time.perf_counter_ns()
            for _ in range(args.pairs):
                empty(size, dtype=u8, device=dev)
            batches.append((time.perf_counter_ns() - start) / args.pairs)
        print("torch_empty,%d,1,%s,%.1f" % (size, args.allocator, statistics.median(batches)))


if __name__ == "__main__":
    main()
