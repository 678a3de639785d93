"""test_stream_gct.py: bench/torch/stream_gct.py's tiny model on the CPU:
the CSV it writes, and caches that grow and evict as the workload says
(scale frames kept, a window of recent frames, evicted frames' special
tokens kept, camera caches grown every frame), with torch.cat and with
--growable (tidalloc's host backend). Skipped without torch."""
import csv
import hashlib
import os
import subprocess
import sys

import pytest
from repo_module import ROOT, library_found, load

torch = pytest.importorskip("torch", reason="stream_gct.py needs torch (not installed here)")

SCRIPT = os.path.join(ROOT, "bench", "torch", "stream_gct.py")
sg = load("bench/torch/stream_gct.py")

FRAMES = 9  # tiny: 2 scale frames + a window of 4, so the last 3 frames evict one each


def expected_cache(shape, frames):
    """(frames held, special tokens) after `frames` frames, by the spec's
    rule: past scale_frames + window, keep the first scale_frames and the
    last window frames, and keep the evicted frames' special tokens."""
    held = shape.scale_frames + shape.window
    return min(frames, held), shape.special * max(0, frames - held)


def frames_after_each_step(shape, frames):
    done, out = 0, []
    for batch in sg.step_batches(frames, shape.scale_frames):
        done += batch
        out.append(done)
    return out


def test_step_batches_put_the_scale_frames_first():
    assert sg.step_batches(5, 8) == [5]
    assert sg.step_batches(11, 8) == [8, 1, 1, 1]


