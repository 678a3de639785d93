/* test_faults.c: every backend call of the grow, shrink and out-of-memory
 * paths made to fail, one at a time.
 *
 * A scenario is a fixed sequence of API calls: growing (allocations that
 * need new pages or segments while earlier blocks hold data), shrinking
 * (frees on the block's stream and on another, tide_record_stream,
 * tide_empty_cache) and running out of memory (filling a small device, then
 * asking for more so that cached memory is freed and the request retried).
 * For each backend operation, and for n = 1, 2, 3, ..., the scenario runs on
 * a fresh allocator with the n-th call of that operation made to fail
 * (tide_host_fail_call), until a run ends without reaching an n-th call.
 * After every API call of every run:
 * - a call that failed has a message; a failure other than out-of-memory
 *   happens only in the call the fault hit, and its message names the
 *   injected failure; out-of-memory comes with "out of memory";
 * - every live block still holds its data, where it was and as large;
 * - allocated, requested and allocation counts equal the sums over live
 *   blocks, and reserved equals what the host backend holds.
 * After the run the fault is disarmed, everything freed and the cache
 * emptied: nothing stays allocated, reserved, created, mapped or reserved
 * in address space, and tide_destroy returns TIDE_OK (ASan sees host leaks).
 * Finally every operation the paths use must have failed at least once, and
 * so must every call site: the host backend counts calls per (operation,
 * return address), and a call site the sweeps reached with a fault armed but
 * never made to fail is reported (with its source line) and fails the test. */
#include <dlfcn.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "memory/arena_table.h"
#include "testutil.h"

#define SLOTS 24
#define NO_FAULT ((tide_backend_op)-1)

/* ------------------------------------------------------------------------ */
/* The harness                                                               */
/* ------------------------------------------------------------------------ */

typedef struct slot {
  bool used;
  void *ptr;
  size_t requested;
  size_t size;
  uint64_t seq;
  tide_stream stream;
} slot;

/* What a step allows when no fault explains a failure. */
typedef enum expect {
  SUCCEED = 0,  /* must succeed */
  MAY_OOM = 1,  /* may run out of memory */
  MUST_OOM = 2, /* must run out of memory */
} expect;

/* Per operation, over all runs. */
typedef struct op_tally {
  unsigned points;   /* distinct (scenario, segments, n) the fault hit */
  unsigned reported; /* the API call it hit returned an error */
  unsigned absorbed; /* ... or handled it and succeeded */
} op_tally;

static op_tally tally[TIDE_OP_COUNT];

/* Per call site (operation and return address), over every run: how many
 * runs reached it with a fault armed, and how many of its calls failed. */
#define MAX_SITES 512

typedef struct site_tally {
  tide_backend_op op;
  uintptr_t site;
  unsigned runs;
  uint64_t failures;
} site_tally;

static site_tally sites[MAX_SITES];
static size_t nsites;

typedef struct harness {
  tide_allocator *a;
  tide_stream side; /* a created stream */
  slot slots[SLOTS];
  uint64_t next_seq;
  bool oom_scenario;
  bool expandable;
  /* The fault: the n-th call of op from armed_at on. */
  tide_backend_op op;
  uint64_t n, armed_at;
  bool hit;
  /* A second fault, at the n2-th call of op2 from armed_at2 on: with the
   * first, it makes an undo step fail too, in the same API call, or with
   * `second_later` the handling of the first failure in a later call. */
  tide_backend_op op2;
  uint64_t n2, armed_at2;
  bool second_before, second_hit, second_later;
  /* With `retry`, once the second fault hit, the next call of op2 fails
   * too: the retry of what the failed undo left behind (an orphan). */
  bool retry, retry_armed, retry_before, retry_hit;
  uint64_t armed_at3;
  uint64_t before_hit[TIDE_OP_COUNT]; /* calls before the API call the fault hit */
  uint64_t hit_ops;                   /* ops called during the API call the fault hit */
  tide_backend_op failed;             /* the op that failed, when known */
  uint64_t counts[TIDE_OP_COUNT];
  const char *where; /* "grow/expandable" for messages */
  int step;
} harness;

static bool fault_reached(harness *h) {
  if (h->op == NO_FAULT) return false;
  return tide_host_call_count(h->a, h->op) - h->armed_at >= h->n;
}

static bool second_reached(harness *h) {
  if (h->op2 == NO_FAULT) return false;
  return tide_host_call_count(h->a, h->op2) - h->armed_at2 >= h->n2;
}

static bool retry_reached(harness *h) {
  return h->retry_armed && tide_host_call_count(h->a, h->op2) > h->armed_at3;
}

static void snapshot_counts(harness *h) {
  for (int op = 0; op < TIDE_OP_COUNT; op++)
    h->counts[op] = tide_host_call_count(h->a, (tide_backend_op)op);
}

/* Before each API call. */
static bool begin_call(harness *h) {
  h->step++;
  snapshot_counts(h);
  tide_clear_error();
  h->second_before = second_reached(h);
  h->retry_before = retry_reached(h);
  return fault_reached(h);
}

/* The op named in an injected-failure message, or NO_FAULT. */
static tide_backend_op op_in_message(const char *msg) {
  const char *p = strstr(msg, "injected failure: ");
  if (!p) return NO_FAULT;
  p += strlen("injected failure: ");
  for (int op = 1; op < TIDE_OP_COUNT; op++) {
    const char *name = tide_backend_op_name((tide_backend_op)op);
    size_t len = strlen(name);
    if (strncmp(p, name, len) == 0 && p[len] == ' ') return (tide_backend_op)op;
  }
  return NO_FAULT;
}

static void check_consistent(harness *h);

