"""test_torch_versions.py: which torch versions the shim is tried on, and a
failed build remembered, without torch: a stand-in torch package (a version
string, CUDA's header in a temporary folder, and a cpp_extension.load that
fails as a real compiler does, or succeeds) in front of whatever is installed.
In process for tidalloc.shim; as `python -m tidalloc run` in a subprocess for
what a user sees (one line, then the pluggable path)."""
import os
import sys
import time
import types

import pytest

PYTHON_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python")
sys.path.insert(0, PYTHON_DIR)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tidalloc import shim  # noqa: E402
from fake_torch import COMPILER_OUTPUT, calls as _calls, launch as _launch  # noqa: E402

class FakeTorch:
    """A torch module with cpp_extension, put in sys.modules; .calls counts
    cpp_extension.load, .fail makes it raise COMPILER_OUTPUT."""

    def __init__(self, monkeypatch, tmp_path, version):
        self.calls = 0
        self.fail = True
        torch = types.ModuleType("torch")
        torch.__version__ = version
        torch.version = types.SimpleNamespace(cuda="13.0")
        ext = types.ModuleType("torch.utils.cpp_extension")
        cuda = tmp_path / "cuda"
        (cuda / "include").mkdir(parents=True, exist_ok=True)
        (cuda / "include" / "cuda_runtime_api.h").write_text("")
        ext.CUDA_HOME = str(cuda)
        ext.verify_ninja_availability = lambda: None
        ext.load = self._load
        utils = types.ModuleType("torch.utils")
        utils.cpp_extension = ext
        torch.utils = utils
        self.torch = torch
        for name, module in (("torch", torch), ("torch.utils", utils),
                             ("torch.utils.cpp_extension", ext)):
            monkeypatch.setitem(sys.modules, name, module)
        library = tmp_path / "libtidalloc.so"
        library.write_bytes(b"")
        monkeypatch.setattr(shim._lib, "library_path", lambda: str(library))
        monkeypatch.setenv("TIDALLOC_CACHE", str(tmp_path / "cache"))
        monkeypatch.setenv("CXX", sys.executable)  # any program that exists
        for name in ("TIDALLOC_SHIM_RETRY", "TIDALLOC_VERBOSE", "TIDALLOC_TORCH_BRIDGE"):
            monkeypatch.delenv(name, raising=False)

    def _load(self, name, sources, build_directory, **kwargs):
        self.calls += 1
        if self.fail:
            raise RuntimeError(COMPILER_OUTPUT)
        with open(os.path.join(build_directory, name + ".so"), "w") as f:
            f.write("built")


@pytest.fixture
def fake(monkeypatch, tmp_path):
    return lambda version="2.15.0": FakeTorch(monkeypatch, tmp_path, version)


@pytest.mark.parametrize("version, supported", [
    ("2.8.0", True), ("2.9.1", True), ("2.15.0", True), ("2.12.1+cu126", True),
    ("2.11.0a0+git1234", True), ("2.7.1", False), ("2.16.0", False), ("3.0.0", False),
    ("1.13.1", False), ("nonsense", False)])
def test_supported_versions(version, supported):
    assert shim.version_supported(version) is supported


def test_supported_range_matches_the_compile_check():
    """The range said to users is the one tests/torch/torch_versions.txt
    (what shim_compile.sh --versions compiles against) spans."""
    listed = os.path.join(os.path.dirname(__file__), "..", "torch", "torch_versions.txt")
    with open(listed) as f:
        versions = [shim.torch_minor(x) for x in f if x.strip() and not x.startswith("#")]
    assert (min(versions), max(versions)) == shim.SUPPORTED
    assert shim.supported_range() == "2.8 to 2.15"


@pytest.mark.parametrize("version", ["2.7.1", "2.16.0"])
def test_outside_the_range_is_refused_without_a_build(fake, version):
    t = fake(version)
    why = shim.unavailable()
    assert why == "torch %s is outside the versions the shim supports (2.8 to 2.15)" % version
    with pytest.raises(shim.ShimUnavailable, match="outside the versions"):
        shim.build()
    assert t.calls == 0
    assert shim.plan() == ("pluggable", why)
    # Asked for by name, it is tried all the same.
    assert shim.unavailable(any_version=True) is None
    assert shim.plan("shim")[0] == "shim"


def test_a_failed_build_says_why_in_one_line_and_is_remembered(fake):
    t = fake("2.15.0")
    with pytest.raises(shim.ShimUnavailable) as first:
        shim.build()
    message = str(first.value)
    assert "\n" not in message
    assert "torch 2.15.0" in message
    assert "abstract class type" in message and "attachOomRejectionObserver" in message
    assert "build-shim --retry" in message
    assert "ninja: build stopped" not in message
    assert t.calls == 1
    log = message.split("compiler output: ")[1].split(")")[0]
    with open(log) as f:
        assert f.read().strip() == COMPILER_OUTPUT.strip()  # all of it, for the user

    start = time.monotonic()
    with pytest.raises(shim.ShimUnavailable) as second:
        shim.build()
    assert time.monotonic() - start < 1
    assert t.calls == 1  # no second compile
    assert "for torch 2.15.0 failed earlier and is not tried again" in str(second.value)
    assert "attachOomRejectionObserver" in str(second.value)
    bridge, why = shim.plan()
    assert bridge == "pluggable" and "earlier build" in why and "--retry" in why


