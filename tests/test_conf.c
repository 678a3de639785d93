/* test_conf.c: the option table and tide_config: defaults, every key with good
 * and bad values, the list form of roundup_power2_divisions, byte units,
 * atomic parsing, sources, clone and diff, and garbage that must be refused
 * without harm. */
#include <locale.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "base/internal.h"

static tide_config *new_config(void) {
  tide_config *config = NULL;
  assert_int_equal(tide_config_new(&config), TIDE_OK);
  assert_non_null(config);
  return config;
}

/* The formatted value of `key`; the text lives until the next call. */
static const char *get(const tide_config *config, const char *key) {
  static char buf[512];
  assert_int_equal(tide_config_get(config, key, buf, sizeof buf), TIDE_OK);
  return buf;
}

static tide_config_source source_of(const tide_config *config, const char *key) {
  for (size_t i = 0; i < tide_config_option_count(); i++) {
    tide_option_info info;
    assert_int_equal(tide_config_option(config, i, &info), TIDE_OK);
    if (strcmp(info.key, key) == 0) return info.source;
  }
  fail_msg("no option %s", key);
  return TIDE_CONFIG_DEFAULT;
}

/* How many options differ from a fresh config. */
static size_t changed_from_defaults(const tide_config *config) {
  tide_config *fresh = new_config();
  char buf[1024];
  size_t n = _tide_config_diff(fresh, config, buf, sizeof buf);
  tide_config_free(fresh);
  return n;
}

static const char *const all_keys[] = {
    "backend",
    "expandable_segments",
    "page_size_mb",
    "handle_size_mb",
    "handle_threshold_mb",
    "max_split_size_mb",
    "roundup_power2_divisions",
    "garbage_collection_threshold",
    "memory_fraction",
    "memory_limit",
    "release_holes",
    "load_handles",
    "peer_access",
    "capture_detection",
    "graph_capture_record_stream_reuse",
    "trace",
    "host_capacity",
    "host_granularity",
    "host_devices",
    "host_queue_depth",
    "host_shared",
};
#define KEY_COUNT (sizeof all_keys / sizeof all_keys[0])

/* ------------------------------------------------------------------------ */

static void test_defaults(void **state) {
  (void)state;
  tide_config *config = new_config();
  const _tide_conf_values *v = _tide_config_values(config);
  assert_non_null(v);
  assert_int_equal(v->backend, TIDE_BACKEND_AUTO);
  assert_true(v->expandable_segments);
  assert_int_equal(v->page_size, 2 * TIDE_MiB);
  assert_true(v->max_split_size == SIZE_MAX);
  for (int i = 0; i < TIDE_ROUNDUP_INTERVALS; i++) assert_int_equal(v->roundup_divisions[i], 0);
  assert_true(v->gc_threshold == 0.0);
  assert_true(v->memory_fraction == 1.0);
  assert_int_equal(v->memory_limit, 0);
  assert_true(v->release_holes);
  assert_true(v->load_handles);
  assert_false(v->capture_detection);
  assert_false(v->graph_reuse);
  assert_int_equal(v->trace_capacity, 0);
  assert_int_equal(v->host_capacity, 0); /* auto: the backend sizes it from the machine */
  assert_int_equal(v->host_granularity, 2 * TIDE_MiB);
  assert_int_equal(v->host_devices, 1);

  assert_string_equal(get(config, "backend"), "auto");
  assert_string_equal(get(config, "expandable_segments"), "True");
  assert_string_equal(get(config, "max_split_size_mb"), "unlimited");
  assert_string_equal(get(config, "memory_fraction"), "1.0");
  assert_string_equal(get(config, "host_capacity"), "auto");
  assert_string_equal(get(config, "host_granularity"), "2MiB");
  assert_string_equal(get(config, "host_queue_depth"), "0");
  assert_string_equal(get(config, "release_holes"), "True");
  assert_string_equal(get(config, "load_handles"), "True");
  tide_config_free(config);
}

/* Keys of earlier versions (release_slack, release_limit, wait_limit) are
 * accepted, change nothing, and leave a notice naming the key; a config
 * without them has none. They are no options: tide_config_get refuses. */
static void test_retired_keys_accepted_with_notice(void **state) {
  (void)state;
  tide_config *config = new_config();
  assert_null(tide_config_notice(config));
  tide_config *plain = new_config();
  assert_int_equal(tide_config_parse(config, "release_slack:0.017,memory_limit:1GiB"), TIDE_OK);
  const char *notice = tide_config_notice(config);
  assert_non_null(notice);
  assert_non_null(strstr(notice, "release_slack"));
  assert_non_null(strstr(notice, "no effect"));
  assert_int_equal(tide_config_set(plain, "memory_limit", "1GiB"), TIDE_OK);
  assert_int_equal(_tide_config_diff(config, plain, NULL, 0), 0); /* nothing else changed */
  assert_int_equal(tide_config_set(plain, "wait_limit", "auto"), TIDE_OK);
  assert_non_null(strstr(tide_config_notice(plain), "wait_limit"));
  char buf[64];
  assert_int_equal(tide_config_get(config, "release_slack", buf, sizeof buf), TIDE_ERR_CONFIG);
  /* A bad entry elsewhere in the text applies nothing, the notice neither. */
  tide_config *other = new_config();
  assert_int_equal(tide_config_parse(other, "release_limit:0.02,nonsense:1"), TIDE_ERR_CONFIG);
  assert_null(tide_config_notice(other));
  tide_config_free(other);
  tide_config_free(plain);
  tide_config_free(config);
}

