"""native_shim.py: CUDA graphs and torch.compile(mode="reduce-overhead") with
tidalloc as PyTorch's own allocator (the shim), against PyTorch's allocator.

One process per allocator (the allocator is chosen before CUDA starts):
  python tests/torch/native_shim.py --allocator tidalloc --out t.pt
  python tests/torch/native_shim.py --allocator native --out n.pt
  python tests/torch/native_shim.py --compare n.pt t.pt
Each case checks what it can alone (replays equal eager, fillers intact,
memory given back, checkpoints taken, no growth) and saves its outputs; the
compare step checks that both allocators gave the same outputs, and prints
the memory and time figures of the growing-KV model side by side.

Cases: graph capture and replay with allocations between replays; two
graphs sharing a pool; make_graphed_callables; torch.cuda.MemPool with
use_mem_pool; a pool's memory back when its graphs are deleted; compiled
(reduce-overhead) training step; compiled decoding with a KV cache grown by
torch.cat every step, replayed and then grown further so that cudagraph
trees checkpoint and restore the pool (the case fails if they never do);
dynamic shapes that re-record; 1000 compiled steps with no growth; the
statistics and snapshot; MemPools with their own allocator under a memory
fraction (PyTorch's test_mempool_limited_memory_with_allocator), and a
tensor that outlives its pool and the pool's allocator, and such a pool's
memory split, waiting on streams and in the figures; with
graph_capture_record_stream_reuse, a block freed after record_stream reused
in the same capture once its streams joined, not before (PyTorch's
test_graph_capture_reclaim_2_streams and _4_streams). Exit status 1 if a
case failed."""
import argparse
import gc
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

MiB = 1 << 20


def setup(allocator):
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if allocator == "tidalloc":
        import tidalloc.torch
        tidalloc.torch.install(bridge=os.environ.get("TIDALLOC_TORCH_BRIDGE", "shim"))
    import torch
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch


class Failed(AssertionError):
    pass


def check(cond, what):
    if not cond:
        raise Failed(what)


# ---------------------------------------------------------------------------
# Plain CUDA graphs
# ---------------------------------------------------------------------------

def mlp(torch, width=512):
    return torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                               torch.nn.Linear(4 * width, width)).cuda()


