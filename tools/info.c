/* info.c: `tidalloc info`, what tidalloc would run on and with: the
 * version, the backend, each device with its memory and mapping sizes, and
 * every configuration option with its value, default, source and meaning.
 * Unlike micro and replay it does not prefer the host backend: it shows what
 * a program using the same configuration would get. */
#include <stdio.h>
#include <string.h>

#include "cli.h"

static const char *source_name(tide_config_source source) {
  switch (source) {
  case TIDE_CONFIG_DEFAULT: return "default";
  case TIDE_CONFIG_ENVIRONMENT: return "environment";
  case TIDE_CONFIG_CODE: return "code";
  }
  return "?";
}

static void print_bytes_line(const char *label, uint64_t bytes) {
  char human[32];
  printf("  %-14s %llu (%s)\n", label, (unsigned long long)bytes,
         cli_format_bytes(bytes, human, sizeof(human)));
}

static void print_device(const tide_info *info) {
  printf("device %d: %s\n", info->device, info->device_name ? info->device_name : "?");
  print_bytes_line("total memory", info->total_memory);
  print_bytes_line("free memory", info->free_memory);
  print_bytes_line("granularity", info->granularity);
  print_bytes_line("page size", info->page_size);
}

/* Create an allocator on `device`, print what it reports and destroy it.
 * *count gets the device count. False after printing why. */
static bool show_device(const tide_config *config, int device, int *count) {
  tide_allocator *alloc = NULL;
  if (tide_create(device, config, &alloc) != TIDE_OK) {
    fflush(stdout);
    fprintf(stderr, "tidalloc info: cannot create an allocator on device %d: %s (%s)\n", device,
            tide_last_error(), tide_status_name(tide_last_status()));
    return false;
  }
  tide_info info;
  bool ok = tide_get_info(alloc, &info) == TIDE_OK;
  if (!ok) {
    cli_report_tide_error("info: reading the device");
  } else {
    if (device == 0) {
      printf("backend: %s\n", info.backend ? info.backend : "?");
      printf("devices: %d\n", info.device_count);
    }
    print_device(&info);
    *count = info.device_count;
  }
  if (tide_destroy(alloc) != TIDE_OK) {
    cli_report_tide_error("info: destroying the allocator");
    ok = false;
  }
  return ok;
}

static bool print_options(const tide_config *config) {
  size_t n = tide_config_option_count();
  int key_w = 3, value_w = 5, default_w = 7;
  for (size_t i = 0; i < n; i++) {
    tide_option_info o;
    if (tide_config_option(config, i, &o) != TIDE_OK) continue;
    if ((int)strlen(o.key) > key_w) key_w = (int)strlen(o.key);
    if ((int)strlen(o.value) > value_w) value_w = (int)strlen(o.value);
    if ((int)strlen(o.default_value) > default_w) default_w = (int)strlen(o.default_value);
  }
  printf("\noptions (set with TIDALLOC_CONF=\"key:value,...\" or --conf):\n");
  printf("  %-*s  %-*s  %-*s  %-11s  %s\n", key_w, "key", value_w, "value", default_w, "default",
         "source", "meaning");
  bool ok = true;
  for (size_t i = 0; i < n; i++) {
    tide_option_info o;
    if (tide_config_option(config, i, &o) != TIDE_OK) {
      cli_report_tide_error("info: reading an option");
      ok = false;
      continue;
    }
    printf("  %-*s  %-*s  %-*s  %-11s  %s\n", key_w, o.key, value_w, o.value, default_w,
           o.default_value, source_name(o.source), o.meaning);
  }
  return ok;
}

static void print_help(void) {
  printf("usage: tidalloc info [--conf STR]\n"
         "\n"
         "Print the version, the backend, every device (name, total and free memory,\n"
         "mapping granularity, page size) and every configuration option with its\n"
         "value, default, source (default, environment or code) and meaning. The\n"
         "configuration is the defaults, then TIDALLOC_CONF, then --conf. Exits\n"
         "non-zero with one message if the configuration does not parse, and after\n"
         "printing the options if no allocator can be created.\n"
         "\n"
         "  --conf STR   options, \"key:value,...\"\n");
}

int tide_cli_info(int argc, char **argv) {
  const char *conf = NULL;
  const cli_option options[] = {{.name = "--conf", .kind = CLI_TEXT, .target = &conf}};
  int code = cli_parse(argc, argv, "info", print_help, options, 1, NULL, 0);
  if (code >= 0) return code;

  /* A configuration that does not parse is the one thing said: the message
   * names the bad entry and what is accepted. */
  tide_config *config = NULL;
  if (cli_config_build(NULL, conf, &config) != TIDE_OK) {
    cli_report_tide_error("info");
    tide_config_free(config);
    return CLI_EXIT_FAILURE;
  }
  printf("tidalloc %s\n", tide_version());
  int count = 1;
  bool ok = show_device(config, 0, &count);
  for (int device = 1; ok && device < count; device++) {
    ok = show_device(config, device, &count);
  }
  if (!print_options(config)) ok = false;
  tide_config_free(config);
  return ok ? CLI_EXIT_OK : CLI_EXIT_FAILURE;
}
