/* test_share.c: sharing blocks between processes (tide_share_*) on the host
 * backend: export and import in one process and across a fork over a Unix
 * socket, blocks of many pages (more descriptors than one message carries),
 * fixed segments, bad input, injected failures leaving no descriptor or
 * mapping behind, and teardown with imports still mapped. */
#include <dirent.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "testutil.h"

/* Blocks of several pages export a piece per page: no load handles (their
 * pieces are test_load_handles.c's). */
#define HOST_CONF "backend:host,host_capacity:4GiB,load_handles:False"

/* Open descriptors of this process: a failed export or import must leave
 * this unchanged. */
static int open_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  if (!d) return -1;
  int n = 0;
  while (readdir(d)) n++;
  closedir(d);
  return n;
}

static void fill(uint8_t *p, size_t n, uint8_t seed) {
  for (size_t i = 0; i < n; i += 4096) p[i] = (uint8_t)(seed + i / 4096);
  p[n - 1] = (uint8_t)(seed ^ 0x5a);
}

static bool filled(const uint8_t *p, size_t n, uint8_t seed) {
  for (size_t i = 0; i < n; i += 4096)
    if (p[i] != (uint8_t)(seed + i / 4096)) return false;
  return p[n - 1] == (uint8_t)(seed ^ 0x5a);
}

/* Export a block, import it in a second allocator, see writes both ways. */
static void roundtrip(const char *conf, size_t size, size_t at) {
  tide_allocator *a = tu_create(conf), *b = tu_create(conf);
  uint8_t *filler = NULL;
  if (at) assert_non_null(filler = tide_malloc(a, at, NULL)); /* not at a page start */
  uint8_t *p = NULL;
  assert_non_null(p = tide_malloc(a, size, NULL));
  fill(p, size, 7);
  tide_share_desc desc;
  tide_share_piece *pieces = NULL;
  tu_assert_ok(tide_share_export(a, p, &desc, &pieces));
  assert_true(desc.size >= size);
  assert_int_equal(desc.backend, 0);
  uint8_t *q = NULL;
  tu_assert_ok(tide_share_import(b, &desc, pieces, (void **)&q));
  tide_share_pieces_close(pieces, desc.num_pieces); /* the mapping keeps the memory */
  assert_true(filled(q, size, 7));
  fill(q, size, 99);
  assert_true(filled(p, size, 99));
  tide_stats sb = tu_stats(b);
  assert_int_equal(sb.allocated_bytes[TIDE_POOL_ALL].current, 0); /* imports are the exporter's */
  tu_assert_ok(tide_share_close(b, q));
  tu_assert_status(tide_share_close(b, q), TIDE_ERR_BAD_POINTER);
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_check(b));
  tu_assert_ok(tide_free(a, p, NULL));
  if (filler) tu_assert_ok(tide_free(a, filler, NULL));
  tu_assert_ok(tide_destroy(b));
  tu_assert_ok(tide_destroy(a));
}

static void test_roundtrip_small(void **state) {
  (void)state;
  roundtrip(HOST_CONF, 4096, 0);
  roundtrip(HOST_CONF, 4096, 512 * 3);
}

static void test_roundtrip_pages(void **state) {
  (void)state;
  roundtrip(HOST_CONF, 5 * TU_MiB + 12345, 0);
  roundtrip(HOST_CONF, 5 * TU_MiB, 3 * TU_MiB); /* starts inside a page */
}

/* Blocks in a segment of 8 MiB handles (handle_size_mb:8, requests of
 * 32 MiB or more, no load handles): one piece per handle, the second block
 * starting inside the handle the first one ends in. */
