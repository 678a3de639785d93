"""test_kv.py: tidalloc.kv.KVCache on the host backend with CPU tensors
(TIDALLOC_CONF=backend:host; ctest sets it): appends equal torch.cat's
caches and return views of the cache's storage (no copy of earlier steps),
sliding windows in a ring equal torch.cat's last W steps, put, truncate,
reorder, rebatch, and static views read by a compiled function across
lengths without recompiling. Skipped without torch."""
import os
import sys

import pytest

torch = pytest.importorskip("torch", reason="tidalloc.kv needs torch (not installed here; "
                            "make test installs it into a cached virtual environment, "
                            "scripts/torch_venv.sh)")
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
from tidalloc import _lib  # noqa: E402
from tidalloc.kv import KVCache  # noqa: E402

if _lib.backend(0) != "host":
    pytest.skip("these tests need tidalloc's host backend (TIDALLOC_CONF=backend:host)",
                allow_module_level=True)


def steps(n, b=2, h=3, dk=8, dv=4, first=5, dtype_v=torch.float32, seed=0):
    """n appends: `first` steps, then one at a time."""
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        t = first if i == 0 else 1
        yield (torch.randn(b, h, t, dk, generator=g),
               torch.randn(b, h, t, dv, generator=g).to(dtype_v))


def storage_range(cache, which=0):
    """[start, end) addresses of the cache's keys (which=0) or values storage."""
    rows = cache._k if which == 0 else cache._v
    if cache.window is None:
        return rows.grow.data_ptr, rows.grow.data_ptr + rows.grow.capacity_rows * rows.row_bytes
    return rows.buf.data, rows.buf.data + 2 * rows.ring_bytes


def test_append_equals_cat_and_returns_views_of_fixed_storage():
    cache = KVCache(max_len=64)
    ref_k = ref_v = None
    earlier = []
    for k, v in steps(20, dtype_v=torch.bfloat16):
        keys, values = cache.append(k, v)
        ref_k = k if ref_k is None else torch.cat((ref_k, k), dim=2)
        ref_v = v if ref_v is None else torch.cat((ref_v, v), dim=2)
        assert torch.equal(keys, ref_k) and torch.equal(values, ref_v)
        assert values.dtype == torch.bfloat16 and keys.dtype == torch.float32
        # A view over the cache's storage, at the address it always had: an
        # append copied nothing that was there before.
        assert keys.data_ptr() == cache.data_ptrs()[0]
        assert values.data_ptr() == cache.data_ptrs()[1]
        assert keys.stride(-1) == 1 and values.stride(-1) == 1
        earlier.append(keys)
    assert len(cache) == cache.seen == 24 and keys.shape == (2, 3, 24, 8)
    # The first view still reads the storage: overwriting step 0 shows in it.
    cache.put(0, torch.zeros(2, 3, 1, 8), torch.zeros(2, 3, 1, 4))
    assert earlier[0][:, :, 0].abs().sum() == 0
    assert torch.equal(earlier[0][:, :, 1:], ref_k[:, :, 1:5])
    cache.close()


