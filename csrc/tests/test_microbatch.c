/* One run_concurrent call (csrc/grads/microbatch.c). The reducer: buckets in the fixed order,
 * readiness by arrival counts, thread ends and failures, and the wait across threads. The shared
 * depth gathers, on 2 forked ranks over shm (G_d = 2) with 2 micro-batch threads: one gather per
 * (layer, phase, use) whatever thread asks first, its values, the learned order and the
 * prefetch it starts on the next call, per-call weights not kept, a failed gather reported to
 * every asker, and every reference given back (counted; leaks: LeakSanitizer in every rank). */
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "axc/microbatch.h"
#include "axc/sched.h"
#include "axc/runtime.h"
#include "ctest.h"
#include "fork_ranks.h"
#include "rank_tally.h"

static axc_bucket_key key_of(axc_dtype dt, axc_group_kind g)
{
    return (axc_bucket_key){.dtype = dt, .device = -1, .ngroups = 1, .groups = {g}};
}

static void test_buckets(void)
{
    axc_mb *mb;
    CHECK(axc_mb_create(&mb, 0, 64, NULL, NULL) == AXC_ERR_INVALID);
    CHECK(axc_mb_create(&mb, 2, 0, NULL, NULL) == AXC_ERR_INVALID);
    CHECK_OK(axc_mb_create(&mb, 2, 64, NULL, NULL));
    axc_bucket_key data = key_of(AXC_DT_F32, AXC_GROUP_DATA);
    axc_bucket_key depth = key_of(AXC_DT_F32, AXC_GROUP_DEPTH);
    axc_bucket_key half = key_of(AXC_DT_BF16, AXC_GROUP_DATA);
    CHECK_OK(axc_mb_add_param(mb, 0x100, &data, 32));
    CHECK_OK(axc_mb_add_param(mb, 0x200, &data, 32)); /* fits: 64 bytes */
    CHECK_OK(axc_mb_add_param(mb, 0x300, &data, 8));  /* over 64: a new bucket */
    CHECK_OK(axc_mb_add_param(mb, 0x400, &depth, 8)); /* another key */
    CHECK_OK(axc_mb_add_param(mb, 0x500, &half, 8));  /* another dtype */
    CHECK_OK(axc_mb_add_param(mb, 0x600, &half, 100)); /* larger than a bucket: joins it
                                                         * only if it fits: a new one */
    CHECK(axc_mb_add_param(mb, 0x200, &data, 4) == AXC_ERR_INVALID); /* twice */
    axc_bucket_key none = {.dtype = AXC_DT_F32, .device = -1, .ngroups = 0};
    CHECK(axc_mb_add_param(mb, 0x700, &none, 4) == AXC_ERR_INVALID);
    CHECK(axc_mb_params(mb) == 6 && axc_mb_buckets(mb) == 5);
    CHECK(axc_mb_has_param(mb, 0x300) && !axc_mb_has_param(mb, 0x700));
    CHECK(!axc_mb_has_param(NULL, 0x300));
    /* both micro-batches' arrivals, in any order; the first bucket only when both of its
     * parameters have both */
    axc_mb_arrive(mb, 0x700); /* not summed: ignored */
    for (uintptr_t id = 0x600; id >= 0x100; id -= 0x100)
        axc_mb_arrive(mb, id);
    for (uintptr_t id = 0x100; id <= 0x600; id += 0x100)
        axc_mb_arrive(mb, id);
    int first = -1, count = -1;
    axc_bucket_key k;
    int want_first[] = {0, 2, 3, 4, 5}, want_count[] = {2, 1, 1, 1, 1};
    for (int i = 0; i < 5; i++) {
        CHECK(axc_mb_next_bucket(mb, -1, &first, &count, &k) == 1);
        CHECK(first == want_first[i] && count == want_count[i]);
    }
    CHECK(k.dtype == AXC_DT_BF16 && k.groups[0] == AXC_GROUP_DATA);
    CHECK(axc_mb_next_bucket(mb, -1, &first, &count, &k) == 0); /* all handed out */
    axc_mb_destroy(mb);
    axc_mb_destroy(NULL);
}

