/* test_backend_host.c: the host backend on its own: physical memory, address
 * space and mappings with the CUDA driver's preconditions, streams and events
 * with hold/release, fault injection and call counts, sparse memory, and
 * concurrent use from several threads. */
#include <dirent.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "backend/backend.h"
#include "base/internal.h"

#define GRAN ((size_t)2 << 20)

typedef struct fixture {
  _tide_backend b;
  const _tide_backend_ops *ops;
  void *ctx;
} fixture;

static _tide_conf_values conf_of(size_t capacity, size_t granularity, int devices) {
  _tide_conf_values conf;
  memset(&conf, 0, sizeof conf);
  conf.host_capacity = capacity;
  conf.host_granularity = granularity;
  conf.host_devices = devices;
  return conf;
}

static void open_device(fixture *f, size_t capacity) {
  _tide_conf_values conf = conf_of(capacity, GRAN, 1);
  assert_int_equal(_tide_host_open(&conf, 0, &f->b), TIDE_OK);
  assert_non_null(f->b.ops);
  assert_int_equal(f->b.is_host, 1);
  f->ops = f->b.ops;
  f->ctx = f->b.ctx;
}

static void close_device(fixture *f) { f->ops->destroy(f->ctx); }

static bool error_contains(const char *text) { return strstr(tide_last_error(), text) != NULL; }

/* A reservation of `pages` granules. */
static uintptr_t reserve_pages(fixture *f, size_t pages) {
  uintptr_t addr = 0;
  assert_int_equal(f->ops->reserve(f->ctx, pages * GRAN, 0, &addr), TIDE_OK);
  assert_true(addr != 0);
  assert_int_equal(addr % GRAN, 0);
  return addr;
}

static _tide_handle create_pages(fixture *f, size_t pages) {
  _tide_handle h = 0;
  assert_int_equal(f->ops->create(f->ctx, pages * GRAN, &h), TIDE_OK);
  assert_true(h != 0);
  return h;
}

/* Map a handle of `pages` granules at addr and make it accessible. */
static void map_rw(fixture *f, uintptr_t addr, size_t pages, _tide_handle h) {
  assert_int_equal(f->ops->map(f->ctx, addr, pages * GRAN, h), TIDE_OK);
  assert_int_equal(f->ops->set_access(f->ctx, addr, pages * GRAN), TIDE_OK);
}

/* Write seed + i to every `stride`-th word (i the word's index), and check it. */
static void fill_sparse(uintptr_t addr, size_t bytes, uint64_t seed, size_t stride) {
  uint64_t *p = (uint64_t *)addr;
  for (size_t i = 0; i < bytes / sizeof *p; i += stride) p[i] = seed + i;
}

static bool holds_sparse(uintptr_t addr, size_t bytes, uint64_t seed, size_t stride) {
  const uint64_t *p = (const uint64_t *)addr;
  for (size_t i = 0; i < bytes / sizeof *p; i += stride)
    if (p[i] != seed + i) return false;
  return true;
}

/* A word in every 4 KiB page, at a different place in each. */
static void fill(uintptr_t addr, size_t bytes, uint64_t seed) {
  fill_sparse(addr, bytes, seed, 511);
}

static bool holds(uintptr_t addr, size_t bytes, uint64_t seed) {
  return holds_sparse(addr, bytes, seed, 511);
}

/* ------------------------------------------------------------------------ */

static void test_op_names(void **state) {
  (void)state;
  assert_string_equal(tide_backend_op_name(TIDE_OP_ANY), "any");
  assert_string_equal(tide_backend_op_name(TIDE_OP_RESERVE), "reserve");
  assert_string_equal(tide_backend_op_name(TIDE_OP_MAP), "map");
  assert_string_equal(tide_backend_op_name(TIDE_OP_SET_ACCESS), "set_access");
  assert_string_equal(tide_backend_op_name(TIDE_OP_EVENT_SYNCHRONIZE), "event_synchronize");
  assert_string_equal(tide_backend_op_name(TIDE_OP_MEM_INFO), "mem_info");
  assert_string_equal(tide_backend_op_name(TIDE_OP_DEVICE_SYNCHRONIZE), "device_synchronize");
  assert_string_equal(tide_backend_op_name(TIDE_OP_COUNT), "unknown");
  assert_string_equal(tide_backend_op_name((tide_backend_op)-1), "unknown");
  for (int op = 0; op < TIDE_OP_COUNT; op++) {
    assert_non_null(tide_backend_op_name((tide_backend_op)op));
    assert_string_not_equal(tide_backend_op_name((tide_backend_op)op), "unknown");
  }
}

static void test_open_validates_conf(void **state) {
  (void)state;
  _tide_backend b;
  memset(&b, 0, sizeof b);
  _tide_conf_values conf = conf_of(64 * GRAN, 3 << 20, 1);
  assert_int_equal(_tide_host_open(&conf, 0, &b), TIDE_ERR_CONFIG);
  assert_true(error_contains("host_granularity"));
  assert_null(b.ops);

  conf = conf_of(64 * GRAN, 1024, 1);
  assert_int_equal(_tide_host_open(&conf, 0, &b), TIDE_ERR_CONFIG);
  assert_true(error_contains("page size"));

  conf = conf_of(64 * GRAN + 4096, GRAN, 1);
  assert_int_equal(_tide_host_open(&conf, 0, &b), TIDE_ERR_CONFIG);
  assert_true(error_contains("host_capacity"));

  conf = conf_of(64 * GRAN, GRAN, 0);
  assert_int_equal(_tide_host_open(&conf, 0, &b), TIDE_ERR_CONFIG);
  assert_true(error_contains("host_devices"));

  conf = conf_of(64 * GRAN, GRAN, 2);
  assert_int_equal(_tide_host_open(&conf, 2, &b), TIDE_ERR_INVALID);
  assert_true(error_contains("device 2"));
  assert_int_equal(_tide_host_open(&conf, -1, &b), TIDE_ERR_INVALID);
  assert_int_equal(_tide_host_open(NULL, 0, &b), TIDE_ERR_INVALID);
  assert_null(b.ops);

  /* The second of two devices, with a small (page-sized) granularity. */
  conf = conf_of(64 * 4096, 4096, 2);
  assert_int_equal(_tide_host_open(&conf, 1, &b), TIDE_OK);
  int count = 0;
  size_t gran = 0, free_bytes = 0, total = 0;
  char name[64];
  assert_int_equal(b.ops->device_count(b.ctx, &count), TIDE_OK);
  assert_int_equal(count, 2);
  assert_int_equal(b.ops->device_name(b.ctx, name, sizeof name), TIDE_OK);
  assert_string_equal(name, "tidalloc emulated device 1");
  assert_int_equal(b.ops->granularity(b.ctx, &gran), TIDE_OK);
  assert_int_equal(gran, 4096);
  assert_int_equal(b.ops->mem_info(b.ctx, &free_bytes, &total), TIDE_OK);
  assert_int_equal(total, 64 * 4096);
  assert_int_equal(free_bytes, 64 * 4096);
  assert_string_equal(b.ops->name, "host");
  b.ops->destroy(b.ctx);
}

/* The default capacity (auto) follows the machine: each emulated device is
 * at most half the memory behind it, divided among the devices, so that a
 * program filling it gets TIDE_ERR_OOM instead of being killed by the
 * kernel. An explicit capacity is honoured whatever the machine. */
static void test_auto_capacity_follows_the_machine(void **state) {
  (void)state;
  uint64_t physical = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE);
  uint64_t machine = _tide_machine_memory();
  assert_true(machine > 0 && machine <= physical);
  for (int devices = 1; devices <= 4; devices *= 2) {
    _tide_conf_values conf = conf_of(0, GRAN, devices);
    size_t capacity = _tide_host_capacity(&conf);
    assert_true(capacity > 0 && capacity % GRAN == 0);
    if (machine / 2 / (uint64_t)devices >= GRAN)
      assert_true(capacity <= machine / 2 / (uint64_t)devices);
    for (int device = 0; device < devices; device++) {
      _tide_backend b;
      memset(&b, 0, sizeof b);
      assert_int_equal(_tide_host_open(&conf, device, &b), TIDE_OK);
      size_t free_bytes = 0, total = 0;
      assert_int_equal(b.ops->mem_info(b.ctx, &free_bytes, &total), TIDE_OK);
      assert_int_equal(total, capacity);
      b.ops->destroy(b.ctx);
    }
  }

  /* Through the public API: the default config says auto, and an
   * allocator's device has the derived size. */
  tide_config *config = NULL;
  assert_int_equal(tide_config_new(&config), TIDE_OK);
  char text[32];
  assert_int_equal(tide_config_get(config, "host_capacity", text, sizeof text), TIDE_OK);
  assert_string_equal(text, "auto");
  assert_int_equal(tide_config_parse(config, "backend:host"), TIDE_OK);
  tide_allocator *a = NULL;
  tide_info info;
  assert_int_equal(tide_create(0, config, &a), TIDE_OK);
  assert_int_equal(tide_get_info(a, &info), TIDE_OK);
  assert_true(info.total_memory <= machine / 2 || info.total_memory == GRAN);
  assert_int_equal(tide_destroy(a), TIDE_OK);

  /* Larger than the machine when asked for: the memory is sparse, and a
   * program that writes less than the machine holds may want the room. */
  uint64_t big = (machine / TIDE_GiB + 8) * TIDE_GiB;
  char conf_text[64];
  snprintf(conf_text, sizeof conf_text, "host_capacity:%lluGiB",
           (unsigned long long)(big / TIDE_GiB));
  assert_int_equal(tide_config_parse(config, conf_text), TIDE_OK);
  assert_int_equal(tide_create(0, config, &a), TIDE_OK);
  assert_int_equal(tide_get_info(a, &info), TIDE_OK);
  assert_int_equal(info.total_memory, big);
  assert_int_equal(tide_destroy(a), TIDE_OK);
  /* And back to auto. */
  assert_int_equal(tide_config_parse(config, "host_capacity:auto"), TIDE_OK);
  assert_int_equal(tide_config_get(config, "host_capacity", text, sizeof text), TIDE_OK);
  assert_string_equal(text, "auto");
  tide_config_free(config);
}