/* After each API call: `failed` and its status; `e` what the step allows. */
static void end_call(harness *h, bool hit_before, bool failed, tide_status st, expect e,
                     const char *what) {
  bool hit_here = !hit_before && fault_reached(h);
  bool second_here = !h->second_before && second_reached(h);
  bool retry_here = !h->retry_before && retry_reached(h);
  const char *msg = tide_last_error();
  if (second_here && !hit_here && !h->second_later)
    fail_msg("%s step %d: %s reached the second fault, which is meant for a step after the "
             "first in the same call",
             h->where, h->step, what);
  if (second_here && h->retry && !h->retry_armed) {
    h->armed_at3 = tide_host_call_count(h->a, h->op2);
    tu_assert_ok(tide_host_fail_call(h->a, h->op2, 1));
    h->retry_armed = true;
  }
  if (retry_here) h->retry_hit = true;
  if (hit_here) {
    memcpy(h->before_hit, h->counts, sizeof h->before_hit);
    h->hit = true;
    h->hit_ops = 0;
    for (int op = 1; op < TIDE_OP_COUNT; op++)
      if (tide_host_call_count(h->a, (tide_backend_op)op) > h->counts[op]) h->hit_ops |= 1ull << op;
    if (h->op != TIDE_OP_ANY) h->failed = h->op;
    tally[h->op].points++;
    if (failed)
      tally[h->op].reported++;
    else
      tally[h->op].absorbed++;
  }
  if (failed) {
    if (!msg || !*msg)
      fail_msg("%s step %d: %s failed with %s and no message", h->where, h->step, what,
               tide_status_name(st));
    if (st == TIDE_ERR_OOM) {
      bool allowed = e != SUCCEED || hit_here || (h->hit && h->oom_scenario);
      if (!allowed)
        fail_msg("%s step %d: %s ran out of memory unexpectedly: %s", h->where, h->step, what, msg);
      if (!strstr(msg, "out of memory"))
        fail_msg("%s step %d: %s: TIDE_ERR_OOM without \"out of memory\": %s", h->where, h->step,
                 what, msg);
    } else {
      if (!hit_here && !retry_here && !second_here)
        fail_msg("%s step %d: %s failed with %s though no fault was injected into it%s: %s",
                 h->where, h->step, what, tide_status_name(st), h->hit ? " (one was, earlier)" : "",
                 msg);
      if (!strstr(msg, "injected failure"))
        fail_msg("%s step %d: %s failed with %s, message does not say what failed: %s", h->where,
                 h->step, what, tide_status_name(st), msg);
      tide_backend_op named = op_in_message(msg);
      bool later = (second_here || retry_here) && named == h->op2;
      if (h->op != TIDE_OP_ANY && named != h->op && !later)
        fail_msg("%s step %d: %s: the message names %s, the fault was in %s: %s", h->where, h->step,
                 what, named == NO_FAULT ? "no operation" : tide_backend_op_name(named),
                 tide_backend_op_name(h->op), msg);
      if (h->op == TIDE_OP_ANY && named != NO_FAULT) h->failed = named;
    }
  } else if (e == MUST_OOM && !h->hit) {
    fail_msg("%s step %d: %s succeeded, expected to run out of memory", h->where, h->step, what);
  }
  check_consistent(h);
}

/* Live blocks intact and where they were; stats equal to their sums. */
static void check_consistent(harness *h) {
  int64_t bytes = 0, requested = 0, count = 0;
  for (int i = 0; i < SLOTS; i++) {
    slot *s = &h->slots[i];
    if (!s->used) continue;
    void *base = NULL;
    size_t size = 0;
    tide_stream stream = NULL;
    tide_status rc = tide_block_info(h->a, s->ptr, &base, &size, &stream);
    if (rc != TIDE_OK || base != s->ptr || size != s->size || stream != s->stream)
      fail_msg("%s step %d: live block %d (%p, %zu bytes) reads as %s, base %p, size %zu: %s",
               h->where, h->step, i, s->ptr, s->size, tide_status_name(rc), base, size,
               tide_last_error());
    size_t bad = tu_check(s->ptr, s->requested, s->seq, TU_PATTERN_DEFAULT);
    if (bad != SIZE_MAX)
      fail_msg("%s step %d: block %d (%p, %zu bytes) lost its data at offset %zu", h->where,
               h->step, i, s->ptr, s->requested, bad);
    bytes += (int64_t)s->size;
    requested += (int64_t)s->requested;
    count++;
  }
  tide_stats st = tu_stats(h->a);
  uint64_t held = tide_host_bytes_in_use(h->a);
  if (st.allocated_bytes[0].current != bytes || st.requested_bytes[0].current != requested ||
      st.allocations[0].current != count)
    fail_msg("%s step %d: stats say %lld bytes allocated (%lld requested) in %lld blocks; the "
             "live blocks hold %lld (%lld) in %lld",
             h->where, h->step, (long long)st.allocated_bytes[0].current,
             (long long)st.requested_bytes[0].current, (long long)st.allocations[0].current,
             (long long)bytes, (long long)requested, (long long)count);
  if ((uint64_t)st.reserved_bytes[0].current != held)
    fail_msg("%s step %d: reserved is %lld bytes, the device holds %llu", h->where, h->step,
             (long long)st.reserved_bytes[0].current, (unsigned long long)held);
  if (st.reserved_bytes[0].current < bytes)
    fail_msg("%s step %d: reserved %lld < allocated %lld", h->where, h->step,
             (long long)st.reserved_bytes[0].current, (long long)bytes);
  if (tide_check(h->a) != TIDE_OK) fail_msg("%s step %d: %s", h->where, h->step, tide_last_error());
}

/* ------------------------------------------------------------------------ */
/* API calls through the harness                                             */
/* ------------------------------------------------------------------------ */

static void h_malloc(harness *h, int k, size_t size, tide_stream stream, expect e) {
  assert_false(h->slots[k].used);
  bool before = begin_call(h);
  void *p = tide_malloc(h->a, size, stream);
  if (p) {
    slot *s = &h->slots[k];
    void *base = NULL;
    tu_assert_ok(tide_block_info(h->a, p, &base, &s->size, NULL));
    assert_ptr_equal(base, p);
    assert_true(s->size >= size);
    s->used = true;
    s->ptr = p;
    s->requested = size;
    s->seq = h->next_seq++;
    s->stream = stream;
    tu_fill(p, size, s->seq, TU_PATTERN_DEFAULT);
  }
  char what[64];
  snprintf(what, sizeof what, "tide_malloc(%zu)", size);
  end_call(h, before, p == NULL, p ? TIDE_OK : tide_last_status(), e, what);
}

static void h_free(harness *h, int k, tide_stream stream) {
  slot *s = &h->slots[k];
  if (!s->used) return; /* its allocation failed */
  bool before = begin_call(h);
  tide_status rc = tide_free(h->a, s->ptr, stream);
  if (rc == TIDE_OK) s->used = false;
  end_call(h, before, rc != TIDE_OK, rc, SUCCEED, "tide_free");
}

static void h_record(harness *h, int k, tide_stream stream) {
  slot *s = &h->slots[k];
  if (!s->used) return;
  bool before = begin_call(h);
  tide_status rc = tide_record_stream(h->a, s->ptr, stream);
  end_call(h, before, rc != TIDE_OK, rc, SUCCEED, "tide_record_stream");
}

static size_t orphans_of(harness *h);

/* TIDE_OK from tide_empty_cache means the device took everything back: no
 * piece it refused is still waiting for a retry. */
static void h_empty_cache(harness *h) {
  bool before = begin_call(h);
  tide_status rc = tide_empty_cache(h->a);
  end_call(h, before, rc != TIDE_OK, rc, SUCCEED, "tide_empty_cache");
  size_t left = orphans_of(h);
  if (rc == TIDE_OK && left)
    fail_msg("%s step %d: tide_empty_cache returned TIDE_OK, but %zu piece(s) of memory the "
             "backend refused to give back are still held",
             h->where, h->step, left);
}

static void h_free_all(harness *h) {
  for (int k = 0; k < SLOTS; k++) h_free(h, k, h->slots[k].stream);
}

/* ------------------------------------------------------------------------ */
/* Scenarios                                                                 */
/* ------------------------------------------------------------------------ */

