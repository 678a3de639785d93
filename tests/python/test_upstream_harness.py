"""test_upstream_harness.py: the harness that runs PyTorch's own tests under
tidalloc (tests/torch/upstream) refuses to run when tidalloc was asked for
and is not installed, instead of reporting the native allocator's results
under tidalloc's name; and says which allocator ran. Skipped without torch."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="the harness needs torch (not installed here)")
HERE = os.path.dirname(os.path.abspath(__file__))
UPSTREAM = os.path.join(HERE, "..", "torch", "upstream")
PYTHON = os.path.join(HERE, "..", "..", "python")


def run_pytest(tmp_path, environ):
    (tmp_path / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([UPSTREAM, PYTHON]), **environ)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "upstream_compat",
                           "-p", "no:cacheprovider", "test_nothing.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_a_run_that_asked_for_tidalloc_stops_when_it_is_missing(tmp_path):
    r = run_pytest(tmp_path, {"TIDALLOC_INSTALL": "1",
                              "TIDALLOC_LIB": str(tmp_path / "missing" / "libtidalloc.so")})
    assert r.returncode == 3, r.stdout + r.stderr
    assert "tidalloc was asked for but" in r.stdout + r.stderr
    assert "1 passed" not in r.stdout


def test_the_native_run_says_so(tmp_path):
    r = run_pytest(tmp_path, {"TIDALLOC_INSTALL": "0"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "allocator: PyTorch's own" in r.stdout


def test_the_allocator_line_is_written_under_q(tmp_path):
    (tmp_path / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([UPSTREAM, PYTHON]), TIDALLOC_INSTALL="0")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "upstream_compat",
                        "-p", "no:cacheprovider", "test_nothing.py"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "allocator: PyTorch's own" in r.stdout, r.stdout + r.stderr
