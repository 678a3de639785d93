/* replay.c: `tidalloc replay`, a recorded allocation trace run through
 * tidalloc to see how much memory it reserves for it.
 *
 * The trace (trace_read.h says what one is) is read as it is replayed, in
 * batches of BATCH events: memory holds the batch and the live blocks, not
 * the file, and the timed part of each batch measures the allocator and not
 * zlib. Trace addresses map to the pointers tidalloc returned through an
 * open-addressing hash table. Each distinct stream id gets a tidalloc stream
 * when it first appears; id 0 is the default (NULL) stream. --graph-pool-mib
 * first makes a recorded graph's pool of that size beside the trace. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "tidalloc_testing.h"
#include "trace_read.h"

enum {
  MAX_STREAMS = 1024, /* distinct stream ids a trace may use */
  REPORT_FIRST = 5,   /* problems described one by one before only counting */
  BATCH = 4096,       /* events read ahead of their replay */
};

/* The trace's streams: ids in order of appearance, and tidalloc's streams. */
typedef struct trace_streams {
  uint64_t ids[MAX_STREAMS]; /* [0] is always id 0 */
  tide_stream handles[MAX_STREAMS];
  size_t count;
} trace_streams;

/* The index of a stream id, its stream created if new; -1 after printing why. */
static int stream_index(tide_allocator *alloc, trace_streams *s, const char *name,
                        const trace_event *ev) {
  for (size_t i = 0; i < s->count; i++) {
    if (s->ids[i] == ev->stream) return (int)i;
  }
  if (s->count == MAX_STREAMS) {
    cli_error("replay: %s:%llu: more than %d streams", name, (unsigned long long)ev->line,
              MAX_STREAMS);
    return -1;
  }
  if (tide_stream_create(alloc, &s->handles[s->count]) != TIDE_OK) {
    cli_report_tide_error("replay: creating a stream");
    return -1;
  }
  s->ids[s->count] = ev->stream;
  return (int)s->count++;
}

/* ------------------------------------------------------------------------ */
/* Live blocks: trace address -> tidalloc pointer                           */
/* ------------------------------------------------------------------------ */

typedef struct live_block {
  uint64_t addr;
  void *ptr; /* NULL: empty slot */
  uint64_t size;
  uint32_t stream;
} live_block;

typedef struct live_map {
  live_block *slots;
  size_t mask;    /* capacity - 1, capacity a power of two */
  unsigned shift; /* 64 - log2(capacity): the hash keeps the product's high bits */
  size_t count;
} live_map;

static size_t live_hash(const live_map *m, uint64_t addr) {
  return (size_t)((addr * 0x9e3779b97f4a7c15ull) >> m->shift);
}

static bool live_init(live_map *m, size_t capacity) {
  m->slots = calloc(capacity, sizeof(live_block));
  m->mask = capacity - 1;
  m->shift = 64;
  for (size_t c = capacity; c > 1; c >>= 1) m->shift--;
  m->count = 0;
  return m->slots != NULL;
}

static live_block *live_find(live_map *m, uint64_t addr) {
  for (size_t i = live_hash(m, addr);; i = (i + 1) & m->mask) {
    live_block *b = &m->slots[i];
    if (b->ptr == NULL) return NULL;
    if (b->addr == addr) return b;
  }
}

static void live_put_slot(live_map *m, const live_block *block) {
  size_t i = live_hash(m, block->addr);
  while (m->slots[i].ptr != NULL) i = (i + 1) & m->mask;
  m->slots[i] = *block;
}

static bool live_insert(live_map *m, const live_block *block) {
  if ((m->count + 1) * 2 > m->mask + 1) {
    live_map bigger;
    if (!live_init(&bigger, (m->mask + 1) * 2)) return false;
    for (size_t i = 0; i <= m->mask; i++) {
      if (m->slots[i].ptr != NULL) live_put_slot(&bigger, &m->slots[i]);
    }
    bigger.count = m->count;
    free(m->slots);
    *m = bigger;
  }
  live_put_slot(m, block);
  m->count++;
  return true;
}

