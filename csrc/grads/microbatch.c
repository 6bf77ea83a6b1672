/* One run_concurrent call's shared decisions (axc/microbatch.h): the reducer's buckets and
 * their readiness; the shared depth gathers, their learned order and prefetch. */
#include "axc/microbatch.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "axc/grid.h"
#include "axc/reduce.h"

typedef struct mb_param {
    uintptr_t id;
    int bucket;
    int arrived; /* micro-batches whose gradient arrived */
} mb_param;

typedef struct mb_bucket {
    axc_bucket_key key;
    int first, count;
    size_t bytes;
    int missing; /* parameters with fewer than n arrivals */
} mb_bucket;

typedef struct gather_key {
    int layer, phase, use;
} gather_key;

static int same_gather(gather_key a, gather_key b)
{
    return a.layer == b.layer && a.phase == b.phase && a.use == b.use;
}

/* one first arrival: its key, its weight (a reference; NULL: not kept) and size */
typedef struct arrival {
    gather_key key;
    void *w;
    size_t numel;
} arrival;

struct axc_mb_memory {
    axc_mb_ops ops;
    arrival *learned;
    int nlearned;
    axc_mb_stats last;
};

/* a started shared gather */
typedef struct gather {
    gather_key key;
    void *src;          /* the weight it gathers (identity) */
    void *pinned;       /* keeps the storage it sends from, until its work is waited */
    void *data, *owner; /* the gathered buffer */
    axc_work *work;     /* NULL once taken by its waiter */
    int live;           /* in the table: not yet used by all n */
    int ready;          /* waited for: `status` is its outcome */
    axc_status status;
    char msg[256];
    int uses;
} gather;

/* a key's blocks while micro-batches still hand theirs in */
typedef struct scatter_part {
    int layer, use, count;
    void **owners, **blocks; /* [n] */
} scatter_part;

/* a started shared reduce-scatter */
typedef struct scatter {
    void *w;            /* the weight (a reference) */
    void *out;          /* the reduced shard's owner */
    axc_work *work;     /* NULL once waited by close */
    void *block_owner;  /* the summed block, until let go */
    int held;
    axc_status status;
    char msg[256]; /* why, when status is not AXC_OK */
} scatter;

/* one micro-batch's uses of one (layer, phase) so far */
typedef struct use_count {
    int layer, phase, count;
} use_count;

/* one micro-batch's use counts (touched by its own thread only) */
typedef struct mb_uses {
    use_count *u;
    int nu, capu;
} mb_uses;

struct axc_mb {
    int n;
    mb_uses *uses; /* [n] */
    axc_comm *comm;
    axc_mb_memory *mem;
    axc_mb_ops ops;
    pthread_mutex_t gmu; /* the gathers' state */
    pthread_cond_t gcv;  /* a gather became ready */
    pthread_mutex_t smu; /* the reduce-scatters' state (parts, sc, held): taken after gmu */
    gather *g;           /* every gather started in this call, in issue order */
    int ng, capg;
    gather_key *arrived; /* keys first asked for */
    int narrived, caparrived;
    arrival *seq; /* this call's first arrivals, in order */
    int nseq, capseq;
    long long prefetched;
    scatter_part *parts;
    int nparts, capparts;
    scatter *sc;
    int nsc, capsc;
    int bound;     /* summed blocks held at most */
    int held;      /* summed blocks held now */
    int peak_held;
    int closed;
    size_t bucket_bytes;
    pthread_mutex_t mu;
    pthread_cond_t cv; /* an arrival completed a parameter, or a thread ended */
    mb_param *p;
    int np, capp;
    mb_bucket *b;
    int nb, capb;
    int *slot; /* open addressing: index + 1 into p by id, 0 empty; capslot a power of two */
    int capslot;
    int next;     /* the reducer's next bucket */
    int finished; /* threads ended */
    int failed;   /* a thread ended with an error */
};

static size_t hash_id(uintptr_t id, int cap)
{
    return (size_t)(((uint64_t)id >> 4) * 0x9E3779B97F4A7C15ull >> 20) & (size_t)(cap - 1);
}

static int find(const axc_mb *mb, uintptr_t id)
{
    if (!mb->capslot)
        return -1;
    for (size_t h = hash_id(id, mb->capslot);; h = (h + 1) & (size_t)(mb->capslot - 1)) {
        int s = mb->slot[h];
        if (!s)
            return -1;
        if (mb->p[s - 1].id == id)
            return s - 1;
    }
}

static void put(axc_mb *mb, int i)
{
    size_t h = hash_id(mb->p[i].id, mb->capslot);
    while (mb->slot[h])
        h = (h + 1) & (size_t)(mb->capslot - 1);
    mb->slot[h] = i + 1;
}

