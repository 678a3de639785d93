/* stream_model.c: the allocation sequence of streaming reconstruction
 * (LingBot-Map, SDPA path, 518 wide x 378 high, patch 14, bf16 autocast).
 *
 * Shapes. 37 x 27 = 999 patches; with 6 special tokens (camera, 4 registers,
 * scale) a frame is T = 1005 tokens. Width 1024, 16 heads of 64.
 *
 * Where the description leaves a choice, the model takes the VGGT-style one:
 * the frame is 518 wide (37 patches) and 378 high (27); aggregator blocks
 * normalize and rotate q and k in fp32; the outputs of all 24 layer pairs
 * are kept until the heads are done; every frame is a keyframe; the heads
 * run on the scale frames as one batch like the rest of the network.
 *
 * Weights (fp32, one tensor per parameter, allocated at load and kept):
 *   encoder ViT-L/14 (24 blocks, MLP 4096, pos-embed 1370)    304.4 M params
 *   aggregator, 24 frame + 24 global blocks (qk-norm)         604.7 M
 *   camera head (trunk of 4 blocks of width 2048, adaLN)      216.2 M
 *   DPT depth head (features 256, out channels 256..1024)      33.8 M
 *   together 1159.1 M params = 4.318 GiB.
 *
 * KV cache, per global layer and frame: K = 16 x 1005 x 64 fp32 = 4,116,480 B,
 * V in bf16 = 2,058,240 B; 6,174,720 B per layer, 148,193,280 B = 0.1380 GiB
 * per frame over the 24 layers. The cache keeps at most 8 + 64 = 72 frames:
 * 64 frames hold 8.83 GiB, the full window 9.94 GiB. Each evicted frame adds
 * its 6 special tokens to the special cache: 6 x 6144 B x 24 layers =
 * 0.00082 GiB per evicted frame (0.36 GiB after 512 frames, 440 evicted).
 * Per frame the model also keeps depth + confidence (2 x 518 x 378 fp32 =
 * 1.49 MiB) and a pose (36 B), and grows the camera head's cache by
 * 16 x 128 x 4 B for K and for V in each of its 4 blocks x 4 iterations
 * (256 KiB per keyframe).
 *
 * The peak falls in the last frame's last global layer: every cache full,
 * plus that layer's attention transients (a clone of K and V, their
 * concatenation after the special cache, autocast's bf16 copy of that K:
 * 7 x 2.06 MB per frame held, 0.86 GiB at 64 frames, 0.99 GiB at the full
 * window with 440 frames' special tokens), plus the frame's activations
 * (the 24 aggregator outputs kept for the heads, 24 x 1005 x 2048 fp32 =
 * 0.18 GiB, and a block's buffers: 0.19 GiB together).
 *
 *   at the peak, GiB          64 frames   512 frames
 *   itemised weights             4.32        4.32
 *   KV cache, 24 layers          8.83        9.94
 *   special cache                0           0.36
 *   attention transients         0.86        0.99
 *   activations                  0.19        0.19
 *   outputs kept                 0.09        0.75
 *   camera head cache            0.02        0.12
 *   sum                         14.31       16.67
 *   measured (table of the workload, allocated)  15.41-15.45  17.48-17.53
 *
 * Calibration. The itemised sum falls short of the measurement by 1.1 GiB at
 * 64 frames and 0.85 GiB at 512: memory the public description of the model
 * does not itemise. The model loads it with the weights, as 21 more blocks of
 * the aggregator's shape (264.6 M params, 0.986 GiB), which puts the weights
 * at 5.30 GiB and the peaks of an exact allocator (the counting fake of the
 * tests) at 15.29 GiB for 64 frames (-1.0%) and 17.65 GiB for 512 (+0.7%).
 * The rest of the sweep: 128 frames 16.66, 256 16.99, 1024 18.97, 2048
 * 21.60, 4096 26.87, 10000 42.06 GiB (past the window the peak grows by
 * 2.6 MB a frame: outputs, special tokens, the camera cache). */
#include "stream_model.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------- */
/* Shapes                                                                   */
/* ---------------------------------------------------------------------- */

enum {
  IMG_H = 378,
  IMG_W = 518,
  PATCH = 14,
  GRID_H = IMG_H / PATCH,    /* 27 */
  GRID_W = IMG_W / PATCH,    /* 37 */
  PATCHES = GRID_H * GRID_W, /* 999 */
  SPECIAL = 6,
  TOKENS = PATCHES + SPECIAL, /* 1005, the aggregator's tokens per frame */
  ENC_TOKENS = PATCHES + 5,   /* 1004: class token, 4 registers, patches */
  WIDTH = 1024,
  MLP = 4096,
  HEADS = 16,
  HEAD_DIM = 64,
  ENC_BLOCKS = 24,
  LAYERS = 24,         /* frame blocks, and global blocks */
  HEAD_IN = 2 * WIDTH, /* the heads read frame and global outputs side by side */
  CAM_BLOCKS = 4,
  CAM_ITERS = 4,
  CAM_CACHES = CAM_BLOCKS * CAM_ITERS,
  CAM_HEAD_DIM = 128,
  POSE = 9,
  DPT_FEATURES = 256,
  DPT_LEVELS = 4,
  F32 = 4,
  BF16 = 2
};

static const int dpt_layers[DPT_LEVELS] = {4, 11, 17, 23};
static const int dpt_channels[DPT_LEVELS] = {256, 512, 1024, 1024};
/* Feature map sizes after the DPT's resize layers: x4, x2, x1, /2 (ceil). */
static const int dpt_h[DPT_LEVELS] = {GRID_H * 4, GRID_H * 2, GRID_H, (GRID_H + 1) / 2};
static const int dpt_w[DPT_LEVELS] = {GRID_W * 4, GRID_W * 2, GRID_W, (GRID_W + 1) / 2};