/* many parameters: the id table grows and still finds every one */
static void test_many_params(void)
{
    axc_mb *mb;
    CHECK_OK(axc_mb_create(&mb, 1, 1 << 20, NULL, NULL));
    axc_bucket_key data = key_of(AXC_DT_F32, AXC_GROUP_DATA);
    int ok = 1;
    for (uintptr_t i = 1; i <= 1000; i++)
        ok &= axc_mb_add_param(mb, i * 48, &data, 4) == AXC_OK;
    CHECK(ok && axc_mb_buckets(mb) == 1);
    for (uintptr_t i = 1; i <= 1000; i++)
        ok &= axc_mb_has_param(mb, i * 48) && !axc_mb_has_param(mb, i * 48 + 8);
    CHECK(ok);
    int first, count;
    axc_bucket_key k;
    for (uintptr_t i = 1; i < 1000; i++)
        axc_mb_arrive(mb, i * 48);
    /* a timed wait for a bucket not ready: "not yet" (the caller looks for an interrupt) */
    CHECK(axc_mb_next_bucket(mb, 5, &first, &count, &k) == -1);
    CHECK(axc_mb_next_bucket(mb, 0, &first, &count, &k) == -1);
    axc_mb_arrive(mb, 1000 * 48);
    CHECK(axc_mb_next_bucket(mb, -1, &first, &count, &k) == 1 && first == 0 && count == 1000);
    axc_mb_destroy(mb);
}

struct waiter {
    axc_mb *mb;
    int got[4], first[4];
    int calls;
};

static void *reducer(void *arg)
{
    struct waiter *w = arg;
    int count;
    axc_bucket_key k;
    while (w->calls < 4 && (w->got[w->calls] = axc_mb_next_bucket(w->mb, -1, &w->first[w->calls],
                                                                   &count, &k)))
        w->calls++;
    return NULL;
}

static void nap(void)
{
    struct timespec ts = {0, 20 * 1000 * 1000};
    nanosleep(&ts, NULL);
}

/* The reducer waits on another thread until a bucket is ready; after every thread ended it
 * takes what is left without the missing arrivals. */
static void test_wait_across_threads(void)
{
    axc_mb *mb;
    CHECK_OK(axc_mb_create(&mb, 2, 8, NULL, NULL));
    axc_bucket_key data = key_of(AXC_DT_F32, AXC_GROUP_DATA);
    for (uintptr_t id = 1; id <= 3; id++)
        CHECK_OK(axc_mb_add_param(mb, id, &data, 8)); /* a bucket each */
    struct waiter w = {.mb = mb};
    pthread_t t;
    CHECK(pthread_create(&t, NULL, reducer, &w) == 0);
    axc_mb_arrive(mb, 2);
    axc_mb_arrive(mb, 2); /* bucket 1 ready, but bucket 0 comes first */
    nap();
    CHECK(w.calls == 0);
    axc_mb_arrive(mb, 1);
    nap();
    CHECK(w.calls == 0); /* one of two micro-batches */
    axc_mb_arrive(mb, 1);
    for (int i = 0; i < 200 && w.calls < 2; i++)
        nap();
    CHECK(w.calls == 2 && w.first[0] == 0 && w.first[1] == 1);
    axc_mb_thread_done(mb, 0);
    nap();
    CHECK(w.calls == 2); /* one thread still runs: parameter 3 may still arrive */
    axc_mb_thread_done(mb, 0);
    CHECK(pthread_join(t, NULL) == 0);
    CHECK(w.calls == 3 && w.first[2] == 2 && w.got[2] == 1);
    axc_mb_destroy(mb);
}

/* A failed micro-batch stops the reducer: no more buckets, even ready ones. */
static void test_failure_stops(void)
{
    axc_mb *mb;
    CHECK_OK(axc_mb_create(&mb, 2, 8, NULL, NULL));
    axc_bucket_key data = key_of(AXC_DT_F32, AXC_GROUP_DATA);
    CHECK_OK(axc_mb_add_param(mb, 1, &data, 8));
    CHECK_OK(axc_mb_add_param(mb, 2, &data, 8));
    struct waiter w = {.mb = mb};
    pthread_t t;
    CHECK(pthread_create(&t, NULL, reducer, &w) == 0);
    nap();
    axc_mb_thread_done(mb, 1);
    CHECK(pthread_join(t, NULL) == 0);
    CHECK(w.calls == 0);
    axc_mb_arrive(mb, 1);
    axc_mb_arrive(mb, 1);
    int first, count;
    axc_bucket_key k;
    CHECK(axc_mb_next_bucket(mb, -1, &first, &count, &k) == 0);
    axc_mb_destroy(mb);
}

