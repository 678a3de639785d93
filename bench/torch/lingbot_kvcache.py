"""lingbot_kvcache.py: LingBot-Map's streaming attention with its key/value
caches in tidalloc.kv.KVCache instead of torch.cat, for comparing the two on
LingBot-Map's own model (validate.py's `lingbot_kvcache` program).

LingBot-Map's streaming attention (SDPAAttention in the aggregator's global
blocks under --backend sdpa, CausalAttention in the camera head's trunk)
keeps each layer's keys and values in a dict as [B, H, frames, tokens, D]
tensors: every step concatenates the new frames, evicts what falls out of
the window (the first scale frames and the last `window` frames stay; an
evicted frame's camera, register and scale tokens move to a special cache),
clones the cache, prepends the special tokens and attends (CausalAttention
with an all-True mask). install() replaces the cached branch of both
forwards with the same rule in a KVCache per layer:
[scale frames][a ring of `window` frame slots][special tokens], a frame past
the window taking the slot of the frame it evicts once that frame's special
tokens are appended (bench/torch/frame_cache.py, which stream_gct.py's
--growable uses too). Nothing is rebuilt or cloned, and the attention reads the cache where
it is. The keys are held in the dtype the attention reads (bf16 under
autocast) rather than as they come (fp32 from the qk norm), as autocast
would cast them anyway.

The order of the keys differs from LingBot-Map's (the ring rotates, the
special tokens come last); no mask restricts the attention (CausalAttention's
all-True mask is kept), so its result does not depend on the order but for
rounding. The dict keeps
what the rest of the model reads: `k_{i}` is a [B, H, frames held, tokens,
D] view of the cache (the aggregator reads its shape). Configurations the
conversion does not cover (skip-append frames, camera-only or no-scale
eviction, the non-fused path) go to LingBot-Map's own code.

    import lingbot_kvcache
    uninstall = lingbot_kvcache.install(max_frames=1100)   # before the first frame
"""
import os
import sys

import torch

# frame_cache.py beside this file, also when this file is loaded by its path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from frame_cache import FrameCache  # noqa: E402

# The dict key under which a layer's cache lives beside LingBot-Map's keys.
CACHE_KEY = "_tidalloc_kv_%d"


def frames_view(tensor, cache):
    """The frames `cache` holds whole, of its keys or values `tensor`, as
    [B, H, frames, tokens, D] (a view): what LingBot-Map keeps in k_{i}."""
    return tensor[:, :, :cache.frames * cache.tokens].unflatten(2, (cache.frames, cache.tokens))


def covered(attn, kv_cache):
    """Whether the conversion covers this call (else LingBot-Map's code runs)."""
    return (kv_cache is not None and attn.fused_attn and not kv_cache.get("_skip_append", False)
            and attn.kv_cache_cross_frame_special and attn.kv_cache_include_scale_frames
            and not attn.kv_cache_camera_only and not attn.training)


def install(max_frames):
    """Replace the cached branch of SDPAAttention.forward and
    CausalAttention.forward (see the module's description); `max_frames`:
    the most frames a stream may have (address space is reserved for them,
    memory mapped as the caches grow). Returns a function that puts
    LingBot-Map's own forwards back."""
    from lingbot_map.layers import attention as lingbot_attention
    originals = {}
    for name, masked in (("SDPAAttention", False), ("CausalAttention", True)):
        cls = getattr(lingbot_attention, name)
        originals[cls] = cls.forward
        cls.forward = converted(cls.forward, masked, max_frames, lingbot_attention)

    def uninstall():
        for cls, forward in originals.items():
            cls.forward = forward
    return uninstall


def converted(original, masked, max_frames, lingbot_attention):
    """A forward that runs cached_forward where the conversion covers the
    call and `original` elsewhere."""
    def forward(self, x, **kwargs):
        if not covered(self, kwargs.get("kv_cache")):
            return original(self, x, **kwargs)
        return cached_forward(self, x, masked, max_frames, lingbot_attention, **kwargs)
    return forward


def cached_forward(self, x, masked, max_frames, lingbot_attention, kv_cache, pos=None,
                   global_idx=0, num_frame_per_block=1, enable_3d_rope=False,
                   num_register_tokens=4, **_unused):
    """LingBot-Map's cached branch (keyframes), with the cache in a
    FrameCache: q, k, v and their norms and rotary embedding as LingBot-Map
    makes them, the new frames appended in place, attention over the whole
    cache (masked: with CausalAttention's all-True mask)."""
    B, N, C = x.shape
    special = num_register_tokens + 2  # camera, registers, scale
    qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    gate_score = None
    if getattr(self, "gate_proj", None) is not None:
        gate_score = self.gate_proj(x).reshape(B, N, self.num_heads, self.head_dim).permute(
            0, 2, 1, 3)
    q, k = self.q_norm(q), self.k_norm(k)
    if self.rope is not None and not enable_3d_rope:
        q, k = self.rope(q, pos), self.rope(k, pos)
    elif enable_3d_rope and pos is not None and (masked or self.rope is not None):
        # (CausalAttention applies 3D RoPE without a rope module, SDPAAttention only with one)
        q = lingbot_attention.apply_rotary_emb(q, pos)
        k = lingbot_attention.apply_rotary_emb(k, pos)

    key = CACHE_KEY % global_idx
    cache = kv_cache.get(key)
    if kv_cache.get("k_%d" % global_idx) is None or cache is None:
        # A new stream (LingBot-Map's clean_kv_cache sets every key to None).
        if cache is not None:
            cache.close()
        tokens = N // num_frame_per_block
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(
            x.device.type) else None
        cache = FrameCache(self.kv_cache_scale_frames, self.kv_cache_sliding_window, tokens,
                           special, max_frames, dtype)
        kv_cache[key] = cache
    frames = N // cache.tokens
    shape = (B, self.num_heads, frames, cache.tokens, self.head_dim)
    k, v = k.reshape(shape), v.reshape(shape)
    for i in range(frames):
        cache.append_frame(k[:, :, i], v[:, :, i])
    kv_cache["k_%d" % global_idx] = frames_view(cache.kv.keys, cache)
    kv_cache["v_%d" % global_idx] = frames_view(cache.kv.values, cache)

    keys, values = cache.kv.keys, cache.kv.values
    mask = (torch.ones(B, 1, q.shape[2], keys.shape[2], dtype=torch.bool, device=q.device)
            if masked else None)
    out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    if gate_score is not None:
        out = out * torch.sigmoid(gate_score)
    out = out.transpose(1, 2).reshape(B, -1, self.num_heads * self.head_dim)
    return self.proj_drop(self.proj(out))
