"""test_frame_flatness.py: bench/torch/frame_flatness.py, which says whether the
streaming model's time per frame stays flat once its window is full, on
made-up per-frame rows (no torch, no GPU)."""
from repo_module import load


def load_flatness():
    return load("bench/torch/frame_flatness.py")


def test_frame_flatness_takes_the_steps_after_the_window_is_full(tmp_path, capsys):
    ff = load_flatness()
    rows = []
    for frame in range(1, 41):
        cache = min(frame, 8)  # the window fills at frame 8
        flat = 0.010
        rising = 0.010 * (1 + 0.01 * frame)  # 1% of the first step more each frame
        rows.append(dict(frames="40", frame=str(frame), cache_frames=str(cache),
                         seconds="%.6f" % (0.5 if frame < 8 else flat)))
        rows.append(dict(frames="41", frame=str(frame), cache_frames=str(cache),
                         seconds="%.6f" % rising))
    flat_steps = ff.steady_steps([r for r in rows if r["frames"] == "40"])
    assert flat_steps[0][0] == 8 and len(flat_steps) == 33  # the slow filling steps left out
    n, first, last, ratio, slope = ff.flatness(flat_steps)
    assert ratio == 1.0 and abs(slope) < 1e-9
    n, first, last, ratio, slope = ff.flatness(ff.steady_steps([r for r in rows
                                                                if r["frames"] == "41"]))
    assert 1.15 < ratio < 1.25 and 70 < slope < 90  # 1% of the first step per frame: ~80% a 100
    path = tmp_path / "frames.csv"
    with open(path, "w") as f:
        f.write("frames,frame,batch,cache_frames,special_tokens,seconds,allocated_gib,"
                "reserved_gib\n")
        for r in rows:
            f.write("%s,%s,1,%s,0,%s,,\n" % (r["frames"], r["frame"], r["cache_frames"],
                                              r["seconds"]))
    assert ff.main([str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("file,frames,steady_steps")
    assert out[1].split(",")[1:4] == ["40", "33", "10.000"]
