#!/usr/bin/env python3
"""fuzz/seeds.py: writes the seed inputs of fuzz/corpus/ops/ and fuzz/corpus/conf/.

The ops seeds are short programs in the byte language of fuzz_ops.c (its
`ops` table, by weight, and each operation's arguments), one per area of the
allocator, so that fuzzing starts from inputs that already reach reuse,
streams, out-of-memory, faults, bad pointers and pinned memory. OPS below
mirrors that table: keep them in step (new rows go at the end of both).
Inputs found by fuzzing are added to the corpus as they are (regress-*).

    python3 fuzz/seeds.py        # rewrites the seed-* files
"""
import os

OPS = [("malloc", 24), ("free", 16), ("free_sized", 4), ("double_free", 3),
       ("interior", 2), ("unknown", 2), ("record", 4), ("block_info", 2),
       ("stream_create", 3), ("stream_destroy", 2), ("hold", 3), ("release", 3),
       ("synchronize", 1), ("empty_cache", 3), ("limit", 2), ("fault", 3),
       ("pinned_malloc", 3), ("pinned_free", 3), ("pinned_record", 1),
       ("pinned_empty", 1), ("memcpy", 2), ("figures", 1)]
BASE = {}
_total = 0
for _name, _weight in OPS:
    BASE[_name] = _total
    _total += _weight

# Backend operations, as tide_backend_op numbers them, and the index of each
# in fuzz_ops.c's `faultable` list.
FAULTABLE = ["any", "reserve", "unreserve", "create", "release", "map", "set_access", "unmap",
             "stream_create", "stream_destroy", "stream_synchronize", "event_create",
             "event_record", "event_query", "event_synchronize", "mem_info", "host_alloc",
             "host_free", "copy"]


def op(name, *args):
    return bytes([BASE[name], *args])


def config(expandable=True, release_holes=True, capacity=2, rounding=0, max_split=False,
           gc=False, small_granularity=False, page=2, trace=False):
    """The two configuration bytes (capacity: 0 64 MiB, 1 256 MiB, 2 1 GiB, 3 128 MiB)."""
    a = (0 if expandable else 1) | (0 if release_holes else 2) | capacity << 2 | rounding << 4
    a |= (64 if max_split else 0) | (128 if gc else 0)
    b = (1 if small_granularity else 0) | {1: 2, 4: 4, 2: 0}[page] | (8 if trace else 0)
    return bytes([a, b])


# Stream choices (pick_stream): 0 the default stream, 1..3 created streams.
DEFAULT, S1, S2, S3 = 0, 1, 2, 3


def size_favorite(i):  # 512, 4096, 1000, 1 MiB, 2 MiB, 3 MiB, 20 MiB, 300 KiB
    return bytes([2, i])


def size_small(n):  # 1 + n * 16 bytes
    return bytes([6, n & 255, n >> 8])


def size_large(n):  # 1 MiB + n * 512 bytes
    return bytes([10, n & 255, n >> 8])


def size_huge(i):  # capacity + 1, capacity * 4, 1 TiB, 4 PiB, 4 PiB + 1, SIZE_MAX, SIZE_MAX - 511
    return bytes([1, i])


def malloc(stream, size):
    return op("malloc", stream) + size


def fault(name, n):
    return op("fault", FAULTABLE.index(name), n)


