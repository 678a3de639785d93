/* tidalloc.h: the whole public C API of tidalloc, a caching GPU memory allocator
 * for streaming inference. Everything a program can call is declared here, with
 * the tide_ prefix; every other symbol of the library is internal.
 *
 * A tide_allocator serves one device. Memory comes back from tide_malloc in
 * blocks carved from segments; freed blocks stay cached for reuse and are only
 * returned to the device by tide_empty_cache, by the garbage collector or by
 * the out-of-memory path. With expandable segments (the default) a segment is
 * one large virtual range whose pages are mapped as blocks need them, so
 * reserved memory follows allocated memory closely.
 *
 * Errors: functions return a tide_status (TIDE_OK is 0) and the allocation
 * functions return NULL; tide_last_error() then holds a message for the
 * calling thread, in words a user can act on. The library never aborts and
 * never prints. */
#ifndef TIDALLOC_H
#define TIDALLOC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define TIDE_API
#else
#define TIDE_API __attribute__((visibility("default")))
#endif

/* What the compiler may check at the caller. TIDE_NODISCARD, before a
 * declaration: a warning where the result is dropped (a status whose failure
 * leaves an output unset or a change not made, or memory that would leak).
 * TIDE_MALLOC and TIDE_ALLOC_SIZE(n), after one: the function returns memory
 * no other pointer aliases, of the size its n-th argument gives (its usable
 * size may be larger, tide_block_info says; code that uses more than it
 * asked for must ask for more; tide_pinned_malloc, whose rounding is
 * documented as usable, has no TIDE_ALLOC_SIZE). Empty where the compiler
 * lacks them. */
#if defined(__cplusplus) && __cplusplus >= 201703L
#define TIDE_NODISCARD [[nodiscard]]
#elif defined(__GNUC__) || defined(__clang__)
#define TIDE_NODISCARD __attribute__((warn_unused_result))
#else
#define TIDE_NODISCARD
#endif
#if defined(__GNUC__) || defined(__clang__)
#define TIDE_MALLOC __attribute__((malloc))
#define TIDE_ALLOC_SIZE(n) __attribute__((alloc_size(n)))
#else
#define TIDE_MALLOC
#define TIDE_ALLOC_SIZE(n)
#endif

#define TIDE_VERSION_MAJOR 0
#define TIDE_VERSION_MINOR 1
#define TIDE_VERSION_PATCH 0
#define TIDE_VERSION_STRING "0.1.0"

/* ------------------------------------------------------------------------ */
/* Status codes and errors                                                  */
/* ------------------------------------------------------------------------ */

typedef enum tide_status {
  TIDE_OK = 0,
  TIDE_ERR_OOM = 1,         /* out of memory: device, memory limit or host capacity */
  TIDE_ERR_INVALID = 2,     /* a bad argument (size, handle, stream, NULL) */
  TIDE_ERR_BAD_POINTER = 3, /* a pointer this allocator never handed out, or an interior one */
  TIDE_ERR_DOUBLE_FREE = 4, /* a pointer that was already freed */
  TIDE_ERR_CONFIG = 5,      /* a bad configuration key or value */
  TIDE_ERR_STATE = 6,       /* the call is not allowed now (after shutdown, config after use) */
  TIDE_ERR_BACKEND = 7,     /* the device backend failed */
  TIDE_ERR_UNAVAILABLE = 8, /* the backend asked for cannot be used on this machine */
  TIDE_ERR_NOT_READY = 9,   /* work is still pending (a query answer, not a failure) */
} tide_status;

/* The name of a status code ("TIDE_ERR_OOM"). Never NULL. */
TIDE_API const char *tide_status_name(tide_status status);
/* The message of the last failure on the calling thread, or "" if there was
 * none. Valid until the next tidalloc call on this thread. */
TIDE_API const char *tide_last_error(void);
/* The status of the last failure on the calling thread (TIDE_OK if none). */
TIDE_API tide_status tide_last_status(void);
/* Forget the last failure of the calling thread. */
TIDE_API void tide_clear_error(void);

/* The library version, as TIDE_VERSION_STRING. */
TIDE_API const char *tide_version(void);

/* ------------------------------------------------------------------------ */
/* Configuration                                                            */
/* ------------------------------------------------------------------------ */

/* A set of options. Options are written "key:value,key:value" as in
 * PYTORCH_CUDA_ALLOC_CONF; the keys PyTorch users know keep their meaning.
 * `tidalloc info` prints every option with its value and where it came from. */
typedef struct tide_config tide_config;

typedef enum tide_config_source {
  TIDE_CONFIG_DEFAULT = 0,     /* nobody set it */
  TIDE_CONFIG_ENVIRONMENT = 1, /* from the TIDALLOC_CONF environment variable */
  TIDE_CONFIG_CODE = 2,        /* from tide_config_set/parse or tide_config_process_set */
} tide_config_source;

/* One option, as tide_config_option describes it. Strings belong to the
 * config and stay valid until it is changed or freed. */
typedef struct tide_option_info {
  const char *key;
  const char *value; /* the current value, formatted */
  const char *default_value;
  const char *meaning; /* one line */
  tide_config_source source;
} tide_option_info;

/* A new config holding every default. */
TIDE_NODISCARD TIDE_API tide_status tide_config_new(tide_config **out);
TIDE_API void tide_config_free(tide_config *config);
/* Apply the TIDALLOC_CONF environment variable (absent or empty: no change). */
TIDE_NODISCARD TIDE_API tide_status tide_config_load_env(tide_config *config);
/* Apply "key:value,key:value". On error nothing is applied. */
TIDE_NODISCARD TIDE_API tide_status tide_config_parse(tide_config *config, const char *text);
/* Set one option from its text form. */
TIDE_NODISCARD TIDE_API tide_status tide_config_set(tide_config *config, const char *key,
                                                    const char *value);