#define K_FRAME_BYTES ((size_t)HEADS * TOKENS * HEAD_DIM * F32)
#define V_FRAME_BYTES ((size_t)HEADS * TOKENS * HEAD_DIM * BF16)
#define K_TOKEN_BYTES ((size_t)HEADS * HEAD_DIM * F32)
#define V_TOKEN_BYTES ((size_t)HEADS * HEAD_DIM * BF16)
#define CAM_FRAME_BYTES ((size_t)HEADS * CAM_HEAD_DIM * F32)
#define IMAGE_BYTES ((size_t)IMG_H * IMG_W * F32)

size_t stream_model_k_frame_bytes(void) { return K_FRAME_BYTES; }
size_t stream_model_v_frame_bytes(void) { return V_FRAME_BYTES; }
size_t stream_model_k_token_bytes(void) { return K_TOKEN_BYTES; }
size_t stream_model_v_token_bytes(void) { return V_TOKEN_BYTES; }
int stream_model_special_tokens(void) { return SPECIAL; }
int stream_model_global_layers(void) { return LAYERS; }

void stream_model_default_params(stream_model_params *params, int frames) {
  params->frames = frames;
  params->scale_frames = 8;
  params->window = 64;
  params->keyframe_interval = 1;
  params->grow = 0;
}

const char *stream_model_status_text(stream_model_status status) {
  switch (status) {
  case STREAM_MODEL_OK: return "ok";
  case STREAM_MODEL_NO_MEMORY: return "out of memory";
  case STREAM_MODEL_COPY_FAILED: return "a copy failed";
  case STREAM_MODEL_BAD_PARAMS: return "bad parameters";
  case STREAM_MODEL_HOST_MEMORY: return "out of host memory for bookkeeping";
  }
  return "unknown status";
}

/* ---------------------------------------------------------------------- */
/* The model's state                                                      */
/* ---------------------------------------------------------------------- */

/* Every live buffer has a slot, so a run that stops half-way frees all it
 * holds: the model's functions refer to buffers by slot (-1: none). */
typedef struct live_buf {
  void *ptr; /* NULL: the slot is free */
  size_t bytes;
  void *growable; /* grow mode: the buffer's handle (ptr is its data) */
  int next_free;
} live_buf;

typedef struct slot_list {
  int *slots;
  int count;
  int cap;
} slot_list;

typedef struct model {
  const stream_model_params *params;
  const stream_model_ops *ops;
  stream_model_result *result;
  stream_model_status status;
  bool count_only;  /* weights are counted, not allocated */
  uint64_t counted; /* bytes counted in that mode */
  live_buf *bufs;
  int buf_count;
  int buf_cap;
  int free_head;
  slot_list weights;
  slot_list outputs;
  int kv_k[LAYERS], kv_v[LAYERS];
  int kv_frames[LAYERS];
  int kv_appended[LAYERS]; /* grow mode: frames ever appended (the ring's clock) */
  int special_k[LAYERS], special_v[LAYERS];
  int special_tokens[LAYERS];
  int cam_k[CAM_CACHES], cam_v[CAM_CACHES];
  int cam_frames[CAM_CACHES];
} model;

static int take_slot(model *m) {
  if (m->free_head >= 0) {
    int slot = m->free_head;
    m->free_head = m->bufs[slot].next_free;
    return slot;
  }
  if (m->buf_count == m->buf_cap) {
    int cap = m->buf_cap ? m->buf_cap * 2 : 1024;
    live_buf *bufs = realloc(m->bufs, (size_t)cap * sizeof *bufs);
    if (!bufs) return -1;
    m->bufs = bufs;
    m->buf_cap = cap;
  }
  return m->buf_count++;
}

static void give_slot(model *m, int slot) {
  m->bufs[slot].ptr = NULL;
  m->bufs[slot].bytes = 0;
  m->bufs[slot].growable = NULL;
  m->bufs[slot].next_free = m->free_head;
  m->free_head = slot;
}

static int buf_alloc(model *m, size_t bytes, stream_model_kind kind) {
  if (m->status != STREAM_MODEL_OK) return -1;
  int slot = take_slot(m);
  if (slot < 0) {
    m->status = STREAM_MODEL_HOST_MEMORY;
    return -1;
  }
  void *ptr = m->ops->alloc(m->ops->ctx, bytes, kind);
  if (!ptr) {
    give_slot(m, slot);
    m->status = STREAM_MODEL_NO_MEMORY;
    m->result->failed_bytes = bytes;
    m->result->failed_kind = kind;
    return -1;
  }
  m->bufs[slot].ptr = ptr;
  m->bufs[slot].bytes = bytes;
  m->bufs[slot].growable = NULL;
  stream_model_result *r = m->result;
  r->allocs++;
  r->live_bytes += bytes;
  if (r->live_bytes > r->peak_live_bytes) r->peak_live_bytes = r->live_bytes;
  return slot;
}

static void buf_free(model *m, int *slot) {
  if (*slot < 0) return;
  live_buf *b = &m->bufs[*slot];
  if (b->growable)
    m->ops->buf_destroy(m->ops->ctx, b->growable);
  else
    m->ops->free(m->ops->ctx, b->ptr, b->bytes);
  m->result->frees++;
  m->result->live_bytes -= b->bytes;
  give_slot(m, *slot);
  *slot = -1;
}

/* A growable buffer of length 0 (grow mode). */
static int buf_make(model *m, size_t capacity, stream_model_kind kind) {
  if (m->status != STREAM_MODEL_OK) return -1;
  int slot = take_slot(m);
  if (slot < 0) {
    m->status = STREAM_MODEL_HOST_MEMORY;
    return -1;
  }
  void *data = NULL;
  void *buf = m->ops->buf_create(m->ops->ctx, capacity, kind, &data);
  if (!buf) {
    give_slot(m, slot);
    m->status = STREAM_MODEL_NO_MEMORY;
    m->result->failed_bytes = capacity;
    m->result->failed_kind = kind;
    return -1;
  }
  m->bufs[slot].ptr = data;
  m->bufs[slot].bytes = 0;
  m->bufs[slot].growable = buf;
  m->result->allocs++;
  return slot;
}