static void test_option_table(void **state) {
  (void)state;
  tide_config *config = new_config();
  assert_int_equal(tide_config_option_count(), KEY_COUNT);
  bool seen[KEY_COUNT] = {false};
  for (size_t i = 0; i < tide_config_option_count(); i++) {
    tide_option_info info;
    memset(&info, 0, sizeof info);
    assert_int_equal(tide_config_option(config, i, &info), TIDE_OK);
    assert_non_null(info.key);
    assert_non_null(info.meaning);
    assert_true(strlen(info.meaning) > 10);
    assert_null(strchr(info.meaning, '\n'));
    /* Defaults are written canonically: a fresh config shows them as is. */
    assert_string_equal(info.value, info.default_value);
    assert_int_equal(info.source, TIDE_CONFIG_DEFAULT);
    size_t k = 0;
    while (k < KEY_COUNT && strcmp(all_keys[k], info.key) != 0) k++;
    assert_true(k < KEY_COUNT);
    assert_false(seen[k]);
    seen[k] = true;
  }
  for (size_t k = 0; k < KEY_COUNT; k++) assert_true(seen[k]);

  tide_option_info info;
  assert_int_equal(tide_config_option(config, KEY_COUNT, &info), TIDE_ERR_INVALID);
  assert_non_null(strstr(tide_last_error(), "past the last option"));
  tide_config_free(config);
}

/* The value strings of tide_option_info follow the config. */
static void test_option_value_follows_changes(void **state) {
  (void)state;
  tide_config *config = new_config();
  tide_option_info info;
  for (size_t i = 0; i < tide_config_option_count(); i++) {
    assert_int_equal(tide_config_option(config, i, &info), TIDE_OK);
    if (strcmp(info.key, "trace") == 0) break;
  }
  assert_string_equal(info.value, "0");
  assert_int_equal(tide_config_set(config, "trace", "4096"), TIDE_OK);
  assert_string_equal(info.value, "4096");
  tide_config_free(config);
}

typedef struct good_case {
  const char *key;
  const char *input;
  const char *canonical;
} good_case;

