/* cli.h: what the files of the tidalloc command share: the subcommands'
 * entry points, and helpers every subcommand may reuse: building the
 * allocator's configuration the same way everywhere, argument parsing from
 * a table of options,
 * messages, a monotonic clock, a median, and a progress bar.
 *
 * Exit codes of every subcommand: 0 success, 1 a failure while running
 * (allocator error, bad trace), 2 a usage error (bad option). */
#ifndef TIDE_CLI_H
#define TIDE_CLI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "tidalloc.h"

enum { CLI_EXIT_OK = 0, CLI_EXIT_FAILURE = 1, CLI_EXIT_USAGE = 2 };

/* ------------------------------------------------------------------------ */
/* Subcommands: each gets argv with argv[0] being the subcommand's name.     */
/* ------------------------------------------------------------------------ */

int tide_cli_micro(int argc, char **argv);  /* micro.c */
int tide_cli_replay(int argc, char **argv); /* replay.c */
int tide_cli_info(int argc, char **argv);   /* info.c */
int tide_cli_stream(int argc, char **argv); /* stream.c */
int tide_cli_soak(int argc, char **argv);   /* soak.c */

/* ------------------------------------------------------------------------ */
/* Configuration (cli.c): one rule for every subcommand.                     */
/* ------------------------------------------------------------------------ */

/* The emulated device of the commands whose workloads never write device
 * memory on the host backend (stream, replay): the same size on every
 * machine, so that their figures and the traces that fit do not depend on
 * the machine's memory. The host backend's own default follows the
 * machine's memory so that memory written cannot exceed it; memory never
 * written costs nothing, so a device larger than the machine is safe here.
 * TIDALLOC_CONF and --conf still set host_capacity. */
#define CLI_UNWRITTEN_DEVICE "host_capacity:24GiB"

/* Build a config: the defaults, then `first` (NULL: nothing; micro and replay
 * pass "backend:host" so that they run on the emulated device unless told
 * otherwise), then TIDALLOC_CONF, then `conf` (the --conf argument, NULL:
 * nothing). Later steps override earlier ones.
 * On failure the status is returned, tide_last_error() says why, and *out
 * still holds the config with the steps before the failing one applied (NULL
 * only if no config could be made at all), so a caller can show what it has;
 * the caller frees *out in every case. */
tide_status cli_config_build(const char *first, const char *conf, tide_config **out);

/* cli_config_build then tide_create(device, ...). On failure prints the reason
 * on stderr (prefixed by "tidalloc <what>: ") and returns NULL. */
tide_allocator *cli_allocator_create(const char *what, const char *first, const char *conf,
                                     int device);

/* ------------------------------------------------------------------------ */
/* Arguments and messages (cli.c)                                            */
/* ------------------------------------------------------------------------ */

/* If argv[*i] is `name` ("--conf") followed by a value, or "name=value",
 * store the value, advance *i past what was used and return true. A missing
 * value prints a usage error and sets *bad. */
bool cli_option_value(int argc, char **argv, int *i, const char *name, const char **value,
                      bool *bad);
/* One option of a subcommand, for cli_parse. */
typedef enum cli_kind {
  CLI_FLAG,   /* no value: *(bool *)target = true */
  CLI_TEXT,   /* *(const char **)target = the value */
  CLI_COUNT,  /* *(uint64_t *)target = a whole number in [min, max] */
  CLI_CUSTOM, /* parse(value, target); false refuses the value */
  CLI_MANY,   /* every argument after it that is no option ("-5" is none), each
               * through parse(value, target), which says why it refuses one;
               * at least one */
} cli_kind;

typedef struct cli_option {
  const char *name; /* "--conf" */
  cli_kind kind;
  void *target;
  uint64_t min, max; /* CLI_COUNT */
  /* CLI_CUSTOM: true if the value is taken; false after its own message
   * (cli_error), or without one, then the usage error says what the
   * option wants. */
  bool (*parse)(const char *value, void *target);
  /* What a refused value's message says the option wants ("a count from 1
   * to 100000"); NULL for CLI_COUNT: "a number from MIN to MAX". For
   * CLI_MANY, what one value is ("frame count"), for the message when none
   * follows. */
  const char *wants;
  bool *given; /* if not NULL, set when the option's value is taken */
} cli_option;

/* Parse argv[1..] of the subcommand `command` ("micro"): -h or --help calls
 * help() and gives CLI_EXIT_OK; each of the `count` options is taken as its
 * kind says, as "--name value" or "--name=value"; an argument that starts
 * with '-' and is no option, or a positional argument beyond the
 * `max_positional` that go into `positional` (in order, NULL-filled), is a
 * usage error, as is a refused value, each with a message on stderr.
 * Returns -1 to go on, or the exit code. */
int cli_parse(int argc, char **argv, const char *command, void (*help)(void),
              const cli_option *options, size_t count, const char **positional,
              size_t max_positional);

/* Parse a whole decimal unsigned number; false if `text` is not one. */
bool cli_parse_u64(const char *text, uint64_t *out);
/* True for "-h" and "--help". */
bool cli_is_help(const char *arg);

/* "tidalloc: <message>\n" on stderr. */
void cli_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* "tidalloc <what>: <tide_last_error()>\n" on stderr. */
void cli_report_tide_error(const char *what);

/* Flush and close `f`, an output named `name` in messages ("standard
 * output", a path). False after "tidalloc: cannot write NAME: reason" on
 * stderr when anything written to it was lost (a full disk, a closed pipe),
 * then or earlier. */
bool cli_close_output(FILE *f, const char *name);

/* "1.50 GiB", "512 B" into buf (>= 32 bytes); returns buf. */
const char *cli_format_bytes(uint64_t bytes, char *buf, size_t len);

/* ------------------------------------------------------------------------ */
/* Measuring (cli.c)                                                         */
/* ------------------------------------------------------------------------ */

/* Nanoseconds of the monotonic clock. */
uint64_t cli_now_ns(void);
/* The median of n values (n >= 1; the mean of the middle two when n is even).
 * Sorts `values` in place. */
double cli_median(double *values, size_t n);

/* Draw "label [=====>    ]  42%" on stderr, redrawn in place, only when
 * stderr is a terminal; fraction >= 1 finishes the line. Cheap to call often:
 * it redraws only when the shown percentage changes. For one thread at a
 * time. */
void cli_progress(const char *label, double fraction);

#endif /* TIDE_CLI_H */