static bool buf_resize(model *m, int slot, size_t bytes, stream_model_kind kind) {
  live_buf *b = &m->bufs[slot];
  if (m->ops->buf_resize(m->ops->ctx, b->growable, bytes) != 0) {
    m->status = STREAM_MODEL_NO_MEMORY;
    m->result->failed_bytes = bytes;
    m->result->failed_kind = kind;
    return false;
  }
  stream_model_result *r = m->result;
  r->live_bytes = r->live_bytes - b->bytes + bytes;
  if (r->live_bytes > r->peak_live_bytes) r->peak_live_bytes = r->live_bytes;
  b->bytes = bytes;
  return true;
}

static bool buf_copy(model *m, int dst, size_t dst_offset, int src, size_t src_offset,
                     size_t bytes) {
  if (bytes == 0) return true;
  const live_buf *d = &m->bufs[dst], *s = &m->bufs[src];
  /* A copy out of bounds is a bug of this model: stop rather than issue it. */
  if (dst_offset + bytes > d->bytes || src_offset + bytes > s->bytes ||
      m->ops->copy(m->ops->ctx, d->ptr, dst_offset, s->ptr, src_offset, bytes) != 0) {
    m->status = STREAM_MODEL_COPY_FAILED;
    return false;
  }
  m->result->copies++;
  m->result->copied_bytes += bytes;
  return true;
}

static bool list_push(model *m, slot_list *list, int slot) {
  if (list->count == list->cap) {
    int cap = list->cap ? list->cap * 2 : 256;
    int *slots = realloc(list->slots, (size_t)cap * sizeof *slots);
    if (!slots) {
      m->status = STREAM_MODEL_HOST_MEMORY;
      return false;
    }
    list->slots = slots;
    list->cap = cap;
  }
  list->slots[list->count++] = slot;
  return true;
}

/* Allocate into `var` or leave the calling function: the slot table frees
 * whatever the function had allocated. */
#define ALLOC(var, bytes, kind)                                                                    \
  do {                                                                                             \
    if (((var) = buf_alloc(m, (bytes), (kind))) < 0) return false;                                 \
  } while (0)
#define ACT STREAM_MODEL_ACTIVATION

/* ---------------------------------------------------------------------- */
/* Weights                                                                */
/* ---------------------------------------------------------------------- */

static bool param(model *m, size_t elements) {
  if (m->count_only) {
    m->counted += elements * F32;
    return true;
  }
  int slot;
  ALLOC(slot, elements * F32, STREAM_MODEL_WEIGHT);
  return list_push(m, &m->weights, slot);
}

/* A pre-norm transformer block: LayerNorms, qkv, projection, MLP, optional
 * qk-norm and layer scales, in the order PyTorch registers them. */
static bool block_params(model *m, size_t d, size_t mlp, size_t head_dim, bool qk_norm,
                         bool layer_scale) {
  bool ok = param(m, d) && param(m, d) && param(m, 3 * d * d) && param(m, 3 * d);
  if (ok && qk_norm)
    ok = param(m, head_dim) && param(m, head_dim) && param(m, head_dim) && param(m, head_dim);
  ok = ok && param(m, d * d) && param(m, d);
  if (ok && layer_scale) ok = param(m, d);
  ok = ok && param(m, d) && param(m, d) && param(m, mlp * d) && param(m, mlp) &&
       param(m, d * mlp) && param(m, d);
  if (ok && layer_scale) ok = param(m, d);
  return ok;
}

/* DINOv2 ViT-L/14 with 4 registers: position embedding for 37 x 37 + 1. */
static bool encoder_params(model *m) {
  if (!(param(m, WIDTH) && param(m, 4 * WIDTH) && param(m, WIDTH) &&
        param(m, (37 * 37 + 1) * WIDTH) && param(m, (size_t)WIDTH * 3 * PATCH * PATCH) &&
        param(m, WIDTH)))
    return false;
  for (int i = 0; i < ENC_BLOCKS; i++)
    if (!block_params(m, WIDTH, MLP, HEAD_DIM, false, true)) return false;
  return param(m, WIDTH) && param(m, WIDTH);
}

/* Camera, register and scale tokens (one set for the first frame, one for
 * the rest), then frame and global blocks interleaved. */
static bool aggregator_params(model *m) {
  if (!(param(m, 2 * WIDTH) && param(m, 2 * 4 * WIDTH) && param(m, 2 * WIDTH))) return false;
  for (int i = 0; i < 2 * LAYERS; i++)
    if (!block_params(m, WIDTH, MLP, HEAD_DIM, true, true)) return false;
  return true;
}

static bool camera_head_params(model *m) {
  if (!(param(m, HEAD_IN) && param(m, HEAD_IN) && param(m, HEAD_IN) && param(m, HEAD_IN) &&
        param(m, (size_t)HEAD_IN * POSE) && param(m, HEAD_IN) &&
        param(m, (size_t)3 * HEAD_IN * HEAD_IN) && param(m, 3 * HEAD_IN)))
    return false;
  for (int i = 0; i < CAM_BLOCKS; i++)
    if (!block_params(m, HEAD_IN, 4 * HEAD_IN, CAM_HEAD_DIM, false, true)) return false;
  return param(m, (size_t)WIDTH * HEAD_IN) && param(m, WIDTH) && param(m, (size_t)POSE * WIDTH) &&
         param(m, POSE);
}

static bool conv_params(model *m, size_t out, size_t in, size_t k, bool bias) {
  return param(m, out * in * k * k) && (!bias || param(m, out));
}

