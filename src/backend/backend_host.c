/* backend_host.c: the host backend, an emulated device in host memory.
 *
 * It mirrors the CUDA driver's virtual memory management closely enough that
 * a test on it fails where the GPU would fail:
 * - Physical memory is one sparse memfd of host_capacity bytes. create() takes
 *   a contiguous run of granularity-sized units of it (a bitmap, first fit);
 *   a handle names a slot of the handle table plus the slot's generation, so
 *   a stale handle is refused. Released memory stays alive while mapped and
 *   its RAM goes back to the system (hole punching) when the last mapping
 *   goes.
 * - reserve() is an inaccessible anonymous mapping; map() puts a window of
 *   the memfd over part of it (inaccessible until set_access), and unmap()
 *   puts the inaccessible anonymous memory back, so the reservation stays.
 *   The same handle may be mapped at several addresses: the views share bytes.
 * - Streams complete their work at once unless held; a held stream keeps
 *   every event recorded on it pending until it is released (as if a long
 *   kernel ran). With host_queue_depth N, an event completes only once N
 *   more have been recorded on its stream, or at its Nth query while
 *   pending (time passes between queries), or once the stream (or the
 *   event) is waited for: a GPU's queue, whose work completes behind the
 *   CPU. Ids of events are slot numbers plus generations; ids of streams
 *   are slot numbers plus a serial number unique in the process, so a
 *   stream of one emulated device is never taken for one of another (a
 *   GPU's streams belong to their context).
 * - Graph capture is emulated (tide_host_capture_*): a stream being captured
 *   has a capture id, which streams joined to it share; waiting for it is
 *   refused as the driver refuses it, and an event recorded on it belongs to
 *   the graph: it never completes until it is recorded again outside a
 *   capture (the driver answers CUDA_ERROR_CAPTURED_EVENT). Its graph is
 *   kept as far as the allocator asks of it: each stream's dependencies
 *   (what its next captured work follows), nodes of work (captured on a
 *   stream with tide_host_capture_work), forks and joins (_join, _wait);
 *   the nodes go when their capture ends.
 * - Pinned host memory (host_alloc) is plain page-aligned anonymous memory,
 *   counted against nothing: the emulated device's capacity is device memory.
 *   Its ranges are remembered, so host_free knows their sizes.
 * - copy() copies at once, even on a held stream: holding models work that
 *   takes long, and a copy ordered on it would only be finished early, which
 *   no correct caller can tell. A range that reaches into reserved address
 *   space must be mapped (else the copy is refused as the driver would), and
 *   one that reaches into pinned memory must stay inside one allocation;
 *   other ranges are ordinary host memory.
 * - Peer access: there is only one address space, so there is nothing to do.
 * - Every operation counts its calls and may be told to fail its n-th call.
 *   It also counts calls and failures per call site (the operation and the
 *   return address of its call), so that a fault sweep can tell which call
 *   sites of the allocator it never made to fail.
 *
 * One mutex guards the tables; call counters and fault triggers are atomics. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend/backend.h"
#include "base/internal.h"

/* Ids pack a generation in the high 32 bits and a slot in the low ones. */
_Static_assert(sizeof(void *) == 8, "the host backend packs ids into 64-bit pointers");

/* ------------------------------------------------------------------------ */
/* Operation names                                                          */
/* ------------------------------------------------------------------------ */

static const char *const op_names[TIDE_OP_COUNT] = {
    [TIDE_OP_ANY] = "any",
    [TIDE_OP_RESERVE] = "reserve",
    [TIDE_OP_UNRESERVE] = "unreserve",
    [TIDE_OP_CREATE] = "create",
    [TIDE_OP_RELEASE] = "release",
    [TIDE_OP_MAP] = "map",
    [TIDE_OP_SET_ACCESS] = "set_access",
    [TIDE_OP_UNMAP] = "unmap",
    [TIDE_OP_STREAM_CREATE] = "stream_create",
    [TIDE_OP_STREAM_DESTROY] = "stream_destroy",
    [TIDE_OP_STREAM_SYNCHRONIZE] = "stream_synchronize",
    [TIDE_OP_EVENT_CREATE] = "event_create",
    [TIDE_OP_EVENT_DESTROY] = "event_destroy",
    [TIDE_OP_EVENT_RECORD] = "event_record",
    [TIDE_OP_EVENT_QUERY] = "event_query",
    [TIDE_OP_EVENT_SYNCHRONIZE] = "event_synchronize",
    [TIDE_OP_MEM_INFO] = "mem_info",
    [TIDE_OP_HOST_ALLOC] = "host_alloc",
    [TIDE_OP_HOST_FREE] = "host_free",
    [TIDE_OP_COPY] = "copy",
    [TIDE_OP_CAPTURE_STATUS] = "capture_status",
    [TIDE_OP_EXPORT] = "export",
    [TIDE_OP_IMPORT] = "import",
    [TIDE_OP_CAPTURE_GRAPH] = "capture_graph",
    [TIDE_OP_DEVICE_SYNCHRONIZE] = "device_synchronize",
};

const char *tide_backend_op_name(tide_backend_op op) {
  if ((int)op < 0 || op >= TIDE_OP_COUNT) return "unknown";
  return op_names[op];
}

/* ------------------------------------------------------------------------ */
/* State                                                                    */
/* ------------------------------------------------------------------------ */

typedef struct host_handle {
  uint32_t gen;  /* bumped when the slot is freed: old handles go stale */
  bool live;     /* holds units of the memfd */
  bool released; /* release() was called; the units go with the last mapping */
  uint32_t maps; /* live mappings of this handle */
  size_t first_unit;
  size_t units;
  /* Imported from another process (import_fd): memory of that fd at
   * `fd_offset`, outside this device's memfd and capacity; -1 otherwise. */
  int fd;
  off_t fd_offset;
} host_handle;

/* A reserved range, or a mapping (then `handle` is its slot in the table). */
typedef struct host_range {
  uintptr_t addr;
  size_t size;
  uint32_t handle;
} host_range;

/* Sorted by address, never overlapping. */
typedef struct range_table {
  host_range *items;
  size_t count;
  size_t cap;
} range_table;

typedef struct host_stream {
  uint64_t serial; /* of its id; 0 while the slot is free */
  bool alive;      /* created and not destroyed (slot 0, the default stream, always) */
  bool held;
  uint64_t capture_id; /* being captured into a graph (0: not) */
  /* While captured: the nodes its next captured work will depend on. */
  uint64_t *deps;
  size_t ndeps, deps_cap;
  uint64_t submitted; /* tickets handed out; never reset, even when the slot is reused */
  uint64_t completed;
} host_stream;

typedef struct host_event {
  uint32_t gen;
  bool alive;
  bool recorded;
  bool captured;   /* last recorded on a stream being captured: part of a graph */
  uint32_t stream; /* slot of the stream it was recorded on */
  uint64_t ticket;
  uint64_t queries; /* since it was recorded, while not done */
} host_event;

/* A node of a graph being captured: work captured on a stream, after the
 * nodes that stream's captured work had reached. */
typedef struct host_node {
  uint64_t capture_id; /* 0 once its capture ended */
  uint64_t *deps;      /* node ids */
  size_t ndeps;
} host_node;

/* Slots freed for reuse. */
typedef struct index_stack {
  uint32_t *items;
  size_t count;
  size_t cap;
} index_stack;

/* Calls of one operation from one call site, in an open-addressed table
 * keyed by (return address << 5 | op); slots are claimed, never freed. */
#define SITE_SLOTS 512u
_Static_assert(TIDE_OP_COUNT <= 32, "site keys keep the operation in 5 bits");

typedef struct host_site {
  _Atomic uint64_t key; /* 0: free */
  _Atomic uint64_t calls;
  _Atomic uint64_t failures;
} host_site;

typedef struct host_device {
  pthread_mutex_t lock;
  int device;
  int device_count;
  int memfd;
  size_t capacity;
  size_t granularity;
  uint64_t queue_depth; /* host_queue_depth */
  size_t units;
  uint64_t *unit_bits; /* 1: used; bits past `units` are set so scans stop there */
  size_t bytes_in_use;
  bool shared; /* host_shared: bytes_in_use counts in shared_in_use[device] too */

  host_handle *handles;
  size_t handle_count, handle_cap;
  index_stack free_handles;

  range_table reserved;
  range_table mapped;
  range_table pinned; /* host_alloc's allocations */

  host_stream *streams; /* slot 0: the default stream */
  size_t stream_count, stream_cap;
  index_stack free_streams;

  host_event *events;
  size_t event_count, event_cap;
  index_stack free_events;
  uint64_t next_capture_id;
  /* Nodes of the captures under way; node id = node_base + index + 1, so
   * ids stay unique after the table is emptied (when no capture is left). */
  host_node *nodes;
  size_t node_count, node_cap;
  uint64_t node_base;

  _Atomic uint64_t calls[TIDE_OP_COUNT];
  _Atomic uint64_t fail_at[TIDE_OP_COUNT];          /* the call number that fails; 0: none */
  _Atomic uint64_t calls_at_failure[TIDE_OP_COUNT]; /* when the last injected failure fired */
  host_site sites[SITE_SLOTS];
} host_device;

/* The bytes that the emulated devices of each number hold, together, where
 * they share it (host_shared): the memory of a GPU that several processes
 * use. Only the counts are shared; each device keeps its own memory. */
