/* Gradient buckets (axc/buckets.h): a state machine over this pass's flat buffers. */
#include "axc/buckets.h"

#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum bucket_state { BUCKET_OPEN, BUCKET_PARKED, BUCKET_RETIRED };

typedef struct bucket {
    axc_bucket_key key;
    void *data, *owner;
    size_t cap, used; /* elements */
    int holds;        /* chunk records still accumulating into it */
    enum bucket_state state;
    int closed;       /* retired by axc_buckets_close_all: its pass's sums started */
    uint64_t print;   /* fingerprint of its pieces (tags and sizes, in order); never 0 */
    uint64_t check;   /* fingerprint of its pieces' idents and sizes; 0 once a piece had none */
} bucket;

struct axc_buckets {
    axc_bucket_ops ops;
    size_t bucket_bytes;
    bucket *v; /* this pass's buckets, in the order they were made */
    int n, cap;
    /* the number of this pass's first bucket: numbers are not reused across passes, so that a
     * piece taken before the pass ended is not mistaken for one of a later pass's bucket */
    int first;
    /* retired buckets whose sums are still to be handed out: bucket numbers in retirement
     * order; `next_group` is the group the first one hands out next */
    int *due;
    int ndue, due_head, next_group;
    axc_bucket_stats stats;
    axc_bucket_codec codec[AXC_GROUP_COUNT];
    /* error-feedback residuals, kept across steps, by slot key: (pass of the step, bucket
     * number of the pass, group position), see residual_key */
    struct residual {
        long long key;
        void *data, *owner;
        int device;
        size_t elems;
        uint64_t print; /* the fingerprint of the bucket it last served; 0: none yet */
    } *res;
    int nres;
    int pass; /* passes with buckets since the last axc_buckets_new_step */
    int cut;  /* this step's passes went past the error-feedback limit (counted once) */
};

/* one piece into a bucket's fingerprint (FNV-1a over the tag and size; never 0) */
static uint64_t print_add(uint64_t h, uint64_t tag, size_t n)
{
    uint64_t words[2] = {tag, (uint64_t)n};
    for (int w = 0; w < 2; w++)
        for (int i = 0; i < 64; i += 8) {
            h ^= (words[w] >> i) & 0xffu;
            h *= 0x100000001b3ull;
        }
    return h ? h : 1;
}

int axc_bucket_key_same(const axc_bucket_key *a, const axc_bucket_key *b)
{
    if (a->dtype != b->dtype || a->device != b->device || a->ngroups != b->ngroups)
        return 0;
    for (int i = 0; i < a->ngroups; i++)
        if (a->groups[i] != b->groups[i])
            return 0;
    return 1;
}

static axc_status check_key(const axc_bucket_key *key)
{
    if (!key || (unsigned)key->dtype >= AXC_DT_COUNT)
        return axc_fail(AXC_ERR_INVALID, "gradient bucket: unknown dtype %d",
                        key ? (int)key->dtype : -1);
    if (key->ngroups < 1 || key->ngroups > AXC_BUCKET_MAX_GROUPS)
        return axc_fail(AXC_ERR_INVALID,
                        "gradient bucket: %d groups to sum over, expected 1 to %d", key->ngroups,
                        AXC_BUCKET_MAX_GROUPS);
    for (int i = 0; i < key->ngroups; i++)
        if ((unsigned)key->groups[i] >= AXC_GROUP_COUNT)
            return axc_fail(AXC_ERR_INVALID, "gradient bucket: unknown group %d",
                            (int)key->groups[i]);
    return AXC_OK;
}

axc_status axc_buckets_create(axc_buckets **out, const axc_bucket_ops *ops, size_t bucket_bytes)
{
    if (!out || !ops || !ops->alloc || !ops->release)
        return axc_fail(AXC_ERR_INVALID, "axc_buckets_create: missing output or allocator");
    axc_buckets *b = calloc(1, sizeof *b);
    if (!b)
        return axc_fail(AXC_ERR_NOMEM, "axc_buckets_create: out of memory");
    b->ops = *ops;
    axc_status st = axc_buckets_set_bytes(b, bucket_bytes);
    if (st != AXC_OK) {
        free(b);
        return st;
    }
    *out = b;
    return AXC_OK;
}

