/* trace_read.c: reading a recorded allocation trace one event at a time, in
 * bounded memory and time (trace_read.h says what a trace is and what is
 * refused).
 *
 * The file is read in blocks of IN_BYTES (text in memory is read where it
 * lies); a gzip stream (it starts with the bytes 1f 8b, else the text is
 * read as it is) is inflated into blocks of OUT_BYTES (MEMORY_OUT_BYTES for
 * text in memory, which is small: tests and the fuzz target). A line that lies whole in a block is
 * parsed where it lies; one cut by a block's end is copied into a buffer of TRACE_LINE_MAX bytes.
 * Runs of empty lines are skipped eight bytes at a time. */
#include "trace_read.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#define ZLIB_CONST /* next_in is read only */
#include <zlib.h>

enum {
  IN_BYTES = 1 << 16,
  OUT_BYTES = 1 << 18,
  MEMORY_OUT_BYTES = 1 << 14,
  NAME_SHOWN = 160,  /* bytes of the file name shown in messages */
  FIELD_SHOWN = 40,  /* bytes of a bad field shown */
  ERROR_BYTES = 768, /* the message */
};

static const char *const FIELD_NAMES[5] = {"t_us", "action", "addr", "size", "stream"};

struct trace_reader {
  char name[NAME_SHOWN * 4 + 4]; /* printable */
  int fd;                        /* -1: reading from memory */
  const uint8_t *mem;
  size_t mem_size, mem_pos, max_read;
  double file_bytes; /* 0: unknown */
  uint64_t raw_read; /* bytes of the file read so far */
  bool raw_end;
  const uint8_t *in; /* the block read: in_buf, or the text in memory */
  uint8_t *in_buf;   /* IN_BYTES + 1 (the first byte kept while reading the second) */
  size_t in_len, in_pos;
  bool gzip, z_ready;
  bool member_done;  /* inflate reached the end of a gzip member */
  bool later_member; /* inflating a member after the first */
  bool z_failed;     /* inflate failed after output still to be read */
  z_stream z;
  uint8_t *out; /* out_bytes, for gzip only */
  size_t out_bytes;
  const uint8_t *text; /* decoded bytes: in (plain) or out (gzip) */
  size_t text_len, text_pos;
  char line[TRACE_LINE_MAX + 1]; /* a line cut by a block's end */
  uint64_t line_no;              /* of the last line read */
  uint64_t last_t_us, last_t_line;
  bool failed;
  char error[ERROR_BYTES];
};

/* A printable copy of n bytes: control bytes, bytes above 0x7e, quotes and
 * backslashes escaped; cut to `shown` bytes of the source with "...". */
static void printable(char *dst, size_t cap, const void *src, size_t n, size_t shown) {
  const uint8_t *s = src;
  size_t o = 0;
  for (size_t i = 0; i < n && i < shown; i++) {
    uint8_t c = s[i];
    char tmp[5];
    if (c >= 0x20 && c < 0x7f && c != '\\' && c != '\'') {
      tmp[0] = (char)c;
      tmp[1] = '\0';
    } else if (c == '\\' || c == '\'') {
      tmp[0] = '\\';
      tmp[1] = (char)c;
      tmp[2] = '\0';
    } else {
      snprintf(tmp, sizeof tmp, "\\x%02x", c);
    }
    size_t t = strlen(tmp);
    if (o + t + 4 > cap) break;
    memcpy(dst + o, tmp, t);
    o += t;
  }
  if (n > shown && o + 4 <= cap) {
    memcpy(dst + o, "...", 3);
    o += 3;
  }
  dst[o] = '\0';
}

/* Record an error at the current line (0: the file as a whole); returns -1. */
__attribute__((format(printf, 2, 3))) static int fail(trace_reader *r, const char *fmt, ...) {
  int n = r->line_no ? snprintf(r->error, sizeof r->error, "%s:%llu: ", r->name,
                                (unsigned long long)r->line_no)
                     : snprintf(r->error, sizeof r->error, "%s: ", r->name);
  if (n < 0) n = 0;
  if ((size_t)n < sizeof r->error) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->error + n, sizeof r->error - (size_t)n, fmt, ap);
    va_end(ap);
  }
  r->failed = true;
  return -1;
}

/* An error of the file as a whole: no line number in front. */
#define fail_file(r, ...) ((r)->line_no = 0, fail((r), __VA_ARGS__))

