"""python -m tidalloc run SCRIPT [ARGS...]: run an unmodified script with
tidalloc as PyTorch's CUDA allocator (TIDALLOC_CONF honoured); --report FILE
writes tidalloc's figures as JSON when the script ends."""
import argparse
import atexit
import json
import runpy
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tidalloc")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a script with tidalloc installed")
    run.add_argument("--conf", help="tidalloc options, key:value,...")
    run.add_argument("--report", help="write a JSON memory report here at exit")
    run.add_argument("script")
    run.add_argument("args", nargs=argparse.REMAINDER)
    a = parser.parse_args(argv)
    from . import _lib
    from . import torch as tide_torch
    tide_torch.install(a.conf)
    if a.report:
        def report():
            with open(a.report, "w") as f:
                json.dump(_lib.memory_stats(0), f, indent=1, sort_keys=True)
        atexit.register(report)
    sys.argv = [a.script] + a.args
    runpy.run_path(a.script, run_name="__main__")


if __name__ == "__main__":
    main()
