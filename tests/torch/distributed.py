"""distributed.py: torch.distributed with NCCL on 2 GPUs, every rank's CUDA
memory from tidalloc (tidalloc.torch.install() in each rank before CUDA
starts).

1. Collectives on tensors tidalloc allocated, of 1 to 2^24 elements, checked
   exactly against the values every rank can compute itself: all_reduce (sum
   of int64 ramps and of small float32 integers, also asynchronous),
   all_gather and all_gather_into_tensor (int64 ramps), broadcast (float32
   from a seeded generator, from the first and from the last rank).
2. Data-parallel training: DistributedDataParallel over a transformer
   encoder block and a linear head, Adam, fixed seeds, --iters iterations
   (default 1000). torch.cuda.memory_allocated and memory_reserved are
   recorded per rank every --interval iterations (default 100); at the end
   both must equal their value at the first record (iteration 100 by
   default) or be at most one page, 2 MiB, above it. The parameters must be
   identical on every rank and the loss finite.

Rank 0 prints every check, a per-rank memory table and, with --csv FILE, the
records as CSV (allocator,rank,iteration,allocated_bytes,reserved_bytes,loss).
Exits 0 when every check passes, 1 when one fails, and 77 (skipped) with a
message when fewer than 2 GPUs are visible.

NVLink multicast (NVLS, symmetric-memory multicast) is never used: the script
sets NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 before NCCL
starts.

    python tests/torch/distributed.py [--iters N] [--csv FILE]     (2 ranks, spawned)
    torchrun --nproc-per-node 2 tests/torch/distributed.py [...]   (ranks from torchrun)
    python tests/torch/distributed.py --native                     (PyTorch's allocator)
    python tests/torch/distributed.py --cpu --iters 200            (the script's logic on
        CPUs with gloo and no tidalloc, for machines without GPUs; figures are 0)"""
import argparse
import csv
import datetime
import functools
import math
import os
import socket
import sys

# Before anything can start NCCL, in this process and in the ranks it starts.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

SKIP = 77  # the exit status of a skipped test, as ctest and automake read it
WORLD = 2
PAGE = 2 << 20  # one page of tidalloc's expandable segments on the H200
MiB = 1 << 20


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=1000, help="training iterations (1000)")
    parser.add_argument("--interval", type=int, default=100,
                        help="iterations between memory records (100); the first record is "
                        "the baseline")
    parser.add_argument("--csv", help="write the memory records here (rank 0)")
    parser.add_argument("--native", action="store_true",
                        help="PyTorch's own allocator instead of tidalloc, for comparison")
    parser.add_argument("--conf", help="tidalloc options for install(), key:value,...")
    parser.add_argument("--cpu", action="store_true",
                        help="gloo on CPUs without tidalloc: checks the script, not the allocator")
    args = parser.parse_args(argv)
    if args.interval < 1 or args.iters < 2 * args.interval:
        parser.error("--iters must be at least twice --interval (a baseline and a later record)")
    return args


# ---------------------------------------------------------------------------
# One rank
# ---------------------------------------------------------------------------

class Ranks:
    """What a rank needs: torch, its device and its results."""

    def __init__(self, torch, dist, rank, world, dev, owns):
        self.torch, self.dist, self.rank, self.world, self.dev = torch, dist, rank, world, dev
        self.owns = owns  # whether tidalloc allocated a pointer; None when it is not in use
        self.checks = []  # (name, ok, detail)

    def check(self, name, ok, detail=""):
        self.checks.append((name, bool(ok), detail))


