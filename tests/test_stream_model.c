/* test_stream_model.c: the streaming workload model of `tidalloc stream`,
 * driven by a counting fake allocator: its peaks against the calibration
 * band, no leak (also when it runs out of memory half-way), the K/V cache's
 * growth and window, the special cache's growth, the camera cache and the
 * outputs, copies in bounds, and a sequence that is the same every run. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "../tools/stream_model.c"

#define GiB (1024.0 * 1024.0 * 1024.0)

/* ------------------------------------------------------------------------ */
/* The counting fake                                                        */
/* ------------------------------------------------------------------------ */

typedef enum fake_op { FAKE_ALLOC, FAKE_FREE, FAKE_COPY } fake_op;

typedef struct fake_event {
  uint8_t op;
  uint8_t kind;
  uint64_t id; /* the buffer (the destination of a copy) */
  uint64_t bytes;
  uint64_t offset;
} fake_event;

typedef struct fake_buf {
  uint64_t id;
  size_t bytes;
  stream_model_kind kind;
  size_t capacity; /* growable buffers (grow mode); 0 for the others */
} fake_buf;

typedef struct fake {
  uint64_t next_id;
  uint64_t live_count;
  uint64_t live_bytes;
  uint64_t peak_bytes;
  uint64_t budget; /* 0: no limit; else allocations past it fail */
  uint64_t bad_frees, bad_copies;
  uint64_t buffers, bad_resizes; /* growable buffers made; resizes past capacity */
  /* The sizes of one kind's allocations, in order (follow_kind < 0: none). */
  int follow_kind;
  size_t *sizes;
  size_t size_count, size_cap;
  /* Every event, when record is set. */
  bool record;
  fake_event *events;
  size_t event_count, event_cap;
} fake;

static void fake_record(fake *f, fake_op op, stream_model_kind kind, uint64_t id, uint64_t bytes,
                        uint64_t offset) {
  if (!f->record) return;
  if (f->event_count == f->event_cap) {
    f->event_cap = f->event_cap ? 2 * f->event_cap : 4096;
    f->events = realloc(f->events, f->event_cap * sizeof *f->events);
    assert_non_null(f->events);
  }
  fake_event *e = &f->events[f->event_count++];
  memset(e, 0, sizeof *e);
  e->op = (uint8_t)op;
  e->kind = (uint8_t)kind;
  e->id = id;
  e->bytes = bytes;
  e->offset = offset;
}

static void *fake_alloc(void *ctx, size_t bytes, stream_model_kind kind) {
  fake *f = ctx;
  if (bytes == 0) return NULL;
  if (f->budget && f->live_bytes + bytes > f->budget) return NULL;
  fake_buf *b = malloc(sizeof *b);
  assert_non_null(b);
  b->id = ++f->next_id;
  b->bytes = bytes;
  b->kind = kind;
  f->live_count++;
  f->live_bytes += bytes;
  if (f->live_bytes > f->peak_bytes) f->peak_bytes = f->live_bytes;
  if ((int)kind == f->follow_kind) {
    if (f->size_count == f->size_cap) {
      f->size_cap = f->size_cap ? 2 * f->size_cap : 1024;
      f->sizes = realloc(f->sizes, f->size_cap * sizeof *f->sizes);
      assert_non_null(f->sizes);
    }
    f->sizes[f->size_count++] = bytes;
  }
  fake_record(f, FAKE_ALLOC, kind, b->id, bytes, 0);
  return b;
}

static void fake_free(void *ctx, void *buf, size_t bytes) {
  fake *f = ctx;
  fake_buf *b = buf;
  if (b == NULL || b->bytes != bytes) {
    f->bad_frees++;
    return;
  }
  fake_record(f, FAKE_FREE, b->kind, b->id, bytes, 0);
  f->live_count--;
  f->live_bytes -= bytes;
  free(b);
}

static int fake_copy(void *ctx, void *dst, size_t dst_offset, const void *src, size_t src_offset,
                     size_t bytes) {
  fake *f = ctx;
  const fake_buf *d = dst, *s = src;
  if (d == NULL || s == NULL || dst_offset + bytes > d->bytes || src_offset + bytes > s->bytes)
    f->bad_copies++;
  fake_record(f, FAKE_COPY, d ? d->kind : 0, d ? d->id : 0, bytes, dst_offset);
  return 0;
}

/* Growable buffers: the handle is the data pointer (copies check bounds
 * against the length). */
