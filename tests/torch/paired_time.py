"""paired_time.py: the time of one validation program under two allocators
(or more), measured in pairs of runs next to each other in time.

Why: a GPT-2 generation loop is bound by the CPU, and on a shared machine
whole processes run 30-50% slower than others for tens of seconds at a time.
Comparing fresh processes one after the other (run_validation.sh) then
measures the machine, not the allocator. Here two processes, one per
configuration, start together, each does its first run (untimed), and then
they take turns: pair i times one run of each, in the order A B for even i
and B A for odd i, so that a drift within a pair favours neither. The ratio
of each pair (B over A) is taken, and the summary gives their median, their
geometric mean with a 95% bootstrap interval, and the same split by order
(which shows whether the second run of a pair is slower).

More than two configurations (--configs A B C ...) run as rounds: one worker
per configuration, one run of each per round, the order rotated by one each
round (A B C, B C A, C A B), and every other configuration's time divided by
A's in the same round. One reference run then serves several comparisons
(tidalloc and the growable caches both against expandable segments), which
saves a third of the time of two separate pairings. --pairs counts rounds.

    taskset -c 4-7 python tests/torch/paired_time.py gpt2 --pairs 40 \\
        [--configs expandable tidalloc] [--budget-s 480] [--fresh-every 8] > pairs.csv
    python tests/torch/paired_time.py stream_gct --frames 512 --pairs 20 > pairs.csv
    python tests/torch/paired_time.py stream_gct --frames 512 --pairs 4 \\
        --configs expandable tidalloc tidalloc@stream_gct_growable > rounds.csv

Programs: validate.py's (gpt2, vit, stream_gct: bench/torch/stream_gct.py's
model, built once per worker, --frames frames with fresh caches each run;
stream_gct_growable: its caches in tidalloc.kv.KVCaches, K in bf16 as attention
reads it (stream_gct_growable_fp32k: in fp32 as it comes); stream_gct_compile: its
hot modules under torch.compile(mode="reduce-overhead"), and
stream_gct_growable_compile with KVCaches too; stream_gct_flash and
stream_gct_growable_flash: the bf16 attention held to the flash kernel; compile_kv: the
growing-KV decoder compiled so, --frames decoding steps per run; lingbot:
LingBot-Map's own benchmark loop, from the checkout LINGBOT_MAP names, through
bench/torch/lingbot_stream.py; lingbot_kvcache: the same with its caches in
tidalloc.kv.KVCache, bench/torch/lingbot_kvcache.py).

Configurations as in run_validation.sh: native, expandable
(expandable_segments:True), tidalloc (tidalloc.torch.install(), capture
detection on; PyTorch's own allocator through the shim, and a worker whose
shim does not build fails rather than time the other path),
tidalloc-pluggable (the same through CUDAPluggableAllocator),
tidalloc-nodetect; and tidalloc:KEY:VALUE,... (tidalloc with those options
added to TIDALLOC_CONF), so that two settings of tidalloc can be paired
(--configs tidalloc:load_handles:False tidalloc), and tidalloc/DIR (tidalloc
with the library built in DIR, from the repository root;
tidalloc/DIR:KEY:VALUE,... adds options), so that two versions of the library
can be paired. A configuration may name
its own program after an @, so that two programs can be paired:
--configs expandable tidalloc@stream_gct_growable times the torch.cat
caches under expandable segments against the growable ones under tidalloc
(their outputs are then not compared: the caches keep their rows in
another order, so sums round differently). Naming the same program again
(--configs native native@stream_gct_compile tidalloc) runs one allocator in
two workers, whose outputs are compared: whether a program's outputs differ
between processes at all.

--warmup-frames N makes each worker's untimed first run a stream of N
frames instead of --frames (eager stream_gct programs): at 1024 frames a
full first run per worker takes minutes of the pairing's time.

--segment-frames N (stream_gct programs) makes the runs of a round take
turns every N frames: each worker begins its run, then streams N frames
while the others wait, the order rotated by one each segment, and a run's
time is that of its segments together (each timed from an idle device to
an idle device). A 1024-frame run takes two minutes, and on one machine
single rounds of whole runs spread by 5-6%, more than the allocators
differ; within a round taken in segments the machine's drift falls on
every configuration alike. Each segment's time is written as a comment
line, "# segment ROUND,INDEX,CONFIG,SECONDS", and --summarize gives the
ratio segment by segment (where in the run a difference lies) and the ratio of
the summed segment times with an interval over the segments resampled, which a
single round can give, and beside it the median of the segments' ratios
(a segment stalled by the machine moves the sum, not the median).

For the compiled programs (compile_kv, stream_gct[_growable]_compile) the first
configuration's worker starts alone and the others once it is ready: inductor
times some kernels' configurations the first time they run and caches the
choice on disk, so workers compiling side by side could each choose
differently and differ for that alone; started after it, they reuse its
choices.

--cache cold (the default for the stream_gct programs and compile_kv) empties each
worker's cache before each timed run, untimed: a streaming program runs once
per process, and a run that reuses the memory the previous run left mapped
makes a tenth of the mappings (tidalloc at 128 frames: 3,306 instead of
26,434), which would flatter an allocator whose cost is in mapping. stdout: one CSV row per run
(program,pair,position,config,seconds,digest,maps,unmaps); stderr: each
configuration's peak allocated and reserved memory over its runs, and the
summary. `paired_time.py --summarize FILE [A B]` summarizes saved rows, runs
appended in one file (each begun by a "# run" line) pooled and one by one.

The pairs of one pair of processes share what sets those processes apart
(on the H200 host, GPT-2 runs of 2.4-5.2 s, and three runs of 29-64 pairs
whose intervals did not overlap), so an interval from resampling pairs
alone is too narrow. --fresh-every N starts a new pair of workers every N
pairs, each set begun by a "# run" line; over several sets (or saved runs)
the summary adds an interval that resamples the sets and then the pairs
within them. Exits non-zero if a worker fails or the outputs differ."""
import argparse
import csv
import math
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from validate import PROGRAMS, SHORT_WARMUP_PROGRAMS, STREAMING_PROGRAMS  # noqa: E402