axc_status axc_mb_create(axc_mb **out, int n, size_t bucket_bytes, axc_comm *comm,
                         axc_mb_memory *mem)
{
    if (!out)
        return axc_fail(AXC_ERR_INVALID, "axc_mb_create: NULL output");
    *out = NULL;
    if (n < 1)
        return axc_fail(AXC_ERR_INVALID, "concurrent micro-batches: n=%d, expected >= 1", n);
    if (bucket_bytes == 0)
        return axc_fail(AXC_ERR_INVALID, "gradient bucket size must be positive, got 0 bytes");
    axc_mb *mb = calloc(1, sizeof *mb);
    if (!mb)
        return axc_fail(AXC_ERR_NOMEM, "axc_mb_create: out of memory");
    mb->uses = calloc((size_t)n, sizeof *mb->uses);
    if (!mb->uses) {
        free(mb);
        return axc_fail(AXC_ERR_NOMEM, "axc_mb_create: out of memory");
    }
    mb->n = n;
    mb->bucket_bytes = bucket_bytes;
    mb->comm = comm;
    mb->mem = mem;
    mb->bound = 2;
    if (mem)
        mb->ops = mem->ops;
    int init = 0;
    init += pthread_mutex_init(&mb->mu, NULL) == 0;
    pthread_condattr_t ca; /* (the reducer's timed waits count on the monotonic clock) */
    if (init == 1 && pthread_condattr_init(&ca) == 0) {
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        init += pthread_cond_init(&mb->cv, &ca) == 0;
        pthread_condattr_destroy(&ca);
    }
    init += init == 2 && pthread_mutex_init(&mb->gmu, NULL) == 0;
    init += init == 3 && pthread_cond_init(&mb->gcv, NULL) == 0;
    init += init == 4 && pthread_mutex_init(&mb->smu, NULL) == 0;
    if (init < 5) {
        if (init > 3)
            pthread_cond_destroy(&mb->gcv);
        if (init > 2)
            pthread_mutex_destroy(&mb->gmu);
        if (init > 1)
            pthread_cond_destroy(&mb->cv);
        if (init > 0)
            pthread_mutex_destroy(&mb->mu);
        free(mb->uses);
        free(mb);
        return axc_fail(AXC_ERR_NOMEM, "axc_mb_create: a pthread lock could not be made");
    }
    *out = mb;
    return AXC_OK;
}

void axc_mb_destroy(axc_mb *mb)
{
    if (!mb)
        return;
    if (!mb->closed)
        (void)axc_mb_close(mb, 0);
    for (int i = 0; i < mb->nsc; i++) { /* (the results, kept for axc_mb_scatter_result) */
        mb->ops.release(mb->ops.ctx, mb->sc[i].w);
        if (mb->sc[i].out)
            mb->ops.release(mb->ops.ctx, mb->sc[i].out);
    }
    for (int i = 0; i < mb->nparts; i++) {
        free(mb->parts[i].owners);
        free(mb->parts[i].blocks);
    }
    free(mb->parts);
    free(mb->sc);
    free(mb->g);
    free(mb->arrived);
    free(mb->seq);
    pthread_mutex_destroy(&mb->smu);
    pthread_cond_destroy(&mb->gcv);
    pthread_mutex_destroy(&mb->gmu);
    pthread_cond_destroy(&mb->cv);
    pthread_mutex_destroy(&mb->mu);
    for (int i = 0; i < mb->n; i++)
        free(mb->uses[i].u);
    free(mb->uses);
    free(mb->p);
    free(mb->b);
    free(mb->slot);
    free(mb);
}

int axc_mb_n(const axc_mb *mb) { return mb->n; }
int axc_mb_params(const axc_mb *mb) { return mb->np; }
int axc_mb_buckets(const axc_mb *mb) { return mb->nb; }
uintptr_t axc_mb_param(const axc_mb *mb, int i) { return i >= 0 && i < mb->np ? mb->p[i].id : 0; }

static int grow(void **v, int *cap, int need, size_t size)
{
    if (need <= *cap)
        return 0;
    int c = *cap ? 2 * *cap : 16;
    while (c < need)
        c *= 2;
    void *nv = realloc(*v, (size_t)c * size);
    if (!nv)
        return -1;
    *v = nv;
    *cap = c;
    return 0;
}

