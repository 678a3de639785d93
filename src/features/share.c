/* share.c: sharing allocated memory between processes (tide_share_*).
 *
 * Export turns the physical pieces under a block (the pages of an
 * expandable segment, or a fixed segment's one handle) into POSIX file
 * descriptors through the backend. Import maps such pieces back to back in
 * a virtual range of the importing allocator and keeps a record of it, so
 * that tide_share_close and allocator teardown can unmap it. Send and
 * receive move a description and its descriptors over a Unix-domain socket
 * (SCM_RIGHTS), in chunks the kernel accepts. */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "features/features.h"

/* Memory of another process mapped here. */
typedef struct _tide_import {
  struct _tide_import *next;
  uintptr_t range; /* the reserved range */
  size_t range_size;
  uintptr_t user; /* the block's address here */
  uint32_t npieces;
  _tide_handle *handles; /* per piece, mapped in order from `range` */
  size_t *sizes;
} _tide_import;

enum { BACKEND_HOST = 0, BACKEND_CUDA = 1 };

static uint32_t backend_kind(const tide_allocator *a) {
  return a->backend.is_host ? BACKEND_HOST : BACKEND_CUDA;
}

void tide_share_pieces_close(tide_share_piece *pieces, uint32_t n) {
  if (!pieces) return;
  for (uint32_t i = 0; i < n; i++)
    if (pieces[i].fd >= 0) close(pieces[i].fd);
  free(pieces);
}

/* ------------------------------------------------------------------------ */
/* Export                                                                    */
/* ------------------------------------------------------------------------ */

/* The pieces under block b: the handles and the size of each. An
 * expandable segment's pieces are the whole handles that map the block's
 * pages (a handle may hold several pages, from before the block's first
 * page to past its last). */
typedef struct piece_plan {
  const _tide_segment *seg; /* expandable: pieces from page `head` on */
  size_t head, page;
  uint32_t count;
  uint64_t offset; /* of the block in the first piece */
} piece_plan;

static void plan_pieces(const _tide_block *b, size_t page, piece_plan *plan) {
  const _tide_segment *seg = b->segment;
  if (!seg->expandable) {
    *plan = (piece_plan){.count = 1, .offset = b->addr - seg->base};
    return;
  }
  size_t first = (b->addr - seg->base) / page, last = (b->addr + b->size - 1 - seg->base) / page;
  size_t head, n;
  _tide_handle_extent(seg, first, &head); /* the handle that maps the first page */
  uint32_t count = 0;
  for (size_t at = head; at <= last; at += n, count++)
    n = _tide_handle_extent(seg, at, &(size_t){0});
  *plan = (piece_plan){.seg = seg,
                       .head = head,
                       .page = page,
                       .count = count,
                       .offset = b->addr - (seg->base + head * page)};
}

/* Export every piece of the plan; on failure close what was made. */
static int export_pieces(tide_allocator *a, const _tide_block *b, const piece_plan *plan,
                         tide_share_piece *out) {
  const _tide_backend *be = &a->backend;
  size_t at = plan->head;
  for (uint32_t i = 0; i < plan->count; i++) {
    _tide_handle h = plan->seg ? plan->seg->pages[at] : b->segment->handle;
    size_t pages = plan->seg ? _tide_handle_extent(plan->seg, at, &(size_t){0}) : 0;
    size_t size = plan->seg ? pages * plan->page : b->segment->size;
    at += pages;
    out[i] = (tide_share_piece){.fd = -1, .size = size};
    int rc = be->ops->export_fd(be->ctx, h, &out[i].fd, &out[i].offset);
    if (rc) {
      for (uint32_t j = 0; j < i; j++) close(out[j].fd);
      _tide_error_prefix("exporting piece %u of %u", i + 1, plan->count);
      return rc;
    }
  }
  return TIDE_OK;
}

