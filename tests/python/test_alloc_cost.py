"""test_alloc_cost.py: the trace reading and the summary of
tests/torch/alloc_cost.py (no torch, no GPU)."""
import gzip
import os

import pytest
from repo_module import load

HERE = os.path.dirname(os.path.abspath(__file__))
alloc_cost = load("tests/torch/alloc_cost.py")


def write_trace(path, rows):
    with gzip.open(path, "wt") as f:
        f.write("t_us,action,addr,size,stream\n")
        for row in rows:
            f.write(",".join(str(x) for x in row) + "\n")


def test_slots_are_dense_and_reused(tmp_path):
    path = str(tmp_path / "t.csv.gz")
    write_trace(path, [(0, "alloc", 100, 512, 0), (1, "alloc", 200, 1024, 0),
                       (2, "free", 100, 512, 0), (3, "alloc", 100, 2048, 0),
                       (4, "free", 200, 1024, 0), (5, "free", 100, 2048, 0)])
    ops, nslots = alloc_cost.load_trace(path)
    assert nslots == 2
    assert ops == [(0, 512), (1, 1024), (0, -1), (0, 2048), (1, -1), (0, -1)]


def test_live_address_allocated_again_is_an_error(tmp_path):
    path = str(tmp_path / "t.csv.gz")
    write_trace(path, [(0, "alloc", 100, 512, 0), (1, "alloc", 100, 512, 0)])
    with pytest.raises(ValueError):
        alloc_cost.load_trace(path)


def test_committed_trace_replays_its_slots():
    trace = os.path.join(HERE, "..", "..", "bench", "traces", "gpt2_b1_512_run1.csv.gz")
    ops, nslots = alloc_cost.load_trace(trace)
    live = set()
    for slot, size in ops:
        if size >= 0:
            assert slot not in live and slot < nslots
            live.add(slot)
        else:
            live.remove(slot)
    assert len(ops) > 300000


def test_summary_takes_each_workers_best_and_the_median():
    rows = {(0, "a"): [110.0, 100.0], (0, "b"): [130.0, 120.0],
            (1, "b"): [125.0, 126.0], (1, "a"): [104.0, 108.0],
            (2, "a"): [300.0, 200.0], (2, "b"): [122.0, 140.0]}
    med, lines = alloc_cost.summarize(rows, ["a", "b"], 1000000, 2.0)
    assert med == {"a": 104.0, "b": 122.0}
    assert "+18.0 ns per event" in lines[-1]
    assert "+18.0 ms" in lines[-1]
    assert "+0.90% of a 2.00 s run" in lines[-1]
