/* Records of pending gradients and summed-over marks (axc/records.h): the pass's records in
 * order, a taken-.grad list in order, and one slot per parameter key (open addressing) with
 * its mark, record count, last record, taken flag and chunk record. */
#include "axc/records.h"

#include <stdlib.h>
#include <string.h>

typedef struct slot {
    uintptr_t key;
    int used;
    void *stamp; /* the mark's stamp (NULL: no mark) */
    axc_groups marked;
    double synced; /* > 0: a synced mark, the scale sync_gradients applied */
    double scaled; /* a mark that is not synced: the scale its .grad carries (1: none) */
    int dated;     /* made by a sync (synced, or sync_gradients_depth_parallel's): has `gen` */
    unsigned long long gen; /* a dated mark's generation (the caller's count when made) */
    size_t nrec, last; /* records of this pass; index of the last one */
    int taken;
    int chunk; /* an open chunk record: recs[chunk_rec] */
    size_t chunk_rec;
    int64_t chunk_bucket;
    long chunk_left;
} slot;

typedef struct count {
    uintptr_t key;
    void *param;
    long n;
} count;

struct axc_chunk_counts {
    count *v;
    size_t n, cap;
};

struct axc_grad_records {
    void (*release)(void *ctx, void *owner);
    void *ctx;
    slot *slots;
    size_t cap, used, marks, chunks;
    size_t dated; /* the marks a sync made */
    axc_grad_record *recs;
    size_t nrecs, rcap;
    axc_taken_grad *taken;
    size_t ntaken, tcap;
    axc_chunk_counts own, *active; /* the pass's counts; where counts go now */
    int64_t task;
    void *pass_owner;
};

void axc_groups_union(axc_groups *into, const axc_groups *add)
{
    for (int i = 0; i < add->n; i++) {
        int seen = 0;
        for (int j = 0; j < into->n; j++)
            seen |= into->g[j] == add->g[i];
        if (!seen && into->n < AXC_GROUP_COUNT)
            into->g[into->n++] = add->g[i];
    }
}

static void release(axc_grad_records *r, void *owner)
{
    if (owner)
        r->release(r->ctx, owner);
}

static int grow(void **v, size_t *cap, size_t need, size_t size)
{
    if (need <= *cap)
        return 1;
    size_t c = *cap ? *cap * 2 : 16;
    while (c < need)
        c *= 2;
    void *n = realloc(*v, c * size);
    if (!n)
        return 0;
    *v = n;
    *cap = c;
    return 1;
}

static size_t hash(uintptr_t key, size_t cap)
{
    uint64_t h = (uint64_t)key * 0x9E3779B97F4A7C15ull;
    return (size_t)(h >> 17) & (cap - 1);
}

static slot *find(const axc_grad_records *r, uintptr_t key)
{
    if (!r->cap)
        return NULL;
    for (size_t i = hash(key, r->cap);; i = (i + 1) & (r->cap - 1)) {
        if (!r->slots[i].used)
            return NULL;
        if (r->slots[i].key == key)
            return &r->slots[i];
    }
}

static void put(slot *slots, size_t cap, const slot *s)
{
    size_t i = hash(s->key, cap);
    while (slots[i].used)
        i = (i + 1) & (cap - 1);
    slots[i] = *s;
}

/* rebuilds the table at `cap`, keeping the slots that hold something */
static int rehash(axc_grad_records *r, size_t cap)
{
    slot *n = calloc(cap, sizeof *n);
    if (!n)
        return 0;
    size_t used = 0;
    for (size_t i = 0; i < r->cap; i++) {
        const slot *s = &r->slots[i];
        if (s->used && (s->stamp || s->nrec || s->taken || s->chunk)) {
            put(n, cap, s);
            used++;
        }
    }
    free(r->slots);
    r->slots = n;
    r->cap = cap;
    r->used = used;
    return 1;
}

static slot *find_or_add(axc_grad_records *r, uintptr_t key)
{
    slot *s = find(r, key);
    if (s)
        return s;
    if ((r->used + 1) * 2 > r->cap && !rehash(r, r->cap ? r->cap * 2 : 64))
        return NULL;
    slot n = {.key = key, .used = 1};
    put(r->slots, r->cap, &n);
    r->used++;
    return find(r, key);
}

