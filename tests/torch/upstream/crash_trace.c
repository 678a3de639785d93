/* crash_trace.c: a SIGSEGV/SIGBUS/SIGABRT handler that writes the native
 * call stack to stderr and then lets the signal do what it would have done.
 * Preloaded (LD_PRELOAD) by run_one.sh on machines without gdb, so that a
 * crash inside a native library leaves its frames in the log; run_one.sh
 * turns the frames of libtidalloc.so and the shim into function names with
 * addr2line. A test tool, not part of the library. */
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static void on_crash(int sig) {
  void *frames[64];
  static const char head[] = "crash_trace: native stack at the signal:\n";
  int n = backtrace(frames, 64);
  (void)!write(2, head, sizeof head - 1);
  backtrace_symbols_fd(frames, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_crash;
  sa.sa_flags = SA_RESETHAND;
  sigaction(SIGSEGV, &sa, NULL);
  sigaction(SIGBUS, &sa, NULL);
  sigaction(SIGABRT, &sa, NULL);
}
