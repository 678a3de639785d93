"""test_attention_cost.py: bench/torch/attention_cost.py on the CPU (tiny
shapes): a row per shape, kernel, way of calling and layout, the cache's
layout as KVCache's views, and a kernel that refuses its inputs recorded as
refused, not a failure. Skipped without torch."""
import csv

import pytest
from repo_module import load

torch = pytest.importorskip("torch", reason="attention_cost.py needs torch (not installed here)")
ac = load("bench/torch/attention_cost.py")


def test_kvcache_layout_has_kvcaches_strides():
    gen = torch.Generator().manual_seed(0)
    t = ac.cache_tensor("kvcache", 2, 3, 5, 4, torch.float32, torch.device("cpu"), gen)
    assert t.shape == (2, 3, 5, 4) and t.stride() == (3 * 4, 4, 2 * 3 * 4, 1)
    c = ac.cache_tensor("contiguous", 2, 3, 5, 4, torch.float32, torch.device("cpu"), gen)
    assert c.is_contiguous()


def test_rows_for_every_combination(tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "cost.csv"
    assert ac.main(["--device", "cpu", "--tiny", "--kernels", "math", "cudnn", "--calls", "3",
                    "--csv", str(out)]) == 0
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 2 * 2 * 2  # shapes x kernels x lengths x layouts
    for r in rows:
        if r["kernel"] == "math":
            assert r["status"] == "ok" and float(r["ms_per_call"]) > 0, r
        else:  # no cuDNN on a CPU: the kernel refuses, the row says so
            assert r["status"] == "refused" and r["ms_per_call"] == "" and r["error"], r
    assert {(r["lengths"], r["layout"]) for r in rows} == {
        (n, lay) for n in ("same", "new") for lay in ("contiguous", "kvcache")}


def test_calls_must_be_positive():
    with pytest.raises(SystemExit):
        ac.parse_args(["--calls", "0"])
