"""graph_safety.py: CUDA graphs captured with torch.cuda.graph under tidalloc
stay correct while the program allocates and writes other tensors between the
capture and the replays.

A graph replays at the addresses its capture used, also those of blocks the
capture freed (its intermediates). If such a block is handed out again after
the capture, a replay overwrites whatever lives there. PyTorch's pluggable
allocator path never tells tidalloc that a capture begins or ends, so
tidalloc.torch.install() turns on capture_detection, which sends allocations
on a stream being captured to a private pool of that capture.

The test captures two MLP blocks (LayerNorm, Linear, GELU, Linear, residual:
their intermediates are freed during capture) as two graphs on one capture
stream, then, before every replay, allocates and fills "filler" tensors of the
intermediates' sizes on the capture stream and on the default stream, frees
some older ones, and writes new inputs. After each round of replays (the second
graph first, so that its output would be overwritten by the first graph's
replay if it had landed in the first graph's freed blocks) it checks:
  - each graph's output equals the eager output on the same input, exactly;
  - every filler still holds the value written into it.
Prints one line per replay round and exits 1 if a check fails, 77 (skipped)
without a CUDA device.

    python tests/torch/graph_safety.py [--replays N]             (under tidalloc)
    python tests/torch/graph_safety.py --native                  (PyTorch's allocator)
    python tests/torch/graph_safety.py --conf capture_detection:False
        (shows what the option prevents: expected to fail)"""
import argparse
import os
import sys

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--native", action="store_true",
                    help="run under PyTorch's own allocator, for comparison")
parser.add_argument("--conf", help="tidalloc options for install(), key:value,...")
parser.add_argument("--replays", type=int, default=5, help="replay rounds (default 5)")
args = parser.parse_args()
if args.replays < 1:
    sys.exit("graph_safety: --replays must be at least 1")

if not args.native:
    # The package of this source tree, also when PYTHONPATH does not name it.
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "python"))
    import tidalloc.torch
    from tidalloc import _lib
    tidalloc.torch.install(args.conf)  # before anything starts CUDA

import torch  # noqa: E402

if not torch.cuda.is_available():
    print("graph_safety: SKIP: no CUDA device (torch.cuda.is_available() is False)")
    sys.exit(77)

MiB = 1 << 20
N_A, N_B, D, H = 256, 128, 1024, 4096  # rows of each graph's input, width, hidden width
dev = torch.device("cuda")
torch.backends.cuda.matmul.allow_tf32 = False  # the same kernels' results, eager and replayed

failures = 0


def check(name, ok, detail=""):
    global failures
    print("%s: %s %s" % ("PASS" if ok else "FAIL", name, detail))
    failures += 0 if ok else 1


class Block(torch.nn.Module):
    """A transformer MLP block: every step but the last makes a tensor the
    capture frees once the next step has read it."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.norm = torch.nn.LayerNorm(D)
        self.up = torch.nn.Linear(D, H)
        self.down = torch.nn.Linear(H, D)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.up(self.norm(x)))
        return x + 0.5 * self.down(h)


if args.native:
    print("allocator: PyTorch native (%s)" % torch.cuda.get_allocator_backend())
else:
    value, source = _lib.conf_option("capture_detection")
    print("allocator: tidalloc (%s), capture_detection %s (set by: %s)"
          % (torch.cuda.get_allocator_backend(), value, source))

gen = torch.Generator(device=dev)
gen.manual_seed(0)
model_a = Block(1).to(dev).eval()
model_b = Block(2).to(dev).eval()
x_a = torch.randn(N_A, D, device=dev, generator=gen)
x_b = torch.randn(N_B, D, device=dev, generator=gen)

# Warm-up on the capture stream, as PyTorch asks before a capture: kernels
# chosen, cuBLAS's workspace for this stream allocated outside the capture.
cap = torch.cuda.Stream()
cap.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(cap), torch.no_grad():
    for _ in range(3):
        model_a(x_a)
        model_b(x_b)
torch.cuda.current_stream().wait_stream(cap)

graph_a, graph_b = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
with torch.no_grad():
    with torch.cuda.graph(graph_a, stream=cap):
        out_a = model_a(x_a)
    with torch.cuda.graph(graph_b, stream=cap):
        out_b = model_b(x_b)
torch.cuda.synchronize()
print("captured two graphs; allocated %.1f MiB, reserved %.1f MiB"
      % (torch.cuda.memory_allocated() / MiB, torch.cuda.memory_reserved() / MiB))

# The sizes of the blocks the captures freed: fillers of these sizes are what
# an allocator would hand those blocks to.
FILLER_SHAPES = ((N_A, H), (N_A, H), (N_A, D), (N_A, D), (N_A, D),
                 (N_B, H), (N_B, H), (N_B, D), (N_B, D), (N_B, D))
fillers = []  # (tensor, the value written into it)


def add_fillers():
    for stream in (cap, torch.cuda.current_stream()):
        with torch.cuda.stream(stream):
            for shape in FILLER_SHAPES:
                value = float(len(fillers) % 4093 + 1)  # distinct, exact in float32
                fillers.append((torch.full(shape, value, device=dev), value))
    torch.cuda.synchronize()


add_fillers()
for replay in range(args.replays):
    # Churn: free the oldest fillers (their blocks go back to the cache) and
    # allocate new ones, so that freed and reused blocks are both in play.
    del fillers[:len(FILLER_SHAPES) // 2]
    add_fillers()
    x_a.copy_(torch.randn(N_A, D, device=dev, generator=gen))
    x_b.copy_(torch.randn(N_B, D, device=dev, generator=gen))
    graph_b.replay()
    graph_a.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        eager_a, eager_b = model_a(x_a), model_b(x_b)
    torch.cuda.synchronize()
    bad = [i for i, (t, v) in enumerate(fillers) if not bool((t == v).all())]
    diff = max((out_a - eager_a).abs().max().item(), (out_b - eager_b).abs().max().item())
    check("replay %d: outputs equal eager, %d fillers intact" % (replay + 1, len(fillers)),
          torch.equal(out_a, eager_a) and torch.equal(out_b, eager_b) and not bad,
          "(max |replay - eager| %.3g%s)" % (diff, ", fillers overwritten: %d" % len(bad)
                                              if bad else ""))
print("allocated %.1f MiB, reserved %.1f MiB after %d replays"
      % (torch.cuda.memory_allocated() / MiB, torch.cuda.memory_reserved() / MiB, args.replays))
print("graph_safety: %s" % ("FAIL" if failures else "PASS"))
sys.exit(1 if failures else 0)
