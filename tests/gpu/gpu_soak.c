/* gpu_soak.c: `tidalloc soak` as a program of its own, for the GPU tests:
 * they build the library but not the tidalloc command (which needs zlib).
 * The code is the command's (tools/soak.c and the helpers of tools/cli.c),
 * with the same options and exit codes. */
#include "cli.h"

int main(int argc, char **argv) { return tide_cli_soak(argc, argv); }
