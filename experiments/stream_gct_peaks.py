"""stream_gct_peaks.py: where bench/torch/stream_gct.py's memory peaks fall
when one process streams several times with no empty_cache between runs
(as paired_time.py's workers do): per run, the peak allocated and reserved
and the step that set the allocated peak, with torch.cat caches and with
growable ones. Under tidalloc (python -m tidalloc run), also its mappings.

    python -m tidalloc run experiments/stream_gct_peaks.py [--frames 128] [--runs 3]"""
import argparse
import importlib.util
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("stream_gct",
                                              os.path.join(HERE, "..", "bench", "torch",
                                                           "stream_gct.py"))
sg = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sg)
GiB = float(1 << 30)


def tidalloc_mappings():
    if "tidalloc" not in sys.modules:
        return None
    import tidalloc
    st = tidalloc.stats(torch.cuda.current_device())
    return st.mappings, st.unmappings


def breakdown():
    """Where reserved memory is, from the allocator's snapshot: bytes of
    the segments' blocks by state, and what reserved holds outside them
    (growable buffers, and under tidalloc pages waiting to be unmapped)."""
    by_state = {}
    in_segments = 0
    for seg in torch.cuda.memory_snapshot():
        for block in seg["blocks"]:
            state = block["state"]
            if state == "unmapped":
                continue
            by_state[state] = by_state.get(state, 0) + block["size"]
            in_segments += block["size"]
    outside = torch.cuda.memory_reserved() - in_segments
    parts = ["%s %.3f" % (k, v / GiB) for k, v in sorted(by_state.items())]
    return "GiB in segments: %s; outside segments %.3f; allocated %.3f" % (
        ", ".join(parts), outside / GiB, torch.cuda.memory_allocated() / GiB)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--frames", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--kinds", nargs="+", default=["cat", "growable"])
    args = p.parse_args()
    dev = torch.device("cuda")
    shape = sg.make_shape()
    model = sg.build_model(shape, dev)
    for kind in args.kinds:
        growable = kind == "growable"
        for run in range(args.runs):
            torch.cuda.reset_peak_memory_stats()
            worst = [0.0, -1]
            step = [0]

            top = [0.0, -1, ""]

            def on_step(batch):
                torch.cuda.synchronize()
                a = torch.cuda.max_memory_allocated() / GiB
                if a > worst[0]:
                    worst[:] = [a, step[0]]
                r = torch.cuda.memory_reserved() / GiB
                if r > top[0] + 0.05:  # a new reserved peak: where its bytes are
                    top[:] = [r, step[0], breakdown()]
                step[0] += 1

            before = tidalloc_mappings()
            state = sg.StreamState(shape, dev, args.frames, growable)
            gen = torch.Generator(device=dev).manual_seed(1)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            sg.stream(model, state, args.frames, dev, gen, False, on_step)
            torch.cuda.synchronize()
            secs = time.perf_counter() - t0
            poses = torch.cat([o[2] for o in state.outputs])
            del poses
            state.close()
            del state
            after = tidalloc_mappings()
            maps = "" if after is None else " maps %d unmaps %d" % (after[0] - before[0],
                                                                    after[1] - before[1])
            print("%-8s run %d: %.2f s, peak allocated %.3f GiB (step %d), peak reserved %.3f "
                  "GiB (%.4f x), after: allocated %.3f reserved %.3f%s" % (
                      kind, run, secs, worst[0], worst[1],
                      torch.cuda.max_memory_reserved() / GiB,
                      torch.cuda.max_memory_reserved() / torch.cuda.max_memory_allocated(),
                      torch.cuda.memory_allocated() / GiB, torch.cuda.memory_reserved() / GiB,
                      maps), flush=True)
            print("    reserved peak %.3f GiB at step %d: %s" % tuple(top), flush=True)


if __name__ == "__main__":
    main()
