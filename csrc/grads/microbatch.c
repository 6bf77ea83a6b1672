/* One run_concurrent call's shared decisions (axc/microbatch.h): the reducer's buckets and
 * their readiness. */
#include "axc/microbatch.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

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

struct axc_mb {
    int n;
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

axc_status axc_mb_create(axc_mb **out, int n, size_t bucket_bytes)
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
    mb->n = n;
    mb->bucket_bytes = bucket_bytes;
    if (pthread_mutex_init(&mb->mu, NULL)) {
        free(mb);
        return axc_fail(AXC_ERR_NOMEM, "axc_mb_create: pthread_mutex_init failed");
    }
    if (pthread_cond_init(&mb->cv, NULL)) {
        pthread_mutex_destroy(&mb->mu);
        free(mb);
        return axc_fail(AXC_ERR_NOMEM, "axc_mb_create: pthread_cond_init failed");
    }
    *out = mb;
    return AXC_OK;
}

void axc_mb_destroy(axc_mb *mb)
{
    if (!mb)
        return;
    pthread_cond_destroy(&mb->cv);
    pthread_mutex_destroy(&mb->mu);
    free(mb->p);
    free(mb->b);
    free(mb->slot);
    free(mb);
}

int axc_mb_n(const axc_mb *mb) { return mb->n; }
int axc_mb_params(const axc_mb *mb) { return mb->np; }
int axc_mb_buckets(const axc_mb *mb) { return mb->nb; }

static int same_key(const axc_bucket_key *a, const axc_bucket_key *b)
{
    if (a->dtype != b->dtype || a->device != b->device || a->ngroups != b->ngroups)
        return 0;
    for (int i = 0; i < a->ngroups; i++)
        if (a->groups[i] != b->groups[i])
            return 0;
    return 1;
}

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
    if (!last || !same_key(&last->key, key) || last->bytes + bytes > mb->bucket_bytes) {
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

int axc_mb_next_bucket(axc_mb *mb, int *first, int *count, axc_bucket_key *key)
{
    pthread_mutex_lock(&mb->mu);
    while (!mb->failed && mb->next < mb->nb && mb->finished < mb->n &&
           mb->b[mb->next].missing > 0)
        pthread_cond_wait(&mb->cv, &mb->mu);
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
