"""stream_gct.py: a streaming 3D reconstruction workload, modelled on
LingBot-Map, as a PyTorch model with random weights, timed over a sweep of
frame counts. bench/torch/README.md ("What it runs") gives its shapes and
sizes; `tidalloc stream` is a C model of the same allocation pattern.

One step runs a frame (the first step: the 8 scale frames as one batch)
through a ViT-L/14 patch encoder, an aggregator of 24 frame blocks and 24
global blocks, a camera head and a DPT depth head. Encoder and aggregator run
under bf16 autocast, the heads in fp32. Each global block keeps its frames'
K (fp32: its qk-LayerNorm answers in fp32) and V (bf16) in a per-layer cache
of shape [1, 16, tokens, 64], grown every step by torch.cat; once it holds
more than 8 + 64 frames it is rebuilt as [first 8] + [last 64] frames, the
evicted frames' 6 special tokens appended to a special cache that grows
without bound, and each attention call clones the cache and concatenates it
after the special cache. The camera head keeps fp32 caches [1, 16, n, 1, 128]
per block and iteration, grown every frame and never evicted. Depth and
confidence (fp32, full resolution) and the pose of every frame stay on the
device.

--growable keeps each global layer's K and V in a tidalloc.kv.KVCache (the
package's [B, H, T, D] cache, appended in place): [scale frames][a ring of 64
frame slots][special tokens of evicted frames] (a frame past the window takes
the slot of the frame it evicts, whose special tokens are appended first),
attention reading it where it is; the camera caches are KVCaches too. The
caches store K in bf16, what the attention reads (KVCache's dtype), so that a
step converts its own keys rather than the whole fp32 cache; --kv-dtype
appended keeps them in fp32 as they come. --compile compiles the
encoder blocks, frame blocks and the fixed-shape parts of the global blocks
with torch.compile(mode="reduce-overhead") (CUDA graphs), the cache work
staying eager.

CSV (--csv, rewritten after each row): frames,status,requested_height,
requested_width,effective_height,effective_width,backend,dtype,seconds,
peak_allocated_gib,peak_reserved_gib,error. seconds: the frame loop, from a
synchronized device to a synchronized device. Peaks are reset before each
row (after the previous row's state is freed and the cache emptied).

    python bench/torch/stream_gct.py [--frame-counts 64 128 ...] [--csv out.csv]
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python bench/torch/stream_gct.py ...
    TIDALLOC_CONF=trace:8000000 python -m tidalloc run bench/torch/stream_gct.py \\
        --frame-counts 96 --trace-csv stream_gct.csv.gz
    TIDALLOC_CONF=backend:host python bench/torch/stream_gct.py --tiny --device cpu --growable"""
import argparse
import csv
import dataclasses
import gc
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# The package of this source tree, also when PYTHONPATH does not name it.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
# sdpa.py and frame_cache.py beside this file, also when this file is loaded by its path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from frame_cache import FrameCache  # noqa: E402
from sdpa import SDPA_KERNELS, sdpa_context  # noqa: E402

CSV_COLUMNS = ("frames", "status", "requested_height", "requested_width", "effective_height",
               "effective_width", "backend", "dtype", "seconds", "peak_allocated_gib",
               "peak_reserved_gib", "error")
FRAME_COLUMNS = ("frames", "frame", "batch", "cache_frames", "special_tokens", "seconds",
                 "allocated_gib", "reserved_gib")
DEFAULT_SWEEP = (64, 128, 256, 512, 1024, 2048, 4096, 10000)
COMPUTE_DTYPE = torch.bfloat16
GiB = float(1 << 30)


# ---------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Shape:
    """The model's dimensions. The defaults are the workload's (518 x 378,
    patch 14, ViT-L/14, 24 + 24 aggregator blocks, window 8 + 64)."""
    height: int = 378
    width: int = 518
    patch: int = 14
    dim: int = 1024
    heads: int = 16
    mlp: int = 4096
    encoder_blocks: int = 24
    layers: int = 24               # frame blocks, and as many global blocks
    registers: int = 4             # special tokens: camera, registers, scale
    pos_grid: int = 37             # the encoder's position embedding: pos_grid^2 + 1
    camera_blocks: int = 4
    camera_iterations: int = 4
    camera_heads: int = 16         # camera trunk width 2 * dim = camera_heads * head dim
    dpt_layers: tuple = (4, 11, 17, 23)
    dpt_channels: tuple = (256, 512, 1024, 1024)
    dpt_features: int = 256
    scale_frames: int = 8
    window: int = 64

    @property
    def grid(self):
        return self.height // self.patch, self.width // self.patch

    @property
    def patches(self):
        return self.grid[0] * self.grid[1]

    @property
    def special(self):
        return self.registers + 2

    @property
    def tokens(self):
        """Aggregator tokens per frame: 999 + 6 = 1005 at full size."""
        return self.patches + self.special

    @property
    def head_dim(self):
        return self.dim // self.heads

    @property
    def camera_dim(self):
        return 2 * self.dim

    @property
    def camera_head_dim(self):
        return self.camera_dim // self.camera_heads

    def effective(self):
        """(height, width) rounded down to whole patches."""
        return self.grid[0] * self.patch, self.grid[1] * self.patch


TINY = dict(height=56, width=70, dim=64, heads=4, mlp=256, encoder_blocks=2, layers=4,
            pos_grid=8, camera_blocks=2, camera_iterations=2, camera_heads=4,
            dpt_layers=(0, 1, 2, 3), dpt_channels=(16, 32, 64, 64), dpt_features=32,
            scale_frames=2, window=4)


