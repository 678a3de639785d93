"""frontier.py: how fast a PyTorch program runs at the memory budget a user
has, and how small a budget still runs it, under each allocator.

Each program runs first uncapped under expandable segments, to measure its
peak allocated bytes; then, for every cap (a multiple of that peak, or none)
and every allocator, in a fresh process whose limit is set with
torch.cuda.set_per_process_memory_fraction (tidalloc takes it through its
shim), the allocators of one cap on consecutive rows in an order that
rotates from cap to cap. A run that runs out of memory is status oom.

Allocators: expandable (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True),
native (PyTorch's own, fixed segments), tidalloc (python -m tidalloc run),
and, for programs with caches that can grow in place, tidalloc-growable
(tidalloc with the program's growable caches).

CSV columns: program,allocator,cap,status,wall_s,peak_allocated_gib,
peak_reserved_gib,limit_gib,unmappings,stream_waits,mappings,order,error,
device_queries,device_query_ms (tidalloc's queries of the device's free
memory, and their time),alloc_retries (allocations that gave the cache back
and tried again),others_wait_ms (the time failed allocations waited for
other processes to give memory back).
wall_s is the program's own timed section: the frame loop of the streaming
model and of LingBot-Map's benchmark; for GPT-2 and ViT, from the model's
move to the device (its weights' allocations) to the end of the work, from a
synchronized device to a synchronized device (the imports and the weights'
random initialization on the CPU, which no allocator touches, stay out). cap is `none` or the
multiple. A PNG (time against cap, one line per allocator, out of memory
marked x) is written beside the CSV when matplotlib is importable.

    python bench/torch/frontier.py --programs gpt2 vit --csv out/frontier.csv
    python bench/torch/frontier.py --programs stream_gct:128 --caps none 1.02 1.05
    python bench/torch/frontier.py --programs gpt2 --caps 1.00 1.01 1.02 --refine 3
    python bench/torch/frontier.py --summarize out/frontier.csv   # ratios, no GPU
    python bench/torch/frontier.py --plot out/frontier.csv        # the PNG, no GPU

Programs: stream_gct:N (bench/torch/stream_gct.py at N frames, eager),
stream_gct_compiled:N (its --compile mode), gpt2 (Hugging Face GPT-2 with
random weights, greedy generation), vit (torchvision's ViT-B/16 with random
weights, bf16 inference), lingbot:FRAMES[:WINDOW] (LingBot-Map's
scripts/benchmark_gct_memory.py, unmodified, from the checkout that the
environment's LINGBOT_MAP names, with --backend sdpa and, given a WINDOW,
--sliding-window WINDOW; its own timed streaming loop and peaks), and
cmd:NAME:SCRIPT:ARGS... (any script, run unmodified; a script that catches
its own out-of-memory passes for ok here)."""
import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
COLUMNS = ("program", "allocator", "cap", "status", "wall_s", "peak_allocated_gib",
           "peak_reserved_gib", "limit_gib", "unmappings", "stream_waits", "mappings", "order",
           "error", "device_queries", "device_query_ms", "alloc_retries", "others_wait_ms")
DEFAULT_CAPS = ("none", "1.00", "1.01", "1.02", "1.03", "1.05", "1.10")
ALLOCATORS = ("expandable", "native", "tidalloc")
GIB = float(1 << 30)


# --------------------------------------------------------------------------
# Programs, as the child runs them: each returns its own timed seconds or None.
# --------------------------------------------------------------------------

def _script_row(argv, out):
    """Runs the script argv[0] in this process with argv, and returns the
    first row of the CSV it wrote to `out` (a temporary file, removed);
    MemoryError where the row's status is not ok."""
    import runpy
    sys.argv = argv
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    with open(out) as f:
        row = next(csv.DictReader(f))
    os.unlink(out)
    if row["status"] != "ok":
        raise MemoryError(row.get("error") or row["status"])
    return row


def _run_stream_gct(arg, growable, compiled):
    out = tempfile.NamedTemporaryFile(suffix=".csv", delete=False).name
    argv = [os.path.join(ROOT, "bench", "torch", "stream_gct.py"), "--frame-counts", arg,
            "--csv", out]
    if growable:
        argv.append("--growable")
    if compiled:
        argv.append("--compile")
    return float(_script_row(argv, out)["seconds"])