/* Under the lock of the arena that holds the block, so its pages stay. */
static int export_from_arena(tide_allocator *a, _tide_arena *arena, uintptr_t addr,
                             tide_share_desc *desc, tide_share_piece **pieces, bool *found) {
  const _tide_block *b = _tide_arena_containing_block(arena, addr);
  if (!b) return TIDE_OK;
  *found = true;
  if (b->state != _TIDE_ALLOCATED)
    return _tide_error_set(TIDE_ERR_BAD_POINTER,
                           "tide_share_export: %p lies in memory that is not allocated",
                           (void *)addr);
  piece_plan plan;
  plan_pieces(b, a->page_size, &plan);
  tide_share_piece *out = calloc(plan.count, sizeof *out);
  if (!out) return _tide_error_set(TIDE_ERR_OOM, "tide_share_export: out of host memory");
  int rc = export_pieces(a, b, &plan, out);
  if (rc) {
    free(out);
    return rc;
  }
  *desc = (tide_share_desc){.size = b->size,
                            .offset = plan.offset,
                            .num_pieces = plan.count,
                            .device = a->device,
                            .backend = backend_kind(a)};
  *pieces = out;
  return TIDE_OK;
}

tide_status tide_share_export(tide_allocator *a, const void *ptr, tide_share_desc *desc,
                              tide_share_piece **pieces) {
  if (!_tide_allocator_valid(a) || !desc || !pieces)
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID,
                                        "tide_share_export: a live allocator, desc and pieces "
                                        "are required");
  if (!a->backend.ops->export_fd)
    return (tide_status)_tide_error_set(TIDE_ERR_UNAVAILABLE,
                                        "tide_share_export: the %s backend cannot share memory",
                                        a->backend.ops->name);
  *pieces = NULL;
  _tide_arena **arenas;
  size_t n = _tide_arenas_snapshot(a, &arenas);
  int rc = TIDE_OK;
  bool found = false;
  for (size_t i = 0; i < n && !found; i++) {
    _tide_lock_acquire(&arenas[i]->lock);
    rc = export_from_arena(a, arenas[i], (uintptr_t)ptr, desc, pieces, &found);
    _tide_lock_release(&arenas[i]->lock);
  }
  free(arenas);
  if (!found)
    rc = _tide_error_set(TIDE_ERR_BAD_POINTER,
                         "tide_share_export: %p was not allocated by this allocator (growable "
                         "buffers cannot be shared)",
                         ptr);
  return (tide_status)rc;
}

/* ------------------------------------------------------------------------ */
/* Import                                                                    */
/* ------------------------------------------------------------------------ */

static int check_desc(const tide_allocator *a, const tide_share_desc *desc,
                      const tide_share_piece *pieces, size_t *total) {
  if (desc->backend != backend_kind(a))
    return _tide_error_set(TIDE_ERR_INVALID,
                           "tide_share_import: the memory was exported by the %s backend, this "
                           "allocator uses the %s backend",
                           desc->backend == BACKEND_HOST ? "host" : "CUDA", a->backend.ops->name);
  if (desc->num_pieces == 0 || desc->size == 0)
    return _tide_error_set(TIDE_ERR_INVALID, "tide_share_import: the description is empty");
  size_t sum = 0;
  for (uint32_t i = 0; i < desc->num_pieces; i++) {
    if (pieces[i].size == 0 || pieces[i].size % a->granularity || sum + pieces[i].size < sum)
      return _tide_error_set(TIDE_ERR_INVALID,
                             "tide_share_import: piece %u has %llu bytes, not a positive "
                             "multiple of the granularity (%zu bytes)",
                             i, (unsigned long long)pieces[i].size, a->granularity);
    sum += pieces[i].size;
  }
  if (desc->offset >= sum || desc->size > sum - desc->offset)
    return _tide_error_set(TIDE_ERR_INVALID,
                           "tide_share_import: a block of %llu bytes at offset %llu does not fit "
                           "in pieces of %zu bytes",
                           (unsigned long long)desc->size, (unsigned long long)desc->offset, sum);
  *total = sum;
  return TIDE_OK;
}

