"""python -m tidalloc run SCRIPT [ARGS...]: run an unmodified script with
tidalloc as PyTorch's CUDA allocator (TIDALLOC_CONF honoured); --report FILE
writes tidalloc's figures as JSON when the script ends, --memory-viz FILE a
snapshot that PyTorch's memory_viz opens, --timeline FILE a PNG of allocated
and reserved bytes over time, --trace-csv FILE.csv.gz every allocation and
free as a trace that `tidalloc replay` reads (the last three need the trace
option, e.g. TIDALLOC_CONF=trace:1000000). `run` needs PyTorch."""
import argparse
import atexit
import importlib.util
import json
import runpy
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m tidalloc",
        description="tidalloc from Python. `run` needs PyTorch (pip install torch); "
        "the tidalloc command (tidalloc --help) runs the benchmarks without it.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a script with tidalloc as PyTorch's CUDA allocator "
                         "(needs PyTorch)",
                         description="Run a script with tidalloc as PyTorch's CUDA allocator. "
                         "Needs PyTorch.")
    run.add_argument("--conf", help="tidalloc options, key:value,...")
    run.add_argument("--report", help="write a JSON memory report here at exit")
    run.add_argument("--memory-viz", help="write a snapshot for PyTorch's memory_viz here at exit")
    run.add_argument("--timeline", help="write a PNG of allocated and reserved over time at exit "
                     "(needs the trace option, e.g. TIDALLOC_CONF=trace:1000000)")
    run.add_argument("--trace-csv", help="write every allocation and free as a trace for "
                     "`tidalloc replay` here at exit (gzip'd CSV; needs the trace option)")
    run.add_argument("script")
    run.add_argument("args", nargs=argparse.REMAINDER)
    a = parser.parse_args(argv)
    if importlib.util.find_spec("torch") is None:
        sys.exit("python -m tidalloc run: needs PyTorch, which this Python (%s) does not have; "
                 "install it (pip install torch)" % sys.executable)
    from . import _lib
    from . import torch as tide_torch
    tide_torch.install(a.conf)
    if a.report:
        def report():
            with open(a.report, "w") as f:
                json.dump(_lib.memory_stats(0), f, indent=1, sort_keys=True)
        atexit.register(report)
    if a.memory_viz or a.timeline or a.trace_csv:
        from . import viz

        def pictures():
            if a.memory_viz:
                viz.export_memory_viz(a.memory_viz)
            if a.timeline:
                viz.timeline_png(a.timeline)
            if a.trace_csv:
                viz.write_replay_trace(a.trace_csv)
        atexit.register(pictures)
    sys.argv = [a.script] + a.args
    runpy.run_path(a.script, run_name="__main__")


if __name__ == "__main__":
    main()