/* The runtime holds one call at a time. */
static void fake_release(void *ctx, void *owner)
{
    (void)ctx;
    (void)owner;
}

static axc_status fake_alloc(void *ctx, const axc_bucket_key *key, size_t elems, void *arg,
                             void **data, void **owner)
{
    (void)arg;
    (void)ctx;
    (void)key;
    (void)elems;
    (void)data;
    (void)owner;
    return AXC_ERR_NOMEM;
}

static void test_runtime_holds_one(void)
{
    axc_runtime_ops ops = {.buckets = {.alloc = fake_alloc, .release = fake_release},
                           .release_kept = fake_release, .bucket_bytes = 64};
    axc_runtime *rt;
    CHECK_OK(axc_runtime_create(&rt, &ops));
    CHECK(axc_runtime_mb(rt) == NULL);
    axc_mb *mb = NULL;
    CHECK_OK(axc_runtime_mb_begin(rt, NULL, 3, 64, &mb));
    CHECK(mb && axc_runtime_mb(rt) == mb && axc_mb_n(mb) == 3);
    axc_mb *second = NULL;
    CHECK(axc_runtime_mb_begin(rt, NULL, 3, 64, &second) == AXC_ERR_STATE && !second);
    axc_runtime_mb_end(rt);
    CHECK(axc_runtime_mb(rt) == NULL);
    axc_runtime_mb_end(rt); /* none: no-op */
    CHECK(axc_runtime_mb_begin(rt, NULL, 0, 64, &mb) == AXC_ERR_INVALID && !axc_runtime_mb(rt));
    /* ended by its owner only: another caller's end (its own begin was refused) is a no-op */
    int a, b;
    CHECK_OK(axc_runtime_mb_begin(rt, &a, 2, 64, NULL));
    CHECK(axc_runtime_mb_begin(rt, &b, 2, 64, NULL) == AXC_ERR_STATE);
    CHECK(axc_runtime_mb_end_owned(rt, &b) == 0 && axc_runtime_mb(rt) != NULL);
    CHECK(axc_runtime_mb_end_owned(rt, &a) == 1 && axc_runtime_mb(rt) == NULL);
    CHECK(axc_runtime_mb_end_owned(rt, &a) == 0); /* (ended already) */
    CHECK_OK(axc_runtime_mb_begin(rt, NULL, 2, 64, NULL));
    axc_runtime_destroy(rt); /* ends the running call too (leak-checked under ASan) */
}

/* ---- shared gathers ---- */

#define SHARD 5

/* a test weight: its shard, and the references the call holds to it */
typedef struct tweight {
    float shard[SHARD];
    size_t elems; /* what describe reports */
    int refs;
} tweight;

/* a test buffer: an owner with a reference count */
typedef struct tbuf {
    int refs;
    float data[];
} tbuf;

static int g_buffers_alive, g_fail_alloc;

static axc_status t_alloc(void *ctx, void *w, size_t elems, void **data, void **owner)
{
    (void)ctx;
    (void)w;
    if (g_fail_alloc)
        return axc_fail(AXC_ERR_NOMEM, "test allocator: refused");
    tbuf *b = calloc(1, sizeof *b + elems * sizeof(float));
    if (!b)
        return AXC_ERR_NOMEM;
    b->refs = 1;
    g_buffers_alive++;
    *data = b->data;
    *owner = b;
    return AXC_OK;
}

static int g_device = -1; /* the device the weights claim to be on */

static axc_status t_describe(void *ctx, void *w, const void **data, size_t *elems,
                             axc_dtype *dtype, int *device)
{
    (void)ctx;
    tweight *t = w;
    *data = t->shard;
    *elems = t->elems;
    *dtype = AXC_DT_F32;
    *device = g_device;
    return AXC_OK;
}

