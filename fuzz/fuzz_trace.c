/* fuzz_trace.c: the trace reader of `tidalloc replay` (tools/trace_read.c)
 * on arbitrary bytes. Checked, besides no crash, leak, hang or undefined
 * behaviour:
 * - a reference reader written here, the rules of trace_read.h done the
 *   plainest way (the whole text split at its newlines), gives the same
 *   events and fails at the same line;
 * - the bytes read in one piece, cut into reads of 1 to 16 bytes, and
 *   gzip'd (in one gzip member or two) give the same events and outcome;
 * - an error's message is printable ASCII and starts with the trace's name
 *   and, for an error of a line, that line's number;
 * - whatever the input (a gzip stream the fuzzer made too), the events that
 *   come out have increasing line numbers, times that never decrease and
 *   allocations of at least one byte. */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "fuzz.h"
#include "trace_read.h"

#define NAME "in\x1b.csv" /* an escape in the name: messages must show it escaped */
#define NAME_SHOWN "in\\x1b.csv"
#define MAX_EVENTS 4096

typedef struct outcome {
  trace_event ev[MAX_EVENTS]; /* the first MAX_EVENTS (a gzip'd input may hold more) */
  size_t n;                   /* every event */
  bool failed;
  uint64_t error_line; /* 0: an error of the whole file, or none */
  char error[1024];
} outcome;

static bool is_gzip(const uint8_t *d, size_t n) { return n >= 2 && d[0] == 0x1f && d[1] == 0x8b; }

/* The reader under test; checks what holds for any input. */
/* An outcome made empty (its events are only read up to n). */
static void outcome_clear(outcome *o) {
  o->n = 0;
  o->failed = false;
  o->error_line = 0;
  o->error[0] = '\0';
}

static void read_all(const uint8_t *data, size_t size, size_t max_read, outcome *o) {
  outcome_clear(o);
  char err[1024];
  trace_reader *r = trace_reader_open_memory(NAME, data, size, max_read, err, sizeof err);
  if (r == NULL) {
    o->failed = true;
    snprintf(o->error, sizeof o->error, "%s", err);
  } else {
    trace_event ev, prev = {0};
    int got;
    while ((got = trace_reader_next(r, &ev)) > 0) {
      if (o->n) {
        FZ_CHECK(ev.line > prev.line, "line %llu after line %llu", (unsigned long long)ev.line,
                 (unsigned long long)prev.line);
        FZ_CHECK(ev.t_us >= prev.t_us, "line %llu: time went back", (unsigned long long)ev.line);
      }
      FZ_CHECK(!ev.is_alloc || ev.size > 0, "line %llu: an alloc of 0 bytes",
               (unsigned long long)ev.line);
      if (o->n < MAX_EVENTS) o->ev[o->n] = ev;
      o->n++;
      prev = ev;
    }
    if (got < 0) {
      o->failed = true;
      snprintf(o->error, sizeof o->error, "%s", trace_reader_error(r));
      FZ_CHECK(trace_reader_next(r, &ev) == -1, "a read after an error did not fail");
    } else {
      FZ_CHECK(*trace_reader_error(r) == '\0', "an error message without an error");
    }
    trace_reader_close(r);
  }
  if (!o->failed) return;
  const char *m = o->error;
  FZ_CHECK(*m, "an error without a message");
  for (const char *p = m; *p; p++)
    FZ_CHECK(*p >= 0x20 && *p < 0x7f, "message has byte 0x%02x: %s", (unsigned char)*p, m);
  size_t k = strlen(NAME_SHOWN);
  FZ_CHECK(strncmp(m, NAME_SHOWN, k) == 0 && m[k] == ':', "message without the name: %s", m);
  o->error_line = strtoull(m + k + 1, NULL, 10);
}

/* ------------------------------------------------------------------------ */
/* The reference reader                                                      */
/* ------------------------------------------------------------------------ */

static bool ref_number(const uint8_t *s, size_t n, uint64_t *out) {
  if (n == 0) return false;
  uint64_t v = 0;
  for (size_t i = 0; i < n; i++) {
    if (s[i] < '0' || s[i] > '9') return false;
    if (v > (UINT64_MAX - (uint64_t)(s[i] - '0')) / 10) return false;
    v = v * 10 + (uint64_t)(s[i] - '0');
  }
  *out = v;
  return true;
}

/* A data line (its '\r' removed, not empty) into ev; false if malformed. */
static bool ref_line(const uint8_t *s, size_t n, trace_event *ev) {
  const uint8_t *f[6];
  size_t len[6], count = 0, start = 0;
  for (size_t i = 0; i <= n; i++) {
    if (i == n || s[i] == ',') {
      if (count == 5) return false;
      f[count] = s + start;
      len[count++] = i - start;
      start = i + 1;
    }
  }
  if (count != 5) return false;
  if (len[1] == 5 && memcmp(f[1], "alloc", 5) == 0) {
    ev->is_alloc = true;
  } else if (len[1] == 4 && memcmp(f[1], "free", 4) == 0) {
    ev->is_alloc = false;
  } else {
    return false;
  }
  return ref_number(f[0], len[0], &ev->t_us) && ref_number(f[2], len[2], &ev->addr) &&
         ref_number(f[3], len[3], &ev->size) && ref_number(f[4], len[4], &ev->stream) &&
         !(ev->is_alloc && ev->size == 0);
}