static void test_controls_refuse_other_backends(void **state) {
  (void)state;
  _tide_backend other;
  memset(&other, 0, sizeof other);
  assert_int_equal(_tide_host_stream_hold(&other, NULL), TIDE_ERR_INVALID);
  assert_int_equal(_tide_host_stream_release(&other, NULL), TIDE_ERR_INVALID);
  assert_int_equal(_tide_host_fail_call(&other, TIDE_OP_MAP, 1), TIDE_ERR_INVALID);
  assert_int_equal(_tide_host_call_count(&other, TIDE_OP_ANY), 0);
  assert_int_equal(_tide_host_bytes_in_use(&other), 0);
  assert_int_equal(_tide_host_fail_call(NULL, TIDE_OP_MAP, 1), TIDE_ERR_INVALID);

  fixture f;
  open_device(&f, 8 * GRAN);
  assert_int_equal(_tide_host_fail_call(&f.b, TIDE_OP_COUNT, 1), TIDE_ERR_INVALID);
  close_device(&f);
}

/* unmap_run ends several adjacent mappings with one call; a run with a gap,
 * part of a mapping or mappings of another size is refused whole. */
static void test_unmap_run(void **state) {
  (void)state;
  fixture f;
  open_device(&f, 16 * GRAN);
  uintptr_t base = reserve_pages(&f, 8);
  _tide_handle h[4];
  for (int i = 0; i < 4; i++) {
    h[i] = create_pages(&f, 1);
    map_rw(&f, base + (size_t)i * GRAN, 1, h[i]);
  }
  _tide_handle wide = create_pages(&f, 2);
  map_rw(&f, base + 5 * GRAN, 2, wide);
  size_t done = 99;
  uint64_t calls = _tide_host_call_count(&f.b, TIDE_OP_UNMAP);
  /* A gap (page 4 is not mapped), and a mapping of two pages. */
  assert_int_equal(f.ops->unmap_run(f.ctx, base + 3 * GRAN, GRAN, 3, &done), TIDE_ERR_BACKEND);
  assert_int_equal(done, 0);
  assert_true(error_contains("is not 3 earlier mappings"));
  assert_int_equal(f.ops->unmap_run(f.ctx, base + 5 * GRAN, GRAN, 2, &done), TIDE_ERR_BACKEND);
  assert_int_equal(_tide_host_mappings(&f.b), 5);
  fill(base, 4 * GRAN, 5); /* all still mapped */
  /* Pages 1..3 in one call; page 0 stays. */
  assert_int_equal(f.ops->unmap_run(f.ctx, base + GRAN, GRAN, 3, &done), TIDE_OK);
  assert_int_equal(done, 3);
  assert_int_equal(_tide_host_call_count(&f.b, TIDE_OP_UNMAP), calls + 3);
  assert_int_equal(_tide_host_mappings(&f.b), 2);
  assert_true(holds(base, GRAN, 5));
  /* The range can be mapped again; an injected failure unmaps nothing. */
  map_rw(&f, base + GRAN, 1, h[1]);
  assert_int_equal(_tide_host_fail_call(&f.b, TIDE_OP_UNMAP, 1), TIDE_OK);
  assert_int_equal(f.ops->unmap_run(f.ctx, base, GRAN, 2, &done), TIDE_ERR_BACKEND);
  assert_int_equal(done, 0);
  assert_int_equal(_tide_host_mappings(&f.b), 3);
  assert_int_equal(f.ops->unmap_run(f.ctx, base, GRAN, 2, &done), TIDE_OK);
  assert_int_equal(f.ops->unmap_run(f.ctx, base + 5 * GRAN, 2 * GRAN, 1, &done), TIDE_OK);
  assert_int_equal(f.ops->unmap_run(f.ctx, base, GRAN, 0, &done), TIDE_OK);
  assert_int_equal(done, 0);
  assert_int_equal(_tide_host_mappings(&f.b), 0);
  for (int i = 0; i < 4; i++) assert_int_equal(f.ops->release(f.ctx, h[i]), TIDE_OK);
  assert_int_equal(f.ops->release(f.ctx, wide), TIDE_OK);
  assert_int_equal(_tide_host_bytes_in_use(&f.b), 0);
  assert_int_equal(f.ops->unreserve(f.ctx, base, 8 * GRAN), TIDE_OK);
  close_device(&f);
}

static void test_map_write_read(void **state) {
  (void)state;
  fixture f;
  open_device(&f, 16 * GRAN);
  uintptr_t base = reserve_pages(&f, 4);
  _tide_handle h = create_pages(&f, 2);
  assert_int_equal(_tide_host_bytes_in_use(&f.b), 2 * GRAN);

  map_rw(&f, base + GRAN, 2, h);
  fill(base + GRAN, 2 * GRAN, 42);
  assert_true(holds(base + GRAN, 2 * GRAN, 42));
  /* The last byte of the mapping is writable too. */
  ((volatile char *)(base + 3 * GRAN))[-1] = 7;
  assert_int_equal(((volatile char *)(base + 3 * GRAN))[-1], 7);

  size_t free_bytes = 0, total = 0;
  assert_int_equal(f.ops->mem_info(f.ctx, &free_bytes, &total), TIDE_OK);
  assert_int_equal(total, 16 * GRAN);
  assert_int_equal(free_bytes, 14 * GRAN);

  assert_int_equal(f.ops->unmap(f.ctx, base + GRAN, 2 * GRAN), TIDE_OK);
  assert_int_equal(f.ops->release(f.ctx, h), TIDE_OK);
  assert_int_equal(_tide_host_bytes_in_use(&f.b), 0);
  assert_int_equal(f.ops->unreserve(f.ctx, base, 4 * GRAN), TIDE_OK);
  close_device(&f);
}

static void test_reserve_alignment(void **state) {
  (void)state;
  fixture f;
  open_device(&f, 16 * GRAN);
  uintptr_t a = 0, b = 0;
  assert_int_equal(f.ops->reserve(f.ctx, 3 * GRAN, 64 * GRAN, &a), TIDE_OK);
  assert_int_equal(a % (64 * GRAN), 0);
  assert_int_equal(f.ops->reserve(f.ctx, GRAN, 3 * GRAN, &b), TIDE_OK);
  assert_int_equal(b % (3 * GRAN), 0);
  /* The whole reservation can be mapped. */
  _tide_handle h = create_pages(&f, 3);
  map_rw(&f, a, 3, h);
  fill(a, 3 * GRAN, 5);
  assert_true(holds(a, 3 * GRAN, 5));
  assert_int_equal(f.ops->unmap(f.ctx, a, 3 * GRAN), TIDE_OK);
  assert_int_equal(f.ops->release(f.ctx, h), TIDE_OK);
  assert_int_equal(f.ops->unreserve(f.ctx, a, 3 * GRAN), TIDE_OK);
  assert_int_equal(f.ops->unreserve(f.ctx, b, GRAN), TIDE_OK);
  close_device(&f);
}

static void test_two_views_share_bytes(void **state) {
  (void)state;
  fixture f;
  open_device(&f, 16 * GRAN);
  /* A ring: the same pages twice in a row. */
  uintptr_t ring = reserve_pages(&f, 4);
  _tide_handle h = create_pages(&f, 2);
  map_rw(&f, ring, 2, h);
  map_rw(&f, ring + 2 * GRAN, 2, h);
  assert_int_equal(_tide_host_bytes_in_use(&f.b), 2 * GRAN);

  fill(ring, 2 * GRAN, 1000);
  assert_true(holds(ring + 2 * GRAN, 2 * GRAN, 1000));
  fill(ring + 2 * GRAN, 2 * GRAN, 77);
  assert_true(holds(ring, 2 * GRAN, 77));
  /* A write that runs past the end of the first view lands at the start of
   * the second: the window stays contiguous. */
  memset((void *)(ring + 2 * GRAN - 8), 0x5a, 16);
  assert_int_equal(*(volatile uint64_t *)(ring + 8), 0);
  assert_int_equal(*(volatile uint8_t *)ring, 0x5a);
  assert_int_equal(*(volatile uint8_t *)(ring + 4 * GRAN - 1), 0x5a);

  /* Unmapping one view leaves the other intact. */
  assert_int_equal(f.ops->unmap(f.ctx, ring, 2 * GRAN), TIDE_OK);
  assert_int_equal(*(volatile uint8_t *)(ring + 2 * GRAN), 0x5a);
  assert_int_equal(f.ops->unmap(f.ctx, ring + 2 * GRAN, 2 * GRAN), TIDE_OK);
  assert_int_equal(f.ops->release(f.ctx, h), TIDE_OK);
  assert_int_equal(_tide_host_bytes_in_use(&f.b), 0);
  assert_int_equal(f.ops->unreserve(f.ctx, ring, 4 * GRAN), TIDE_OK);
  close_device(&f);
}