typedef struct scenario {
  const char *name;
  const char *conf;          /* added to the segment kind's config */
  void (*setup)(harness *h); /* before the fault is armed */
  void (*run)(harness *h);
} scenario;

/* Blocks in both pools and both streams; each size needs new pages (or a
 * new fixed segment) while the earlier blocks hold data. */
static void grow_blocks(harness *h) {
  static const size_t sizes[] = {512,           100 * TU_KiB, TU_MiB,     TU_MiB,      TU_MiB,
                                 1536 * TU_KiB, 3 * TU_MiB,   5 * TU_MiB, 12 * TU_MiB, 25 * TU_MiB};
  int k = 0;
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++, k++)
    h_malloc(h, k, sizes[i], NULL, SUCCEED);
  h_malloc(h, k++, 2 * TU_MiB, h->side, SUCCEED);
  h_malloc(h, k++, 600 * TU_KiB, h->side, SUCCEED);
  h_malloc(h, k++, 7 * TU_MiB, h->side, SUCCEED);
}

static void no_setup(harness *h) { (void)h; }

static void grow_run(harness *h) { grow_blocks(h); }

static void shrink_setup(harness *h) { grow_blocks(h); }

/* Frees on the block's stream, after tide_record_stream, and on another
 * stream (pending until an event completes); the cache emptied while a
 * free is pending; an allocation that completes pending frees; the rest
 * freed and the cache emptied again. */
static void shrink_run(harness *h) {
  h_free(h, 0, NULL);
  h_free(h, 2, NULL);
  h_free(h, 4, NULL);
  h_free(h, 6, NULL);
  h_free(h, 11, h->side);
  h_record(h, 1, h->side);
  h_free(h, 1, NULL);
  h_free(h, 3, h->side); /* allocated on the default stream */
  h_free(h, 10, NULL);   /* allocated on the side stream */
  h_empty_cache(h);
  h_free(h, 5, h->side);
  h_malloc(h, 20, 256 * TU_KiB, NULL, SUCCEED);
  h_malloc(h, 21, 3 * TU_MiB, h->side, SUCCEED);
  h_free(h, 9, NULL);
  h_free(h, 8, NULL);
  h_empty_cache(h);
  h_free_all(h);
  h_empty_cache(h);
}

/* A 64 MiB device: five 12 MiB blocks fill it, a sixth does not fit; with
 * three of them freed (cached), 24 MiB fits only once the cache is given
 * back; then 20 MiB does not fit at all. The blocks freed leave no free
 * block of 24 MiB: with expandable segments, blocks 0, 2 and 4 (holes in
 * the virtual range); with fixed ones 0, 1 and 4, since the emulated
 * device backs a handle with contiguous memory: the new 24 MiB segment
 * needs a free run that long once the cached segments are released. */
static void oom_run(harness *h) {
  h->oom_scenario = true;
  for (int k = 0; k < 5; k++) h_malloc(h, k, 12 * TU_MiB, NULL, SUCCEED);
  h_malloc(h, 5, 12 * TU_MiB, NULL, MUST_OOM);
  h_free(h, 0, NULL);
  h_free(h, h->expandable ? 2 : 1, NULL);
  h_free(h, 4, h->side);
  h_malloc(h, 6, 24 * TU_MiB, NULL, SUCCEED);
  h_malloc(h, 7, 20 * TU_MiB, NULL, MUST_OOM);
  h_malloc(h, 8, 256 * TU_KiB, h->side, MAY_OOM);
  h_free_all(h);
  h_empty_cache(h);
}

/* Concatenation, as a growing cache: each step allocates a block two pages
 * larger than the last and frees the last, with a small block after each
 * so the holes stay apart. Under the limit, growth must unmap the free pages
 * of the holes first: the first time after a stream synchronization, later
 * without one, through the idle marks (events the host backend completes
 * at once). On the side stream too, whose free pages are another arena's. */
static void recycle_run(harness *h) {
  for (int i = 0; i < 6; i++) {
    int k = 2 + i % 2;
    h_malloc(h, k, (size_t)(4 + 4 * i) * TU_MiB, i < 3 ? NULL : h->side, SUCCEED);
    if (i > 0) h_free(h, 2 + (i - 1) % 2, i - 1 < 3 ? NULL : h->side);
    h_malloc(h, 10 + i, 600 * TU_KiB + 2 * TU_MiB, i < 3 ? NULL : h->side, SUCCEED);
  }
  h_free_all(h);
  h_empty_cache(h);
}

static const scenario scenarios[] = {
    {"grow", "host_capacity:1GiB", no_setup, grow_run},
    {"shrink", "host_capacity:1GiB", shrink_setup, shrink_run},
    {"oom", "host_capacity:64MiB", no_setup, oom_run},
    {"recycle", "host_capacity:1GiB,memory_limit:80MiB", no_setup, recycle_run},
    /* Handles of 2 pages for requests of 8 MiB or more (handle_size_mb). */
    {"grow-large-handles", "host_capacity:1GiB,handle_size_mb:4,handle_threshold_mb:0", no_setup,
     grow_run},
    {"shrink-large-handles", "host_capacity:1GiB,handle_size_mb:4,handle_threshold_mb:0",
     shrink_setup, shrink_run},
    {"recycle-large-handles",
     "host_capacity:1GiB,memory_limit:80MiB,handle_size_mb:4,handle_threshold_mb:0", no_setup,
     recycle_run},
};

/* ------------------------------------------------------------------------ */
/* Runs                                                                      */
/* ------------------------------------------------------------------------ */

static uint64_t calls(harness *h, tide_backend_op op) { return tide_host_call_count(h->a, op); }

/* The call sites of the allocator's backend so far. */
typedef struct site_counts {
  _tide_host_site items[MAX_SITES];
  size_t n;
} site_counts;

static void read_sites(harness *h, site_counts *out) {
  out->n = _tide_host_sites(&h->a->backend, out->items, MAX_SITES);
  if (out->n > MAX_SITES) fail_msg("%zu backend call sites, room for %d", out->n, MAX_SITES);
}

static const _tide_host_site *find_site(const site_counts *c, tide_backend_op op, uintptr_t at) {
  for (size_t i = 0; i < c->n; i++)
    if (c->items[i].op == op && c->items[i].site == at) return &c->items[i];
  return NULL;
}

/* Add what the sites did between two readings to the tally. */
static void tally_sites(const site_counts *before, const site_counts *after) {
  for (size_t i = 0; i < after->n; i++) {
    const _tide_host_site *now = &after->items[i];
    const _tide_host_site *then = find_site(before, now->op, now->site);
    uint64_t called = now->calls - (then ? then->calls : 0);
    uint64_t failed = now->failures - (then ? then->failures : 0);
    if (called == 0) continue;
    size_t k = 0;
    while (k < nsites && !(sites[k].op == now->op && sites[k].site == now->site)) k++;
    if (k == nsites) {
      if (nsites == MAX_SITES) fail_msg("more than %d call sites", MAX_SITES);
      sites[nsites++] = (site_tally){.op = now->op, .site = now->site};
    }
    sites[k].runs++;
    sites[k].failures += failed;
  }
}