static void test_roundtrip_large_handles(void **state) {
  (void)state;
  roundtrip(HOST_CONF ",handle_size_mb:8,handle_threshold_mb:0,load_handles:False", 40 * TU_MiB, 0);
  roundtrip(HOST_CONF ",handle_size_mb:8,handle_threshold_mb:0,load_handles:False", 44 * TU_MiB,
            36 * TU_MiB);
  tide_allocator *a =
      tu_create(HOST_CONF ",handle_size_mb:8,handle_threshold_mb:0,load_handles:False");
  void *filler = tide_malloc(a, 36 * TU_MiB, NULL), *p = tide_malloc(a, 44 * TU_MiB, NULL);
  assert_non_null(filler);
  assert_non_null(p);
  assert_int_equal((uintptr_t)p - (uintptr_t)filler, 36 * TU_MiB);
  tide_share_desc desc;
  tide_share_piece *pieces = NULL;
  tu_assert_ok(tide_share_export(a, p, &desc, &pieces));
  assert_int_equal(desc.offset, 4 * TU_MiB); /* into the handle at 32 MiB */
  assert_int_equal(desc.num_pieces, 6);      /* the handles at 32, 40, ..., 72 MiB */
  for (uint32_t i = 0; i < desc.num_pieces; i++) assert_int_equal(pieces[i].size, 8 * TU_MiB);
  tide_share_pieces_close(pieces, desc.num_pieces);
  tu_assert_ok(tide_free(a, p, NULL));
  tu_assert_ok(tide_free(a, filler, NULL));
  tu_assert_ok(tide_destroy(a));
}

static void test_roundtrip_fixed(void **state) {
  (void)state;
  roundtrip(HOST_CONF ",expandable_segments:False", 3 * TU_MiB, 0);
  roundtrip(HOST_CONF ",expandable_segments:False", 4096, 8192);
}

/* More pieces than one message carries: 600 pages of 64 KiB. */
static void test_many_pieces(void **state) {
  (void)state;
  const char *conf = HOST_CONF ",host_granularity:64KiB,page_size_mb:0.0625";
  tide_config *probe = NULL;
  tu_assert_ok(tide_config_new(&probe));
  tide_status st = tide_config_parse(probe, conf);
  tide_config_free(probe);
  if (st != TIDE_OK) conf = HOST_CONF ",host_granularity:64KiB";
  tide_allocator *a = tu_create(conf), *b = tu_create(conf);
  size_t size = 600 * 64 * TU_KiB;
  uint8_t *p = NULL;
  assert_non_null(p = tide_malloc(a, size, NULL));
  fill(p, size, 3);
  tide_share_desc desc;
  tide_share_piece *pieces = NULL;
  tu_assert_ok(tide_share_export(a, p, &desc, &pieces));
  int sv[2];
  assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  tu_assert_ok(tide_share_send(sv[0], &desc, pieces));
  tide_share_desc got;
  tide_share_piece *in = NULL;
  tu_assert_ok(tide_share_recv(sv[1], &got, &in));
  assert_int_equal(got.num_pieces, desc.num_pieces);
  assert_int_equal(got.size, desc.size);
  uint8_t *q = NULL;
  tu_assert_ok(tide_share_import(b, &got, in, (void **)&q));
  assert_true(filled(q, size, 3));
  tide_share_pieces_close(in, got.num_pieces);
  tide_share_pieces_close(pieces, desc.num_pieces);
  close(sv[0]);
  close(sv[1]);
  tu_assert_ok(tide_share_close(b, q));
  tu_assert_ok(tide_free(a, p, NULL));
  tu_assert_ok(tide_destroy(b));
  tu_assert_ok(tide_destroy(a));
}

/* The child maps what the parent sends, checks it, writes its answer. */
static int child_main(int sock) {
  tide_config *c = NULL;
  if (tide_config_new(&c) || tide_config_parse(c, HOST_CONF)) return 2;
  tide_allocator *b = NULL;
  if (tide_create(0, c, &b)) return 3;
  tide_config_free(c);
  tide_share_desc desc;
  tide_share_piece *pieces = NULL;
  if (tide_share_recv(sock, &desc, &pieces)) return 4;
  uint8_t *q = NULL;
  if (tide_share_import(b, &desc, pieces, (void **)&q)) return 5;
  tide_share_pieces_close(pieces, desc.num_pieces);
  if (!filled(q, desc.size, 41)) return 6;
  fill(q, desc.size, 42);
  if (tide_share_close(b, q) || tide_destroy(b)) return 7;
  char done = 'k';
  return write(sock, &done, 1) == 1 ? 0 : 8;
}

