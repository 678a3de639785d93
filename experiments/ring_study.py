#!/usr/bin/env python3
"""ring_study.py: a design study, not part of the library. What a FIFO ring
for caches grown by concatenation would hold and cost on an allocation trace
(the format `tidalloc replay` reads), and optionally a trace that emulates it
for `tidalloc replay`.

The ring: pages mapped in one virtual range, the first pages mapped a second
time right after the last, so that a block placed at the head is contiguous
even where it crosses the end. Blocks are placed at the head, one after
another; a freed block's space comes back when every older block is freed
too (the tail moves past it), as when caches are replaced oldest first. It
grows, by the pages the request lacks plus `--slack-pages`, only when no
live block crosses its end (the new pages then go at the end, right ahead of
the head) and less than a quarter of it is held by freed blocks the tail has
not passed; otherwise the request goes to the ordinary pools (a fallback).
A growth unmaps the second mapping of the first pages (mapped again when a
block next crosses the end). With --no-twin there is no second mapping: a
block that would cross the end goes to the start instead, the gap before the
end held like a freed block until the tail passes it (a segment of its own
with next-fit placement, no pages mapped twice). Pages are 2 MiB.

Which requests go to the ring (`--admit`):
  naive  at least 1 MiB, while a live block up to 1% smaller (not equal) exists;
  chain  the same, and that smaller block is itself in the ring or replaced its
         own predecessor (freed within 16 events after the block was allocated).

With --give-back an empty ring unmaps all its pages (as a real one must where
caches die between calls).

--measure replays the trace through libtidalloc itself (the host backend,
TIDALLOC_CONF as given plus backend:host), the ring's pages held by a
growable buffer of its own range (tide_buf: pages mapped at its end as it
grows, room made in the pools first as for any growth; emptied to length 0
when the ring empties, with --give-back), as many as the ring above has at
each moment. The second mappings map the same pages again, so they cost no
memory; they are counted apart. It prints tidalloc's peak reserved over the
trace's peak live bytes and its mappings. Needs the library built
(build/libtidalloc.so or TIDALLOC_LIB).

Prints the requests the ring took and sent back, its growths, its mappings
and unmappings (the second mapping included), its largest size, and at the
trace's live peak its pages and the live bytes in it and elsewhere.

--emulate OUT.csv.gz writes the trace without the ring's blocks, with each
growth as an allocation of its pages that lives to the end: replayed by
`tidalloc replay`, its peak reserved approximates the ring and the pools
together, with the ring's growth pressing the pools to give pages back as it
would. Approximate: the real ring would have its own range (here its pages
sit among the other blocks) and could give back pages it no longer uses
(here it never shrinks). Compare the replay's peak reserved with the
original trace's peak live bytes.

    python3 experiments/ring_study.py TRACE.csv.gz [--slack-pages 2] [--admit chain]
                                  [--emulate OUT.csv.gz]"""
import argparse
import bisect
import collections
import gzip
import math
import sys

PAGE = 2 << 20
LARGE = 1 << 20


class Ring:
    def __init__(self, slack_pages, twin=True):
        self.slack_pages = slack_pages
        self.use_twin = twin
        self.pages = 0
        self.twin = 0  # pages mapped a second time after the end
        self.head = 0  # offset of the next block
        self.blocks = collections.OrderedDict()  # id -> [offset, size, live], oldest first
        self.used = 0  # bytes from the tail to the head (freed blocks not yet passed included)
        self.dead = 0  # bytes of freed blocks not yet passed
        self.live = 0
        self.maps = self.unmaps = self.growths = 0
        self.twin_maps = self.twin_unmaps = 0  # the second mappings alone
        self.next_id = 0

    def capacity(self):
        return self.pages * PAGE

    def crosses_end(self):
        if any(off + size > self.capacity() for off, size, _ in self.blocks.values()):
            return True
        tail = next(iter(self.blocks.values()))[0] if self.blocks else 0
        return bool(self.blocks) and (self.head < tail or (
            self.head == tail and self.used == self.capacity()))

    def place(self, size):
        """An id, or None (fallback). May grow; returns (id, grown pages)."""
        grown = 0
        if size > self.capacity() - self.used:
            if self.crosses_end() or self.dead > self.capacity() / 4:
                return None, 0
            grown = math.ceil((size - (self.capacity() - self.used)) / PAGE) + self.slack_pages
            self.unmaps += self.twin
            self.twin_unmaps += self.twin
            self.twin = 0
            self.pages += grown
            self.maps += grown
            self.growths += 1
        off = self.head
        if off + size > self.capacity() and not self.use_twin:
            # Skip to the start: the gap before the end is held like a freed
            # block until the tail passes it.
            gap = self.capacity() - off
            if self.used + gap + size > self.capacity():
                return None, grown
            self.next_id += 1
            self.blocks[self.next_id] = [off, gap, False]
            self.used += gap
            self.dead += gap
            off = 0
        elif off + size > self.capacity():
            need = math.ceil((off + size - self.capacity()) / PAGE)
            if need > self.twin:
                self.maps += need - self.twin
                self.twin_maps += need - self.twin
                self.twin = need
        self.head = (off + size) % self.capacity()
        self.next_id += 1
        self.blocks[self.next_id] = [off, size, True]
        self.used += size
        self.live += size
        return self.next_id, grown

    def free(self, block_id):
        b = self.blocks[block_id]
        b[2] = False
        self.live -= b[1]
        self.dead += b[1]
        while self.blocks:
            off, size, live = next(iter(self.blocks.values()))
            if live:
                break
            self.blocks.popitem(last=False)
            self.dead -= size
            self.used -= size
        if not self.blocks:
            self.head = 0

    def give_back(self):
        """An empty ring unmaps all its pages (--give-back)."""
        self.unmaps += self.pages + self.twin
        self.twin_unmaps += self.twin
        self.pages = self.twin = 0