def add_conf(env, options):
    """Append tidalloc options ("KEY:VALUE,...") to env's TIDALLOC_CONF."""
    conf = env.get("TIDALLOC_CONF", "")
    env["TIDALLOC_CONF"] = (conf + "," if conf else "") + options


def config_env(config):
    """(allocator argument for validate.py, environment) of a configuration."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(HERE, "..", "..", "python") + (
        ":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTORCH_CUDA_ALLOC_CONF"] = ""
    if config == "native":
        return "native", env
    if config == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        return "native", env
    if config == "tidalloc-pluggable":
        env["TIDALLOC_TORCH_BRIDGE"] = "pluggable"
        return "tidalloc", env
    # Every other tidalloc configuration measures the shim: where it does not
    # build, the worker fails instead of timing the pluggable path unnoticed.
    env.setdefault("TIDALLOC_TORCH_BRIDGE", "shim")
    if config in ("tidalloc", "tidalloc-nodetect"):
        if config == "tidalloc-nodetect":
            add_conf(env, "capture_detection:False")
        return "tidalloc", env
    if config.startswith("tidalloc/") and len(config) > len("tidalloc/"):
        # Another build of the library (a folder holding libtidalloc.so, from
        # the repository root), with options after a colon: two versions of
        # it paired on one machine, each at the setting it is to be judged by.
        folder, colon, options = config[len("tidalloc/"):].partition(":")
        if not folder or (colon and not options):
            raise ValueError("unknown configuration %r" % config)
        env["TIDALLOC_LIB"] = os.path.join(HERE, "..", "..", folder, "libtidalloc.so")
        if options:
            add_conf(env, options)
        return "tidalloc", env
    if config.startswith("tidalloc:") and len(config) > len("tidalloc:"):
        add_conf(env, config[len("tidalloc:"):])
        return "tidalloc", env
    raise ValueError("unknown configuration %r" % config)


def split_config(config, program):
    """(configuration, program) of a configuration that may name its own
    program after an @ ("tidalloc@stream_gct_growable")."""
    name, _, own = config.partition("@")
    if own and own not in PROGRAMS:
        raise ValueError("unknown program %r in configuration %r" % (own, config))
    return name, own or program


class Worker:
    """One validate.py --serve process: run() times one run in it."""

    def __init__(self, program, config, python=sys.executable, program_args=()):
        config_name, program = split_config(config, program)
        allocator, env = config_env(config_name)
        self.config = config
        self.proc = subprocess.Popen(
            [python, os.path.join(HERE, "validate.py"), program, allocator, "--serve",
             "--label", config] + list(program_args),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, bufsize=1)

    def wait_ready(self):
        # A program may print while it is built (LingBot-Map's imports do):
        # those lines are passed on to stderr until the worker says "ready".
        line = self.proc.stdout.readline()
        while line and line.strip() != "ready":
            sys.stderr.write("%s: %s" % (self.config, line))
            line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError("%s: worker did not start (%r)" % (self.config, line))

    def _ask(self, command):
        """Sends one command; the words of the worker's answer."""
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().split()

    def run(self):
        line = self._ask("run")
        if len(line) != 4:
            raise RuntimeError("%s: worker failed during a run" % self.config)
        return float(line[0]), line[1], int(line[2]), int(line[3])

    def begin(self):
        """Starts a run in segments (the worker serves --segment-frames), untimed."""
        if self._ask("begin") != ["begun"]:
            raise RuntimeError("%s: worker could not begin a run" % self.config)

    def segment(self):
        """The next segment of the run begun: (seconds, None), or after its
        last one (seconds, the run's result as run() gives it, its seconds
        those of every segment together)."""
        words = self._ask("segment")
        if len(words) == 2 and words[0] == "segment":
            return float(words[1]), None
        if len(words) == 6 and words[0] == "end":
            return float(words[1]), (float(words[2]), words[3], int(words[4]), int(words[5]))
        raise RuntimeError("%s: worker failed during a segment" % self.config)

    def close(self):
        """Ends the worker; returns (exit status, its "peaks" line's words or None)."""
        peaks = None
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                words = self.proc.stdout.readline().split()
                if len(words) == 3 and words[0] == "peaks":
                    peaks = float(words[1]), float(words[2])
            except OSError:
                pass
        return self.proc.wait(), peaks