def make_shape(tiny=False, **overrides):
    """The full shape, or the tiny one for CPU tests; None values are ignored."""
    fields = dict(TINY) if tiny else {}
    fields.update({k: v for k, v in overrides.items() if v is not None})
    shape = Shape(**fields)
    if min(shape.grid) < 1 or shape.dim % shape.heads or shape.camera_dim % shape.camera_heads:
        raise ValueError("stream_gct: inconsistent shape %s" % (shape,))
    if max(shape.dpt_layers) >= shape.layers:
        raise ValueError("stream_gct: dpt_layers %s beyond %d layers"
                         % (shape.dpt_layers, shape.layers))
    return shape


# ---------------------------------------------------------------------------
# Transformer blocks
# ---------------------------------------------------------------------------

def rope_tables(shape):
    """cos and sin, [tokens, head_dim] fp32, of a 2D rotary embedding: the
    first half of each head rotates by the patch's row, the second by its
    column; special tokens sit at position 0 (unrotated)."""
    gh, gw = shape.grid
    quarter = shape.head_dim // 4
    inv = 1.0 / (100.0 ** (torch.arange(quarter, dtype=torch.float32) / quarter))
    rows = torch.arange(gh, dtype=torch.float32).repeat_interleave(gw) + 1
    cols = torch.arange(gw, dtype=torch.float32).repeat(gh) + 1
    zeros = torch.zeros(shape.special)
    rows, cols = torch.cat([zeros, rows]), torch.cat([zeros, cols])
    ay, ax = rows[:, None] * inv, cols[:, None] * inv
    angles = torch.cat([ay, ay, ax, ax], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(t, cos, sin):
    """t [B, H, T, D] fp32, rotated pairwise within each half of D."""
    q = t.unflatten(-1, (2, 2, -1))
    rotated = torch.stack((-q[..., 1, :], q[..., 0, :]), dim=-2).flatten(-3)
    return t * cos + rotated * sin


class Mlp(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class LayerScale(nn.Module):
    def __init__(self, dim, init=1e-2):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), init))

    def forward(self, x):
        return x * self.gamma


