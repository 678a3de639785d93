/* cli.c: the helpers every subcommand of the tidalloc command shares (see
 * cli.h): configuration building, argument parsing, messages, the clock, the
 * median and the progress bar. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"

/* ------------------------------------------------------------------------ */
/* Configuration                                                            */
/* ------------------------------------------------------------------------ */

tide_status cli_config_build(const char *first, const char *conf, tide_config **out) {
  *out = NULL;
  tide_status st = tide_config_new(out);
  if (st != TIDE_OK) return st;
  if (first != NULL) {
    st = tide_config_parse(*out, first);
    if (st != TIDE_OK) return st;
  }
  st = tide_config_load_env(*out);
  if (st != TIDE_OK) return st;
  if (conf != NULL) st = tide_config_parse(*out, conf);
  return st;
}

tide_allocator *cli_allocator_create(const char *what, const char *first, const char *conf,
                                     int device) {
  tide_config *config = NULL;
  tide_allocator *alloc = NULL;
  tide_status st = cli_config_build(first, conf, &config);
  if (st == TIDE_OK) st = tide_create(device, config, &alloc);
  if (st != TIDE_OK) {
    cli_report_tide_error(what);
    alloc = NULL;
  }
  tide_config_free(config);
  return alloc;
}

/* ------------------------------------------------------------------------ */
/* Arguments and messages                                                    */
/* ------------------------------------------------------------------------ */

bool cli_option_value(int argc, char **argv, int *i, const char *name, const char **value,
                      bool *bad) {
  const char *arg = argv[*i];
  size_t len = strlen(name);
  if (strncmp(arg, name, len) != 0) return false;
  if (arg[len] == '=') {
    *value = arg + len + 1;
    return true;
  }
  if (arg[len] != '\0') return false;
  if (*i + 1 >= argc) {
    cli_error("%s needs a value", name);
    *bad = true;
    return true;
  }
  *i += 1;
  *value = argv[*i];
  return true;
}

/* An argument that names an option: "-x" or "--x", not "-" or a negative
 * number ("-5" is a bad value, not an option). */
static bool is_option(const char *arg) {
  return arg[0] == '-' && arg[1] != '\0' && !(arg[1] >= '0' && arg[1] <= '9');
}

/* The value of one option into its target; false after a usage message. */
static bool take(const char *command, const cli_option *opt, const char *value) {
  uint64_t n = 0;
  switch (opt->kind) {
  case CLI_FLAG: *(bool *)opt->target = true; return true;
  case CLI_TEXT: *(const char **)opt->target = value; return true;
  case CLI_COUNT:
    if (cli_parse_u64(value, &n) && n >= opt->min && n <= opt->max) {
      *(uint64_t *)opt->target = n;
      return true;
    }
    if (opt->wants)
      cli_error("%s: %s wants %s, not '%s'", command, opt->name, opt->wants, value);
    else
      cli_error("%s: %s wants a number from %llu to %llu, not '%s'", command, opt->name,
                (unsigned long long)opt->min, (unsigned long long)opt->max, value);
    return false;
  case CLI_MANY: return opt->parse(value, opt->target); /* with its own message */
  case CLI_CUSTOM:
    if (opt->parse(value, opt->target)) return true;
    if (opt->wants) cli_error("%s: %s wants %s, not '%s'", command, opt->name, opt->wants, value);
    return false;
  }
  return false;
}

static bool take_value(const char *command, const cli_option *opt, const char *value) {
  bool taken = take(command, opt, value);
  if (taken && opt->given) *opt->given = true;
  return taken;
}

int cli_parse(int argc, char **argv, const char *command, void (*help)(void),
              const cli_option *options, size_t count, const char **positional,
              size_t max_positional) {
  size_t npositional = 0;
  for (size_t p = 0; p < max_positional; p++) positional[p] = NULL;
  for (int i = 1; i < argc; i++) {
    if (cli_is_help(argv[i])) {
      help();
      return CLI_EXIT_OK;
    }
    const cli_option *opt = NULL;
    const char *value = NULL;
    bool bad = false;
    for (size_t k = 0; k < count && !opt; k++) {
      if (options[k].kind == CLI_FLAG || options[k].kind == CLI_MANY) {
        if (strcmp(argv[i], options[k].name) == 0) opt = &options[k];
      } else if (cli_option_value(argc, argv, &i, options[k].name, &value, &bad)) {
        opt = &options[k];
      }
    }
    if (bad) return CLI_EXIT_USAGE;
    if (opt && opt->kind == CLI_MANY) {
      int first = i;
      while (i + 1 < argc && !is_option(argv[i + 1]))
        if (!take_value(command, opt, argv[++i])) return CLI_EXIT_USAGE;
      if (i == first) {
        cli_error("%s: %s needs at least one %s", command, opt->name, opt->wants);
        return CLI_EXIT_USAGE;
      }
      continue;
    }
    if (opt) {
      if (!take_value(command, opt, value)) return CLI_EXIT_USAGE;
      continue;
    }
    if (is_option(argv[i])) {
      cli_error("%s: unknown argument '%s' (try `tidalloc %s --help`)", command, argv[i], command);
      return CLI_EXIT_USAGE;
    }
    if (npositional == max_positional) {
      cli_error("%s: unexpected argument '%s' (try `tidalloc %s --help`)", command, argv[i],
                command);
      return CLI_EXIT_USAGE;
    }
    positional[npositional++] = argv[i];
  }
  return -1;
}

