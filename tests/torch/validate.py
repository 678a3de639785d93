"""validate.py: one validation program under one allocator, for
run_validation.sh: a first run (the warm-up) and then REPEATS timed runs of
the same workload in the same process, every run's output checked identical
to the first. Prints one CSV row:

program,allocator,output_sha256,peak_allocated_mib,peak_reserved_mib,reserved_over_allocated,
seconds,repeats,median_seconds,min_seconds,max_seconds,peak_reserved_all_mib

  output_sha256, peak_*, reserved_over_allocated, seconds: the first run in
      the fresh process, as measured before repeats existed (seconds include
      first-use costs: kernels loaded, memory mapped for the first time);
  repeats, median/min/max_seconds: the timed runs after it;
  peak_reserved_all_mib: peak reserved over the whole process (all runs).

  gpt2: transformers GPT-2 (124M, random weights from its config, seed 0),
        greedy generation of 512 new tokens from a fixed 32-token prompt;
        the output is the generated token ids.
  vit:  timm vit_base_patch16_224 (random weights, seed 0), inference over
        batch sizes 1, 8, 32, 64, 17, 3 (inputs drawn once, before timing;
        the copy to the GPU is timed); the output is every logit.
  stream_gct: bench/torch/stream_gct.py's model (random weights, seed 0,
        built once), --frames frames (default 128) streamed with fresh
        caches each run, grown by torch.cat; stream_gct_growable: the same
        with the caches in the package's tidalloc.kv.KVCache, K stored in
        bf16 as the attention reads it (stream_gct_growable_fp32k: in fp32
        as it comes, as the torch.cat caches keep it); stream_gct_compile:
        the hot modules under torch.compile(mode="reduce-overhead") (the
        first run, untimed, compiles and records the CUDA graphs), and
        stream_gct_growable_compile the same with the caches in KVCaches
        (the cache work stays eager in both); stream_gct_flash and
        stream_gct_growable_flash: stream_gct and stream_gct_growable with
        the bf16 attention held to the flash kernel (stream_gct.py --sdpa
        flash). The output is every frame's pose and the last frame's depth
        and confidence.
  compile_kv: tests/torch/native_shim.py's growing-KV decoder (16 layers,
        width 1024, batch 8) under torch.compile(mode="reduce-overhead"),
        --frames decoding steps per run, its K and V caches grown by
        torch.cat every step from empty; the first two runs, untimed, warm up
        and record a graph per length; the output is each step's first 8 features.
  lingbot: LingBot-Map's own benchmark loop (bench/torch/lingbot_stream.py,
        the checkout LINGBOT_MAP names); lingbot_kvcache: the same with its
        attention caches in tidalloc.kv.KVCache (bench/torch/lingbot_kvcache.py).
        The output is every frame's pose.

The allocator: native (PyTorch's default; PYTORCH_CUDA_ALLOC_CONF is the
caller's, e.g. expandable_segments:True), or tidalloc (installed before CUDA
starts; TIDALLOC_CONF is the caller's). Peaks are
torch.cuda.max_memory_allocated/reserved, which under tidalloc report
tidalloc's figures. Exits 1 if a repeat's output differs from the first run's.

On stderr: every run's seconds and, under tidalloc, the device maps and
unmaps of each run. --trace-csv FILE (tidalloc) writes every allocation and
free of the process as a trace for `tidalloc replay`.

--serve (for paired_time.py) runs the first run, prints "ready", and then
times one run for each "run" line read from stdin, answering each with a
line "SECONDS DIGEST MAPS UNMAPS" (-1 where the allocator does not count
mappings), until "quit" or the end of its input; then a line "peaks
ALLOCATED_MIB RESERVED_MIB" (the largest peaks of any of its runs; each
run's own go to stderr, marked with --label). --cold empties the cache
before each timed run; --warmup-frames N makes the eager streaming
programs' first run a stream of N frames. --segment-frames N (the
streaming programs) also takes "begin", answered "begun", and then
"segment" until the run ends: each streams the next N frames, answered
"segment SECONDS", and the last "end SECONDS" and the run's line.

    python tests/torch/validate.py gpt2|vit|stream_gct[_growable][_compile|_flash]|compile_kv
                                   |lingbot[_kvcache]
                                   native|tidalloc
                                   [--repeats N] [--frames N] [--trace-csv FILE.csv.gz]
                                   [--serve [--cold] [--label NAME] [--warmup-frames N]
                                    [--segment-frames N]]"""
import argparse
import functools
import hashlib
import os
import statistics
import sys
import time