def rotated(items, k):
    k %= len(items)
    return items[k:] + items[:k]


def run_in_segments(order, on_segment=None):
    """One round whose runs take turns segment by segment: every worker's
    run begun (untimed), then its segments, the workers' order rotated by
    one each segment, so that a drift of the machine longer than a few
    segments reaches every configuration alike. {configuration: result},
    each run's seconds those of its segments together; on_segment(config,
    index, seconds) hears of each segment."""
    for worker in order:
        worker.begin()
    results, j = {}, 0
    while len(results) < len(order):
        for worker in rotated(order, j):
            seconds, result = worker.segment()
            if on_segment:
                on_segment(worker.config, j, seconds)
            if result is not None:
                results[worker.config] = result
        if results and len(results) < len(order):
            raise RuntimeError("the runs ended after different numbers of segments (%s first)"
                               % ", ".join(sorted(results)))
        j += 1
    return results


def run_rounds(workers, rounds, budget_s=None, clock=time.monotonic, emit=None,
               segmented=False, on_segment=None):
    """Rounds of runs, one run of each worker per round, the order rotated by
    one each round (two workers: A B, then B A; three: A B C, B C A, C A B),
    so that every configuration takes every place equally often and a drift
    within a round favours none. segmented: the runs of a round take turns
    segment by segment (run_in_segments). Stops when `rounds` are done or
    `budget_s` has passed (no round is begun after it); on_segment(round,
    config, index, seconds) hears of each segment. Returns a list of
    (round, order of the configurations, {configuration: result})."""
    start = clock()
    done = []
    for i in range(rounds):
        if budget_s is not None and clock() - start > budget_s:
            break
        order = rotated(workers, i)
        hear = on_segment and (lambda config, j, seconds, i=i: on_segment(i, config, j, seconds))
        results = run_in_segments(order, hear) if segmented else {}
        for position, worker in enumerate(order):
            if not segmented:
                results[worker.config] = worker.run()
            if emit:  # each run's row as soon as it is known, in case the pairing is cut
                emit(i, position, worker.config, results[worker.config])
        done.append((i, [w.config for w in order], results))
    return done