def _on_device_since(start):
    """Seconds from `start` to a synchronized device."""
    import torch
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _device_start():
    import torch
    torch.cuda.synchronize()
    return time.perf_counter()


def _run_gpt2(arg, growable, compiled):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    batch, new_tokens = 4, int(arg or 512)
    model = GPT2LMHeadModel(GPT2Config(n_positions=2048)).eval()
    start = _device_start()
    model = model.cuda().half()
    ids = torch.randint(0, 50257, (batch, 32), device="cuda")
    with torch.no_grad():
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       pad_token_id=0)
    return _on_device_since(start)


def _run_vit(arg, growable, compiled):
    import torch
    import torchvision
    torch.manual_seed(0)
    model = torchvision.models.vit_b_16().eval()
    steps = int(arg or 20)
    start = _device_start()
    model = model.cuda()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for i in range(steps):
            x = torch.randn(32 + 16 * (i % 3), 3, 224, 224, device="cuda")
            model(x).float().sum().item()
    return _on_device_since(start)


def _run_lingbot(arg, growable, compiled):
    """LingBot-Map's own memory benchmark, unmodified, from the checkout that
    LINGBOT_MAP names: --backend sdpa, FRAMES[:WINDOW] frames (and its
    --sliding-window). The script catches its own out-of-memory and records
    it in its CSV, and resets the peaks before it returns, so its row gives
    the status, the streaming loop's seconds and the peaks."""
    root = os.environ.get("LINGBOT_MAP")
    if not root:
        raise SystemExit("frontier: lingbot needs LINGBOT_MAP, a LingBot-Map checkout")
    frames, _, window = arg.partition(":")
    out = tempfile.NamedTemporaryFile(suffix=".csv", delete=False).name
    argv = [os.path.join(root, "scripts", "benchmark_gct_memory.py"), "--backend", "sdpa",
            "--frame-counts", frames or "512", "--output", out]
    if window:
        argv += ["--sliding-window", window]
    row = _script_row(argv, out)
    return {"wall_s": float(row["seconds"]),
            "peak_allocated_gib": float(row["peak_allocated_gib"]),
            "peak_reserved_gib": float(row["peak_reserved_gib"])}


def _run_cmd(arg, growable, compiled):
    import runpy
    script, *args = arg.split(":")
    sys.argv = [script] + [a for a in " ".join(args).split(" ") if a]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise MemoryError("exit status %s" % e.code)
    return None


PROGRAMS = {
    "stream_gct": lambda a, g: _run_stream_gct(a, g, False),
    "stream_gct_compiled": lambda a, g: _run_stream_gct(a, g, True),
    "gpt2": lambda a, g: _run_gpt2(a, g, False),
    "vit": lambda a, g: _run_vit(a, g, False),
    "lingbot": lambda a, g: _run_lingbot(a, g, False),
    "cmd": lambda a, g: _run_cmd(a, g, False),
}
GROWABLE = ("stream_gct", "stream_gct_compiled")


def split_program(program):
    name, _, arg = program.partition(":")
    if name not in PROGRAMS:
        raise SystemExit("frontier: unknown program %r (known: %s)" % (name, ", ".join(PROGRAMS)))
    return name, arg


def tidalloc_counts():
    """tidalloc's driver work over the process: unmappings, stream waits,
    mappings, queries of the device's free memory and their milliseconds,
    allocations retried after giving the cache back, and milliseconds spent
    waiting for other processes to give memory back."""
    try:
        import tidalloc
        st = tidalloc.stats(0)
        return (st.unmappings, st.stream_waits, st.mappings, st.device_queries,
                st.device_query_ns / 1e6, st.num_alloc_retries, st.others_wait_ns / 1e6)
    except Exception:  # not tidalloc's process
        return "", "", "", "", "", "", ""


