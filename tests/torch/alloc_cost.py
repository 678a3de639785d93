"""alloc_cost.py: what the allocator itself costs a PyTorch program, measured
by replaying the program's allocations through torch in one process per
configuration.

Why: a GPT-2 generation run makes about 168,000 allocations and as many
frees in 2.5-4 s, and whole runs on a shared machine drift by 30% or more,
so a difference of 1% between allocators hides in the runs' noise
(paired_time.py). Here the program's own allocation sequence (a trace in
`tidalloc replay`'s format, e.g. bench/traces/gpt2_b1_512_run1.csv.gz) is
replayed through torch.empty and del on the GPU, the path every tensor of
the program takes, with nothing else in the loop. The difference between
two configurations' time per event, times the events of one program run, is
the allocator's share of the difference in the program's time.

Each worker process replays the trace once untimed, then REPS times timed;
its figure is the least of its timed replays (the one least disturbed by
the machine). Workers of the two configurations alternate, A B then B A,
for ROUNDS rounds. stdout: one CSV row per timed replay
(round,config,rep,seconds,events,ns_per_event); stderr: each configuration's
median over workers of ns per event, and the difference times the events of
one run, against --run-seconds when given.

    python tests/torch/alloc_cost.py TRACE.csv.gz [--configs expandable tidalloc]
        [--rounds 4] [--reps 3] [--run-seconds 3.4] > cost.csv

Configurations as in paired_time.py: native, expandable, tidalloc,
tidalloc-nodetect."""
import argparse
import gzip
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def load_trace(path):
    """The trace as a list of (slot, size) for allocations and (slot, -1) for
    frees, slots numbered densely so that the replay indexes a list."""
    ops, slots, free_slots = [], {}, []
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        header = f.readline().strip().split(",")
        col = {name: i for i, name in enumerate(header)}
        for line in f:
            field = line.rstrip("\n").split(",")
            action, addr = field[col["action"]], field[col["addr"]]
            if action == "alloc":
                slot = free_slots.pop() if free_slots else len(slots) + len(free_slots)
                if addr in slots:
                    raise ValueError("%s: allocation at live address %s" % (path, addr))
                slots[addr] = slot
                ops.append((slot, int(field[col["size"]])))
            elif action == "free":
                slot = slots.pop(addr)
                free_slots.append(slot)
                ops.append((slot, -1))
            else:
                raise ValueError("%s: unknown action %r" % (path, action))
    nslots = 1 + max((s for s, _ in ops), default=-1)
    return ops, nslots


def replay(torch, ops, nslots):
    """One pass of the trace through torch.empty and del; seconds."""
    live = [None] * nslots
    empty, u8, dev = torch.empty, torch.uint8, torch.device("cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for slot, size in ops:
        if size >= 0:
            live[slot] = empty(size, dtype=u8, device=dev)
        else:
            live[slot] = None
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def worker(config, trace, reps):
    if config.startswith("tidalloc"):
        sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
        import tidalloc.torch
        tidalloc.torch.install()
    import torch
    ops, nslots = load_trace(trace)
    replay(torch, ops, nslots)  # first pass: memory mapped, caches filled
    for _ in range(reps):
        print("%.6f %d" % (replay(torch, ops, nslots), len(ops)), flush=True)


def run_worker(config, trace, reps):
    from paired_time import config_env
    _, env = config_env(config)
    cmd = [sys.executable, os.path.abspath(__file__), trace, "--worker", config, "--reps",
           str(reps)]
    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, check=True, text=True).stdout
    return [(float(s), int(n)) for s, n in (line.split() for line in out.split("\n") if line)]


def summarize(rows, configs, events, run_seconds):
    """{config: median over workers of each worker's least ns per event}, and
    lines saying so."""
    best = {c: [] for c in configs}
    for (rnd, config), reps in rows.items():
        best[config].append(min(reps))
    med = {c: statistics.median(v) for c, v in best.items() if v}
    lines = ["%s: %.1f ns per event (median of %d workers; range %.1f-%.1f)"
             % (c, med[c], len(best[c]), min(best[c]), max(best[c])) for c in configs if c in med]
    if len(med) == 2:
        a, b = configs
        diff_s = (med[b] - med[a]) * events * 1e-9
        line = ("%s - %s: %+.1f ns per event, %+.1f ms over one run's %d events"
                % (b, a, med[b] - med[a], diff_s * 1e3, events))
        if run_seconds:
            line += ", %+.2f%% of a %.2f s run" % (100 * diff_s / run_seconds, run_seconds)
        lines.append(line)
    return med, lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--configs", nargs=2, default=["expandable", "tidalloc"])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--run-seconds", type=float,
                        help="a program run's seconds, to give the difference as a share of it")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.trace, args.reps)
        return 0
    print("round,config,rep,seconds,events,ns_per_event")
    rows, events = {}, 0
    for rnd in range(args.rounds):
        order = args.configs if rnd % 2 == 0 else args.configs[::-1]
        for config in order:
            reps = run_worker(config, args.trace, args.reps)
            rows[(rnd, config)] = [s / n * 1e9 for s, n in reps]
            events = reps[0][1]  # the workers count the trace's events as they replay it
            for i, (s, n) in enumerate(reps):
                print("%d,%s,%d,%.6f,%d,%.1f" % (rnd, config, i, s, n, s / n * 1e9), flush=True)
    _, lines = summarize(rows, args.configs, events, args.run_seconds)
    for line in lines:
        print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
