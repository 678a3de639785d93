/* replay.c: a main for the fuzz targets where libFuzzer is not linked: it
 * runs LLVMFuzzerTestOneInput once on every file named, or on every file of
 * every directory named (the committed corpus and crash reproducers), so
 * each build tests them. A failed check aborts, as under libFuzzer. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz.h"

static int run_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, "replay: cannot open %s\n", path);
    return 1;
  }
  uint8_t *data = NULL;
  size_t size = 0, cap = 0;
  for (;;) {
    if (size == cap) {
      cap = cap ? cap * 2 : 4096;
      uint8_t *grown = realloc(data, cap);
      if (!grown) {
        fclose(f);
        free(data);
        fprintf(stderr, "replay: out of memory reading %s\n", path);
        return 1;
      }
      data = grown;
    }
    size_t got = fread(data + size, 1, cap - size, f);
    if (got == 0) break;
    size += got;
  }
  fclose(f);
  LLVMFuzzerTestOneInput(data, size);
  free(data);
  return 0;
}

static int by_name(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The files of a directory, in name order so that runs are repeatable. */
static int run_dir(const char *dir, size_t *count) {
  DIR *d = opendir(dir);
  if (!d) {
    fprintf(stderr, "replay: cannot open directory %s\n", dir);
    return 1;
  }
  char **names = NULL;
  size_t n = 0, cap = 0;
  int failed = 0;
  for (struct dirent *e; (e = readdir(d));) {
    if (e->d_name[0] == '.') continue;
    if (n == cap) {
      cap = cap ? cap * 2 : 64;
      char **grown = realloc(names, cap * sizeof *names);
      if (!grown) {
        failed = 1;
        break;
      }
      names = grown;
    }
    size_t len = strlen(dir) + strlen(e->d_name) + 2;
    names[n] = malloc(len);
    if (!names[n]) {
      failed = 1;
      break;
    }
    snprintf(names[n++], len, "%s/%s", dir, e->d_name);
  }
  closedir(d);
  if (n) qsort(names, n, sizeof *names, by_name);
  for (size_t i = 0; i < n; i++) {
    struct stat st;
    if (!failed && stat(names[i], &st) == 0 && S_ISREG(st.st_mode)) {
      failed |= run_file(names[i]);
      (*count)++;
    }
    free(names[i]);
  }
  free(names);
  return failed;
}

int main(int argc, char **argv) {
  size_t count = 0;
  int failed = 0;
  for (int i = 1; i < argc; i++) {
    struct stat st;
    if (stat(argv[i], &st) != 0) {
      fprintf(stderr, "replay: %s does not exist\n", argv[i]);
      failed = 1;
    } else if (S_ISDIR(st.st_mode)) {
      failed |= run_dir(argv[i], &count);
    } else {
      failed |= run_file(argv[i]);
      count++;
    }
  }
  printf("replay: %zu input(s) run%s\n", count, failed ? ", with errors" : "");
  if (count == 0) {
    fprintf(stderr, "replay: no input found\n");
    return 1;
  }
  return failed;
}