axc_status axc_buckets_set_bytes(axc_buckets *b, size_t bucket_bytes)
{
    if (bucket_bytes == 0)
        return axc_fail(AXC_ERR_INVALID, "gradient bucket size must be positive, got 0 bytes");
    b->bucket_bytes = bucket_bytes;
    return AXC_OK;
}

void axc_buckets_reset(axc_buckets *b)
{
    if (!b)
        return;
    for (int i = 0; i < b->n; i++)
        b->ops.release(b->ops.ctx, b->v[i].owner);
    b->pass += b->n > 0;
    b->first = b->first > INT_MAX / 2 ? 0 : b->first + b->n; /* (wraps after ~10^9 buckets) */
    b->n = 0;
    b->ndue = b->due_head = b->next_group = 0;
}

void axc_buckets_new_step(axc_buckets *b)
{
    if (b)
        b->pass = b->cut = 0;
}

void axc_buckets_clear_residuals(axc_buckets *b)
{
    if (!b)
        return;
    for (int i = 0; i < b->nres; i++)
        if (b->res[i].owner)
            b->ops.release(b->ops.ctx, b->res[i].owner);
    free(b->res);
    b->res = NULL;
    b->nres = 0;
}

void axc_buckets_destroy(axc_buckets *b)
{
    if (!b)
        return;
    axc_buckets_reset(b);
    axc_buckets_clear_residuals(b);
    free(b->v);
    free(b->due);
    free(b);
}

/* The bucket numbered `id`; NULL with the status in *st */
static bucket *get(axc_buckets *b, int id, const char *what, axc_status *st)
{
    *st = AXC_OK;
    if (id >= 0 && id < b->first) {
        *st = axc_fail(AXC_ERR_STATE, "%s: gradient bucket %d belongs to an earlier pass, which ended "
                                "(its sums ran and its buffers were let go) while a piece of it "
                                "was still to be written; that piece was not summed", what, id);
        return NULL;
    }
    if (id < b->first || id - b->first >= b->n) {
        *st = axc_fail(AXC_ERR_INVALID, "%s: no gradient bucket %d in this pass (it has %d to %d)",
                 what, id, b->first, b->first + b->n - 1);
        return NULL;
    }
    return &b->v[id - b->first];
}

enum why_retired { DURING_PASS, AFTER_HOLDS, AT_END };

/* The bucket takes nothing more: its sums are due now, or once its holds are released. */
static void retire(axc_buckets *b, int i, enum why_retired why)
{
    bucket *k = &b->v[i];
    if (k->holds) {
        k->state = BUCKET_PARKED;
        return;
    }
    k->state = BUCKET_RETIRED;
    if (why == AT_END) {
        b->stats.at_end++;
    } else {
        b->stats.early++;
        b->stats.after_holds += why == AFTER_HOLDS;
    }
    if (k->used)
        b->due[b->ndue++] = i; /* (due has room for every bucket: sized with v) */
}

axc_status axc_buckets_take(axc_buckets *b, const axc_bucket_key *key, size_t n, size_t want,
                            void *arg, uint64_t tag, int *bucket_out, size_t *offset, void **owner)
{
    return axc_buckets_take_shared(b, key, n, want, arg, tag, 0, bucket_out, offset, owner);
}

axc_status axc_buckets_take_shared(axc_buckets *b, const axc_bucket_key *key, size_t n,
                                   size_t want, void *arg, uint64_t tag, uint64_t ident,
                                   int *bucket_out, size_t *offset, void **owner)
{
    AXC_TRY(check_key(key));
    int open = -1;
    for (int i = 0; i < b->n; i++)
        if (b->v[i].state == BUCKET_OPEN && axc_bucket_key_same(&b->v[i].key, key)) {
            open = i;
            break;
        }
    if (open >= 0 && b->v[open].used + n > b->v[open].cap) {
        retire(b, open, DURING_PASS);
        open = -1;
    }
    if (open < 0) {
        if (b->n == b->cap) {
            int cap = b->cap ? 2 * b->cap : 8;
            bucket *v = realloc(b->v, (size_t)cap * sizeof *v);
            if (v)
                b->v = v;
            int *due = v ? realloc(b->due, (size_t)cap * sizeof *due) : NULL;
            if (due)
                b->due = due;
            if (!v || !due)
                return axc_fail(AXC_ERR_NOMEM, "gradient buckets: out of memory");
            b->cap = cap;
        }
        size_t per = b->bucket_bytes / axc_dtype_size(key->dtype);
        if (want && want < per)
            per = want;
        size_t elems = n > per ? n : per;
        bucket k = {.key = *key, .cap = elems, .state = BUCKET_OPEN,
                    .print = 0xcbf29ce484222325ull, .check = 0xcbf29ce484222325ull};
        AXC_TRY(b->ops.alloc(b->ops.ctx, key, elems, arg, &k.data, &k.owner));
        open = b->n++;
        b->v[open] = k;
        b->stats.made++;
    }
    bucket *k = &b->v[open];
    *bucket_out = b->first + open;
    *offset = k->used;
    *owner = k->owner;
    k->used += n;
    k->print = print_add(k->print, tag, n);
    k->check = ident && k->check ? print_add(k->check, ident, n) : 0;
    return AXC_OK;
}

