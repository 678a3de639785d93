#!/usr/bin/env python3
"""fuzz/seeds.py: writes the seed inputs of fuzz/corpus/ops/, fuzz/corpus/conf/
and fuzz/corpus/trace/ (traces as `tidalloc replay` reads them, good and bad,
plain and gzip'd).

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
       ("pinned_empty", 1), ("memcpy", 2), ("figures", 1), ("buf_create", 3),
       ("buf_resize", 6), ("buf_destroy", 2), ("pool", 4), ("host_capture", 5),
       ("capture_begin", 4), ("capture_end", 3), ("capture_pool", 2), ("checkpoint", 3),
       ("checkpoint_free", 1), ("restore", 4)]
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
             "host_free", "copy", "capture_status", "event_destroy"]


def op(name, *args):
    return bytes([BASE[name], *args])


def config(expandable=True, release_holes=True, capacity=2, rounding=0, max_split=False,
           gc=False, small_granularity=False, page=2, trace=False, detection=False):
    """The two configuration bytes (capacity: 0 64 MiB, 1 256 MiB, 2 1 GiB, 3 128 MiB)."""
    a = (0 if expandable else 1) | (0 if release_holes else 2) | capacity << 2 | rounding << 4
    a |= (64 if max_split else 0) | (128 if gc else 0)
    b = (1 if small_granularity else 0) | {1: 2, 4: 4, 2: 0}[page] | (8 if trace else 0)
    b |= 16 if detection else 0
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


# Capture pools (the ops after "buf_destroy"). Pools and checkpoints are
# picked by a byte that names the first slot to look at; slot 0 is the first
# pool made, CK* the checkpoint slots.
POOL0, POOL1 = 0, 1
CK0, CK1, CK2 = 0, 1, 2


def pool_create():
    return op("pool", 0)


def pool_retain(pool=POOL0):
    return op("pool", 1, pool)


def pool_release(pool=POOL0):
    return op("pool", 2, pool)


def host_capture_begin(stream):
    return op("host_capture", 0, stream)


def host_capture_join(stream, capturing):
    return op("host_capture", 2, stream, capturing)


def host_capture_end(stream):
    return op("host_capture", 3, stream)


def capture_begin(stream, pool=POOL0):
    return op("capture_begin", pool, stream)


def capture_end(begin_slot=0):
    return op("capture_end", begin_slot)


def checkpoint(slot=CK0, pool=POOL0):
    return op("checkpoint", pool, slot)


def restore(slot=CK0, delta=True):
    return op("restore", slot, 1, 1 if delta else 0)


def free(index, mode=0, stream=DEFAULT):
    """Free the index-th live device block (mode 0: on its stream; 6: on `stream`)."""
    return op("free", index, mode) + (bytes([stream]) if mode in (6, 7) else b"")


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
    # A capture on two streams allocating to a pool: reuse inside the capture,
    # a pool block freed on its own stream, a block of the usual memory freed
    # by the capture (deferred until it ends), then a checkpoint, growth
    # between replays and a restore.
    s["capture"] = (config() + op("stream_create", 0) + op("stream_create", 1)
                    + malloc(S1, size_favorite(3)) + pool_create()
                    + host_capture_begin(S1) + capture_begin(S1)
                    + malloc(S1, size_favorite(4)) + malloc(S1, size_small(100))
                    + host_capture_join(S2, S1) + malloc(S2, size_large(2000))
                    + free(1) + malloc(S1, size_small(100))
                    + free(0) + malloc(S1, size_favorite(3)) + malloc(DEFAULT, size_favorite(3))
                    + op("empty_cache") + op("capture_pool", S2)
                    + host_capture_end(S1) + capture_end(0) + checkpoint(CK0)
                    + capture_begin(S1) + malloc(S1, size_favorite(6))
                    + malloc(S1, size_large(30000)) + capture_end(0)
                    + restore(CK0) + free(0) + restore(CK0, delta=False)
                    + pool_release() + op("empty_cache") + pool_release() + op("empty_cache"))
    # Checkpoints and restores outside captures (a begin on a stream that is
    # not captured routes it): after more allocations, after frees that merge
    # across the checkpoint's blocks, after growth of the segment, and a
    # checkpoint of another pool refused.
    s["restore"] = (config(page=1) + op("stream_create", 0) + pool_create() + pool_create()
                    + capture_begin(S1) + b"".join(malloc(S1, size_large(700 * i)) for i in range(4))
                    + checkpoint(CK0) + malloc(S1, size_small(30)) + restore(CK0)
                    + free(1) + free(1) + checkpoint(CK1) + malloc(S1, size_favorite(6))
                    + malloc(S1, size_favorite(5)) + restore(CK0) + restore(CK1)
                    + free(0) + free(0) + free(0) + restore(CK0)
                    + op("restore", CK0, 0, POOL1, 1) + checkpoint(CK2, POOL1)
                    + op("checkpoint_free", CK1) + restore(CK2) + capture_end(0)
                    + pool_release(POOL1) + restore(CK0, delta=False) + pool_retain()
                    + pool_release() + pool_release() + pool_release())
    # capture_detection: a capture nobody began gets a pool of its own.
    s["detection"] = (config(detection=True, expandable=False) + op("stream_create", 0)
                      + op("stream_create", 1) + host_capture_begin(S1)
                      + malloc(S1, size_favorite(4)) + op("capture_pool", S1)
                      + host_capture_join(S2, S1) + malloc(S2, size_small(9))
                      + op("record", 0, S2) + free(0, 6, DEFAULT) + pool_release()
                      + checkpoint(CK0) + host_capture_end(S2) + restore(CK0)
                      + op("capture_pool", S1) + pool_release() + op("empty_cache"))
    # A free deferred by a capture: a block recorded on a captured stream,
    # freed outside it, must not be handed out until the capture ends; a
    # held stream keeps it waiting after that.
    s["deferred"] = (config() + op("stream_create", 0) + malloc(DEFAULT, size_favorite(4))
                     + op("record", 0, S1) + op("hold", S1) + host_capture_begin(S1)
                     + pool_create() + capture_begin(S1) + free(0) + malloc(DEFAULT, size_favorite(4)) + op("synchronize", S1)
                     + op("empty_cache") + host_capture_end(S1) + capture_end(0)
                     + malloc(DEFAULT, size_favorite(4))
                     + op("release", 0) + malloc(DEFAULT, size_favorite(4)) + op("empty_cache"))
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

H = b"t_us,action,addr,size,stream\n"


def trace_seeds():
    import gzip
    good = H + b"1,alloc,4096,1048576,0\n2,alloc,8192,512,7\n3,free,4096,0,0\n4,free,8192,512,7\n"
    return {
        "good": good,
        "good.gz": gzip.compress(good, mtime=0),
        "two-members.gz": gzip.compress(good[:40], mtime=0) + gzip.compress(good[40:], mtime=0),
        "crlf-no-final-newline": good.replace(b"\n", b"\r\n")[:-2],
        "empty-lines": H + b"\n\n1,alloc,1,1,0\n\n\n\n\n\n\n\n\n\n2,free,1,1,0\n\n",
        "nul": H + b"1,alloc,1,100,0\0x\n2,alloc,2,100,0\n3,free,2,0,0\n",
        "hex-address": H + b"1,alloc,0x7f00,100,0\n",
        "fields": H + b"1,alloc,1,100\n1,alloc,1,100,0,9\n",
        "action": H + b"1,realloc,1,100,0\n",
        "overflow": H + b"1,alloc,1,18446744073709551616,0\n",
        "max": H + b"18446744073709551615,alloc,18446744073709551615,18446744073709551615,1\n",
        "zero-alloc": H + b"1,alloc,1,0,0\n",
        "time-back": H + b"5,alloc,1,1,0\n4,free,1,1,0\n",
        "long-line": H + b"1," * 200 + b"\n",
        "escape": H + b"1,alloc,\x1b[31m,1,0\n",
        "no-header": b"1,alloc,1,1,0\n",
        "empty": b"",
        "junk-after.gz": gzip.compress(good, mtime=0) + b"junk\n",
        "truncated.gz": gzip.compress(good, mtime=0)[:30],
    }


def trace_regressions():
    """The inputs of issue 31, which `tidalloc replay` took without bound or
    misread, and of the reader's own bugs found while it was written."""
    import gzip
    many = H + b"".join(b"%d,alloc,%d,64,0\n%d,free,%d,64,0\n" % (i, i, i, i) for i in range(1, 200))
    corrupt = bytearray(gzip.compress(many, mtime=0))
    corrupt[len(corrupt) * 3 // 5] ^= 0xFF  # inflate fails after giving text
    corrupt[-1] = 0x30  # read 1 byte at a time by fuzz_trace, and in one piece
    return {
        # A NUL byte inside line 2: it was read as a malformed line 2, the
        # alloc of line 3 lost and line 4 misnumbered.
        "issue31-nul.gz": gzip.compress(H + b"1,alloc,1,100,0\0x\n2,alloc,2,100,0\n3,free,2,0,0\n",
                                        mtime=0),
        # /dev/zero's first bytes: the over-long line was skipped without end.
        "issue31-zeros": bytes(4096),
        # Empty lines by the thousand, and frees of an address never live.
        "issue31-newlines.gz": gzip.compress(H + b"\n" * 100000, mtime=0),
        "issue31-frees.gz": gzip.compress(H + b"0,free,1,0,0\n" * 20000, mtime=0),
        # The gzip magic cut by a first read of one byte (it was read as text).
        "first-read-of-one-byte.gz": gzip.compress(H + b"1,alloc,1,1,0\n", mtime=0)[:-1] + b"\x00",
        # Text before a corrupt part of the stream (it was dropped with the
        # error when both came from one inflate call).
        "text-before-corruption.gz": bytes(corrupt),
    }


def main():
    root = os.path.dirname(os.path.abspath(__file__))
    for name, data in seeds().items():
        with open(os.path.join(root, "corpus", "ops", "seed-" + name), "wb") as f:
            f.write(data)
    for name, text in CONF_SEEDS.items():
        with open(os.path.join(root, "corpus", "conf", "seed-" + name), "w") as f:
            f.write(text)
    for name, data in trace_seeds().items():
        with open(os.path.join(root, "corpus", "trace", "seed-" + name), "wb") as f:
            f.write(data)
    for name, data in trace_regressions().items():
        with open(os.path.join(root, "corpus", "trace", "regress-" + name), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main()