static _Atomic size_t shared_in_use[TIDE_HOST_MAX_DEVICES];

/* The bytes in use on the device as its users see it: its own, or, shared,
 * every sharer's. */
static size_t device_in_use(const host_device *d) {
  return d->shared ? atomic_load(&shared_in_use[d->device]) : d->bytes_in_use;
}

/* Take `size` bytes of the device's capacity; false when they do not fit. */
static bool take_capacity(host_device *d, size_t size) {
  if (!d->shared) return size <= d->capacity - d->bytes_in_use;
  size_t used = atomic_load(&shared_in_use[d->device]);
  do {
    if (size > d->capacity || used > d->capacity - size) return false;
  } while (!atomic_compare_exchange_weak(&shared_in_use[d->device], &used, used + size));
  return true;
}

static void give_capacity(host_device *d, size_t size) {
  if (d->shared) atomic_fetch_sub(&shared_in_use[d->device], size);
}

static void lock(host_device *d) { pthread_mutex_lock(&d->lock); }
static void unlock(host_device *d) { pthread_mutex_unlock(&d->lock); }

static const char *bytes_text(uint64_t bytes, char *buf) {
  return _tide_format_bytes(bytes, buf, 32);
}

static int oom_tables(const char *what) {
  return _tide_error_set(TIDE_ERR_OOM, "host backend: out of host memory for its %s table", what);
}

/* ------------------------------------------------------------------------ */
/* Call counting and injected failures                                      */
/* ------------------------------------------------------------------------ */

/* Count a call of `op` from `site`; a full table drops it (no site of the
 * library is near that many). */
static void note_site(host_device *d, tide_backend_op op, uintptr_t site, bool failed) {
  uint64_t key = ((uint64_t)site << 5) | (uint64_t)op;
  uint64_t h = key * UINT64_C(0x9E3779B97F4A7C15);
  for (unsigned probe = 0; probe < SITE_SLOTS; probe++) {
    host_site *s = &d->sites[(unsigned)(h >> 40) % SITE_SLOTS];
    uint64_t have = atomic_load_explicit(&s->key, memory_order_acquire);
    if (have == 0 && atomic_compare_exchange_strong(&s->key, &have, key)) have = key;
    if (have == key) {
      atomic_fetch_add_explicit(&s->calls, 1, memory_order_relaxed);
      if (failed) atomic_fetch_add_explicit(&s->failures, 1, memory_order_relaxed);
      return;
    }
    h += (uint64_t)1 << 40;
  }
}

/* Every counted operation starts here: count the call, then fail it if it
 * is the one a test asked to fail. `site` is the return address of the
 * operation, the allocator's call site (ENTER passes it). */
static int enter(host_device *d, tide_backend_op op, uintptr_t site) {
  uint64_t k = atomic_fetch_add(&d->calls[op], 1) + 1;
  uint64_t any = atomic_fetch_add(&d->calls[TIDE_OP_ANY], 1) + 1;
  bool fail_op = atomic_load(&d->fail_at[op]) == k;
  bool fail_any = !fail_op && atomic_load(&d->fail_at[TIDE_OP_ANY]) == any;
  note_site(d, op, site, fail_op || fail_any);
  if (fail_op || fail_any)
    for (int o = 0; o < TIDE_OP_COUNT; o++)
      atomic_store(&d->calls_at_failure[o], atomic_load(&d->calls[o]));
  if (fail_op)
    return _tide_error_set(TIDE_ERR_BACKEND, "injected failure: %s call %llu", op_names[op],
                           (unsigned long long)k);
  if (fail_any)
    return _tide_error_set(TIDE_ERR_BACKEND,
                           "injected failure: %s call %llu (call %llu of any operation)",
                           op_names[op], (unsigned long long)k, (unsigned long long)any);
  return TIDE_OK;
}

/* In an operation: its own return address is where the allocator called it
 * (operations are only called through the table, never inlined). */
#define ENTER(d, op) enter((d), (op), (uintptr_t)__builtin_return_address(0))

/* ------------------------------------------------------------------------ */
/* Units of the memfd                                                       */
/* ------------------------------------------------------------------------ */

static bool unit_used(const host_device *d, size_t u) {
  return (d->unit_bits[u / 64] >> (u % 64)) & 1;
}

static void units_mark(host_device *d, size_t first, size_t n, bool used) {
  for (size_t u = first; u < first + n; u++) {
    uint64_t bit = (uint64_t)1 << (u % 64);
    if (used)
      d->unit_bits[u / 64] |= bit;
    else
      d->unit_bits[u / 64] &= ~bit;
  }
}

/* First fit: the lowest run of n free units. Whole words are skipped. */
static bool units_find(const host_device *d, size_t n, size_t *first) {
  size_t run = 0, start = 0;
  for (size_t u = 0; u < d->units;) {
    uint64_t word = d->unit_bits[u / 64];
    if (u % 64 == 0 && word == UINT64_MAX) {
      run = 0;
      u += 64;
      continue;
    }
    if (u % 64 == 0 && word == 0) {
      if (run == 0) start = u;
      run += 64;
      u += 64;
    } else {
      if (unit_used(d, u))
        run = 0;
      else if (run++ == 0)
        start = u;
      u++;
    }
    if (run >= n) {
      *first = start;
      return true;
    }
  }
  return false;
}

static size_t units_largest_free_run(const host_device *d) {
  size_t best = 0, run = 0;
  for (size_t u = 0; u < d->units; u++) {
    run = unit_used(d, u) ? 0 : run + 1;
    if (run > best) best = run;
  }
  return best;
}

/* Give the units of a handle back and the RAM behind them to the system. */
static void handle_free(host_device *d, uint32_t slot) {
  host_handle *h = &d->handles[slot];
  if (h->fd >= 0) {
    /* Imported: the exporter's memory, never this device's units. */
    close(h->fd);
    h->fd = -1;
    h->live = false;
    h->released = false;
    h->gen++;
    d->free_handles.items[d->free_handles.count++] = slot;
    return;
  }
  units_mark(d, h->first_unit, h->units, false);
  size_t bytes = h->units * d->granularity;
  /* A failed punch only keeps RAM that a later create reuses: not an error. */
  (void)fallocate(d->memfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                  (off_t)(h->first_unit * d->granularity), (off_t)bytes);
  d->bytes_in_use -= bytes;
  give_capacity(d, bytes);
  h->live = false;
  h->released = false;
  h->gen++;
  /* Room was made when the slot was taken, so this push cannot fail. */
  d->free_handles.items[d->free_handles.count++] = slot;
}

/* The slot of a live, unreleased handle, or false with a message. */
static bool handle_find(host_device *d, _tide_handle handle, const char *op, uint32_t *slot) {
  uint64_t index = (handle & UINT32_MAX);
  uint32_t gen = (uint32_t)(handle >> 32);
  if (index == 0 || index > d->handle_count) {
    _tide_error_set(TIDE_ERR_BACKEND, "%s: unknown handle 0x%llx", op, (unsigned long long)handle);
    return false;
  }
  host_handle *h = &d->handles[index - 1];
  if (h->gen != gen || !h->live || h->released) {
    _tide_error_set(TIDE_ERR_BACKEND, "%s: handle 0x%llx was already released", op,
                    (unsigned long long)handle);
    return false;
  }
  *slot = (uint32_t)(index - 1);
  return true;
}

/* ------------------------------------------------------------------------ */
/* Range tables                                                             */
/* ------------------------------------------------------------------------ */

/* Index of the last range starting at or below addr, or SIZE_MAX. */
static size_t range_find_le(const range_table *t, uintptr_t addr) {
  size_t lo = 0, hi = t->count;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (t->items[mid].addr <= addr)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo == 0 ? SIZE_MAX : lo - 1;
}

/* The range that contains the whole of [addr, addr+size), or SIZE_MAX. */
static size_t range_containing(const range_table *t, uintptr_t addr, size_t size) {
  size_t i = range_find_le(t, addr);
  if (i == SIZE_MAX) return SIZE_MAX;
  const host_range *r = &t->items[i];
  return addr - r->addr + size <= r->size ? i : SIZE_MAX;
}

static bool range_overlaps(const range_table *t, uintptr_t addr, size_t size) {
  /* Ends are sorted as starts are: only the last range starting before our
   * end can reach into us. */
  size_t i = range_find_le(t, addr + size - 1);
  return i != SIZE_MAX && t->items[i].addr + t->items[i].size > addr;
}

/* Whether [addr, addr+size) is covered by ranges without a gap. */
static bool range_covered(const range_table *t, uintptr_t addr, size_t size) {
  size_t i = range_find_le(t, addr);
  uintptr_t end = addr + size, at = addr;
  while (at < end) {
    if (i == SIZE_MAX || i >= t->count) return false;
    const host_range *r = &t->items[i];
    if (r->addr > at || r->addr + r->size <= at) return false;
    at = r->addr + r->size;
    i++;
  }
  return true;
}

static bool range_make_room(range_table *t) {
  return _tide_grow_array((void **)&t->items, &t->cap, t->count + 1, sizeof *t->items);
}

/* Insert in order; room must have been made. */
static void range_insert(range_table *t, host_range r) {
  size_t i = range_find_le(t, r.addr);
  size_t at = i == SIZE_MAX ? 0 : i + 1;
  memmove(&t->items[at + 1], &t->items[at], (t->count - at) * sizeof *t->items);
  t->items[at] = r;
  t->count++;
}