/* owners are buffers (refs > 0 from alloc); weights are told apart by their address range */
static tweight g_w[4];

static int is_weight(void *obj)
{
    return (char *)obj >= (char *)g_w && (char *)obj < (char *)(g_w + 4);
}

static void t_retain(void *ctx, void *obj)
{
    (void)ctx;
    if (is_weight(obj))
        ((tweight *)obj)->refs++;
    else
        ((tbuf *)obj)->refs++;
}

static void t_release(void *ctx, void *obj)
{
    (void)ctx;
    if (is_weight(obj)) {
        ((tweight *)obj)->refs--;
    } else if (--((tbuf *)obj)->refs == 0) {
        g_buffers_alive--;
        free(obj);
    }
}

/* a pinned weight: a reference to it (its storage is the weight's own here), counted */
static int g_pins;

static axc_status t_pin(void *ctx, void *w, void **owner)
{
    g_pins++;
    t_retain(ctx, w);
    *owner = w;
    return AXC_OK;
}

typedef struct mb_thread {
    axc_mb *mb;
    axc_comm *comm;
    int index;
    tweight *w[3]; /* the layers it visits, in order */
    int keep;
    axc_status st[3];
    float got[3][2 * SHARD];
    char msg[3][256];
} mb_thread;

static void *mb_run(void *arg)
{
    mb_thread *t = arg;
    axc_comm_set_thread_channel(t->comm, t->index + 1);
    for (int l = 0; l < 3; l++) {
        void *data = NULL, *owner = NULL;
        t->st[l] = axc_mb_gather(t->mb, l, AXC_PHASE_FWD, 1, t->w[l], t->keep, 2 * SHARD, &data,
                                 &owner);
        if (t->st[l] == AXC_OK) {
            memcpy(t->got[l], data, sizeof t->got[l]);
            t_release(NULL, owner);
        } else {
            snprintf(t->msg[l], sizeof t->msg[l], "%s", axc_last_error());
        }
    }
    return NULL;
}

/* One call of 2 micro-batches over layers w[0..3); returns axc_mb_close's status. */
static axc_status run_call(axc_comm *comm, axc_mb_memory *mem, mb_thread th[2], int keep)
{
    axc_mb *mb;
    CHECK_OK(axc_mb_create(&mb, 2, 64, comm, mem));
    pthread_t p[2];
    for (int i = 0; i < 2; i++) {
        th[i] = (mb_thread){.mb = mb, .comm = comm, .index = i, .keep = keep,
                            .w = {&g_w[0], &g_w[1], &g_w[2]}};
        CHECK(pthread_create(&p[i], NULL, mb_run, &th[i]) == 0);
    }
    for (int i = 0; i < 2; i++)
        CHECK(pthread_join(p[i], NULL) == 0);
    int ok = th[0].st[0] == AXC_OK && th[1].st[0] == AXC_OK;
    axc_status st = axc_mb_close(mb, ok);
    axc_mb_destroy(mb);
    return st;
}

typedef struct rs_thread {
    axc_mb *mb;
    axc_comm *comm;
    int index, rank;
    axc_status st[3];
} rs_thread;

/* micro-batch t's block of layer l on rank r: (t + 1) (r + 1) (j + 1) (l + 1) */
static float block_val(int t, int r, int l, int j) { return (float)((t + 1) * (r + 1) * (j + 1) * (l + 1)); }

static void *rs_run(void *arg)
{
    rs_thread *t = arg;
    axc_comm_set_thread_channel(t->comm, t->index + 1);
    for (int l = 2; l >= 0; l--) { /* (backward order) */
        void *data, *owner;
        t->st[l] = t_alloc(NULL, &g_w[l], 2 * SHARD, &data, &owner);
        if (t->st[l] != AXC_OK)
            continue;
        for (int j = 0; j < 2 * SHARD; j++)
            ((float *)data)[j] = block_val(t->index, t->rank, l, j);
        t->st[l] = axc_mb_scatter(t->mb, l, 1, &g_w[l], owner, data, 2 * SHARD);
        t_release(NULL, owner); /* (the call holds its own reference) */
    }
    return NULL;
}

