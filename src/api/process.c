/* process.c: the process-wide allocator of each device and the process-wide
 * configuration they are created from (defaults, then TIDALLOC_CONF, then
 * tide_config_process_set calls made before first use). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "memory/core.h"

#define MAX_DEVICES 64

static pthread_mutex_t process_mutex = PTHREAD_MUTEX_INITIALIZER;
static tide_config *process_config; /* created on first need */
static _Atomic(tide_allocator *) devices[MAX_DEVICES];
static bool any_created;
static bool shut_down;

/* Under process_mutex. */
static int ensure_config(void) {
  if (process_config) return TIDE_OK;
  tide_config *c = NULL;
  int rc = tide_config_new(&c);
  if (!rc) rc = tide_config_load_env(c);
  if (rc) {
    tide_config_free(c);
    return rc;
  }
  process_config = c;
  return TIDE_OK;
}

tide_status tide_config_process_set(const char *text) {
  if (!text)
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID, "tide_config_process_set: text is NULL");
  pthread_mutex_lock(&process_mutex);
  /* No allocator will be created from it any more: refused, not ignored. */
  int rc = shut_down ? _tide_error_set(TIDE_ERR_STATE,
                                       "tide_config_process_set(\"%s\") after tide_shutdown: the "
                                       "process-wide allocators are gone, nothing would use it",
                                       text)
                     : ensure_config();
  tide_config *next = rc ? NULL : _tide_config_clone(process_config);
  if (!rc && !next) rc = tide_last_status();
  if (!rc) rc = tide_config_parse(next, text);
  if (!rc && any_created) {
    char changes[512];
    if (_tide_config_diff(process_config, next, changes, sizeof changes))
      rc = _tide_error_set(
          TIDE_ERR_STATE,
          "tide_config_process_set(\"%s\") after the first allocator was created: not "
          "applied (%s). Set TIDALLOC_CONF before the program starts, or call "
          "tide_config_process_set before the first allocation",
          text, changes);
  }
  if (!rc) {
    tide_config_free(process_config);
    process_config = next;
    next = NULL;
  }
  pthread_mutex_unlock(&process_mutex);
  tide_config_free(next);
  return (tide_status)rc;
}

tide_status tide_config_process_get(tide_config **out) {
  if (!out)
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID, "tide_config_process_get: out is NULL");
  pthread_mutex_lock(&process_mutex);
  int rc = ensure_config();
  *out = rc ? NULL : _tide_config_clone(process_config);
  if (!rc && !*out) rc = tide_last_status();
  pthread_mutex_unlock(&process_mutex);
  return (tide_status)rc;
}

tide_allocator *tide_device(int device) {
  if (device < 0 || device >= MAX_DEVICES) {
    _tide_error_set(TIDE_ERR_INVALID,
                    "tide_device(%d): device %d does not exist (tidalloc serves devices 0..%d)",
                    device, device, MAX_DEVICES - 1);
    return NULL;
  }
  tide_allocator *a = atomic_load_explicit(&devices[device], memory_order_acquire);
  if (TIDE_LIKELY(a != NULL)) return a;
  pthread_mutex_lock(&process_mutex);
  a = atomic_load(&devices[device]);
  if (!a && shut_down) {
    _tide_error_set(TIDE_ERR_STATE,
                    "tide_device(%d) after tide_shutdown: the process-wide "
                    "allocators are gone",
                    device);
  } else if (!a && !ensure_config() && !tide_create(device, process_config, &a)) {
    atomic_store_explicit(&devices[device], a, memory_order_release);
    any_created = true;
  }
  pthread_mutex_unlock(&process_mutex);
  return a;
}

tide_status tide_shutdown(void) {
  pthread_mutex_lock(&process_mutex);
  /* Every device's failure is told, each named: "device 0: ...; device 1: ...". */
  char text[1024] = ""; /* as long as a message */
  size_t used = 0;
  int status = TIDE_OK;
  for (int d = 0; d < MAX_DEVICES; d++) {
    tide_allocator *a = atomic_exchange(&devices[d], NULL);
    int rc = a ? tide_destroy(a) : TIDE_OK;
    if (!rc) continue;
    if (!status) status = rc;
    if (used < sizeof text) {
      int n = snprintf(text + used, sizeof text - used, "%sdevice %d: %s", used ? "; " : "", d,
                       tide_last_error());
      used += n > 0 ? (size_t)n : 0;
    }
  }
  shut_down = true;
  tide_config_free(process_config);
  process_config = NULL;
  pthread_mutex_unlock(&process_mutex);
  if (status) return (tide_status)_tide_error_set(status, "tide_shutdown: %s", text);
  return TIDE_OK;
}
