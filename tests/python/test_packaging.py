"""How the package finds its library and what `python -m tidalloc` says,
each in a fresh interpreter (the library is loaded once per process)."""
import os
import subprocess
import sys

import pytest

PYTHON_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python")


def run(args, env_changes, cwd=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = PYTHON_DIR
    for key, value in env_changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return subprocess.run([sys.executable] + args, env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=60)


def test_missing_tidalloc_lib_is_an_error_naming_it(tmp_path):
    missing = str(tmp_path / "no_such_libtidalloc.so")
    r = run(["-c", "import tidalloc; print(tidalloc.library_path())"], {"TIDALLOC_LIB": missing})
    assert r.returncode != 0
    assert missing in r.stderr
    assert "does not exist" in r.stderr


def test_tidalloc_lib_is_used_when_it_exists():
    lib = os.environ.get("TIDALLOC_LIB")
    if not lib:
        pytest.skip("TIDALLOC_LIB is not set (ctest sets it)")
    r = run(["-c", "import tidalloc; print(tidalloc.library_path())"], {})
    assert r.returncode == 0, r.stderr
    assert os.path.samefile(r.stdout.strip(), lib)


def test_help_says_run_needs_pytorch(tmp_path):
    r = run(["-m", "tidalloc", "--help"], {}, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "PyTorch" in r.stdout and "run" in r.stdout


def test_run_without_pytorch_says_so_in_one_line(tmp_path):
    probe = run(["-c", "import importlib.util, sys; "
                 "sys.exit(0 if importlib.util.find_spec('torch') else 1)"], {})
    if probe.returncode == 0:
        pytest.skip("torch is installed here")
    script = tmp_path / "script.py"
    script.write_text("print('ran')\n")
    r = run(["-m", "tidalloc", "run", str(script)], {}, cwd=str(tmp_path))
    assert r.returncode != 0
    assert "ran" not in r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "PyTorch" in lines[0]
