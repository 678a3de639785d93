"""sdpa.py: holding torch's scaled_dot_product_attention to one kernel, for
the benchmarks beside this file (--sdpa).

PyTorch picks a kernel per call among flash, memory-efficient, cuDNN and
math. Which one it picks differs by GPU and torch version, and a cache that
grows every step is where they differ most: cuDNN's attention builds an
execution plan for every new key length (cached per length afterwards), so
a program's first pass over each length pays for the plan, where flash and
memory-efficient attention pay nothing. Holding one kernel makes two
configurations compare like with like."""
import contextlib

SDPA_KERNELS = ("default", "flash", "efficient", "cudnn", "math")


def sdpa_context(kernel):
    """A context holding scaled_dot_product_attention to `kernel`
    ("default": PyTorch's choice)."""
    if kernel == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([{"flash": SDPBackend.FLASH_ATTENTION,
                         "efficient": SDPBackend.EFFICIENT_ATTENTION,
                         "cudnn": SDPBackend.CUDNN_ATTENTION,
                         "math": SDPBackend.MATH}[kernel]])
