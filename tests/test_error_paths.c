/* test_error_paths.c: failures that used to be dropped or told wrongly,
 * each injected and checked to come back as a status with a message that
 * says what happened: an orphan that cannot be recorded (realloc fails:
 * this program is linked with -Wl,--wrap=realloc), the backend refusing
 * to unmap or release at teardown or when an import is closed, sizes
 * tide_torch_alloc cannot take, a shrink on a stream that does not exist,
 * devices that do not exist, and tide_shutdown with blocks left on two
 * devices (last: a process shuts down once). */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "memory/core.h"
#include "testutil.h"
#include "tidalloc_torch.h"

/* ------------------------------------------------------------------------ */
/* realloc, failed on demand                                                 */
/* ------------------------------------------------------------------------ */

void *__real_realloc(void *ptr, size_t size);
void *__wrap_realloc(void *ptr, size_t size);

static size_t fail_realloc_of; /* a size whose reallocs fail; 0: none */
static unsigned realloc_failures;

void *__wrap_realloc(void *ptr, size_t size) {
  if (fail_realloc_of && size == fail_realloc_of) {
    realloc_failures++;
    return NULL;
  }
  return __real_realloc(ptr, size);
}

static void expect_message(tide_status got, tide_status want, const char *needle) {
  if (got != want)
    fail_msg("returned %s, expected %s: \"%s\"", tide_status_name(got), tide_status_name(want),
             tide_last_error());
  if (needle && !strstr(tide_last_error(), needle))
    fail_msg("the message lacks \"%s\": \"%s\"", needle, tide_last_error());
}

/* The backend refuses to release a page and the orphan list cannot grow:
 * the piece is lost to the allocator, and it says so. */
static void orphan_not_recorded_is_reported(void **state) {
  (void)state;
  tide_allocator *a = tu_create("page_size_mb:2");
  void *p = tide_malloc(a, 8 * TU_MiB, NULL);
  assert_non_null(p);
  tu_assert_ok(tide_free(a, p, NULL));
  tu_assert_ok(tide_host_fail_call(a, TIDE_OP_RELEASE, 1));
  fail_realloc_of = 8 * sizeof(_tide_orphan_rec); /* the list's first room */
  tide_status rc = tide_empty_cache(a);
  fail_realloc_of = 0;
  assert_int_equal(realloc_failures, 1);
  assert_int_not_equal(rc, TIDE_OK); /* the refused release */
  expect_message(tide_check(a), TIDE_ERR_STATE, "could not be recorded");
  expect_message(tide_destroy(a), TIDE_ERR_BACKEND, "could not be recorded");
}

/* ------------------------------------------------------------------------ */
/* Teardown                                                                  */
/* ------------------------------------------------------------------------ */

static void teardown_refusal(tide_backend_op op, const char *needle) {
  tide_allocator *a = tu_create("page_size_mb:2");
  void *p = tide_malloc(a, 4 * TU_MiB, NULL);
  assert_non_null(p);
  tu_assert_ok(tide_free(a, p, NULL)); /* cached: its pages go at teardown */
  tu_assert_ok(tide_host_fail_call(a, op, 1));
  tide_clear_error();
  tide_status rc = tide_destroy(a);
  if (rc == TIDE_OK)
    fail_msg("tide_destroy said nothing of a refused %s", tide_backend_op_name(op));
  if (!strstr(tide_last_error(), "at teardown") || !strstr(tide_last_error(), needle))
    fail_msg("refused %s: \"%s\"", tide_backend_op_name(op), tide_last_error());
}

static void teardown_refusals_are_reported(void **state) {
  (void)state;
  teardown_refusal(TIDE_OP_UNMAP, "stays held");
  teardown_refusal(TIDE_OP_RELEASE, "stays held");
  teardown_refusal(TIDE_OP_UNRESERVE, "the range");
}

/* ------------------------------------------------------------------------ */
/* Closing an import whose unmap is refused                                  */
/* ------------------------------------------------------------------------ */