/* The current value of one option, formatted, into buf (always terminated). */
TIDE_NODISCARD TIDE_API tide_status tide_config_get(const tide_config *config, const char *key,
                                                    char *buf, size_t len);
/* A sentence for the user about the config, or NULL: a key of an earlier
 * version that was accepted but no longer does anything (release_slack,
 * release_limit, wait_limit), naming it and what to do. The library never
 * prints it; a launcher or program may. Valid until the config changes. */
TIDE_API const char *tide_config_notice(const tide_config *config);
/* The number of options, and a description of the i-th (0-based). */
TIDE_API size_t tide_config_option_count(void);
TIDE_NODISCARD TIDE_API tide_status tide_config_option(const tide_config *config, size_t index,
                                                       tide_option_info *out);

/* The process-wide configuration used by tide_device(): defaults, then
 * TIDALLOC_CONF, then every tide_config_process_set() call made before first use. After
 * the first tide_device() a change is refused with TIDE_ERR_STATE (and the
 * message says which keys would have changed), never silently ignored. */
TIDE_NODISCARD TIDE_API tide_status tide_config_process_set(const char *text);
/* A copy of the process-wide configuration, to read it. Free with tide_config_free. */
TIDE_NODISCARD TIDE_API tide_status tide_config_process_get(tide_config **out);

/* ------------------------------------------------------------------------ */
/* Allocators                                                               */
/* ------------------------------------------------------------------------ */

typedef struct tide_allocator tide_allocator;

/* A stream of work on the device. On the CUDA backend it is a CUstream
 * (cudaStream_t); NULL is the default stream. On the host backend, streams are
 * emulated and come from tide_stream_create. */
typedef struct tide_stream_st *tide_stream;

/* An allocator for one device, configured by `config` (NULL: defaults, then
 * TIDALLOC_CONF). The config is copied. */
TIDE_NODISCARD TIDE_API tide_status tide_create(int device, const tide_config *config,
                                                tide_allocator **out);
/* Destroy an allocator and return all of its memory to the device. Blocks not
 * freed are released too; the call reports them with TIDE_ERR_STATE after
 * doing so (the allocator is gone either way). */
TIDE_API tide_status tide_destroy(tide_allocator *alloc);

/* The process-wide allocator of a device, created on first use from the
 * process-wide configuration. NULL (with a message) if it cannot be created
 * or after tide_shutdown. */
TIDE_NODISCARD TIDE_API tide_allocator *tide_device(int device);
/* Destroy every process-wide allocator. Later tide_device calls fail with
 * TIDE_ERR_STATE. */
TIDE_API tide_status tide_shutdown(void);

/* ------------------------------------------------------------------------ */
/* Allocation                                                               */
/* ------------------------------------------------------------------------ */

/* At least `size` bytes of device memory, aligned to 512 bytes, for use on
 * `stream`. NULL on failure: size 0 or too large (TIDE_ERR_INVALID), or out
 * of memory after freeing cached memory and retrying (TIDE_ERR_OOM, with a
 * message naming the request, allocated, reserved, the device's free memory,
 * the largest free block and what to try). */
TIDE_NODISCARD TIDE_API void *tide_malloc(tide_allocator *alloc, size_t size,
                                          tide_stream stream) TIDE_MALLOC TIDE_ALLOC_SIZE(2);

/* Free a block. `stream` is the stream whose queued work last uses it:
 * normally the stream it was allocated on, in which case the block is reused
 * at once by later work on that stream. If `stream` is another stream, the
 * block is reused only after the work queued on `stream` up to now is done.
 * A NULL ptr is a no-op. */
TIDE_API tide_status tide_free(tide_allocator *alloc, void *ptr, tide_stream stream);
/* As tide_free, checking that `size` is the size that was asked for. A wrong
 * size frees nothing and returns TIDE_ERR_INVALID. */
TIDE_API tide_status tide_free_sized(tide_allocator *alloc, void *ptr, size_t size,
                                     tide_stream stream);
/* Free a block on the stream it was allocated on, for callers that do not
 * know that stream (PyTorch's deleters get only the pointer): as tide_free
 * with the block's own stream. `hint` is the stream to look in first; when
 * it is the block's stream the call costs what tide_free costs, otherwise
 * every stream's blocks are searched. */
TIDE_API tide_status tide_free_home(tide_allocator *alloc, void *ptr, tide_stream hint);
/* Mark a block as used on another stream: when freed, it is reused only after
 * the work queued on `stream` up to the free is done. */
TIDE_API tide_status tide_record_stream(tide_allocator *alloc, void *ptr, tide_stream stream);

/* The block containing `ptr`: its start, its usable size and its stream. */
TIDE_NODISCARD TIDE_API tide_status tide_block_info(tide_allocator *alloc, const void *ptr,
                                                    void **base, size_t *size, tide_stream *stream);

/* Return every cached free page and segment to the device. Blocks waiting on
 * other streams are waited for first, and so are the streams of growable
 * buffers' shrinks, whose pages then go too. */
TIDE_API tide_status tide_empty_cache(tide_allocator *alloc);

/* Limit reserved memory to a fraction (0, 1] of the device's total memory, or
 * to a number of bytes (0 here: no byte limit). The smaller of the two
 * applies; tide_stats.memory_limit gives the bytes it comes to. */
TIDE_API tide_status tide_set_memory_fraction(tide_allocator *alloc, double fraction);
TIDE_API tide_status tide_set_memory_limit(tide_allocator *alloc, size_t bytes);