static void range_remove_n(range_table *t, size_t i, size_t n) {
  memmove(&t->items[i], &t->items[i + n], (t->count - i - n) * sizeof *t->items);
  t->count -= n;
}

static void range_remove(range_table *t, size_t i) { range_remove_n(t, i, 1); }

/* ------------------------------------------------------------------------ */
/* Device queries                                                           */
/* ------------------------------------------------------------------------ */

static int host_device_count(void *ctx, int *count) {
  host_device *d = ctx;
  if (!count) return _tide_error_set(TIDE_ERR_INVALID, "device_count: NULL output");
  *count = d->device_count;
  return TIDE_OK;
}

static int host_device_name(void *ctx, char *buf, size_t len) {
  host_device *d = ctx;
  if (!buf || len == 0) return _tide_error_set(TIDE_ERR_INVALID, "device_name: no buffer");
  snprintf(buf, len, "tidalloc emulated device %d", d->device);
  return TIDE_OK;
}

static int host_granularity(void *ctx, size_t *bytes) {
  host_device *d = ctx;
  if (!bytes) return _tide_error_set(TIDE_ERR_INVALID, "granularity: NULL output");
  *bytes = d->granularity;
  return TIDE_OK;
}

static int host_mem_info(void *ctx, size_t *free_bytes, size_t *total_bytes) {
  host_device *d = ctx;
  int rc = ENTER(d, TIDE_OP_MEM_INFO);
  if (rc) return rc;
  if (!free_bytes || !total_bytes)
    return _tide_error_set(TIDE_ERR_INVALID, "mem_info: NULL output");
  lock(d);
  *total_bytes = d->capacity;
  *free_bytes = d->capacity - device_in_use(d);
  unlock(d);
  return TIDE_OK;
}

/* ------------------------------------------------------------------------ */
/* Address space                                                            */
/* ------------------------------------------------------------------------ */

static bool multiple_of(size_t value, size_t unit) { return value % unit == 0; }

static int host_reserve(void *ctx, size_t size, size_t align, uintptr_t *addr) {
  host_device *d = ctx;
  char a[32], b[32];
  int rc = ENTER(d, TIDE_OP_RESERVE);
  if (rc) return rc;
  if (!addr) return _tide_error_set(TIDE_ERR_INVALID, "reserve: NULL output");
  if (align == 0) align = d->granularity;
  if (size == 0 || !multiple_of(size, d->granularity) || !multiple_of(align, d->granularity))
    return _tide_error_set(TIDE_ERR_BACKEND,
                           "reserve: size %zu and alignment %zu must be multiples of the "
                           "granularity (%s), and the size not 0",
                           size, align, bytes_text(d->granularity, a));
  if (size > SIZE_MAX - align)
    return _tide_error_set(
        TIDE_ERR_OOM, "reserve: %zu bytes aligned to %zu exceed the address space", size, align);

  lock(d);
  if (!range_make_room(&d->reserved)) {
    unlock(d);
    return oom_tables("reservation");
  }
  /* Over-reserve by the alignment, then trim both ends. */
  size_t span = size + align;
  void *p = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    unlock(d);
    return _tide_error_set(err == ENOMEM ? TIDE_ERR_OOM : TIDE_ERR_BACKEND,
                           "reserve: could not reserve %s of address space (aligned to %s): %s",
                           bytes_text(size, a), bytes_text(align, b), strerror(err));
  }
  uintptr_t base = (uintptr_t)p;
  uintptr_t start = base + (align - base % align) % align;
  if (start > base) munmap(p, start - base);
  if (base + span > start + size) munmap((void *)(start + size), base + span - (start + size));
  range_insert(&d->reserved, (host_range){.addr = start, .size = size});
  unlock(d);
  *addr = start;
  return TIDE_OK;
}

static int host_unreserve(void *ctx, uintptr_t addr, size_t size) {
  host_device *d = ctx;
  int rc = ENTER(d, TIDE_OP_UNRESERVE);
  if (rc) return rc;
  lock(d);
  size_t i = range_find_le(&d->reserved, addr);
  if (i == SIZE_MAX || d->reserved.items[i].addr != addr || d->reserved.items[i].size != size) {
    unlock(d);
    return _tide_error_set(TIDE_ERR_BACKEND,
                           "unreserve: [0x%llx, +%zu) is not a range that reserve returned",
                           (unsigned long long)addr, size);
  }
  if (range_overlaps(&d->mapped, addr, size)) {
    unlock(d);
    return _tide_error_set(TIDE_ERR_BACKEND,
                           "unreserve: the range at 0x%llx still has memory mapped in it; "
                           "unmap it first",
                           (unsigned long long)addr);
  }
  munmap((void *)addr, size);
  range_remove(&d->reserved, i);
  unlock(d);
  return TIDE_OK;
}

/* ------------------------------------------------------------------------ */
/* Physical memory                                                          */
/* ------------------------------------------------------------------------ */

static int create_oom(host_device *d, size_t size, bool fits_in_total) {
  char req[32], used[32], cap[32], run[32];
  return _tide_error_set(
      TIDE_ERR_OOM,
      "emulated device %d out of memory: asked for %s, %s of %s in use, largest contiguous "
      "free range %s%s",
      d->device, bytes_text(size, req), bytes_text(device_in_use(d), used),
      bytes_text(d->capacity, cap), bytes_text(units_largest_free_run(d) * d->granularity, run),
      fits_in_total ? " (enough is free, but not in one piece)" : "");
}

/* A free slot of the handle table (room on the free stack is made for every
 * slot, so freeing never allocates); false when the tables cannot grow. */
static bool handle_slot(host_device *d, uint32_t *slot) {
  if (d->free_handles.count > 0) {
    *slot = d->free_handles.items[--d->free_handles.count];
    return true;
  }
  if (d->handle_count >= UINT32_MAX ||
      !_tide_grow_array((void **)&d->handles, &d->handle_cap, d->handle_count + 1,
                        sizeof *d->handles) ||
      !_tide_grow_array((void **)&d->free_handles.items, &d->free_handles.cap, d->handle_count + 1,
                        sizeof *d->free_handles.items))
    return false;
  *slot = (uint32_t)d->handle_count++;
  d->handles[*slot] = (host_handle){.fd = -1};
  return true;
}

static int host_create(void *ctx, size_t size, _tide_handle *out) {
  host_device *d = ctx;
  char g[32];
  int rc = ENTER(d, TIDE_OP_CREATE);
  if (rc) return rc;
  if (!out) return _tide_error_set(TIDE_ERR_INVALID, "create: NULL output");
  if (size == 0 || !multiple_of(size, d->granularity))
    return _tide_error_set(TIDE_ERR_BACKEND,
                           "create: size %zu is not a positive multiple of the granularity (%s)",
                           size, bytes_text(d->granularity, g));
  lock(d);
  size_t units = size / d->granularity, first = 0;
  if (!units_find(d, units, &first) || !take_capacity(d, size)) {
    rc = create_oom(d, size, size <= d->capacity - device_in_use(d));
    unlock(d);
    return rc;
  }
  uint32_t slot;
  if (!handle_slot(d, &slot)) {
    give_capacity(d, size);
    unlock(d);
    return oom_tables("handle");
  }
  host_handle *h = &d->handles[slot];
  h->live = true;
  h->released = false;
  h->maps = 0;
  h->first_unit = first;
  h->units = units;
  h->fd = -1;
  units_mark(d, first, units, true);
  d->bytes_in_use += size;
  *out = ((uint64_t)h->gen << 32) | (slot + 1);
  unlock(d);
  return TIDE_OK;
}

static int host_release(void *ctx, _tide_handle handle) {
  host_device *d = ctx;
  int rc = ENTER(d, TIDE_OP_RELEASE);
  if (rc) return rc;
  lock(d);
  uint32_t slot;
  if (!handle_find(d, handle, "release", &slot)) {
    unlock(d);
    return TIDE_ERR_BACKEND;
  }
  /* As cuMemRelease: mapped memory lives on until its last unmap. */
  d->handles[slot].released = true;
  if (d->handles[slot].maps == 0) handle_free(d, slot);
  unlock(d);
  return TIDE_OK;
}

/* ------------------------------------------------------------------------ */
/* Sharing between processes                                                */
/* ------------------------------------------------------------------------ */

/* A handle's memory is a range of a file: this device's memfd, or for an
 * imported handle the exporter's. The new descriptor refers to that file;
 * the offset says where in it the handle's memory starts. */
static int host_export_fd(void *ctx, _tide_handle handle, int *fd, uint64_t *offset) {
  host_device *d = ctx;
  int rc = ENTER(d, TIDE_OP_EXPORT);
  if (rc) return rc;
  if (!fd || !offset) return _tide_error_set(TIDE_ERR_INVALID, "export: NULL output");
  lock(d);
  uint32_t slot;
  if (!handle_find(d, handle, "export", &slot)) {
    unlock(d);
    return TIDE_ERR_BACKEND;
  }
  const host_handle *h = &d->handles[slot];
  int from = h->fd >= 0 ? h->fd : d->memfd;
  uint64_t at = h->fd >= 0 ? (uint64_t)h->fd_offset : (uint64_t)(h->first_unit * d->granularity);
  int copy = fcntl(from, F_DUPFD_CLOEXEC, 0);
  unlock(d);
  if (copy < 0)
    return _tide_error_set(TIDE_ERR_BACKEND,
                           "export: duplicating the memory's descriptor failed: %s",
                           strerror(errno));
  *fd = copy;
  *offset = at;
  return TIDE_OK;
}

