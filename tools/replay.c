/* replay.c: `tidalloc replay`, a recorded allocation trace run through
 * tidalloc to see how much memory it reserves for it.
 *
 * A trace is a gzip'd CSV, header `t_us,action,addr,size,stream`, one row per
 * event: `alloc` (a block of `size` bytes at `addr`) or `free` (the block at
 * `addr`; its size may be repeated, or 0). The whole trace is read first, so
 * the timed replay measures the allocator and not zlib. Trace addresses map
 * to the pointers tidalloc returned through an open-addressing hash table.
 * Each distinct stream id gets a tidalloc stream; id 0 is the default (NULL)
 * stream. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <zlib.h>

#include "cli.h"

#define TRACE_HEADER "t_us,action,addr,size,stream"
enum {
  LINE_MAX_BYTES = 256, /* longer lines are malformed */
  MAX_STREAMS = 1024,   /* distinct stream ids a trace may use */
  REPORT_FIRST = 5,     /* problems described one by one before only counting */
};

/* ------------------------------------------------------------------------ */
/* The trace in memory                                                       */
/* ------------------------------------------------------------------------ */

typedef struct trace_event {
  uint64_t addr;
  uint64_t size;   /* for frees: 0 when the trace did not say */
  uint64_t line;   /* in the file, for messages */
  uint32_t stream; /* index into trace.stream_ids */
  bool is_alloc;
} trace_event;

typedef struct trace {
  trace_event *events;
  size_t count, capacity;
  uint64_t stream_ids[MAX_STREAMS]; /* [0] is always id 0 */
  size_t stream_count;
  uint64_t malformed_lines;
} trace;

static void trace_free(trace *t) {
  free(t->events);
  memset(t, 0, sizeof(*t));
}

static bool trace_push(trace *t, const trace_event *ev) {
  if (t->count == t->capacity) {
    size_t capacity = t->capacity ? t->capacity * 2 : 65536;
    trace_event *events = realloc(t->events, capacity * sizeof(*events));
    if (events == NULL) return false;
    t->events = events;
    t->capacity = capacity;
  }
  t->events[t->count++] = *ev;
  return true;
}

/* The index of a stream id, added if new; -1 when there are too many. */
static int trace_stream_index(trace *t, uint64_t id) {
  for (size_t i = 0; i < t->stream_count; i++) {
    if (t->stream_ids[i] == id) return (int)i;
  }
  if (t->stream_count == MAX_STREAMS) return -1;
  t->stream_ids[t->stream_count] = id;
  return (int)t->stream_count++;
}

/* One unsigned decimal field ending at `end_char`; advances *p past it. */
static bool parse_field(const char **p, char end_char, uint64_t *out) {
  const char *s = *p;
  if (*s < '0' || *s > '9') return false;
  uint64_t v = 0;
  for (; *s >= '0' && *s <= '9'; s++) {
    uint64_t digit = (uint64_t)(*s - '0');
    if (v > (UINT64_MAX - digit) / 10) return false;
    v = v * 10 + digit;
  }
  if (*s != end_char) return false;
  *out = v;
  *p = s + 1;
  return true;
}

/* Parse one data line (without its newline) into ev and *stream_id. */
static bool parse_line(const char *line, trace_event *ev, uint64_t *stream_id) {
  const char *p = line;
  uint64_t t_us = 0;
  if (!parse_field(&p, ',', &t_us)) return false;
  if (strncmp(p, "alloc,", 6) == 0) {
    ev->is_alloc = true;
    p += 6;
  } else if (strncmp(p, "free,", 5) == 0) {
    ev->is_alloc = false;
    p += 5;
  } else {
    return false;
  }
  if (!parse_field(&p, ',', &ev->addr)) return false;
  if (!parse_field(&p, ',', &ev->size)) return false;
  if (!parse_field(&p, '\0', stream_id)) return false;
  return !(ev->is_alloc && ev->size == 0);
}

static void strip_newline(char *line) {
  size_t len = strlen(line);
  while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = '\0';
}

/* Read a whole line into buf; false at end of file. *too_long is set (and
 * the rest of the line skipped) when it does not fit. */
static bool read_line(gzFile gz, char *buf, int len, bool *too_long) {
  *too_long = false;
  if (gzgets(gz, buf, len) == NULL) return false;
  size_t n = strlen(buf);
  if (n > 0 && buf[n - 1] == '\n') return true;
  if (gzeof(gz)) return true;
  *too_long = true;
  char rest[LINE_MAX_BYTES];
  while (gzgets(gz, rest, sizeof(rest)) != NULL) {
    size_t m = strlen(rest);
    if (m > 0 && rest[m - 1] == '\n') break;
  }
  return true;
}