/* Two micro-batches hand in their dW blocks of 3 layers: one reduce-scatter per layer of their
 * sum; with a bound of 0 no summed block stays held; every reference is given back. */
static void test_scatters(axc_comm *comm, axc_mb_memory *mem, int rank)
{
    axc_mb *mb;
    CHECK_OK(axc_mb_create(&mb, 2, 64, comm, mem));
    axc_mb_set_scatter_bound(mb, 0);
    rs_thread th[2];
    pthread_t p[2];
    for (int i = 0; i < 2; i++) {
        th[i] = (rs_thread){.mb = mb, .comm = comm, .index = i, .rank = rank};
        CHECK(pthread_create(&p[i], NULL, rs_run, &th[i]) == 0);
    }
    for (int i = 0; i < 2; i++)
        CHECK(pthread_join(p[i], NULL) == 0);
    CHECK(th[0].st[0] == AXC_OK && th[1].st[0] == AXC_OK && th[0].st[2] == AXC_OK);
    CHECK_OK(axc_mb_close(mb, 1));
    axc_mb_stats stats;
    axc_mb_memory_stats(mem, &stats);
    CHECK_MSG(stats.reduce_scatters == 3 && stats.peak_blocks == 0, "%lld, peak %lld",
              stats.reduce_scatters, stats.peak_blocks);
    CHECK(axc_mb_scatters(mb) == 3);
    int right = 1;
    for (int i = 0; i < 3; i++) {
        void *w, *out;
        right &= axc_mb_scatter_result(mb, i, &w, &out) == 1;
        int l = (int)((tweight *)w - g_w);
        right &= l == 2 - i; /* started in the order the last arrivals came */
        for (int k = 0; k < SHARD; k++) {
            int j = rank * SHARD + k;
            float want = 0;
            for (int t = 0; t < 2; t++)
                for (int r = 0; r < 2; r++)
                    want += block_val(t, r, l, j);
            right &= ((tbuf *)out)->data[k] == want;
        }
    }
    CHECK(right);
    CHECK(g_w[0].refs == 1 && g_buffers_alive == 3); /* the results, until destroy */
    axc_mb_destroy(mb);
    CHECK(g_w[0].refs == 0 && g_w[2].refs == 0 && g_buffers_alive == 0);
    /* a block of the wrong size: refused, nothing kept */
    CHECK_OK(axc_mb_create(&mb, 1, 64, comm, mem));
    void *data, *owner;
    CHECK_OK(t_alloc(NULL, &g_w[0], SHARD, &data, &owner));
    CHECK(axc_mb_scatter(mb, 0, 1, &g_w[0], owner, data, SHARD) == AXC_ERR_INVALID);
    t_release(NULL, owner);
    axc_mb_destroy(mb);
    CHECK(g_w[0].refs == 0 && g_buffers_alive == 0);
    /* every block is checked, not only the last (the sum runs over the last one's size: a
     * short first block would be read past its end) */
    CHECK_OK(axc_mb_create(&mb, 2, 64, comm, mem));
    CHECK_OK(t_alloc(NULL, &g_w[0], SHARD, &data, &owner));
    CHECK(axc_mb_scatter(mb, 0, 1, &g_w[0], owner, data, SHARD) == AXC_ERR_INVALID);
    CHECK_MSG(strstr(axc_last_error(), "a block of 5 elements, expected 10"), "%s",
              axc_last_error());
    t_release(NULL, owner);
    CHECK_OK(t_alloc(NULL, &g_w[0], 2 * SHARD, &data, &owner));
    CHECK_OK(axc_mb_scatter(mb, 0, 1, &g_w[0], owner, data, 2 * SHARD)); /* (1 of 2: held) */
    t_release(NULL, owner);
    CHECK(axc_mb_scatters(mb) == 0);
    axc_mb_destroy(mb);
    CHECK(g_w[0].refs == 0 && g_buffers_alive == 0);
    /* CUDA weights: refused by the gathers as by the reduce-scatters, with the reason */
    g_device = 0;
    CHECK_OK(axc_mb_create(&mb, 1, 64, comm, mem));
    CHECK_OK(t_alloc(NULL, &g_w[0], 2 * SHARD, &data, &owner));
    CHECK(axc_mb_scatter(mb, 0, 1, &g_w[0], owner, data, 2 * SHARD) == AXC_ERR_INVALID);
    CHECK(strstr(axc_last_error(), "CUDA device 0; concurrent micro-batches run CPU"));
    t_release(NULL, owner);
    CHECK(axc_mb_gather(mb, 0, AXC_PHASE_FWD, 1, &g_w[0], 0, 2 * SHARD, &data, &owner) ==
          AXC_ERR_INVALID);
    CHECK_MSG(strstr(axc_last_error(), "the weight is on CUDA device 0"), "%s",
              axc_last_error());
    axc_mb_destroy(mb);
    g_device = -1;
    CHECK(g_w[0].refs == 0 && g_buffers_alive == 0);
}