/* ------------------------------------------------------------------------ */
/* Bytes: the file, then inflated                                            */
/* ------------------------------------------------------------------------ */

/* Refill r->in (empty when called): 1, 0 at the end of the file, -1. */
static int fill_raw(trace_reader *r) {
  r->in_len = r->in_pos = 0;
  if (r->raw_end) return 0;
  size_t want = IN_BYTES;
  if (r->max_read && r->max_read < want) want = r->max_read;
  if (r->fd < 0) {
    size_t left = r->mem_size - r->mem_pos;
    size_t n = left < want ? left : want;
    r->in = r->mem + r->mem_pos;
    r->mem_pos += n;
    r->in_len = n;
  } else {
    ssize_t n;
    do {
      n = read(r->fd, r->in_buf, want);
    } while (n < 0 && errno == EINTR);
    if (n < 0) return fail(r, "cannot read the file: %s", strerror(errno));
    r->in = r->in_buf;
    r->in_len = (size_t)n;
  }
  r->raw_read += r->in_len;
  if (r->in_len == 0) r->raw_end = true;
  return r->in_len != 0;
}

static int fail_trailing(trace_reader *r, uint64_t offset) {
  return fail_file(
      r, "data after the end of the gzip stream, at byte %llu of the file (after line %llu)",
      (unsigned long long)offset, (unsigned long long)r->last_t_line);
}

/* Make r->text hold more decoded bytes: 1, 0 at the end of the trace, -1.
 * At the end of the file inflate is called once more with no input: it may
 * still hold text of the input it took (a copy cut by a full buffer). */
static int more_text(trace_reader *r) {
  r->text_len = r->text_pos = 0;
  unsigned long long lines = r->line_no; /* whole lines read: errors of the file name it */
  if (r->z_failed) {
    if (r->later_member && r->z.total_out == 0)
      return fail_trailing(r, r->raw_read - (r->in_len - r->in_pos) - r->z.total_in);
    return fail_file(r, "corrupt gzip data after line %llu: %s", lines,
                     r->z.msg ? r->z.msg : "inflate failed");
  }
  for (;;) {
    if (r->in_pos == r->in_len && !r->raw_end && fill_raw(r) < 0) return -1;
    bool at_end = r->in_pos == r->in_len && r->raw_end;
    if (!r->gzip) {
      if (at_end) return 0;
      r->text = r->in + r->in_pos;
      r->text_len = r->in_len - r->in_pos;
      r->in_pos = r->in_len;
      return 1;
    }
    if (r->member_done) {
      if (at_end) return 0;
      /* After a gzip member: another member (as `cat a.gz b.gz` makes), or junk. */
      if (r->in[r->in_pos] != 0x1f) return fail_trailing(r, r->raw_read - (r->in_len - r->in_pos));
      if (inflateReset(&r->z) != Z_OK) return fail(r, "zlib cannot start a gzip member");
      r->member_done = false;
      r->later_member = true;
    }
    r->z.next_in = r->in + r->in_pos;
    r->z.avail_in = (uInt)(r->in_len - r->in_pos);
    r->z.next_out = r->out;
    r->z.avail_out = (uInt)r->out_bytes;
    int zr = inflate(&r->z, Z_NO_FLUSH);
    r->in_pos = r->in_len - r->z.avail_in;
    size_t produced = r->out_bytes - r->z.avail_out;
    if (zr == Z_STREAM_END) {
      r->member_done = true;
    } else if (zr == Z_MEM_ERROR) {
      return fail(r, "out of memory inflating the gzip stream");
    } else if (zr != Z_OK && zr != Z_BUF_ERROR) {
      /* Reported once the text before the fault has been read. */
      r->z_failed = true;
      if (produced == 0) return more_text(r);
    }
    if (produced) {
      r->text = r->out;
      r->text_len = produced;
      return 1;
    }
    if (at_end && !r->member_done) {
      /* All the file given, nothing more comes out, and the stream goes on. */
      if (r->later_member && r->z.total_out == 0)
        return fail_trailing(r, r->raw_read - r->z.total_in);
      return fail_file(r,
                       "the gzip stream ends early (the file is cut short), after %llu whole "
                       "line(s)",
                       lines);
    }
  }
}