/* removes key's slot when it holds nothing (backward-shift deletion) */
static void drop_if_empty(axc_grad_records *r, slot *s)
{
    if (s->stamp || s->nrec || s->taken || s->chunk)
        return;
    size_t i = (size_t)(s - r->slots), mask = r->cap - 1;
    r->slots[i].used = 0;
    r->used--;
    for (size_t j = (i + 1) & mask; r->slots[j].used; j = (j + 1) & mask) {
        size_t home = hash(r->slots[j].key, r->cap);
        /* j's entry may move to the hole at i when i lies on its probe path home..j */
        if (((j - home) & mask) >= ((j - i) & mask)) {
            r->slots[i] = r->slots[j];
            r->slots[j].used = 0;
            i = j;
        }
    }
}

axc_status axc_records_create(axc_grad_records **out, void (*rel)(void *ctx, void *owner),
                              void *ctx)
{
    if (!out || !rel)
        return axc_fail(AXC_ERR_INVALID, "axc_records_create: missing output or release function");
    axc_grad_records *r = calloc(1, sizeof *r);
    if (!r)
        return axc_fail(AXC_ERR_NOMEM, "axc_records_create: out of memory");
    r->release = rel;
    r->ctx = ctx;
    r->active = &r->own;
    r->task = AXC_NO_PASS;
    *out = r;
    return AXC_OK;
}

static void clear_counts(axc_grad_records *r, axc_chunk_counts *c)
{
    while (c->n) { /* (from the back: a release may count again) */
        void *p = c->v[--c->n].param;
        release(r, p);
    }
}

void axc_records_destroy(axc_grad_records *r)
{
    if (!r)
        return;
    axc_records_clear(r);
    for (size_t i = 0; i < r->cap; i++) {
        slot *s = &r->slots[i];
        if (s->used && s->stamp) {
            void *st = s->stamp;
            s->stamp = NULL;
            release(r, st);
        }
    }
    free(r->slots);
    free(r->recs);
    free(r->taken);
    free(r->own.v);
    free(r);
}

/* ------------------------------------------------------------------------------------ marks */

static axc_status set_mark(axc_grad_records *r, uintptr_t key, void *stamp,
                           const axc_groups *groups, double synced, double scaled,
                           int dated, unsigned long long gen)
{
    if (synced <= 0 && scaled == 1.0 && (!groups || groups->n <= 0)) {
        slot *s = find(r, key);
        void *old = s ? s->stamp : NULL;
        if (s && old) {
            s->stamp = NULL;
            r->marks--;
            r->dated -= s->dated != 0;
            s->dated = 0;
            drop_if_empty(r, s);
        }
        release(r, old);
        release(r, stamp);
        return AXC_OK;
    }
    if (!stamp || (groups && groups->n > AXC_GROUP_COUNT))
        return release(r, stamp), axc_fail(AXC_ERR_INVALID, "axc_records_mark: no stamp or too "
                                                            "many groups (%d)",
                                           groups ? groups->n : 0);
    slot *s = find_or_add(r, key);
    if (!s)
        return release(r, stamp), axc_fail(AXC_ERR_NOMEM, "axc_records_mark: out of memory");
    void *old = s->stamp;
    if (!old)
        r->marks++;
    r->dated = r->dated + (dated != 0) - (old && s->dated);
    s->stamp = stamp;
    s->marked = groups ? *groups : (axc_groups){.n = 0};
    s->synced = synced > 0 ? synced : 0;
    s->scaled = synced > 0 ? 1.0 : scaled;
    s->dated = dated;
    s->gen = dated ? gen : 0;
    release(r, old); /* (also when it is `stamp`: the caller handed over one more reference) */
    return AXC_OK;
}

axc_status axc_records_mark(axc_grad_records *r, uintptr_t key, void *stamp, const axc_groups *groups)
{
    return set_mark(r, key, stamp, groups, 0, 1.0, 0, 0);
}