static bool dpt_head_params(model *m) {
  const size_t f = DPT_FEATURES;
  bool ok = param(m, HEAD_IN) && param(m, HEAD_IN);
  for (int l = 0; ok && l < DPT_LEVELS; l++) ok = conv_params(m, dpt_channels[l], HEAD_IN, 1, true);
  ok = ok && conv_params(m, 256, 256, 4, true) && conv_params(m, 512, 512, 2, true) &&
       conv_params(m, 1024, 1024, 3, true);
  for (int l = 0; ok && l < DPT_LEVELS; l++) ok = conv_params(m, f, dpt_channels[l], 3, false);
  for (int l = 0; ok && l < DPT_LEVELS; l++) {
    ok = conv_params(m, f, f, 1, true);
    for (int c = 0; ok && c < 4; c++) ok = conv_params(m, f, f, 3, true);
  }
  return ok && conv_params(m, f / 2, f, 3, true) && conv_params(m, 32, f / 2, 3, true) &&
         conv_params(m, 2, 32, 1, true);
}

/* The calibration term (see the top of the file): resident memory the
 * itemised modules do not account for, loaded as blocks of the aggregator's
 * shape so that its tensor sizes mix like the rest. */
enum { UNITEMISED_BLOCKS = 21 };

static bool unitemised_params(model *m) {
  for (int i = 0; i < UNITEMISED_BLOCKS; i++)
    if (!block_params(m, WIDTH, MLP, HEAD_DIM, true, true)) return false;
  return true;
}

static bool load_weights(model *m) {
  return encoder_params(m) && aggregator_params(m) && camera_head_params(m) && dpt_head_params(m) &&
         unitemised_params(m);
}

uint64_t stream_model_weight_bytes(void) {
  model m;
  memset(&m, 0, sizeof m);
  m.count_only = true;
  load_weights(&m);
  return m.counted;
}

/* ---------------------------------------------------------------------- */
/* Caches grown by concatenation                                          */
/* ---------------------------------------------------------------------- */

/* torch.cat((cache, new)): a buffer of old + added bytes, the old contents
 * and the new part copied in, the old buffer freed. */
static bool cat_grow(model *m, int *cache, size_t old_bytes, int src, size_t src_offset,
                     size_t add_bytes, stream_model_kind kind) {
  int grown;
  ALLOC(grown, old_bytes + add_bytes, kind);
  if (*cache >= 0 && !buf_copy(m, grown, 0, *cache, 0, old_bytes)) return false;
  if (!buf_copy(m, grown, old_bytes, src, src_offset, add_bytes)) return false;
  buf_free(m, cache);
  *cache = grown;
  return true;
}

/* Grow mode: append in place to a growable buffer of `capacity` bytes. */
static bool grow_append(model *m, int *cache, size_t capacity, size_t old_bytes, int src,
                        size_t src_offset, size_t add_bytes, stream_model_kind kind) {
  if (*cache < 0 && (*cache = buf_make(m, capacity, kind)) < 0) return false;
  return buf_resize(m, *cache, old_bytes + add_bytes, kind) &&
         buf_copy(m, *cache, old_bytes, src, src_offset, add_bytes);
}

/* Append to a cache: by concatenation, or in place in grow mode. */
static bool cache_append(model *m, int *cache, size_t capacity, size_t old_bytes, int src,
                         size_t src_offset, size_t add_bytes, stream_model_kind kind) {
  if (m->params->grow)
    return grow_append(m, cache, capacity, old_bytes, src, src_offset, add_bytes, kind);
  return cat_grow(m, cache, old_bytes, src, src_offset, add_bytes, kind);
}

/* Append the special tokens of `count` frames, from frame `first` of
 * `cache`, to a special cache of `tokens` tokens. */
static bool special_grow(model *m, int *special, int tokens, int cache, size_t frame_bytes,
                         size_t token_bytes, int first, int count, stream_model_kind kind) {
  size_t old_bytes = (size_t)tokens * token_bytes, per_frame = SPECIAL * token_bytes;
  int grown;
  ALLOC(grown, old_bytes + (size_t)count * per_frame, kind);
  if (*special >= 0 && !buf_copy(m, grown, 0, *special, 0, old_bytes)) return false;
  for (int i = 0; i < count; i++)
    if (!buf_copy(m, grown, old_bytes + (size_t)i * per_frame, cache,
                  (size_t)(first + i) * frame_bytes, per_frame))
      return false;
  buf_free(m, special);
  *special = grown;
  return true;
}

/* Rebuild a cache of `frames` frames as its first `head` and last `tail`. */
static bool window_rebuild(model *m, int *cache, size_t frame_bytes, int frames, int head, int tail,
                           stream_model_kind kind) {
  int kept;
  ALLOC(kept, (size_t)(head + tail) * frame_bytes, kind);
  if (!buf_copy(m, kept, 0, *cache, 0, (size_t)head * frame_bytes) ||
      !buf_copy(m, kept, (size_t)head * frame_bytes, *cache, (size_t)(frames - tail) * frame_bytes,
                (size_t)tail * frame_bytes))
    return false;
  buf_free(m, cache);
  *cache = kept;
  return true;
}

/* Grow mode: the layer's cache is [scale frames][a ring of `window` frame
 * slots] in one growable buffer per K and V. A frame past the window takes
 * the slot of the frame it evicts, whose special tokens are appended to the
 * special buffer first: no rebuild, no copy of the frames kept. */