def collectives(r):
    torch, dist, dev, rank, world = r.torch, r.dist, r.dev, r.rank, r.world
    ranks_sum = world * (world + 1) // 2  # the sum of rank + 1 over the ranks
    for n in (1, 1000, 1 << 18, 1 << 24):
        ramp = torch.arange(n, device=dev, dtype=torch.int64)
        t = ramp * (rank + 1)
        dist.all_reduce(t)
        r.check("all_reduce int64 sum, %d elements" % n, torch.equal(t, ramp * ranks_sum))

        f = torch.full((n,), float(rank + 1), device=dev)
        dist.all_reduce(f, async_op=True).wait()
        r.check("all_reduce float32 sum (async), %d elements" % n,
                bool((f == float(ranks_sum)).all()))
        del t, f

        mine = ramp + rank * n
        gathered = torch.empty(world * n, device=dev, dtype=torch.int64)
        if r.owns:
            r.check("tidalloc allocated the tensors, %d elements" % n,
                    all(r.owns(x.data_ptr()) for x in (ramp, mine, gathered)))
        dist.all_gather_into_tensor(gathered, mine)
        everyone = torch.arange(world * n, device=dev, dtype=torch.int64)
        r.check("all_gather_into_tensor int64, %d elements per rank" % n,
                torch.equal(gathered, everyone))
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine)
        r.check("all_gather int64, %d elements per rank" % n,
                all(torch.equal(parts[k], ramp + k * n) for k in range(world)))
        del mine, gathered, everyone, parts

        for src in (0, world - 1):
            # Every rank draws the same values from the same seed on the CPU.
            expected = torch.randn(n, generator=torch.Generator().manual_seed(1234 + n)).to(dev)
            b = expected.clone() if rank == src else torch.zeros(n, device=dev)
            dist.broadcast(b, src)
            r.check("broadcast float32 from rank %d, %d elements" % (src, n),
                    torch.equal(b, expected))
        del ramp


def training(r, args):
    """Returns the memory records: (iteration, allocated, reserved, loss)."""
    torch, dist, dev, rank = r.torch, r.dist, r.dev, r.rank
    from torch.nn.parallel import DistributedDataParallel
    D, S, B = 512, 128, 32  # width, sequence length, batch per rank
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts them)
    model = torch.nn.Sequential(
        torch.nn.TransformerEncoderLayer(D, nhead=8, dim_feedforward=4 * D, dropout=0.0,
                                         batch_first=True),
        torch.nn.Linear(D, D)).to(dev)
    ddp = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-4)
    gen = torch.Generator(device=dev)
    gen.manual_seed(100 + rank)  # each rank its own data, as in data parallelism
    records, loss = [], None
    for it in range(1, args.iters + 1):
        x = torch.randn(B, S, D, device=dev, generator=gen)
        target = torch.randn(B, S, D, device=dev, generator=gen)
        loss = torch.nn.functional.mse_loss(ddp(x), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if it % args.interval == 0:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
                alloc, res = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
            else:
                alloc = res = 0
            records.append((it, alloc, res, loss.item()))
    r.check("training loss is finite", all(math.isfinite(rec[3]) for rec in records),
            "(last %.6f)" % records[-1][3])

    # DDP averages the gradients, so every rank applies the same update.
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = torch.empty(r.world * flat.numel(), device=dev, dtype=flat.dtype)
    dist.all_gather_into_tensor(everyone, flat)
    same = all(torch.equal(everyone[k * flat.numel():(k + 1) * flat.numel()], flat)
               for k in range(r.world))
    r.check("parameters identical on every rank after %d iterations" % args.iters, same,
            "(%d parameters)" % flat.numel())

    base, end = records[0], records[-1]
    r.check("no memory growth after iteration %d (allocated, reserved)" % base[0],
            end[1] <= base[1] + PAGE and end[2] <= base[2] + PAGE,
            "(allocated %.1f -> %.1f MiB, reserved %.1f -> %.1f MiB; at most %d MiB above)"
            % (base[1] / MiB, end[1] / MiB, base[2] / MiB, end[2] / MiB, PAGE // MiB))
    return records


def run_rank(rank, world, args):
    """One rank, start to end; returns True if every check of every rank passed."""
    local = int(os.environ.get("LOCAL_RANK", rank))
    owns = None  # whether tidalloc allocated a pointer, when tidalloc is in use
    if not args.native and not args.cpu:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                        "python"))
        import tidalloc.torch
        from tidalloc import _lib
        tidalloc.torch.install(args.conf)  # before this rank starts CUDA
        owns = functools.partial(_lib.owns, index=local)
    import torch
    import torch.distributed as dist
    if args.cpu:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(minutes=5))
    else:
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev,
                                timeout=datetime.timedelta(minutes=5))
    r = Ranks(torch, dist, rank, world, dev, owns)
    allocator = ("cpu (gloo)" if args.cpu else
                 "native" if args.native else "tidalloc (%s)" % torch.cuda.get_allocator_backend())
    collectives(r)
    records = training(r, args)

    everyone = [None] * world
    dist.all_gather_object(everyone, (rank, r.checks, records))
    ok = all(c[1] for _, checks, _ in everyone for c in checks)
    if rank == 0:
        report(everyone, allocator, args)
        print("distributed: %s" % ("PASS" if ok else "FAIL"), flush=True)
    dist.destroy_process_group()
    return ok