def child(args):
    """One run, in this process: the limit, the program, its figures as JSON."""
    import torch
    name, arg = split_program(args.program)
    total = torch.cuda.get_device_properties(0).total_memory
    limit = None
    if args.limit_bytes:
        limit = int(args.limit_bytes)
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), 0)
    result = {"status": "ok", "error": "", "limit_gib": "" if limit is None else limit / GIB}
    torch.cuda.synchronize()
    start = time.perf_counter()
    own = None
    try:
        own = PROGRAMS[name](arg, args.growable)
        torch.cuda.synchronize()
        if isinstance(own, dict):  # the program's own time and peaks
            result.update(own)
        else:
            result["wall_s"] = own if own is not None else time.perf_counter() - start
    except (torch.cuda.OutOfMemoryError, MemoryError, RuntimeError) as e:
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "out of memory" not in text.lower() and not isinstance(e, MemoryError):
            raise
        result.update(status="oom", error=text[:700], wall_s="")
    if not isinstance(own, dict):
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    (result["unmappings"], result["stream_waits"], result["mappings"], result["device_queries"],
     result["device_query_ms"], result["alloc_retries"],
     result["others_wait_ms"]) = tidalloc_counts()
    if args.trace:
        try:
            from tidalloc import viz
            viz.write_replay_trace(args.trace, 0, cap=TRACE_EVENTS)
        except Exception as e:  # the run's figures stand without it
            print("frontier: no trace written: %s" % e, file=sys.stderr)
    with open(args.result, "w") as f:
        json.dump(result, f)


# --------------------------------------------------------------------------
# The parent: fresh processes, pairs, the CSV and the picture.
# --------------------------------------------------------------------------

TRACE_EVENTS = 8_000_000  # the trace ring of a traced run: the longest program's events


def trace_path(trace_dir, program, allocator, cap):
    return os.path.join(trace_dir, "%s_%s_%s.csv.gz" % (program.replace(":", "_"), allocator, cap))


def launch(program, allocator, limit, timeout, trace=None):
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable]
    if allocator == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if allocator == "native":  # said, since a program may default to expandable segments
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:False"
    if allocator.startswith("tidalloc"):
        cmd += ["-m", "tidalloc", "run"]
    result = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    cmd += [os.path.abspath(__file__), "--child", "--program", program, "--result", result]
    if limit:
        cmd += ["--limit-bytes", str(limit)]
    if allocator == "tidalloc-growable":
        cmd.append("--growable")
    if trace and allocator.startswith("tidalloc"):
        conf = env.get("TIDALLOC_CONF", "")
        env["TIDALLOC_CONF"] = (conf + "," if conf else "") + "trace:%d" % TRACE_EVENTS
        cmd += ["--trace", trace]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        with open(result) as f:
            out = json.load(f)
    except subprocess.TimeoutExpired:
        out = {"status": "timeout", "error": "over %d s" % timeout}
    except (OSError, ValueError):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        oom = any("out of memory" in line.lower() for line in tail)
        out = {"status": "oom" if oom else "error", "error": " | ".join(tail)[:300]}
    finally:
        if os.path.exists(result):
            os.unlink(result)
    return out


