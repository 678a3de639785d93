/* trace_read.h: reading a recorded allocation trace one event at a time.
 *
 * A trace is a CSV, gzip'd or plain, header `t_us,action,addr,size,stream`,
 * one row per event: `alloc` (a block of `size` bytes at `addr`) or `free`
 * (the block at `addr`; its size may be repeated, or 0). Every number is an
 * unsigned decimal. The reader holds one line and two fixed buffers, whatever
 * the size of the trace: a line longer than TRACE_LINE_MAX bytes, a NUL byte,
 * a malformed field, a timestamp earlier than the one before, a corrupt or
 * truncated gzip stream and data after the gzip stream are each an error that
 * names the file, the line and what is wrong, in printable ASCII (bytes of
 * the file are escaped). Empty lines are skipped. */
#ifndef TIDE_TRACE_READ_H
#define TIDE_TRACE_READ_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define TRACE_HEADER "t_us,action,addr,size,stream"
enum { TRACE_LINE_MAX = 255 /* bytes of a line, without its newline */ };

typedef struct trace_event {
  uint64_t t_us;
  uint64_t addr;
  uint64_t size;   /* for frees: 0 when the trace did not say */
  uint64_t stream; /* the trace's stream id; 0 is the default stream */
  uint64_t line;   /* in the file, for messages */
  bool is_alloc;
} trace_event;

typedef struct trace_reader trace_reader;

/* Open a trace file and read its header. NULL when it cannot be opened,
 * does not start with the header or memory runs out; then `err` (of `len`
 * bytes) says why. */
trace_reader *trace_reader_open(const char *path, char *err, size_t len);

/* The same over `size` bytes in memory (kept by the caller until close),
 * called `name` in messages. Each read from it takes at most `max_read`
 * bytes (0: no limit), so tests can cut the input anywhere. */
trace_reader *trace_reader_open_memory(const char *name, const uint8_t *data, size_t size,
                                       size_t max_read, char *err, size_t len);

/* The next event: 1 and *ev filled, 0 at the end of the trace, -1 on an
 * error (trace_reader_error says what; every later call returns -1). */
int trace_reader_next(trace_reader *r, trace_event *ev);

/* The last error, "" when none: "<file>:<line>: <what>". */
const char *trace_reader_error(const trace_reader *r);

/* The file's name as messages show it (printable). */
const char *trace_reader_name(const trace_reader *r);

/* The fraction of the file read so far (0 when its size is unknown). */
double trace_reader_progress(const trace_reader *r);

void trace_reader_close(trace_reader *r);

#endif /* TIDE_TRACE_READ_H */