axc_status axc_mb_add_param(axc_mb *mb, uintptr_t id, const axc_bucket_key *key, size_t bytes)
{
    if (!key || key->ngroups < 1 || key->ngroups > AXC_BUCKET_MAX_GROUPS)
        return axc_fail(AXC_ERR_INVALID, "micro-batch reducer: a parameter needs 1 to %d groups "
                                         "to sum over", AXC_BUCKET_MAX_GROUPS);
    if (find(mb, id) >= 0)
        return axc_fail(AXC_ERR_INVALID, "micro-batch reducer: parameter %#lx given twice",
                        (unsigned long)id);
    if (grow((void **)&mb->p, &mb->capp, mb->np + 1, sizeof *mb->p))
        return axc_fail(AXC_ERR_NOMEM, "micro-batch reducer: out of memory");
    if (2 * (mb->np + 1) > mb->capslot) { /* rehash at half load */
        int cap = mb->capslot ? 2 * mb->capslot : 32;
        int *slot = calloc((size_t)cap, sizeof *slot);
        if (!slot)
            return axc_fail(AXC_ERR_NOMEM, "micro-batch reducer: out of memory");
        free(mb->slot);
        mb->slot = slot;
        mb->capslot = cap;
        for (int i = 0; i < mb->np; i++)
            put(mb, i);
    }
    mb_bucket *last = mb->nb ? &mb->b[mb->nb - 1] : NULL;
    if (!last || !axc_bucket_key_same(&last->key, key) || last->bytes + bytes > mb->bucket_bytes) {
        if (grow((void **)&mb->b, &mb->capb, mb->nb + 1, sizeof *mb->b))
            return axc_fail(AXC_ERR_NOMEM, "micro-batch reducer: out of memory");
        last = &mb->b[mb->nb++];
        *last = (mb_bucket){.key = *key, .first = mb->np};
    }
    last->count++;
    last->bytes += bytes;
    last->missing++;
    mb->p[mb->np] = (mb_param){.id = id, .bucket = mb->nb - 1};
    put(mb, mb->np++);
    return AXC_OK;
}

int axc_mb_has_param(const axc_mb *mb, uintptr_t id) { return mb && find(mb, id) >= 0; }

void axc_mb_arrive(axc_mb *mb, uintptr_t id)
{
    int i = find(mb, id); /* (the table is not changed while threads run) */
    if (i < 0)
        return;
    pthread_mutex_lock(&mb->mu);
    if (++mb->p[i].arrived == mb->n && --mb->b[mb->p[i].bucket].missing == 0)
        pthread_cond_broadcast(&mb->cv);
    pthread_mutex_unlock(&mb->mu);
}

void axc_mb_thread_done(axc_mb *mb, int failed)
{
    pthread_mutex_lock(&mb->mu);
    mb->finished++;
    mb->failed |= failed != 0;
    pthread_cond_broadcast(&mb->cv);
    pthread_mutex_unlock(&mb->mu);
}

int axc_mb_next_bucket(axc_mb *mb, int wait_ms, int *first, int *count, axc_bucket_key *key)
{
    struct timespec until;
    if (wait_ms >= 0) {
        clock_gettime(CLOCK_MONOTONIC, &until);
        until.tv_sec += wait_ms / 1000;
        until.tv_nsec += (long)(wait_ms % 1000) * 1000000L;
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000L;
        }
    }
    pthread_mutex_lock(&mb->mu);
    while (!mb->failed && mb->next < mb->nb && mb->finished < mb->n &&
           mb->b[mb->next].missing > 0) {
        if (wait_ms < 0) {
            pthread_cond_wait(&mb->cv, &mb->mu);
        } else if (pthread_cond_timedwait(&mb->cv, &mb->mu, &until) == ETIMEDOUT) {
            pthread_mutex_unlock(&mb->mu);
            return -1;
        }
    }
    int got = !mb->failed && mb->next < mb->nb;
    if (got) {
        const mb_bucket *b = &mb->b[mb->next++];
        *first = b->first;
        *count = b->count;
        *key = b->key;
    }
    pthread_mutex_unlock(&mb->mu);
    return got;
}

/* ---- each micro-batch's uses of a layer ---- */

axc_status axc_mb_next_use(axc_mb *mb, int layer, int phase, int *use)
{
    int ch = axc_comm_thread_channel();
    if (ch < 1 || ch > mb->n)
        return axc_fail(AXC_ERR_STATE, "concurrent micro-batches: layer %d's shared depth "
                                       "traffic asked for on channel %d, expected a micro-batch "
                                       "thread's (1 to %d)", layer, ch, mb->n);
    mb_uses *t = &mb->uses[ch - 1];
    int i = 0; /* (a few keys per layer: a scan costs less than the collective it names) */
    while (i < t->nu && (t->u[i].layer != layer || t->u[i].phase != phase))
        i++;
    if (i == t->nu) {
        if (grow((void **)&t->u, &t->capu, t->nu + 1, sizeof *t->u))
            return axc_fail(AXC_ERR_NOMEM, "concurrent micro-batches: out of memory");
        t->u[t->nu++] = (use_count){.layer = layer, .phase = phase};
    }
    *use = ++t->u[i].count;
    return AXC_OK;
}

/* ---- the learned order, kept across calls ---- */

axc_status axc_mb_memory_create(axc_mb_memory **out, const axc_mb_ops *ops)
{
    if (!out || !ops || !ops->alloc || !ops->describe || !ops->retain || !ops->release)
        return axc_fail(AXC_ERR_INVALID, "axc_mb_memory_create: missing output or ops");
    axc_mb_memory *m = calloc(1, sizeof *m);
    if (!m)
        return axc_fail(AXC_ERR_NOMEM, "axc_mb_memory_create: out of memory");
    m->ops = *ops;
    *out = m;
    return AXC_OK;
}