@pytest.mark.parametrize("installed, torch_backend, environ, expected", [
    (False, "native", {}, "native"),
    (False, "native", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "expandable"),
    (False, "native", {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64, expandable_segments:true"},
     "expandable"),
    (False, "native", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, "native"),
    (False, "cudaMallocAsync", {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
     "cudaMallocAsync"),
    (True, "native", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "tidalloc"),
])
def test_backend_column_names_the_allocator(installed, torch_backend, environ, expected):
    assert sg.backend_name(installed, torch_backend, environ) == expected


def test_full_shape_has_the_workload_token_counts():
    shape = sg.make_shape()
    assert shape.grid == (27, 37) and shape.patches == 999 and shape.tokens == 1005
    assert (shape.dim, shape.heads, shape.head_dim, shape.mlp) == (1024, 16, 64, 4096)
    assert (shape.scale_frames, shape.window, shape.camera_head_dim) == (8, 64, 128)
    # K of one global layer and frame: 16 x 1005 x 64 fp32 = 4.1 MB.
    assert shape.heads * shape.tokens * shape.head_dim * 4 == 4116480


def test_cat_caches_grow_and_evict_by_the_rule():
    torch.set_num_threads(1)
    shape = sg.make_shape(tiny=True)
    model = sg.build_model(shape, "cpu")
    state = sg.StreamState(shape, "cpu", FRAMES)
    generator = torch.Generator().manual_seed(1)
    h, d, t = shape.heads, shape.head_dim, shape.tokens
    seen = []

    def check(batch):
        n = state.frames_done
        held, special = expected_cache(shape, n)
        for cache in state.kv:
            assert cache.k.shape == (1, h, held * t, d) and cache.k.dtype == torch.float32
            assert cache.v.shape == (1, h, held * t, d) and cache.v.dtype == torch.bfloat16
            assert cache.special_k.shape == (1, h, special, d)
            assert cache.special_k.dtype == torch.float32
            assert cache.special_v.shape == (1, h, special, d)
        for cache in state.camera:
            assert cache.k.shape == (1, shape.camera_heads, n, 1, shape.camera_head_dim)
            assert cache.k.dtype == cache.v.dtype == torch.float32
        depth, confidence, pose = state.outputs[-1]
        assert depth.shape == confidence.shape == (batch, 1, 56, 70)
        assert depth.dtype == torch.float32 and pose.shape == (batch, 9)
        seen.append(n)

    sg.stream(model, state, FRAMES, "cpu", generator, on_step=check)
    assert seen == frames_after_each_step(shape, FRAMES)
    assert len(state.outputs) == len(seen)


def test_eviction_keeps_the_scale_frames_and_the_latest_window():
    # Frames tagged by value: after eviction the cache holds the first
    # scale_frames and the last window frames, in order, and the special
    # tokens of the frames in between.
    shape = sg.make_shape(tiny=True)
    cache = sg.CatKVCache(shape, "cpu")
    h, d, t = shape.heads, shape.head_dim, shape.tokens
    for f in range(FRAMES):
        frame = torch.full((1, h, t, d), float(f))
        cache.append(frame, frame)
    held = list(range(shape.scale_frames)) + list(range(FRAMES - shape.window, FRAMES))
    per_frame = cache.k.view(1, h, len(held), t, d)[0, 0, :, 0, 0].tolist()
    assert per_frame == [float(f) for f in held]
    evicted = range(shape.scale_frames, FRAMES - shape.window)
    assert cache.special_k[0, 0, :, 0].tolist() == [float(f) for f in evicted
                                                     for _ in range(shape.special)]


def test_paired_runner_repeats_its_outputs():
    torch.set_num_threads(1)
    run = sg.paired_runner("cpu", frames=4, tiny=True)
    digests = []
    for _ in range(2):
        digest = hashlib.sha256()
        run(digest)
        digests.append(digest.hexdigest())
    assert digests[0] == digests[1]
    # A shorter stream (a warm-up) through the same model: other outputs, and
    # the run after it still gives the first ones.
    short, again = hashlib.sha256(), hashlib.sha256()
    run(short, frames=2)
    run(again)
    assert short.hexdigest() != digests[0] and again.hexdigest() == digests[0]


def test_paired_runner_in_segments_gives_the_whole_runs_outputs():
    torch.set_num_threads(1)
    run = sg.paired_runner("cpu", frames=FRAMES, tiny=True)
    whole = hashlib.sha256()
    run(whole)
    pieces = hashlib.sha256()
    # The scale frames come as one step, so the first pause is past them;
    # then one every 3 frames, never after the last step.
    assert list(run.segments(pieces, 3)) == [3, 6]
    assert pieces.hexdigest() == whole.hexdigest()
    assert list(run.segments(hashlib.sha256(), FRAMES)) == []


@pytest.mark.parametrize("growable", [False, True], ids=["cat", "growable"])
def test_command_writes_its_csvs(tmp_path, growable):
    if growable and not library_found():
        pytest.skip("--growable needs libtidalloc.so (make build, or set TIDALLOC_LIB)")
    out, frames_csv = tmp_path / "sweep.csv", tmp_path / "frames.csv"
    env = dict(os.environ, OMP_NUM_THREADS="1", TIDALLOC_CONF="backend:host")
    cmd = [sys.executable, SCRIPT, "--tiny", "--device", "cpu", "--frame-counts", "3",
           str(FRAMES), "--warmup-frames", "0", "--csv", str(out),
           "--per-frame-csv", str(frames_csv)] + (["--growable"] if growable else [])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0].keys()) == list(sg.CSV_COLUMNS)
    assert [int(r["frames"]) for r in rows] == [3, FRAMES]
    for row in rows:
        assert row["status"] == "ok" and row["error"] == ""
        assert (row["requested_height"], row["requested_width"]) == ("56", "70")
        assert (row["effective_height"], row["effective_width"]) == ("56", "70")
        assert row["backend"] == "cpu" and row["dtype"] == "bfloat16"
        assert float(row["seconds"]) > 0
    shape = sg.make_shape(tiny=True)
    with open(frames_csv) as f:
        steps = [r for r in csv.DictReader(f) if int(r["frames"]) == FRAMES]
    assert [int(r["frame"]) for r in steps] == frames_after_each_step(shape, FRAMES)
    for r in steps:
        held, special = expected_cache(shape, int(r["frame"]))
        assert (int(r["cache_frames"]), int(r["special_tokens"])) == (held, special)