static void test_across_fork(void **state) {
  (void)state;
  int sv[2];
  assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    close(sv[0]);
    _exit(child_main(sv[1]));
  }
  close(sv[1]);
  tide_allocator *a = tu_create(HOST_CONF);
  uint8_t *p = NULL;
  size_t size = 3 * TU_MiB + 512; /* a multiple of 512: the block is this size */
  assert_non_null(p = tide_malloc(a, size, NULL));
  fill(p, size, 41);
  tide_share_desc desc;
  tide_share_piece *pieces = NULL;
  tu_assert_ok(tide_share_export(a, p, &desc, &pieces));
  tu_assert_ok(tide_share_send(sv[0], &desc, pieces));
  tide_share_pieces_close(pieces, desc.num_pieces);
  char done = 0;
  ssize_t got = read(sv[0], &done, 1);
  int status = 0;
  assert_int_equal(waitpid(pid, &status, 0), pid);
  assert_true(WIFEXITED(status));
  assert_int_equal(WEXITSTATUS(status), 0); /* else: the step of child_main that failed */
  assert_int_equal(got, 1);
  assert_true(filled(p, desc.size, 42)); /* the child's writes */
  close(sv[0]);
  tu_assert_ok(tide_free(a, p, NULL));
  tu_assert_ok(tide_destroy(a));
}

static void test_bad_input(void **state) {
  (void)state;
  tide_allocator *a = tu_create(HOST_CONF);
  tide_share_desc desc;
  tide_share_piece *pieces = NULL;
  int x = 0;
  tu_assert_status(tide_share_export(a, &x, &desc, &pieces), TIDE_ERR_BAD_POINTER);
  tu_assert_last_error(TIDE_ERR_BAD_POINTER, "not allocated by this allocator");
  void *p = NULL;
  assert_non_null(p = tide_malloc(a, 1000, NULL));
  tu_assert_status(tide_share_export(a, p, NULL, &pieces), TIDE_ERR_INVALID);
  tu_assert_status(tide_share_export(NULL, p, &desc, &pieces), TIDE_ERR_INVALID);
  tu_assert_ok(tide_share_export(a, p, &desc, &pieces));
  tide_share_desc wrong = desc;
  void *q = NULL;
  wrong.backend = 1;
  tu_assert_status(tide_share_import(a, &wrong, pieces, &q), TIDE_ERR_INVALID);
  tu_assert_last_error(TIDE_ERR_INVALID, "CUDA backend");
  wrong = desc;
  wrong.size = pieces[0].size + 1;
  tu_assert_status(tide_share_import(a, &wrong, pieces, &q), TIDE_ERR_INVALID);
  wrong = desc;
  wrong.num_pieces = 0;
  tu_assert_status(tide_share_import(a, &wrong, pieces, &q), TIDE_ERR_INVALID);
  tide_share_pieces_close(pieces, desc.num_pieces);
  tu_assert_ok(tide_free(a, p, NULL));
  tu_assert_status(tide_share_export(a, p, &desc, &pieces), TIDE_ERR_BAD_POINTER);
  tu_assert_last_error(TIDE_ERR_BAD_POINTER, "not allocated");
  tu_assert_status(tide_share_close(a, p), TIDE_ERR_BAD_POINTER);
  /* A socket whose other end closed: a clear failure, nothing received. */
  int sv[2];
  assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  close(sv[0]);
  tide_share_piece *in = (tide_share_piece *)&x;
  assert_int_not_equal(tide_share_recv(sv[1], &desc, &in), TIDE_OK);
  assert_null(in);
  close(sv[1]);
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_destroy(a));
}