/* Successful calls of `op`, if `failed` is the op whose call failed (the
 * second fault's op failed too, if reached). */
static int64_t succeeded(harness *h, tide_backend_op op, tide_backend_op failed) {
  int64_t failures =
      (op == failed) + (op == h->op2 && h->second_hit) + (op == h->op2 && h->retry_hit);
  return (int64_t)calls(h, op) - failures;
}

/* Every range reserved was unreserved, if `failed` is the op that failed
 * (NO_FAULT: none), and the device holds no mapping (unmap calls are not
 * counted against maps: one call may end a run of them). Only injected
 * faults make these calls fail here; create also fails when the small
 * device is full, so handles are checked by the bytes the device holds
 * instead. */
static bool balanced(harness *h, tide_backend_op failed) {
  return succeeded(h, TIDE_OP_RESERVE, failed) == succeeded(h, TIDE_OP_UNRESERVE, failed) &&
         tide_host_mappings(h->a) == 0;
}

static void check_balanced(harness *h) {
  bool ok;
  if (!h->hit) {
    ok = balanced(h, NO_FAULT);
  } else if (h->failed != NO_FAULT) {
    ok = balanced(h, h->failed);
  } else { /* TIDE_OP_ANY absorbed: one of the ops of that call failed */
    ok = false;
    for (int op = 1; op < TIDE_OP_COUNT && !ok; op++)
      if (h->hit_ops & (1ull << op)) ok = balanced(h, (tide_backend_op)op);
  }
  if (!ok)
    fail_msg("%s: after freeing everything: reserve %llu / unreserve %llu, create %llu / "
             "release %llu, map %llu / unmap %llu calls, %llu mappings left (injected failure in "
             "%s%s%s): a range or "
             "mapping was left behind, or a call failed without an injected fault (a backend "
             "precondition broken)",
             h->where, (unsigned long long)calls(h, TIDE_OP_RESERVE),
             (unsigned long long)calls(h, TIDE_OP_UNRESERVE),
             (unsigned long long)calls(h, TIDE_OP_CREATE),
             (unsigned long long)calls(h, TIDE_OP_RELEASE),
             (unsigned long long)calls(h, TIDE_OP_MAP), (unsigned long long)calls(h, TIDE_OP_UNMAP),
             (unsigned long long)tide_host_mappings(h->a),
             h->failed == NO_FAULT ? "an unknown op" : tide_backend_op_name(h->failed),
             h->second_hit ? " and " : "", h->second_hit ? tide_backend_op_name(h->op2) : "");
}

/* Pieces of memory the backend refused to give back, kept for a retry. */
static size_t orphans_of(harness *h) {
  _tide_arena **arenas = NULL;
  size_t n = _tide_arenas_snapshot(h->a, &arenas);
  size_t orphans = 0;
  for (size_t i = 0; i < n; i++) {
    _tide_lock_acquire(&arenas[i]->lock);
    orphans += arenas[i]->norphans;
    _tide_lock_release(&arenas[i]->lock);
  }
  free(arenas);
  return orphans;
}

static void check_no_orphans(harness *h) {
  size_t orphans = orphans_of(h);
  if (orphans)
    fail_msg("%s: %zu orphan(s) left after the cache was emptied with no fault armed", h->where,
             orphans);
}

/* The faults of a run: the n-th call of op (NO_FAULT: none) and, if op2 is
 * not NO_FAULT, its n2-th call, meant to come later in the same API call
 * (an undo step, or a fallback); with `retry`, also the next call of op2
 * after that one (the retry of what the failed step left behind). */
typedef struct fault_plan {
  tide_backend_op op;
  uint64_t n;
  tide_backend_op op2;
  uint64_t n2;
  bool retry;
  bool later; /* the second fault may come in a later API call than the first */
} fault_plan;

#define PLAN_NONE ((fault_plan){.op = NO_FAULT, .op2 = NO_FAULT})
#define PLAN_ONE(o, k) ((fault_plan){.op = (o), .n = (k), .op2 = NO_FAULT})

typedef struct run_result {
  bool reached, second, retried;      /* the first fault, the second, the retry's were hit */
  uint64_t used[TIDE_OP_COUNT];       /* calls the scenario made, per op */
  uint64_t before_hit[TIDE_OP_COUNT]; /* ... before the API call the first fault hit */
  uint64_t at_failure[TIDE_OP_COUNT]; /* ... when the last injected failure fired */
} run_result;

/* One run of a scenario with the faults of `plan`; returns whether the
 * first fault was reached, and fills `out` if not NULL. */
static bool run_once(const scenario *sc, bool expandable, fault_plan plan, run_result *out) {
  tide_backend_op op = plan.op, op2 = plan.op2;
  uint64_t n = plan.n;
  char conf[160], where[128];
  snprintf(conf, sizeof conf, "expandable_segments:%s,%s", expandable ? "True" : "False", sc->conf);
  snprintf(where, sizeof where, "%s/%s, %s call %llu fails%s%s%s", sc->name,
           expandable ? "expandable" : "fixed", op == NO_FAULT ? "no" : tide_backend_op_name(op),
           (unsigned long long)n, op2 == NO_FAULT ? "" : " and then ",
           op2 == NO_FAULT ? "" : tide_backend_op_name(op2), plan.retry ? ", and its retry" : "");
  harness *h = calloc(1, sizeof *h);
  assert_non_null(h);
  h->where = where;
  h->expandable = expandable;
  h->op = h->op2 = NO_FAULT;
  h->failed = NO_FAULT;
  h->a = tu_create(conf);
  tu_assert_ok(tide_stream_create(h->a, &h->side));
  sc->setup(h);
  check_consistent(h);

  uint64_t start[TIDE_OP_COUNT];
  for (int o = 0; o < TIDE_OP_COUNT; o++) start[o] = calls(h, (tide_backend_op)o);
  if (op != NO_FAULT) {
    h->op = op;
    h->n = n;
    h->armed_at = calls(h, op);
    tu_assert_ok(tide_host_fail_call(h->a, op, n));
  }
  if (op2 != NO_FAULT) {
    h->op2 = op2;
    h->n2 = plan.n2;
    h->retry = plan.retry;
    h->second_later = plan.later;
    h->armed_at2 = calls(h, op2);
    tu_assert_ok(tide_host_fail_call(h->a, op2, plan.n2));
  }
  site_counts *before = malloc(sizeof *before), *after = malloc(sizeof *after);
  assert_non_null(before);
  assert_non_null(after);
  read_sites(h, before);
  sc->run(h);
  read_sites(h, after);
  if (op != NO_FAULT) tally_sites(before, after);
  free(before);
  free(after);
  bool reached = fault_reached(h);
  assert_true(reached == h->hit);
  h->second_hit = second_reached(h);
  if (out) {
    out->reached = reached;
    out->second = h->second_hit;
    out->retried = h->retry_hit;
    for (int o = 0; o < TIDE_OP_COUNT; o++) {
      out->used[o] = calls(h, (tide_backend_op)o) - start[o];
      out->before_hit[o] = h->hit ? h->before_hit[o] - start[o] : 0;
      uint64_t at = _tide_host_calls_at_failure(&h->a->backend, (tide_backend_op)o);
      out->at_failure[o] = at > start[o] ? at - start[o] : 0;
    }
  }

  /* Disarmed, everything must come back. */
  if (op != NO_FAULT) tu_assert_ok(tide_host_fail_call(h->a, op, 0));
  if (op2 != NO_FAULT) tu_assert_ok(tide_host_fail_call(h->a, op2, 0));
  h->op = NO_FAULT; /* op2 stays set: the balance counts its failure */
  for (int k = 0; k < SLOTS; k++)
    if (h->slots[k].used) {
      tu_assert_ok(tide_free(h->a, h->slots[k].ptr, h->slots[k].stream));
      h->slots[k].used = false;
    }
  tu_assert_ok(tide_empty_cache(h->a));
  check_consistent(h);
  tide_stats st = tu_stats(h->a);
  if (st.reserved_bytes[0].current != 0 || tide_host_bytes_in_use(h->a) != 0 ||
      st.segments[0].current != 0 || st.active_bytes[0].current != 0)
    fail_msg("%s: after freeing everything and emptying the cache: reserved %lld, device "
             "holds %llu, %lld segments, %lld active bytes",
             where, (long long)st.reserved_bytes[0].current,
             (unsigned long long)tide_host_bytes_in_use(h->a), (long long)st.segments[0].current,
             (long long)st.active_bytes[0].current);
  if (st.num_device_alloc != st.num_device_free)
    fail_msg("%s: num_device_alloc %llu != num_device_free %llu with nothing held", where,
             (unsigned long long)st.num_device_alloc, (unsigned long long)st.num_device_free);
  check_balanced(h);
  check_no_orphans(h);
  tu_assert_ok(tide_stream_destroy(h->a, h->side));
  tu_assert_ok(tide_destroy(h->a));
  free(h);
  return reached;
}