class QKV(nn.Module):
    """norm, qkv projection, and for aggregator blocks qk-LayerNorm (in
    fp32, so K comes out fp32 as under CUDA autocast) and 2D RoPE. Returns
    q, k, v as [B, heads, T, head_dim]; v in the autocast dtype."""

    def __init__(self, dim, heads, qk_norm):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.q_norm = nn.LayerNorm(dim // heads) if qk_norm else None
        self.k_norm = nn.LayerNorm(dim // heads) if qk_norm else None

    def forward(self, x, cos=None, sin=None):
        b, t, c = x.shape
        qkv = self.qkv(self.norm(x)).view(b, t, 3, self.heads, c // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        if self.q_norm is not None:
            q, k = self.q_norm(q.float()), self.k_norm(k.float())
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v


class Tail(nn.Module):
    """After attention: projection, layer scale and residual, then the MLP."""

    def __init__(self, dim, mlp):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.ls1 = LayerScale(dim)
        self.norm = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, mlp)
        self.ls2 = LayerScale(dim)

    def forward(self, x, attended):
        x = x + self.ls1(self.proj(attended))
        return x + self.ls2(self.mlp(self.norm(x)))


# The kernel attend() holds scaled_dot_product_attention to (--sdpa):
# "default" leaves the choice to PyTorch. The camera head's fp32 attention
# keeps PyTorch's choice either way (flash takes no fp32).
ATTENTION_KERNEL = "default"


def set_attention_kernel(kernel):
    """attend()'s kernel from now on, one of sdpa.SDPA_KERNELS."""
    global ATTENTION_KERNEL
    if kernel not in SDPA_KERNELS:
        raise ValueError("stream_gct: no attention kernel %r (one of %s)"
                         % (kernel, ", ".join(SDPA_KERNELS)))
    ATTENTION_KERNEL = kernel


def attend(q, k, v):
    """SDPA in the compute dtype (autocast's casts, made explicit so that
    the CPU path allocates the same); [B, H, T, D] -> [B, T, H * D]."""
    with sdpa_context(ATTENTION_KERNEL):
        out = F.scaled_dot_product_attention(q.to(COMPUTE_DTYPE), k.to(COMPUTE_DTYPE),
                                             v.to(COMPUTE_DTYPE))
    return out.transpose(1, 2).flatten(2)


class Block(nn.Module):
    """A pre-norm transformer block. forward() attends within each frame
    (encoder and frame blocks); a global block calls qkv and tail itself,
    with the cache's attention between them."""

    def __init__(self, dim, heads, mlp, qk_norm):
        super().__init__()
        self.qkv = QKV(dim, heads, qk_norm)
        self.tail = Tail(dim, mlp)

    def forward(self, x, cos=None, sin=None):
        q, k, v = self.qkv(x, cos, sin)
        return self.tail(x, attend(q, k, v))


# ---------------------------------------------------------------------------
# KV caches: grown by torch.cat (the workload's way) or in place
# ---------------------------------------------------------------------------

def flatten_frames(t):
    """[B, H, T, D] -> [1, H, B * T, D] (a view for one frame)."""
    b, h, n, d = t.shape
    return t.transpose(0, 1).reshape(1, h, b * n, d)


class CatKVCache:
    """One global layer's K and V, [1, H, frames * T, D], grown by torch.cat;
    past scale_frames + window frames rebuilt as [first scale_frames] +
    [last window], the evicted frames' special tokens appended to the
    special caches. attention() clones the cache and concatenates it after
    the special cache, as transients."""

    def __init__(self, shape, device):
        h, d = shape.heads, shape.head_dim
        self.shape = shape
        self.k = torch.empty(1, h, 0, d, dtype=torch.float32, device=device)
        self.v = torch.empty(1, h, 0, d, dtype=COMPUTE_DTYPE, device=device)
        self.special_k = torch.empty(1, h, 0, d, dtype=torch.float32, device=device)
        self.special_v = torch.empty(1, h, 0, d, dtype=COMPUTE_DTYPE, device=device)
        self.frames = 0

    @property
    def special_tokens(self):
        return self.special_k.shape[2]

    def append(self, k, v):
        """k, v: [B, H, T, D] of B new frames."""
        self.k = torch.cat([self.k, flatten_frames(k).to(self.k.dtype)], dim=2)
        self.v = torch.cat([self.v, flatten_frames(v).to(self.v.dtype)], dim=2)
        self.frames += k.shape[0]
        if self.frames > self.shape.scale_frames + self.shape.window:
            self._evict()

    def _evict(self):
        shape, n = self.shape, self.frames
        s, w, t, keep = shape.scale_frames, shape.window, shape.tokens, shape.special
        k, v = (c.view(1, c.shape[1], n, t, c.shape[3]) for c in (self.k, self.v))
        evicted = slice(s, n - w)
        self.special_k = torch.cat([self.special_k, k[:, :, evicted, :keep].flatten(2, 3)], dim=2)
        self.special_v = torch.cat([self.special_v, v[:, :, evicted, :keep].flatten(2, 3)], dim=2)
        self.k = torch.cat([k[:, :, :s], k[:, :, n - w:]], dim=2).flatten(2, 3)
        self.v = torch.cat([v[:, :, :s], v[:, :, n - w:]], dim=2).flatten(2, 3)
        self.frames = s + w

    def attention(self, q):
        """q [1, H, Tq, D] over the special tokens and the frames held."""
        k = torch.cat([self.special_k, self.k.clone()], dim=2)
        v = torch.cat([self.special_v, self.v.clone()], dim=2)
        return attend(q, k, v)

    def close(self):
        self.k = self.v = self.special_k = self.special_v = None


class GrowableKVCache:
    """The same cache in place (frame_cache.FrameCache: the package's
    [B, H, T, D] tidalloc.kv.KVCache, [scale frames][a ring of `window` frame
    slots][special tokens of evicted frames], nothing rebuilt, attention
    reading the cache where it is). kv_dtype "attention": K and V stored in
    the compute dtype, which attend() converts them to anyway (the same
    values, converted once a step's keys instead of the whole cache every
    step); "appended": K in fp32 and V in the compute dtype, as they come."""

    def __init__(self, shape, device, total_frames, map_ahead_frames=1, kv_dtype="attention"):
        self.cache = FrameCache(shape.scale_frames, shape.window, shape.tokens, shape.special,
                                total_frames,
                                dtype=COMPUTE_DTYPE if kv_dtype == "attention" else None,
                                map_ahead_steps=map_ahead_frames * shape.tokens)

    @property
    def kv(self):
        """The KVCache itself."""
        return self.cache.kv

    @property
    def frames(self):
        """Frames held whole (scale frames and ring)."""
        return self.cache.frames

    @property
    def special_tokens(self):
        return self.cache.special_tokens

    def append(self, k, v):
        """k, v: [B, H, T, D] of B new frames, appended a frame at a time."""
        if not self.kv.initialized and self.kv.dtype is None:
            # K in fp32 and V in the compute dtype, as the first append brings them.
            k, v = k.float(), v.to(COMPUTE_DTYPE)
        for i in range(k.shape[0]):
            self.cache.append_frame(k[i:i + 1], v[i:i + 1])

    def attention(self, q):
        return attend(q, self.kv.keys, self.kv.values)

    def close(self):
        self.cache.close()


class CatCameraCache:
    """A camera block's K and V for one iteration: [1, H, n, 1, Dc] fp32,
    grown by torch.cat every frame, never evicted."""

    def __init__(self, shape, device):
        h, d = shape.camera_heads, shape.camera_head_dim
        self.k = torch.empty(1, h, 0, 1, d, device=device)
        self.v = torch.empty(1, h, 0, 1, d, device=device)

    def append(self, k, v):
        """k, v: [B, H, Dc] of B new frames."""
        self.k = torch.cat([self.k, k.transpose(0, 1)[None, :, :, None]], dim=2)
        self.v = torch.cat([self.v, v.transpose(0, 1)[None, :, :, None]], dim=2)

    def keys_values(self):
        return self.k.squeeze(3), self.v.squeeze(3)

    @property
    def frames(self):
        return self.k.shape[2]

    def close(self):
        self.k = self.v = None


class GrowableCameraCache:
    """The same in a tidalloc.kv.KVCache of [1, H, n, Dc], one step a frame."""

    def __init__(self, shape, device, total_frames):
        from tidalloc.kv import KVCache
        self.kv = KVCache(max_len=total_frames, map_ahead_steps=0)

    def append(self, k, v):
        """k, v: [B, H, Dc] of B new frames."""
        self.kv.append(k.transpose(0, 1)[None], v.transpose(0, 1)[None])

    def keys_values(self):
        return self.kv.keys, self.kv.values

    @property
    def frames(self):
        return len(self.kv)

    def close(self):
        self.kv.close()


class StreamState:
    """What a stream keeps across steps: the caches and the outputs."""

    def __init__(self, shape, device, total_frames, growable=False, map_ahead_frames=1,
                 kv_dtype="attention"):
        if growable:
            kv = [GrowableKVCache(shape, device, total_frames, map_ahead_frames, kv_dtype)
                  for _ in range(shape.layers)]
            cam = [GrowableCameraCache(shape, device, total_frames)
                   for _ in range(shape.camera_blocks * shape.camera_iterations)]
        else:
            kv = [CatKVCache(shape, device) for _ in range(shape.layers)]
            cam = [CatCameraCache(shape, device)
                   for _ in range(shape.camera_blocks * shape.camera_iterations)]
        self.kv, self.camera, self.outputs = kv, cam, []
        self.frames_done = 0

    def camera_cache(self, iteration, block, blocks_per_iteration):
        return self.camera[iteration * blocks_per_iteration + block]

    def close(self):
        for cache in self.kv + self.camera:
            cache.close()
        self.kv, self.camera, self.outputs = [], [], []


# ---------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------

class Encoder(nn.Module):
    """DINOv2-style ViT-L/14 with 4 registers: patch embedding, interpolated
    position embedding, blocks, norm; returns the patch tokens."""

    def __init__(self, shape):
        super().__init__()
        self.shape = shape
        d = shape.dim
        self.patch_embed = nn.Conv2d(3, d, shape.patch, shape.patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.registers = nn.Parameter(torch.randn(1, shape.registers, d) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, shape.pos_grid ** 2 + 1, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, shape.heads, shape.mlp, qk_norm=False)
                                    for _ in range(shape.encoder_blocks))
        self.norm = nn.LayerNorm(d)

    def position_embedding(self):
        g, (gh, gw) = self.shape.pos_grid, self.shape.grid
        grid = self.pos_embed[:, 1:].reshape(1, g, g, -1).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(gh, gw), mode="bicubic", align_corners=False)
        return grid.flatten(2).transpose(1, 2)

    def forward(self, images):
        b = images.shape[0]
        x = self.patch_embed(images).flatten(2).transpose(1, 2) + self.position_embedding()
        cls = (self.cls_token + self.pos_embed[:, :1]).expand(b, -1, -1)
        x = torch.cat([cls, self.registers.expand(b, -1, -1), x], dim=1)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)[:, 1 + self.shape.registers:]


