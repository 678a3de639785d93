/* snapshot.c: a picture of every segment and block of an allocator, as
 * JSON (with its growable buffers) for tools that draw memory maps or find
 * what holds memory, and as arrays (tide_layout_get) for programs that
 * build their own, such as PyTorch's memory snapshot. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "features/features.h"

typedef struct text {
  char *data;
  size_t len, cap;
  bool failed;
} text;

static void put(text *t, const char *fmt, ...) TIDE_PRINTF(2, 3);

static void put(text *t, const char *fmt, ...) {
  if (t->failed) return;
  if (!t->data) { /* a first buffer, so that data + len is always defined */
    t->data = malloc(t->cap = 4096);
    if (!t->data) {
      t->failed = true;
      return;
    }
  }
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(t->data + t->len, t->cap - t->len, fmt, ap);
    va_end(ap);
    if (n < 0) {
      t->failed = true;
      return;
    }
    if ((size_t)n < t->cap - t->len) {
      t->len += (size_t)n;
      return;
    }
    size_t cap = (t->cap + (size_t)n + 1) * 2;
    char *grown = realloc(t->data, cap);
    if (!grown) {
      t->failed = true;
      return;
    }
    t->data = grown;
    t->cap = cap;
  }
}

static const char *state_name(uint8_t state) {
  switch (state) {
  case _TIDE_FREE:
  case _TIDE_QUICK: return "free";
  case _TIDE_ALLOCATED: return "allocated";
  case _TIDE_PENDING: return "pending";
  default: return "unmapped";
  }
}

static void put_segment(text *t, const _tide_arena *arena, const _tide_segment *seg, bool *first) {
  put(t,
      "%s\n    {\"address\": %llu, \"size\": %zu, \"mapped\": %zu, \"pool\": \"%s\", "
      "\"kind\": \"%s\", \"stream\": %llu, \"capture_pool\": %llu, \"blocks\": [",
      *first ? "" : ",", (unsigned long long)seg->base, seg->size, seg->mapped,
      seg->pool == _TIDE_SMALL ? "small" : "large", seg->expandable ? "expandable" : "fixed",
      (unsigned long long)(uintptr_t)arena->stream, (unsigned long long)arena->pool_id);
  *first = false;
  for (const _tide_block *b = seg->first; b; b = b->next)
    put(t, "%s\n      {\"address\": %llu, \"size\": %zu, \"state\": \"%s\", \"requested\": %zu}",
        b == seg->first ? "" : ",", (unsigned long long)b->addr, b->size, state_name(b->state),
        b->state == _TIDE_ALLOCATED ? b->requested : 0);
  put(t, "\n    ]}");
}

/* Growable buffers: where they are, how long, how much is mapped. */
static void put_buffers(text *t, tide_allocator *a) {
  size_t n = _tide_bufs_list(a, NULL, 0);
  _tide_buf_info *bufs = calloc(n ? n : 1, sizeof *bufs);
  if (!bufs) {
    t->failed = true;
    return;
  }
  size_t now = _tide_bufs_list(a, bufs, n); /* buffers made meanwhile are left out */
  if (now < n) n = now;
  for (size_t i = 0; i < n; i++)
    put(t,
        "%s\n    {\"address\": %llu, \"capacity\": %zu, \"length\": %zu, \"mapped\": %zu, "
        "\"ring\": %s, \"stream\": %llu}",
        i ? "," : "", (unsigned long long)bufs[i].address, bufs[i].capacity, bufs[i].length,
        bufs[i].mapped, bufs[i].ring ? "true" : "false",
        (unsigned long long)(uintptr_t)bufs[i].stream);
  free(bufs);
}