/* n = 1, 2, ... for op until the scenario no longer reaches an n-th call. */
static unsigned sweep_op(const scenario *sc, bool expandable, tide_backend_op op) {
  unsigned hits = 0;
  for (uint64_t n = 1; run_once(sc, expandable, PLAN_ONE(op, n), NULL); n++) {
    hits++;
    if (n > 2000)
      fail_msg("%s: op %s still reached after %llu calls", sc->name, tide_backend_op_name(op),
               (unsigned long long)n);
  }
  return hits;
}

static void sweep(const scenario *sc, bool expandable) {
  run_result base;
  const uint64_t *used = base.used;
  /* The baseline: every step as expected. */
  run_once(sc, expandable, PLAN_NONE, &base);
  unsigned total = 0;
  for (int op = 0; op < TIDE_OP_COUNT; op++) {
    unsigned hits = sweep_op(sc, expandable, (tide_backend_op)op);
    /* Every call the baseline made is a fault point, and only those. */
    if (hits != used[op])
      fail_msg("%s/%s: %u fault points of %s, but the run makes %llu calls", sc->name,
               expandable ? "expandable" : "fixed", hits, tide_backend_op_name((tide_backend_op)op),
               (unsigned long long)used[op]);
    total += hits;
  }
  print_message("%s/%s: %u fault points (%llu reserve, %llu create, %llu map, %llu set_access, "
                "%llu unmap, %llu release, %llu unreserve, %llu event calls)\n",
                sc->name, expandable ? "expandable" : "fixed", total,
                (unsigned long long)used[TIDE_OP_RESERVE], (unsigned long long)used[TIDE_OP_CREATE],
                (unsigned long long)used[TIDE_OP_MAP], (unsigned long long)used[TIDE_OP_SET_ACCESS],
                (unsigned long long)used[TIDE_OP_UNMAP], (unsigned long long)used[TIDE_OP_RELEASE],
                (unsigned long long)used[TIDE_OP_UNRESERVE],
                (unsigned long long)(used[TIDE_OP_EVENT_CREATE] + used[TIDE_OP_EVENT_RECORD] +
                                     used[TIDE_OP_EVENT_QUERY] + used[TIDE_OP_EVENT_SYNCHRONIZE]));
}

/* ------------------------------------------------------------------------ */
/* Tests                                                                     */
/* ------------------------------------------------------------------------ */

static void faults_grow_expandable(void **state) {
  (void)state;
  sweep(&scenarios[0], true);
}
static void faults_grow_fixed(void **state) {
  (void)state;
  sweep(&scenarios[0], false);
}
static void faults_shrink_expandable(void **state) {
  (void)state;
  sweep(&scenarios[1], true);
}
static void faults_shrink_fixed(void **state) {
  (void)state;
  sweep(&scenarios[1], false);
}
static void faults_recycle_expandable(void **state) {
  (void)state;
  sweep(&scenarios[3], true);
}
static void faults_grow_large_handles(void **state) {
  (void)state;
  sweep(&scenarios[4], true);
}
static void faults_shrink_large_handles(void **state) {
  (void)state;
  sweep(&scenarios[5], true);
}
static void faults_recycle_large_handles(void **state) {
  (void)state;
  sweep(&scenarios[6], true);
}
static void faults_oom_expandable(void **state) {
  (void)state;
  sweep(&scenarios[2], true);
}
static void faults_oom_fixed(void **state) {
  (void)state;
  sweep(&scenarios[2], false);
}

/* A step of growth fails, and then so does the first call that would undo
 * it: the undo keeps what the device refused (an orphan) and the next
 * tide_empty_cache gives it back. */
static void undo_sweep(const scenario *sc, bool expandable) {
  static const tide_backend_op first[] = {TIDE_OP_RESERVE, TIDE_OP_CREATE, TIDE_OP_MAP,
                                          TIDE_OP_SET_ACCESS};
  static const tide_backend_op undo[] = {TIDE_OP_UNMAP, TIDE_OP_RELEASE, TIDE_OP_UNRESERVE};
  unsigned reached[3] = {0}, retried[3] = {0}, runs = 0;
  for (int retry = 0; retry < 2; retry++)
    for (size_t i = 0; i < sizeof first / sizeof first[0]; i++)
      for (size_t j = 0; j < 3; j++) {
        run_result r;
        fault_plan plan = {first[i], 1, undo[j], 1, retry, false};
        for (; run_once(sc, expandable, plan, &r); plan.n++) {
          reached[j] += r.second;
          retried[j] += r.retried;
          runs++;
        }
      }
  print_message("undo/%s/%s: %u runs; an undo step failed: unmap %u, release %u, unreserve %u; "
                "and so did its retry: %u, %u, %u\n",
                sc->name, expandable ? "expandable" : "fixed", runs, reached[0], reached[1],
                reached[2], retried[0], retried[1], retried[2]);
  assert_true(reached[0] > 0 && retried[0] > 0);
  assert_true(reached[1] > 0 && retried[1] > 0);
  /* An expandable range is never undone. */
  if (!expandable) assert_true(reached[2] > 0 && retried[2] > 0);
}

