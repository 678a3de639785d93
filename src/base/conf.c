/* conf.c: the option table and tide_config, a set of option values with the
 * source of each. Text is written "key:value,key:value" as in
 * PYTORCH_CUDA_ALLOC_CONF; parsing is strict (trailing garbage, negatives,
 * overflow, NaN and infinities are errors) and atomic (on any error nothing is
 * applied). Each option's default is its text in the table, parsed like any
 * other value, so the table is the one place defaults live.
 *
 * Numbers are scanned and formatted here rather than with plain strtod, so
 * that a program's LC_NUMERIC (a decimal comma) cannot change what a config
 * means; their value comes from strtod_l in the "C" locale, which rounds
 * correctly, so that formatting a value and parsing the text gives it back.
 * The process-wide configuration (tide_config_process_set/get) lives elsewhere. */
#include <locale.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/internal.h"

#define TIDE_CONF_ENV "TIDALLOC_CONF"
#define VALUE_TEXT_LEN 256  /* the longest formatted value (a full list) fits */
#define ITEM_VALUE_MAX 1024 /* longer values are refused, not truncated */
#define KEY_MAX 64
#define SHOWN_MAX 80 /* bytes of a bad key or value quoted in a message */

/* ------------------------------------------------------------------------ */
/* Characters and numbers                                                   */
/* ------------------------------------------------------------------------ */

static bool is_space(unsigned char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }
static bool is_digit(unsigned char c) { return c >= '0' && c <= '9'; }
static unsigned char lower(unsigned char c) { return c >= 'A' && c <= 'Z' ? c + 32 : c; }

static bool equals_nocase(const char *a, const char *b) {
  for (; *a && *b; a++, b++)
    if (lower((unsigned char)*a) != lower((unsigned char)*b)) return false;
  return *a == *b;
}

static bool is_pow2(uint64_t x) { return x != 0 && (x & (x - 1)) == 0; }

static unsigned log2_u64(uint64_t x) {
  unsigned n = 0;
  while (x >>= 1) n++;
  return n;
}

/* [begin, end) without surrounding whitespace. */
static void trim(const char **begin, const char **end) {
  while (*begin < *end && is_space((unsigned char)**begin)) (*begin)++;
  while (*end > *begin && is_space((unsigned char)(*end)[-1])) (*end)--;
}

/* Copy [begin, end) into buf as a string; false if it does not fit. */
static bool copy_range(const char *begin, const char *end, char *buf, size_t len) {
  size_t n = (size_t)(end - begin);
  if (n >= len) return false;
  memcpy(buf, begin, n);
  buf[n] = '\0';
  return true;
}

/* A printable, bounded copy of user text for messages: random bytes in a
 * message would make it unreadable (or not valid UTF-8). */
static const char *shown(const char *begin, const char *end, char *buf, size_t len) {
  size_t n = 0;
  for (const char *p = begin; p < end && n + 4 < len && n < SHOWN_MAX; p++) {
    unsigned char c = (unsigned char)*p;
    buf[n++] = (c >= 0x20 && c < 0x7f && c != '"') ? (char)c : '?';
  }
  if ((size_t)(end - begin) > n) {
    memcpy(buf + n, "...", 3);
    n += 3;
  }
  buf[n] = '\0';
  return buf;
}

static void set_why(char *why, size_t why_len, const char *text) {
  snprintf(why, why_len, "%s", text);
}

/* A whole decimal number without sign, at most max. */
static bool parse_uint(const char *s, uint64_t max, uint64_t *out, char *why, size_t why_len) {
  if (*s == '-') return set_why(why, why_len, "negative"), false;
  if (!is_digit((unsigned char)*s)) return set_why(why, why_len, "not a whole number"), false;
  uint64_t value = 0;
  for (; is_digit((unsigned char)*s); s++) {
    uint64_t digit = (uint64_t)(*s - '0');
    if (value > (UINT64_MAX - digit) / 10) return set_why(why, why_len, "too large"), false;
    value = value * 10 + digit;
  }
  if (*s != '\0') return set_why(why, why_len, "not a whole number"), false;
  if (value > max) return set_why(why, why_len, "too large"), false;
  *out = value;
  return true;
}

/* The "C" locale for numbers, made once (0 if it cannot be made). */
static locale_t c_numeric;
static pthread_once_t c_numeric_once = PTHREAD_ONCE_INIT;

static void make_c_numeric(void) { c_numeric = newlocale(LC_NUMERIC_MASK, "C", (locale_t)0); }

/* Powers of ten that doubles hold exactly: one multiplication or division by
 * them rounds correctly (Clinger's fast path). */
static const double exact_pow10[] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,
                                     1e8,  1e9,  1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
                                     1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

static double scale_pow10(uint64_t mantissa, long exp10) {
  if (mantissa <= ((uint64_t)1 << 53) && exp10 >= -22 && exp10 <= 22)
    return exp10 >= 0 ? (double)mantissa * exact_pow10[exp10]
                      : (double)mantissa / exact_pow10[-exp10];
  /* Beyond the fast path the result may be off by an ulp: only without the
   * "C" locale (see parse_decimal). */
  double value = (double)mantissa;
  if (exp10 > 400) return value * 1e300 * 1e300;
  if (exp10 < -400) return 0.0;
  for (; exp10 > 0; exp10--) value *= 10.0;
  for (; exp10 < 0; exp10++) value /= 10.0;
  return value;
}

/* A decimal number without sign: digits, an optional fraction, an optional
 * exponent ("0.5", ".25", "1e-3"). No NaN, no infinity, no hex. */
