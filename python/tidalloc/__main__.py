"""python -m tidalloc run [options] SCRIPT [ARGS...]: run an unmodified script
with tidalloc as PyTorch's CUDA allocator (TIDALLOC_CONF honoured); --report
FILE writes tidalloc's figures as JSON when the script ends, --memory-viz FILE
a snapshot that PyTorch's memory_viz opens, --timeline FILE a PNG of
allocated and reserved bytes over time, --trace-csv FILE.csv.gz every
allocation and free as a trace that `tidalloc replay` reads (the last three
need the trace option, e.g. TIDALLOC_CONF=trace:1000000). Options after the
script's name are the script's. `run` needs PyTorch.

python -m tidalloc build-shim [--retry] [--verbose]: build the PyTorch shim
ahead of time (containers, machines without network, CI) and print where it
is, or why it cannot be built.

python -m tidalloc info: which bridge to PyTorch a process would get (the
shim, the pluggable allocator) and why.

A mistake on the command line (an unknown option, a script that does not
exist, a bad --conf) is one line on stderr and exit status 2."""
import argparse
import atexit
import importlib.util
import json
import os
import runpy
import sys
import warnings

PROG = "python -m tidalloc"


class _Parser(argparse.ArgumentParser):
    """Errors in one line, with where to find the usage."""

    def error(self, message):
        self.exit(2, "%s: %s (%s --help)\n" % (self.prog, message, self.prog))


def _fail(prog, message, status=2):
    sys.stderr.write("%s: %s\n" % (prog, message))
    sys.exit(status)


def _parser():
    parser = _Parser(
        prog=PROG,
        description="tidalloc from Python. `python -m tidalloc run [options] script [script "
        "args]` runs a script with tidalloc as PyTorch's CUDA allocator (the options after the "
        "script's name are the script's); it needs PyTorch (pip install torch). The tidalloc "
        "command (tidalloc --help) runs the benchmarks without it.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser(
        "run", help="run a script with tidalloc as PyTorch's CUDA allocator (needs PyTorch)",
        usage="%s run [options] script [script args]" % PROG,
        description="Run a script with tidalloc as PyTorch's CUDA allocator. Needs PyTorch. "
        "The options come before the script's name: everything after it is the script's "
        "(python -m tidalloc run train.py --conf x gives --conf x to train.py).")
    run.add_argument("--conf", help="tidalloc options, key:value,... (added to TIDALLOC_CONF)")
    run.add_argument("--report", help="write a JSON memory report here at exit")
    run.add_argument("--memory-viz", help="write a snapshot for PyTorch's memory_viz here at exit")
    run.add_argument("--timeline", help="write a PNG of allocated and reserved over time at exit "
                     "(needs the trace option, e.g. TIDALLOC_CONF=trace:1000000)")
    run.add_argument("--trace-csv", help="write every allocation and free as a trace for "
                     "`tidalloc replay` here at exit (gzip'd CSV; needs the trace option)")
    run.add_argument("script", nargs="?", help="the Python script to run")
    run.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    build = sub.add_parser(
        "build-shim", help="build the PyTorch shim now and print where it is (needs PyTorch)",
        description="Build the shim that makes tidalloc PyTorch's own allocator, for the torch "
        "of this Python, into the cache (TIDALLOC_CACHE, else ~/.cache/tidalloc), and print its "
        "path; or say why it cannot be built (exit status 1). A build that failed is not tried "
        "again for the same torch and sources unless --retry.")
    build.add_argument("--retry", action="store_true",
                       help="build even though an earlier build for this torch failed")
    build.add_argument("--verbose", action="store_true",
                       help="show the compiler's output (also TIDALLOC_VERBOSE=1)")
    parser.commands = {"run": run, "build-shim": build}
    parser.commands["info"] = sub.add_parser(
        "info", help="which bridge to PyTorch a process would get, and why",
        description="Say which bridge tidalloc.torch.install() would take in a process started "
        "now (the shim or the pluggable allocator) and why, without building anything.")
    return parser


