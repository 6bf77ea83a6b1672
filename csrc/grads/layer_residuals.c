/* The linear layers' depth dW residuals (axc/layer_residuals.h): a table by layer id, and the
 * buffers kept for in-flight work until the pass ends. */
#include "axc/layer_residuals.h"

#include <stdint.h>
#include <stdlib.h>

/* A use by deferred work belongs to the generation of passes that was current when the call
 * that made it had queued its work (axc_layer_residuals_call_done), so a pass that ends on one
 * thread releases only what the work it waited for used, never a use a call on another thread
 * is still queueing. Two calls of one layer on two threads share its buffer: `open` counts the
 * uses not queued yet, and the last one queued stamps the buffer. */
typedef struct entry {
    int layer;
    int device;
    int busy;       /* a deferred reduce-scatter uses it */
    int open;       /* uses whose call has not queued its work yet */
    uint64_t stamp; /* the generation of the latest queued use (0: none yet) */
    void *data, *owner;
    size_t elems;
} entry;

typedef struct kept_buf {
    void *owner, *data;
    int open;
    uint64_t stamp;
} kept_buf;

struct axc_layer_residuals {
    axc_bucket_ops ops;
    entry *v;
    int n, cap;
    /* owners kept until their pass's end; kept_cap >= nkept + nbusy always (room is reserved
     * before an entry turns busy), so dropping a busy one never needs memory */
    kept_buf *kept;
    int nkept, kept_cap, nbusy;
    uint64_t gen; /* the current generation (from 1) */
};

axc_status axc_layer_residuals_create(axc_layer_residuals **out, const axc_bucket_ops *ops)
{
    if (!out || !ops || !ops->release)
        return axc_fail(AXC_ERR_INVALID, "axc_layer_residuals_create: missing output or "
                                         "release function");
    axc_layer_residuals *t = calloc(1, sizeof *t);
    if (!t)
        return axc_fail(AXC_ERR_NOMEM, "axc_layer_residuals_create: out of memory");
    t->ops = *ops;
    t->gen = 1;
    *out = t;
    return AXC_OK;
}

static void release(axc_layer_residuals *t, void *owner)
{
    if (owner)
        t->ops.release(t->ops.ctx, owner);
}

void axc_layer_residuals_release(axc_layer_residuals *t, void *owner) { release(t, owner); }

/* room for `more` owners kept beyond those kept and busy now */
static axc_status reserve(axc_layer_residuals *t, int more)
{
    int want = t->nkept + t->nbusy + more;
    if (want <= t->kept_cap)
        return AXC_OK;
    int cap = t->kept_cap ? 2 * t->kept_cap : 8;
    cap = cap < want ? want : cap;
    kept_buf *k = realloc(t->kept, (size_t)cap * sizeof *k);
    if (!k)
        return axc_fail(AXC_ERR_NOMEM, "depth dW residuals: out of memory");
    t->kept = k;
    t->kept_cap = cap;
    return AXC_OK;
}

/* drops e's buffer: released, or kept until the pass's end while a deferred work uses it
 * (the room is reserved) */
static void drop_buffer(axc_layer_residuals *t, entry *e)
{
    if (e->busy) {
        t->kept[t->nkept++] = (kept_buf){e->owner, e->data, e->open, e->stamp};
        t->nbusy--;
    } else {
        release(t, e->owner);
    }
    e->busy = 0;
    e->owner = e->data = NULL;
}

/* new zeros (no allocator: refused by name) */
static axc_status alloc(axc_layer_residuals *t, int device, size_t elems, void **data,
                        void **owner)
{
    if (!t->ops.alloc_residual)
        return axc_fail(AXC_ERR_STATE, "depth dW residuals: this runtime was made without a "
                                       "residual allocator");
    return t->ops.alloc_residual(t->ops.ctx, NULL, device, elems, data, owner);
}

static int find(const axc_layer_residuals *t, int layer)
{
    for (int i = 0; i < t->n; i++)
        if (t->v[i].layer == layer)
            return i;
    return -1;
}

/* the entry of `layer`, a new empty one when it has none */
static entry *slot(axc_layer_residuals *t, int layer)
{
    int i = find(t, layer);
    if (i >= 0)
        return &t->v[i];
    if (t->n == t->cap) {
        int cap = t->cap ? 2 * t->cap : 8;
        entry *v = realloc(t->v, (size_t)cap * sizeof *v);
        if (!v) {
            axc_fail(AXC_ERR_NOMEM, "depth dW residuals: out of memory for layer %d", layer);
            return NULL;
        }
        t->v = v;
        t->cap = cap;
    }
    t->v[t->n] = (entry){.layer = layer};
    return &t->v[t->n++];
}

static axc_status check_layer(int layer, size_t elems)
{
    if (layer < 0)
        return axc_fail(AXC_ERR_INVALID, "depth dW residual: layer id %d, expected >= 0", layer);
    if (elems == 0)
        return axc_fail(AXC_ERR_INVALID, "depth dW residual of layer %d: 0 elements", layer);
    return AXC_OK;
}

axc_status axc_layer_residuals_for(axc_layer_residuals *t, int layer, int device, size_t elems,
                                   int in_flight, float **data)
{
    AXC_TRY(check_layer(layer, elems));
    int i = find(t, layer);
    entry *e = i >= 0 ? &t->v[i] : NULL;
    if (!e || !e->owner || e->elems != elems || e->device != device) {
        void *d = NULL, *owner = NULL;
        AXC_TRY(alloc(t, device, elems, &d, &owner));
        /* (looked up again: the allocation may have run code that changed the table) */
        if (!(e = slot(t, layer))) {
            release(t, owner);
            return AXC_ERR_NOMEM;
        }
        drop_buffer(t, e);
        *e = (entry){.layer = layer, .device = device, .data = d, .owner = owner,
                     .elems = elems};
    }
    if (in_flight && !e->busy) {
        AXC_TRY(reserve(t, 1));
        e->busy = 1;
        t->nbusy++;
    }
    if (in_flight)
        e->open++; /* (until the call queued its work: call_done) */
    *data = e->data;
    return AXC_OK;
}