static void release_arrivals(const axc_mb_ops *ops, arrival *a, int n)
{
    for (int i = 0; i < n; i++)
        if (a[i].w)
            ops->release(ops->ctx, a[i].w);
}

void axc_mb_memory_clear(axc_mb_memory *m)
{
    if (!m)
        return;
    release_arrivals(&m->ops, m->learned, m->nlearned);
    free(m->learned);
    m->learned = NULL;
    m->nlearned = 0;
}

void axc_mb_memory_destroy(axc_mb_memory *m)
{
    axc_mb_memory_clear(m);
    free(m);
}

void axc_mb_memory_stats(const axc_mb_memory *m, axc_mb_stats *out)
{
    *out = m ? m->last : (axc_mb_stats){0};
}

int axc_mb_memory_learned(const axc_mb_memory *m) { return m ? m->nlearned : 0; }

void *axc_mb_memory_learned_weight(const axc_mb_memory *m, int i)
{
    return m && i >= 0 && i < m->nlearned ? m->learned[i].w : NULL;
}

/* ---- shared gathers ---- */

static void *let_go(const axc_mb *mb)
{
    return mb->ops.blocking_begin ? mb->ops.blocking_begin(mb->ops.ctx) : NULL;
}

static void take_back(const axc_mb *mb, void *state)
{
    if (mb->ops.blocking_end)
        mb->ops.blocking_end(mb->ops.ctx, state);
}

/* Takes the gathers' (gmu) or the reduce-scatters' (smu) lock; waits for it without the
 * caller's lock (whose holder may be waiting here too), which is taken back with this one
 * held. */
static void lock_shared(const axc_mb *mb, pthread_mutex_t *mu)
{
    if (pthread_mutex_trylock(mu) == 0)
        return;
    void *s = let_go(mb);
    pthread_mutex_lock(mu);
    take_back(mb, s);
}

static void lock_gathers(axc_mb *mb) { lock_shared(mb, &mb->gmu); }
static void lock_scatters(axc_mb *mb) { lock_shared(mb, &mb->smu); }

/* A work whose wait timed out while it still runs belongs to the backend: it may still write
 * its buffers, so neither the work nor those buffers may be freed (leaked instead, as
 * axc_work_wait's callers do elsewhere). */
static int still_running(axc_status st, axc_work *work)
{
    return st == AXC_ERR_TIMEOUT && !axc_work_done(work);
}

/* Waits for `work` and frees it; *running (if given): it timed out still running, not freed,
 * and its buffers must be leaked. */
static axc_status wait_work(axc_mb *mb, axc_work *work, int *running)
{
    if (running)
        *running = 0;
    if (!work)
        return AXC_OK;
    void *s = let_go(mb);
    axc_status st = axc_work_wait(work);
    if (still_running(st, work)) {
        if (running)
            *running = 1;
    } else {
        axc_work_free(work);
    }
    take_back(mb, s);
    return st;
}

/* Gather g's work was waited for: the weight storage it sent from is let go; still running,
 * its buffer and that storage are leaked instead (the backend may still use them). */
static void gather_waited(axc_mb *mb, gather *g, int running)
{
    if (running)
        g->owner = NULL;
    else if (g->pinned)
        mb->ops.release(mb->ops.ctx, g->pinned);
    g->pinned = NULL;
}

static int find_live(const axc_mb *mb, gather_key key)
{
    for (int i = 0; i < mb->ng; i++)
        if (mb->g[i].live && same_gather(mb->g[i].key, key))
            return i;
    return -1;
}

static int was_issued(const axc_mb *mb, gather_key key)
{
    for (int i = 0; i < mb->ng; i++)
        if (same_gather(mb->g[i].key, key))
            return 1;
    return 0;
}

/* start_gather with the weight's storage held by `pinned` (described in w's place); the gather
 * keeps `pinned` when it starts. */
/* Starts depth collective `c` on `channel` (a shared one: the gathers' n + 1, the
 * reduce-scatters' n + 2) and puts the calling thread back on its own. */
static axc_status start_on_channel(axc_mb *mb, int channel, const axc_coll *c, axc_work **work)
{
    int own = axc_comm_thread_channel();
    axc_status st = axc_comm_set_thread_channel(mb->comm, channel);
    if (st != AXC_OK)
        return st;
    st = axc_comm_start(mb->comm, AXC_GROUP_DEPTH, c, work);
    axc_status back = axc_comm_set_thread_channel(mb->comm, own);
    if (st == AXC_OK && back != AXC_OK) {
        axc_work_free(*work);
        *work = NULL;
        st = back;
    }
    return st;
}