/* One single-micro-batch call on this thread gathering (layer l, weight ws[l]) for l < nl;
 * a nap of `delay_ms` before layer `delay_at`. Returns the first failure, else close's. */
static axc_status one_thread_call(axc_comm *comm, axc_mb_memory *mem, int nl, const int *layers,
                                  tweight *const *ws, int delay_at, int delay_ms)
{
    axc_mb *mb;
    CHECK_OK(axc_mb_create(&mb, 1, 64, comm, mem));
    axc_comm_set_thread_channel(comm, 1);
    axc_status st = AXC_OK;
    for (int l = 0; l < nl && st == AXC_OK; l++) {
        if (l == delay_at) {
            struct timespec ts = {0, (long)delay_ms * 1000000L};
            nanosleep(&ts, NULL);
        }
        void *data, *owner;
        st = axc_mb_gather(mb, layers[l], AXC_PHASE_FWD, 1, ws[l], 1, 2 * SHARD, &data, &owner);
        if (st == AXC_OK)
            t_release(NULL, owner);
    }
    axc_status cst = axc_mb_close(mb, st == AXC_OK);
    axc_mb_destroy(mb);
    axc_comm_set_thread_channel(comm, 0);
    return st != AXC_OK ? st : cst;
}

/* A prefetch of the learned order whose layer then comes with another tensor: its buffer is let
 * go only after the prefetch completed (released first, the collective wrote freed memory:
 * ASan). Rank 0 follows the learned order (layer 0 prefetches layer 1 from w[1]; layer 1 comes
 * with w[3]: the prefetch is waited for, then a gather of its own); rank 1 has forgotten the
 * order and matches those collectives one by one, late (the prefetch completes ~300 ms after
 * rank 0 asked for layer 1). */
static void test_prefetch_other_tensor(axc_comm *comm, axc_mb_memory *mem, int rank)
{
    axc_mb_memory_clear(mem);
    static const int layers[3] = {0, 1, 2};
    tweight *const first[3] = {&g_w[0], &g_w[1], &g_w[2]};
    CHECK_OK(one_thread_call(comm, mem, 3, layers, first, -1, 0));
    if (rank == 0) {
        tweight *const second[3] = {&g_w[0], &g_w[3], &g_w[2]};
        CHECK_OK(one_thread_call(comm, mem, 3, layers, second, -1, 0));
        axc_mb_stats stats;
        axc_mb_memory_stats(mem, &stats);
        CHECK_MSG(stats.gathers == 4 && stats.prefetched == 0, "%lld gathers, %lld prefetched",
                  stats.gathers, stats.prefetched);
    } else { /* gather 0, then (late) the prefetch's match, layer 1's own, layer 2 */
        axc_mb_memory_clear(mem);
        static const int late[4] = {0, 1, 7, 2};
        tweight *const second[4] = {&g_w[0], &g_w[3], &g_w[3], &g_w[2]};
        CHECK_OK(one_thread_call(comm, mem, 4, late, second, 1, 300));
    }
    axc_mb_memory_clear(mem);
    CHECK(g_w[0].refs == 0 && g_w[1].refs == 0 && g_w[3].refs == 0 && g_buffers_alive == 0);
}