/* The bucket of `id` that a piece taken earlier may still be written into; NULL (the status in
 * *st) once its pass ended or its end-of-pass sums started */
static bucket *writable(axc_buckets *b, int id, const char *what, axc_status *st)
{
    bucket *k = get(b, id, what, st);
    if (k && k->closed) {
        *st = axc_fail(AXC_ERR_STATE, "%s: gradient bucket %d started its end-of-pass sums "
                                      "while a piece of it was still to be written; that piece "
                                      "was not summed", what, id);
        return NULL;
    }
    return k;
}

axc_status axc_buckets_check(axc_buckets *b, int id)
{
    axc_status st;
    return writable(b, id, "gradient bucket", &st) ? AXC_OK : st;
}

axc_status axc_buckets_written(axc_buckets *b, int id)
{
    axc_status st;
    bucket *k = writable(b, id, "axc_buckets_written", &st);
    if (!k)
        return st;
    if (k->state == BUCKET_OPEN && k->used == k->cap)
        retire(b, id - b->first, DURING_PASS);
    return AXC_OK;
}

axc_status axc_buckets_hold(axc_buckets *b, int id)
{
    axc_status st;
    bucket *k = writable(b, id, "axc_buckets_hold", &st);
    if (!k)
        return st;
    if (k->state == BUCKET_RETIRED)
        return axc_fail(AXC_ERR_STATE, "gradient bucket %d already started its sums: it takes "
                                       "no more holds", id);
    k->holds++;
    return AXC_OK;
}

axc_status axc_buckets_unhold(axc_buckets *b, int id)
{
    axc_status st;
    bucket *k = get(b, id, "axc_buckets_unhold", &st);
    if (!k)
        return st;
    if (k->holds <= 0)
        return axc_fail(AXC_ERR_STATE, "gradient bucket %d has no hold to release", id);
    if (--k->holds == 0 && (k->state == BUCKET_PARKED || k->used == k->cap))
        retire(b, id - b->first, AFTER_HOLDS);
    return AXC_OK;
}

void axc_buckets_close_all(axc_buckets *b)
{
    for (int pass = 0; pass < 2; pass++) /* parked first, then open */
        for (int i = 0; i < b->n; i++)
            if (b->v[i].state == (pass ? BUCKET_OPEN : BUCKET_PARKED)) {
                b->v[i].holds = 0;
                b->v[i].closed = 1;
                retire(b, i, AT_END);
            }
}

static struct residual *residual_slot(axc_buckets *b, long long key)
{
    for (int i = 0; i < b->nres; i++)
        if (b->res[i].key == key)
            return &b->res[i];
    struct residual *r = realloc(b->res, (size_t)(b->nres + 1) * sizeof *r);
    if (!r) {
        axc_fail(AXC_ERR_NOMEM, "gradient buckets: out of memory for residual %lld", key);
        return NULL;
    }
    b->res = r;
    r += b->nres++;
    *r = (struct residual){.key = key};
    return r;
}

axc_status axc_buckets_set_codec(axc_buckets *b, axc_group_kind group, const axc_bucket_codec *c)
{
    if ((unsigned)group >= AXC_GROUP_COUNT)
        return axc_fail(AXC_ERR_INVALID, "gradient bucket codec: unknown group %d", (int)group);
    int block = 0;
    AXC_TRY(axc_codec_check(c->codec, c->block, &block));
    b->codec[group] = *c;
    b->codec[group].block = c->codec == AXC_CODEC_NONE ? 0 : block;
    return AXC_OK;
}

