#!/usr/bin/env python3
"""docs_blocks.py: every code block of README.md and docs/*.md runs as
written.

Each fenced block is tagged: sh, c and python blocks run; text blocks are
shown, never run. A block that must not run here (a GPU, the network, the
whole build) has the line `<!-- not run: why -->` right before it; there
may be at most MAX_NOT_RUN of those in all, each with its reason. A block
with another tag, or none, fails: say what it is.

The blocks run in the state the README's install leaves: the `tidalloc`
command on PATH, the Python package importable (with the library of the
build), build/ built. Each file's blocks run in order in a scratch folder
that links the repository's files (build/ is the build given), so they
may use what an earlier block of the same file made and write nothing into
the repository.

- sh: `bash -e -o pipefail`, with `python` and `python3` on PATH.
- c: compiled against include/ and the build's library, then run if it has
  a main (on the host backend).
- python: run in a fresh interpreter on the host backend; a line
  `print(...)  # text` must print a line that starts with the text (the
  comment's part before a colon, where it explains after one).

Blocks that use torch (torch, transformers, tidalloc.torch/kv/hf,
`tidalloc run`) run with --torch-python, and are skipped, saying so,
without it.

usage: docs_blocks.py --build DIR [--torch-python PY] [--list] [FILE.md ...]"""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
RUN_TAGS = ("sh", "c", "python")
SHOW_TAGS = ("text",)
MAX_NOT_RUN = 5
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^```(\S*)\s*$")
NEEDS_TORCH = re.compile(r"\b(import torch|from torch|torch\.|transformers|tidalloc run|"
                         r"tidalloc\.(torch|kv|hf)|GrowableTensor)")
TIMEOUT = 600


class Block:
    def __init__(self, path, line, tag, text, not_run):
        self.path, self.line, self.tag, self.text, self.not_run = path, line, tag, text, not_run

    def where(self):
        return "%s:%d" % (os.path.relpath(self.path, ROOT), self.line)


def parse(path):
    """The fenced blocks of a Markdown file, and the problems of its markup."""
    blocks, problems = [], []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        tag, start = m.group(1), i
        end = start + 1
        while end < len(lines) and lines[end] != "```":
            end += 1
        if end == len(lines):
            problems.append("%s:%d: a block that never closes" % (path, start + 1))
            break
        before = start - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        marker = NOT_RUN.match(lines[before]) if before >= 0 else None
        block = Block(path, start + 1, tag, "\n".join(lines[start + 1:end]) + "\n",
                      marker.group(1) if marker else None)
        where = block.where()
        if tag not in RUN_TAGS + SHOW_TAGS:
            problems.append("%s: block tagged %r: tag it %s, or text for what is not run"
                            % (where, tag, ", ".join(RUN_TAGS)))
        elif block.not_run is not None and not block.not_run:
            problems.append("%s: `not run` gives no reason" % where)
        elif block.not_run is not None and tag in SHOW_TAGS:
            problems.append("%s: a text block never runs: drop its `not run` line" % where)
        blocks.append(block)
        i = end + 1
    return blocks, problems


def expected_prints(code):
    """What each `print(...)  # comment` line says it prints."""
    wants = []
    for m in re.finditer(r"^print\(.*\)\s+#\s*(.+)$", code, re.M):
        want = m.group(1).strip()
        if ":" in want and not want.startswith("torch"):
            want = want.split(":")[0].strip()
        wants.append(want)
    return wants


