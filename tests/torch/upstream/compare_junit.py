"""compare_junit.py: PyTorch's tests under its own allocator and under
tidalloc, side by side, from the JUnit XML files pytest wrote.
  python compare_junit.py native.xml tidalloc.xml [--known known.txt]
Prints the counts of each (passed, failed, skipped, errors), every test
whose outcome differs, and last the tests that pass under the native
allocator only. --known names tests (one per line, "name  reason") that
inspect the native allocator's internals: they are listed apart. --common
compares only the tests both runs reached (runs stopped by a time limit
write the tests they finished). --unexplained FILE writes the tests that
pass under the native allocator only and are not known, one "Class::test"
a line, for a rerun of each alone: a test run after others in one worker
process can fail from what they left behind (a graph kept alive by a
reference cycle until the next collection), and the two allocators' runs
hand tests to their workers in different orders."""
import argparse
import sys
import xml.etree.ElementTree as ET


def outcomes(path):
    res = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = "%s::%s" % (case.get("classname", ""), case.get("name", ""))
        kind = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                kind = "failed"
                msg = (child.get("message") or "").splitlines()
                res[name] = (kind, msg[0][:200] if msg else "")
                break
            if child.tag == "skipped":
                kind = "skipped"
        res.setdefault(name, (kind, ""))
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("native")
    p.add_argument("tidalloc")
    p.add_argument("--known")
    p.add_argument("--common", action="store_true",
                   help="compare only the tests that both runs reached")
    p.add_argument("--unexplained", metavar="FILE",
                   help="write the unexplained native-only passes here (Class::test a line)")
    a = p.parse_args()
    n, t = outcomes(a.native), outcomes(a.tidalloc)
    if a.common:  # runs cut short: compare the tests both ran
        both = set(n) & set(t)
        n = {k: v for k, v in n.items() if k in both}
        t = {k: v for k, v in t.items() if k in both}
    known = {}
    if a.known:
        for line in open(a.known):
            if line.strip() and not line.startswith("#"):
                name, _, why = line.strip().partition("  ")
                known[name] = why.strip()
    for label, res in (("native", n), ("tidalloc", t)):
        c = {k: sum(1 for v in res.values() if v[0] == k) for k in ("passed", "failed", "skipped")}
        print("%-9s %4d passed, %4d failed, %4d skipped (%d tests)"
              % (label, c["passed"], c["failed"], c["skipped"], len(res)))
    only_native = []
    for name in sorted(set(n) | set(t)):
        a_, b_ = n.get(name, ("absent", "")), t.get(name, ("absent", ""))
        if a_[0] != b_[0]:
            print("%-10s %-10s %s  %s" % (a_[0], b_[0], name, b_[1] or a_[1]))
            if a_[0] == "passed":
                only_native.append(name)
    unexplained = [x for x in only_native if x.split("::")[-1] not in known and x not in known]
    print("pass under native only: %d (%d named as inspecting native internals, %d not)"
          % (len(only_native), len(only_native) - len(unexplained), len(unexplained)))
    if a.unexplained:
        with open(a.unexplained, "w") as f:
            for name in unexplained:
                f.write("%s::%s\n" % (name.split("::")[0].rsplit(".", 1)[-1], name.split("::")[-1]))
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
