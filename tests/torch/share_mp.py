"""share_mp.py: CUDA tensors sent between processes through torch.multiprocessing
while tidalloc is PyTorch's allocator in the sending process.

The parent installs tidalloc, makes tensors of several sizes and dtypes (one
a view with an offset into its storage, one a Parameter), and puts them on a
queue of a spawned child. The child checks every value against what it
computes itself, adds 1 in place to each shared tensor, and answers. The
parent then sees the child's writes in its own tensors: the memory is shared,
not copied. Prints PASS/FAIL lines; exit 0 only if all pass.

    python tests/torch/share_mp.py        (needs a GPU; TIDALLOC_LIB or a build/)
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def make(device):
    g = torch.Generator(device="cpu").manual_seed(7)
    big = torch.randn(3_000_000, generator=g).to(device)  # ~11 MiB: several pages
    small = torch.arange(1000, dtype=torch.int32).to(device)
    half = torch.randn(64, 128, generator=g).to(device=device, dtype=torch.bfloat16)
    base = torch.randn(4096, generator=g).to(device)
    view = base[1000:3000]  # an offset into its storage
    param = torch.nn.Parameter(torch.randn(256, generator=g).to(device))
    return {"big": big, "small": small, "half": half, "view": view, "param": param}


def child(inbox, outbox):
    try:
        torch.cuda.set_device(0)
        got = inbox.get()
        want = make("cuda:0")
        report = []
        for name, t in got.items():
            same = t.dtype == want[name].dtype and t.shape == want[name].shape and \
                torch.equal(t.detach(), want[name].detach())
            report.append((name, bool(same), str(t.dtype), tuple(t.shape)))
            with torch.no_grad():
                t.add_(1)
        torch.cuda.synchronize()
        outbox.put(("ok", report, isinstance(got["param"], torch.nn.Parameter)))
        inbox.get()  # keep the mappings until the parent has looked
    except Exception as e:  # report, never hang the parent
        outbox.put(("error", "%s: %s" % (type(e).__name__, e), False))


def main():
    import tidalloc.torch as tt
    tt.install()
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 0
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=child, args=(inbox, outbox))
    proc.start()
    tensors = make("cuda:0")
    before = {k: v.detach().clone() for k, v in tensors.items()}
    inbox.put(tensors)
    status, report, is_param = outbox.get(timeout=300)
    failures = 0
    if status != "ok":
        print("FAIL: the child could not use the tensors: %s" % report)
        failures += 1
    else:
        for name, same, dtype, shape in report:
            print("%s: child read %s (%s %s) equal to the parent's" %
                  ("PASS" if same else "FAIL", name, dtype, shape))
            failures += not same
        print("%s: the Parameter arrived as a Parameter" % ("PASS" if is_param else "FAIL"))
        failures += not is_param
        torch.cuda.synchronize()
        for name, t in tensors.items():
            ok = torch.equal(t.detach(), before[name] + 1)
            print("%s: the child's in-place add is seen in the parent's %s (shared, not copied)" %
                  ("PASS" if ok else "FAIL", name))
            failures += not ok
    inbox.put("done")
    proc.join(timeout=120)
    print("%s: child exit code %s" % ("PASS" if proc.exitcode == 0 else "FAIL", proc.exitcode))
    failures += proc.exitcode != 0
    print("%s: share_mp: %d failure(s)" % ("PASS" if failures == 0 else "FAIL", failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