def seeds():
    s = {}
    # Same sizes over and over on one stream: quick reuse, splitting, merging.
    s["reuse"] = config() + b"".join(
        malloc(DEFAULT, size_favorite(i % 8)) + malloc(DEFAULT, size_small(300 + i))
        + op("free", 0, 0) for i in range(12)) + op("empty_cache")
    # Several streams: frees on other streams, records, a held stream.
    s["streams"] = (config() + op("stream_create", 0) + op("stream_create", 1)
                    + malloc(S1, size_large(3000)) + malloc(S2, size_favorite(4))
                    + malloc(DEFAULT, size_small(50)) + op("record", 0, S2)
                    + op("hold", S2) + op("free", 0, 6, S2) + op("free", 0, 5)
                    + op("empty_cache") + op("synchronize", S2) + op("release", 0)
                    + op("empty_cache") + op("stream_destroy", 1) + op("free", 0, 0)
                    + op("figures"))
    # A 64 MiB device: allocations until out of memory, frees, and more.
    s["oom"] = (config(capacity=0) + b"".join(malloc(DEFAULT, size_favorite(6)) for _ in range(4))
                + op("free", 1, 0) + malloc(DEFAULT, size_large(40000))
                + malloc(DEFAULT, size_huge(0)) + malloc(DEFAULT, size_huge(3))
                + op("limit", 0, 3) + malloc(DEFAULT, size_favorite(6)) + op("limit", 3)
                + op("empty_cache"))
    s["oom_fixed"] = config(expandable=False, capacity=0, gc=True) + s["oom"][2:]
    # Injected failures in growth, release and stream ordering.
    s["faults"] = (config() + fault("create", 2) + malloc(DEFAULT, size_favorite(5))
                   + malloc(DEFAULT, size_favorite(5)) + fault("map", 1)
                   + malloc(DEFAULT, size_large(9000)) + fault("set_access", 1)
                   + fault("unmap", 1) + malloc(DEFAULT, size_large(20000))
                   + fault("unmap", 1) + malloc(DEFAULT, size_large(20000))
                   + op("free", 0, 0) + fault("unmap", 1) + op("empty_cache")
                   + op("stream_create", 0) + malloc(S1, size_small(10))
                   + fault("event_create", 1) + op("free", 0, 5)
                   + fault("stream_synchronize", 1) + op("empty_cache") + op("empty_cache"))
    s["faults_fixed"] = (config(expandable=False) + fault("reserve", 1)
                         + malloc(DEFAULT, size_favorite(4)) + fault("release", 1)
                         + malloc(DEFAULT, size_favorite(4)) + op("free", 0, 0)
                         + fault("unreserve", 1) + op("empty_cache") + fault("any", 3)
                         + malloc(DEFAULT, size_large(100)) + op("empty_cache"))
    # What users get wrong.
    s["bad_pointers"] = (config() + malloc(DEFAULT, size_favorite(3))
                         + malloc(DEFAULT, size_small(7)) + op("free", 0, 0)
                         + op("double_free", 0) + op("interior", 0, 1, 2, 0, 0)
                         + b"".join(op("unknown", k, 3) for k in range(6))
                         + op("free_sized", 0, 2) + op("free_sized", 0, 0)
                         + op("malloc", 15, 7) + size_favorite(0) + malloc(DEFAULT, bytes([0]))
                         + op("stream_destroy", 0) + op("limit", 2, 3))
    # Pinned memory and copies.
    s["pinned"] = (config() + op("stream_create", 0) + op("pinned_malloc", DEFAULT, 1, 200, 1)
                   + op("pinned_malloc", S1, 1, 10, 0) + op("pinned_record", 0, S1)
                   + malloc(DEFAULT, size_small(400)) + op("memcpy", 0, 0, 1, 0)
                   + op("memcpy", 1, 0, 0, 0) + op("memcpy", 0, 0, 0, 0) + op("hold", S1) + op("pinned_free", 0, 0, 5)
                   + op("pinned_empty") + op("release", 0) + op("pinned_empty")
                   + fault("host_alloc", 1) + op("pinned_malloc", DEFAULT, 1, 0, 64))
    # Other configurations: rounding, oversize blocks, small pages, trace.
    s["rounding"] = (config(rounding=2, max_split=True, small_granularity=True, page=1, trace=True)
                     + b"".join(malloc(DEFAULT, size_large(1000 * i + 7)) for i in range(1, 8))
                     + op("free", 2, 0) + op("free", 3, 0) + malloc(DEFAULT, size_favorite(6))
                     + malloc(DEFAULT, size_large(30000)) + op("figures") + op("empty_cache"))
    s["no_release_holes"] = (config(release_holes=False, rounding=1, page=4)
                             + b"".join(malloc(DEFAULT, size_large(500 * i)) + op("free", 0, 0)
                                        for i in range(10)))
    return s


CONF_SEEDS = {
    "defaults": "",
    "pytorch": "expandable_segments:True,max_split_size_mb:128,garbage_collection_threshold:0.8",
    "list": "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
    "bytes": "memory_limit:512MiB,host_capacity:24GiB,host_granularity:2MiB",
    "fractions": "memory_fraction:0.5,garbage_collection_threshold:1e-3",
    "spaces": " backend : host , page_size_mb : 4 ,trace:1024",
    "unknown": "per_process_memory_fraction:0.5",
    "bad": "page_size_mb:0,expandable_segments:maybe",
}


def main():
    root = os.path.dirname(os.path.abspath(__file__))
    for name, data in seeds().items():
        with open(os.path.join(root, "corpus", "ops", "seed-" + name), "wb") as f:
            f.write(data)
    for name, text in CONF_SEEDS.items():
        with open(os.path.join(root, "corpus", "conf", "seed-" + name), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