/* The fd stays the caller's: the handle keeps a duplicate, closed when the
 * handle is released and unmapped everywhere. */
static int host_import_fd(void *ctx, int fd, uint64_t offset, size_t size, _tide_handle *out) {
  host_device *d = ctx;
  char g[32];
  int rc = ENTER(d, TIDE_OP_IMPORT);
  if (rc) return rc;
  if (!out) return _tide_error_set(TIDE_ERR_INVALID, "import: NULL output");
  if (size == 0 || !multiple_of(size, d->granularity) || offset % d->granularity ||
      offset > (uint64_t)INT64_MAX - size)
    return _tide_error_set(TIDE_ERR_BACKEND,
                           "import: size %zu and offset %llu must be multiples of the "
                           "granularity (%s)",
                           size, (unsigned long long)offset, bytes_text(d->granularity, g));
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0)
    return _tide_error_set(TIDE_ERR_BACKEND, "import: descriptor %d is not open", fd);
  if ((uint64_t)st.st_size < offset + size)
    return _tide_error_set(TIDE_ERR_BACKEND,
                           "import: the descriptor holds %lld bytes, not the %llu the handle "
                           "needs",
                           (long long)st.st_size, (unsigned long long)(offset + size));
  int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (own < 0)
    return _tide_error_set(TIDE_ERR_BACKEND, "import: duplicating descriptor %d failed: %s", fd,
                           strerror(errno));
  lock(d);
  uint32_t slot;
  if (!handle_slot(d, &slot)) {
    unlock(d);
    close(own);
    return oom_tables("handle");
  }
  host_handle *h = &d->handles[slot];
  *h = (host_handle){.gen = h->gen,
                     .live = true,
                     .units = size / d->granularity,
                     .fd = own,
                     .fd_offset = (off_t)offset};
  *out = ((uint64_t)h->gen << 32) | (slot + 1);
  unlock(d);
  return TIDE_OK;
}

/* ------------------------------------------------------------------------ */
/* Mappings                                                                 */
/* ------------------------------------------------------------------------ */

/* Checks shared by map and set_access: a positive, aligned, non-wrapping range. */
static bool range_args_ok(host_device *d, const char *op, uintptr_t addr, size_t size) {
  char g[32];
  if (size == 0 || addr % d->granularity || size % d->granularity || addr + size < addr) {
    _tide_error_set(TIDE_ERR_BACKEND,
                    "%s: address 0x%llx and size %zu must be positive multiples of the "
                    "granularity (%s)",
                    op, (unsigned long long)addr, size, bytes_text(d->granularity, g));
    return false;
  }
  return true;
}

static int host_map(void *ctx, uintptr_t addr, size_t size, _tide_handle handle) {
  host_device *d = ctx;
  char hs[32];
  int rc = ENTER(d, TIDE_OP_MAP);
  if (rc) return rc;
  if (!range_args_ok(d, "map", addr, size)) return TIDE_ERR_BACKEND;
  lock(d);
  uint32_t slot;
  if (!handle_find(d, handle, "map", &slot)) goto fail;
  host_handle *h = &d->handles[slot];
  if (size != h->units * d->granularity) {
    _tide_error_set(TIDE_ERR_BACKEND, "map: size %zu is not the handle's size (%s)", size,
                    bytes_text(h->units * d->granularity, hs));
    goto fail;
  }
  if (range_containing(&d->reserved, addr, size) == SIZE_MAX) {
    _tide_error_set(TIDE_ERR_BACKEND, "map: [0x%llx, +%zu) is not inside one reserved range",
                    (unsigned long long)addr, size);
    goto fail;
  }
  if (range_overlaps(&d->mapped, addr, size)) {
    _tide_error_set(TIDE_ERR_BACKEND, "map: [0x%llx, +%zu) overlaps memory already mapped there",
                    (unsigned long long)addr, size);
    goto fail;
  }
  if (!range_make_room(&d->mapped)) {
    unlock(d);
    return oom_tables("mapping");
  }
  int fd = h->fd >= 0 ? h->fd : d->memfd;
  off_t offset = h->fd >= 0 ? h->fd_offset : (off_t)(h->first_unit * d->granularity);
  if (mmap((void *)addr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, fd, offset) == MAP_FAILED) {
    _tide_error_set(TIDE_ERR_BACKEND, "map: mmap at 0x%llx failed: %s", (unsigned long long)addr,
                    strerror(errno));
    goto fail;
  }
  h->maps++;
  range_insert(&d->mapped, (host_range){.addr = addr, .size = size, .handle = slot});
  unlock(d);
  return TIDE_OK;
fail:
  unlock(d);
  return TIDE_ERR_BACKEND;
}

static int host_set_access(void *ctx, uintptr_t addr, size_t size) {
  host_device *d = ctx;
  int rc = ENTER(d, TIDE_OP_SET_ACCESS);
  if (rc) return rc;
  if (!range_args_ok(d, "set_access", addr, size)) return TIDE_ERR_BACKEND;
  lock(d);
  if (!range_covered(&d->mapped, addr, size)) {
    unlock(d);
    return _tide_error_set(TIDE_ERR_BACKEND, "set_access: [0x%llx, +%zu) is not fully mapped",
                           (unsigned long long)addr, size);
  }
  if (mprotect((void *)addr, size, PROT_READ | PROT_WRITE) != 0) {
    int err = errno;
    unlock(d);
    return _tide_error_set(TIDE_ERR_BACKEND, "set_access: mprotect at 0x%llx failed: %s",
                           (unsigned long long)addr, strerror(err));
  }
  unlock(d);
  return TIDE_OK;
}

static int host_unmap(void *ctx, uintptr_t addr, size_t size) {
  host_device *d = ctx;
  int rc = ENTER(d, TIDE_OP_UNMAP);
  if (rc) return rc;
  lock(d);
  size_t i = range_find_le(&d->mapped, addr);
  if (i == SIZE_MAX || d->mapped.items[i].addr != addr || d->mapped.items[i].size != size) {
    unlock(d);
    return _tide_error_set(TIDE_ERR_BACKEND,
                           "unmap: [0x%llx, +%zu) is not exactly one earlier mapping",
                           (unsigned long long)addr, size);
  }
  /* Put inaccessible reserved memory back, so the reservation stays whole. */
  if (mmap((void *)addr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
           -1, 0) == MAP_FAILED) {
    int err = errno;
    unlock(d);
    return _tide_error_set(TIDE_ERR_BACKEND, "unmap: mmap at 0x%llx failed: %s",
                           (unsigned long long)addr, strerror(err));
  }
  uint32_t slot = d->mapped.items[i].handle;
  range_remove(&d->mapped, i);
  host_handle *h = &d->handles[slot];
  if (--h->maps == 0 && h->released) handle_free(d, slot);
  unlock(d);
  return TIDE_OK;
}

/* `count` mappings of `page` bytes from addr, one after the other: checked
 * whole before anything changes (a refused run unmaps nothing), then one
 * mmap puts inaccessible reserved memory back over all of them, as one
 * cuMemUnmap over several mappings does on CUDA. One call for the fault
 * injection and the counts. */
static int host_unmap_run(void *ctx, uintptr_t addr, size_t page, size_t count, size_t *done) {
  host_device *d = ctx;
  *done = 0;
  if (count == 0) return TIDE_OK;
  int rc = ENTER(d, TIDE_OP_UNMAP);
  if (rc) return rc;
  lock(d);
  size_t first = range_find_le(&d->mapped, addr);
  for (size_t k = 0; k < count; k++) {
    size_t i = first == SIZE_MAX ? SIZE_MAX : first + k;
    if (i >= d->mapped.count || d->mapped.items[i].addr != addr + k * page ||
        d->mapped.items[i].size != page) {
      unlock(d);
      return _tide_error_set(TIDE_ERR_BACKEND,
                             "unmap: [0x%llx, +%zu) is not %zu earlier mappings of %zu bytes",
                             (unsigned long long)addr, count * page, count, page);
    }
  }
  if (mmap((void *)addr, count * page, PROT_NONE,
           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) == MAP_FAILED) {
    int err = errno;
    unlock(d);
    return _tide_error_set(TIDE_ERR_BACKEND, "unmap: mmap at 0x%llx failed: %s",
                           (unsigned long long)addr, strerror(err));
  }
  for (size_t k = 0; k < count; k++) {
    host_handle *h = &d->handles[d->mapped.items[first + k].handle];
    if (--h->maps == 0 && h->released) handle_free(d, d->mapped.items[first + k].handle);
  }
  range_remove_n(&d->mapped, first, count);
  unlock(d);
  *done = count;
  return TIDE_OK;
}

/* ------------------------------------------------------------------------ */
/* Streams and events                                                       */
/* ------------------------------------------------------------------------ */

/* Stream ids: NULL is slot 0; others are (serial << STREAM_SLOT_BITS) |
 * slot, slot >= 1, with a serial number drawn from one counter by every
 * host device of the process: no two streams ever created share an id, so
 * a stream of another device (or one destroyed) is refused. A destroyed
 * stream that is still held keeps its slot (and id) until it is released:
 * its events stay pending. */
#define STREAM_SLOT_BITS 20
#define STREAM_SLOTS ((uint64_t)1 << STREAM_SLOT_BITS)
static _Atomic uint64_t next_stream_serial = 1;