static bool parse_decimal(const char *s, double *out, char *why, size_t why_len) {
  const char *start = s;
  uint64_t mantissa = 0;
  long exp10 = 0, exponent = 0;
  int significant = 0, digits = 0;
  if (*s == '-') return set_why(why, why_len, "negative"), false;
  for (; is_digit((unsigned char)*s); s++, digits++) {
    if (mantissa == 0 && *s == '0') continue;
    if (significant < 19)
      mantissa = mantissa * 10 + (uint64_t)(*s - '0'), significant++;
    else
      exp10++;
  }
  if (*s == '.') {
    for (s++; is_digit((unsigned char)*s); s++, digits++) {
      if (mantissa == 0 && *s == '0') {
        exp10--;
        continue;
      }
      if (significant < 19) mantissa = mantissa * 10 + (uint64_t)(*s - '0'), significant++, exp10--;
    }
  }
  if (digits == 0) return set_why(why, why_len, "not a number"), false;
  if (*s == 'e' || *s == 'E') {
    bool negative = false;
    s++;
    if (*s == '+' || *s == '-') negative = (*s++ == '-');
    if (!is_digit((unsigned char)*s)) return set_why(why, why_len, "not a number"), false;
    for (; is_digit((unsigned char)*s); s++)
      if (exponent < 100000) exponent = exponent * 10 + (*s - '0');
    exp10 += negative ? -exponent : exponent;
  }
  if (*s != '\0') return set_why(why, why_len, "not a number"), false;
  /* The text is a plain decimal number now: strtod_l in the "C" locale
   * rounds it correctly (the mantissa above keeps 19 digits only). */
  pthread_once(&c_numeric_once, make_c_numeric);
  double value = mantissa == 0 ? 0.0
                 : c_numeric   ? strtod_l(start, NULL, c_numeric)
                               : scale_pow10(mantissa, exp10);
  if (value > 1.7976931348623157e308) return set_why(why, why_len, "too large"), false;
  if (mantissa != 0 && value == 0.0) return set_why(why, why_len, "too small"), false;
  *out = value;
  return true;
}

/* The shortest text that parses back to `value`; the decimal point is
 * always '.', whatever the locale printf uses. */
static void format_decimal(double value, char *buf, size_t len) {
  char why[8];
  for (int precision = 1; precision <= 17; precision++) {
    snprintf(buf, len, "%.*g", precision, value);
    char *w = buf;
    for (const char *r = buf; *r; r++) {
      unsigned char c = (unsigned char)*r;
      if (is_digit(c) || c == 'e' || c == '+' || c == '-')
        *w++ = (char)c;
      else if (w == buf || w[-1] != '.')
        *w++ = '.';
    }
    *w = '\0';
    double back;
    if (parse_decimal(buf, &back, why, sizeof why) && back == value) break;
  }
  if (!strchr(buf, '.') && !strchr(buf, 'e') && strlen(buf) + 2 < len) strcat(buf, ".0");
}

/* Bytes with an optional binary unit: B, K/KB/KiB, M/MB/MiB, G/GB/GiB,
 * T/TB/TiB (any case; KB means KiB, as PyTorch's _mb options mean MiB). */
static bool parse_bytes(const char *s, uint64_t max, uint64_t *out, char *why, size_t why_len) {
  static const char *const units[] = {"b", "k", "m", "g", "t"};
  if (*s == '-') return set_why(why, why_len, "negative"), false;
  const char *p = s;
  while (is_digit((unsigned char)*p)) p++;
  char number[32];
  if (!copy_range(s, p, number, sizeof number)) return set_why(why, why_len, "too large"), false;
  const char *unit = p;
  while (is_space((unsigned char)*unit)) unit++;
  unsigned shift = 0;
  bool known = *unit == '\0';
  for (unsigned i = 0; i < 5 && !known; i++) {
    char with_b[4] = {units[i][0], 'b', 0, 0}, with_ib[4] = {units[i][0], 'i', 'b', 0};
    if (equals_nocase(unit, units[i]) ||
        (i > 0 && (equals_nocase(unit, with_b) || equals_nocase(unit, with_ib)))) {
      known = true;
      shift = 10 * i;
    }
  }
  uint64_t value;
  if (*number == '\0' || *p == '.')
    return set_why(why, why_len, "not a whole number of bytes"), false;
  if (!parse_uint(number, UINT64_MAX, &value, why, why_len)) return false;
  if (!known) return set_why(why, why_len, "unknown unit"), false;
  if (value > (max >> shift)) return set_why(why, why_len, "too large"), false;
  *out = value << shift;
  return true;
}

/* "24GiB" when a binary unit divides the count exactly, else plain bytes. */
static void format_bytes(uint64_t bytes, char *buf, size_t len) {
  static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  unsigned unit = 0;
  while (bytes != 0 && unit < 4 && (bytes & 1023) == 0) bytes >>= 10, unit++;
  if (unit == 0)
    snprintf(buf, len, "%llu", (unsigned long long)bytes);
  else
    snprintf(buf, len, "%llu%s", (unsigned long long)bytes, units[unit]);
}

static bool parse_bool(const char *s, bool *out, char *why, size_t why_len) {
  if (equals_nocase(s, "true") || strcmp(s, "1") == 0) return *out = true, true;
  if (equals_nocase(s, "false") || strcmp(s, "0") == 0) return *out = false, true;
  set_why(why, why_len, "not a boolean");
  return false;
}

static void format_bool(bool value, char *buf, size_t len) {
  snprintf(buf, len, "%s", value ? "True" : "False");
}

/* ------------------------------------------------------------------------ */
/* The options                                                              */
/* ------------------------------------------------------------------------ */

static bool parse_backend(const char *s, _tide_conf_values *v, char *why, size_t why_len) {
  if (equals_nocase(s, "auto")) return v->backend = TIDE_BACKEND_AUTO, true;
  if (equals_nocase(s, "host")) return v->backend = TIDE_BACKEND_HOST, true;
  if (equals_nocase(s, "cuda")) return v->backend = TIDE_BACKEND_CUDA, true;
  if (equals_nocase(s, "native") || equals_nocase(s, "cudaMallocAsync"))
    set_why(why, why_len,
            "in PyTorch this key picks native or cudaMallocAsync; in tidalloc "
            "it picks the device backend");
  else
    set_why(why, why_len, "unknown backend");
  return false;
}

