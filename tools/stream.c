/* stream.c: `tidalloc stream`, the streaming-inference workload benchmark.
 *
 * For each frame count of the sweep it creates a fresh allocator (defaults,
 * then TIDALLOC_CONF, then --conf), runs the workload of stream_model.c on
 * it, and records the seconds and the peak allocated and reserved memory, or
 * that the run ran out of memory and why. Rows go to a CSV file in the format
 * of LingBot-Map's own memory benchmark, so runs of both compare line by
 * line; the file is rewritten after every row, so a sweep that is killed
 * keeps what it measured. A table goes to stdout and, on a terminal, a
 * progress bar to stderr.
 *
 * The host backend computes nothing and never touches the memory, so an
 * emulated 141 GiB device costs no RAM: the cache copies are no-ops there. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "stream_model.h"

/* The frame: 518 wide, 378 high (37 x 27 patches of 14). */
enum { FRAME_HEIGHT = 378, FRAME_WIDTH = 518 };
enum { MAX_SWEEP = 64, MAX_FRAMES = 10000000, ERROR_LEN = 1024 };

/* What fits the host backend's default 24 GiB emulated device in either
 * mode, in a few seconds: longer runs are asked for with --frames. */
static const int default_sweep[] = {64, 128, 256, 512, 1024};

#define CSV_HEADER                                                                                 \
  "frames,status,requested_height,requested_width,effective_height,effective_width,"               \
  "backend,dtype,seconds,peak_allocated_gib,peak_reserved_gib,error"

/* --driver-csv: the driver's work of each row, which the benchmark's own
 * columns (above, kept as they are) do not carry. */
#define DRIVER_CSV_HEADER                                                                          \
  "frames,status,backend,seconds,reserved_over_allocated,pages_mapped,pages_unmapped,mappings,"    \
  "unmappings,max_running_ratio,max_running_ratio_frame,median_frame_ms,p90_frame_ms,"             \
  "max_frame_ms,stream_waits,median_alloc_ms,median_issue_ms,mapping_s"

/* --frames-csv: each one-frame step of every run, with the statistics'
 * running counts after it (their differences are the frame's). */
#define FRAMES_CSV_HEADER                                                                          \
  "backend,frames,frame,frame_ms,issue_ms,alloc_ms,mappings,unmappings,stream_waits,"              \
  "allocated_gib,reserved_gib,mapping_ms"

typedef struct stream_args {
  int frames[MAX_SWEEP];
  int sweep_length;
  const char *conf;
  const char *csv_path;
  const char *driver_csv_path;
  const char *trace_path;      /* --trace-csv: each run's allocations and frees */
  const char *frames_csv_path; /* --frames-csv: one row per single frame */
  const char *label;
  bool stop_on_oom;
  bool grow;         /* --mode grow: the caches in growable buffers */
  bool sync_frames;  /* --sync-frames: each frame ends when the device is done */
  bool frames_given; /* a --frames was read: later ones add to it */
} stream_args;

/* One line of the results. */
typedef struct stream_row {
  int frames;
  bool oom;
  char backend[64];
  double seconds;
  double peak_allocated_gib;
  double peak_reserved_gib;
  uint64_t pages_mapped, pages_unmapped; /* the terminal table's, not the CSV's */
  uint64_t mappings, unmappings;
  /* The most, over the frames, of the peak reserved so far over the peak
   * allocated so far, and the frame it was seen after: the ratio
   * throughout the run, which the final one alone does not show. */
  double max_running_ratio;
  int max_running_ratio_frame;
  /* The single-frame steps' wall times (not the scale frames' batch): the
   * cost of a frame once the run streams, which the total, with its set-up,
   * hides. Milliseconds; 0 when no single frame ran. */
  double median_frame_ms, p90_frame_ms, max_frame_ms;
  /* Times the allocator blocked until the stream was done (tide_stats). */
  uint64_t stream_waits;
  /* With --sync-frames, the medians over the one-frame steps of the time
   * the calling thread spent inside the allocator (tide_malloc, tide_free,
   * growable buffers' calls) and of the time it took to issue the frame's
   * work, before waiting for the device: whether a frame is bound by the
   * CPU, and how much of that is the allocator's. 0 without. */
  double median_alloc_ms, median_issue_ms;
  /* Seconds spent in the device's calls that map and unmap memory
   * (tide_stats.mapping_ns), over the whole run. */
  double mapping_s;
  char error[ERROR_LEN]; /* why it ran out of memory; "" when ok */
} stream_row;

/* ------------------------------------------------------------------------ */
/* The model on a tidalloc allocator                                         */
/* ------------------------------------------------------------------------ */

