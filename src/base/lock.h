/* lock.h: the short spin lock that guards an arena. Critical sections are a
 * few dozen instructions, so spinning beats sleeping; after a while a waiter
 * yields the CPU so that an oversubscribed machine still makes progress. */
#ifndef TIDE_LOCK_H
#define TIDE_LOCK_H

#include <sched.h>

#include "base/internal.h"

#if defined(__x86_64__) || defined(__i386__)
#define TIDE_CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define TIDE_CPU_RELAX() __asm__ __volatile__("yield")
#else
#define TIDE_CPU_RELAX() ((void)0)
#endif

static inline void _tide_lock_init(_tide_lock *l) { atomic_init(&l->held, 0); }

/* One attempt: true when the lock is now held. */
static inline bool _tide_lock_try(_tide_lock *l) {
  return !atomic_exchange_explicit(&l->held, 1, memory_order_acquire);
}

static inline void _tide_lock_acquire(_tide_lock *l) {
  if (TIDE_LIKELY(_tide_lock_try(l))) return;
  for (unsigned spins = 0;; spins++) {
    while (atomic_load_explicit(&l->held, memory_order_relaxed)) {
      if (spins++ < 64)
        TIDE_CPU_RELAX();
      else
        sched_yield();
    }
    if (!atomic_exchange_explicit(&l->held, 1, memory_order_acquire)) return;
  }
}

static inline void _tide_lock_release(_tide_lock *l) {
  atomic_store_explicit(&l->held, 0, memory_order_release);
}

#endif /* TIDE_LOCK_H */
