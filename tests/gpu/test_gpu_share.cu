/* test_gpu_share.cu: a block tidalloc allocated in one process is mapped by a
 * second process (tide_share_export / send / recv / import), which checks
 * the first process's pattern with a kernel and writes its own; the first
 * process then sees the second's writes. Blocks: a small one, one of
 * several pages starting inside a page, and one in a fixed segment. The
 * processes are forked before either touches CUDA. When the device or
 * system refuses exportable memory, the test says so and checks that the
 * refusal is a clear TIDE_ERR_UNAVAILABLE. */
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpu_check.h"

typedef struct shared_case {
  const char *name;
  const char *conf;
  size_t before; /* bytes allocated first, so the block starts mid-page */
  size_t size;
} shared_case;

static const shared_case cases[] = {
    {"small block", "", 0, 64 * 1024},
    {"5 pages, mid-page start", "", 3 * GPU_MiB, 9 * GPU_MiB + 512},
    {"fixed segment", "expandable_segments:False", 4096, 3 * GPU_MiB},
    /* 8 MiB handles from the first byte: the block starts inside the handle
     * the one before it ends in, and is exported as whole handles. */
    {"8 MiB handles, mid-handle start", "handle_size_mb:8,handle_threshold_mb:0", 36 * GPU_MiB,
     44 * GPU_MiB},
};
#define NCASES (sizeof cases / sizeof cases[0])

static void send_byte(int sock, char c) {
  if (write(sock, &c, 1) != 1) gpu_fatal(__FILE__, __LINE__, "write to the other process failed");
}

static char recv_byte(int sock) {
  char c = 0;
  if (read(sock, &c, 1) != 1) gpu_fatal(__FILE__, __LINE__, "the other process went away");
  return c;
}

/* The importing process: per case, map what arrives, check, write, unmap. */
static int importer(int sock) {
  counter bad = counter_new();
  for (size_t k = 0; k < NCASES; k++) {
    tide_allocator *b = gpu_allocator(cases[k].conf);
    tide_share_desc desc;
    tide_share_piece *pieces = NULL;
    if (recv_byte(sock) == 'u') { /* the exporter cannot share: nothing comes */
      TIDE_OK_OR_DIE(tide_destroy(b));
      continue;
    }
    TIDE_OK_OR_DIE(tide_share_recv(sock, &desc, &pieces));
    void *q = NULL;
    TIDE_OK_OR_DIE(tide_share_import(b, &desc, pieces, &q));
    tide_share_pieces_close(pieces, desc.num_pieces);
    queue_check(q, cases[k].size, 1000 + k, bad.dev, NULL);
    unsigned long long wrong = counter_take(bad);
    check(wrong == 0, "importer, %s: %llu words differ from the exporter's pattern (%u pieces)",
          cases[k].name, wrong, desc.num_pieces);
    fill(q, cases[k].size, 2000 + k, NULL);
    CUDA_OK(cudaDeviceSynchronize());
    TIDE_OK_OR_DIE(tide_share_close(b, q));
    TIDE_OK_OR_DIE(tide_destroy(b));
    send_byte(sock, 'w');
  }
  counter_free(bad);
  return finish("test_gpu_share (importer)");
}

/* One case in the exporting process. */
static void export_case(int sock, size_t k, counter bad) {
  const shared_case *c = &cases[k];
  tide_allocator *a = gpu_allocator(c->conf);
  void *first = c->before ? tide_malloc(a, c->before, NULL) : NULL;
  void *p = tide_malloc(a, c->size, NULL);
  if (!p || (c->before && !first))
    gpu_fatal(__FILE__, __LINE__, "tide_malloc: %s", tide_last_error());
  fill(p, c->size, 1000 + k, NULL);
  CUDA_OK(cudaDeviceSynchronize());
  tide_share_desc desc;
  tide_share_piece *pieces = NULL;
  tide_status st = tide_share_export(a, p, &desc, &pieces);
  if (st == TIDE_ERR_UNAVAILABLE) {
    check(tide_last_error()[0] != '\0', "%s: the device cannot share memory, and says why: %s",
          c->name, tide_last_error());
    send_byte(sock, 'u');
  } else {
    check(st == TIDE_OK, "%s: exported as %u piece(s): %s", c->name, st ? 0 : desc.num_pieces,
          st ? tide_last_error() : "ok");
    if (st != TIDE_OK) gpu_fatal(__FILE__, __LINE__, "cannot go on");
    send_byte(sock, 's');
    TIDE_OK_OR_DIE(tide_share_send(sock, &desc, pieces));
    tide_share_pieces_close(pieces, desc.num_pieces);
    recv_byte(sock);
    queue_check(p, c->size, 2000 + k, bad.dev, NULL);
    unsigned long long wrong = counter_take(bad);
    check(wrong == 0, "exporter, %s: %llu words differ from what the importer wrote", c->name,
          wrong);
  }
  TIDE_OK_OR_DIE(tide_free(a, p, NULL));
  if (first) TIDE_OK_OR_DIE(tide_free(a, first, NULL));
  TIDE_OK_OR_DIE(tide_check(a));
  TIDE_OK_OR_DIE(tide_destroy(a));
}

int main(void) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) gpu_fatal(__FILE__, __LINE__, "socketpair");
  fflush(stdout);
  pid_t pid = fork(); /* before CUDA is touched in either process */
  if (pid < 0) gpu_fatal(__FILE__, __LINE__, "fork failed");
  if (pid == 0) {
    close(sv[0]);
    _exit(importer(sv[1]));
  }
  close(sv[1]);
  print_device();
  counter bad = counter_new();
  for (size_t k = 0; k < NCASES; k++) export_case(sv[0], k, bad);
  counter_free(bad);
  close(sv[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  check(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the importing process passed (status %d)",
        WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  return finish("test_gpu_share");
}