typedef struct tide_target {
  tide_allocator *alloc;
  tide_status alloc_status; /* of the allocation that failed, TIDE_OK if none */
  char alloc_error[ERROR_LEN];
  tide_status free_status; /* of the first free that failed */
  char free_error[ERROR_LEN];
  bool copies; /* issue the cache copies (a real device) */
  tide_status copy_status;
  char copy_error[ERROR_LEN];
  /* Progress over the whole sweep. */
  uint64_t frames_before;
  uint64_t frames_total;
  double shown; /* the fraction last drawn */
  /* The run's ratio throughout (stream_row's max_running_ratio). */
  double max_running_ratio;
  int max_running_ratio_frame;
  /* Frame times: when the last step ended, and each single frame's. */
  bool sync_frames;
  uint64_t step_end_ns;
  int frames_seen;
  double *frame_ms;
  int frame_count;
  /* With sync_frames: time inside the allocator in the current step, and
   * each single frame's allocator and issue times (stream_row). */
  uint64_t alloc_ns;
  double *alloc_ms, *issue_ms;
  /* --frames-csv: the open file (NULL when not asked for), and the run's
   * backend column and length for its rows. */
  FILE *frames_csv;
  const char *backend;
  int run_frames;
  /* --trace-csv: the run's allocations and frees as `tidalloc replay` reads
   * them, from `trace_start` on; NULL when not asked for. */
  FILE *trace;
  uint64_t trace_start;
} tide_target;

/* The first failure of a kind, with its message: later ones would only
 * follow from it. */
static void keep_first_failure(tide_status *status, char error[ERROR_LEN]) {
  if (*status != TIDE_OK) return;
  *status = tide_last_status();
  snprintf(error, ERROR_LEN, "%s", tide_last_error());
}

/* One line of the trace: sizes rounded up to 512 B, as in recorded traces. */
static void trace_event(tide_target *t, const char *action, const void *ptr, size_t bytes) {
  if (!t->trace) return;
  fprintf(t->trace, "%llu,%s,%llu,%llu,0\n",
          (unsigned long long)((cli_now_ns() - t->trace_start) / 1000), action,
          (unsigned long long)(uintptr_t)ptr, (unsigned long long)((bytes + 511) / 512 * 512));
}

/* Clock reads around allocator calls, only with sync_frames: the plain run
 * stays as it was. `start` of 0 means not timed. */
static uint64_t alloc_clock(const tide_target *t) { return t->sync_frames ? cli_now_ns() : 0; }

static void alloc_clock_add(tide_target *t, uint64_t start) {
  if (start) t->alloc_ns += cli_now_ns() - start;
}

static void *target_alloc(void *ctx, size_t bytes, stream_model_kind kind) {
  (void)kind;
  tide_target *t = ctx;
  uint64_t start = alloc_clock(t);
  void *ptr = tide_malloc(t->alloc, bytes, NULL);
  alloc_clock_add(t, start);
  if (ptr == NULL)
    keep_first_failure(&t->alloc_status, t->alloc_error);
  else
    trace_event(t, "alloc", ptr, bytes);
  return ptr;
}

static void target_free(void *ctx, void *buf, size_t bytes) {
  tide_target *t = ctx;
  trace_event(t, "free", buf, bytes);
  uint64_t start = alloc_clock(t);
  tide_status st = tide_free(t->alloc, buf, NULL);
  alloc_clock_add(t, start);
  if (st != TIDE_OK) keep_first_failure(&t->free_status, t->free_error);
}

/* The cache copies of concatenation, on the device's stream. On the host
 * backend nothing is computed, so nothing is copied: the emulated device
 * would otherwise have to hold the whole workload in RAM. */
static int target_copy(void *ctx, void *dst, size_t dst_offset, const void *src, size_t src_offset,
                       size_t bytes) {
  tide_target *t = ctx;
  if (!t->copies) return 0;
  tide_status st =
      tide_memcpy(t->alloc, (char *)dst + dst_offset, (const char *)src + src_offset, bytes, NULL);
  if (st != TIDE_OK) keep_first_failure(&t->copy_status, t->copy_error);
  return st == TIDE_OK ? 0 : -1;
}

/* Grow mode's caches: growable buffers, mapped a page ahead so that an
 * append that crosses a page boundary finds it mapped (about a hundred
 * buffers: no worker thread each). */