class Aggregator(nn.Module):
    """Frame blocks and global blocks in turn over [special tokens, patches];
    each pair's outputs, side by side, are kept for the heads."""

    def __init__(self, shape):
        super().__init__()
        self.shape = shape
        d = shape.dim
        # One set of camera, register and scale tokens for the stream's first
        # frame, one for the rest.
        self.special = nn.Parameter(torch.randn(2, shape.special, d) * 0.02)
        self.frame_blocks = nn.ModuleList(Block(d, shape.heads, shape.mlp, qk_norm=True)
                                          for _ in range(shape.layers))
        self.global_blocks = nn.ModuleList(Block(d, shape.heads, shape.mlp, qk_norm=True)
                                           for _ in range(shape.layers))
        cos, sin = rope_tables(shape)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def global_block(self, i, x, cache):
        """x [B, T, C]: K and V of the B frames join the layer's cache, and
        their queries attend to everything the cache holds."""
        block = self.global_blocks[i]
        q, k, v = block.qkv(x, self.cos, self.sin)
        cache.append(k, v)
        attended = cache.attention(flatten_frames(q))
        b, t = x.shape[:2]
        return block.tail(x, attended.view(b, t, -1))

    def forward(self, patches, first_frame, state):
        b = patches.shape[0]
        which = torch.ones(b, dtype=torch.long, device=patches.device)
        if first_frame == 0:
            which[0] = 0
        x = torch.cat([self.special[which], patches], dim=1)
        outputs = []
        for i in range(self.shape.layers):
            f = self.frame_blocks[i](x, self.cos, self.sin)
            x = self.global_block(i, f, state.kv[i])
            outputs.append(torch.cat([f, x], dim=-1))
        return outputs