/* ------------------------------------------------------------------------ */
/* Lines                                                                     */
/* ------------------------------------------------------------------------ */

static int fail_long(trace_reader *r, const uint8_t *start, size_t n) {
  const uint8_t *nul = memchr(start, '\0', n);
  if (nul) return fail(r, "a NUL byte at column %zu", (size_t)(nul - start) + 1);
  return fail(r, "the line is longer than %d bytes", TRACE_LINE_MAX);
}

/* The next line without its newline (nor a '\r' before it): 1 with *line
 * and *len set, 0 at the end, -1. Runs of empty lines are counted, not
 * returned one by one. */
static int next_line(trace_reader *r, const char **line, size_t *len) {
  size_t have = 0;
  bool started = false;
  for (;;) {
    if (r->text_pos == r->text_len) {
      int m = more_text(r);
      if (m < 0) return -1;
      if (m == 0) {
        if (!started) return 0;
        break; /* the last line, without a newline */
      }
    }
    const uint8_t *s = r->text + r->text_pos;
    size_t avail = r->text_len - r->text_pos;
    if (!started) {
      /* Empty lines, eight at a time. */
      size_t skip = 0;
      const uint64_t newlines = 0x0a0a0a0a0a0a0a0aull;
      for (uint64_t w; skip + 8 <= avail; skip += 8) {
        memcpy(&w, s + skip, 8);
        if (w != newlines) break;
      }
      while (skip < avail && s[skip] == '\n') skip++;
      r->line_no += skip;
      r->text_pos += skip;
      if (skip == avail) continue;
      s += skip;
      avail -= skip;
    }
    const uint8_t *nl = memchr(s, '\n', avail);
    size_t take = nl ? (size_t)(nl - s) : avail;
    if (!started && nl && take <= TRACE_LINE_MAX) {
      /* The whole line lies in this block: parsed where it is. */
      r->text_pos += take + 1;
      r->line_no++;
      *line = (const char *)s;
      *len = take;
      return 1;
    }
    started = true;
    if (have + take > TRACE_LINE_MAX) {
      r->line_no++;
      if (have && memchr(r->line, '\0', have)) return fail_long(r, (const uint8_t *)r->line, have);
      size_t room = TRACE_LINE_MAX - have;
      const uint8_t *nul = memchr(s, '\0', take < room + 1 ? take : room + 1);
      if (nul) return fail(r, "a NUL byte at column %zu", have + (size_t)(nul - s) + 1);
      return fail_long(r, s, 0);
    }
    memcpy(r->line + have, s, take);
    have += take;
    r->text_pos += take + (nl != NULL);
    if (nl) break;
  }
  r->line_no++;
  *line = r->line;
  *len = have;
  return 1;
}

/* ------------------------------------------------------------------------ */
/* Fields                                                                    */
/* ------------------------------------------------------------------------ */

static int fail_field(trace_reader *r, int field, const char *s, size_t n, const char *what) {
  char shown[FIELD_SHOWN * 4 + 8];
  printable(shown, sizeof shown, s, n, FIELD_SHOWN);
  return fail(r, "malformed field %d (%s): '%s' %s", field + 1, FIELD_NAMES[field], shown, what);
}

static int parse_number(trace_reader *r, int field, const char *s, size_t n, uint64_t *out) {
  if (n == 0) return fail(r, "malformed field %d (%s): empty", field + 1, FIELD_NAMES[field]);
  uint64_t v = 0;
  for (size_t i = 0; i < n; i++) {
    unsigned digit = (unsigned)(unsigned char)s[i] - '0';
    if (digit > 9) {
      return fail_field(r, field, s, n,
                        field == 2 ? "is not a decimal number (addresses are written in decimal)"
                                   : "is not an unsigned decimal number");
    }
    if (v > (UINT64_MAX - digit) / 10) return fail_field(r, field, s, n, "does not fit in 64 bits");
    v = v * 10 + digit;
  }
  *out = v;
  return 0;
}