static void test_capacity_exhaustion(void **state) {
  (void)state;
  fixture f;
  open_device(&f, 8 * GRAN);
  _tide_handle a = create_pages(&f, 5);
  uintptr_t base = reserve_pages(&f, 5);
  map_rw(&f, base, 5, a);
  fill(base, 5 * GRAN, 9);

  _tide_handle h = 0;
  assert_int_equal(f.ops->create(f.ctx, 4 * GRAN, &h), TIDE_ERR_OOM);
  assert_int_equal(h, 0);
  assert_true(error_contains("asked for 8.00 MiB"));
  assert_true(error_contains("10.00 MiB of 16.00 MiB in use"));
  assert_int_equal(f.ops->create(f.ctx, 100 * GRAN, &h), TIDE_ERR_OOM);
  /* Nothing was freed or disturbed. */
  assert_int_equal(_tide_host_bytes_in_use(&f.b), 5 * GRAN);
  assert_true(holds(base, 5 * GRAN, 9));

  /* The rest fits exactly; then nothing does. */
  _tide_handle b = create_pages(&f, 1), c = create_pages(&f, 1), d = create_pages(&f, 1);
  assert_int_equal(f.ops->create(f.ctx, GRAN, &h), TIDE_ERR_OOM);
  size_t free_bytes = 1, total = 0;
  assert_int_equal(f.ops->mem_info(f.ctx, &free_bytes, &total), TIDE_OK);
  assert_int_equal(free_bytes, 0);

  /* Two free units that are not neighbours make no room for two. */
  assert_int_equal(f.ops->release(f.ctx, b), TIDE_OK);
  assert_int_equal(f.ops->release(f.ctx, d), TIDE_OK);
  assert_int_equal(f.ops->create(f.ctx, 2 * GRAN, &h), TIDE_ERR_OOM);
  assert_true(error_contains("not in one piece"));
  assert_int_equal(f.ops->release(f.ctx, c), TIDE_OK);
  h = create_pages(&f, 3);
  assert_int_equal(_tide_host_bytes_in_use(&f.b), 8 * GRAN);
  assert_true(holds(base, 5 * GRAN, 9));

  assert_int_equal(f.ops->release(f.ctx, h), TIDE_OK);
  assert_int_equal(f.ops->unmap(f.ctx, base, 5 * GRAN), TIDE_OK);
  assert_int_equal(f.ops->release(f.ctx, a), TIDE_OK);
  assert_int_equal(_tide_host_bytes_in_use(&f.b), 0);
  assert_int_equal(f.ops->unreserve(f.ctx, base, 5 * GRAN), TIDE_OK);
  /* The whole capacity is one piece again. */
  h = create_pages(&f, 8);
  assert_int_equal(f.ops->release(f.ctx, h), TIDE_OK);
  close_device(&f);
}

/* Runs of free units that cross 64-unit words: the holes left are exactly
 * the ones first fit should leave. */
static void test_first_fit_across_words(void **state) {
  (void)state;
  fixture f;
  open_device(&f, 200 * GRAN);
  /* A free run that starts on a word boundary, after a full word. */
  _tide_handle x = create_pages(&f, 64), y = create_pages(&f, 64);
  assert_int_equal(f.ops->release(f.ctx, y), TIDE_OK);
  _tide_handle z = create_pages(&f, 10);
  uintptr_t view = reserve_pages(&f, 74);
  map_rw(&f, view, 64, x);
  map_rw(&f, view + 64 * GRAN, 10, z);
  fill(view, 64 * GRAN, 1);
  fill(view + 64 * GRAN, 10 * GRAN, 2);
  assert_true(holds(view, 64 * GRAN, 1));
  assert_true(holds(view + 64 * GRAN, 10 * GRAN, 2));
  assert_int_equal(f.ops->unmap(f.ctx, view, 64 * GRAN), TIDE_OK);
  assert_int_equal(f.ops->unmap(f.ctx, view + 64 * GRAN, 10 * GRAN), TIDE_OK);
  assert_int_equal(f.ops->unreserve(f.ctx, view, 74 * GRAN), TIDE_OK);
  assert_int_equal(f.ops->release(f.ctx, x), TIDE_OK);
  /* Units 64..73 are taken, so 126 fit only after them. */
  _tide_handle w = 0;
  assert_int_equal(f.ops->create(f.ctx, 127 * GRAN, &w), TIDE_ERR_OOM);
  w = create_pages(&f, 126);
  assert_int_equal(f.ops->release(f.ctx, w), TIDE_OK);
  assert_int_equal(f.ops->release(f.ctx, z), TIDE_OK);

  _tide_handle a = create_pages(&f, 70), b = create_pages(&f, 1), c = create_pages(&f, 60);
  assert_int_equal(f.ops->release(f.ctx, a), TIDE_OK);
  /* Units 0..69 are free: 65 go there (first fit), 10 go after unit 130. */
  _tide_handle d = create_pages(&f, 65), e = create_pages(&f, 10);
  /* Left: 65..69 (5 units) and 141..199 (59 units). */
  _tide_handle h = 0;
  assert_int_equal(f.ops->create(f.ctx, 60 * GRAN, &h), TIDE_ERR_OOM);
  assert_true(error_contains("largest contiguous free range 118.00 MiB"));
  _tide_handle g = create_pages(&f, 59);
  assert_int_equal(f.ops->create(f.ctx, 6 * GRAN, &h), TIDE_ERR_OOM);
  _tide_handle k = create_pages(&f, 5);
  assert_int_equal(f.ops->create(f.ctx, GRAN, &h), TIDE_ERR_OOM);
  assert_int_equal(_tide_host_bytes_in_use(&f.b), 200 * GRAN);
  const _tide_handle all[] = {b, c, d, e, g, k};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
    assert_int_equal(f.ops->release(f.ctx, all[i]), TIDE_OK);
  assert_int_equal(_tide_host_bytes_in_use(&f.b), 0);
  h = create_pages(&f, 200);
  assert_int_equal(f.ops->release(f.ctx, h), TIDE_OK);
  close_device(&f);
}

static void test_release_while_mapped(void **state) {
  (void)state;
  fixture f;
  open_device(&f, 8 * GRAN);
  uintptr_t base = reserve_pages(&f, 4);
  _tide_handle h = create_pages(&f, 2);
  map_rw(&f, base, 2, h);
  map_rw(&f, base + 2 * GRAN, 2, h);
  fill(base, 2 * GRAN, 31);

  assert_int_equal(f.ops->release(f.ctx, h), TIDE_OK);
  assert_int_equal(_tide_host_bytes_in_use(&f.b), 2 * GRAN);
  assert_true(holds(base, 2 * GRAN, 31));
  /* The handle is gone for everything else. */
  assert_int_equal(f.ops->release(f.ctx, h), TIDE_ERR_BACKEND);
  assert_true(error_contains("already released"));
  uintptr_t other = reserve_pages(&f, 2);
  assert_int_equal(f.ops->map(f.ctx, other, 2 * GRAN, h), TIDE_ERR_BACKEND);

  /* Its units are not handed out while it is mapped. */
  _tide_handle g = create_pages(&f, 6), x = 0;
  assert_int_equal(f.ops->create(f.ctx, GRAN, &x), TIDE_ERR_OOM);
  assert_int_equal(f.ops->release(f.ctx, g), TIDE_OK);

  assert_int_equal(f.ops->unmap(f.ctx, base, 2 * GRAN), TIDE_OK);
  assert_int_equal(_tide_host_bytes_in_use(&f.b), 2 * GRAN);
  assert_true(holds(base + 2 * GRAN, 2 * GRAN, 31));
  assert_int_equal(f.ops->unmap(f.ctx, base + 2 * GRAN, 2 * GRAN), TIDE_OK);
  assert_int_equal(_tide_host_bytes_in_use(&f.b), 0);
  size_t free_bytes = 0, total = 0;
  assert_int_equal(f.ops->mem_info(f.ctx, &free_bytes, &total), TIDE_OK);
  assert_int_equal(free_bytes, total);

  /* The stale handle stays invalid even when its slot is reused. */
  _tide_handle all = create_pages(&f, 8);
  assert_true(all != h);
  assert_int_equal(f.ops->release(f.ctx, h), TIDE_ERR_BACKEND);
  assert_int_equal(f.ops->release(f.ctx, all), TIDE_OK);
  assert_int_equal(f.ops->unreserve(f.ctx, base, 4 * GRAN), TIDE_OK);
  assert_int_equal(f.ops->unreserve(f.ctx, other, 2 * GRAN), TIDE_OK);
  close_device(&f);
}