static void test_good_values(void **state) {
  (void)state;
  static const good_case cases[] = {
      {"backend", "auto", "auto"},
      {"backend", "host", "host"},
      {"backend", "CUDA", "cuda"},
      {"expandable_segments", "False", "False"},
      {"expandable_segments", "true", "True"},
      {"expandable_segments", "0", "False"},
      {"expandable_segments", "1", "True"},
      {"expandable_segments", "FALSE", "False"},
      {"page_size_mb", "1", "1"},
      {"page_size_mb", "20", "20"},
      {"page_size_mb", "1024", "1024"},
      {"page_size_mb", "007", "7"},
      {"handle_size_mb", "0", "0"},
      {"handle_size_mb", "16", "16"},
      {"handle_size_mb", "1024", "1024"},
      {"handle_threshold_mb", "auto", "auto"},
      {"handle_threshold_mb", "AUTO", "auto"},
      {"handle_threshold_mb", "0", "0"},
      {"handle_threshold_mb", "8192", "8192"},
      {"max_split_size_mb", "20", "20"},
      {"max_split_size_mb", "512", "512"},
      {"max_split_size_mb", "none", "unlimited"},
      {"max_split_size_mb", "Unlimited", "unlimited"},
      {"max_split_size_mb", "4294967296", "4294967296"},
      {"roundup_power2_divisions", "4", "4"},
      {"roundup_power2_divisions", "0", "0"},
      {"roundup_power2_divisions", "1024", "1024"},
      {"garbage_collection_threshold", "0.8", "0.8"},
      {"garbage_collection_threshold", ".25", "0.25"},
      {"garbage_collection_threshold", "6e-1", "0.6"},
      {"garbage_collection_threshold", "0", "0"},
      {"garbage_collection_threshold", "0.999999", "0.999999"},
      {"memory_fraction", "0.5", "0.5"},
      {"memory_fraction", "1", "1.0"},
      {"memory_fraction", "0.0001", "0.0001"},
      {"memory_limit", "0", "0"},
      {"memory_limit", "512MiB", "512MiB"},
      {"memory_limit", "2GB", "2GiB"},
      {"memory_limit", "1073741824", "1GiB"},
      {"release_holes", "True", "True"},
      {"release_holes", "false", "False"},
      {"load_handles", "False", "False"},
      {"load_handles", "1", "True"},
      {"host_queue_depth", "0", "0"},
      {"host_queue_depth", "64", "64"},
      {"trace", "0", "0"},
      {"trace", "16777216", "16777216"},
      {"host_capacity", "4KiB", "4KiB"},
      {"host_capacity", "80gib", "80GiB"},
      {"host_capacity", "1536MiB", "1536MiB"},
      {"host_capacity", "auto", "auto"},
      {"host_capacity", "AUTO", "auto"},
      {"host_granularity", "4096", "4KiB"},
      {"host_granularity", "64KiB", "64KiB"},
      {"host_granularity", "1GiB", "1GiB"},
      {"host_devices", "1", "1"},
      {"host_devices", "64", "64"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    tide_config *config = new_config();
    tide_status status = tide_config_set(config, cases[i].key, cases[i].input);
    if (status != TIDE_OK)
      fail_msg("%s:%s refused: %s", cases[i].key, cases[i].input, tide_last_error());
    if (strcmp(get(config, cases[i].key), cases[i].canonical) != 0)
      fail_msg("%s:%s shows as %s, expected %s", cases[i].key, cases[i].input,
               get(config, cases[i].key), cases[i].canonical);
    assert_int_equal(source_of(config, cases[i].key), TIDE_CONFIG_CODE);
    /* The canonical text reads back to the same value. */
    tide_config *again = new_config();
    assert_int_equal(tide_config_set(again, cases[i].key, cases[i].canonical), TIDE_OK);
    assert_int_equal(_tide_config_diff(config, again, NULL, 0), 0);
    tide_config_free(again);
    tide_config_free(config);
  }
}

static void test_values_reach_the_struct(void **state) {
  (void)state;
  tide_config *config = new_config();
  assert_int_equal(
      tide_config_parse(
          config, "backend:host,expandable_segments:False,page_size_mb:20,"
                  "handle_size_mb:40,handle_threshold_mb:64,"
                  "max_split_size_mb:200,garbage_collection_threshold:0.75,"
                  "memory_fraction:0.5,memory_limit:3GiB,release_holes:False,"
                  "load_handles:False,"
                  "peer_access:False,capture_detection:True,"
                  "graph_capture_record_stream_reuse:True,trace:100,host_capacity:8GiB,host_"
                  "granularity:64KiB,"
                  "host_devices:4,host_queue_depth:3,host_shared:True,roundup_power2_divisions:8"),
      TIDE_OK);
  const _tide_conf_values *v = _tide_config_values(config);
  assert_int_equal(v->backend, TIDE_BACKEND_HOST);
  assert_false(v->expandable_segments);
  assert_int_equal(v->page_size, 20 * TIDE_MiB);
  assert_int_equal(v->handle_size, 40 * TIDE_MiB);
  assert_int_equal(v->handle_threshold, 64 * TIDE_MiB);
  assert_int_equal(v->max_split_size, 200 * TIDE_MiB);
  assert_true(v->gc_threshold == 0.75);
  assert_true(v->memory_fraction == 0.5);
  assert_int_equal(v->memory_limit, 3 * TIDE_GiB);
  assert_false(v->release_holes);
  assert_false(v->load_handles);
  assert_false(v->peer_access);
  assert_true(v->capture_detection);
  assert_true(v->graph_reuse);
  assert_int_equal(v->trace_capacity, 100);
  assert_int_equal(v->host_capacity, 8 * TIDE_GiB);
  assert_int_equal(v->host_granularity, 64 * TIDE_KiB);
  assert_int_equal(v->host_devices, 4);
  assert_int_equal(v->host_queue_depth, 3);
  assert_true(v->host_shared);
  for (int i = 0; i < TIDE_ROUNDUP_INTERVALS; i++) assert_int_equal(v->roundup_divisions[i], 8);
  assert_int_equal(changed_from_defaults(config), KEY_COUNT);
  tide_config_free(config);
}

typedef struct bad_case {
  const char *key;
  const char *input;
} bad_case;

static void test_bad_values(void **state) {
  (void)state;
  static const bad_case cases[] = {
      {"backend", "gpu"},
      {"backend", ""},
      {"backend", "native"},
      {"expandable_segments", "yes"},
      {"expandable_segments", "2"},
      {"expandable_segments", "Truee"},
      {"page_size_mb", "0"},
      {"page_size_mb", "1025"},
      {"page_size_mb", "-2"},
      {"page_size_mb", "2.5"},
      {"handle_size_mb", "1025"},
      {"handle_size_mb", "-1"},
      {"handle_size_mb", "8.5"},
      {"handle_threshold_mb", "-1"},
      {"handle_threshold_mb", "big"},
      {"page_size_mb", "2MiB"},
      {"page_size_mb", "0x10"},
      {"page_size_mb", "+2"},
      {"page_size_mb", "18446744073709551616"},
      {"max_split_size_mb", "19"},
      {"max_split_size_mb", "0"},
      {"max_split_size_mb", "4294967297"},
      {"max_split_size_mb", "99999999999999999999999"},
      {"max_split_size_mb", "infinite"},
      {"roundup_power2_divisions", "3"},
      {"roundup_power2_divisions", "2048"},
      {"roundup_power2_divisions", "-4"},
      {"garbage_collection_threshold", "1"},
      {"garbage_collection_threshold", "1.5"},
      {"garbage_collection_threshold", "-0.5"},
      {"garbage_collection_threshold", "nan"},
      {"garbage_collection_threshold", "inf"},
      {"garbage_collection_threshold", "0.5x"},
      {"garbage_collection_threshold", "0x0.8p0"},
      {"garbage_collection_threshold", "1e-400"},
      {"garbage_collection_threshold", "."},
      {"garbage_collection_threshold", "1e"},
      {"garbage_collection_threshold", "0,5"},
      {"memory_fraction", "0"},
      {"memory_fraction", "1.0001"},
      {"memory_fraction", "1e999"},
      {"memory_fraction", "NaN"},
      {"memory_fraction", "-1"},
      {"memory_limit", "-1"},
      {"memory_limit", "1.5GiB"},
      {"memory_limit", "12XB"},
      {"memory_limit", "GiB"},
      {"memory_limit", "4097TiB"},
      {"memory_limit", "99999999999999999999999"},
      {"memory_limit", "18446744073709551615"},
      {"memory_limit", "1PiB"},
      {"release_holes", "maybe"},
      {"load_handles", "sometimes"},
      {"host_queue_depth", "-1"},
      {"host_queue_depth", "1000001"},
      {"trace", "16777217"},
      {"trace", "-1"},
      {"trace", "1k"},
      {"host_capacity", "0"},
      {"host_capacity", "4095"},
      {"host_capacity", "5000TiB"},
      {"host_granularity", "3MiB"},
      {"host_granularity", "2KiB"},
      {"host_granularity", "2GiB"},
      {"host_devices", "0"},
      {"host_devices", "65"},
      {"host_devices", "two"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    tide_config *config = new_config();
    tide_clear_error();
    tide_status status = tide_config_set(config, cases[i].key, cases[i].input);
    if (status != TIDE_ERR_CONFIG)
      fail_msg("%s:%s gave %s, expected TIDE_ERR_CONFIG", cases[i].key, cases[i].input,
               tide_status_name(status));
    assert_int_equal(tide_last_status(), TIDE_ERR_CONFIG);
    const char *message = tide_last_error();
    /* The message names the key, quotes the value and says what is accepted. */
    assert_non_null(strstr(message, cases[i].key));
    char quoted[128];
    snprintf(quoted, sizeof quoted, "\"%s\"", cases[i].input);
    if (!strstr(message, quoted)) fail_msg("message lacks %s: %s", quoted, message);
    assert_non_null(strstr(message, "accepted:"));
    assert_int_equal(changed_from_defaults(config), 0);
    assert_int_equal(source_of(config, cases[i].key), TIDE_CONFIG_DEFAULT);
    tide_config_free(config);
  }
}

static void test_backend_pytorch_value_explained(void **state) {
  (void)state;
  tide_config *config = new_config();
  assert_int_equal(tide_config_parse(config, "backend:cudaMallocAsync"), TIDE_ERR_CONFIG);
  assert_non_null(strstr(tide_last_error(), "PyTorch"));
  tide_config_free(config);
}

/* ------------------------------------------------------------------------ */

static void expect_divisions(const tide_config *config, const unsigned expected[17]) {
  const _tide_conf_values *v = _tide_config_values(config);
  for (int i = 0; i < TIDE_ROUNDUP_INTERVALS; i++)
    if (v->roundup_divisions[i] != expected[i])
      fail_msg("interval %d (%llu MiB): %u, expected %u", i, 1ULL << i, v->roundup_divisions[i],
               expected[i]);
}

static void test_roundup_list(void **state) {
  (void)state;
  tide_config *config = new_config();
  assert_int_equal(tide_config_parse(config, "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]"),
                   TIDE_OK);
  /* 256 is interval 8 (256..512 MiB); the first key also covers all below. */
  static const unsigned pytorch_example[17] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 4, 8, 8, 8, 8, 8, 8};
  expect_divisions(config, pytorch_example);
  assert_string_equal(get(config, "roundup_power2_divisions"), "[256:1,512:2,1024:4,>:8]");

  /* Spaces anywhere, and the list shares the text with other keys. */
  assert_int_equal(
      tide_config_parse(config, " roundup_power2_divisions : [ 2 : 4 , > : 16 ] , trace : 5 "),
      TIDE_OK);
  static const unsigned two_then_rest[17] = {4,  4,  16, 16, 16, 16, 16, 16, 16,
                                             16, 16, 16, 16, 16, 16, 16, 16};
  expect_divisions(config, two_then_rest);
  assert_string_equal(get(config, "roundup_power2_divisions"), "[2:4,>:16]");
  assert_string_equal(get(config, "trace"), "5");

  /* ">" alone covers every interval; intervals not named are 0. */
  assert_int_equal(tide_config_set(config, "roundup_power2_divisions", "[>:2]"), TIDE_OK);
  assert_string_equal(get(config, "roundup_power2_divisions"), "2");
  assert_int_equal(tide_config_set(config, "roundup_power2_divisions", "[1:2,4:8]"), TIDE_OK);
  static const unsigned gap[17] = {2, 0, 8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  expect_divisions(config, gap);
  assert_string_equal(get(config, "roundup_power2_divisions"), "[1:2,2:0,4:8,>:0]");
  assert_int_equal(tide_config_set(config, "roundup_power2_divisions", "[65536:4]"), TIDE_OK);
  static const unsigned all4[17] = {4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4};
  expect_divisions(config, all4);
  assert_int_equal(tide_config_set(config, "roundup_power2_divisions", "[32768:0,>:4]"), TIDE_OK);
  assert_string_equal(get(config, "roundup_power2_divisions"), "[32768:0,>:4]");
  assert_int_equal(tide_config_set(config, "roundup_power2_divisions", "[]"), TIDE_OK);
  assert_string_equal(get(config, "roundup_power2_divisions"), "0");

  /* Every canonical list reads back to itself. */
  static const char *const lists[] = {"[1:1,2:2,4:4,8:8,16:16,32:32,64:64,128:128,256:256,"
                                      "512:512,1024:1024,2048:1,4096:2,8192:4,16384:8,"
                                      "32768:16,>:32]",
                                      "[16:2,>:4]", "[1:0,>:1]"};
  for (size_t i = 0; i < sizeof lists / sizeof lists[0]; i++) {
    assert_int_equal(tide_config_set(config, "roundup_power2_divisions", lists[i]), TIDE_OK);
    assert_string_equal(get(config, "roundup_power2_divisions"), lists[i]);
  }
  tide_config_free(config);
}

static void test_roundup_list_errors(void **state) {
  (void)state;
  static const char *const bad[] = {
      "[3:1]",    "[256:3]",   "[512:1,256:2]", "[256:1,256:2]", "[>:8,256:1]", "[>:8,>:4]",
      "[256:1",   "[[256:1]]", "[256]",         "[131072:1]",    "[256:2048]",  "[0:1]",
      "[256:-1]", "[:1]",      "[256:]",        "[256:1]x",      "[abc:1]",     "[256:1:2]",
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    tide_config *config = new_config();
    char text[128];
    snprintf(text, sizeof text, "roundup_power2_divisions:%s", bad[i]);
    tide_status status = tide_config_parse(config, text);
    if (status != TIDE_ERR_CONFIG) fail_msg("%s gave %s", text, tide_status_name(status));
    assert_non_null(strstr(tide_last_error(), "roundup_power2_divisions"));
    assert_int_equal(changed_from_defaults(config), 0);
    tide_config_free(config);
  }
}

/* ------------------------------------------------------------------------ */

static void test_byte_units(void **state) {
  (void)state;
  static const struct {
    const char *text;
    uint64_t bytes;
  } cases[] = {
      {"0", 0},
      {"1", 1},
      {"7B", 7},
      {"7b", 7},
      {"1k", 1024},
      {"1KB", 1024},
      {"1KiB", 1024},
      {"3kib", 3072},
      {"512MiB", 512ULL << 20},
      {"512mb", 512ULL << 20},
      {"2G", 2ULL << 30},
      {"2GB", 2ULL << 30},
      {"2 GiB", 2ULL << 30},
      {"1TiB", 1ULL << 40},
      {"1tb", 1ULL << 40},
      {"4096TiB", 1ULL << 52},
      {"1073741825", 1073741825ULL},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    tide_config *config = new_config();
    if (tide_config_set(config, "memory_limit", cases[i].text) != TIDE_OK)
      fail_msg("%s refused: %s", cases[i].text, tide_last_error());
    assert_int_equal(_tide_config_values(config)->memory_limit, cases[i].bytes);
    tide_config_free(config);
  }
  tide_config *config = new_config();
  assert_int_equal(tide_config_set(config, "memory_limit", "1073741825"), TIDE_OK);
  assert_string_equal(get(config, "memory_limit"), "1073741825");
  assert_int_equal(tide_config_set(config, "memory_limit", "1048576KiB"), TIDE_OK);
  assert_string_equal(get(config, "memory_limit"), "1GiB");
  assert_int_equal(tide_config_set(config, "memory_limit", "1536KiB"), TIDE_OK);
  assert_string_equal(get(config, "memory_limit"), "1536KiB");
  tide_config_free(config);
}

/* ------------------------------------------------------------------------ */

static void test_parse_syntax(void **state) {
  (void)state;
  tide_config *config = new_config();
  assert_int_equal(tide_config_parse(config, ""), TIDE_OK);
  assert_int_equal(tide_config_parse(config, "   "), TIDE_OK);
  assert_int_equal(tide_config_parse(config, ",,"), TIDE_OK);
  assert_int_equal(changed_from_defaults(config), 0);
  assert_int_equal(source_of(config, "trace"), TIDE_CONFIG_DEFAULT);

  assert_int_equal(tide_config_parse(config, "trace:1,"), TIDE_OK);
  assert_string_equal(get(config, "trace"), "1");
  assert_int_equal(tide_config_parse(config, "  trace :\t2 ,\n page_size_mb: 4 "), TIDE_OK);
  assert_string_equal(get(config, "trace"), "2");
  assert_string_equal(get(config, "page_size_mb"), "4");
  /* A repeated key: the last wins. */
  assert_int_equal(tide_config_parse(config, "trace:3,trace:9"), TIDE_OK);
  assert_string_equal(get(config, "trace"), "9");
  tide_config_free(config);
}

static void test_atomic(void **state) {
  (void)state;
  static const char *const texts[] = {
      "trace:10,page_size_mb:0",
      "trace:10,bogus:1",
      "trace:10,expandable_segments",
      "expandable_segments:False,trace:10,memory_limit:lots",
      "host_devices:2,:5",
  };
  for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
    tide_config *config = new_config();
    assert_int_equal(tide_config_parse(config, texts[i]), TIDE_ERR_CONFIG);
    assert_int_equal(changed_from_defaults(config), 0);
    assert_int_equal(source_of(config, "trace"), TIDE_CONFIG_DEFAULT);
    assert_int_equal(source_of(config, "expandable_segments"), TIDE_CONFIG_DEFAULT);
    assert_int_equal(source_of(config, "host_devices"), TIDE_CONFIG_DEFAULT);
    assert_string_equal(get(config, "trace"), "0");
    tide_config_free(config);
  }
}

static void test_unknown_keys(void **state) {
  (void)state;
  tide_config *config = new_config();
  assert_int_equal(tide_config_parse(config, "trce:5"), TIDE_ERR_CONFIG);
  const char *message = tide_last_error();
  assert_non_null(strstr(message, "unknown key \"trce\""));
  for (size_t k = 0; k < KEY_COUNT; k++) assert_non_null(strstr(message, all_keys[k]));

  static const char *const pytorch_keys[] = {
      "pinned_use_cuda_host_register", "pinned_num_register_threads", "release_lock_on_cudamalloc",
      "max_non_split_rounding_mb"};
  for (size_t i = 0; i < sizeof pytorch_keys / sizeof pytorch_keys[0]; i++) {
    char text[128];
    snprintf(text, sizeof text, "%s:True", pytorch_keys[i]);
    assert_int_equal(tide_config_parse(config, text), TIDE_ERR_CONFIG);
    assert_non_null(strstr(tide_last_error(), pytorch_keys[i]));
    assert_non_null(strstr(tide_last_error(), "PyTorch allocator option tidalloc does not have"));
  }
  assert_int_equal(tide_config_parse(config, "per_process_memory_fraction:0.5"), TIDE_ERR_CONFIG);
  assert_non_null(strstr(tide_last_error(), "memory_fraction, which means the same"));

  /* Keys are case-sensitive, as in PyTorch. */
  assert_int_equal(tide_config_set(config, "Trace", "5"), TIDE_ERR_CONFIG);
  assert_int_equal(tide_config_set(config, "", "5"), TIDE_ERR_CONFIG);
  assert_int_equal(changed_from_defaults(config), 0);
  tide_config_free(config);
}

/* ------------------------------------------------------------------------ */

static void test_sources(void **state) {
  (void)state;
  tide_config *config = new_config();
  assert_int_equal(unsetenv("TIDALLOC_CONF"), 0);
  assert_int_equal(tide_config_load_env(config), TIDE_OK);
  assert_int_equal(changed_from_defaults(config), 0);
  assert_int_equal(setenv("TIDALLOC_CONF", "", 1), 0);
  assert_int_equal(tide_config_load_env(config), TIDE_OK);
  assert_int_equal(changed_from_defaults(config), 0);

  assert_int_equal(setenv("TIDALLOC_CONF", "trace:5,expandable_segments:False,host_devices:1", 1),
                   0);
  assert_int_equal(tide_config_load_env(config), TIDE_OK);
  assert_string_equal(get(config, "trace"), "5");
  assert_string_equal(get(config, "expandable_segments"), "False");
  assert_int_equal(source_of(config, "trace"), TIDE_CONFIG_ENVIRONMENT);
  assert_int_equal(source_of(config, "expandable_segments"), TIDE_CONFIG_ENVIRONMENT);
  /* Set to its default value, but set all the same. */
  assert_int_equal(source_of(config, "host_devices"), TIDE_CONFIG_ENVIRONMENT);
  assert_int_equal(source_of(config, "page_size_mb"), TIDE_CONFIG_DEFAULT);

  /* Code overrides the environment, key by key. */
  assert_int_equal(tide_config_set(config, "trace", "7"), TIDE_OK);
  assert_int_equal(source_of(config, "trace"), TIDE_CONFIG_CODE);
  assert_string_equal(get(config, "trace"), "7");
  assert_int_equal(tide_config_parse(config, "page_size_mb:8"), TIDE_OK);
  assert_int_equal(source_of(config, "page_size_mb"), TIDE_CONFIG_CODE);
  assert_int_equal(source_of(config, "expandable_segments"), TIDE_CONFIG_ENVIRONMENT);

  /* A bad environment says where the text came from and changes nothing. */
  assert_int_equal(setenv("TIDALLOC_CONF", "trace:9,page_size_mb:huge", 1), 0);
  assert_int_equal(tide_config_load_env(config), TIDE_ERR_CONFIG);
  assert_non_null(strstr(tide_last_error(), "TIDALLOC_CONF"));
  assert_non_null(strstr(tide_last_error(), "\"huge\""));
  assert_string_equal(get(config, "trace"), "7");
  assert_int_equal(source_of(config, "trace"), TIDE_CONFIG_CODE);
  assert_int_equal(unsetenv("TIDALLOC_CONF"), 0);
  tide_config_free(config);
}

static void test_clone_and_diff(void **state) {
  (void)state;
  tide_config *a = new_config();
  assert_int_equal(tide_config_parse(a, "trace:5"), TIDE_OK);
  tide_config *b = _tide_config_clone(a);
  assert_non_null(b);
  assert_ptr_not_equal(a, b);
  char buf[512];
  assert_int_equal(_tide_config_diff(a, b, buf, sizeof buf), 0);
  assert_string_equal(buf, "");
  assert_int_equal(source_of(b, "trace"), TIDE_CONFIG_CODE);

  /* The clone is independent, and its strings are its own. */
  assert_int_equal(tide_config_parse(b, "trace:6,expandable_segments:False,memory_limit:2GiB"),
                   TIDE_OK);
  assert_string_equal(get(a, "trace"), "5");
  assert_int_equal(_tide_config_diff(a, b, buf, sizeof buf), 3);
  assert_string_equal(buf, "expandable_segments: True -> False; memory_limit: 0 -> 2GiB; "
                           "trace: 5 -> 6");
  /* A short buffer still counts every difference and stays terminated. */
  char small[12];
  memset(small, 'x', sizeof small);
  assert_int_equal(_tide_config_diff(a, b, small, sizeof small), 3);
  assert_int_equal(strlen(small), sizeof small - 1);
  assert_int_equal(_tide_config_diff(a, b, NULL, 0), 3);

  tide_config_free(a);
  a = _tide_config_clone(b);
  tide_config_free(b);
  assert_string_equal(get(a, "memory_limit"), "2GiB");
  tide_config_free(a);

  assert_null(_tide_config_clone(NULL));
  assert_int_equal(tide_last_status(), TIDE_ERR_INVALID);
  assert_null(_tide_config_values(NULL));
}

static void test_get(void **state) {
  (void)state;
  tide_config *config = new_config();
  char buf[8];
  assert_int_equal(tide_config_get(config, "host_capacity", buf, sizeof buf), TIDE_OK);
  assert_string_equal(buf, "auto");
  assert_int_equal(tide_config_get(config, " trace ", buf, sizeof buf), TIDE_OK);
  assert_string_equal(buf, "0");
  /* Too short: truncated, terminated, and reported. */
  assert_int_equal(tide_config_get(config, "max_split_size_mb", buf, 4), TIDE_ERR_INVALID);
  assert_string_equal(buf, "unl");
  assert_non_null(strstr(tide_last_error(), "max_split_size_mb"));
  assert_int_equal(tide_config_get(config, "nope", buf, sizeof buf), TIDE_ERR_CONFIG);
  assert_string_equal(buf, "");
  tide_config_free(config);
}

static void test_null_arguments(void **state) {
  (void)state;
  tide_config *config = new_config();
  char buf[16];
  tide_option_info info;
  tide_clear_error();
  assert_int_equal(tide_config_new(NULL), TIDE_ERR_INVALID);
  assert_true(strlen(tide_last_error()) > 0);
  assert_int_equal(tide_config_load_env(NULL), TIDE_ERR_INVALID);
  assert_int_equal(tide_config_parse(NULL, "trace:1"), TIDE_ERR_INVALID);
  assert_int_equal(tide_config_parse(config, NULL), TIDE_ERR_INVALID);
  assert_non_null(strstr(tide_last_error(), "text is NULL"));
  assert_int_equal(tide_config_set(NULL, "trace", "1"), TIDE_ERR_INVALID);
  assert_int_equal(tide_config_set(config, NULL, "1"), TIDE_ERR_INVALID);
  assert_int_equal(tide_config_set(config, "trace", NULL), TIDE_ERR_INVALID);
  assert_int_equal(tide_config_get(NULL, "trace", buf, sizeof buf), TIDE_ERR_INVALID);
  assert_int_equal(tide_config_get(config, NULL, buf, sizeof buf), TIDE_ERR_INVALID);
  assert_int_equal(tide_config_get(config, "trace", NULL, 16), TIDE_ERR_INVALID);
  assert_int_equal(tide_config_get(config, "trace", buf, 0), TIDE_ERR_INVALID);
  assert_int_equal(tide_config_option(NULL, 0, &info), TIDE_ERR_INVALID);
  assert_int_equal(tide_config_option(config, 0, NULL), TIDE_ERR_INVALID);
  assert_int_equal(_tide_config_diff(NULL, config, buf, sizeof buf), 0);
  assert_string_equal(buf, "");
  tide_config_free(NULL);
  assert_int_equal(changed_from_defaults(config), 0);
  tide_config_free(config);
}

/* ------------------------------------------------------------------------ */

/* Parsing `text` either succeeds or fails with TIDE_ERR_CONFIG and changes
 * nothing. */
static void expect_safe(tide_config *config, const char *text) {
  tide_config *before = _tide_config_clone(config);
  assert_non_null(before);
  tide_status status = tide_config_parse(config, text);
  if (status != TIDE_OK && status != TIDE_ERR_CONFIG)
    fail_msg("status %s for garbage", tide_status_name(status));
  if (status == TIDE_ERR_CONFIG) {
    assert_int_equal(_tide_config_diff(before, config, NULL, 0), 0);
    assert_true(strlen(tide_last_error()) > 0);
  }
  tide_config_free(before);
}

static void test_garbage(void **state) {
  (void)state;
  tide_config *config = new_config();
  static const char *const texts[] = {
      ":",
      ":::",
      "trace::5",
      "trace:1:2",
      "[",
      "]]]]",
      "[[[[",
      "trace:[",
      "trace:]",
      "backend:host:cuda",
      "a:b:c",
      "\x01\xff:\x80",
      "trace:5\x01",
      "trace:\xe2\x82\xac",
      "memory_limit:1\xc2\xa0GiB",
      "expandable_segments:True]",
      "roundup_power2_divisions:[256:1,>:8],]",
      "=",
      "trace=5",
      "trace 5",
      "\"trace\":5",
  };
  for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
    tide_config *fresh = new_config();
    if (tide_config_parse(fresh, texts[i]) != TIDE_ERR_CONFIG) fail_msg("text %zu was accepted", i);
    assert_int_equal(changed_from_defaults(fresh), 0);
    tide_config_free(fresh);
  }

  /* Random bytes, and random mixtures of the characters that matter. */
  static const char alphabet[] = "trace:page_size_mb,[]>0123456789 .eE-+KiBMGT";
  unsigned seed = 12345;
  char text[300];
  for (int round = 0; round < 20000; round++) {
    seed = seed * 1103515245u + 12345u;
    size_t len = (seed >> 16) % (sizeof text - 1);
    for (size_t i = 0; i < len; i++) {
      seed = seed * 1103515245u + 12345u;
      unsigned r = seed >> 16;
      text[i] = round % 2 ? (char)(1 + r % 255) : alphabet[r % (sizeof alphabet - 1)];
    }
    text[len] = '\0';
    expect_safe(config, text);
  }

  /* Very long strings: a key, a value, a list, many entries. */
  size_t big = 1 << 20;
  char *huge = malloc(big + 64);
  assert_non_null(huge);
  memset(huge, 'a', big);
  huge[big] = '\0';
  assert_int_equal(tide_config_parse(config, huge), TIDE_ERR_CONFIG);
  memcpy(huge, "trace:", 6);
  memset(huge + 6, '9', big - 6);
  assert_int_equal(tide_config_parse(config, huge), TIDE_ERR_CONFIG);
  assert_true(strlen(tide_last_error()) < 1024);
  memset(huge + 6, '0', big - 7);
  huge[big - 1] = '5'; /* "trace:000...05": a valid number, too long a value */
  expect_safe(config, huge);
  memcpy(huge, "roundup_power2_divisions:[", 26);
  memset(huge + 26, '[', big - 26);
  assert_int_equal(tide_config_parse(config, huge), TIDE_ERR_CONFIG);
  for (size_t i = 0; i + 8 <= big; i += 8) memcpy(huge + i, "trace:1,", 8);
  huge[big] = '\0';
  assert_int_equal(tide_config_parse(config, huge), TIDE_OK);
  assert_string_equal(get(config, "trace"), "1");
  free(huge);
  tide_config_free(config);
}

