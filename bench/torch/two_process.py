"""two_process.py: two streaming processes on one GPU whose peaks together
fit in the memory a ballast process leaves, under each allocator.

A ballast process takes all of the device's free memory but MARGIN times
the two programs' peaks allocated together (measured first, one process at
a time, under expandable segments) plus a CUDA context for each; then both
programs start at once under the allocator, and each one's completion, wall
time and peaks are recorded. Under expandable segments a process keeps the
pages it freed, so the first to grow can starve the second; tidalloc gives
pages back when the device runs low.

--margins runs the pair at several margins, tightest first, each allocator
in turn; --rounds N runs each margin's allocators N times, their order
reversed every other round, so that two allocators' pairs can be compared
round by round (the machine drifts between rounds). --stagger S starts the
second process S seconds after the first, so that it grows while the first
holds what it has freed (a second stream joining a running one) rather than
beside it. --summarize CSV prints, per margin, each allocator's completions
and, for every round where both allocators' pairs completed, the ratio of
their makespans (the later process's wall time).

CSV columns: allocator,process,status,wall_s,peak_allocated_gib,
peak_reserved_gib,room_gib,error,margin,stagger_s,round,unmappings,
stream_waits,mappings,device_queries,alloc_retries,others_wait_ms (the last
six tidalloc's, as frontier.py counts them: others_wait_ms is the time its
failed allocations waited for the other process to give memory back).

    python bench/torch/two_process.py --program stream_gct:64 --csv out/two_process.csv
    python bench/torch/two_process.py --program stream_gct:64 --margins 1.0 1.02 --stagger 5 \
        --rounds 3
    python bench/torch/two_process.py --summarize out/two_process.csv"""
import argparse
import csv
import json
import statistics
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import frontier  # noqa: E402

GIB = float(1 << 30)
COLUMNS = ("allocator", "process", "status", "wall_s", "peak_allocated_gib", "peak_reserved_gib",
           "room_gib", "error", "margin", "stagger_s", "round", "unmappings", "stream_waits",
           "mappings", "device_queries", "alloc_retries", "others_wait_ms")
BALLAST = """
import sys, time, torch
keep = int(sys.argv[1])
x = torch.empty(keep, dtype=torch.uint8, device="cuda")
print("ready", flush=True)
sys.stdin.read()
"""


def child_cmd(program, allocator, result):
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env["PYTHONPATH"] = os.path.join(frontier.ROOT, "python") + os.pathsep + env.get(
        "PYTHONPATH", "")
    cmd = [sys.executable]
    if allocator == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    else:
        cmd += ["-m", "tidalloc", "run"]
    cmd += [frontier.__file__, "--child", "--program", program, "--result", result]
    return cmd, env


def read(result, proc):
    try:
        with open(result) as f:
            return json.load(f)
    except (OSError, ValueError):
        tail = (proc.stderr.read() if proc.stderr else "").strip().splitlines()[-3:]
        oom = any("out of memory" in line.lower() for line in tail)
        return {"status": "oom" if oom else "error", "error": " | ".join(tail)[:300]}


def round_orders(allocators, rounds):
    """The allocators' order in each round: as given, then reversed, and so
    on, so that neither always runs first after a margin's ballast starts."""
    return [list(allocators) if r % 2 == 0 else list(reversed(allocators))
            for r in range(rounds)]


def makespan(rows):
    """The pair's time: the later process's wall time, or None unless both
    processes completed."""
    if len(rows) != 2 or any(r["status"] != "ok" for r in rows):
        return None
    return max(float(r["wall_s"]) for r in rows)


