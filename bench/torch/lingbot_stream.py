"""lingbot_stream.py: LingBot-Map's streaming benchmark loop, in segments,
for tests/torch/paired_time.py (validate.py's `lingbot` program).

LingBot-Map's scripts/benchmark_gct_memory.py times one stream of frames in
one call, so two allocators can only be compared run against run, minutes
apart. This runs the same loop with the same model, inputs and defaults
(--backend sdpa, window 64, 8 scale frames, keyframe every frame, bf16
autocast), taken from that script itself in the checkout LINGBOT_MAP names,
and pauses it every N frames, so that a pairing can interleave two
processes' runs segment by segment. The weights are drawn with a fixed seed
(the script leaves them unseeded), so every process computes the same
outputs.

    run = paired_runner(torch.device("cuda"), 512)
    run(digest)                       # one whole stream, fresh caches
    for _ in run.segments(digest, 64):  # the same, paused every 64 frames
        ...

LINGBOT_ARGS adds arguments to the script's own (e.g. "--sliding-window
128"). paired_runner(..., kvcache=True) runs the model with its attention
caches in tidalloc.kv.KVCache (bench/torch/lingbot_kvcache.py)."""
import importlib.util
import os
import shlex
import sys


def load_script():
    """The benchmark script of the LingBot-Map checkout LINGBOT_MAP names, as
    a module (its main() is not run)."""
    root = os.environ.get("LINGBOT_MAP")
    if not root:
        raise SystemExit("lingbot_stream: LINGBOT_MAP must name a LingBot-Map checkout")
    path = os.path.join(root, "scripts", "benchmark_gct_memory.py")
    spec = importlib.util.spec_from_file_location("benchmark_gct_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def script_args(script, extra=()):
    """The script's own defaults with --backend sdpa, then LINGBOT_ARGS, then extra."""
    argv = sys.argv
    sys.argv = ([argv[0], "--backend", "sdpa"] + shlex.split(os.environ.get("LINGBOT_ARGS", ""))
                + list(extra))
    try:
        return script.parse_args()
    finally:
        sys.argv = argv


def paired_runner(device, frames, extra_args=(), seed=0, kvcache=False):
    """run(digest, frames=frames): one stream through one model built here,
    as the script's run_streaming_once streams it, adding every frame's pose
    to digest; run.segments(digest, every, frames) the same, pausing after
    every `every` frames. kvcache: the attention's caches in KVCaches (for
    every model of the process; run.uninstall() undoes it)."""
    import torch
    script = load_script()
    uninstall = None
    if kvcache:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import lingbot_kvcache
        uninstall = lingbot_kvcache.install(max_frames=frames + 100)
    args = script_args(script, extra_args)
    device = str(device)
    dtype = (torch.float32 if torch.device(device).type == "cpu"
             else script.resolve_dtype(device, args.dtype))
    height = script.patch_align(args.height, args.patch_size, args.adjust_to_patch)
    width = script.patch_align(args.width, args.patch_size, args.adjust_to_patch)
    torch.manual_seed(seed)
    model = script.build_model(args, max_frame_num=frames + 100, device=device)
    images = script.make_source_images(frame_count=frames, source_count=args.num_source_images,
                                       height=height, width=width, materialize_inputs=False)

    def forward(batch, scale_frames, per_block):
        torch.compiler.cudagraph_mark_step_begin()
        with script.make_autocast(dtype):  # none for float32, the CPU's
            out = model.forward(batch, num_frame_for_scale=scale_frames,
                                num_frame_per_block=per_block, causal_inference=True)
        return out["pose_enc"] if isinstance(out, dict) and "pose_enc" in out else None

    def segments(digest, every, frames=frames):
        if every < 1:
            raise ValueError("segments of %d frames" % every)
        scale_frames = min(args.num_scale_frames, frames)
        poses = []
        model.clean_kv_cache()
        try:
            with torch.no_grad():
                first = torch.cat([script.get_frame(images, i, dtype, device)
                                   for i in range(scale_frames)], dim=1)
                poses.append(forward(first, scale_frames, scale_frames))
                del first
                interval = max(int(args.keyframe_interval), 1)
                since = scale_frames  # frames streamed since the last pause
                for i in range(scale_frames, frames):
                    keyframe = interval <= 1 or (i - scale_frames) % interval == 0
                    if not keyframe:
                        model._set_skip_append(True)
                    frame = script.get_frame(images, i, dtype, device)
                    poses.append(forward(frame, scale_frames, 1))
                    if not keyframe:
                        model._set_skip_append(False)
                    since += 1
                    if since >= every and i + 1 < frames:
                        since = 0
                        yield i + 1
            for p in poses:
                if p is not None:
                    digest.update(p.float().cpu().numpy().tobytes())
        finally:
            model.clean_kv_cache()

    def run(digest, frames=frames):
        for _ in segments(digest, frames, frames):
            pass
    run.segments = segments
    run.uninstall = uninstall  # with kvcache: puts LingBot-Map's own attention back
    return run