static void report_malformed(trace *t, uint64_t line_no, const char *line, const char *path) {
  if (++t->malformed_lines <= REPORT_FIRST) {
    fprintf(stderr, "tidalloc replay: %s:%llu: malformed line '%.80s'\n", path,
            (unsigned long long)line_no, line);
  }
}

/* Read a trace file. False after printing why (unreadable, no header, a
 * corrupt gzip stream, no memory); malformed lines are only counted. */
static bool trace_load(const char *path, trace *t) {
  memset(t, 0, sizeof(*t));
  t->stream_count = 1; /* id 0, the default stream */
  gzFile gz = gzopen(path, "rb");
  if (gz == NULL) {
    cli_error("replay: cannot open '%s'", path);
    return false;
  }
  gzbuffer(gz, 1 << 20);
  struct stat st;
  double file_bytes = stat(path, &st) == 0 && st.st_size > 0 ? (double)st.st_size : 0.0;
  char line[LINE_MAX_BYTES];
  bool too_long = false;
  uint64_t line_no = 1;
  bool ok = read_line(gz, line, sizeof(line), &too_long);
  if (ok) strip_newline(line);
  if (!ok || too_long || strcmp(line, TRACE_HEADER) != 0) {
    int zerr = Z_OK;
    const char *zmsg = gzerror(gz, &zerr);
    cli_error("replay: %s does not start with the header '%s'%s%s", path, TRACE_HEADER,
              zerr != Z_OK ? ": " : "", zerr != Z_OK ? zmsg : "");
    gzclose(gz);
    return false;
  }
  while (read_line(gz, line, sizeof(line), &too_long)) {
    line_no++;
    strip_newline(line);
    if (line[0] == '\0' && !too_long) continue; /* a blank line, e.g. at the end */
    trace_event ev = {.line = line_no};
    uint64_t stream_id = 0;
    if (too_long || !parse_line(line, &ev, &stream_id)) {
      report_malformed(t, line_no, line, path);
      continue;
    }
    int stream = trace_stream_index(t, stream_id);
    if (stream < 0) {
      cli_error("replay: %s uses more than %d streams", path, MAX_STREAMS);
      gzclose(gz);
      return false;
    }
    ev.stream = (uint32_t)stream;
    if (!trace_push(t, &ev)) {
      cli_error("replay: out of host memory reading %s", path);
      gzclose(gz);
      return false;
    }
    if ((line_no & 0xffff) == 0 && file_bytes > 0.0) {
      cli_progress("reading", (double)gzoffset(gz) / file_bytes);
    }
  }
  int zerr = Z_OK;
  const char *zmsg = gzerror(gz, &zerr);
  if (zerr != Z_OK && zerr != Z_STREAM_END) {
    cli_error("replay: %s is corrupt after line %llu: %s", path, (unsigned long long)line_no, zmsg);
    gzclose(gz);
    return false;
  }
  gzclose(gz);
  if (file_bytes > 0.0) cli_progress("reading", 1.0);
  return true;
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
                         const tide_stream *streams, live_map *live, uint64_t *live_bytes,
                         replay_result *r) {
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
  void *ptr = tide_malloc(alloc, (size_t)ev->size, streams[ev->stream]);
  if (ptr == NULL) {
    fprintf(stderr, "tidalloc replay: %s:%llu: allocating %llu bytes failed: %s (%s)\n", path,
            (unsigned long long)ev->line, (unsigned long long)ev->size, tide_last_error(),
            tide_status_name(tide_last_status()));
    return false;
  }
  live_block block = {.addr = ev->addr, .ptr = ptr, .size = ev->size, .stream = ev->stream};
  if (!live_insert(live, &block)) {
    cli_error("replay: out of host memory");
    tide_free(alloc, ptr, streams[ev->stream]);
    return false;
  }
  *live_bytes += ev->size;
  if (*live_bytes > r->peak_live) r->peak_live = *live_bytes;
  r->allocs++;
  return true;
}