/* A failure whose handling makes another backend call, and that call fails
 * too: a free on another stream whose event cannot be created or recorded
 * waits for the stream instead, and that wait fails; a fixed segment whose
 * handle the device will not release is still unreserved, and that fails;
 * after a growth that could not map, the next growth must release a block
 * freed since the newest idle mark and waits for the stream, and that wait
 * fails (the only way to that wait in these scenarios). A probe run with
 * only the first failure shows how many calls of the second operation came
 * before it; the next one is failed as well, or with `every_later`, each
 * later one in turn. */
typedef struct second_fault {
  const scenario *sc;
  tide_backend_op first, second;
  bool fixed_only; /* expandable segments unreserve a range only once it is empty */
  bool every_later;
} second_fault;

static void second_sweep(bool expandable) {
  const second_fault pairs[] = {
      {&scenarios[1], TIDE_OP_EVENT_CREATE, TIDE_OP_STREAM_SYNCHRONIZE, false, false},
      {&scenarios[1], TIDE_OP_EVENT_RECORD, TIDE_OP_STREAM_SYNCHRONIZE, false, false},
      {&scenarios[1], TIDE_OP_RELEASE, TIDE_OP_UNRESERVE, true, false},
      {&scenarios[2], TIDE_OP_RELEASE, TIDE_OP_UNRESERVE, true, false},
      {&scenarios[2], TIDE_OP_MAP, TIDE_OP_STREAM_SYNCHRONIZE, false, true},
  };
  unsigned runs = 0, second[sizeof pairs / sizeof pairs[0]] = {0};
  for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) {
    run_result probe;
    const second_fault *p = &pairs[i];
    if (p->fixed_only && expandable) continue;
    for (uint64_t n = 1; run_once(p->sc, expandable, PLAN_ONE(p->first, n), &probe); n++) {
      fault_plan plan = {p->first,      n, p->second, probe.at_failure[p->second] + 1, false,
                         p->every_later};
      run_result r;
      do {
        assert_true(run_once(p->sc, expandable, plan, &r));
        second[i] += r.second;
        runs++;
        plan.n2++;
      } while (p->every_later && r.second);
    }
    print_message("second/%s: %s then %s in %s: %u of the runs failed both\n",
                  expandable ? "expandable" : "fixed", tide_backend_op_name(p->first),
                  tide_backend_op_name(p->second), p->sc->name, second[i]);
  }
  /* Waiting instead of an event is the same with both segment kinds. */
  assert_true(second[0] > 0 && second[1] > 0);
  if (!expandable) assert_true(second[2] + second[3] > 0);
  assert_true(second[4] > 0);
}

static void faults_undo_expandable(void **state) {
  (void)state;
  undo_sweep(&scenarios[0], true);
}
static void faults_undo_fixed(void **state) {
  (void)state;
  undo_sweep(&scenarios[0], false);
}
static void faults_undo_large_handles(void **state) {
  (void)state;
  undo_sweep(&scenarios[4], true);
}
static void faults_second_expandable(void **state) {
  (void)state;
  second_sweep(true);
}
static void faults_second_fixed(void **state) {
  (void)state;
  second_sweep(false);
}

/* ------------------------------------------------------------------------ */
/* Single failures, each a small reproducer of what the sweeps check         */
/* ------------------------------------------------------------------------ */

/* A free on another stream whose event cannot be created waits for that
 * stream instead and succeeds; when waiting fails too, the free fails, keeps
 * the block, and says why: the backend's message must survive in it. */
static void faults_free_message_names_cause(void **state) {
  (void)state;
  tide_allocator *a = tu_create("host_capacity:1GiB");
  tide_stream side;
  tu_assert_ok(tide_stream_create(a, &side));
  void *p = tide_malloc(a, TU_MiB, NULL);
  assert_non_null(p);
  tu_fill(p, TU_MiB, 1, TU_PATTERN_DEFAULT);
  uint64_t syncs = tide_host_call_count(a, TIDE_OP_STREAM_SYNCHRONIZE);
  tu_assert_ok(tide_host_fail_call(a, TIDE_OP_EVENT_CREATE, 1));
  tu_assert_ok(tide_free(a, p, side));
  assert_int_equal(tide_host_call_count(a, TIDE_OP_STREAM_SYNCHRONIZE), syncs + 1);
  /* Waited for: the block is reusable at once. */
  void *q = tide_malloc(a, TU_MiB, NULL);
  assert_ptr_equal(q, p);
  tu_fill(q, TU_MiB, 2, TU_PATTERN_DEFAULT);
  tu_assert_ok(tide_host_fail_call(a, TIDE_OP_EVENT_CREATE, 1));
  tu_assert_ok(tide_host_stream_hold(a, side));
  tu_assert_status(tide_free(a, q, side), TIDE_ERR_NOT_READY);
  tu_assert_last_error(TIDE_ERR_NOT_READY, "is held");
  tu_assert_last_error(TIDE_ERR_NOT_READY, "still allocated");
  tu_assert_ok(tide_block_info(a, q, NULL, NULL, NULL));
  tu_assert_pattern(q, TU_MiB, 2, TU_PATTERN_DEFAULT);
  tu_assert_ok(tide_host_stream_release(a, side));
  tu_assert_ok(tide_free(a, q, side));
  tu_assert_ok(tide_empty_cache(a));
  assert_int_equal(tide_host_bytes_in_use(a), 0);
  tu_assert_ok(tide_stream_destroy(a, side));
  tu_assert_ok(tide_destroy(a));
}

/* Pages created for an allocation that then fails, and released again, are
 * device allocations and device frees alike. */
static void faults_device_counters_match(void **state) {
  (void)state;
  tide_allocator *a = tu_create("host_capacity:1GiB,expandable_segments:True");
  tu_assert_ok(tide_host_fail_call(a, TIDE_OP_SET_ACCESS, 1));
  assert_null(tide_malloc(a, 3 * TU_MiB, NULL)); /* two pages created, then undone */
  tu_assert_last_error(TIDE_ERR_BACKEND, "injected failure: set_access");
  tide_stats st = tu_stats(a);
  assert_int_equal(tide_host_bytes_in_use(a), 0);
  if (st.num_device_alloc != st.num_device_free)
    fail_msg("after a failed allocation whose pages were released: num_device_alloc %llu, "
             "num_device_free %llu (create calls %llu, release calls %llu)",
             (unsigned long long)st.num_device_alloc, (unsigned long long)st.num_device_free,
             (unsigned long long)tide_host_call_count(a, TIDE_OP_CREATE),
             (unsigned long long)tide_host_call_count(a, TIDE_OP_RELEASE));
  tu_assert_ok(tide_destroy(a));
}

/* A page whose mapping the device refused to undo is kept for a retry; the
 * allocator must not map new memory over it meanwhile, nor give back the
 * range around it while it is still mapped. */