/* A decimal comma in the program's locale changes nothing. */
/* A decimal value formats to text that parses back to the same value, and
 * so to the same text, however many digits it was written with (numbers
 * beyond 19 digits or the exact powers of ten used to lose an ulp, and the
 * config's text then changed when it was parsed again). */
static void test_decimal_round_trip(void **state) {
  (void)state;
  static const char *const texts[] = {
      "10446744073709407370949e-31",
      "0.1000000000000000055511151231257827",
      "3e-300",
      "123456789012345678901234567890e-40",
      "9.999999999999999e-1",
      "4.9e-324",
      "0.7",
      "1e-7",
  };
  for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
    tide_config *a = new_config(), *b = new_config();
    assert_int_equal(tide_config_set(a, "garbage_collection_threshold", texts[i]), TIDE_OK);
    char first[64], again[64];
    snprintf(first, sizeof first, "%s", get(a, "garbage_collection_threshold"));
    assert_int_equal(tide_config_set(b, "garbage_collection_threshold", first), TIDE_OK);
    snprintf(again, sizeof again, "%s", get(b, "garbage_collection_threshold"));
    if (strcmp(first, again) != 0)
      fail_msg("\"%s\" formats as \"%s\", which formats as \"%s\"", texts[i], first, again);
    assert_true(_tide_config_values(a)->gc_threshold == _tide_config_values(b)->gc_threshold);
    tide_config_free(a);
    tide_config_free(b);
  }
}