def test_default_map_ahead_holds_a_sixteenth_at_most():
    # A small cache maps a page when an append reaches it (nothing ahead
    # beyond its last partial page); a large one keeps pages mapped ahead,
    # never more than 4 MiB and a sixteenth of its length beyond it.
    import time
    small = KVCache(max_len=1 << 16)
    small.append(torch.zeros(1, 4, 1, 16), torch.zeros(1, 4, 1, 16))
    buf, row = small._k.grow._buf, small._k.row_bytes
    page = buf.mapped
    while len(small) * row < 3 * page:
        small.append(torch.zeros(1, 4, 97, 16), torch.zeros(1, 4, 97, 16))
        assert buf.mapped - len(small) * row < page, (buf.mapped, len(small) * row)
    small.close()
    large = KVCache(max_len=1 << 16)
    step = torch.zeros(1, 8, 512, 128)
    while len(large) * 4096 < 40 * page:
        large.append(step, step)
    buf, length = large._k.grow._buf, len(large) * 4096
    deadline = time.monotonic() + 10
    while buf.mapped < length + page and time.monotonic() < deadline:
        time.sleep(0.01)  # the worker maps ahead on its own thread
    assert length + page <= buf.mapped <= length + max(4 << 20, length // 16) + page
    large.close()


def test_dtype_stores_what_attention_reads():
    # K made in fp32, attention in bf16: a cache stored in bf16 gives the
    # attention exactly what converting the fp32 cache at every step gives it.
    wide, narrow = KVCache(max_len=64), KVCache(max_len=64, dtype=torch.bfloat16)
    q = torch.randn(2, 3, 1, 8).to(torch.bfloat16)
    for k, v in steps(12, dtype_v=torch.bfloat16):
        kw, vw = wide.append(k, v)
        kn, vn = narrow.append(k, v)
        assert kw.dtype == torch.float32 and kn.dtype == vn.dtype == torch.bfloat16
        assert torch.equal(kn, kw.to(torch.bfloat16)) and torch.equal(vn, vw)
        assert torch.equal(F.scaled_dot_product_attention(q, kn, vn),
                           F.scaled_dot_product_attention(q, kw.to(torch.bfloat16), vw))
    # Half the bytes a step for the keys.
    assert narrow._k.row_bytes * 2 == wide._k.row_bytes
    wide.close()
    narrow.close()


def test_sdpa_reads_the_views():
    cache = KVCache(max_len=32)
    ref_k = ref_v = None
    for k, v in steps(10, dv=8):
        keys, values = cache.append(k, v)
        ref_k = k if ref_k is None else torch.cat((ref_k, k), dim=2)
        ref_v = v if ref_v is None else torch.cat((ref_v, v), dim=2)
        q = torch.randn(2, 3, 1, 8)
        out = F.scaled_dot_product_attention(q, keys, values)
        assert torch.allclose(out, F.scaled_dot_product_attention(q, ref_k, ref_v), atol=1e-6)
    # Prefill-style: queries of the whole cache, causal.
    q = torch.randn(2, 3, len(cache), 8)
    assert torch.allclose(F.scaled_dot_product_attention(q, keys, values, is_causal=True),
                          F.scaled_dot_product_attention(q, ref_k, ref_v, is_causal=True),
                          atol=1e-6)
    cache.close()


@pytest.mark.parametrize("window", [1, 3, 7])
def test_window_equals_cat_then_last_w_in_the_ring(window):
    cache = KVCache(window=window)
    ref_k = ref_v = None
    g = torch.Generator().manual_seed(1)
    # Appends of 1 to 2 * window steps, past the ring's end many times.
    for i in range(60):
        t = 1 + (i * 5) % (2 * window)
        k = torch.randn(2, 3, t, 8, generator=g)
        v = torch.randn(2, 3, t, 4, generator=g)
        keys, values = cache.append(k, v)
        ref_k = (k if ref_k is None else torch.cat((ref_k, k), dim=2))[:, :, -window:]
        ref_v = (v if ref_v is None else torch.cat((ref_v, v), dim=2))[:, :, -window:]
        assert torch.equal(keys, ref_k) and torch.equal(values, ref_v), i
        lo, hi = storage_range(cache, 0)
        end = keys.data_ptr() + keys.shape[2] * keys.stride(2) * keys.element_size()
        assert lo <= keys.data_ptr() and end <= hi, "a view of the ring, not a copy"
    assert len(cache) == window
    cache.close()


def test_window_wraps_a_ring_that_is_not_a_multiple_of_the_step():
    # 3 * 5 * 7 floats a step: the ring's 2 MiB holds no whole number of them,
    # so steps straddle its end and are read through the second mapping.
    cache = KVCache(window=1000)
    row_bytes = 3 * 5 * 7 * 4
    assert (2 << 20) % row_bytes != 0
    ref = None
    g = torch.Generator().manual_seed(2)
    for i in range(60):
        k = torch.randn(3, 5, 200, 7, generator=g)
        keys, _ = cache.append(k, k)
        ref = (k if ref is None else torch.cat((ref, k), dim=2))[:, :, -1000:]
        assert torch.equal(keys, ref), i
    cache.close()


def test_truncate_reorder_rebatch_reset():
    cache = KVCache(max_len=40)
    ref_k = None
    for k, v in steps(6):
        cache.append(k, v)
        ref_k = k if ref_k is None else torch.cat((ref_k, k), dim=2)
    cache.truncate(7)
    assert len(cache) == 7 and torch.equal(cache.keys, ref_k[:, :, :7])
    k, v = torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2, 4)
    keys, _ = cache.append(k, v)
    assert torch.equal(keys, torch.cat((ref_k[:, :, :7], k), dim=2))
    ptr = keys.data_ptr()
    before = keys.clone()
    idx = torch.tensor([1, 0])
    cache.reorder(idx)
    assert torch.equal(cache.keys, before[idx]) and cache.keys.data_ptr() == ptr
    cache.rebatch(torch.tensor([0, 0, 1]))
    assert cache.keys.shape == (3, 3, 9, 8)
    assert torch.equal(cache.keys, before[idx][torch.tensor([0, 0, 1])])
    cache.reset()
    assert len(cache) == 0 and cache.keys.shape == (3, 3, 0, 8)
    cache.close()