/* The thorough parse: every field split out, the first fault named. */
static int parse_fields(trace_reader *r, const char *line, size_t len, trace_event *ev) {
  const char *nul = memchr(line, '\0', len);
  if (nul) return fail(r, "a NUL byte at column %zu", (size_t)(nul - line) + 1);
  const char *f[5];
  size_t n[5];
  int count = 0;
  const char *start = line, *end = line + len;
  for (const char *p = line;; p++) {
    if (p == end || *p == ',') {
      if (count < 5) {
        f[count] = start;
        n[count] = (size_t)(p - start);
      }
      count++;
      start = p + 1;
      if (p == end) break;
    }
  }
  if (count != 5) {
    char shown[FIELD_SHOWN * 4 + 8];
    printable(shown, sizeof shown, line, len, FIELD_SHOWN);
    return fail(r, "malformed line '%s': %d field(s), where the header '%s' has 5", shown, count,
                TRACE_HEADER);
  }
  if (parse_number(r, 0, f[0], n[0], &ev->t_us) < 0) return -1;
  if (n[1] == 5 && memcmp(f[1], "alloc", 5) == 0) {
    ev->is_alloc = true;
  } else if (n[1] == 4 && memcmp(f[1], "free", 4) == 0) {
    ev->is_alloc = false;
  } else {
    return fail_field(r, 1, f[1], n[1], "is neither alloc nor free");
  }
  if (parse_number(r, 2, f[2], n[2], &ev->addr) < 0) return -1;
  if (parse_number(r, 3, f[3], n[3], &ev->size) < 0) return -1;
  if (parse_number(r, 4, f[4], n[4], &ev->stream) < 0) return -1;
  return 0;
}

/* One pass over a line as it should be (numbers of at most 19 digits, which
 * cannot overflow); anything else goes to parse_fields, which names it. */
static int parse_event(trace_reader *r, const char *line, size_t len, trace_event *ev) {
  const char *p = line, *end = line + len;
  uint64_t v[5] = {0};
  for (int field = 0; field < 5; field++) {
    if (field == 1) {
      if (end - p >= 6 && memcmp(p, "alloc,", 6) == 0) {
        ev->is_alloc = true;
        p += 6;
      } else if (end - p >= 5 && memcmp(p, "free,", 5) == 0) {
        ev->is_alloc = false;
        p += 5;
      } else {
        goto thorough;
      }
      continue;
    }
    const char *digits = p;
    uint64_t x = 0;
    for (unsigned d; p < end && (d = (unsigned)(unsigned char)*p - '0') <= 9; p++) x = x * 10 + d;
    if (p == digits || p - digits > 19) goto thorough;
    if (field < 4) {
      if (p == end || *p != ',') goto thorough;
      p++;
    } else if (p != end) {
      goto thorough;
    }
    v[field] = x;
  }
  ev->t_us = v[0];
  ev->addr = v[2];
  ev->size = v[3];
  ev->stream = v[4];
  goto checks;
thorough:
  if (parse_fields(r, line, len, ev) < 0) return -1;
checks:
  if (ev->is_alloc && ev->size == 0)
    return fail(r, "malformed field 4 (size): an alloc of 0 bytes");
  if (ev->t_us < r->last_t_us) {
    return fail(r, "t_us %llu is earlier than the %llu of line %llu (timestamps may not decrease)",
                (unsigned long long)ev->t_us, (unsigned long long)r->last_t_us,
                (unsigned long long)r->last_t_line);
  }
  r->last_t_us = ev->t_us;
  r->last_t_line = r->line_no;
  ev->line = r->line_no;
  return 0;
}

int trace_reader_next(trace_reader *r, trace_event *ev) {
  if (r->failed) return -1;
  for (;;) {
    const char *line;
    size_t len;
    int got = next_line(r, &line, &len);
    if (got <= 0) return got;
    if (len > 0 && line[len - 1] == '\r') len--;
    if (len == 0) continue; /* an empty line */
    return parse_event(r, line, len, ev) < 0 ? -1 : 1;
  }
}

/* ------------------------------------------------------------------------ */
/* Opening                                                                   */
/* ------------------------------------------------------------------------ */

static trace_reader *reader_new(const char *name) {
  trace_reader *r = calloc(1, sizeof *r);
  if (r == NULL) return NULL;
  r->fd = -1;
  printable(r->name, sizeof r->name, name, strlen(name), NAME_SHOWN);
  return r;
}