/* ------------------------------------------------------------------------ */
/* Streams                                                                  */
/* ------------------------------------------------------------------------ */

/* Create, synchronize and destroy streams through the allocator's backend
 * (on CUDA a plain CUstream; on the host backend an emulated stream). */
TIDE_NODISCARD TIDE_API tide_status tide_stream_create(tide_allocator *alloc, tide_stream *out);
TIDE_API tide_status tide_stream_destroy(tide_allocator *alloc, tide_stream stream);
TIDE_API tide_status tide_stream_synchronize(tide_allocator *alloc, tide_stream stream);

/* Copy `bytes` bytes from `src` to `dst`, ordered on `stream`. Either side
 * may be device memory (of any device the addresses are known to) or host
 * memory; with device or pinned memory on both sides the copy is
 * asynchronous: it is queued on `stream` and the call returns at once, so
 * synchronize the stream before the CPU reads the destination. The ranges
 * must not overlap. 0 bytes is a no-op. On CUDA it is cuMemcpyAsync (unified
 * addressing); on the host backend the copy is done at once, even on a held
 * stream, and a range that reaches into emulated device memory must be
 * mapped, or the copy is refused. */
TIDE_NODISCARD TIDE_API tide_status tide_memcpy(tide_allocator *alloc, void *dst, const void *src,
                                                size_t bytes, tide_stream stream);

/* ------------------------------------------------------------------------ */
/* Statistics, snapshots and the trace                                      */
/* ------------------------------------------------------------------------ */

typedef struct tide_stat {
  int64_t current;
  int64_t peak;
} tide_stat;

enum { TIDE_POOL_ALL = 0, TIDE_POOL_SMALL = 1, TIDE_POOL_LARGE = 2, TIDE_POOL_KINDS = 3 };

/* Byte and count statistics, each for all pools, the small pool (requests up
 * to 1 MiB) and the large pool. Peaks are exact: they are the highest value
 * the current figure reached since creation or tide_reset_peak_stats.
 * - allocated: bytes in blocks handed out (rounded sizes);
 * - requested: bytes asked for;
 * - active: allocated plus freed blocks still waiting on another stream;
 * - inactive_split: free bytes in blocks split from larger ones;
 * - reserved: bytes of device memory held (mapped pages, fixed segments). */
/* tide_stats.memory_limit where no limit applies. */
#define TIDE_NO_LIMIT UINT64_MAX

typedef struct tide_stats {
  tide_stat allocated_bytes[TIDE_POOL_KINDS];
  tide_stat requested_bytes[TIDE_POOL_KINDS];
  tide_stat active_bytes[TIDE_POOL_KINDS];
  tide_stat inactive_split_bytes[TIDE_POOL_KINDS];
  tide_stat reserved_bytes[TIDE_POOL_KINDS];
  tide_stat allocations[TIDE_POOL_KINDS];    /* live allocations */
  tide_stat active_blocks[TIDE_POOL_KINDS];  /* allocations plus blocks waiting on streams */
  tide_stat inactive_split[TIDE_POOL_KINDS]; /* free split blocks */
  tide_stat segments[TIDE_POOL_KINDS];       /* fixed and expandable segments */
  uint64_t num_allocs;                       /* successful tide_malloc calls */
  uint64_t num_frees;                        /* successful frees */
  uint64_t pages_mapped;                     /* pages mapped into expandable segments */
  uint64_t pages_unmapped;                   /* pages unmapped from them */
  uint64_t segments_created;
  uint64_t segments_released;
  uint64_t num_alloc_retries;    /* allocations that freed cached memory and retried */
  uint64_t num_ooms;             /* allocations that failed for lack of memory */
  uint64_t num_sync_all_streams; /* times the allocator waited for pending streams */
  uint64_t num_device_alloc;     /* backend calls that created physical memory */
  uint64_t num_device_free;      /* backend calls that released it */
  uint64_t oversize_allocations; /* live allocations of at least max_split_size */
  /* Bytes reserved memory may reach now, as enforced: the smaller of
   * memory_fraction of the device's total memory and memory_limit, the
   * device's total memory when neither is set. 0 means 0 bytes (a fraction
   * too small for one byte): nothing more can be reserved. TIDE_NO_LIMIT
   * where no limit applies (the pinned pool). */
  uint64_t memory_limit;
  /* Physical handles mapped into expandable segments and growable buffers
   * and unmapped from them (a ring's pages count twice: they are mapped at
   * two addresses): the driver's work is per mapping (a map and an access
   * change each, or an unmap), whatever its size; see handle_size_mb. */
  uint64_t mappings;
  uint64_t unmappings;
  /* Times the allocator blocked the calling thread until a stream or an
   * event was done, to unmap memory queued work may still read or to reuse
   * a block another stream used: each one drains that stream's queue while
   * the CPU waits. */
  uint64_t stream_waits;
  /* Nanoseconds the calling threads spent in the device's calls that create,
   * map, make accessible, unmap and release memory (segments, growable
   * buffers, imported memory), summed over threads: what growing and
   * shrinking memory cost the program, tens of microseconds a mapping on a
   * GPU. The cached path makes no such call. */
  uint64_t mapping_ns;
  /* Times the allocator asked the device how much memory it has free, and
   * the nanoseconds those calls took (summed over threads): growth asks
   * before it takes more, and allocations past the quick blocks ask now and
   * then whether others need memory back (docs/design.md, "Memory by
   * pressure"). The cached path makes no such call. */
  uint64_t device_queries;
  uint64_t device_query_ns;
  /* Nanoseconds allocations the device could not hold spent waiting for
   * others (another process, another allocator of the device) to give
   * memory back, before they succeeded or failed for lack of memory (summed
   * over threads; docs/design.md, "Memory by pressure"). 0 where no other
   * held memory beyond the device's low-water mark when one failed. */
  uint64_t others_wait_ns;
  uint64_t reserved_u64[1]; /* for future use; zero */
} tide_stats;

