"""test_two_process.py: bench/torch/two_process.py's rounds and summary,
from rows alone (the runs themselves need a GPU)."""
import io

from repo_module import load

tp = load("bench/torch/two_process.py")


def test_rounds_reverse_the_order_every_other_round():
    assert tp.round_orders(["expandable", "tidalloc"], 3) == [
        ["expandable", "tidalloc"], ["tidalloc", "expandable"], ["expandable", "tidalloc"]]
    assert tp.round_orders(["a"], 2) == [["a"], ["a"]]


def rows(allocator, rnd, walls, margin=1.02, statuses=("ok", "ok")):
    return [dict(allocator=allocator, process=k, status=s, wall_s="" if s != "ok" else str(w),
                 margin=str(margin), round=str(rnd))
            for k, (w, s) in enumerate(zip(walls, statuses))]


def test_makespan_is_the_later_process_and_needs_both():
    assert tp.makespan(rows("x", 0, (6.0, 7.5))) == 7.5
    assert tp.makespan(rows("x", 0, (6.0, 0), statuses=("ok", "oom"))) is None
    assert tp.makespan(rows("x", 0, (6.0,))) is None


def test_summary_pairs_rounds_and_counts_completions():
    table = (rows("expandable", 0, (6.0, 8.0)) + rows("tidalloc", 0, (6.5, 7.6))
             + rows("tidalloc", 1, (7.0, 7.2)) + rows("expandable", 1, (7.0, 8.0))
             + rows("expandable", 2, (6.0, 0), statuses=("ok", "oom"))
             + rows("tidalloc", 2, (6.0, 6.6))
             + rows("expandable", 0, (5.0, 5.0), margin=1.06)
             + rows("tidalloc", 0, (5.5, 5.5), margin=1.06))
    out = io.StringIO()
    tp.summarize(table, out)
    lines = out.getvalue().splitlines()
    assert lines[0] == "margin 1.02: completed expandable 5 of 6, tidalloc 6 of 6"
    # rounds 0 and 1 completed under both: 7.6 / 8.0 and 7.2 / 8.0
    assert lines[1] == "  tidalloc / expandable makespan: 0.950 0.900 (median 0.925 over 2 rounds)"
    assert lines[2] == "margin 1.06: completed expandable 2 of 2, tidalloc 2 of 2"
    assert lines[3] == "  tidalloc / expandable makespan: 1.100 (median 1.100 over 1 rounds)"


def test_summary_says_when_no_round_completed_under_both():
    out = io.StringIO()
    tp.summarize(rows("expandable", 0, (6.0, 0), statuses=("ok", "oom"))
                 + rows("tidalloc", 0, (6.0, 6.0)), out)
    assert "no round where both pairs completed" in out.getvalue()