/* Remove a found block, shifting later entries of its probe run back so
 * that lookups never stop early. */
static void live_remove(live_map *m, live_block *block) {
  size_t hole = (size_t)(block - m->slots);
  for (size_t i = (hole + 1) & m->mask; m->slots[i].ptr != NULL; i = (i + 1) & m->mask) {
    size_t home = live_hash(m, m->slots[i].addr);
    /* Move entry i into the hole unless its home lies in (hole, i]. */
    bool home_after_hole = hole <= i ? (hole < home && home <= i) : (hole < home || home <= i);
    if (!home_after_hole) {
      m->slots[hole] = m->slots[i];
      hole = i;
    }
  }
  m->slots[hole].ptr = NULL;
  m->count--;
}

/* ------------------------------------------------------------------------ */
/* Replay                                                                    */
/* ------------------------------------------------------------------------ */

typedef struct replay_result {
  uint64_t events;
  uint64_t allocs, frees;
  uint64_t peak_live;
  uint64_t unknown_frees;
  uint64_t duplicate_allocs;
  uint64_t size_mismatches;
  tide_stats stats;
  uint64_t synchronizations; /* stream synchronizations (host backend: counted; else 0) */
  double seconds;
} replay_result;

static void report_event(uint64_t *counter, const char *path, const trace_event *ev,
                         const char *what) {
  if (++*counter <= REPORT_FIRST) {
    fprintf(stderr, "tidalloc replay: %s:%llu: %s (address %llu)\n", path,
            (unsigned long long)ev->line, what, (unsigned long long)ev->addr);
  }
}

/* Free every live block on the stream it was allocated on. */
static bool free_all(tide_allocator *alloc, live_map *live, const tide_stream *streams) {
  bool ok = true;
  for (size_t i = 0; i <= live->mask; i++) {
    live_block *b = &live->slots[i];
    if (b->ptr == NULL) continue;
    if (tide_free(alloc, b->ptr, streams[b->stream]) != TIDE_OK) {
      cli_report_tide_error("replay: freeing a live block at the end");
      ok = false;
    }
    b->ptr = NULL;
  }
  live->count = 0;
  return ok;
}

/* One event; false on an allocation failure or out of host memory. */
static bool replay_event(tide_allocator *alloc, const char *path, const trace_event *ev,
                         uint32_t stream, const tide_stream *streams, live_map *live,
                         uint64_t *live_bytes, replay_result *r) {
  live_block *found = live_find(live, ev->addr);
  if (!ev->is_alloc) {
    if (found == NULL) {
      report_event(&r->unknown_frees, path, ev, "free of an address that is not live");
      return true;
    }
    if (ev->size != 0 && ev->size != found->size) {
      report_event(&r->size_mismatches, path, ev, "free with another size than allocated");
    }
    if (tide_free(alloc, found->ptr, streams[found->stream]) != TIDE_OK) {
      fflush(stdout);
      fprintf(stderr, "tidalloc replay: %s:%llu: ", path, (unsigned long long)ev->line);
      cli_report_tide_error("free");
      return false;
    }
    *live_bytes -= found->size;
    live_remove(live, found);
    r->frees++;
    return true;
  }
  if (found != NULL) {
    report_event(&r->duplicate_allocs, path, ev, "allocation at an address already live");
    return true;
  }
  void *ptr = tide_malloc(alloc, (size_t)ev->size, streams[stream]);
  if (ptr == NULL) {
    fprintf(stderr, "tidalloc replay: %s:%llu: allocating %llu bytes failed: %s (%s)\n", path,
            (unsigned long long)ev->line, (unsigned long long)ev->size, tide_last_error(),
            tide_status_name(tide_last_status()));
    return false;
  }
  live_block block = {.addr = ev->addr, .ptr = ptr, .size = ev->size, .stream = stream};
  if (!live_insert(live, &block)) {
    cli_error("replay: out of host memory");
    tide_free(alloc, ptr, streams[stream]);
    return false;
  }
  *live_bytes += ev->size;
  if (*live_bytes > r->peak_live) r->peak_live = *live_bytes;
  r->allocs++;
  return true;
}