TIDE_NODISCARD TIDE_API tide_status tide_get_stats(tide_allocator *alloc, tide_stats *out);
/* Set every peak to its current value. */
TIDE_API tide_status tide_reset_peak_stats(tide_allocator *alloc);

/* A JSON document of every segment and block: address, size, state, stream,
 * requested size, mapped or not. Free the text with tide_string_free. */
TIDE_NODISCARD TIDE_API tide_status tide_snapshot_json(tide_allocator *alloc, char **out,
                                                       size_t *len);
TIDE_API void tide_string_free(char *text);

/* The same picture as arrays, for programs that build their own (PyTorch's
 * memory snapshot): every segment, with its blocks in address order (they
 * tile it: unmapped ranges of expandable segments are blocks too). */
enum {
  TIDE_BLOCK_FREE = 0,      /* cached, free for the segment's stream */
  TIDE_BLOCK_ALLOCATED = 1, /* handed out */
  TIDE_BLOCK_PENDING = 2,   /* freed, waiting for work queued on other streams */
  TIDE_BLOCK_UNMAPPED = 3,  /* address space of an expandable segment with no memory */
};

typedef struct tide_block_view {
  uint64_t address;
  uint64_t size;
  uint64_t requested; /* allocated blocks: the bytes asked for; 0 otherwise */
  uint32_t state;     /* TIDE_BLOCK_* */
  uint32_t reserved_;
} tide_block_view;

typedef struct tide_segment_view {
  uint64_t address;
  uint64_t size;   /* address space, mapped or not */
  uint64_t mapped; /* bytes of memory mapped into it */
  tide_stream stream;
  uint64_t capture_pool; /* tide_pool_id of the capture pool it serves; 0: usual memory */
  uint32_t large;        /* 1: the large pool (requests over 1 MiB), 0: the small pool */
  uint32_t expandable;   /* 1: an expandable segment, 0: a fixed one */
  size_t first_block;    /* its blocks: blocks[first_block .. first_block + num_blocks) */
  size_t num_blocks;
} tide_segment_view;

typedef struct tide_layout {
  tide_segment_view *segments;
  size_t num_segments;
  tide_block_view *blocks;
  size_t num_blocks;
} tide_layout;

/* Fill *out (free it with tide_layout_free). Each arena is read under its
 * lock, one after the other. */
TIDE_NODISCARD TIDE_API tide_status tide_layout_get(tide_allocator *alloc, tide_layout *out);
TIDE_API void tide_layout_free(tide_layout *layout);

typedef enum tide_trace_kind {
  TIDE_TRACE_ALLOC = 0,
  TIDE_TRACE_FREE = 1,  /* the user freed a block (it may still wait on streams) */
  TIDE_TRACE_MAP = 2,   /* pages mapped into a segment, or a fixed segment created */
  TIDE_TRACE_UNMAP = 3, /* pages unmapped, or a fixed segment released */
  TIDE_TRACE_OOM = 4,   /* an allocation failed for lack of memory */
  TIDE_TRACE_EMPTY_CACHE = 5,
} tide_trace_kind;

typedef struct tide_trace_event {
  uint64_t seq;     /* 0, 1, 2, ... in the order events happened */
  uint64_t time_ns; /* monotonic clock */
  uint32_t kind;    /* tide_trace_kind */
  uint32_t pool;    /* TIDE_POOL_SMALL or TIDE_POOL_LARGE (0 if none) */
  uint64_t addr;
  uint64_t size;
  tide_stream stream;
} tide_trace_event;

/* Copy up to `cap` of the newest trace events into `out`, oldest first; `n`
 * gets how many were copied and `dropped` (if not NULL) how many older events
 * the ring overwrote. The ring holds the `trace` configuration key's count of
 * events (0: tracing off). */
TIDE_NODISCARD TIDE_API tide_status tide_trace_read(tide_allocator *alloc, tide_trace_event *out,
                                                    size_t cap, size_t *n, uint64_t *dropped);

/* Check the allocator's internal consistency: that the blocks of every
 * segment tile it without gaps or overlaps, that free blocks are merged and
 * sit in the right size bin, that the map of live blocks, the lists of
 * pending and unmapped blocks and the mapped pages agree with the blocks,
 * that every statistic equals its sum over the blocks, and the same for the
 * pinned pool. TIDE_OK, or TIDE_ERR_STATE with the first broken invariant in
 * tide_last_error(). It takes every lock of the allocator for the length of
 * a walk over all blocks and changes nothing: call it between operations
 * (after each step of a test, or when chasing a corruption), not on a hot
 * path. Safe while other threads use the allocator. */
TIDE_NODISCARD TIDE_API tide_status tide_check(tide_allocator *alloc);

/* ------------------------------------------------------------------------ */
/* Growable buffers                                                         */
/* ------------------------------------------------------------------------ */