def test_errors_say_what_is_wrong():
    with pytest.raises(ValueError, match="max_len"):
        KVCache()
    cache = KVCache(max_len=4)
    cache.append(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
    with pytest.raises(ValueError, match="beyond max_len=4"):
        cache.append(torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8))
    with pytest.raises(ValueError, match="the cache holds"):
        cache.append(torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8))
    with pytest.raises(ValueError, match="not all held"):
        cache.put(3, torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
    cache.close()
    with pytest.raises(ValueError, match="only on a growing cache"):
        w = KVCache(window=4)
        w.append(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
        w.put(0, torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))


def test_static_view_is_read_by_one_compiled_function_across_lengths():
    """A compiled step reads fixed-shape views of the first `bucket` steps
    (their pages mapped now) and a mask from a length tensor: appends fill
    the views in place, so one compilation serves every length up to the
    bucket, and each output equals attention over the exact cache."""
    cache = KVCache(max_len=256)
    first_k, first_v = torch.randn(1, 4, 3, 16), torch.randn(1, 4, 3, 16)
    cache.append(first_k, first_v)
    bucket = 64
    keys, values = cache.static_view(bucket)
    assert keys.shape == (1, 4, bucket, 16) and keys.data_ptr() == cache.data_ptrs()[0]
    length = torch.tensor(len(cache))
    positions = torch.arange(bucket)

    def step(q, keys, values, length):
        mask = (positions < length).view(1, 1, 1, bucket)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)

    from torch._dynamo.testing import CompileCounter
    counter = CompileCounter()  # counts the graphs dynamo compiles
    compiled = torch.compile(step, backend=counter, dynamic=False, fullgraph=True)
    g = torch.Generator().manual_seed(3)
    for _ in range(40):
        k, v = torch.randn(1, 4, 1, 16, generator=g), torch.randn(1, 4, 1, 16, generator=g)
        exact_k, exact_v = cache.append(k, v)
        length.fill_(len(cache))
        q = torch.randn(1, 4, 1, 16, generator=g)
        out = compiled(q, keys, values, length)
        assert torch.allclose(out, F.scaled_dot_product_attention(q, exact_k, exact_v),
                              atol=1e-6)
    assert counter.frame_count == 1, "compiled %d times" % counter.frame_count
    assert keys.data_ptr() == cache.keys.data_ptr()
    with pytest.raises(ValueError, match="only on a growing cache"):
        KVCache(window=4).static_view(4)
    cache.close()


def test_kv_decode_bench_runs_on_the_host(tmp_path):
    # bench/torch/kv_decode.py on the CPU: a row per window and cache kind.
    import csv
    import subprocess
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    out = tmp_path / "kv_decode.csv"
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "python"))
    subprocess.run([sys.executable, os.path.join(root, "bench", "torch", "kv_decode.py"),
                    "--device", "cpu", "--tokens", "64", "--window", "32", "--layers", "2",
                    "--heads", "2", "--head-dim", "8", "--csv", str(out)],
                   check=True, env=env, capture_output=True, timeout=120)
    rows = list(csv.DictReader(open(out)))
    assert [(r["cache"], r["tokens"]) for r in rows] == [
        ("cat", "64"), ("cat", "96"), ("kvcache", "64"), ("kvcache", "96")]
    assert all(float(r["wall_us_per_step"]) > 0 for r in rows)