def test_map_ahead_frames_must_not_be_negative():
    r = subprocess.run([sys.executable, SCRIPT, "--tiny", "--device", "cpu",
                        "--map-ahead-frames", "-1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--map-ahead-frames must be 0 or more" in r.stderr


def test_profile_frames_sums_kernels_by_kind():
    assert sg.kernel_kind("void pytorch_flash::flash_fwd_kernel<...>") == "attention"
    assert sg.kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert sg.kernel_kind("void at::native::(anonymous)::CatArrayBatchedCopy<...>") == "copy"
    assert sg.kernel_kind("Memcpy DtoD (Device -> Device)") == "copy"
    assert sg.kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmul"
    assert sg.kernel_kind("void at::native::vectorized_layer_norm_kernel") == "other"
    lines = sg.kernel_summary([("flash_fwd", 3000.0), ("CatArrayBatchedCopy", 1000.0),
                               ("gemm_a", 500.0), ("layer_norm", 500.0)], steps=2)
    assert lines[0] == ("device time per step over 2 steps: 2.500 ms (attention 1.500, "
                        "copy 0.500, matmul 0.250, other 0.250)")
    assert "flash_fwd" in lines[1] and len(lines) == 5
    timed = sg.kernel_summary([("flash_fwd", 3000.0)], steps=2, wall_s=0.009)
    assert timed[1] == "wall time per step over the same steps: 4.500 ms"


def test_profile_frames_takes_two_steps_in_order():
    for bad in ("3", "4:2", "0:2", "a:b"):
        r = subprocess.run([sys.executable, SCRIPT, "--tiny", "--device", "cpu",
                            "--profile-frames", bad], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "--profile-frames" in r.stderr, (bad, r.stderr)


def test_attention_kernel_is_held_for_the_bf16_attention(monkeypatch):
    # --sdpa: attend() calls scaled_dot_product_attention with only the
    # chosen kernel enabled, and "default" leaves PyTorch's flags alone.
    flags = torch.backends.cuda
    seen = []

    def spy(q, k, v, *args, **kwargs):
        seen.append((flags.flash_sdp_enabled(), flags.mem_efficient_sdp_enabled(),
                     flags.math_sdp_enabled()))
        return torch.zeros_like(q)
    monkeypatch.setattr(sg.F, "scaled_dot_product_attention", spy)
    q = torch.randn(1, 2, 3, 8)
    try:
        for kernel in ("flash", "math", "default"):
            sg.set_attention_kernel(kernel)
            assert sg.attend(q, q, q).shape == (1, 3, 16)
    finally:
        sg.set_attention_kernel("default")
    assert seen == [(True, False, False), (False, False, True), (True, True, True)]
    with pytest.raises(ValueError, match="no attention kernel 'fast'"):
        sg.set_attention_kernel("fast")


def test_paired_runner_holds_its_attention_kernel():
    # The kernel reaches attend(): the math kernel rounds differently from
    # PyTorch's choice on the CPU (its flash kernel), so the outputs differ.
    torch.set_num_threads(1)
    digests = {}
    try:
        for kernel in ("default", "math"):
            run = sg.paired_runner("cpu", frames=4, tiny=True, sdpa=kernel)
            assert sg.ATTENTION_KERNEL == kernel
            digest = hashlib.sha256()
            run(digest)
            digests[kernel] = digest.hexdigest()
    finally:
        sg.set_attention_kernel("default")
    assert digests["default"] != digests["math"]


def test_step_callbacks_run_together():
    seen = []
    both = sg.each(lambda b: seen.append(("a", b)), None, lambda b: seen.append(("b", b)))
    both(3)
    assert seen == [("a", 3), ("b", 3)]
    assert sg.each(None, None) is None


# What a check run in its own process starts with: the script as module sg.
CHECK_PRELUDE = r"""
import hashlib, importlib.util, sys
import torch
sys.path.insert(0, %(root)r + "/python")
spec = importlib.util.spec_from_file_location("stream_gct", %(script)r)
sg = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sg)
torch.set_num_threads(1)
"""


def run_check(body, **values):
    """CHECK_PRELUDE + body in a fresh python on the host backend (values
    filled in with ROOT, SCRIPT and FRAMES); its stdout, once it exits 0."""
    code = (CHECK_PRELUDE + body) % dict(root=ROOT, script=SCRIPT, frames=FRAMES, **values)
    env = dict(os.environ, OMP_NUM_THREADS="1", TIDALLOC_CONF="backend:host")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    return r.stdout


GROWABLE_CHECK = r"""
shape = sg.make_shape(tiny=True)
model = sg.build_model(shape, "cpu")
held_max, t = shape.scale_frames + shape.window, shape.tokens
outputs = {}
for growable in (False, True):
    state = sg.StreamState(shape, "cpu", %(frames)d, growable, %(map_ahead)d, %(kv_dtype)r)
    ptrs = {}  # each cache's storage address, from its first append (made lazily)

    def check(batch):
        if not growable:
            return
        n = state.frames_done
        special = shape.special * max(0, n - held_max)
        for cache in state.kv:
            ptr = ptrs.setdefault(id(cache), cache.kv.data_ptrs()[0])
            rows = min(n, held_max) * t + special
            # The package's KVCache: [1, H, rows, D] views over storage that
            # never moves (the first step's address, every step).
            assert len(cache.kv) == rows, (n, len(cache.kv), rows)
            assert cache.kv.keys.shape[2] == cache.kv.values.shape[2] == rows
            assert cache.kv.keys.data_ptr() == ptr
            # K as the attention reads it (bf16), or fp32 as it comes.
            assert cache.kv.keys.dtype == %(key_dtype)s
            assert cache.kv.values.dtype == torch.bfloat16
        for cache in state.camera:
            assert len(cache.kv) == cache.kv.values.shape[2] == n

    sg.stream(model, state, %(frames)d, "cpu", torch.Generator().manual_seed(1), on_step=check)
    outputs[growable] = [o[2] for o in state.outputs] + [state.outputs[-1][0]]
    state.close()
# The ring holds the same keys in another order: attention's result agrees
# up to the order of its sums.
for a, b in zip(outputs[False], outputs[True]):
    assert torch.allclose(a, b, rtol=1e-2, atol=1e-2), (a - b).abs().max()
print("growable ok")
"""


@pytest.mark.parametrize("map_ahead,kv_dtype", [(1, "attention"), (0, "appended")],
                         ids=["map-ahead,bf16-keys", "no-map-ahead,fp32-keys"])
def test_growable_buffers_follow_the_rule_in_place(map_ahead, kv_dtype):
    if not library_found():
        pytest.skip("--growable needs libtidalloc.so (make build, or set TIDALLOC_LIB)")
    out = run_check(GROWABLE_CHECK, map_ahead=map_ahead, kv_dtype=kv_dtype,
                    key_dtype="torch.bfloat16" if kv_dtype == "attention" else "torch.float32")
    assert "growable ok" in out


@pytest.mark.skipif(not os.environ.get("STREAM_GCT_COMPILE_TEST"),
                    reason="slow (torch.compile of the tiny model takes minutes on a CPU); "
                    "set STREAM_GCT_COMPILE_TEST=1")
def test_compiled_model_runs(tmp_path):
    out = tmp_path / "compiled.csv"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, SCRIPT, "--tiny", "--device", "cpu", "--compile", "--frame-counts",
           str(FRAMES), "--csv", str(out)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert [(r["frames"], r["status"]) for r in rows] == [(str(FRAMES), "ok")]


KEY_DTYPE_CHECK = r"""
digests = []
for kv_dtype in ("attention", "appended"):
    run = sg.paired_runner("cpu", %(frames)d, growable=True, tiny=True, kv_dtype=kv_dtype)
    d = hashlib.sha256()
    run(d)
    digests.append(d.hexdigest())
print(digests[0] == digests[1], digests)
"""


def test_keys_stored_in_bf16_change_no_output():
    # attend() converts K to bf16 at every step: a cache that stores it in
    # bf16 gives the attention the same values, so every output is equal.
    if not library_found():
        pytest.skip("--growable needs libtidalloc.so (make build, or set TIDALLOC_LIB)")
    out = run_check(KEY_DTYPE_CHECK)
    assert out.startswith("True"), out