/* A growable buffer reserves `capacity` bytes of address space once and maps
 * physical pages into it as its length grows, unmapping them as it shrinks:
 * its address never changes, so a KV cache can grow in place (no copy) and a
 * CUDA graph that reads it stays valid. Pages are the device's mapping
 * granularity (2 MiB on current GPUs).
 *
 * map_ahead keeps that many bytes mapped beyond the length, so most growth
 * costs no backend call; with async_map_ahead a worker thread of the buffer
 * maps them after each growth, off the caller's thread. Pages are whole: the
 * mapped pages are the fewest that cover length + map_ahead, so a map_ahead
 * of a few growths' bytes maps the next page only as the length nears it
 * (memory held beyond the length: the partial page, and the next one only
 * then), where a map_ahead of a page keeps one to two pages beyond it.
 * map_ahead_fraction bounds map_ahead by the length: with 0.01, the pages
 * mapped beyond the last one the length touches are whole pages within 1% of
 * the length (so a short buffer maps only what it needs, and the memory held
 * beyond its length stays a fraction of it, however large a step map_ahead
 * covers); 0 leaves map_ahead as it is. A shrink unmaps pages
 * only once the work queued on the stream passed to it is done (an event
 * decides; nothing waits).
 *
 * A ring buffer (ring != 0) of capacity W is W bytes of physical pages mapped
 * twice, back to back: the bytes at data + x and data + W + x are the same, so
 * a window of up to W bytes starting anywhere in [0, W) is contiguous. Its
 * pages are mapped at creation; its length is always W.
 *
 * Accounting: mapped pages count in reserved bytes (and against the memory
 * limit), the length in allocated and requested bytes (large pool), each
 * buffer as one allocation, in the figures of the stream given at creation.
 * A buffer is used by one thread at a time (the worker synchronizes itself);
 * tide_destroy destroys the buffers left. */
typedef struct tide_buf tide_buf;

typedef struct tide_buf_options {
  size_t capacity;           /* bytes of address space (rounded up to the page); for a ring, W */
  int ring;                  /* nonzero: a ring buffer, mapped twice */
  size_t map_ahead;          /* bytes kept mapped beyond the length, at least (0: none) */
  int async_map_ahead;       /* nonzero: a worker thread maps ahead */
  tide_stream stream;        /* whose figures the buffer joins, and the default for resizes */
  double map_ahead_fraction; /* nonzero: map ahead at most this fraction of the length */
} tide_buf_options;

/* Defaults: everything zero. */
TIDE_API void tide_buf_options_init(tide_buf_options *options);
/* Reserve the range (and, for a ring, map it whole). TIDE_ERR_INVALID for a
 * zero or too large capacity or an unknown stream; TIDE_ERR_OOM when a ring's
 * pages pass the memory limit or the device has no more. */
TIDE_NODISCARD TIDE_API tide_status tide_buf_create(tide_allocator *alloc,
                                                    const tide_buf_options *options,
                                                    tide_buf **out);
/* Unmap and release everything. Waits for the streams of pending shrinks;
 * if that wait fails (TIDE_ERR_NOT_READY on a held host stream, say) the
 * buffer is kept as it was. Work queued that still reads the buffer must be
 * done first, as with any free. */
TIDE_API tide_status tide_buf_destroy(tide_buf *buf);
/* tide_buf_destroy once the work queued on `stream` (the stream of the
 * buffer's last use) is done: waits for it, and if that wait fails (the
 * stream is being captured, or a held host stream) the buffer is kept as it
 * was. A shrink lets go only the pages past what it keeps mapped ahead, and a
 * ring never shrinks, so this is how a buffer goes safely while work that
 * reads it may still be queued. */
TIDE_API tide_status tide_buf_destroy_after(tide_buf *buf, tide_stream stream);
/* Set the length. Growing maps the pages missing, giving the allocator's
 * cached memory back first if memory runs out (TIDE_ERR_OOM past the device
 * or memory limit even then, with a message; the length then stays as it
 * was); a failure of the worker mapping ahead, other than running out of
 * memory, is the next call's error;
 * shrinking lets pages go once the work queued on `stream` is done. Data
 * below min(old, new) length is kept. TIDE_ERR_INVALID beyond the capacity
 * or for a ring. */
TIDE_NODISCARD TIDE_API tide_status tide_buf_resize(tide_buf *buf, size_t length,
                                                    tide_stream stream);
/* Map pages for `length` bytes now without changing the length, such as
 * before a frame that will need them. */
TIDE_API tide_status tide_buf_reserve_ahead(tide_buf *buf, size_t length);
TIDE_API void *tide_buf_data(const tide_buf *buf);
TIDE_API size_t tide_buf_length(const tide_buf *buf);
TIDE_API size_t tide_buf_capacity(const tide_buf *buf);
/* Bytes mapped now (pages waiting to be unmapped included). */
TIDE_API size_t tide_buf_mapped(const tide_buf *buf);

/* ------------------------------------------------------------------------ */
/* Capture pools: the memory of CUDA graphs                                 */
/* ------------------------------------------------------------------------ */

