"""tidalloc.kv: an attention layer's key/value cache in the layout models use,
[B, H, T, D], appended in place.

    cache = KVCache(max_len=4096)              # one per layer
    keys, values = cache.append(k, v)          # k, v: [B, H, t, D]
    out = F.scaled_dot_product_attention(q, keys, values)

stands for

    k_cache = torch.cat((k_cache, k), dim=2)
    v_cache = torch.cat((v_cache, v), dim=2)

with no copy of the earlier steps: an append copies the t new steps and
returns views over the cache's storage, whose address never changes.

Layout: the storage is [T, B, H, D] (one row of B x H x D per step, the
growable dimension outermost, so that T grows in place) and the [B, H, T, D]
tensors returned are permuted views of it, with strides (H*D, D, B*H*D, 1).
Their last dimension is contiguous, which is what the fused kernels of
scaled_dot_product_attention (flash, memory-efficient, cuDNN) ask of their
inputs; the other strides are free.

Two kinds of storage:
- growing (window=None): a tidalloc growable buffer of max_len steps of
  address space, whose pages are mapped as the cache grows; `put` overwrites
  steps in place (for caches that evict by reusing slots), `truncate` drops
  the last ones.
- sliding window (window=W): the last W steps, as
  `torch.cat((cache, new), 2)[:, :, -W:]` keeps them, in a tidalloc ring
  buffer (its pages mapped twice, back to back), so that the last W steps are
  always one strided view in time order: dropping the oldest copies nothing.

Tensors: CUDA tensors with tidalloc's cuda backend, CPU tensors with its host
backend (TIDALLOC_CONF=backend:host, an emulated device in host memory, for
tests). The cache's shape (B, H, D for keys and values separately) and dtypes
(unless `dtype` is given) are taken from the first append; later appends are
converted to those dtypes as copy_ converts."""
import ctypes

from . import _lib
from .buffer import Buffer, GrowableTensor, _itemsize, _typestr, _View

__all__ = ["KVCache"]

# Memory mapped ahead of the length by default (a worker thread maps it), so
# that an append seldom waits for a mapping: at most 4 MiB (two pages of the
# usual granularity) and at most a sixteenth of the cache. A small cache (a
# decode step's keys of a small model) then holds no page it does not use,
# since its appends cross a page seldom and a mapping made in the append
# costs little; a large one (a streaming model's frames) has its next pages
# ready, for at most 1/16 more memory.
DEFAULT_MAP_AHEAD_BYTES = 4 << 20
DEFAULT_MAP_AHEAD_FRACTION = 1.0 / 16


def _torch():
    import torch
    return torch


def tidalloc_device(device):
    """tidalloc's device index for a torch device, checking that tidalloc's
    backend serves it (cuda for CUDA tensors, host for CPU tensors)."""
    torch = _torch()
    device = torch.device(device)
    if device.type == "cuda":
        index, wanted = (device.index if device.index is not None
                         else torch.cuda.current_device()), "cuda"
    elif device.type == "cpu":
        index, wanted = 0, "host"
    else:
        raise ValueError("tidalloc.kv: tensors on %s are not supported (CUDA tensors, or CPU "
                         "tensors on tidalloc's host backend)" % device)
    backend = _lib.backend(index)
    if backend != wanted:
        hint = ("set TIDALLOC_CONF=backend:host before the process first uses tidalloc"
                if wanted == "host" else "this process runs tidalloc's %s backend" % backend)
        raise ValueError("tidalloc.kv: %s tensors need tidalloc's %s backend (%s)"
                         % (device.type.upper(), wanted, hint))
    return index


def _tensor_over(buf, nbytes, dtype, device, host):
    """A 1-D tensor of `dtype` over `nbytes` bytes at the buffer's address
    (a view: it keeps the buffer alive)."""
    torch = _torch()
    if host:
        raw = (ctypes.c_uint8 * nbytes).from_address(buf.data)
        raw.owner = buf
        flat = torch.frombuffer(raw, dtype=torch.uint8)
    else:
        view = _View(buf, buf.data, (nbytes,), _typestr(torch, torch.uint8))
        flat = torch.as_tensor(view, device="cuda:%d" % device)
    return flat.view(dtype)