/* Read and replay the whole trace, batch by batch. */
static bool replay_trace(tide_allocator *alloc, trace_reader *reader, trace_streams *streams,
                         replay_result *r) {
  const char *name = trace_reader_name(reader);
  live_map live;
  trace_event *batch = malloc(BATCH * sizeof *batch);
  uint32_t *stream_of = malloc(BATCH * sizeof *stream_of);
  if (!live_init(&live, 1 << 16) || batch == NULL || stream_of == NULL) {
    cli_error("replay: out of host memory");
    free(live.slots);
    free(batch);
    free(stream_of);
    return false;
  }
  uint64_t live_bytes = 0, ns = 0;
  bool ok = true;
  for (int got = 1; ok && got > 0;) {
    size_t n = 0;
    while (n < BATCH && (got = trace_reader_next(reader, &batch[n])) > 0) n++;
    for (size_t i = 0; i < n && ok; i++) {
      int s = batch[i].stream == 0 ? 0 : stream_index(alloc, streams, name, &batch[i]);
      if (s < 0) ok = false;
      stream_of[i] = (uint32_t)s;
    }
    uint64_t t0 = cli_now_ns();
    for (size_t i = 0; i < n && ok; i++) {
      ok = replay_event(alloc, name, &batch[i], stream_of[i], streams->handles, &live, &live_bytes,
                        r);
      r->events++;
    }
    ns += cli_now_ns() - t0;
    cli_progress("replaying", trace_reader_progress(reader));
    if (got < 0) {
      cli_error("replay: %s", trace_reader_error(reader));
      ok = false;
    }
  }
  r->seconds = (double)ns / 1e9;
  cli_progress("replaying", 1.0);
  if (tide_get_stats(alloc, &r->stats) != TIDE_OK) {
    cli_report_tide_error("replay: reading statistics");
    ok = false;
  }
  r->synchronizations = tide_host_call_count(alloc, TIDE_OP_STREAM_SYNCHRONIZE);
  if (!free_all(alloc, &live, streams->handles)) ok = false;
  free(live.slots);
  free(batch);
  free(stream_of);
  return ok;
}

/* ------------------------------------------------------------------------ */
/* A graph pool beside the trace                                             */
/* ------------------------------------------------------------------------ */

/* What a CUDA graph recorded before the trace leaves: a capture pool that
 * keeps `bytes` of memory its replays write to, with nothing allocated in
 * it (PyTorch counts a graph's blocks only while it records). The peaks
 * are then reset, as for a run that only replays. Host backend only: the
 * capture is emulated. */
typedef struct graph_pool {
  tide_pool *pool;
  tide_stream stream;
} graph_pool;

static bool graph_pool_make(tide_allocator *alloc, size_t bytes, graph_pool *g) {
  void *p = NULL;
  bool ok = tide_stream_create(alloc, &g->stream) == TIDE_OK &&
            tide_pool_create(alloc, &g->pool) == TIDE_OK &&
            tide_host_capture_begin(alloc, g->stream) == TIDE_OK &&
            tide_capture_begin(alloc, g->stream, g->pool) == TIDE_OK &&
            (p = tide_malloc(alloc, bytes, g->stream)) != NULL &&
            tide_free(alloc, p, g->stream) == TIDE_OK &&
            tide_host_capture_end(alloc, g->stream) == TIDE_OK &&
            tide_capture_end(alloc, g->stream) == TIDE_OK &&
            tide_reset_peak_stats(alloc) == TIDE_OK;
  if (!ok) cli_report_tide_error("replay: making the graph pool (host backend only)");
  return ok;
}

/* The graph and the pool's creator let go: its memory goes back. */
static bool graph_pool_drop(tide_allocator *alloc, graph_pool *g) {
  bool ok = true;
  if (g->pool) ok = tide_pool_release(g->pool) == TIDE_OK && tide_pool_release(g->pool) == TIDE_OK;
  if (ok && g->stream) ok = tide_stream_destroy(alloc, g->stream) == TIDE_OK;
  if (!ok) cli_report_tide_error("replay: releasing the graph pool");
  return ok;
}

