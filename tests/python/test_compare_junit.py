"""test_compare_junit.py: tests/torch/upstream/compare_junit.py tells the
tests that pass under PyTorch's allocator only apart from those known to
inspect its internals, and writes the others for a rerun alone."""
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch", "upstream",
                      "compare_junit.py")


def junit(path, outcomes):
    cases = []
    for name, outcome in outcomes.items():
        cls, test = name.split("::")
        body = {"passed": "", "failed": '<failure message="AssertionError: no"/>',
                "skipped": '<skipped message="no GPU"/>'}[outcome]
        cases.append('<testcase classname=".upstream.test.test_cuda.%s" name="%s">%s</testcase>'
                     % (cls, test, body))
    path.write_text('<testsuites><testsuite>%s</testsuite></testsuites>' % "".join(cases))
    return str(path)


def test_unexplained_native_only_passes_are_written_for_a_rerun(tmp_path):
    native = junit(tmp_path / "n.xml", {"TestCuda::test_a": "passed", "TestCuda::test_b": "passed",
                                        "TestMemPool::test_c": "passed",
                                        "TestCuda::test_d": "failed"})
    tidalloc = junit(tmp_path / "t.xml", {"TestCuda::test_a": "passed",
                                          "TestCuda::test_b": "failed",
                                          "TestMemPool::test_c": "failed",
                                          "TestCuda::test_d": "failed"})
    known = tmp_path / "known.txt"
    known.write_text("# comment\ntest_b  counts the native allocator's segments\n")
    rerun = tmp_path / "rerun.txt"
    r = subprocess.run([sys.executable, SCRIPT, native, tidalloc, "--known", str(known),
                        "--unexplained", str(rerun)], capture_output=True, text=True)
    assert r.returncode == 1, r.stdout + r.stderr  # one failure is not explained
    assert "pass under native only: 2 (1 named as inspecting native internals, 1 not)" in r.stdout
    assert rerun.read_text() == "TestMemPool::test_c\n"


def test_nothing_unexplained_writes_an_empty_list(tmp_path):
    same = {"TestCuda::test_a": "passed", "TestCuda::test_e": "skipped"}
    rerun = tmp_path / "rerun.txt"
    r = subprocess.run([sys.executable, SCRIPT, junit(tmp_path / "n.xml", same),
                        junit(tmp_path / "t.xml", same), "--unexplained", str(rerun)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert rerun.read_text() == ""