class CameraBlock(nn.Module):
    """A block of the camera trunk over one token per frame, attending to
    its cache of every frame so far (the current ones included)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.tail = Tail(dim, 4 * dim)

    def forward(self, x, cache):
        b, c = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, 3, self.heads, c // self.heads).unbind(1)
        cache.append(k, v)
        keys, values = cache.keys_values()
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values)
        return self.tail(x, out[0].transpose(0, 1).reshape(b, c))


class CameraHead(nn.Module):
    """Iterative pose refinement (fp32): per iteration the pose is embedded,
    modulates the camera tokens (adaLN), goes through the trunk, and a
    branch predicts its update. Returns [B, 9] poses."""

    def __init__(self, shape):
        super().__init__()
        c = shape.camera_dim
        self.shape = shape
        self.token_norm = nn.LayerNorm(c)
        self.trunk_norm = nn.LayerNorm(c)
        self.embed_pose = nn.Linear(9, c)
        self.modulation = nn.Linear(c, 3 * c)
        self.trunk = nn.ModuleList(CameraBlock(c, shape.camera_heads)
                                   for _ in range(shape.camera_blocks))
        self.pose_branch = nn.Sequential(nn.Linear(c, shape.dim), nn.GELU(),
                                         nn.Linear(shape.dim, 9))

    def forward(self, tokens, state):
        tokens = self.token_norm(tokens)
        pose = torch.zeros(tokens.shape[0], 9, device=tokens.device)
        for it in range(self.shape.camera_iterations):
            shift, scale, gate = self.modulation(F.silu(self.embed_pose(pose))).chunk(3, dim=-1)
            h = gate * (self.trunk_norm(tokens) * (1 + scale) + shift) + tokens
            for b, block in enumerate(self.trunk):
                h = block(h, state.camera_cache(it, b, len(self.trunk)))
            pose = pose + self.pose_branch(self.trunk_norm(h))
        return pose


class ResidualUnit(nn.Module):
    def __init__(self, features):
        super().__init__()
        self.conv1 = nn.Conv2d(features, features, 3, padding=1)
        self.conv2 = nn.Conv2d(features, features, 3, padding=1)

    def forward(self, x):
        return self.conv2(F.relu(self.conv1(F.relu(x)))) + x


class Fusion(nn.Module):
    """A DPT fusion block: add the refined skip level, refine, upsample."""

    def __init__(self, features, has_skip):
        super().__init__()
        self.skip_unit = ResidualUnit(features) if has_skip else None
        self.unit = ResidualUnit(features)
        self.out_conv = nn.Conv2d(features, features, 1)

    def forward(self, x, skip, size):
        if self.skip_unit is not None:
            x = x + self.skip_unit(skip)
        x = F.interpolate(self.unit(x), size=size, mode="bilinear", align_corners=True)
        return self.out_conv(x)


class DepthHead(nn.Module):
    """A DPT head (fp32) on four aggregator layers: projections resized to
    x4, x2, x1 and /2 of the patch grid, fused coarse to fine, then a conv
    at 2x the finest level, upsampled to the image (128 channels at full
    resolution, the largest activation: 100 MB a frame at full size), and
    convs to depth and confidence, each [B, 1, H, W]."""

    def __init__(self, shape):
        super().__init__()
        self.shape = shape
        c, feats, ch = shape.camera_dim, shape.dpt_features, shape.dpt_channels
        self.norm = nn.LayerNorm(c)
        self.projects = nn.ModuleList(nn.Conv2d(c, n, 1) for n in ch)
        self.resize = nn.ModuleList([nn.ConvTranspose2d(ch[0], ch[0], 4, 4),
                                     nn.ConvTranspose2d(ch[1], ch[1], 2, 2), nn.Identity(),
                                     nn.Conv2d(ch[3], ch[3], 3, stride=2, padding=1)])
        self.layer_rn = nn.ModuleList(nn.Conv2d(n, feats, 3, padding=1, bias=False) for n in ch)
        self.fusions = nn.ModuleList(Fusion(feats, has_skip=i < 3) for i in range(4))
        self.conv1 = nn.Conv2d(feats, feats // 2, 3, padding=1)
        self.conv2 = nn.Conv2d(feats // 2, 32, 3, padding=1)
        self.conv3 = nn.Conv2d(32, 2, 1)

    def level(self, i, tokens):
        gh, gw = self.shape.grid
        x = self.norm(tokens[:, self.shape.special:])
        x = x.transpose(1, 2).reshape(x.shape[0], -1, gh, gw)
        return self.layer_rn[i](self.resize[i](self.projects[i](x)))

    def forward(self, layer_outputs):
        levels = [self.level(i, layer_outputs[layer])
                  for i, layer in enumerate(self.shape.dpt_layers)]
        sizes = [tuple(lv.shape[-2:]) for lv in levels]
        path = self.fusions[3](levels[3], None, sizes[2])
        for i in (2, 1, 0):
            size = sizes[i - 1] if i else (2 * sizes[0][0], 2 * sizes[0][1])
            path = self.fusions[i](path, levels[i], size)
        x = F.interpolate(self.conv1(path), size=self.shape.effective(), mode="bilinear",
                          align_corners=True)
        out = self.conv3(F.relu(self.conv2(x)))
        return out[:, :1].exp(), 1 + out[:, 1:].exp()


class StreamModel(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.shape = shape
        self.encoder = Encoder(shape)
        self.aggregator = Aggregator(shape)
        self.camera_head = CameraHead(shape)
        self.depth_head = DepthHead(shape)

    def step(self, images, state):
        """One step of B frames: encoder and aggregator under bf16 autocast,
        heads in fp32; keeps (depth, confidence, pose) in state.outputs."""
        kind = images.device.type
        with torch.autocast(kind, dtype=COMPUTE_DTYPE):
            layer_outputs = self.aggregator(self.encoder(images), state.frames_done, state)
            with torch.autocast(kind, enabled=False):
                layer_outputs = [o.float() for o in layer_outputs]
                pose = self.camera_head(layer_outputs[-1][:, 0], state)
                depth, confidence = self.depth_head(layer_outputs)
        state.outputs.append((depth, confidence, pose))
        state.frames_done += images.shape[0]

    def compile_hot_modules(self):
        """Encoder blocks, frame blocks and the fixed-shape parts of the
        global blocks under torch.compile (CUDA graphs on a GPU); the cache
        work between them stays eager."""
        options = dict(mode="reduce-overhead", dynamic=False)
        for block in list(self.encoder.blocks) + list(self.aggregator.frame_blocks):
            block.compile(**options)
        for block in self.aggregator.global_blocks:
            block.qkv.compile(**options)
            block.tail.compile(**options)


def build_model(shape, device, seed=0, compile_hot=False):
    """Random weights (fp32, as a loaded checkpoint would be) made on `device`."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = StreamModel(shape).eval()
    if compile_hot:
        # The blocks of a kind share their code: one graph per step shape
        # (4 for Block.forward on the CPU's tiny run). Room is left for
        # recompilations per module instance, so that none falls back to eager.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, 1024)
        model.compile_hot_modules()
    return model


# ---------------------------------------------------------------------------
# Streaming and measuring
# ---------------------------------------------------------------------------

def device_index(device):
    device = torch.device(device)
    return (device.index or 0) if device.type == "cuda" else 0


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def step_batches(frames, scale_frames):
    """The scale frames as one batch, then one frame a step."""
    first = min(frames, scale_frames)
    return ([first] if first else []) + [1] * (frames - first)


def stream_steps(model, state, frames, device, generator, compiled=False):
    """Stream `frames` frames of random images through the model, yielding
    each step's frame count once the step is queued."""
    h, w = model.shape.effective()
    for batch in step_batches(frames, model.shape.scale_frames):
        with torch.no_grad():
            if compiled:
                torch.compiler.cudagraph_mark_step_begin()
            images = torch.randn(batch, 3, h, w, device=device, generator=generator)
            model.step(images, state)
            del images
        yield batch


def stream(model, state, frames, device, generator, compiled=False, on_step=None):
    """Stream `frames` frames of random images through the model."""
    for batch in stream_steps(model, state, frames, device, generator, compiled):
        if on_step is not None:
            on_step(batch)


def memory_figures(device):
    """(allocated, reserved) bytes now, or None off a GPU."""
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)