/* A capture pool is private memory for CUDA graphs, as PyTorch's graph pools
 * (not to be confused with the small and large size classes of the
 * statistics, TIDE_POOL_SMALL and TIDE_POOL_LARGE). A graph replays the
 * kernels its capture recorded at the addresses the capture allocated, also
 * those of blocks the capture freed again: so what a capture allocates must
 * come from memory no other allocation can take while the graph may run.
 *
 * - Which allocations go to a pool: after tide_capture_begin(alloc, stream,
 *   pool) on a stream that is being captured, every allocation on a stream of
 *   that capture (the stream, and streams forked from it, which share its
 *   capture id; cuStreamGetCaptureInfo on CUDA) goes to `pool`, until
 *   tide_capture_end. Allocations on other streams go to the allocator's
 *   usual memory. A begin on a stream that is not being captured sends that
 *   stream's allocations to the pool until the end (to grow a pool between
 *   replays, say). With the `capture_detection` option, an allocation on a
 *   stream being captured with no begin goes to a pool the allocator makes
 *   for that capture; tide_capture_pool gives it, with one user (the graph)
 *   to release when the graph is destroyed.
 * - Frees during a capture: a block of a pool freed on its own stream can be
 *   taken again by a later allocation of the same capture (the graph orders
 *   them), and never returns to the allocator's usual memory. A block of the
 *   usual memory freed by a stream being captured, and any free that would
 *   have to wait for a stream being captured, is deferred: the block becomes
 *   reusable only once those streams are no longer captured.
 * - Life: a pool lives while it has users. tide_pool_create gives one (the
 *   caller's); every tide_capture_begin takes one more, for the graph being
 *   captured, which tide_pool_release gives back when that graph is
 *   destroyed (right after tide_capture_end if nothing is kept, as after a
 *   begin used to grow a pool); tide_pool_retain takes one more. Several
 *   graphs may share one pool. While a pool has users its memory is never
 *   returned, not even by tide_empty_cache or the out-of-memory path; pages
 *   are mapped into its expandable segments during captures and between
 *   replays as it grows, and blocks never move. When the last user goes,
 *   its free memory goes back to the device at once, and the memory of
 *   blocks still allocated once they are freed and tide_empty_cache runs;
 *   then the pool is gone and its handle must not be used again. Graphs
 *   replay, and their outputs are read, on streams the allocator does not
 *   see, so giving a pool's memory back first waits for the whole device
 *   (every stream); while a capture is begun or watched (or frees wait for
 *   one) that wait would invalidate it, and the memory stays until a
 *   tide_empty_cache after the capture.
 * - Blocks a capture freed are free in the pool afterwards, and the graph's
 *   replays write them: a later allocation in the pool on the same stream
 *   (in a later capture, or after a begin outside a capture) may take them.
 *   That is right when graphs replay in the order they were captured (what
 *   PyTorch assumes of graphs sharing a pool); otherwise allocate on another
 *   stream (each stream has its own memory in the pool) or checkpoint and
 *   restore around the allocations, as graph trees do.
 * - Statistics: tide_get_stats counts pools' memory with the rest;
 *   tide_pool_get_stats gives one pool's figures.
 *
 * A begin must come after the capture has begun on `stream` (after
 * cudaStreamBeginCapture) for forked streams to be recognised, and the end
 * after cudaStreamEndCapture. */
typedef struct tide_pool tide_pool;

/* A new pool of `alloc`, with one user (the caller). */
TIDE_NODISCARD TIDE_API tide_status tide_pool_create(tide_allocator *alloc, tide_pool **out);
/* One more user of `pool` (a graph that shares it). */
TIDE_API tide_status tide_pool_retain(tide_pool *pool);
/* One user fewer. The last one returns the pool's free memory to the
 * device, after waiting for the whole device (a replay of a graph may still
 * run on any stream); TIDE_ERR_NOT_READY (or a backend error) says that some
 * of it could not be returned yet (the device cannot be waited for now: a
 * capture is under way, say): it goes back at the next tide_empty_cache. Refused with
 * TIDE_ERR_STATE when the only users left are captures still in progress (end them first). */
TIDE_API tide_status tide_pool_release(tide_pool *pool);
/* A number naming the pool, never reused in the process (snapshots show it
 * as "capture_pool"; 0 there is the allocator's usual memory). 0 for a bad
 * handle. */
TIDE_API uint64_t tide_pool_id(const tide_pool *pool);
/* The figures of one pool, as tide_get_stats gives them for the allocator
 * (the counters are those of the pool's blocks; peaks are per stream). */
TIDE_NODISCARD TIDE_API tide_status tide_pool_get_stats(tide_pool *pool, tide_stats *out);

/* Allocations of the capture `stream` is in (or, if it is not being
 * captured, of `stream`) go to `pool` until tide_capture_end(alloc, stream).
 * Takes a user of the pool, for the graph. TIDE_ERR_STATE if `stream`
 * already has a begin, or its capture already allocates to a pool. */
TIDE_API tide_status tide_capture_begin(tide_allocator *alloc, tide_stream stream, tide_pool *pool);
/* The end of tide_capture_begin on `stream`; frees deferred by the capture
 * become reusable once no stream they wait for is captured any more. */
TIDE_API tide_status tide_capture_end(tide_allocator *alloc, tide_stream stream);
/* The pool an allocation on `stream` would go to now; TIDE_ERR_INVALID
 * (and *out NULL) when it would go to the allocator's usual memory. */
TIDE_NODISCARD TIDE_API tide_status tide_capture_pool(tide_allocator *alloc, tide_stream stream,
                                                      tide_pool **out);

/* For callers that decide themselves which allocations go to a pool (such
 * as PyTorch, whose beginAllocateToPool gives a filter of streams or
 * threads): tide_pool_malloc allocates in `pool` for `stream`, as
 * tide_malloc does in the allocator's usual memory (free it with tide_free
 * or tide_free_home). While such a caller's capture is under way, it
 * brackets it with tide_capture_watch_begin and _end: frees then ask
 * whether the streams they wait for are being captured, and are deferred
 * until the capture ends where they must be, as during tide_capture_begin's
 * captures. The calls nest. */
TIDE_NODISCARD TIDE_API void *tide_pool_malloc(tide_pool *pool, size_t size,
                                               tide_stream stream) TIDE_MALLOC TIDE_ALLOC_SIZE(2);