def report(everyone, allocator, args):
    everyone = sorted(everyone, key=lambda e: e[0])
    print("allocator: %s, %d ranks, NCCL_NVLS_ENABLE=%s, TORCH_SYMM_MEM_DISABLE_MULTICAST=%s"
          % (allocator, len(everyone), os.environ.get("NCCL_NVLS_ENABLE"),
             os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST")))
    for rank, checks, _ in everyone:
        for name, ok, detail in checks:
            print("%s: rank %d: %s %s" % ("PASS" if ok else "FAIL", rank, name, detail))
    header = "%9s" % "iteration" + "".join(
        " | rank %d allocated MiB  reserved MiB" % rank for rank, _, _ in everyone)
    print(header)
    print("-" * len(header))
    for i, rec in enumerate(everyone[0][2]):
        print("%9d" % rec[0] + "".join(" | %18.1f  %12.1f" % (recs[i][1] / MiB, recs[i][2] / MiB)
                                       for _, _, recs in everyone))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["allocator", "rank", "iteration", "allocated_bytes", "reserved_bytes",
                        "loss"])
            name = "cpu" if args.cpu else "native" if args.native else "tidalloc"
            for rank, _, recs in everyone:
                for it, alloc, res, loss in recs:
                    w.writerow([name, rank, it, alloc, res, "%.6f" % loss])
        print("wrote %s" % args.csv)


def spawned(rank, world, args):
    """The entry of a rank started by torch.multiprocessing.spawn."""
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    if not run_rank(rank, world, args):
        sys.exit(1)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    args = parse_args()
    import torch
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        world = int(os.environ["WORLD_SIZE"])
        if not args.cpu and torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE",
                                                                           world)):
            print("distributed: SKIP: %d ranks on this host but %d GPUs visible"
                  % (int(os.environ.get("LOCAL_WORLD_SIZE", world)), torch.cuda.device_count()))
            sys.exit(SKIP)
        sys.exit(0 if run_rank(int(os.environ["RANK"]), world, args) else 1)
    if not args.cpu and torch.cuda.device_count() < WORLD:
        print("distributed: SKIP: needs %d GPUs, %d visible" % (WORLD, torch.cuda.device_count()))
        sys.exit(SKIP)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ["WORLD_SIZE"] = str(WORLD)
    import torch.multiprocessing as mp
    try:
        mp.spawn(spawned, args=(WORLD, args), nprocs=WORLD, join=True)
    except mp.ProcessExitedException as e:
        print("distributed: FAIL: %s" % e)
        sys.exit(1)
    except mp.ProcessRaisedException as e:
        print("distributed: FAIL: a rank raised:\n%s" % e)
        sys.exit(1)


if __name__ == "__main__":
    main()