def pairs_of(rounds, name_a, name_b):
    """The pairs (round, first of the two, seconds_a, seconds_b, digest_a,
    digest_b) of two configurations over `rounds` as run_rounds gives them."""
    out = []
    for i, order, results in rounds:
        first = name_a if order.index(name_a) < order.index(name_b) else name_b
        ra, rb = results[name_a], results[name_b]
        out.append((i, first, ra[0], rb[0], ra[1], rb[1]))
    return out


def run_pairs(a, b, pairs, budget_s=None, clock=time.monotonic, emit=None):
    """Pairs of runs, A B then B A alternately, until `pairs` are done or
    `budget_s` has passed (no pair is begun after it). Returns a list of
    (pair, first_config, seconds_a, seconds_b, digest_a, digest_b)."""
    return pairs_of(run_rounds([a, b], pairs, budget_s, clock, emit), a.config, b.config)


def geometric_mean(values):
    return math.exp(statistics.fmean(math.log(v) for v in values))


def bootstrap_interval(values, resamples=4000, seed=0, statistic=geometric_mean):
    """95% percentile interval of statistic(values) (their geometric mean),
    `values` resampled with replacement."""
    rng = random.Random(seed)
    n = len(values)
    means = sorted(statistic([values[rng.randrange(n)] for _ in range(n)])
                   for _ in range(resamples))
    return means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def cluster_interval(groups, resamples=4000, seed=0):
    """95% percentile interval of the geometric mean of the ratios in
    `groups` (lists of ratios, one per pair of worker processes), resampling
    the groups and then the ratios within each: the pairs of one pair of
    processes share whatever sets those processes apart, which resampling
    pairs alone takes for agreement."""
    rng = random.Random(seed)
    k = len(groups)
    means = []
    for _ in range(resamples):
        sample = []
        for _ in range(k):
            g = groups[rng.randrange(k)]
            sample.extend(g[rng.randrange(len(g))] for _ in range(len(g)))
        means.append(geometric_mean(sample))
    means.sort()
    return means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def summarize(pairs, name_a, name_b):
    """Lines that say how B's time compares with A's over the pairs."""
    ratios = [p[3] / p[2] for p in pairs]
    if not ratios:
        return ["no pair completed"]
    lo, hi = bootstrap_interval(ratios) if len(ratios) > 1 else (ratios[0], ratios[0])
    lines = [
        "%d pairs: %s median %.4f s, %s median %.4f s" % (
            len(pairs), name_a, statistics.median(p[2] for p in pairs), name_b,
            statistics.median(p[3] for p in pairs)),
        "%s / %s per pair: median %.4f, geometric mean %.4f (95%% bootstrap interval %.4f-%.4f)"
        % (name_b, name_a, statistics.median(ratios), geometric_mean(ratios), lo, hi),
    ]
    for first in (name_a, name_b):
        sub = [p[3] / p[2] for p in pairs if p[1] == first]
        if sub:
            lines.append("  pairs with %s first: %d, geometric mean %.4f"
                         % (first, len(sub), geometric_mean(sub)))
    return lines


def read_pairs(lines, name_a, name_b):
    """Pairs from this script's CSV rows, several runs appended in one file
    (each begun by a "# run" line): {program: [(run, pair), ...]} as
    run_pairs() gives them, pair numbers kept apart per run."""
    run, rows = 0, {}
    for line in lines:
        line = line.strip()
        if line.startswith("# run"):
            run += 1
            continue
        if not line or line.startswith("#") or line.startswith("program,"):
            continue
        # A configuration may hold commas (tidalloc:KEY:VALUE,KEY:VALUE): quoted.
        program, pair, position, config, seconds, digest = next(csv.reader([line]))[:6]
        rows.setdefault((program, run, int(pair)), {})[config] = (int(position), float(seconds),
                                                                  digest)
    out = {}
    for (program, run, pair), by in sorted(rows.items()):
        if name_a not in by or name_b not in by:
            continue  # a pair cut short
        first = name_a if by[name_a][0] < by[name_b][0] else name_b
        out.setdefault(program, []).append(((run, pair), first, by[name_a][1], by[name_b][1],
                                            by[name_a][2], by[name_b][2]))
    return out