axc_status axc_records_mark_scaled(axc_grad_records *r, uintptr_t key, void *stamp,
                                   const axc_groups *groups, double scale, unsigned long long gen)
{
    if (!(scale > 0))
        return release(r, stamp), axc_fail(AXC_ERR_INVALID, "axc_records_mark_scaled: scale "
                                                            "%g, expected > 0", scale);
    return set_mark(r, key, stamp, groups, 0, scale, 1, gen);
}

axc_status axc_records_mark_synced(axc_grad_records *r, uintptr_t key, void *stamp,
                                   const axc_groups *groups, double scale, unsigned long long gen)
{
    if (!(scale > 0))
        return release(r, stamp), axc_fail(AXC_ERR_INVALID, "axc_records_mark_synced: scale %g, "
                                                            "expected > 0", scale);
    return set_mark(r, key, stamp, groups, scale, 1.0, 1, gen);
}

int axc_records_marked(const axc_grad_records *r, uintptr_t key, void **stamp, axc_groups *groups)
{
    const slot *s = find(r, key);
    if (!s || !s->stamp)
        return 0;
    if (stamp)
        *stamp = s->stamp;
    if (groups)
        *groups = s->marked;
    return 1;
}

double axc_records_synced(const axc_grad_records *r, uintptr_t key, unsigned long long *gen)
{
    const slot *s = find(r, key);
    if (gen)
        *gen = s && s->stamp ? s->gen : 0;
    return s && s->stamp ? s->synced : 0;
}

int axc_records_dated(const axc_grad_records *r, uintptr_t key, unsigned long long *gen)
{
    const slot *s = find(r, key);
    int dated = s && s->stamp && s->dated;
    if (gen)
        *gen = dated ? s->gen : 0;
    return dated;
}

double axc_records_scale(const axc_grad_records *r, uintptr_t key)
{
    const slot *s = find(r, key);
    if (!s || !s->stamp)
        return 1.0;
    return s->synced > 0 ? s->synced : s->scaled;
}

size_t axc_records_dated_keys(const axc_grad_records *r, uintptr_t *out, size_t cap)
{
    size_t n = 0;
    for (size_t i = 0; i < r->cap; i++) {
        const slot *s = &r->slots[i];
        if (s->used && s->stamp && s->dated) {
            if (n < cap)
                out[n] = s->key;
            n++;
        }
    }
    return n;
}

size_t axc_records_marks(const axc_grad_records *r) { return r->marks; }
size_t axc_records_dated_count(const axc_grad_records *r) { return r->dated; }

/* ---------------------------------------------------------------------------------- records */

axc_status axc_records_add(axc_grad_records *r, const axc_grad_record *rec)
{
    slot *s = NULL;
    if (rec->groups.n < 0 || rec->groups.n > AXC_GROUP_COUNT || !rec->param || !rec->dw) {
        release(r, rec->param), release(r, rec->dw), release(r, rec->keep);
        return axc_fail(AXC_ERR_INVALID, "axc_records_add: a record needs a parameter, a "
                                         "gradient and at most %d groups", AXC_GROUP_COUNT);
    }
    if (!grow((void **)&r->recs, &r->rcap, r->nrecs + 1, sizeof *r->recs)
        || !(s = find_or_add(r, rec->key))) {
        release(r, rec->param), release(r, rec->dw), release(r, rec->keep);
        return axc_fail(AXC_ERR_NOMEM, "axc_records_add: out of memory");
    }
    s->last = r->nrecs;
    s->nrec++;
    r->recs[r->nrecs++] = *rec;
    return AXC_OK;
}

int axc_records_pending(const axc_grad_records *r, uintptr_t key)
{
    const slot *s = find(r, key);
    return s && s->nrec;
}

const axc_grad_record *axc_records_last(const axc_grad_records *r, uintptr_t key)
{
    const slot *s = find(r, key);
    return s && s->nrec ? &r->recs[s->last] : NULL;
}

size_t axc_records_count(const axc_grad_records *r) { return r->nrecs; }