def backend_name(tidalloc_installed, torch_backend, environ):
    """The CSV's backend column: tidalloc when it is PyTorch's allocator,
    else what PyTorch's settings say (PYTORCH_CUDA_ALLOC_CONF, or its newer
    name PYTORCH_ALLOC_CONF)."""
    if tidalloc_installed:
        return "tidalloc"
    if torch_backend == "cudaMallocAsync":
        return "cudaMallocAsync"
    conf = ",".join(environ.get(name, "") for name in ("PYTORCH_CUDA_ALLOC_CONF",
                                                        "PYTORCH_ALLOC_CONF"))
    if "expandable_segments:true" in conf.replace(" ", "").lower():
        return "expandable"
    return "native"


def allocator_backend(device):
    """native, expandable, cudaMallocAsync or tidalloc (cpu off a GPU)."""
    if torch.device(device).type != "cuda":
        return "cpu"
    tide = sys.modules.get("tidalloc.torch")
    return backend_name(tide is not None and getattr(tide, "_installed", False),
                        torch.cuda.get_allocator_backend(), os.environ)


def is_out_of_memory(error):
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error).lower()
    return "out of memory" in text or "cuda_error_out_of_memory" in text


def release(device):
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


class FrameLog:
    """Per-step rows for --per-frame-csv. On a GPU a step's time is that
    between the CUDA events recorded at the ends of it and of the step
    before (no synchronization in the loop, so the timed loop runs as
    without the log); off a GPU, wall time. Memory: allocated and reserved
    as the allocator counts them when the step was issued."""

    def __init__(self, device, frames, state):
        self.device, self.frames, self.state, self.rows = device, frames, state, []
        self.on_gpu = torch.device(device).type == "cuda"
        self.marks = [self._mark()]

    def _mark(self):
        if not self.on_gpu:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def __call__(self, batch):
        self.marks.append(self._mark())
        mem = memory_figures(self.device)
        cache = self.state.kv[0]
        self.rows.append({"frames": self.frames, "frame": self.state.frames_done, "batch": batch,
                          "cache_frames": cache.frames, "special_tokens": cache.special_tokens,
                          "allocated_gib": "%.4f" % (mem[0] / GiB) if mem else "",
                          "reserved_gib": "%.4f" % (mem[1] / GiB) if mem else ""})

    def finish(self):
        """The rows, with each step's seconds (after the loop is synchronized)."""
        for row, (a, b) in zip(self.rows, zip(self.marks, self.marks[1:])):
            seconds = a.elapsed_time(b) / 1e3 if self.on_gpu else b - a
            row["seconds"] = "%.6f" % seconds
        return self.rows


# Kernel names by what they do, for --profile-frames' summary (the first
# kind whose word a name holds).
KERNEL_KINDS = (("attention", ("fmha", "flash", "attention", "attn", "sdpa")),
                ("copy", ("cat", "copy", "memcpy", "memset")),
                ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "wgmma")))


def kernel_kind(name):
    low = name.lower()
    for kind, words in KERNEL_KINDS:
        if any(w in low for w in words):
            return kind
    return "other"


def kernel_summary(kernels, steps, top=12, wall_s=None):
    """Lines summing device time by kind of kernel, per step (and the
    steps' wall time, when given), then the `top` kernels; kernels: (name,
    total microseconds) pairs."""
    by_kind = {}
    for name, us in kernels:
        kind = kernel_kind(name)
        by_kind[kind] = by_kind.get(kind, 0.0) + us
    total = sum(by_kind.values())
    lines = ["device time per step over %d steps: %.3f ms (%s)"
             % (steps, total / 1e3 / steps, ", ".join(
                 "%s %.3f" % (k, v / 1e3 / steps) for k, v in sorted(by_kind.items(),
                                                                    key=lambda kv: -kv[1])))]
    if wall_s is not None:
        lines.append("wall time per step over the same steps: %.3f ms" % (wall_s * 1e3 / steps))
    for name, us in sorted(kernels, key=lambda kv: -kv[1])[:top]:
        lines.append("  %9.3f ms/step  %-9s %s" % (us / 1e3 / steps, kernel_kind(name), name[:110]))
    return lines


class StepProfiler:
    """--profile-frames A:B: the device's kernels over steps A to B-1 of a
    run (torch.profiler, CUDA activity only), summed by kind (attention,
    copies, matmuls, other) and printed per step to stderr with the steps'
    wall time, so that two caches' runs show where their steps differ, and
    a wall time well above the device's shows steps waiting for the host
    (a kernel's plan being built, say). The profiled steps run a little
    slower; their run's time is not comparable to others."""

    def __init__(self, first, last, device):
        self.first, self.last, self.steps, self.prof = first, last, 0, None
        self.on_gpu = torch.device(device).type == "cuda"
        self.device = device

    def __call__(self, batch):
        self.steps += 1
        if not self.on_gpu:
            return
        if self.steps == self.first:
            from torch.profiler import ProfilerActivity, profile
            synchronize(self.device)
            self.prof = profile(activities=[ProfilerActivity.CUDA])
            self.prof.__enter__()
            self.started = time.perf_counter()
        elif self.steps == self.last and self.prof is not None:
            synchronize(self.device)
            wall_s = time.perf_counter() - self.started
            self.prof.__exit__(None, None, None)
            kernels = []
            for e in self.prof.key_averages():
                us = getattr(e, "self_device_time_total", None)
                if us is None:
                    us = getattr(e, "self_cuda_time_total", 0)
                if us > 0:
                    kernels.append((e.key, us))
            for line in kernel_summary(kernels, self.last - self.first, wall_s=wall_s):
                print("stream_gct: %s" % line, file=sys.stderr, flush=True)
            self.prof = None


def each(*callbacks):
    """One on_step callback calling those given (None ones left out)."""
    callbacks = [c for c in callbacks if c is not None]
    if not callbacks:
        return None
    return lambda batch: [c(batch) for c in callbacks]