TIDE_API tide_status tide_capture_watch_begin(tide_allocator *alloc);
/* TIDE_ERR_STATE without a begin to end. */
TIDE_API tide_status tide_capture_watch_end(tide_allocator *alloc);
/* graph_capture_record_stream_reuse (the option sets it at creation; this
 * switches it at run time, as PyTorch's setting may change between
 * captures): while on (nonzero), a capture pool's block freed during a
 * capture after use on other streams (tide_record_stream, or a free on
 * another stream) is taken again by allocations on its own stream in the
 * same capture as soon as the capture's graph orders every such use before
 * that stream's next work (the streams joined), not only after the capture
 * ends. It asks the driver for the graph's dependencies while such a free
 * waits. Frees made while it is off wait for the capture's end. */
TIDE_API tide_status tide_capture_reuse_set(tide_allocator *alloc, int on);
/* The addresses of the blocks allocated in `pool` now: up to `cap` of them
 * into `out` (may be NULL with cap 0), their number into *count (which may
 * be more than cap: call again with room for them). What PyTorch's
 * checkPoolLiveAllocations compares with the tensors it knows are alive. */
TIDE_NODISCARD TIDE_API tide_status tide_pool_allocated(tide_pool *pool, void **out, size_t cap,
                                                        size_t *count);

/* Checkpoint and restore: what graph-tree runtimes do between replays of
 * different graphs that share a pool (PyTorch's getCheckpointState and
 * setCheckpointPoolState).
 *
 * A checkpoint records the pool's segments and their blocks: which are
 * allocated (address, size, requested size), free, or unmapped. Restoring it
 * brings the pool back to that state: every block allocated in the
 * checkpoint is allocated again at the same address with the same size, and
 * everything else in the pool is free. Blocks allocated both now and in the
 * checkpoint (same address and size) stay as they are. The layout around
 * them is rebuilt from the checkpoint's addresses, whatever happened since:
 * segments that grew (pages mapped since), free blocks that merged across
 * what were separate blocks, segments made since. Pages mapped since the
 * checkpoint stay mapped (a graph captured since may still use them); so
 * reserved memory does not go down, and the other figures are exact. The
 * allocation state is restored, not the contents of the memory. The
 * restore first waits for frees of the pool's blocks that wait on other
 * streams; if that fails, or host memory runs out, nothing else changes.
 * Refused with TIDE_ERR_STATE while a capture allocates to the pool or a
 * free of its blocks is deferred by a capture, TIDE_ERR_NOT_READY while such
 * a free, its captures ended, still waits for work on its streams that
 * cannot be waited for now (a held stream), and TIDE_ERR_INVALID for a
 * checkpoint of another pool. */
typedef struct tide_checkpoint tide_checkpoint;

/* What a restore changed, for the caller to bring its own records in line. */
typedef struct tide_restore_delta {
  void **restored;  /* allocated in the checkpoint but not before the restore (freed since): */
  size_t nrestored; /* allocated again, the caller's to free */
  void **released;  /* allocated before the restore but not in the checkpoint: */
  size_t nreleased; /* free now, the pointers no longer valid */
} tide_restore_delta;

/* The state of `pool` now. Free with tide_checkpoint_free. */
TIDE_NODISCARD TIDE_API tide_status tide_pool_checkpoint(tide_pool *pool, tide_checkpoint **out);
/* Bring `pool` back to `checkpoint`; `delta` (may be NULL) gets the blocks
 * that changed hands, to free with tide_restore_delta_free. */
TIDE_NODISCARD TIDE_API tide_status tide_pool_restore(tide_pool *pool,
                                                      const tide_checkpoint *checkpoint,
                                                      tide_restore_delta *delta);
TIDE_API void tide_checkpoint_free(tide_checkpoint *checkpoint);
/* The blocks allocated in a checkpoint, in address order: up to `cap` of
 * them into `out` (may be NULL with cap 0); returns how many there are.
 * With a restore's delta it gives what PyTorch's CheckpointDelta holds: the
 * blocks allocated before the restore are `released` plus those of the
 * checkpoint that are not `restored` (they stayed allocated), the blocks
 * allocated after it are all of the checkpoint's. */
TIDE_API size_t tide_checkpoint_allocated(const tide_checkpoint *checkpoint, void **out,
                                          size_t cap);
TIDE_API void tide_restore_delta_free(tide_restore_delta *delta);

/* ------------------------------------------------------------------------ */
/* Sharing memory between processes                                         */
/* ------------------------------------------------------------------------ */

/* An allocated block can be mapped by another process on the same machine.
 * Its memory is made of pieces (the pages of an expandable segment, or the
 * one handle of a fixed segment), each exported as a POSIX file descriptor
 * (cuMemExportToShareableHandle on CUDA; the emulated device's memory file
 * on the host backend). The descriptors travel between processes over a
 * Unix-domain socket (tide_share_send / tide_share_recv, or any other
 * SCM_RIGHTS channel); the importer maps the pieces back to back at an
 * address of its own.
 *
 * The exporter keeps the block allocated for as long as importers use it:
 * once it is freed, the exporter may hand its memory out again. An importer
 * that keeps a mapping after that keeps the pages alive, no longer shared.
 * Imported memory is not counted in the importer's figures. */
typedef struct tide_share_desc {
  uint64_t size;       /* bytes of the block */
  uint64_t offset;     /* where the block starts in the first piece */
  uint32_t num_pieces; /* descriptors, in address order */
  int32_t device;      /* the exporter's device */
  uint32_t backend;    /* 0: host backend, 1: CUDA; the importer's must match */
  uint32_t reserved;
} tide_share_desc;

typedef struct tide_share_piece {
  int fd; /* a POSIX file descriptor, owned by whoever holds the piece */
  uint32_t pad;
  uint64_t offset; /* where the piece's memory starts in what fd refers to */
  uint64_t size;   /* bytes of the piece (a multiple of the granularity) */
} tide_share_piece;