/* Unmap the first `mapped` pieces and release the handles of the first
 * `made`; unreserve the range. A piece whose unmap is refused is not
 * released (it is still mapped), and then the range is not unreserved
 * either: they stay held. The first failure's message is returned. */
static int undo_import(tide_allocator *a, _tide_import *im, uint32_t made, uint32_t mapped) {
  const _tide_backend *be = &a->backend;
  _tide_first_error first = {0};
  uintptr_t at = im->range;
  uint32_t still_mapped = 0;
  for (uint32_t i = 0; i < made; i++) {
    int rc = i < mapped ? _tide_mem_unmap(a, at, im->sizes[i]) : TIDE_OK;
    if (rc) {
      still_mapped++;
      _tide_error_prefix("unmapping imported piece %u (%zu bytes at %#lx); it stays mapped and "
                         "its range reserved",
                         i, im->sizes[i], (unsigned long)at);
    } else {
      rc = _tide_mem_release(a, im->handles[i]);
    }
    _tide_first_error_note(&first, rc);
    at += im->sizes[i];
  }
  if (still_mapped == 0)
    _tide_first_error_note(&first, be->ops->unreserve(be->ctx, im->range, im->range_size));
  return _tide_first_error_end(&first);
}

static int map_pieces(tide_allocator *a, _tide_import *im, const tide_share_piece *pieces) {
  const _tide_backend *be = &a->backend;
  uint32_t made = 0, mapped = 0;
  uintptr_t at = im->range;
  int rc = TIDE_OK;
  for (; made < im->npieces; made++) {
    im->sizes[made] = pieces[made].size;
    rc = be->ops->import_fd(be->ctx, pieces[made].fd, pieces[made].offset, pieces[made].size,
                            &im->handles[made]);
    if (rc) break;
    rc = _tide_mem_map(a, at, pieces[made].size, im->handles[made]);
    if (rc) {
      made++;
      break;
    }
    mapped++;
    at += pieces[made].size;
  }
  if (!rc) rc = _tide_mem_set_access(a, im->range, im->range_size);
  if (rc) {
    _tide_saved_error saved;
    _tide_error_save(&saved);
    undo_import(a, im, made, mapped);
    return _tide_error_restore(&saved);
  }
  return TIDE_OK;
}

static _tide_import *import_new(uint32_t npieces) {
  _tide_import *im = calloc(1, sizeof *im);
  if (!im) return NULL;
  im->handles = calloc(npieces, sizeof *im->handles);
  im->sizes = calloc(npieces, sizeof *im->sizes);
  if (!im->handles || !im->sizes) {
    free(im->handles);
    free(im->sizes);
    free(im);
    return NULL;
  }
  im->npieces = npieces;
  return im;
}

static void import_delete(_tide_import *im) {
  free(im->handles);
  free(im->sizes);
  free(im);
}

tide_status tide_share_import(tide_allocator *a, const tide_share_desc *desc,
                              const tide_share_piece *pieces, void **out) {
  if (!_tide_allocator_valid(a) || !desc || !pieces || !out)
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID,
                                        "tide_share_import: a live allocator, desc, pieces and "
                                        "out are required");
  if (!a->backend.ops->import_fd)
    return (tide_status)_tide_error_set(TIDE_ERR_UNAVAILABLE,
                                        "tide_share_import: the %s backend cannot share memory",
                                        a->backend.ops->name);
  size_t total = 0;
  int rc = check_desc(a, desc, pieces, &total);
  if (rc) return (tide_status)rc;
  _tide_import *im = import_new(desc->num_pieces);
  if (!im) return (tide_status)_tide_error_set(TIDE_ERR_OOM, "tide_share_import: out of memory");
  const _tide_backend *be = &a->backend;
  rc = be->ops->reserve(be->ctx, total, a->granularity, &im->range);
  if (rc) {
    import_delete(im);
    return (tide_status)rc;
  }
  im->range_size = total;
  if ((rc = map_pieces(a, im, pieces))) {
    import_delete(im);
    return (tide_status)rc;
  }
  im->user = im->range + desc->offset;
  pthread_mutex_lock(&a->imports_mutex);
  im->next = a->imports;
  a->imports = im;
  pthread_mutex_unlock(&a->imports_mutex);
  *out = (void *)im->user;
  return TIDE_OK;
}