axc_status axc_layer_residuals_scratch(axc_layer_residuals *t, int device, size_t elems,
                                       int in_flight, float **data, void **owner)
{
    *owner = NULL;
    if (elems == 0)
        return axc_fail(AXC_ERR_INVALID, "a scratch depth dW residual of 0 elements");
    void *d = NULL, *o = NULL;
    AXC_TRY(alloc(t, device, elems, &d, &o));
    if (in_flight) {
        axc_status st = reserve(t, 1);
        if (st != AXC_OK) {
            release(t, o);
            return st;
        }
        t->kept[t->nkept++] = (kept_buf){o, d, 1, 0};
    } else {
        *owner = o;
    }
    *data = d;
    return AXC_OK;
}

axc_status axc_layer_residuals_for_call(axc_layer_residuals *t, int layer, int device,
                                        size_t elems, int trains, int in_flight, float **data,
                                        void **scratch)
{
    *data = NULL;
    *scratch = NULL;
    if (layer < 0 || elems == 0)
        return AXC_OK;
    if (trains)
        return axc_layer_residuals_for(t, layer, device, elems, in_flight, data);
    return axc_layer_residuals_scratch(t, device, elems, in_flight, data, scratch);
}

static void remove_at(axc_layer_residuals *t, int i)
{
    drop_buffer(t, &t->v[i]);
    t->v[i] = t->v[--t->n];
}

void axc_layer_residuals_forget(axc_layer_residuals *t, int layer)
{
    if (!t)
        return;
    int i = find(t, layer);
    if (i >= 0)
        remove_at(t, i);
}

void axc_layer_residuals_clear(axc_layer_residuals *t)
{
    if (!t)
        return;
    while (t->n > 0)
        remove_at(t, t->n - 1);
}

uint64_t axc_layer_residuals_pass_begin(axc_layer_residuals *t) { return t ? t->gen++ : 0; }

void axc_layer_residuals_call_done(axc_layer_residuals *t, const float *data)
{
    if (!t || !data)
        return;
    for (int i = 0; i < t->n; i++)
        if (t->v[i].busy && t->v[i].open > 0 && t->v[i].data == data) {
            t->v[i].open--;
            t->v[i].stamp = t->gen; /* (the newest use decides) */
        }
    for (int i = 0; i < t->nkept; i++)
        if (t->kept[i].open > 0 && t->kept[i].data == data) {
            t->kept[i].open--;
            t->kept[i].stamp = t->gen;
        }
}

/* whether the uses of a buffer (`open` not queued yet, the latest queued in generation
 * `stamp`) are over when the passes up to `gen` are */
static int over(int open, uint64_t stamp, uint64_t gen)
{
    return gen == AXC_LAYER_RESIDUALS_ALL || (!open && stamp && stamp <= gen);
}

void axc_layer_residuals_pass_done(axc_layer_residuals *t, uint64_t gen)
{
    if (!t)
        return;
    for (int i = 0; i < t->n; i++)
        if (t->v[i].busy && over(t->v[i].open, t->v[i].stamp, gen)) {
            t->v[i].busy = t->v[i].open = 0;
            t->v[i].stamp = 0;
            t->nbusy--;
        }
    /* (a release may run other code that keeps more: taken one at a time, each found anew) */
    for (;;) {
        int i = t->nkept - 1;
        while (i >= 0 && !over(t->kept[i].open, t->kept[i].stamp, gen))
            i--;
        if (i < 0)
            break;
        void *owner = t->kept[i].owner;
        t->kept[i] = t->kept[--t->nkept];
        release(t, owner);
    }
}

void axc_layer_residuals_destroy(axc_layer_residuals *t)
{
    if (!t)
        return;
    axc_layer_residuals_clear(t);
    axc_layer_residuals_pass_done(t, AXC_LAYER_RESIDUALS_ALL);
    free(t->v);
    free(t->kept);
    free(t);
}

int axc_layer_residuals_count(const axc_layer_residuals *t) { return t ? t->n : 0; }

void axc_layer_residuals_at(const axc_layer_residuals *t, int i, int *layer, void **owner,
                            size_t *elems)
{
    int have = t && i >= 0 && i < t->n;
    *layer = have ? t->v[i].layer : -1;
    *owner = have ? t->v[i].owner : NULL;
    *elems = have ? t->v[i].elems : 0;
}

int axc_layer_residuals_get(const axc_layer_residuals *t, int layer, void **owner,
                            size_t *elems)
{
    int i = t ? find(t, layer) : -1;
    axc_layer_residuals_at(t, i, &layer, owner, elems);
    return i >= 0;
}

axc_status axc_layer_residuals_set(axc_layer_residuals *t, int layer, void *data, void *owner,
                                   int device, size_t elems)
{
    axc_status st = check_layer(layer, elems);
    entry *e = st == AXC_OK ? slot(t, layer) : NULL;
    if (!e) {
        release(t, owner);
        return st != AXC_OK ? st : AXC_ERR_NOMEM;
    }
    drop_buffer(t, e);
    *e = (entry){.layer = layer, .device = device, .data = data, .owner = owner,
                 .elems = elems};
    return AXC_OK;
}

int axc_layer_residuals_kept(const axc_layer_residuals *t) { return t ? t->nkept : 0; }