static bool kv_append_grow(model *m, int layer, int k_new, int v_new, int added) {
  const int head = m->params->scale_frames, tail = m->params->window;
  const size_t frames_cap = (size_t)(head + tail);
  const size_t special_cap = (size_t)m->params->frames * SPECIAL;
  for (int i = 0; i < added; i++) {
    int n = m->kv_frames[layer], f = m->kv_appended[layer];
    int slot = n;
    if (n < head + tail) {
      if ((m->kv_k[layer] < 0 &&
           (m->kv_k[layer] = buf_make(m, frames_cap * K_FRAME_BYTES, STREAM_MODEL_KV_K)) < 0) ||
          (m->kv_v[layer] < 0 &&
           (m->kv_v[layer] = buf_make(m, frames_cap * V_FRAME_BYTES, STREAM_MODEL_KV_V)) < 0) ||
          !buf_resize(m, m->kv_k[layer], (size_t)(n + 1) * K_FRAME_BYTES, STREAM_MODEL_KV_K) ||
          !buf_resize(m, m->kv_v[layer], (size_t)(n + 1) * V_FRAME_BYTES, STREAM_MODEL_KV_V))
        return false;
      m->kv_frames[layer] = n + 1;
    } else {
      slot = head + (f - head) % tail;
      size_t tokens = (size_t)m->special_tokens[layer], per = SPECIAL;
      if (!grow_append(m, &m->special_k[layer], special_cap * K_TOKEN_BYTES, tokens * K_TOKEN_BYTES,
                       m->kv_k[layer], (size_t)slot * K_FRAME_BYTES, per * K_TOKEN_BYTES,
                       STREAM_MODEL_SPECIAL_K) ||
          !grow_append(m, &m->special_v[layer], special_cap * V_TOKEN_BYTES, tokens * V_TOKEN_BYTES,
                       m->kv_v[layer], (size_t)slot * V_FRAME_BYTES, per * V_TOKEN_BYTES,
                       STREAM_MODEL_SPECIAL_V))
        return false;
      m->special_tokens[layer] += SPECIAL;
    }
    if (!buf_copy(m, m->kv_k[layer], (size_t)slot * K_FRAME_BYTES, k_new, (size_t)i * K_FRAME_BYTES,
                  K_FRAME_BYTES) ||
        !buf_copy(m, m->kv_v[layer], (size_t)slot * V_FRAME_BYTES, v_new, (size_t)i * V_FRAME_BYTES,
                  V_FRAME_BYTES))
      return false;
    m->kv_appended[layer] = f + 1;
  }
  return true;
}

/* Append `added` frames of K and V to a global layer's cache; past the
 * window, move the evicted frames' special tokens to the special cache and
 * rebuild the cache as [scale frames] + [last window frames]. */
static bool kv_append(model *m, int layer, int k_new, int v_new, int added) {
  if (m->params->grow) return kv_append_grow(m, layer, k_new, v_new, added);
  int n = m->kv_frames[layer];
  if (!cat_grow(m, &m->kv_k[layer], (size_t)n * K_FRAME_BYTES, k_new, 0,
                (size_t)added * K_FRAME_BYTES, STREAM_MODEL_KV_K) ||
      !cat_grow(m, &m->kv_v[layer], (size_t)n * V_FRAME_BYTES, v_new, 0,
                (size_t)added * V_FRAME_BYTES, STREAM_MODEL_KV_V))
    return false;
  n += added;
  m->kv_frames[layer] = n;
  int head = m->params->scale_frames, tail = m->params->window;
  if (n <= head + tail) return true;
  int evicted = n - head - tail;
  int tokens = m->special_tokens[layer];
  if (!special_grow(m, &m->special_k[layer], tokens, m->kv_k[layer], K_FRAME_BYTES, K_TOKEN_BYTES,
                    head, evicted, STREAM_MODEL_SPECIAL_K) ||
      !special_grow(m, &m->special_v[layer], tokens, m->kv_v[layer], V_FRAME_BYTES, V_TOKEN_BYTES,
                    head, evicted, STREAM_MODEL_SPECIAL_V))
    return false;
  m->special_tokens[layer] = tokens + evicted * SPECIAL;
  if (!window_rebuild(m, &m->kv_k[layer], K_FRAME_BYTES, n, head, tail, STREAM_MODEL_KV_K) ||
      !window_rebuild(m, &m->kv_v[layer], V_FRAME_BYTES, n, head, tail, STREAM_MODEL_KV_V))
    return false;
  m->kv_frames[layer] = head + tail;
  return true;
}

/* The global attention call: a clone of the cache and its concatenation
 * after the special cache, autocast's bf16 casts of q and of that K, then
 * SDPA's output (returned) and log-sum-exp. The transients are freed. */
static bool global_attention(model *m, int layer, size_t rows, int *att) {
  const stream_model_kind t = STREAM_MODEL_ATTN_TRANSIENT;
  size_t n = (size_t)m->kv_frames[layer], s = (size_t)m->special_tokens[layer];
  size_t k_bytes = s * K_TOKEN_BYTES + n * K_FRAME_BYTES;
  size_t v_bytes = s * V_TOKEN_BYTES + n * V_FRAME_BYTES;
  int clone_k = -1, clone_v = -1, cat_k = -1, cat_v = -1, q16, k16, lse;
  /* Grow mode: the kernel reads the caches where they are. */
  if (!m->params->grow) {
    ALLOC(clone_k, n * K_FRAME_BYTES, t);
    if (!buf_copy(m, clone_k, 0, m->kv_k[layer], 0, n * K_FRAME_BYTES)) return false;
    ALLOC(clone_v, n * V_FRAME_BYTES, t);
    if (!buf_copy(m, clone_v, 0, m->kv_v[layer], 0, n * V_FRAME_BYTES)) return false;
    ALLOC(cat_k, k_bytes, t);
    if ((s && !buf_copy(m, cat_k, 0, m->special_k[layer], 0, s * K_TOKEN_BYTES)) ||
        !buf_copy(m, cat_k, s * K_TOKEN_BYTES, clone_k, 0, n * K_FRAME_BYTES))
      return false;
    ALLOC(cat_v, v_bytes, t);
    if ((s && !buf_copy(m, cat_v, 0, m->special_v[layer], 0, s * V_TOKEN_BYTES)) ||
        !buf_copy(m, cat_v, s * V_TOKEN_BYTES, clone_v, 0, n * V_FRAME_BYTES))
      return false;
  }
  ALLOC(q16, rows * WIDTH * BF16, ACT);
  ALLOC(k16, k_bytes / 2, t);
  ALLOC(*att, rows * WIDTH * BF16, ACT);
  ALLOC(lse, HEADS * rows * F32, ACT);
  buf_free(m, &lse);
  buf_free(m, &k16);
  buf_free(m, &q16);
  buf_free(m, &cat_v);
  buf_free(m, &cat_k);
  buf_free(m, &clone_v);
  buf_free(m, &clone_k);
  return true;
}

