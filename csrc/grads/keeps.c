/* Keep-alive lists (axc/keeps.h): per kind, a FIFO of (number, owner). */
#include "axc/keeps.h"

#include <stdlib.h>
#include <string.h>

typedef struct entry {
    uint64_t number;
    void *owner;
} entry;

typedef struct fifo {
    entry *v;
    size_t head, n, cap; /* live entries are v[head .. n) */
} fifo;

struct axc_keeps {
    void (*release)(void *ctx, void *owner);
    void *ctx;
    fifo q[AXC_KEEP_KINDS];
};

static const char *const kind_names[AXC_KEEP_KINDS] = {"task", "result", "output"};

axc_status axc_keep_kind_from_name(const char *name, axc_keep_kind *kind)
{
    for (int i = 0; i < AXC_KEEP_KINDS; i++)
        if (name && strcmp(name, kind_names[i]) == 0) {
            *kind = (axc_keep_kind)i;
            return AXC_OK;
        }
    return axc_fail(AXC_ERR_INVALID, "unknown keep-alive kind '%s', expected task, result or "
                                     "output", name ? name : "(null)");
}

axc_status axc_keeps_create(axc_keeps **out, void (*release)(void *ctx, void *owner), void *ctx)
{
    if (!out || !release)
        return axc_fail(AXC_ERR_INVALID, "axc_keeps_create: missing output or release function");
    axc_keeps *k = calloc(1, sizeof *k);
    if (!k)
        return axc_fail(AXC_ERR_NOMEM, "axc_keeps_create: out of memory");
    k->release = release;
    k->ctx = ctx;
    *out = k;
    return AXC_OK;
}

axc_status axc_keeps_add(axc_keeps *k, axc_keep_kind kind, uint64_t number, void *owner)
{
    if ((unsigned)kind >= AXC_KEEP_KINDS) {
        k->release(k->ctx, owner);
        return axc_fail(AXC_ERR_INVALID, "unknown keep-alive kind %d", (int)kind);
    }
    fifo *f = &k->q[kind];
    if (f->head && f->head == f->n) /* empty: start at the front again */
        f->head = f->n = 0;
    if (f->n == f->cap) {
        if (f->head) { /* room at the front: slide the live entries down */
            memmove(f->v, f->v + f->head, (f->n - f->head) * sizeof *f->v);
            f->n -= f->head;
            f->head = 0;
        } else {
            size_t cap = f->cap ? 2 * f->cap : 16;
            entry *v = realloc(f->v, cap * sizeof *v);
            if (!v) {
                k->release(k->ctx, owner);
                return axc_fail(AXC_ERR_NOMEM, "keep-alive list: out of memory");
            }
            f->v = v;
            f->cap = cap;
        }
    }
    f->v[f->n++] = (entry){number, owner};
    return AXC_OK;
}

static void release_upto(axc_keeps *k, fifo *f, uint64_t done)
{
    /* (in order: a later entry with a smaller number waits for the earlier ones, as the
     * numbers of one kind are handed out in increasing order) */
    while (f->head < f->n && f->v[f->head].number <= done) {
        void *owner = f->v[f->head].owner;
        f->head++;
        k->release(k->ctx, owner);
    }
}

void axc_keeps_release_done(axc_keeps *k, uint64_t tasks_run, uint64_t results_done)
{
    release_upto(k, &k->q[AXC_KEEP_TASK], tasks_run);
    release_upto(k, &k->q[AXC_KEEP_RESULT], results_done);
    release_upto(k, &k->q[AXC_KEEP_OUTPUT], results_done);
}

size_t axc_keeps_count(const axc_keeps *k, axc_keep_kind kind)
{
    return (unsigned)kind < AXC_KEEP_KINDS ? k->q[kind].n - k->q[kind].head : 0;
}

void axc_keeps_clear(axc_keeps *k)
{
    if (!k)
        return;
    for (int i = 0; i < AXC_KEEP_KINDS; i++)
        release_upto(k, &k->q[i], UINT64_MAX);
}

void axc_keeps_destroy(axc_keeps *k)
{
    if (!k)
        return;
    axc_keeps_clear(k);
    for (int i = 0; i < AXC_KEEP_KINDS; i++)
        free(k->q[i].v);
    free(k);
}