def run_frames(model, frames, args, frame_rows):
    """One row of the sweep: a fresh state, `frames` frames, timed."""
    device = args.device
    generator = torch.Generator(device=device).manual_seed(args.seed + 1)
    row = {"frames": frames, "status": "ok", "seconds": "", "peak_allocated_gib": "",
           "peak_reserved_gib": "", "error": ""}
    state = None
    try:
        state = StreamState(model.shape, device, frames, args.growable, args.map_ahead_frames,
                            args.kv_dtype)
        log = FrameLog(device, frames, state) if args.per_frame_csv else None
        profiler = (StepProfiler(*args.profile_frames, device=device)
                    if args.profile_frames else None)
        synchronize(device)
        start = time.perf_counter()
        stream(model, state, frames, device, generator, args.compile, each(log, profiler))
        synchronize(device)
        row["seconds"] = "%.3f" % (time.perf_counter() - start)
        if log:
            frame_rows.extend(log.finish())
    except Exception as e:  # noqa: BLE001: only out-of-memory is a result, the rest re-raised
        if not is_out_of_memory(e):
            raise
        row["status"] = "oom"
        row["error"] = " ".join(str(e).split())[:300]
    finally:
        if torch.device(device).type == "cuda":
            row["peak_allocated_gib"] = "%.3f" % (torch.cuda.max_memory_allocated(device) / GiB)
            row["peak_reserved_gib"] = "%.3f" % (torch.cuda.max_memory_reserved(device) / GiB)
        if state is not None:
            state.close()
        del state
        release(device)
    return row


def write_csv(path, columns, rows):
    """Write all rows so far (the file always holds whole rows)."""
    if not path:
        return
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def warm_up(model, args):
    """Untimed: the scale batch and a couple of frames (kernels, cuBLAS,
    compilation happen here), twice with --compile so that the CUDA graphs
    of both step shapes are recorded before the timed loop."""
    frames = args.warmup_frames
    for _ in range(2 if args.compile else 1):
        if frames <= 0:
            return
        state = StreamState(model.shape, args.device, frames, args.growable, args.map_ahead_frames,
                            args.kv_dtype)
        generator = torch.Generator(device=args.device).manual_seed(args.seed)
        try:
            stream(model, state, frames, args.device, generator, args.compile)
            synchronize(args.device)
        finally:
            state.close()
            release(args.device)


def report_tidalloc(device):
    """Under tidalloc, on stderr: the driver's work over the whole process
    and, with the shim, how often PyTorch called its graph-pool methods
    (cudagraph trees' checkpoints and live-allocation checks cost there)."""
    if allocator_backend(device) != "tidalloc":
        return
    import tidalloc
    st = tidalloc.stats(device_index(device))
    print("stream_gct: tidalloc: %d mappings, %d unmappings, %.1f ms in mapping calls, %d stream "
          "waits, %d device queries in %.1f ms"
          % (st.mappings, st.unmappings, st.mapping_ns / 1e6, st.stream_waits, st.device_queries,
             st.device_query_ns / 1e6),
          file=sys.stderr)
    from tidalloc import shim
    calls = {k: v for k, v in shim.counts().items() if v}
    if calls:
        print("stream_gct: tidalloc shim calls: %s" % ", ".join(
            "%s %d" % kv for kv in sorted(calls.items())), file=sys.stderr)


def trace_capacity():
    """The trace ring's size under tidalloc (0 when tracing is off)."""
    from tidalloc import _lib
    value = _lib.conf_option("trace")[0]
    try:
        return int(float(value))
    except ValueError:
        return 0