def _no_torch(prog):
    if importlib.util.find_spec("torch") is None:
        _fail(prog, "needs PyTorch, which this Python (%s) does not have; install it "
              "(pip install torch)" % sys.executable, status=1)


def _run(a):
    prog = PROG + " run"
    if not a.script:
        _fail(prog, "no script named (usage: %s run [options] script [script args])" % PROG)
    if not os.path.exists(a.script):
        _fail(prog, "%s: no such file" % a.script)
    from . import _lib
    if a.conf:
        try:
            _lib.configure(a.conf)
        except _lib.TidallocError as e:
            _fail(prog, "--conf: %s" % e)
        except OSError as e:  # the library itself is missing
            _fail(prog, str(e), status=1)
    try:
        notice = _lib.conf_notice()  # a retired key in TIDALLOC_CONF or --conf
    except (_lib.TidallocError, OSError):
        notice = None  # a bad TIDALLOC_CONF is reported by install() below
    if notice:
        sys.stderr.write("tidalloc: %s\n" % notice)
    _no_torch(prog)
    from . import torch as tide_torch
    # The fallback's warning, if any, as one line.
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            tide_torch.install()
        except _lib.TidallocError as e:  # a bad TIDALLOC_CONF
            _fail(prog, str(e))
        except (RuntimeError, ValueError, OSError) as e:
            _fail(prog, str(e), status=1)
    for w in said:
        text = str(w.message)
        if text.startswith("tidalloc"):
            sys.stderr.write(text + "\n")
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
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
    return 0


def _build_shim(a):
    prog = PROG + " build-shim"
    from . import shim
    why = shim.unavailable(any_version=os.environ.get("TIDALLOC_TORCH_BRIDGE") == "shim")
    if why:
        hint = ""
        if "outside the versions" in why:
            hint = "; TIDALLOC_TORCH_BRIDGE=shim tries it all the same"
        _fail(prog, "cannot build the shim: %s%s" % (why, hint), status=1)
    try:
        path = shim.build(verbose=a.verbose or None, retry=a.retry, any_version=True)
    except (shim.ShimUnavailable, OSError) as e:
        _fail(prog, str(e), status=1)
    import torch
    print("%s: the shim for torch %s is %s" % (prog, torch.__version__, path))
    return 0


def _info(a):
    from . import shim
    print("python: %s (%s)" % (sys.executable, sys.version.split()[0]))
    try:
        from . import _lib
        print("tidalloc library: %s" % _lib.library_path())
    except OSError as e:
        print("tidalloc library: not found (%s)" % e)
    print("torch versions the shim supports: %s" % shim.supported_range())
    if importlib.util.find_spec("torch") is None:
        print("torch: not installed")
        print("bridge: none: PyTorch is not installed (pip install torch)")
        return 0
    import torch
    print("torch: %s (CUDA %s)%s" % (torch.__version__, torch.version.cuda,
                                     "" if shim.version_supported(torch.__version__)
                                     else ", outside the supported versions"))
    bridge, why = shim.plan()
    if bridge == "error":
        print("bridge: none, install() raises: %s" % why)
    elif bridge == "pluggable":
        print("bridge: pluggable: %s" % why)
        print("lost on the pluggable path: %s" % ", ".join(shim.LOST))
    else:
        print("bridge: shim: %s" % why)
    return 0


def main(argv=None):
    parser = _parser()
    a, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's parser, which knows its options
        sub = parser.commands.get(a.command, parser)
        where = " (a script's options come after its name)" if a.command == "run" else ""
        sub.error("unknown option%s %s%s" % ("s" if len(unknown) > 1 else "", " ".join(unknown),
                                             where))
    return {"run": _run, "build-shim": _build_shim, "info": _info}[a.command](a)


if __name__ == "__main__":
    sys.exit(main())