axc_status axc_records_take(axc_grad_records *r, const axc_taken_grad *t)
{
    slot *s = find(r, t->key);
    axc_status st = AXC_OK;
    if (s && s->taken)
        st = axc_fail(AXC_ERR_STATE, "axc_records_take: this parameter's .grad is taken already");
    else if (!grow((void **)&r->taken, &r->tcap, r->ntaken + 1, sizeof *r->taken)
             || !(s = find_or_add(r, t->key)))
        st = axc_fail(AXC_ERR_NOMEM, "axc_records_take: out of memory");
    if (st != AXC_OK) {
        release(r, t->param), release(r, t->prev), release(r, t->scratch);
        return st;
    }
    s->taken = 1;
    r->taken[r->ntaken++] = *t;
    return AXC_OK;
}

int axc_records_is_taken(const axc_grad_records *r, uintptr_t key)
{
    const slot *s = find(r, key);
    return s && s->taken;
}

size_t axc_records_taken(const axc_grad_records *r) { return r->ntaken; }

/* ----------------------------------------------------------------------------- chunk records */

axc_status axc_records_chunk_open(axc_grad_records *r, uintptr_t key, int64_t bucket, long left)
{
    slot *s = find(r, key);
    if (!s || !s->nrec)
        return axc_fail(AXC_ERR_STATE, "axc_records_chunk_open: the parameter has no record");
    if (s->chunk)
        return axc_fail(AXC_ERR_STATE, "axc_records_chunk_open: a chunk record is open already");
    s->chunk = 1;
    s->chunk_rec = s->last;
    s->chunk_bucket = bucket;
    s->chunk_left = left;
    r->chunks++;
    return AXC_OK;
}

void *axc_records_chunk_dw(const axc_grad_records *r, uintptr_t key)
{
    const slot *s = find(r, key);
    return s && s->chunk ? r->recs[s->chunk_rec].dw : NULL;
}

int axc_records_chunk_done(axc_grad_records *r, uintptr_t key, int64_t *bucket)
{
    slot *s = find(r, key);
    if (!s || !s->chunk)
        return 0;
    if (--s->chunk_left != 0) /* more to come, or an unknown count: the end of the pass */
        return 0;
    s->chunk = 0;
    r->chunks--;
    if (bucket)
        *bucket = s->chunk_bucket;
    return 1;
}

size_t axc_records_chunks_open(const axc_grad_records *r) { return r->chunks; }

axc_status axc_chunk_counts_create(axc_chunk_counts **out)
{
    *out = calloc(1, sizeof **out);
    return *out ? AXC_OK : axc_fail(AXC_ERR_NOMEM, "axc_chunk_counts_create: out of memory");
}

void axc_chunk_counts_destroy(axc_chunk_counts *c, axc_grad_records *r)
{
    if (!c)
        return;
    if (r && r->active == c)
        r->active = &r->own;
    clear_counts(r, c);
    free(c->v);
    free(c);
}

static axc_status count_into(axc_grad_records *r, axc_chunk_counts *c, uintptr_t key, void *param,
                             long n)
{
    for (size_t i = 0; i < c->n; i++)
        if (c->v[i].key == key) {
            c->v[i].n += n;
            release(r, param); /* (the table holds one already) */
            return AXC_OK;
        }
    if (!grow((void **)&c->v, &c->cap, c->n + 1, sizeof *c->v)) {
        release(r, param);
        return axc_fail(AXC_ERR_NOMEM, "chunk call counts: out of memory");
    }
    c->v[c->n++] = (count){key, param, n};
    return AXC_OK;
}

axc_status axc_records_expect_chunk(axc_grad_records *r, uintptr_t key, void *param)
{
    return count_into(r, r->active, key, param, 1);
}

axc_chunk_counts *axc_records_count_into(axc_grad_records *r, axc_chunk_counts *c)
{
    axc_chunk_counts *prev = r->active == &r->own ? NULL : r->active;
    r->active = c ? c : &r->own;
    return prev;
}

axc_status axc_records_add_counts(axc_grad_records *r, axc_chunk_counts *c)
{
    axc_status st = AXC_OK;
    for (size_t i = 0; i < c->n; i++) {
        axc_status s = count_into(r, &r->own, c->v[i].key, c->v[i].param, c->v[i].n);
        st = st != AXC_OK ? st : s; /* (the owner went into the table or was released) */
    }
    c->n = 0;
    return st;
}

