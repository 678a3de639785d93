"""bench/torch/lingbot_stream.py: LingBot-Map's streaming loop in segments,
and with its attention caches in tidalloc.kv.KVCache
(bench/torch/lingbot_kvcache.py: the same poses, evictions included).
Needs a LingBot-Map checkout (LINGBOT_MAP) and its packages (einops, scipy);
skipped without them. Runs a small image size on the CPU."""
import hashlib
import importlib.util
import os

import pytest
from repo_module import library_found, load

pytestmark = pytest.mark.skipif(
    not os.environ.get("LINGBOT_MAP") or any(importlib.util.find_spec(m) is None
                                             for m in ("einops", "scipy")),
    reason="needs LINGBOT_MAP (a LingBot-Map checkout) and einops and scipy")


LINGBOT_STREAM = "bench/torch/lingbot_stream.py"
SMALL = ["--height", "56", "--width", "56"]  # 4 x 4 patches: seconds a frame on a CPU


def test_segments_pause_every_n_frames_and_give_the_whole_runs_outputs():
    import torch
    run = load(LINGBOT_STREAM).paired_runner(torch.device("cpu"), 20, extra_args=SMALL)
    whole, pieces = hashlib.sha256(), hashlib.sha256()
    run(whole)
    # 8 scale frames in one step, then one frame a step: a pause at the
    # first step boundary past each 4 frames, none after the last frame.
    assert list(run.segments(pieces, 4)) == [9, 13, 17]
    assert pieces.hexdigest() == whole.hexdigest()
    again = hashlib.sha256()
    run(again)  # fresh caches each run: the same outputs
    assert again.hexdigest() == whole.hexdigest()


def test_weights_are_seeded_so_every_process_computes_the_same():
    import torch
    module = load(LINGBOT_STREAM)
    digests = []
    for _ in range(2):
        d = hashlib.sha256()
        module.paired_runner(torch.device("cpu"), 10, extra_args=SMALL)(d)
        digests.append(d.hexdigest())
    assert digests[0] == digests[1]


class Poses:
    """A digest that keeps the poses it is given (float32), to compare two
    runs within a tolerance."""

    def __init__(self):
        self.parts = []

    def update(self, data):
        import numpy as np
        self.parts.append(np.frombuffer(data, dtype=np.float32).copy())


def test_kvcache_conversion_computes_lingbot_maps_poses():
    # A window of 4 frames after 2 scale frames, 12 frames: the last 6 are
    # evicted into the special tokens, through the ring of KVCache slots.
    # The keys' order differs from LingBot-Map's, so the sums round
    # differently; the poses agree to float32 rounding.
    if not library_found() or "backend:host" not in os.environ.get("TIDALLOC_CONF", ""):
        pytest.skip("needs libtidalloc.so and TIDALLOC_CONF=backend:host")
    import numpy as np
    import torch
    torch.set_num_threads(1)
    module = load(LINGBOT_STREAM)
    args = SMALL + ["--sliding-window", "4", "--num-scale-frames", "2"]
    plain = Poses()
    module.paired_runner(torch.device("cpu"), 12, extra_args=args)(plain)
    from lingbot_map.layers.attention import CausalAttention, SDPAAttention
    originals = (CausalAttention.forward, SDPAAttention.forward)
    run = module.paired_runner(torch.device("cpu"), 12, extra_args=args, kvcache=True)
    try:
        converted, again = Poses(), Poses()
        import lingbot_kvcache  # as the runner imported it
        frames, evicted = [], []
        real = lingbot_kvcache.FrameCache.append_frame

        def counted(cache, k, v):
            frames.append(cache.tokens)
            evicted.append(cache.evicting and cache.frames == cache.scale_frames + cache.window)
            return real(cache, k, v)
        lingbot_kvcache.FrameCache.append_frame = counted
        run(converted)
        lingbot_kvcache.FrameCache.append_frame = real
        run(again)  # a second stream: fresh caches after clean_kv_cache
    finally:
        run.uninstall()
    assert (CausalAttention.forward, SDPAAttention.forward) == originals
    # Every frame of the aggregator's global layers and of the camera head's
    # trunk went through a FrameCache, and the ring took evicted frames.
    assert frames and min(frames) == 1 and max(frames) > 1 and sum(evicted) > 0
    want, got = np.concatenate(plain.parts), np.concatenate(converted.parts)
    assert want.shape == got.shape and want.size > 0
    assert np.allclose(got, want, rtol=1e-4, atol=1e-5), np.abs(got - want).max()
    print("largest difference from LingBot-Map's poses: %.3g" % np.abs(got - want).max())
    assert np.array_equal(np.concatenate(again.parts), got)