static void *fake_buf_create(void *ctx, size_t capacity, stream_model_kind kind, void **data) {
  fake *f = ctx;
  fake_buf *b = calloc(1, sizeof *b);
  assert_non_null(b);
  b->id = ++f->next_id;
  b->kind = kind;
  b->capacity = capacity;
  f->live_count++;
  f->buffers++;
  *data = b;
  return b;
}

static int fake_buf_resize(void *ctx, void *buf, size_t bytes) {
  fake *f = ctx;
  fake_buf *b = buf;
  if (bytes > b->capacity) {
    f->bad_resizes++;
    return -1;
  }
  if (f->budget && f->live_bytes - b->bytes + bytes > f->budget) return -1;
  f->live_bytes = f->live_bytes - b->bytes + bytes;
  if (f->live_bytes > f->peak_bytes) f->peak_bytes = f->live_bytes;
  b->bytes = bytes;
  return 0;
}

static void fake_buf_destroy(void *ctx, void *buf) {
  fake *f = ctx;
  fake_buf *b = buf;
  f->live_count--;
  f->live_bytes -= b->bytes;
  free(b);
}

static stream_model_ops fake_ops(fake *f) {
  stream_model_ops ops = {f,    fake_alloc,      fake_free,       fake_copy,
                          NULL, fake_buf_create, fake_buf_resize, fake_buf_destroy};
  return ops;
}

static void fake_init(fake *f) {
  memset(f, 0, sizeof *f);
  f->follow_kind = -1;
}

static void fake_done(fake *f) {
  free(f->sizes);
  free(f->events);
}

/* Run `frames` frames with the defaults on a fresh fake; checks the run
 * ended well and left nothing behind. */
static stream_model_result run_mode(fake *f, int frames, int grow) {
  stream_model_params params;
  stream_model_default_params(&params, frames);
  params.grow = grow;
  stream_model_ops ops = fake_ops(f);
  stream_model_result r;
  assert_int_equal(stream_model_run(&params, &ops, &r), STREAM_MODEL_OK);
  assert_int_equal(r.frames_done, frames);
  return r;
}

static stream_model_result run_frames(fake *f, int frames) { return run_mode(f, frames, 0); }

/* ------------------------------------------------------------------------ */
/* Calibration                                                              */
/* ------------------------------------------------------------------------ */

/* The measured peak allocated of the workload's table (the mean of its
 * rows) and the band the model is calibrated to, +-3%. */
static void assert_peak_near(int frames, double measured_gib) {
  fake f;
  fake_init(&f);
  stream_model_result r = run_frames(&f, frames);
  double peak = (double)f.peak_bytes / GiB;
  if (peak < measured_gib * 0.97 || peak > measured_gib * 1.03)
    fail_msg("%d frames: peak %.3f GiB, measured %.2f GiB", frames, peak, measured_gib);
  assert_int_equal(r.peak_live_bytes, f.peak_bytes); /* the model counts what the fake saw */
  fake_done(&f);
}

static void test_peak_64_frames(void **state) {
  (void)state;
  assert_peak_near(64, 15.43);
}

static void test_peak_512_frames(void **state) {
  (void)state;
  assert_peak_near(512, 17.505);
}

/* ------------------------------------------------------------------------ */
/* Leaks and bounds                                                         */
/* ------------------------------------------------------------------------ */

static void test_everything_freed(void **state) {
  (void)state;
  fake f;
  fake_init(&f);
  stream_model_result r = run_frames(&f, 100);
  assert_int_equal(f.live_count, 0);
  assert_int_equal(f.live_bytes, 0);
  assert_int_equal(f.bad_frees, 0);
  assert_int_equal(f.bad_copies, 0);
  assert_int_equal(r.allocs, f.next_id);
  assert_int_equal(r.frees, r.allocs);
  assert_int_equal(r.live_bytes, 0);
  assert_int_equal(r.stray_buffers, 0); /* each buffer freed where it dies */
  assert_true(r.copies > 0);
  fake_done(&f);
}

/* Out of memory half-way (in a step, with caches and outputs held): the run
 * stops, says so, and frees everything. */