tide_status tide_share_close(tide_allocator *a, void *ptr) {
  if (!_tide_allocator_valid(a))
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID,
                                        "tide_share_close: not a live tidalloc allocator");
  pthread_mutex_lock(&a->imports_mutex);
  _tide_import **link = &a->imports;
  while (*link && (*link)->user != (uintptr_t)ptr) link = &(*link)->next;
  _tide_import *im = *link;
  if (im) *link = im->next;
  pthread_mutex_unlock(&a->imports_mutex);
  if (!im)
    return (tide_status)_tide_error_set(TIDE_ERR_BAD_POINTER,
                                        "tide_share_close: %p is not memory tide_share_import "
                                        "mapped in this allocator",
                                        ptr);
  int rc = undo_import(a, im, im->npieces, im->npieces);
  import_delete(im);
  return (tide_status)rc;
}

int _tide_imports_close_all(tide_allocator *a) {
  _tide_first_error first = {0};
  while (a->imports) {
    _tide_import *im = a->imports;
    a->imports = im->next;
    _tide_first_error_note(&first, undo_import(a, im, im->npieces, im->npieces));
    import_delete(im);
  }
  return _tide_first_error_end(&first);
}

/* ------------------------------------------------------------------------ */
/* Sending descriptors over a Unix-domain socket                             */
/* ------------------------------------------------------------------------ */

#define SHARE_MAGIC 0x7469646553484152ull /* "tideSHAR" */
#define FDS_PER_MESSAGE 250u              /* the kernel takes at most 253 */

typedef struct wire_header {
  uint64_t magic;
  tide_share_desc desc;
} wire_header;

typedef struct wire_piece {
  uint64_t offset, size;
} wire_piece;

/* One message: `len` bytes of data, and `nfds` descriptors with them. */
static int send_message(int sock, const void *data, size_t len, const int *fds, uint32_t nfds) {
  union {
    char buf[CMSG_SPACE(sizeof(int) * FDS_PER_MESSAGE)];
    struct cmsghdr align;
  } control;
  memset(&control, 0, sizeof control);
  struct iovec iov = {.iov_base = (void *)data, .iov_len = len};
  struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
  if (nfds) {
    msg.msg_control = control.buf;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
    memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
  }
  ssize_t sent;
  do sent = sendmsg(sock, &msg, MSG_NOSIGNAL);
  while (sent < 0 && errno == EINTR);
  if (sent < 0)
    return _tide_error_set(TIDE_ERR_INVALID, "tide_share_send: sendmsg failed: %s",
                           strerror(errno));
  if ((size_t)sent != len)
    return _tide_error_set(TIDE_ERR_BACKEND, "tide_share_send: sent %zd of %zu bytes", sent, len);
  return TIDE_OK;
}

tide_status tide_share_send(int sock, const tide_share_desc *desc, const tide_share_piece *pieces) {
  if (!desc || (!pieces && desc->num_pieces))
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID, "tide_share_send: desc and pieces "
                                                          "are required");
  wire_header h = {.magic = SHARE_MAGIC, .desc = *desc};
  int rc = send_message(sock, &h, sizeof h, NULL, 0);
  for (uint32_t done = 0; !rc && done < desc->num_pieces;) {
    uint32_t n = desc->num_pieces - done;
    if (n > FDS_PER_MESSAGE) n = FDS_PER_MESSAGE;
    wire_piece wire[FDS_PER_MESSAGE];
    int fds[FDS_PER_MESSAGE];
    for (uint32_t i = 0; i < n; i++) {
      wire[i] = (wire_piece){pieces[done + i].offset, pieces[done + i].size};
      fds[i] = pieces[done + i].fd;
    }
    rc = send_message(sock, wire, n * sizeof *wire, fds, n);
    done += n;
  }
  return (tide_status)rc;
}