static void test_preconditions(void **state) {
  (void)state;
  fixture f;
  open_device(&f, 16 * GRAN);
  const _tide_backend_ops *o = f.ops;
  void *c = f.ctx;
  uintptr_t addr = 0;
  _tide_handle h = 0;

  /* reserve */
  assert_int_equal(o->reserve(c, 0, 0, &addr), TIDE_ERR_BACKEND);
  assert_int_equal(o->reserve(c, GRAN + 4096, 0, &addr), TIDE_ERR_BACKEND);
  assert_true(error_contains("granularity"));
  assert_int_equal(o->reserve(c, GRAN, GRAN / 2, &addr), TIDE_ERR_BACKEND);
  assert_int_equal(o->reserve(c, GRAN, 0, NULL), TIDE_ERR_INVALID);
  assert_int_equal(addr, 0);
  uintptr_t r1 = reserve_pages(&f, 4), r2 = reserve_pages(&f, 4);

  /* create and release */
  assert_int_equal(o->create(c, 0, &h), TIDE_ERR_BACKEND);
  assert_int_equal(o->create(c, GRAN / 2, &h), TIDE_ERR_BACKEND);
  assert_int_equal(o->create(c, GRAN, NULL), TIDE_ERR_INVALID);
  assert_int_equal(h, 0);
  assert_int_equal(_tide_host_bytes_in_use(&f.b), 0);
  assert_int_equal(o->release(c, 0), TIDE_ERR_BACKEND);
  assert_int_equal(o->release(c, 12345), TIDE_ERR_BACKEND);
  assert_true(error_contains("unknown handle"));
  _tide_handle one = create_pages(&f, 1), two = create_pages(&f, 2);
  assert_int_equal(o->release(c, one + ((uint64_t)7 << 32)), TIDE_ERR_BACKEND);

  /* map */
  assert_int_equal(o->map(c, r1 + 4096, GRAN, one), TIDE_ERR_BACKEND);
  assert_true(error_contains("granularity"));
  assert_int_equal(o->map(c, r1, 2 * GRAN, one), TIDE_ERR_BACKEND);
  assert_true(error_contains("handle's size"));
  assert_int_equal(o->map(c, r1, GRAN, two), TIDE_ERR_BACKEND);
  assert_int_equal(o->map(c, r1, 0, one), TIDE_ERR_BACKEND);
  assert_int_equal(o->map(c, r1, GRAN, 999), TIDE_ERR_BACKEND);
  /* Outside any reservation, past the end of one, and straddling two. */
  uintptr_t outside = (r1 < r2 ? r2 : r1) + 64 * GRAN;
  assert_int_equal(o->map(c, outside, GRAN, one), TIDE_ERR_BACKEND);
  assert_true(error_contains("reserved range"));
  assert_int_equal(o->map(c, r1 + 3 * GRAN, 2 * GRAN, two), TIDE_ERR_BACKEND);
  assert_int_equal(o->map(c, r2 + 3 * GRAN, 2 * GRAN, two), TIDE_ERR_BACKEND);
  /* Over an existing mapping, wholly or in part. */
  assert_int_equal(o->map(c, r1 + GRAN, 2 * GRAN, two), TIDE_OK);
  assert_int_equal(o->map(c, r1 + 2 * GRAN, GRAN, one), TIDE_ERR_BACKEND);
  assert_true(error_contains("overlaps"));
  assert_int_equal(o->map(c, r1, 2 * GRAN, two), TIDE_ERR_BACKEND);
  assert_int_equal(o->map(c, r1 + 2 * GRAN, 2 * GRAN, two), TIDE_ERR_BACKEND);

  /* set_access: only over mapped memory, aligned. */
  assert_int_equal(o->set_access(c, r1, 2 * GRAN), TIDE_ERR_BACKEND);
  assert_true(error_contains("not fully mapped"));
  assert_int_equal(o->set_access(c, r1 + GRAN, 3 * GRAN), TIDE_ERR_BACKEND);
  assert_int_equal(o->set_access(c, r1 + GRAN, GRAN + 4096), TIDE_ERR_BACKEND);
  assert_int_equal(o->set_access(c, r1 + GRAN, 0), TIDE_ERR_BACKEND);
  assert_int_equal(o->set_access(c, outside, GRAN), TIDE_ERR_BACKEND);
  /* Spanning two adjacent mappings is fine, and part of one is too. */
  assert_int_equal(o->map(c, r1 + 3 * GRAN, GRAN, one), TIDE_OK);
  assert_int_equal(o->set_access(c, r1 + GRAN, 3 * GRAN), TIDE_OK);
  assert_int_equal(o->set_access(c, r1 + 2 * GRAN, GRAN), TIDE_OK);
  fill(r1 + GRAN, 3 * GRAN, 3);
  assert_true(holds(r1 + GRAN, 3 * GRAN, 3));

  /* unmap: exactly one earlier mapping. */
  assert_int_equal(o->unmap(c, r1 + GRAN, GRAN), TIDE_ERR_BACKEND);
  assert_true(error_contains("exactly one"));
  assert_int_equal(o->unmap(c, r1 + 2 * GRAN, GRAN), TIDE_ERR_BACKEND);
  assert_int_equal(o->unmap(c, r1 + GRAN, 3 * GRAN), TIDE_ERR_BACKEND);
  assert_int_equal(o->unmap(c, r1, GRAN), TIDE_ERR_BACKEND);
  assert_int_equal(o->unmap(c, r1, 4 * GRAN), TIDE_ERR_BACKEND);
  assert_true(holds(r1 + GRAN, 3 * GRAN, 3));

  /* unreserve: a whole range with nothing mapped. */
  assert_int_equal(o->unreserve(c, r1, 4 * GRAN), TIDE_ERR_BACKEND);
  assert_true(error_contains("still has memory mapped"));
  assert_int_equal(o->unreserve(c, r2, 2 * GRAN), TIDE_ERR_BACKEND);
  assert_int_equal(o->unreserve(c, r2 + GRAN, 3 * GRAN), TIDE_ERR_BACKEND);
  assert_int_equal(o->unreserve(c, outside, GRAN), TIDE_ERR_BACKEND);

  /* After all of that, everything still works and comes apart cleanly. */
  assert_true(holds(r1 + GRAN, 3 * GRAN, 3));
  assert_int_equal(o->unmap(c, r1 + 3 * GRAN, GRAN), TIDE_OK);
  assert_int_equal(o->unmap(c, r1 + GRAN, 2 * GRAN), TIDE_OK);
  /* Unmapped memory is reserved again, not gone: it can be mapped anew. */
  assert_int_equal(o->unmap(c, r1 + GRAN, 2 * GRAN), TIDE_ERR_BACKEND);
  /* The handle's bytes survive unmapping: map it elsewhere and read them. */
  map_rw(&f, r1, 2, two);
  assert_true(holds(r1, 2 * GRAN, 3));
  assert_int_equal(o->unmap(c, r1, 2 * GRAN), TIDE_OK);
  assert_int_equal(o->release(c, one), TIDE_OK);
  assert_int_equal(o->release(c, two), TIDE_OK);
  assert_int_equal(_tide_host_bytes_in_use(&f.b), 0);
  assert_int_equal(o->unreserve(c, r1, 4 * GRAN), TIDE_OK);
  assert_int_equal(o->unreserve(c, r2, 4 * GRAN), TIDE_OK);
  assert_int_equal(o->unreserve(c, r2, 4 * GRAN), TIDE_ERR_BACKEND);
  close_device(&f);
}