static tide_stream stream_id(const host_device *d, uint32_t slot) {
  if (slot == 0) return NULL;
  return (tide_stream)(uintptr_t)((d->streams[slot].serial << STREAM_SLOT_BITS) | slot);
}

/* For messages: "the default stream" or "stream 0x2". */
static const char *stream_text(tide_stream stream, char *buf, size_t len) {
  if (!stream) return "the default stream";
  snprintf(buf, len, "stream %p", (void *)stream);
  return buf;
}

static bool stream_find(host_device *d, tide_stream stream, const char *op, bool draining_ok,
                        uint32_t *slot) {
  uint64_t id = (uint64_t)(uintptr_t)stream;
  uint64_t index = id & (STREAM_SLOTS - 1), serial = id >> STREAM_SLOT_BITS;
  if (id == 0) {
    *slot = 0;
    return true;
  }
  if (index == 0 || index >= d->stream_count || serial == 0) goto unknown;
  host_stream *s = &d->streams[index];
  if (s->serial != serial) goto unknown;
  if (!s->alive && !(draining_ok && s->held)) goto unknown;
  *slot = (uint32_t)index;
  return true;
unknown:
  _tide_error_set(TIDE_ERR_INVALID, "%s: unknown or destroyed stream %p", op, (void *)stream);
  return false;
}

/* A stream slot no longer needed goes back for reuse. Its counters stay, so
 * tickets of old events remain complete. */
static void stream_retire(host_device *d, uint32_t slot) {
  d->streams[slot].serial = 0;
  d->free_streams.items[d->free_streams.count++] = slot;
}

static int host_stream_create(void *ctx, tide_stream *out) {
  host_device *d = ctx;
  int rc = ENTER(d, TIDE_OP_STREAM_CREATE);
  if (rc) return rc;
  if (!out) return _tide_error_set(TIDE_ERR_INVALID, "stream_create: NULL output");
  lock(d);
  uint32_t slot;
  if (d->free_streams.count > 0) {
    slot = d->free_streams.items[--d->free_streams.count];
  } else {
    if (d->stream_count >= STREAM_SLOTS ||
        !_tide_grow_array((void **)&d->streams, &d->stream_cap, d->stream_count + 1,
                          sizeof *d->streams) ||
        !_tide_grow_array((void **)&d->free_streams.items, &d->free_streams.cap,
                          d->stream_count + 1, sizeof *d->free_streams.items)) {
      unlock(d);
      return oom_tables("stream");
    }
    slot = (uint32_t)d->stream_count++;
    d->streams[slot] = (host_stream){0};
  }
  d->streams[slot].serial = atomic_fetch_add(&next_stream_serial, 1);
  d->streams[slot].alive = true;
  d->streams[slot].held = false;
  d->streams[slot].capture_id = 0;
  d->streams[slot].ndeps = 0;
  *out = stream_id(d, slot);
  unlock(d);
  return TIDE_OK;
}

static int host_stream_destroy(void *ctx, tide_stream stream) {
  host_device *d = ctx;
  int rc = ENTER(d, TIDE_OP_STREAM_DESTROY);
  if (rc) return rc;
  if (!stream)
    return _tide_error_set(TIDE_ERR_INVALID,
                           "stream_destroy: the default stream cannot be destroyed");
  lock(d);
  uint32_t slot;
  if (!stream_find(d, stream, "stream_destroy", false, &slot)) {
    unlock(d);
    return TIDE_ERR_INVALID;
  }
  d->streams[slot].alive = false;
  /* As on a GPU, destroying a stream does not cancel its queued work: a held
   * stream's events stay pending until it is released. */
  if (!d->streams[slot].held) {
    d->streams[slot].completed = d->streams[slot].submitted; /* its queue runs out */
    stream_retire(d, slot);
  }
  unlock(d);
  return TIDE_OK;
}

static int host_stream_synchronize(void *ctx, tide_stream stream) {
  host_device *d = ctx;
  int rc = ENTER(d, TIDE_OP_STREAM_SYNCHRONIZE);
  if (rc) return rc;
  lock(d);
  uint32_t slot;
  if (!stream_find(d, stream, "stream_synchronize", false, &slot)) {
    unlock(d);
    return TIDE_ERR_INVALID;
  }
  bool held = d->streams[slot].held, capturing = d->streams[slot].capture_id != 0;
  if (!held && !capturing) d->streams[slot].completed = d->streams[slot].submitted;
  unlock(d);
  char text[48];
  if (capturing)
    return _tide_error_set(TIDE_ERR_NOT_READY,
                           "stream_synchronize: %s is being captured into a graph, so its work "
                           "does not run now and waiting for it is illegal; try again after the "
                           "capture ends",
                           stream_text(stream, text, sizeof text));
  if (held)
    return _tide_error_set(TIDE_ERR_NOT_READY,
                           "stream_synchronize: %s is held, so waiting for it would never end; "
                           "release it (tide_host_stream_release) first",
                           stream_text(stream, text, sizeof text));
  return TIDE_OK;
}

/* Every stream's work done, as cuCtxSynchronize waits for it. A held
 * stream (a destroyed one still draining among them) would keep the wait
 * going for ever; a stream being captured would have its capture invalidated by
 * the driver: both are refused, and nothing completes. */
static int host_device_synchronize(void *ctx) {
  host_device *d = ctx;
  int rc = ENTER(d, TIDE_OP_DEVICE_SYNCHRONIZE);
  if (rc) return rc;
  lock(d);
  tide_stream captured = NULL, held = NULL;
  bool any_captured = false, any_held = false;
  for (uint32_t i = 0; i < d->stream_count; i++) {
    const host_stream *s = &d->streams[i];
    if (!s->alive && !s->held) continue; /* a free slot, or a stream that ran out */
    if (s->capture_id && !any_captured) {
      any_captured = true;
      captured = stream_id(d, i);
    } else if (s->held && !any_held) {
      any_held = true;
      held = stream_id(d, i);
    }
  }
  if (!any_captured && !any_held)
    for (uint32_t i = 0; i < d->stream_count; i++)
      if (d->streams[i].alive) d->streams[i].completed = d->streams[i].submitted;
  unlock(d);
  char text[48];
  if (any_captured)
    return _tide_error_set(TIDE_ERR_NOT_READY,
                           "device_synchronize: %s is being captured into a graph, and waiting "
                           "for the whole device would invalidate the capture; try again after "
                           "the capture ends",
                           stream_text(captured, text, sizeof text));
  if (any_held)
    return _tide_error_set(TIDE_ERR_NOT_READY,
                           "device_synchronize: %s is held, so waiting for the device would never "
                           "end; release it (tide_host_stream_release) first",
                           stream_text(held, text, sizeof text));
  return TIDE_OK;
}

static int host_stream_check(void *ctx, tide_stream stream) {
  host_device *d = ctx;
  lock(d);
  uint32_t slot;
  bool known = stream_find(d, stream, "stream_check", false, &slot);
  unlock(d);
  return known ? TIDE_OK : TIDE_ERR_INVALID;
}

static int host_stream_capture_status(void *ctx, tide_stream stream, bool *capturing,
                                      uint64_t *capture_id) {
  host_device *d = ctx;
  int rc = ENTER(d, TIDE_OP_CAPTURE_STATUS);
  if (rc) return rc;
  if (!capturing || !capture_id)
    return _tide_error_set(TIDE_ERR_INVALID, "stream_capture_status: NULL output");
  lock(d);
  uint32_t slot;
  if (!stream_find(d, stream, "stream_capture_status", false, &slot)) {
    unlock(d);
    return TIDE_ERR_INVALID;
  }
  *capture_id = d->streams[slot].capture_id;
  *capturing = *capture_id != 0;
  unlock(d);
  return TIDE_OK;
}

/* ------------------------------------------------------------------------ */
/* Emulated capture graphs                                                  */
/* ------------------------------------------------------------------------ */

/* Up to cap of the n ids into out; *count gets n. */
static void give_nodes(const uint64_t *ids, size_t n, _tide_node *out, size_t cap, size_t *count) {
  if (out && n) memcpy(out, ids, (n < cap ? n : cap) * sizeof *ids);
  *count = n;
}

/* The node of an id whose capture is under way, else NULL. Under the lock. */
static const host_node *node_find(const host_device *d, _tide_node id) {
  if (id <= d->node_base || id - d->node_base > d->node_count) return NULL;
  const host_node *node = &d->nodes[id - d->node_base - 1];
  return node->capture_id ? node : NULL;
}

static int host_capture_deps(void *ctx, tide_stream stream, uint64_t *capture_id, _tide_node *out,
                             size_t cap, size_t *n) {
  host_device *d = ctx;
  int rc = ENTER(d, TIDE_OP_CAPTURE_GRAPH);
  if (rc) return rc;
  if (!capture_id || !n || (cap && !out))
    return _tide_error_set(TIDE_ERR_INVALID, "capture_deps: NULL output");
  lock(d);
  uint32_t slot;
  if (!stream_find(d, stream, "capture_deps", false, &slot)) {
    unlock(d);
    return TIDE_ERR_INVALID;
  }
  const host_stream *s = &d->streams[slot];
  *capture_id = s->capture_id;
  give_nodes(s->deps, s->capture_id ? s->ndeps : 0, out, cap, n);
  unlock(d);
  return TIDE_OK;
}

