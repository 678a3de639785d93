/* placement_floor.c: how far above the live peak a trace's blocks reach
 * when nothing is ever unmapped, under four textbook placements (first,
 * best, last and worst fit over address-ordered free blocks that merge),
 * blocks above 1 MiB in one range and the rest in another, each range's
 * high water rounded up to 2 MiB pages. A placement whose high water stays
 * within 1.02 x the live peak would keep the goal with no remapping at all;
 * none does on the streaming model's trace (docs/design.md, "The remapping
 * that keeps 1.02").
 *   cc -O2 -o /tmp/placement_floor experiments/placement_floor.c
 *   zcat bench/traces/stream_gct_96.csv.gz | /tmp/placement_floor 0   (0-3) */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
typedef struct {
  uint64_t a, s;
} blk;
typedef struct {
  blk *f;
  size_t n, cap;
  uint64_t hw;
} range;
static int policy; /* 0 first, 1 best, 2 last, 3 worst fit */
static uint64_t take(range *r, uint64_t s) {
  size_t best = (size_t)-1;
  for (size_t i = 0; i < r->n; i++)
    if (r->f[i].s >= s) {
      if (policy == 0) {
        best = i;
        break;
      }
      if (policy == 2) {
        best = i;
        continue;
      }
      if (policy == 3) {
        if (best == (size_t)-1 || r->f[i].s > r->f[best].s) best = i;
        continue;
      }
      if (best == (size_t)-1 || r->f[i].s < r->f[best].s) best = i;
    }
  if (best == (size_t)-1) {
    /* extend: a free block at the top joins */
    if (r->n && r->f[r->n - 1].a + r->f[r->n - 1].s == r->hw) {
      uint64_t a = r->f[r->n - 1].a;
      r->hw = a + s;
      r->n--;
      return a;
    }
    uint64_t a = r->hw;
    r->hw += s;
    return a;
  }
  uint64_t a = r->f[best].a;
  r->f[best].a += s;
  r->f[best].s -= s;
  if (!r->f[best].s) {
    memmove(&r->f[best], &r->f[best + 1], (r->n - best - 1) * sizeof(blk));
    r->n--;
  }
  return a;
}
static void give(range *r, uint64_t a, uint64_t s) {
  size_t i = 0;
  while (i < r->n && r->f[i].a < a) i++;
  if (r->n == r->cap) {
    r->cap = r->cap ? 2 * r->cap : 64;
    r->f = realloc(r->f, r->cap * sizeof(blk));
  }
  memmove(&r->f[i + 1], &r->f[i], (r->n - i) * sizeof(blk));
  r->f[i] = (blk){a, s};
  r->n++;
  if (i + 1 < r->n && r->f[i].a + r->f[i].s == r->f[i + 1].a) {
    r->f[i].s += r->f[i + 1].s;
    memmove(&r->f[i + 1], &r->f[i + 2], (r->n - i - 2) * sizeof(blk));
    r->n--;
  }
  if (i > 0 && r->f[i - 1].a + r->f[i - 1].s == r->f[i].a) {
    r->f[i - 1].s += r->f[i].s;
    memmove(&r->f[i], &r->f[i + 1], (r->n - i - 1) * sizeof(blk));
    r->n--;
  }
}
/* Records of live blocks, their slots reused once freed: a trace's live
 * blocks are few, its allocations many (4 million at 1024 frames). */
#define MAXL 4000000
static uint64_t pa[MAXL], ps[MAXL];
static int pr[MAXL];
static size_t nl, freed[MAXL], nfreed;
int main(int argc, char **argv) {
  policy = argc > 1 ? atoi(argv[1]) : 0;
  range R[2] = {{0}};
  char line[256];
  uint64_t live = 0, peak = 0, hwpk = 0;
  fgets(line, sizeof line, stdin);
  /* open addressing hash of live addresses */
  size_t H = 1 << 22;
  uint64_t *hk = calloc(H, 8);
  size_t *hv = calloc(H, sizeof(size_t));
  while (fgets(line, sizeof line, stdin)) {
    char act[16];
    unsigned long long t, addr, size;
    int st;
    if (sscanf(line, "%llu,%15[^,],%llu,%llu,%d", &t, act, &addr, &size, &st) != 5) continue;
    size_t h = (addr * 11400714819323198485ull) >> 42;
    if (act[0] == 'a') {
      uint64_t s = (size + 511) / 512 * 512;
      int k = s > (1 << 20);
      uint64_t a = take(&R[k], s);
      /* The first empty or freed slot: an address is live once at most. */
      while (hk[h] && hk[h] != (uint64_t)-1) h = (h + 1) & (H - 1);
      size_t rec = nfreed ? freed[--nfreed] : nl++;
      if (rec >= MAXL) {
        fprintf(stderr, "placement_floor: more than %d blocks live at once\n", MAXL);
        return 1;
      }
      hk[h] = addr + 1;
      hv[h] = rec;
      pa[rec] = a;
      ps[rec] = s;
      pr[rec] = k;
      live += s;
      if (live > peak) peak = live;
      uint64_t hw = 0;
      for (int j = 0; j < 2; j++) hw += (R[j].hw + (2 << 20) - 1) / (2 << 20) * (2 << 20);
      if (hw > hwpk) hwpk = hw;
    } else {
      while (hk[h] && hk[h] != addr + 1) h = (h + 1) & (H - 1);
      if (!hk[h]) continue;
      size_t i = hv[h];
      hk[h] = (uint64_t)-1; /* tombstone */
      freed[nfreed++] = i;
      give(&R[pr[i]], pa[i], ps[i]);
      live -= ps[i];
    }
  }
  printf("policy %s: peak live %.3f GiB, high water %.3f GiB, ratio %.4f\n",
         (const char *[]){"first", "best", "last", "worst"}[policy], peak / 1073741824.0,
         hwpk / 1073741824.0, (double)hwpk / peak);
  return 0;
}
