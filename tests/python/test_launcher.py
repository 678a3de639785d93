"""test_launcher.py: `python -m tidalloc`'s answers to a user's mistakes,
without torch: a script that does not exist, a bad --conf, an unknown option,
no script at all: one line on stderr, no traceback, exit status 2. And the
documented rule, said in --help: options after the script's name are the
script's (checked with the stand-in torch of fake_torch.py)."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.join(HERE, "..", "..", "python")
sys.path.insert(0, HERE)
from fake_torch import launch  # noqa: E402


def tidalloc(*args, cwd=None):
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR)
    return subprocess.run([sys.executable, "-m", "tidalloc"] + list(args), env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=60)


def one_line_error(r):
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stdout == ""
    assert "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_missing_script(tmp_path):
    line = one_line_error(tidalloc("run", "missing.py", cwd=str(tmp_path)))
    assert line == "python -m tidalloc run: missing.py: no such file"


def test_bad_conf_names_the_key_and_what_is_accepted(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    line = one_line_error(tidalloc("run", "--conf", "memory_fraction:abc", str(script)))
    assert line.startswith("python -m tidalloc run: --conf: ")
    assert 'bad value "abc" for memory_fraction' in line and "accepted:" in line


def test_unknown_key_in_conf(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    line = one_line_error(tidalloc("run", "--conf", "no_such_key:1", str(script)))
    assert line.startswith("python -m tidalloc run: --conf: ") and "no_such_key" in line


@pytest.mark.parametrize("args, words", [
    (["run", "--bogus", "s.py"], "unknown option --bogus"),
    (["run", "--conf"], "argument --conf: expected one argument"),
    (["run"], "no script named"),
    (["info", "--bogus"], "unknown option --bogus"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    ([], "the following arguments are required: command"),
])
def test_bad_command_lines(tmp_path, args, words):
    (tmp_path / "s.py").write_text("print('ran')\n")
    line = one_line_error(tidalloc(*args, cwd=str(tmp_path)))
    assert line.startswith("python -m tidalloc")
    assert words in line, line


def test_help_says_the_rule():
    r = tidalloc("run", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "usage: python -m tidalloc run [options] script [script args]" in text
    assert "everything after it is the script's" in text


def test_options_after_the_script_are_the_scripts(tmp_path):
    r = launch(tmp_path, "2.7.1", "run", "script.py", "--conf", "release_slack:abc", "--report",
               "x.json")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "script ran ['--conf', 'release_slack:abc', '--report', 'x.json']\n"
    assert not (tmp_path / "x.json").exists()


def test_retired_key_named_in_one_line(tmp_path):
    """release_slack and its followers no longer do anything: the run goes
    on, and one line says so (here the missing torch ends it after)."""
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    r = tidalloc("run", "--conf", "release_slack:0.02", str(script))
    assert "Traceback" not in r.stderr
    notice = [line for line in r.stderr.splitlines() if "release_slack" in line]
    assert len(notice) == 1, r.stderr
    assert notice[0].startswith("tidalloc: ") and "has no effect" in notice[0]
    r = tidalloc("run", "--conf", "memory_limit:1GiB", str(script))
    assert "has no effect" not in r.stderr
