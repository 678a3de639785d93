/* fuzz_conf.c: the configuration parser on arbitrary text, through every
 * way text reaches it: tide_config_parse, TIDALLOC_CONF (tide_config_load_env),
 * tide_config_set (the text split at its first ':') and the process-wide
 * tide_config_process_set. Checked, besides no crash, leak or undefined behaviour:
 * - a parse that succeeds round-trips: every value, formatted, written back
 *   as "key:value,..." into a fresh config parses to the same values, and
 *   parsing the same text again changes nothing; an option whose value
 *   changed is marked as set from code;
 * - a parse that fails returns TIDE_ERR_CONFIG with a message of printable
 *   ASCII (user text is quoted safely) and changes no value and no source;
 * - the environment variable gives the same outcome and values as the parse,
 *   and its messages name TIDALLOC_CONF;
 * - tide_config_get of every key fits its buffer or says how much it needs. */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"
#include "tidalloc.h"

/* A config that differs from the defaults in many keys, so that a failed
 * parse that applied part of its text would show. */
static const char *const BASE =
    "backend:host,expandable_segments:False,page_size_mb:4,max_split_size_mb:64,"
    "roundup_power2_divisions:[2:4,>:8],garbage_collection_threshold:0.5,memory_fraction:0.75,"
    "memory_limit:3GiB,release_holes:False,trace:16,host_capacity:8GiB,host_granularity:64KiB";

#define MAX_OPTIONS 64
#define VALUE_LEN 256

typedef struct values {
  size_t n;
  char text[MAX_OPTIONS][VALUE_LEN];
  tide_config_source source[MAX_OPTIONS];
} values;

static void read_values(const tide_config *c, values *out) {
  out->n = tide_config_option_count();
  FZ_CHECK(out->n > 0 && out->n <= MAX_OPTIONS, "%zu options", out->n);
  for (size_t i = 0; i < out->n; i++) {
    tide_option_info info;
    FZ_CHECK(tide_config_option(c, i, &info) == TIDE_OK, "tide_config_option(%zu): %s", i,
             tide_last_error());
    FZ_CHECK(info.key && info.value && info.default_value && info.meaning, "option %zu: NULL text",
             i);
    FZ_CHECK(strlen(info.value) < VALUE_LEN, "option %s: value of %zu bytes", info.key,
             strlen(info.value));
    strcpy(out->text[i], info.value);
    out->source[i] = info.source;
  }
}

/* The key of option i (a config made once holds the names). */
static const char *key_of(size_t i) {
  static tide_config *names;
  tide_option_info info;
  if (!names)
    FZ_CHECK(tide_config_new(&names) == TIDE_OK, "tide_config_new: %s", tide_last_error());
  FZ_CHECK(tide_config_option(names, i, &info) == TIDE_OK, "no option %zu", i);
  return info.key;
}

static void expect_same(const values *a, const values *b, bool sources, const char *what,
                        const char *text) {
  for (size_t i = 0; i < a->n; i++) {
    FZ_CHECK(strcmp(a->text[i], b->text[i]) == 0,
             "%s: option %s is \"%s\", expected \"%s\" (text \"%s\")", what, key_of(i), b->text[i],
             a->text[i], text);
    FZ_CHECK(!sources || a->source[i] == b->source[i],
             "%s: the source of option %s changed (text \"%s\")", what, key_of(i), text);
  }
}

static tide_config *config_of(const char *text) {
  tide_config *c = NULL;
  FZ_CHECK(tide_config_new(&c) == TIDE_OK && c, "tide_config_new: %s", tide_last_error());
  if (text)
    FZ_CHECK(tide_config_parse(c, text) == TIDE_OK, "base text refused: %s", tide_last_error());
  return c;
}

/* A failure's message: present, bounded and printable. */
static void check_message(const char *what, const char *needle) {
  const char *msg = tide_last_error();
  FZ_CHECK(msg && *msg, "%s failed without a message", what);
  for (const char *p = msg; *p; p++)
    FZ_CHECK(*p >= 0x20 && *p < 0x7f, "%s: message has byte 0x%02x: %s", what, (unsigned char)*p,
             msg);
  FZ_CHECK(!needle || strstr(msg, needle), "%s: message lacks \"%s\": %s", what, needle, msg);
}