static void test_streams_and_events(void **state) {
  (void)state;
  fixture f;
  open_device(&f, 8 * GRAN);
  const _tide_backend_ops *o = f.ops;
  void *c = f.ctx;

  tide_stream s1 = NULL, s2 = NULL;
  assert_int_equal(o->stream_synchronize(c, NULL), TIDE_OK);
  assert_int_equal(o->stream_create(c, &s1), TIDE_OK);
  assert_int_equal(o->stream_create(c, &s2), TIDE_OK);
  assert_non_null(s1);
  assert_non_null(s2);
  assert_true(s1 != s2);

  _tide_event e1 = NULL, e2 = NULL, fresh = NULL;
  assert_int_equal(o->event_create(c, &e1), TIDE_OK);
  assert_int_equal(o->event_create(c, &e2), TIDE_OK);
  assert_int_equal(o->event_create(c, &fresh), TIDE_OK);
  assert_non_null(e1);
  assert_true(e1 != e2);
  /* An event never recorded counts as complete, as on CUDA. */
  assert_int_equal(o->event_query(c, fresh), TIDE_OK);
  assert_int_equal(o->event_synchronize(c, fresh), TIDE_OK);

  /* Unheld streams complete at once. */
  assert_int_equal(o->event_record(c, e1, s1), TIDE_OK);
  assert_int_equal(o->event_query(c, e1), TIDE_OK);

  /* A held stream keeps what is recorded after the hold pending... */
  assert_int_equal(_tide_host_stream_hold(&f.b, s1), TIDE_OK);
  assert_int_equal(o->event_query(c, e1), TIDE_OK);
  assert_int_equal(o->event_record(c, e1, s1), TIDE_OK);
  assert_int_equal(o->event_query(c, e1), TIDE_ERR_NOT_READY);
  assert_int_equal(o->event_synchronize(c, e1), TIDE_ERR_NOT_READY);
  assert_true(error_contains("held"));
  assert_int_equal(o->stream_synchronize(c, s1), TIDE_ERR_NOT_READY);
  assert_true(error_contains("held"));
  /* ...while other streams run on. */
  assert_int_equal(o->event_record(c, e2, s2), TIDE_OK);
  assert_int_equal(o->event_query(c, e2), TIDE_OK);
  assert_int_equal(o->stream_synchronize(c, s2), TIDE_OK);
  /* Recording the pending event again on a free stream moves it there. */
  assert_int_equal(o->event_record(c, e2, s1), TIDE_OK);
  assert_int_equal(o->event_query(c, e2), TIDE_ERR_NOT_READY);
  assert_int_equal(o->event_record(c, e2, s2), TIDE_OK);
  assert_int_equal(o->event_query(c, e2), TIDE_OK);

  /* Release completes everything recorded so far and un-holds. */
  assert_int_equal(_tide_host_stream_release(&f.b, s1), TIDE_OK);
  assert_int_equal(o->event_query(c, e1), TIDE_OK);
  assert_int_equal(o->event_synchronize(c, e1), TIDE_OK);
  assert_int_equal(o->stream_synchronize(c, s1), TIDE_OK);
  assert_int_equal(o->event_record(c, e1, s1), TIDE_OK);
  assert_int_equal(o->event_query(c, e1), TIDE_OK);
  /* Releasing a stream that is not held changes nothing. */
  assert_int_equal(_tide_host_stream_release(&f.b, s2), TIDE_OK);

  /* The default stream can be held too. */
  assert_int_equal(_tide_host_stream_hold(&f.b, NULL), TIDE_OK);
  assert_int_equal(o->event_record(c, e2, NULL), TIDE_OK);
  assert_int_equal(o->event_query(c, e2), TIDE_ERR_NOT_READY);
  assert_int_equal(o->stream_synchronize(c, NULL), TIDE_ERR_NOT_READY);
  assert_true(error_contains("default stream"));
  assert_int_equal(_tide_host_stream_release(&f.b, NULL), TIDE_OK);
  assert_int_equal(o->event_query(c, e2), TIDE_OK);

  /* Unknown streams and events. */
  tide_stream bogus = (tide_stream)(uintptr_t)99;
  assert_int_equal(o->event_record(c, e1, bogus), TIDE_ERR_INVALID);
  assert_int_equal(o->stream_synchronize(c, bogus), TIDE_ERR_INVALID);
  assert_int_equal(o->stream_destroy(c, bogus), TIDE_ERR_INVALID);
  assert_int_equal(o->stream_destroy(c, NULL), TIDE_ERR_INVALID);
  assert_int_equal(_tide_host_stream_hold(&f.b, bogus), TIDE_ERR_INVALID);
  assert_int_equal(_tide_host_stream_release(&f.b, bogus), TIDE_ERR_INVALID);
  assert_int_equal(o->event_query(c, (_tide_event)(uintptr_t)77), TIDE_ERR_INVALID);
  assert_int_equal(o->event_query(c, NULL), TIDE_ERR_INVALID);
  assert_int_equal(o->event_record(c, NULL, s1), TIDE_ERR_INVALID);

  /* A destroyed stream is unknown; its id is not handed out again. */
  assert_int_equal(o->stream_destroy(c, s2), TIDE_OK);
  assert_int_equal(o->stream_synchronize(c, s2), TIDE_ERR_INVALID);
  assert_int_equal(o->event_record(c, e2, s2), TIDE_ERR_INVALID);
  assert_int_equal(o->stream_destroy(c, s2), TIDE_ERR_INVALID);
  tide_stream s3 = NULL;
  assert_int_equal(o->stream_create(c, &s3), TIDE_OK);
  assert_true(s3 != s2 && s3 != s1 && s3 != NULL);
  assert_int_equal(o->stream_synchronize(c, s2), TIDE_ERR_INVALID);
  assert_int_equal(o->stream_synchronize(c, s3), TIDE_OK);

  /* Destroying a held stream leaves its events pending until it is released
   * (by its old id, which stays reserved until then). */
  assert_int_equal(_tide_host_stream_hold(&f.b, s1), TIDE_OK);
  assert_int_equal(o->event_record(c, e1, s1), TIDE_OK);
  assert_int_equal(o->stream_destroy(c, s1), TIDE_OK);
  assert_int_equal(o->event_query(c, e1), TIDE_ERR_NOT_READY);
  assert_int_equal(o->event_record(c, e2, s1), TIDE_ERR_INVALID);
  assert_int_equal(o->stream_synchronize(c, s1), TIDE_ERR_INVALID);
  assert_int_equal(_tide_host_stream_hold(&f.b, s1), TIDE_ERR_INVALID);
  tide_stream s4 = NULL;
  assert_int_equal(o->stream_create(c, &s4), TIDE_OK);
  assert_true(s4 != s1);
  assert_int_equal(_tide_host_stream_release(&f.b, s1), TIDE_OK);
  assert_int_equal(o->event_query(c, e1), TIDE_OK);
  assert_int_equal(_tide_host_stream_release(&f.b, s1), TIDE_ERR_INVALID);

  /* Destroyed events are unknown, even once their slot is reused. */
  assert_int_equal(o->event_destroy(c, e1), TIDE_OK);
  assert_int_equal(o->event_query(c, e1), TIDE_ERR_INVALID);
  assert_int_equal(o->event_destroy(c, e1), TIDE_ERR_INVALID);
  _tide_event e3 = NULL;
  assert_int_equal(o->event_create(c, &e3), TIDE_OK);
  assert_true(e3 != e1);
  assert_int_equal(o->event_synchronize(c, e1), TIDE_ERR_INVALID);
  assert_int_equal(o->event_query(c, e3), TIDE_OK);

  /* Destroying a pending event is allowed. */
  assert_int_equal(_tide_host_stream_hold(&f.b, s3), TIDE_OK);
  assert_int_equal(o->event_record(c, e3, s3), TIDE_OK);
  assert_int_equal(o->event_destroy(c, e3), TIDE_OK);
  assert_int_equal(_tide_host_stream_release(&f.b, s3), TIDE_OK);

  assert_int_equal(o->event_destroy(c, e2), TIDE_OK);
  assert_int_equal(o->event_destroy(c, fresh), TIDE_OK);
  assert_int_equal(o->stream_destroy(c, s3), TIDE_OK);
  assert_int_equal(o->stream_destroy(c, s4), TIDE_OK);
  /* Destroying the backend with a held stream and pending events is fine. */
  assert_int_equal(o->stream_create(c, &s1), TIDE_OK);
  assert_int_equal(o->event_create(c, &e1), TIDE_OK);
  assert_int_equal(_tide_host_stream_hold(&f.b, s1), TIDE_OK);
  assert_int_equal(o->event_record(c, e1, s1), TIDE_OK);
  close_device(&f);
}

/* device_synchronize waits for every stream, those nobody asked about too,
 * and a destroyed one still draining; a held stream or one being captured
 * (whose capture the driver would invalidate) refuses it, completing
 * nothing. */
static void test_device_synchronize(void **state) {
  (void)state;
  fixture f;
  open_device(&f, 8 * GRAN);
  const _tide_backend_ops *o = f.ops;
  void *c = f.ctx;
  assert_int_equal(o->device_synchronize(c), TIDE_OK);
  tide_stream s1 = NULL, s2 = NULL;
  assert_int_equal(o->stream_create(c, &s1), TIDE_OK);
  assert_int_equal(o->stream_create(c, &s2), TIDE_OK);
  _tide_event e1 = NULL, e2 = NULL;
  assert_int_equal(o->event_create(c, &e1), TIDE_OK);
  assert_int_equal(o->event_create(c, &e2), TIDE_OK);

  assert_int_equal(_tide_host_stream_hold(&f.b, s1), TIDE_OK);
  assert_int_equal(o->event_record(c, e1, s1), TIDE_OK);
  assert_int_equal(o->device_synchronize(c), TIDE_ERR_NOT_READY);
  assert_true(error_contains("held"));
  assert_int_equal(o->event_query(c, e1), TIDE_ERR_NOT_READY);
  /* A destroyed stream whose work still runs holds the device too. */
  assert_int_equal(o->stream_destroy(c, s1), TIDE_OK);
  assert_int_equal(o->device_synchronize(c), TIDE_ERR_NOT_READY);
  assert_int_equal(_tide_host_stream_release(&f.b, s1), TIDE_OK);
  assert_int_equal(o->device_synchronize(c), TIDE_OK);
  assert_int_equal(o->event_query(c, e1), TIDE_OK);

  /* A stream being captured: refused, and nothing else completes. */
  assert_int_equal(_tide_host_stream_hold(&f.b, NULL), TIDE_OK);
  assert_int_equal(o->event_record(c, e2, NULL), TIDE_OK);
  assert_int_equal(_tide_host_stream_release(&f.b, NULL), TIDE_OK);
  assert_int_equal(_tide_host_capture_begin(&f.b, s2), TIDE_OK);
  assert_int_equal(o->device_synchronize(c), TIDE_ERR_NOT_READY);
  assert_true(error_contains("captured"));
  assert_int_equal(_tide_host_capture_end(&f.b, s2), TIDE_OK);
  assert_int_equal(o->device_synchronize(c), TIDE_OK);

  /* With a queue, it completes what waiting for each stream would. */
  _tide_backend q;
  _tide_conf_values conf = conf_of(8 * GRAN, GRAN, 1);
  conf.host_queue_depth = 3;
  assert_int_equal(_tide_host_open(&conf, 0, &q), TIDE_OK);
  tide_stream qs = NULL;
  _tide_event qe = NULL;
  assert_int_equal(q.ops->stream_create(q.ctx, &qs), TIDE_OK);
  assert_int_equal(q.ops->event_create(q.ctx, &qe), TIDE_OK);
  assert_int_equal(q.ops->event_record(q.ctx, qe, qs), TIDE_OK);
  assert_int_equal(q.ops->event_query(q.ctx, qe), TIDE_ERR_NOT_READY);
  assert_int_equal(q.ops->device_synchronize(q.ctx), TIDE_OK);
  assert_int_equal(q.ops->event_query(q.ctx, qe), TIDE_OK);
  assert_int_equal(q.ops->event_destroy(q.ctx, qe), TIDE_OK);
  assert_int_equal(q.ops->stream_destroy(q.ctx, qs), TIDE_OK);
  q.ops->destroy(q.ctx);

  assert_int_equal(o->event_destroy(c, e1), TIDE_OK);
  assert_int_equal(o->event_destroy(c, e2), TIDE_OK);
  assert_int_equal(o->stream_destroy(c, s2), TIDE_OK);
  close_device(&f);
}