static void test_locale_independent(void **state) {
  (void)state;
  static const char *const locales[] = {"de_DE.UTF-8", "de_DE.utf8", "fr_FR.UTF-8", "ru_RU.UTF-8"};
  const char *set = NULL;
  for (size_t i = 0; i < sizeof locales / sizeof locales[0] && !set; i++)
    set = setlocale(LC_NUMERIC, locales[i]);
  if (!set) skip();
  tide_config *config = new_config();
  assert_int_equal(tide_config_set(config, "garbage_collection_threshold", "0.75"), TIDE_OK);
  assert_string_equal(get(config, "garbage_collection_threshold"), "0.75");
  assert_string_equal(get(config, "memory_fraction"), "1.0");
  tide_config_free(config);
  setlocale(LC_NUMERIC, "C");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_defaults),
      cmocka_unit_test(test_option_table),
      cmocka_unit_test(test_option_value_follows_changes),
      cmocka_unit_test(test_good_values),
      cmocka_unit_test(test_values_reach_the_struct),
      cmocka_unit_test(test_bad_values),
      cmocka_unit_test(test_backend_pytorch_value_explained),
      cmocka_unit_test(test_roundup_list),
      cmocka_unit_test(test_roundup_list_errors),
      cmocka_unit_test(test_byte_units),
      cmocka_unit_test(test_parse_syntax),
      cmocka_unit_test(test_atomic),
      cmocka_unit_test(test_unknown_keys),
      cmocka_unit_test(test_sources),
      cmocka_unit_test(test_clone_and_diff),
      cmocka_unit_test(test_get),
      cmocka_unit_test(test_null_arguments),
      cmocka_unit_test(test_garbage),
      cmocka_unit_test(test_retired_keys_accepted_with_notice),
      cmocka_unit_test(test_decimal_round_trip),
      cmocka_unit_test(test_locale_independent),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