/* Every value written back as text parses into a fresh config as it was. */
static void check_round_trip(const values *v, const char *text) {
  size_t len = 0, cap = v->n * (VALUE_LEN + 64) + 1;
  char *all = malloc(cap);
  FZ_CHECK(all, "out of memory");
  for (size_t i = 0; i < v->n; i++)
    len += (size_t)snprintf(all + len, cap - len, "%s%s:%s", i ? "," : "", key_of(i), v->text[i]);
  tide_config *c = config_of(NULL);
  tide_status rc = tide_config_parse(c, all);
  FZ_CHECK(rc == TIDE_OK, "the formatted values \"%s\" of text \"%s\" do not parse: %s", all, text,
           tide_last_error());
  values back;
  read_values(c, &back);
  expect_same(v, &back, false, "round trip", text);
  /* One key at a time, as tide_config_set takes it. */
  for (size_t i = 0; i < v->n; i++) {
    FZ_CHECK(tide_config_set(c, key_of(i), v->text[i]) == TIDE_OK,
             "tide_config_set(%s, \"%s\"): %s", key_of(i), v->text[i], tide_last_error());
    char buf[VALUE_LEN], tiny[2];
    FZ_CHECK(tide_config_get(c, key_of(i), buf, sizeof buf) == TIDE_OK &&
                 strcmp(buf, v->text[i]) == 0,
             "tide_config_get(%s) = \"%s\", expected \"%s\"", key_of(i), buf, v->text[i]);
    tide_status small = tide_config_get(c, key_of(i), tiny, sizeof tiny);
    FZ_CHECK((small == TIDE_OK) == (strlen(v->text[i]) < sizeof tiny) && strlen(tiny) < sizeof tiny,
             "tide_config_get(%s) into 2 bytes: %s", key_of(i), tide_status_name(small));
  }
  tide_config_free(c);
  free(all);
}

static tide_status parse_checked(const char *text, values *after) {
  tide_config *c = config_of(BASE);
  values before;
  read_values(c, &before);
  tide_clear_error();
  tide_status rc = tide_config_parse(c, text);
  read_values(c, after);
  if (rc != TIDE_OK) {
    FZ_CHECK(rc == TIDE_ERR_CONFIG, "tide_config_parse(\"%s\"): %s", text, tide_status_name(rc));
    check_message("tide_config_parse", NULL);
    expect_same(&before, after, true, "failed parse", text);
  } else {
    for (size_t i = 0; i < before.n; i++)
      FZ_CHECK(strcmp(before.text[i], after->text[i]) == 0 || after->source[i] == TIDE_CONFIG_CODE,
               "option %s changed to \"%s\" but is not marked as set from code", key_of(i),
               after->text[i]);
    check_round_trip(after, text);
    /* Applying the same text twice is applying it once. */
    values again;
    FZ_CHECK(tide_config_parse(c, text) == TIDE_OK, "a second parse of \"%s\" failed: %s", text,
             tide_last_error());
    read_values(c, &again);
    expect_same(after, &again, true, "second parse", text);
  }
  tide_config_free(c);
  return rc;
}

/* TIDALLOC_CONF: the same outcome as the parse into a default config. */
static void check_environment(const char *text, tide_status want) {
  if (setenv("TIDALLOC_CONF", text, 1) != 0) return;
  tide_config *env = config_of(NULL), *parsed = config_of(NULL);
  tide_clear_error();
  tide_status rc = tide_config_load_env(env);
  if (*text == '\0') {
    FZ_CHECK(rc == TIDE_OK, "an empty TIDALLOC_CONF failed: %s", tide_last_error());
  } else {
    FZ_CHECK(rc == want, "TIDALLOC_CONF=\"%s\": %s, the parse gave %s", text, tide_status_name(rc),
             tide_status_name(want));
    if (rc != TIDE_OK) check_message("tide_config_load_env", "TIDALLOC_CONF");
  }
  if (rc == TIDE_OK && tide_config_parse(parsed, text) == TIDE_OK) {
    values a, b;
    read_values(parsed, &a);
    read_values(env, &b);
    expect_same(&a, &b, false, "TIDALLOC_CONF", text);
  }
  tide_config_free(env);
  tide_config_free(parsed);
  unsetenv("TIDALLOC_CONF");
}

/* tide_config_set with the text split at its first ':'. */
static void check_set(const char *text) {
  const char *colon = strchr(text, ':');
  if (!colon) return;
  size_t klen = (size_t)(colon - text);
  char *key = malloc(klen + 1);
  FZ_CHECK(key, "out of memory");
  memcpy(key, text, klen);
  key[klen] = '\0';
  tide_config *c = config_of(BASE);
  values before, after;
  read_values(c, &before);
  tide_clear_error();
  tide_status rc = tide_config_set(c, key, colon + 1);
  read_values(c, &after);
  if (rc != TIDE_OK) {
    FZ_CHECK(rc == TIDE_ERR_CONFIG, "tide_config_set(\"%s\"): %s", text, tide_status_name(rc));
    check_message("tide_config_set", NULL);
    expect_same(&before, &after, true, "failed tide_config_set", text);
  } else {
    check_round_trip(&after, text);
  }
  tide_config_free(c);
  free(key);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char *text = malloc(size + 1);
  if (!text) return 0;
  memcpy(text, data, size);
  text[size] = '\0'; /* C text ends at its first NUL */
  values after;
  tide_status rc = parse_checked(text, &after);
  check_environment(text, rc);
  check_set(text);
  /* The process-wide configuration, before any allocator: the same answer. */
  tide_clear_error();
  tide_status process = tide_config_process_set(text);
  FZ_CHECK(process == rc, "tide_config_process_set(\"%s\"): %s, the parse gave %s", text,
           tide_status_name(process), tide_status_name(rc));
  free(text);
  return 0;
}