/* Export the allocated block that holds `ptr`: fills *desc and returns a
 * malloc'd array of desc->num_pieces pieces whose descriptors the caller
 * owns (tide_share_pieces_close closes and frees them).
 * TIDE_ERR_BAD_POINTER when ptr is not in an allocated block;
 * TIDE_ERR_UNAVAILABLE when the device's memory cannot be exported. */
TIDE_NODISCARD TIDE_API tide_status tide_share_export(tide_allocator *alloc, const void *ptr,
                                                      tide_share_desc *desc,
                                                      tide_share_piece **pieces);
/* Close the descriptors of n pieces and free the array (NULL is a no-op). */
TIDE_API void tide_share_pieces_close(tide_share_piece *pieces, uint32_t n);
/* Map exported memory in this process: *out is the block's address here.
 * The pieces' descriptors stay the caller's (they may be closed at once).
 * The allocator must be of the same backend kind as the exporter's. */
TIDE_NODISCARD TIDE_API tide_status tide_share_import(tide_allocator *alloc,
                                                      const tide_share_desc *desc,
                                                      const tide_share_piece *pieces, void **out);
/* Unmap memory tide_share_import mapped (ptr: its address). Destroying the
 * allocator unmaps what is left. */
TIDE_API tide_status tide_share_close(tide_allocator *alloc, void *ptr);
/* Send a description and its pieces' descriptors over a connected
 * Unix-domain socket (stream or seqpacket); the descriptors stay the
 * caller's. tide_share_recv receives them: *pieces is malloc'd, its
 * descriptors the caller's (tide_share_pieces_close). */
TIDE_NODISCARD TIDE_API tide_status tide_share_send(int socket, const tide_share_desc *desc,
                                                    const tide_share_piece *pieces);
TIDE_NODISCARD TIDE_API tide_status tide_share_recv(int socket, tide_share_desc *desc,
                                                    tide_share_piece **pieces);

/* ------------------------------------------------------------------------ */
/* Pinned host memory                                                       */
/* ------------------------------------------------------------------------ */

/* A cache of pinned (page-locked) host memory for asynchronous copies to and
 * from the device, such as outputs offloaded every frame. Each allocator has
 * one. Sizes are rounded up to a power of two of at least 4 KiB (pinning
 * works in whole pages), and each size keeps its own free list; cached
 * blocks go back to the system only through tide_pinned_empty_cache, the
 * out-of-memory path or tide_destroy. On CUDA the memory comes from
 * cuMemHostAlloc (portable, mapped into the device's address space, so that
 * kernels may read it too); on the host backend from mmap.
 *
 * Reuse is ordered by streams as for device memory: a block freed on the
 * stream it was allocated on is reused at once by later requests on that
 * stream, and by requests on other streams once the work queued on its
 * stream before the free is done. A block freed on another stream, or
 * recorded on other streams, waits for their queued work first. The CPU is
 * not a stream: before writing into a block with the CPU, make sure the work
 * queued earlier on its stream is done (a block just reused on the same
 * stream may still be the target of the previous owner's copy). */

/* At least `size` bytes of pinned host memory for use on `stream`, aligned
 * to 4 KiB. NULL on failure: size 0 or too large (TIDE_ERR_INVALID), an
 * unknown stream (TIDE_ERR_INVALID), or no pinned memory even after freeing
 * every cached block and retrying (TIDE_ERR_OOM, with a message). */
TIDE_NODISCARD TIDE_API void *tide_pinned_malloc(tide_allocator *alloc, size_t size,
                                                 tide_stream stream) TIDE_MALLOC;
/* Free a pinned block; `stream` as in tide_free. A NULL ptr is a no-op. */
TIDE_API tide_status tide_pinned_free(tide_allocator *alloc, void *ptr, tide_stream stream);
/* Mark a pinned block as used on another stream, as tide_record_stream. */
TIDE_API tide_status tide_pinned_record_stream(tide_allocator *alloc, void *ptr,
                                               tide_stream stream);
/* Return every cached pinned block to the system, waiting first for blocks
 * whose streams still use them. Blocks in use stay. */
TIDE_API tide_status tide_pinned_empty_cache(tide_allocator *alloc);
/* The pinned pool's figures, in the device's struct: allocated, requested,
 * active (allocated plus freed blocks waiting on streams), reserved (pinned
 * bytes held, cached included), allocations, active blocks and segments
 * (each block is one pinned allocation of the backend). The small pool holds
 * the blocks of up to 1 MiB, the large pool the others; inactive_split
 * figures and pages are 0 (blocks are never split), and the memory limit is
 * TIDE_NO_LIMIT (no limit applies to pinned memory). */
TIDE_NODISCARD TIDE_API tide_status tide_pinned_get_stats(tide_allocator *alloc, tide_stats *out);

/* ------------------------------------------------------------------------ */
/* Devices and the backend                                                  */
/* ------------------------------------------------------------------------ */

typedef struct tide_info {
  const char *version;
  const char *backend;     /* "host" or "cuda" */
  const char *device_name; /* "emulated device" or the GPU's name */
  int device;
  int device_count;
  uint64_t total_memory;
  uint64_t free_memory;
  uint64_t granularity; /* the backend's mapping granularity */
  uint64_t page_size;   /* the page size expandable segments map */
} tide_info;

TIDE_NODISCARD TIDE_API tide_status tide_get_info(tide_allocator *alloc, tide_info *out);

#ifdef __cplusplus
}
#endif

#endif /* TIDALLOC_H */