/* ------------------------------------------------------------------------ */
/* Fault injection                                                          */
/* ------------------------------------------------------------------------ */

typedef struct op_fixture {
  fixture f;
  uintptr_t slot; /* one reserved granule to map into */
  tide_stream stream;
  _tide_event event;
} op_fixture;

/* One call of `op` that succeeds unless a failure is injected; whatever it
 * returns, the state afterwards is as before (a failed call changed
 * nothing, so cleaning up after it must still succeed). Other operations
 * are called for setup and cleanup. */
static int call_op_once(op_fixture *x, tide_backend_op op) {
  const _tide_backend_ops *o = x->f.ops;
  void *c = x->f.ctx;
  uintptr_t addr = 0;
  _tide_handle h = 0;
  tide_stream s = NULL;
  _tide_event e = NULL;
  size_t fb = 0, tb = 0;
  void *host = NULL;
  char bytes_from[64] = {1}, bytes_to[64];
  int rc = TIDE_ERR_STATE;
  switch (op) {
  case TIDE_OP_RESERVE:
    rc = o->reserve(c, GRAN, 0, &addr);
    if (rc == TIDE_OK) assert_int_equal(o->unreserve(c, addr, GRAN), TIDE_OK);
    break;
  case TIDE_OP_UNRESERVE:
    assert_int_equal(o->reserve(c, GRAN, 0, &addr), TIDE_OK);
    rc = o->unreserve(c, addr, GRAN);
    if (rc != TIDE_OK) assert_int_equal(o->unreserve(c, addr, GRAN), TIDE_OK);
    break;
  case TIDE_OP_CREATE:
    rc = o->create(c, GRAN, &h);
    if (rc == TIDE_OK) assert_int_equal(o->release(c, h), TIDE_OK);
    break;
  case TIDE_OP_RELEASE:
    assert_int_equal(o->create(c, GRAN, &h), TIDE_OK);
    rc = o->release(c, h);
    if (rc != TIDE_OK) assert_int_equal(o->release(c, h), TIDE_OK);
    break;
  case TIDE_OP_MAP:
    assert_int_equal(o->create(c, GRAN, &h), TIDE_OK);
    rc = o->map(c, x->slot, GRAN, h);
    if (rc == TIDE_OK) assert_int_equal(o->unmap(c, x->slot, GRAN), TIDE_OK);
    assert_int_equal(o->release(c, h), TIDE_OK);
    break;
  case TIDE_OP_SET_ACCESS:
    assert_int_equal(o->create(c, GRAN, &h), TIDE_OK);
    assert_int_equal(o->map(c, x->slot, GRAN, h), TIDE_OK);
    rc = o->set_access(c, x->slot, GRAN);
    if (rc == TIDE_OK) *(volatile int *)x->slot = 1;
    assert_int_equal(o->unmap(c, x->slot, GRAN), TIDE_OK);
    assert_int_equal(o->release(c, h), TIDE_OK);
    break;
  case TIDE_OP_UNMAP:
    assert_int_equal(o->create(c, GRAN, &h), TIDE_OK);
    assert_int_equal(o->map(c, x->slot, GRAN, h), TIDE_OK);
    rc = o->unmap(c, x->slot, GRAN);
    if (rc != TIDE_OK) assert_int_equal(o->unmap(c, x->slot, GRAN), TIDE_OK);
    assert_int_equal(o->release(c, h), TIDE_OK);
    break;
  case TIDE_OP_EXPORT: {
    int fd = -1;
    uint64_t off = 0;
    assert_int_equal(o->create(c, GRAN, &h), TIDE_OK);
    rc = o->export_fd(c, h, &fd, &off);
    if (rc == TIDE_OK) close(fd);
    assert_int_equal(o->release(c, h), TIDE_OK);
    break;
  }
  case TIDE_OP_IMPORT: {
    int fd = -1;
    uint64_t off = 0;
    _tide_handle imported = 0;
    assert_int_equal(o->create(c, GRAN, &h), TIDE_OK);
    assert_int_equal(o->export_fd(c, h, &fd, &off), TIDE_OK);
    rc = o->import_fd(c, fd, off, GRAN, &imported);
    if (rc == TIDE_OK) assert_int_equal(o->release(c, imported), TIDE_OK);
    close(fd);
    assert_int_equal(o->release(c, h), TIDE_OK);
    break;
  }
  case TIDE_OP_STREAM_CREATE:
    rc = o->stream_create(c, &s);
    if (rc == TIDE_OK) assert_int_equal(o->stream_destroy(c, s), TIDE_OK);
    break;
  case TIDE_OP_STREAM_DESTROY:
    assert_int_equal(o->stream_create(c, &s), TIDE_OK);
    rc = o->stream_destroy(c, s);
    if (rc != TIDE_OK) assert_int_equal(o->stream_destroy(c, s), TIDE_OK);
    break;
  case TIDE_OP_STREAM_SYNCHRONIZE: rc = o->stream_synchronize(c, x->stream); break;
  case TIDE_OP_EVENT_CREATE:
    rc = o->event_create(c, &e);
    if (rc == TIDE_OK) assert_int_equal(o->event_destroy(c, e), TIDE_OK);
    break;
  case TIDE_OP_EVENT_DESTROY:
    assert_int_equal(o->event_create(c, &e), TIDE_OK);
    rc = o->event_destroy(c, e);
    if (rc != TIDE_OK) assert_int_equal(o->event_destroy(c, e), TIDE_OK);
    break;
  case TIDE_OP_EVENT_RECORD: rc = o->event_record(c, x->event, x->stream); break;
  case TIDE_OP_EVENT_QUERY: rc = o->event_query(c, x->event); break;
  case TIDE_OP_EVENT_SYNCHRONIZE: rc = o->event_synchronize(c, x->event); break;
  case TIDE_OP_MEM_INFO: rc = o->mem_info(c, &fb, &tb); break;
  case TIDE_OP_HOST_ALLOC:
    rc = o->host_alloc(c, 4096, &host);
    if (rc == TIDE_OK) assert_int_equal(o->host_free(c, host), TIDE_OK);
    break;
  case TIDE_OP_HOST_FREE:
    assert_int_equal(o->host_alloc(c, 4096, &host), TIDE_OK);
    rc = o->host_free(c, host);
    if (rc != TIDE_OK) assert_int_equal(o->host_free(c, host), TIDE_OK);
    break;
  case TIDE_OP_COPY: rc = o->copy(c, bytes_to, bytes_from, sizeof bytes_to, x->stream); break;
  case TIDE_OP_CAPTURE_STATUS: {
    bool capturing = true;
    uint64_t id = 1;
    rc = o->stream_capture_status(c, x->stream, &capturing, &id);
    if (rc == TIDE_OK) assert_true(!capturing && id == 0);
    break;
  }
  case TIDE_OP_CAPTURE_GRAPH: {
    uint64_t id = 1;
    size_t n = 1;
    rc = o->capture_deps(c, x->stream, &id, NULL, 0, &n);
    if (rc == TIDE_OK) assert_true(id == 0 && n == 0);
    break;
  }
  case TIDE_OP_DEVICE_SYNCHRONIZE: rc = o->device_synchronize(c); break;
  case TIDE_OP_ANY:
  case TIDE_OP_COUNT: break;
  }
  return rc;
}

/* Whether call_op_once cleans up after a failure with a second call of op. */
static bool cleanup_repeats(tide_backend_op op) {
  return op == TIDE_OP_UNRESERVE || op == TIDE_OP_RELEASE || op == TIDE_OP_UNMAP ||
         op == TIDE_OP_STREAM_DESTROY || op == TIDE_OP_EVENT_DESTROY || op == TIDE_OP_HOST_FREE;
}

