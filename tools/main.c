/* main.c: the tidalloc command's entry point: dispatch to a subcommand, the
 * top-level help and version. The helpers the subcommands share are in
 * cli.c. */
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "cli.h"

typedef struct subcommand {
  const char *name;
  int (*run)(int argc, char **argv);
  const char *summary;
} subcommand;

static const subcommand subcommands[] = {
    {"info", tide_cli_info, "print the version, the device and every configuration option"},
    {"micro", tide_cli_micro, "measure alloc+free latency against the host's allocators"},
    {"replay", tide_cli_replay, "replay a recorded allocation trace and report peak memory"},
    {"stream", tide_cli_stream, "run a streaming-inference memory workload"},
    {"soak", tide_cli_soak, "run a mixed workload for a while, verifying every byte"},
};
static const size_t subcommand_count = sizeof(subcommands) / sizeof(subcommands[0]);

static void print_usage(FILE *out) {
  fprintf(out,
          "tidalloc %s: a caching GPU memory allocator for streaming inference\n"
          "\n"
          "usage: tidalloc <command> [options]\n"
          "       tidalloc <command> --help\n"
          "       tidalloc --version\n"
          "\n"
          "commands:\n",
          tide_version());
  for (size_t i = 0; i < subcommand_count; i++) {
    fprintf(out, "  %-8s %s\n", subcommands[i].name, subcommands[i].summary);
  }
  fprintf(out, "\n"
               "Every command accepts --conf \"key:value,...\": the allocator's options, applied\n"
               "after the TIDALLOC_CONF environment variable. `tidalloc info` lists them.\n");
}

static const subcommand *find_subcommand(const char *name) {
  for (size_t i = 0; i < subcommand_count; i++) {
    if (strcmp(subcommands[i].name, name) == 0) return &subcommands[i];
  }
  return NULL;
}

/* `tidalloc help [command]`: a command's help is its own --help. */
static int run_help(int argc, char **argv) {
  if (argc < 3) {
    print_usage(stdout);
    return CLI_EXIT_OK;
  }
  const subcommand *cmd = find_subcommand(argv[2]);
  if (cmd == NULL) {
    cli_error("no command '%s' (try `tidalloc --help`)", argv[2]);
    return CLI_EXIT_USAGE;
  }
  char help_flag[] = "--help";
  char *help_argv[] = {argv[2], help_flag, NULL};
  return cmd->run(2, help_argv);
}

static int run(int argc, char **argv) {
  if (argc < 2) {
    print_usage(stderr);
    return CLI_EXIT_USAGE;
  }
  const char *first = argv[1];
  bool help = cli_is_help(first);
  bool version = strcmp(first, "--version") == 0 || strcmp(first, "-V") == 0;
  /* `tidalloc --version extra` is a mistyped command line, not a request. */
  if ((help || version) && argc > 2) {
    cli_error("%s takes no arguments, not '%s' (try `tidalloc --help`)", first, argv[2]);
    return CLI_EXIT_USAGE;
  }
  if (help) {
    print_usage(stdout);
    return CLI_EXIT_OK;
  }
  if (strcmp(first, "help") == 0) {
    if (argc > 3) {
      cli_error("help takes one command, not '%s' (try `tidalloc --help`)", argv[3]);
      return CLI_EXIT_USAGE;
    }
    return run_help(argc, argv);
  }
  if (version) {
    printf("tidalloc %s\n", tide_version());
    return CLI_EXIT_OK;
  }
  const subcommand *cmd = find_subcommand(first);
  if (cmd == NULL) {
    cli_error("no command '%s' (try `tidalloc --help`)", first);
    return CLI_EXIT_USAGE;
  }
  return cmd->run(argc - 1, argv + 1);
}

int main(int argc, char **argv) {
  int code = run(argc, argv);
  /* What a command printed is its result: output lost to a full disk or a
   * closed file is a failure, not a success with nothing written. */
  if (!cli_close_output(stdout, "standard output") && code == CLI_EXIT_OK) code = CLI_EXIT_FAILURE;
  return code;
}
