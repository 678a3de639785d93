"""fake_torch.py: a stand-in torch for the tests beside this file, on disk,
for `python -m tidalloc` in a subprocess without torch installed: a version
string (FAKE_TORCH_VERSION), enough of torch.cuda for the pluggable path,
and a cpp_extension whose load fails as a compiler does (COMPILER_OUTPUT),
counting its calls. launch() runs `python -m tidalloc ARGS...` with it."""
import os
import subprocess
import sys
import textwrap

PYTHON_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python")

# What cpp_extension raises when the compiler fails (verbose off): the
# compiler's output after "Error building extension".
COMPILER_OUTPUT = textwrap.dedent("""\
    Error building extension 'tidalloc_torch_x': [1/2] c++ -MMD -c tidalloc_torch.cpp
    FAILED: tidalloc_torch.o
    /usr/include/c++/13/bits/stl_construct.h:115:28: error: no matching function for call to 'construct_at(tidalloc_torch::TidallocAllocator*&)'
    /usr/include/c++/13/bits/stl_construct.h:96:17: error: invalid new-expression of abstract class type 'tidalloc_torch::TidallocAllocator'
    tidalloc_torch.cpp:226:7: note:   because the following virtual functions are pure within 'tidalloc_torch::TidallocAllocator':
    CUDACachingAllocator.h:270:16: note:     'virtual void c10::cuda::CUDACachingAllocator::CUDAAllocator::attachOomRejectionObserver(c10::cuda::CUDACachingAllocator::OomRejectionObserver)'
    ninja: build stopped: subcommand failed.
    """)


# A torch package on disk for `python -m tidalloc run`: enough of torch.cuda
# for the pluggable path, cpp_extension.load failing as above and counting
# its calls in $FAKE_TORCH_CALLS.
FAKE_TORCH = '''
import os, types
__version__ = os.environ["FAKE_TORCH_VERSION"]
version = types.SimpleNamespace(cuda="13.0")

class Tensor: pass

def _stat(device=None): return 0

cuda = types.ModuleType("torch.cuda")
cuda.is_initialized = lambda: False
cuda.current_device = lambda: 0
memory = types.ModuleType("torch.cuda.memory")
class CUDAPluggableAllocator:
    def __init__(self, path, alloc, free): self.args = (path, alloc, free)
memory.CUDAPluggableAllocator = CUDAPluggableAllocator
memory.change_current_allocator = lambda allocator: None
cuda.memory = memory
for _name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
              "max_memory_reserved", "memory_stats", "reset_peak_memory_stats", "empty_cache"):
    setattr(cuda, _name, _stat)

nn = types.ModuleType("torch.nn")
nn.parameter = types.SimpleNamespace(Parameter=type("Parameter", (Tensor,), {}))
multiprocessing = types.ModuleType("torch.multiprocessing")
multiprocessing.reductions = types.SimpleNamespace(reduce_tensor=lambda t: None,
                                                   init_reductions=lambda: None)

def _load(name, sources, build_directory, **kwargs):
    with open(os.environ["FAKE_TORCH_CALLS"], "a") as f:
        f.write(name + "\\n")
    raise RuntimeError(os.environ["FAKE_TORCH_OUTPUT"])

cpp_extension = types.ModuleType("torch.utils.cpp_extension")
cpp_extension.CUDA_HOME = os.environ["FAKE_CUDA_HOME"]
cpp_extension.verify_ninja_availability = lambda: None
cpp_extension.load = _load
utils = types.ModuleType("torch.utils")
utils.cpp_extension = cpp_extension
import sys
sys.modules.update({"torch.cuda": cuda, "torch.cuda.memory": memory, "torch.nn": nn,
                    "torch.multiprocessing": multiprocessing,
                    "torch.multiprocessing.reductions": multiprocessing.reductions,
                    "torch.utils": utils, "torch.utils.cpp_extension": cpp_extension})
'''


def launch(tmp_path, version, *args, env_extra=None):
    pkg = tmp_path / "site" / "torch"
    if not pkg.exists():
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(FAKE_TORCH)
        (tmp_path / "cuda" / "include").mkdir(parents=True)
        (tmp_path / "cuda" / "include" / "cuda_runtime_api.h").write_text("")
        (tmp_path / "script.py").write_text("import sys\nprint('script ran', sys.argv[1:])\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), PYTHON_DIR]),
               FAKE_TORCH_VERSION=version, FAKE_TORCH_CALLS=str(tmp_path / "calls"),
               FAKE_TORCH_OUTPUT=COMPILER_OUTPUT, FAKE_CUDA_HOME=str(tmp_path / "cuda"),
               TIDALLOC_CACHE=str(tmp_path / "cache"), CXX=sys.executable,
               TIDALLOC_CONF="backend:host")
    for name in ("TIDALLOC_SHIM_RETRY", "TIDALLOC_VERBOSE", "TIDALLOC_TORCH_BRIDGE"):
        env.pop(name, None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "tidalloc"] + list(args), env=env,
                          capture_output=True, text=True, timeout=120, cwd=str(tmp_path))


def calls(tmp_path):
    path = tmp_path / "calls"
    return len(path.read_text().splitlines()) if path.exists() else 0
