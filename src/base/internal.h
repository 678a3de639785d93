/* internal.h: the glossary and what the library's files share.
 *
 * Words (see docs/design.md for the picture):
 * - device:    one GPU, or one emulated device of the host backend.
 * - page:      the unit of physical memory an expandable segment maps
 *              (page_size, a multiple of the backend's granularity).
 * - segment:   a range of device addresses blocks are carved from. A fixed
 *              segment is backed whole at creation; an expandable segment
 *              reserves a large virtual range and maps pages on demand.
 * - block:     a piece of a segment: allocated, free (mapped, in a bin),
 *              pending (freed, waiting on events of other streams) or
 *              unmapped (virtual space of an expandable segment, no pages).
 * - pool:      the small (requests up to 1 MiB) or large blocks of an arena.
 * - capture pool: private memory of CUDA graphs (tide_pool): allocations
 *              made during a capture go there, never to an arena's pools.
 * - arena:     the pools, segments and live blocks of one stream, behind
 *              one lock: streams never contend with each other.
 * - reserved:  physical bytes held; allocated: bytes handed to users.
 *
 * Names: public functions are tide_*, functions shared between files are
 * _tide_*, everything else is static. */
#ifndef TIDE_INTERNAL_H
#define TIDE_INTERNAL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tidalloc.h"

#define TIDE_KiB ((size_t)1 << 10)
#define TIDE_MiB ((size_t)1 << 20)
#define TIDE_GiB ((size_t)1 << 30)

/* Expandable segments of large handles (handle_size_mb): at most this many
 * pages per handle; requests of at least TIDE_HANDLES_PER_REQUEST of those
 * handles grow them ... */
#define TIDE_MAX_HANDLE_PAGES 1024
#define TIDE_HANDLES_PER_REQUEST 4
/* ... once the arena holds this many of those handles' worth (the default
 * of handle_threshold_mb). */
#define TIDE_HANDLES_BEFORE_LARGE 1024

/* PyTorch's constants, which our users' intuitions are built on. */
#define TIDE_MIN_BLOCK ((size_t)512)         /* every size is rounded to this */
#define TIDE_SMALL_SIZE ((size_t)1 << 20)    /* requests up to this use the small pool */
#define TIDE_SMALL_BUFFER ((size_t)2 << 20)  /* fixed segment size of the small pool */
#define TIDE_LARGE_BUFFER ((size_t)20 << 20) /* fixed segment size for requests below */
#define TIDE_MIN_LARGE_ALLOC ((size_t)10 << 20)
#define TIDE_ROUND_LARGE ((size_t)2 << 20) /* fixed segments above round to this */
/* Sizes above this are refused outright: no device has this much memory and
 * rounding arithmetic stays far from overflow. */
#define TIDE_MAX_ALLOC ((size_t)1 << 52)

#if defined(__GNUC__)
#define TIDE_LIKELY(x) __builtin_expect(!!(x), 1)
#define TIDE_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define TIDE_PRINTF(f, a) __attribute__((format(printf, f, a)))
#define TIDE_NOINLINE __attribute__((noinline))
#define TIDE_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define TIDE_LIKELY(x) (x)
#define TIDE_UNLIKELY(x) (x)
#define TIDE_PRINTF(f, a)
#define TIDE_NOINLINE
#define TIDE_ALWAYS_INLINE inline
#endif

/* Code that only checks (tide_check and what it calls): a fuzz build leaves
 * it out of coverage feedback, whose branches there say nothing about new
 * states of the allocator and cost time at every step (clang 13 and later;
 * validate.c is left out whole, by its compile options). */
#if defined(__clang__) && __clang_major__ >= 13
#define TIDE_CHECK_ONLY __attribute__((no_sanitize("coverage")))
#else
#define TIDE_CHECK_ONLY
#endif

/* ------------------------------------------------------------------------ */
/* Errors (error.c)                                                          */
/* ------------------------------------------------------------------------ */

/* Record a failure for the calling thread and return `status`, so that
 * `return _tide_error_set(TIDE_ERR_INVALID, "...")` reads naturally. */
int _tide_error_set(tide_status status, const char *fmt, ...) TIDE_PRINTF(2, 3);
/* Prefix the current message with more context ("growing segment: ..."). */
void _tide_error_prefix(const char *fmt, ...) TIDE_PRINTF(1, 2);
/* Keep the current error across calls that may overwrite it (undo paths). */
typedef struct _tide_saved_error {
  tide_status status;
  char text[512];
} _tide_saved_error;
void _tide_error_save(_tide_saved_error *saved);
int _tide_error_restore(const _tide_saved_error *saved);
/* The first of several failures with its own message, which the later ones
 * would overwrite: note each result as it comes, end with the first. */
typedef struct _tide_first_error {
  int status;
  _tide_saved_error saved;
} _tide_first_error;
static inline void _tide_first_error_note(_tide_first_error *first, int status) {
  if (status == 0 || first->status != 0) return;
  first->status = status;
  _tide_error_save(&first->saved);
}
static inline int _tide_first_error_end(const _tide_first_error *first) {
  return first->status ? _tide_error_restore(&first->saved) : 0;
}
/* Format a byte count for messages: "1.50 GiB", "512 B". buf >= 32 bytes. */
const char *_tide_format_bytes(uint64_t bytes, char *buf, size_t len);

