/* The linear layers' depth dW residuals (csrc/grads/layer_residuals.c): zeros on first use and
 * on a size or device change, kept across calls, scratch ones for calls that do not train,
 * forgotten with the layer, and nothing released while a deferred reduce-scatter uses it. */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "axc/layer_residuals.h"
#include "ctest.h"

/* every buffer made is an owner of its own: counted live, filled with zeros */
typedef struct buf {
    int device;
    size_t elems;
    float data[];
} buf;

static int live, made;
static int fail_next; /* the next allocation fails */

static axc_status alloc_residual(void *ctx, void *bucket_owner, int device, size_t elems,
                                 void **data, void **owner)
{
    (void)ctx;
    if (bucket_owner)
        return axc_fail(AXC_ERR_INVALID, "a layer residual is made without a bucket");
    if (fail_next) {
        fail_next = 0;
        return axc_fail(AXC_ERR_NOMEM, "test: allocation refused");
    }
    buf *b = calloc(1, sizeof *b + elems * sizeof(float));
    if (!b)
        return axc_fail(AXC_ERR_NOMEM, "test: out of memory");
    b->device = device;
    b->elems = elems;
    live++;
    made++;
    *data = b->data;
    *owner = b;
    return AXC_OK;
}

static void release(void *ctx, void *owner)
{
    (void)ctx;
    live--;
    free(owner);
}

static axc_status alloc_bucket(void *ctx, const axc_bucket_key *key, size_t elems, void *arg,
                               void **data, void **owner)
{
    (void)ctx, (void)key, (void)elems, (void)arg, (void)data, (void)owner;
    return axc_fail(AXC_ERR_INVALID, "test: no buckets here");
}

static buf *owner_of(float *data) { return (buf *)((char *)data - offsetof(buf, data)); }

