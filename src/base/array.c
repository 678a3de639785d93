/* array.c: the growable arrays the library's tables are made of. */
#include <stdlib.h>

#include "base/internal.h"

bool _tide_grow_array(void **items, size_t *cap, size_t need, size_t item_size) {
  if (need <= *cap) return true;
  size_t new_cap = *cap ? *cap * 2 : 16;
  while (new_cap < need) new_cap *= 2;
  void *p = realloc(*items, new_cap * item_size);
  if (!p) return false;
  *items = p;
  *cap = new_cap;
  return true;
}