static void format_backend(const _tide_conf_values *v, char *buf, size_t len) {
  static const char *const names[] = {"auto", "host", "cuda"};
  snprintf(buf, len, "%s", v->backend >= 0 && v->backend <= 2 ? names[v->backend] : "?");
}

#define ROUNDUP_MAX_DIVISIONS 1024
#define ROUNDUP_LAST (TIDE_ROUNDUP_INTERVALS - 1)

static bool parse_divisions(const char *s, unsigned *out, char *why, size_t why_len) {
  uint64_t n;
  if (!parse_uint(s, ROUNDUP_MAX_DIVISIONS, &n, why, why_len)) return false;
  if (n != 0 && !is_pow2(n)) return set_why(why, why_len, "divisions not a power of two"), false;
  *out = (unsigned)n;
  return true;
}

/* One "key:divisions" entry of the list form: the key is a power of two of
 * MiB naming the interval [key, 2*key) MiB, or ">" for every interval after
 * the last one named. Keys rise; ">" comes last. */
static bool parse_roundup_entry(const char *begin, const char *end, unsigned *div, int *last,
                                bool *saw_rest, char *why, size_t why_len) {
  const char *colon = memchr(begin, ':', (size_t)(end - begin));
  if (!colon) return set_why(why, why_len, "a list entry lacks ':'"), false;
  const char *kb = begin, *ke = colon, *vb = colon + 1, *ve = end;
  trim(&kb, &ke);
  trim(&vb, &ve);
  char key[32], value[32];
  if (!copy_range(kb, ke, key, sizeof key) || !copy_range(vb, ve, value, sizeof value))
    return set_why(why, why_len, "a list entry is too long"), false;
  unsigned divisions;
  char inner[64], key_text[SHOWN_MAX + 8];
  shown(kb, ke, key_text, sizeof key_text); /* the key as a message may quote it */
  if (!parse_divisions(value, &divisions, inner, sizeof inner))
    return snprintf(why, why_len, "list entry \"%s\": %s", key_text, inner), false;
  if (*saw_rest) return set_why(why, why_len, "an entry follows \">\""), false;
  if (strcmp(key, ">") == 0) {
    for (int i = *last + 1; i < TIDE_ROUNDUP_INTERVALS; i++) div[i] = divisions;
    *saw_rest = true;
    return true;
  }
  uint64_t mib;
  if (!parse_uint(key, (uint64_t)1 << ROUNDUP_LAST, &mib, inner, sizeof inner) || !is_pow2(mib))
    return snprintf(why, why_len, "list key \"%s\" is not a power of two from 1 to %llu MiB",
                    key_text, 1ULL << ROUNDUP_LAST),
           false;
  int index = (int)log2_u64(mib);
  if (index <= *last) return set_why(why, why_len, "list keys must rise"), false;
  /* The first key also covers every smaller size, as in PyTorch. */
  for (int i = *last < 0 ? 0 : index; i <= index; i++) div[i] = divisions;
  *last = index;
  return true;
}

static bool parse_roundup_list(const char *s, unsigned *div, char *why, size_t why_len) {
  size_t n = strlen(s);
  if (n < 2 || s[n - 1] != ']') return set_why(why, why_len, "a list lacks its ']'"), false;
  const char *begin = s + 1, *stop = s + n - 1;
  if (memchr(begin, '[', (size_t)(stop - begin)) || memchr(begin, ']', (size_t)(stop - begin)))
    return set_why(why, why_len, "nested brackets"), false;
  int last = -1;
  bool saw_rest = false;
  memset(div, 0, sizeof(unsigned) * TIDE_ROUNDUP_INTERVALS);
  while (begin < stop) {
    const char *end = memchr(begin, ',', (size_t)(stop - begin));
    if (!end) end = stop;
    const char *b = begin, *e = end;
    trim(&b, &e);
    if (b < e && !parse_roundup_entry(b, e, div, &last, &saw_rest, why, why_len)) return false;
    begin = end + 1;
  }
  return true;
}

static bool parse_roundup(const char *s, _tide_conf_values *v, char *why, size_t why_len) {
  unsigned div[TIDE_ROUNDUP_INTERVALS];
  if (*s == '[') {
    if (!parse_roundup_list(s, div, why, why_len)) return false;
  } else {
    unsigned all;
    if (!parse_divisions(s, &all, why, why_len)) return false;
    for (int i = 0; i < TIDE_ROUNDUP_INTERVALS; i++) div[i] = all;
  }
  memcpy(v->roundup_divisions, div, sizeof div);
  return true;
}

/* The shortest list that parses back to the same intervals: the first entry
 * covers the leading run, ">" the trailing run. */
static void format_roundup(const _tide_conf_values *v, char *buf, size_t len) {
  const unsigned *div = v->roundup_divisions;
  int first = 0, rest = ROUNDUP_LAST;
  while (first < ROUNDUP_LAST && div[first + 1] == div[0]) first++;
  if (first == ROUNDUP_LAST) {
    snprintf(buf, len, "%u", div[0]);
    return;
  }
  while (rest > first + 1 && div[rest - 1] == div[ROUNDUP_LAST]) rest--;
  size_t used = (size_t)snprintf(buf, len, "[");
  for (int i = first; i < rest && used < len; i++)
    used += (size_t)snprintf(buf + used, len - used, "%s%llu:%u", i == first ? "" : ",", 1ULL << i,
                             div[i]);
  if (used < len) used += (size_t)snprintf(buf + used, len - used, ",>:%u", div[ROUNDUP_LAST]);
  if (used < len) snprintf(buf + used, len - used, "]");
}