static bool replay_trace(tide_allocator *alloc, const char *path, const trace *t,
                         tide_stream *streams, replay_result *r) {
  live_map live;
  if (!live_init(&live, 1 << 16)) {
    cli_error("replay: out of host memory");
    return false;
  }
  uint64_t live_bytes = 0;
  bool ok = true;
  uint64_t t0 = cli_now_ns();
  for (size_t i = 0; i < t->count && ok; i++) {
    ok = replay_event(alloc, path, &t->events[i], streams, &live, &live_bytes, r);
    r->events++;
    if ((i & 0xffff) == 0) cli_progress("replaying", (double)i / (double)t->count);
  }
  r->seconds = (double)(cli_now_ns() - t0) / 1e9;
  cli_progress("replaying", 1.0);
  if (tide_get_stats(alloc, &r->stats) != TIDE_OK) {
    cli_report_tide_error("replay: reading statistics");
    ok = false;
  }
  r->synchronizations = tide_host_call_count(alloc, TIDE_OP_STREAM_SYNCHRONIZE);
  if (!free_all(alloc, &live, streams)) ok = false;
  free(live.slots);
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

static void print_keys(const char *path, const trace *t, const replay_result *r) {
  printf("trace %s\n", base_name(path));
  printf("events %llu\n", (unsigned long long)r->events);
  printf("allocs %llu\n", (unsigned long long)r->allocs);
  printf("frees %llu\n", (unsigned long long)r->frees);
  printf("streams %zu\n", t->stream_count);
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
  printf("malformed_lines %llu\n", (unsigned long long)t->malformed_lines);
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
  printf("usage: tidalloc replay FILE.csv.gz [--conf STR] [--csv]\n"
         "\n"
         "Replay a recorded allocation trace (gzip'd CSV, header\n"
         "%s; actions alloc and free) through tidalloc, on the\n"
         "host backend unless --conf or TIDALLOC_CONF choose another, and print the\n"
         "peak live bytes of the trace next to tidalloc's peak allocated and reserved\n"
         "bytes. Exits non-zero if the trace has malformed lines, frees of addresses\n"
         "that are not live, or if an allocation fails.\n"
         "\n"
         "  --conf STR   tidalloc options, \"key:value,...\"\n"
         "  --csv        one header line and one row instead of `key value` lines\n",
         TRACE_HEADER);
}

static bool create_streams(tide_allocator *alloc, const trace *t, tide_stream *streams) {
  streams[0] = NULL;
  for (size_t i = 1; i < t->stream_count; i++) {
    if (tide_stream_create(alloc, &streams[i]) != TIDE_OK) {
      cli_report_tide_error("replay: creating a stream");
      for (size_t j = 1; j < i; j++) tide_stream_destroy(alloc, streams[j]);
      return false;
    }
  }
  return true;
}

static bool destroy_everything(tide_allocator *alloc, const trace *t, tide_stream *streams) {
  bool ok = true;
  for (size_t i = 1; i < t->stream_count; i++) {
    if (tide_stream_destroy(alloc, streams[i]) != TIDE_OK) {
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
  for (int i = 1; i < argc; i++) {
    const char *value = NULL;
    bool bad = false;
    if (cli_is_help(argv[i])) {
      print_help();
      return CLI_EXIT_OK;
    } else if (strcmp(argv[i], "--csv") == 0) {
      csv = true;
    } else if (cli_option_value(argc, argv, &i, "--conf", &value, &bad)) {
      if (bad) return CLI_EXIT_USAGE;
      conf = value;
    } else if (argv[i][0] == '-' || path != NULL) {
      cli_error("replay: unexpected argument '%s' (try `tidalloc replay --help`)", argv[i]);
      return CLI_EXIT_USAGE;
    } else {
      path = argv[i];
    }
  }
  if (path == NULL) {
    cli_error("replay: which trace? (try `tidalloc replay --help`)");
    return CLI_EXIT_USAGE;
  }

  trace t;
  if (!trace_load(path, &t)) {
    trace_free(&t);
    return CLI_EXIT_FAILURE;
  }
  tide_allocator *alloc = cli_allocator_create("replay", "backend:host", conf, 0);
  tide_stream *streams = calloc(t.stream_count, sizeof(tide_stream));
  if (alloc == NULL || streams == NULL || !create_streams(alloc, &t, streams)) {
    if (streams == NULL) cli_error("replay: out of host memory");
    if (alloc != NULL) tide_destroy(alloc);
    free(streams);
    trace_free(&t);
    return CLI_EXIT_FAILURE;
  }
  replay_result r = {0};
  bool ok = replay_trace(alloc, path, &t, streams, &r);
  if (!destroy_everything(alloc, &t, streams)) ok = false;
  if (ok) {
    if (csv) {
      print_csv(path, &r);
    } else {
      print_keys(path, &t, &r);
    }
  }
  uint64_t problems = t.malformed_lines + r.unknown_frees + r.duplicate_allocs + r.size_mismatches;
  if (ok && problems != 0) {
    cli_error("replay: %s has %llu malformed lines, %llu frees of addresses not live, %llu "
              "allocations at live addresses and %llu frees of another size",
              path, (unsigned long long)t.malformed_lines, (unsigned long long)r.unknown_frees,
              (unsigned long long)r.duplicate_allocs, (unsigned long long)r.size_mismatches);
  }
  free(streams);
  trace_free(&t);
  return ok && problems == 0 ? CLI_EXIT_OK : CLI_EXIT_FAILURE;
}