static axc_status start_gather_pinned(axc_mb *mb, gather_key key, void *w, void *pinned,
                                      size_t numel, int *gi)
{
    const void *shard;
    size_t elems;
    axc_dtype dtype;
    int device;
    AXC_TRY(mb->ops.describe(mb->ops.ctx, pinned, &shard, &elems, &dtype, &device));
    if (device >= 0) /* (as the reduce-scatters: run_concurrent runs host tensors) */
        return axc_fail(AXC_ERR_INVALID, "shared depth all-gather of layer %d: the weight is on "
                                         "CUDA device %d; concurrent micro-batches run CPU "
                                         "tensors only", key.layer, device);
    size_t G = (size_t)axc_grid_group_size(axc_comm_grid(mb->comm), AXC_GROUP_DEPTH);
    if (elems * G != numel)
        return axc_fail(AXC_ERR_INVALID, "shared depth all-gather of layer %d: %zu elements "
                                         "asked for, but the shard has %zu over %zu ranks",
                        key.layer, numel, elems, G);
    if (grow((void **)&mb->g, &mb->capg, mb->ng + 1, sizeof *mb->g))
        return axc_fail(AXC_ERR_NOMEM, "shared depth all-gathers: out of memory");
    void *data, *owner;
    AXC_TRY(mb->ops.alloc(mb->ops.ctx, w, numel, &data, &owner));
    axc_coll c = {.kind = AXC_COLL_ALL_GATHER, .send = shard, .recv = data, .count = elems,
                  .dtype = dtype, .op = AXC_RED_SUM, .device = device};
    axc_work *work = NULL;
    axc_status st = start_on_channel(mb, mb->n + 1, &c, &work);
    if (st != AXC_OK) {
        mb->ops.release(mb->ops.ctx, owner);
        return st;
    }
    *gi = mb->ng++;
    mb->g[*gi] = (gather){.key = key, .src = w, .pinned = pinned, .data = data, .owner = owner,
                          .work = work, .live = 1};
    return AXC_OK;
}

/* Starts the gather of `key` from weight `w` on the gather channel (the lock held: issue
 * order); its index in *gi. */
static axc_status start_gather(axc_mb *mb, gather_key key, void *w, size_t numel, int *gi)
{
    void *pinned = w; /* (sent from without a copy: its storage must outlive the work) */
    if (mb->ops.pin)
        AXC_TRY(mb->ops.pin(mb->ops.ctx, w, &pinned));
    else
        mb->ops.retain(mb->ops.ctx, w);
    axc_status st = start_gather_pinned(mb, key, w, pinned, numel, gi);
    if (st != AXC_OK)
        mb->ops.release(mb->ops.ctx, pinned);
    return st;
}

/* What a first arrival decides with the lock held: the gather to wait for in *gi. */
static axc_status first_arrival(axc_mb *mb, gather_key key, void *w, int keep, size_t numel,
                                int *gi)
{
    if (grow((void **)&mb->arrived, &mb->caparrived, mb->narrived + 1, sizeof *mb->arrived) ||
        grow((void **)&mb->seq, &mb->capseq, mb->nseq + 1, sizeof *mb->seq))
        return axc_fail(AXC_ERR_NOMEM, "shared depth all-gathers: out of memory");
    mb->arrived[mb->narrived++] = key;
    *gi = find_live(mb, key);
    if (*gi >= 0 && mb->g[*gi].src != w) { /* prefetched from another tensor: not this one */
        gather *g = &mb->g[*gi];
        axc_work *work = g->work;
        g->work = NULL;
        g->live = 0;
        g->ready = 1;
        /* every rank started it; its data is not used, but it writes its buffer until it
         * completes: let go of the buffer only then */
        int running;
        (void)wait_work(mb, work, &running);
        gather_waited(mb, g, running);
        if (g->owner)
            mb->ops.release(mb->ops.ctx, g->owner);
        g->owner = NULL;
        *gi = -1;
    }
    if (*gi < 0)
        AXC_TRY(start_gather(mb, key, w, numel, gi));
    else
        mb->prefetched++;
    int j = mb->nseq++;
    if (keep)
        mb->ops.retain(mb->ops.ctx, w);
    mb->seq[j] = (arrival){key, keep ? w : NULL, numel};
    /* the successor in the learned order, if this call follows it so far (the same key for the
     * same weight) */
    const axc_mb_memory *m = mb->mem;
    if (j + 1 < m->nlearned && same_gather(m->learned[j].key, key) && m->learned[j].w == w) {
        const arrival *next = &m->learned[j + 1];
        int ni;
        if (next->w && !was_issued(mb, next->key))
            AXC_TRY(start_gather(mb, next->key, next->w, next->numel, &ni));
    }
    return AXC_OK;
}

/* The first arrival at `key` failed with `st` (its gather may have started: gi >= 0): the
 * others asking for it fail too instead of waiting for ever. Returns st, its message kept. */
