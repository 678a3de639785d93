"""repo_module.py: a script of this repository (one not installed as a
package: scripts/, bench/, tests/torch/) loaded as a module by its
path from the repository root, for the tests beside this file."""
import importlib.util
import os

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def load(relative_path):
    """The module of ROOT/relative_path, executed once per call."""
    name = os.path.splitext(os.path.basename(relative_path))[0]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relative_path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