static void *target_buf_create(void *ctx, size_t capacity, stream_model_kind kind, void **data) {
  (void)kind;
  tide_target *t = ctx;
  /* No map_ahead: growth here maps on the calling thread either way (no
   * worker), so pages mapped ahead save no time, and each of the model's
   * 80-odd buffers would hold a page more than its length: 1.023-1.026 x the
   * allocated peak from the scale frames to frame 25, and more pages
   * unmapped from the segments to make room for them (host backend). */
  tide_buf_options o;
  tide_buf_options_init(&o);
  o.capacity = capacity;
  tide_buf *b = NULL;
  uint64_t start = alloc_clock(t);
  int rc = tide_buf_create(t->alloc, &o, &b);
  alloc_clock_add(t, start);
  if (rc != TIDE_OK) {
    keep_first_failure(&t->alloc_status, t->alloc_error);
    return NULL;
  }
  *data = tide_buf_data(b);
  return b;
}

static int target_buf_resize(void *ctx, void *buf, size_t bytes) {
  tide_target *t = ctx;
  uint64_t start = alloc_clock(t);
  int rc = tide_buf_resize(buf, bytes, NULL);
  alloc_clock_add(t, start);
  if (rc == TIDE_OK) return 0;
  keep_first_failure(&t->alloc_status, t->alloc_error);
  return -1;
}

static void target_buf_destroy(void *ctx, void *buf) {
  tide_target *t = ctx;
  uint64_t start = alloc_clock(t);
  int rc = tide_buf_destroy(buf);
  alloc_clock_add(t, start);
  if (rc != TIDE_OK) keep_first_failure(&t->free_status, t->free_error);
}

/* After each frame: the peak reserved so far over the peak allocated so far
 * (one statistics read a frame, microseconds against the frame's work). */
static void track_running_ratio(tide_target *t, const tide_stats *stats, int frames_done) {
  int64_t allocated = stats->allocated_bytes[TIDE_POOL_ALL].peak;
  if (allocated <= 0) return;
  double ratio = (double)stats->reserved_bytes[TIDE_POOL_ALL].peak / (double)allocated;
  if (ratio > t->max_running_ratio) {
    t->max_running_ratio = ratio;
    t->max_running_ratio_frame = frames_done;
  }
}

/* A step's wall time, kept when the step was one frame. With sync_frames a
 * step ends when the device has done its copies, else when the calling
 * thread has issued them. */
static void track_frame_time(tide_target *t, int frames_done) {
  uint64_t issued = cli_now_ns();
  if (t->sync_frames && t->copies && tide_stream_synchronize(t->alloc, NULL) != TIDE_OK)
    keep_first_failure(&t->copy_status, t->copy_error);
  uint64_t now = cli_now_ns();
  if (frames_done - t->frames_seen == 1 && t->frame_ms != NULL) {
    t->alloc_ms[t->frame_count] = (double)t->alloc_ns / 1e6;
    t->issue_ms[t->frame_count] = (double)(issued - t->step_end_ns) / 1e6;
    t->frame_ms[t->frame_count++] = (double)(now - t->step_end_ns) / 1e6;
  }
  t->frames_seen = frames_done;
  t->alloc_ns = 0;
}

static void write_field(FILE *f, const char *text);

/* A --frames-csv row for the one-frame step just timed (the last entry of
 * the frame times). */
static void write_frame_row(tide_target *t, const tide_stats *stats, int frames_done) {
  int i = t->frame_count - 1;
  write_field(t->frames_csv, t->backend);
  fprintf(t->frames_csv, ",%d,%d,%.3f,%.3f,%.3f,%llu,%llu,%llu,%.4f,%.4f,%.3f\n", t->run_frames,
          frames_done, t->frame_ms[i], t->issue_ms[i], t->alloc_ms[i],
          (unsigned long long)stats->mappings, (unsigned long long)stats->unmappings,
          (unsigned long long)stats->stream_waits,
          (double)stats->allocated_bytes[TIDE_POOL_ALL].current / 1073741824.0,
          (double)stats->reserved_bytes[TIDE_POOL_ALL].current / 1073741824.0,
          (double)stats->mapping_ns / 1e6);
}

static void target_progress(void *ctx, int frames_done, int frames_total) {
  (void)frames_total;
  tide_target *t = ctx;
  int timed = t->frame_count;
  track_frame_time(t, frames_done);
  tide_stats stats;
  if (t->alloc != NULL && tide_get_stats(t->alloc, &stats) == TIDE_OK) {
    track_running_ratio(t, &stats, frames_done);
    if (t->frames_csv && t->frame_count > timed) write_frame_row(t, &stats, frames_done);
  }
  t->step_end_ns = cli_now_ns(); /* the next frame starts here: the statistics read is neither's */
  t->shown = (double)(t->frames_before + (uint64_t)frames_done) / (double)t->frames_total;
  cli_progress("stream", t->shown);
}

/* ------------------------------------------------------------------------ */
/* One run                                                                   */
/* ------------------------------------------------------------------------ */

/* The backend column: the label, else what kind of segments the config
 * asks for. */