static axc_status fail_key(axc_mb *mb, gather_key key, int gi, axc_status st)
{
    char msg[256];
    snprintf(msg, sizeof msg, "%s", axc_last_error());
    if (gi < 0) {
        if (grow((void **)&mb->g, &mb->capg, mb->ng + 1, sizeof *mb->g))
            return axc_fail(st, "%s", msg); /* (out of memory: the others will not be told) */
        gi = mb->ng++;
        mb->g[gi] = (gather){.key = key, .live = 1};
    }
    axc_work *work = mb->g[gi].work;
    mb->g[gi].work = NULL;
    int running;
    (void)wait_work(mb, work, &running); /* (started on every rank: it completes) */
    gather *g = &mb->g[gi];
    gather_waited(mb, g, running);
    g->ready = 1;
    g->status = st;
    snprintf(g->msg, sizeof g->msg, "%s", msg);
    pthread_cond_broadcast(&mb->gcv);
    return axc_fail(st, "%s", msg);
}

axc_status axc_mb_gather(axc_mb *mb, int layer, int phase, int use, void *w, int keep,
                         size_t numel, void **data, void **owner)
{
    if (!mb->comm || !mb->mem)
        return axc_fail(AXC_ERR_STATE, "shared depth all-gather: the call has no communicator");
    gather_key key = {layer, phase, use};
    lock_gathers(mb);
    int first = 1;
    for (int i = 0; i < mb->narrived && first; i++)
        first = !same_gather(mb->arrived[i], key);
    int gi = first ? -1 : find_live(mb, key);
    axc_status st = first ? first_arrival(mb, key, w, keep, numel, &gi) : AXC_OK;
    if (st != AXC_OK)
        st = fail_key(mb, key, gi, st);
    else if (gi < 0)
        st = axc_fail(AXC_ERR_STATE, "shared depth all-gather of layer %d: asked for by more "
                                     "than %d micro-batches", layer, mb->n);
    if (st != AXC_OK) {
        pthread_mutex_unlock(&mb->gmu);
        return st;
    }
    if (first) { /* wait for it without the lock, then wake the others */
        axc_work *work = mb->g[gi].work;
        mb->g[gi].work = NULL;
        pthread_mutex_unlock(&mb->gmu);
        int running;
        st = wait_work(mb, work, &running);
        lock_gathers(mb);
        gather *g = &mb->g[gi];
        gather_waited(mb, g, running);
        g->ready = 1;
        g->status = st;
        if (st != AXC_OK)
            snprintf(g->msg, sizeof g->msg, "%s", axc_last_error());
        pthread_cond_broadcast(&mb->gcv);
    } else if (!mb->g[gi].ready) {
        void *s = let_go(mb);
        while (!mb->g[gi].ready)
            pthread_cond_wait(&mb->gcv, &mb->gmu);
        take_back(mb, s);
    }
    gather *g = &mb->g[gi];
    if (g->status != AXC_OK) {
        if (!first)
            st = axc_fail(g->status, "the shared depth all-gather of this layer failed: %s",
                          g->msg);
        pthread_mutex_unlock(&mb->gmu);
        return st;
    }
    *data = g->data;
    *owner = g->owner;
    mb->ops.retain(mb->ops.ctx, g->owner);
    if (++g->uses == mb->n) {
        mb->ops.release(mb->ops.ctx, g->owner);
        g->owner = NULL;
        g->live = 0;
    }
    pthread_mutex_unlock(&mb->gmu);
    return AXC_OK;
}