class Chains:
    """Which requests go to the ring (`--admit`), from the live blocks of at
    least LARGE bytes and the replacements seen so far."""

    def __init__(self, admit):
        self.admit = admit
        self.live_sizes = []  # sorted
        self.addrs_of_size = collections.defaultdict(set)
        self.confirmed = set()  # addrs of live blocks that replaced a predecessor
        self.recent = collections.OrderedDict()  # addr -> (possible predecessors, event)

    def predecessor_size(self, size):
        """The largest live size up to 1% below `size` (not equal), or None."""
        if size < LARGE:
            return None
        i = bisect.bisect_left(self.live_sizes, size * 0.99)
        best = None
        while i < len(self.live_sizes) and self.live_sizes[i] < size:
            best = self.live_sizes[i]
            i += 1
        return best

    def wanted(self, pred, in_ring):
        return pred is not None and self.admit != "none" and (self.admit == "naive" or any(
            a in self.confirmed or a in in_ring for a in self.addrs_of_size[pred]))

    def allocated(self, addr, size, pred, ev):
        if size < LARGE:
            return
        if pred is not None:
            self.recent[addr] = (frozenset(self.addrs_of_size[pred]), ev)
            if len(self.recent) > 64:
                self.recent.popitem(last=False)
        self.addrs_of_size[size].add(addr)
        bisect.insort(self.live_sizes, size)

    def freed(self, addr, size, ev):
        """A block freed within 16 events after its successor's allocation
        confirms that successor as a chain's."""
        if size < LARGE:
            return
        self.live_sizes.pop(bisect.bisect_left(self.live_sizes, size))
        self.addrs_of_size[size].discard(addr)
        self.confirmed.discard(addr)
        self.recent.pop(addr, None)
        for successor, (preds, at) in list(self.recent.items()):
            if addr in preds and ev - at <= 16:
                self.confirmed.add(successor)
                del self.recent[successor]


class Sink:
    """Where the walk sends what it does not keep in the ring: nowhere."""

    def alloc(self, t, addr, size_text, stream):
        pass

    def free(self, t, addr, size_text, stream):
        pass

    def ring_grew(self, t, grown, pages):
        pass

    def ring_emptied(self, t):
        pass


class Emulation(Sink):
    """The trace for `tidalloc replay`: the ring's blocks left out, each
    growth an allocation of its pages (a chunk) until the ring empties."""

    def __init__(self):
        self.out = []
        self.chunks = 0
        self.first_chunk = 1  # the chunks of the ring's pages still mapped

    def alloc(self, t, addr, size_text, stream):
        self.out.append("%s,alloc,%s,%s,%s" % (t, addr, size_text, stream))

    def free(self, t, addr, size_text, stream):
        self.out.append("%s,free,%s,%s,%s" % (t, addr, size_text, stream))

    def ring_grew(self, t, grown, pages):
        self.chunks += 1
        self.out.append("%s,alloc,%d,%d,0" % (t, (1 << 50) + self.chunks * (1 << 36), grown * PAGE))

    def ring_emptied(self, t):
        for k in range(self.first_chunk, self.chunks + 1):
            self.out.append("%s,free,%d,0,0" % (t, (1 << 50) + k * (1 << 36)))
        self.first_chunk = self.chunks + 1


