/* test_graph_reuse.c: graph_capture_record_stream_reuse on the host backend,
 * whose emulated captures keep a graph (tide_host_capture_work and _wait).
 *
 * - The emulated graph: what a stream's next work depends on, forks, joins,
 *   nodes and their dependencies, and their end with the capture.
 * - PyTorch's two tests (TestMemPool.test_graph_capture_reclaim_2_streams
 *   and _4_streams) step by step: a block freed after use on other streams
 *   is not taken before those streams joined the allocating stream, and is
 *   taken after; through tide_pool_malloc with tide_capture_watch_begin (as
 *   PyTorch's allocator calls it) and through tide_capture_begin.
 * - Off (the default), the free waits for the capture's end; the switch at
 *   run time; a free by another stream; queries that fail prove nothing and
 *   the reuse comes at a later allocation or the capture's end.
 * tide_check after every step. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <cmocka.h>

#include "features/features.h"
#include "testutil.h"

#define BLOCK 32 /* eight floats, as PyTorch's tests ask */

static tide_allocator *make(bool reuse) {
  return tu_create(reuse ? "host_capacity:1GiB,graph_capture_record_stream_reuse:True"
                         : "host_capacity:1GiB");
}

static tide_stream new_stream(tide_allocator *a) {
  tide_stream s = NULL;
  tu_assert_ok(tide_stream_create(a, &s));
  return s;
}

static void *pool_malloc(tide_pool *pool, tide_stream s) {
  void *p = tide_pool_malloc(pool, BLOCK, s);
  if (!p) fail_msg("tide_pool_malloc failed: %s", tide_last_error());
  tu_assert_ok(tide_check(pool->alloc));
  return p;
}

static void destroy_clean(tide_allocator *a) {
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_empty_cache(a));
  tide_stats st = tu_stats(a);
  assert_int_equal(st.allocated_bytes[0].current, 0);
  assert_int_equal(st.active_bytes[0].current, 0);
  assert_int_equal(atomic_load(&a->capture_watch), 0);
  assert_int_equal(atomic_load(&a->reuse_marked), 0);
  assert_null(a->captures.reach);
  tu_assert_ok(tide_destroy(a));
}

/* The dependencies of the next work on s (up to 8), and its capture id. */
static size_t deps_of(tide_allocator *a, tide_stream s, _tide_node *out, uint64_t *id) {
  const _tide_backend *be = &a->backend;
  size_t n = 0;
  tu_assert_ok(be->ops->capture_deps(be->ctx, s, id, out, 8, &n));
  assert_true(n <= 8);
  return n;
}

/* ------------------------------------------------------------------------ */
/* The emulated graph                                                        */
/* ------------------------------------------------------------------------ */

