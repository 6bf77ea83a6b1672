/* What in-flight work still reads or writes, kept alive until the scheduler says it is done
 * (docs/ARCHITECTURE.md#who-owns-what): the tensors a deferred dW GEMM task reads (until task
 * number k has run), a held backward dX all-reduce writes and a held forward output (until
 * result number k is awaited). The list holds opaque owners (torch tensors, in the binding) and
 * releases them through the caller's function, in the order they were added, so the caller
 * decides on which thread and under which lock owners go (the binding: with the GIL held). Not
 * thread-safe: the caller serialises every call. */
#ifndef AXC_KEEPS_H
#define AXC_KEEPS_H

#include <stddef.h>
#include <stdint.h>

#include "axc/status.h"

typedef enum axc_keep_kind {
    AXC_KEEP_TASK = 0,   /* until task number k has run */
    AXC_KEEP_RESULT = 1, /* a held backward result: until result number k is done */
    AXC_KEEP_OUTPUT = 2, /* a held forward output: until result number k is done */
    AXC_KEEP_KINDS = 3
} axc_keep_kind;

typedef struct axc_keeps axc_keeps;

axc_status axc_keeps_create(axc_keeps **out, void (*release)(void *ctx, void *owner), void *ctx);
/* Releases every owner. NULL is a no-op. */
void axc_keeps_destroy(axc_keeps *k);
/* Keeps `owner` until `number` of its kind is done. On failure the owner is released. */
axc_status axc_keeps_add(axc_keeps *k, axc_keep_kind kind, uint64_t number, void *owner);
/* Releases, per kind and in the order they were added, the owners whose number is done: tasks
 * up to `tasks_run`, results and outputs up to `results_done`. */
void axc_keeps_release_done(axc_keeps *k, uint64_t tasks_run, uint64_t results_done);
size_t axc_keeps_count(const axc_keeps *k, axc_keep_kind kind);
/* Releases every owner of every kind (init, finalize). */
void axc_keeps_clear(axc_keeps *k);
axc_status axc_keep_kind_from_name(const char *name, axc_keep_kind *kind);

#endif