axc_status axc_mb_close(axc_mb *mb, int ok)
{
    if (mb->closed)
        return AXC_OK;
    mb->closed = 1;
    axc_status first = AXC_OK;
    char first_msg[256] = "";
    lock_gathers(mb);
    for (int i = 0; i < mb->ng; i++) {
        gather *g = &mb->g[i];
        axc_work *work = g->work;
        g->work = NULL;
        int running;
        axc_status st = wait_work(mb, work, &running);
        if (st != AXC_OK && first == AXC_OK) {
            first = st;
            snprintf(first_msg, sizeof first_msg, "%s", axc_last_error());
        }
        gather_waited(mb, g, running);
        if (g->owner)
            mb->ops.release(mb->ops.ctx, g->owner);
        g->owner = NULL;
        g->live = 0;
    }
    lock_scatters(mb); /* (after gmu: the lock order) */
    for (int i = 0; i < mb->nsc; i++) { /* (in issue order: they run in it) */
        scatter *e = &mb->sc[i];
        axc_work *work = e->work;
        e->work = NULL;
        int running;
        axc_status st = wait_work(mb, work, &running);
        if (st != AXC_OK && e->status == AXC_OK) {
            e->status = st;
            snprintf(e->msg, sizeof e->msg, "%s", axc_last_error());
        }
        if (e->status != AXC_OK && first == AXC_OK) {
            first = e->status;
            snprintf(first_msg, sizeof first_msg, "%s", e->msg);
        }
        if (running) { /* (it still reads the block and writes the shard: both leaked) */
            e->block_owner = NULL;
            e->out = NULL;
        }
        if (e->block_owner)
            mb->ops.release(mb->ops.ctx, e->block_owner);
        e->block_owner = NULL;
    }
    for (int i = 0; i < mb->nparts; i++) { /* blocks of keys not every micro-batch reached */
        for (int k = 0; k < mb->parts[i].count; k++)
            mb->ops.release(mb->ops.ctx, mb->parts[i].owners[k]);
        mb->parts[i].count = 0;
    }
    if (mb->mem) {
        mb->mem->last = (axc_mb_stats){.gathers = mb->ng, .prefetched = mb->prefetched,
                                       .reduce_scatters = mb->nsc,
                                       .peak_blocks = mb->peak_held};
        if (ok) {
            axc_mb_memory_clear(mb->mem);
            mb->mem->learned = mb->seq;
            mb->mem->nlearned = mb->nseq;
            mb->seq = NULL;
            mb->nseq = mb->capseq = 0;
        }
    }
    if (mb->seq)
        release_arrivals(&mb->ops, mb->seq, mb->nseq);
    mb->nseq = 0;
    pthread_mutex_unlock(&mb->smu);
    pthread_mutex_unlock(&mb->gmu);
    if (!ok || first == AXC_OK)
        return AXC_OK;
    return axc_fail(first, "%s", first_msg);
}

/* ---- shared dW reduce-scatters ---- */

void axc_mb_set_scatter_bound(axc_mb *mb, int bound) { mb->bound = bound < 0 ? 0 : bound; }

int axc_mb_scatters(const axc_mb *mb) { return mb->nsc; }

int axc_mb_scatter_result(const axc_mb *mb, int i, void **w, void **out)
{
    if (i < 0 || i >= mb->nsc)
        return 0;
    *w = mb->sc[i].w;
    *out = mb->sc[i].out;
    return mb->sc[i].status == AXC_OK;
}

static int find_part(axc_mb *mb, int layer, int use)
{
    for (int i = 0; i < mb->nparts; i++)
        if (mb->parts[i].layer == layer && mb->parts[i].use == use)
            return i;
    if (grow((void **)&mb->parts, &mb->capparts, mb->nparts + 1, sizeof *mb->parts))
        return -1;
    scatter_part p = {.layer = layer, .use = use};
    p.owners = calloc((size_t)mb->n, sizeof *p.owners);
    p.blocks = calloc((size_t)mb->n, sizeof *p.blocks);
    if (!p.owners || !p.blocks) {
        free(p.owners);
        free(p.blocks);
        return -1;
    }
    mb->parts[mb->nparts] = p;
    return mb->nparts++;
}

/* Sums the part's blocks into its first and starts the reduce-scatter (smu held: the
 * reduce-scatters start in one order on every rank; the gathers go on meanwhile). */
static axc_status start_scatter(axc_mb *mb, scatter_part *p, void *w, size_t elems)
{
    const void *shard;
    size_t shard_elems;
    axc_dtype dtype;
    int device;
    AXC_TRY(mb->ops.describe(mb->ops.ctx, w, &shard, &shard_elems, &dtype, &device));
    (void)device; /* (every block was checked as it came: check_block) */
    if (grow((void **)&mb->sc, &mb->capsc, mb->nsc + 1, sizeof *mb->sc))
        return axc_fail(AXC_ERR_NOMEM, "shared dW reduce-scatters: out of memory");
    void *s = let_go(mb); /* (a sum of whole weights: without the caller's lock) */
    axc_reduce(dtype, AXC_RED_SUM, p->blocks[0], (const void *const *)p->blocks, p->count, elems,
               1);
    take_back(mb, s);
    void *data, *out;
    AXC_TRY(mb->ops.alloc(mb->ops.ctx, w, shard_elems, &data, &out));
    axc_coll c = {.kind = AXC_COLL_REDUCE_SCATTER, .send = p->blocks[0], .recv = data,
                  .count = shard_elems, .dtype = dtype, .op = AXC_RED_SUM, .device = -1};
    axc_work *work = NULL;
    axc_status st = start_on_channel(mb, mb->n + 2, &c, &work);
    if (st != AXC_OK) {
        mb->ops.release(mb->ops.ctx, out);
        return st;
    }
    mb->ops.retain(mb->ops.ctx, w);
    mb->sc[mb->nsc++] = (scatter){.w = w, .out = out, .work = work,
                                  .block_owner = p->owners[0], .held = 1};
    p->owners[0] = NULL;
    for (int k = 1; k < p->count; k++) /* (summed into the first) */
        mb->ops.release(mb->ops.ctx, p->owners[k]);
    p->count = 0;
    return AXC_OK;
}