static int host_node_deps(void *ctx, _tide_node node, _tide_node *out, size_t cap, size_t *n) {
  host_device *d = ctx;
  int rc = ENTER(d, TIDE_OP_CAPTURE_GRAPH);
  if (rc) return rc;
  if (!n || (cap && !out)) return _tide_error_set(TIDE_ERR_INVALID, "node_deps: NULL output");
  lock(d);
  const host_node *x = node_find(d, node);
  if (x) give_nodes(x->deps, x->ndeps, out, cap, n);
  unlock(d);
  if (!x)
    return _tide_error_set(TIDE_ERR_INVALID,
                           "node_deps: unknown graph node %llu, or its capture ended",
                           (unsigned long long)node);
  return TIDE_OK;
}

/* Room in s's dependencies for `more` ids; false (nothing changed) without
 * host memory, so that a control that fails changes nothing. */
static bool deps_room(host_stream *s, size_t more) {
  return _tide_grow_array((void **)&s->deps, &s->deps_cap, s->ndeps + more, sizeof *s->deps);
}

/* Add ids to s's dependencies, each once; deps_room made room. */
static void deps_add(host_stream *s, const uint64_t *ids, size_t n) {
  for (size_t i = 0; i < n; i++) {
    bool seen = false;
    for (size_t j = 0; j < s->ndeps && !seen; j++) seen = s->deps[j] == ids[i];
    if (!seen) s->deps[s->ndeps++] = ids[i];
  }
}

/* The nodes of capture `id` end with it; once no capture has nodes left,
 * the table empties (ids go on from where they were). Under the lock. */
static void nodes_end(host_device *d, uint64_t id) {
  bool left = false;
  for (size_t i = 0; i < d->node_count; i++) {
    host_node *x = &d->nodes[i];
    if (x->capture_id == id) {
      free(x->deps);
      *x = (host_node){0};
    }
    left |= x->capture_id != 0;
  }
  if (!left) {
    d->node_base += d->node_count;
    d->node_count = 0;
  }
}

/* Event ids: (generation << 32) | (slot + 1), never NULL. */
static bool event_find(host_device *d, _tide_event event, const char *op, uint32_t *slot) {
  uint64_t id = (uint64_t)(uintptr_t)event;
  uint64_t index = id & UINT32_MAX;
  if (index == 0 || index > d->event_count || d->events[index - 1].gen != (uint32_t)(id >> 32) ||
      !d->events[index - 1].alive) {
    _tide_error_set(TIDE_ERR_INVALID, "%s: unknown or destroyed event %p", op, event);
    return false;
  }
  *slot = (uint32_t)(index - 1);
  return true;
}

static bool event_done(const host_device *d, const host_event *e) {
  return !e->captured && (!e->recorded || d->streams[e->stream].completed >= e->ticket);
}

static int captured_event(tide_stream stream, const char *op) {
  char text[48];
  return _tide_error_set(TIDE_ERR_NOT_READY,
                         "%s: the event was recorded on %s while it was being captured into a "
                         "graph; it completes only when the graph runs",
                         op, stream_text(stream, text, sizeof text));
}

static int host_event_create(void *ctx, _tide_event *out) {
  host_device *d = ctx;
  int rc = ENTER(d, TIDE_OP_EVENT_CREATE);
  if (rc) return rc;
  if (!out) return _tide_error_set(TIDE_ERR_INVALID, "event_create: NULL output");
  lock(d);
  uint32_t slot;
  if (d->free_events.count > 0) {
    slot = d->free_events.items[--d->free_events.count];
  } else {
    if (d->event_count >= UINT32_MAX ||
        !_tide_grow_array((void **)&d->events, &d->event_cap, d->event_count + 1,
                          sizeof *d->events) ||
        !_tide_grow_array((void **)&d->free_events.items, &d->free_events.cap, d->event_count + 1,
                          sizeof *d->free_events.items)) {
      unlock(d);
      return oom_tables("event");
    }
    slot = (uint32_t)d->event_count++;
    d->events[slot] = (host_event){0};
  }
  host_event *e = &d->events[slot];
  e->alive = true;
  e->recorded = false;
  *out = (_tide_event)(uintptr_t)(((uint64_t)e->gen << 32) | (slot + 1));
  unlock(d);
  return TIDE_OK;
}

static int host_event_destroy(void *ctx, _tide_event event) {
  host_device *d = ctx;
  int rc = ENTER(d, TIDE_OP_EVENT_DESTROY);
  if (rc) return rc;
  lock(d);
  uint32_t slot;
  if (!event_find(d, event, "event_destroy", &slot)) {
    unlock(d);
    return TIDE_ERR_INVALID;
  }
  d->events[slot].alive = false;
  d->events[slot].gen++;
  d->free_events.items[d->free_events.count++] = slot;
  unlock(d);
  return TIDE_OK;
}

/* A stream that is not held completes its work queue_depth events behind
 * its submissions. */
static void stream_progress(const host_device *d, host_stream *s) {
  uint64_t done = s->submitted > d->queue_depth ? s->submitted - d->queue_depth : 0;
  if (done > s->completed) s->completed = done;
}

static int host_event_record(void *ctx, _tide_event event, tide_stream stream) {
  host_device *d = ctx;
  int rc = ENTER(d, TIDE_OP_EVENT_RECORD);
  if (rc) return rc;
  lock(d);
  uint32_t eslot, sslot;
  if (!event_find(d, event, "event_record", &eslot) ||
      !stream_find(d, stream, "event_record", false, &sslot)) {
    unlock(d);
    return TIDE_ERR_INVALID;
  }
  host_stream *s = &d->streams[sslot];
  host_event *e = &d->events[eslot];
  e->recorded = true;
  e->queries = 0;
  e->stream = sslot;
  e->captured = s->capture_id != 0; /* a node of the graph, not work of the stream */
  if (!e->captured) {
    e->ticket = ++s->submitted;
    if (!s->held) stream_progress(d, s);
  }
  unlock(d);
  return TIDE_OK;
}

static int host_event_query(void *ctx, _tide_event event) {
  host_device *d = ctx;
  int rc = ENTER(d, TIDE_OP_EVENT_QUERY);
  if (rc) return rc;
  lock(d);
  uint32_t slot;
  if (!event_find(d, event, "event_query", &slot)) {
    unlock(d);
    return TIDE_ERR_INVALID;
  }
  host_event *e = &d->events[slot];
  bool done = event_done(d, e), captured = e->captured;
  /* Time passes between queries: the queue_depth-th query of a pending
   * event finds the stream's work done up to it. */
  if (!done && !captured && e->recorded && !d->streams[e->stream].held &&
      ++e->queries >= d->queue_depth) {
    if (d->streams[e->stream].completed < e->ticket) d->streams[e->stream].completed = e->ticket;
    done = event_done(d, e);
  }
  tide_stream stream = stream_id(d, e->stream);
  unlock(d);
  if (captured) return captured_event(stream, "event_query");
  return done ? TIDE_OK : _tide_error_set(TIDE_ERR_NOT_READY, "event not complete yet");
}

static int host_event_synchronize(void *ctx, _tide_event event) {
  host_device *d = ctx;
  int rc = ENTER(d, TIDE_OP_EVENT_SYNCHRONIZE);
  if (rc) return rc;
  lock(d);
  uint32_t slot;
  if (!event_find(d, event, "event_synchronize", &slot)) {
    unlock(d);
    return TIDE_ERR_INVALID;
  }
  host_event *e = &d->events[slot];
  /* Waiting for an event of a stream that is not held lets its queue run
   * up to it. */
  if (!e->captured && e->recorded && !d->streams[e->stream].held &&
      d->streams[e->stream].completed < e->ticket)
    d->streams[e->stream].completed = e->ticket;
  bool done = event_done(d, e), captured = e->captured;
  tide_stream stream = done ? NULL : stream_id(d, e->stream);
  unlock(d);
  char text[48];
  if (captured) return captured_event(stream, "event_synchronize");
  if (!done)
    return _tide_error_set(TIDE_ERR_NOT_READY,
                           "event_synchronize: the event waits on %s, which is held, so waiting "
                           "would never end; release it (tide_host_stream_release) first",
                           stream_text(stream, text, sizeof text));
  return TIDE_OK;
}

/* ------------------------------------------------------------------------ */
/* Pinned host memory and copies                                            */
/* ------------------------------------------------------------------------ */

static size_t system_page(void) { return (size_t)sysconf(_SC_PAGESIZE); }

static int host_host_alloc(void *ctx, size_t size, void **out) {
  host_device *d = ctx;
  char a[32];
  int rc = ENTER(d, TIDE_OP_HOST_ALLOC);
  if (rc) return rc;
  if (!out) return _tide_error_set(TIDE_ERR_INVALID, "host_alloc: NULL output");
  size_t page = system_page();
  if (size == 0 || size > SIZE_MAX - page)
    return _tide_error_set(TIDE_ERR_INVALID, "host_alloc: size %zu is 0 or too large", size);
  size_t bytes = (size + page - 1) / page * page;
  lock(d);
  if (!range_make_room(&d->pinned)) {
    unlock(d);
    return oom_tables("pinned memory");
  }
  void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    int err = errno;
    unlock(d);
    return _tide_error_set(err == ENOMEM ? TIDE_ERR_OOM : TIDE_ERR_BACKEND,
                           "host_alloc: could not allocate %s of pinned host memory: %s",
                           bytes_text(bytes, a), strerror(err));
  }
  range_insert(&d->pinned, (host_range){.addr = (uintptr_t)p, .size = bytes});
  unlock(d);
  *out = p;
  return TIDE_OK;
}

