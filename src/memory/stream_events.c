/* stream_events.c: how far an arena's stream has run, for the memory freed
 * on it. A block freed on its own stream is free at once, but work queued
 * before its free may still read it, so its pages may be unmapped, or
 * handed to another stream, only once the stream is past that work. The
 * arena learns it from idle marks, events recorded on its stream now and
 * then, each with the arena's clock: once one completes, every block freed
 * (stamped) before its clock is idle. Where no mark will do, the stream is
 * waited for. The arena's spare events, which marks and stream-ordered
 * frees (arena.c) take and give back, are here too. */
#include <stdlib.h>
#include <string.h>

#include "memory/core.h"

/* ------------------------------------------------------------------------ */
/* Spare events                                                              */
/* ------------------------------------------------------------------------ */

int _tide_event_take(_tide_arena *arena, _tide_event *out) {
  if (arena->nspare_events) {
    *out = arena->spare_events[--arena->nspare_events];
    return TIDE_OK;
  }
  const _tide_backend *be = &arena->alloc->backend;
  return be->ops->event_create(be->ctx, out);
}

void _tide_event_give(_tide_arena *arena, _tide_event e) {
  if (arena->nspare_events == arena->spare_events_cap) {
    size_t cap = arena->spare_events_cap ? arena->spare_events_cap * 2 : 16;
    _tide_event *grown = realloc(arena->spare_events, cap * sizeof *grown);
    if (!grown) {
      const _tide_backend *be = &arena->alloc->backend;
      be->ops->event_destroy(be->ctx, e);
      return;
    }
    arena->spare_events = grown;
    arena->spare_events_cap = cap;
  }
  arena->spare_events[arena->nspare_events++] = e;
}

/* ------------------------------------------------------------------------ */
/* Idle marks                                                                */
/* ------------------------------------------------------------------------ */

/* Idle marks may be used: not while captures are watched (an event
 * recorded on a capturing stream would join the graph, and a capture's
 * frees follow rules of their own), nor on a stream that is gone. With
 * capture_detection, a capture may have begun unannounced: the stream is
 * asked (one query, where the alternative is a stream synchronization). */
bool _tide_idle_marks_usable(const _tide_arena *arena) {
  struct tide_allocator *a = arena->alloc;
  return !arena->stream_gone &&
         atomic_load_explicit(&a->capture_watch, memory_order_relaxed) == 0 &&
         (!a->conf.capture_detection || !_tide_capture_detected(&a->backend, arena->stream));
}

/* In order: the marks were recorded on one stream. A failed query counts as
 * not done. */
void _tide_idle_marks_poll(_tide_arena *arena) {
  const _tide_backend *be = &arena->alloc->backend;
  _tide_saved_error saved;
  _tide_error_save(&saved);
  unsigned done = 0;
  while (done < arena->nidle_marks &&
         be->ops->event_query(be->ctx, arena->idle_marks[done].event) == TIDE_OK) {
    if (arena->idle_marks[done].clock > arena->idle_before)
      arena->idle_before = arena->idle_marks[done].clock;
    _tide_event_give(arena, arena->idle_marks[done].event);
    done++;
  }
  arena->nidle_marks -= done;
  memmove(arena->idle_marks, arena->idle_marks + done,
          arena->nidle_marks * sizeof *arena->idle_marks);
  _tide_error_restore(&saved);
}

void _tide_idle_mark_add(_tide_arena *arena, bool usable) {
  if (arena->nidle_marks == _TIDE_IDLE_MARKS || !usable) return;
  const _tide_backend *be = &arena->alloc->backend;
  _tide_saved_error saved;
  _tide_error_save(&saved);
  _tide_event e;
  if (_tide_event_take(arena, &e) == TIDE_OK) {
    if (be->ops->event_record(be->ctx, e, arena->stream) == TIDE_OK) {
      /* A tick, so that blocks freed from now on are stamped after it. */
      arena->idle_marks[arena->nidle_marks++] = (struct _tide_idle_mark){e, ++arena->clock};
    } else {
      _tide_event_give(arena, e);
    }
  }
  _tide_error_restore(&saved);
}

/* ------------------------------------------------------------------------ */
/* Waiting for the stream                                                    */
/* ------------------------------------------------------------------------ */

/* A capture pool's memory is used by work the arena's stream does not
 * order: its graphs replay on whatever stream the program launches them on,
 * and their outputs are read there. Only the whole device says when that
 * work is done (PyTorch's allocator frees a graph's memory with cudaFree,
 * which waits for the device). Waiting for the device while a capture is
 * under way would invalidate the capture, so then nothing is waited for
 * and the memory stays, to go back once no capture is (TIDE_ERR_NOT_READY). */
static int wait_device(_tide_arena *arena) {
  struct tide_allocator *a = arena->alloc;
  const _tide_backend *be = &a->backend;
  if (atomic_load_explicit(&a->capture_watch, memory_order_acquire) != 0)
    return _tide_error_set(TIDE_ERR_NOT_READY,
                           "cannot return the memory of a capture pool yet: its graphs' replays "
                           "may still use it on any stream, and waiting for the whole device "
                           "would invalidate the capture under way (a stream is captured, or "
                           "about to be)");
  _tide_note_stream_wait(a);
  int rc = be->ops->device_synchronize(be->ctx);
  if (rc) {
    _tide_error_prefix("cannot return the memory of a capture pool yet");
    return rc;
  }
  return TIDE_OK;
}

static int wait_stream(_tide_arena *arena) {
  const _tide_backend *be = &arena->alloc->backend;
  /* A destroyed stream's work is ordered before the default stream's. */
  tide_stream s = arena->stream_gone ? NULL : arena->stream;
  _tide_note_stream_wait(arena->alloc);
  int rc = be->ops->stream_synchronize(be->ctx, s);
  if (rc) {
    _tide_error_prefix("cannot return cached memory of stream %p yet", (void *)arena->stream);
    return rc;
  }
  return TIDE_OK;
}

int _tide_stream_settle(_tide_arena *arena) {
  int rc = arena->pool_id != 0 ? wait_device(arena) : wait_stream(arena);
  if (rc) return rc;
  arena->idle_before = ++arena->clock; /* everything freed so far is idle */
  return TIDE_OK;
}

/* The oldest idle mark recorded after the free, not the whole stream, so
 * that the work queued since that mark keeps the device busy while the CPU
 * goes on: a stream synchronization drains the whole queue, so a program
 * that frees and grows every step would lose the overlap of its CPU and
 * device work every step. */
int _tide_idle_wait(_tide_arena *arena, uint64_t stamp) {
  _tide_idle_marks_poll(arena);
  if (stamp < arena->idle_before) return TIDE_OK;
  unsigned i = 0;
  while (i < arena->nidle_marks && arena->idle_marks[i].clock <= stamp) i++;
  if (i < arena->nidle_marks) {
    const _tide_backend *be = &arena->alloc->backend;
    _tide_note_stream_wait(arena->alloc);
    _tide_saved_error saved;
    _tide_error_save(&saved);
    int rc = be->ops->event_synchronize(be->ctx, arena->idle_marks[i].event);
    _tide_error_restore(&saved);
    if (rc == TIDE_OK) _tide_idle_marks_poll(arena);
    if (stamp < arena->idle_before) return TIDE_OK;
  }
  return _tide_stream_settle(arena);
}