bool cli_parse_u64(const char *text, uint64_t *out) {
  if (text == NULL || *text < '0' || *text > '9') return false;
  errno = 0;
  char *end = NULL;
  unsigned long long v = strtoull(text, &end, 10);
  if (errno != 0 || *end != '\0') return false;
  *out = (uint64_t)v;
  return true;
}

bool cli_is_help(const char *arg) { return strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0; }

void cli_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fflush(stdout); /* what was printed before the message comes before it */
  fputs("tidalloc: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
}

void cli_report_tide_error(const char *what) {
  const char *message = tide_last_error();
  fflush(stdout);
  fprintf(stderr, "tidalloc %s: %s (%s)\n", what, message[0] ? message : "unknown error",
          tide_status_name(tide_last_status()));
}

bool cli_close_output(FILE *f, const char *name) {
  /* ferror: a write that failed earlier, whose bytes a later flush does not
   * bring back; errno is only this flush's or close's. */
  errno = 0;
  bool earlier = ferror(f) != 0;
  bool flushed = fflush(f) == 0;
  int flush_errno = errno;
  bool closed = fclose(f) == 0;
  if (!earlier && flushed && closed) return true;
  int why = !flushed ? flush_errno : !closed ? errno : 0;
  if (f != stdout) fflush(stdout); /* what was printed before the message comes before it */
  if (why != 0)
    fprintf(stderr, "tidalloc: cannot write %s: %s\n", name, strerror(why));
  else
    fprintf(stderr, "tidalloc: cannot write %s: a write failed\n", name);
  return false;
}

const char *cli_format_bytes(uint64_t bytes, char *buf, size_t len) {
  static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < 1024) {
    snprintf(buf, len, "%llu B", (unsigned long long)bytes);
    return buf;
  }
  double value = (double)bytes;
  size_t unit = 0;
  while (value >= 1024.0 && unit + 1 < sizeof(units) / sizeof(units[0])) {
    value /= 1024.0;
    unit++;
  }
  snprintf(buf, len, "%.2f %s", value, units[unit]);
  return buf;
}

/* ------------------------------------------------------------------------ */
/* Measuring                                                                 */
/* ------------------------------------------------------------------------ */

uint64_t cli_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int compare_doubles(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

double cli_median(double *values, size_t n) {
  qsort(values, n, sizeof(values[0]), compare_doubles);
  if (n % 2 == 1) return values[n / 2];
  return (values[n / 2 - 1] + values[n / 2]) / 2.0;
}

void cli_progress(const char *label, double fraction) {
  /* The last drawn state, so that frequent calls redraw rarely. */
  static int last_percent = -1;
  static const char *last_label = NULL;
  static int is_tty = -1;
  if (is_tty < 0) is_tty = isatty(STDERR_FILENO) ? 1 : 0;
  if (!is_tty) return;
  if (fraction < 0.0) fraction = 0.0;
  if (fraction > 1.0) fraction = 1.0;
  int percent = (int)(fraction * 100.0);
  if (percent == last_percent && label == last_label) return;
  last_percent = percent;
  last_label = label;

  enum { WIDTH = 30 };
  char bar[WIDTH + 1];
  int filled = (int)(fraction * WIDTH);
  for (int i = 0; i < WIDTH; i++) {
    bar[i] = i < filled ? '=' : (i == filled ? '>' : ' ');
  }
  bar[WIDTH] = '\0';
  fprintf(stderr, "\r%s [%s] %3d%%", label, bar, percent);
  if (fraction >= 1.0) {
    fputc('\n', stderr);
    last_percent = -1;
    last_label = NULL;
  }
  fflush(stderr);
}