static void test_emulated_graph(void **state) {
  (void)state;
  tide_allocator *a = make(false);
  const _tide_backend *be = &a->backend;
  tide_stream s = new_stream(a), t = new_stream(a), u = new_stream(a);
  _tide_node d[8], e[8];
  uint64_t id = 7, id2 = 0;
  assert_int_equal(deps_of(a, s, d, &id), 0);
  assert_int_equal(id, 0);
  assert_int_equal(tide_host_capture_work(a, s), TIDE_ERR_INVALID); /* not captured */
  tu_assert_ok(tide_host_capture_begin(a, s));
  assert_int_equal(deps_of(a, s, d, &id), 0); /* nothing captured yet */
  assert_true(id != 0);
  tu_assert_ok(tide_host_capture_work(a, s));
  assert_int_equal(deps_of(a, s, d, &id), 1);
  _tide_node first = d[0];
  size_t n = 9;
  tu_assert_ok(be->ops->node_deps(be->ctx, first, NULL, 0, &n));
  assert_int_equal(n, 0);
  tu_assert_ok(tide_host_capture_join(a, t, s)); /* a fork carries the dependencies */
  assert_int_equal(deps_of(a, t, e, &id2), 1);
  assert_int_equal(id2, id);
  assert_true(e[0] == first);
  tu_assert_ok(tide_host_capture_work(a, t));
  tu_assert_ok(tide_host_capture_work(a, s));
  assert_int_equal(deps_of(a, t, e, &id2), 1);
  assert_int_equal(deps_of(a, s, d, &id), 1);
  assert_true(d[0] != e[0]);
  tu_assert_ok(be->ops->node_deps(be->ctx, e[0], d + 1, 7, &n)); /* t's work after first */
  assert_int_equal(n, 1);
  assert_true(d[1] == first);
  tu_assert_ok(tide_host_capture_wait(a, s, t)); /* a join: both ends */
  assert_int_equal(deps_of(a, s, d, &id), 2);
  tu_assert_ok(tide_host_capture_wait(a, s, t)); /* each node once */
  assert_int_equal(deps_of(a, s, d, &id), 2);
  tu_assert_ok(tide_host_capture_work(a, s));
  assert_int_equal(deps_of(a, s, d, &id), 1);
  tu_assert_ok(be->ops->node_deps(be->ctx, d[0], e, 8, &n));
  assert_int_equal(n, 2);
  n = 0;
  tu_assert_ok(be->ops->node_deps(be->ctx, d[0], e, 1, &n)); /* room for one: says two */
  assert_int_equal(n, 2);
  /* _wait joins a stream in no capture, and refuses one in another. */
  tu_assert_ok(tide_host_capture_wait(a, u, s));
  assert_int_equal(deps_of(a, u, e, &id2), 1);
  assert_int_equal(id2, id);
  assert_int_equal(tide_host_capture_wait(a, s, s), TIDE_ERR_INVALID);
  tide_stream v = new_stream(a);
  tu_assert_ok(tide_host_capture_begin(a, v));
  assert_int_equal(tide_host_capture_wait(a, v, s), TIDE_ERR_INVALID);
  tu_assert_ok(tide_host_capture_end(a, v));
  assert_int_equal(tide_host_capture_wait(a, v, NULL), TIDE_ERR_INVALID);
  tu_assert_ok(tide_host_capture_end(a, s));
  assert_int_equal(deps_of(a, u, e, &id2), 0);
  assert_int_equal(id2, 0);
  assert_int_equal(be->ops->node_deps(be->ctx, first, e, 8, &n), TIDE_ERR_INVALID);
  /* Node ids are not reused by the next capture. */
  tu_assert_ok(tide_host_capture_begin(a, s));
  tu_assert_ok(tide_host_capture_work(a, s));
  assert_int_equal(deps_of(a, s, d, &id), 1);
  assert_true(d[0] > first);
  tu_assert_ok(tide_host_capture_end(a, s));
  assert_int_equal(tide_host_fail_call(a, TIDE_OP_CAPTURE_GRAPH, 1), TIDE_OK);
  assert_int_equal(be->ops->capture_deps(be->ctx, s, &id, NULL, 0, &n), TIDE_ERR_BACKEND);
  destroy_clean(a);
}

/* ------------------------------------------------------------------------ */
/* PyTorch's tests                                                           */
/* ------------------------------------------------------------------------ */

/* test_graph_capture_reclaim_2_streams, through tide_pool_malloc. */
static void reclaim_2_streams(bool reuse, bool *reused_before, bool *reused_after) {
  tide_allocator *a = make(reuse);
  tide_stream s1 = new_stream(a), s2 = new_stream(a);
  tide_pool *pool = NULL;
  tu_assert_ok(tide_pool_create(a, &pool));
  tu_assert_ok(tide_capture_watch_begin(a));
  tu_assert_ok(tide_host_capture_begin(a, s1));
  void *sink1 = pool_malloc(pool, s1);
  void *data1 = pool_malloc(pool, s1);
  tu_assert_ok(tide_host_capture_wait(a, s2, s1)); /* s2.wait_stream(s1) */
  void *buf2 = pool_malloc(pool, s2);
  tu_assert_ok(tide_host_capture_work(a, s2)); /* torch.add(data1, 2.0, out=buf2) */
  tu_assert_ok(tide_record_stream(a, data1, s2));
  tu_assert_ok(tide_free_home(a, data1, s1));
  tu_assert_ok(tide_check(a));
  void *data2 = pool_malloc(pool, s1); /* before the join */
  tu_assert_ok(tide_host_capture_wait(a, s1, s2));
  tu_assert_ok(tide_host_capture_work(a, s1)); /* sink1.fill_(1.0) */
  void *data3 = pool_malloc(pool, s1);         /* after it */
  *reused_before = data2 == data1;
  *reused_after = data3 == data1;
  tu_assert_ok(tide_host_capture_end(a, s1));
  tu_assert_ok(tide_capture_watch_end(a));
  void *frees[] = {sink1, buf2, data2, data3};
  for (size_t i = 0; i < sizeof frees / sizeof *frees; i++)
    tu_assert_ok(tide_free_home(a, frees[i], s1));
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_pool_release(pool));
  destroy_clean(a);
}

static void test_reclaim_2_streams(void **state) {
  (void)state;
  bool before = true, after = false;
  reclaim_2_streams(true, &before, &after);
  assert_false(before);
  assert_true(after);
  reclaim_2_streams(false, &before, &after); /* off: only after the capture */
  assert_false(before);
  assert_false(after);
}

/* test_graph_capture_reclaim_4_streams, through tide_capture_begin (the
 * allocations of the capture's streams routed to the pool by tide_malloc). */
