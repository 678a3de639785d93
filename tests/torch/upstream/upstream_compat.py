"""upstream_compat.py: a pytest plugin (-p upstream_compat) that lets test
files of PyTorch's repository from a neighbouring version import against the
installed torch: every name they import from torch.testing._internal that
this torch lacks is defined before collection. A renamed flag gets its new
value (HAS_CUDA is HAS_CUDA_AND_TRITON now); another missing flag is False;
a missing helper skips the test that uses it, saying so. The tests run the
same way under both allocators, so a test this changes changes for both."""
import ast
import glob
import importlib
import os
import unittest

RENAMED = {
    "HAS_CUDA": "HAS_CUDA_AND_TRITON",
}


def _flag(module, name):
    if name in RENAMED and hasattr(module, RENAMED[name]):
        return getattr(module, RENAMED[name])
    if name == "TEST_CUDAMALLOCASYNC":
        import torch
        return torch.cuda.is_available() and torch.cuda.get_allocator_backend() == "cudaMallocAsync"
    return False


def _missing_helper(name):
    reason = "%s is not in this torch's testing helpers" % name

    def helper(*args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return unittest.skip(reason)(args[0])
        return unittest.skip(reason)  # used as a decorator factory
    return helper


def _imports(path):
    tree = ast.parse(open(path).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "torch.testing._internal"):
            for alias in node.names:
                yield node.module, alias.name


def pytest_configure(config):
    added = []
    for path in glob.glob(os.path.join(os.getcwd(), "test*.py")):
        for module_name, name in _imports(path):
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            if hasattr(module, name):
                continue
            value = _flag(module, name) if name.isupper() else _missing_helper(name)
            setattr(module, name, value)
            added.append("%s.%s" % (module_name.rsplit(".", 1)[-1], name))
    if added:
        print("upstream_compat: defined %s" % ", ".join(sorted(set(added))))


def _allocator():
    """What allocates CUDA memory in this process, as a line for the report,
    and whether that is what the run asked for (TIDALLOC_INSTALL=1: tidalloc,
    installed by sitecustomize.py, whose errors Python only mentions in one
    line of stderr and then goes on without it)."""
    if os.environ.get("TIDALLOC_INSTALL") != "1":
        return "allocator: PyTorch's own", True
    try:
        import tidalloc.torch
    except Exception as e:  # noqa: BLE001: any failure means the run is not under tidalloc
        return "allocator: tidalloc was asked for but cannot be imported (%s)" % e, False
    bridge = tidalloc.torch.bridge()
    if bridge is None:
        return ("allocator: tidalloc was asked for but is not installed (sitecustomize.py "
                "failed: run python -c 'import tidalloc.torch; tidalloc.torch.install()' to see "
                "why)"), False
    return "allocator: tidalloc (%s)" % bridge, True


def pytest_report_header(config):
    return _allocator()[0]


def pytest_sessionstart(session):
    """A run that asked for tidalloc and does not have it stops at once:
    its results would be the native allocator's under tidalloc's name. The
    line is written also under -q, which leaves out the report header."""
    line, ok = _allocator()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line)
    if not ok:
        import pytest
        pytest.exit(line, returncode=3)