def case_graph_replay(torch, out):
    model = mlp(torch)
    static_in = torch.randn(64, 512, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            model(static_in)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g):
        static_out = model(static_in)
    fillers, results = [], []
    for i in range(5):
        # Allocations between replays, of the sizes the capture freed and others.
        for size in (64 * 2048 * 4, 64 * 512 * 4, 3 * MiB, 17 * 1024):
            t = torch.full((size // 4,), float(i + 1), device="cuda")
            fillers.append((t, float(i + 1)))
        x = torch.randn(64, 512, device="cuda")
        static_in.copy_(x)
        g.replay()
        with torch.no_grad():
            ref = model(x)
        check(torch.equal(static_out, ref), "replay %d differs from eager" % i)
        results.append(static_out.clone())
        if len(fillers) > 8:
            fillers = fillers[4:]
    torch.cuda.synchronize()
    for t, v in fillers:
        check(bool((t == v).all()), "a tensor allocated between replays was overwritten")
    out["graph_replay"] = torch.stack(results).cpu()


def case_shared_pool(torch, out):
    a, b = mlp(torch, 256), mlp(torch, 256)
    xa, xb = torch.randn(32, 256, device="cuda"), torch.randn(32, 256, device="cuda")
    for m, x in ((a, xa), (b, xb)):
        with torch.no_grad():
            m(x)
    g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.no_grad():
        with torch.cuda.graph(g1):
            ya = a(xa)
        with torch.cuda.graph(g2, pool=g1.pool()):
            yb = b(ya + xb)
    res = []
    for i in range(4):
        xa.copy_(torch.randn(32, 256, device="cuda"))
        xb.copy_(torch.randn(32, 256, device="cuda"))
        g1.replay()
        g2.replay()
        with torch.no_grad():
            ref_a = a(xa)
            ref_b = b(ref_a + xb)
        check(torch.equal(ya, ref_a) and torch.equal(yb, ref_b), "shared-pool replay %d" % i)
        res.append(yb.clone())
    out["shared_pool"] = torch.stack(res).cpu()


def case_graphed_callables(torch, out):
    torch.manual_seed(1)
    model = mlp(torch, 128)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 128, device="cuda", requires_grad=False)
    graphed = torch.cuda.make_graphed_callables(model, (x,))
    losses = []
    for i in range(10):
        xi = torch.randn(16, 128, device="cuda")
        loss = graphed(xi).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    out["graphed_callables"] = torch.stack(losses).cpu()
    out["graphed_callables_w"] = model[0].weight.detach().cpu()


def case_mempool(torch, out):
    if not hasattr(torch.cuda, "MemPool"):
        out["mempool"] = "skipped: no torch.cuda.MemPool"
        return
    pool = torch.cuda.MemPool()
    check(pool.use_count() >= 1, "a new MemPool has a user")
    with torch.cuda.use_mem_pool(pool):
        xs = [torch.randn(n, device="cuda") for n in (1000, 300_000, 3_000_000)]
    y = torch.randn(1000, device="cuda")  # outside: the usual memory
    segs = pool.snapshot()
    in_pool = sum(s["total_size"] for s in segs)
    check(in_pool >= sum(x.numel() * 4 for x in xs), "the pool's snapshot holds its tensors")
    addrs = [(s["address"], s["address"] + s["total_size"]) for s in segs]
    inside = lambda p: any(lo <= p < hi for lo, hi in addrs)
    check(all(inside(x.data_ptr()) for x in xs), "tensors made under use_mem_pool are in the pool")
    check(not inside(y.data_ptr()), "a tensor made outside use_mem_pool is not in the pool")
    out["mempool"] = torch.stack([x[:1000].cpu() for x in xs])
    del xs, segs
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    del pool
    gc.collect()
    torch.cuda.empty_cache()
    after = torch.cuda.memory_reserved()
    out["mempool_reserved_back"] = before - after


def case_nested_mempool(torch, out):
    """Nested use_mem_pool blocks allocate to the innermost pool, as in
    PyTorch's test_nested_mempool: pools 1, 2, 3 entered in turn, a tensor
    made at each level on the way in and out."""
    if not hasattr(torch.cuda, "MemPool"):
        out["nested_mempool"] = "skipped: no torch.cuda.MemPool"
        return
    pools = [torch.cuda.MemPool() for _ in range(3)]
    made = []  # (tensor, index of the pool it must be in)

    def make(level):
        made.append((torch.empty(5 << 18, device="cuda"), level))  # 5 MiB

    with torch.cuda.use_mem_pool(pools[0]):
        make(0)
        with torch.cuda.use_mem_pool(pools[1]):
            make(1)
            with torch.cuda.use_mem_pool(pools[2]):
                make(2)
            make(1)
        make(0)
    ranges = [[(s["address"], s["address"] + s["total_size"]) for s in p.snapshot()]
              for p in pools]
    for i, (t, level) in enumerate(made):
        holders = [k for k, rs in enumerate(ranges) if any(lo <= t.data_ptr() < hi for lo, hi in rs)]
        check(holders == [level], "tensor %d, made in pool %d, lies in pool(s) %s"
              % (i, level + 1, [k + 1 for k in holders]))
    out["nested_mempool"] = "ok"
    del made
    del pools
    gc.collect()


def case_pool_freed(torch, out):
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    big = torch.randn(4096, 4096, device="cuda")
    graphs, keep = [], []
    for i in range(3):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            t = big @ big  # 64 MiB outputs and a temporary each
            u = (t * 2).sum()
        graphs.append(g)
        keep.append(u)
    held = torch.cuda.memory_reserved() - base
    del graphs, g, keep, t, u
    gc.collect()
    torch.cuda.synchronize()
    right_after = torch.cuda.memory_reserved() - base
    torch.cuda.empty_cache()
    after_empty = torch.cuda.memory_reserved() - base
    out["pool_freed"] = {"held": held, "after_delete": right_after, "after_empty_cache": after_empty}
    check(held >= 3 * 64 * MiB, "the graphs' pools held their memory (%d bytes)" % held)
    check(after_empty <= 64 * MiB + 2 * MiB,
          "the pools' memory came back once the graphs were deleted (%d of %d bytes left)"
          % (after_empty, held))


# ---------------------------------------------------------------------------
# torch.compile(mode="reduce-overhead")
# ---------------------------------------------------------------------------

def case_compile_train(torch, out):
    torch.manual_seed(2)
    model = mlp(torch, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def step(x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    cstep = torch.compile(step, mode="reduce-overhead")
    gen = torch.Generator(device="cuda").manual_seed(3)
    losses = []
    for i in range(30):
        torch.compiler.cudagraph_mark_step_begin()
        x = torch.randn(64, 256, device="cuda", generator=gen)
        y = torch.randn(64, 256, device="cuda", generator=gen)
        loss = cstep(x, y)
        losses.append(loss.detach().clone())  # before the next replay overwrites it
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["compile_train"] = torch.stack(losses).cpu()
    out["compile_train_w"] = model[2].weight.detach().cpu()


class Decoder(object):
    """A small transformer decoder whose layers keep K and V caches grown by
    torch.cat every step (the pattern of streaming models)."""

    def __init__(self, torch, layers, width, heads):
        self.torch = torch
        g = torch.Generator(device="cuda").manual_seed(4)
        self.layers = []
        for _ in range(layers):
            self.layers.append({
                "qkv": torch.randn(width, 3 * width, device="cuda", generator=g) / width ** 0.5,
                "o": torch.randn(width, width, device="cuda", generator=g) / width ** 0.5,
                "up": torch.randn(width, 4 * width, device="cuda", generator=g) / width ** 0.5,
                "down": torch.randn(4 * width, width, device="cuda", generator=g) / (4 * width) ** 0.5,
            })
        self.heads = heads

    def step(self, x, caches):
        """x: [B, 1, W]; caches: list of (k, v) [B, H, T, D]; returns the
        output and the grown caches."""
        torch = self.torch
        F = torch.nn.functional
        b, _, w = x.shape
        h, d = self.heads, w // self.heads
        grown = []
        for layer, (k_cache, v_cache) in zip(self.layers, caches):
            q, k, v = (F.layer_norm(x, (w,)) @ layer["qkv"]).split(w, dim=-1)
            q, k, v = (t.view(b, 1, h, d).transpose(1, 2) for t in (q, k, v))
            k_all = torch.cat([k_cache, k], dim=2)
            v_all = torch.cat([v_cache, v], dim=2)
            a = F.scaled_dot_product_attention(q, k_all, v_all)
            x = x + a.transpose(1, 2).reshape(b, 1, w) @ layer["o"]
            x = x + F.gelu(F.layer_norm(x, (w,)) @ layer["up"]) @ layer["down"]
            grown.append((k_all, v_all))
        return x, grown


def decode(torch, fn, embed, dec, steps, batch, width, gen, keep_out):
    h, d = dec.heads, width // dec.heads
    caches = [(torch.zeros(batch, h, 1, d, device="cuda"), torch.zeros(batch, h, 1, d, device="cuda"))
              for _ in dec.layers]
    x = torch.randn(batch, 1, width, device="cuda", generator=gen)
    outs = []
    for i in range(steps):
        torch.compiler.cudagraph_mark_step_begin()
        # A graph of a fixed shape replays first; the step's new shape then
        # runs while the tree executes it, so the tree restores a checkpoint.
        y, new = fn(embed(x), caches)
        # What a user keeps across steps is cloned out of the graph's memory.
        caches = [(k.clone(), v.clone()) for k, v in new]
        x = y.clone()
        if keep_out:
            outs.append(y[:, 0, :8].clone())
    return outs, caches


def compiled_decoder(torch, layers, width):
    """The decoder and its step and embedding, each compiled with
    reduce-overhead: (dec, step, embed) for decode()."""
    dec = Decoder(torch, layers, width, width // 64)
    fn = torch.compile(dec.step, mode="reduce-overhead")
    scale = torch.linspace(0.5, 1.5, width, device="cuda")
    embed = torch.compile(lambda x: torch.nn.functional.layer_norm(x, (width,)) * scale,
                          mode="reduce-overhead")
    return dec, fn, embed


def case_compile_kv(torch, out, steps, batch=4, width=512, layers=4):
    dec, fn, embed = compiled_decoder(torch, layers, width)
    gen = torch.Generator(device="cuda").manual_seed(5)
    # Pass 1 records a graph per length; pass 2 replays them and records the
    # longer ones, which makes the tree restore checkpoints of its pool.
    decode(torch, fn, embed, dec, steps // 2, batch, width, gen, False)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    gen.manual_seed(6)
    t0 = time.perf_counter()
    outs, caches = decode(torch, fn, embed, dec, steps, batch, width, gen, True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak_alloc = torch.cuda.max_memory_allocated()
    peak_res = torch.cuda.max_memory_reserved()
    out["compile_kv"] = torch.stack(outs).cpu()
    out["compile_kv_figures"] = {"seconds": seconds, "peak_allocated": peak_alloc,
                                 "peak_reserved": peak_res,
                                 "ratio": peak_res / max(peak_alloc, 1), "steps": steps,
                                 "batch": batch, "width": width, "layers": layers}
    if "tidalloc" in sys.modules:
        import tidalloc._lib as tl
        st = tl.stats(0)
        out["compile_kv_figures"].update(mappings=st.mappings, unmappings=st.unmappings,
                                         mapping_ms=st.mapping_ns / 1e6,
                                         stream_waits=st.stream_waits)
        print("compile_kv: tidalloc made %d mappings and %d unmappings (%.1f ms in mapping "
              "calls), %d stream waits" % (st.mappings, st.unmappings, st.mapping_ns / 1e6,
                                           st.stream_waits))
    print("compile_kv: %d steps, batch %d, width %d, %d layers: %.3f s, peak allocated %d, "
          "peak reserved %d (%.4f)" % (steps, batch, width, layers, seconds, peak_alloc, peak_res,
                                       peak_res / max(peak_alloc, 1)))
    from tidalloc.viz import pool_breakdown
    print("compile_kv: at the end, by pool: %s" % pool_breakdown(torch))


def case_dynamic_shapes(torch, out):
    model = mlp(torch, 128)
    fn = torch.compile(model, mode="reduce-overhead")
    res = []
    gen = torch.Generator(device="cuda").manual_seed(7)
    with torch.no_grad():
        for rnd in range(3):
            for bs in (8, 16, 8, 32, 16):
                torch.compiler.cudagraph_mark_step_begin()
                x = torch.randn(bs, 128, device="cuda", generator=gen)
                y = fn(x)
                check(torch.allclose(y, model(x), rtol=1e-4, atol=1e-5),
                      "compiled output at batch %d differs from eager" % bs)
                res.append(y.sum().reshape(1).clone())
    out["dynamic_shapes"] = torch.cat(res).cpu()


def case_steady(torch, out):
    model = mlp(torch, 256)
    fn = torch.compile(model, mode="reduce-overhead")
    x = torch.randn(32, 256, device="cuda")
    figures = {}
    with torch.no_grad():
        for i in range(1000):
            torch.compiler.cudagraph_mark_step_begin()
            y = fn(x)
            x = y.clone().tanh()
            if i in (100, 999):
                torch.cuda.synchronize()
                figures[i] = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
    out["steady"] = x[:4, :8].cpu()
    out["steady_figures"] = {str(k): v for k, v in figures.items()}
    check(figures[999] == figures[100], "memory grew between step 100 and 999: %s" % figures)


def case_oom(torch, out):
    """A request no device holds fails with PyTorch's out-of-memory error,
    outside a capture and inside one (PyTorch's test_graph_capture_oom), and
    the allocator serves the next request."""
    for where in ("outside", "capture"):
        try:
            if where == "capture":
                with torch.cuda.graph(torch.cuda.CUDAGraph()):
                    torch.zeros(2**40, device="cuda")
            else:
                torch.zeros(2**40, device="cuda")
        except torch.OutOfMemoryError as e:
            check("out of memory" in str(e), "the error says out of memory: %s" % e)
        else:
            raise AssertionError("4 TiB %s a capture did not fail" % where)
        x = torch.ones(1 << 20, device="cuda")
        check(x.sum().item() == float(1 << 20), "an allocation after the failure works")
    out["oom"] = "ok"


def case_stats(torch, out):
    x = torch.randn(1 << 20, device="cuda")
    torch.cuda.synchronize()
    st = torch.cuda.memory_stats()
    for key in ("allocated_bytes.all.current", "reserved_bytes.all.current",
                "active_bytes.all.current", "allocation.all.current", "segment.all.current"):
        check(key in st, "memory_stats has %s" % key)
    check(st["allocated_bytes.all.current"] == torch.cuda.memory_allocated(), "allocated agrees")
    check(0 < st["allocated_bytes.all.current"] <= st["reserved_bytes.all.current"],
          "0 < allocated <= reserved")
    check(st["allocated_bytes.all.peak"] >= st["allocated_bytes.all.current"], "peak >= current")
    snap = torch.cuda.memory._snapshot()
    total = sum(s["total_size"] for s in snap["segments"])
    check(total == st["reserved_bytes.all.current"],
          "the snapshot's segments add up to reserved (%d vs %d)"
          % (total, st["reserved_bytes.all.current"]))
    found = any(s["address"] <= x.data_ptr() < s["address"] + s["total_size"]
                for s in snap["segments"])
    check(found, "the snapshot holds a live tensor")
    summary = torch.cuda.memory_summary()
    check("Allocated memory" in summary, "memory_summary renders")
    torch.cuda.reset_peak_memory_stats()
    out["stats"] = "ok"
    del x


# ---------------------------------------------------------------------------
# MemPools with their own allocator
# ---------------------------------------------------------------------------

OWN_ALLOCATOR_SOURCE = r"""
#include <cuda_runtime_api.h>
#include <stddef.h>
#define EXPORT __attribute__((visibility("default")))
extern "C" {
EXPORT int own_allocs = 0;
EXPORT int own_frees = 0;
EXPORT void *own_alloc(size_t size, int device, void *stream) {
  void *p = nullptr;
  if (cudaMalloc(&p, size) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  own_allocs++;
  return p;
}
EXPORT void own_free(void *p, size_t size, int device, void *stream) {
  cudaFree(p);
  own_frees++;
}
}
"""


def own_allocator(torch):
    """A CUDAPluggableAllocator over cudaMalloc, built as PyTorch's MemPool
    tests build theirs (plain device memory rather than their managed
    memory), and a function that reads how often it allocated and freed."""
    import ctypes
    import tempfile
    from torch.utils.cpp_extension import load
    src = os.path.join(tempfile.mkdtemp(prefix="tidalloc_own_"), "own_allocator.cpp")
    with open(src, "w") as f:
        f.write(OWN_ALLOCATOR_SOURCE)
    path = load(name="tidalloc_own_allocator", sources=[src], is_python_module=False,
                with_cuda=True, verbose=False)
    lib = ctypes.CDLL(path)
    calls = lambda: (ctypes.c_int.in_dll(lib, "own_allocs").value,
                     ctypes.c_int.in_dll(lib, "own_frees").value)
    return torch.cuda.memory.CUDAPluggableAllocator(path, "own_alloc", "own_free"), calls


def case_mempool_limited(torch, out):
    """PyTorch's test_mempool_limited_memory_with_allocator: two pools with
    their own allocator, one used when the usual memory runs out, under a
    memory fraction that leaves 80 MiB. The pools' memory counts against the
    fraction; freed, it stays cached in its pool; the use_on_oom pool's free
    memory serves the usual allocations that find none, and goes back to its
    allocator when the pools are deleted."""
    if not hasattr(torch.cuda, "MemPool"):
        out["mempool_limited"] = "skipped: no torch.cuda.MemPool"
        return
    allocator, calls = own_allocator(torch)
    base_allocs, base_frees = calls()
    pool_do_not_use = torch.cuda.MemPool(allocator.allocator())
    pool_use = torch.cuda.MemPool(allocator.allocator(), use_on_oom=True)
    nelem_1mb = MiB // 4
    init_fraction = torch.cuda.get_per_process_memory_fraction()
    torch.cuda.empty_cache()
    _, all_memory = torch.cuda.mem_get_info()
    pre_reserved = torch.cuda.memory_reserved()
    torch.cuda.set_per_process_memory_fraction((80 * MiB + pre_reserved) / all_memory)

    def oom(what, nelem):
        try:
            torch.randn(nelem, device="cuda")
        except torch.OutOfMemoryError:
            return
        raise Failed("%s did not run out of memory" % what)

    try:
        with torch.cuda.use_mem_pool(pool_do_not_use):
            a = torch.randn(40 * nelem_1mb, device="cuda")
        with torch.cuda.use_mem_pool(pool_use):
            b = torch.randn(40 * nelem_1mb, device="cuda")
        b_dataptr = b.data_ptr()
        check(torch.cuda.memory_reserved() - pre_reserved >= 80 * MiB,
              "the pools' memory counts in reserved (%d bytes more)"
              % (torch.cuda.memory_reserved() - pre_reserved))
        oom("40 MiB in the usual memory with the fraction held by the pools", 40 * nelem_1mb)
        del a, b
        c = torch.randn(30 * nelem_1mb, device="cuda")
        c_dataptr = c.data_ptr()
        oom("a second 30 MiB (only the use_on_oom pool may serve it)", 30 * nelem_1mb)
        del c
        check(b_dataptr == c_dataptr, "the use_on_oom pool's free memory served c")
        with torch.cuda.use_mem_pool(pool_use):
            e = torch.randn(20 * nelem_1mb, device="cuda")
        e_dataptr = e.data_ptr()
        del e
        check(e_dataptr == c_dataptr, "the pool's memory is its own again once c is freed")
        allocs, frees = calls()
        allocs, frees = allocs - base_allocs, frees - base_frees
        check(allocs == 2 and frees == 0,
              "freed pool memory stays cached (%d allocations, %d frees)" % (allocs, frees))
        del pool_use, pool_do_not_use
        gc.collect()
        allocs, frees = calls()
        allocs, frees = allocs - base_allocs, frees - base_frees
        check(frees == allocs, "deleted pools gave their memory back (%d allocations, %d frees)"
              % (allocs, frees))
    finally:
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(init_fraction)
    out["mempool_limited"] = "ok"


def case_mempool_allocator_deleted(torch, out):
    """PyTorch's test_tensor_delete_after_allocator_delete: a tensor of a
    pool with its own allocator outlives the pool and the allocator's Python
    object; its memory goes back through that allocator when it dies, at
    empty_cache at the latest."""
    if not hasattr(torch.cuda, "MemPool"):
        out["mempool_allocator_deleted"] = "skipped: no torch.cuda.MemPool"
        return
    allocator, calls = own_allocator(torch)
    base_allocs, base_frees = calls()
    pool = torch.cuda.MemPool(allocator.allocator())
    with torch.cuda.use_mem_pool(pool):
        data = torch.empty(4, device="cuda")
    check(calls() == (base_allocs + 1, base_frees), "the pool's allocator allocated once")
    del pool
    del allocator
    check(calls()[1] == base_frees, "the live tensor's memory is kept")
    del data
    torch.cuda.empty_cache()
    check(calls()[1] == base_frees + 1, "the tensor's memory went back through its allocator")
    out["mempool_allocator_deleted"] = "ok"


def case_mempool_own_memory(torch, out):
    """More of a pool's own memory, as PyTorch's allocator keeps it: under a
    fraction of 40 MiB, pools made and deleted in turn give their memory back
    and the last one's free 40 MiB serves two 20 MiB usual allocations
    (test_deleted_mempool_not_used_on_oom); a piece used on another stream is
    not reused before that stream is done; the figures and the snapshot
    count the pool's segment."""
    if not hasattr(torch.cuda, "MemPool"):
        out["mempool_own_memory"] = "skipped: no torch.cuda.MemPool"
        return
    allocator, _ = own_allocator(torch)
    nelem_1mb = MiB // 4
    init_fraction = torch.cuda.get_per_process_memory_fraction()
    torch.cuda.empty_cache()
    _, all_memory = torch.cuda.mem_get_info()
    torch.cuda.set_per_process_memory_fraction(
        (40 * MiB + torch.cuda.memory_reserved()) / all_memory)
    try:
        for _ in range(10):
            pool = torch.cuda.MemPool(allocator.allocator(), use_on_oom=True)
            with torch.cuda.use_mem_pool(pool):
                a = torch.randn(40 * nelem_1mb, device="cuda")
            del a, pool
        pool = torch.cuda.MemPool(allocator.allocator(), use_on_oom=True)
        with torch.cuda.use_mem_pool(pool):
            a = torch.randn(40 * nelem_1mb, device="cuda")
        del a
        b = torch.randn(20 * nelem_1mb, device="cuda")
        c = torch.randn(20 * nelem_1mb, device="cuda")
        del b, c, pool
    finally:
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(init_fraction)

    pool = torch.cuda.MemPool(allocator.allocator())
    s = torch.cuda.Stream()
    with torch.cuda.use_mem_pool(pool):
        x = torch.ones(4 * nelem_1mb, device="cuda")
    x_ptr = x.data_ptr()
    with torch.cuda.stream(s):
        torch.cuda._sleep(100_000_000)
        y = x * 2
    x.record_stream(s)
    del x
    with torch.cuda.use_mem_pool(pool):
        z = torch.empty(4 * nelem_1mb, device="cuda")
    check(z.data_ptr() != x_ptr, "a piece still used by another stream was reused")
    torch.cuda.synchronize()
    del y, z
    torch.cuda.empty_cache()
    with torch.cuda.use_mem_pool(pool):
        w = torch.empty(4 * nelem_1mb, device="cuda")
    check(w.data_ptr() == x_ptr, "the piece is reused once the other stream is done")
    del w, pool
    gc.collect()

    torch.cuda.empty_cache()
    pool = torch.cuda.MemPool(allocator.allocator())
    r0, a0 = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    with torch.cuda.use_mem_pool(pool):
        x = torch.empty(3 * nelem_1mb, device="cuda")
    check(torch.cuda.memory_reserved() - r0 == 20 * MiB, "a 3 MiB request reserves 20 MiB (%d)"
          % (torch.cuda.memory_reserved() - r0))
    check(torch.cuda.memory_allocated() - a0 == 3 * MiB, "and allocates 3 MiB (%d)"
          % (torch.cuda.memory_allocated() - a0))
    segs = torch.cuda.memory._snapshot()["segments"]
    reserved = torch.cuda.memory_stats()["reserved_bytes.all.current"]
    check(sum(sg["total_size"] for sg in segs) == reserved, "the snapshot adds up to reserved")
    mine = [sg for sg in segs if tuple(sg["segment_pool_id"]) == tuple(pool.id)]
    check(len(mine) == 1 and mine[0]["allocated_size"] == 3 * MiB,
          "the snapshot shows the pool's segment: %s" % mine)
    del x
    check(torch.cuda.memory_reserved() - r0 == 20 * MiB, "freed, it stays in its pool")
    del pool
    gc.collect()
    check(torch.cuda.memory_reserved() == r0, "the deleted pool gave it back")
    out["mempool_own_memory"] = "ok"


def reclaim_streams(torch, nside):
    """One capture on s1; data1 read on nside other streams (record_stream)
    and freed; s1 joins them one by one: an allocation before the last join
    must not take data1's block, one after it must."""
    s1 = torch.cuda.Stream()
    side = [torch.cuda.Stream() for _ in range(nside)]
    g = torch.cuda.CUDAGraph(keep_graph=True)
    torch.cuda.synchronize()
    with torch.cuda.stream(s1):
        g.capture_begin()
        sink1 = torch.empty(8, device="cuda")
        data1 = torch.ones(8, device="cuda")
        data1_ptr = data1.data_ptr()
        bufs = []
        for i, s in enumerate(side):
            s.wait_stream(s1)
            with torch.cuda.stream(s):
                bufs.append(torch.add(data1, float(i + 2)))
                data1.record_stream(s)
        del data1
        for s in side[:-1]:
            s1.wait_stream(s)
        sink1.fill_(1.0)
        data2 = torch.empty(8, device="cuda")  # before the last join
        s1.wait_stream(side[-1])
        sink1.add_(1.0)
        data3 = torch.empty(8, device="cuda")  # after it
        g.capture_end()
    torch.cuda.synchronize()
    check(data2.data_ptr() != data1_ptr, "%d streams: reused before the join" % (nside + 1))
    check(data3.data_ptr() == data1_ptr, "%d streams: not reused after the join" % (nside + 1))
    del g, bufs, sink1, data2, data3


def case_graph_reclaim(torch, out):
    """PyTorch's test_graph_capture_reclaim_2_streams and _4_streams."""
    try:
        torch.cuda.memory._set_allocator_settings("graph_capture_record_stream_reuse:True")
    except RuntimeError as e:
        out["graph_reclaim"] = "skipped: %s" % e
        return
    try:
        torch.cuda.empty_cache()
        reclaim_streams(torch, 1)
        reclaim_streams(torch, 3)
    finally:
        torch.cuda.memory._set_allocator_settings("graph_capture_record_stream_reuse:False")
    out["graph_reclaim"] = "ok"


CASES = ["graph_replay", "shared_pool", "graphed_callables", "mempool", "nested_mempool",
         "pool_freed", "compile_train", "compile_kv", "dynamic_shapes", "steady", "stats", "oom",
         "mempool_limited", "mempool_allocator_deleted", "mempool_own_memory", "graph_reclaim"]


def run(args):
    torch = setup(args.allocator)
    out, failed, notes = {}, [], {}
    for name in args.cases or CASES:
        t0 = time.perf_counter()
        try:
            if name == "compile_kv":
                case_compile_kv(torch, out, args.kv_steps, args.kv_batch, args.kv_width,
                                args.kv_layers)
            else:
                globals()["case_" + name](torch, out)
            status = "PASS"
        except Exception as e:  # one failing case does not stop the others
            status = "FAIL"
            failed.append(name)
            notes[name] = "%s: %s" % (type(e).__name__, e)
            traceback.print_exc()
        print("%-18s %s  %.1f s%s" % (name, status, time.perf_counter() - t0,
                                       ("  " + notes[name][:300]) if name in notes else ""),
              flush=True)
        gc.collect()
    if args.allocator == "tidalloc":
        import tidalloc.shim
        import tidalloc.torch
        out["bridge"] = tidalloc.torch.bridge()
        out["counts"] = tidalloc.shim.counts()
        print("bridge %s, calls %s" % (out["bridge"], json.dumps(out["counts"])))
        if out["bridge"] == "shim" and "compile_kv" in (args.cases or CASES):
            c = out["counts"]
            if not c.get("set_checkpoint_pool_state") or not c.get("get_checkpoint_state"):
                failed.append("checkpoints")
                print("checkpoints        FAIL  cudagraph trees never restored a checkpoint")
            else:
                print("checkpoints        PASS  %d taken, %d restored"
                      % (c["get_checkpoint_state"], c["set_checkpoint_pool_state"]))
    out["failed"] = failed
    out["torch"] = torch.__version__
    torch.save(out, args.out)
    print("%d passed, %d failed" % (len(args.cases or CASES) - len(set(failed) - {"checkpoints"}),
                                    len(failed)))
    return 1 if failed else 0


def compare(a_path, b_path):
    import torch
    a, b = torch.load(a_path, weights_only=False), torch.load(b_path, weights_only=False)
    bad = 0
    for key in sorted(set(a) & set(b)):
        va, vb = a[key], b[key]
        if isinstance(va, torch.Tensor):
            same = va.shape == vb.shape and torch.equal(va, vb)
            diff = (va.double() - vb.double()).abs().max().item() if va.shape == vb.shape else None
            print("%-24s %s%s" % (key, "equal" if same else "DIFFERENT",
                                  "" if same else " (max abs diff %s)" % diff))
            bad += not same
    ka, kb = a.get("compile_kv_figures"), b.get("compile_kv_figures")
    if ka and kb:
        print("growing-KV model, %d steps: reserved/peak allocated %.4f vs %.4f; "
              "seconds %.3f vs %.3f (ratio %.3f)" % (ka["steps"], ka["ratio"], kb["ratio"],
                                                     ka["seconds"], kb["seconds"],
                                                     kb["seconds"] / ka["seconds"]))
    for k in ("pool_freed", "mempool_reserved_back"):
        print("%-24s %s | %s" % (k, a.get(k), b.get(k)))
    print("compare: %d output(s) differ" % bad)
    return 1 if bad else 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--allocator", choices=["native", "tidalloc"])
    p.add_argument("--out")
    p.add_argument("--cases", nargs="*")
    p.add_argument("--kv-steps", type=int, default=128)
    p.add_argument("--kv-batch", type=int, default=4)
    p.add_argument("--kv-width", type=int, default=512)
    p.add_argument("--kv-layers", type=int, default=4)
    p.add_argument("--compare", nargs=2, metavar=("NATIVE", "TIDALLOC"))
    args = p.parse_args()
    if args.compare:
        return compare(*args.compare)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