static int host_host_free(void *ctx, void *ptr) {
  host_device *d = ctx;
  int rc = ENTER(d, TIDE_OP_HOST_FREE);
  if (rc) return rc;
  lock(d);
  size_t i = range_find_le(&d->pinned, (uintptr_t)ptr);
  if (!ptr || i == SIZE_MAX || d->pinned.items[i].addr != (uintptr_t)ptr) {
    unlock(d);
    return _tide_error_set(TIDE_ERR_BACKEND,
                           "host_free: %p is not pinned memory that host_alloc returned (or it "
                           "was freed already)",
                           ptr);
  }
  munmap(ptr, d->pinned.items[i].size);
  range_remove(&d->pinned, i);
  unlock(d);
  return TIDE_OK;
}

/* Whether a copy may touch [addr, addr+size): device memory must be mapped,
 * pinned memory must not be overrun. Under the lock. */
static bool copy_range_ok(host_device *d, const char *side, uintptr_t addr, size_t size) {
  if (range_overlaps(&d->reserved, addr, size)) {
    if (range_containing(&d->reserved, addr, size) == SIZE_MAX ||
        !range_covered(&d->mapped, addr, size)) {
      _tide_error_set(TIDE_ERR_BACKEND,
                      "copy: the %s [0x%llx, +%zu) reaches into device address space that is "
                      "not mapped (an illegal address on a GPU)",
                      side, (unsigned long long)addr, size);
      return false;
    }
  }
  if (range_overlaps(&d->pinned, addr, size) &&
      range_containing(&d->pinned, addr, size) == SIZE_MAX) {
    _tide_error_set(TIDE_ERR_BACKEND,
                    "copy: the %s [0x%llx, +%zu) runs past the end of its pinned allocation", side,
                    (unsigned long long)addr, size);
    return false;
  }
  return true;
}

static int host_copy(void *ctx, void *dst, const void *src, size_t bytes, tide_stream stream) {
  host_device *d = ctx;
  int rc = ENTER(d, TIDE_OP_COPY);
  if (rc) return rc;
  uintptr_t to = (uintptr_t)dst, from = (uintptr_t)src;
  if (!dst || !src || bytes == 0 || to + bytes < to || from + bytes < from)
    return _tide_error_set(TIDE_ERR_INVALID, "copy: NULL pointer, 0 bytes or a range that wraps");
  if (to < from + bytes && from < to + bytes)
    return _tide_error_set(TIDE_ERR_INVALID, "copy: the ranges overlap");
  lock(d);
  uint32_t slot;
  bool ok = stream_find(d, stream, "copy", false, &slot) &&
            copy_range_ok(d, "destination", to, bytes) && copy_range_ok(d, "source", from, bytes);
  /* Under the lock, so that no unmap can take the pages away meanwhile. */
  if (ok) memcpy(dst, src, bytes);
  unlock(d);
  return ok ? TIDE_OK : tide_last_status();
}

/* ------------------------------------------------------------------------ */
/* Opening and destroying                                                   */
/* ------------------------------------------------------------------------ */

static void host_destroy(void *ctx) {
  host_device *d = ctx;
  if (!d) return;
  give_capacity(d, d->bytes_in_use); /* what a leak held goes with the device */
  /* Unmapping a reservation takes the mappings inside it along. */
  for (size_t i = 0; i < d->reserved.count; i++)
    munmap((void *)d->reserved.items[i].addr, d->reserved.items[i].size);
  for (size_t i = 0; i < d->pinned.count; i++)
    munmap((void *)d->pinned.items[i].addr, d->pinned.items[i].size);
  if (d->memfd >= 0) close(d->memfd);
  for (size_t i = 0; i < d->handle_count; i++)
    if (d->handles[i].live && d->handles[i].fd >= 0) close(d->handles[i].fd);
  for (size_t i = 0; i < d->node_count; i++) free(d->nodes[i].deps);
  free(d->nodes);
  for (size_t i = 0; i < d->stream_count; i++) free(d->streams[i].deps);
  free(d->unit_bits);
  free(d->handles);
  free(d->free_handles.items);
  free(d->reserved.items);
  free(d->mapped.items);
  free(d->pinned.items);
  free(d->streams);
  free(d->free_streams.items);
  free(d->events);
  free(d->free_events.items);
  pthread_mutex_destroy(&d->lock);
  free(d);
}

static const _tide_backend_ops host_ops = {
    .name = "host",
    .destroy = host_destroy,
    .device_count = host_device_count,
    .device_name = host_device_name,
    .mem_info = host_mem_info,
    .granularity = host_granularity,
    .reserve = host_reserve,
    .unreserve = host_unreserve,
    .create = host_create,
    .release = host_release,
    .map = host_map,
    .set_access = host_set_access,
    .unmap = host_unmap,
    .unmap_run = host_unmap_run,
    .export_fd = host_export_fd,
    .import_fd = host_import_fd,
    .host_alloc = host_host_alloc,
    .host_free = host_host_free,
    .copy = host_copy,
    .stream_create = host_stream_create,
    .stream_destroy = host_stream_destroy,
    .stream_synchronize = host_stream_synchronize,
    .device_synchronize = host_device_synchronize,
    .stream_check = host_stream_check,
    .stream_capture_status = host_stream_capture_status,
    .capture_deps = host_capture_deps,
    .node_deps = host_node_deps,
    .event_create = host_event_create,
    .event_destroy = host_event_destroy,
    .event_record = host_event_record,
    .event_query = host_event_query,
    .event_synchronize = host_event_synchronize,
};

static int check_conf(const _tide_conf_values *conf, int device) {
  char g[32], c[32], p[32];
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  size_t gran = conf->host_granularity;
  if (gran < page || (gran & (gran - 1)) != 0)
    return _tide_error_set(TIDE_ERR_CONFIG,
                           "host_granularity must be a power of two of at least the system page "
                           "size (%s), got %zu bytes",
                           bytes_text(page, p), gran);
  size_t capacity = _tide_host_capacity(conf);
  if (capacity == 0 || capacity % gran != 0 || capacity > (size_t)INT64_MAX)
    return _tide_error_set(TIDE_ERR_CONFIG,
                           "host_capacity must be a positive multiple of host_granularity (%s), "
                           "got %zu bytes (%s)",
                           bytes_text(gran, g), capacity, bytes_text(capacity, c));
  if (conf->host_devices < 1)
    return _tide_error_set(TIDE_ERR_CONFIG, "host_devices must be at least 1, got %d",
                           conf->host_devices);
  if (device < 0 || device >= conf->host_devices)
    return _tide_error_set(TIDE_ERR_INVALID,
                           "device %d does not exist: the host backend emulates %d device%s "
                           "(host_devices)",
                           device, conf->host_devices, conf->host_devices == 1 ? "" : "s");
  return TIDE_OK;
}

/* The memfd that backs every handle: sparse, so untouched units cost no RAM. */
static int open_memfd(host_device *d) {
  char name[64], c[32];
  snprintf(name, sizeof name, "tidalloc-device-%d", d->device);
  d->memfd = memfd_create(name, MFD_CLOEXEC);
  if (d->memfd < 0)
    return _tide_error_set(TIDE_ERR_BACKEND, "host backend: memfd_create failed: %s",
                           strerror(errno));
  if (ftruncate(d->memfd, (off_t)d->capacity) != 0)
    return _tide_error_set(TIDE_ERR_BACKEND, "host backend: sizing its memory to %s failed: %s",
                           bytes_text(d->capacity, c), strerror(errno));
  return TIDE_OK;
}

int _tide_host_open(const _tide_conf_values *conf, int device, _tide_backend *out) {
  if (!conf || !out) return _tide_error_set(TIDE_ERR_INVALID, "host backend: NULL argument");
  int rc = check_conf(conf, device);
  if (rc) return rc;
  host_device *d = calloc(1, sizeof *d);
  if (!d) return _tide_error_set(TIDE_ERR_OOM, "host backend: out of host memory");
  d->memfd = -1;
  d->device = device;
  d->device_count = conf->host_devices;
  d->capacity = _tide_host_capacity(conf);
  d->granularity = conf->host_granularity;
  d->queue_depth = conf->host_queue_depth;
  d->shared = conf->host_shared;
  d->units = d->capacity / d->granularity;
  size_t words = (d->units + 63) / 64;
  pthread_mutex_init(&d->lock, NULL);
  for (int op = 0; op < TIDE_OP_COUNT; op++) {
    atomic_init(&d->calls[op], 0);
    atomic_init(&d->fail_at[op], 0);
  }
  d->unit_bits = calloc(words, sizeof *d->unit_bits);
  d->streams = calloc(1, sizeof *d->streams);
  if (!d->unit_bits || !d->streams) {
    host_destroy(d);
    return _tide_error_set(TIDE_ERR_OOM, "host backend: out of host memory");
  }
  if (d->units % 64) d->unit_bits[words - 1] = UINT64_MAX << (d->units % 64);
  d->stream_count = d->stream_cap = 1;
  d->streams[0].alive = true;
  rc = open_memfd(d);
  if (rc) {
    host_destroy(d);
    return rc;
  }
  out->ops = &host_ops;
  out->ctx = d;
  out->is_host = 1;
  return TIDE_OK;
}