static void test_out_of_memory_frees_everything(void **state) {
  (void)state;
  const uint64_t budgets[] = {(uint64_t)(1.0 * GiB), (uint64_t)(12.0 * GiB),
                              (uint64_t)(16.0 * GiB)};
  for (size_t i = 0; i < sizeof budgets / sizeof budgets[0]; i++) {
    fake f;
    fake_init(&f);
    f.budget = budgets[i];
    stream_model_params params;
    stream_model_default_params(&params, 200);
    stream_model_ops ops = fake_ops(&f);
    stream_model_result r;
    assert_int_equal(stream_model_run(&params, &ops, &r), STREAM_MODEL_NO_MEMORY);
    assert_true(r.frames_done < 200);
    assert_true(r.failed_bytes > 0);
    assert_int_equal(f.live_count, 0);
    assert_int_equal(f.live_bytes, 0);
    assert_int_equal(f.bad_frees, 0);
    assert_int_equal(r.frees, r.allocs);
    assert_true(f.peak_bytes <= f.budget);
    fake_done(&f);
  }
}

static void test_bad_params(void **state) {
  (void)state;
  fake f;
  fake_init(&f);
  stream_model_ops ops = fake_ops(&f);
  stream_model_params params;
  stream_model_result r;
  stream_model_default_params(&params, 0);
  assert_int_equal(stream_model_run(&params, &ops, &r), STREAM_MODEL_BAD_PARAMS);
  stream_model_default_params(&params, 10);
  params.window = 0;
  assert_int_equal(stream_model_run(&params, &ops, &r), STREAM_MODEL_BAD_PARAMS);
  assert_int_equal(f.next_id, 0); /* nothing was allocated */
  fake_done(&f);
}

/* ------------------------------------------------------------------------ */
/* Growth                                                                   */
/* ------------------------------------------------------------------------ */

/* The frame counts of the K (or V) caches allocated, in order, as the model
 * should make them: the scale batch at once, then one frame more per step
 * and layer, and once past 8 + 64 a rebuild to 72 frames. */
static void assert_cache_sequence(stream_model_kind kind, size_t frame_bytes) {
  const int frames = 100, layers = stream_model_global_layers();
  fake f;
  fake_init(&f);
  f.follow_kind = (int)kind;
  run_frames(&f, frames);
  size_t at = 0;
  for (int l = 0; l < layers; l++) {
    assert_true(at < f.size_count);
    assert_int_equal(f.sizes[at++], 8 * frame_bytes);
  }
  for (int frame = 8; frame < frames; frame++) {
    int held = frame < 72 ? frame : 72;
    for (int l = 0; l < layers; l++) {
      assert_true(at < f.size_count);
      assert_int_equal(f.sizes[at++], (size_t)(held + 1) * frame_bytes);
      if (held + 1 > 72) {
        assert_true(at < f.size_count);
        assert_int_equal(f.sizes[at++], 72 * frame_bytes);
      }
    }
  }
  assert_int_equal(at, f.size_count);
  fake_done(&f);
}

static void test_k_cache_grows_and_windows(void **state) {
  (void)state;
  assert_int_equal(stream_model_k_frame_bytes(), (size_t)16 * 1005 * 64 * 4);
  assert_cache_sequence(STREAM_MODEL_KV_K, stream_model_k_frame_bytes());
}

static void test_v_cache_grows_and_windows(void **state) {
  (void)state;
  assert_int_equal(stream_model_v_frame_bytes(), (size_t)16 * 1005 * 64 * 2);
  assert_cache_sequence(STREAM_MODEL_KV_V, stream_model_v_frame_bytes());
}

/* The special caches grow by 6 tokens for every evicted frame, never
 * shrink, one allocation per layer and eviction. */
static void assert_special_sequence(stream_model_kind kind, size_t token_bytes) {
  const int frames = 100, layers = stream_model_global_layers();
  fake f;
  fake_init(&f);
  f.follow_kind = (int)kind;
  run_frames(&f, frames);
  int evictions = frames - 72;
  assert_int_equal(f.size_count, (size_t)(evictions * layers));
  size_t at = 0;
  for (int e = 1; e <= evictions; e++)
    for (int l = 0; l < layers; l++)
      assert_int_equal(f.sizes[at++], (size_t)(e * stream_model_special_tokens()) * token_bytes);
  fake_done(&f);
}

static void test_special_cache_grows_by_evicted_tokens(void **state) {
  (void)state;
  assert_int_equal(stream_model_special_tokens(), 6);
  assert_special_sequence(STREAM_MODEL_SPECIAL_K, stream_model_k_token_bytes());
  assert_special_sequence(STREAM_MODEL_SPECIAL_V, stream_model_v_token_bytes());
}