/* Limits of the options below, each with its reason. Blocks this large stay
 * whole; PyTorch refuses less than its 20 MiB large buffer, and above
 * TIDE_MAX_ALLOC a limit means nothing. */
#define SPLIT_MIN_MB (TIDE_LARGE_BUFFER / TIDE_MiB)
#define MAX_ALLOC_MB (TIDE_MAX_ALLOC / TIDE_MiB)
/* The emulated device is mapped with mmap, which works in whole host pages. */
#define HOST_MIN_BYTES ((uint64_t)4 << 10)
/* Every emulated handle is at least a granularity: beyond 1 GiB a small
 * request would hold gigabytes. */
#define HOST_MAX_GRANULARITY ((uint64_t)TIDE_GiB)
/* The trace ring is host memory taken at creation: a bound keeps a typo from
 * taking gigabytes. */
#define TRACE_MAX ((uint64_t)1 << 24)
/* Far beyond any queue a GPU holds; it only bounds the number. */
#define HOST_MAX_QUEUE_DEPTH 1000000

/* How an option's text maps to its field of _tide_conf_values. */
typedef enum kind {
  KIND_BOOL,     /* True/False (also true/false/1/0) into a bool */
  KIND_UINT,     /* a whole number in [min, max] into an int, unsigned or size_t */
  KIND_MIB,      /* a whole number of MiB in [min, max], stored in bytes (size_t) */
  KIND_BYTES,    /* bytes with an optional unit in [min, max] (size_t) */
  KIND_FRACTION, /* a decimal number in [0, 1] (double), see FLAG_* */
  KIND_CUSTOM,   /* the option's own parse and format functions */
} kind;

enum {
  FLAG_NONZERO = 1,   /* KIND_FRACTION: 0 is refused ("zero") */
  FLAG_BELOW_ONE = 2, /* KIND_FRACTION: 1 is refused ("not below 1") */
  FLAG_POW2 = 4,      /* KIND_BYTES: a power of two */
};

typedef bool (*parse_fn)(const char *text, _tide_conf_values *v, char *why, size_t why_len);
typedef void (*format_fn)(const _tide_conf_values *v, char *buf, size_t len);

typedef struct option {
  const char *key;
  const char *default_text; /* canonical: formatting the default gives it back */
  const char *meaning;
  const char *accepts; /* what a message says is accepted */
  kind kind;
  size_t offset, size; /* the field (FIELD) */
  uint64_t min, max;   /* limits of KIND_UINT, KIND_MIB (in MiB) and KIND_BYTES */
  unsigned flags;
  /* KIND_MIB and KIND_BYTES: a word (and an alias) for the value `special`,
   * in bytes, which formats as the word. */
  const char *word, *alias;
  size_t special;
  parse_fn parse; /* KIND_CUSTOM */
  format_fn format;
} option;

#define FIELD(name)                                                                                \
  .offset = offsetof(_tide_conf_values, name), .size = sizeof(((_tide_conf_values *)0)->name)

static void *field_of(const option *opt, _tide_conf_values *v) { return (char *)v + opt->offset; }

static const void *const_field_of(const option *opt, const _tide_conf_values *v) {
  return (const char *)v + opt->offset;
}

/* A whole number into a field of its size (the limits keep it in range). */
static void store_uint(const option *opt, _tide_conf_values *v, uint64_t value) {
  void *field = field_of(opt, v);
  if (opt->size == sizeof(uint32_t)) {
    uint32_t narrow = (uint32_t)value;
    memcpy(field, &narrow, sizeof narrow);
  } else {
    size_t wide = (size_t)value;
    memcpy(field, &wide, sizeof wide);
  }
}

static uint64_t load_uint(const option *opt, const _tide_conf_values *v) {
  const void *field = const_field_of(opt, v);
  if (opt->size == sizeof(uint32_t)) {
    uint32_t narrow;
    memcpy(&narrow, field, sizeof narrow);
    return narrow;
  }
  size_t wide;
  memcpy(&wide, field, sizeof wide);
  return wide;
}

static bool below_min(const option *opt, uint64_t value, char *why, size_t why_len) {
  if (value >= opt->min) return false;
  set_why(why, why_len, value == 0 ? "zero" : "too small");
  return true;
}

static bool parse_option(const option *opt, const char *s, _tide_conf_values *v, char *why,
                         size_t why_len) {
  uint64_t n;
  double x;
  if (opt->word && (equals_nocase(s, opt->word) || (opt->alias && equals_nocase(s, opt->alias)))) {
    store_uint(opt, v, opt->special);
    return true;
  }
  switch (opt->kind) {
  case KIND_BOOL: return parse_bool(s, (bool *)field_of(opt, v), why, why_len);
  case KIND_UINT:
    if (!parse_uint(s, opt->max, &n, why, why_len) || below_min(opt, n, why, why_len)) return false;
    store_uint(opt, v, n);
    return true;
  case KIND_MIB:
    if (!parse_uint(s, opt->max, &n, why, why_len) || below_min(opt, n, why, why_len)) return false;
    store_uint(opt, v, n * TIDE_MiB);
    return true;
  case KIND_BYTES:
    if (!parse_bytes(s, opt->max, &n, why, why_len) || below_min(opt, n, why, why_len))
      return false;
    if ((opt->flags & FLAG_POW2) && !is_pow2(n))
      return set_why(why, why_len, "not a power of two"), false;
    store_uint(opt, v, n);
    return true;
  case KIND_FRACTION:
    if (!parse_decimal(s, &x, why, why_len)) return false;
    if ((opt->flags & FLAG_NONZERO) && x == 0.0) return set_why(why, why_len, "zero"), false;
    if ((opt->flags & FLAG_BELOW_ONE) && x >= 1.0)
      return set_why(why, why_len, "not below 1"), false;
    if (x > 1.0) return set_why(why, why_len, "above 1"), false;
    memcpy(field_of(opt, v), &x, sizeof x);
    return true;
  case KIND_CUSTOM: return opt->parse(s, v, why, why_len);
  }
  return false;
}

