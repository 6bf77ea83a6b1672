/* Gradient buckets (csrc/grads/buckets.c): which piece goes where, when sums come due, holds,
 * the end-of-pass order and buffer ownership. */
#include <stdlib.h>
#include <string.h>

#include "axc/buckets.h"
#include "ctest.h"

typedef struct alloc_log {
    int allocs, releases, fail_next;
    size_t last_elems;
    void *last_arg; /* the take's argument the last alloc got */
} alloc_log;

static axc_status fake_alloc(void *ctx, const axc_bucket_key *key, size_t elems, void *arg,
                             void **data, void **owner)
{
    alloc_log *log = ctx;
    if (log->fail_next) {
        log->fail_next = 0;
        return axc_fail(AXC_ERR_NOMEM, "fake allocator: refused %zu elements", elems);
    }
    log->allocs++;
    log->last_elems = elems;
    log->last_arg = arg;
    *data = calloc(elems, axc_dtype_size(key->dtype));
    *owner = *data;
    return *data ? AXC_OK : AXC_ERR_NOMEM;
}

static axc_status fake_residual(void *ctx, void *bucket_owner, int device, size_t elems,
                                void **data, void **owner)
{
    (void)bucket_owner;
    (void)device;
    ((alloc_log *)ctx)->allocs++;
    *data = calloc(elems, sizeof(float));
    *owner = *data;
    return *data ? AXC_OK : AXC_ERR_NOMEM;
}

static void fake_release(void *ctx, void *owner)
{
    ((alloc_log *)ctx)->releases++;
    free(owner);
}

static axc_bucket_key key_of(axc_dtype dt, int ngroups, axc_group_kind g0, axc_group_kind g1)
{
    axc_bucket_key k = {.dtype = dt, .device = -1, .ngroups = ngroups};
    k.groups[0] = g0;
    k.groups[1] = g1;
    return k;
}

static int drain(axc_buckets *b, axc_bucket_sum *out, int cap)
{
    int n = 0;
    axc_bucket_sum s;
    while (axc_buckets_next_sum(b, &s))
        if (n < cap)
            out[n++] = s;
    return n;
}