/* 16 camera caches (4 blocks x 4 iterations), K and V, end at 8 KiB a
 * keyframe each: 256 KiB per keyframe in all. */
static void test_camera_cache(void **state) {
  (void)state;
  const int frames = 30;
  fake f;
  fake_init(&f);
  f.follow_kind = STREAM_MODEL_CAMERA_KV;
  run_frames(&f, frames);
  size_t largest = 0, at_largest = 0;
  for (size_t i = 0; i < f.size_count; i++) {
    if (f.sizes[i] > largest) {
      largest = f.sizes[i];
      at_largest = 0;
    }
    if (f.sizes[i] == largest) at_largest++;
  }
  assert_int_equal(largest, (size_t)frames * 8192);
  assert_int_equal(at_largest * largest, (size_t)frames * 256 * 1024);
  fake_done(&f);
}

/* Depth and confidence at 518 x 378 fp32 and a pose of 9 floats, per frame. */
static void test_outputs_per_frame(void **state) {
  (void)state;
  const int frames = 20;
  fake f;
  fake_init(&f);
  f.follow_kind = STREAM_MODEL_OUTPUT;
  run_frames(&f, frames);
  size_t total = 0;
  for (size_t i = 0; i < f.size_count; i++) total += f.sizes[i];
  assert_int_equal(total, (size_t)frames * (2 * 518 * 378 * 4 + 9 * 4));
  fake_done(&f);
}

/* ------------------------------------------------------------------------ */
/* Determinism                                                              */
/* ------------------------------------------------------------------------ */

static void test_deterministic(void **state) {
  (void)state;
  fake a, b, c;
  fake_init(&a);
  fake_init(&b);
  fake_init(&c);
  a.record = b.record = c.record = true;
  run_frames(&a, 90);
  run_frames(&b, 90);
  run_frames(&c, 91);
  assert_true(a.event_count > 0);
  assert_int_equal(a.event_count, b.event_count);
  assert_memory_equal(a.events, b.events, a.event_count * sizeof *a.events);
  /* The comparison can tell runs apart: one frame more is another sequence. */
  assert_int_not_equal(a.event_count, c.event_count);
  fake_done(&a);
  fake_done(&b);
  fake_done(&c);
}

/* The weights are what the top of stream_model.c says: the itemised modules
 * (1159.1 M params) and the calibration term, 5.30 GiB in fp32. */
static void test_weight_total(void **state) {
  (void)state;
  double gib = (double)stream_model_weight_bytes() / GiB;
  assert_true(gib > 5.29 && gib < 5.32);
}

/* Grow mode keeps the caches in growable buffers: nothing leaks, no copy
 * or resize goes out of bounds, the caches are never copied whole (only each
 * frame's new part and evicted special tokens), and the clone and cat
 * transients of attention are gone, so the peak is lower. */
static void test_grow_mode(void **state) {
  (void)state;
  fake cat, grow;
  fake_init(&cat);
  fake_init(&grow);
  stream_model_result rc = run_mode(&cat, 200, 0);
  stream_model_result rg = run_mode(&grow, 200, 1);
  assert_int_equal(grow.live_count, 0);
  assert_int_equal(grow.live_bytes, 0);
  assert_int_equal(grow.bad_copies, 0);
  assert_int_equal(grow.bad_resizes, 0);
  assert_int_equal(grow.bad_frees, 0);
  assert_int_equal(rg.stray_buffers, 0);
  assert_true(grow.buffers >= 4 * (uint64_t)stream_model_global_layers());
  assert_true(rg.copied_bytes * 10 < rc.copied_bytes);
  assert_true(grow.peak_bytes < cat.peak_bytes);
  fake_done(&cat);
  fake_done(&grow);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_grow_mode),
      cmocka_unit_test(test_weight_total),
      cmocka_unit_test(test_peak_64_frames),
      cmocka_unit_test(test_peak_512_frames),
      cmocka_unit_test(test_everything_freed),
      cmocka_unit_test(test_out_of_memory_frees_everything),
      cmocka_unit_test(test_bad_params),
      cmocka_unit_test(test_k_cache_grows_and_windows),
      cmocka_unit_test(test_v_cache_grows_and_windows),
      cmocka_unit_test(test_special_cache_grows_by_evicted_tokens),
      cmocka_unit_test(test_camera_cache),
      cmocka_unit_test(test_outputs_per_frame),
      cmocka_unit_test(test_deterministic),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