int axc_buckets_residual_count(const axc_buckets *b) { return b->nres; }

void axc_buckets_residual(const axc_buckets *b, int i, long long *key, void **owner,
                          size_t *elems)
{
    int have = i >= 0 && i < b->nres;
    *key = have ? b->res[i].key : -1;
    *owner = have ? b->res[i].owner : NULL;
    *elems = have ? b->res[i].elems : 0;
}

axc_status axc_buckets_set_residual(axc_buckets *b, long long key, void *data, void *owner,
                                    int device, size_t elems)
{
    struct residual *r = key >= 0 ? residual_slot(b, key) : NULL;
    if (!r) {
        b->ops.release(b->ops.ctx, owner);
        return key < 0 ? axc_fail(AXC_ERR_INVALID, "residual slot %lld: expected >= 0", key)
                       : AXC_ERR_NOMEM;
    }
    if (r->owner)
        b->ops.release(b->ops.ctx, r->owner);
    *r = (struct residual){key, data, owner, device, elems, 0}; /* (adopted by its next bucket) */
    return AXC_OK;
}

/* The residual of (this pass, bucket i, group position): kept when its size and device match
 * and it last served the same pieces (or came from a checkpoint), else new zeros. */
static float *residual_for(axc_buckets *b, long long key, const bucket *k)
{
    struct residual *r = residual_slot(b, key);
    if (!r)
        return NULL;
    if (!r->owner || r->elems != k->used || r->device != k->key.device ||
        (r->print && r->print != k->print)) {
        void *data, *owner;
        if (b->ops.alloc_residual(b->ops.ctx, k->owner, k->key.device, k->used, &data, &owner) !=
            AXC_OK)
            return NULL;
        if (r->owner)
            b->ops.release(b->ops.ctx, r->owner);
        *r = (struct residual){key, data, owner, k->key.device, k->used, 0};
    }
    r->print = k->print;
    return r->data;
}

int axc_buckets_next_sum(axc_buckets *b, axc_bucket_sum *sum)
{
    if (b->due_head == b->ndue)
        return 0;
    int i = b->due[b->due_head];
    const bucket *k = &b->v[i];
    axc_group_kind group = k->key.groups[b->next_group];
    *sum = (axc_bucket_sum){.group = group, .data = k->data, .count = k->used,
                            .dtype = k->key.dtype, .device = k->key.device,
                            .check = k->check};
    const axc_bucket_codec *c = &b->codec[group];
    if (c->codec != AXC_CODEC_NONE && k->key.dtype == AXC_DT_F32) {
        sum->codec = c->codec;
        sum->block = c->block;
        /* a residual per (pass of the step, bucket, group position): the same gradients in
         * every step; past AXC_BUCKET_MAX_EF_PASSES passes without a new step, none */
        long long key = ((long long)b->pass << 32) | (long long)(i * AXC_BUCKET_MAX_GROUPS +
                                                                  b->next_group);
        if (c->error_feedback && b->ops.alloc_residual && b->pass >= AXC_BUCKET_MAX_EF_PASSES &&
            !b->cut) {
            b->cut = 1;
            b->stats.ef_cutoffs++;
        }
        if (c->error_feedback && b->ops.alloc_residual && b->pass < AXC_BUCKET_MAX_EF_PASSES &&
            !(sum->residual = residual_for(b, key, k)))
            return -1;
    }
    if (++b->next_group == k->key.ngroups) {
        b->next_group = 0;
        b->due_head++;
    }
    return 1;
}

int axc_buckets_open(const axc_buckets *b)
{
    int c = 0;
    for (int i = 0; i < b->n; i++)
        c += b->v[i].state != BUCKET_RETIRED;
    return c;
}

int axc_buckets_count(const axc_buckets *b) { return b->n; }

void axc_buckets_stats(const axc_buckets *b, axc_bucket_stats *out) { *out = b->stats; }

void axc_buckets_zero_stats(axc_buckets *b) { b->stats = (axc_bucket_stats){0}; }