/* ------------------------------------------------------------------------ */
/* Output                                                                    */
/* ------------------------------------------------------------------------ */

static const char *base_name(const char *path) {
  const char *slash = strrchr(path, '/');
  return slash ? slash + 1 : path;
}

static double reserved_over_live(const replay_result *r) {
  int64_t reserved = r->stats.reserved_bytes[TIDE_POOL_ALL].peak;
  return r->peak_live ? (double)reserved / (double)r->peak_live : 0.0;
}

static void print_keys(const char *path, const trace_streams *streams, const replay_result *r) {
  printf("trace %s\n", base_name(path));
  printf("events %llu\n", (unsigned long long)r->events);
  printf("allocs %llu\n", (unsigned long long)r->allocs);
  printf("frees %llu\n", (unsigned long long)r->frees);
  printf("streams %zu\n", streams->count);
  printf("peak_live_bytes %llu\n", (unsigned long long)r->peak_live);
  printf("peak_allocated_bytes %lld\n", (long long)r->stats.allocated_bytes[TIDE_POOL_ALL].peak);
  printf("peak_reserved_bytes %lld\n", (long long)r->stats.reserved_bytes[TIDE_POOL_ALL].peak);
  printf("reserved_over_live %.4f\n", reserved_over_live(r));
  printf("segments_created %llu\n", (unsigned long long)r->stats.segments_created);
  printf("pages_mapped %llu\n", (unsigned long long)r->stats.pages_mapped);
  printf("pages_unmapped %llu\n", (unsigned long long)r->stats.pages_unmapped);
  printf("mappings %llu\n", (unsigned long long)r->stats.mappings);
  printf("unmappings %llu\n", (unsigned long long)r->stats.unmappings);
  /* Counted by the host backend's emulated device; 0 on another backend. */
  printf("stream_synchronizations %llu\n", (unsigned long long)r->synchronizations);
  /* The allocator's own count, on any backend: how often it waited. */
  printf("stream_waits %llu\n", (unsigned long long)r->stats.stream_waits);
  printf("seconds %.3f\n", r->seconds);
  printf("ns_per_event %.1f\n", r->events ? r->seconds * 1e9 / (double)r->events : 0.0);
  /* Always 0: a malformed line stops the replay. Kept for scripts that read it. */
  printf("malformed_lines 0\n");
  printf("unknown_frees %llu\n", (unsigned long long)r->unknown_frees);
  printf("duplicate_allocs %llu\n", (unsigned long long)r->duplicate_allocs);
  printf("size_mismatches %llu\n", (unsigned long long)r->size_mismatches);
}

/* The driver's work (mappings, unmappings) goes last: on a GPU the time of
 * growth follows it. */
static void print_csv(const char *path, const replay_result *r) {
  printf("trace,events,peak_live_bytes,peak_allocated_bytes,peak_reserved_bytes,"
         "reserved_over_live,seconds,mappings,unmappings\n");
  printf("%s,%llu,%llu,%lld,%lld,%.4f,%.3f,%llu,%llu\n", base_name(path),
         (unsigned long long)r->events, (unsigned long long)r->peak_live,
         (long long)r->stats.allocated_bytes[TIDE_POOL_ALL].peak,
         (long long)r->stats.reserved_bytes[TIDE_POOL_ALL].peak, reserved_over_live(r), r->seconds,
         (unsigned long long)r->stats.mappings, (unsigned long long)r->stats.unmappings);
}

/* ------------------------------------------------------------------------ */
/* The command                                                               */
/* ------------------------------------------------------------------------ */