/* A failure at each backend call of export and import leaves no open
 * descriptor, mapping or reservation behind; the next try succeeds. */
static void test_faults(void **state) {
  (void)state;
  static const tide_backend_op ops[] = {TIDE_OP_EXPORT, TIDE_OP_IMPORT, TIDE_OP_RESERVE,
                                        TIDE_OP_MAP, TIDE_OP_SET_ACCESS};
  for (size_t k = 0; k < sizeof ops / sizeof ops[0]; k++) {
    for (uint64_t nth = 1; nth <= 3; nth++) {
      tide_allocator *a = tu_create(HOST_CONF), *b = tu_create(HOST_CONF);
      uint8_t *p = NULL;
      assert_non_null(p = tide_malloc(a, 5 * TU_MiB, NULL)); /* 3 pages */
      fill(p, 5 * TU_MiB, 11);
      int before = open_fds();
      tide_allocator *victim = ops[k] == TIDE_OP_EXPORT ? a : b;
      uint64_t used_before = tide_host_bytes_in_use(b);
      tu_assert_ok(tide_host_fail_call(victim, ops[k], nth));
      tide_share_desc desc;
      tide_share_piece *pieces = NULL;
      uint8_t *q = NULL;
      tide_status st = tide_share_export(a, p, &desc, &pieces);
      if (st == TIDE_OK) {
        st = tide_share_import(b, &desc, pieces, (void **)&q);
        tide_share_pieces_close(pieces, desc.num_pieces);
      }
      bool fired =
          nth == 1 || ops[k] == TIDE_OP_EXPORT || ops[k] == TIDE_OP_IMPORT || ops[k] == TIDE_OP_MAP;
      if (fired) {
        tu_assert_status(st, TIDE_ERR_BACKEND);
        tu_assert_last_error(TIDE_ERR_BACKEND, "injected failure");
      } else {
        tu_assert_ok(st);
        tu_assert_ok(tide_share_close(b, q));
      }
      tu_assert_ok(tide_host_fail_call(victim, ops[k], 0));
      assert_int_equal(open_fds(), before);
      assert_int_equal(tide_host_bytes_in_use(b), used_before);
      tu_assert_ok(tide_check(a));
      tu_assert_ok(tide_check(b));
      assert_true(filled(p, 5 * TU_MiB, 11));
      tu_assert_ok(tide_free(a, p, NULL));
      tu_assert_ok(tide_destroy(b));
      tu_assert_ok(tide_destroy(a));
    }
  }
}

/* Destroying an allocator unmaps what it imported and closes nothing of the
 * caller's. */
static void test_destroy_with_imports(void **state) {
  (void)state;
  tide_allocator *a = tu_create(HOST_CONF);
  void *p = NULL, *q = NULL;
  assert_non_null(p = tide_malloc(a, 3 * TU_MiB, NULL));
  int before = open_fds();
  tide_allocator *b = tu_create(HOST_CONF);
  tide_share_desc desc;
  tide_share_piece *pieces = NULL;
  tu_assert_ok(tide_share_export(a, p, &desc, &pieces));
  tu_assert_ok(tide_share_import(b, &desc, pieces, &q));
  tide_share_pieces_close(pieces, desc.num_pieces);
  tu_assert_ok(tide_destroy(b));
  assert_int_equal(open_fds(), before);
  tu_assert_ok(tide_free(a, p, NULL));
  tu_assert_ok(tide_destroy(a));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_roundtrip_small),
      cmocka_unit_test(test_roundtrip_pages),
      cmocka_unit_test(test_roundtrip_large_handles),
      cmocka_unit_test(test_roundtrip_fixed),
      cmocka_unit_test(test_many_pieces),
      cmocka_unit_test(test_across_fork),
      cmocka_unit_test(test_bad_input),
      cmocka_unit_test(test_faults),
      cmocka_unit_test(test_destroy_with_imports),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