static void op_fixture_open(op_fixture *x) {
  open_device(&x->f, 8 * GRAN);
  x->slot = reserve_pages(&x->f, 1);
  assert_int_equal(x->f.ops->stream_create(x->f.ctx, &x->stream), TIDE_OK);
  assert_int_equal(x->f.ops->event_create(x->f.ctx, &x->event), TIDE_OK);
}

static void op_fixture_close(op_fixture *x) {
  assert_int_equal(_tide_host_bytes_in_use(&x->f.b), 0);
  /* Nothing was left mapped: the reservation comes apart. */
  assert_int_equal(x->f.ops->unreserve(x->f.ctx, x->slot, GRAN), TIDE_OK);
  close_device(&x->f);
}

/* host_queue_depth N: a stream's events complete N records behind, or at
 * their Nth query while pending (time passes between queries, as a GPU's
 * queue runs on while the CPU polls); waiting for the stream or the event
 * lets the queue run up to it, and a stream destroyed runs its queue out. */
static void test_queue_depth(void **state) {
  (void)state;
  fixture f;
  _tide_conf_values conf = conf_of(8 * GRAN, GRAN, 1);
  conf.host_queue_depth = 3;
  assert_int_equal(_tide_host_open(&conf, 0, &f.b), TIDE_OK);
  f.ops = f.b.ops;
  f.ctx = f.b.ctx;
  const _tide_backend_ops *o = f.ops;
  void *c = f.ctx;
  tide_stream s = NULL;
  assert_int_equal(o->stream_create(c, &s), TIDE_OK);
  _tide_event e[4];
  for (int i = 0; i < 4; i++) assert_int_equal(o->event_create(c, &e[i]), TIDE_OK);
  for (int i = 0; i < 3; i++) assert_int_equal(o->event_record(c, e[i], s), TIDE_OK);
  assert_int_equal(o->event_query(c, e[0]), TIDE_ERR_NOT_READY); /* two behind, one query */
  assert_int_equal(o->event_record(c, e[3], s), TIDE_OK);        /* three behind e[0] */
  assert_int_equal(o->event_query(c, e[0]), TIDE_OK);
  /* e[1], two behind: its third query finds it done. */
  assert_int_equal(o->event_query(c, e[1]), TIDE_ERR_NOT_READY);
  assert_int_equal(o->event_query(c, e[1]), TIDE_ERR_NOT_READY);
  assert_int_equal(o->event_query(c, e[1]), TIDE_OK);
  assert_int_equal(o->event_query(c, e[2]), TIDE_ERR_NOT_READY);
  /* Waiting for an event completes it and what came before, not after. */
  assert_int_equal(o->event_synchronize(c, e[2]), TIDE_OK);
  assert_int_equal(o->event_query(c, e[2]), TIDE_OK);
  assert_int_equal(o->event_query(c, e[3]), TIDE_ERR_NOT_READY);
  /* Other streams do not move it; waiting for the stream does. */
  assert_int_equal(o->event_record(c, e[0], NULL), TIDE_OK);
  assert_int_equal(o->event_query(c, e[3]), TIDE_ERR_NOT_READY);
  assert_int_equal(o->stream_synchronize(c, s), TIDE_OK);
  assert_int_equal(o->event_query(c, e[3]), TIDE_OK);
  /* Recording again starts the count of queries again. */
  assert_int_equal(o->event_record(c, e[1], s), TIDE_OK);
  assert_int_equal(o->event_query(c, e[1]), TIDE_ERR_NOT_READY);
  assert_int_equal(o->event_query(c, e[1]), TIDE_ERR_NOT_READY);
  /* A destroyed stream's queue runs out. */
  assert_int_equal(o->stream_destroy(c, s), TIDE_OK);
  assert_int_equal(o->event_query(c, e[1]), TIDE_OK);
  for (int i = 0; i < 4; i++) assert_int_equal(o->event_destroy(c, e[i]), TIDE_OK);
  close_device(&f);
}

static void test_fault_injection_each_op(void **state) {
  (void)state;
  op_fixture x;
  op_fixture_open(&x);
  const uint64_t nths[] = {1, 3};
  for (int op = TIDE_OP_ANY + 1; op < TIDE_OP_COUNT; op++) {
    for (size_t k = 0; k < sizeof nths / sizeof nths[0]; k++) {
      uint64_t n = nths[k];
      uint64_t before = _tide_host_call_count(&x.f.b, (tide_backend_op)op);
      assert_int_equal(_tide_host_fail_call(&x.f.b, (tide_backend_op)op, n), TIDE_OK);
      for (uint64_t call = 1; call <= 4; call++) {
        int rc = call_op_once(&x, (tide_backend_op)op);
        if (call == n) {
          char expect[96];
          snprintf(expect, sizeof expect, "injected failure: %s call %llu",
                   tide_backend_op_name((tide_backend_op)op), (unsigned long long)(before + call));
          assert_int_equal(rc, TIDE_ERR_BACKEND);
          assert_string_equal(tide_last_error(), expect);
        } else {
          assert_int_equal(rc, TIDE_OK);
        }
        assert_int_equal(_tide_host_bytes_in_use(&x.f.b), 0);
      }
      uint64_t expected = before + 4 + (cleanup_repeats((tide_backend_op)op) ? 1 : 0);
      assert_int_equal(_tide_host_call_count(&x.f.b, (tide_backend_op)op), expected);
    }
  }
  /* n = 0 disarms. */
  assert_int_equal(_tide_host_fail_call(&x.f.b, TIDE_OP_CREATE, 2), TIDE_OK);
  assert_int_equal(_tide_host_fail_call(&x.f.b, TIDE_OP_CREATE, 0), TIDE_OK);
  for (int i = 0; i < 4; i++) assert_int_equal(call_op_once(&x, TIDE_OP_CREATE), TIDE_OK);
  /* Arming again replaces the earlier arming. */
  assert_int_equal(_tide_host_fail_call(&x.f.b, TIDE_OP_CREATE, 3), TIDE_OK);
  assert_int_equal(_tide_host_fail_call(&x.f.b, TIDE_OP_CREATE, 1), TIDE_OK);
  assert_int_equal(call_op_once(&x, TIDE_OP_CREATE), TIDE_ERR_BACKEND);
  for (int i = 0; i < 4; i++) assert_int_equal(call_op_once(&x, TIDE_OP_CREATE), TIDE_OK);
  op_fixture_close(&x);
}

static void test_fault_injection_any_op(void **state) {
  (void)state;
  op_fixture x;
  op_fixture_open(&x);
  const _tide_backend_ops *o = x.f.ops;
  void *c = x.f.ctx;
  size_t fb = 0, tb = 0;
  _tide_handle h = 0;

  /* The very next call of any operation. */
  assert_int_equal(_tide_host_fail_call(&x.f.b, TIDE_OP_ANY, 1), TIDE_OK);
  assert_int_equal(o->event_query(c, x.event), TIDE_ERR_BACKEND);
  assert_true(error_contains("injected failure: event_query call"));
  assert_true(error_contains("of any operation"));
  assert_int_equal(o->event_query(c, x.event), TIDE_OK);

  /* The third call from now, whichever it is: here a map. */
  assert_int_equal(_tide_host_fail_call(&x.f.b, TIDE_OP_ANY, 3), TIDE_OK);
  assert_int_equal(o->mem_info(c, &fb, &tb), TIDE_OK);
  assert_int_equal(o->create(c, GRAN, &h), TIDE_OK);
  uint64_t maps = _tide_host_call_count(&x.f.b, TIDE_OP_MAP);
  assert_int_equal(o->map(c, x.slot, GRAN, h), TIDE_ERR_BACKEND);
  char expect[64];
  snprintf(expect, sizeof expect, "injected failure: map call %llu", (unsigned long long)maps + 1);
  assert_true(error_contains(expect));
  /* The failed map mapped nothing: the range is free for the next one. */
  assert_int_equal(o->map(c, x.slot, GRAN, h), TIDE_OK);
  assert_int_equal(o->unmap(c, x.slot, GRAN), TIDE_OK);
  assert_int_equal(o->release(c, h), TIDE_OK);
  assert_int_equal(o->mem_info(c, &fb, &tb), TIDE_OK);
  op_fixture_close(&x);
}

static void test_call_counts(void **state) {
  (void)state;
  fixture f;
  open_device(&f, 8 * GRAN);
  for (int op = 0; op < TIDE_OP_COUNT; op++)
    assert_int_equal(_tide_host_call_count(&f.b, (tide_backend_op)op), 0);
  size_t fb = 0, tb = 0, g = 0;
  int n = 0;
  char name[64];
  _tide_handle a = create_pages(&f, 1), b = 0;
  assert_int_equal(f.ops->create(f.ctx, 0, &b), TIDE_ERR_BACKEND); /* failures count too */
  assert_int_equal(f.ops->mem_info(f.ctx, &fb, &tb), TIDE_OK);
  /* Plain queries are not counted. */
  assert_int_equal(f.ops->device_count(f.ctx, &n), TIDE_OK);
  assert_int_equal(f.ops->device_name(f.ctx, name, sizeof name), TIDE_OK);
  assert_int_equal(f.ops->granularity(f.ctx, &g), TIDE_OK);
  assert_int_equal(f.ops->release(f.ctx, a), TIDE_OK);
  assert_int_equal(_tide_host_call_count(&f.b, TIDE_OP_CREATE), 2);
  assert_int_equal(_tide_host_call_count(&f.b, TIDE_OP_MEM_INFO), 1);
  assert_int_equal(_tide_host_call_count(&f.b, TIDE_OP_RELEASE), 1);
  assert_int_equal(_tide_host_call_count(&f.b, TIDE_OP_MAP), 0);
  assert_int_equal(_tide_host_call_count(&f.b, TIDE_OP_ANY), 4);
  assert_int_equal(_tide_host_call_count(&f.b, TIDE_OP_COUNT), 0);
  close_device(&f);
}

