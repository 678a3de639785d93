/* pinned.h: the pinned host memory pool of an allocator (pinned.c), as the
 * allocator's entry points call it. The pool has its own lock: every
 * function may be called from any thread, except create and destroy, which
 * come with the allocator's. Failures set the thread's error message. */
#ifndef TIDE_PINNED_H
#define TIDE_PINNED_H

#include "memory/core.h"

typedef struct _tide_pinned _tide_pinned;

int _tide_pinned_create(tide_allocator *a, _tide_pinned **out);
/* Give every block back, in use or cached. Returns how many were still
 * allocated or waiting on streams. */
size_t _tide_pinned_destroy(_tide_pinned *pool);

void *_tide_pinned_malloc(_tide_pinned *pool, size_t size, tide_stream stream);
int _tide_pinned_free(_tide_pinned *pool, void *ptr, tide_stream stream);
int _tide_pinned_record_stream(_tide_pinned *pool, void *ptr, tide_stream stream);
int _tide_pinned_empty_cache(_tide_pinned *pool);
void _tide_pinned_stats(_tide_pinned *pool, tide_stats *out);
/* `stream` is about to be destroyed: wait for its work, and let no block
 * count on it any more. */
void _tide_pinned_stream_gone(_tide_pinned *pool, tide_stream stream);

/* Check the pool's invariants under its lock (see validate.c): TIDE_OK, or
 * TIDE_ERR_STATE with the first one broken written into `why`. */
int _tide_pinned_validate(_tide_pinned *pool, char *why, size_t len);

#endif /* TIDE_PINNED_H */