def walk(rows, ring, chains, sink, give_back):
    """The trace, each request the ring admits placed there (or sent back),
    everything else to `sink`. Returns the figures study() prints."""
    live = {}  # addr -> size
    in_ring = {}  # addr -> ring block id
    taken = fallbacks = 0
    live_bytes = peak_live = 0
    at_peak = (0, 0)
    peak_pages = 0
    for ev, (t, action, addr, size_text, stream) in enumerate(rows):
        size = int(size_text)
        if action == "alloc":
            placed = False
            pred = chains.predecessor_size(size)
            if chains.wanted(pred, in_ring):
                block_id, grown = ring.place((size + 511) // 512 * 512)
                if block_id is None:
                    fallbacks += 1
                else:
                    taken += 1
                    placed = True
                    in_ring[addr] = block_id
                    if grown:
                        sink.ring_grew(t, grown, ring.pages)
            chains.allocated(addr, size, pred, ev)
            live[addr] = size
            live_bytes += size
            if not placed:
                sink.alloc(t, addr, size_text, stream)
        else:
            size = live.pop(addr)
            live_bytes -= size
            chains.freed(addr, size, ev)
            if addr in in_ring:
                ring.free(in_ring.pop(addr))
                if give_back and not ring.blocks and ring.pages:
                    ring.give_back()
                    sink.ring_emptied(t)
            else:
                sink.free(t, addr, size_text, stream)
        peak_pages = max(peak_pages, ring.pages)
        if live_bytes > peak_live:
            peak_live = live_bytes
            at_peak = (ring.pages, ring.live)
    return dict(taken=taken, fallbacks=fallbacks, ring=ring, peak_pages=peak_pages,
                peak_live=peak_live, at_peak=at_peak)


def study(rows, slack_pages, admit, emulate, twin=True, give_back=False):
    sink = Emulation() if emulate else Sink()
    r = walk(rows, Ring(slack_pages, twin), Chains(admit), sink, give_back)
    if emulate:
        sink.ring_emptied(rows[-1][0])
    return r, sink.out if emulate else []


class Measured(Sink):
    """The trace through libtidalloc: the ring's pages held by a growable
    buffer of `capacity` bytes."""

    def __init__(self, capacity):
        import os
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                        "python"))
        conf = os.environ.get("TIDALLOC_CONF", "")
        os.environ["TIDALLOC_CONF"] = (conf + "," if conf else "") + "backend:host"
        import tidalloc
        from tidalloc import _lib
        self.tidalloc = tidalloc
        self.lib = _lib.lib()
        self.buffer = tidalloc.Buffer(capacity)
        self.ptrs = {}

    def alloc(self, t, addr, size_text, stream):
        size = int(size_text)
        ptr = self.lib.tide_torch_alloc(size, 0, None)
        if not ptr:
            raise RuntimeError("allocation of %d bytes failed: %s" % (size, self.tidalloc._lib.last_error()))
        self.ptrs[addr] = (ptr, size)

    def free(self, t, addr, size_text, stream):
        ptr, size = self.ptrs.pop(addr)
        self.lib.tide_torch_free(ptr, size, 0, None)

    def ring_grew(self, t, grown, pages):
        self.buffer.resize(pages * PAGE)

    def ring_emptied(self, t):
        self.buffer.resize(0)

    def figures(self):
        st = self.tidalloc.memory_stats(0)
        return st["reserved_bytes.all.peak"], st["num_device_map"]


def measure(rows, slack_pages, admit, give_back, twin):
    """As study(), on libtidalloc; returns (peak live, peak reserved, mappings, ring)."""
    peak_live = live = 0
    sizes = {}
    for _, action, addr, size, _ in rows:
        if action == "alloc":
            sizes[addr] = int(size)
            live += int(size)
            peak_live = max(peak_live, live)
        else:
            live -= sizes.pop(addr)
    target = Measured(2 * peak_live + (1 << 30))
    r = walk(rows, Ring(slack_pages, twin), Chains(admit), target, give_back)
    reserved, mappings = target.figures()
    return peak_live, reserved, mappings, r["ring"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--slack-pages", type=int, default=2)
    parser.add_argument("--admit", choices=("naive", "chain", "none"), default="chain",
                        help="none: no ring (the baseline, with --measure)")
    parser.add_argument("--emulate", metavar="OUT.csv.gz")
    parser.add_argument("--give-back", action="store_true",
                        help="an empty ring unmaps all its pages")
    parser.add_argument("--measure", action="store_true",
                        help="replay through libtidalloc, the ring a growable buffer (no twin)")
    parser.add_argument("--no-twin", action="store_true",
                        help="no second mapping: a block that would cross the end goes to the "
                        "start, the gap before the end held until the tail passes it")
    args = parser.parse_args()
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as f:
        rows = [line.rstrip("\n").split(",") for line in f][1:]
    if args.measure:
        peak_live, reserved, mappings, ring = measure(rows, args.slack_pages, args.admit,
                                                      args.give_back, not args.no_twin)
        print("measured: peak reserved %d bytes, %.4f x the trace's peak live %d; %d mappings"
              "%s" % (reserved, reserved / peak_live, peak_live, mappings,
                      "" if args.no_twin else ", and the ring's second mappings: %d mapped, "
                      "%d unmapped" % (ring.twin_maps, ring.twin_unmaps)))
        return 0
    r, out = study(rows, args.slack_pages, args.admit, args.emulate, not args.no_twin,
                   args.give_back)
    ring = r["ring"]
    print("requests to the ring %d, sent back %d; growths %d; mappings %d, unmappings %d"
          % (r["taken"], r["fallbacks"], ring.growths, ring.maps, ring.unmaps))
    pages, ring_live = r["at_peak"]
    print("ring at most %d pages; at the live peak (%.2f pages) the ring has %d pages holding "
          "%.2f, the rest %.2f pages live" % (r["peak_pages"], r["peak_live"] / PAGE, pages,
                                              ring_live / PAGE, (r["peak_live"] - ring_live) / PAGE))
    if args.emulate:
        with gzip.open(args.emulate, "wt") as f:
            f.write("t_us,action,addr,size,stream\n" + "\n".join(out) + "\n")
        print("peak live bytes of the original trace: %d" % r["peak_live"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