static void print_help(void) {
  printf("usage: tidalloc replay FILE.csv.gz [--conf STR] [--csv] [--graph-pool-mib N]\n"
         "\n"
         "Replay a recorded allocation trace (gzip'd CSV, header\n"
         "%s; actions alloc and free) through tidalloc, on the\n"
         "host backend unless --conf or TIDALLOC_CONF choose another (a 24 GiB\n"
         "emulated device unless host_capacity says otherwise: the replay writes\n"
         "none of its memory), and print the\n"
         "peak live bytes of the trace next to tidalloc's peak allocated and reserved\n"
         "bytes. Exits non-zero at the first malformed line (naming its line and\n"
         "field; numbers, addresses too, are unsigned decimals; t_us may not\n"
         "decrease), if the trace has frees of addresses that are not live, or if\n"
         "an allocation fails.\n"
         "\n"
         "  --conf STR   tidalloc options, \"key:value,...\"\n"
         "  --csv        one header line and one row instead of `key value` lines\n"
         "  --graph-pool-mib N  first keep N MiB in a capture pool, as a recorded CUDA\n"
         "               graph's pool holds the memory its replays write (host backend);\n"
         "               the peaks are reset after it, so peak_reserved_bytes counts\n"
         "               the pool and peak_allocated_bytes does not\n",
         TRACE_HEADER);
}

static bool destroy_everything(tide_allocator *alloc, const trace_streams *streams) {
  bool ok = true;
  for (size_t i = 1; i < streams->count; i++) {
    if (tide_stream_destroy(alloc, streams->handles[i]) != TIDE_OK) {
      cli_report_tide_error("replay: destroying a stream");
      ok = false;
    }
  }
  if (tide_destroy(alloc) != TIDE_OK) {
    cli_report_tide_error("replay: destroying the allocator");
    ok = false;
  }
  return ok;
}

int tide_cli_replay(int argc, char **argv) {
  const char *path = NULL, *conf = NULL;
  bool csv = false;
  uint64_t pool_mib = 0;
  const cli_option options[] = {
      {.name = "--csv", .kind = CLI_FLAG, .target = &csv},
      {.name = "--conf", .kind = CLI_TEXT, .target = &conf},
      {.name = "--graph-pool-mib",
       .kind = CLI_COUNT,
       .target = &pool_mib,
       .min = 1,
       .max = (uint64_t)1 << 22,
       .wants = "a whole number of MiB from 1 to 4194304"},
  };
  int code = cli_parse(argc, argv, "replay", print_help, options,
                       sizeof options / sizeof options[0], &path, 1);
  if (code >= 0) return code;
  if (path == NULL) {
    cli_error("replay: which trace? (try `tidalloc replay --help`)");
    return CLI_EXIT_USAGE;
  }

  char err[1024];
  trace_reader *reader = trace_reader_open(path, err, sizeof err);
  if (reader == NULL) {
    cli_error("replay: %s", err);
    return CLI_EXIT_FAILURE;
  }
  tide_allocator *alloc =
      cli_allocator_create("replay", "backend:host," CLI_UNWRITTEN_DEVICE, conf, 0);
  trace_streams *streams = calloc(1, sizeof *streams);
  if (alloc == NULL || streams == NULL) {
    if (streams == NULL) cli_error("replay: out of host memory");
    if (alloc != NULL) tide_destroy(alloc);
    free(streams);
    trace_reader_close(reader);
    return CLI_EXIT_FAILURE;
  }
  streams->count = 1; /* id 0, the default stream */
  replay_result r = {0};
  graph_pool g = {0};
  bool ok = pool_mib == 0 || graph_pool_make(alloc, (size_t)pool_mib << 20, &g);
  if (ok) ok = replay_trace(alloc, reader, streams, &r);
  if (!graph_pool_drop(alloc, &g)) ok = false;
  if (!destroy_everything(alloc, streams)) ok = false;
  if (ok) {
    if (csv) {
      print_csv(path, &r);
    } else {
      print_keys(path, streams, &r);
    }
  }
  uint64_t problems = r.unknown_frees + r.duplicate_allocs + r.size_mismatches;
  if (ok && problems != 0) {
    cli_error("replay: %s has %llu frees of addresses not live, %llu allocations at live "
              "addresses and %llu frees of another size",
              trace_reader_name(reader), (unsigned long long)r.unknown_frees,
              (unsigned long long)r.duplicate_allocs, (unsigned long long)r.size_mismatches);
  }
  free(streams);
  trace_reader_close(reader);
  return ok && problems == 0 ? CLI_EXIT_OK : CLI_EXIT_FAILURE;
}