static void import_close_after_refused_unmap(void **state) {
  (void)state;
  tide_allocator *a = tu_create("page_size_mb:2"), *b = tu_create("page_size_mb:2");
  void *p = tide_malloc(a, 4 * TU_MiB, NULL);
  assert_non_null(p);
  tide_share_desc desc;
  tide_share_piece *pieces = NULL;
  tu_assert_ok(tide_share_export(a, p, &desc, &pieces));
  void *q = NULL;
  tu_assert_ok(tide_share_import(b, &desc, pieces, &q));
  tide_share_pieces_close(pieces, desc.num_pieces);
  uint64_t releases = tide_host_call_count(b, TIDE_OP_RELEASE);
  uint64_t unreserves = tide_host_call_count(b, TIDE_OP_UNRESERVE);
  tu_assert_ok(tide_host_fail_call(b, TIDE_OP_UNMAP, 1));
  expect_message(tide_share_close(b, q), TIDE_ERR_BACKEND, "stays mapped");
  /* The first piece stays mapped: neither it nor the range went back. */
  assert_true(tide_host_call_count(b, TIDE_OP_RELEASE) - releases < desc.num_pieces);
  assert_int_equal(tide_host_call_count(b, TIDE_OP_UNRESERVE), unreserves);
  tu_assert_ok(tide_free(a, p, NULL));
  tide_destroy(b); /* the emulated device goes with its mapping */
  tu_assert_ok(tide_destroy(a));
}

/* ------------------------------------------------------------------------ */
/* Messages                                                                  */
/* ------------------------------------------------------------------------ */

static void torch_alloc_of_no_bytes_says_why(void **state) {
  (void)state;
  tide_clear_error();
  assert_null(tide_torch_alloc(0, 0, NULL));
  tu_assert_last_error(TIDE_ERR_INVALID, "size 0");
  tide_clear_error();
  assert_null(tide_torch_alloc(-5, 0, NULL));
  tu_assert_last_error(TIDE_ERR_INVALID, "tide_torch_alloc(-5): a negative size");
}

static void resize_on_unknown_stream_names_the_stream(void **state) {
  (void)state;
  tide_allocator *a = tu_create("page_size_mb:2");
  tide_buf *b = NULL;
  tide_buf_options o = {.capacity = 64 * TU_MiB};
  tu_assert_ok(tide_buf_create(a, &o, &b));
  tu_assert_ok(tide_buf_resize(b, 8 * TU_MiB, NULL));
  tide_stream bogus = (tide_stream)(uintptr_t)0x4242;
  expect_message(tide_buf_resize(b, 0, bogus), TIDE_ERR_INVALID, "not a stream of this device");
  assert_null(strstr(tide_last_error(), "event_record"));
  assert_int_equal(tide_buf_length(b), 8 * TU_MiB);
  tu_assert_ok(tide_buf_resize(b, 0, NULL));
  tu_assert_ok(tide_buf_destroy(b));
  tu_assert_ok(tide_destroy(a));
}

static void devices_that_do_not_exist(void **state) {
  (void)state;
  static const int bad[] = {-1, 64, 99, 1 << 20};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    tide_clear_error();
    assert_null(tide_device(bad[i]));
    tu_assert_last_error(TIDE_ERR_INVALID, "does not exist");
  }
  tide_config *c = tu_config(NULL);
  tide_allocator *a = NULL;
  expect_message(tide_create(-1, c, &a), TIDE_ERR_INVALID, "does not exist");
  tide_config_free(c);
}

/* 3 blocks left on 2 devices: both devices and all 3 blocks are told. */
static void shutdown_names_every_device(void **state) {
  (void)state;
  tu_assert_ok(tide_config_process_set("backend:host,host_devices:2,page_size_mb:2"));
  tide_allocator *d0 = tide_device(0), *d1 = tide_device(1);
  assert_non_null(d0);
  assert_non_null(d1);
  assert_non_null(tide_malloc(d0, 1024, NULL));
  assert_non_null(tide_malloc(d0, 4096, NULL));
  assert_non_null(tide_malloc(d1, 1024, NULL));
  tide_status rc = tide_shutdown();
  assert_int_equal(rc, TIDE_ERR_STATE);
  const char *m = tide_last_error();
  if (!strstr(m, "device 0: ") || !strstr(m, "with 2 block(s)") || !strstr(m, "device 1: ") ||
      !strstr(m, "with 1 block(s)"))
    fail_msg("tide_shutdown: \"%s\"", m);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(orphan_not_recorded_is_reported),
      cmocka_unit_test(teardown_refusals_are_reported),
      cmocka_unit_test(import_close_after_refused_unmap),
      cmocka_unit_test(torch_alloc_of_no_bytes_says_why),
      cmocka_unit_test(resize_on_unknown_stream_names_the_stream),
      cmocka_unit_test(devices_that_do_not_exist),
      cmocka_unit_test(shutdown_names_every_device), /* last */
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
