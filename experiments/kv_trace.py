"""kv_trace.py: a synthetic allocation trace of a decoder's K and V caches
grown by torch.cat, for `tidalloc replay`: each step allocates the next
caches (one row longer) and then frees the previous ones, as a compiled
decoder's step clones its caches out of the graph's memory. Runs start from
nothing, as paired runs from an emptied cache do.

    python3 experiments/kv_trace.py OUT.csv.gz [--caches 32] [--row-bytes 32768]
        [--steps 256] [--runs 1]

The defaults are tests/torch/native_shim.py's large growing-KV model (16
layers, K and V, batch 8 x 16 heads x 64 features of fp32 a row)."""
import argparse
import gzip


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--caches", type=int, default=32)
    p.add_argument("--row-bytes", type=int, default=32768)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--runs", type=int, default=1)
    a = p.parse_args()
    lines = ["t_us,action,addr,size,stream"]
    clock, next_addr = 0, 1

    def event(action, addr, size):
        nonlocal clock
        clock += 1
        lines.append("%d,%s,%d,%d,0" % (clock, action, addr, size))

    def alloc(size):
        nonlocal next_addr
        addr, next_addr = next_addr, next_addr + 1
        event("alloc", addr, size)
        return addr

    for _ in range(a.runs):
        caches = [alloc(a.row_bytes) for _ in range(a.caches)]
        for step in range(1, a.steps + 1):
            grown = [alloc(a.row_bytes * (step + 1)) for _ in range(a.caches)]
            for addr in caches:
                event("free", addr, 0)
            caches = grown
        for addr in caches:
            event("free", addr, 0)
    with gzip.open(a.out, "wt") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