int main(void)
{
    alloc_log log = {0};
    axc_bucket_ops ops = {fake_alloc, fake_release, fake_residual, &log};
    axc_buckets *b = NULL;
    CHECK_OK(axc_buckets_create(&b, &ops, 16 * sizeof(float))); /* 16 floats a bucket */
    axc_bucket_key data = key_of(AXC_DT_F32, 1, AXC_GROUP_DATA, 0);
    axc_bucket_key two = key_of(AXC_DT_F32, 2, AXC_GROUP_DEPTH, AXC_GROUP_DATA);
    axc_bucket_sum sums[16];
    int id, id2;
    size_t off;
    void *owner, *owner2;

    /* a) pieces share the open bucket of their key; a full bucket's sum is due once written;
     * the take that makes a bucket hands its argument to alloc */
    int like1, like2;
    CHECK_OK(axc_buckets_take(b, &data, 10, 0, &like1, 0, &id, &off, &owner));
    CHECK(id == 0 && off == 0 && log.allocs == 1 && log.last_elems == 16);
    CHECK(log.last_arg == &like1);
    CHECK_OK(axc_buckets_written(b, id));
    CHECK(drain(b, sums, 16) == 0); /* not full: nothing due */
    CHECK_OK(axc_buckets_take(b, &data, 6, 0, &like2, 0, &id2, &off, &owner2));
    CHECK(id2 == 0 && off == 10 && owner2 == owner);
    CHECK(log.allocs == 1 && log.last_arg == &like1); /* (no new bucket: no alloc) */
    CHECK(drain(b, sums, 16) == 0); /* full, but the piece is not written yet */
    CHECK_OK(axc_buckets_written(b, id2));
    CHECK(drain(b, sums, 16) == 1 && sums[0].count == 16 && sums[0].data == owner &&
          sums[0].group == AXC_GROUP_DATA && sums[0].device == -1);
    CHECK(axc_buckets_open(b) == 0);

    /* b) another key gets its own bucket; a piece that does not fit retires the open one (its
     * sums in the key's group order) and a piece larger than a bucket gets one of its size */
    CHECK_OK(axc_buckets_take(b, &two, 4, 0, NULL, 0, &id, &off, &owner));
    CHECK(id == 1 && off == 0);
    CHECK_OK(axc_buckets_take(b, &two, 40, 0, NULL, 0, &id2, &off, &owner2));
    CHECK(id2 == 2 && off == 0 && log.last_elems == 40 && owner2 != owner);
    CHECK(drain(b, sums, 16) == 2 && sums[0].group == AXC_GROUP_DEPTH &&
          sums[1].group == AXC_GROUP_DATA && sums[0].count == 4 && sums[1].data == owner);
    CHECK_OK(axc_buckets_written(b, id2)); /* 40 of 40: full */
    CHECK(drain(b, sums, 16) == 2 && sums[0].count == 40);

    /* c) a held bucket parks when it retires and starts its sums at the last unhold */
    CHECK_OK(axc_buckets_take(b, &data, 8, 0, NULL, 0, &id, &off, &owner));
    CHECK(id == 3);
    CHECK_OK(axc_buckets_hold(b, id));
    CHECK_OK(axc_buckets_hold(b, id));
    CHECK_OK(axc_buckets_take(b, &data, 12, 0, NULL, 0, &id2, &off, &owner2)); /* no room: 3 parks */
    CHECK(id2 == 4 && drain(b, sums, 16) == 0 && axc_buckets_open(b) == 2);
    CHECK_OK(axc_buckets_unhold(b, id));
    CHECK(drain(b, sums, 16) == 0);
    CHECK_OK(axc_buckets_unhold(b, id));
    CHECK(drain(b, sums, 16) == 1 && sums[0].count == 8);
    CHECK(axc_buckets_unhold(b, id) == AXC_ERR_STATE); /* no hold left */
    CHECK(strstr(axc_last_error(), "no hold") != NULL);
    /* a held bucket that fills retires at its last unhold */
    CHECK_OK(axc_buckets_hold(b, id2));
    CHECK_OK(axc_buckets_take(b, &data, 4, 0, NULL, 0, &id, &off, &owner));
    CHECK(id == id2 && off == 12);
    CHECK_OK(axc_buckets_written(b, id)); /* full, held: parks */
    CHECK(drain(b, sums, 16) == 0);
    CHECK_OK(axc_buckets_unhold(b, id));
    CHECK(drain(b, sums, 16) == 1 && sums[0].count == 16);
    CHECK(axc_buckets_hold(b, id) == AXC_ERR_STATE); /* retired: takes no hold */

    /* d) the end of a pass: parked buckets first, then open ones in the order they were made */
    axc_bucket_key half = key_of(AXC_DT_BF16, 1, AXC_GROUP_WORLD, 0);
    int a, p, c;
    CHECK_OK(axc_buckets_take(b, &half, 3, 0, NULL, 0, &a, &off, &owner)); /* open, bf16 */
    CHECK_OK(axc_buckets_take(b, &data, 5, 0, NULL, 0, &p, &off, &owner));
    CHECK_OK(axc_buckets_hold(b, p));
    CHECK_OK(axc_buckets_take(b, &data, 16, 0, NULL, 0, &c, &off, &owner)); /* p parks; c open */
    CHECK(drain(b, sums, 16) == 0 && axc_buckets_open(b) == 3);
    axc_buckets_close_all(b);
    CHECK(drain(b, sums, 16) == 3 && sums[0].count == 5 && sums[1].count == 3 &&
          sums[1].dtype == AXC_DT_BF16 && sums[1].group == AXC_GROUP_WORLD &&
          sums[2].count == 16);
    CHECK(axc_buckets_open(b) == 0);

    axc_bucket_stats stats;
    axc_buckets_stats(b, &stats);
    /* made 0 to 7; retired early: 0, 1, 2, 3 and 4 (the last two after holds); at the end: 5 to 7 */
    CHECK(stats.made == 8 && stats.early == 5 && stats.after_holds == 2 && stats.at_end == 3);

    /* e) reset releases every buffer of the pass; numbering goes on, so a piece taken before
     * the pass ended (another thread's finish between a deferred gradient's take and its
     * record) is refused, not written into the later pass's bucket of the same position */
    CHECK_OK(axc_buckets_take(b, &data, 1, 0, NULL, 0, &id2, &off, &owner)); /* taken, not yet written */
    int made = axc_buckets_count(b);
    CHECK(made == log.allocs && log.releases == 0 && id2 == made - 1);
    axc_buckets_close_all(b);
    CHECK(axc_buckets_check(b, id2) == AXC_ERR_STATE); /* its end-of-pass sums started */
    CHECK(strstr(axc_last_error(), "end-of-pass sums") != NULL);
    CHECK(axc_buckets_written(b, id2) == AXC_ERR_STATE);
    CHECK(drain(b, sums, 16) == 1);
    axc_buckets_reset(b);
    CHECK(log.releases == made && axc_buckets_count(b) == 0);
    CHECK_OK(axc_buckets_take(b, &data, 1, 0, NULL, 0, &id, &off, &owner));
    CHECK(id == made && off == 0 && id != id2);
    CHECK(axc_buckets_written(b, id2) == AXC_ERR_STATE);
    CHECK(strstr(axc_last_error(), "earlier pass") != NULL);
    CHECK(axc_buckets_hold(b, 0) == AXC_ERR_STATE && axc_buckets_unhold(b, 0) == AXC_ERR_STATE);
    CHECK(axc_buckets_check(b, id) == AXC_OK);
    CHECK_OK(axc_buckets_hold(b, id));
    CHECK_OK(axc_buckets_unhold(b, id));
    /* an abandoned pass: reset drops what is due without handing it out */
    axc_buckets_close_all(b);
    axc_buckets_reset(b);
    CHECK(drain(b, sums, 16) == 0 && log.releases == log.allocs);

    /* f) bad input and a failing allocator */
    axc_bucket_key bad = key_of(AXC_DT_F32, 0, 0, 0);
    CHECK(axc_buckets_take(b, &bad, 1, 0, NULL, 0, &id, &off, &owner) == AXC_ERR_INVALID);
    CHECK(strstr(axc_last_error(), "expected 1 to 4") != NULL);
    bad = key_of(AXC_DT_F32, 1, (axc_group_kind)99, 0);
    CHECK(axc_buckets_take(b, &bad, 1, 0, NULL, 0, &id, &off, &owner) == AXC_ERR_INVALID);
    CHECK(axc_buckets_written(b, 700) == AXC_ERR_INVALID);
    CHECK(strstr(axc_last_error(), "no gradient bucket 700") != NULL);
    CHECK(axc_buckets_written(b, -1) == AXC_ERR_INVALID);
    log.fail_next = 1;
    CHECK(axc_buckets_take(b, &data, 1, 0, NULL, 0, &id, &off, &owner) == AXC_ERR_NOMEM);
    CHECK(axc_buckets_count(b) == 0); /* nothing half-made */
    CHECK(axc_buckets_set_bytes(b, 0) == AXC_ERR_INVALID);
    /* g) compression: float32 sums over a compressed group carry the codec and, with error
     * feedback, a residual per (pass of the step, bucket, group position) kept across steps
     * (new zeros when the size changes); other dtypes and groups stay exact */
    axc_bucket_codec int8 = {AXC_CODEC_INT8, 0, 1};
    CHECK_OK(axc_buckets_set_codec(b, AXC_GROUP_DATA, &int8));
    axc_bucket_codec bad_block = {AXC_CODEC_INT8, 3, 0};
    CHECK(axc_buckets_set_codec(b, AXC_GROUP_DATA, &bad_block) == AXC_ERR_INVALID);
    float *first_residual = NULL, *last_residual = NULL;
    axc_buckets_new_step(b); /* (the passes above counted) */
    for (int pass = 0; pass < 3; pass++) {
        size_t n = pass < 2 ? 6 : 5;
        CHECK_OK(axc_buckets_take(b, &two, n, 0, NULL, 0, &id, &off, &owner));    /* depth, data */
        CHECK_OK(axc_buckets_take(b, &half, n, 0, NULL, 0, &id2, &off, &owner2)); /* bf16 over world */
        axc_buckets_close_all(b);
        CHECK(drain(b, sums, 16) == 3);
        CHECK(sums[0].group == AXC_GROUP_DEPTH && sums[0].codec == AXC_CODEC_NONE &&
              !sums[0].residual);
        CHECK(sums[1].group == AXC_GROUP_DATA && sums[1].codec == AXC_CODEC_INT8 &&
              sums[1].block == AXC_CODEC_DEFAULT_BLOCK && sums[1].residual != NULL);
        CHECK(sums[2].codec == AXC_CODEC_NONE && !sums[2].residual); /* bf16: exact */
        if (pass == 0)
            first_residual = sums[1].residual;
        else if (pass == 1)
            CHECK(sums[1].residual == first_residual); /* kept */
        last_residual = sums[1].residual;
        axc_buckets_reset(b);
        axc_buckets_new_step(b); /* (each pass its own step) */
    }
    void *res_owner;
    size_t res_elems;
    long long key;
    CHECK(axc_buckets_residual_count(b) == 1); /* step pass 0, bucket 0, group position 1 */
    axc_buckets_residual(b, 0, &key, &res_owner, &res_elems);
    CHECK(res_owner != NULL && res_elems == 5 && key == 1);
    axc_buckets_residual(b, 1, &key, &res_owner, &res_elems);
    CHECK(res_owner == NULL && res_elems == 0 && key == -1);
    /* two passes in one step (two synchronous sums): bucket 0 of each has its own residual */
    CHECK_OK(axc_buckets_take(b, &two, 5, 0, NULL, 0, &id, &off, &owner));
    axc_buckets_close_all(b);
    CHECK(drain(b, sums, 16) == 2 && sums[1].residual == last_residual);
    axc_buckets_reset(b);
    CHECK_OK(axc_buckets_take(b, &two, 5, 0, NULL, 0, &id, &off, &owner));
    axc_buckets_close_all(b);
    CHECK(drain(b, sums, 16) == 2 && sums[1].residual && sums[1].residual != last_residual);
    axc_buckets_reset(b);
    CHECK(axc_buckets_residual_count(b) == 2);
    axc_buckets_new_step(b);
    float *mine = calloc(5, sizeof(float));
    log.allocs++; /* (released by the engine from now on) */
    CHECK_OK(axc_buckets_set_residual(b, 1, mine, mine, -1, 5));
    CHECK_OK(axc_buckets_take(b, &two, 5, 0, NULL, 0, &id, &off, &owner));
    axc_buckets_close_all(b);
    CHECK(drain(b, sums, 16) == 2 && sums[1].residual == mine); /* adopted */
    axc_buckets_reset(b);
    /* the slot's fingerprint: another gradient of the same size at its position (a parameter
     * first bucketed in a later step shifts the rest) starts from zeros, it does not get the
     * first one's residual; the same gradient again keeps it */
    axc_buckets_new_step(b);
    CHECK_OK(axc_buckets_take(b, &two, 5, 0, NULL, 7, &id, &off, &owner)); /* (was tag 0) */
    axc_buckets_close_all(b);
    CHECK(drain(b, sums, 16) == 2 && sums[1].residual && sums[1].residual != mine);
    float *tag7 = sums[1].residual;
    axc_buckets_reset(b);
    axc_buckets_new_step(b);
    CHECK_OK(axc_buckets_take(b, &two, 5, 0, NULL, 7, &id, &off, &owner));
    axc_buckets_close_all(b);
    CHECK(drain(b, sums, 16) == 2 && sums[1].residual == tag7); /* the same pieces: kept */
    axc_buckets_reset(b);
    axc_buckets_new_step(b); /* two pieces of 2 + 3 (same size in all): other contents */
    CHECK_OK(axc_buckets_take(b, &two, 2, 0, NULL, 7, &id, &off, &owner));
    CHECK_OK(axc_buckets_take(b, &two, 3, 0, NULL, 8, &id, &off, &owner));
    axc_buckets_close_all(b);
    CHECK(drain(b, sums, 16) == 2 && sums[1].residual && sums[1].residual != tag7);
    axc_buckets_reset(b);
    /* past AXC_BUCKET_MAX_EF_PASSES passes without a new step: no residual, and the cutoff
     * counted once per step (the Python layer warns on it) */
    axc_buckets_stats(b, &stats);
    long long cutoffs = stats.ef_cutoffs;
    axc_buckets_new_step(b);
    for (int pass = 0; pass < AXC_BUCKET_MAX_EF_PASSES + 2; pass++) {
        CHECK_OK(axc_buckets_take(b, &two, 5, 0, NULL, 9, &id, &off, &owner));
        axc_buckets_close_all(b);
        CHECK(drain(b, sums, 16) == 2 &&
              (sums[1].residual != NULL) == (pass < AXC_BUCKET_MAX_EF_PASSES));
        axc_buckets_reset(b);
    }
    axc_buckets_stats(b, &stats);
    CHECK(stats.ef_cutoffs == cutoffs + 1);
    axc_buckets_new_step(b);
    CHECK_OK(axc_buckets_take(b, &two, 5, 0, NULL, 9, &id, &off, &owner));
    axc_buckets_close_all(b);
    CHECK(drain(b, sums, 16) == 2 && sums[1].residual != NULL);
    axc_buckets_reset(b);
    axc_bucket_codec none = {AXC_CODEC_NONE, 0, 0};
    CHECK_OK(axc_buckets_set_codec(b, AXC_GROUP_DATA, &none));
    axc_buckets_clear_residuals(b);
    CHECK(axc_buckets_residual_count(b) == 0);

    /* h) `want`: a new bucket holds what the caller still puts in (fewer than a bucket's
     * elements), never less than the piece, never more than a bucket */
    CHECK_OK(axc_buckets_take(b, &data, 3, 7, NULL, 0, &id, &off, &owner));
    CHECK(log.last_elems == 7 && off == 0);
    CHECK_OK(axc_buckets_written(b, id));
    CHECK_OK(axc_buckets_take(b, &data, 4, 4, NULL, 0, &id2, &off, &owner2));
    CHECK(id2 == id && off == 3); /* (fits: 7 of 7, full) */
    CHECK_OK(axc_buckets_written(b, id2));
    CHECK(drain(b, sums, 16) == 1 && sums[0].count == 7);
    CHECK_OK(axc_buckets_take(b, &data, 5, 2, NULL, 0, &id, &off, &owner)); /* want < n */
    CHECK(log.last_elems == 5);
    CHECK_OK(axc_buckets_written(b, id));
    CHECK_OK(axc_buckets_take(b, &data, 1, 1000, NULL, 0, &id, &off, &owner)); /* want > bucket */
    CHECK(log.last_elems == 16);
    CHECK_OK(axc_buckets_written(b, id));
    axc_buckets_close_all(b);
    (void)drain(b, sums, 16);
    axc_buckets_reset(b);

    /* the sums' check: the fingerprint of the pieces' idents and sizes (the same on every rank
     * that packed the same gradients); none once a piece had no ident */
    uint64_t checks[4];
    const uint64_t idents[4][2] = {{1, 2}, {1, 2}, {1, 3}, {1, 0}};
    for (int t = 0; t < 4; t++) {
        CHECK_OK(axc_buckets_take_shared(b, &data, 4, 0, NULL, 100 + t, idents[t][0], &id, &off,
                                         &owner));
        CHECK_OK(axc_buckets_written(b, id));
        CHECK_OK(axc_buckets_take_shared(b, &data, 4, 0, NULL, 200 + t, idents[t][1], &id, &off,
                                         &owner));
        CHECK_OK(axc_buckets_written(b, id));
        axc_buckets_close_all(b);
        CHECK(drain(b, sums, 16) == 1);
        checks[t] = sums[0].check;
        axc_buckets_reset(b);
    }
    CHECK(checks[0] != 0 && checks[0] == checks[1]); /* (the tags, rank-local, do not count) */
    CHECK(checks[2] != 0 && checks[2] != checks[0] && checks[3] == 0);
    CHECK_OK(axc_buckets_take(b, &data, 4, 0, NULL, 1, &id, &off, &owner));
    CHECK_OK(axc_buckets_written(b, id));
    axc_buckets_close_all(b);
    CHECK(drain(b, sums, 16) == 1 && sums[0].check == 0);
    axc_buckets_reset(b);

    axc_buckets_zero_stats(b);
    axc_buckets_stats(b, &stats);
    CHECK(stats.made == 0 && stats.early == 0 && stats.at_end == 0);
    axc_buckets_destroy(b);
    CHECK(log.releases == log.allocs);
    axc_buckets_destroy(NULL);
    return ctest_summary("test_buckets");
}