void axc_records_clear_counts(axc_grad_records *r) { clear_counts(r, &r->own); }

long axc_records_take_count(axc_grad_records *r, uintptr_t key)
{
    axc_chunk_counts *c = &r->own;
    for (size_t i = 0; i < c->n; i++)
        if (c->v[i].key == key) {
            count e = c->v[i];
            c->v[i] = c->v[--c->n];
            release(r, e.param);
            return e.n;
        }
    return 0;
}

/* ------------------------------------------------------------------------------- end of pass */

axc_status axc_records_detach(axc_grad_records *r, int finishing, axc_records_pass *out)
{
    memset(out, 0, sizeof *out);
    size_t ndrop = 0, nrestore = 0;
    for (size_t i = 0; i < r->ntaken; i++) {
        const slot *s = find(r, r->taken[i].key);
        if (finishing && s && s->nrec)
            ndrop += 3;
        else
            nrestore++;
    }
    axc_taken_grad *restore = nrestore ? malloc(nrestore * sizeof *restore) : NULL;
    void **drop = ndrop ? malloc(ndrop * sizeof *drop) : NULL;
    if ((nrestore && !restore) || (ndrop && !drop)) {
        free(restore);
        free(drop);
        return axc_fail(AXC_ERR_NOMEM, "axc_records_detach: out of memory");
    }
    for (size_t i = 0; i < r->ntaken; i++) {
        const axc_taken_grad *t = &r->taken[i];
        const slot *s = find(r, t->key);
        if (finishing && s && s->nrec) {
            drop[out->ndrop++] = t->param;
            drop[out->ndrop++] = t->prev;
            drop[out->ndrop++] = t->scratch;
        } else {
            restore[out->nrestore++] = *t;
        }
    }
    out->restore = restore;
    out->drop = drop;
    out->recs = r->recs;
    out->nrecs = r->nrecs;
    r->recs = NULL;
    r->nrecs = r->rcap = 0;
    r->ntaken = 0;
    r->chunks = 0;
    for (size_t i = 0; i < r->cap; i++) {
        slot *s = &r->slots[i];
        s->nrec = 0;
        s->taken = s->chunk = 0;
    }
    if (r->cap)
        rehash(r, r->cap); /* (the same size: cannot fail for want of room; on NOMEM the
                            * emptied slots just stay until the next rebuild) */
    axc_records_clear_counts(r);
    return AXC_OK;
}

void axc_records_pass_release(axc_grad_records *r, axc_records_pass *p)
{
    axc_records_pass q = *p; /* (a release may call back in: p is emptied first) */
    memset(p, 0, sizeof *p);
    for (size_t i = 0; i < q.nrecs; i++) {
        release(r, q.recs[i].param);
        release(r, q.recs[i].dw);
        release(r, q.recs[i].keep);
    }
    for (size_t i = 0; i < q.nrestore; i++) {
        release(r, q.restore[i].param);
        release(r, q.restore[i].prev);
        release(r, q.restore[i].scratch);
    }
    for (size_t i = 0; i < q.ndrop; i++)
        release(r, q.drop[i]);
    free(q.recs);
    free(q.restore);
    free(q.drop);
}

void axc_records_set_pass(axc_grad_records *r, int64_t task, void *owner)
{
    void *old = r->pass_owner;
    r->task = task;
    r->pass_owner = owner;
    release(r, old);
}

void axc_records_set_task(axc_grad_records *r, int64_t task) { r->task = task; }

int64_t axc_records_pass_task(const axc_grad_records *r) { return r->task; }

void *axc_records_pass_owner(const axc_grad_records *r) { return r->pass_owner; }

void axc_records_clear(axc_grad_records *r)
{
    axc_records_pass p;
    if (axc_records_detach(r, 0, &p) == AXC_OK)
        axc_records_pass_release(r, &p);
    axc_records_set_pass(r, AXC_NO_PASS, NULL);
    r->active = &r->own;
}