class _Rows:
    """Steps of one tensor (keys or values): rows of [B, H, D] in a growable
    buffer or a ring. `rows(start, n)` is the [n, B, H, D] rows from step
    `start` on (in the ring, `start` counts from the oldest step held)."""

    def __init__(self, row_shape, dtype, steps, window, device, host, map_ahead_steps,
                 map_ahead_fraction=0.0):
        torch = _torch()
        self.row_shape = tuple(row_shape)
        self.dtype = dtype
        self.row_elems = 1
        for d in self.row_shape:
            self.row_elems *= d
        self.row_bytes = self.row_elems * _itemsize(torch, dtype)
        self.window = window
        self.length = 0     # steps held
        self.head = 0       # ring: the element where the next step goes
        if window is None:
            self.grow = GrowableTensor(self.row_shape, dtype, steps, device=device,
                                       map_ahead_rows=map_ahead_steps,
                                       map_ahead_fraction=map_ahead_fraction)
            # The whole capacity as [B, H, T, D]: an append narrows it, the
            # fewest tensor operations a decode step can cost.
            self.heads = _heads_major(self.grow._full)
            self.buf = None
        else:
            self.grow = None
            self.buf = Buffer(window * self.row_bytes, device, ring=True,
                              release_stream=None if host else
                              (torch.cuda.current_stream(device).cuda_stream or None))
            # The ring's W bytes (rounded up to the page), mapped twice: any
            # window of up to W bytes from an offset in [0, W) is contiguous.
            self.ring_bytes = self.buf.capacity
            self.ring_elems = self.ring_bytes // (self.row_bytes // self.row_elems)
            self.flat = _tensor_over(self.buf, 2 * self.ring_bytes, dtype, device, host)

    # -- reading
    def rows(self, start=0, n=None):
        """[n, B, H, D] steps from `start` (default: all held)."""
        if n is None:
            n = self.length - start
        if self.grow is not None:
            return self.grow._full[start:start + n]
        first = (self.head - (self.length - start) * self.row_elems) % self.ring_elems
        return self.flat[first:first + n * self.row_elems].view((n,) + self.row_shape)

    def heads_view(self):
        """All steps held as [B, H, T, D]."""
        if self.grow is not None:
            return self.heads.narrow(2, 0, self.length)
        return _heads_major(self.rows())

    # -- writing
    def append_heads(self, new):
        """new: [B, H, t, D]; returns all steps held as [B, H, T, D]."""
        if self.grow is None:
            self._ring_append(_steps_major(new))
            return self.heads_view()
        start = self.grow.extend(new.shape[2])
        self.length = self.grow.rows
        self.heads.narrow(2, start, self.length - start).copy_(new)
        return self.heads.narrow(2, 0, self.length)

    def _ring_append(self, new):
        """new: [t, B, H, D], after the newest step of the ring."""
        t = new.shape[0]
        if t > self.window:
            new, t = new[t - self.window:], self.window
        self.flat[self.head:self.head + t * self.row_elems].view((t,) + self.row_shape).copy_(new)
        self.head = (self.head + t * self.row_elems) % self.ring_elems
        self.length = min(self.window, self.length + t)

    def truncate(self, n):
        if self.grow is not None:
            self.grow.truncate(n)
            self.length = self.grow.rows
            return
        drop = self.length - n
        self.head = (self.head - drop * self.row_elems) % self.ring_elems
        self.length = n

    def reserve(self, steps):
        """Map the pages of the first `steps` steps (growing storage)."""
        self.grow._buf.reserve_ahead(steps * self.row_bytes)

    def close(self):
        if self.grow is not None:
            self.heads = None
            self.grow.close()
        else:
            self.flat = None
            self.buf.close()


def _steps_major(t):
    """[B, H, t, D] -> [t, B, H, D] (a view)."""
    return t.permute(2, 0, 1, 3)


def _heads_major(rows):
    """[T, B, H, D] -> [B, H, T, D] (a view)."""
    return rows.permute(1, 2, 0, 3)


