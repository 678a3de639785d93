"""test_paired_time.py: the pairing and the summary of tests/torch/paired_time.py,
with stand-in workers (no torch, no GPU)."""
import csv
import os

import pytest
from repo_module import load

paired_time = load("tests/torch/paired_time.py")


class FakeWorker:
    """Takes `base` seconds a run, times a factor that the machine's state
    sets: the state drifts with every run made on either worker."""

    def __init__(self, config, base, machine):
        self.config, self.base, self.machine = config, base, machine

    def run(self):
        self.machine["runs"] += 1
        slow = 1.5 if ((self.machine["runs"] - 1) // 6) % 2 else 1.0  # spells of six runs
        return self.base * slow, "same", 0, 0


def test_pairs_alternate_order_and_cancel_slow_spells():
    machine = {"runs": 0}
    a = FakeWorker("expandable", 2.0, machine)
    b = FakeWorker("tidalloc", 2.02, machine)
    pairs = paired_time.run_pairs(a, b, 24)
    assert len(pairs) == 24
    assert [p[1] for p in pairs[:4]] == ["expandable", "tidalloc", "expandable", "tidalloc"]
    # Every pair's two runs fall in the same spell here, so each ratio is the true one
    # although the runs themselves differ by half.
    ratios = [p[3] / p[2] for p in pairs]
    assert max(ratios) - min(ratios) < 1e-9
    assert abs(paired_time.geometric_mean(ratios) - 1.01) < 1e-9
    assert any("1.0100" in line for line in paired_time.summarize(pairs, "expandable", "tidalloc"))


def test_budget_stops_before_a_new_pair():
    ticks = iter(range(100))
    machine = {"runs": 0}
    a = FakeWorker("a", 1.0, machine)
    b = FakeWorker("b", 1.0, machine)
    pairs = paired_time.run_pairs(a, b, 50, budget_s=3, clock=lambda: next(ticks))
    assert len(pairs) == 3  # begun at ticks 1, 2, 3 (not above 3); tick 4 stops it
    assert machine["runs"] == 6


def test_bootstrap_interval_contains_the_mean_and_narrows_with_more_pairs():
    few = [1.0, 1.1, 0.9, 1.05, 0.95]
    lo, hi = paired_time.bootstrap_interval(few)
    assert lo < paired_time.geometric_mean(few) < hi
    lo2, hi2 = paired_time.bootstrap_interval(few * 20)
    assert hi2 - lo2 < (hi - lo) / 2


def load_validate():
    return load("tests/torch/validate.py")


class FakeCuda:
    def synchronize(self):
        pass

    def reset_peak_memory_stats(self):
        pass

    def max_memory_allocated(self):
        return 100 << 20

    def max_memory_reserved(self):
        return 102 << 20

    def memory_stats(self):
        return {}


class FakeTorch:
    cuda = FakeCuda()


def test_serve_answers_each_run_then_reports_peaks(monkeypatch, capsys):
    import io
    validate = load_validate()
    outputs = iter([b"x", b"x", b"x"])
    monkeypatch.setattr("sys.stdin", io.StringIO("run\nrun\nquit\n"))
    assert validate.serve(FakeTorch(), lambda digest: digest.update(next(outputs))) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "ready"
    runs = [line.split() for line in lines[1:3]]
    assert all(len(r) == 4 and float(r[0]) >= 0 and r[2:] == ["-1", "-1"] for r in runs)
    assert runs[0][1] == runs[1][1]
    assert lines[3] == "peaks 100.0 102.0"


def test_serve_reports_each_runs_peaks_apart(monkeypatch, capsys):
    import io
    validate = load_validate()

    class Cuda(FakeCuda):
        peak = [100 << 20, 102 << 20]
        resets = 0

        def max_memory_allocated(self):
            return self.peak[0]

        def max_memory_reserved(self):
            return self.peak[1]

        def reset_peak_memory_stats(self):
            Cuda.resets += 1
            self.peak[:] = [10 << 20, 11 << 20]  # the timed runs peak lower than the first

    class Torch:
        cuda = Cuda()

    monkeypatch.setattr("sys.stdin", io.StringIO("run\nrun\nquit\n"))
    assert validate.serve(Torch(), lambda digest: digest.update(b"x"), label="tidalloc") == 0
    out, err = capsys.readouterr()
    assert Cuda.resets == 2
    assert "validate.py tidalloc: first run" in err
    assert "first run: peak allocated 100.0 MiB, reserved 102.0 MiB (1.0200 x)" in err
    assert "run 0: peak allocated 10.0 MiB, reserved 11.0 MiB (1.1000 x)" in err
    assert "run 1: peak allocated 10.0 MiB" in err
    assert out.splitlines()[-1] == "peaks 100.0 102.0"  # the largest, the first run's


def test_serve_fails_when_a_run_gives_other_outputs(monkeypatch, capsys):
    import io
    validate = load_validate()
    outputs = iter([b"x", b"y"])
    monkeypatch.setattr("sys.stdin", io.StringIO("run\nrun\n"))
    assert validate.serve(FakeTorch(), lambda digest: digest.update(next(outputs))) == 1


def test_serve_checks_timed_runs_against_each_other_after_a_shorter_warm_run(monkeypatch,
                                                                          capsys):
    """A shorter first stream (--warmup-frames) has other outputs than the
    timed runs: the first timed run is the reference, and a later one that
    differs from it still fails."""
    import io
    validate = load_validate()

    def run(digest, frames=1024):
        digest.update(b"%d" % frames)

    monkeypatch.setattr("sys.stdin", io.StringIO("run\nrun\nquit\n"))
    warm = lambda digest: run(digest, frames=16)  # noqa: E731
    assert validate.serve(FakeTorch(), run, warm_run=warm) == 0
    outputs = iter([b"x", b"y"])
    monkeypatch.setattr("sys.stdin", io.StringIO("run\nrun\nquit\n"))
    assert validate.serve(FakeTorch(), lambda digest: digest.update(next(outputs)),
                          warm_run=lambda digest: digest.update(b"w")) == 1
    assert "other outputs than the first" in capsys.readouterr().err


def test_read_pairs_keeps_runs_apart_and_drops_cut_pairs():
    rows = """# run 1: ...
program,pair,position,config,seconds,digest,maps,unmaps
gpt2,0,0,expandable,2.0,d,-1,-1
gpt2,0,1,tidalloc,1.0,d,20,20
gpt2,1,0,tidalloc,3.0,d,20,20
# run 2: ...
gpt2,0,0,expandable,4.0,d,-1,-1
gpt2,0,1,tidalloc,2.0,d,20,20
vit,0,0,tidalloc,0.5,e,2,2
vit,0,1,expandable,0.25,e,-1,-1
""".splitlines()
    got = paired_time.read_pairs(rows, "expandable", "tidalloc")
    assert [p[0] for p in got["gpt2"]] == [(1, 0), (2, 0)]  # run 1's pair 1 was cut short
    assert [p[3] / p[2] for p in got["gpt2"]] == [0.5, 0.5]
    assert got["vit"][0][1] == "tidalloc" and got["vit"][0][3] / got["vit"][0][2] == 2.0


def test_cluster_interval_widens_when_process_pairs_disagree():
    # Two pairs of processes, each consistent within itself, 10% apart.
    groups = [[0.95 + 0.001 * (i % 3) for i in range(30)],
              [1.05 + 0.001 * (i % 3) for i in range(30)]]
    pooled = [r for g in groups for r in g]
    lo, hi = paired_time.bootstrap_interval(pooled)
    clo, chi = paired_time.cluster_interval(groups)
    assert hi - lo < 0.03
    assert clo < 0.96 and chi > 1.04
    assert clo <= paired_time.geometric_mean(pooled) <= chi


class FakeProcess:
    """Stands in for a validate.py --serve worker: each new one runs at its
    own speed (the machine's differences between processes)."""
    started = []
    args = []

    def __init__(self, program, config, program_args=()):
        self.config = config
        self.program_args = list(program_args)
        FakeProcess.args.append(self.program_args)
        FakeProcess.started.append(config)
        self.speed = 1.0 + 0.1 * ((len(FakeProcess.started) - 1) // 2 % 2)

    def wait_ready(self):
        pass

    def run(self):
        return (2.0 if self.config == "expandable" else 2.02) * self.speed, "same", 0, 0

    def close(self):
        return 0, (100.0, 101.0)


def test_fresh_every_starts_new_workers_and_resamples_them(monkeypatch, capsys):
    FakeProcess.started = []
    monkeypatch.setattr(paired_time, "Worker", FakeProcess)
    monkeypatch.setattr("sys.argv",
                        ["paired_time.py", "gpt2", "--pairs", "6", "--fresh-every", "2"])
    assert paired_time.main() == 0
    out, err = capsys.readouterr()
    assert out.count("# run: workers") == 3
    assert len(FakeProcess.started) == 6
    assert len([line for line in out.splitlines() if line.startswith("gpt2,")]) == 12
    assert "resampling the worker pairs as well" in err
    assert "geometric mean 1.0100" in err


def test_stream_gct_workers_get_the_frame_count(monkeypatch, capsys):
    FakeProcess.started, FakeProcess.args = [], []
    monkeypatch.setattr(paired_time, "Worker", FakeProcess)
    monkeypatch.setattr("sys.argv", ["paired_time.py", "stream_gct", "--frames", "64",
                                     "--pairs", "2"])
    assert paired_time.main() == 0
    assert FakeProcess.args == [["--frames", "64", "--cold"], ["--frames", "64", "--cold"]]
    out, _ = capsys.readouterr()
    assert len([line for line in out.splitlines() if line.startswith("stream_gct,")]) == 4


def test_warmup_frames_reach_eager_streaming_workers_only(monkeypatch, capsys):
    FakeProcess.started, FakeProcess.args = [], []
    monkeypatch.setattr(paired_time, "Worker", FakeProcess)
    monkeypatch.setattr("sys.argv", ["paired_time.py", "stream_gct", "--frames", "1024",
                                     "--warmup-frames", "16", "--pairs", "1", "--configs",
                                     "expandable", "tidalloc@stream_gct_growable"])
    assert paired_time.main() == 0
    assert FakeProcess.args == [["--frames", "1024", "--warmup-frames", "16", "--cold"]] * 2
    capsys.readouterr()
    for configs in (["native", "tidalloc@stream_gct_compile"], ["expandable", "tidalloc"]):
        warmup = "0" if configs[1] == "tidalloc" else "16"
        monkeypatch.setattr("sys.argv", ["paired_time.py", "stream_gct", "--warmup-frames",
                                         warmup, "--pairs", "1", "--configs"] + configs)
        with pytest.raises(SystemExit, match="--warmup-frames"):
            paired_time.main()


def test_tidalloc_with_options(monkeypatch):
    monkeypatch.setenv("TIDALLOC_CONF", "trace:10")
    allocator, env = paired_time.config_env("tidalloc:load_handles:False,release_slack:0.02")
    assert allocator == "tidalloc"
    assert env["TIDALLOC_CONF"] == "trace:10,load_handles:False,release_slack:0.02"
    monkeypatch.delenv("TIDALLOC_CONF")
    assert paired_time.config_env("tidalloc:load_handles:False")[1]["TIDALLOC_CONF"] == \
        "load_handles:False"
    try:
        paired_time.config_env("tidalloc:")
    except ValueError:
        pass
    else:
        raise AssertionError("an empty option list was accepted")


def test_a_configuration_may_name_its_own_program():
    assert paired_time.split_config("tidalloc@stream_gct_growable", "stream_gct") == \
        ("tidalloc", "stream_gct_growable")
    assert paired_time.split_config("expandable", "stream_gct") == ("expandable", "stream_gct")
    try:
        paired_time.split_config("tidalloc@nothing", "gpt2")
    except ValueError:
        pass
    else:
        raise AssertionError("an unknown program was accepted")


class DifferentOutputs(FakeProcess):
    def run(self):
        seconds, _, maps, unmaps = super().run()
        return seconds, self.config, maps, unmaps  # a digest of its own per worker


def test_outputs_are_compared_only_between_runs_of_one_program(monkeypatch, capsys):
    DifferentOutputs.started, DifferentOutputs.args = [], []
    monkeypatch.setattr(paired_time, "Worker", DifferentOutputs)
    monkeypatch.setattr("sys.argv", ["paired_time.py", "stream_gct", "--pairs", "2", "--configs",
                                     "expandable", "tidalloc@stream_gct_growable"])
    assert paired_time.main() == 0
    monkeypatch.setattr("sys.argv", ["paired_time.py", "stream_gct", "--pairs", "2", "--configs",
                                     "expandable", "tidalloc"])
    assert paired_time.main() == 1
    assert "gave different outputs" in capsys.readouterr().err


def test_pluggable_bridge_configuration(monkeypatch):
    allocator, env = paired_time.config_env("tidalloc-pluggable")
    assert allocator == "tidalloc" and env["TIDALLOC_TORCH_BRIDGE"] == "pluggable"


def test_another_build_with_options(monkeypatch):
    monkeypatch.setenv("TIDALLOC_CONF", "trace:10")
    allocator, env = paired_time.config_env("tidalloc/ab-new:release_slack:0.017,wait_limit:1")
    assert allocator == "tidalloc"
    assert env["TIDALLOC_LIB"].endswith(os.path.join("ab-new", "libtidalloc.so"))
    assert env["TIDALLOC_CONF"] == "trace:10,release_slack:0.017,wait_limit:1"
    allocator, env = paired_time.config_env("tidalloc/ab-new")  # no options: the conf as it is
    assert env["TIDALLOC_CONF"] == "trace:10"
    for bad in ("tidalloc/:release_slack:1", "tidalloc/ab-new:"):
        with pytest.raises(ValueError):
            paired_time.config_env(bad)


def test_tidalloc_configurations_require_the_shim(monkeypatch):
    # A shim that fails to build must fail the pairing, not fall back to the
    # pluggable path and be timed as if it were the shim.
    monkeypatch.delenv("TIDALLOC_TORCH_BRIDGE", raising=False)
    for config in ("tidalloc", "tidalloc:release_slack:1", "tidalloc/build", "tidalloc-nodetect"):
        assert paired_time.config_env(config)[1]["TIDALLOC_TORCH_BRIDGE"] == "shim", config
    assert "TIDALLOC_TORCH_BRIDGE" not in paired_time.config_env("expandable")[1]
    monkeypatch.setenv("TIDALLOC_TORCH_BRIDGE", "pluggable")  # the user's own choice stands
    assert paired_time.config_env("tidalloc")[1]["TIDALLOC_TORCH_BRIDGE"] == "pluggable"


def test_streaming_workers_start_each_run_cold_unless_told(monkeypatch, capsys):
    for argv, want in ((["stream_gct"], True), (["stream_gct", "--cache", "warm"], False),
                       (["gpt2"], False), (["gpt2", "--cache", "cold"], True)):
        FakeProcess.started, FakeProcess.args = [], []
        monkeypatch.setattr(paired_time, "Worker", FakeProcess)
        monkeypatch.setattr("sys.argv", ["paired_time.py"] + argv + ["--pairs", "1"])
        assert paired_time.main() == 0
        assert all(("--cold" in a) == want for a in FakeProcess.args), (argv, FakeProcess.args)
    capsys.readouterr()


def test_serve_warms_up_with_its_own_run(monkeypatch, capsys):
    import io
    validate = load_validate()
    calls = []
    monkeypatch.setattr("sys.stdin", io.StringIO("run\nquit\n"))
    assert validate.serve(FakeTorch(), lambda digest: calls.append("run"),
                          warm_run=lambda digest: calls.append("warm-up")) == 0
    assert calls == ["warm-up", "run"]
    capsys.readouterr()


def test_a_cold_worker_empties_the_cache_before_each_timed_run(monkeypatch, capsys):
    import io
    validate = load_validate()
    events = []

    class Cuda(FakeCuda):
        def empty_cache(self):
            events.append("empty")

    class Torch:
        cuda = Cuda()

    def run(digest):
        events.append("run")
        digest.update(b"x")

    monkeypatch.setattr("sys.stdin", io.StringIO("run\nrun\nquit\n"))
    assert validate.serve(Torch(), run, cold=True) == 0
    assert events == ["run", "empty", "run", "empty", "run"]
    capsys.readouterr()


def test_three_configurations_rotate_and_share_the_reference(monkeypatch, capsys):
    machine = {"runs": 0}
    workers = [FakeWorker("expandable", 2.0, machine), FakeWorker("tidalloc", 1.9, machine),
               FakeWorker("growable", 1.8, machine)]
    rounds = paired_time.run_rounds(workers, 6)
    assert [r[1] for r in rounds[:3]] == [["expandable", "tidalloc", "growable"],
                                          ["tidalloc", "growable", "expandable"],
                                          ["growable", "expandable", "tidalloc"]]
    # Each configuration takes each place twice in six rounds.
    for config in ("expandable", "tidalloc", "growable"):
        assert sorted(r[1].index(config) for r in rounds) == [0, 0, 1, 1, 2, 2]
    pairs = paired_time.pairs_of(rounds, "expandable", "growable")
    assert [p[1] for p in pairs[:3]] == ["expandable", "growable", "growable"]
    assert len(pairs) == 6
    # Through main: one summary per configuration against the first, as CSV rows of rounds.
    FakeProcess.started, FakeProcess.args = [], []
    monkeypatch.setattr(paired_time, "Worker", FakeProcess)
    monkeypatch.setattr("sys.argv", ["paired_time.py", "gpt2", "--pairs", "3", "--configs",
                                     "expandable", "tidalloc", "tidalloc-pluggable"])
    assert paired_time.main() == 0
    out, err = capsys.readouterr()
    assert FakeProcess.started == ["expandable", "tidalloc", "tidalloc-pluggable"]
    assert len([line for line in out.splitlines() if line.startswith("gpt2,")]) == 9
    assert "tidalloc / expandable per pair" in err
    assert "tidalloc-pluggable / expandable per pair" in err
    # Saved rows of three configurations read back as pairs of any two of them.
    got = paired_time.read_pairs(out.splitlines(), "tidalloc", "tidalloc-pluggable")
    assert len(got["gpt2"]) == 3


def test_a_configuration_with_commas_reads_back_from_its_rows(monkeypatch, capsys):
    # tidalloc:KEY:VALUE,KEY:VALUE is one configuration, one CSV field.
    config = "tidalloc:handle_size_mb:16,handle_threshold_mb:4096"
    FakeProcess.started, FakeProcess.args = [], []
    monkeypatch.setattr(paired_time, "Worker", FakeProcess)
    monkeypatch.setattr("sys.argv", ["paired_time.py", "gpt2", "--pairs", "2", "--configs",
                                     "expandable", config])
    assert paired_time.main() == 0
    out, _ = capsys.readouterr()
    rows = [line for line in out.splitlines() if line.startswith("gpt2,")]
    assert len(rows) == 4 and all(len(next(csv.reader([r]))) == 8 for r in rows)
    got = paired_time.read_pairs(out.splitlines(), "expandable", config)
    assert len(got["gpt2"]) == 2


def test_compiled_programs_start_the_other_workers_once_the_first_is_ready(monkeypatch, capsys):
    # Inductor tunes kernels by timing them: workers compiling side by side may
    # choose differently, so the first compiles alone and the others reuse it.
    events = []

    class Recording(FakeProcess):
        def __init__(self, program, config, program_args=()):
            events.append("start " + config)
            super().__init__(program, config, program_args)

        def wait_ready(self):
            events.append("ready " + self.config)

    for program, staggered in (("compile_kv", True), ("stream_gct", False)):
        events.clear()
        FakeProcess.started, FakeProcess.args = [], []
        monkeypatch.setattr(paired_time, "Worker", Recording)
        monkeypatch.setattr("sys.argv", ["paired_time.py", program, "--pairs", "1", "--configs",
                                         "native", "tidalloc", "expandable"])
        assert paired_time.main() == 0
        capsys.readouterr()
        if staggered:
            assert events[:2] == ["start native", "ready native"]
            assert sorted(events[2:4]) == ["start expandable", "start tidalloc"]
        else:
            assert events[:3] == ["start native", "start tidalloc", "start expandable"]


def test_configurations_must_be_two_or_more_and_different(monkeypatch):
    for configs in (["tidalloc"], ["tidalloc", "tidalloc"]):
        monkeypatch.setattr("sys.argv", ["paired_time.py", "gpt2", "--configs"] + configs)
        try:
            paired_time.main()
        except SystemExit as e:
            assert "two or more different" in str(e.code)
        else:
            raise AssertionError("%s was accepted" % configs)


def test_one_allocator_twice_compares_two_processes(monkeypatch, capsys):
    # "native" and "native@PROGRAM" (the same program named again) are two
    # workers of one allocator: their outputs are compared, so a difference
    # shows that the program itself differs between processes.
    DifferentOutputs.started, DifferentOutputs.args = [], []
    monkeypatch.setattr(paired_time, "Worker", DifferentOutputs)
    monkeypatch.setattr("sys.argv", ["paired_time.py", "stream_gct_compile", "--pairs", "1",
                                     "--configs", "native", "native@stream_gct_compile"])
    assert paired_time.main() == 1
    err = capsys.readouterr().err
    assert "native and native@stream_gct_compile gave different outputs" in err
    assert paired_time.config_env(paired_time.split_config(
        "native@stream_gct_compile", "stream_gct_compile")[0])[0] == "native"


class FakeSegmentWorker:
    """A run of `segments` segments of `base` seconds each, times a factor
    that grows with every segment run on either worker (a machine that
    slows steadily over minutes)."""

    def __init__(self, config, base, machine, segments=8):
        self.config, self.base, self.machine, self.segments = config, base, machine, segments
        self.left, self.total = None, 0.0

    def begin(self):
        assert self.left is None, "a run begun twice"
        self.left, self.total = self.segments, 0.0

    def segment(self):
        self.machine["segments"] += 1
        self.machine.setdefault("order", []).append(self.config)
        seconds = self.base * (1 + 0.01 * self.machine["segments"])
        self.left -= 1
        self.total += seconds
        if self.left:
            return seconds, None
        self.left = None
        return seconds, (self.total, "same", 0, 0)

    def run(self):
        self.begin()
        while True:
            _, result = self.segment()
            if result:
                return result


def test_segments_take_turns_so_a_steady_drift_reaches_both_alike():
    for segmented, close in ((False, False), (True, True)):
        machine = {"segments": 0}
        a = FakeSegmentWorker("expandable", 1.0, machine)
        b = FakeSegmentWorker("tidalloc", 1.01, machine)
        rounds = paired_time.run_rounds([a, b], 2, segmented=segmented)
        ratios = [results["tidalloc"][0] / results["expandable"][0] for _, _, results in rounds]
        # Whole runs one after the other: the second run of each pair pays the
        # drift over the first (about 8% here); in segments, A B then B A
        # segment by segment, the drift falls on both alike and each ratio is 1.01.
        assert all(abs(r - 1.01) < 1e-9 for r in ratios) == close
    assert machine["order"][:4] == ["expandable", "tidalloc", "tidalloc", "expandable"]
    assert machine["order"][16:18] == ["tidalloc", "expandable"]  # round 2 begins with B


def test_segmented_runs_that_end_apart_are_an_error():
    machine = {"segments": 0}
    a = FakeSegmentWorker("a", 1.0, machine, segments=4)
    b = FakeSegmentWorker("b", 1.0, machine, segments=5)
    with pytest.raises(RuntimeError, match="different numbers of segments"):
        paired_time.run_rounds([a, b], 1, segmented=True)


def segmented_run():
    """A run(digest) of four frames whose run.segments pauses every `every`."""
    def segments(digest, every, frames=4):
        done = 0
        for _ in range(frames):
            done += 1
            if done % every == 0 and done < frames:
                yield done
        digest.update(b"four frames")

    def run(digest):
        for _ in segments(digest, 4):
            pass
    run.segments = segments
    return run


def test_serve_streams_a_run_in_segments_with_the_whole_runs_outputs(monkeypatch, capsys):
    import io
    validate = load_validate()
    monkeypatch.setattr("sys.stdin", io.StringIO("run\nbegin\nsegment\nsegment\nquit\n"))
    assert validate.serve(FakeTorch(), segmented_run(), segment_frames=2) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "ready"
    whole = lines[1].split()
    assert lines[2] == "begun"
    first, last = lines[3].split(), lines[4].split()
    assert first[0] == "segment" and len(first) == 2
    assert last[0] == "end" and len(last) == 6
    assert last[3] == whole[1]  # the digest of the run in segments is the whole run's
    assert float(last[2]) >= float(last[1])  # the run's seconds hold its last segment's
    assert lines[5] == "peaks 100.0 102.0"


def test_serve_refuses_segments_unless_told(monkeypatch, capsys):
    import io
    validate = load_validate()
    monkeypatch.setattr("sys.stdin", io.StringIO("begin\n"))
    assert validate.serve(FakeTorch(), segmented_run()) == 2
    monkeypatch.setattr("sys.stdin", io.StringIO("segment\n"))
    assert validate.serve(FakeTorch(), segmented_run(), segment_frames=2) == 2


def test_segment_frames_reach_streaming_workers_only(monkeypatch, capsys):
    FakeProcess.started, FakeProcess.args = [], []
    monkeypatch.setattr(paired_time, "Worker", FakeProcess)
    monkeypatch.setattr(paired_time, "run_rounds",
                        lambda workers, rounds, budget_s, emit, segmented, on_segment:
                        FakeProcess.args.append(("segmented", segmented)) or [])
    monkeypatch.setattr("sys.argv", ["paired_time.py", "stream_gct", "--frames", "1024",
                                     "--segment-frames", "64", "--pairs", "1"])
    paired_time.main()
    assert FakeProcess.args[:2] == [["--frames", "1024", "--segment-frames", "64", "--cold"]] * 2
    assert FakeProcess.args[2] == ("segmented", True)
    capsys.readouterr()
    for program, frames in (("gpt2", "64"), ("stream_gct", "0")):
        monkeypatch.setattr("sys.argv", ["paired_time.py", program, "--segment-frames", frames])
        with pytest.raises(SystemExit, match="--segment-frames"):
            paired_time.main()


def test_segments_are_written_and_summarized_segment_by_segment(monkeypatch, capsys, tmp_path):
    machine = {"segments": 0}

    class Process(FakeSegmentWorker):
        def __init__(self, program, config, program_args=()):
            super().__init__(config, 1.0 if config == "expandable" else 1.01, machine, segments=4)

        def wait_ready(self):
            pass

        def close(self):
            return 0, (100.0, 101.0)

    other = "tidalloc:release_slack:0.02,wait_limit:1"  # a name the rows must quote
    monkeypatch.setattr(paired_time, "Worker", Process)
    monkeypatch.setattr("sys.argv", ["paired_time.py", "stream_gct", "--segment-frames", "32",
                                     "--pairs", "2", "--configs", "expandable", other])
    assert paired_time.main() == 0
    out = capsys.readouterr().out
    lines = out.splitlines(keepends=True)
    assert len([line for line in lines if line.startswith("# segment ")]) == 16
    times = paired_time.read_segments(lines, "expandable", other)
    assert sorted(times) == [0, 1, 2, 3] and all(len(t) == 2 for t in times.values())
    # In one segment the second of the two pays one step of the drift over the first.
    assert all(abs(paired_time.geometric_mean([b / a for a, b in t]) - 1.01) < 0.015
               for t in times.values())
    path = tmp_path / "rounds.csv"
    path.write_text(out)
    paired_time.summarize_file(str(path), "expandable", other)
    summary = capsys.readouterr().out
    assert "by segment (geometric mean over rounds): 0: 1.0" in summary
    assert "summed segment times: 1.01" in summary and "over 8 segments" in summary
    assert "2 pairs" in summary and "geometric mean 1.0100" in summary


def test_segment_sum_interval_covers_the_true_ratio_only_where_segments_agree():
    """The ratio of summed segment times, and an interval that is narrow
    where every segment says the same and wide where they scatter."""
    steady = [(1.0 + 0.1 * i, 1.02 * (1.0 + 0.1 * i)) for i in range(16)]
    ratio, lo, hi = paired_time.segment_sum_interval(steady)
    assert abs(ratio - 1.02) < 1e-9 and hi - lo < 1e-9
    scattered = [(1.0, 1.02 * (0.8 if i % 2 else 1.2)) for i in range(16)]
    ratio, lo, hi = paired_time.segment_sum_interval(scattered)
    assert abs(ratio - 1.02) < 1e-9 and lo < 0.98 and hi > 1.06


SERVED_WORKER = r"""
import sys
sys.path.insert(0, sys.argv[1])
from repo_module import load
from test_paired_time import FakeTorch, segmented_run
validate = load("tests/torch/validate.py")
sys.exit(validate.serve(FakeTorch(), segmented_run(), segment_frames=int(sys.argv[2]),
                        label="fake"))
"""


def served_worker(config, segment_frames):
    """paired_time's Worker over a real pipe to validate.serve (a stand-in torch)."""
    import subprocess
    import sys
    worker = paired_time.Worker.__new__(paired_time.Worker)
    worker.config = config
    worker.proc = subprocess.Popen(
        [sys.executable, "-c", SERVED_WORKER, os.path.dirname(os.path.abspath(__file__)),
         str(segment_frames)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        bufsize=1)
    worker.wait_ready()
    return worker


def test_workers_and_serve_speak_the_same_segment_protocol():
    a, b = served_worker("a", 2), served_worker("b", 1)
    try:
        rounds = paired_time.run_rounds([a, b], 1, segmented=False)
        whole = rounds[0][2]
        assert whole["a"][1] == whole["b"][1]
        # b pauses after every frame (four segments), a every other (two): they end apart.
        with pytest.raises(RuntimeError, match="different numbers of segments"):
            paired_time.run_rounds([a, b], 1, segmented=True)
    finally:
        for w in (a, b):
            w.proc.kill()
            w.proc.wait()
    a, b = served_worker("a", 2), served_worker("b", 2)
    try:
        heard = []
        rounds = paired_time.run_rounds([a, b], 2, segmented=True,
                                        on_segment=lambda *seg: heard.append(seg))
        assert [(i, c, j) for i, c, j, _ in heard] == [
            (0, "a", 0), (0, "b", 0), (0, "b", 1), (0, "a", 1),
            (1, "b", 0), (1, "a", 0), (1, "a", 1), (1, "b", 1)]
        for _, _, results in rounds:
            assert results["a"][1] == results["b"][1] == whole["a"][1]  # the whole run's digest
            assert results["a"][2:] == (-1, -1)
        assert all(w.close() == (0, (100.0, 102.0)) for w in (a, b))
    finally:
        for w in (a, b):
            if w.proc.poll() is None:
                w.proc.kill()



def test_a_worker_that_prints_while_it_is_built_still_starts(capsys):
    """A program whose imports print (LingBot-Map's do) before the worker
    says "ready": the lines go to stderr, and the worker starts; a worker
    that ends without "ready" is an error naming it."""
    import subprocess
    import sys

    def worker(text):
        w = object.__new__(paired_time.Worker)
        w.config = "expandable"
        w.proc = subprocess.Popen([sys.executable, "-c", "print(%r, end='')" % text],
                                  stdout=subprocess.PIPE, text=True)
        return w

    w = worker("flashinfer not available\nready\n")
    w.wait_ready()
    w.proc.wait()
    assert "expandable: flashinfer not available" in capsys.readouterr().err
    w = worker("some noise\n")
    with pytest.raises(RuntimeError, match="expandable: worker did not start"):
        w.wait_ready()
    w.proc.wait()


def test_median_segment_ratio_ignores_one_stalled_segment():
    """One segment stalled to 1.6 x its time moves the ratio of summed
    segment times but not the median of the segments' ratios."""
    pairs = [(4.0, 4.0 * r) for r in (0.98, 0.99, 1.0, 1.01, 1.02, 0.99, 1.0, 1.01)]
    stalled = pairs[:3] + [(4.0, 6.4)] + pairs[4:]
    summed = paired_time.segment_sum_interval(stalled)[0]
    median, lo, hi = paired_time.segment_median_interval(stalled)
    assert summed > 1.06
    assert 0.99 <= median <= 1.01 and lo <= median <= hi


def test_crowded_device_is_named():
    """Four LingBot-Map workers of about 20 GB on an 80 GB card come within
    the low-water mark: said; two are not."""
    total = 81559.0
    four = [19850.0, 18322.0, 20276.0, 20484.0]
    assert "low-water mark" in paired_time.crowding_warning(four, total)
    assert paired_time.crowding_warning(four[:2], total) is None
    assert paired_time.crowding_warning(four, None) is None