/* ------------------------------------------------------------------------ */
/* Controls                                                                 */
/* ------------------------------------------------------------------------ */

static host_device *host_of(_tide_backend *b) {
  return b && b->is_host && b->ops == &host_ops ? b->ctx : NULL;
}

static int not_host(const char *op) {
  return _tide_error_set(TIDE_ERR_INVALID, "%s: only the host backend has this control", op);
}

int _tide_host_stream_hold(_tide_backend *b, tide_stream stream) {
  host_device *d = host_of(b);
  if (!d) return not_host("stream hold");
  lock(d);
  uint32_t slot;
  if (!stream_find(d, stream, "stream hold", false, &slot)) {
    unlock(d);
    return TIDE_ERR_INVALID;
  }
  d->streams[slot].held = true;
  unlock(d);
  return TIDE_OK;
}

int _tide_host_stream_release(_tide_backend *b, tide_stream stream) {
  host_device *d = host_of(b);
  if (!d) return not_host("stream release");
  lock(d);
  uint32_t slot;
  /* A destroyed stream that is held may still be released: its work ends. */
  if (!stream_find(d, stream, "stream release", true, &slot)) {
    unlock(d);
    return TIDE_ERR_INVALID;
  }
  host_stream *s = &d->streams[slot];
  s->completed = s->submitted;
  s->held = false;
  if (!s->alive) stream_retire(d, slot);
  unlock(d);
  return TIDE_OK;
}

/* The slot of a live stream other than the default one, for the capture
 * controls; false with a message. Under the lock. */
static bool capturable(host_device *d, tide_stream stream, const char *op, uint32_t *slot) {
  if (!stream) {
    _tide_error_set(TIDE_ERR_INVALID, "%s: the default stream cannot be captured", op);
    return false;
  }
  return stream_find(d, stream, op, false, slot);
}

int _tide_host_capture_begin(_tide_backend *b, tide_stream stream) {
  host_device *d = host_of(b);
  if (!d) return not_host("capture begin");
  lock(d);
  uint32_t slot;
  int rc = TIDE_OK;
  if (!capturable(d, stream, "capture begin", &slot))
    rc = TIDE_ERR_INVALID;
  else if (d->streams[slot].capture_id)
    rc = _tide_error_set(TIDE_ERR_INVALID, "capture begin: stream %p is already being captured",
                         (void *)stream);
  else {
    d->streams[slot].capture_id = ++d->next_capture_id;
    d->streams[slot].ndeps = 0;
  }
  unlock(d);
  return rc;
}

int _tide_host_capture_join(_tide_backend *b, tide_stream stream, tide_stream capturing) {
  host_device *d = host_of(b);
  if (!d) return not_host("capture join");
  lock(d);
  uint32_t slot, from;
  int rc = TIDE_OK;
  if (!capturable(d, stream, "capture join", &slot) ||
      !capturable(d, capturing, "capture join", &from))
    rc = TIDE_ERR_INVALID;
  else if (!d->streams[from].capture_id || d->streams[slot].capture_id)
    rc = _tide_error_set(TIDE_ERR_INVALID,
                         "capture join: stream %p must be being captured and stream %p not",
                         (void *)capturing, (void *)stream);
  else if (!deps_room(&d->streams[slot], d->streams[from].ndeps))
    rc = oom_tables("stream dependency");
  else {
    /* A fork: the joined stream's work follows what the capture reached. */
    d->streams[slot].capture_id = d->streams[from].capture_id;
    d->streams[slot].ndeps = 0;
    deps_add(&d->streams[slot], d->streams[from].deps, d->streams[from].ndeps);
  }
  unlock(d);
  return rc;
}

int _tide_host_capture_end(_tide_backend *b, tide_stream stream) {
  host_device *d = host_of(b);
  if (!d) return not_host("capture end");
  lock(d);
  uint32_t slot;
  int rc = TIDE_OK;
  if (!capturable(d, stream, "capture end", &slot)) {
    rc = TIDE_ERR_INVALID;
  } else if (!d->streams[slot].capture_id) {
    rc = _tide_error_set(TIDE_ERR_INVALID, "capture end: stream %p is not being captured",
                         (void *)stream);
  } else {
    uint64_t id = d->streams[slot].capture_id;
    for (size_t i = 1; i < d->stream_count; i++)
      if (d->streams[i].capture_id == id) {
        d->streams[i].capture_id = 0;
        d->streams[i].ndeps = 0;
      }
    nodes_end(d, id);
  }
  unlock(d);
  return rc;
}

/* Work captured on `stream`: a node after the stream's dependencies, which
 * it then replaces. Under the lock. */
static int capture_work(host_device *d, host_stream *s) {
  uint64_t *deps = s->ndeps ? malloc(s->ndeps * sizeof *deps) : NULL;
  if ((s->ndeps && !deps) || !deps_room(s, 1) ||
      !_tide_grow_array((void **)&d->nodes, &d->node_cap, d->node_count + 1, sizeof *d->nodes)) {
    free(deps);
    return oom_tables("graph node");
  }
  if (deps) memcpy(deps, s->deps, s->ndeps * sizeof *deps);
  d->nodes[d->node_count] =
      (host_node){.capture_id = s->capture_id, .deps = deps, .ndeps = s->ndeps};
  s->deps[0] = d->node_base + ++d->node_count;
  s->ndeps = 1;
  return TIDE_OK;
}

int _tide_host_capture_work(_tide_backend *b, tide_stream stream) {
  host_device *d = host_of(b);
  if (!d) return not_host("capture work");
  lock(d);
  uint32_t slot;
  int rc = TIDE_OK;
  if (!capturable(d, stream, "capture work", &slot))
    rc = TIDE_ERR_INVALID;
  else if (!d->streams[slot].capture_id)
    rc = _tide_error_set(TIDE_ERR_INVALID, "capture work: stream %p is not being captured",
                         (void *)stream);
  else
    rc = capture_work(d, &d->streams[slot]);
  unlock(d);
  return rc;
}

int _tide_host_capture_wait(_tide_backend *b, tide_stream stream, tide_stream other) {
  host_device *d = host_of(b);
  if (!d) return not_host("capture wait");
  lock(d);
  uint32_t slot, from;
  int rc = TIDE_OK;
  if (!capturable(d, stream, "capture wait", &slot) ||
      !capturable(d, other, "capture wait", &from)) {
    rc = TIDE_ERR_INVALID;
  } else {
    host_stream *s = &d->streams[slot], *o = &d->streams[from];
    if (slot == from || !o->capture_id || (s->capture_id && s->capture_id != o->capture_id))
      rc = _tide_error_set(TIDE_ERR_INVALID,
                           "capture wait: stream %p must be another stream being captured, and "
                           "stream %p in its capture or in none",
                           (void *)other, (void *)stream);
    else if (!deps_room(s, o->ndeps))
      rc = oom_tables("stream dependency");
    else {
      if (!s->capture_id) s->ndeps = 0; /* joins the capture */
      s->capture_id = o->capture_id;
      deps_add(s, o->deps, o->ndeps);
    }
  }
  unlock(d);
  return rc;
}

int _tide_host_fail_call(_tide_backend *b, tide_backend_op op, uint64_t n) {
  host_device *d = host_of(b);
  if (!d) return not_host("fail call");
  if ((int)op < 0 || op >= TIDE_OP_COUNT)
    return _tide_error_set(TIDE_ERR_INVALID, "fail call: unknown backend operation %d", (int)op);
  uint64_t at = n == 0 ? 0 : atomic_load(&d->calls[op]) + n;
  atomic_store(&d->fail_at[op], at);
  return TIDE_OK;
}

uint64_t _tide_host_call_count(_tide_backend *b, tide_backend_op op) {
  host_device *d = host_of(b);
  if (!d || (int)op < 0 || op >= TIDE_OP_COUNT) return 0;
  return atomic_load(&d->calls[op]);
}

uint64_t _tide_host_calls_at_failure(_tide_backend *b, tide_backend_op op) {
  host_device *d = host_of(b);
  if (!d || (int)op < 0 || op >= TIDE_OP_COUNT) return 0;
  return atomic_load(&d->calls_at_failure[op]);
}

size_t _tide_host_sites(_tide_backend *b, _tide_host_site *out, size_t cap) {
  host_device *d = host_of(b);
  size_t n = 0;
  for (unsigned i = 0; d && i < SITE_SLOTS; i++) {
    uint64_t key = atomic_load_explicit(&d->sites[i].key, memory_order_acquire);
    if (key == 0) continue;
    if (n < cap)
      out[n] = (_tide_host_site){.op = (tide_backend_op)(key & 31),
                                 .site = (uintptr_t)(key >> 5),
                                 .calls = atomic_load(&d->sites[i].calls),
                                 .failures = atomic_load(&d->sites[i].failures)};
    n++;
  }
  return n;
}

uint64_t _tide_host_mappings(_tide_backend *b) {
  host_device *d = host_of(b);
  if (!d) return 0;
  lock(d);
  uint64_t n = d->mapped.count;
  unlock(d);
  return n;
}

uint64_t _tide_host_bytes_in_use(_tide_backend *b) {
  host_device *d = host_of(b);
  if (!d) return 0;
  lock(d);
  uint64_t bytes = d->bytes_in_use;
  unlock(d);
  return bytes;
}
