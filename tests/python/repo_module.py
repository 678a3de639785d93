"""repo_module.py: a script of this repository (one not installed as a
package: scripts/, bench/, tests/torch/) loaded as a module by its
path from the repository root, for the tests beside this file; and
whether this tree's package finds its built library."""
import importlib.util
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def load(relative_path):
    """The module of ROOT/relative_path, executed once per call."""
    name = os.path.splitext(os.path.basename(relative_path))[0]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relative_path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def library_found():
    """Whether the package of this tree (python/) finds libtidalloc.so
    (make build, or TIDALLOC_LIB)."""
    sys.path.insert(0, os.path.join(ROOT, "python"))
    try:
        import tidalloc
        return os.path.exists(tidalloc.library_path())
    except (ImportError, OSError):
        return False