/* ---------------------------------------------------------------------- */
/* Transformer blocks                                                     */
/* ---------------------------------------------------------------------- */

typedef enum block_type { ENCODER_BLOCK, FRAME_BLOCK, GLOBAL_BLOCK } block_type;

/* Attention of one block over `rows` tokens; returns its bf16 output.
 * Aggregator blocks normalize q and k (LayerNorm under autocast answers in
 * fp32, which is why the K cache is fp32) and rotate them. */
static bool block_attention(model *m, block_type type, int layer, int batch, size_t rows,
                            int *att) {
  const size_t f32 = rows * WIDTH * F32, bf16 = rows * WIDTH * BF16;
  int norm, qkv, q, k, v, qr, kr, lse, q16, k16;
  ALLOC(norm, f32, ACT);
  ALLOC(qkv, 3 * bf16, ACT);
  buf_free(m, &norm);
  if (type == ENCODER_BLOCK) {
    ALLOC(*att, bf16, ACT);
    ALLOC(lse, HEADS * rows * F32, ACT);
    buf_free(m, &lse);
    buf_free(m, &qkv);
    return true;
  }
  ALLOC(q, f32, ACT);
  ALLOC(k, f32, ACT);
  ALLOC(v, bf16, ACT);
  buf_free(m, &qkv);
  ALLOC(qr, f32, ACT);
  buf_free(m, &q);
  ALLOC(kr, f32, ACT);
  buf_free(m, &k);
  if (type == GLOBAL_BLOCK) {
    if (!kv_append(m, layer, kr, v, batch)) return false;
    buf_free(m, &kr);
    buf_free(m, &v);
    if (!global_attention(m, layer, rows, att)) return false;
  } else {
    ALLOC(q16, bf16, ACT);
    ALLOC(k16, bf16, ACT);
    ALLOC(*att, bf16, ACT);
    ALLOC(lse, HEADS * rows * F32, ACT);
    buf_free(m, &lse);
    buf_free(m, &k16);
    buf_free(m, &q16);
    buf_free(m, &kr);
    buf_free(m, &v);
  }
  buf_free(m, &qr);
  return true;
}

/* A pre-norm block: x + attn(norm(x)), then + mlp(norm(.)). The input stays
 * the caller's; the output is a new fp32 buffer. */
static bool vit_block(model *m, block_type type, int layer, int batch, size_t rows, int *out) {
  const size_t f32 = rows * WIDTH * F32, bf16 = rows * WIDTH * BF16;
  int att, proj, x1, norm, hidden, act, mlp;
  if (!block_attention(m, type, layer, batch, rows, &att)) return false;
  ALLOC(proj, bf16, ACT);
  buf_free(m, &att);
  ALLOC(x1, f32, ACT);
  buf_free(m, &proj);
  ALLOC(norm, f32, ACT);
  ALLOC(hidden, rows * MLP * BF16, ACT);
  buf_free(m, &norm);
  ALLOC(act, rows * MLP * BF16, ACT);
  buf_free(m, &hidden);
  ALLOC(mlp, bf16, ACT);
  buf_free(m, &act);
  ALLOC(*out, f32, ACT);
  buf_free(m, &mlp);
  buf_free(m, &x1);
  return true;
}

/* The ViT-L/14 encoder; returns the aggregator's input tokens. */
static bool run_encoder(model *m, int batch, int *tokens) {
  const size_t rows = (size_t)batch * ENC_TOKENS;
  int patches, pos, x, y, norm;
  ALLOC(patches, (size_t)batch * PATCHES * WIDTH * BF16, ACT);
  ALLOC(pos, (size_t)PATCHES * WIDTH * F32, ACT); /* interpolated position embedding */
  ALLOC(x, rows * WIDTH * F32, ACT);
  buf_free(m, &pos);
  buf_free(m, &patches);
  for (int i = 0; i < ENC_BLOCKS; i++) {
    if (!vit_block(m, ENCODER_BLOCK, i, batch, rows, &y)) return false;
    buf_free(m, &x);
    x = y;
  }
  ALLOC(norm, rows * WIDTH * F32, ACT);
  buf_free(m, &x);
  ALLOC(*tokens, (size_t)batch * TOKENS * WIDTH * F32, ACT); /* special tokens prepended */
  buf_free(m, &norm);
  return true;
}

/* Frame and global blocks in turn; the output of each pair, side by side,
 * is kept for the heads. Takes ownership of `tokens`. */
static bool run_aggregator(model *m, int batch, int tokens, int inter[LAYERS]) {
  const size_t rows = (size_t)batch * TOKENS;
  int x = tokens, f, g;
  for (int i = 0; i < LAYERS; i++) {
    if (!vit_block(m, FRAME_BLOCK, i, batch, rows, &f)) return false;
    buf_free(m, &x);
    if (!vit_block(m, GLOBAL_BLOCK, i, batch, rows, &g)) return false;
    ALLOC(inter[i], rows * HEAD_IN * F32, ACT);
    buf_free(m, &f);
    x = g;
  }
  buf_free(m, &x);
  return true;
}

/* ---------------------------------------------------------------------- */
/* Heads (fp32)                                                           */
/* ---------------------------------------------------------------------- */

/* One block of the camera trunk over one token per frame. Its K and V join
 * the block's cache on keyframes; otherwise they are concatenated to it for
 * this call only. */
/* Grow mode: a camera cache holds one entry per frame at most. */
static size_t cam_capacity(const model *m) { return (size_t)m->params->frames * CAM_FRAME_BYTES; }