def check_environment(args):
    """Refuse combinations that cannot work, before building anything."""
    on_gpu = torch.device(args.device).type == "cuda"
    if on_gpu and not torch.cuda.is_available():
        sys.exit("stream_gct: no CUDA device (torch.cuda.is_available() is False); "
                 "use --device cpu --tiny")
    if args.trace_csv:
        if allocator_backend(args.device) != "tidalloc":
            sys.exit("stream_gct: --trace-csv needs tidalloc as the allocator "
                     "(python -m tidalloc run bench/torch/stream_gct.py ...)")
        if trace_capacity() <= 0:
            sys.exit("stream_gct: --trace-csv needs tidalloc's trace ring, "
                     "e.g. TIDALLOC_CONF=trace:8000000")
    if args.growable:
        from tidalloc import _lib
        backend = _lib.backend(device_index(args.device))
        if backend != ("cuda" if on_gpu else "host"):
            sys.exit("stream_gct: --growable on %s needs tidalloc's %s backend (it has %s)%s"
                     % (args.device, "cuda" if on_gpu else "host", backend,
                        "" if on_gpu else "; set TIDALLOC_CONF=backend:host"))
    if args.compile and not on_gpu:
        print("stream_gct: --compile off a GPU compiles without CUDA graphs", file=sys.stderr)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frame-counts", type=int, nargs="+", default=list(DEFAULT_SWEEP),
                   metavar="N",
                   help="frames per run (default: %s)" % " ".join(map(str, DEFAULT_SWEEP)))
    p.add_argument("--stop-on-oom", action="store_true", help="end the sweep at the first oom")
    p.add_argument("--csv", help="one row per frame count, rewritten after each row")
    p.add_argument("--per-frame-csv", help="one row per step (timed by CUDA events, no "
                   "synchronization in the loop): " + ",".join(FRAME_COLUMNS))
    p.add_argument("--trace-csv", help="under tidalloc, every allocation and free of the "
                   "process for `tidalloc replay` (gzip'd CSV; needs TIDALLOC_CONF=trace:N)")
    p.add_argument("--growable", action="store_true",
                   help="KV and camera caches in tidalloc.kv.KVCache instead of torch.cat")
    p.add_argument("--map-ahead-frames", type=int, default=1, metavar="N",
                   help="with --growable, the rows of N frames each KV cache keeps mapped ahead, "
                   "mapped by a worker thread of its own (default 1; 0: none, each append maps "
                   "what it needs)")
    p.add_argument("--kv-dtype", choices=("attention", "appended"), default="attention",
                   help="with --growable, what the KV caches store K as: the compute dtype the "
                   "attention reads (default), or fp32 as it comes")
    p.add_argument("--compile", action="store_true",
                   help='hot modules under torch.compile(mode="reduce-overhead")')
    p.add_argument("--sdpa", choices=SDPA_KERNELS, default="default",
                   help="hold the bf16 attention (encoder, frame and global blocks) to one "
                   "kernel (default: PyTorch's choice; cuDNN's builds a plan for every new "
                   "cache length)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true",
                   help="a reduced model (2+4+4 blocks, width 64, 56x70 image, window 2+4)")
    p.add_argument("--height", type=int, help="requested image height (default 378)")
    p.add_argument("--width", type=int, help="requested image width (default 518)")
    p.add_argument("--scale-frames", type=int, help="frames of the first batch, never evicted")
    p.add_argument("--window", type=int, help="most recent frames the KV cache keeps")
    p.add_argument("--warmup-frames", type=int, help="untimed frames before the sweep "
                   "(default: the scale frames and 2 more; 0: none)")
    p.add_argument("--profile-frames", metavar="A:B",
                   help="the device's kernels over steps A to B-1 of each run, by kind, on "
                   "stderr (those runs' times are perturbed)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.profile_frames:
        try:
            first, last = (int(x) for x in args.profile_frames.split(":"))
        except ValueError:
            p.error("--profile-frames takes A:B, two step numbers")
        if not 1 <= first < last:
            p.error("--profile-frames A:B needs 1 <= A < B")
        args.profile_frames = (first, last)
    if any(n < 1 for n in args.frame_counts):
        p.error("--frame-counts must be positive")
    if args.map_ahead_frames < 0:
        p.error("--map-ahead-frames must be 0 or more")
    return args


def print_row(row):
    print("%6s frames  %-3s  %8s s  peak allocated %s GiB  reserved %s GiB  %s"
          % (row["frames"], row["status"], row["seconds"] or "-",
             row["peak_allocated_gib"] or "-", row["peak_reserved_gib"] or "-", row["error"]),
          flush=True)


def main(argv=None):
    args = parse_args(argv)
    shape = make_shape(args.tiny, height=args.height, width=args.width,
                       scale_frames=args.scale_frames, window=args.window)
    if args.warmup_frames is None:
        args.warmup_frames = shape.scale_frames + 2
    check_environment(args)
    set_attention_kernel(args.sdpa)
    if torch.device(args.device).type == "cuda":
        torch.cuda.set_device(device_index(args.device))
    model = build_model(shape, args.device, args.seed, args.compile)
    warm_up(model, args)
    backend = allocator_backend(args.device)
    eff_h, eff_w = shape.effective()
    rows, frame_rows = [], []
    for frames in args.frame_counts:
        if torch.device(args.device).type == "cuda":
            torch.cuda.reset_peak_memory_stats(args.device)
        row = run_frames(model, frames, args, frame_rows)
        row.update(requested_height=shape.height, requested_width=shape.width,
                   effective_height=eff_h, effective_width=eff_w, backend=backend,
                   dtype=str(COMPUTE_DTYPE).replace("torch.", ""))
        rows.append(row)
        write_csv(args.csv, CSV_COLUMNS, rows)
        write_csv(args.per_frame_csv, FRAME_COLUMNS, frame_rows)
        print_row(row)
        if row["status"] == "oom" and args.stop_on_oom:
            break
    report_tidalloc(args.device)
    if args.compile and torch.device(args.device).type == "cuda":
        from tidalloc.viz import pool_breakdown
        print("stream_gct: at the end, by pool: %s" % pool_breakdown(torch), file=sys.stderr)
    if args.trace_csv:
        from tidalloc import viz
        n = viz.write_replay_trace(args.trace_csv, device_index(args.device),
                                   cap=trace_capacity() + 1)
        print("stream_gct: %d allocations and frees written to %s" % (n, args.trace_csv))
    return 0  # an oom is a result (its row says so), not a failure


# ---------------------------------------------------------------------------
# For tests/torch/validate.py --serve (paired timing)
# ---------------------------------------------------------------------------

def paired_runner(device, frames, growable=False, tiny=False, seed=0, compiled=False,
                  kv_dtype="attention", sdpa="default"):
    """A function run(digest, frames=frames) that streams `frames` frames
    through one model built here, with fresh caches every call, and adds the
    outputs (every pose, the last depth and confidence) to `digest`. compiled: the hot
    modules under torch.compile(mode="reduce-overhead"), as --compile;
    kv_dtype as --kv-dtype, sdpa as --sdpa.
    run.segments(digest, every, frames=frames) is the same run as a
    generator that pauses after each `every` frames (at the first step
    boundary past them), so that a pairing can interleave two processes'
    runs segment by segment; the outputs go to `digest` in its last one."""
    shape = make_shape(tiny)
    set_attention_kernel(sdpa)
    model = build_model(shape, device, seed, compile_hot=compiled)

    def segments(digest, every, frames=frames):
        if every < 1:
            raise ValueError("segments of %d frames" % every)
        generator = torch.Generator(device=device).manual_seed(seed + 1)
        state = StreamState(shape, device, frames, growable, kv_dtype=kv_dtype)
        try:
            done, since = 0, 0
            for batch in stream_steps(model, state, frames, device, generator, compiled):
                done, since = done + batch, since + batch
                if since >= every and done < frames:
                    since = 0
                    yield done
            depth, confidence, _ = state.outputs[-1]
            poses = torch.cat([o[2] for o in state.outputs])
            for t in (poses, depth, confidence):
                digest.update(t.float().cpu().numpy().tobytes())
        finally:
            state.close()

    def run(digest, frames=frames):
        for _ in segments(digest, frames, frames):
            pass
    run.segments = segments
    return run


if __name__ == "__main__":
    sys.exit(main())