def read_segments(lines, name_a, name_b):
    """From "# segment ROUND,INDEX,CONFIG,SECONDS" lines (runs in segments),
    {index: [(A's seconds, B's seconds) in each round that has both]}, the
    rounds of several runs in one file kept apart."""
    run, seconds = 0, {}
    for line in lines:
        if line.startswith("# run"):
            run += 1
        elif line.startswith("# segment "):
            i, index, config, t = next(csv.reader([line[len("# segment "):].strip()]))
            seconds[(run, int(i), int(index), config)] = float(t)
    times = {}
    for (run, i, index, config), t in sorted(seconds.items()):
        other = seconds.get((run, i, index, name_a))
        if config == name_b and other:
            times.setdefault(index, []).append((other, t))
    return times


def ratio_of_sums(pairs):
    """B's summed seconds over A's, from (A's seconds, B's seconds) pairs."""
    return sum(b for _, b in pairs) / sum(a for a, _ in pairs)


def segment_sum_interval(pairs):
    """B's summed segment time over A's, and its 95% percentile interval
    with the segments resampled, each with its pair: an interval from a
    single round, on the assumption that segments vary independently."""
    return (ratio_of_sums(pairs),) + bootstrap_interval(pairs, statistic=ratio_of_sums)


def segment_median_interval(pairs):
    """The median of the segments' ratios (B over A), and its 95% percentile
    interval with the segments resampled. A machine that stalls one process
    for seconds at a time makes one segment 1.5 x its usual time: the summed
    times take that segment's stall whole, the median does not, so where the
    two disagree a stall, not the allocator, set the sum."""
    ratios = [b / a for a, b in pairs]
    return (statistics.median(ratios),) + bootstrap_interval(ratios, statistic=statistics.median)


