"""run_counts.py: what tidalloc does in each run of a validation program, on a
GPU, in one process under tidalloc's shim: every run's seconds, device
mappings and unmappings, milliseconds in mapping calls and stream waits, and
how often PyTorch called the shim's graph-pool methods (cudagraph trees
recording a graph, taking and restoring checkpoints), so that a run whose
mappings grow can be told apart from one that records graphs again.

    python experiments/run_counts.py stream_gct_compile --frames 128 --runs 4 [--cold]
        [--trace-csv FILE.csv.gz]

--cold empties the cache before each run after the first two (as
tests/torch/paired_time.py does). --trace-csv writes the whole process's
allocations and frees for `tidalloc replay`."""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "torch"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("program")
    parser.add_argument("--frames", type=int, default=128)
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--cold", action="store_true")
    parser.add_argument("--trace-csv")
    args = parser.parse_args()
    import tidalloc.torch
    tidalloc.torch.install("trace:4000000" if args.trace_csv else None)
    import torch
    from tidalloc import shim
    import validate
    run = validate.make_program(args.program, torch, torch.device("cuda"), args.frames)
    for i in range(args.runs):
        if args.cold and i >= 2:
            validate.empty_caches(torch)
        before_stats = validate.tidalloc_stats(torch)
        before_counts = shim.counts()
        torch.cuda.reset_peak_memory_stats()
        seconds, digest = validate.timed_run(torch, run)
        st = validate.tidalloc_stats(torch)
        calls = {k: v - before_counts.get(k, 0) for k, v in shim.counts().items()}
        print("run %d: %.3f s, digest %s, %d maps, %d unmaps, %.1f ms mapping, %d waits, "
              "peak allocated %.1f MiB, reserved %.1f MiB; shim calls %s" % (
                  i, seconds, digest, st.mappings - before_stats.mappings,
                  st.unmappings - before_stats.unmappings,
                  (st.mapping_ns - before_stats.mapping_ns) / 1e6,
                  st.stream_waits - before_stats.stream_waits,
                  torch.cuda.max_memory_allocated() / 2**20,
                  torch.cuda.max_memory_reserved() / 2**20,
                  {k: v for k, v in calls.items() if v}), flush=True)
    if args.trace_csv:
        validate.write_trace(args.trace_csv)


if __name__ == "__main__":
    main()