def gpt2(torch, dev):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).to(dev).eval()
    prompt = torch.randint(0, 50257, (1, 32), generator=torch.Generator().manual_seed(1)).to(dev)

    def run(digest):
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=512, min_new_tokens=512, do_sample=False,
                                 pad_token_id=0, attention_mask=torch.ones_like(prompt))
        digest.update(out.cpu().numpy().tobytes())  # 544 token ids: a negligible copy
    return run


def vit(torch, dev):
    import timm
    torch.manual_seed(0)
    model = timm.create_model("vit_base_patch16_224", pretrained=False).to(dev).eval()

    # The same inputs every run, made once on the CPU (the values a generator
    # seeded afresh gives): drawing 10M normal numbers took a fifth of each
    # run and its CPU time varied from process to process, which hid the
    # allocator's part. The copy to the GPU stays in the timed part.
    gen = torch.Generator().manual_seed(2)
    inputs = [torch.randn(batch, 3, 224, 224, generator=gen) for batch in (1, 8, 32, 64, 17, 3)]

    def run(digest):
        with torch.no_grad():
            for cpu_input in inputs:
                x = cpu_input.to(dev)
                # Logits are copied out inside the timed part, as before repeats existed.
                digest.update(model(x).float().cpu().numpy().tobytes())
    return run