static bool camera_block(model *m, int cache, int batch, bool keyframe, int *out) {
  const size_t row = (size_t)batch * HEAD_IN * F32, frame_kv = (size_t)batch * CAM_FRAME_BYTES;
  const size_t n = (size_t)m->cam_frames[cache] * CAM_FRAME_BYTES;
  int norm, qkv, tk = -1, tv = -1, att, proj, h1, hidden, act, mlp;
  ALLOC(norm, row, ACT);
  ALLOC(qkv, 3 * row, ACT);
  buf_free(m, &norm);
  if (keyframe) {
    if (!cache_append(m, &m->cam_k[cache], cam_capacity(m), n, qkv, row, frame_kv,
                      STREAM_MODEL_CAMERA_KV) ||
        !cache_append(m, &m->cam_v[cache], cam_capacity(m), n, qkv, 2 * row, frame_kv,
                      STREAM_MODEL_CAMERA_KV))
      return false;
    m->cam_frames[cache] += batch;
  } else {
    ALLOC(tk, n + frame_kv, STREAM_MODEL_ATTN_TRANSIENT);
    if (!buf_copy(m, tk, 0, m->cam_k[cache], 0, n) || !buf_copy(m, tk, n, qkv, row, frame_kv))
      return false;
    ALLOC(tv, n + frame_kv, STREAM_MODEL_ATTN_TRANSIENT);
    if (!buf_copy(m, tv, 0, m->cam_v[cache], 0, n) || !buf_copy(m, tv, n, qkv, 2 * row, frame_kv))
      return false;
  }
  ALLOC(att, row, ACT);
  buf_free(m, &tv);
  buf_free(m, &tk);
  buf_free(m, &qkv);
  ALLOC(proj, row, ACT);
  buf_free(m, &att);
  ALLOC(h1, row, ACT);
  buf_free(m, &proj);
  ALLOC(norm, row, ACT);
  ALLOC(hidden, 4 * row, ACT);
  buf_free(m, &norm);
  ALLOC(act, 4 * row, ACT);
  buf_free(m, &hidden);
  ALLOC(mlp, row, ACT);
  buf_free(m, &act);
  ALLOC(*out, row, ACT);
  buf_free(m, &mlp);
  buf_free(m, &h1);
  return true;
}

/* Iterative pose refinement: 4 iterations of an adaLN-modulated trunk of 4
 * blocks on the camera tokens of the last layer. Keeps the pose. */
static bool run_camera_head(model *m, int batch, bool keyframe) {
  const size_t row = (size_t)batch * HEAD_IN * F32, pose_bytes = (size_t)batch * POSE * F32;
  int tokens, pose, embed, mod, h, h2, hidden, delta, next, kept;
  ALLOC(tokens, row, ACT);
  ALLOC(pose, pose_bytes, ACT);
  for (int it = 0; it < CAM_ITERS; it++) {
    ALLOC(embed, row, ACT);
    ALLOC(mod, 3 * row, ACT);
    buf_free(m, &embed);
    ALLOC(h, row, ACT);
    buf_free(m, &mod);
    for (int b = 0; b < CAM_BLOCKS; b++) {
      if (!camera_block(m, it * CAM_BLOCKS + b, batch, keyframe, &h2)) return false;
      buf_free(m, &h);
      h = h2;
    }
    ALLOC(hidden, (size_t)batch * WIDTH * F32, ACT);
    ALLOC(delta, pose_bytes, ACT);
    buf_free(m, &hidden);
    ALLOC(next, pose_bytes, ACT);
    buf_free(m, &delta);
    buf_free(m, &pose);
    pose = next;
    buf_free(m, &h);
  }
  buf_free(m, &tokens);
  ALLOC(kept, pose_bytes, STREAM_MODEL_OUTPUT);
  buf_free(m, &pose);
  return list_push(m, &m->outputs, kept);
}

/* A residual conv unit of the DPT: relu, conv, relu, conv, add. */
static bool residual_unit(model *m, size_t bytes, int *out) {
  int a, b, c, d;
  ALLOC(a, bytes, ACT);
  ALLOC(b, bytes, ACT);
  buf_free(m, &a);
  ALLOC(c, bytes, ACT);
  buf_free(m, &b);
  ALLOC(d, bytes, ACT);
  buf_free(m, &c);
  ALLOC(*out, bytes, ACT);
  buf_free(m, &d);
  return true;
}

/* A DPT fusion block at feature level `level`: merge the coarser path (if
 * there is one), refine, upsample to `out_h` x `out_w`, project. */
static bool fusion_block(model *m, int batch, int level, bool has_path, int out_h, int out_w,
                         int *out) {
  const size_t per_pixel = (size_t)batch * DPT_FEATURES * F32;
  const size_t in_bytes = per_pixel * (size_t)dpt_h[level] * (size_t)dpt_w[level];
  const size_t out_bytes = per_pixel * (size_t)out_h * (size_t)out_w;
  int skip, merged = -1, refined, up;
  if (has_path) {
    if (!residual_unit(m, in_bytes, &skip)) return false;
    ALLOC(merged, in_bytes, ACT);
    buf_free(m, &skip);
  }
  if (!residual_unit(m, in_bytes, &refined)) return false;
  ALLOC(up, out_bytes, ACT);
  buf_free(m, &refined);
  ALLOC(*out, out_bytes, ACT);
  buf_free(m, &up);
  buf_free(m, &merged);
  return true;
}

/* The DPT depth head on four aggregator layers; keeps depth and confidence.
 * Its largest buffer is 128 channels at full resolution (100 MB a frame). */