/* ------------------------------------------------------------------------ */
/* Configuration (conf.c)                                                    */
/* ------------------------------------------------------------------------ */

enum { TIDE_BACKEND_AUTO = 0, TIDE_BACKEND_HOST = 1, TIDE_BACKEND_CUDA = 2 };

/* PyTorch's roundup_power2_divisions intervals: 1 MiB, 2 MiB, ... 64 GiB. */
#define TIDE_ROUNDUP_INTERVALS 17
/* The most devices the host backend emulates (host_devices). */
#define TIDE_HOST_MAX_DEVICES 64

/* The resolved value of every option (tide_config holds these plus where
 * each came from). */
typedef struct _tide_conf_values {
  int backend;              /* TIDE_BACKEND_* */
  bool expandable_segments; /* default true */
  size_t page_size;         /* bytes an expandable segment maps at once */
  size_t handle_size;       /* the most one physical handle of an expandable segment holds */
  size_t handle_threshold;  /* reserved bytes before large handles; SIZE_MAX: 1024 of them */
  size_t max_split_size;    /* SIZE_MAX: no limit */
  unsigned roundup_divisions[TIDE_ROUNDUP_INTERVALS]; /* 0 or 1: plain 512 B rounding */
  double gc_threshold;                                /* garbage_collection_threshold, 0: off */
  double memory_fraction;    /* (0, 1]; 1.0 (default): the whole device; treat 0 alike */
  size_t memory_limit;       /* bytes, 0: no limit */
  bool release_holes;        /* recycle free pages inside segments when growing */
  bool load_handles;         /* one handle per growth until a stream first frees */
  size_t trace_capacity;     /* trace ring events, 0: off */
  size_t host_capacity;      /* bytes of the emulated device; 0: auto (_tide_host_capacity) */
  size_t host_granularity;   /* the emulated device's mapping granularity */
  int host_devices;          /* emulated devices */
  unsigned host_queue_depth; /* events a host stream's completion lags behind, 0: none */
  bool host_shared;          /* emulated devices of one number share their capacity */
  bool peer_access;          /* CUDA: every GPU that can reach ours may use it */
  bool capture_detection;    /* every allocation asks whether its stream is being captured */
  bool graph_reuse;          /* graph_capture_record_stream_reuse: the initial switch */
} _tide_conf_values;

/* The values of a config (tide_config is opaque outside conf.c). */
const _tide_conf_values *_tide_config_values(const tide_config *config);
/* Bytes of memory the machine can give this process: physical memory, or
 * its control group's limit if lower; 0 if unknown (machine.c). */
uint64_t _tide_machine_memory(void);
/* Bytes of each emulated device: host_capacity, or when it is auto, a
 * share of the machine's memory divided among host_devices and capped, in
 * whole host_granularity units (machine.c says how much and why). */
size_t _tide_host_capacity(const _tide_conf_values *conf);
/* Copy of a config, or NULL without memory. */
tide_config *_tide_config_clone(const tide_config *config);
/* Write into buf the keys whose values differ between a and b, as
 * "key: old -> new; ..." (empty when equal). Returns how many differ. */
size_t _tide_config_diff(const tide_config *a, const tide_config *b, char *buf, size_t len);

/* ------------------------------------------------------------------------ */
/* Locks (lock.h has the inline fast path)                                   */
/* ------------------------------------------------------------------------ */

typedef struct _tide_lock {
  atomic_int held;
} _tide_lock;

/* ------------------------------------------------------------------------ */
/* Memory of handles (handles.c)                                             */
/* ------------------------------------------------------------------------ */

/* Objects of a kind gone since, that wait before one is used again. */
#define TIDE_HANDLE_QUARANTINE 64

/* The objects of one kind: a static of the file that makes them, {0}. */
typedef struct _tide_handle_kind {
  _tide_lock lock;
  struct _tide_retired *head, *tail; /* gone, oldest first */
  size_t count;
} _tide_handle_kind;

/* A zeroed object of `size` bytes (the same for every call of a kind),
 * 64-byte aligned, or NULL without memory. Its memory is never freed: an
 * object that goes is retired, its magic word cleared first by the caller,
 * and a stale handle reads that word. */
void *_tide_handle_new(_tide_handle_kind *kind, size_t size);
void _tide_handle_retire(_tide_handle_kind *kind, void *object);

/* ------------------------------------------------------------------------ */
/* Growable arrays (array.c)                                                 */
/* ------------------------------------------------------------------------ */

/* Make room for `need` items of `item_size` bytes in *items (capacity *cap),
 * doubling; false (nothing changed) when host memory runs out. */
bool _tide_grow_array(void **items, size_t *cap, size_t need, size_t item_size);

/* ------------------------------------------------------------------------ */
/* Clock                                                                     */
/* ------------------------------------------------------------------------ */

uint64_t _tide_now_ns(void);

#endif /* TIDE_INTERNAL_H */