def summarize(rows, out=sys.stdout):
    """Per margin: each allocator's completed processes, and where a round
    completed under two allocators, the ratio of the second's makespan to
    the first's (the first allocator named in the CSV is the reference)."""
    def margin_of(row):  # files written before margins were recorded have none
        return float(row["margin"]) if row.get("margin") else None

    margins = sorted({margin_of(r) for r in rows}, key=lambda m: (m is None, m or 0.0))
    for margin in margins:
        at = [r for r in rows if margin_of(r) == margin]
        allocators = list(dict.fromkeys(r["allocator"] for r in at))
        done = ", ".join("%s %d of %d" % (a, sum(r["status"] == "ok" for r in at
                                                 if r["allocator"] == a),
                                          sum(r["allocator"] == a for r in at))
                         for a in allocators)
        print("margin %s: completed %s" % ("%g" % margin if margin is not None else "unknown",
                                            done), file=out)
        rounds = sorted({int(r.get("round") or 0) for r in at})
        for other in allocators[1:]:
            ratios = []
            for rnd in rounds:
                spans = [makespan([r for r in at if r["allocator"] == a
                                   and int(r.get("round") or 0) == rnd])
                         for a in (allocators[0], other)]
                if None not in spans:
                    ratios.append(spans[1] / spans[0])
            if ratios:
                print("  %s / %s makespan: %s (median %.3f over %d rounds)"
                      % (other, allocators[0], " ".join("%.3f" % x for x in ratios),
                         statistics.median(ratios), len(ratios)), file=out)
            else:
                print("  %s / %s: no round where both pairs completed" % (other, allocators[0]),
                      file=out)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--summarize", metavar="CSV", help="print the summary of a CSV and exit")
    p.add_argument("--program", default="stream_gct:64")
    p.add_argument("--allocators", nargs="+", default=["expandable", "tidalloc"])
    p.add_argument("--margin", "--margins", type=float, nargs="+", default=[1.06],
                   dest="margins",
                   help="room left for both programs, as a multiple of their peaks allocated "
                   "(several: one pair per margin and allocator)")
    p.add_argument("--stagger", type=float, default=0.0, metavar="S",
                   help="start the second process S seconds after the first")
    p.add_argument("--context-gib", type=float, default=0.6,
                   help="room for each program's CUDA context, outside any allocator")
    p.add_argument("--rounds", type=int, default=1,
                   help="pairs per margin and allocator, the order reversed every other round")
    p.add_argument("--csv", default="two_process.csv")
    args = p.parse_args()
    if args.summarize:
        with open(args.summarize) as f:
            summarize(list(csv.DictReader(f)))
        return
    if args.rounds < 1:
        p.error("--rounds must be positive")
    import torch
    first = frontier.launch(args.program, "expandable", None, 900)
    if first.get("status") != "ok":
        raise SystemExit("two_process: %s does not run alone: %s" % (args.program,
                                                                     first.get("error")))
    peak = first["peak_allocated_gib"] * GIB
    rows = []
    for margin in sorted(args.margins):
        room = 2 * peak * margin + 2 * args.context_gib * GIB
        for rnd, order in enumerate(round_orders(args.allocators, args.rounds)):
            for allocator in order:
                rows += run_pair(args, torch, allocator, room, margin, rnd)
                frontier.write_rows(args.csv, rows, COLUMNS)
    summarize(rows)


def run_pair(args, torch, allocator, room, margin, rnd=0):
    """The two programs beside a ballast that leaves `room` bytes: their rows."""
    free, _ = torch.cuda.mem_get_info()
    ballast = subprocess.Popen([sys.executable, "-c", BALLAST, str(int(free - room))],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ballast.stdout.readline()
    procs, rows = [], []
    for k in range(2):
        if k and args.stagger:
            time.sleep(args.stagger)
        result = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
        cmd, env = child_cmd(args.program, allocator, result)
        procs.append((k, result, subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                                  stderr=subprocess.PIPE, text=True)))
    for k, result, proc in procs:
        proc.wait()
        out = read(result, proc)
        row = {"allocator": allocator, "process": k, "room_gib": "%.3f" % (room / GIB),
               "margin": margin, "stagger_s": args.stagger, "round": rnd}
        row.update(out)
        rows.append({c: frontier.fmt(row.get(c, "")) for c in COLUMNS})
        print(",".join(str(rows[-1][c]) for c in COLUMNS[:6]) + ",margin %g" % margin,
              flush=True)
        if os.path.exists(result):
            os.unlink(result)
    ballast.stdin.close()
    ballast.wait()
    time.sleep(1)
    return rows


if __name__ == "__main__":
    main()