def summarize_file(path, name_a, name_b):
    """Each program's pairs over all the runs in `path`, and run by run;
    for runs in segments, the ratio segment by segment (where in a run the
    difference lies) and over all segments, with an interval."""
    with open(path) as f:
        lines = f.readlines()
    programs = read_pairs(lines, name_a, name_b)
    by_segment = read_segments(lines, name_a, name_b)
    if by_segment:
        print("%s / %s by segment (geometric mean over rounds): %s" % (
            name_b, name_a, ", ".join("%d: %.3f" % (index, geometric_mean([b / a for a, b in t]))
                                      for index, t in sorted(by_segment.items()))))
        every = [pair for t in by_segment.values() for pair in t]
        ratio, lo, hi = segment_sum_interval(every)
        print("%s / %s, summed segment times: %.4f (95%% interval over %d segments, resampled: "
              "%.4f-%.4f)" % (name_b, name_a, ratio, len(every), lo, hi))
        ratio, lo, hi = segment_median_interval(every)
        print("%s / %s, median segment ratio: %.4f (95%% interval, resampled: %.4f-%.4f)"
              % (name_b, name_a, ratio, lo, hi))
    for program, pairs in programs.items():
        print("%s, all runs:" % program)
        for line in summarize(pairs, name_a, name_b):
            print("  " + line)
        runs = sorted({p[0][0] for p in pairs})
        if len(runs) > 1:
            groups = [[p[3] / p[2] for p in pairs if p[0][0] == run] for run in runs]
            lo, hi = cluster_interval(groups)
            print("  resampling the runs as well as their pairs: 95%% interval %.4f-%.4f over %d "
                  "runs (each run a pair of processes)" % (lo, hi, len(runs)))
        for run in runs:
            sub_pairs = [p for p in pairs if p[0][0] == run]
            print("%s, run %d: %s" % (program, run, summarize(sub_pairs, name_a, name_b)[1]))
    return 0


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--summarize":
        # paired_time.py --summarize FILE [A B]: the summary of saved rows.
        if len(sys.argv) not in (3, 5):
            sys.exit("usage: paired_time.py --summarize FILE [A B]")
        names = sys.argv[3:5] if len(sys.argv) == 5 else ["expandable", "tidalloc"]
        return summarize_file(sys.argv[2], *names)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("program", choices=PROGRAMS)
    parser.add_argument("--frames", type=int, default=128,
                        help="frames per run of the stream_gct programs (default 128)")
    parser.add_argument("--configs", nargs="+", default=["expandable", "tidalloc"],
                        metavar="CONFIG",
                        help="two or more configurations; the first is the reference that the "
                        "others' times are divided by (default: expandable tidalloc)")
    parser.add_argument("--cache", choices=("cold", "warm"),
                        help="cold: each worker empties its cache before each timed run, as a "
                        "program's one run in a fresh process finds it (the default for the "
                        "stream_gct programs); warm: runs reuse what earlier runs left cached "
                        "(the default for gpt2 and vit)")
    parser.add_argument("--pairs", type=int, default=40,
                        help="pairs (rounds, with more than two configurations; default 40)")
    parser.add_argument("--budget-s", type=float, help="begin no pair after this many seconds")
    parser.add_argument("--warmup-frames", type=int, metavar="N",
                        help="the eager stream_gct programs: each worker's untimed first run "
                        "streams N frames, not --frames (at 1024 frames a full one is minutes)")
    parser.add_argument("--segment-frames", type=int, metavar="N",
                        help="the stream_gct programs: the runs of a round take turns every N "
                        "frames instead of run after run, so that the machine's drift over "
                        "a long run reaches every configuration alike")
    parser.add_argument("--fresh-every", type=int, default=0, metavar="N",
                        help="a new pair of worker processes every N pairs, each set begun by a "
                        "'# run' line, so that the summary can resample the processes too")
    parser.add_argument("--limit-gib", type=float, metavar="G",
                        help="cap every worker at G GiB (torch.cuda."
                        "set_per_process_memory_fraction): the pairs at a user's budget")
    args = parser.parse_args()
    if args.fresh_every < 0 or args.pairs < 1:
        sys.exit("paired_time.py: --pairs must be at least 1 and --fresh-every at least 0")
    if len(args.configs) < 2 or len(set(args.configs)) != len(args.configs):
        sys.exit("paired_time.py: --configs needs two or more different configurations")
    if args.warmup_frames is not None and (args.warmup_frames < 1 or any(
            split_config(c, args.program)[1] not in SHORT_WARMUP_PROGRAMS
            for c in args.configs)):
        sys.exit("paired_time.py: --warmup-frames takes a positive count, and only eager "
                 "stream_gct programs (a compiled program's first runs record its graphs)")

    if args.segment_frames is not None and (args.segment_frames < 1 or any(
            split_config(c, args.program)[1] not in STREAMING_PROGRAMS
            for c in args.configs)):
        sys.exit("paired_time.py: --segment-frames takes a positive count, and only the "
                 "streaming programs (%s)" % ", ".join(STREAMING_PROGRAMS))

    print("program,pair,position,config,seconds,digest,maps,unmaps", flush=True)

    # A configuration may hold commas (tidalloc:KEY:VALUE,KEY:VALUE): the csv
    # module quotes it, as read_pairs reads it back.
    rows = csv.writer(sys.stdout, lineterminator="\n")

    def emit(i, position, config, r):
        seconds, digest, maps, unmaps = r
        rows.writerow([args.program, i, position, config, "%.6f" % seconds, digest, maps, unmaps])
        sys.stdout.flush()

    def emit_segment(i, config, index, seconds):
        # A comment line to the readers of the rows: "# segment ROUND,INDEX,CONFIG,SECONDS".
        sys.stdout.write("# segment ")
        rows.writerow([i, index, config, "%.6f" % seconds])
        sys.stdout.flush()

    start, sets, status, total = time.monotonic(), [], 0, 0
    while total < args.pairs:
        left = None if args.budget_s is None else args.budget_s - (time.monotonic() - start)
        if left is not None and left < 0 and sets:
            break
        want = args.pairs - total
        if args.fresh_every:
            want = min(want, args.fresh_every)
            print("# run: workers %d" % (len(sets) + 1), flush=True)
        rc, done = run_set(args, want, left, emit, emit_segment)
        status |= rc
        sets.append(done)
        total += len(done)
        if rc or len(done) < want:
            break
    rounds = [r for s in sets for r in s]
    reference = args.configs[0]
    for other in args.configs[1:]:
        pairs = pairs_of(rounds, reference, other)
        same_program = split_config(reference, args.program)[1] == \
            split_config(other, args.program)[1]
        if same_program and any(p[4] != p[5] for p in pairs):
            print("paired_time: %s and %s gave different outputs" % (reference, other),
                  file=sys.stderr)
            status = 1
        for line in summarize(pairs, reference, other):
            print(line, file=sys.stderr)
        groups = [[p[3] / p[2] for p in pairs_of(s, reference, other)] for s in sets if s]
        if len(groups) > 1:
            lo, hi = cluster_interval(groups)
            print("resampling the worker pairs as well: 95%% interval %.4f-%.4f over %d sets of "
                  "processes" % (lo, hi, len(groups)), file=sys.stderr)
    return 1 if status else 0