static int next_use(axc_mb *mb, int layer, int phase)
{
    int use = -1;
    CHECK_OK(axc_mb_next_use(mb, layer, phase, &use));
    return use;
}

/* Each micro-batch counts its own uses of (layer, phase), named by its thread's channel, from 1
 * at each call; a thread off the micro-batch channels is refused. */
static void test_next_use(axc_comm *comm)
{
    axc_mb *mb;
    for (int round = 0; round < 2; round++) { /* (a second call counts afresh) */
        CHECK_OK(axc_mb_create(&mb, 2, 64, NULL, NULL));
        int use;
        axc_comm_set_thread_channel(comm, 0); /* the caller's */
        CHECK(axc_mb_next_use(mb, 5, AXC_PHASE_FWD, &use) == AXC_ERR_STATE);
        CHECK(strstr(axc_last_error(), "channel 0") != NULL);
        axc_comm_set_thread_channel(comm, 3); /* the gathers' */
        CHECK(axc_mb_next_use(mb, 5, AXC_PHASE_FWD, &use) == AXC_ERR_STATE);
        axc_comm_set_thread_channel(comm, 1);
        CHECK(next_use(mb, 5, AXC_PHASE_FWD) == 1);
        CHECK(next_use(mb, 5, AXC_PHASE_FWD) == 2);
        CHECK(next_use(mb, 5, AXC_PHASE_BWD) == 1);
        CHECK(next_use(mb, 6, AXC_PHASE_FWD) == 1);
        CHECK(next_use(mb, 5, AXC_MB_PHASE_SCATTER) == 1);
        for (int l = 0; l < 40; l++) /* (past the first allocation) */
            CHECK(next_use(mb, 100 + l, AXC_PHASE_BWD) == 1);
        CHECK(next_use(mb, 5, AXC_PHASE_FWD) == 3);
        axc_comm_set_thread_channel(comm, 2); /* the other micro-batch: its own counts */
        CHECK(next_use(mb, 5, AXC_PHASE_FWD) == 1);
        CHECK(next_use(mb, 5, AXC_MB_PHASE_SCATTER) == 1);
        axc_comm_set_thread_channel(comm, 0);
        axc_mb_destroy(mb);
    }
}

