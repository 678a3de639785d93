"""test_frontier.py: bench/torch/frontier.py's --refine caps (the grid step
that holds expandable segments' and tidalloc's tightest completing caps,
cut evenly) and --summarize's ordering, from rows alone (no GPU)."""
from repo_module import load

frontier = load("bench/torch/frontier.py")


def rows(*runs):
    return [dict(program="p", allocator=a, cap=c, status=s) for a, c, s in runs]


def test_refine_cuts_the_step_both_share():
    got = frontier.refine_caps(rows(("expandable", "1.00", "oom"), ("tidalloc", "1.00", "oom"),
                                    ("expandable", "1.01", "ok"), ("tidalloc", "1.01", "ok"),
                                    ("native", "1.01", "oom")), "p", 3)
    assert got == ["1.0025", "1.0050", "1.0075"]


def test_refine_spans_both_steps_and_skips_caps_tried():
    # tidalloc completes a step lower: the refined caps run from the cap
    # tidalloc failed at to the one expandable segments needed, less those
    # already run.
    got = frontier.refine_caps(rows(("tidalloc", "1.01", "oom"), ("tidalloc", "1.02", "ok"),
                                    ("expandable", "1.02", "oom"), ("expandable", "1.03", "ok")),
                               "p", 3)
    assert got == ["1.0150", "1.0250"]


def test_nothing_to_refine_without_a_failure_below_or_a_completion():
    assert frontier.refine_caps(rows(("expandable", "1.02", "ok"), ("tidalloc", "1.02", "ok")),
                                "p", 3) == []
    assert frontier.refine_caps(rows(("expandable", "1.02", "oom"), ("tidalloc", "1.01", "oom"),
                                     ("tidalloc", "1.02", "ok")), "p", 3) == []
    assert frontier.refine_caps(rows(("expandable", "1.00", "oom"), ("expandable", "1.01", "ok"),
                                     ("tidalloc", "none", "ok")), "p", 2) == []


def test_summary_orders_caps_by_value(tmp_path, capsys):
    path = tmp_path / "f.csv"
    frontier.write_rows(str(path), [
        {"program": "p", "allocator": a, "cap": c, "status": "ok", "wall_s": "1.0"}
        for a, c in (("expandable", "1.01"), ("tidalloc", "1.0025"), ("expandable", "none"))])
    frontier.summarize(str(path))
    out = capsys.readouterr().out
    assert out.index("cap none") < out.index("cap 1.0025") < out.index("cap 1.01")