# Programs under torch.compile: inductor tunes some kernels by timing them the
# first time they run, so two processes that compile at once may choose
# differently and differ in time for that alone.
COMPILED_PROGRAMS = ("compile_kv", "stream_gct_compile", "stream_gct_growable_compile")


def run_set(args, rounds, budget_s, emit, on_segment=None):
    """One set of worker processes, one per configuration, for up to `rounds`
    rounds; (status, rounds as run_rounds gives them)."""
    programs = [split_config(c, args.program)[1] for c in args.configs]
    streaming = any(p in STREAMING_PROGRAMS or p == "compile_kv" for p in programs)
    extra = ["--frames", str(args.frames)] if streaming else []
    if args.warmup_frames:
        extra += ["--warmup-frames", str(args.warmup_frames)]
    if args.segment_frames:
        extra += ["--segment-frames", str(args.segment_frames)]
    if args.limit_gib:
        extra += ["--limit-gib", repr(args.limit_gib)]
    if (args.cache or ("cold" if streaming else "warm")) == "cold":
        extra.append("--cold")
    compiled = any(p in COMPILED_PROGRAMS for p in programs)
    workers = []
    status, done = 0, []
    try:
        if compiled:
            # The first worker compiles alone; the others then find its kernels
            # and their tuned configurations in inductor's on-disk caches, so
            # that every worker runs the same kernels and no difference in
            # autotuning passes for one between allocators.
            workers.append(Worker(args.program, args.configs[0], program_args=extra))
            workers[0].wait_ready()
        workers += [Worker(args.program, c, program_args=extra)
                    for c in args.configs[len(workers):]]
        for w in workers[1 if compiled else 0:]:
            w.wait_ready()
        done = run_rounds(workers, rounds, budget_s, emit=emit,
                          segmented=bool(args.segment_frames), on_segment=on_segment)
    except RuntimeError as e:
        print("paired_time: %s" % e, file=sys.stderr)
        status = 1
    finally:
        reserved = []
        for w in workers:
            rc, peaks = w.close()
            status |= rc != 0
            if peaks:
                reserved.append(peaks[1])
                print("%s: peak allocated %.1f MiB, reserved %.1f MiB (%.4f x allocated)"
                      % (w.config, peaks[0], peaks[1], peaks[1] / peaks[0]), file=sys.stderr)
        warning = crowding_warning(reserved, device_total_mib())
        if warning:
            print(warning, file=sys.stderr)
    return status, done


def device_total_mib():
    """The first GPU's memory in MiB from nvidia-smi (no CUDA context in this
    process), or None."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,"
                              "nounits", "--id=0"], capture_output=True, text=True, timeout=30)
        return float(out.stdout.split()[0]) if out.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


# What a worker holds on the device besides its allocator's memory: the CUDA
# context with PyTorch's kernels loaded, about half a GiB.
CONTEXT_MIB = 512


def crowding_warning(reserved_mib, total_mib):
    """A warning where the workers' reserved peaks and contexts together come
    within the free-memory low-water mark (a 64th of the device) of the
    device's memory: the workers hold their memory all at once, so
    tidalloc's workers may have run under the device's pressure, recycling
    pages an uncapped run keeps."""
    if not reserved_mib or not total_mib:
        return None
    held = sum(reserved_mib) + CONTEXT_MIB * len(reserved_mib)
    if held < total_mib - total_mib / 64:
        return None
    return ("paired_time: the workers' reserved peaks and contexts come to %.0f of the "
            "device's %.0f MiB: "
            "tidalloc's workers may have met the device's low-water mark and recycled pages; "
            "fewer configurations at once keep an uncapped pairing uncapped" % (held, total_mib))


if __name__ == "__main__":
    sys.exit(main())