static void format_option(const option *opt, const _tide_conf_values *v, char *buf, size_t len) {
  if (opt->kind == KIND_CUSTOM) {
    opt->format(v, buf, len);
    return;
  }
  if (opt->kind == KIND_BOOL) {
    format_bool(*(const bool *)const_field_of(opt, v), buf, len);
    return;
  }
  if (opt->kind == KIND_FRACTION) {
    double x;
    memcpy(&x, const_field_of(opt, v), sizeof x);
    if (x == 0.0)
      snprintf(buf, len, "0");
    else
      format_decimal(x, buf, len);
    return;
  }
  uint64_t n = load_uint(opt, v);
  if (opt->word && n == opt->special)
    snprintf(buf, len, "%s", opt->word);
  else if (opt->kind == KIND_BYTES)
    format_bytes(n, buf, len);
  else
    snprintf(buf, len, "%llu", (unsigned long long)(opt->kind == KIND_MIB ? n / TIDE_MiB : n));
}

#define BOOL_ACCEPTS "True or False (also true/false/1/0)"

static const option options[] = {
    {.key = "backend",
     .default_text = "auto",
     .meaning = "device backend: cuda, host (an emulated device in host memory), or auto (cuda "
                "where a GPU is usable, else host)",
     .accepts = "auto, host or cuda",
     .kind = KIND_CUSTOM,
     .parse = parse_backend,
     .format = format_backend},
    {.key = "expandable_segments",
     .default_text = "True",
     .meaning = "one large virtual range per pool and stream, pages mapped on demand (False: "
                "fixed segments as cudaMalloc gives)",
     .accepts = BOOL_ACCEPTS,
     .kind = KIND_BOOL,
     FIELD(expandable_segments)},
    {.key = "page_size_mb",
     .default_text = "2",
     .meaning = "MiB an expandable segment maps at once (rounded up to the backend's granularity)",
     .accepts = "a whole number of MiB from 1 to 1024",
     .kind = KIND_MIB,
     FIELD(page_size),
     .min = 1,
     .max = 1024},
    {.key = "handle_size_mb",
     .default_text = "8",
     .meaning = "the most MiB one physical handle of an expandable segment holds: above "
                "page_size_mb, a stream holding handle_threshold_mb gives its requests of at "
                "least 4 such handles segments of handles this large (fewer driver mappings; a "
                "handle is unmapped only whole); at page_size_mb or below, one handle per page",
     .accepts = "a whole number of MiB from 0 to 1024",
     .kind = KIND_MIB,
     FIELD(handle_size),
     .max = 1024},
    {.key = "handle_threshold_mb",
     .default_text = "auto",
     .meaning = "MiB a stream's memory reaches before its large requests get large handles "
                "(handle_size_mb); auto: 1024 of those handles' worth",
     .accepts = "auto, or a whole number of MiB from 0 to 4294967296",
     .kind = KIND_MIB,
     FIELD(handle_threshold),
     .max = MAX_ALLOC_MB,
     .word = "auto",
     .special = SIZE_MAX},
    {.key = "max_split_size_mb",
     .default_text = "unlimited",
     .meaning = "blocks at least this many MiB are never split, so large free blocks stay whole",
     .accepts = "a whole number of MiB from 20 to 4294967296, or unlimited (or none)",
     .kind = KIND_MIB,
     FIELD(max_split_size),
     .min = SPLIT_MIN_MB,
     .max = MAX_ALLOC_MB,
     .word = "unlimited",
     .alias = "none",
     .special = SIZE_MAX},
    {.key = "roundup_power2_divisions",
     .default_text = "0",
     .meaning = "round sizes above 1 MiB up to one of N equal divisions of their power-of-two "
                "interval (0: plain 512 B rounding)",
     .accepts = "0 or a power of two up to 1024 for every interval, or a list such as "
                "[256:1,512:2,1024:4,>:8] keyed by rising powers of two of MiB from 1 to 65536, "
                "\">\" for every interval after the last named",
     .kind = KIND_CUSTOM,
     .parse = parse_roundup,
     .format = format_roundup},
    {.key = "garbage_collection_threshold",
     .default_text = "0",
     .meaning = "when reserved memory is above this fraction of the limit, cached free memory is "
                "returned before growing (0: off)",
     .accepts = "0 (off) or a fraction strictly between 0 and 1, such as 0.8",
     .kind = KIND_FRACTION,
     FIELD(gc_threshold),
     .flags = FLAG_BELOW_ONE},
    {.key = "memory_fraction",
     .default_text = "1.0",
     .meaning = "reserved memory may reach this fraction of the device's total memory (1.0: the "
                "whole device)",
     .accepts = "a fraction above 0 and at most 1, such as 0.5",
     .kind = KIND_FRACTION,
     FIELD(memory_fraction),
     .flags = FLAG_NONZERO},
    {.key = "memory_limit",
     .default_text = "0",
     .meaning = "reserved memory may reach this many bytes (0: no limit); the smaller of this and "
                "memory_fraction applies",
     .accepts = "0 or bytes up to 4096TiB with an optional unit B, KiB, MiB, GiB, TiB (KB, MB, "
                "GB, TB mean the same), such as 512MiB",
     .kind = KIND_BYTES,
     FIELD(memory_limit),
     .max = TIDE_MAX_ALLOC},
    {.key = "release_holes",
     .default_text = "True",
     .meaning = "when growing would raise reserved memory past its peak, first unmap whole free "
                "pages inside the segments, so physical memory is reused instead of added",
     .accepts = BOOL_ACCEPTS,
     .kind = KIND_BOOL,
     FIELD(release_holes)},
    {.key = "load_handles",
     .default_text = "True",
     .meaning = "until a stream first frees a block (a model loading its weights), each growth of "
                "an expandable segment for large requests maps its pages as one physical handle: "
                "far fewer driver calls for memory that is kept, and freed, if ever, whole",
     .accepts = BOOL_ACCEPTS,
     .kind = KIND_BOOL,
     FIELD(load_handles)},
    {.key = "peer_access",
     .default_text = "True",
     .meaning = "CUDA: every other GPU that can access this one's memory (cuDeviceCanAccessPeer) "
                "may read and write the allocator's blocks, so kernels on several GPUs can share "
                "them; the host backend has one address space and ignores it",
     .accepts = BOOL_ACCEPTS,
     .kind = KIND_BOOL,
     FIELD(peer_access)},
    {.key = "capture_detection",
     .default_text = "False",
     .meaning = "allocations from a stream being captured into a CUDA graph go to a private pool "
                "of that capture even without tide_capture_begin (costs a driver query per "
                "allocation and free)",
     .accepts = BOOL_ACCEPTS,
     .kind = KIND_BOOL,
     FIELD(capture_detection)},
    {.key = "graph_capture_record_stream_reuse",
     .default_text = "False",
     .meaning = "a capture pool's block freed during a capture after use on other streams "
                "(tide_record_stream) is reused in the same capture once the graph orders those "
                "uses before the allocating stream's next work, instead of at the capture's end "
                "(graph queries per allocation while such a free waits; tide_capture_reuse_set "
                "changes it at run time)",
     .accepts = BOOL_ACCEPTS,
     .kind = KIND_BOOL,
     FIELD(graph_reuse)},
    {.key = "trace",
     .default_text = "0",
     .meaning = "events kept in the trace ring, read with tide_trace_read (0: off)",
     .accepts = "a whole number from 0 to 16777216",
     .kind = KIND_UINT,
     FIELD(trace_capacity),
     .max = TRACE_MAX},
    {.key = "host_capacity",
     .default_text = "auto",
     .meaning = "memory of each emulated device of the host backend (auto: half the machine's "
                "memory, or of its control group's limit if lower, shared among host_devices, at "
                "most 24GiB each, so that filling it ends in out of memory rather than the "
                "process being killed)",
     .accepts = "auto, or bytes from 4KiB to 4096TiB with an optional unit, such as 24GiB",
     .kind = KIND_BYTES,
     FIELD(host_capacity),
     .min = HOST_MIN_BYTES,
     .max = TIDE_MAX_ALLOC,
     .word = "auto",
     .special = 0 /* the backend derives it from the machine */},
    {.key = "host_granularity",
     .default_text = "2MiB",
     .meaning = "mapping granularity of the host backend",
     .accepts = "a power of two of bytes from 4KiB to 1GiB, such as 2MiB",
     .kind = KIND_BYTES,
     FIELD(host_granularity),
     .min = HOST_MIN_BYTES,
     .max = HOST_MAX_GRANULARITY,
     .flags = FLAG_POW2},
    {.key = "host_devices",
     .default_text = "1",
     .meaning = "emulated devices of the host backend",
     .accepts = "a whole number from 1 to 64",
     .kind = KIND_UINT,
     FIELD(host_devices),
     .min = 1,
     .max = TIDE_HOST_MAX_DEVICES},
    {.key = "host_queue_depth",
     .default_text = "0",
     .meaning = "host backend: an event completes only once this many more have been recorded on "
                "its stream, or it has been queried this many times while pending, or the stream "
                "is waited for, as work queued on a GPU completes behind the CPU; 0: at once",
     .accepts = "a whole number from 0 to 1000000",
     .kind = KIND_UINT,
     FIELD(host_queue_depth),
     .max = HOST_MAX_QUEUE_DEPTH},
    {.key = "host_shared",
     .default_text = "False",
     .meaning = "host backend: the allocators of this process that set it share the capacity of "
                "each emulated device number, as processes share a GPU: what one holds, the "
                "others see gone from the device's free memory (host_capacity must agree)",
     .accepts = BOOL_ACCEPTS,
     .kind = KIND_BOOL,
     FIELD(host_shared)},
};

