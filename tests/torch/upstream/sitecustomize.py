"""sitecustomize.py: installs tidalloc as PyTorch's allocator in every Python
process started with this folder on PYTHONPATH and TIDALLOC_INSTALL=1, so
that PyTorch's own test files (and the worker processes pytest starts) run
under tidalloc unchanged. TIDALLOC_TORCH_BRIDGE picks the bridge (default:
the shim)."""
import os

if os.environ.get("TIDALLOC_INSTALL") == "1":
    import tidalloc.torch

    tidalloc.torch.install(bridge=os.environ.get("TIDALLOC_TORCH_BRIDGE", "shim"))