/* One message of exactly `len` bytes; descriptors that came with it go to
 * fds (up to `want`), *got says how many. Extra descriptors are closed. */
static int recv_message(int sock, void *data, size_t len, int *fds, uint32_t want, uint32_t *got) {
  union {
    char buf[CMSG_SPACE(sizeof(int) * FDS_PER_MESSAGE)];
    struct cmsghdr align;
  } control;
  struct iovec iov = {.iov_base = data, .iov_len = len};
  struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
  msg.msg_control = control.buf;
  msg.msg_controllen = sizeof control.buf;
  ssize_t r;
  do r = recvmsg(sock, &msg, MSG_WAITALL | MSG_CMSG_CLOEXEC);
  while (r < 0 && errno == EINTR);
  *got = 0;
  for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    int *in = (int *)CMSG_DATA(c);
    for (size_t i = 0; i < n; i++) {
      if (*got < want)
        fds[(*got)++] = in[i];
      else
        close(in[i]);
    }
  }
  if (r < 0)
    return _tide_error_set(TIDE_ERR_INVALID, "tide_share_recv: recvmsg failed: %s",
                           strerror(errno));
  if ((size_t)r != len || (msg.msg_flags & MSG_CTRUNC))
    return _tide_error_set(TIDE_ERR_BACKEND,
                           "tide_share_recv: a short message (%zd of %zu bytes%s): the sender "
                           "closed the socket or sent something else",
                           r, len, (msg.msg_flags & MSG_CTRUNC) ? ", descriptors cut" : "");
  return TIDE_OK;
}

static int recv_pieces(int sock, tide_share_piece *pieces, uint32_t count) {
  for (uint32_t done = 0; done < count;) {
    uint32_t n = count - done, got = 0;
    if (n > FDS_PER_MESSAGE) n = FDS_PER_MESSAGE;
    wire_piece wire[FDS_PER_MESSAGE];
    int fds[FDS_PER_MESSAGE];
    int rc = recv_message(sock, wire, n * sizeof *wire, fds, n, &got);
    for (uint32_t i = 0; i < got; i++) pieces[done + i].fd = fds[i];
    if (!rc && got != n)
      rc = _tide_error_set(TIDE_ERR_BACKEND,
                           "tide_share_recv: %u descriptors arrived where %u were sent", got, n);
    if (rc) return rc;
    for (uint32_t i = 0; i < n; i++) {
      pieces[done + i].offset = wire[i].offset;
      pieces[done + i].size = wire[i].size;
    }
    done += n;
  }
  return TIDE_OK;
}

tide_status tide_share_recv(int sock, tide_share_desc *desc, tide_share_piece **pieces) {
  if (!desc || !pieces)
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID,
                                        "tide_share_recv: desc and pieces are required");
  *pieces = NULL;
  wire_header h;
  uint32_t got = 0;
  int rc = recv_message(sock, &h, sizeof h, NULL, 0, &got);
  if (rc) return (tide_status)rc;
  if (h.magic != SHARE_MAGIC || h.desc.num_pieces == 0)
    return (tide_status)_tide_error_set(TIDE_ERR_INVALID,
                                        "tide_share_recv: not a tidalloc share description");
  tide_share_piece *out = calloc(h.desc.num_pieces, sizeof *out);
  if (!out) return (tide_status)_tide_error_set(TIDE_ERR_OOM, "tide_share_recv: out of memory");
  for (uint32_t i = 0; i < h.desc.num_pieces; i++) out[i].fd = -1;
  if ((rc = recv_pieces(sock, out, h.desc.num_pieces))) {
    tide_share_pieces_close(out, h.desc.num_pieces);
    return (tide_status)rc;
  }
  *desc = h.desc;
  *pieces = out;
  return TIDE_OK;
}