class Runner:
    def __init__(self, build, torch_python):
        self.build = os.path.abspath(build)
        self.torch_python = torch_python
        self.scratch = tempfile.mkdtemp(prefix="docs_blocks.")
        self.bin = os.path.join(self.scratch, "bin")
        os.mkdir(self.bin)
        os.symlink(os.path.join(self.build, "tidalloc"), os.path.join(self.bin, "tidalloc"))

    def close(self):
        shutil.rmtree(self.scratch, ignore_errors=True)

    def workdir(self, doc):
        """A fresh folder that links the repository's files, build/ the build's."""
        work = tempfile.mkdtemp(prefix=os.path.basename(doc) + ".", dir=self.scratch)
        for name in os.listdir(ROOT):
            if name in (".git", "build"):
                continue
            os.symlink(os.path.join(ROOT, name), os.path.join(work, name))
        os.symlink(self.build, os.path.join(work, "build"))
        return work

    def env(self, python):
        env = dict(os.environ)
        for key in ("TIDALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
            env.pop(key, None)
        pybin = os.path.join(self.scratch, "py-" + str(abs(hash(python))))
        if not os.path.isdir(pybin):
            os.mkdir(pybin)
            for name in ("python", "python3"):  # a script: a venv's python must keep its path
                with open(os.path.join(pybin, name), "w") as f:
                    f.write('#!/bin/sh\nexec "%s" "$@"\n' % python)
                os.chmod(os.path.join(pybin, name), 0o755)
        env["PATH"] = os.pathsep.join([self.bin, pybin, env.get("PATH", "")])
        env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
        env["TIDALLOC_LIB"] = os.path.join(self.build, "libtidalloc.so")
        env["OMP_NUM_THREADS"] = "1"
        return env

    def run(self, block, work):
        """None when it ran as written, else what went wrong."""
        python = sys.executable
        if NEEDS_TORCH.search(block.text):
            if not self.torch_python:
                return "skip"
            python = self.torch_python
        env = self.env(python)
        if block.tag == "sh":
            cmd = ["bash", "-e", "-o", "pipefail", "-c", block.text]
        elif block.tag == "python":
            env["TIDALLOC_CONF"] = "backend:host"
            cmd = [python, "-c", block.text]
        else:
            return self.run_c(block, work, env)
        r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True,
                           timeout=TIMEOUT)
        if r.returncode != 0:
            return "exit status %d\n%s%s" % (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
        printed = [line.strip() for line in r.stdout.splitlines() if line.strip()]
        for want in expected_prints(block.text) if block.tag == "python" else ():
            if not any(line.startswith(want) for line in printed):
                return "printed no line starting with %r:\n%s" % (want, "\n".join(printed))
        return None

    def run_c(self, block, work, env):
        src = os.path.join(work, "block_%d.c" % block.line)
        with open(src, "w") as f:
            f.write(block.text)
        has_main = re.search(r"\bint\s+main\s*\(", block.text) is not None
        cc = os.environ.get("CC", "cc")
        out = src[:-2]
        cmd = [cc, "-std=c11", "-Wall", "-Werror", "-I", os.path.join(ROOT, "include")]
        if has_main:
            cmd += [src, "-L", self.build, "-ltidalloc", "-Wl,-rpath," + self.build, "-o", out]
        else:
            cmd += ["-c", src, "-o", out + ".o"]
        r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            return "does not compile:\n" + r.stderr[-3000:]
        if has_main:
            env["TIDALLOC_CONF"] = "backend:host"
            r = subprocess.run([out], cwd=work, env=env, capture_output=True, text=True,
                               timeout=TIMEOUT)
            if r.returncode != 0:
                return "exit status %d\n%s%s" % (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
        return None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", help="the build folder (its tidalloc and libtidalloc.so)")
    p.add_argument("--torch-python", help="a python with torch and transformers")
    p.add_argument("--list", action="store_true", help="list the blocks, run nothing")
    p.add_argument("files", nargs="*")
    args = p.parse_args()
    files = args.files or [os.path.join(ROOT, "README.md")] + sorted(
        glob.glob(os.path.join(ROOT, "docs", "*.md")))
    blocks, problems = [], []
    for path in files:
        b, bad = parse(os.path.abspath(path))
        blocks += b
        problems += bad
    not_run = [b for b in blocks if b.not_run]
    if len(not_run) > MAX_NOT_RUN:
        problems.append("%d blocks are marked `not run`, more than %d: make them run, or show "
                        "them as text (%s)" % (len(not_run), MAX_NOT_RUN,
                                               ", ".join(b.where() for b in not_run)))
    if args.list:
        for b in blocks:
            state = "not run: " + b.not_run if b.not_run else (
                "shown" if b.tag in SHOW_TAGS else "runs" if b.tag in RUN_TAGS else "bad tag")
            print("%s %s %s" % (b.where(), b.tag or "-", state))
        return 0
    if not args.build:
        p.error("--build is needed to run the blocks")
    failures = list(problems)
    ran = skipped = 0
    runner = Runner(args.build, args.torch_python)
    try:
        works = {}
        for b in blocks:
            if b.tag not in RUN_TAGS or b.not_run:
                continue
            work = works.setdefault(b.path, None) or runner.workdir(b.path)
            works[b.path] = work
            try:
                why = runner.run(b, work)
            except subprocess.TimeoutExpired:
                why = "ran over %d s" % TIMEOUT
            if why == "skip":
                skipped += 1
                print("SKIP %s (%s): it needs torch, and no --torch-python was given"
                      % (b.where(), b.tag))
            elif why:
                failures.append("%s (%s) does not run as written: %s" % (b.where(), b.tag, why))
                print("FAIL %s (%s)" % (b.where(), b.tag))
            else:
                ran += 1
                print("ok   %s (%s)" % (b.where(), b.tag))
    finally:
        runner.close()
    for f in failures:
        print("FAIL: " + f, file=sys.stderr)
    print("docs_blocks: %d blocks ran, %d skipped, %d not run by their marks, %d failures"
          % (ran, skipped, len(not_run), len(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