static void test_reclaim_4_streams(void **state) {
  (void)state;
  tide_allocator *a = make(true);
  tide_stream s1 = new_stream(a), s2 = new_stream(a), s3 = new_stream(a), s4 = new_stream(a);
  tide_pool *pool = NULL;
  tu_assert_ok(tide_pool_create(a, &pool));
  tu_assert_ok(tide_host_capture_begin(a, s1));
  tu_assert_ok(tide_capture_begin(a, s1, pool));
  void *data1 = tide_malloc(a, BLOCK, s1);
  tu_assert_ok(tide_host_capture_work(a, s1)); /* torch.ones */
  void *sink1 = tide_malloc(a, BLOCK, s1), *sink3 = tide_malloc(a, BLOCK, s1);
  tide_stream side[] = {s2, s3, s4};
  void *bufs[3];
  for (int i = 0; i < 3; i++) {
    tu_assert_ok(tide_host_capture_wait(a, side[i], s1));
    bufs[i] = tide_malloc(a, BLOCK, side[i]);
    assert_non_null(bufs[i]);
    tu_assert_ok(tide_host_capture_work(a, side[i])); /* reads data1 */
    tu_assert_ok(tide_record_stream(a, data1, side[i]));
  }
  tu_assert_ok(tide_free(a, data1, s1));
  tu_assert_ok(tide_host_capture_wait(a, s1, s2)); /* partial joins */
  tu_assert_ok(tide_host_capture_work(a, s1));
  tu_assert_ok(tide_host_capture_wait(a, s3, s4));
  tu_assert_ok(tide_host_capture_work(a, s3));
  void *data2 = tide_malloc(a, BLOCK, s1);
  assert_true(data2 != data1);
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_host_capture_wait(a, s1, s3)); /* the final join */
  tu_assert_ok(tide_host_capture_work(a, s1));
  void *data3 = tide_malloc(a, BLOCK, s1);
  assert_ptr_equal(data3, data1);
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_host_capture_end(a, s1));
  tu_assert_ok(tide_capture_end(a, s1));
  tu_assert_ok(tide_free(a, sink1, s1));
  tu_assert_ok(tide_free(a, sink3, s1));
  tu_assert_ok(tide_free(a, data2, s1));
  tu_assert_ok(tide_free(a, data3, s1));
  for (int i = 0; i < 3; i++) tu_assert_ok(tide_free(a, bufs[i], side[i]));
  tu_assert_ok(tide_pool_release(pool));
  destroy_clean(a);
}

/* ------------------------------------------------------------------------ */
/* The switch, other frees, failures                                         */
/* ------------------------------------------------------------------------ */

/* A capture on s1 with a block of s1 read on s2 and freed by `freer`. */
typedef struct scene {
  tide_allocator *a;
  tide_stream s1, s2;
  tide_pool *pool;
  void *data1, *other;
} scene;

static void scene_open(scene *x, bool reuse, bool free_on_s2) {
  x->a = make(reuse);
  x->s1 = new_stream(x->a);
  x->s2 = new_stream(x->a);
  tu_assert_ok(tide_pool_create(x->a, &x->pool));
  tu_assert_ok(tide_capture_watch_begin(x->a));
  tu_assert_ok(tide_host_capture_begin(x->a, x->s1));
  x->other = pool_malloc(x->pool, x->s1); /* keeps data1 from merging */
  x->data1 = pool_malloc(x->pool, x->s1);
  tu_assert_ok(tide_host_capture_work(x->a, x->s1));
  tu_assert_ok(tide_host_capture_wait(x->a, x->s2, x->s1));
  tu_assert_ok(tide_host_capture_work(x->a, x->s2));
  tu_assert_ok(tide_record_stream(x->a, x->data1, x->s2));
  tu_assert_ok(tide_free(x->a, x->data1, free_on_s2 ? x->s2 : x->s1));
}

static void scene_join(scene *x) {
  tu_assert_ok(tide_host_capture_wait(x->a, x->s1, x->s2));
  tu_assert_ok(tide_host_capture_work(x->a, x->s1));
}

static void scene_close(scene *x, void *p) {
  tu_assert_ok(tide_host_capture_end(x->a, x->s1));
  tu_assert_ok(tide_capture_watch_end(x->a));
  tu_assert_ok(tide_free_home(x->a, p, x->s1));
  tu_assert_ok(tide_free_home(x->a, x->other, x->s1));
  tu_assert_ok(tide_check(x->a));
  tu_assert_ok(tide_pool_release(x->pool));
  destroy_clean(x->a);
}

/* The free waits for the capture's end when the option is off, and the
 * switch decides at the free. */