/* A micro-batch's block of w's dW: as many elements as w's shard over the depth ranks, on the
 * host (each block is summed over `elems` elements: checked as it comes, not only the last). */
static axc_status check_block(axc_mb *mb, int layer, void *w, size_t elems)
{
    const void *shard;
    size_t shard_elems;
    axc_dtype dtype;
    int device;
    AXC_TRY(mb->ops.describe(mb->ops.ctx, w, &shard, &shard_elems, &dtype, &device));
    size_t G = (size_t)axc_grid_group_size(axc_comm_grid(mb->comm), AXC_GROUP_DEPTH);
    if (device >= 0)
        return axc_fail(AXC_ERR_INVALID, "shared dW reduce-scatter of layer %d: the weight is "
                                         "on CUDA device %d; concurrent micro-batches run CPU "
                                         "tensors only", layer, device);
    if (shard_elems * G != elems)
        return axc_fail(AXC_ERR_INVALID, "shared dW reduce-scatter of layer %d: a block of %zu "
                                         "elements, expected %zu (the shard over %zu ranks)",
                        layer, elems, shard_elems * G, G);
    return AXC_OK;
}

axc_status axc_mb_scatter(axc_mb *mb, int layer, int use, void *w, void *block_owner,
                          void *block, size_t elems)
{
    if (!mb->comm || !mb->mem)
        return axc_fail(AXC_ERR_STATE, "shared dW reduce-scatter: the call has no communicator");
    AXC_TRY(check_block(mb, layer, w, elems));
    lock_scatters(mb);
    int pi = find_part(mb, layer, use);
    if (pi < 0) {
        pthread_mutex_unlock(&mb->smu);
        return axc_fail(AXC_ERR_NOMEM, "shared dW reduce-scatters: out of memory");
    }
    scatter_part *p = &mb->parts[pi];
    if (p->count == mb->n) { /* (the part of an earlier key that failed to start) */
        pthread_mutex_unlock(&mb->smu);
        return axc_fail(AXC_ERR_STATE, "shared dW reduce-scatter of layer %d: more than %d "
                                       "blocks", layer, mb->n);
    }
    mb->ops.retain(mb->ops.ctx, block_owner);
    p->owners[p->count] = block_owner;
    p->blocks[p->count++] = block;
    if (p->count < mb->n) {
        pthread_mutex_unlock(&mb->smu);
        return AXC_OK;
    }
    axc_status st = start_scatter(mb, p, w, elems);
    /* let go of finished ones; past the bound, the oldest busy ones are waited for (each held
     * one asked once whether it is done: the answer may change between two asks) */
    int busy = 0, nh = 0, heldi[64], done[64]; /* (the oldest 64 held: a few in practice) */
    for (int i = 0; i < mb->nsc; i++) {
        if (!mb->sc[i].held)
            continue;
        int d = axc_work_done(mb->sc[i].work);
        busy += !d;
        if (nh < 64) {
            heldi[nh] = i;
            done[nh++] = d;
        }
    }
    int excess = busy > mb->bound ? busy - mb->bound : 0;
    int retire[64], nretire = 0;
    for (int k = 0; k < nh; k++) {
        if (done[k] || excess > 0) {
            excess -= !done[k];
            mb->sc[heldi[k]].held = 0;
            retire[nretire++] = heldi[k];
        }
    }
    int held = 0;
    for (int i = 0; i < mb->nsc; i++)
        held += mb->sc[i].held;
    if (held > mb->peak_held)
        mb->peak_held = held;
    axc_work *works[64];
    for (int k = 0; k < nretire; k++)
        works[k] = mb->sc[retire[k]].work;
    pthread_mutex_unlock(&mb->smu);
    /* the oldest first (they run in issue order); each left `held` once, so one thread waits
     * for it here (close waits again: the result is kept, and frees it) */
    axc_status ws[64];
    char msgs[64][256]; /* (each failure's own message, kept with its result) */
    void *s = nretire ? let_go(mb) : NULL;
    for (int k = 0; k < nretire; k++) {
        ws[k] = axc_work_wait(works[k]);
        if (ws[k] != AXC_OK)
            snprintf(msgs[k], sizeof msgs[k], "%s", axc_last_error());
    }
    if (nretire)
        take_back(mb, s);
    lock_scatters(mb);
    for (int k = 0; k < nretire; k++) {
        scatter *e = &mb->sc[retire[k]];
        if (ws[k] != AXC_OK && e->status == AXC_OK) {
            e->status = ws[k];
            snprintf(e->msg, sizeof e->msg, "%.255s", msgs[k]); /* (e->msg holds 256) */
        }
        if (still_running(ws[k], works[k]))
            continue; /* (it still reads the block: close waits again, or leaks it) */
        mb->ops.release(mb->ops.ctx, e->block_owner);
        e->block_owner = NULL;
    }
    pthread_mutex_unlock(&mb->smu);
    return st;
}
