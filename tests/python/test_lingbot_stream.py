"""bench/torch/lingbot_stream.py: LingBot-Map's streaming loop in segments.
Needs a LingBot-Map checkout (LINGBOT_MAP) and its packages (einops, scipy);
skipped without them. Runs a small image size on the CPU."""
import hashlib
import importlib.util
import os

import pytest
from repo_module import load

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