def bench_torch_module(name):
    """bench/torch/NAME.py, loaded by its path."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "torch",
                        name + ".py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stream_gct(torch, dev, frames, growable=False, compiled=False, kv_dtype="attention",
               sdpa="default"):
    return bench_torch_module("stream_gct").paired_runner(dev, frames, growable=growable,
                                                          compiled=compiled, kv_dtype=kv_dtype,
                                                          sdpa=sdpa)


def compile_kv(torch, dev, steps, layers=16, width=1024, batch=8):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from native_shim import compiled_decoder, decode
    dec, fn, embed = compiled_decoder(torch, layers, width)
    gen = torch.Generator(device=dev)

    def run(digest):
        gen.manual_seed(6)
        outs, _ = decode(torch, fn, embed, dec, steps, batch, width, gen, True)
        digest.update(torch.stack(outs).float().cpu().numpy().tobytes())
    return run


EAGER_STREAM_PROGRAMS = ("stream_gct", "stream_gct_growable", "stream_gct_growable_fp32k",
                         "stream_gct_flash", "stream_gct_growable_flash")
PROGRAMS = (("gpt2", "vit") + EAGER_STREAM_PROGRAMS
            + ("stream_gct_compile", "stream_gct_growable_compile", "compile_kv", "lingbot",
               "lingbot_kvcache"))
# The programs whose first run may be a shorter stream (--warmup-frames): a
# compiled program's first runs record the graphs its timed runs replay.
SHORT_WARMUP_PROGRAMS = EAGER_STREAM_PROGRAMS + ("lingbot", "lingbot_kvcache")
# The programs that stream frames, and can be timed in segments (--segment-frames).
STREAMING_PROGRAMS = EAGER_STREAM_PROGRAMS + ("stream_gct_compile", "stream_gct_growable_compile",
                                              "lingbot", "lingbot_kvcache")


def make_program(name, torch, dev, frames):
    """The run(digest) function of a validation program."""
    if name.startswith("stream_gct"):
        return stream_gct(torch, dev, frames, growable="growable" in name,
                          compiled=name.endswith("_compile"),
                          kv_dtype="appended" if name.endswith("_fp32k") else "attention",
                          sdpa="flash" if name.endswith("_flash") else "default")
    if name == "compile_kv":
        return compile_kv(torch, dev, frames)
    if name in ("lingbot", "lingbot_kvcache"):
        return bench_torch_module("lingbot_stream").paired_runner(
            dev, frames, kvcache=name == "lingbot_kvcache")
    return {"gpt2": gpt2, "vit": vit}[name](torch, dev)


def device_mappings(torch):
    """Physical handles mapped and unmapped so far (tidalloc's memory_stats
    keys), or None where the allocator does not count them."""
    stats = torch.cuda.memory_stats()
    if "num_device_map" in stats:  # the pluggable bridge's figures
        return stats["num_device_map"], stats["num_device_unmap"]
    st = tidalloc_stats(torch)  # the shim: PyTorch's keys only
    return (st.mappings, st.unmappings) if st else None


def tidalloc_stats(torch):
    """tidalloc's own statistics of the current device where tidalloc is
    installed, or None under any other allocator."""
    installed = sys.modules.get("tidalloc.torch")
    if installed is None or not installed.bridge():
        return None
    import tidalloc
    return tidalloc.stats(torch.cuda.current_device())


# tidalloc's counters a run's line reports beside its mapping time, so that
# two builds or settings that differ in time can be told apart by what the
# library did (allocations that retried, waits for all streams, segments).
RUN_COUNTERS = ("num_allocs", "num_alloc_retries", "num_sync_all_streams", "segments_created",
                "segments_released", "num_device_alloc", "num_device_free", "unmappings")


def counter_deltas(before, after):
    """`name=delta` for each of RUN_COUNTERS between two tidalloc stats."""
    return " ".join("%s=%d" % (name, getattr(after, name) - getattr(before, name))
                    for name in RUN_COUNTERS)


def idle_to_idle(torch, work):
    """(seconds, work()'s result), timed from an idle device to an idle device."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = work()
    torch.cuda.synchronize()
    return time.perf_counter() - start, result


def timed_run(torch, run):
    """One run, from an idle device to an idle device: (seconds, digest)."""
    digest = hashlib.sha256()
    seconds, _ = idle_to_idle(torch, lambda: run(digest))
    return seconds, digest.hexdigest()[:16]


def empty_caches(torch):
    """Untimed: every cached block back to the device, so that the next run
    maps its memory as a program's only run in a fresh process would."""
    import gc
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()


def run_peaks(torch):
    """(peak allocated, peak reserved) in MiB since the last reset."""
    return torch.cuda.max_memory_allocated() / 2**20, torch.cuda.max_memory_reserved() / 2**20


def buffers_beside(torch):
    """tidalloc's peak reserved MiB since the last reset where the package
    holds growable buffers beside another allocator (tidalloc.kv under
    expandable segments: PyTorch's peaks leave them out), else None."""
    # Only a program that made KV caches (tidalloc.kv) holds them: asking
    # otherwise would open tidalloc on the device for nothing.
    if ("tidalloc.kv" not in sys.modules or not hasattr(torch.cuda, "current_device") or
            tidalloc_stats(torch) is not None):
        return None
    import tidalloc
    return tidalloc.stats(torch.cuda.current_device()).reserved_bytes[0].peak / 2**20


def reset_peaks(torch):
    torch.cuda.reset_peak_memory_stats()
    if buffers_beside(torch) is not None:
        import tidalloc
        tidalloc.reset_peak(torch.cuda.current_device())


def report_peaks(label, what, peaks, torch=None):
    beside = buffers_beside(torch) if torch is not None else None
    print("validate.py %s: %s: peak allocated %.1f MiB, reserved %.1f MiB (%.4f x)%s"
          % (label, what, peaks[0], peaks[1], peaks[1] / max(peaks[0], 1e-9),
             "" if beside is None else "; growable buffers in tidalloc beside it: peak reserved "
             "%.1f MiB" % beside), file=sys.stderr, flush=True)


class _TimedRuns:
    """What serve() keeps between commands: the mapping counters, the peaks
    over every run, the reference output, and a run begun in segments."""

    def __init__(self, torch, label, cold, first, overall):
        self.torch, self.label, self.cold = torch, label, cold
        self.first, self.overall, self.runs = first, overall, 0
        self.before = device_mappings(torch) or (0, 0)
        self.costs = None
        self.pieces = None  # a run begun in segments: (generator, digest, seconds so far)

    def begin(self):
        """Untimed: the cache emptied (cold), the peaks reset, the counters read."""
        if self.cold:
            empty_caches(self.torch)
            self.before = device_mappings(self.torch) or self.before
        reset_peaks(self.torch)
        self.costs = tidalloc_stats(self.torch)

    def end(self, seconds, digest):
        """The run's reports; its answer line, or None if its outputs differ from the first's."""
        torch, label = self.torch, self.label
        peaks = run_peaks(torch)
        self.overall = (max(self.overall[0], peaks[0]), max(self.overall[1], peaks[1]))
        report_peaks(label, "run %d" % self.runs, peaks, torch)
        if self.costs is not None:
            now = tidalloc_stats(torch)
            print("validate.py %s: run %d: %.1f ms in mapping calls, %d stream waits, %d device "
                  "queries in %.1f ms; %s"
                  % (label, self.runs, (now.mapping_ns - self.costs.mapping_ns) / 1e6,
                     now.stream_waits - self.costs.stream_waits,
                     now.device_queries - self.costs.device_queries,
                     (now.device_query_ns - self.costs.device_query_ns) / 1e6,
                     counter_deltas(self.costs, now)),
                  file=sys.stderr, flush=True)
        self.runs += 1
        after = device_mappings(torch)
        maps, unmaps = (after[0] - self.before[0], after[1] - self.before[1]) if after else (-1, -1)
        self.before = after or self.before
        self.first = self.first or digest
        if digest != self.first:
            print("validate.py: a run gave other outputs than the first (%s vs %s)"
                  % (digest, self.first), file=sys.stderr)
            return None
        return "%.6f %s %d %d" % (seconds, digest, maps, unmaps)

    def begin_segments(self, run, every):
        """Untimed, as begin(): a run of `run.segments`, `every` frames a segment."""
        self.begin()
        digest = hashlib.sha256()
        self.pieces = (run.segments(digest, every), digest, 0.0)

    def segment(self):
        """The next segment of the run begun, timed from an idle device to an
        idle device: "segment SECONDS", or after the last one "end SECONDS"
        and the run's answer line; None if the outputs differ."""
        generator, digest, total = self.pieces
        seconds, ended = idle_to_idle(self.torch, lambda: next(generator, None) is None)
        if not ended:
            self.pieces = (generator, digest, total + seconds)
            return "segment %.6f" % seconds
        self.pieces = None
        line = self.end(total + seconds, digest.hexdigest()[:16])
        return None if line is None else "end %.6f %s" % (seconds, line)


def serve(torch, run, warmups=1, cold=False, label="worker", by_pool=False, warm_run=None,
          segment_frames=None):
    """The first run (`warmups` of them), then one timed run per "run"
    command on stdin. The process sits idle between commands, so two of
    them (one per allocator) can take turns on one machine, each run next
    to the other's in time. cold: the cache is emptied before each timed
    run (untimed), so that runs do not reuse the memory earlier runs left
    mapped. The peaks are reset before each timed run and reported on stderr
    run by run (the first runs together), so that a peak shows which run set
    it; "peaks" at the end gives the largest of them. by_pool: at the end,
    where the reserved memory sits, pool by pool. warm_run: what the first
    runs run instead of `run` (a shorter stream: --warmup-frames).
    segment_frames (a run with run.segments, the streaming programs): "begin"
    starts a timed run, answered "begun", and each "segment" then streams
    the next segment_frames frames of it, answered as _TimedRuns.segment
    says, so that processes can take turns within a run."""
    for _ in range(warmups):
        _, first = timed_run(torch, warm_run or run)
    if warm_run is not None:
        first = None  # a shorter stream has other outputs: the first timed run is the reference
    overall = run_peaks(torch)
    report_peaks(label, "first run%s" % ("s" if warmups > 1 else ""), overall, torch)
    runs = _TimedRuns(torch, label, cold, first, overall)
    print("ready", flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        if command == "run":
            runs.begin()
            answer = runs.end(*timed_run(torch, run))
        elif command == "begin" and segment_frames and runs.pieces is None:
            runs.begin_segments(run, segment_frames)
            answer = "begun"
        elif command == "segment" and runs.pieces is not None:
            answer = runs.segment()
        else:
            print("validate.py: unknown command %r here" % command, file=sys.stderr)
            return 2
        if answer is None:
            return 1
        print(answer, flush=True)
    if by_pool:
        # Where the reserved memory sits: the usual memory and each graph
        # pool, with (under tidalloc) each pool's allocated peak, so that a
        # run's reserved peak can be set against what the graphs need.
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                        "python"))
        from tidalloc.viz import pool_breakdown
        print("validate.py %s: by pool: %s" % (label, pool_breakdown(torch)), file=sys.stderr,
              flush=True)
    print("peaks %.1f %.1f" % runs.overall, flush=True)
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("program", choices=PROGRAMS)
    parser.add_argument("allocator", choices=("native", "tidalloc"))
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after the first "
                        "(default 3)")
    parser.add_argument("--frames", type=int, default=128,
                        help="frames per run of the stream_gct programs, decoding steps of "
                        "compile_kv (default 128)")
    parser.add_argument("--trace-csv", metavar="FILE.csv.gz",
                        help="under tidalloc, write every allocation and free of the whole run "
                        "as a trace that `tidalloc replay` reads (turns the trace ring on)")
    parser.add_argument("--cold", action="store_true", help="with --serve: empty the cache "
                        "before each timed run (untimed)")
    parser.add_argument("--serve", action="store_true", help="after the first run, time one run "
                        "per 'run' line on stdin (for paired_time.py)")
    parser.add_argument("--label", help="with --serve: the name its reports on stderr carry "
                        "(paired_time.py passes the configuration)")
    parser.add_argument("--warmup-frames", type=int, metavar="N",
                        help="with --serve, for the eager stream_gct programs: the first run "
                        "streams N frames, not --frames (a 1024-frame warm-up is minutes)")
    parser.add_argument("--segment-frames", type=int, metavar="N",
                        help="with --serve, for the stream_gct programs: take 'begin' and "
                        "'segment' commands, a timed run streamed N frames at a time")
    parser.add_argument("--limit-gib", type=float, metavar="G",
                        help="cap the process at G GiB with "
                        "torch.cuda.set_per_process_memory_fraction (tidalloc takes it through "
                        "its shim), as a user short of memory does")
    args = parser.parse_args()
    if args.repeats < 1:
        sys.exit("validate.py: --repeats must be at least 1")
    if args.warmup_frames is not None and (
            args.warmup_frames < 1 or args.program not in SHORT_WARMUP_PROGRAMS):
        sys.exit("validate.py: --warmup-frames takes a positive count, for %s (a compiled "
                 "program's first runs record its graphs)" % ", ".join(SHORT_WARMUP_PROGRAMS))
    if args.segment_frames is not None and (
            args.segment_frames < 1 or args.program not in STREAMING_PROGRAMS):
        sys.exit("validate.py: --segment-frames takes a positive count, for the streaming "
                 "programs (%s)" % ", ".join(STREAMING_PROGRAMS))
    if args.allocator == "tidalloc":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                        "python"))
        import tidalloc.torch
        tidalloc.torch.install("trace:4000000" if args.trace_csv else None)
    import torch
    if not torch.cuda.is_available():
        sys.exit("validate.py: no CUDA device (torch.cuda.is_available() is False)")
    if args.limit_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.limit_gib * (1 << 30) / total))
    if args.program in ("gpt2", "vit"):
        # GPT-2 and ViT as their recorded results ran; the streaming model
        # keeps PyTorch's defaults, as bench/torch/stream_gct.py runs it (with
        # cuDNN's TF32 off, its first run peaked at 43.8 GiB allocated against
        # 17 GiB in the program itself).
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    run = make_program(args.program, torch, dev, args.frames)

    if args.serve:
        # Compiled: the second run still records CUDA graphs the first only warmed up.
        compiled = "compile" in args.program
        warm_run = None
        if args.warmup_frames:
            warm_run = functools.partial(run, frames=args.warmup_frames)
        sys.exit(serve(torch, run, warmups=2 if compiled else 1, cold=args.cold,
                       label=args.label or args.allocator, by_pool=compiled, warm_run=warm_run,
                       segment_frames=args.segment_frames))
    digests, seconds, mappings = [], [], []
    for i in range(1 + args.repeats):
        t, d = timed_run(torch, run)
        seconds.append(t)
        digests.append(d)
        mappings.append(device_mappings(torch))
        if i == 0:  # the first run's peaks: the figures these columns always had
            alloc = torch.cuda.max_memory_allocated()
            res = torch.cuda.max_memory_reserved()
    differ = [i for i, d in enumerate(digests) if d != digests[0]]
    if differ:
        print("validate.py: %s under %s: runs %s give other outputs than the first (%s vs %s)"
              % (args.program, args.allocator, differ, [digests[i] for i in differ], digests[0]),
              file=sys.stderr)
    timed = seconds[1:]
    # Mapping work per run, on stderr (the CSV's columns stay as they are):
    # what recycling costs a program whose memory rises and falls each run.
    if mappings[0] is not None:
        runs = " ".join("%d/%d" % (m - pm, u - pu) for (m, u), (pm, pu)
                        in zip(mappings, [(0, 0)] + mappings[:-1]))
        print("%s under %s: device maps/unmaps per run: %s" % (args.program, args.allocator, runs),
              file=sys.stderr)
    print("%s under %s: seconds per run: %s" % (args.program, args.allocator,
                                                 " ".join("%.4f" % t for t in seconds)),
          file=sys.stderr)
    print("%s,%s,%s,%.1f,%.1f,%.4f,%.3f,%d,%.3f,%.3f,%.3f,%.1f"
          % (args.program, args.allocator, digests[0], alloc / 2**20, res / 2**20, res / alloc,
             seconds[0], len(timed), statistics.median(timed), min(timed), max(timed),
             torch.cuda.max_memory_reserved() / 2**20))
    if args.trace_csv and args.allocator == "tidalloc":
        write_trace(args.trace_csv)
    sys.exit(1 if differ else 0)


def write_trace(path):
    """The whole run's allocations and frees, for `tidalloc replay`."""
    from tidalloc import viz
    viz.write_replay_trace(path)


if __name__ == "__main__":
    main()