static void faults_refused_unmap_keeps_range_usable(void **state) {
  (void)state;
  tide_allocator *a = tu_create("host_capacity:1GiB,expandable_segments:True");
  tu_assert_ok(tide_host_fail_call(a, TIDE_OP_SET_ACCESS, 1));
  tu_assert_ok(tide_host_fail_call(a, TIDE_OP_UNMAP, 1));
  assert_null(tide_malloc(a, TU_MiB, NULL)); /* set_access fails, then its undo's unmap */
  tu_assert_last_error(TIDE_ERR_BACKEND, "injected failure: set_access");
  assert_int_equal(tu_stats(a).reserved_bytes[0].current, (int64_t)tide_host_bytes_in_use(a));

  /* No fault is armed now: the next allocation must work. */
  void *p = tide_malloc(a, TU_MiB, NULL);
  if (!p)
    fail_msg("tide_malloc after a refused unmap failed with %s: %s",
             tide_status_name(tide_last_status()), tide_last_error());
  tu_fill(p, TU_MiB, 2, TU_PATTERN_DEFAULT);
  tu_assert_pattern(p, TU_MiB, 2, TU_PATTERN_DEFAULT);
  tu_assert_ok(tide_free(a, p, NULL));
  tu_assert_ok(tide_empty_cache(a));
  assert_int_equal(tide_host_bytes_in_use(a), 0);
  assert_int_equal(tu_stats(a).reserved_bytes[0].current, 0);
  tu_assert_ok(tide_destroy(a));
}

/* The same, with the retry of the refused unmap refused as well: growth
 * that wants the page still mapped there takes it as it is (mapping over it
 * would fail) instead of failing the allocation with a backend error. */
static void faults_refused_unmap_twice_page_adopted(void **state) {
  (void)state;
  tide_allocator *a = tu_create("host_capacity:1GiB,expandable_segments:True");
  tu_assert_ok(tide_host_fail_call(a, TIDE_OP_SET_ACCESS, 1));
  tu_assert_ok(tide_host_fail_call(a, TIDE_OP_UNMAP, 1));
  assert_null(tide_malloc(a, TU_MiB, NULL));
  tu_assert_last_error(TIDE_ERR_BACKEND, "injected failure: set_access");
  tu_assert_ok(tide_host_fail_call(a, TIDE_OP_UNMAP, 1)); /* the retry fails too */
  uint64_t unmaps = tide_host_call_count(a, TIDE_OP_UNMAP);
  void *p = tide_malloc(a, TU_MiB, NULL);
  if (!p)
    fail_msg("tide_malloc with a page still mapped where it grows failed with %s: %s",
             tide_status_name(tide_last_status()), tide_last_error());
  assert_int_equal(tide_host_call_count(a, TIDE_OP_UNMAP), unmaps + 1); /* the retry was made */
  tu_fill(p, TU_MiB, 3, TU_PATTERN_DEFAULT);
  tu_assert_ok(tide_check(a));
  tu_assert_pattern(p, TU_MiB, 3, TU_PATTERN_DEFAULT);
  tu_assert_ok(tide_free(a, p, NULL));
  tu_assert_ok(tide_empty_cache(a));
  tu_assert_ok(tide_check(a));
  assert_int_equal(tide_host_bytes_in_use(a), 0);
  assert_int_equal(tu_stats(a).reserved_bytes[0].current, 0);
  tu_assert_ok(tide_destroy(a));
}

/* tide_empty_cache meets two failures: a free waits on a held stream
 * (TIDE_ERR_NOT_READY), then an unmap is refused (TIDE_ERR_BACKEND). It
 * returns the first, and the message must be the first's too, not the
 * last one's. */
static void faults_first_failure_keeps_its_message(void **state) {
  (void)state;
  tide_allocator *a = tu_create("host_capacity:1GiB,expandable_segments:True");
  tide_stream side;
  tu_assert_ok(tide_stream_create(a, &side));
  void *p = tide_malloc(a, 4 * TU_MiB, NULL);
  void *q = tide_malloc(a, 4 * TU_MiB, NULL);
  assert_non_null(p);
  assert_non_null(q);
  tu_assert_ok(tide_free(a, q, NULL)); /* cached: its pages will be unmapped */
  tu_assert_ok(tide_host_stream_hold(a, side));
  tu_assert_ok(tide_free(a, p, side)); /* waits for the held stream */
  tu_assert_ok(tide_host_fail_call(a, TIDE_OP_UNMAP, 1));
  uint64_t unmaps = tide_host_call_count(a, TIDE_OP_UNMAP);
  tide_clear_error();
  tide_status rc = tide_empty_cache(a);
  assert_true(tide_host_call_count(a, TIDE_OP_UNMAP) > unmaps); /* both failures happened */
  tu_assert_status(rc, TIDE_ERR_NOT_READY);
  if (tide_last_status() != rc)
    fail_msg("tide_empty_cache returned %s, but the message is of %s: %s", tide_status_name(rc),
             tide_status_name(tide_last_status()), tide_last_error());
  tu_assert_last_error(TIDE_ERR_NOT_READY, "held");
  tu_assert_ok(tide_check(a));
  tu_assert_ok(tide_host_stream_release(a, side));
  tu_assert_ok(tide_empty_cache(a));
  assert_int_equal(tide_host_bytes_in_use(a), 0);
  tu_assert_ok(tide_stream_destroy(a, side));
  tu_assert_ok(tide_destroy(a));
}

/* Giving the cache back with a refused mapping still pending: the range
 * around it is unreserved only once nothing is mapped in it, so each range
 * is unreserved by exactly one call (the backend refuses an unreserve of a
 * range with memory mapped in it, as the CUDA driver does). */
/* Every range reserved was unreserved with one call: none was tried while
 * memory was still mapped in it (the backend refuses that). */
static void assert_one_unreserve_per_range(tide_allocator *a) {
  if (tide_host_call_count(a, TIDE_OP_UNRESERVE) != tide_host_call_count(a, TIDE_OP_RESERVE))
    fail_msg("%llu range(s) reserved, %llu unreserve calls: an unreserve was tried while "
             "memory was still mapped in the range",
             (unsigned long long)tide_host_call_count(a, TIDE_OP_RESERVE),
             (unsigned long long)tide_host_call_count(a, TIDE_OP_UNRESERVE));
}

static void faults_unreserve_after_orphans(void **state) {
  (void)state;
  tide_allocator *a = tu_create("host_capacity:1GiB,expandable_segments:True");
  tu_assert_ok(tide_host_fail_call(a, TIDE_OP_SET_ACCESS, 1));
  tu_assert_ok(tide_host_fail_call(a, TIDE_OP_UNMAP, 1));
  assert_null(tide_malloc(a, TU_MiB, NULL));
  tu_assert_ok(tide_empty_cache(a));
  assert_int_equal(tide_host_bytes_in_use(a), 0);
  assert_int_equal(tu_stats(a).segments[0].current, 0);
  assert_one_unreserve_per_range(a);
  tu_assert_ok(tide_destroy(a));
}