class KVCache:
    """One attention layer's keys and values, [B, H, T, D] each, appended in
    place along T.

    max_len: the most steps the cache holds (address space is reserved for
    them; pages are mapped as it grows). window: keep only the last `window`
    steps, in a ring buffer (then max_len is not needed). map_ahead_steps:
    steps kept mapped beyond the length, mapped by a worker thread (default:
    up to 4 MiB worth, and no more than a sixteenth of the steps held, so a
    small cache maps pages as its appends reach them). dtype: what keys and
    values are stored as (default: their dtypes at the first append); an
    append converts to it as copy_ converts. A model that attends in a lower
    precision than it makes K in (K in fp32 from a LayerNorm under autocast,
    attention in bf16) stores what the attention reads: each step's keys are
    then converted once, at their append, instead of the whole cache at
    every step, and the cache takes half the memory. The shape and device
    come from the first append.

    The tensors returned by append(), keys and values are views: valid until
    the steps they cover are dropped or overwritten (by truncate, put, a
    window moving past them, reorder or close)."""

    def __init__(self, max_len=None, window=None, map_ahead_steps=None, dtype=None):
        if window is None and max_len is None:
            raise ValueError("KVCache: give max_len (the most steps it holds) or window")
        if window is not None and window < 1:
            raise ValueError("KVCache: window must be at least 1 (got %r)" % (window,))
        if max_len is not None and max_len < 1:
            raise ValueError("KVCache: max_len must be at least 1 (got %r)" % (max_len,))
        self.max_len = max_len if window is None else window
        self.window = window
        self.map_ahead_steps = map_ahead_steps
        self.dtype = dtype
        self.seen = 0       # steps appended in total (the position of the next one)
        self._k = self._v = None
        self.device = None

    # -- set up on the first append
    def _create(self, k, v):
        torch = _torch()
        if k.dim() != 4 or v.dim() != 4:
            raise ValueError("KVCache.append: k and v must be [B, H, t, D] (got %s and %s)"
                             % (tuple(k.shape), tuple(v.shape)))
        index = tidalloc_device(k.device)
        host = k.device.type == "cpu"
        sides = []
        for t in (k, v):
            dtype = self.dtype or t.dtype
            row_shape = (t.shape[0], t.shape[1], t.shape[3])
            row_bytes = t.shape[0] * t.shape[1] * t.shape[3] * _itemsize(torch, dtype)
            ahead, fraction = self.map_ahead_steps, 0.0
            if ahead is None:
                ahead = max(1, -(-DEFAULT_MAP_AHEAD_BYTES // max(1, row_bytes)))
                fraction = DEFAULT_MAP_AHEAD_FRACTION
            sides.append(_Rows(row_shape, dtype, self.max_len, self.window, index, host, ahead,
                               fraction))
        self._k, self._v = sides
        self.device = torch.device(k.device)

    def _check(self, k, v):
        ks, vs = k.shape, v.shape
        if (len(ks) == 4 and len(vs) == 4 and ks[2] == vs[2]
                and (ks[0], ks[1], ks[3]) == self._k.row_shape
                and (vs[0], vs[1], vs[3]) == self._v.row_shape
                and k.device == self.device and v.device == self.device):
            return
        self._explain(k, v)

    def _explain(self, k, v):
        """Raise the error that names what _check found wrong."""
        if k.dim() != 4 or v.dim() != 4 or k.shape[2] != v.shape[2]:
            raise ValueError("KVCache.append: k and v must be [B, H, t, D] with the same t "
                             "(got %s and %s)" % (tuple(k.shape), tuple(v.shape)))
        for name, new, rows in (("k", k, self._k), ("v", v, self._v)):
            if (new.shape[0], new.shape[1], new.shape[3]) != rows.row_shape:
                raise ValueError("KVCache.append: %s of shape %s, the cache holds [B, H, T, D] = "
                                 "%s" % (name, tuple(new.shape), rows.row_shape[:2] + ("T",)
                                         + rows.row_shape[2:]))
        if k.device != self.device or v.device != self.device:
            raise ValueError("KVCache.append: the cache is on %s, k on %s and v on %s"
                             % (self.device, k.device, v.device))

    # -- the cache
    def append(self, k, v):
        """Copy k and v ([B, H, t, D]) after the steps held; returns
        (keys, values), the whole cache as [B, H, T, D] views (with a window,
        the last `window` steps)."""
        if self._k is None:
            self._create(k, v)
        else:
            self._check(k, v)
        t = k.shape[2]
        if self.window is None and self._k.length + t > self.max_len:
            raise ValueError("KVCache.append: %d + %d steps is beyond max_len=%d; create the "
                             "cache with a larger max_len (it reserves address space, not "
                             "memory)" % (self._k.length, t, self.max_len))
        keys = self._k.append_heads(k)
        values = self._v.append_heads(v)
        self.seen += t
        return keys, values

    @property
    def keys(self):
        """All steps held, [B, H, T, D] (None before the first append)."""
        return None if self._k is None else self._k.heads_view()

    @property
    def values(self):
        return None if self._v is None else self._v.heads_view()

    def __len__(self):
        return 0 if self._k is None else self._k.length

    @property
    def initialized(self):
        return self._k is not None

    def put(self, start, k, v):
        """Overwrite steps [start, start + t) with k and v ([B, H, t, D]) in
        place: for caches that evict by giving an old step's slot to a new one
        (attention without a mask over the cache does not depend on the order
        of its steps). Growing storage only."""
        if self._k is None or self.window is not None:
            raise ValueError("KVCache.put: only on a growing cache (no window) after the first "
                             "append")
        self._check(k, v)
        t = k.shape[2]
        if start < 0 or start + t > len(self):
            raise ValueError("KVCache.put: steps [%d, %d) are not all held (%d held)"
                             % (start, start + t, len(self)))
        self._k.rows(start, t).copy_(_steps_major(k))
        self._v.rows(start, t).copy_(_steps_major(v))

    def truncate(self, length):
        """Keep the first `length` steps (with a window: drop the newest
        steps, keeping the oldest `length` of those held). With growing
        storage, pages past them go once the current stream is past the work
        queued so far."""
        if self._k is None:
            return
        length = max(0, min(length, len(self)))
        self.seen -= len(self) - length
        self._k.truncate(length)
        self._v.truncate(length)

    def reorder(self, index):
        """Keep batch entries `index` (a 1-D index tensor of B entries, such
        as beam search's beam_idx), in place: one gather of the cache into
        a temporary and a copy back."""
        if self._k is None or len(self) == 0:
            return
        for rows in (self._k, self._v):
            held = rows.rows()
            idx = index.to(held.device)
            if idx.numel() != held.shape[1]:
                raise ValueError("KVCache.reorder: %d indices for a batch of %d (a different "
                                 "batch size needs rebatch)" % (idx.numel(), held.shape[1]))
            held.copy_(held.index_select(1, idx))

    def rebatch(self, index):
        """A batch of len(index) entries taken from this one's (repeats allowed),
        in new storage: the steps held are copied once."""
        if self._k is None:
            return
        keys, values = self.keys, self.values
        idx = index.to(keys.device)
        new_k, new_v = keys.index_select(0, idx), values.index_select(0, idx)
        seen = self.seen
        self.close()
        self._create(new_k, new_v)
        if new_k.shape[2]:
            self.append(new_k, new_v)
        self.seen = seen

    def reset(self):
        """Drop every step; the storage (and its shape) stays for reuse."""
        self.truncate(0)
        self.seen = 0

    # -- CUDA graphs
    def static_view(self, length):
        """(keys, values) as [B, H, length, D] views of the first `length`
        steps, held or not, with their pages mapped now: a view of fixed
        address and shape that a captured graph (or a compiled function) can
        keep reading as appends fill it, up to `length` steps. Steps not yet
        held read as zero; mask them (attn_mask of positions < len(cache)).
        Growing storage only; truncating below `length` while a graph reads
        the view unmaps pages it reads."""
        if self._k is None or self.window is not None:
            raise ValueError("KVCache.static_view: only on a growing cache (no window) after the "
                             "first append")
        if not 0 < length <= self.max_len:
            raise ValueError("KVCache.static_view: length %d is not in [1, max_len=%d]"
                             % (length, self.max_len))
        out = []
        for rows in (self._k, self._v):
            rows.reserve(length)
            view = rows.grow._full[:length]
            if length > rows.length:
                view[rows.length:].zero_()
            out.append(_heads_major(view))
        return tuple(out)

    def data_ptrs(self):
        """(keys, values) storage addresses (fixed for a growing cache)."""
        if self._k is None:
            return None
        if self.window is None:
            return self._k.grow.data_ptr, self._v.grow.data_ptr
        return self._k.buf.data, self._v.buf.data

    def close(self):
        """Give the storage back (once the current stream is past the work
        queued on it); tensors over it must not be used afterwards."""
        for rows in (self._k, self._v):
            if rows is not None:
                rows.close()
        self._k = self._v = None

    def __repr__(self):
        if self._k is None:
            return "KVCache(max_len=%s, window=%s, empty)" % (self.max_len, self.window)
        b, h, d = self._k.row_shape
        return ("KVCache(B=%d, H=%d, T=%d, D=%d, %s, %s)"
                % (b, h, len(self), d, str(self._k.dtype).replace("torch.", ""),
                   "window=%d" % self.window if self.window else "max_len=%d" % self.max_len))