static bool backend_name(const tide_config *config, const char *label, bool grow, char *buf,
                         size_t len) {
  if (label != NULL) {
    snprintf(buf, len, "%s", label);
    return true;
  }
  char value[32];
  if (tide_config_get(config, "expandable_segments", value, sizeof value) != TIDE_OK) {
    cli_report_tide_error("stream: reading expandable_segments");
    return false;
  }
  bool expandable =
      strcmp(value, "True") == 0 || strcmp(value, "true") == 0 || strcmp(value, "1") == 0;
  snprintf(buf, len, "%s%s", expandable ? "tidalloc-expandable" : "tidalloc-fixed",
           grow ? "-grow" : "");
  return true;
}

static int compare_doubles(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* The median of n values (sorts them). */
static double median_of(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, compare_doubles);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* The median, 90th percentile and largest of the frame times, and the
 * medians of the allocator and issue times where they were taken (sorts
 * them). */
static void summarise_frames(tide_target *t, stream_row *row) {
  int n = t->frame_count;
  if (n == 0) return;
  if (t->sync_frames) {
    row->median_alloc_ms = median_of(t->alloc_ms, n);
    row->median_issue_ms = median_of(t->issue_ms, n);
  }
  row->median_frame_ms = median_of(t->frame_ms, n);
  row->p90_frame_ms = t->frame_ms[(int)((double)(n - 1) * 0.9)];
  row->max_frame_ms = t->frame_ms[n - 1];
}

/* The per-frame times' arrays: gone, and NULL (no frame is then timed). */
static void free_frame_times(tide_target *t) {
  free(t->frame_ms);
  free(t->alloc_ms);
  free(t->issue_ms);
  t->frame_ms = t->alloc_ms = t->issue_ms = NULL;
}

/* Copies run on a real device only (see target_copy). */
static bool device_copies(tide_allocator *alloc) {
  tide_info info;
  return tide_get_info(alloc, &info) == TIDE_OK && strcmp(info.backend, "host") != 0;
}

/* --trace-csv: each run rewrites the file, so it ends with the last run's. */
static bool open_trace(const char *path, tide_target *t) {
  t->trace = fopen(path, "w");
  if (!t->trace) {
    cli_error("stream: cannot write the trace to %s", path);
    return false;
  }
  fputs("t_us,action,addr,size,stream\n", t->trace);
  t->trace_start = cli_now_ns();
  return true;
}

static bool close_trace(const char *path, tide_target *t) {
  bool ok = cli_close_output(t->trace, path);
  t->trace = NULL;
  return ok;
}

/* Run `frames` frames on a fresh allocator into `row`. False (after saying
 * why) when the sweep cannot go on: a bad configuration, an allocator that
 * cannot be created, a failure other than running out of memory. */
static bool run_one(const stream_args *args, int frames, tide_target *target, stream_row *row) {
  memset(row, 0, sizeof *row);
  row->frames = frames;
  tide_config *config = NULL;
  tide_allocator *alloc = NULL;
  if (cli_config_build(CLI_UNWRITTEN_DEVICE, args->conf, &config) != TIDE_OK ||
      tide_create(0, config, &alloc) != TIDE_OK) {
    cli_report_tide_error("stream");
    tide_config_free(config);
    return false;
  }
  bool named = backend_name(config, args->label, args->grow, row->backend, sizeof row->backend);
  tide_config_free(config);
  if (!named) {
    tide_destroy(alloc);
    return false;
  }
  target->copies = device_copies(alloc);
  target->backend = row->backend;
  target->run_frames = frames;
  target->copy_status = TIDE_OK;
  target->copy_error[0] = '\0';

  target->alloc = alloc;
  target->alloc_status = target->free_status = TIDE_OK;
  target->alloc_error[0] = target->free_error[0] = '\0';
  target->max_running_ratio = 0;
  target->max_running_ratio_frame = 0;
  target->sync_frames = args->sync_frames;
  target->frames_seen = 0;
  target->frame_count = 0;
  target->alloc_ns = 0;
  target->frame_ms = malloc((size_t)frames * sizeof *target->frame_ms);
  target->alloc_ms = malloc((size_t)frames * sizeof *target->alloc_ms);
  target->issue_ms = malloc((size_t)frames * sizeof *target->issue_ms);
  if (!target->frame_ms || !target->alloc_ms || !target->issue_ms) free_frame_times(target);
  if (args->trace_path && !open_trace(args->trace_path, target)) {
    free_frame_times(target);
    tide_destroy(alloc);
    return false;
  }
  stream_model_ops ops = {
      target,          target_alloc,      target_free,       target_copy,
      target_progress, target_buf_create, target_buf_resize, target_buf_destroy};
  stream_model_params params;
  stream_model_default_params(&params, frames);
  params.grow = args->grow;
  stream_model_result result;
  uint64_t start = cli_now_ns();
  target->step_end_ns = start;
  stream_model_status status = stream_model_run(&params, &ops, &result);
  /* Copies are asynchronous: the time counts until the device is done. */
  if (target->copies && tide_stream_synchronize(alloc, NULL) != TIDE_OK)
    keep_first_failure(&target->copy_status, target->copy_error);
  row->seconds = (double)(cli_now_ns() - start) / 1e9;

  tide_stats stats;
  bool ok = tide_get_stats(alloc, &stats) == TIDE_OK;
  if (!ok) cli_report_tide_error("stream: reading the statistics");
  row->peak_allocated_gib =
      ok ? (double)stats.allocated_bytes[TIDE_POOL_ALL].peak / 1073741824.0 : 0;
  row->peak_reserved_gib = ok ? (double)stats.reserved_bytes[TIDE_POOL_ALL].peak / 1073741824.0 : 0;
  row->pages_mapped = ok ? stats.pages_mapped : 0;
  row->pages_unmapped = ok ? stats.pages_unmapped : 0;
  row->mappings = ok ? stats.mappings : 0;
  row->unmappings = ok ? stats.unmappings : 0;
  row->stream_waits = ok ? stats.stream_waits : 0;
  row->mapping_s = ok ? (double)stats.mapping_ns / 1e9 : 0;
  row->max_running_ratio = target->max_running_ratio;
  row->max_running_ratio_frame = target->max_running_ratio_frame;
  summarise_frames(target, row);
  if (target->trace && !close_trace(args->trace_path, target)) ok = false;
  free_frame_times(target);
  if (tide_destroy(alloc) != TIDE_OK) {
    cli_report_tide_error("stream: destroying the allocator");
    ok = false;
  }
  target->alloc = NULL;

  if (target->free_status != TIDE_OK) {
    cli_error("stream: %d frames: a free failed: %s (%s)", frames, target->free_error,
              tide_status_name(target->free_status));
    return false;
  }
  if (target->copy_status != TIDE_OK) {
    cli_error("stream: %d frames: a cache copy failed: %s (%s)", frames, target->copy_error,
              tide_status_name(target->copy_status));
    return false;
  }
  if (status == STREAM_MODEL_NO_MEMORY && target->alloc_status == TIDE_ERR_OOM) {
    row->oom = true;
    snprintf(row->error, sizeof row->error, "%s", target->alloc_error);
  } else if (status == STREAM_MODEL_NO_MEMORY) {
    cli_error("stream: %d frames: an allocation of %zu bytes failed: %s (%s)", frames,
              result.failed_bytes, target->alloc_error, tide_status_name(target->alloc_status));
    return false;
  } else if (status != STREAM_MODEL_OK) {
    cli_error("stream: %d frames: the workload stopped: %s", frames,
              stream_model_status_text(status));
    return false;
  }
  return ok;
}

/* ------------------------------------------------------------------------ */
/* Output                                                                    */
/* ------------------------------------------------------------------------ */

/* A CSV field in double quotes, inner quotes doubled, line breaks as spaces
 * so that every row stays one line. */
static void write_quoted(FILE *f, const char *text) {
  fputc('"', f);
  for (const char *p = text; *p; p++) {
    if (*p == '"') fputc('"', f);
    fputc(*p == '\n' || *p == '\r' ? ' ' : *p, f);
  }
  fputc('"', f);
}

/* A CSV field, quoted only where it must be. */
static void write_field(FILE *f, const char *text) {
  if (strpbrk(text, ",\"\r\n") != NULL) {
    write_quoted(f, text);
  } else {
    fputs(text, f);
  }
}

static void write_row(FILE *f, const stream_row *r) {
  fprintf(f, "%d,%s,%d,%d,%d,%d,", r->frames, r->oom ? "oom" : "ok", FRAME_HEIGHT, FRAME_WIDTH,
          FRAME_HEIGHT, FRAME_WIDTH);
  write_field(f, r->backend);
  fprintf(f, ",bf16,%.3f,%.4f,%.4f,", r->seconds, r->peak_allocated_gib, r->peak_reserved_gib);
  if (r->oom) write_quoted(f, r->error);
  fputc('\n', f);
}

/* Peak reserved over peak allocated (0 when nothing was allocated). */
static double reserved_ratio(const stream_row *r) {
  return r->peak_allocated_gib > 0 ? r->peak_reserved_gib / r->peak_allocated_gib : 0;
}

static void write_driver_row(FILE *f, const stream_row *r) {
  double ratio = reserved_ratio(r);
  fprintf(f, "%d,%s,", r->frames, r->oom ? "oom" : "ok");
  write_field(f, r->backend);
  fprintf(f, ",%.3f,%.4f,%llu,%llu,%llu,%llu,%.4f,%d,%.3f,%.3f,%.3f,%llu,%.3f,%.3f,%.4f\n",
          r->seconds, ratio, (unsigned long long)r->pages_mapped,
          (unsigned long long)r->pages_unmapped, (unsigned long long)r->mappings,
          (unsigned long long)r->unmappings, r->max_running_ratio, r->max_running_ratio_frame,
          r->median_frame_ms, r->p90_frame_ms, r->max_frame_ms, (unsigned long long)r->stream_waits,
          r->median_alloc_ms, r->median_issue_ms, r->mapping_s);
}

/* Whether `path` names something other than a regular file (a device, a
 * pipe, a symbolic link such as /dev/stdout): renaming a file over it would
 * replace it, and writing it after every row would repeat the rows, so it is
 * written in place, once, when the sweep ends. */
static bool is_special(const char *path) {
  struct stat st;
  return lstat(path, &st) == 0 && !S_ISREG(st.st_mode);
}

/* Write `header` and every row so far (through `write`) to a file beside
 * `path`, then rename it over `path`: a reader never sees half a file. A
 * path that is not a regular file is written in place, and only when
 * `last` (the end of the sweep); a regular file is not written then. */
static bool write_csv(const char *path, const char *header,
                      void (*write)(FILE *, const stream_row *), const stream_row *rows, int count,
                      bool last) {
  bool special = is_special(path);
  if (special != last) return true;
  if (special) {
    FILE *f = fopen(path, "w");
    if (f == NULL) {
      cli_error("cannot write %s: %s", path, strerror(errno));
      return false;
    }
    fprintf(f, "%s\n", header);
    for (int i = 0; i < count; i++) write(f, &rows[i]);
    return cli_close_output(f, path);
  }
  size_t len = strlen(path) + 5;
  char *tmp = malloc(len);
  if (tmp == NULL) {
    cli_error("stream: out of host memory");
    return false;
  }
  snprintf(tmp, len, "%s.tmp", path);
  FILE *f = fopen(tmp, "w");
  bool ok = f != NULL;
  if (ok) {
    fprintf(f, "%s\n", header);
    for (int i = 0; i < count; i++) write(f, &rows[i]);
    /* ferror: a row that failed to be written, which fclose alone would
     * not report once the buffer is empty. */
    ok = !ferror(f);
    ok = fclose(f) == 0 && ok;
  }
  if (ok) ok = rename(tmp, path) == 0;
  if (!ok) {
    cli_error("cannot write %s: %s", path, strerror(errno));
    remove(tmp);
  }
  free(tmp);
  return ok;
}

static void print_table(const stream_row *rows, int count) {
  /* The backend column as wide as its longest label. */
  int backend_w = 7;
  for (int i = 0; i < count; i++)
    if ((int)strlen(rows[i].backend) > backend_w) backend_w = (int)strlen(rows[i].backend);
  printf("%8s  %-6s  %-*s  %9s  %14s  %13s  %9s  %12s  %14s  %8s  %8s\n", "frames", "status",
         backend_w, "backend", "seconds", "allocated GiB", "reserved GiB", "res/alloc",
         "pages mapped", "pages unmapped", "maps", "unmaps");
  for (int i = 0; i < count; i++) {
    const stream_row *r = &rows[i];
    double ratio = reserved_ratio(r);
    printf("%8d  %-6s  %-*s  %9.3f  %14.3f  %13.3f  %9.3f  %12llu  %14llu  %8llu  %8llu\n",
           r->frames, r->oom ? "oom" : "ok", backend_w, r->backend, r->seconds,
           r->peak_allocated_gib, r->peak_reserved_gib, ratio, (unsigned long long)r->pages_mapped,
           (unsigned long long)r->pages_unmapped, (unsigned long long)r->mappings,
           (unsigned long long)r->unmappings);
  }
  for (int i = 0; i < count; i++)
    if (rows[i].oom) printf("\n%d frames: %s\n", rows[i].frames, rows[i].error);
}

/* ------------------------------------------------------------------------ */
/* The command                                                               */
/* ------------------------------------------------------------------------ */

static void print_help(void) {
  printf("usage: tidalloc stream [--frames N...] [--mode cat|grow] [--conf STR]\n"
         "                       [--stop-on-oom] [--csv FILE] [--driver-csv FILE]\n"
         "                       [--label NAME] [--sync-frames] [--trace-csv FILE]\n"
         "                       [--frames-csv FILE]\n"
         "\n"
         "Run a synthetic streaming-inference workload with the allocation pattern of\n"
         "LingBot-Map (518x378 frames, a ViT-L/14 encoder, 24 global layers whose K/V\n"
         "caches grow by concatenation inside a window of 8 + 64 frames, per-frame\n"
         "activations and outputs) on a fresh allocator for each frame count, and\n"
         "report the seconds and the peak allocated and reserved memory. The allocator\n"
         "is configured by its defaults, then TIDALLOC_CONF, then --conf; the host\n"
         "backend emulates a 24 GiB device unless host_capacity says otherwise.\n"
         "\n"
         "  --frames N...   frame counts to run (default: 64 128 256 512 1024; more\n"
         "                  frames need a larger device: host_capacity:141GiB emulates\n"
         "                  an H200); a repeated --frames adds its counts to the sweep\n"
         "  --mode cat      grow the caches by allocate-copy-free (the default)\n"
         "  --mode grow     grow them in place, in growable buffers (the window a ring\n"
         "                  of frame slots), attention reading them without clone or cat\n"
         "  --conf STR      tidalloc options, \"key:value,...\"; e.g.\n"
         "                  \"expandable_segments:False,host_capacity:141GiB\" for a\n"
         "                  fixed-segment allocator on an emulated H200\n"
         "  --stop-on-oom   stop the sweep at the first frame count that runs out\n"
         "                  (a frame count that runs out of memory makes the command\n"
         "                  exit 1 after the table, with or without this option)\n"
         "  --csv FILE      write the rows to FILE (rewritten after each row):\n"
         "                  %s\n"
         "  --driver-csv FILE  the same rows' driver work (pages and handles mapped and\n"
         "                  unmapped, which growth's time follows on a GPU, and the\n"
         "                  seconds spent in those calls) to FILE:\n"
         "                  %s\n"
         "  --label NAME    the backend column (default: tidalloc-expandable or\n"
         "                  tidalloc-fixed, from expandable_segments)\n"
         "  --sync-frames   end each frame when the device is done with it, so that the\n"
         "                  driver CSV's frame times (one-frame steps: median, 90th\n"
         "                  percentile, max) are the device's, not the issuing thread's,\n"
         "                  and time the allocator's calls and each frame's issuing\n"
         "                  (median_alloc_ms, median_issue_ms)\n"
         "  --frames-csv FILE  every one-frame step of every run to FILE, a row each:\n"
         "                  %s\n"
         "                  (the counts and mapping_ms are the run's so far; frame,\n"
         "                  issue and allocator times as in the driver CSV's medians)\n"
         "  --trace-csv FILE  write every allocation and free of the run through\n"
         "                  tide_malloc/tide_free to FILE, in the format `tidalloc\n"
         "                  replay` reads (each run rewrites it: with several frame\n"
         "                  counts it holds the last; grow mode's buffers are not in it;\n"
         "                  writing it makes the run slower)\n",
         CSV_HEADER, DRIVER_CSV_HEADER, FRAMES_CSV_HEADER);
}

/* --frames takes the numbers that follow it ("64 128" or "64,128"); a
 * repeated --frames adds its counts to the earlier ones' (the first one
 * replaces the default sweep). */
static bool parse_frames(const char *text, void *target) {
  stream_args *args = target;
  if (!args->frames_given) args->sweep_length = 0;
  args->frames_given = true;
  int before = args->sweep_length;
  for (const char *at = text; *at != '\0';) {
    size_t len = strcspn(at, ",");
    char item[32];
    uint64_t n = 0;
    snprintf(item, sizeof item, "%.*s", (int)len, at);
    at += len + (at[len] == ',');
    if (len == 0) continue; /* "64,,128" as strtok read it */
    if (len >= sizeof item || !cli_parse_u64(item, &n) || n == 0 || n > MAX_FRAMES) {
      cli_error("stream: --frames wants frame counts from 1 to %d, not '%s'", MAX_FRAMES, item);
      return false;
    }
    if (args->sweep_length == MAX_SWEEP) {
      cli_error("stream: --frames takes at most %d frame counts", MAX_SWEEP);
      return false;
    }
    args->frames[args->sweep_length++] = (int)n;
  }
  if (args->sweep_length == before) {
    cli_error("stream: --frames needs at least one frame count, not '%s'", text);
    return false;
  }
  return true;
}

static bool parse_mode(const char *text, void *target) {
  bool *grow = target;
  *grow = strcmp(text, "grow") == 0;
  return *grow || strcmp(text, "cat") == 0;
}

/* Returns -1 to go on, or the exit code. */
static int parse_args(int argc, char **argv, stream_args *args) {
  memset(args, 0, sizeof *args);
  args->sweep_length = (int)(sizeof default_sweep / sizeof default_sweep[0]);
  memcpy(args->frames, default_sweep, sizeof default_sweep);
  const cli_option options[] = {
      {.name = "--frames",
       .kind = CLI_MANY,
       .target = args,
       .parse = parse_frames,
       .wants = "frame count"},
      {.name = "--mode",
       .kind = CLI_CUSTOM,
       .target = &args->grow,
       .parse = parse_mode,
       .wants = "cat or grow"},
      {.name = "--conf", .kind = CLI_TEXT, .target = &args->conf},
      {.name = "--csv", .kind = CLI_TEXT, .target = &args->csv_path},
      {.name = "--driver-csv", .kind = CLI_TEXT, .target = &args->driver_csv_path},
      {.name = "--trace-csv", .kind = CLI_TEXT, .target = &args->trace_path},
      {.name = "--frames-csv", .kind = CLI_TEXT, .target = &args->frames_csv_path},
      {.name = "--label", .kind = CLI_TEXT, .target = &args->label},
      {.name = "--stop-on-oom", .kind = CLI_FLAG, .target = &args->stop_on_oom},
      {.name = "--sync-frames", .kind = CLI_FLAG, .target = &args->sync_frames},
  };
  return cli_parse(argc, argv, "stream", print_help, options, sizeof options / sizeof options[0],
                   NULL, 0);
}

int tide_cli_stream(int argc, char **argv) {
  stream_args args;
  int code = parse_args(argc, argv, &args);
  if (code >= 0) return code;
  stream_row *rows = calloc((size_t)args.sweep_length, sizeof *rows);
  if (rows == NULL) {
    cli_error("stream: out of host memory");
    return CLI_EXIT_FAILURE;
  }
  tide_target target;
  memset(&target, 0, sizeof target);
  for (int i = 0; i < args.sweep_length; i++) target.frames_total += (uint64_t)args.frames[i];
  if (args.frames_csv_path != NULL) {
    target.frames_csv = fopen(args.frames_csv_path, "w");
    if (target.frames_csv == NULL) {
      cli_error("stream: cannot write %s: %s", args.frames_csv_path, strerror(errno));
      free(rows);
      return CLI_EXIT_FAILURE;
    }
    fputs(FRAMES_CSV_HEADER "\n", target.frames_csv);
  }

  /* Every output is written once before the first run, so that a path that
   * cannot be written fails now, not after minutes of benchmark. */
  bool ok = true;
  if (args.csv_path != NULL) ok = write_csv(args.csv_path, CSV_HEADER, write_row, rows, 0, false);
  if (ok && args.driver_csv_path != NULL)
    ok = write_csv(args.driver_csv_path, DRIVER_CSV_HEADER, write_driver_row, rows, 0, false);
  if (ok && args.trace_path != NULL) {
    FILE *trace = fopen(args.trace_path, "w");
    if (trace == NULL) {
      cli_error("cannot write %s: %s", args.trace_path, strerror(errno));
      ok = false;
    } else {
      ok = cli_close_output(trace, args.trace_path);
    }
  }
  int count = 0;
  for (int i = 0; ok && i < args.sweep_length; i++) {
    ok = run_one(&args, args.frames[i], &target, &rows[count]);
    if (!ok) break;
    count++;
    target.frames_before += (uint64_t)args.frames[i];
    if (args.csv_path != NULL)
      ok = write_csv(args.csv_path, CSV_HEADER, write_row, rows, count, false);
    if (ok && args.driver_csv_path != NULL)
      ok = write_csv(args.driver_csv_path, DRIVER_CSV_HEADER, write_driver_row, rows, count, false);
    if (rows[count - 1].oom && args.stop_on_oom) break;
  }
  /* Outputs that are not regular files get their rows now, once. */
  if (args.csv_path != NULL && !write_csv(args.csv_path, CSV_HEADER, write_row, rows, count, true))
    ok = false;
  if (args.driver_csv_path != NULL &&
      !write_csv(args.driver_csv_path, DRIVER_CSV_HEADER, write_driver_row, rows, count, true))
    ok = false;
  if (target.shown > 0 && target.shown < 1.0)
    cli_progress("stream", 1.0); /* stopped early: end the bar's line */
  if (count > 0) print_table(rows, count);
  if (target.frames_csv != NULL && !cli_close_output(target.frames_csv, args.frames_csv_path))
    ok = false;
  /* A frame count that ran out of memory is a failure of the request. */
  int ooms = 0;
  for (int i = 0; i < count; i++) ooms += rows[i].oom;
  if (ok && ooms > 0) {
    cli_error("stream: %d of the %d frame counts run ran out of memory (the messages above say "
              "why)",
              ooms, count);
    ok = false;
  }
  free(rows);
  return ok ? CLI_EXIT_OK : CLI_EXIT_FAILURE;
}
