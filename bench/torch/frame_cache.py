"""frame_cache.py: a streaming model's attention cache, evicted as
LingBot-Map evicts it, in place in a tidalloc.kv.KVCache, for
stream_gct.py --growable and lingbot_kvcache.py.

One layer's keys and values for whole frames of `tokens` tokens:
[scale frames][a ring of `window` frame slots][special tokens of evicted
frames], one step a token. A frame past the window takes the slot of the
oldest frame in the ring (KVCache.put) once that frame's first `special`
tokens (camera, registers, scale) are appended at the end: nothing is
rebuilt or cloned, and attention reads the cache where it is (the order of
the keys does not change attention's result but for rounding). A cache of
one token a frame (a camera head's) keeps every frame, as LingBot-Map's."""
import os
import sys

# The package of this source tree, also when PYTHONPATH does not name it.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))


class FrameCache:
    """max_frames: the most frames a stream may have (address space is
    reserved for what they leave in the cache); dtype and map_ahead_steps
    as KVCache takes them."""

    def __init__(self, scale_frames, window, tokens, special, max_frames, dtype=None,
                 map_ahead_steps=None):
        from tidalloc.kv import KVCache
        self.scale_frames, self.window, self.tokens, self.special = (scale_frames, window, tokens,
                                                                     special)
        self.evicting = tokens > 1
        held = scale_frames + window
        if self.evicting:
            rows = held * tokens + special * max(0, max_frames - held)
        else:
            rows = max_frames * tokens
        self.kv = KVCache(max_len=max(rows, tokens), map_ahead_steps=map_ahead_steps,
                          dtype=dtype)
        self.frames = 0          # frames held whole (scale frames and ring)
        self.appended = 0        # frames ever appended: the ring's clock
        self.special_tokens = 0  # tokens kept of evicted frames

    def append_frame(self, k, v):
        """k, v: [B, H, tokens, D], one frame (copied into the cache)."""
        s, w, t = self.scale_frames, self.window, self.tokens
        if not self.evicting or self.frames < s + w:
            self.kv.append(k, v)
            self.frames += 1
        else:
            slot = s + (self.appended - s) % w
            special = slice(slot * t, slot * t + self.special)
            self.kv.append(self.kv.keys[:, :, special], self.kv.values[:, :, special])
            self.kv.put(slot * t, k, v)
            self.special_tokens += self.special
        self.appended += 1

    def close(self):
        self.kv.close()
