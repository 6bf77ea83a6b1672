/* One run_concurrent call's reducer (csrc/grads/microbatch.c): buckets in the fixed order,
 * readiness by arrival counts, thread ends and failures, and the wait across threads. */
#include <pthread.h>
#include <stdint.h>
#include <time.h>

#include "axc/microbatch.h"
#include "axc/runtime.h"
#include "ctest.h"

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
        CHECK(axc_mb_next_bucket(mb, &first, &count, &k) == 1);
        CHECK(first == want_first[i] && count == want_count[i]);
    }
    CHECK(k.dtype == AXC_DT_BF16 && k.groups[0] == AXC_GROUP_DATA);
    CHECK(axc_mb_next_bucket(mb, &first, &count, &k) == 0); /* all handed out */
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
    axc_mb_arrive(mb, 1000 * 48);
    CHECK(axc_mb_next_bucket(mb, &first, &count, &k) == 1 && first == 0 && count == 1000);
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
    while (w->calls < 4 && (w->got[w->calls] = axc_mb_next_bucket(w->mb, &w->first[w->calls],
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
    CHECK(axc_mb_next_bucket(mb, &first, &count, &k) == 0);
    axc_mb_destroy(mb);
}

/* The runtime holds one call at a time. */
static void fake_release(void *ctx, void *owner)
{
    (void)ctx;
    (void)owner;
}

static axc_status fake_alloc(void *ctx, const axc_bucket_key *key, size_t elems, void **data,
                             void **owner)
{
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
    CHECK_OK(axc_runtime_mb_begin(rt, 3, 64, &mb));
    CHECK(mb && axc_runtime_mb(rt) == mb && axc_mb_n(mb) == 3);
    axc_mb *second = NULL;
    CHECK(axc_runtime_mb_begin(rt, 3, 64, &second) == AXC_ERR_STATE && !second);
    axc_runtime_mb_end(rt);
    CHECK(axc_runtime_mb(rt) == NULL);
    axc_runtime_mb_end(rt); /* none: no-op */
    CHECK(axc_runtime_mb_begin(rt, 0, 64, &mb) == AXC_ERR_INVALID && !axc_runtime_mb(rt));
    CHECK_OK(axc_runtime_mb_begin(rt, 2, 64, NULL));
    axc_runtime_destroy(rt); /* ends the running call too (leak-checked under ASan) */
}

int main(void)
{
    test_buckets();
    test_many_params();
    test_wait_across_threads();
    test_failure_stops();
    test_runtime_holds_one();
    return ctest_summary("test_microbatch");
}