#define OPTION_COUNT (sizeof options / sizeof options[0])

/* PyTorch allocator keys without a tidalloc counterpart, with a hint where a
 * tidalloc option does the same. */
#define PINNED "; remove it (tidalloc's pinned pool, tide_pinned_malloc, has no such setting)"
static const struct {
  const char *key;
  const char *hint;
} pytorch_only[] = {
    {"per_process_memory_fraction", "; write memory_fraction, which means the same"},
    {"max_non_split_rounding_mb", "; remove it"},
    {"release_lock_on_cudamalloc", "; remove it"},
    {"release_lock_on_hipmalloc", "; remove it"},
    {"pinned_use_cuda_host_register", PINNED},
    {"pinned_use_hip_host_register", PINNED},
    {"pinned_num_register_threads", PINNED},
    {"pinned_use_background_threads", PINNED},
    {"pinned_reserve_segment_size_mb", PINNED},
    {"pinned_free_catch_all", PINNED},
    {"throw_on_cudamalloc_oom", "; remove it"},
};

/* Keys of earlier versions that no longer do anything: accepted, their
 * value ignored, and named in the config's notice (tide_config_notice), so
 * that a setting carried over does not stop a program. */
static const char *const retired[] = {"release_slack", "release_limit", "wait_limit"};
#define RETIRED_NOTICE                                                                             \
  "has no effect: cached pages are given back under pressure (memory_limit, memory_fraction, "     \
  "the device running low), not by a fraction above the peak; remove it"

/* ------------------------------------------------------------------------ */
/* Configs                                                                  */
/* ------------------------------------------------------------------------ */