def write_rows(path, rows, columns=COLUMNS):
    """The CSV at `path`, rewritten with every row so far (a cut run keeps its rows)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for row in rows:
            w.writerow(row)


def fmt(v):
    return "%.4f" % v if isinstance(v, float) else v


class BudgetSpent(Exception):
    pass


def run_caps(args, program, caps, allocators, peak, rows, deadline, first=0):
    """Each cap of `caps`, every allocator on consecutive rows, in an order
    that rotates from cap to cap (starting at rotation `first`)."""
    for i, cap in enumerate(caps, first):
        order = allocators[i % len(allocators):] + allocators[:i % len(allocators)]
        limit = None if cap == "none" else math.ceil(peak * float(cap))
        for k, allocator in enumerate(order):
            if deadline and time.time() > deadline:
                raise BudgetSpent()
            trace = None
            if args.trace_dir:
                os.makedirs(args.trace_dir, exist_ok=True)
                trace = trace_path(args.trace_dir, program, allocator, cap)
            out = launch(program, allocator, limit, args.timeout, trace)
            row = {"program": program, "allocator": allocator, "cap": cap, "order": k,
                   "limit_gib": "" if limit is None else limit / GIB}
            row.update(out)
            row = {c: fmt(row.get(c, "")) for c in COLUMNS}
            rows.append(row)
            write_rows(args.csv, rows)
            print(",".join(str(row[c]) for c in COLUMNS[:8]), flush=True)


# The allocators whose tightest caps --refine compares.
REFINED = ("expandable", "tidalloc")


def refine_caps(rows, program, n):
    """n caps evenly spaced inside the grid step where expandable segments'
    and tidalloc's tightest completing caps lie: strictly between the
    lower of the caps just below each one's tightest (which failed) and the
    higher of the two tightest, formatted to 4 decimals. Empty where either
    never completed, or completed at every cap tried (nothing below to
    refine against)."""
    bounds = []
    for allocator in REFINED:
        tried = [(float(r["cap"]), r["status"] == "ok") for r in rows
                 if r["program"] == program and r["allocator"] == allocator and r["cap"] != "none"]
        ok = [c for c, good in tried if good]
        if not ok:
            return []
        tightest = min(ok)
        failed = [c for c, good in tried if not good and c < tightest]
        if not failed:
            return []
        bounds.append((max(failed), tightest))
    lo, hi = min(b[0] for b in bounds), max(b[1] for b in bounds)
    tried = {round(float(r["cap"]), 6) for r in rows
             if r["program"] == program and r["cap"] != "none"}
    caps = ["%.4f" % (lo + (hi - lo) * (j + 1) / (n + 1)) for j in range(n)]
    return [c for c in dict.fromkeys(caps)
            if lo < float(c) < hi and round(float(c), 6) not in tried]


def run_frontier(args):
    rows = []
    deadline = time.time() + args.budget_seconds if args.budget_seconds else None
    for program in args.programs:
        name, _ = split_program(program)
        allocators = list(args.allocators)
        if name in GROWABLE and args.growable and "tidalloc-growable" not in allocators:
            allocators.append("tidalloc-growable")
        if args.peak_gib:
            peak = args.peak_gib * GIB
            print("%s: peak allocated %.3f GiB as given" % (program, args.peak_gib), flush=True)
        else:
            first = launch(program, "expandable", None, args.timeout)
            if first.get("status") != "ok":
                print("frontier: %s does not run uncapped: %s" % (program, first.get("error")),
                      file=sys.stderr)
                continue
            peak = first["peak_allocated_gib"] * GIB
            print("%s: peak allocated %.3f GiB uncapped" % (program, peak / GIB), flush=True)
        try:
            run_caps(args, program, args.caps, allocators, peak, rows, deadline)
            if args.refine:
                caps = refine_caps(rows, program, args.refine)
                print("%s: refined caps %s" % (program, " ".join(caps) or "none (no step to "
                                               "refine)"), flush=True)
                run_caps(args, program, caps, [a for a in allocators if a in REFINED], peak,
                         rows, deadline, first=len(args.caps))
        except BudgetSpent:
            print("frontier: the time budget is spent; stopping", file=sys.stderr)
            write_rows(args.csv, rows)
            return rows
    plot(args.csv, rows)
    return rows


def plot(path, rows):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    programs = sorted({r["program"] for r in rows})
    if not programs:
        return
    fig, axes = plt.subplots(1, len(programs), figsize=(4.2 * len(programs), 3.4), squeeze=False)
    for ax, program in zip(axes[0], programs):
        mine = [r for r in rows if r["program"] == program]
        caps = sorted({float(r["cap"]) for r in mine if r["cap"] != "none"})
        uncapped_x = (caps[-1] if caps else 1.0) + 0.03  # "none" to the right of every cap
        top = max([float(r["wall_s"]) for r in mine if r["status"] == "ok"] or [1.0])
        for k, allocator in enumerate(("expandable", "native", "tidalloc", "tidalloc-growable")):
            runs = [r for r in mine if r["allocator"] == allocator]
            if not runs:
                continue
            by_x = {}
            for r in runs:
                x = float(r["cap"]) if r["cap"] != "none" else uncapped_x
                by_x.setdefault(x, []).append(r)
            xs = sorted(by_x)
            # The line through each cap's median time where a run completed;
            # every run a dot; a cap where none completed an x at the top.
            med = [(x, statistics.median(float(r["wall_s"]) for r in by_x[x]
                                         if r["status"] == "ok"))
                   for x in xs if any(r["status"] == "ok" for r in by_x[x])]
            line, = ax.plot([x for x, _ in med], [y for _, y in med], "-", label=allocator,
                            color="C%d" % k)  # one colour per allocator in every panel
            dots = [(x, float(r["wall_s"])) for x in xs for r in by_x[x] if r["status"] == "ok"]
            ax.plot([x for x, _ in dots], [y for _, y in dots], "o", color=line.get_color(),
                    markersize=4)
            bad = [x for x in xs if all(r["status"] != "ok" for r in by_x[x])]
            ax.plot(bad, [top * (1.02 + 0.025 * k)] * len(bad), "x", color=line.get_color(),
                    markersize=8)  # one row of x's per allocator
        ax.set_xticks(caps + [uncapped_x])
        ax.set_xticklabels(["%g" % c for c in caps] + ["none"], fontsize=7)
        ax.set_title(program, fontsize=9)
        ax.set_xlabel("cap (x peak allocated)")
        ax.set_ylabel("seconds")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.splitext(path)[0] + ".png", dpi=110)


def plot_csv(path):
    """The PNG of a CSV that run_frontier wrote, beside it; fails saying why
    when matplotlib is missing or the CSV has no rows."""
    with open(path) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise SystemExit("frontier: %s has no rows" % path)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("frontier: --plot needs matplotlib (pip install matplotlib)")
    plot(path, rows)
    print(os.path.splitext(path)[0] + ".png")


def summarize(path):
    """Each cap's tidalloc time over expandable segments' (ok pairs), and
    each allocator's tightest completing cap, per program."""
    with open(path) as f:
        rows = list(csv.DictReader(f))
    for program in sorted({r["program"] for r in rows}):
        mine = [r for r in rows if r["program"] == program]
        print(program)
        caps = sorted({r["cap"] for r in mine}, key=lambda c: -1.0 if c == "none" else float(c))
        for cap in caps:
            got = {r["allocator"]: r for r in mine if r["cap"] == cap}
            cells = []
            for allocator in sorted(got):
                r = got[allocator]
                cells.append("%s %s" % (allocator, r["wall_s"] if r["status"] == "ok"
                                        else r["status"]))
            e, t = got.get("expandable"), got.get("tidalloc")
            ratio = ""
            if e and t and e["status"] == t["status"] == "ok":
                ratio = "  tidalloc/expandable %.3f" % (float(t["wall_s"]) / float(e["wall_s"]))
            print("  cap %-5s %s%s" % (cap, "; ".join(cells), ratio))
        for allocator in sorted({r["allocator"] for r in mine}):
            caps = [float(r["cap"]) for r in mine
                    if r["allocator"] == allocator and r["cap"] != "none" and r["status"] == "ok"]
            print("  tightest cap completed by %s: %s" % (allocator, min(caps) if caps else "-"))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--programs", nargs="+", default=["gpt2", "vit"])
    p.add_argument("--caps", nargs="+", default=list(DEFAULT_CAPS))
    p.add_argument("--allocators", nargs="+", default=list(ALLOCATORS))
    p.add_argument("--growable", action="store_true",
                   help="add tidalloc-growable for programs with growable caches")
    p.add_argument("--csv", default="frontier.csv")
    p.add_argument("--timeout", type=int, default=600, help="seconds a run may take")
    p.add_argument("--budget-seconds", type=int, default=0,
                   help="start no run after this many seconds (0: no budget)")
    p.add_argument("--peak-gib", type=float, default=0,
                   help="the programs' peak allocated GiB, known from an earlier run: the caps "
                   "are multiples of it, and no first run measures it")
    p.add_argument("--refine", type=int, default=0, metavar="N",
                   help="after the caps, N more caps evenly spaced inside the grid step where "
                   "expandable segments' and tidalloc's tightest completing caps lie, for those "
                   "two, so that the margin between them is measured, not the grid's")
    p.add_argument("--summarize", metavar="CSV")
    p.add_argument("--plot", metavar="CSV",
                   help="draw the PNG of a CSV this script wrote, beside it (no GPU)")
    p.add_argument("--trace-dir", help="tidalloc's runs record every allocation and free and "
                   "write them here as PROGRAM_ALLOCATOR_CAP.csv.gz, for `tidalloc replay` (an "
                   "out-of-memory run's trace too: replayed under the same limit, it shows "
                   "where the memory was)")
    p.add_argument("--trace", help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--program", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--limit-bytes", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.summarize:
        summarize(args.summarize)
    elif args.plot:
        plot_csv(args.plot)
    elif args.child:
        child(args)
    else:
        for cap in args.caps:
            if cap != "none":
                float(cap)
        run_frontier(args)


if __name__ == "__main__":
    main()