static void gathers_main(int rank, int world, const int dims[4], double timeout)
{
    rank_begin(rank);
    axc_comm_config cfg;
    CHECK_OK(fork_ranks_config(&cfg, rank, world, dims, "mbgather", timeout));
    cfg.channels = 5; /* 2 micro-batches + the caller's + gathers + reduce-scatters */
    axc_comm *comm = NULL;
    axc_status st = axc_comm_create(&comm, &cfg);
    CHECK_OK(st);
    if (st != AXC_OK) {
        rank_end(rank);
        return;
    }
    test_next_use(comm);
    for (int l = 0; l < 4; l++) {
        g_w[l].elems = SHARD;
        for (int i = 0; i < SHARD; i++)
            g_w[l].shard[i] = (float)(100 * l + 10 * rank + i);
    }
    axc_mb_ops ops = {.alloc = t_alloc, .describe = t_describe, .retain = t_retain,
                      .release = t_release, .pin = t_pin};
    axc_mb_memory *mem;
    CHECK_OK(axc_mb_memory_create(&mem, &ops));
    mb_thread th[2];
    /* the first call: one gather per layer, nothing prefetched, every value in rank order */
    CHECK_OK(run_call(comm, mem, th, 1));
    axc_mb_stats stats;
    axc_mb_memory_stats(mem, &stats);
    CHECK_MSG(stats.gathers == 3 && stats.prefetched == 0, "%lld gathers, %lld prefetched",
              stats.gathers, stats.prefetched);
    int right = 1;
    for (int t = 0; t < 2; t++)
        for (int l = 0; l < 3; l++)
            for (int r = 0; r < 2; r++)
                for (int i = 0; i < SHARD; i++)
                    right &= th[t].st[l] == AXC_OK &&
                             th[t].got[l][r * SHARD + i] == (float)(100 * l + 10 * r + i);
    CHECK(right);
    CHECK(axc_mb_memory_learned(mem) == 3 && axc_mb_memory_learned_weight(mem, 1) == &g_w[1]);
    CHECK(g_w[0].refs == 1 && g_w[2].refs == 1 && g_w[3].refs == 0); /* kept by the order */
    CHECK(g_buffers_alive == 0);
    /* the second call follows the learned order: each first arrival starts its successor */
    for (int l = 0; l < 3; l++)
        for (int i = 0; i < SHARD; i++)
            g_w[l].shard[i] += 1000.0f; /* (a prefetch reads the values at its start) */
    CHECK_OK(run_call(comm, mem, th, 0));
    axc_mb_memory_stats(mem, &stats);
    CHECK_MSG(stats.gathers == 3 && stats.prefetched == 2, "%lld gathers, %lld prefetched",
              stats.gathers, stats.prefetched);
    CHECK(th[0].got[2][SHARD + 1] == 1000.0f + 200 + 10 + 1);
    /* keep = 0 (per-call tensors): learned, but without the weights, so nothing is prefetched
     * on the next call */
    CHECK(axc_mb_memory_learned(mem) == 3 && axc_mb_memory_learned_weight(mem, 0) == NULL);
    CHECK(g_w[0].refs == 0 && g_w[1].refs == 0);
    CHECK_OK(run_call(comm, mem, th, 1));
    axc_mb_memory_stats(mem, &stats);
    CHECK(stats.gathers == 3 && stats.prefetched == 0);
    CHECK(g_pins == 9); /* every gather sent from a pinned weight (given back: refs below) */
    /* a weight whose shard does not fit: the first asker fails, the other is told (nothing
     * learned first: no prefetch of it) */
    axc_mb_memory_clear(mem);
    CHECK(g_w[1].refs == 0);
    g_w[1].elems = SHARD - 1;
    st = run_call(comm, mem, th, 1);
    CHECK(st == AXC_OK); /* (its first layer went fine: closed as ok) */
    int first = strstr(th[0].msg[1], "this layer failed") ? 1 : 0; /* (either thread) */
    CHECK(th[first].st[1] == AXC_ERR_INVALID && strstr(th[first].msg[1], "shard has 4"));
    CHECK_MSG(th[1 - first].st[1] == AXC_ERR_INVALID &&
                  strstr(th[1 - first].msg[1], "shared depth all-gather of this layer failed"),
              "%s", th[1 - first].msg[1]);
    g_w[1].elems = SHARD;
    /* a failed allocation: the same, and nothing leaks */
    g_fail_alloc = 1;
    axc_mb *mb;
    CHECK_OK(axc_mb_create(&mb, 1, 64, comm, mem));
    void *data, *owner;
    CHECK(axc_mb_gather(mb, 9, AXC_PHASE_BWD, 1, &g_w[3], 1, 2 * SHARD, &data, &owner) ==
          AXC_ERR_NOMEM);
    g_fail_alloc = 0;
    axc_mb_destroy(mb); /* (not closed: closes as failed, the learned order stays) */
    CHECK(axc_mb_memory_learned(mem) == 2 && g_w[3].refs == 0); /* layers 0 and 2 */
    /* without a communicator: refused */
    CHECK_OK(axc_mb_create(&mb, 1, 64, NULL, NULL));
    CHECK(axc_mb_gather(mb, 0, 0, 1, &g_w[0], 1, 2 * SHARD, &data, &owner) == AXC_ERR_STATE);
    axc_mb_destroy(mb);
    axc_mb_memory_clear(mem);
    CHECK(g_w[0].refs == 0 && g_w[1].refs == 0 && g_w[2].refs == 0 && g_buffers_alive == 0);
    test_scatters(comm, mem, rank);
    test_prefetch_other_tensor(comm, mem, rank);
    axc_mb_memory_destroy(mem);
    axc_comm_destroy(comm);
    rank_end(rank);
}

int main(void)
{
    test_buckets();
    test_many_params();
    test_wait_across_threads();
    test_failure_stops();
    test_runtime_holds_one();
    if (!rank_tally_init())
        return 1;
    static const int depth2[4] = {1, 1, 1, 2};
    spawn_and_tally("G_d=2 gathers", 2, gathers_main, depth2);
    return ctest_summary("test_microbatch");
}