/* ------------------------------------------------------------------------ */
/* Sparse memory                                                            */
/* ------------------------------------------------------------------------ */

static size_t resident_bytes(void) {
  FILE *fp = fopen("/proc/self/statm", "r");
  assert_non_null(fp);
  unsigned long size = 0, resident = 0;
  assert_int_equal(fscanf(fp, "%lu %lu", &size, &resident), 2);
  fclose(fp);
  return resident * (size_t)sysconf(_SC_PAGESIZE);
}

/* The bytes of RAM the backend's memfd holds, found through /proc/self/fd. */
static size_t memfd_bytes(void) {
  DIR *dir = opendir("/proc/self/fd");
  assert_non_null(dir);
  long long found = -1;
  struct dirent *ent;
  while ((ent = readdir(dir)) != NULL) {
    char path[300], target[PATH_MAX];
    snprintf(path, sizeof path, "/proc/self/fd/%s", ent->d_name);
    ssize_t n = readlink(path, target, sizeof target - 1);
    if (n <= 0) continue;
    target[n] = '\0';
    if (!strstr(target, "memfd:tidalloc-device-0")) continue;
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    found = (long long)st.st_blocks * 512;
  }
  closedir(dir);
  assert_true(found >= 0);
  return (size_t)found;
}

static void test_untouched_memory_costs_no_ram(void **state) {
  (void)state;
  fixture f;
  open_device(&f, (size_t)8 << 30);
  size_t before = resident_bytes();
  size_t big = (size_t)4 << 30;
  uintptr_t base = 0;
  assert_int_equal(f.ops->reserve(f.ctx, big, 0, &base), TIDE_OK);
  _tide_handle h = 0;
  assert_int_equal(f.ops->create(f.ctx, big, &h), TIDE_OK);
  assert_int_equal(f.ops->map(f.ctx, base, big, h), TIDE_OK);
  assert_int_equal(f.ops->set_access(f.ctx, base, big), TIDE_OK);
  size_t after = resident_bytes();
  assert_true(after < before + ((size_t)64 << 20));
  assert_int_equal(_tide_host_bytes_in_use(&f.b), big);
  assert_true(memfd_bytes() < ((size_t)1 << 20));

  /* Touched memory does cost RAM, and goes back once released and unmapped. */
  memset((void *)(base + ((size_t)1 << 30)), 1, (size_t)16 << 20);
  assert_true(memfd_bytes() >= ((size_t)16 << 20));
  assert_int_equal(f.ops->release(f.ctx, h), TIDE_OK);
  assert_true(memfd_bytes() >= ((size_t)16 << 20)); /* still mapped: still alive */
  assert_int_equal(f.ops->unmap(f.ctx, base, big), TIDE_OK);
  assert_true(memfd_bytes() < ((size_t)1 << 20));
  assert_int_equal(_tide_host_bytes_in_use(&f.b), 0);
  assert_int_equal(f.ops->unreserve(f.ctx, base, big), TIDE_OK);
  close_device(&f);
}

/* ------------------------------------------------------------------------ */
/* Threads                                                                  */
/* ------------------------------------------------------------------------ */

#define THREADS 4
#define ROUNDS 400
#define THREAD_PAGES 6
#define WORKER_STRIDE 4099 /* a word every 32 KiB or so: enough to see two threads share units */

typedef struct worker {
  fixture *f;
  int id;
  uintptr_t base; /* THREAD_PAGES granules of its own */
  unsigned errors;
  unsigned corrupt;
  uint64_t create_calls;
  uint64_t created;
  uint64_t ooms;
} worker;

static void *work(void *arg) {
  worker *w = arg;
  const _tide_backend_ops *o = w->f->ops;
  void *c = w->f->ctx;
  unsigned seed = (unsigned)w->id * 7919u + 1;
  tide_stream s = NULL;
  _tide_event e = NULL;
  if (o->stream_create(c, &s) || o->event_create(c, &e)) w->errors++;
  for (int round = 0; round < ROUNDS; round++) {
    size_t pages = 1 + (size_t)(rand_r(&seed) % 3);
    _tide_handle h = 0;
    w->create_calls++;
    int rc = o->create(c, pages * GRAN, &h);
    if (rc == TIDE_ERR_OOM) {
      w->ooms++;
      sched_yield();
      continue;
    }
    if (rc != TIDE_OK) {
      w->errors++;
      continue;
    }
    w->created++;
    /* Two views, so each thread also exercises shared mappings. */
    uintptr_t v1 = w->base, v2 = w->base + 3 * GRAN;
    if (o->map(c, v1, pages * GRAN, h) || o->map(c, v2, pages * GRAN, h) ||
        o->set_access(c, v1, pages * GRAN) || o->set_access(c, v2, pages * GRAN)) {
      w->errors++;
      break;
    }
    uint64_t tag = ((uint64_t)w->id << 40) | ((uint64_t)round << 8);
    fill_sparse(v1, pages * GRAN, tag, WORKER_STRIDE);
    if (o->event_record(c, e, s) || o->event_query(c, e)) w->errors++;
    sched_yield();
    if (!holds_sparse(v2, pages * GRAN, tag, WORKER_STRIDE)) w->corrupt++;
    /* Release first: the memory must live on until the last unmap. */
    if (o->release(c, h) || o->unmap(c, v1, pages * GRAN)) w->errors++;
    if (!holds_sparse(v2, pages * GRAN, tag, WORKER_STRIDE)) w->corrupt++;
    if (o->unmap(c, v2, pages * GRAN)) w->errors++;
  }
  if (o->event_destroy(c, e) || o->stream_destroy(c, s)) w->errors++;
  return NULL;
}

static void test_threads(void **state) {
  (void)state;
  fixture f;
  /* Less than the threads could want at once, so creates also fail and
   * freed units are reused while other threads hold theirs. */
  open_device(&f, 10 * GRAN);
  worker workers[THREADS];
  pthread_t threads[THREADS];
  for (int i = 0; i < THREADS; i++) {
    workers[i] = (worker){.f = &f, .id = i + 1, .base = reserve_pages(&f, THREAD_PAGES)};
    assert_int_equal(pthread_create(&threads[i], NULL, work, &workers[i]), 0);
  }
  uint64_t calls = 0, created = 0;
  for (int i = 0; i < THREADS; i++) {
    assert_int_equal(pthread_join(threads[i], NULL), 0);
    assert_int_equal(workers[i].errors, 0);
    assert_int_equal(workers[i].corrupt, 0);
    calls += workers[i].create_calls;
    created += workers[i].created;
  }
  assert_true(created > 0);
  assert_int_equal(_tide_host_call_count(&f.b, TIDE_OP_CREATE), calls);
  assert_int_equal(_tide_host_call_count(&f.b, TIDE_OP_RELEASE), created);
  assert_int_equal(_tide_host_call_count(&f.b, TIDE_OP_UNMAP), 2 * created);
  assert_int_equal(_tide_host_bytes_in_use(&f.b), 0);
  size_t fb = 0, tb = 0;
  assert_int_equal(f.ops->mem_info(f.ctx, &fb, &tb), TIDE_OK);
  assert_int_equal(fb, tb);
  for (int i = 0; i < THREADS; i++)
    assert_int_equal(f.ops->unreserve(f.ctx, workers[i].base, THREAD_PAGES * GRAN), TIDE_OK);
  /* The whole capacity is one free piece again. */
  _tide_handle all = create_pages(&f, 10);
  assert_int_equal(f.ops->release(f.ctx, all), TIDE_OK);
  close_device(&f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_op_names),
      cmocka_unit_test(test_open_validates_conf),
      cmocka_unit_test(test_auto_capacity_follows_the_machine),
      cmocka_unit_test(test_controls_refuse_other_backends),
      cmocka_unit_test(test_map_write_read),
      cmocka_unit_test(test_unmap_run),
      cmocka_unit_test(test_reserve_alignment),
      cmocka_unit_test(test_two_views_share_bytes),
      cmocka_unit_test(test_capacity_exhaustion),
      cmocka_unit_test(test_first_fit_across_words),
      cmocka_unit_test(test_release_while_mapped),
      cmocka_unit_test(test_preconditions),
      cmocka_unit_test(test_streams_and_events),
      cmocka_unit_test(test_queue_depth),
      cmocka_unit_test(test_device_synchronize),
      cmocka_unit_test(test_fault_injection_each_op),
      cmocka_unit_test(test_fault_injection_any_op),
      cmocka_unit_test(test_call_counts),
      cmocka_unit_test(test_untouched_memory_costs_no_ram),
      cmocka_unit_test(test_threads),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