struct tide_config {
  _tide_conf_values values;
  tide_config_source source[OPTION_COUNT];
  char text[OPTION_COUNT][VALUE_TEXT_LEN]; /* formatted values, for tide_option_info */
  char notice[256];                        /* tide_config_notice; empty: none */
};

/* Where text being applied came from, for sources and messages. */
typedef struct origin {
  tide_config_source source;
  const char *name; /* "TIDALLOC_CONF", "configuration text", ... */
} origin;

static void refresh_texts(tide_config *config) {
  for (size_t i = 0; i < OPTION_COUNT; i++)
    format_option(&options[i], &config->values, config->text[i], VALUE_TEXT_LEN);
}

static int find_option(const char *key) {
  for (size_t i = 0; i < OPTION_COUNT; i++)
    if (strcmp(options[i].key, key) == 0) return (int)i;
  return -1;
}

static int unknown_key_error(const origin *from, const char *begin, const char *end) {
  char key_text[SHOWN_MAX + 8];
  shown(begin, end, key_text, sizeof key_text);
  size_t n = (size_t)(end - begin);
  for (size_t i = 0; i < sizeof pytorch_only / sizeof pytorch_only[0]; i++)
    if (strlen(pytorch_only[i].key) == n && memcmp(pytorch_only[i].key, begin, n) == 0)
      return _tide_error_set(TIDE_ERR_CONFIG,
                             "%s: \"%s\" is a PyTorch allocator option tidalloc does not "
                             "have%s",
                             from->name, key_text, pytorch_only[i].hint);
  char known[512];
  size_t used = 0;
  for (size_t i = 0; i < OPTION_COUNT && used < sizeof known; i++)
    used +=
        (size_t)snprintf(known + used, sizeof known - used, "%s%s", i ? ", " : "", options[i].key);
  if (n == 0)
    return _tide_error_set(TIDE_ERR_CONFIG, "%s: an entry has no key before ':'; known keys: %s",
                           from->name, known);
  return _tide_error_set(TIDE_ERR_CONFIG, "%s: unknown key \"%s\"; known keys: %s", from->name,
                         key_text, known);
}

static int bad_value_error(const origin *from, const option *opt, const char *begin,
                           const char *end, const char *why) {
  char value_text[SHOWN_MAX + 8];
  shown(begin, end, value_text, sizeof value_text);
  return _tide_error_set(TIDE_ERR_CONFIG, "%s: bad value \"%s\" for %s (%s); accepted: %s",
                         from->name, value_text, opt->key, why, opt->accepts);
}

static bool is_retired(const char *key) {
  for (size_t i = 0; i < sizeof retired / sizeof retired[0]; i++)
    if (strcmp(retired[i], key) == 0) return true;
  return false;
}

/* Apply one key and value (each a range of text) to `values`; a retired
 * key only writes `notice` (of NOTICE_LEN bytes). */
#define NOTICE_LEN sizeof((tide_config *)0)->notice
static int apply_pair(const origin *from, const char *kb, const char *ke, const char *vb,
                      const char *ve, _tide_conf_values *values, tide_config_source *source,
                      char *notice) {
  trim(&kb, &ke);
  trim(&vb, &ve);
  char key[KEY_MAX];
  bool copied = copy_range(kb, ke, key, sizeof key);
  if (copied && is_retired(key)) {
    snprintf(notice, NOTICE_LEN, "%s: %s %s", from->name, key, RETIRED_NOTICE);
    return TIDE_OK;
  }
  int index = copied ? find_option(key) : -1;
  if (index < 0) return unknown_key_error(from, kb, ke);
  const option *opt = &options[index];
  char value[ITEM_VALUE_MAX];
  char why[160];
  if (vb == ve) return bad_value_error(from, opt, vb, ve, "empty");
  if (!copy_range(vb, ve, value, sizeof value))
    return bad_value_error(from, opt, vb, ve, "too long");
  if (!parse_option(opt, value, values, why, sizeof why))
    return bad_value_error(from, opt, vb, ve, why);
  source[index] = from->source;
  return TIDE_OK;
}

/* The end of the entry starting at p: the next ',' outside brackets. */
static const char *entry_end(const char *p) {
  int depth = 0;
  for (; *p; p++) {
    if (*p == '[')
      depth++;
    else if (*p == ']' && depth > 0)
      depth--;
    else if (*p == ',' && depth == 0)
      break;
  }
  return p;
}

/* Parse all of `text` into a scratch copy, then commit: a bad entry anywhere
 * leaves the config as it was. */
static int apply_text(tide_config *config, const char *text, const origin *from) {
  _tide_conf_values values = config->values;
  tide_config_source source[OPTION_COUNT];
  memcpy(source, config->source, sizeof source);
  char notice[NOTICE_LEN];
  memcpy(notice, config->notice, sizeof notice);
  for (const char *p = text; *p;) {
    const char *end = entry_end(p);
    const char *b = p, *e = end;
    trim(&b, &e);
    if (b < e) {
      const char *colon = memchr(b, ':', (size_t)(e - b));
      if (!colon) {
        char entry[SHOWN_MAX + 8];
        return _tide_error_set(TIDE_ERR_CONFIG,
                               "%s: entry \"%s\" has no ':'; write key:value, such as "
                               "expandable_segments:True",
                               from->name, shown(b, e, entry, sizeof entry));
      }
      int status = apply_pair(from, b, colon, colon + 1, e, &values, source, notice);
      if (status != TIDE_OK) return status;
    }
    p = *end ? end + 1 : end;
  }
  config->values = values;
  memcpy(config->source, source, sizeof source);
  memcpy(config->notice, notice, sizeof notice);
  refresh_texts(config);
  return TIDE_OK;
}