static bool run_dpt_head(model *m, int batch, const int inter[LAYERS]) {
  const size_t b = (size_t)batch, image = b * IMAGE_BYTES;
  const int h0 = dpt_h[0] * 2, w0 = dpt_w[0] * 2;
  int feat[DPT_LEVELS], rn[DPT_LEVELS], norm, proj, path = -1, next, c1, up, c2, relu, c3, depth,
                                                    conf;
  for (int l = 0; l < DPT_LEVELS; l++) feat[l] = rn[l] = -1;
  for (int l = 0; l < DPT_LEVELS; l++) {
    const size_t c = (size_t)dpt_channels[l];
    if (inter[dpt_layers[l]] < 0) { /* the aggregator did not keep the layer read here */
      m->status = STREAM_MODEL_BAD_PARAMS;
      return false;
    }
    ALLOC(norm, b * PATCHES * HEAD_IN * F32, ACT); /* layer dpt_layers[l], patch tokens */
    ALLOC(proj, b * c * PATCHES * F32, ACT);
    buf_free(m, &norm);
    ALLOC(feat[l], b * c * (size_t)dpt_h[l] * (size_t)dpt_w[l] * F32, ACT);
    buf_free(m, &proj);
  }
  for (int l = 0; l < DPT_LEVELS; l++) {
    ALLOC(rn[l], b * DPT_FEATURES * (size_t)dpt_h[l] * (size_t)dpt_w[l] * F32, ACT);
    buf_free(m, &feat[l]);
  }
  for (int l = DPT_LEVELS - 1; l >= 0; l--) {
    int oh = l > 0 ? dpt_h[l - 1] : h0, ow = l > 0 ? dpt_w[l - 1] : w0;
    if (!fusion_block(m, batch, l, path >= 0, oh, ow, &next)) return false;
    buf_free(m, &path);
    path = next;
  }
  for (int l = 0; l < DPT_LEVELS; l++) buf_free(m, &rn[l]);
  ALLOC(c1, b * DPT_FEATURES / 2 * (size_t)h0 * (size_t)w0 * F32, ACT);
  buf_free(m, &path);
  ALLOC(up, 128 * image, ACT);
  buf_free(m, &c1);
  ALLOC(c2, 32 * image, ACT);
  buf_free(m, &up);
  ALLOC(relu, 32 * image, ACT);
  buf_free(m, &c2);
  ALLOC(c3, 2 * image, ACT);
  buf_free(m, &relu);
  ALLOC(depth, image, STREAM_MODEL_OUTPUT);
  ALLOC(conf, image, STREAM_MODEL_OUTPUT);
  buf_free(m, &c3);
  return list_push(m, &m->outputs, depth) && list_push(m, &m->outputs, conf);
}

/* ---------------------------------------------------------------------- */
/* The stream                                                             */
/* ---------------------------------------------------------------------- */

/* One step: `batch` frames from `first` through encoder, aggregator and
 * heads. */
static bool run_step(model *m, int first, int batch) {
  int inter[LAYERS], image, tokens;
  for (int i = 0; i < LAYERS; i++) inter[i] = -1;
  ALLOC(image, (size_t)batch * 3 * IMAGE_BYTES, ACT);
  if (!run_encoder(m, batch, &tokens) || !run_aggregator(m, batch, tokens, inter)) return false;
  bool keyframe = first % m->params->keyframe_interval == 0 || batch > 1;
  if (!run_camera_head(m, batch, keyframe) || !run_dpt_head(m, batch, inter)) return false;
  for (int i = 0; i < LAYERS; i++) buf_free(m, &inter[i]);
  buf_free(m, &image);
  return true;
}

/* Free what the run keeps (outputs, caches, weights), newest first, then any
 * buffer a stopped step left behind. */
static void release_all(model *m) {
  for (int i = m->outputs.count - 1; i >= 0; i--) buf_free(m, &m->outputs.slots[i]);
  for (int c = CAM_CACHES - 1; c >= 0; c--) {
    buf_free(m, &m->cam_v[c]);
    buf_free(m, &m->cam_k[c]);
  }
  for (int l = LAYERS - 1; l >= 0; l--) {
    buf_free(m, &m->special_v[l]);
    buf_free(m, &m->special_k[l]);
    buf_free(m, &m->kv_v[l]);
    buf_free(m, &m->kv_k[l]);
  }
  for (int i = m->weights.count - 1; i >= 0; i--) buf_free(m, &m->weights.slots[i]);
  for (int s = 0; s < m->buf_count; s++) {
    int slot = s;
    if (!m->bufs[s].ptr) continue;
    m->result->stray_buffers++;
    buf_free(m, &slot);
  }
  free(m->outputs.slots);
  free(m->weights.slots);
  free(m->bufs);
}

static bool params_valid(const stream_model_params *p, const stream_model_ops *ops) {
  return p && ops && ops->alloc && ops->free && ops->copy && p->frames > 0 && p->scale_frames > 0 &&
         p->window > 0 && p->keyframe_interval > 0 &&
         (!p->grow || (ops->buf_create && ops->buf_resize && ops->buf_destroy));
}

static void model_init(model *m, const stream_model_params *params, const stream_model_ops *ops,
                       stream_model_result *out) {
  memset(m, 0, sizeof *m);
  m->params = params;
  m->ops = ops;
  m->result = out;
  m->free_head = -1;
  for (int l = 0; l < LAYERS; l++) m->kv_k[l] = m->kv_v[l] = m->special_k[l] = m->special_v[l] = -1;
  for (int c = 0; c < CAM_CACHES; c++) m->cam_k[c] = m->cam_v[c] = -1;
}

stream_model_status stream_model_run(const stream_model_params *params, const stream_model_ops *ops,
                                     stream_model_result *out) {
  memset(out, 0, sizeof *out);
  if (!params_valid(params, ops)) return STREAM_MODEL_BAD_PARAMS;
  model m;
  model_init(&m, params, ops, out);
  bool ok = load_weights(&m);
  while (ok && out->frames_done < params->frames) {
    int left = params->frames - out->frames_done;
    int batch = out->frames_done == 0 && params->scale_frames < left ? params->scale_frames
                : out->frames_done == 0                              ? left
                                                                     : 1;
    ok = run_step(&m, out->frames_done, batch);
    if (ok) {
      out->frames_done += batch;
      if (ops->progress) ops->progress(ops->ctx, out->frames_done, params->frames);
    }
  }
  release_all(&m);
  if (m.status != STREAM_MODEL_OK) out->stray_buffers = 0; /* a stopped step leaves some */
  return m.status;
}
