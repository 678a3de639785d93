"""tidalloc.shim without a GPU: what install() does when the shim cannot be
built (one warning naming the reason, then the pluggable path), the reasons
given, and, where a torch with CUDA headers is installed, that the shim
builds and loads (its entry points answer)."""
import os
import subprocess
import sys

import pytest

PYTHON_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python")
sys.path.insert(0, PYTHON_DIR)

from tidalloc import shim  # noqa: E402


def _has_torch():
    try:
        import torch  # noqa: F401
        return True
    except ImportError:
        return False


def test_unavailable_names_a_reason_or_none():
    why = shim.unavailable()
    if not _has_torch():
        assert why and "PyTorch is not installed" in why
    else:
        assert why is None or isinstance(why, str) and why


def test_missing_compiler_is_the_reason(monkeypatch):
    if not _has_torch():
        pytest.skip("no torch here: the first reason is PyTorch itself")
    import torch
    if torch.version.cuda is None:
        pytest.skip("this torch is built without CUDA")
    monkeypatch.setenv("CXX", "no-such-compiler-for-tidalloc")
    why = shim.unavailable()
    assert why and "no-such-compiler-for-tidalloc" in why


def test_build_refuses_with_the_reason(monkeypatch):
    monkeypatch.setattr(shim, "unavailable", lambda any_version=False: "a reason for the test")
    with pytest.raises(shim.ShimUnavailable, match="a reason for the test"):
        shim.build()


def test_install_falls_back_with_one_warning():
    """In a fresh process: the shim made unavailable, install() warns once
    with the reason and installs the pluggable path (the fallback's own
    call into PyTorch needs no GPU)."""
    if not _has_torch():
        pytest.skip("tidalloc.torch needs torch")
    code = r'''
import warnings
import tidalloc.shim as shim
shim.unavailable = lambda any_version=False: "no compiler in this test"
import tidalloc.torch as tt
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    tt.install()
msgs = [str(x.message) for x in w if "tidalloc" in str(x.message)]
print(len(msgs), tt.bridge())
print(msgs[0])
'''
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR, TIDALLOC_CONF="backend:host")
    env.pop("TIDALLOC_TORCH_BRIDGE", None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    first, message = r.stdout.splitlines()[:2]
    assert first == "1 pluggable"
    assert "no compiler in this test" in message and "reduce-overhead" in message


def test_shim_builds_and_loads(tmp_path):
    """Only where a torch with CUDA's headers and a compiler are installed
    (about 15 s the first time)."""
    if shim.unavailable():
        pytest.skip("the shim cannot be built here: %s" % shim.unavailable())
    code = r'''
import tidalloc.shim as shim
lib = shim.load()
print(lib.tidalloc_torch_built_for().decode())
print(sorted(shim.counts()) == sorted(shim.COUNT_NAMES))
'''
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR, TIDALLOC_CACHE=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    import torch
    built_for, names_ok = r.stdout.split()[-2:]
    assert torch.__version__.startswith(built_for)
    assert names_ok == "True"


def _macro_calls(text, names):
    """(macro, [argument text, ...]) for each call of the named macros in C++
    source, split at the commas outside parentheses and string literals."""
    import re
    for m in re.finditer(r"\b(%s)\(" % "|".join(names), text):
        args, cur, depth, quote, i = [], "", 1, None, m.end()
        while depth:
            c = text[i]
            if quote:
                if c == "\\":
                    cur, i = cur + text[i:i + 2], i + 2
                    continue
                quote = None if c == quote else quote
            elif c in "\"'":
                quote = c
            elif c == "(":
                depth += 1
            elif c == ")":
                depth -= 1
                if not depth:
                    break
            elif c == "," and depth == 1:
                args.append(cur)
                cur, i = "", i + 1
                continue
            cur, i = cur + c, i + 1
        args.append(cur)
        yield m.group(1), [a.strip() for a in args]


def test_shim_messages_are_one_string():
    """Every TORCH_CHECK and TORCH_WARN of the shim passes its message as one
    argument (a literal or msg(...)): several would make c10::str format them
    through std::ostream in the shim's code, which crashed the process on a
    number where the shim carries its own copy of libstdc++."""
    source = os.path.join(PYTHON_DIR, "tidalloc", "shim", "tidalloc_torch.cpp")
    with open(source) as f:
        text = "\n".join(line for line in f.read().splitlines()
                         if not line.lstrip().startswith("//"))
    skip = {"TORCH_CHECK_WITH": 2, "TORCH_CHECK": 1, "TORCH_WARN": 0, "TORCH_WARN_ONCE": 0}
    calls = list(_macro_calls(text, sorted(skip, key=len, reverse=True)))
    assert len(calls) > 20
    for name, args in calls:
        message = args[skip[name]:]
        assert len(message) == 1 and (message[0].startswith('"') or
                                      message[0].startswith("msg(")), (name, args)