static void reference(const uint8_t *text, size_t size, outcome *o) {
  outcome_clear(o);
  size_t hl = strlen(TRACE_HEADER);
  bool header = false;
  uint64_t line = 0, last_t = 0;
  for (size_t pos = 0; pos < size;) {
    const uint8_t *nl = memchr(text + pos, '\n', size - pos);
    size_t n = nl ? (size_t)(nl - (text + pos)) : size - pos;
    const uint8_t *s = text + pos;
    pos += n + 1;
    line++;
    if (n == 0) continue; /* empty lines are skipped, before the header too */
    o->error_line = line;
    if (n > TRACE_LINE_MAX) {
      o->failed = true;
      return;
    }
    if (s[n - 1] == '\r') n--;
    if (!header) {
      if (n != hl || memcmp(s, TRACE_HEADER, hl) != 0) {
        o->failed = true;
        return;
      }
      header = true;
      continue;
    }
    if (n == 0) continue;
    trace_event ev = {.line = line};
    if (memchr(s, '\0', n) || !ref_line(s, n, &ev) || ev.t_us < last_t) {
      o->failed = true;
      return;
    }
    last_t = ev.t_us;
    FZ_CHECK(o->n < MAX_EVENTS, "reference: too many events");
    o->ev[o->n++] = ev;
  }
  o->error_line = 0;
  o->failed = !header; /* an empty file, or only empty lines */
}

/* ------------------------------------------------------------------------ */
/* Comparing                                                                 */
/* ------------------------------------------------------------------------ */

static void expect_same(const outcome *a, const outcome *b, const char *what, bool messages) {
  FZ_CHECK(a->n == b->n, "%s: %zu events, expected %zu (%s)", what, b->n, a->n, b->error);
  for (size_t i = 0; i < a->n && i < MAX_EVENTS; i++) {
    const trace_event *x = &a->ev[i], *y = &b->ev[i];
    FZ_CHECK(x->t_us == y->t_us && x->addr == y->addr && x->size == y->size &&
                 x->stream == y->stream && x->line == y->line && x->is_alloc == y->is_alloc,
             "%s: event %zu differs (line %llu, expected line %llu)", what, i,
             (unsigned long long)y->line, (unsigned long long)x->line);
  }
  FZ_CHECK(a->failed == b->failed, "%s: %s, expected %s (%s%s)", what,
           b->failed ? "failed" : "succeeded", a->failed ? "failure" : "success", a->error,
           b->error);
  FZ_CHECK(a->error_line == b->error_line, "%s: error at line %llu, expected line %llu: %s", what,
           (unsigned long long)b->error_line, (unsigned long long)a->error_line, b->error);
  if (messages)
    FZ_CHECK(strcmp(a->error, b->error) == 0, "%s: '%s', expected '%s'", what, b->error, a->error);
}

/* `size` bytes gzip'd; the stream is cut in two members at `split`. */
static uint8_t *gzip_of(const uint8_t *data, size_t size, size_t split, size_t *out_size) {
  size_t cap = 2 * (size + 64) + 64, len = 0;
  uint8_t *out = malloc(cap);
  FZ_CHECK(out, "out of memory");
  size_t parts[2] = {split, size - split};
  for (int p = 0; p < 2; p++) {
    if (p == 1 && parts[1] == 0) break;
    z_stream z;
    memset(&z, 0, sizeof z);
    /* A 512-byte window: little to set up at every run. */
    FZ_CHECK(deflateInit2(&z, 1, Z_DEFLATED, 16 + 9, 1, Z_DEFAULT_STRATEGY) == Z_OK,
             "deflateInit2");
    z.next_in = (Bytef *)(uintptr_t)(data + (p ? split : 0));
    z.avail_in = (uInt)parts[p];
    z.next_out = out + len;
    z.avail_out = (uInt)(cap - len);
    FZ_CHECK(deflate(&z, Z_FINISH) == Z_STREAM_END, "deflate did not finish");
    len = cap - z.avail_out;
    deflateEnd(&z);
  }
  *out_size = len;
  return out;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size > 8 * TRACE_LINE_MAX * 4) return 0; /* enough for every rule; keeps runs fast */
  static outcome whole, cut, ref, packed;
  read_all(data, size, 0, &whole);
  size_t step = 1 + (size ? data[size - 1] % 16 : 0);
  read_all(data, size, step, &cut);
  expect_same(&whole, &cut, "reads of a few bytes", true);
  if (is_gzip(data, size)) return 0; /* read as gzip: no text to compare with */
  reference(data, size, &ref);
  expect_same(&ref, &whole, "the reference", false);
  size_t gz_size, split = size ? data[0] % (size + 1) : 0;
  uint8_t *gz = gzip_of(data, size, split, &gz_size);
  read_all(gz, gz_size, step, &packed);
  free(gz);
  expect_same(&whole, &packed, "gzip'd", false);
  return 0;
}