tide_status tide_snapshot_json(tide_allocator *a, char **out, size_t *len) {
  if (!_tide_allocator_valid(a) || !out)
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID, "tide_snapshot_json: bad argument");
  tide_stats st;
  _tide_stats_collect(a, &st);
  text t = {0};
  put(&t,
      "{\n  \"version\": \"%s\", \"backend\": \"%s\", \"device\": %d, \"page_size\": %zu, "
      "\"granularity\": %zu,\n  \"allocated_bytes\": %lld, \"reserved_bytes\": %lld, "
      "\"active_bytes\": %lld,\n  \"segments\": [",
      TIDE_VERSION_STRING, a->backend.ops->name, a->device, a->page_size, a->granularity,
      (long long)st.allocated_bytes[0].current, (long long)st.reserved_bytes[0].current,
      (long long)st.active_bytes[0].current);
  _tide_arena **arenas;
  size_t n = _tide_arenas_snapshot(a, &arenas);
  bool first = true;
  for (size_t i = 0; i < n; i++) {
    _tide_lock_acquire(&arenas[i]->lock);
    for (int kind = 0; kind < 2; kind++)
      for (const _tide_segment *seg = arenas[i]->pools[kind].segments; seg; seg = seg->next)
        put_segment(&t, arenas[i], seg, &first);
    _tide_lock_release(&arenas[i]->lock);
  }
  free(arenas);
  put(&t, "\n  ],\n  \"buffers\": [");
  put_buffers(&t, a);
  put(&t, "\n  ]\n}\n");
  if (t.failed) {
    free(t.data);
    return (tide_status)_tide_error_set(TIDE_ERR_OOM, "out of host memory for the snapshot");
  }
  *out = t.data;
  if (len) *len = t.len;
  return TIDE_OK;
}

void tide_string_free(char *s) { free(s); }

/* ------------------------------------------------------------------------ */
/* The layout as arrays                                                      */
/* ------------------------------------------------------------------------ */

static uint32_t view_state(uint8_t state) {
  switch (state) {
  case _TIDE_FREE:
  case _TIDE_QUICK: return TIDE_BLOCK_FREE;
  case _TIDE_ALLOCATED: return TIDE_BLOCK_ALLOCATED;
  case _TIDE_PENDING: return TIDE_BLOCK_PENDING;
  default: return TIDE_BLOCK_UNMAPPED;
  }
}

typedef struct layout_builder {
  tide_layout *out;
  size_t segments_cap, blocks_cap;
} layout_builder;

static int add_segment(layout_builder *lb, const _tide_arena *arena, const _tide_segment *seg) {
  tide_layout *l = lb->out;
  if (!_tide_grow_array((void **)&l->segments, &lb->segments_cap, l->num_segments + 1,
                        sizeof *l->segments))
    return TIDE_ERR_OOM;
  tide_segment_view *sv = &l->segments[l->num_segments++];
  *sv = (tide_segment_view){.address = seg->base,
                            .size = seg->size,
                            .mapped = seg->mapped,
                            .stream = arena->stream,
                            .capture_pool = arena->pool_id,
                            .large = seg->pool == _TIDE_LARGE,
                            .expandable = seg->expandable,
                            .first_block = l->num_blocks};
  for (const _tide_block *b = seg->first; b; b = b->next) {
    if (!_tide_grow_array((void **)&l->blocks, &lb->blocks_cap, l->num_blocks + 1,
                          sizeof *l->blocks))
      return TIDE_ERR_OOM;
    uint32_t state = view_state(b->state);
    l->blocks[l->num_blocks++] = (tide_block_view){
        .address = b->addr,
        .size = b->size,
        .requested = state == TIDE_BLOCK_ALLOCATED ? b->requested : 0,
        .state = state,
    };
  }
  sv->num_blocks = l->num_blocks - sv->first_block;
  return TIDE_OK;
}

tide_status tide_layout_get(tide_allocator *a, tide_layout *out) {
  if (out) memset(out, 0, sizeof *out);
  if (!_tide_allocator_valid(a) || !out)
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID, "tide_layout_get: %s is NULL or invalid",
                                        out ? "the allocator" : "out");
  layout_builder lb = {.out = out};
  _tide_arena **arenas;
  size_t n = _tide_arenas_snapshot(a, &arenas);
  int rc = arenas ? TIDE_OK : TIDE_ERR_OOM;
  for (size_t i = 0; i < n && !rc; i++) {
    _tide_lock_acquire(&arenas[i]->lock);
    for (int kind = 0; kind < 2 && !rc; kind++)
      for (const _tide_segment *seg = arenas[i]->pools[kind].segments; seg && !rc; seg = seg->next)
        rc = add_segment(&lb, arenas[i], seg);
    _tide_lock_release(&arenas[i]->lock);
  }
  free(arenas);
  if (!rc) return TIDE_OK;
  tide_layout_free(out);
  return (tide_status)_tide_error_set(TIDE_ERR_OOM, "tide_layout_get: out of host memory");
}

void tide_layout_free(tide_layout *layout) {
  if (!layout) return;
  free(layout->segments);
  free(layout->blocks);
  memset(layout, 0, sizeof *layout);
}