static void test_switch(void **state) {
  (void)state;
  scene x;
  scene_open(&x, false, false);
  assert_int_equal(atomic_load(&x.a->reuse_marked), 0);
  scene_join(&x);
  void *p = pool_malloc(x.pool, x.s1);
  assert_true(p != x.data1);
  scene_close(&x, p);

  x.a = make(false);
  tu_assert_ok(tide_capture_reuse_set(x.a, 1));
  tu_assert_ok(tide_destroy(x.a));
  assert_int_equal(tide_capture_reuse_set(NULL, 1), TIDE_ERR_INVALID);

  scene_open(&x, true, false);
  tu_assert_ok(tide_capture_reuse_set(x.a, 0)); /* frees from now wait */
  assert_int_equal(atomic_load(&x.a->reuse_marked), 1);
  scene_join(&x);
  p = pool_malloc(x.pool, x.s1); /* marked while on: reused */
  assert_ptr_equal(p, x.data1);
  scene_close(&x, p);
}

/* Freed by the other stream: its own uses and s1's are the markers. */
static void test_free_on_other_stream(void **state) {
  (void)state;
  scene x;
  scene_open(&x, true, true);
  void *p = pool_malloc(x.pool, x.s1);
  assert_true(p != x.data1);
  scene_join(&x);
  void *q = pool_malloc(x.pool, x.s1);
  assert_ptr_equal(q, x.data1);
  tu_assert_ok(tide_free_home(x.a, q, x.s1));
  scene_close(&x, p);
}

/* A query failing at the free: no markers, the capture's end frees it. */
static void test_marking_fails(void **state) {
  (void)state;
  tide_allocator *a = make(true);
  tide_stream s1 = new_stream(a), s2 = new_stream(a);
  tide_pool *pool = NULL;
  tu_assert_ok(tide_pool_create(a, &pool));
  tu_assert_ok(tide_capture_watch_begin(a));
  tu_assert_ok(tide_host_capture_begin(a, s1));
  void *keep = pool_malloc(pool, s1), *data1 = pool_malloc(pool, s1);
  tu_assert_ok(tide_host_capture_wait(a, s2, s1));
  tu_assert_ok(tide_host_capture_work(a, s2));
  tu_assert_ok(tide_record_stream(a, data1, s2));
  tu_assert_ok(tide_host_fail_call(a, TIDE_OP_CAPTURE_GRAPH, 1));
  tu_assert_ok(tide_free(a, data1, s1)); /* still freed, and no error */
  assert_int_equal(atomic_load(&a->reuse_marked), 0);
  tu_assert_ok(tide_host_capture_wait(a, s1, s2));
  tu_assert_ok(tide_host_capture_work(a, s1));
  void *p = pool_malloc(pool, s1);
  assert_true(p != data1);
  tu_assert_ok(tide_host_capture_end(a, s1));
  tu_assert_ok(tide_capture_watch_end(a)); /* the capture's end frees it */
  void *q = pool_malloc(pool, s1);
  assert_ptr_equal(q, data1);
  tu_assert_ok(tide_free_home(a, q, s1));
  tu_assert_ok(tide_free_home(a, p, s1));
  tu_assert_ok(tide_free_home(a, keep, s1));
  tu_assert_ok(tide_pool_release(pool));
  destroy_clean(a);
}

/* A query failing in the walk: not reused then, the next allocation
 * resumes the walk and reuses it. Every call of the walk is made to fail
 * in turn. */
static void test_walk_fails(void **state) {
  (void)state;
  for (uint64_t k = 1;; k++) {
    scene x;
    scene_open(&x, true, false);
    scene_join(&x);
    uint64_t before = tide_host_call_count(x.a, TIDE_OP_CAPTURE_GRAPH);
    tu_assert_ok(tide_host_fail_call(x.a, TIDE_OP_CAPTURE_GRAPH, k));
    void *p = pool_malloc(x.pool, x.s1);
    uint64_t made = tide_host_call_count(x.a, TIDE_OP_CAPTURE_GRAPH) - before;
    if (made < k) { /* the walk made fewer calls: done */
      assert_ptr_equal(p, x.data1);
      tu_assert_ok(tide_host_fail_call(x.a, TIDE_OP_CAPTURE_GRAPH, 0));
      scene_close(&x, p);
      assert_true(k > 2);
      return;
    }
    assert_true(p != x.data1);
    void *q = pool_malloc(x.pool, x.s1);
    assert_ptr_equal(q, x.data1);
    tu_assert_ok(tide_free_home(x.a, q, x.s1));
    scene_close(&x, p);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_emulated_graph),       cmocka_unit_test(test_reclaim_2_streams),
      cmocka_unit_test(test_reclaim_4_streams),    cmocka_unit_test(test_switch),
      cmocka_unit_test(test_free_on_other_stream), cmocka_unit_test(test_marking_fails),
      cmocka_unit_test(test_walk_fails),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