int main(void)
{
    axc_bucket_ops ops = {alloc_bucket, release, alloc_residual, NULL};
    axc_layer_residuals *t = NULL;
    axc_bucket_ops none = {alloc_bucket, NULL, alloc_residual, NULL};
    CHECK(axc_layer_residuals_create(&t, &none) == AXC_ERR_INVALID);
    /* without an allocator: made, but every residual is refused by name */
    none = (axc_bucket_ops){alloc_bucket, release, NULL, NULL};
    CHECK_OK(axc_layer_residuals_create(&t, &none));
    float *r = NULL, *r2 = NULL;
    CHECK(axc_layer_residuals_for(t, 1, -1, 4, 0, &r) == AXC_ERR_STATE);
    CHECK(strstr(axc_last_error(), "without a residual allocator") != NULL && live == 0);
    axc_layer_residuals_destroy(t);
    CHECK_OK(axc_layer_residuals_create(&t, &ops));

    /* first use: zeros; kept across calls (what the reduce-scatter wrote stays) */
    CHECK_OK(axc_layer_residuals_for(t, 3, -1, 16, 0, &r));
    CHECK(r && r[0] == 0.0f && r[15] == 0.0f && live == 1);
    r[5] = 2.5f;
    CHECK_OK(axc_layer_residuals_for(t, 3, -1, 16, 0, &r2));
    CHECK(r2 == r && r2[5] == 2.5f && live == 1 && made == 1);
    CHECK(axc_layer_residuals_count(t) == 1);
    void *owner = NULL;
    size_t elems = 0;
    CHECK(axc_layer_residuals_get(t, 3, &owner, &elems) && owner == owner_of(r) && elems == 16);
    CHECK(!axc_layer_residuals_get(t, 4, &owner, &elems) && owner == NULL && elems == 0);

    /* another size, then another device: new zeros, the old one released (nothing in flight) */
    CHECK_OK(axc_layer_residuals_for(t, 3, -1, 8, 0, &r));
    CHECK(r[5] == 0.0f && owner_of(r)->elems == 8 && live == 1 && made == 2);
    r[1] = 1.0f;
    CHECK_OK(axc_layer_residuals_for(t, 3, 0, 8, 0, &r));
    CHECK(r[1] == 0.0f && owner_of(r)->device == 0 && live == 1 && made == 3);

    /* a second layer; forgetting one leaves the other */
    CHECK_OK(axc_layer_residuals_for(t, 7, -1, 4, 0, &r2));
    r2[0] = 7.0f;
    CHECK(axc_layer_residuals_count(t) == 2 && live == 2);
    axc_layer_residuals_forget(t, 3);
    axc_layer_residuals_forget(t, 99); /* (none: nothing happens) */
    CHECK(axc_layer_residuals_count(t) == 1 && live == 1);
    int layer = -1;
    axc_layer_residuals_at(t, 0, &layer, &owner, &elems);
    CHECK(layer == 7 && owner == owner_of(r2) && elems == 4);
    axc_layer_residuals_at(t, 5, &layer, &owner, &elems);
    CHECK(layer == -1 && owner == NULL && elems == 0);
    /* a reused id starts from zeros */
    CHECK_OK(axc_layer_residuals_for(t, 3, -1, 8, 0, &r));
    CHECK(r[1] == 0.0f && live == 2);

    /* in flight (a deferred reduce-scatter): replaced, forgotten or cleared, the buffer stays
     * until the pass's end */
    float *inflight = NULL;
    CHECK_OK(axc_layer_residuals_for(t, 7, -1, 4, 1, &inflight));
    CHECK(inflight == r2 && inflight[0] == 7.0f);
    CHECK_OK(axc_layer_residuals_for(t, 7, -1, 5, 0, &r2)); /* another size meanwhile */
    CHECK(r2 != inflight && live == 3 && axc_layer_residuals_kept(t) == 1);
    CHECK(inflight[0] == 7.0f); /* (still allocated: ASan would say otherwise) */
    CHECK_OK(axc_layer_residuals_for(t, 3, -1, 8, 1, &r));
    axc_layer_residuals_forget(t, 3);
    CHECK(live == 3 && axc_layer_residuals_kept(t) == 2 && axc_layer_residuals_count(t) == 1);
    /* a pass ending while the calls are still queueing their work (open uses) releases nothing */
    axc_layer_residuals_pass_done(t, axc_layer_residuals_pass_begin(t));
    CHECK(live == 3 && axc_layer_residuals_kept(t) == 2);
    axc_layer_residuals_call_done(t, inflight);
    /* a pass whose wait began before the second call queued its work keeps that one */
    uint64_t gen = axc_layer_residuals_pass_begin(t);
    axc_layer_residuals_call_done(t, r);
    axc_layer_residuals_pass_done(t, gen);
    CHECK(live == 2 && axc_layer_residuals_kept(t) == 1);
    axc_layer_residuals_pass_done(t, axc_layer_residuals_pass_begin(t));
    CHECK(live == 1 && axc_layer_residuals_kept(t) == 0);
    /* busy marks end with the pass: a later drop releases at once */
    CHECK_OK(axc_layer_residuals_for(t, 7, -1, 5, 1, &r2));
    axc_layer_residuals_call_done(t, r2);
    axc_layer_residuals_pass_done(t, axc_layer_residuals_pass_begin(t));
    CHECK_OK(axc_layer_residuals_for(t, 7, -1, 6, 0, &r2));
    CHECK(live == 1 && axc_layer_residuals_kept(t) == 0);
    /* two calls of one layer on two threads share its buffer: the first one queued and a pass
     * ended (its wait began before the second call queued its work), the second still holds it */
    float *b1 = NULL, *b2 = NULL;
    CHECK_OK(axc_layer_residuals_for(t, 7, -1, 6, 1, &b1));
    CHECK_OK(axc_layer_residuals_for(t, 7, -1, 6, 1, &b2));
    CHECK(b1 == r2 && b2 == r2);
    axc_layer_residuals_call_done(t, b1);
    axc_layer_residuals_pass_done(t, axc_layer_residuals_pass_begin(t));
    axc_layer_residuals_forget(t, 7);
    CHECK(live == 1 && axc_layer_residuals_kept(t) == 1); /* (the second use keeps it) */
    axc_layer_residuals_call_done(t, b2);
    axc_layer_residuals_pass_done(t, axc_layer_residuals_pass_begin(t));
    CHECK(live == 0 && axc_layer_residuals_kept(t) == 0);
    CHECK_OK(axc_layer_residuals_for(t, 7, -1, 6, 0, &r2));
    CHECK(live == 1);

    /* scratch zeros: never the layer's, released by the caller, or kept while in flight */
    void *scratch = NULL;
    float *s = NULL;
    r2[0] = 3.0f;
    CHECK_OK(axc_layer_residuals_for_call(t, 7, -1, 6, 0, 0, &s, &scratch));
    CHECK(s && s != r2 && s[0] == 0.0f && scratch == owner_of(s) && live == 2);
    s[0] = 9.0f;
    axc_layer_residuals_release(t, scratch);
    CHECK(live == 1 && r2[0] == 3.0f);
    CHECK_OK(axc_layer_residuals_for_call(t, 7, -1, 6, 0, 1, &s, &scratch));
    CHECK(s && scratch == NULL && live == 2 && axc_layer_residuals_kept(t) == 1);
    axc_layer_residuals_release(t, NULL); /* (NULL: nothing) */
    axc_layer_residuals_call_done(t, s);
    axc_layer_residuals_pass_done(t, axc_layer_residuals_pass_begin(t));
    CHECK(live == 1 && axc_layer_residuals_kept(t) == 0);
    /* the call's own: trains; none without a layer id or when C needs none */
    CHECK_OK(axc_layer_residuals_for_call(t, 7, -1, 6, 1, 0, &s, &scratch));
    CHECK(s == r2 && scratch == NULL && s[0] == 3.0f);
    CHECK_OK(axc_layer_residuals_for_call(t, -1, -1, 6, 1, 0, &s, &scratch));
    CHECK(s == NULL && scratch == NULL);
    CHECK_OK(axc_layer_residuals_for_call(t, 7, -1, 0, 1, 0, &s, &scratch));
    CHECK(s == NULL && scratch == NULL && live == 1);

    /* set (a checkpoint's): adopted, replacing what was there */
    float *mine = NULL;
    void *mine_owner = NULL;
    CHECK_OK(alloc_residual(NULL, NULL, -1, 6, (void **)&mine, &mine_owner));
    mine[2] = 4.0f;
    CHECK_OK(axc_layer_residuals_set(t, 7, mine, mine_owner, -1, 6));
    CHECK(live == 1);
    CHECK_OK(axc_layer_residuals_for(t, 7, -1, 6, 0, &r2));
    CHECK(r2 == mine && r2[2] == 4.0f);
    CHECK_OK(alloc_residual(NULL, NULL, -1, 2, (void **)&mine, &mine_owner));
    CHECK_OK(axc_layer_residuals_set(t, 11, mine, mine_owner, -1, 2));
    CHECK(axc_layer_residuals_count(t) == 2 && live == 2);
    /* bad input: refused by name, the owner released */
    CHECK_OK(alloc_residual(NULL, NULL, -1, 2, (void **)&mine, &mine_owner));
    CHECK(axc_layer_residuals_set(t, -2, mine, mine_owner, -1, 2) == AXC_ERR_INVALID);
    CHECK(strstr(axc_last_error(), "layer id -2") != NULL && live == 2);
    CHECK(axc_layer_residuals_for(t, 1, -1, 0, 0, &r) == AXC_ERR_INVALID);
    CHECK(strstr(axc_last_error(), "0 elements") != NULL);
    /* an allocation that fails changes nothing */
    fail_next = 1;
    CHECK(axc_layer_residuals_for(t, 7, -1, 9, 0, &r) == AXC_ERR_NOMEM);
    CHECK(axc_layer_residuals_get(t, 7, &owner, &elems) && elems == 6 && live == 2);
    fail_next = 1;
    CHECK(axc_layer_residuals_for(t, 12, -1, 9, 0, &r) == AXC_ERR_NOMEM);
    CHECK(!axc_layer_residuals_get(t, 12, &owner, &elems) && axc_layer_residuals_count(t) == 2);

    /* clear (a checkpoint load mid-pass): those in flight wait for the pass's end */
    CHECK_OK(axc_layer_residuals_for(t, 7, -1, 6, 1, &r));
    axc_layer_residuals_clear(t);
    CHECK(axc_layer_residuals_count(t) == 0 && live == 1 && axc_layer_residuals_kept(t) == 1);
    axc_layer_residuals_call_done(t, r);
    axc_layer_residuals_pass_done(t, axc_layer_residuals_pass_begin(t));
    CHECK(live == 0);

    /* many layers (the table grows), some in flight at destroy: everything released */
    for (int i = 0; i < 40; i++)
        CHECK_OK(axc_layer_residuals_for(t, i, -1, (size_t)(1 + i), i % 3 == 0, &r));
    CHECK(axc_layer_residuals_count(t) == 40 && live == 40);
    for (int i = 0; i < 40; i += 2)
        axc_layer_residuals_forget(t, i);
    CHECK(axc_layer_residuals_count(t) == 20 && axc_layer_residuals_kept(t) == 7);
    axc_layer_residuals_destroy(t);
    CHECK(live == 0);
    axc_layer_residuals_destroy(NULL);
    return ctest_summary("test_layer_residuals");
}