/* A buffer destroyed while the backend refuses to unmap its page leaves the
 * mapping and its range as orphans. While the unmap is still refused, the
 * range must wait for it: unreserving a range with memory mapped in it fails
 * on its own, and when it is the last failure that failure, not the one the
 * backend gave, is what tide_empty_cache reports (found by fuzz_ops). */
static void faults_buffer_range_waits_for_its_mapping(void **state) {
  (void)state;
  tide_allocator *a = tu_create("host_capacity:1GiB,expandable_segments:True");
  tide_buf_options o;
  tide_buf_options_init(&o);
  o.capacity = 8 * TU_MiB;
  tide_buf *b = NULL;
  tu_assert_ok(tide_buf_create(a, &o, &b));
  tu_assert_ok(tide_buf_resize(b, TU_MiB, NULL));
  tu_assert_ok(tide_host_fail_call(a, TIDE_OP_UNMAP, 1));
  tu_assert_ok(tide_buf_destroy(b));
  tu_assert_ok(tide_host_fail_call(a, TIDE_OP_UNMAP, 1)); /* the first retry's */
  tu_assert_ok(tide_empty_cache(a));                      /* the second succeeds */
  assert_int_equal(tide_host_bytes_in_use(a), 0);
  assert_int_equal(tide_host_mappings(a), 0);
  assert_one_unreserve_per_range(a);
  tu_assert_ok(tide_destroy(a));
}

/* Every operation of the paths failed somewhere, reported or handled. It
 * reads the tally of the tests before it, so it runs last. */
static void faults_every_op_failed(void **state) {
  (void)state;
  static const tide_backend_op required[] = {
      TIDE_OP_RESERVE,      TIDE_OP_UNRESERVE,    TIDE_OP_CREATE,      TIDE_OP_RELEASE,
      TIDE_OP_MAP,          TIDE_OP_SET_ACCESS,   TIDE_OP_UNMAP,       TIDE_OP_STREAM_SYNCHRONIZE,
      TIDE_OP_EVENT_CREATE, TIDE_OP_EVENT_RECORD, TIDE_OP_EVENT_QUERY, TIDE_OP_EVENT_SYNCHRONIZE,
      TIDE_OP_MEM_INFO,     TIDE_OP_ANY,
  };
  unsigned points = 0;
  for (int op = 0; op < TIDE_OP_COUNT; op++) {
    points += tally[op].points;
    if (tally[op].points)
      print_message("%-20s %4u fault points: %4u reported, %4u handled\n",
                    tide_backend_op_name((tide_backend_op)op), tally[op].points, tally[op].reported,
                    tally[op].absorbed);
  }
  print_message("%u fault points in all\n", points);
  for (size_t i = 0; i < sizeof required / sizeof required[0]; i++)
    if (tally[required[i]].points == 0)
      fail_msg("no call of %s was made to fail", tide_backend_op_name(required[i]));
}

/* Where a return address lies, as "function (file:line)" when addr2line can
 * say, else as an offset into its binary. */
static const char *describe_site(uintptr_t at, char *buf, size_t len) {
  Dl_info info;
  if (!dladdr((void *)at, &info) || !info.dli_fname) {
    snprintf(buf, len, "%#lx", (unsigned long)at);
    return buf;
  }
  uintptr_t offset = at - 1 - (uintptr_t)info.dli_fbase; /* the call, not the next instruction */
  snprintf(buf, len, "%s+%#lx", info.dli_fname, (unsigned long)offset);
  char command[1024], fn[256] = "", where[512] = "";
  snprintf(command, sizeof command, "addr2line -f -i -e '%s' %#lx 2>/dev/null", info.dli_fname,
           (unsigned long)offset);
  FILE *p = popen(command, "r");
  if (!p) return buf;
  /* -i: the innermost function first, then those it was inlined into. */
  size_t used = 0;
  while (fgets(fn, sizeof fn, p) && fgets(where, sizeof where, p) && where[0] != '?' &&
         used < len) {
    fn[strcspn(fn, "\n")] = '\0';
    where[strcspn(where, " \n")] = '\0';
    const char *file = strrchr(where, '/');
    used += (size_t)snprintf(buf + used, len - used, "%s%s (%s)", used ? " < " : "", fn,
                             file ? file + 1 : where);
  }
  pclose(p);
  return buf;
}

static int by_op_then_place(const void *x, const void *y) {
  const site_tally *a = x, *b = y;
  if (a->op != b->op) return (a->op > b->op) - (a->op < b->op);
  return (a->site > b->site) - (a->site < b->site);
}

/* Every call site a sweep reached with a fault armed was made to fail in
 * one of the runs: a site never failed is an error path nobody tested. It
 * reads the tally of the sweeps, so it runs after them. */
static void faults_every_call_site_failed(void **state) {
  (void)state;
  qsort(sites, nsites, sizeof *sites, by_op_then_place);
  size_t never = 0;
  char text[768];
  print_message("%zu call sites of backend operations reached with a fault armed:\n", nsites);
  for (size_t i = 0; i < nsites; i++) {
    never += sites[i].failures == 0;
    print_message("  %-18s %5u runs %5llu failed%s  %s\n", tide_backend_op_name(sites[i].op),
                  sites[i].runs, (unsigned long long)sites[i].failures,
                  sites[i].failures ? "" : " NEVER",
                  describe_site(sites[i].site, text, sizeof text));
  }
  print_message("%zu of %zu call sites failed at least once\n", nsites - never, nsites);
  assert_true(nsites > 0);
  if (never)
    fail_msg("%zu call site(s) of backend operations were reached but never made to fail (marked "
             "NEVER above): add a scenario or a sweep that fails them",
             never);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(faults_grow_expandable),
      cmocka_unit_test(faults_grow_fixed),
      cmocka_unit_test(faults_shrink_expandable),
      cmocka_unit_test(faults_shrink_fixed),
      cmocka_unit_test(faults_recycle_expandable),
      cmocka_unit_test(faults_grow_large_handles),
      cmocka_unit_test(faults_shrink_large_handles),
      cmocka_unit_test(faults_recycle_large_handles),
      cmocka_unit_test(faults_undo_large_handles),
      cmocka_unit_test(faults_oom_expandable),
      cmocka_unit_test(faults_oom_fixed),
      cmocka_unit_test(faults_undo_expandable),
      cmocka_unit_test(faults_undo_fixed),
      cmocka_unit_test(faults_second_expandable),
      cmocka_unit_test(faults_second_fixed),
      cmocka_unit_test(faults_free_message_names_cause),
      cmocka_unit_test(faults_device_counters_match),
      cmocka_unit_test(faults_refused_unmap_keeps_range_usable),
      cmocka_unit_test(faults_refused_unmap_twice_page_adopted),
      cmocka_unit_test(faults_first_failure_keeps_its_message),
      cmocka_unit_test(faults_unreserve_after_orphans),
      cmocka_unit_test(faults_buffer_range_waits_for_its_mapping),
      cmocka_unit_test(faults_every_op_failed),
      cmocka_unit_test(faults_every_call_site_failed),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