def test_retry_builds_again(fake, monkeypatch):
    t = fake("2.15.0")
    with pytest.raises(shim.ShimUnavailable):
        shim.build()
    monkeypatch.setenv("TIDALLOC_SHIM_RETRY", "1")
    with pytest.raises(shim.ShimUnavailable, match="failed"):
        shim.build()
    assert t.calls == 2
    monkeypatch.delenv("TIDALLOC_SHIM_RETRY")
    t.fail = False
    with pytest.raises(shim.ShimUnavailable, match="failed earlier"):
        shim.build()  # still remembered without a retry
    assert t.calls == 2
    path = shim.build(retry=True)
    assert t.calls == 3 and os.path.exists(path)
    assert shim.remembered_failure() is None
    assert shim.build() == path and t.calls == 3  # built: cached
    assert shim.plan() == ("shim", "built for this torch: %s" % path)


def test_another_torch_or_shim_source_tries_again(fake, monkeypatch, tmp_path):
    t = fake("2.15.0")
    with pytest.raises(shim.ShimUnavailable):
        shim.build()
    assert t.calls == 1
    t.torch.__version__ = "2.15.1"
    with pytest.raises(shim.ShimUnavailable, match="failed"):
        shim.build()
    assert t.calls == 2
    changed = tmp_path / "tidalloc_torch.cpp"
    with open(shim.SOURCE) as f:
        changed.write_text(f.read() + "\n// changed\n")
    monkeypatch.setattr(shim, "SOURCE", str(changed))
    t.fail = False
    assert os.path.exists(shim.build())
    assert t.calls == 3


def test_a_fresh_shim_is_planned_not_built(fake):
    t = fake("2.8.0")
    bridge, why = shim.plan()
    assert bridge == "shim" and "not built yet" in why and "build-shim" in why
    assert t.calls == 0
    assert shim.plan("pluggable")[0] == "pluggable"


def test_run_on_an_unsupported_torch_says_one_line(tmp_path):
    r = _launch(tmp_path, "2.7.1", "run", "script.py", "--flag")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "script ran ['--flag']\n"
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("tidalloc: torch 2.7.1 is outside the versions the shim "
                               "supports (2.8 to 2.15); running as a pluggable allocator, without ")
    assert "reduce-overhead" in lines[0] and "MemPool" in lines[0]
    assert _calls(tmp_path) == 0


def test_run_after_a_failed_build_does_not_build_again(tmp_path):
    first = _launch(tmp_path, "2.15.0", "run", "script.py")
    assert first.returncode == 0, first.stderr
    assert "script ran" in first.stdout
    # The notice of the build, then why it failed and what is lost.
    said = first.stderr.splitlines()
    assert len(said) == 2 and "building the PyTorch shim" in said[0], first.stderr
    assert "attachOomRejectionObserver" in said[1] and "without" in said[1]
    assert "ninja" not in first.stderr and "Traceback" not in first.stderr
    assert _calls(tmp_path) == 1

    second = _launch(tmp_path, "2.15.0", "run", "script.py")
    assert second.returncode == 0, second.stderr
    assert _calls(tmp_path) == 1  # remembered: no compiler run
    lines = second.stderr.splitlines()
    assert len(lines) == 1 and "failed earlier" in lines[0] and "--retry" in lines[0], \
        second.stderr

    retried = _launch(tmp_path, "2.15.0", "run", "script.py",
                      env_extra={"TIDALLOC_SHIM_RETRY": "1"})
    assert retried.returncode == 0 and _calls(tmp_path) == 2

    b = _launch(tmp_path, "2.15.0", "build-shim", "--retry")
    assert b.returncode == 1 and _calls(tmp_path) == 3
    said = b.stderr.splitlines()
    assert said[0] == "tidalloc: building the PyTorch shim for torch 2.15.0 (once, about 15 s)"
    assert len(said) == 2 and said[1].startswith("python -m tidalloc build-shim: building the "
                                                 "shim for torch 2.15.0 failed (error: "), said

    info = _launch(tmp_path, "2.15.0", "info")
    assert info.returncode == 0, info.stderr
    assert "torch: 2.15.0 (CUDA 13.0)" in info.stdout
    assert "bridge: pluggable: an earlier build" in info.stdout
    assert "lost on the pluggable path:" in info.stdout


def test_info_and_build_shim_on_an_unsupported_torch(tmp_path):
    info = _launch(tmp_path, "2.16.0", "info")
    assert info.returncode == 0, info.stderr
    assert "torch: 2.16.0 (CUDA 13.0), outside the supported versions" in info.stdout
    assert "bridge: pluggable: torch 2.16.0 is outside the versions the shim supports " \
           "(2.8 to 2.15)" in info.stdout
    b = _launch(tmp_path, "2.16.0", "build-shim")
    assert b.returncode == 1
    assert b.stderr.strip() == ("python -m tidalloc build-shim: cannot build the shim: torch "
                                "2.16.0 is outside the versions the shim supports (2.8 to 2.15); "
                                "TIDALLOC_TORCH_BRIDGE=shim tries it all the same")
    assert _calls(tmp_path) == 0
