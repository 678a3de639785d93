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
in turn; --stagger S starts the second process S seconds after the first,
so that it grows while the first holds what it has freed (a second stream
joining a running one) rather than beside it.

CSV columns: allocator,process,status,wall_s,peak_allocated_gib,
peak_reserved_gib,room_gib,error,margin,stagger_s.

    python bench/torch/two_process.py --program stream_gct:64 --csv out/two_process.csv
    python bench/torch/two_process.py --program stream_gct:64 --margins 1.0 1.02 1.06 --stagger 5"""
import argparse
import json
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
           "room_gib", "error", "margin", "stagger_s")
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


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    p.add_argument("--csv", default="two_process.csv")
    args = p.parse_args()
    import torch
    first = frontier.launch(args.program, "expandable", None, 900)
    if first.get("status") != "ok":
        raise SystemExit("two_process: %s does not run alone: %s" % (args.program,
                                                                     first.get("error")))
    peak = first["peak_allocated_gib"] * GIB
    rows = []
    for margin in sorted(args.margins):
        room = 2 * peak * margin + 2 * args.context_gib * GIB
        for allocator in args.allocators:
            rows += run_pair(args, torch, allocator, room, margin)
            frontier.write_rows(args.csv, rows, COLUMNS)


def run_pair(args, torch, allocator, room, margin):
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
               "margin": margin, "stagger_s": args.stagger}
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