tide_status tide_config_new(tide_config **out) {
  if (!out) return _tide_error_set(TIDE_ERR_INVALID, "tide_config_new: out is NULL");
  *out = NULL;
  tide_config *config = calloc(1, sizeof *config);
  if (!config) return _tide_error_set(TIDE_ERR_OOM, "tide_config_new: no host memory for a config");
  for (size_t i = 0; i < OPTION_COUNT; i++) {
    char why[160];
    if (!parse_option(&options[i], options[i].default_text, &config->values, why, sizeof why)) {
      free(config);
      return _tide_error_set(TIDE_ERR_STATE,
                             "tide_config_new: the default of %s does not "
                             "parse (%s); this is a bug in tidalloc",
                             options[i].key, why);
    }
    config->source[i] = TIDE_CONFIG_DEFAULT;
  }
  refresh_texts(config);
  *out = config;
  return TIDE_OK;
}

void tide_config_free(tide_config *config) { free(config); }

const char *tide_config_notice(const tide_config *config) {
  return config && config->notice[0] ? config->notice : NULL;
}

tide_status tide_config_load_env(tide_config *config) {
  if (!config) return _tide_error_set(TIDE_ERR_INVALID, "tide_config_load_env: config is NULL");
  const char *text = getenv(TIDE_CONF_ENV);
  if (!text || !*text) return TIDE_OK;
  const origin from = {TIDE_CONFIG_ENVIRONMENT, "TIDALLOC_CONF (environment variable)"};
  return (tide_status)apply_text(config, text, &from);
}

tide_status tide_config_parse(tide_config *config, const char *text) {
  if (!config) return _tide_error_set(TIDE_ERR_INVALID, "tide_config_parse: config is NULL");
  if (!text) return _tide_error_set(TIDE_ERR_INVALID, "tide_config_parse: text is NULL");
  const origin from = {TIDE_CONFIG_CODE, "configuration text"};
  return (tide_status)apply_text(config, text, &from);
}

tide_status tide_config_set(tide_config *config, const char *key, const char *value) {
  if (!config) return _tide_error_set(TIDE_ERR_INVALID, "tide_config_set: config is NULL");
  if (!key) return _tide_error_set(TIDE_ERR_INVALID, "tide_config_set: key is NULL");
  if (!value) return _tide_error_set(TIDE_ERR_INVALID, "tide_config_set: value is NULL");
  const origin from = {TIDE_CONFIG_CODE, "tide_config_set"};
  _tide_conf_values values = config->values;
  int status = apply_pair(&from, key, key + strlen(key), value, value + strlen(value), &values,
                          config->source, config->notice);
  if (status != TIDE_OK) return (tide_status)status;
  config->values = values;
  refresh_texts(config);
  return TIDE_OK;
}

tide_status tide_config_get(const tide_config *config, const char *key, char *buf, size_t len) {
  if (!config) return _tide_error_set(TIDE_ERR_INVALID, "tide_config_get: config is NULL");
  if (!key) return _tide_error_set(TIDE_ERR_INVALID, "tide_config_get: key is NULL");
  if (!buf || len == 0)
    return _tide_error_set(TIDE_ERR_INVALID, "tide_config_get: no buffer to write into");
  buf[0] = '\0';
  const char *kb = key, *ke = key + strlen(key);
  trim(&kb, &ke);
  char name[KEY_MAX];
  int index = copy_range(kb, ke, name, sizeof name) ? find_option(name) : -1;
  if (index < 0) {
    const origin from = {TIDE_CONFIG_CODE, "tide_config_get"};
    return (tide_status)unknown_key_error(&from, kb, ke);
  }
  const char *text = config->text[index];
  size_t need = strlen(text) + 1;
  snprintf(buf, len, "%s", text);
  if (need > len)
    return _tide_error_set(TIDE_ERR_INVALID,
                           "tide_config_get: the value of %s needs %zu bytes, the buffer has %zu",
                           options[index].key, need, len);
  return TIDE_OK;
}

size_t tide_config_option_count(void) { return OPTION_COUNT; }

tide_status tide_config_option(const tide_config *config, size_t index, tide_option_info *out) {
  if (!config) return _tide_error_set(TIDE_ERR_INVALID, "tide_config_option: config is NULL");
  if (!out) return _tide_error_set(TIDE_ERR_INVALID, "tide_config_option: out is NULL");
  if (index >= OPTION_COUNT)
    return _tide_error_set(TIDE_ERR_INVALID,
                           "tide_config_option: index %zu is past the last option (%zu options)",
                           index, OPTION_COUNT);
  out->key = options[index].key;
  out->value = config->text[index];
  out->default_value = options[index].default_text;
  out->meaning = options[index].meaning;
  out->source = config->source[index];
  return TIDE_OK;
}

const _tide_conf_values *_tide_config_values(const tide_config *config) {
  return config ? &config->values : NULL;
}

tide_config *_tide_config_clone(const tide_config *config) {
  if (!config) {
    _tide_error_set(TIDE_ERR_INVALID, "cloning a config: config is NULL");
    return NULL;
  }
  tide_config *copy = malloc(sizeof *copy);
  if (!copy) {
    _tide_error_set(TIDE_ERR_OOM, "cloning a config: no host memory");
    return NULL;
  }
  memcpy(copy, config, sizeof *copy);
  return copy;
}

/* Formatting is canonical, so equal texts mean equal values. */
size_t _tide_config_diff(const tide_config *a, const tide_config *b, char *buf, size_t len) {
  size_t count = 0, used = 0;
  if (buf && len) buf[0] = '\0';
  if (!a || !b) return 0;
  for (size_t i = 0; i < OPTION_COUNT; i++) {
    if (strcmp(a->text[i], b->text[i]) == 0) continue;
    if (buf && used < len)
      used += (size_t)snprintf(buf + used, len - used, "%s%s: %s -> %s", count ? "; " : "",
                               options[i].key, a->text[i], b->text[i]);
    count++;
  }
  return count;
}
