/* stream_model.h: a synthetic model of a streaming reconstruction network's
 * memory traffic (LingBot-Map: a ViT-L/14 encoder, 24 frame and 24 global
 * aggregator blocks with a windowed KV cache, a camera head and a DPT depth
 * head). It computes nothing: it issues the allocations, frees and cache
 * copies that inference would, in the same order and sizes, through a small
 * interface, so that one model drives the host backend, the GPU (with real
 * copies) and a counting fake in the tests. The sequence is deterministic.
 * stream_model.c says how the sizes were derived and calibrated. */
#ifndef TIDE_STREAM_MODEL_H
#define TIDE_STREAM_MODEL_H

#include <stddef.h>
#include <stdint.h>

/* What a buffer holds: lets a backend name its buffers and tests follow one
 * kind (the K cache's sizes, say) through the sequence. */
typedef enum stream_model_kind {
  STREAM_MODEL_WEIGHT = 0,     /* parameters, allocated at load and kept */
  STREAM_MODEL_ACTIVATION,     /* per-frame activations, freed within the frame */
  STREAM_MODEL_KV_K,           /* a global layer's K cache (fp32) */
  STREAM_MODEL_KV_V,           /* a global layer's V cache (bf16) */
  STREAM_MODEL_SPECIAL_K,      /* special tokens of evicted frames, K (fp32) */
  STREAM_MODEL_SPECIAL_V,      /* the same, V (bf16) */
  STREAM_MODEL_ATTN_TRANSIENT, /* the clone and concatenation made for attention */
  STREAM_MODEL_CAMERA_KV,      /* the camera head's K or V cache */
  STREAM_MODEL_OUTPUT,         /* per-frame results kept to the end */
  STREAM_MODEL_KIND_COUNT
} stream_model_kind;

/* The memory a model runs on. `alloc` returns NULL when it cannot allocate
 * (the model then frees what it holds and stops). `copy` moves bytes between
 * two live buffers (a no-op where nothing is computed) and returns 0, or
 * nonzero to stop the run. `progress` may be NULL. Grow mode (params.grow)
 * also needs growable buffers: `buf_create` reserves `capacity` bytes at a
 * fixed address (length 0; NULL on failure, stored in *data), `buf_resize`
 * sets the length (0, or nonzero when out of memory), `buf_destroy` ends it. */
typedef struct stream_model_ops {
  void *ctx;
  void *(*alloc)(void *ctx, size_t bytes, stream_model_kind kind);
  void (*free)(void *ctx, void *buf, size_t bytes);
  int (*copy)(void *ctx, void *dst, size_t dst_offset, const void *src, size_t src_offset,
              size_t bytes);
  void (*progress)(void *ctx, int frames_done, int frames_total);
  void *(*buf_create)(void *ctx, size_t capacity, stream_model_kind kind, void **data);
  int (*buf_resize)(void *ctx, void *buf, size_t bytes);
  void (*buf_destroy)(void *ctx, void *buf);
} stream_model_ops;

typedef struct stream_model_params {
  int frames;            /* frames streamed in all, scale frames included */
  int scale_frames;      /* the first frames, run as one batch and never evicted: 8 */
  int window;            /* the most recent frames the KV cache keeps besides them: 64 */
  int keyframe_interval; /* the camera head's cache grows every this many frames: 1 */
  int grow;              /* 0: caches grow by torch.cat (allocate, copy, free); 1: in
                            place, in growable buffers (the window as a ring of frame
                            slots), attention reading them without clone or cat */
} stream_model_params;

typedef enum stream_model_status {
  STREAM_MODEL_OK = 0,
  STREAM_MODEL_NO_MEMORY = 1, /* alloc returned NULL */
  STREAM_MODEL_COPY_FAILED = 2,
  STREAM_MODEL_BAD_PARAMS = 3,
  STREAM_MODEL_HOST_MEMORY = 4 /* the model's own bookkeeping ran out of host memory */
} stream_model_status;

typedef struct stream_model_result {
  int frames_done; /* frames whose outputs were produced */
  uint64_t allocs; /* successful alloc calls */
  uint64_t frees;
  uint64_t copies;
  uint64_t copied_bytes;
  uint64_t live_bytes;      /* bytes live when the run stopped (0 after a full run) */
  uint64_t peak_live_bytes; /* the most bytes live at once: what an exact allocator holds */
  uint64_t stray_buffers;   /* buffers neither freed where they die nor part of the
                               state: 0 after a full run (else a bug of the model;
                               they are freed at the end all the same) */
  size_t failed_bytes;      /* the size of the failed request, when NO_MEMORY */
  stream_model_kind failed_kind;
} stream_model_result;

/* Bytes per frame of one global layer's K (fp32) and V (bf16) cache, and per
 * special token: the units tests and reports speak in. */
size_t stream_model_k_frame_bytes(void);
size_t stream_model_v_frame_bytes(void);
size_t stream_model_k_token_bytes(void);
size_t stream_model_v_token_bytes(void);
/* Special tokens of a frame (camera, 4 registers, scale), global layers. */
int stream_model_special_tokens(void);
int stream_model_global_layers(void);
/* Total bytes of the weights the model loads. */
uint64_t stream_model_weight_bytes(void);

/* The workload's defaults for a run of `frames` frames. */
void stream_model_default_params(stream_model_params *params, int frames);

/* Run the workload. Every buffer the model allocates is freed before it
 * returns, whether it finishes or stops early. */
stream_model_status stream_model_run(const stream_model_params *params, const stream_model_ops *ops,
                                     stream_model_result *out);

/* "ok", "out of memory", ... */
const char *stream_model_status_text(stream_model_status status);

#endif /* TIDE_STREAM_MODEL_H */
