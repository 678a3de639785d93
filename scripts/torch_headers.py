#!/usr/bin/env python3
"""torch_headers.py: fetch the C++ headers of torch releases into a cache
outside the repository, for tests/torch/shim_compile.sh --versions (the shim
compiled against each supported release without installing it).

  scripts/torch_headers.py                 every release of tests/torch/torch_versions.txt
  scripts/torch_headers.py 2.15.0 2.8.0    these
  scripts/torch_headers.py --list          where the cache is and what it holds

For each version, pip downloads the wheel (no dependencies) for --platform
(default manylinux_2_28_x86_64: the CUDA build users install, whose headers
include c10/cuda/impl/cuda_cmake_macros.h, which the macOS and Windows wheels
lack), only torch/include is extracted, into
  $TIDE_TORCH_HEADERS/<version>/include
  (default ${XDG_CACHE_HOME:-~/.cache}/tidalloc/torch-headers/<version>/include),
the headers the shim includes are checked to be there, the C++ standard
torch's cpp_extension compiles with is noted in <version>/cxx_std (C++20
from 2.12), and the wheel is deleted (a Linux wheel is 0.5-1 GB; its
headers about 65 MB). A version already in the cache is skipped unless
--force. Exit status 0 when every
version is in the cache at the end, 1 otherwise (one line per failure)."""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
VERSIONS = os.path.join(ROOT, "tests", "torch", "torch_versions.txt")
SHIM = os.path.join(ROOT, "python", "tidalloc", "shim", "tidalloc_torch.cpp")
# Generated for a CUDA build only; c10/cuda's headers include it.
ALSO_REQUIRED = ("c10/cuda/impl/cuda_cmake_macros.h",)
# The include folders a build searches (cpp_extension passes both).
SEARCHED = ("", "torch/csrc/api/include")
MARKER = ".complete"  # written last: a folder without it is an interrupted extraction
# Wheels carry one copy of the headers whatever the Python; some releases
# lack wheels for some Pythons, so these are tried in turn.
PYTHONS = ("3.12", "3.11", "3.10", "3.13")


def cache_dir():
    if os.environ.get("TIDE_TORCH_HEADERS"):
        return os.environ["TIDE_TORCH_HEADERS"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tidalloc", "torch-headers")


def listed_versions():
    with open(VERSIONS) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


def required_headers():
    """The torch headers the shim includes (#include <c10/...> and <torch/...>)."""
    with open(SHIM) as f:
        found = re.findall(r"^\s*#\s*include\s*<((?:c10|torch|ATen)/[^>]+)>", f.read(), re.M)
    return sorted(set(found) | set(ALSO_REQUIRED))


def complete(version):
    return os.path.exists(os.path.join(cache_dir(), version, MARKER))


def download(version, platform, work):
    """The wheel's path, or raise RuntimeError with pip's last line."""
    last = ""
    for py in PYTHONS:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--platform", platform, "--python-version", py, "--implementation", "cp",
               "--progress-bar", "off", "-q", "-d", work, "torch==" + version]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = [w for w in os.listdir(work) if w.endswith(".whl")]
        if r.returncode == 0 and wheels:
            return os.path.join(work, wheels[0])
        lines = [x for x in (r.stderr or r.stdout).splitlines() if x.strip()]
        last = lines[-1] if lines else "pip exited %d" % r.returncode
    raise RuntimeError("pip download torch==%s for %s: %s" % (version, platform, last))


def cxx_standard(z):
    """The C++ standard torch's cpp_extension compiles extensions with
    ("c++17", "c++20"): the -std=c++NN torch/utils/cpp_extension.py passes
    most often (its docstrings show others)."""
    try:
        text = z.read("torch/utils/cpp_extension.py").decode("utf-8", "replace")
    except KeyError:
        return None
    found = re.findall(r"'-std=(c\+\+\d\d)'", text)
    return max(set(found), key=found.count) if found else None


def extract(wheel, dest):
    """torch/include/* of the wheel into dest (torch/include/ stripped);
    returns the C++ standard its cpp_extension uses, or None."""
    prefix = "torch/include/"
    with zipfile.ZipFile(wheel) as z:
        std = cxx_standard(z)
        for info in z.infolist():
            if not info.filename.startswith(prefix) or info.is_dir():
                continue
            rel = info.filename[len(prefix):]
            target = os.path.join(dest, rel)
            if not os.path.abspath(target).startswith(os.path.abspath(dest) + os.sep):
                raise RuntimeError("%s: member %s leaves the folder" % (wheel, info.filename))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with z.open(info) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
    return std


def fetch(version, platform, force):
    folder = os.path.join(cache_dir(), version)
    if complete(version) and not force:
        print("torch_headers: %s already in %s" % (version, folder))
        return
    os.makedirs(cache_dir(), exist_ok=True)
    # The wheel and the partial extraction live beside the cache (same disk).
    with tempfile.TemporaryDirectory(prefix=".fetch-%s-" % version, dir=cache_dir()) as work:
        wheel = download(version, platform, work)
        size = os.path.getsize(wheel)
        staging = os.path.join(work, "include")
        std = extract(wheel, staging)
        os.remove(wheel)
        missing = [h for h in required_headers()
                   if not any(os.path.exists(os.path.join(staging, d, h)) for d in SEARCHED)]
        if missing:
            raise RuntimeError("torch %s (%s): the wheel lacks %s; try another --platform"
                               % (version, os.path.basename(wheel), ", ".join(missing)))
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        os.rename(staging, os.path.join(folder, "include"))
        if std:  # shim_compile.sh compiles with it, as cpp_extension would
            with open(os.path.join(folder, "cxx_std"), "w") as f:
                f.write(std + "\n")
        with open(os.path.join(folder, MARKER), "w") as f:
            f.write("%s\n" % os.path.basename(wheel))
    print("torch_headers: %s -> %s/include (from %s, %d MB, deleted)"
          % (version, folder, os.path.basename(wheel), size // 1000000))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("versions", nargs="*", help="torch versions (default: tests/torch/"
                   "torch_versions.txt)")
    p.add_argument("--platform", default="manylinux_2_28_x86_64",
                   help="the wheel's platform tag (default %(default)s)")
    p.add_argument("--force", action="store_true", help="fetch again what the cache holds")
    p.add_argument("--list", action="store_true", help="print the cache folder and its versions")
    a = p.parse_args(argv)
    versions = a.versions or listed_versions()
    if a.list:
        print("cache: %s" % cache_dir())
        for v in versions:
            print("%-8s %s" % (v, "present" if complete(v) else "absent"))
        return 0
    failed = 0
    for v in versions:
        try:
            fetch(v, a.platform, a.force)
        except (RuntimeError, OSError, zipfile.BadZipFile) as e:
            print("torch_headers: %s" % e, file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