/* Decide gzip or plain from the first bytes, then read the header. */
static bool reader_start(trace_reader *r) {
  if (fill_raw(r) < 0) return false;
  if (r->in_len == 0) {
    fail(r, "the file is empty; a trace starts with the line '%s'", TRACE_HEADER);
    return false;
  }
  bool magic;
  if (r->fd < 0) {
    magic = r->mem_size >= 2 && r->mem[0] == 0x1f && r->mem[1] == 0x8b;
  } else {
    if (r->in_len == 1 && r->in[0] == 0x1f) {
      /* A first read of 1 byte: the second says whether it is gzip's magic. */
      if (fill_raw(r) < 0) return false;
      memmove(r->in_buf + 1, r->in_buf, r->in_len);
      r->in_buf[0] = 0x1f;
      r->in = r->in_buf;
      r->in_len++;
    }
    magic = r->in_len >= 2 && r->in[0] == 0x1f && r->in[1] == 0x8b;
  }
  if (magic) {
    r->gzip = true;
    r->out_bytes = r->fd < 0 ? MEMORY_OUT_BYTES : OUT_BYTES;
    r->out = malloc(r->out_bytes);
    if (r->out == NULL) {
      fail(r, "out of host memory for the gzip stream");
      return false;
    }
    if (inflateInit2(&r->z, 15 + 16) != Z_OK) {
      fail(r, "zlib cannot start inflating");
      return false;
    }
    r->z_ready = true;
  }
  const char *line;
  size_t len;
  int got = next_line(r, &line, &len);
  if (got < 0) {
    size_t n = strlen(r->error);
    snprintf(r->error + n, sizeof r->error - n, " (a trace starts with the line '%s')",
             TRACE_HEADER);
    return false;
  }
  if (got > 0 && len > 0 && line[len - 1] == '\r') len--;
  if (got == 0) r->line_no = 0; /* only empty lines: an error of the file */
  if (got == 0 || len != strlen(TRACE_HEADER) || memcmp(line, TRACE_HEADER, len) != 0) {
    char shown[FIELD_SHOWN * 4 + 8];
    printable(shown, sizeof shown, got > 0 ? line : "", got > 0 ? len : 0, FIELD_SHOWN);
    fail(r, "not a trace: the first line is '%s', not the header '%s'", shown, TRACE_HEADER);
    return false;
  }
  return true;
}

static void set_error(char *err, size_t len, const trace_reader *r, const char *fallback) {
  if (err && len) snprintf(err, len, "%s", r ? r->error : fallback);
}

trace_reader *trace_reader_open(const char *path, char *err, size_t len) {
  trace_reader *r = reader_new(path);
  if (r == NULL) {
    set_error(err, len, NULL, "out of host memory opening a trace");
    return NULL;
  }
  r->fd = open(path, O_RDONLY | O_CLOEXEC);
  r->in_buf = malloc(IN_BYTES + 1);
  if (r->in_buf == NULL) {
    fail(r, "out of host memory");
  } else if (r->fd < 0) {
    fail(r, "cannot open: %s", strerror(errno));
  } else {
    struct stat st;
    if (fstat(r->fd, &st) == 0 && S_ISDIR(st.st_mode)) {
      fail(r, "is a directory, not a trace");
    } else {
      if (fstat(r->fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0)
        r->file_bytes = (double)st.st_size;
      if (reader_start(r)) return r;
    }
  }
  set_error(err, len, r, NULL);
  trace_reader_close(r);
  return NULL;
}

trace_reader *trace_reader_open_memory(const char *name, const uint8_t *data, size_t size,
                                       size_t max_read, char *err, size_t len) {
  trace_reader *r = reader_new(name);
  if (r == NULL) {
    set_error(err, len, NULL, "out of host memory opening a trace");
    return NULL;
  }
  r->mem = data;
  r->mem_size = size;
  r->max_read = max_read;
  r->file_bytes = (double)size;
  if (reader_start(r)) return r;
  set_error(err, len, r, NULL);
  trace_reader_close(r);
  return NULL;
}

const char *trace_reader_error(const trace_reader *r) { return r->failed ? r->error : ""; }

const char *trace_reader_name(const trace_reader *r) { return r->name; }

double trace_reader_progress(const trace_reader *r) {
  return r->file_bytes > 0.0 ? (double)r->raw_read / r->file_bytes : 0.0;
}

void trace_reader_close(trace_reader *r) {
  if (r == NULL) return;
  if (r->z_ready) inflateEnd(&r->z);
  if (r->fd >= 0) close(r->fd);
  free(r->in_buf);
  free(r->out);
  free(r);
}
